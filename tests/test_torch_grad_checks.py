"""Tests for dualgraph.torch._grad_checks: what a replay's backward asks before writing .grad."""

from __future__ import annotations

import pytest
import torch

from dualgraph import DualgraphError
from dualgraph.torch._grad_checks import aliases, span


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
