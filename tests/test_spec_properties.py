"""Properties of TreeSpec over random trees: round trips, JSON, and check against mutations."""

from __future__ import annotations

import collections
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import TREES, EncoderOutput, assert_same_tree, leaves_of, ml_dtypes, replace_leaves

from dualgraph import SpecMismatchError, TreeSpec, describe
from dualgraph._spec import _shown_by_parts

REPO = Path(__file__).resolve().parents[1]

DTYPES = ["float32", "float16", "float64", "complex64", "int64", "int32", "bool"]
if ml_dtypes is not None:
    DTYPES.append("bfloat16")


class Pair(NamedTuple):
    first: Any
    second: Any


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    values = np.asarray(np.random.default_rng(seed).standard_normal(shape))
    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


# NaNs of other signs and payloads too: a constant comes back with its bits.
def nan_of(negative: bool, payload: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", negative << 63 | 0x7FF << 52 | payload))[0]
    return value


nans = st.builds(nan_of, st.booleans(), st.integers(1, 2**52 - 1))
# Lone surrogates (JSON escapes them and reads them back), ints at the bit limit and past
# float precision, look-alike keys ("1" and 1, -1 and -2, which share a hash).
odd_texts = st.sampled_from(
    ["\ud800", "\udfff", "a\udc00", "\U0001f600", "\x00", "1", "", "x" * 5000]
)
big_ints = st.sampled_from([2**2048 - 1, -(2**2048) + 1, 2**53 + 1, -(2**63), 2**61 - 1])
constants = st.one_of(
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(),
    nans,
    st.text(max_size=6),
    odd_texts,
    big_ints,
)
keys = st.one_of(st.text(max_size=4), st.integers(-3, 3), odd_texts, big_ints)


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4).map(tuple),
        st.lists(children, max_size=4),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=3).map(collections.OrderedDict),
        st.builds(Pair, children, children),
        st.builds(EncoderOutput, children, children, children),
    )


trees = st.recursive(st.one_of(st.none(), constants, arrays()), containers, max_leaves=12)

properties = settings(max_examples=100, deadline=None)


def with_fresh_values(tree: Any) -> Any:
    """The same structure with new array values and new (equal) float constant objects."""

    def fresh(_: int, leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            return np.ones_like(leaf)
        if type(leaf) is float:  # a new object of the same bits (a NaN keeps sign and payload)
            value: float = struct.unpack("<d", struct.pack("<d", leaf))[0]
            return value
        return leaf

    return replace_leaves(tree, fresh)


def replace_leaf(tree: Any, index: int, replacement: Any) -> Any:
    return replace_leaves(tree, lambda i, leaf: replacement if i == index else leaf)


def other_dtype(name: str) -> str:
    return next(d for d in DTYPES if d != name and d != "bfloat16")


def mutations(leaf: Any) -> list[Any]:
    """Replacements for ``leaf`` that a spec of the original tree must reject."""
    if leaf is None:
        return [np.zeros(1, "float32"), 0, ""]
    if isinstance(leaf, np.ndarray):
        return [
            np.zeros((*leaf.shape, 1), leaf.dtype),
            np.zeros(leaf.shape, other_dtype(leaf.dtype.name)),
            None,
            0,
        ]
    if type(leaf) is bool:
        changed: list[Any] = [not leaf, int(leaf)]
    elif type(leaf) is int:
        changed = [leaf + 1, leaf > 0, *([float(leaf)] if leaf.bit_length() < 1024 else [])]
    elif type(leaf) is float:
        changed = [1.5 if leaf == 0.5 else 0.5, repr(leaf), -leaf]  # -leaf: -0.0, -nan
    else:
        changed = [leaf + "!"]
    return [*changed, None, np.zeros(1, "float32")]


@properties
@given(trees)
def test_unflatten_of_flatten_rebuilds_any_tree(tree: Any) -> None:
    spec = describe(tree)
    assert_same_tree(spec.unflatten(spec.flatten(tree, check=True)), tree)


@properties
@given(trees)
def test_json_round_trip_gives_an_equal_spec_and_identical_json(tree: Any) -> None:
    spec = describe(tree)
    loaded = TreeSpec.from_json(spec.to_json())
    assert loaded == spec
    assert loaded.to_json() == spec.to_json()
    # and one that works as the spec does: the same hash, leaves and paths, and the same tree
    # rebuilt (constants by type and bits, dict keys by type, in the same order)
    assert hash(loaded) == hash(spec) and {spec: 1}[loaded] == 1
    assert loaded.leaves == spec.leaves and loaded.paths == spec.paths
    assert_same_tree(loaded.unflatten(spec.flatten(tree)), tree)
    loaded.check(tree)


@properties
@given(trees)
def test_repr_is_each_container_shown_around_its_childrens_text(tree: Any) -> None:
    spec = describe(tree)
    assert repr(spec) == f"TreeSpec({_shown_by_parts(spec._nodes)})"


@properties
@given(trees)
def test_paths_align_with_the_leaves_of_any_tree(tree: Any) -> None:
    spec = describe(tree)
    assert len(spec.paths) == len(leaves_of(tree)) == len(set(spec.paths))


@properties
@given(trees)
def test_check_accepts_the_same_structure_with_fresh_values(tree: Any) -> None:
    describe(tree).check(with_fresh_values(tree))


@settings(max_examples=80, deadline=None)
@given(trees)
def test_check_rejects_every_single_leaf_mutation_naming_its_path(tree: Any) -> None:
    spec = describe(tree)
    for index, leaf in enumerate(leaves_of(tree)):
        for replacement in mutations(leaf):
            mutated = replace_leaf(tree, index, replacement)
            with pytest.raises(SpecMismatchError) as caught:
                spec.check(mutated)
            assert caught.value.path == spec.paths[index], f"{leaf!r} -> {replacement!r}"


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_json_is_identical_in_a_fresh_process(hash_seed: str) -> None:
    script = textwrap.dedent(
        """
        import json
        import dualgraph
        from trees import TREES

        specs = {name: dualgraph.describe(build()) for name, build in TREES.items()}
        print(json.dumps({name: spec.to_json() for name, spec in specs.items()}))
        """
    )
    env = {
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
        "PYTHONHASHSEED": hash_seed,
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    here = {name: describe(build()).to_json() for name, build in TREES.items()}
    assert json.loads(result.stdout) == here


@properties
@given(trees, st.integers(60, 400))
def test_what_to_json_writes_from_json_reads_under_any_size_limit(tree: Any, limit: int) -> None:
    # to_json wrote documents over the limit that from_json then refused
    from unittest import mock

    from dualgraph import DualgraphError
    from dualgraph import _json as json_module

    spec = describe(tree)
    with mock.patch.object(json_module, "MAX_JSON_CHARS", limit):
        try:
            text = spec.to_json()
        except DualgraphError as error:
            assert f"over the limit of {limit}" in str(error)
            return
        assert TreeSpec.from_json(text) == spec


class _Int(int):
    pass


class _IndexOf:
    """A dimension whose ``__index__`` gives ``value``, whatever its type."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __index__(self) -> Any:
        return self.value


class _Signed:
    """An array of a registered type whose signature gives ``dims`` as they are."""

    def __init__(self, dims: tuple[Any, ...]) -> None:
        self.dims = dims


dimensions = st.one_of(
    st.integers(0, 5),
    st.integers(0, 5).map(np.int64),
    st.integers(0, 5).map(_Int),
    st.booleans(),
    st.floats(0, 5),
)
signature_dims = st.lists(dimensions | dimensions.map(_IndexOf), max_size=3).map(tuple)


@properties
@given(signature_dims)
def test_a_shape_any_signature_gives_is_refused_or_written_and_read_back_as_exact_ints(
    dims: tuple[Any, ...],
) -> None:
    # Before: an __index__ giving True or 2.0 (or an int subclass) stayed in the shape: the
    # spec's JSON held [true] or [2.0], which from_json refused
    from dualgraph import DualgraphError, register_array_type
    from dualgraph import _leaves as leaves_module

    registered = dict(leaves_module._REGISTERED)
    register_array_type(
        _Signed, signature=lambda x: (x.dims, "float32"), requires_grad=lambda x: True
    )
    try:
        try:
            spec = describe((_Signed(dims),))
        except DualgraphError:
            return
        (shape,) = [leaf.shape for leaf in spec.arrays]
        assert shape is not None and all(type(dim) is int for dim in shape)
        assert TreeSpec.from_json(spec.to_json()) == spec
    finally:
        leaves_module._REGISTERED.clear()
        leaves_module._REGISTERED.update(registered)
        leaves_module._RESOLVED.clear()
