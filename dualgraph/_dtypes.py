"""Framework-neutral dtype names: which a spec accepts, and which can carry gradients.

A spec names an array's dtype by a word from a closed vocabulary (numpy / ml_dtypes / torch
spelling: ``"float32"``, ``"bfloat16"``, ``"int64"``...), plus JAX's typed PRNG keys
(``"key<fry>"``). Names are only ever compared: the core never hands a name read from a file to
numpy's dtype parser, which reads strings such as ``"O"`` or ``"S100000000000"`` as dtypes.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = [
    "DIFFERENTIABLE_DTYPES",
    "DTYPE_NAMES",
    "is_differentiable_dtype",
    "is_dtype_name",
    "numpy_dtype",
]

#: Dtype names (numpy / ml_dtypes spelling) whose arrays take part in backward by default.
DIFFERENTIABLE_DTYPES: frozenset[str] = frozenset(
    {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float128",  # numpy's long double on most 64-bit platforms
        "complex32",  # torch's chalf
        "complex64",
        "complex128",
        "complex256",
        "bcomplex32",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e5m3fnu",
        "float8_e8m0fnu",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "float4_e2m1fn",
    }
)

_INTEGER_DTYPES = {
    *(f"int{bits}" for bits in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
    *(f"uint{bits}" for bits in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
}
# torch's quantized and bit-container dtypes, named as torch prints them.
_TORCH_ONLY_DTYPES = {
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    "float4_e2m1fn_x2",
}

#: Every dtype name a spec accepts, besides JAX key dtypes (``key<impl>``).
DTYPE_NAMES: frozenset[str] = frozenset(
    {"bool", *_INTEGER_DTYPES, *DIFFERENTIABLE_DTYPES, *_TORCH_ONLY_DTYPES}
)

_KEY_DTYPE = re.compile(r"key<[a-z0-9_]{1,32}>")
_NUMPY_DTYPES: dict[str, np.dtype] = {}


def is_differentiable_dtype(name: str) -> bool:
    """Whether arrays of dtype ``name`` are differentiable (floating or complex).

    >>> is_differentiable_dtype("bfloat16"), is_differentiable_dtype("int64")
    (True, False)
    """
    # (a name of another type is none: an unhashable one would leak TypeError from the lookup)
    return type(name) is str and name in DIFFERENTIABLE_DTYPES


def is_dtype_name(name: object, /) -> bool:
    """Whether ``name`` is a dtype name a spec accepts.

    >>> is_dtype_name("float32"), is_dtype_name("key<fry>"), is_dtype_name("O"), is_dtype_name(3)
    (True, True, False, False)
    """
    if type(name) is not str:
        return False
    return name in DTYPE_NAMES or (len(name) <= 40 and _KEY_DTYPE.fullmatch(name) is not None)


def numpy_dtype(name: str, /) -> np.dtype | None:
    """The numpy dtype whose ``.name`` is exactly ``name``, if numpy (or ml_dtypes) has it.

    Only names of the vocabulary reach numpy, and only a dtype that names itself ``name`` is
    returned, so that ``numpy_dtype(x.dtype.name) == x.dtype`` compares like the names do.

    >>> numpy_dtype("float32"), numpy_dtype("qint8"), numpy_dtype("O")
    (dtype('float32'), None, None)
    """
    found = _NUMPY_DTYPES.get(name)
    if found is None and name in DTYPE_NAMES:
        try:
            found = np.dtype(name)
        except (TypeError, ValueError):  # not numpy's (or ml_dtypes is not imported yet)
            return None
        if found.name != name:
            return None
        _NUMPY_DTYPES[name] = found
    return found
