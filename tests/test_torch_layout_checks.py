"""Layouts: sizes and strides compared per call, as ``size()`` and ``stride()`` would be."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_cases import GRAPH_BACKENDS, device_of

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch import _layout_checks
from dualgraph.torch._layout_checks import Layouts


def test_layouts_are_the_same_until_a_tensor_is_laid_out_otherwise() -> None:
    weight, bias = torch.randn(4, 4), torch.randn(4)
    layouts = Layouts.of((weight, bias))
    assert layouts.same()
    weight.data = weight.data.t()  # the same memory read transposed
    assert not layouts.same()


_RELAID = {
    "shape": lambda t: t.reshape(2, 8),
    "dimensions": lambda t: t.reshape(16),
    "prefix": lambda t: t.flatten()[:8].view(2, 4),
}


@pytest.mark.parametrize("relaid", sorted(_RELAID))
def test_layouts_see_another_shape_or_dimension_count(relaid: str) -> None:
    tensor = torch.randn(4, 4)
    layouts = Layouts.of((tensor,))
    tensor.data = _RELAID[relaid](tensor.data)
    assert not layouts.same()


def test_layouts_see_a_stride_change_on_a_dimension_of_size_one() -> None:
    # Inductor's C guard, which the others go through, ignores a size-1 dimension's stride:
    # such tensors are compared through their stride() tuples, as before.
    tensor = torch.randn(4, 1)
    layouts = Layouts.of((tensor,))
    tensor.data = tensor.data.as_strided((4, 1), (1, 4))  # the same memory
    assert tensor.stride() == (1, 4)
    assert not layouts.same()


def test_layouts_of_a_zero_dimensional_and_an_empty_tensor() -> None:
    scalar, empty = torch.tensor(2.0), torch.empty(0, 3)
    layouts = Layouts.of((scalar, empty))
    assert layouts.same()
    empty.data = torch.empty_strided((0, 3), (1, 1))
    assert not layouts.same()


class _Column(nn.Module):
    """A parameter with a dimension of size one."""

    def __init__(self) -> None:
        super().__init__()
        self.column = nn.Parameter(torch.randn(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.column


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_restrided_on_a_dimension_of_size_one_is_refused(backend: str) -> None:
    device = device_of(backend)
    module = _Column().to(device)
    dgt.make_graphed_callables(module, (torch.randn(8, 3, device=device),), backend=backend)
    # the same memory, the same elements: only the stride no element moves by differs
    module.column.data = module.column.data.as_strided((8, 1), (1, 8))
    with pytest.raises(DualgraphError, match=r"^_Column\.column: the parameter's layout changed"):
        module(torch.randn(8, 3, device=device))


def test_layouts_are_the_same_where_only_what_else_the_guard_reads_changed() -> None:
    # The C guard also compares requires_grad and the dispatch keys under autocast and
    # inference mode: there it answers False, and the sizes and strides decide.
    weight = nn.Parameter(torch.randn(4, 4))
    layouts = Layouts.of((weight,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layouts.same()
    with torch.inference_mode():
        assert layouts.same()
    weight.requires_grad_(False)
    assert layouts.same()
    weight.data = weight.data.t()
    assert not layouts.same()


def test_layouts_without_the_guard_compare_the_tuples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dualgraph.torch._layout_checks._TensorGuards", None)
    weight = torch.randn(4, 4)
    layouts = Layouts.of((weight,))
    assert layouts.same()
    weight.data = weight.data.t()
    assert not layouts.same()


def test_layouts_alternating_between_two_states_make_no_guard_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A replay under autocast, one without, and so on: the guard of each is kept.
    from dualgraph.torch import _layout_checks

    made = []
    make = _layout_checks._guard_of
    monkeypatch.setattr(_layout_checks, "_guard_of", lambda t: made.append(1) or make(t))
    weight = nn.Parameter(torch.randn(4, 4))
    layouts = Layouts.of((weight,))
    for _ in range(3):
        assert layouts.same()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layouts.same()
    assert len(made) == 2  # at construction, and the first call under autocast
    weight.data = weight.data.t()
    assert not layouts.same()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layouts.same()


def test_a_guard_class_that_ignores_strides_is_not_trusted() -> None:
    class Lenient:  # a torch whose guard compared sizes only
        def __init__(self, *tensors: torch.Tensor, **_: object) -> None:
            self.sizes = [t.size() for t in tensors]

        def check(self, *tensors: torch.Tensor) -> bool:
            return [t.size() for t in tensors] == self.sizes

    assert not _layout_checks._guard_answers_as_tuples(Lenient)
    if _layout_checks._TensorGuards is not None:
        assert _layout_checks._guard_answers_as_tuples(_layout_checks._TensorGuards)


def test_a_guard_class_that_ignores_requires_grad_makes_no_exact_guard() -> None:
    # The input guard (exact_guard) stands in for the dtype, class and requires_grad checks
    # too: a torch whose guard compares the layout only must not be trusted for them.
    class LayoutOnly:  # passes _guard_answers_as_tuples
        def __init__(self, *tensors: torch.Tensor, **_: object) -> None:
            self.layouts = [(t.size(), t.stride()) for t in tensors]

        def check(self, *tensors: torch.Tensor) -> bool:
            return [(t.size(), t.stride()) for t in tensors] == self.layouts

    assert _layout_checks._guard_answers_as_tuples(LayoutOnly)
    assert not _layout_checks._guard_answers_as_input_checks(LayoutOnly)
    if _layout_checks._TensorGuards is not None:
        assert _layout_checks._guard_answers_as_input_checks(_layout_checks._TensorGuards)


def test_the_input_guard_self_test_answers_alike_when_asked_inside_inference_mode() -> None:
    # ``import dualgraph.torch`` inside ``torch.inference_mode()`` runs the import-time self-test
    # there, where every tensor it makes is an inference tensor: it must still trust the guard.
    if _layout_checks._TensorGuards is None:
        pytest.skip("this torch has no TensorGuards")
    with torch.inference_mode():
        assert _layout_checks._guard_answers_as_input_checks(_layout_checks._TensorGuards)
    with torch.no_grad():
        assert _layout_checks._guard_answers_as_input_checks(_layout_checks._TensorGuards)
