"""TreeSpec: describe, flatten, unflatten, check, grad mask, JSON, equality, repr and pickling."""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import itertools
import json
import pickle
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from trees import (
    GRAD_DTYPES,
    TREES,
    Attention,
    EncoderOutput,
    array,
    assert_same_tree,
    float_bits,
    leaf_at,
    leaves_of,
)

import dualgraph
from dualgraph import (
    DualgraphError,
    LeafSpec,
    SpecMismatchError,
    TreeSpec,
    UnsupportedLeafError,
    describe,
)
from dualgraph import _spec as spec_module
from dualgraph._nodes import NONE, Node

NAMES = list(TREES)


def mismatch(expected_tree: Any, found_tree: Any, *, root: str = "") -> SpecMismatchError:
    """The error ``check`` raises for ``found_tree`` against the spec of ``expected_tree``."""
    with pytest.raises(SpecMismatchError) as caught:
        describe(expected_tree).check(found_tree, root=root)
    return caught.value


# -- describe --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_spec_has_one_leaf_per_leaf_of_the_tree_in_optree_order(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    kinds = [
        "none" if leaf is None else "array" if isinstance(leaf, np.ndarray) else "const"
        for leaf in leaves_of(tree)
    ]
    assert [leaf.kind for leaf in spec.leaves] == kinds


@pytest.mark.parametrize("name", NAMES)
def test_every_path_addresses_its_leaf_in_the_tree(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    for path, leaf in zip(spec.paths, leaves_of(tree), strict=True):
        assert leaf_at(tree, path) is leaf


@pytest.mark.parametrize("name", NAMES)
def test_paths_are_unique(name: str) -> None:
    paths = describe(TREES[name]()).paths
    assert len(set(paths)) == len(paths)


@pytest.mark.parametrize("name", NAMES)
def test_array_leaves_record_shape_dtype_and_grad(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    for leaf in spec.arrays:
        found = leaf_at(tree, leaf.path)
        assert (leaf.shape, leaf.dtype) == (found.shape, found.dtype.name)
        assert leaf.grad is (found.dtype.name in GRAD_DTYPES)


@pytest.mark.parametrize("name", NAMES)
def test_constant_leaves_keep_type_and_value(name: str) -> None:
    tree = TREES[name]()
    for leaf in describe(tree).leaves:
        if leaf.kind == "const":
            found = leaf_at(tree, leaf.path)
            assert type(leaf.value) is type(found)
            assert repr(leaf.value) == repr(found)


def test_paths_name_indices_keys_and_fields() -> None:
    tree = {"layers": [(array(2), None)], "out": Attention(weights=array(2), bias=None), 3: 1}
    assert describe(tree).paths == (
        "[3]",
        "['layers'][0][0]",
        "['layers'][0][1]",
        "['out'].weights",
        "['out'].bias",
    )


def test_root_leaf_has_the_empty_path() -> None:
    assert describe(array(2)).paths == ("",)
    assert describe(None).paths == ("",)
    assert describe("vit").paths == ("",)


def test_empty_containers_have_no_leaves() -> None:
    spec = describe(TREES["empty_containers"]())
    assert spec.leaves == ()
    assert spec.flatten(TREES["empty_containers"]()) == []


def test_none_position_is_part_of_the_structure() -> None:
    x = array(2)
    assert describe((x, None)) != describe((None, x))


def test_arrays_lists_only_array_leaves_aligned_with_array_paths() -> None:
    spec = describe(TREES["encoder_dict"]())
    assert [leaf.path for leaf in spec.arrays] == list(spec.array_paths)
    assert spec.array_paths == ("['hidden']", "['pooled']")
    assert spec.num_arrays == 2


@pytest.mark.parametrize(
    ("leaf", "type_name"),
    [({1, 2}, "builtins.set"), (lambda: 0, "builtins.function"), (object(), "builtins.object")],
    ids=["set", "lambda", "object"],
)
def test_unsupported_leaf_error_names_path_type_and_how_to_register(
    leaf: Any, type_name: str
) -> None:
    with pytest.raises(UnsupportedLeafError) as caught:
        describe({"outputs": [array(2), leaf]})
    message = str(caught.value)
    assert caught.value.path == "['outputs'][1]"
    assert message.startswith(f"['outputs'][1]: unsupported leaf of type {type_name}.")
    assert "dualgraph.register_dataclass(cls)" in message
    assert "dualgraph.register_array_type(" in message


def test_unsupported_root_leaf_is_named_root() -> None:
    with pytest.raises(UnsupportedLeafError, match=r"^<root>: unsupported leaf of type builtins\."):
        describe(object())


def test_unregistered_dataclass_is_an_unsupported_leaf() -> None:
    @dataclasses.dataclass
    class Unregistered:
        x: Any

    with pytest.raises(
        UnsupportedLeafError, match=r"^\[0\]: .*\.Unregistered\. .*register_dataclass"
    ):
        describe((Unregistered(1),))


def test_dict_subclass_is_an_unsupported_leaf() -> None:
    with pytest.raises(UnsupportedLeafError, match=r"^<root>: .* collections\.defaultdict"):
        describe(collections.defaultdict(list))
    with pytest.raises(UnsupportedLeafError, match=r"^\['a'\]\[1\]: .* collections\.defaultdict"):
        describe({"a": [1, collections.defaultdict(list)]})


@pytest.mark.parametrize("key", [(1, 2), 1.5, True, None], ids=repr)
def test_dict_key_that_is_not_str_or_int_is_unsupported(key: Any) -> None:
    with pytest.raises(UnsupportedLeafError) as caught:
        describe({"out": {key: array(2)}})
    assert caught.value.path == "['out']"
    assert f"dict key {key!r} of type {type(key).__name__} is not supported" in str(caught.value)


# -- flatten ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_flatten_returns_the_array_leaves_in_spec_order(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    arrays = spec.flatten(tree)
    assert type(arrays) is list
    assert len(arrays) == len(spec.array_paths)
    for found, path in zip(arrays, spec.array_paths, strict=True):
        assert found is leaf_at(tree, path)


@pytest.mark.parametrize("name", NAMES)
def test_flatten_with_check_returns_the_same_arrays(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    assert [id(a) for a in spec.flatten(tree, check=True)] == [id(a) for a in spec.flatten(tree)]


@pytest.mark.parametrize("name", NAMES)
def test_flatten_accepts_a_fresh_tree_of_the_same_structure(name: str) -> None:
    spec = describe(TREES[name]())
    fresh = TREES[name]()
    assert len(spec.flatten(fresh, check=True)) == spec.num_arrays


def test_flatten_without_check_skips_shapes_and_dtypes() -> None:
    spec = describe((array(2, 8), None))
    other = array(3, dtype="float16")
    assert spec.flatten((other, None)) == [other]


def test_flatten_without_check_names_what_it_refused_not_a_shape_it_takes() -> None:
    # Before: '[0]: expected float32[2, 8], got float16[3]', a shape flatten takes (a bucket's
    # other length), while the constant at [1] was what it refused
    spec = describe((array(2, 8), "vit"))
    with pytest.raises(SpecMismatchError, match=r"^\[1\]: expected str 'vit', got str 'deit'$"):
        spec.flatten((array(3, dtype="float16"), "deit"))
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected float32\[2, 8\], got float16"):
        spec.flatten((array(3, dtype="float16"), "deit"), check=True)


def test_flatten_with_check_compares_shapes() -> None:
    spec = describe((array(2, 8), None))
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected float32\[2, 8\], got "):
        spec.flatten((array(3), None), check=True)


@pytest.mark.parametrize("check", [False, True])
def test_flatten_rejects_none_in_an_array_slot(check: bool) -> None:
    spec = describe((array(2), None))
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected float32\[2\], got None$"):
        spec.flatten((None, None), check=check)


@pytest.mark.parametrize("check", [False, True])
def test_flatten_rejects_an_array_in_a_none_slot(check: bool) -> None:
    spec = describe((array(2), None))
    with pytest.raises(SpecMismatchError, match=r"^\[1\]: expected None, got float32\[2\]$"):
        spec.flatten((array(2), array(2)), check=check)


@pytest.mark.parametrize("check", [False, True])
def test_flatten_rejects_a_changed_constant(check: bool) -> None:
    spec = describe((array(2), "vit"))
    with pytest.raises(SpecMismatchError, match=r"^\[1\]: expected str 'vit', got str 'deit'$"):
        spec.flatten((array(2), "deit"), check=check)


@pytest.mark.parametrize("check", [False, True])
def test_flatten_rejects_another_container_type(check: bool) -> None:
    spec = describe((array(2), None))
    with pytest.raises(SpecMismatchError, match=r"^<root>: expected a tuple"):
        spec.flatten([array(2), None], check=check)


def test_flatten_error_paths_start_at_root() -> None:
    spec = describe({"mask": array(2)})
    with pytest.raises(SpecMismatchError) as caught:
        spec.flatten({"mask": None}, root="kwargs")
    assert caught.value.path == "kwargs['mask']"


# -- unflatten -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_unflatten_of_flatten_rebuilds_the_tree(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    assert_same_tree(spec.unflatten(spec.flatten(tree)), tree)


@pytest.mark.parametrize("name", NAMES)
def test_unflatten_puts_each_array_at_its_path(name: str) -> None:
    spec = describe(TREES[name]())
    arrays = [np.zeros(leaf.shape, "float64") for leaf in spec.arrays]
    rebuilt = spec.unflatten(arrays)
    for given, path in zip(arrays, spec.array_paths, strict=True):
        assert leaf_at(rebuilt, path) is given


@pytest.mark.parametrize("name", NAMES)
def test_unflatten_restores_none_and_constants(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    rebuilt = spec.unflatten(spec.flatten(TREES[name]()))
    for leaf in spec.leaves:
        if leaf.kind == "none":
            assert leaf_at(rebuilt, leaf.path) is None
        elif leaf.kind == "const":
            assert repr(leaf_at(rebuilt, leaf.path)) == repr(leaf_at(tree, leaf.path))


def test_unflatten_keeps_the_users_dict_key_order() -> None:
    spec = describe({"zeta": array(2), "alpha": None, "mid": array(3)})
    rebuilt = spec.unflatten(spec.flatten({"mid": array(3), "alpha": None, "zeta": array(2)}))
    assert list(rebuilt) == ["zeta", "alpha", "mid"]


def test_flatten_orders_dict_arrays_by_sorted_key_whatever_the_users_order() -> None:
    zeta, mid = array(2), array(3)
    spec = describe({"zeta": zeta, "mid": mid})
    assert spec.array_paths == ("['mid']", "['zeta']")
    assert spec.flatten({"zeta": zeta, "mid": mid}) == [mid, zeta]
    assert spec.flatten({"mid": mid, "zeta": zeta}) == [mid, zeta]


def test_unflatten_accepts_any_sequence_of_arrays() -> None:
    spec = describe((array(2), None))
    x = array(2)
    assert spec.unflatten((x,))[0] is x


@pytest.mark.parametrize("arrays", ["ab", b"ab", {0: 1, 1: 2}, {1, 2}, frozenset({1, 2})], ids=repr)
def test_unflatten_refuses_what_is_no_sequence_of_arrays(arrays: Any) -> None:
    # a str of the right length was rebuilt as a tree of its characters, a dict by its values
    spec = describe((array(2), {"m": array(1)}))
    with pytest.raises(SpecMismatchError, match=r"^unflatten: expected a sequence of 2 arrays"):
        spec.unflatten(arrays)


class ClassUnreadable:
    """An object whose ``__class__`` raises: ``isinstance`` reads it and passes the error on."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise ValueError("no class to read")


def test_unflatten_refuses_an_object_whose_class_cannot_be_read() -> None:
    # Before: count_arrays's isinstance test leaked the object's own ValueError
    spec = describe((array(2), None))
    with pytest.raises(SpecMismatchError, match=r"^unflatten: expected a sequence of 1 arrays"):
        spec.unflatten(ClassUnreadable())  # type: ignore[arg-type]


def test_a_tree_spec_of_an_object_whose_class_cannot_be_read_is_refused() -> None:
    with pytest.raises(DualgraphError, match=r"^a TreeSpec is made of the nodes of one tree"):
        TreeSpec([ClassUnreadable()])  # type: ignore[list-item]


@pytest.mark.parametrize("count", [0, 2])
def test_unflatten_rejects_the_wrong_number_of_arrays(count: int) -> None:
    spec = describe((array(2), None))
    with pytest.raises(SpecMismatchError, match=f"^unflatten: expected 1 arrays, got {count}$"):
        spec.unflatten([array(2)] * count)


# -- grad mask -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_grad_mask_has_one_flag_per_array_leaf(name: str) -> None:
    spec = describe(TREES[name]())
    assert spec.grad_mask == tuple(leaf.grad for leaf in spec.arrays)


def test_grad_mask_is_true_for_floating_and_complex_arrays_only() -> None:
    spec = describe(TREES["mixed_dtypes"]())
    grads = dict(zip(spec.array_paths, spec.grad_mask, strict=True))
    assert grads["['float32']"] and grads["['float16']"] and grads["['complex64']"]
    assert not grads["['int64']"] and not grads["['bool']"]


@pytest.mark.parametrize("name", NAMES)
def test_with_grad_mask_changes_only_the_grad_mask(name: str) -> None:
    spec = describe(TREES[name]())
    flipped = [not flag for flag in spec.grad_mask]
    changed = spec.with_grad_mask(flipped)
    assert changed.grad_mask == tuple(flipped)
    assert changed.paths == spec.paths
    assert [(a.shape, a.dtype) for a in changed.arrays] == [(a.shape, a.dtype) for a in spec.arrays]


def test_with_grad_mask_follows_array_paths_order_not_the_users_key_order() -> None:
    spec = describe({"zeta": array(2), "alpha": array(2)})
    assert spec.array_paths == ("['alpha']", "['zeta']")
    changed = spec.with_grad_mask([False, True])
    grads = {leaf.path: leaf.grad for leaf in changed.arrays}
    assert grads == {"['alpha']": False, "['zeta']": True}
    assert repr(changed) == "TreeSpec({'zeta': float32[2](grad), 'alpha': float32[2]})"


def test_with_grad_mask_leaves_the_original_spec_unchanged() -> None:
    spec = describe(TREES["vit_layer"]())
    spec.with_grad_mask([False])
    assert spec.grad_mask == (True,)


def test_with_grad_mask_makes_an_unequal_spec() -> None:
    spec = describe(TREES["vit_layer"]())
    assert spec.with_grad_mask([False]) != spec
    assert spec.with_grad_mask([True]) == spec


def test_with_grad_mask_rejects_the_wrong_length() -> None:
    spec = describe(TREES["encoder_dict"]())
    with pytest.raises(DualgraphError, match="grad mask has 1 entries, the spec has 2 array"):
        spec.with_grad_mask([True])


def test_with_grad_mask_refuses_an_endless_iterator_after_one_entry_too_many() -> None:
    # Before: itertools.repeat(False) (all False, meant) was read until memory ran out
    spec = describe(TREES["encoder_dict"]())
    for mask in (iter([False] * 3), itertools.repeat(False)):
        with pytest.raises(DualgraphError, match="grad mask has more than 2 entries, for 2 array"):
            spec.with_grad_mask(mask)
    assert spec.with_grad_mask(iter([False, True])).grad_mask == (False, True)


@pytest.mark.parametrize(
    "entry", ["False", 0, 1, 0.0, None, np.zeros(1, bool), np.int64(0)], ids=repr
)
def test_with_grad_mask_coerces_nothing_but_bools(entry: Any) -> None:
    # bool("False") is True: a mask entry that is not a bool is refused, naming its position
    spec = describe(TREES["vit_layer"]())
    with pytest.raises(
        DualgraphError, match=r"grad mask\[0\] \(the array at \S+\): expected a bool"
    ):
        spec.with_grad_mask([entry])


class _DtypeRaises:
    """An entry whose ``dtype`` cannot be read (a lazy array, a proxy that fails)."""

    @property
    def dtype(self) -> Any:
        raise RuntimeError("no dtype here")


class _DtypeStrRaises:
    """An entry whose dtype cannot be printed."""

    class _Dtype:
        def __str__(self) -> str:
            raise RuntimeError("no name here")

    dtype = _Dtype()


@pytest.mark.parametrize("entry", [_DtypeRaises(), _DtypeStrRaises()], ids=type)
def test_with_grad_mask_names_the_entry_whose_dtype_cannot_be_read(entry: Any) -> None:
    # Before: the exception out of reading the dtype ended the mask's reading, so the error
    # ("a grad mask is a sequence of bools: no dtype here") named neither the entry nor its array
    spec = describe(TREES["vit_layer"]())
    with pytest.raises(
        DualgraphError, match=r"grad mask\[0\] \(the array at \[0\]\): expected a bool, got"
    ):
        spec.with_grad_mask([entry])


@pytest.mark.parametrize("mask", ["1", b"\x01", 1, None], ids=repr)
def test_with_grad_mask_is_a_sequence(mask: Any) -> None:
    spec = describe(TREES["vit_layer"]())
    with pytest.raises(DualgraphError, match="a grad mask is a sequence of bools"):
        spec.with_grad_mask(mask)


def test_with_grad_mask_takes_zero_dimensional_boolean_arrays() -> None:
    spec = describe(TREES["vit_layer"]())
    assert spec.with_grad_mask([np.bool_(False)]).grad_mask == (False,)
    assert spec.with_grad_mask((np.array(True),)).grad_mask == (True,)


class _CountedMask:
    """A mask of ``length`` entries (``False``) that counts how many were read; past ``limit``
    reads it fails (a mask whose length lies, or an endless one)."""

    def __init__(self, length: int, limit: int = 10**6) -> None:
        self.length, self.limit, self.read = length, limit, 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[bool]:
        while True:
            self.read += 1
            if self.read > self.limit:
                raise AssertionError("read past the limit")
            yield False


def test_with_grad_mask_refuses_a_mask_of_another_length_before_reading_its_entries() -> None:
    # Before: every entry was read first (a wrong numpy mask of 10**7 entries took 27 s)
    spec = describe(TREES["encoder_dict"]())
    mask = _CountedMask(10**6)
    with pytest.raises(DualgraphError, match=r"grad mask has 1000000 entries, the spec has 2 arr"):
        spec.with_grad_mask(mask)
    assert mask.read == 0


def test_with_grad_mask_reads_a_mask_whose_length_lies_one_entry_past_the_leaves() -> None:
    # Before: a sized mask was read to its end (an endless one until memory ran out)
    spec = describe(TREES["encoder_dict"]())
    mask = _CountedMask(2, limit=10)
    with pytest.raises(DualgraphError, match="grad mask has more than 2 entries, for 2 array"):
        spec.with_grad_mask(mask)
    assert mask.read == 3


class _Unprintable:
    def __format__(self, spec: str) -> str:
        raise RuntimeError("cannot format")

    def __repr__(self) -> str:
        raise RuntimeError("cannot repr")


def test_grad_mask_errors_name_classes_whose_module_is_no_str() -> None:
    # Before: the mask's own RuntimeError leaked, or the entry went unnamed
    odd = type("Odd", (), {})
    odd.__module__ = _Unprintable()  # type: ignore[assignment]
    spec = describe((np.zeros(2, np.float32),))
    with pytest.raises(DualgraphError, match=r"a grad mask is a sequence of bools, got <_Unp"):
        spec.with_grad_mask(odd())
    with pytest.raises(DualgraphError, match=r"grad mask\[0\] \(the array at \[0\]\): .* got <"):
        spec.with_grad_mask([odd()])
    with pytest.raises(DualgraphError, match=r"grad mask\[0\] .*: expected a bool, got <"):
        dualgraph.describe_call((np.zeros(2, np.float32),)).with_grad_mask([odd()])


def test_check_ignores_the_grad_flag() -> None:
    tree = TREES["encoder_dict"]()
    describe(tree).with_grad_mask([False, False]).check(tree)


# -- check -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_check_accepts_the_described_tree(name: str) -> None:
    tree = TREES[name]()
    assert describe(tree).check(tree) is None


@pytest.mark.parametrize("name", NAMES)
def test_check_accepts_a_fresh_tree_of_the_same_structure(name: str) -> None:
    describe(TREES[name]()).check(TREES[name]())


def test_check_accepts_a_dict_in_another_key_order() -> None:
    describe({"hidden": array(2), "aux_loss": None}).check({"aux_loss": None, "hidden": array(2)})


def test_check_names_shape_mismatch_with_root() -> None:
    error = mismatch({"mask": array(2, 8)}, {"mask": array(2, 9)}, root="kwargs")
    assert str(error) == "kwargs['mask']: expected float32[2, 8], got float32[2, 9]"
    assert error.path == "kwargs['mask']"


def test_check_names_dtype_mismatch() -> None:
    error = mismatch((array(2, 16), None), (array(2, 16, dtype="float16"), None))
    assert str(error) == "[0]: expected float32[2, 16], got float16[2, 16]"
    assert error.path == "[0]"


def test_check_names_none_where_an_array_was() -> None:
    error = mismatch((array(2, 16), None), (None, None))
    assert str(error) == "[0]: expected float32[2, 16], got None"
    assert error.path == "[0]"


def test_check_names_an_array_where_none_was() -> None:
    error = mismatch((array(2, 16), None), (array(2, 16), array(2)))
    assert str(error) == "[1]: expected None, got float32[2]"
    assert error.path == "[1]"


def test_check_names_a_missing_key() -> None:
    error = mismatch(TREES["encoder_dict"](), {"hidden": array(2, 16, 64), "aux_loss": None})
    assert str(error) == "['pooled']: missing (expected float32[2, 64])"
    assert error.path == "['pooled']"


def test_check_names_an_extra_key() -> None:
    error = mismatch(TREES["encoder_dict"](), {**TREES["encoder_dict"](), "extra": None})
    assert str(error) == "['extra']: unexpected entry None"
    assert error.path == "['extra']"


class _StrKey(str):
    pass


class _IntKey(int):
    pass


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize(
    ("key", "found"),
    [(1, True), (0, False), (1, 1.0), (1, np.int64(1)), (1, _IntKey(1)), ("a", _StrKey("a"))],
    ids=["bool-for-int", "false-for-0", "float-for-int", "numpy-int", "int-subclass", "str-sub"],
)
@pytest.mark.parametrize("mapping", [dict, collections.OrderedDict])
def test_a_key_equal_to_the_specs_but_of_another_type_is_a_mismatch(
    mapping: type, key: Any, found: Any, check: bool
) -> None:
    spec = describe(mapping([(key, array(2)), ("b", None)]))
    with pytest.raises(SpecMismatchError) as caught:
        spec.flatten(mapping([(found, array(2)), ("b", None)]), check=check)
    expected = f"{type(key).__name__} key {key!r}"
    assert f"[{found!r}]: key of type {type(found).__name__}, expected the {expected}" in str(
        caught.value
    )


def test_check_names_another_container_type() -> None:
    error = mismatch((array(2), None), [array(2), None])
    assert str(error) == "<root>: expected a tuple of length 2, got a list of length 2"
    assert error.path == ""


def test_check_names_another_length() -> None:
    error = mismatch({"layers": [array(2), array(2)]}, {"layers": [array(2)]})
    assert str(error) == "['layers']: expected a list of length 2, got a list of length 1"
    assert error.path == "['layers']"


def test_check_names_another_namedtuple_type() -> None:
    error = mismatch(Attention(array(2), None), (array(2), None))
    assert str(error) == "<root>: expected a trees.Attention, got a tuple of length 2"


def test_check_names_a_dataclass_field() -> None:
    error = mismatch(TREES["dataclass"](), EncoderOutput(hidden=None, pooled=array(2)))
    assert str(error) == ".hidden: expected float32[2, 8], got None"
    assert error.path == ".hidden"


@pytest.mark.parametrize(
    ("expected", "found", "message"),
    [
        (16, 17, "expected int 16, got int 17"),
        (16, 16.0, "expected int 16, got float 16.0"),
        (1, True, "expected int 1, got bool True"),
        (1.5, 2.5, "expected float 1.5, got float 2.5"),
        (float("nan"), 0.0, "expected float nan, got float 0.0"),
        ("vit", "deit", "expected str 'vit', got str 'deit'"),
        ("vit", None, "expected str 'vit', got None"),
    ],
    ids=["int", "int-vs-float", "int-vs-bool", "float", "nan", "str", "str-vs-none"],
)
def test_check_names_a_changed_constant(expected: Any, found: Any, message: str) -> None:
    error = mismatch((array(2), expected), (array(2), found))
    assert str(error) == f"[1]: {message}"
    assert error.path == "[1]"


def test_check_accepts_nan_constant_equal_to_itself() -> None:
    describe((float("nan"),)).check((float("nan"),))


def test_check_tells_negative_zero_from_zero() -> None:
    error = mismatch((array(2), -0.0), (array(2), 0.0))
    assert str(error) == "[1]: expected float -0.0, got float 0.0"


def nan_with_bits(bits: int) -> float:
    """The float of these 64 bits (a NaN of another sign or payload than ``float('nan')``)."""
    value: float = struct.unpack("<d", bits.to_bytes(8, "little"))[0]
    return value


#: NaNs a spec must tell apart: float("nan"), its negative, and two of other payloads.
NANS = [
    float("nan"),
    -float("nan"),
    nan_with_bits(0x7FF8_0000_0000_0001),
    nan_with_bits(0xFFF0_0000_0000_0002),  # a signalling NaN with the sign bit
]


def test_check_tells_a_negative_nan_constant_from_nan() -> None:
    error = mismatch((array(2), float("nan")), (array(2), -float("nan")))
    assert str(error) == "[1]: expected float nan, got float -nan"


@pytest.mark.parametrize("value", NANS[1:], ids=["negative", "payload", "signalling"])
def test_check_refuses_any_other_nan_in_place_of_a_nan_constant(value: float) -> None:
    spec = describe((float("nan"),))
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected float nan, got float "):
        spec.check((value,))
    describe((value,)).check((nan_with_bits(float_bits(value)),))


def test_nan_constants_of_other_signs_and_payloads_come_back_as_they_were() -> None:
    spec = describe(tuple(NANS))
    assert [float_bits(value) for value in spec.unflatten([])] == list(map(float_bits, NANS))
    assert len(set(spec.leaves)) == len(NANS)


def test_json_keeps_the_sign_and_payload_of_nan_constants() -> None:
    spec = describe(tuple(NANS))
    loaded = TreeSpec.from_json(spec.to_json())
    assert [float_bits(value) for value in loaded.unflatten([])] == list(map(float_bits, NANS))
    assert loaded == spec
    assert loaded.to_json() == spec.to_json()


def test_check_compares_ordereddict_key_order() -> None:
    expected = collections.OrderedDict([("a", array(2)), ("b", None)])
    found = collections.OrderedDict([("b", None), ("a", array(2))])
    error = mismatch(expected, found)
    assert str(error) == "<root>: expected keys in the order ['a', 'b'], got ['b', 'a']"


def test_check_names_an_unsupported_object_in_the_tree() -> None:
    error = mismatch({"aux_loss": None}, {"aux_loss": {1, 2}})
    assert str(error) == "['aux_loss']: expected None, got an object of type builtins.set"


class Mode(enum.IntEnum):
    FAST = 1


class Name(str):
    pass


@pytest.mark.parametrize(
    ("expected", "found", "shown"),
    [
        (1, Mode.FAST, "<Mode.FAST: 1> (an object of type test_spec.Mode)"),
        (0.5, np.float32(0.5), "np.float32(0.5) (an object of type numpy.float32)"),
        (True, np.bool_(True), "np.True_ (an object of type numpy.bool)"),
        ("vit", Name("vit"), "'vit' (an object of type test_spec.Name)"),
        (2, 2 + 0j, "(2+0j) (an object of type builtins.complex)"),
    ],
    ids=["int-enum", "numpy-float", "numpy-bool", "str-subclass", "complex"],
)
def test_a_value_where_a_constant_was_is_shown_by_its_repr_and_type(
    expected: Any, found: Any, shown: str
) -> None:
    # Before: 'expected int 1, got an object of type test_spec.Mode', naming no value: which
    # member, which number, which text stood there was left to guess
    error = mismatch({"mode": expected}, {"mode": found})
    assert str(error) == f"['mode']: expected {type(expected).__name__} {expected!r}, got {shown}"


def test_check_names_the_first_difference_in_spec_order() -> None:
    error = mismatch({"b": array(2), "a": array(2)}, {"b": array(3), "a": array(3)})
    assert error.path == "['a']"
    error = mismatch((array(2), array(2)), (array(3), array(3)))
    assert error.path == "[0]"


def test_the_structure_difference_of_two_specs_leaves_out_shapes_alone() -> None:
    def difference(expected: Any, found: Any, **options: bool) -> tuple[str, str, str] | None:
        found_difference = spec_module.structure_difference(
            describe(expected), describe(found), **options
        )
        if found_difference is None:
            return None
        path, a, b = found_difference
        return path, "nothing" if a is None else a.brief(), "nothing" if b is None else b.brief()

    assert difference({"x": array(2), "n": 1}, {"x": array(5), "n": 1}) is None
    # one leaf path, [0], in each: the containers differ
    assert difference([array(2)], (array(2),)) == ("", "a list of length 1", "a tuple of length 1")
    assert difference({0: 1}, [1]) == ("", "a dict with keys [0]", "a list of length 1")
    assert difference((float("nan"),), (-float("nan"),)) == ("[0]", "float nan", "float -nan")
    assert difference((array(2),), (array(2, dtype="int64"),)) == ("[0]", "float32[2]", "int64[2]")
    assert difference((array(2),), (array(3, dtype="int64"),), dtypes=False) is None
    assert difference({"a": 1}, {"a": 1, "b": None}) == ("['b']", "nothing", "None")


def test_spec_mismatch_error_is_a_dualgraph_error_and_a_value_error() -> None:
    error = mismatch((array(2),), (None,))
    assert isinstance(error, DualgraphError)
    assert isinstance(error, ValueError)


# -- JSON ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_json_round_trip_gives_an_equal_spec(name: str) -> None:
    spec = describe(TREES[name]())
    assert TreeSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("name", NAMES)
def test_json_round_trip_gives_identical_json(name: str) -> None:
    text = describe(TREES[name]()).to_json()
    assert TreeSpec.from_json(text).to_json() == text


@pytest.mark.parametrize("name", NAMES)
def test_spec_loaded_from_json_rebuilds_the_tree(name: str) -> None:
    tree = TREES[name]()
    loaded = TreeSpec.from_json(describe(tree).to_json())
    loaded.check(tree)
    assert_same_tree(loaded.unflatten(loaded.flatten(tree)), tree)


@pytest.mark.parametrize("name", NAMES)
def test_json_is_compact_with_sorted_keys(name: str) -> None:
    text = describe(TREES[name]()).to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("name", NAMES)
def test_json_is_versioned(name: str) -> None:
    document = json.loads(describe(TREES[name]()).to_json())
    assert (document["format"], document["version"]) == ("dualgraph.TreeSpec", 2)
    assert sorted(document) == ["format", "tree", "version"]


def test_json_lists_nodes_in_pre_order_with_children_in_flatten_order() -> None:
    tree = {"zeta": (array(2), None), "alpha": 1.5, 7: "x"}
    rows = json.loads(describe(tree).to_json())["tree"]
    assert rows == [
        ["dict", ["zeta", "alpha", 7]],  # the user's key order ...
        ["const", "str", "x"],  # ... children in flatten order: int keys, then sorted str keys
        ["const", "float", "1.5"],
        ["tuple", 2],
        ["array", "float32", [2], True],
        ["none"],
    ]


def test_json_rows_never_nest_whatever_the_depth() -> None:
    tree: Any = None
    for _ in range(50):
        tree = [tree]
    rows = json.loads(describe(tree).to_json())["tree"]
    assert rows == [["list", 1]] * 50 + [["none"]]


@pytest.mark.parametrize("name", NAMES)
def test_json_holds_no_framework_or_device_name(name: str) -> None:
    text = describe(TREES[name]()).to_json().lower()
    for word in ("numpy", "ndarray", "torch", "jax", "cuda", "cpu", "device"):
        assert word not in text


def test_json_is_strict_even_for_nan_and_infinite_constants() -> None:
    text = describe(TREES["constants"]()).to_json()

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    json.loads(text, parse_constant=refuse)


def test_json_float_constants_round_trip_exactly() -> None:
    tree = TREES["constants"]()
    loaded = TreeSpec.from_json(describe(tree).to_json())
    assert_same_tree(loaded.unflatten([]), tree)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not a TreeSpec JSON document: "),
        ("[]", "not a TreeSpec JSON document (format must be 'dualgraph.TreeSpec')"),
        ('{"format": "other"}', "format must be 'dualgraph.TreeSpec'"),
        ('{"format": "dualgraph.TreeSpec", "version": 99}', "TreeSpec JSON version 99 is not"),
    ],
    ids=["not-json", "not-an-object", "other-format", "other-version"],
)
def test_from_json_rejects_other_documents(text: str, message: str) -> None:
    with pytest.raises(DualgraphError) as caught:
        TreeSpec.from_json(text)
    assert message in str(caught.value)


def document(rows: Any) -> str:
    return json.dumps({"format": "dualgraph.TreeSpec", "version": 2, "tree": rows})


@pytest.mark.parametrize(
    ("rows", "where"),
    [
        ([["array", "float32", [-1], True]], "<root>: bad shape [-1]"),
        ([["array", "float32", [2], 1]], "<root>: grad is a bool, got 1"),
        ([["array", 3, [2], True]], "<root>: dtype 3 is not one a spec accepts"),
        ([["const", "float", "x"]], "<root>: a float constant is stored as its repr"),
        ([["const", "int", "1"]], "<root>: a int constant holds '1'"),
        ([["tensor"]], "<root>: unknown node kind 'tensor'"),
        ([["set", 0]], "<root>: unknown node kind 'set'"),
        (
            [["dict", ["a"]]],
            "<root>: the row has 1 children, but the rows after it leave room for 0",
        ),
        (
            [["list", 2], ["list", 1], ["none"]],
            "at [0]: the row has 1 children, but the rows after",
        ),
        ([["tuple", 2], ["none"], 3], "at [1]: a node row is a list starting with its kind"),
        ([["none"], ["none"]], "at <root>: 1 rows follow the end of the tree"),
    ],
    ids=[
        "shape",
        "grad",
        "dtype",
        "float",
        "int",
        "leaf-kind",
        "node-kind",
        "keys",
        "short",
        "child",
        "extra",
    ],
)
def test_from_json_rejects_a_malformed_tree_naming_where(rows: Any, where: str) -> None:
    with pytest.raises(DualgraphError, match=r"^malformed TreeSpec JSON at ") as caught:
        TreeSpec.from_json(document(rows))
    assert where in str(caught.value)


def test_from_json_names_a_namedtuple_it_does_not_know_and_how_to_register_it() -> None:
    rows = [["namedtuple", "no_such_module:Out", []]]
    with pytest.raises(DualgraphError) as caught:
        TreeSpec.from_json(document(rows))
    message = str(caught.value)
    assert "namedtuple 'no_such_module:Out' is not registered in this process" in message
    assert "dualgraph.register_namedtuple(cls)" in message


def test_from_json_refuses_a_dataclass_that_is_not_registered() -> None:
    rows = [["dataclass", f"{__name__}:Unregistered", []]]
    with pytest.raises(DualgraphError, match=r"dualgraph\.register_dataclass\(cls\)"):
        TreeSpec.from_json(document(rows))


@dataclasses.dataclass
class Unregistered:
    """A dataclass that tests name in JSON without ever registering it."""


def test_from_json_reads_bytes_as_utf8() -> None:
    spec = describe({"naïve": array(2)})
    assert TreeSpec.from_json(spec.to_json().encode()) == spec


# -- equality, hashing, repr, pickling -------------------------------------------------------------


#: Ints that all hash to 0 (an int hashes by its value modulo 2**61 - 1), and dims made of them.
ONE_HASH = [k * (2**61 - 1) for k in range(1, 41)]
ONE_HASH_DIMS = [0, *ONE_HASH[:4]]  # within 2**63 - 1
ONE_HASH_ROWS = {
    "constant": [[["const", "int", n]] for n in ONE_HASH],
    "shape": [
        [["array", "int8", [ONE_HASH_DIMS[i // 5**j % 5] for j in range(3)], False]]
        for i in range(len(ONE_HASH))
    ],
    "key": [[["dict", [n]], ["none"]] for n in ONE_HASH],
}


@pytest.mark.parametrize("kind", list(ONE_HASH_ROWS))
def test_specs_of_documents_whose_ints_share_a_hash_hash_apart(kind: str) -> None:
    # Before: a spec hashed by its ints' hashes, so specs read from documents (a dict or set of
    # them, the specs' shared programs) made a table of one hash: time quadratic in their number
    specs = [TreeSpec.from_json(document(rows)) for rows in ONE_HASH_ROWS[kind]]
    assert len(set(specs)) == len(specs)
    assert len({hash(spec) for spec in specs}) == len(specs)
    assert len({hash(spec.leaves) for spec in specs}) == len(specs)
    again = TreeSpec.from_json(specs[0].to_json())
    assert again == specs[0] and hash(again) == hash(specs[0])


@pytest.mark.parametrize("name", NAMES)
def test_specs_of_fresh_trees_are_equal_with_equal_hashes(name: str) -> None:
    first, second = describe(TREES[name]()), describe(TREES[name]())
    assert first == second
    assert hash(first) == hash(second)


def test_specs_of_different_table_trees_differ() -> None:
    specs = {name: describe(build()) for name, build in TREES.items()}
    for (a, first), (b, second) in itertools.combinations(specs.items(), 2):
        assert first != second, f"{a} and {b}"


def test_specs_of_dicts_in_another_key_order_differ() -> None:
    # The key order is kept so unflatten can restore it, so it is part of the spec.
    assert describe({"a": None, "b": 1}) != describe({"b": 1, "a": None})


def test_spec_is_never_equal_to_another_type() -> None:
    spec = describe(None)
    assert spec != None  # noqa: E711 - __eq__ itself is under test
    assert spec != "TreeSpec(None)"


def test_equal_specs_are_one_dict_key() -> None:
    cache = {describe(TREES["vit_layer"]()): "graph"}
    assert cache[describe(TREES["vit_layer"]())] == "graph"


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("vit_layer", "TreeSpec((float32[2, 16, 64](grad), None))"),
        (
            "encoder_dict",
            "TreeSpec({'hidden': float32[2, 16, 64](grad), 'pooled': float32[2, 64](grad), "
            "'aux_loss': None})",
        ),
        ("none", "TreeSpec(None)"),
        ("array", "TreeSpec(float32[3, 4](grad))"),
        ("scalar_array", "TreeSpec(float32[](grad))"),
        ("constant", "TreeSpec(16)"),
        ("empty_containers", "TreeSpec(((), [], {}, OrderedDict({})))"),
        ("one_tuple", "TreeSpec((float32[2](grad),))"),
        (
            "nested_namedtuple",
            "TreeSpec(LayerOutput(hidden=float32[2, 4, 8](grad), "
            "attention=Attention(weights=float32[2, 4, 4](grad), bias=None), "
            "cache=(float32[2, 4, 8](grad), float32[2, 4, 8](grad))))",
        ),
        (
            "ordered_dict",
            "TreeSpec(OrderedDict({'zeta': float32[3](grad), 'alpha': None, 'mid': 3}))",
        ),
        (
            "dataclass",
            "TreeSpec(EncoderOutput(hidden=float32[2, 8](grad), pooled=float32[2](grad), "
            "aux_loss=None))",
        ),
        ("int_keyed_dict", "TreeSpec({3: float32[2](grad), 1: None, 2: 5})"),
        (
            "constants",
            "TreeSpec((0, -7, 1180591620717411303424, 1.5, 1e-310, 0.0, -0.0, nan, inf, -inf, "
            "True, False))",
        ),
    ],
)
def test_repr_shows_the_tree_with_leaves_described(name: str, shown: str) -> None:
    assert repr(describe(TREES[name]())) == shown


def test_repr_marks_only_arrays_that_carry_a_gradient() -> None:
    spec = describe((array(2), array(2, dtype="int64")))
    assert repr(spec) == "TreeSpec((float32[2](grad), int64[2]))"


def test_leaf_spec_prints_as_in_the_tree_repr() -> None:
    spec = describe((array(2, 3), None, "vit", 0.5))
    assert [str(leaf) for leaf in spec.leaves] == ["float32[2, 3]", "None", "'vit'", "0.5"]


def test_leaf_spec_fields() -> None:
    spec = describe((array(2, 3, dtype="int64"), "vit"))
    assert spec.leaves == (
        LeafSpec("array", "[0]", shape=(2, 3), dtype="int64", grad=False),
        LeafSpec("const", "[1]", value="vit"),
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [(True, 1), (1, 1.0), (0.0, -0.0), (False, 0), ("1", 1)],
    ids=["bool-int", "int-float", "zero-signs", "false-zero", "str-int"],
)
def test_leaf_specs_of_constants_a_spec_tells_apart_are_unequal(first: Any, second: Any) -> None:
    a, b = describe((first,)), describe((second,))
    assert a != b
    assert a.leaves != b.leaves
    assert len({*a.leaves, *b.leaves}) == 2


def test_a_nan_constant_leaf_spec_equals_itself_read_back() -> None:
    spec = describe((float("nan"), float("-nan")))
    loaded = TreeSpec.from_json(spec.to_json())
    assert loaded == spec
    assert loaded.leaves == spec.leaves
    assert hash(loaded.leaves) == hash(spec.leaves)


@pytest.mark.parametrize("name", NAMES)
def test_pickle_round_trip_gives_an_equal_working_spec(name: str) -> None:
    tree = TREES[name]()
    spec = describe(tree)
    loaded = pickle.loads(pickle.dumps(spec))
    assert loaded == spec
    assert_same_tree(loaded.unflatten(loaded.flatten(tree, check=True)), tree)


def test_deepcopy_gives_an_equal_spec() -> None:
    spec = describe(TREES["nested_namedtuple"]())
    assert copy.deepcopy(spec) == spec


def test_describe_is_exported_with_the_spec_types() -> None:
    assert dualgraph.describe is describe
    assert dualgraph.TreeSpec is TreeSpec


def test_describe_root_prefixes_unsupported_leaf_paths_but_not_spec_paths() -> None:
    with pytest.raises(UnsupportedLeafError) as caught:
        describe(({"x": {1, 2}},), root="args")
    assert caught.value.path == "args[0]['x']"
    assert str(caught.value).startswith("args[0]['x']: unsupported leaf of type builtins.set")
    assert describe((array(2),), root="args").paths == ("[0]",)


@pytest.mark.parametrize(
    "mask", [{True}, frozenset({False}), {True: 1}, collections.OrderedDict([(True, 1)])], ids=repr
)
def test_with_grad_mask_refuses_unordered_or_keyed_collections(mask: Any) -> None:
    # a set has no order and a dict's entries are its keys: neither says which leaf is which
    spec = describe((np.zeros(2, np.float32),))
    with pytest.raises(DualgraphError, match="a grad mask is a sequence of bools"):
        spec.with_grad_mask(mask)


@pytest.mark.parametrize("nodes", [5, None, 1.5, object()], ids=repr)
def test_the_treespec_constructor_refuses_what_is_not_a_sequence_of_nodes(nodes: Any) -> None:
    with pytest.raises(DualgraphError, match="a TreeSpec is made of the nodes of one tree"):
        TreeSpec(nodes)


def test_the_treespec_constructor_reads_an_iterator_to_the_node_limit_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: an endless iterator was read until memory ran out, and one whose iteration
    # raised leaked its error
    def failing() -> Iterator[Node]:
        yield NONE
        raise RuntimeError("no more")

    with pytest.raises(DualgraphError, match="a TreeSpec is made of the nodes of one tree"):
        TreeSpec(failing())
    monkeypatch.setattr(spec_module, "MAX_NODES", 100)
    with pytest.raises(DualgraphError, match="a TreeSpec has at most 100 nodes, got more"):
        TreeSpec(itertools.repeat(NONE))
    assert TreeSpec(iter([NONE])) == describe(None)


@pytest.mark.parametrize("root", [3, None, b"args"])
def test_a_root_that_is_not_a_str_is_refused_by_name(root: Any) -> None:
    spec = describe((1,))
    attempts = (
        lambda: describe((object(),), root=root),
        lambda: spec.check((2,), root=root),
        lambda: spec.flatten((2,), root=root),
        lambda: spec.mismatch((2,), root=root),
    )
    for attempt in attempts:
        with pytest.raises(DualgraphError, match=r"^root must be a str \(a path prefix\), got "):
            attempt()


@pytest.mark.parametrize("which", ["tree_spec", "leaf_spec"])
def test_comparing_a_spec_with_an_object_whose_class_cannot_be_read_is_unequal(which: str) -> None:
    # Before: __eq__'s isinstance test leaked the object's own ValueError
    spec = describe((array(2), None))
    compared: Any = spec if which == "tree_spec" else spec.leaves[0]
    assert (compared == ClassUnreadable()) is False
    assert (compared != ClassUnreadable()) is True


NON_NATIVE = np.dtype("float32").newbyteorder()  # the other byte order than this machine's
NON_NATIVE_NAME = ("big" if NON_NATIVE.byteorder == ">" else "little") + "-endian float32"


def test_describing_an_array_of_the_other_byte_order_is_refused_naming_its_path() -> None:
    # Before: described as float32, the byte order dropped
    with pytest.raises(
        DualgraphError,
        match=rf"^\[1\]\['x'\]: a {NON_NATIVE_NAME} array \(numpy dtype '{NON_NATIVE.str}'\)",
    ):
        describe((None, {"x": np.zeros(2, NON_NATIVE)}))


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_an_array_of_the_other_byte_order_fails_the_check_of_a_native_one(size: int) -> None:
    # Before: check and flatten(check=True) passed it as float32[2]
    spec = describe([np.zeros(2, np.float32), *[None] * size])
    odd = [np.zeros(2, NON_NATIVE), *[None] * size]
    message = rf"^\[0\]: expected float32\[2\], got {NON_NATIVE_NAME}\[2\]$"
    with pytest.raises(SpecMismatchError, match=message):
        spec.check(odd)
    with pytest.raises(SpecMismatchError, match=message):
        spec.flatten(odd, check=True)


class _KeyOfTheHashOfA:
    """A dict key hashing as 'a' whose comparison raises once armed: reading a dict holding it
    by the key 'a' runs that comparison."""

    armed = False

    def __hash__(self) -> int:
        return hash("a")

    def __eq__(self, other: object) -> bool:
        if _KeyOfTheHashOfA.armed:
            raise RuntimeError("compared")
        return False

    def __repr__(self) -> str:
        return "K()"


@pytest.mark.parametrize("kind", [dict, collections.OrderedDict], ids=["dict", "ordereddict"])
@pytest.mark.parametrize("method", ["check", "flatten"])
def test_a_mismatch_whose_explanation_raises_names_the_containers_path(
    kind: type, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: '<root>: the tree could not be read: compared' (the container's path was lost)
    spec = describe([None, kind([("a", 1), ("b", 2)])])
    # one key more: a dict's keys differ by their count, before any is compared
    found = [None, kind([("b", 2), (_KeyOfTheHashOfA(), 1), ("c", 3)])]
    monkeypatch.setattr(_KeyOfTheHashOfA, "armed", True)
    with pytest.raises(SpecMismatchError, match=r"^\[1\]: reading an? \w+ with keys") as caught:
        getattr(spec, method)(found)
    assert caught.value.path == "[1]"
    assert "RuntimeError: compared" in str(caught.value)


@dualgraph.register_dataclass
@dataclasses.dataclass
class _Tripled:
    x: Any

    def __post_init__(self) -> None:
        self.x = self.x * 3


def test_a_refused_rebuild_says_what_to_do_in_full() -> None:
    # Before: clipped to 120 characters as a user's error is ('... raised DualgraphError:
    # ..._Tripled did not keep field 'x' as given when r...'), cutting off why and what to do
    spec = describe([_Tripled(array(1))])
    with pytest.raises(DualgraphError) as caught:
        spec.unflatten([array(1)])
    assert str(caught.value).startswith("unflatten: [0]: rebuilding a ")
    assert str(caught.value).endswith(
        "Make that conversion outside the class, or keep the values it is given"
    )
