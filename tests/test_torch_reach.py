"""Tests for dualgraph.torch._reach: which outputs reach each input and parameter."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from dualgraph.torch._reach import reach_of, trace_leaves, used_inside


def test_every_output_reaching_every_leaf_needs_nothing() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    assert reach_of([x * w, (x + w).exp()], [x, w]) is None


def test_each_leaf_lists_the_outputs_whose_graph_reaches_it() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    x, z = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    outputs = [(x * a).tanh(), (x * z + b).sum(), x.view(3, 1)]
    assert reach_of(outputs, [x, z, a, b]) == (
        frozenset({0, 1, 2}),
        frozenset({1}),
        frozenset({0}),
        frozenset({1}),
    )


def test_an_output_that_is_a_leaf_reaches_that_leaf_and_an_unused_leaf_none() -> None:
    x, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    assert reach_of([x, x * 2], [x, unused]) == (frozenset({0, 1}), frozenset())


def test_a_leaf_behind_a_shared_subgraph_is_found_once_per_output() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    hidden = (w * 3).exp()  # one node both outputs go through
    assert reach_of([hidden + 1, hidden * 2], [w]) is None
    assert reach_of([hidden + 1, torch.ones(2, requires_grad=True) * 2], [w]) == (frozenset({0}),)


def _reference(
    outputs: list[torch.Tensor], leaves: list[torch.Tensor]
) -> tuple[tuple[frozenset[int], ...], list[int]]:
    """Each leaf's outputs by one plain walk per output, and the ids of the foreign leaves."""
    position = {id(leaf): i for i, leaf in enumerate(leaves)}
    reach: list[set[int]] = [set() for _ in leaves]
    foreign: dict[int, torch.Tensor] = {}
    for k, output in enumerate(outputs):
        if output.grad_fn is None:
            if id(output) in position:
                reach[position[id(output)]].add(k)
            elif output.requires_grad:
                foreign[id(output)] = output
            continue
        seen: list[Any] = []
        stack = [output.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or any(node is other for other in seen):
                continue
            seen.append(node)
            if type(node).__name__ == "AccumulateGrad":
                if id(node.variable) in position:
                    reach[position[id(node.variable)]].add(k)
                else:
                    foreign[id(node.variable)] = node.variable
                continue
            stack.extend(next_node for next_node, _ in node.next_functions)
    return tuple(frozenset(r) for r in reach), sorted(foreign)


@pytest.mark.parametrize("seed", range(40))
def test_one_walk_finds_what_a_walk_per_output_finds(seed: int) -> None:
    """Random graphs: shared subgraphs, outputs that are leaves or reach other outputs, leaves
    used twice by one op, foreign leaves, unused leaves."""
    rng = random.Random(seed)
    leaves = [torch.randn(3, requires_grad=True) for _ in range(rng.randint(1, 5))]
    others = [torch.randn(3, requires_grad=True) for _ in range(rng.randint(0, 2))]
    pool: list[torch.Tensor] = leaves + others + [torch.randn(3)]
    for _ in range(rng.randint(1, 12)):
        a, b = rng.choice(pool), rng.choice(pool)
        pool.append(rng.choice([a * b, a + b, (a * a).tanh(), a.exp() - b, a.view(3, 1).sum(1)]))
    outputs = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
    # never none: an empty list would let the seed assert nothing (3 of the 40 did)
    outputs = [t for t in outputs if t.requires_grad] or [
        rng.choice([t for t in pool if t.requires_grad])
    ]
    reach, foreign = trace_leaves(outputs, leaves)
    expected, expected_foreign = _reference(outputs, leaves)
    everything = frozenset(range(len(outputs)))
    assert reach == (None if all(r == everything for r in expected) else expected)
    assert sorted({id(t) for t in foreign}) == expected_foreign
    assert reach_of(outputs, leaves) == reach


class _KeepsAVariable(torch.autograd.Function):
    """A custom Function whose context holds an attribute named like AccumulateGrad's leaf."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.variable = torch.ones(2, requires_grad=True)  # not an input: not in the graph
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def test_a_custom_functions_context_is_not_taken_for_a_leaf() -> None:
    x, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    out = _KeepsAVariable.apply(x * w)
    assert trace_leaves([out, x * 3], [x, w]) == ((frozenset({0, 1}), frozenset({0})), [])


def test_used_inside_finds_the_outputs_other_outputs_are_computed_from() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    hidden = x * 2
    view = hidden.t()
    first, second = (x * 3).split(1)  # two outputs of one node: each its own
    outputs = [hidden, view, view.exp(), first, second, first.exp(), x + 1]
    assert used_inside(outputs, range(len(outputs))) == (0, 1, 3)


def test_used_inside_walks_no_graph_for_a_single_output() -> None:
    # An output's own graph never leads back to it; the walk (0.1 ms for a ViT block's graph at
    # each capture) is not made. A node whose edges raise when read tells whether it was.
    class Unwalkable:
        @property
        def next_functions(self) -> Any:
            raise AssertionError("walked")

    class Output:
        grad_fn = Unwalkable()
        output_nr = 0

    assert used_inside([Output(), torch.ones(2)], [0]) == ()  # type: ignore[list-item]


def test_used_inside_does_not_walk_an_output_handed_out_as_a_view_of_another() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    hidden = x * 2
    outputs = [hidden, hidden.t(), x.exp()]
    assert used_inside(outputs, range(3), frozenset({1})) == ()
    assert used_inside(outputs, range(3)) == (0,)
