"""Which outputs of a callable each input and parameter takes its grad from.

Eager's backward reaches a leaf only along the outputs the loss uses: a parameter that only an
output left out of the loss depends on keeps ``.grad`` ``None`` (and an optimizer skips it). A
graph's backward computes every grad at once, so the replay needs, for each leaf, the outputs
that reach it; :func:`reach_of` finds them once, in the autograd graph of a warmup call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["reach_of"]


def reach_of(
    outputs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]
) -> tuple[frozenset[int], ...] | None:
    """For each of ``leaves``, the positions of the ``outputs`` whose graph reaches it.

    ``None`` when every output reaches every leaf (nothing for a replay to do).

    >>> w = torch.ones(2, requires_grad=True)
    >>> b = torch.ones(2, requires_grad=True)
    >>> x = torch.ones(2, requires_grad=True)
    >>> reach_of([x * w, x + b], [x, w, b])
    (frozenset({0, 1}), frozenset({0}), frozenset({1}))
    """
    position = {id(leaf): i for i, leaf in enumerate(leaves)}
    reach: list[set[int]] = [set() for _ in leaves]
    for k, output in enumerate(outputs):
        for i in _leaves_reached(output, position):
            reach[i].add(k)
    frozen = tuple(frozenset(r) for r in reach)
    everything = frozenset(range(len(outputs)))
    return None if all(r == everything for r in frozen) else frozen


def _leaves_reached(output: torch.Tensor, position: dict[int, int]) -> set[int]:
    """Positions of the leaves (as in ``position``) the graph of ``output`` reaches."""
    found: set[int] = set()
    root = output.grad_fn
    if root is None:  # the output is a leaf itself
        if id(output) in position:
            found.add(position[id(output)])
        return found
    seen: set[Any] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if variable is not None and id(variable) in position:
            found.add(position[id(variable)])
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
