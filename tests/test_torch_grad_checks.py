"""Tests for dualgraph.torch._grad_checks: what a replay's backward asks before writing .grad."""

from __future__ import annotations

import pytest
import torch

from dualgraph import DualgraphError
from dualgraph.torch._grad_checks import aliases, grad_problem, span


def test_aliases_is_true_for_the_accumulators_own_memory_alike() -> None:
    accumulator = torch.zeros(2, 3)
    assert aliases(accumulator.detach(), accumulator, "w")


def test_aliases_is_false_for_memory_of_its_own_or_a_sparse_grad() -> None:
    accumulator = torch.zeros(2, 3)
    assert not aliases(torch.zeros(2, 3), accumulator, "w")
    assert not aliases(torch.zeros(2, 3).to_sparse(), accumulator, "w")


def test_aliases_refuses_the_same_memory_in_another_layout() -> None:
    accumulator = torch.zeros(2, 3)
    with pytest.raises(DualgraphError, match=r"^w: \.grad shares memory"):
        aliases(accumulator.t(), accumulator, "w")


def test_span_covers_the_bytes_of_a_strided_tensor() -> None:
    base = torch.zeros(4, 4)
    start = base.data_ptr()
    assert span(base[:, 1]) == (start + 4, start + 4 + (3 * 4 + 1) * 4)
    empty = base[:0]
    assert span(empty) == (empty.data_ptr(), empty.data_ptr())


def _problem(grad: torch.Tensor | None, **param_attrs: object) -> tuple[str, str | None] | None:
    weight = torch.nn.Parameter(torch.ones(2, 3))
    for key, value in param_attrs.items():
        setattr(weight, key, value)
    accumulator = torch.zeros(2, 3)
    return grad_problem([(weight, accumulator, grad, None)], [span(accumulator)], {weight: "w"})


def test_grad_problem_passes_a_dense_grad_of_its_own_or_none() -> None:
    assert _problem(torch.zeros(2, 3)) is None
    assert _problem(None) is None


def test_grad_problem_leaves_to_autograd_what_eager_adds_otherwise() -> None:
    sparse = ".grad is torch.sparse_coo (expected torch.strided)"
    assert _problem(torch.zeros(2, 3).to_sparse()) == ("w", sparse)  # eager: the dense sum
    wider = ".grad is float64, the parameter float32"
    assert _problem(torch.zeros(2, 3, dtype=torch.float64)) == ("w", wider)  # added in float64
    new = "grad_dtype is float64, the parameter float32"
    assert _problem(None, grad_dtype=torch.float64) == ("w", new)  # a new float64 .grad


def test_grad_problem_refuses_a_grad_in_another_parameters_memory() -> None:
    weight, other = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    accumulators = (torch.zeros(4), torch.zeros(4))
    shared = torch.zeros(4)
    pending = [(weight, accumulators[0], shared, None), (other, accumulators[1], shared, None)]
    names = {weight: "weight", other: "other"}
    assert grad_problem(pending, [span(a) for a in accumulators], names) in {
        ("weight", None),
        ("other", None),
    }
