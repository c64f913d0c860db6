"""Hooks of tensors a replay's backward gives no grad, which eager's backward never reaches.

A replay is one autograd node with an edge to each of its inputs and parameters. Where the
loss leaves out every output that reaches one of them (see ``_reach.py``), the replay hands
autograd ``None`` for it, and the engine still runs the node at the end of that edge: the
tensor's hooks get ``None`` (a ``grad * 2`` hook raises) and its post-accumulate hooks run, where
eager's backward never gets to the tensor and calls none. :func:`quiet_hooks` makes those hooks
pass over a ``None`` grad until the backward ends. A grad another use of the tensor brings in
the same backward still reaches them, as in eager.

>>> w = torch.ones(2, requires_grad=True)
>>> calls = []
>>> handle = w.register_hook(calls.append)
>>> class Unreached(torch.autograd.Function):
...     @staticmethod
...     def forward(ctx, x, w):
...         return x * 2
...     @staticmethod
...     def backward(ctx, grad):
...         quiet_hooks([w])
...         return grad * 2, None
>>> Unreached.apply(torch.ones(2, requires_grad=True), w).sum().backward()
>>> calls, w.grad
([], None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._grad_checks import grad_accumulator, own_hooks

__all__ = ["quiet_hooks"]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
# register_multi_grad_hook(mode="all")'s per-tensor hook counts the calls of every tensor whose
# node runs (this one's too), and hands a None on as eager does: it must see the None.
_MULTI_GRAD_COUNTER = ("torch.autograd.graph", "get_inner_hook.<locals>.inner_hook")


def quiet_hooks(tensors: Iterable[torch.Tensor]) -> None:
    """Until this backward ends, the hooks of ``tensors`` pass over a ``None`` grad.

    Call it from inside the backward (an autograd ``Function``'s) that hands them ``None``.
    """
    restore: list[tuple[dict[Any, Any], Any, Any, Any]] = []
    handles = []
    for tensor in tensors:
        hooks = own_hooks(tensor)
        if hooks:
            for key, hook in list(hooks.items()):
                if not _is_multi_grad_counter(hook):
                    hooks[key] = quiet = _tensor_hook(hook)
                    restore.append((hooks, key, hook, quiet))
        post_hooks = own_hooks(tensor, "_post_accumulate_grad_hooks")
        if post_hooks and tensor.grad_fn is None:
            got_none = [False]
            node = grad_accumulator(tensor)
            handles.append(node.register_prehook(_recorder(got_none)))
            for key, hook in list(post_hooks.items()):
                post_hooks[key] = quiet = _post_hook(hook, got_none)
                restore.append((post_hooks, key, hook, quiet))
    if restore:
        _queue_callback(lambda: _restore(restore, handles))


def _is_multi_grad_counter(hook: Any) -> bool:
    name = getattr(hook, "__qualname__", "")
    return getattr(hook, "__module__", None) == _MULTI_GRAD_COUNTER[0] and name.endswith(
        _MULTI_GRAD_COUNTER[1]
    )


def _tensor_hook(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def quiet(grad: torch.Tensor | None) -> Any:
        return None if grad is None else hook(grad)

    return quiet


def _recorder(got_none: list[bool]) -> Callable[[Any], None]:
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        got_none[0] = grad_outputs[0] is None

    return record


def _post_hook(hook: Callable[[Any], Any], got_none: list[bool]) -> Callable[[Any], Any]:
    def quiet(tensor: torch.Tensor) -> Any:
        return None if got_none[0] else hook(tensor)

    return quiet


def _restore(restore: list[tuple[dict[Any, Any], Any, Any, Any]], handles: list[Any]) -> None:
    for hooks, key, hook, quiet in restore:
        if hooks.get(key) is quiet:  # unless removed or replaced during the backward
            hooks[key] = hook
    for handle in handles:
        handle.remove()
