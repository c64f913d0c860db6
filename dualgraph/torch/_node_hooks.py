"""Hooks put on a parameter's ``AccumulateGrad`` node itself after capture.

Megatron-LM's DDP (``grad_acc = p.expand_as(p).grad_fn.next_functions[0][0];
grad_acc.register_hook(...)``) and torch's ``_apply_optimizer_in_backward`` hook the node, not
the tensor, and keep the node alive to keep the hook. ``param_grads="in_graph"`` never runs that
node; ``"auto"`` adding the grads into ``.grad`` itself runs it with no grad (a pre-hook reads
``None``).

A leaf keeps only a weak reference to its node, and a node holds its parameter: a node that
someone keeps raises the parameter's reference count (``Tensor._use_count``). So each forward
compares the counts with the lowest seen (one pass, no lookup); only a parameter counted more
is looked up, and its node's hook dicts read (found once per node, by registering and removing a
hook, whose handle names the dict; kept in the node's ``metadata``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._grad_checks import grad_accumulator

__all__ = ["HeldNodes", "node_has_hooks"]

_use_count = torch.Tensor._use_count  # type: ignore[attr-defined]
_DICTS = "dualgraph: hook dicts"


def _nothing(*_: Any) -> None:
    return None


def node_has_hooks(param: torch.Tensor) -> bool:
    """Whether ``param``'s ``AccumulateGrad`` node has a Python pre-hook or hook.

    >>> w = torch.ones(2, requires_grad=True)
    >>> node = w.view_as(w).grad_fn.next_functions[0][0]
    >>> node_has_hooks(w)
    False
    >>> handle = node.register_prehook(lambda grads: None)
    >>> node_has_hooks(w)
    True
    """
    if not param.requires_grad:  # frozen: no node (a backward skips it)
        return False
    node = grad_accumulator(param)
    if node is None:
        return False
    metadata = node.metadata
    dicts = metadata.get(_DICTS)
    if dicts is None:
        # The node's hooks live in one dict each (pre-hooks, hooks), which a handle names; the
        # empty dicts stay with the node, and hooks registered later go into them.
        pre, post = node.register_prehook(_nothing), node.register_hook(_nothing)
        dicts = metadata[_DICTS] = (pre.hooks_dict_ref(), post.hooks_dict_ref())
        pre.remove()
        post.remove()
    return any(map(len, dicts))


class HeldNodes:
    """Which parameters' ``AccumulateGrad`` nodes something keeps at a forward.

    Counts each parameter's references against the lowest counts seen (at construction, when no
    autograd graph of a call is alive, or later). A higher count is a node someone keeps (or a
    view of the parameter, or a saved copy of it: looked at, then found to have no hooks).
    """

    __slots__ = ("_counts", "_names", "_params")

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        self._params = tuple(params)
        self._names = tuple(names)
        self._counts = tuple(map(_use_count, self._params))

    def unchanged(self) -> bool:
        """Whether no parameter is referenced more than ever seen (the usual case: one pass)."""
        return tuple(map(_use_count, self._params)) == self._counts

    def held(self) -> tuple[int, ...]:
        """The positions of the parameters referenced more than ever seen; lower counts become
        the counts expected from now on."""
        now = tuple(map(_use_count, self._params))
        self._counts = tuple(map(min, now, self._counts))
        return tuple(i for i, (count, least) in enumerate(zip(now, self._counts, strict=True)) if count > least)

    def hooked(self) -> str | None:
        """The name of the first parameter whose node someone keeps with a hook on it."""
        for i in self.held():
            if node_has_hooks(self._params[i]):
                return self._names[i]
        return None
