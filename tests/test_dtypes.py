"""Framework-neutral dtype names and which of them carry gradients."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from trees import ml_dtypes

import dualgraph
from dualgraph import DIFFERENTIABLE_DTYPES, DTYPE_NAMES, is_differentiable_dtype
from dualgraph._dtypes import is_dtype_name, numpy_dtype

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
    for name in DIFFERENTIABLE_DTYPES - {"float128", "complex256", "complex32"}:
        assert np.dtype(getattr(ml_dtypes, name, None) or name).name == name


@pytest.mark.parametrize("name", ["", "Float32", "torch.float32", "half", "object"])
def test_unknown_and_framework_spellings_are_not_differentiable(name: str) -> None:
    assert not is_differentiable_dtype(name)


def test_dtype_names_are_exported() -> None:
    assert dualgraph.DIFFERENTIABLE_DTYPES is DIFFERENTIABLE_DTYPES
    assert dualgraph.is_differentiable_dtype is is_differentiable_dtype


def test_every_differentiable_dtype_is_in_the_vocabulary() -> None:
    assert DIFFERENTIABLE_DTYPES < DTYPE_NAMES
    assert {"bool", "int8", "uint64", "int4", "qint8"} < DTYPE_NAMES


@pytest.mark.parametrize("name", ["float32", "bool", "int4", "key<fry>", "key<unsafe_rbg>"])
def test_spec_dtype_names(name: str) -> None:
    assert is_dtype_name(name)


@pytest.mark.parametrize(
    "name",
    [
        *["O", "object", "<f4", "f4", "S100000000000", "str96", "datetime64[ns]", "i4,i4"],
        *["(2,)f4", "", "Float32", "key<>", "key<" + "a" * 40 + ">", "key<FRY>", 3, None, b"x"],
    ],
    ids=repr,
)
def test_other_names_are_not_spec_dtypes(name: object) -> None:
    assert not is_dtype_name(name)


def test_numpy_dtype_only_for_vocabulary_names_numpy_spells_the_same() -> None:
    assert numpy_dtype("float32") == np.dtype("float32")
    assert numpy_dtype("qint8") is None  # torch's
    assert numpy_dtype("key<fry>") is None
    assert numpy_dtype("O") is None  # numpy would read it: it never gets the chance
    assert numpy_dtype("<f4") is None


@pytest.mark.parametrize("dtype", ["object", "U3", "S2", "datetime64[ns]", "V4", "i4,f4"])
def test_numpy_arrays_of_other_dtypes_are_unsupported_leaves(dtype: str) -> None:
    with pytest.raises(dualgraph.UnsupportedLeafError, match=r"^\[0\]: dtype '.*' is not one"):
        dualgraph.describe((np.zeros(2, dtype),))


def test_the_vocabulary_is_exported() -> None:
    assert dualgraph.DTYPE_NAMES is DTYPE_NAMES


@pytest.mark.parametrize("name", [["float32"], {}, None, b"float32", 3], ids=repr)
def test_what_is_no_dtype_name_is_not_differentiable(name: Any) -> None:
    # Before: an unhashable argument leaked TypeError ("unhashable type: 'list'")
    assert is_differentiable_dtype(name) is False
