"""Framework-neutral dtype names and which of them can carry gradients."""

from __future__ import annotations

__all__ = ["DIFFERENTIABLE_DTYPES", "is_differentiable_dtype"]

#: Dtype names (numpy / ml_dtypes spelling) whose arrays take part in backward by default.
DIFFERENTIABLE_DTYPES: frozenset[str] = frozenset(
    {
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float128",  # numpy's long double on most 64-bit platforms
        "complex64",
        "complex128",
        "complex256",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e8m0fnu",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "float4_e2m1fn",
    }
)


def is_differentiable_dtype(name: str) -> bool:
    """Whether arrays of dtype ``name`` are differentiable (floating or complex).

    >>> is_differentiable_dtype("bfloat16"), is_differentiable_dtype("int64")
    (True, False)
    """
    return name in DIFFERENTIABLE_DTYPES
