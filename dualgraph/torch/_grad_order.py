"""The order in which eager's backward reaches the parameters, and a replay's edges that keep it.

Eager's backward runs each parameter's ``AccumulateGrad`` node (its tensor hooks, the add into
``.grad``, its post-accumulate-grad hooks) as the backward reaches it: the last layer's first. A
replay's autograd node hands every parameter grad out at once, and the engine runs the
``AccumulateGrad`` nodes made ready together in the order of its heap (they share one priority),
which is not eager's: a hook that reads another parameter's ``.grad`` (a norm summed across
hooks, a bucket flattened in the order its grads arrive) saw other values than in eager.

The order is noted once, at the inspected warmup's backward (eager's own engine, by a tensor hook
on each parameter). Where a parameter has a hook at a forward, the replay's edges to the
parameters go through one view each, made in the reverse of that order: the engine runs the
node made last first (the highest sequence number), and each view hands its grad straight to its
``AccumulateGrad`` node, so the hooks run in eager's order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

__all__ = ["reaching_order", "views_in_order"]


def _note(order: list[int], position: int, grad: torch.Tensor) -> None:
    order.append(position)


@contextlib.contextmanager
def reaching_order(params: Sequence[torch.Tensor]) -> Iterator[list[int]]:
    """Within it, a backward notes the positions of ``params`` in the order it reaches them.

    Nothing is noted for fewer than two parameters. The hooks are removed on exit, and a
    parameter that had no hook dict before has none after.

    >>> first, second = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    >>> with reaching_order([first, second]) as order:
    ...     ((first * 2).exp() * second).sum().backward()
    >>> order, first._backward_hooks
    ([1, 0], None)
    """
    order: list[int] = []
    if len(params) < 2:
        yield order
        return
    had_none = [param._backward_hooks is None for param in params]
    handles = [
        param.register_hook(functools.partial(_note, order, position))
        for position, param in enumerate(params)
        if param.requires_grad
    ]
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()
        for param, none in zip(params, had_none, strict=True):
            if none and not param._backward_hooks:
                param._backward_hooks = None


def views_in_order(params: Sequence[torch.Tensor], made_first: Sequence[int]) -> list[torch.Tensor]:
    """One view of each parameter that requires grad (the others as they are), made in the order
    ``made_first`` gives (positions: the parameter eager reaches last first).

    >>> a, b = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    >>> views = views_in_order([a, b], [1, 0])
    >>> views[0]._base is a, views[0].grad_fn._sequence_nr() > views[1].grad_fn._sequence_nr()
    (True, True)
    """
    views: list[torch.Tensor] = list(params)
    for position in made_first:
        param = params[position]
        if param.requires_grad:
            views[position] = param.view_as(param)
    return views
