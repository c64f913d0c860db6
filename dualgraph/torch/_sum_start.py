"""Accumulators set to ``-0.0`` before a backward's grads are added into them, in one
``torch._foreach_copy_`` per device and dtype.

Where a ``.grad`` is ``None`` (every step after ``optimizer.zero_grad()``), eager's
``AccumulateGrad`` sets it to the grad itself; a graph that adds the grad into an accumulator
gives the same bits only from ``-0.0`` (``-0.0 + g`` is ``g`` for every real ``g``, where
``0.0 + -0.0`` is ``0.0``; torch adds complex numbers as ``a + 1 * b``, which keeps neither, so
complex parameters take autograd). Zeroing then negating takes two multi-tensor kernels, and
torch's ``_foreach_*`` kernels serve one dtype at a time (a list of mixed dtypes goes tensor by
tensor: a kernel per accumulator, twice). :class:`SumStart` copies ``-0.0`` from one shared
buffer per device and dtype (views of it laid out as each accumulator is) instead: one kernel
per dtype, every value (``NaN``, ``inf``) overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._output_aliases import is_dense

__all__ = ["SumStart", "start_sums"]

#: Elements per view of the shared ``-0.0`` buffer (so it never holds more than this per device
#: and dtype): a larger contiguous accumulator is copied into in pieces of this size.
CHUNK = 1 << 20

# The shared buffers, by (device, dtype), read only: they only ever hold -0.0.
_NEGATIVE_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def start_sums(accumulators: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
    """Set ``accumulators`` to ``-0.0`` (two multi-tensor kernels): the start of a sum.

    >>> total = torch.ones(2)
    >>> start_sums([total])
    >>> (total + torch.tensor([-0.0, 0.0])).signbit().tolist()
    [True, False]
    """
    torch._foreach_zero_(accumulators)
    torch._foreach_neg_(accumulators)


def _negative_zeros(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A buffer of at least ``numel`` (at most :data:`CHUNK`) ``-0.0`` on ``device``."""
    key = (device, dtype)
    zeros = _NEGATIVE_ZEROS.get(key)
    if zeros is None or zeros.numel() < numel:
        zeros = torch.zeros(numel, device=device, dtype=dtype).neg_()
        if device.type == "cuda":
            # written on this stream; the backwards that read it may run on another
            torch.cuda.current_stream(device).synchronize()
        _NEGATIVE_ZEROS[key] = zeros  # views made of an older one keep it alive
    return zeros


class SumStart:
    """Sets the accumulators it was made from to ``-0.0`` when called.

    >>> a, b = torch.ones(3), torch.ones(2, 2, dtype=torch.float64)
    >>> SumStart([a, b])()
    >>> a.signbit().all().item(), b.signbit().all().item(), a.abs().sum().item()
    (True, True, 0.0)
    """

    __slots__ = ("_copies", "_others")

    def __init__(self, accumulators: Sequence[torch.Tensor]) -> None:
        copies: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], ...]] = {}
        others = []  # not dense (nor contiguous, where larger than a chunk), during a capture
        # the views of the shared buffers made here, by device, dtype and size (a block's norm
        # weights and biases share one)
        sized: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        # asked only of CUDA accumulators: the query initializes CUDA, which CPU graphs never need
        capturing = (
            any(a.is_cuda for a in accumulators) and torch.cuda.is_current_stream_capturing()
        )
        for accumulator in accumulators:
            numel = accumulator.numel()
            if numel == 0:
                continue
            contiguous = accumulator.is_contiguous()
            if capturing or not (contiguous or (is_dense(accumulator) and numel <= CHUNK)):
                others.append(accumulator)
                continue
            device, dtype = accumulator.device, accumulator.dtype
            zeros = _negative_zeros(device, dtype, min(numel, CHUNK))
            targets, sources = copies.setdefault((device, dtype), ([], []))
            if not contiguous:  # dense, permuted (channels_last, say)
                targets.append(accumulator)
                sources.append(zeros[:numel].as_strided(accumulator.size(), accumulator.stride()))
                continue
            flat = accumulator.view(-1)
            if numel <= CHUNK:  # the usual one: itself, from a view of the buffer per size
                key = (device, dtype, numel)
                source = sized.get(key)
                if source is None:
                    source = sized[key] = zeros[:numel]
                targets.append(flat)
                sources.append(source)
                continue
            for begin in range(0, numel, CHUNK):
                piece = flat[begin : begin + CHUNK]
                targets.append(piece)
                sources.append(zeros[: piece.numel()])
        self._copies = tuple((tuple(t), tuple(s)) for t, s in copies.values())
        self._others = tuple(others)

    def __call__(self) -> None:
        for targets, sources in self._copies:
            torch._foreach_copy_(targets, sources)
        if self._others:
            start_sums(self._others)
