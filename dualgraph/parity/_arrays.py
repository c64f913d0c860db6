"""One leaf of torch against the same leaf of JAX, as numpy arrays: the tolerance model at work.

Nothing is coerced: the two arrays must have the same dtype and shape (else the leaf fails and
says so). Integers and bools are compared exactly, in their own dtype. Floating and complex
leaves follow :mod:`._tolerances`; NaN and infinities must sit at the same positions (with the
same sign) on both sides, and are counted.

>>> import numpy as np
>>> y = np.full(4, 1e-7, np.float32)
>>> compare_arrays("out", -y, y).reason
'4 values over tolerance, worst at 1e+04x (max abs 2e-07)'
>>> compare_arrays("ids", np.array([2**60 + 1]), np.array([2**60])).reason
'1 values differ (largest difference 1)'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import torch

from .._dtypes import is_differentiable_dtype, is_dtype_name
from .._errors import DualgraphError
from .._nodes import clip_text
from ._bridge import UNSIGNED_OF_SIZE, to_numpy, unreadable
from ._report import LeafReport
from ._tolerances import Tolerance, check_tolerances, tolerance_for

__all__ = ["compare_arrays"]


def compare_arrays(
    path: str,
    actual: np.ndarray,
    expected: np.ndarray,
    *,
    tolerances: Tolerance | Mapping[str, Tolerance] | None = None,
    allow_nan: bool = False,
) -> LeafReport:
    """Compare ``actual`` (torch's) with ``expected`` (JAX's reference) at leaf ``path``: numpy
    arrays, or anything ``np.asarray`` reads (JAX arrays); torch tensors are read as
    :func:`compare` reads them (detached, on the host, bfloat16 and conjugates included)."""
    if not isinstance(allow_nan, bool):  # "no" would be truthy: NaN leaves would pass
        raise DualgraphError(f"allow_nan must be True or False, got {allow_nan!r}")
    check_tolerances(tolerances)  # a misnamed dtype would be ignored, even for int leaves
    actual, expected = _as_numpy(path, actual), _as_numpy(path, expected)
    dtype = expected.dtype.name
    shape = tuple(expected.shape)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return _differing_leaves(path, actual, expected)
    if not is_dtype_name(dtype):  # objects, strings, dates: no numbers to compare
        problem = f"{dtype} is not a numeric dtype: nothing to compare"
        return _differing_leaves(path, actual, expected, problem)
    if not is_differentiable_dtype(dtype):  # integers (int4 too), bools
        return _compare_exact(path, actual, expected)
    tolerance = tolerance_for(dtype, tolerances)
    a, b = _widened(actual), _widened(expected)
    # A complex entry of finite parts can be larger than float64's largest value (|1.7e308 +
    # 1.7e308j|): the leaf's rms, and every limit it scales, would be inf, and any difference
    # pass. Such a leaf is judged at a quarter of its size (exact, a power of two; every limit
    # is relative), and the sizes it reports are scaled back.
    shrink = 4.0 if a.dtype.kind == "c" and _past_half_of_float64(a, b) else 1.0
    a, b = (a / shrink, b / shrink) if shrink != 1.0 else (a, b)
    # NaN and infinities part by part: a complex entry is NaN for a NaN in either part, so
    # judged as a whole, NaN in the real part would match NaN in the imaginary part.
    part_a, part_b = parts(a), parts(b)
    nan_a, nan_b = np.isnan(part_a), np.isnan(part_b)
    inf_a, inf_b = np.isinf(part_a), np.isinf(part_b)
    part_finite = ~(nan_a | nan_b | inf_a | inf_b)
    finite = part_finite.all(axis=-1)
    part_differs = (nan_a != nan_b) | (inf_a != inf_b) | (inf_a & inf_b & (part_a != part_b))
    nonfinite_differs = part_differs.any(axis=-1)
    unmatched = _first_unmatched(nonfinite_differs, actual, expected)
    a_fin, b_fin = a[finite], b[finite]
    # A fill that dwarfs the rest (a mask's -1e9 or finfo.min) sets no scale: judged by it, the
    # other entries would pass whatever their values (they are judged by what is left).
    judged = _not_fill(a_fin, b_fin, expected.dtype)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        diff = np.abs(a_fin - b_fin)  # float64 values near its limit: differences may be inf
        magnitude = np.abs(b_fin)
        scale = _rms(magnitude[judged])
        allowed = tolerance.rtol * magnitude + tolerance.atol * scale
        ratio = np.where(diff == 0, 0.0, diff / allowed)  # allowed == 0 < diff: inf
        ratio[np.isnan(ratio)] = np.inf  # an overflowed difference over an overflowed limit
        relative = np.where((diff == 0) | (magnitude == 0), 0.0, diff / magnitude)
        # The finite part of an entry whose other part is NaN or infinite (complex only) is
        # held to the same limits as a finite entry.
        partial = ~finite & ~nonfinite_differs & part_finite.any(axis=-1)
        if partial.any():
            kept = part_finite[partial]
            x, y = part_a[partial][kept], part_b[partial][kept]
            over_part = np.abs(x - y) > tolerance.rtol * np.abs(y) + tolerance.atol * scale
            rows = np.flatnonzero(partial)[np.flatnonzero(kept)[over_part] // kept.shape[-1]]
            nonfinite_differs[rows] = True
    entry_over = nonfinite_differs.copy()
    entry_over[finite] |= ratio > 1
    score = float(ratio.max(initial=0.0))
    ulps = None
    if tolerance.max_ulps is not None:  # the formats of 8 bits and fewer: one step at most
        steps = np.where(part_finite, _ulps_apart(path, actual, expected), 0)
        ulps = int(steps.max(initial=0))
        entry_over |= (steps > tolerance.max_ulps).any(axis=-1)
        if ulps > tolerance.max_ulps:
            score = max(score, ulps / tolerance.max_ulps if tolerance.max_ulps else math.inf)
    bias = None
    if tolerance.max_bias is not None:  # a scale or offset of the whole leaf, hidden in scatter
        bias = _systematic(a_fin[judged], b_fin[judged], tolerance.max_bias)
    over = int(np.count_nonzero(entry_over))
    if nonfinite_differs.any():
        score = float("inf")
    nonfinite = int(np.count_nonzero(~finite & ~nonfinite_differs))
    warning = None
    if expected.size and nonfinite == expected.size:
        warning = _all_nonfinite(nan_b.any(axis=-1))
    return LeafReport(
        path=path,
        dtype=dtype,
        shape=shape,
        max_abs=float(diff.max(initial=0.0)) * shrink,
        max_rel=float(relative.max(initial=0.0)),
        scale=scale * shrink,
        score=score,
        rel_l2=_relative_l2(diff[judged], magnitude[judged]),
        cosine=_cosine(a_fin[judged], b_fin[judged]),
        mismatched=over,
        tolerance=tolerance,
        nonfinite=nonfinite,
        warning=warning,
        allow_nan=allow_nan,
        ulps=ulps,
        scale_error=None if bias is None else bias[0],
        offset_error=None if bias is None else bias[1],
        bias_usage=None if bias is None else bias[2],
        unmatched_nonfinite=unmatched[0],
        first_unmatched=unmatched[1],
    )


def _past_half_of_float64(*arrays: np.ndarray) -> bool:
    """Whether a finite part of a complex entry is over ``2**1020``, where its magnitude, or a
    difference, may overflow float64.

    >>> _past_half_of_float64(np.array([1.7e308 + 1j]), np.array([1 + 1j]))
    True
    """
    for x in arrays:
        parts = np.abs(np.stack([x.real, x.imag]))
        if bool(np.any(parts[np.isfinite(parts)] > 2.0**1020)):
            return True
    return False


def _first_unmatched(
    differs: np.ndarray, actual: np.ndarray, expected: np.ndarray
) -> tuple[int, str | None]:
    """How many entries are NaN or infinite on one side only (or infinite of the other sign),
    and the first of them as ``"[i, j]: torch nan, JAX 0.5"``: such an entry has no difference
    to measure, so the leaf's ``max_abs`` says nothing of it.

    >>> _first_unmatched(np.array([False, True]), np.array([1.0, np.nan]), np.array([1.0, 2.5]))
    (1, '[1]: torch nan, JAX 2.5')
    """
    found = _first_entry(differs, expected.shape)
    if found is None:
        return 0, None
    first, index = found
    where = f"[{', '.join(map(str, index))}]" if expected.ndim else "the entry"
    torch_value, jax_value = actual.reshape(-1)[first], expected.reshape(-1)[first]
    return int(np.count_nonzero(differs)), f"{where}: torch {torch_value!s}, JAX {jax_value!s}"


def _first_entry(
    flat_mask: np.ndarray, shape: tuple[int, ...]
) -> tuple[int, tuple[int, ...]] | None:
    """The flat position of the first true entry of ``flat_mask`` and its index in an array of
    ``shape``; ``None`` where none is true.

    >>> _first_entry(np.array([False, False, True, True]), (2, 2))
    (2, (1, 0))
    """
    if not flat_mask.any():
        return None
    first = int(np.argmax(flat_mask))
    return first, tuple(int(i) for i in np.unravel_index(first, shape))


def _systematic(a: np.ndarray, b: np.ndarray, max_bias: float) -> tuple[float, float, float] | None:
    """``(s, o, usage)``: the least-squares fit of ``a - b`` as ``s * b + o * rms(b)`` (the
    leaf's scale error and offset, complex ones by magnitude) and the larger of ``|s|`` and
    ``|o|`` over its limit, ``max_bias`` plus ``z = 4 + 8 / dof`` standard errors of the fit
    (``dof``: the entries less the values fitted); ``None`` where nothing can be told (no scale,
    or no entry left over to measure the scatter by).

    The standard errors are measured from the residuals entry by entry (HC3: each weighted by
    its own size and its leverage), not from their pooled variance: rounding errors follow each
    entry's magnitude, so in a leaf of a few large entries among small ones (heavy-tailed
    gradients, sparse ones) the fit rests on those few, and is as uncertain as their errors.

    >>> b = np.linspace(-1.0, 1.0, 64)
    >>> s, o, usage = _systematic(1.02 * b, b, 2**-8)
    >>> round(s, 6), round(o, 6), usage > 1
    (0.02, 0.0, True)
    """
    count = b.size
    rms = _rms(np.abs(b))
    if count < 2 or not (rms > 0.0 and math.isfinite(rms)):
        return None
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x, d = b / rms, (a - b) / rms  # at the leaf's scale: float64 near its limit is safe
        if not np.all(np.isfinite(d)):
            return None  # an overflowed difference: the entry-wise limits fail it already
        columns = np.stack([x, np.ones_like(x)], axis=-1)
        gram = columns.conj().T @ columns
        if abs(np.linalg.det(gram)) <= 1e-9 * gram[0, 0].real * count:
            columns = columns[:, :1]  # one value throughout: a scale and an offset are one error
            gram = gram[:1, :1]
        fitted = columns.shape[1]
        dof = count - fitted
        if dof < 1:
            return None
        inverse = np.linalg.inv(gram)
        coefficients = inverse @ (columns.conj().T @ d)
        residual = d - columns @ coefficients
        leverage = np.sum((columns @ inverse) * columns.conj(), axis=-1).real
        weight = np.abs(residual) ** 2 / np.square(1 - np.minimum(leverage, 1.0))
        meat = (columns.conj().T * weight) @ columns
        errors = np.sqrt(np.abs(np.diag(inverse @ meat @ inverse.conj().T)))
    s = complex(coefficients[0])
    o = complex(coefficients[1]) if fitted == 2 else 0j
    z = 4 + 8 / dof
    usage = 0.0
    for value, error in zip((s, o), errors, strict=False):
        limit = max_bias + z * float(error)
        if value and not math.isnan(limit):  # an entry of leverage 1 tells nothing: inf
            usage = max(usage, abs(value) / limit)
    real = not (np.iscomplexobj(a) or np.iscomplexobj(b))
    return (s.real if real else abs(s)), (o.real if real else abs(o)), usage


def _as_numpy(path: str, x: Any) -> np.ndarray:
    """``x`` as a numpy array; a torch tensor read as :func:`compare` reads torch's leaves
    (``np.asarray`` refuses one that requires grad, a bfloat16 one or a lazy conjugate)."""
    if isinstance(x, torch.Tensor):
        problem = unreadable(x)
        if problem is not None:
            raise DualgraphError(f"{path}: {problem}")
        return to_numpy(x)
    try:
        array = np.asarray(x)
    except Exception as error:  # a deleted JAX array, a typed PRNG key, a tracer, ragged lists
        raise DualgraphError(
            f"{path}: {type(x).__name__} cannot be read as a numpy array to compare "
            f"({type(error).__name__}: {clip_text(error)})"
        ) from error
    # In native byte order: '>f4' and '<f4' are one dtype's values (compared as differing
    # dtypes, both named float32), and the steps between values are counted on the bits.
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _not_fill(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Where the entries of a leaf's finite values ``a`` (torch's) and ``b`` (the reference)
    are judged for its scale, relative L2 error and cosine: all, less a fill value that
    dwarfs the rest by more than ``1 / eps`` of the dtype (a mask's ``-1e9`` or
    ``finfo.min`` beside logits), held exactly alike on both sides. Formats of 8 bits and
    fewer (held to one step each) are judged whole.

    >>> logits = np.array([-1e9, -1e9, 2.5, -0.5])
    >>> _not_fill(logits, logits, np.dtype(np.float32)).tolist()
    [False, False, True, True]
    """
    everything = np.ones(b.shape, bool)
    info = ml_dtypes.finfo(dtype)
    if info.bits <= 8:
        return everything
    magnitude = np.abs(b)
    peak = float(magnitude.max(initial=0.0))
    fill = magnitude == peak
    rest = magnitude[~fill]
    if peak == 0.0 or not rest.size or float(rest.max()) >= peak * float(info.eps):
        return everything
    if not np.array_equal(a[fill], b[fill]):  # a value that differs is no fill: judged with it
        return everything
    return ~fill


def _differing_leaves(
    path: str, actual: np.ndarray, expected: np.ndarray, problem: str | None = None
) -> LeafReport:
    def show(x: np.ndarray) -> str:
        return f"{x.dtype.name}[{', '.join(map(str, x.shape))}]"

    return LeafReport(
        path=path,
        dtype=expected.dtype.name,
        shape=tuple(expected.shape),
        max_abs=float("inf"),
        max_rel=float("inf"),
        scale=0.0,
        score=float("inf"),
        rel_l2=None,
        cosine=None,
        mismatched=int(expected.size),
        tolerance=None,
        problem=problem or f"torch gives {show(actual)} where JAX gives {show(expected)}",
    )


def _compare_exact(path: str, actual: np.ndarray, expected: np.ndarray) -> LeafReport:
    differs = actual != expected  # in the leaves' own dtype: no rounding through float64
    mismatched = int(np.count_nonzero(differs))
    largest = 0
    if mismatched:  # exact, as Python ints: int64 differences can overflow int64
        pairs = zip(actual[differs].tolist(), expected[differs].tolist(), strict=True)
        largest = max(abs(int(x) - int(y)) for x, y in pairs)
    return LeafReport(
        path=path,
        dtype=expected.dtype.name,
        shape=tuple(expected.shape),
        max_abs=largest,
        max_rel=0.0,
        scale=0.0,
        score=float("inf") if mismatched else 0.0,
        rel_l2=None,
        cosine=None,
        mismatched=mismatched,
        tolerance=None,
    )


def first_difference(a: np.ndarray, b: np.ndarray) -> tuple[tuple[int, ...], str, str] | None:
    """``(index, a's value, b's value)`` at the first entry where two arrays of one dtype and
    shape differ in value (NaN matching NaN, ``-0.0`` matching ``0.0``); ``None`` if none does.

    >>> a = np.array([[1.0, np.nan], [2.0, 3.0]])
    >>> first_difference(a, np.array([[1.0, np.nan], [2.0, 4.0]]))
    ((1, 1), '3.0', '4.0')
    """
    if np.array_equal(a, b):  # the usual case, settled in the arrays' own dtype
        return None
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if is_differentiable_dtype(a.dtype.name):  # NaN, or a difference to locate: widened
        parts_a, parts_b = parts(_widened(a)), parts(_widened(b))
        same = (parts_a == parts_b) | (np.isnan(parts_a) & np.isnan(parts_b))
        differing = ~same.all(axis=-1)
    else:
        differing = flat_a != flat_b
    found = _first_entry(differing, a.shape)
    if found is None:
        return None
    first, index = found
    return index, str(flat_a[first]), str(flat_b[first])


def _widened(x: np.ndarray) -> np.ndarray:
    """``x`` in a dtype that holds its values and their differences without rounding them away,
    flat (the positions found by the non-finite checks index its entries)."""
    if x.dtype.kind == "c":
        wide = np.promote_types(x.dtype, np.complex128)
    elif x.dtype.kind == "f":
        wide = np.promote_types(x.dtype, np.float64)
    else:  # bfloat16, float8 and the other ml_dtypes floats
        wide = np.dtype(np.float64)
    return x.astype(wide).reshape(-1)


def _ulps_apart(path: str, actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """How many representable values apart each entry's parts are (as :func:`parts` lays them
    out, flat); meaningful where both are finite. ``0.0`` and ``-0.0`` are one value."""
    if expected.dtype.kind == "c":
        a, b = actual.reshape(-1), expected.reshape(-1)
        return np.stack(
            [_real_ulps_apart(path, a.real, b.real), _real_ulps_apart(path, a.imag, b.imag)],
            axis=-1,
        )
    return _real_ulps_apart(path, actual.reshape(-1), expected.reshape(-1))[:, np.newaxis]


def _real_ulps_apart(path: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Steps between the values of two arrays of one IEEE-like format, by their bits: sign
    and magnitude, so the magnitudes of two same-signed floats differ by the steps between
    them and, across zero, the steps are the sum of both magnitudes."""
    bits = UNSIGNED_OF_SIZE.get(a.dtype.itemsize)
    if bits is None:  # long double: an x87 or double-double layout in 16 bytes
        raise DualgraphError(
            f"{path}: max_ulps cannot be applied to {a.dtype.name}, whose values are not "
            "ordered by an IEEE bit layout; pass a Tolerance without max_ulps for it"
        )
    info = ml_dtypes.finfo(a.dtype)
    if info.bits < 8 * a.dtype.itemsize:  # float6, float4 in a byte: the bits above theirs
        a, b = (x.astype(np.float32).astype(x.dtype) for x in (a, b))  # may be set: zeroed
    unsigned = float(info.min) > 0  # float8_e8m0fnu: every bit is the exponent's
    sign = np.uint64(0 if unsigned else 1 << (info.bits - 1))
    x = a.view(bits).astype(np.uint64)
    y = b.view(bits).astype(np.uint64)
    mag_x, mag_y = x & ~sign, y & ~sign
    same_sign = (x & sign) == (y & sign)
    apart = np.where(mag_x > mag_y, mag_x - mag_y, mag_y - mag_x)
    return np.where(same_sign, apart, mag_x + mag_y)


def parts(x: np.ndarray) -> np.ndarray:
    """``x`` with a last axis of its parts: the value itself, or a complex's real and imaginary
    (NaN and infinities are told part by part).

    >>> parts(np.array([1 + 2j, np.nan])).tolist(), parts(np.array([0.5])).tolist()
    ([[1.0, 2.0], [nan, 0.0]], [[0.5]])
    """
    if x.dtype.kind == "c":
        return np.stack([x.real, x.imag], axis=-1)
    return x[..., np.newaxis]


def _rms(magnitude: np.ndarray) -> float:
    """The root mean square of non-negative values, without overflowing on huge ones."""
    peak, norm = _scaled_norm(magnitude)
    return peak * (norm / float(np.sqrt(magnitude.size))) if magnitude.size else 0.0


def _scaled_norm(magnitude: np.ndarray) -> tuple[float, float]:
    """``(peak, n)`` with ``peak * n`` the L2 norm of non-negative values (never multiplied out
    here: for float64 values near its limit the product overflows)."""
    peak = float(magnitude.max(initial=0.0))
    if peak == 0.0 or not np.isfinite(peak):
        return peak, 1.0
    return peak, float(np.sqrt(np.sum(np.square(magnitude / peak))))


def _relative_l2(diff: np.ndarray, magnitude: np.ndarray) -> float:
    """``||torch - jax|| / ||jax||``: 0 when both are zero, ``inf`` when only the reference is."""
    (error_peak, error), (size_peak, size) = _scaled_norm(diff), _scaled_norm(magnitude)
    if error_peak == 0.0:
        return 0.0
    if size_peak == 0.0:
        return float("inf")
    with np.errstate(over="ignore"):
        return float(np.float64(error_peak) / size_peak * (error / size))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """``Re<a, b> / (|a| |b|)``: 1 when both are zero, 0 when only one is.

    Computed as ``1 - |a / |a| - b / |b||**2 / 2`` (the same value; near -1 from the sum),
    which is exactly 1 for equal leaves and keeps its digits near 1: the quotient of a dot
    product by the norms' product rounds either way, and read a quarter of equal leaves as
    below a ``min_cosine`` of 1.

    >>> x = np.array([0.1, 0.7, -2.3])
    >>> _cosine(x, x.copy()), _cosine(-x, x)
    (1.0, -1.0)
    """
    peak_a = float(np.abs(a).max(initial=0.0))
    peak_b = float(np.abs(b).max(initial=0.0))
    if peak_a == 0.0 or peak_b == 0.0:
        return 1.0 if peak_a == peak_b else 0.0
    a, b = a / peak_a, b / peak_b
    unit_a = a / float(np.linalg.norm(a))
    unit_b = b / float(np.linalg.norm(b))
    apart = float(np.linalg.norm(unit_a - unit_b))
    if apart > 1.0:  # nearer -1: from the sum, which keeps the digits there
        return max(-1.0, min(1.0, float(np.linalg.norm(unit_a + unit_b)) ** 2 / 2 - 1.0))
    return max(-1.0, min(1.0, 1.0 - apart**2 / 2))


def _all_nonfinite(nan: np.ndarray) -> str:
    if nan.all():
        return "NaN everywhere on both sides: no value compared"
    return "no finite value on either side (NaN and infinities only): no value compared"
