"""Tests for dualgraph.torch._reach: which outputs reach each input and parameter."""

from __future__ import annotations

import torch

from dualgraph.torch._reach import reach_of


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
