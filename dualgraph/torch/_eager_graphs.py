"""Whether an eager autograd graph of a graphed callable's parameters is alive.

A graphed callable sometimes runs its callable eagerly: a shape bucket's ``fallback="eager"``,
or a call whose Python would branch otherwise than at capture (grad mode, an input's
``requires_grad``). Such a call's graph gives the parameters grads of its own. Under
``param_grads="auto"`` a replay's backward that ran in the same backward and added its grads
into ``.grad`` itself would round differently from eager's sum of both, so while such a graph
is alive the replays hand their grads to autograd (which sums them, as eager does).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EagerGraphs"]


class EagerGraphs:
    """Whether an autograd graph of an eager call is alive (``param_grads="auto"``).

    A graph is tracked through a token in the metadata of its output nodes: it dies with them.

    >>> graphs = EagerGraphs()
    >>> out = torch.ones(2, requires_grad=True) * 2
    >>> graphs.track([out, None])
    >>> graphs()
    True
    >>> del out
    >>> graphs()
    False
    """

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = 0

    def __call__(self) -> bool:
        return self.alive > 0

    def track(self, outputs: Sequence[Any]) -> None:
        """Count the graph behind ``outputs`` (flat leaves) as alive until their nodes die."""
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        nodes = {id(node): node for node in map(_grad_fn, tensors) if node is not None}
        if not nodes:
            return
        token = _Token()
        weakref.finalize(token, self._release)
        self.alive += 1
        for node in nodes.values():
            node.metadata["dualgraph.eager_fallback"] = token

    def _release(self) -> None:
        self.alive -= 1


class _Token:
    """Lives as long as the autograd nodes whose metadata hold it."""


def _grad_fn(tensor: torch.Tensor) -> Any:
    return tensor.grad_fn
