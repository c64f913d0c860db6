"""Which entries of the JAX params a torch parameter (or a part of a complex one) reaches through
``params_from_torch``: the one rule of the checks that a mapping drops no trained entry and
puts none in two places.

A unit (``(name, part)``: a real parameter whole, part ``None``, or a complex one's ``"real"``
or ``"imaginary"`` part, each probed alone) reaches an entry that turns NaN where the unit is
NaN and changes where the unit goes from 0 to a finite value, the other parameters as given.
Either probe alone misleads: NaN spreads through complex arithmetic (``-1 * w`` multiplies by
``-1 + 0j``, and ``NaN * 0`` is NaN, so ``(-1 * w).real`` turns NaN with ``w.imag`` NaN though
it is ``-w.real``), and a clip (``max(w, 5)``) is 5 at 0, 1 and 2 alike.

>>> leaves_of = lambda given: [(-1 * given["w"]).real]
>>> base = {"w": np.zeros(2, np.complex64)}
>>> reference = leaves_of(base)
>>> [m.tolist() for m in reached_entries(leaves_of, base, reference, [("w", "imaginary")])]
[[False, False]]
>>> [m.tolist() for m in reached_entries(leaves_of, base, reference, [("w", "real")])]
[[True, True]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from .._dtypes import is_differentiable_dtype
from ._arrays import parts

__all__ = ["PROBE_VALUES", "holds_nan", "mark", "probed_parts", "reached_entries", "unit_name"]

#: A unit of a parameter: its name and part (``None``, ``"real"`` or ``"imaginary"``).
Unit = tuple[str, str | None]

#: The finite values a unit is set to where one probe is not enough (a clip ``max(w, 5)`` moves
#: at 1024 only, ``clip(w, -6, -5)`` at -1024 only).
PROBE_VALUES = (1.0, 1024.0, -1024.0)


def probed_parts(a: np.ndarray) -> tuple[str | None, ...]:
    """The parts of a parameter probed one by one: a complex one's real and imaginary parts
    (NaN in both at once hides a part mapped twice behind one dropped, and counts ``w.real``
    and ``w.imag`` leaves as two uses), a real one whole (``None``).

    >>> probed_parts(np.zeros(2, np.complex64)), probed_parts(np.zeros(2, np.float32))
    (('real', 'imaginary'), (None,))
    """
    return ("real", "imaginary") if a.dtype.kind == "c" else (None,)


def mark(part: str | None, value: float) -> complex | float:
    """The value that sets ``part`` of a parameter to ``value`` alone: a complex one's other part
    0 (``np.nan`` as a complex is ``nan+0j``: its real part only).

    >>> mark("imaginary", np.nan), mark("real", 2.0), mark(None, 2.0)
    (nanj, (2+0j), 2.0)
    """
    if part is None:
        return value
    return complex(value, 0.0) if part == "real" else complex(0.0, value)


def unit_name(name: str, part: str | None) -> str:
    """A torch parameter, or a part of a complex one, for messages.

    >>> unit_name("w", "real"), unit_name("b", None)
    ("'w' (its real part)", "'b'")
    """
    return repr(name) if part is None else f"{name!r} (its {part} part)"


def reached_entries(
    leaves_of: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
    base: Mapping[str, np.ndarray],
    reference: Sequence[np.ndarray],
    units: Iterable[Unit],
    values: Sequence[float] = PROBE_VALUES[:1],
) -> list[np.ndarray | None]:
    """For each leaf ``leaves_of`` gives, the entries ``units`` reach (``None`` for a leaf that
    is not floating): NaN where the units are NaN, and apart from ``reference`` (the leaves of
    ``base``, in which the units' parameters are 0) where they are one of ``values``; the
    other parameters as in ``base``. Both parts of a complex parameter among ``units`` are set
    together. A leaf of a dtype without NaN (float4_e2m1fn, float6: NaN is cast to -0) is
    probed by ``values`` alone."""
    units = list(units)

    def leaves_with(value: float) -> list[np.ndarray]:
        marks: dict[str, complex | float] = {}
        for name, part in units:
            marks[name] = mark(part, value) + marks.get(name, 0)
        given = {n: np.full_like(a, marks[n]) if n in marks else a for n, a in base.items()}
        return [np.asarray(x) for x in leaves_of(given)]

    found: list[np.ndarray | None] = [
        (np.isnan(leaf) if holds_nan(leaf.dtype) else np.ones(leaf.shape, bool))
        if _floating(leaf)
        else None
        for leaf in leaves_with(np.nan)
    ]
    moved = [_apart(leaves, reference) for leaves in map(leaves_with, values)]
    return [
        None if nan is None else nan & np.logical_or.reduce([m[i] for m in moved])
        for i, nan in enumerate(found)
    ]


@functools.cache
def holds_nan(dtype: np.dtype) -> bool:
    """Whether ``dtype`` has a NaN (float4_e2m1fn and the float6 formats cast it to -0).

    >>> import ml_dtypes
    >>> holds_nan(np.dtype(np.float32)), holds_nan(np.dtype(ml_dtypes.float4_e2m1fn))
    (True, False)
    """
    return bool(np.isnan(np.array(np.nan).astype(dtype)))


def _apart(leaves: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per leaf, the entries that differ from ``reference``'s in some part (NaN equal to NaN;
    all entries of a leaf that is not floating, which :func:`reached_entries` leaves out)."""
    found = []
    for leaf, before in zip(leaves, map(np.asarray, reference), strict=True):
        if not _floating(leaf) or (leaf.shape, leaf.dtype) != (before.shape, before.dtype):
            found.append(np.ones(leaf.shape, bool))
            continue
        a, b = parts(leaf), parts(before)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        found.append(~same.all(axis=-1))
    return found


def _floating(array: np.ndarray) -> bool:
    return is_differentiable_dtype(array.dtype.name)  # bfloat16 and float8 too (kind "V")
