"""How far apart torch and JAX may be, per dtype: entry by entry, as a whole, and in direction.

A floating leaf passes when, over the positions where both sides are finite,

- every entry: ``|torch - jax| <= rtol * |jax| + atol * rms``, ``rms`` being the root mean
  square of the reference leaf (its typical scale);
- the whole leaf: ``||torch - jax|| / ||jax|| <= max_rel_l2`` (the relative L2 error);
- its direction: the cosine similarity of the two leaves is at least ``min_cosine``;
- with ``max_ulps`` set (the formats of 8 bits and fewer by default): every entry is at most
  ``max_ulps`` representable values away from the reference's.

``rtol`` bounds the error of the large entries; ``atol * rms`` is the floor the entries near zero
are held to: rounding errors of a sum follow the size of its terms, not of its result, so an
entry that nearly cancels is judged against the leaf's typical magnitude rather than its own,
yet a leaf of tiny values is judged at its own scale, never against an absolute 1 (a leaf of
``1e-7``'s whose sign flipped fails). In low precision the entries of a deep network's gradients
scatter by several ulps, so the entry-wise bounds must be loose; the relative L2 error, which
averages that scatter, stays small and catches what they let through (a leaf scaled by 10% in
bfloat16). The cosine is the sign and direction check. Integers and bools compare exactly.

A systematic error hides in that scatter: a leaf scaled by 1.5% in bfloat16 is within every
limit above. ``max_bias`` bounds it: the difference ``torch - jax`` is fitted (least squares) as
``s * jax + o * rms`` plus a residual; the scale error ``|s|`` and the offset ``|o|`` must each be
at most ``max_bias`` plus what the residual's scatter explains (``z = 4 + 8 / dof`` standard
errors of the fit, ``dof`` the entries less the two fitted values, the errors measured from the
residuals entry by entry: a leaf of a few entries cannot tell a scale from its rounding).
Rounding errors are independent between entries and average out of the fit, so a shared factor
rounded once (``eps / 2``) is all it allows.

The low-precision limits follow one rule (:func:`rounding_tolerance`) from the dtype's machine
epsilon ``eps`` and a reduction depth ``depth`` (the roundings along a path through the
computation, 64 by default): one rounding is off by up to ``u = eps / 2``, and ``depth``
independent ones by about ``u * sqrt(depth)``, so ``max_rel_l2 = u * sqrt(depth)`` (4 ``eps`` at
depth 64), ``rtol`` twice and ``atol`` eight times that (the entries scatter around the L2
error), ``min_cosine = 1 - max_rel_l2**2 / 2`` and ``max_bias = u``. Deeper computations pass
``tolerances={"bfloat16": rounding_tolerance("bfloat16", depth=256)}``.
A fill that dwarfs the rest of a leaf (one value, equal on both sides, over ``1 / eps`` times
every other entry: a mask's ``-1e9``) is left out of ``rms``, the L2 norms and the cosine.

The formats of 8 bits and fewer hold so few values that their limits in ``rtol`` and ``atol``
reach several of them (``float4_e2m1fn``'s ``2 * eps`` is 100%: a 6 read as 0 passes), and
``float8_e8m0fnu``, a scale of powers of two, has no value between ``x`` and ``x / 2``, so no
relative limit tells one step down from a hundred: they are held to one step (``max_ulps=1``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from .._dtypes import is_differentiable_dtype
from .._errors import DualgraphError

__all__ = [
    "DEFAULT_DEPTH",
    "DEFAULT_TOLERANCES",
    "Tolerance",
    "check_tolerances",
    "rounding_tolerance",
    "tolerance_for",
]


@dataclass(frozen=True)
class Tolerance:
    """The limits for one dtype: ``rtol`` (of ``|jax|``), ``atol`` (of the leaf's RMS),
    ``max_rel_l2`` (of the leaf's L2 norm), ``min_cosine``, ``max_ulps`` (representable
    values between an entry and the reference's) and ``max_bias`` (the leaf's systematic scale
    error and offset, beyond its scatter); ``None``: not limited.

    >>> limits = DEFAULT_TOLERANCES["float32"]
    >>> limits.rtol, limits.atol, limits.max_rel_l2, limits.min_cosine, limits.max_bias
    (0.0001, 0.0001, 0.0001, 0.99999, None)
    >>> DEFAULT_TOLERANCES["float8_e4m3fn"].max_ulps
    1
    """

    rtol: float
    atol: float
    max_rel_l2: float
    min_cosine: float
    max_ulps: int | None = None
    max_bias: float | None = None

    def __post_init__(self) -> None:
        names = ("rtol", "atol", "max_rel_l2", "min_cosine")
        values = [getattr(self, name) for name in names]
        if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in values):
            raise DualgraphError(f"{self}: the limits of a Tolerance must be real numbers")
        try:
            floats = [float(x) for x in values]
        except OverflowError:
            floats = [float("inf")]
        if not all(math.isfinite(x) for x in floats):  # an infinite limit lets anything pass
            raise DualgraphError(f"{self}: the limits of a Tolerance must be finite")
        rtol, atol, max_rel_l2, min_cosine = floats
        if not (min(rtol, atol, max_rel_l2) >= 0 and -1 <= min_cosine <= 1):
            raise DualgraphError(
                f"{self}: rtol, atol and max_rel_l2 must be >= 0, min_cosine within [-1, 1]"
            )
        for name, value in zip(names, floats, strict=True):  # numpy and Fraction limits too
            object.__setattr__(self, name, value)
        ulps = self.max_ulps
        if ulps is not None:
            if isinstance(ulps, bool) or not isinstance(ulps, numbers.Integral) or ulps < 0:
                raise DualgraphError(f"{self}: max_ulps must be None or an int >= 0, got {ulps!r}")
            object.__setattr__(self, "max_ulps", int(ulps))
        bias = self.max_bias
        if bias is not None:
            if isinstance(bias, bool) or not isinstance(bias, numbers.Real):
                raise DualgraphError(f"{self}: max_bias must be None or a real number >= 0")
            try:
                bias = float(bias)
            except OverflowError:
                bias = float("inf")
            if not (math.isfinite(bias) and bias >= 0):
                raise DualgraphError(f"{self}: max_bias must be None or a finite number >= 0")
            object.__setattr__(self, "max_bias", bias)


def _narrow(eps: float) -> Tolerance:
    """8 bits and fewer (``eps`` is the format's machine epsilon): the final rounding dominates,
    so one ulp apart is a match, and two are not."""
    return Tolerance(
        rtol=2 * eps, atol=eps, max_rel_l2=eps, min_cosine=max(0.5, 1 - 2 * eps**2), max_ulps=1
    )


#: The roundings along a path through a computation that :func:`rounding_tolerance` allows for
#: by default.
DEFAULT_DEPTH = 64

#: Machine epsilons of the dtypes :func:`rounding_tolerance` knows.
_EPSILON = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def rounding_tolerance(dtype: str, depth: int = DEFAULT_DEPTH) -> Tolerance:
    """The limits of a low-precision ``dtype`` (bfloat16, float16) for a computation of
    ``depth`` roundings along a path: with ``u = eps / 2`` (one rounding) and
    ``e = u * sqrt(depth)`` (``depth`` independent ones), ``max_rel_l2 = e``, ``rtol = 2 e``,
    ``atol = 8 e``, ``min_cosine = 1 - e**2 / 2`` and ``max_bias = u``.

    >>> rounding_tolerance("bfloat16").max_rel_l2  # 4 eps at the default depth, 64
    0.03125
    >>> rounding_tolerance("float16", depth=256).rtol
    0.015625
    """
    if dtype not in _EPSILON:
        raise DualgraphError(
            f"rounding_tolerance: no rule for {dtype!r}; it knows {sorted(_EPSILON)} (pass a "
            "Tolerance for other dtypes)"
        )
    if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 1:
        raise DualgraphError(f"rounding_tolerance: depth must be an int >= 1, got {depth!r}")
    unit = _EPSILON[dtype] / 2
    error = unit * math.sqrt(int(depth))
    return Tolerance(
        rtol=2 * error,
        atol=8 * error,
        max_rel_l2=error,
        min_cosine=1 - error**2 / 2,
        max_bias=unit,
    )


#: ``dtype name -> Tolerance`` for floating and complex leaves; integers and bools are exact.
#: float64 and float32 chosen from measured differences (see the README's table): outputs and
#: gradients of the dualgraph ViT encoder, torch vs JAX; float16 and bfloat16 by
#: :func:`rounding_tolerance`, which the same measurements stay well within.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-9, atol=1e-9, max_rel_l2=1e-9, min_cosine=0.999999999),
    "complex128": Tolerance(rtol=1e-9, atol=1e-9, max_rel_l2=1e-9, min_cosine=0.999999999),
    "float32": Tolerance(rtol=1e-4, atol=1e-4, max_rel_l2=1e-4, min_cosine=0.99999),
    "complex64": Tolerance(rtol=1e-4, atol=1e-4, max_rel_l2=1e-4, min_cosine=0.99999),
    "float16": rounding_tolerance("float16"),
    "bfloat16": rounding_tolerance("bfloat16"),
    "float8_e4m3fn": _narrow(0.125),
    "float8_e4m3fnuz": _narrow(0.125),
    "float8_e4m3": _narrow(0.125),
    "float8_e4m3b11fnuz": _narrow(0.125),
    "float8_e5m2": _narrow(0.25),
    "float8_e5m2fnuz": _narrow(0.25),
    "float8_e3m4": _narrow(0.0625),
    "float8_e8m0fnu": _narrow(1.0),
    "float6_e2m3fn": _narrow(0.125),
    "float6_e3m2fn": _narrow(0.25),
    "float4_e2m1fn": _narrow(0.5),
}


def check_tolerances(overrides: Tolerance | Mapping[str, Tolerance] | None, /) -> None:
    """Refuse ``overrides`` that are no :class:`Tolerance`, or a mapping with a key that names
    no floating or complex dtype (it would be ignored: ``{"fp32": strict}`` would leave float32
    leaves to the default, looser limits) or a value that is no :class:`Tolerance`."""
    if overrides is None or isinstance(overrides, Tolerance):
        return
    if not isinstance(overrides, Mapping):
        raise DualgraphError(
            "tolerances: expected a Tolerance or a mapping of dtype names to Tolerances, "
            f"got {type(overrides).__name__}"
        )
    for dtype, found in overrides.items():
        if not (isinstance(dtype, str) and is_differentiable_dtype(dtype)):
            raise DualgraphError(
                f"tolerances: {dtype!r} is not the name of a floating or complex dtype (e.g. "
                "'float32', 'bfloat16', 'complex64'); integers and bools compare exactly"
            )
        if not isinstance(found, Tolerance):
            raise DualgraphError(
                f"tolerances[{dtype!r}] is a {type(found).__name__}, not a Tolerance"
            )


def tolerance_for(
    dtype: str, overrides: Tolerance | Mapping[str, Tolerance] | None = None
) -> Tolerance:
    """The tolerance of a floating or complex ``dtype``: ``overrides`` first, then the table.

    ``overrides`` is one :class:`Tolerance` for every floating dtype, or a mapping by dtype name
    (checked by :func:`check_tolerances`).

    >>> tolerance_for("bfloat16", {"bfloat16": Tolerance(0.1, 0.1, 0.1, 0.9)}).rtol
    0.1
    """
    check_tolerances(overrides)
    if isinstance(overrides, Tolerance):
        return overrides
    if overrides is not None and dtype in overrides:
        return overrides[dtype]
    try:
        return DEFAULT_TOLERANCES[dtype]
    except KeyError:
        raise DualgraphError(
            f"no default tolerance for dtype {dtype}; pass tolerances={{{dtype!r}: "
            "Tolerance(rtol=..., atol=..., max_rel_l2=..., min_cosine=...)}"
        ) from None
