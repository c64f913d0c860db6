"""dualgraph.jax._leaves: JAX arrays, tracers and ShapeDtypeStructs as leaves of a spec."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optree
import pytest
from trees import TREES

import dualgraph
from dualgraph import describe
from dualgraph.jax._leaves import jax_signature

DTYPES = ["float32", "bfloat16", "float16", "complex64", "int32", "int8", "uint8", "bool"]


def as_jax(tree: Any) -> Any:
    return optree.tree_map(
        lambda leaf: jnp.asarray(leaf) if isinstance(leaf, np.ndarray) else leaf,
        tree,
        none_is_leaf=True,
        namespace="dualgraph",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_array_is_described_by_shape_and_neutral_dtype_name(dtype: str) -> None:
    leaf = describe(jnp.zeros((2, 3), dtype)).leaves[0]
    assert (leaf.kind, leaf.shape, leaf.dtype) == ("array", (2, 3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_floating_and_complex_arrays_take_part_in_backward(dtype: str) -> None:
    expected = dtype.startswith(("float", "bfloat", "complex"))
    assert describe(jnp.zeros(2, dtype)).grad_mask == (expected,)


@pytest.mark.parametrize("name", ["vit_layer", "encoder_dict", "nested_namedtuple", "deep"])
def test_a_jax_tree_has_the_json_of_the_same_numpy_tree(name: str) -> None:
    tree = TREES[name]()
    assert describe(as_jax(tree)).to_json() == describe(tree).to_json()


def test_a_shape_dtype_struct_is_described_like_the_array() -> None:
    struct = jax.ShapeDtypeStruct((4, 2), jnp.bfloat16)
    assert describe((struct, None)) == describe((jnp.zeros((4, 2), jnp.bfloat16), None))


@pytest.mark.parametrize("transform", [jax.jit, jax.grad, jax.vmap], ids=["jit", "grad", "vmap"])
def test_tracers_are_described_like_the_arrays_they_stand_for(transform: Any) -> None:
    seen = []

    def fn(x: jax.Array) -> jax.Array:
        seen.append(describe({"x": x, "none": None}))
        return (x * 2).sum()

    x = jnp.ones(3)
    transform(fn)(x)
    shape = () if transform is jax.vmap else (3,)
    assert seen[0] == describe({"x": jnp.ones(shape), "none": None})


def test_signature_reads_shape_and_dtype() -> None:
    assert jax_signature(jnp.zeros((0, 5), jnp.int8)) == ((0, 5), "int8")


def test_check_accepts_jax_arrays_against_a_numpy_spec_and_names_a_mismatch() -> None:
    spec = describe({"mask": np.zeros((2, 8), np.float32)})
    spec.check({"mask": jnp.zeros((2, 8))})
    with pytest.raises(dualgraph.SpecMismatchError, match=r"args\['mask'\].*bfloat16\[2, 8\]"):
        spec.check({"mask": jnp.zeros((2, 8), jnp.bfloat16)}, root="args")


def test_the_core_registers_jax_lazily_on_the_first_jax_leaf() -> None:
    code = (
        "import sys, dualgraph, jax.numpy as jnp\n"
        "before = 'dualgraph.jax._leaves' in sys.modules\n"
        "spec = dualgraph.describe(jnp.ones(2))\n"
        "print(before, 'dualgraph.jax._leaves' in sys.modules, spec)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "TreeSpec(float32[2](grad))"]
