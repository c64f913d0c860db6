"""KeptBytes: the bytes of many tensors kept, small ones in one copy, and those changed found."""

from __future__ import annotations

import pytest
import torch

from dualgraph.torch import _kept_bytes
from dualgraph.torch._kept_bytes import KeptBytes
from dualgraph.torch._params import bytes_of


def _tensors() -> list[torch.Tensor]:
    return [
        torch.randn(3, 4),
        torch.nn.Parameter(torch.randn(5)),
        torch.arange(6, dtype=torch.int64),
        torch.randn(2, 3).t(),  # not contiguous: its elements in element order
        torch.tensor(1.5),
        torch.zeros(0),
        torch.tensor([True, False]),
        torch.randn(2, dtype=torch.complex64),
    ]


def test_the_kept_bytes_of_each_tensor_are_its_bytes_of_then() -> None:
    tensors = _tensors()
    then = [bytes_of(t) for t in tensors]
    kept = KeptBytes(tensors)
    for t in tensors:
        t.data.zero_()
    assert all(torch.equal(kept.of(i), then[i]) for i in range(len(tensors)))


def test_nothing_changed_is_found_unchanged() -> None:
    kept = KeptBytes(_tensors())
    assert kept.changed() == []


@pytest.mark.parametrize("position", range(8))
def test_a_tensor_written_without_a_version_bump_is_found_alone(position: int) -> None:
    tensors = _tensors()
    kept = KeptBytes(tensors)
    target = tensors[position]
    if target.numel() == 0:
        target.data = torch.zeros(1)  # no bytes to change: laid out anew instead
    else:  # its first element, in place through .data
        first = (0,) * target.dim()
        data = target.data
        data[first] = ~data[first] if data.dtype == torch.bool else data[first] + 1
    assert kept.changed() == [position]


def test_a_tensor_given_other_memory_with_the_same_bytes_is_changed() -> None:
    tensors = _tensors()
    kept = KeptBytes(tensors)
    tensors[1].data = tensors[1].data.clone()  # .data = other: the graphs read the old memory
    assert kept.changed() == [1]


def test_a_negative_zero_and_a_nan_are_compared_by_their_bits() -> None:
    tensors = [torch.tensor([0.0, float("nan")]), torch.ones(2)]
    kept = KeptBytes(tensors)
    tensors[0].data[0] = -0.0
    assert kept.changed() == [0]
    kept = KeptBytes(tensors)
    assert kept.changed() == []  # a NaN is its own bits


def test_a_tensor_given_a_negative_bit_is_compared_by_its_values() -> None:
    tensors = [torch.tensor([1.0, 2.0]), torch.ones(2)]
    kept = KeptBytes(tensors)
    tensors[0].data = torch._neg_view(tensors[0].data)  # the same memory, negated values
    assert kept.changed() == [0]


def test_one_small_tensor_alone_is_kept_as_a_copy() -> None:
    # torch's flatten hands one tensor back as a view of itself, which would change with it
    tensor = torch.zeros(3)
    kept = KeptBytes([tensor])
    tensor.data[0] = 1.0
    assert kept.changed() == [0]


def test_large_tensors_are_compared_on_their_own_and_batches_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kept_bytes, "BATCHED_BELOW", 16)
    monkeypatch.setattr(_kept_bytes, "BATCH_BYTES", 24)
    flattened: list[int] = []
    flatten = _kept_bytes._flatten_dense_tensors
    monkeypatch.setattr(
        _kept_bytes, "_flatten_dense_tensors", lambda ts: flattened.append(len(ts)) or flatten(ts)
    )
    tensors = [torch.zeros(2), torch.zeros(8), torch.zeros(3), torch.zeros(3), torch.zeros(1)]
    kept = KeptBytes(tensors)  # 8, [32: its own], 12 + 12 > 24: two batches of 8 + 12, 12 + 4
    assert flattened == [2, 2]
    tensors[4].data[0] = 1.0
    tensors[1].data[7] = 1.0
    assert kept.changed() == [1, 4]
