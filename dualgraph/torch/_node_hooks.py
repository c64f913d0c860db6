"""Hooks put on a parameter's ``AccumulateGrad`` node itself after capture.

Megatron-LM's DDP (``grad_acc = p.expand_as(p).grad_fn.next_functions[0][0];
grad_acc.register_hook(...)``) and torch's ``_apply_optimizer_in_backward`` hook the node, not
the tensor, and keep the node alive to keep the hook. ``param_grads="in_graph"`` never runs that
node; ``"auto"`` adding the grads into ``.grad`` itself runs it with no grad (a pre-hook reads
``None``).

A leaf keeps only a weak reference to its node, and a node holds its parameter: a node that
someone keeps (an autograd graph, a replay's pending backward, a hook's owner) raises the
parameter's reference count (``Tensor._use_count``). So each forward compares the counts with
the lowest seen (one pass, no lookup); only for a parameter counted more is the node looked at.
Its hook dicts are found once per node (by registering and removing a hook, whose handle names
the dict; kept in the node's ``metadata``), and held weakly: a node's dicts live as long as the
node, so while they do, that node is still the parameter's, and they are read without a lookup.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ._grad_checks import grad_accumulator

__all__ = ["HeldNodes", "node_hook_dicts"]

_use_count = torch.Tensor._use_count  # type: ignore[attr-defined]
_DICTS = "dualgraph: hook dicts"
_Dicts = tuple[dict[Any, Any], dict[Any, Any]]
_DEAD = (lambda: None, lambda: None)


def _nothing(*_: Any) -> None:
    return None


def node_hook_dicts(param: torch.Tensor) -> _Dicts | None:
    """The pre-hook and hook dicts of ``param``'s ``AccumulateGrad`` node (``None``: frozen).

    >>> w = torch.ones(2, requires_grad=True)
    >>> node = w.view_as(w).grad_fn.next_functions[0][0]
    >>> pre, post = node_hook_dicts(w)
    >>> handle = node.register_prehook(lambda grads: None)
    >>> len(pre), len(post)
    (1, 0)
    """
    if not param.requires_grad:  # frozen: no node (a backward skips it)
        return None
    node = grad_accumulator(param)
    if node is None:
        return None
    metadata = node.metadata
    dicts: _Dicts | None = metadata.get(_DICTS)
    if dicts is None:
        # The node's hooks live in one dict each (pre-hooks, hooks), which a handle names; the
        # empty dicts stay with the node, and hooks registered later go into them.
        pre, post = node.register_prehook(_nothing), node.register_hook(_nothing)
        dicts = metadata[_DICTS] = (pre.hooks_dict_ref(), post.hooks_dict_ref())
        pre.remove()
        post.remove()
    return dicts


class HeldNodes:
    """Which parameters' ``AccumulateGrad`` nodes are kept, with a hook, at a forward.

    Counts each parameter's references against the lowest counts seen (at construction, when no
    autograd graph of a call is alive, or later). A higher count is a node someone keeps (or a
    view of the parameter, or a saved copy of it), whose hooks are then looked at.
    """

    __slots__ = ("_counts", "_dicts", "_names", "_params")

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        self._params = tuple(params)
        self._names = tuple(names)
        self._counts = tuple(map(_use_count, self._params))
        # each parameter's node's hook dicts, weakly (alive: that node is still the parameter's)
        self._dicts: list[tuple[Any, Any]] = [_DEAD] * len(self._params)

    def unchanged(self) -> bool:
        """Whether no parameter is referenced more than ever seen (the usual case: one pass)."""
        return tuple(map(_use_count, self._params)) == self._counts

    def hooked(self) -> str | None:
        """The name of the first parameter whose node someone keeps with a Python hook on it
        (a pre-hook or a hook); lower counts become the counts expected from now on."""
        now = tuple(map(_use_count, self._params))
        self._counts = tuple(map(min, now, self._counts))
        for i, (count, least) in enumerate(zip(now, self._counts, strict=True)):
            if count > least and self._has_hooks(i):
                return self._names[i]
        return None

    def _has_hooks(self, i: int) -> bool:
        pre_ref, post_ref = self._dicts[i]
        pre, post = pre_ref(), post_ref()
        if pre is None or post is None:  # not looked at yet, or that node is gone
            dicts = node_hook_dicts(self._params[i])
            if dicts is None:
                return False
            pre, post = dicts
            self._dicts[i] = (weakref.ref(pre), weakref.ref(post))
        return bool(pre) or bool(post)
