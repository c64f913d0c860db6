"""Tests for dualgraph.torch._grad_checks: what a replay's backward asks before writing .grad."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dualgraph import DualgraphError
from dualgraph.torch._grad_checks import GradProblem, aliases, grad_problem, span


def test_aliases_is_true_for_the_accumulators_own_memory_alike() -> None:
    accumulator = torch.zeros(2, 3)
    assert aliases(accumulator.detach(), accumulator, "w")


def test_aliases_is_false_for_memory_of_its_own_or_a_sparse_grad() -> None:
    accumulator = torch.zeros(2, 3)
    assert not aliases(torch.zeros(2, 3), accumulator, "w")
    assert not aliases(torch.zeros(2, 3).to_sparse(), accumulator, "w")


def test_aliases_refuses_the_same_memory_in_another_layout() -> None:
    accumulator = torch.zeros(2, 2)  # (another shape is grad_problem's: eager raises)
    with pytest.raises(DualgraphError, match=r"^w: \.grad shares memory"):
        aliases(accumulator.t(), accumulator, "w")


def test_grad_problem_finds_a_grad_moved_to_another_device() -> None:
    # (p.grad.data = p.grad.data.cpu() on a GPU: a meta tensor stands in for the other device)
    weight = torch.nn.Parameter(torch.ones(8))
    accumulator = torch.zeros(8)
    moved = torch.zeros(8, device="meta")
    problem = grad_problem([(weight, accumulator, moved, None)], [span(accumulator)], {weight: "w"})
    assert problem is not None and problem.raises_for is weight
    assert problem.found == ".grad is on meta, the parameter on cpu: eager's add into it raises"


def test_grad_problem_finds_a_grad_of_another_shape_in_the_same_memory() -> None:
    weight = torch.nn.Parameter(torch.ones(8))
    accumulator = torch.zeros(8)
    prefix = accumulator[:5]  # the same address and strides
    assert not aliases(prefix, accumulator, "w")
    problem = grad_problem(
        [(weight, accumulator, prefix, None)], [span(accumulator)], {weight: "w"}
    )
    assert problem is not None and problem.raises_for is weight
    assert problem.found == ".grad has shape [5], the parameter [8]: eager's add into it raises"


def test_span_covers_the_bytes_of_a_strided_tensor() -> None:
    base = torch.zeros(4, 4)
    start = base.data_ptr()
    assert span(base[:, 1]) == (start + 4, start + 4 + (3 * 4 + 1) * 4)
    empty = base[:0]
    assert span(empty) == (empty.data_ptr(), empty.data_ptr())


def _problem(grad: torch.Tensor | None, **param_attrs: object) -> GradProblem | None:
    weight = torch.nn.Parameter(torch.ones(2, 3))
    for key, value in param_attrs.items():
        setattr(weight, key, value)
    accumulator = torch.zeros(2, 3)
    return grad_problem([(weight, accumulator, grad, None)], [span(accumulator)], {weight: "w"})


def _found(grad: torch.Tensor | None, **param_attrs: object) -> tuple[str, str | None, bool]:
    """What :func:`grad_problem` says of a ``.grad``: the name, what it found, whether eager
    raises for it."""
    problem = _problem(grad, **param_attrs)
    assert problem is not None
    return problem.name, problem.found, problem.raises_for is not None


def test_grad_problem_passes_a_dense_grad_of_its_own_or_none() -> None:
    assert _problem(torch.zeros(2, 3)) is None
    assert _problem(None) is None


def test_grad_problem_passes_a_grad_requiring_grad_a_view_or_a_strided_one() -> None:
    # eager adds into each in place, as the copy back of an accumulator does
    assert _problem(torch.zeros(2, 3, requires_grad=True)) is None
    assert _problem(torch.zeros(12, requires_grad=True)[:6].view(2, 3)) is None
    assert _problem(torch.zeros(3, 2).t()) is None
    assert _problem(torch.zeros(2, 6)[:, ::2]) is None  # strides eager can't classify


def test_grad_problem_leaves_to_autograd_what_eager_adds_otherwise() -> None:
    sparse = (
        ".grad is torch.sparse_coo (expected torch.strided): eager replaces it by the dense sum"
    )
    assert _found(torch.zeros(2, 3).to_sparse()) == ("w", sparse, False)
    wider = ".grad is float64, the parameter float32: eager adds in the .grad's dtype"
    assert _found(torch.zeros(2, 3, dtype=torch.float64)) == ("w", wider, False)
    new = "grad_dtype is float64, the parameter float32: eager makes a .grad of the grad_dtype"
    assert _found(None, grad_dtype=torch.float64) == ("w", new, False)


def _inference_zeros() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(2, 3)


_SHARED = ".grad's elements share memory (an expanded tensor?): eager's in-place add into it raises"
_INFERENCE = (
    ".grad is an inference tensor: eager's in-place add into it raises outside inference mode"
)


@pytest.mark.parametrize(
    ("make", "found"),
    [
        (lambda: torch.zeros(1, 1).expand(2, 3), _SHARED),
        (lambda: torch.zeros(3).as_strided((2, 3), (0, 1)), _SHARED),
        (_inference_zeros, _INFERENCE),
    ],
    ids=["expanded", "zero_stride", "inference"],
)
def test_grad_problem_names_a_grad_eagers_in_place_add_raises_for(make: Any, found: str) -> None:
    assert _found(make()) == ("w", found, True)


def test_grad_problem_leaves_to_autograd_a_grad_whose_elements_overlap() -> None:
    # torch can't tell (no error in eager), which adds into each element once per appearance
    overlapping = torch.zeros(5).as_strided((2, 3), (1, 1))
    said = ".grad's elements overlap in memory: eager adds into each element in place, one after "
    assert _found(overlapping) == ("w", said + "another", False)


def test_grad_problem_refuses_a_grad_in_another_parameters_memory() -> None:
    weight, other = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    accumulators = (torch.zeros(4), torch.zeros(4))
    shared = torch.zeros(4)
    pending = [(weight, accumulators[0], shared, None), (other, accumulators[1], shared, None)]
    names = {weight: "weight", other: "other"}
    assert grad_problem(pending, [span(a) for a in accumulators], names) in {
        ("weight", None, None, None),
        ("other", None, None, None),
    }
