"""Torch tensors as spec leaves: neutral dtype names, signatures, and the grad flag.

A spec written from torch tensors must read the same as one written from numpy (or JAX) arrays,
so the dtype names are numpy's (``ml_dtypes``' for bfloat16 and float8), never ``torch.*``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dualgraph
from dualgraph.torch._leaves import dtype_name, tensor_signature

NUMPY_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_dtype_names_are_numpy_names(dtype: torch.dtype) -> None:
    assert dtype_name(dtype) == torch.empty(0, dtype=dtype).numpy().dtype.name


@pytest.mark.parametrize("name", ML_DTYPES)
def test_bfloat16_and_float8_names_are_ml_dtypes_names(name: str) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtype_name(getattr(torch, name)) == np.dtype(getattr(ml_dtypes, name)).name == name


def test_dtype_aliases_have_the_canonical_name() -> None:
    aliases = [torch.half, torch.float, torch.double, torch.long, torch.int, torch.cfloat]
    assert [dtype_name(d) for d in aliases] == [
        "float16",
        "float32",
        "float64",
        "int64",
        "int32",
        "complex64",
    ]


@pytest.mark.parametrize("dtype", [*NUMPY_DTYPES, torch.bfloat16], ids=str)
def test_floating_and_complex_names_are_the_differentiable_ones(dtype: torch.dtype) -> None:
    differentiable = dtype.is_floating_point or dtype.is_complex
    assert dualgraph.is_differentiable_dtype(dtype_name(dtype)) == differentiable


def test_tensor_signature_is_shape_and_dtype_name() -> None:
    assert tensor_signature(torch.zeros(2, 3, dtype=torch.bfloat16)) == ((2, 3), "bfloat16")
    assert tensor_signature(torch.tensor(1)) == ((), "int64")


def test_the_grad_flag_of_a_tensor_is_its_requires_grad() -> None:
    tree = (torch.zeros(2, requires_grad=True), torch.zeros(2), torch.arange(3), None)
    assert dualgraph.describe(tree).grad_mask == (True, False, False)


def test_parameters_and_tensor_subclasses_are_array_leaves() -> None:
    class Tagged(torch.Tensor):
        pass

    tagged = torch.zeros(3).as_subclass(Tagged)
    spec = dualgraph.describe((nn.Parameter(torch.zeros(2, 2)), tagged))
    assert repr(spec) == "TreeSpec((float32[2, 2](grad), float32[3]))"


def test_a_torch_spec_equals_the_numpy_spec_of_the_same_tree() -> None:
    from_torch = dualgraph.describe(
        {"hidden": torch.zeros(2, 4, requires_grad=True), "ids": torch.zeros(2, dtype=torch.int64)}
    )
    from_numpy = dualgraph.describe(
        {"hidden": np.zeros((2, 4), np.float32), "ids": np.zeros(2, np.int64)}
    )
    assert from_torch == from_numpy
    assert from_torch.to_json() == from_numpy.to_json()
    assert "torch" not in from_torch.to_json()


def test_the_core_registers_torch_on_first_sight_of_a_tensor() -> None:
    code = (
        "import sys, torch, dualgraph\n"
        "assert 'dualgraph.torch' not in sys.modules\n"
        "print(dualgraph.describe(torch.zeros(2, 3, requires_grad=True)))\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert result.stdout.strip() == "TreeSpec(float32[2, 3](grad))"


def _generator_input(x: torch.Tensor, extra: object) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize(
    ("extra", "path"),
    [(torch.Generator(), "args[1]"), ({"gen": [torch.Generator()]}, "args[1]['gen'][0]")],
    ids=["argument", "nested"],
)
def test_a_generator_input_is_refused_naming_its_path_and_why(extra: object, path: str) -> None:
    # The old message advised register_dataclass, which no registration could make sound.
    sample = (torch.randn(3, requires_grad=True), extra)
    with pytest.raises(dualgraph.UnsupportedLeafError) as info:
        dualgraph.torch.make_graphed_callables(_generator_input, sample, backend="emulate")
    message = str(info.value)
    assert info.value.path == path
    assert message.startswith(f"{path}: unsupported leaf of type torch._C.Generator. ")
    assert "default CUDA generator" in message and "eagerly" in message
    assert "register_dataclass" not in message


def test_a_generator_output_is_refused_naming_its_path_and_why() -> None:
    generator = torch.Generator()

    def returns_its_generator(x: torch.Tensor) -> tuple[torch.Tensor, torch.Generator]:
        return x * 2, generator

    sample = (torch.randn(3, requires_grad=True),)
    with pytest.raises(dualgraph.DualgraphError) as info:
        dualgraph.torch.make_graphed_callables(returns_its_generator, sample, backend="emulate")
    message = str(info.value)
    assert "output[1]: unsupported leaf of type torch._C.Generator. " in message
    assert "default CUDA generator" in message and "register_dataclass" not in message
