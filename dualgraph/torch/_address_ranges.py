"""Where tensors' memory lies, found by any byte it shares with another's.

Two storages may hold the same memory (``torch.from_numpy`` of overlapping numpy views,
``torch.frombuffer``, DLPack), so a check by storage start address misses them; these do not.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "AddressRanges",
    "StorageIndex",
    "first_sharing",
    "memory_of",
    "storage_key",
    "storage_spans",
]


class AddressRanges:
    """Ranges ``[start, end)`` with a name each; ``find`` is a bisection, not a scan.

    >>> ranges = AddressRanges([(100, 116, "scale"), (200, 208, "bias")])
    >>> ranges.find(112, 120), ranges.find(116, 200)
    ('scale', None)
    """

    __slots__ = ("_ends", "_ranges", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int, str]]) -> None:
        self._ranges = sorted(ranges, key=lambda found: found[:2])
        self._starts = [start for start, _, _ in self._ranges]
        # The furthest end among the ranges starting at or before each: one comparison says
        # whether any of them reaches past a start.
        self._ends: list[int] = []
        furthest = 0
        for _, end, _ in self._ranges:
            furthest = max(furthest, end)
            self._ends.append(furthest)

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def find(self, start: int, end: int) -> str | None:
        """The name of a range holding any byte of ``[start, end)``, or ``None``."""
        before = bisect_left(self._starts, end)  # the ranges that start before ``end``
        if not before or self._ends[before - 1] <= start:
            return None
        return next(name for _, stop, name in self._ranges[:before] if stop > start)


class StorageIndex:
    """Where some named tensors' storages lie, for finding the one an input's storage is, or
    holds memory of without being it (from_numpy of a view of it, frombuffer, DLPack).

    By start address first (one dict look-up); on a miss, by address range, but only where the
    input's storage or one of these is not torch's own (not resizable): only such a storage can
    be another storage over memory that is also another's, so the common path stays a dict
    look-up. Where two tensors share a storage, the first named is the one found.

    >>> scale = torch.zeros(4)
    >>> index = StorageIndex([("scale", scale), ("bias", torch.zeros(2))])
    >>> memory = scale[2:].untyped_storage()
    >>> index.owner(memory, memory.data_ptr(), foreign=not memory.resizable())
    'scale'
    """

    __slots__ = ("_by_start", "_ranges", "any_foreign")

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        by_start: dict[int, str] = {}
        ranges = []
        any_foreign = False
        for name, tensor in named:
            memory = memory_of(tensor)
            if memory is None:
                continue
            start = memory.data_ptr()
            by_start.setdefault(start, name)
            ranges.append((start, start + memory.nbytes(), name))
            any_foreign = any_foreign or not memory.resizable()
        self._by_start = by_start
        self._ranges = AddressRanges(ranges)
        #: Whether some of these storages are not torch's own (every miss is then a range look-up).
        self.any_foreign = any_foreign

    def __bool__(self) -> bool:
        return bool(self._by_start)

    def owner(self, memory: torch.UntypedStorage, start: int, foreign: bool) -> str | None:
        """The name of a tensor whose storage is ``memory`` or holds any byte of it, or ``None``.

        ``start`` and ``foreign`` are ``memory.data_ptr()`` and ``not memory.resizable()``, read
        once by a caller that looks ``memory`` up in several indexes.
        """
        name = self._by_start.get(start)
        if name is None and (foreign or self.any_foreign):
            name = self._ranges.find(start, start + memory.nbytes())
        return name


def memory_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """A non-empty tensor's storage (``None`` for none, or no plain storage)."""
    try:
        return tensor.untyped_storage() if tensor.numel() else None
    except Exception:  # e.g. a tensor subclass without a storage of its own
        return None


def storage_key(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage, as a key that tensors of one storage share
    (``-id(tensor)`` for one without a plain storage, a tensor subclass's: it shares none).

    >>> x = torch.zeros(4)
    >>> storage_key(x[2:]) == storage_key(x) != storage_key(x.clone())
    True
    """
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # a tensor subclass without a plain storage: nothing to share
        return -id(tensor)


#: A storage's addresses ``[start, end)``, and the storage (for its look-ups by the caller).
Span = tuple[int, int, torch.UntypedStorage]


def storage_spans(tensors: Sequence[torch.Tensor]) -> list[Span | None]:
    """Each tensor's storage with its addresses, ``None`` for an empty tensor (plain dense
    tensors: the checked inputs of a call).

    >>> empty, (start, end, _) = storage_spans([torch.zeros(0), torch.zeros(2)])
    >>> empty, end - start
    (None, 8)
    """
    spans: list[Span | None] = []
    add = spans.append
    for tensor in tensors:
        if tensor.numel():
            memory = tensor.untyped_storage()
            start = memory.data_ptr()
            add((start, start + memory.nbytes(), memory))
        else:
            add(None)
    return spans


def first_sharing(
    spans: Sequence[Span | None], i: int, among: Iterable[int] | None = None
) -> int | None:
    """The first of ``among`` (all, where ``None``) but ``i`` whose storage holds any byte of
    ``i``'s, or ``None``; ``spans``: :func:`storage_spans`, ``i``'s not ``None``.

    >>> x = torch.zeros(4)
    >>> spans = storage_spans([x, torch.zeros(2), x[1:]])
    >>> first_sharing(spans, 0), first_sharing(spans, 0, [1])
    (2, None)
    """
    start, end, _ = spans[i]  # type: ignore[misc]
    for j, span in enumerate(spans) if among is None else ((j, spans[j]) for j in among):
        if span is not None and j != i and span[0] < end and start < span[1]:
            return j
    return None
