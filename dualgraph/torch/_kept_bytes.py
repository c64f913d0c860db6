"""The bytes of many tensors, kept to find later those whose bytes changed, small ones together.

Warmup keeps the bytes of a callable's parameters around its calls and compares them after
(``module_tensors_kept``). One copy and one in-place comparison per tensor is a dozen small ops
per tensor (on CUDA, each comparison a synchronizing ``torch.equal``): for a layer's many small
tensors (biases, norms' weights) that host time is most of it. So the small tensors of one
device and dtype are copied into one flat tensor, in element order (as :func:`bytes_of` copies
each), and compared in one ``torch.equal`` of wider integers (:func:`same_bytes`) with one flat
copy of them as they are now (64 KiB at most); only where that differs is each compared on its
own. A large tensor is copied and compared on its own, in place (no second copy of it), as its
ops cost little beside its bytes. A tensor laid out anew (``.data = other``: another address,
dtype, shape, strides or device) is changed.

>>> a, b = torch.zeros(2, 3), torch.ones(4)
>>> kept = KeptBytes([a, b])
>>> kept.changed()
[]
>>> b.data[1] = 2.0  # no version bump
>>> kept.changed(), torch.equal(kept.of(1), bytes_of(torch.ones(4)))
([1], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

from ._params import bytes_now, bytes_of, same_bytes

__all__ = ["KeptBytes"]

#: A tensor of this many bytes or more is copied and compared on its own, in place.
BATCHED_BELOW = 1 << 14
#: At most this many bytes in one batch: the transient copy its comparison makes. Small on
#: purpose: on a CPU, glibc maps fresh pages for each allocation above 128 KiB (page faults on
#: every copy), which cost more than the ops a larger batch saves.
BATCH_BYTES = 1 << 16


def _flat(tensors: Sequence[torch.Tensor], *, copy: bool) -> torch.Tensor:
    """The elements of ``tensors`` (plain strided tensors of one device and dtype), in order,
    as one tensor of bytes: their :func:`bytes_of`, concatenated (the concatenation resolves a
    conjugate or negative bit, as ``bytes_of`` does); a new tensor where ``copy`` (torch's
    flatten hands one tensor back as a view of itself)."""
    if len(tensors) == 1:
        return bytes_of(tensors[0]) if copy else bytes_now(tensors[0])
    with torch.no_grad():  # no autograd history of parameters (a copy records none anyway)
        return _flatten_dense_tensors(tensors).view(torch.uint8)


def _batched(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements copy into a flat tensor as :func:`bytes_of` copies them: a
    plain strided tensor (a conjugate or negative bit is resolved by the copy, as there)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
    )


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Where and how ``tensor``'s elements lie: ``.data = other`` changes it."""
    return tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), tensor.device


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Batch:
    """Small tensors of one device and dtype (positions among all), with their flat copy."""

    __slots__ = ("flat", "positions")

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.flat: torch.Tensor | None = None


class KeptBytes:
    """The bytes of ``tensors`` (strided ones: each has an address) as they are now (as
    :func:`bytes_of` copies each)."""

    __slots__ = ("_batches", "_kept", "_layouts", "_tensors")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tuple(tensors)
        self._layouts = list(map(_layout, self._tensors))
        # per tensor: its own copy, or (batch, start, end) of its bytes in the batch's copy
        self._kept: list[torch.Tensor | tuple[_Batch, int, int]] = []
        self._batches: list[_Batch] = []
        filling: dict[tuple[torch.device, torch.dtype], tuple[_Batch, int]] = {}
        for i, (tensor, layout) in enumerate(zip(self._tensors, self._layouts, strict=True)):
            size = _size(tensor)
            if size >= BATCHED_BELOW or not _batched(tensor):
                self._kept.append(bytes_of(tensor))
                continue
            key = (layout[4], layout[1])  # device, dtype
            batch, start = filling.get(key, (None, 0))
            if batch is None or start + size > BATCH_BYTES:
                batch, start = _Batch(), 0
                self._batches.append(batch)
            batch.positions.append(i)
            self._kept.append((batch, start, start + size))
            filling[key] = (batch, start + size)
        for batch in self._batches:
            batch.flat = _flat([self._tensors[i] for i in batch.positions], copy=True)

    def of(self, i: int) -> torch.Tensor:
        """The kept bytes of the ``i``-th tensor (what :func:`bytes_of` gave then)."""
        kept = self._kept[i]
        if isinstance(kept, torch.Tensor):
            return kept
        batch, start, end = kept
        assert batch.flat is not None
        return batch.flat[start:end]

    def changed(self) -> list[int]:
        """The positions of the tensors laid out anew (``.data = other``) or whose bytes are not
        those kept, in order: a batch's bytes compared at once, each on its own only where that
        differs or one of it was laid out anew."""
        layouts = list(map(_layout, self._tensors))
        moved = {
            i
            for i, (now, then) in enumerate(zip(layouts, self._layouts, strict=True))
            if now != then
        }
        found = set(moved)
        found.update(
            i
            for i, kept in enumerate(self._kept)
            if isinstance(kept, torch.Tensor)
            and i not in moved
            and not same_bytes(kept, bytes_now(self._tensors[i]))
        )
        for batch in self._batches:
            assert batch.flat is not None
            if not moved.intersection(batch.positions) and same_bytes(
                batch.flat, _flat([self._tensors[i] for i in batch.positions], copy=False)
            ):
                continue
            found.update(
                i
                for i in batch.positions
                if i not in moved and not same_bytes(self.of(i), bytes_now(self._tensors[i]))
            )
        return sorted(found)
