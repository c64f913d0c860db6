"""Named address ranges, found by any byte they share with another range.

Two storages may hold the same memory (``torch.from_numpy`` of overlapping numpy views,
``torch.frombuffer``, DLPack), so a check by storage start address misses them; this one does not.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

__all__ = ["AddressRanges"]


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
