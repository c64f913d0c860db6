"""Framework-neutral dtype names and which of them carry gradients."""

from __future__ import annotations

import numpy as np
import pytest
from trees import ml_dtypes

import dualgraph
from dualgraph import DIFFERENTIABLE_DTYPES, is_differentiable_dtype

FLOATING_AND_COMPLEX = [np.float16, np.float32, np.float64, np.longdouble]
FLOATING_AND_COMPLEX += [np.complex64, np.complex128, np.clongdouble]
NOT_DIFFERENTIABLE = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint64]


@pytest.mark.parametrize("dtype", FLOATING_AND_COMPLEX, ids=lambda d: np.dtype(d).name)
def test_numpy_floating_and_complex_dtypes_are_differentiable(dtype: type) -> None:
    assert is_differentiable_dtype(np.dtype(dtype).name)


@pytest.mark.parametrize("dtype", NOT_DIFFERENTIABLE, ids=lambda d: np.dtype(d).name)
def test_integer_and_bool_dtypes_are_not_differentiable(dtype: type) -> None:
    assert not is_differentiable_dtype(np.dtype(dtype).name)


@pytest.mark.parametrize(
    "name", ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"]
)
def test_low_precision_floats_are_differentiable(name: str) -> None:
    assert is_differentiable_dtype(name)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_neutral_names_are_numpy_and_ml_dtypes_spellings() -> None:
    for name in DIFFERENTIABLE_DTYPES - {"float128", "complex256"}:
        assert np.dtype(getattr(ml_dtypes, name, None) or name).name == name


@pytest.mark.parametrize("name", ["", "Float32", "torch.float32", "half", "object"])
def test_unknown_and_framework_spellings_are_not_differentiable(name: str) -> None:
    assert not is_differentiable_dtype(name)


def test_dtype_names_are_exported() -> None:
    assert dualgraph.DIFFERENTIABLE_DTYPES is DIFFERENTIABLE_DTYPES
    assert dualgraph.is_differentiable_dtype is is_differentiable_dtype
