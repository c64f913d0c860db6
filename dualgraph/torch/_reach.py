"""Which outputs of a callable each input and parameter takes its grad from, and foreign leaves.

Eager's backward reaches a leaf only along the outputs the loss uses: a parameter that only an
output left out of the loss depends on keeps ``.grad`` ``None`` (and an optimizer skips it). A
graph's backward computes every grad at once, so the replay needs, for each leaf, the outputs
that reach it; :func:`trace_leaves` finds them once, in the autograd graph of a warmup call, in
the same walk that finds the leaves requiring grad that are neither inputs nor parameters (which
a replay could give no gradient: the capture refuses them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["reach_of", "trace_leaves", "used_inside"]

# The node of a leaf that needs grad (read with getattr: torch's stubs do not declare it).
_ACCUMULATE_GRAD: Any = getattr(torch._C._functions, "AccumulateGrad")  # noqa: B009


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
    return trace_leaves(outputs, leaves)[0]


def trace_leaves(
    outputs: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    walked: list[Any] | None = None,
) -> tuple[tuple[frozenset[int], ...] | None, list[torch.Tensor]]:
    """:func:`reach_of`, and the leaves the outputs depend on that are not among ``leaves``.

    One walk of the graph, each node once: the foreign leaves come once per leaf node reached
    (an output that is a foreign leaf itself, once per output). ``walked``, where given, gets
    every node walked (for another look at the graph without walking it again).

    >>> x, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    >>> reach, foreign = trace_leaves([x * w], [x])
    >>> reach, foreign[0] is w
    (None, True)
    """
    position = {id(leaf): i for i, leaf in enumerate(leaves)}
    leaf_masks = [0] * len(leaves)  # bit k: output k reaches the leaf
    foreign: list[torch.Tensor] = []
    # The nodes reached, by node: the dict keeps each one alive (Python wrappers of autograd
    # nodes are made on demand, and one that died could be mistaken for a new one).
    index: dict[Any, int] = {}
    nodes: list[Any] = []
    masks: list[int] = []  # bit k: output k reaches the node
    indegree: list[int] = []
    stack: list[int] = []
    for k, output in enumerate(outputs):
        root = output.grad_fn
        if root is None:  # the output is a leaf itself
            i = position.get(id(output))
            if i is not None:
                leaf_masks[i] |= 1 << k
            elif output.requires_grad:
                foreign.append(output)
            continue
        j = index.get(root)
        if j is None:
            j = index[root] = len(nodes)
            nodes.append(root)
            masks.append(0)
            indegree.append(0)
            stack.append(j)
        masks[j] |= 1 << k
    children: list[list[int]] = [[] for _ in nodes]
    leaf_of: dict[int, int] = {}  # node -> position of its leaf
    while stack:
        j = stack.pop()
        node = nodes[j]
        if type(node) is _ACCUMULATE_GRAD:
            variable = node.variable
            i = position.get(id(variable))
            if i is None:
                foreign.append(variable)
            else:
                leaf_of[j] = i
            continue
        kids = children[j]
        for next_node, _ in node.next_functions:
            if next_node is None:
                continue
            c = index.get(next_node)
            if c is None:
                c = index[next_node] = len(nodes)
                nodes.append(next_node)
                masks.append(0)
                indegree.append(0)
                children.append([])
                stack.append(c)
            indegree[c] += 1
            kids.append(c)
    if walked is not None:
        walked.extend(nodes)
    every = (1 << len(outputs)) - 1
    if len(outputs) == 1:  # one output reaches every node
        masks = [every] * len(nodes)
    else:  # spread each node's outputs to the nodes after it, in graph order
        order = [j for j, count in enumerate(indegree) if count == 0]
        for j in order:
            mask = masks[j]
            for c in children[j]:
                masks[c] |= mask
                indegree[c] -= 1
                if indegree[c] == 0:
                    order.append(c)
    for j, i in leaf_of.items():
        leaf_masks[i] |= masks[j]
    if all(mask == every for mask in leaf_masks):
        return None, foreign
    reach = tuple(frozenset(k for k in range(len(outputs)) if mask >> k & 1) for mask in leaf_masks)
    return reach, foreign


def used_inside(
    outputs: Sequence[torch.Tensor], candidates: Sequence[int], views: frozenset[int] = frozenset()
) -> tuple[int, ...]:
    """The positions among ``candidates`` of the outputs that other outputs are computed from.

    Eager's grad at such an output (``hidden`` in ``return hidden, head(hidden)``) includes what
    flows back from the outputs computed from it; a replay's, only what the loss sends to it
    directly. ``views``: outputs a replay hands out as views of another output, whose grads
    reach it outside the graph (their graph is walked only where another output uses them).

    >>> x = torch.ones(2, requires_grad=True)
    >>> hidden = x * 2
    >>> used_inside([hidden, hidden.exp(), x + 1], [0, 1, 2])
    (0,)
    """
    if len(candidates) < 2:  # an output's own graph never leads back to it (no cycle): the
        return ()  # usual single output needs no walk (0.1 ms for a ViT block's graph)
    reached: set[tuple[Any, int]] = set()  # (node, its output's number) some edge leads to
    seen: dict[Any, None] = {}  # the nodes walked (kept alive: see trace_leaves)
    stack = []
    for k in candidates:
        node = outputs[k].grad_fn
        if k not in views and node is not None and node not in seen:
            seen[node] = None
            stack.append(node)
    while stack:
        for next_node, number in stack.pop().next_functions:
            if next_node is None:
                continue
            reached.add((next_node, number))
            if next_node not in seen:
                seen[next_node] = None
                stack.append(next_node)
    return tuple(
        k
        for k in candidates
        if (node := outputs[k].grad_fn) is not None and (node, outputs[k].output_nr) in reached
    )
