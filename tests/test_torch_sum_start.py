"""The start of the in-graph accumulators' sums at ``-0.0`` (``dualgraph/torch/_sum_start.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dualgraph.torch import _sum_start
from dualgraph.torch._sum_start import SumStart


def _held_values(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor holding what a previous step's grads may: signs, zeros, inf and NaN."""
    values = torch.tensor([1.5, -2.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    return (
        values.repeat(-(-torch.Size(shape).numel() // 7))[: torch.Size(shape).numel()]
        .to(dtype)
        .reshape(shape)
    )


def _all_negative_zero(tensor: torch.Tensor) -> bool:
    return bool((tensor == 0).all() and tensor.signbit().all())


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_every_element_becomes_negative_zero_whatever_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mixed dtypes, a permuted (channels_last) layout, one accumulator larger than a chunk
    (copied in pieces) and one not dense (left to zero and negate): each ends ``-0.0``."""
    monkeypatch.setattr(_sum_start, "CHUNK", 8)
    monkeypatch.setattr(_sum_start, "_NEGATIVE_ZEROS", {})
    not_dense = _held_values(4, 6)[:, ::2]
    accumulators = [
        _held_values(5),
        _held_values(3, 7, dtype=torch.float64),  # 21 elements: three pieces
        _held_values(2, 3, 2, 1, dtype=torch.bfloat16).to(memory_format=torch.channels_last),
        not_dense,
        torch.empty(0),
    ]
    SumStart(accumulators)()
    assert all(map(_all_negative_zero, accumulators))
    assert all(zeros.numel() <= 8 for zeros in _sum_start._NEGATIVE_ZEROS.values())


def test_a_start_is_one_copy_per_dtype() -> None:
    """torch's multi-tensor kernels take one dtype each: a list of mixed dtypes would go tensor
    by tensor (a kernel per accumulator on a GPU), and zeroing then negating took two."""
    accumulators = [
        _held_values(4),
        _held_values(3, dtype=torch.float64),
        _held_values(2, 2),
        _held_values(5, dtype=torch.float64),
    ]
    start = SumStart(accumulators)
    with _Ops() as ops:
        start()
    assert ops.names == ["_foreach_copy_.default"] * 2
    assert all(map(_all_negative_zero, accumulators))


def test_the_shared_buffer_stays_negative_zero() -> None:
    """Many starts share one buffer per device and dtype; the copies only read it."""
    first, second = _held_values(6), _held_values(3, 3)
    starts = SumStart([first]), SumStart([second])
    for _ in range(2):
        for start in starts:
            start()
        first.fill_(7.0)
    # every buffer read, the one the first start was made with (smaller, replaced since) too
    sources = [source for start in starts for _, group in start._copies for source in group]
    assert len(sources) == 2 and all(map(_all_negative_zero, sources))


def test_accumulators_on_the_cpu_never_ask_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a CUDA stream is capturing is asked of CUDA accumulators only: the query
    initializes CUDA (a context on the device), which graphs on the CPU never need."""
    asked: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU
    monkeypatch.setattr(
        torch.cuda, "is_current_stream_capturing", lambda: asked.append(True) or False
    )
    accumulator = torch.ones(3)
    SumStart([accumulator])()
    assert asked == []
    assert _all_negative_zero(accumulator)


def test_accumulators_of_one_size_start_from_one_view_of_the_buffer() -> None:
    """A block's norm weights and biases (and a model's many biases) are of a few sizes: one view
    of the shared buffer is made per size, and each accumulator is copied into as itself (a
    slice of itself and a view of the buffer each took two ops an accumulator)."""
    accumulators = [_held_values(6), _held_values(2, 3), _held_values(4)]
    start = SumStart(accumulators)
    ((targets, sources),) = start._copies
    assert sources[0] is sources[1] and sources[2] is not sources[0]
    assert [t.data_ptr() for t in targets] == [a.data_ptr() for a in accumulators]
    start()
    assert all(map(_all_negative_zero, accumulators))
