"""CallSpec: the spec of a call's (args, kwargs): paths, flatten with checks, unflatten, JSON."""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import itertools
import json
import pickle
import re
import types
from typing import Any

import numpy as np
import pytest
from trees import TREES, Attention, array, assert_same_tree

import dualgraph
from dualgraph import CallSpec, DualgraphError, SpecMismatchError, TreeSpec, describe_call


def sample_call() -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional arrays in containers, a constant, None, and array and non-array kwargs."""
    args = (array(2, 3), {"x": array(4), "aux": None}, 7)
    kwargs = {"mask": np.ones((2, 3), bool), "scale": 0.5, "bias": array(3)}
    return args, kwargs


def mismatch(args: Any, kwargs: Any, *, check: bool = True) -> SpecMismatchError:
    spec = describe_call(*sample_call())
    with pytest.raises(SpecMismatchError) as caught:
        spec.flatten(args, kwargs, check=check)
    return caught.value


# -- describe_call ---------------------------------------------------------------------------------


def test_array_paths_start_at_args_then_kwargs_in_flatten_order() -> None:
    spec = describe_call(*sample_call())
    assert spec.array_paths == ("args[0]", "args[1]['x']", "kwargs['bias']", "kwargs['mask']")
    assert spec.num_arrays == 4
    assert spec.num_args_arrays == 2


def test_arrays_carry_the_call_paths_shapes_dtypes_and_grads() -> None:
    spec = describe_call(*sample_call())
    assert [leaf.path for leaf in spec.arrays] == list(spec.array_paths)
    assert [(leaf.shape, leaf.dtype) for leaf in spec.arrays] == [
        ((2, 3), "float32"),
        ((4,), "float32"),
        ((3,), "float32"),
        ((2, 3), "bool"),
    ]
    assert spec.grad_mask == (True, True, True, False)


def test_args_and_kwargs_specs_describe_a_tuple_and_a_dict() -> None:
    args, kwargs = sample_call()
    spec = describe_call(args, kwargs)
    assert spec.args_spec == dualgraph.describe(args)
    assert spec.kwargs_spec == dualgraph.describe(kwargs)


def test_a_list_of_args_is_described_as_a_tuple() -> None:
    args, kwargs = sample_call()
    assert describe_call(list(args), kwargs) == describe_call(args, kwargs)


def test_none_kwargs_are_no_kwargs() -> None:
    spec = describe_call((array(2),), None)
    assert spec == describe_call((array(2),), {})
    assert spec.kwargs_spec == dualgraph.describe({})


def test_any_mapping_of_kwargs_is_described_as_a_dict() -> None:
    args, kwargs = sample_call()
    assert describe_call(args, types.MappingProxyType(kwargs)) == describe_call(args, kwargs)


@pytest.mark.parametrize(
    "args", [array(2), {"x": 1}, None, "ab"], ids=["array", "dict", "none", "str"]
)
def test_describe_call_rejects_args_that_are_not_a_tuple_or_list(args: Any) -> None:
    with pytest.raises(DualgraphError, match=r"^args: expected a tuple or list"):
        describe_call(args, None)


def test_describe_call_rejects_kwargs_that_are_not_a_mapping() -> None:
    with pytest.raises(DualgraphError, match=r"^kwargs: expected a mapping .* got list"):
        describe_call((), [("x", 1)])


def test_describe_call_rejects_keyword_names_that_are_not_str() -> None:
    with pytest.raises(DualgraphError, match=r"^kwargs: keyword names must be str, got 1 \(int\)"):
        describe_call((), {1: array(2)})


class _UnprintableKey:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    "key", [10**5000, _UnprintableKey()], ids=["int-too-long-to-print", "failing-repr"]
)
def test_keyword_names_that_cannot_be_printed_are_still_a_dualgraph_error(key: Any) -> None:
    with pytest.raises(DualgraphError, match=r"^kwargs: keyword names must be str, got <"):
        describe_call((), {key: 1})
    spec = describe_call((), {"x": 1})
    with pytest.raises(SpecMismatchError, match=r"^kwargs: keyword names must be str, got <"):
        spec.flatten((), types.MappingProxyType({key: 1}))
    with pytest.raises(
        SpecMismatchError, match=r"^kwargs\[<an int of 16610 bits>\]: unexpected entry int 1"
    ):
        spec.flatten((), {"x": 1, 10**5000: 1})


def test_describe_call_names_an_unsupported_leaf_by_its_call_path() -> None:
    with pytest.raises(dualgraph.UnsupportedLeafError, match=r"^kwargs\['opt'\]: unsupported"):
        describe_call((array(2),), {"opt": object()})


# -- flatten ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("check", [False, True])
def test_flatten_returns_args_arrays_then_kwargs_arrays(check: bool) -> None:
    args, kwargs = sample_call()
    arrays = describe_call(args, kwargs).flatten(args, kwargs, check=check)
    assert type(arrays) is list
    expected = [args[0], args[1]["x"], kwargs["bias"], kwargs["mask"]]
    assert [id(a) for a in arrays] == [id(a) for a in expected]


def test_flatten_accepts_a_fresh_call_of_the_same_structure() -> None:
    spec = describe_call(*sample_call())
    args, kwargs = sample_call()
    assert len(spec.flatten(args, kwargs, check=True)) == 4


def test_flatten_accepts_args_as_a_list_and_kwargs_as_any_mapping() -> None:
    args, kwargs = sample_call()
    spec = describe_call(args, kwargs)
    arrays = spec.flatten(list(args), types.MappingProxyType(kwargs), check=True)
    assert arrays[2] is kwargs["bias"]


def test_flatten_accepts_kwargs_in_another_order() -> None:
    args, kwargs = sample_call()
    reordered = dict(reversed(list(kwargs.items())))
    assert describe_call(args, kwargs).flatten(args, reordered)[3] is kwargs["mask"]


@pytest.mark.parametrize("kwargs", [None, {}])
def test_flatten_without_kwargs_when_none_were_described(kwargs: Any) -> None:
    x = array(2)
    assert describe_call((x,), None).flatten((x,), kwargs, check=True) == [x]


def test_flatten_with_check_names_a_shape_mismatch_by_path() -> None:
    args, kwargs = sample_call()
    args = (args[0], {"x": array(5), "aux": None}, 7)
    error = mismatch(args, kwargs)
    assert str(error) == "args[1]['x']: expected float32[4], got float32[5]"
    assert error.path == "args[1]['x']"


def test_flatten_without_check_skips_shapes_and_dtypes() -> None:
    args, kwargs = sample_call()
    kwargs["mask"] = array(9)
    spec = describe_call(*sample_call())
    assert spec.flatten(args, kwargs)[3] is kwargs["mask"]
    with pytest.raises(SpecMismatchError, match=r"^kwargs\['mask'\]: expected bool\[2, 3\]"):
        spec.flatten(args, kwargs, check=True)


def test_flatten_without_check_names_the_argument_it_refused_not_another_shape() -> None:
    # Before: 'args[0]: expected float32[2, 3], got float32[5, 3]' for a call refused for its
    # constant (7 -> 8), as a bucketed or padded call of another length is
    args, kwargs = sample_call()
    error = mismatch((array(5, 3), args[1], 8), kwargs, check=False)
    assert str(error) == "args[2]: expected int 7, got int 8"


@pytest.mark.parametrize("check", [False, True])
def test_flatten_always_checks_none_positions_and_constants(check: bool) -> None:
    args, kwargs = sample_call()
    error = mismatch((None, *args[1:]), kwargs, check=check)
    assert str(error).startswith("args[0]: expected float32[2, 3], got None")
    error = mismatch(args, {**kwargs, "scale": 0.25}, check=check)
    assert str(error) == "kwargs['scale']: expected float 0.5, got float 0.25"
    assert error.path == "kwargs['scale']"


@pytest.mark.parametrize("check", [False, True])
def test_flatten_names_a_missing_kwarg(check: bool) -> None:
    args, kwargs = sample_call()
    del kwargs["mask"]
    error = mismatch(args, kwargs, check=check)
    assert str(error).startswith("kwargs['mask']: missing")
    assert error.path == "kwargs['mask']"


def test_flatten_names_missing_kwargs_when_called_with_none() -> None:
    args, _ = sample_call()
    assert str(mismatch(args, None)).startswith("kwargs['mask']: missing")  # the user's order


@pytest.mark.parametrize("check", [False, True])
def test_flatten_names_an_unexpected_kwarg(check: bool) -> None:
    args, kwargs = sample_call()
    error = mismatch(args, {**kwargs, "dropout": 0.1}, check=check)
    assert str(error) == "kwargs['dropout']: unexpected entry float 0.1"


def test_flatten_names_an_unexpected_kwarg_when_none_were_described() -> None:
    spec = describe_call((array(2),), None)
    with pytest.raises(SpecMismatchError, match=r"^kwargs\['x'\]: unexpected entry"):
        spec.flatten((array(2),), {"x": 1})


@pytest.mark.parametrize("kwargs", [[("scale", 0.5)], "scale", 3], ids=["list", "str", "int"])
def test_flatten_rejects_kwargs_that_are_not_a_mapping(kwargs: Any) -> None:
    args, _ = sample_call()
    error = mismatch(args, kwargs)
    assert str(error).startswith("kwargs: expected a mapping of keyword arguments, got ")
    assert error.path == "kwargs"


def test_flatten_rejects_non_mapping_kwargs_even_when_none_were_described() -> None:
    spec = describe_call((), None)
    with pytest.raises(SpecMismatchError, match=r"^kwargs: expected a mapping"):
        spec.flatten((), [])


def test_flatten_rejects_keyword_names_that_are_not_str() -> None:
    args, kwargs = sample_call()
    assert str(mismatch(args, {**kwargs, 1: 2})) == "kwargs[1]: unexpected entry int 2"
    error = mismatch(args, types.MappingProxyType({**kwargs, 1: 2}))
    assert str(error).startswith("kwargs: keyword names must be str, got 1 (int)")


@pytest.mark.parametrize("args", [None, array(2), {"x": 1}], ids=["none", "array", "dict"])
def test_flatten_rejects_args_that_are_not_a_tuple(args: Any) -> None:
    _, kwargs = sample_call()
    error = mismatch(args, kwargs)
    assert str(error).startswith("args: expected a tuple of positional arguments, got ")
    assert error.path == "args"


class _FailingList(list):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise ValueError("cannot iterate")


def test_args_whose_own_iteration_fails_are_a_dualgraph_error_naming_args() -> None:
    # Before: the list subclass's ValueError leaked from describe_call and flatten
    args, kwargs = sample_call()
    failing = _FailingList(args)
    with pytest.raises(DualgraphError, match=r"^args: reading the positional arguments raised Val"):
        describe_call(failing, kwargs)
    error = mismatch(failing, kwargs)
    assert str(error).startswith("args: reading the positional arguments raised ValueError")
    assert error.path == "args"


class _FailingEquality:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no equality")

    __hash__ = None  # type: ignore[assignment]


def test_args_and_kwargs_of_a_class_whose_module_cannot_compare_are_named() -> None:
    # Before: naming the class compared its __module__ with 'builtins': its RuntimeError leaked
    odd = type("Odd", (), {})
    odd.__module__ = _FailingEquality()  # type: ignore[assignment]
    args, kwargs = sample_call()
    with pytest.raises(DualgraphError, match=r"^args: expected a tuple or list of .*, got <"):
        describe_call(odd(), kwargs)
    with pytest.raises(DualgraphError, match=r"^kwargs: expected a mapping of .*, got <"):
        describe_call(args, odd())
    assert str(mismatch(odd(), kwargs)).startswith("args: expected a tuple of positional argum")
    assert str(mismatch(args, odd())).startswith("kwargs: expected a mapping of keyword argum")


def test_flatten_names_a_wrong_number_of_args() -> None:
    args, kwargs = sample_call()
    assert str(mismatch(args[:2], kwargs)) == (
        "args[2]: missing (expected int 7): the call has 2 positional arguments, expected 3"
    )


def test_flatten_names_the_first_extra_positional_argument() -> None:
    args, kwargs = sample_call()
    error = mismatch((*args, "extra", None), kwargs)
    assert str(error) == (
        "args[3]: unexpected extra positional argument str 'extra': the call has 5 positional "
        "arguments, expected 3"
    )
    assert error.path == "args[3]"


# -- unflatten -------------------------------------------------------------------------------------


def test_unflatten_rebuilds_args_and_kwargs() -> None:
    args, kwargs = sample_call()
    spec = describe_call(args, kwargs)
    rebuilt_args, rebuilt_kwargs = spec.unflatten(spec.flatten(args, kwargs))
    assert type(rebuilt_args) is tuple and type(rebuilt_kwargs) is dict
    assert_same_tree(rebuilt_args, args)
    assert_same_tree(rebuilt_kwargs, kwargs)


def test_unflatten_puts_fresh_arrays_at_their_paths() -> None:
    spec = describe_call(*sample_call())
    fresh = [array(2, 3), array(4), array(3), np.zeros((2, 3), bool)]
    args, kwargs = spec.unflatten(fresh)
    assert args[0] is fresh[0] and args[1]["x"] is fresh[1]
    assert kwargs["bias"] is fresh[2] and kwargs["mask"] is fresh[3]
    assert args[1]["aux"] is None and args[2] == 7 and kwargs["scale"] == 0.5


@pytest.mark.parametrize("count", [0, 3, 5])
def test_unflatten_rejects_the_wrong_number_of_arrays(count: int) -> None:
    spec = describe_call(*sample_call())
    with pytest.raises(SpecMismatchError, match=f"expected 4 arrays, got {count}"):
        spec.unflatten([array(2)] * count)


@pytest.mark.parametrize("arrays", ["ab", {0: 1, 1: 2}, {1, 2}], ids=repr)
def test_unflatten_refuses_what_is_no_sequence_of_arrays(arrays: Any) -> None:
    # a dict or set leaked a TypeError from slicing; a str was rebuilt as its characters
    spec = describe_call((array(2),), {"m": array(1)})
    with pytest.raises(SpecMismatchError, match=r"^unflatten: expected a sequence of 2 arrays"):
        spec.unflatten(arrays)


def test_unflatten_of_a_sequence_that_cannot_be_sliced_is_a_spec_mismatch() -> None:
    class NoSlices(collections.abc.Sequence):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, slice):
                raise TypeError("no slices")
            return array(1)

    spec = describe_call((array(1),), {"m": array(1)})
    with pytest.raises(SpecMismatchError, match=r"^unflatten: .*TypeError: no slices"):
        spec.unflatten(NoSlices())


def test_unflatten_of_a_call_without_kwargs_gives_an_empty_dict() -> None:
    spec = describe_call((array(2), None), None)
    assert spec.unflatten([array(2)])[1] == {}


# -- grad mask -------------------------------------------------------------------------------------


def test_with_grad_mask_splits_the_mask_between_args_and_kwargs() -> None:
    spec = describe_call(*sample_call()).with_grad_mask([False, True, False, True])
    assert spec.grad_mask == (False, True, False, True)
    assert spec.args_spec.grad_mask == (False, True)
    assert spec.kwargs_spec.grad_mask == (False, True)


def test_with_grad_mask_leaves_the_original_unchanged_and_differs_from_it() -> None:
    spec = describe_call(*sample_call())
    masked = spec.with_grad_mask([False] * 4)
    assert spec.grad_mask == (True, True, True, False)
    assert masked != spec


@pytest.mark.parametrize("length", [3, 5])
def test_with_grad_mask_rejects_the_wrong_length(length: int) -> None:
    with pytest.raises(DualgraphError, match=f"grad mask has {length} entries, the call has 4"):
        describe_call(*sample_call()).with_grad_mask([True] * length)


def test_with_grad_mask_refuses_an_endless_iterator_after_one_entry_too_many() -> None:
    for mask in (iter([True] * 5), itertools.cycle([True, False])):
        with pytest.raises(DualgraphError, match="grad mask has more than 4 entries, for 4 array"):
            describe_call(*sample_call()).with_grad_mask(mask)


# -- JSON, equality, display -----------------------------------------------------------------------


def test_json_round_trip_gives_an_equal_working_spec() -> None:
    args, kwargs = sample_call()
    spec = describe_call(args, kwargs)
    loaded = CallSpec.from_json(spec.to_json())
    assert loaded == spec and hash(loaded) == hash(spec)
    assert loaded.to_json() == spec.to_json()
    assert [id(a) for a in loaded.flatten(args, kwargs, check=True)] == [
        id(a) for a in spec.flatten(args, kwargs)
    ]


@pytest.mark.parametrize("name", list(TREES))
def test_json_round_trip_of_every_table_tree_as_an_argument(name: str) -> None:
    spec = describe_call((TREES[name](),), {"tree": TREES[name]()})
    assert CallSpec.from_json(spec.to_json()) == spec


def test_a_call_spec_that_cannot_be_written_names_the_call_path() -> None:
    # Before: to_json's error named the path from the tree's own root ('at [1]', 'at ['k']'),
    # not from args or kwargs
    long_name = collections.namedtuple("P" * 1100, ["x"])  # type: ignore[misc]
    spec = describe_call((None, long_name(None)))
    with pytest.raises(DualgraphError, match=r"^cannot write the spec at args\[1\]: the class"):
        spec.to_json()
    spec = describe_call((), {"k": "\ud83d\ude00"})
    with pytest.raises(DualgraphError, match=r"^cannot write the spec at kwargs\['k'\]: the str"):
        spec.to_json()


def test_json_is_versioned_with_sorted_keys() -> None:
    text = describe_call(*sample_call()).to_json()
    document = json.loads(text)
    assert document["format"] == "dualgraph.CallSpec" and document["version"] == 1
    assert json.dumps(document, sort_keys=True, separators=(",", ":")) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2", "not a CallSpec JSON document"),
        ('{"format": "dualgraph.TreeSpec"}', "not a CallSpec JSON document"),
        ('{"format": "dualgraph.CallSpec", "version": 2}', "version 2 is not supported"),
        ('{"format": "dualgraph.CallSpec", "version": true}', "version True is not supported"),
        ('{"format": "dualgraph.CallSpec", "version": 1}', "'args' is missing"),
        (
            '{"format": "dualgraph.CallSpec", "version": 1, "args": [], "kwargs": [], "x": 1}',
            "unknown key 'x'",
        ),
        ('{"format": "dualgraph.CallSpec", "version": 1, "args": [], "kwargs": []}', "at args: "),
    ],
)
def test_from_json_rejects_other_documents(text: str, message: str) -> None:
    with pytest.raises(DualgraphError, match=message):
        CallSpec.from_json(text)


class ClassUnreadable:
    """An object whose ``__class__`` raises: ``isinstance`` reads it and passes the error on."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise ValueError("no class to read")


ENTRY_POINTS: dict[str, Any] = {
    "describe_call args": lambda spec, bad: describe_call(bad),
    "describe_call kwargs": lambda spec, bad: describe_call((), bad),
    "flatten args": lambda spec, bad: spec.flatten(bad, None),
    "flatten kwargs": lambda spec, bad: spec.flatten((array(2),), bad),
    "unflatten": lambda spec, bad: spec.unflatten(bad),
    "CallSpec": lambda spec, bad: CallSpec(bad, bad),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_an_object_whose_class_cannot_be_read_is_a_dualgraph_error(entry: str) -> None:
    # Before: the isinstance tests of args, kwargs and arrays leaked the object's own ValueError
    spec = describe_call((array(2),), {"k": 1})
    with pytest.raises(DualgraphError, match=r"expected|CallSpec takes two TreeSpecs"):
        ENTRY_POINTS[entry](spec, ClassUnreadable())


def test_from_json_rejects_args_that_are_not_a_tuple() -> None:
    document = json.loads(describe_call((array(2),)).to_json())
    document["args"] = [["list", 0]]
    # Before: 'args: the args spec must describe a tuple', which did not say that the document
    # was malformed, nor which row
    message = (
        "malformed CallSpec JSON at args: the args spec must describe a tuple, not a list of "
        'length 0 (row 0 of the document\'s "args" list)'
    )
    with pytest.raises(DualgraphError, match=f"^{re.escape(message)}$"):
        CallSpec.from_json(json.dumps(document))


@pytest.mark.parametrize("part", ["args", "kwargs"])
def test_a_refused_document_is_explained_by_its_root_alone(
    part: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The message showed the whole spec (clipped after rendering it): a document of nested
    # dicts with long keys took time quadratic in its size to refuse (10 MB: 80 s).
    document = json.loads(describe_call((array(2),)).to_json())
    document[part] = [["dict", [1 if part == "kwargs" else "k" * 100]]] * 50 + [["none"]]
    rendered: list[object] = []
    monkeypatch.setattr(TreeSpec, "__repr__", lambda spec: rendered.append(spec) or "TreeSpec()")
    what = "a tuple" if part == "args" else "a dict with str keys"
    root = "[1]" if part == "kwargs" else "['" + "k" * 100 + "']"
    message = (
        f"malformed CallSpec JSON at {part}: the {part} spec must describe {what}, not a dict "
        f'with keys {root} (row 0 of the document\'s "{part}" list)'
    )
    with pytest.raises(DualgraphError, match=f"^{re.escape(message)}$"):
        CallSpec.from_json(json.dumps(document))
    assert rendered == []


def test_from_json_rejects_kwargs_with_int_keys() -> None:
    document = json.loads(describe_call((array(2),)).to_json())
    document["kwargs"] = [["dict", [1]], ["none"]]
    message = r"^malformed CallSpec JSON at kwargs: the kwargs spec must describe a dict"
    with pytest.raises(DualgraphError, match=message):
        CallSpec.from_json(json.dumps(document))


def test_from_json_reads_utf8_bytes_and_names_other_types() -> None:
    spec = describe_call((), {"naïve": 1})
    assert CallSpec.from_json(spec.to_json().encode()) == spec
    with pytest.raises(DualgraphError, match="not UTF-8"):
        CallSpec.from_json(b"\xff")
    with pytest.raises(DualgraphError, match="a CallSpec JSON document is a str, got int"):
        CallSpec.from_json(3)  # type: ignore[arg-type]


def test_from_json_names_malformed_rows_by_call_path() -> None:
    document = json.loads(describe_call((array(2),), {"m": None}).to_json())
    document["kwargs"][1] = ["array", "float32", [True], False]
    with pytest.raises(DualgraphError, match=r"^malformed CallSpec JSON at kwargs\['m'\]: bad sh"):
        CallSpec.from_json(json.dumps(document))


def test_calls_with_different_kwargs_differ() -> None:
    args, kwargs = sample_call()
    assert describe_call(args, kwargs) != describe_call(args, {**kwargs, "scale": 1.0})
    assert describe_call(args, kwargs) != describe_call(args, None)


def test_equal_specs_are_one_dict_key() -> None:
    first, second = describe_call(*sample_call()), describe_call(*sample_call())
    assert {first: 1}[second] == 1


def test_call_spec_is_never_equal_to_a_tree_spec() -> None:
    args, _ = sample_call()
    assert describe_call(args) != dualgraph.describe(args)


def test_repr_shows_args_and_kwargs() -> None:
    spec = describe_call((array(2), None), {"mask": np.ones(3, bool)})
    assert repr(spec) == "CallSpec(args=(float32[2](grad), None), kwargs={'mask': bool[3]})"


def test_repr_of_an_empty_call() -> None:
    assert repr(describe_call(())) == "CallSpec(args=(), kwargs={})"


def test_pickle_round_trip_gives_an_equal_spec() -> None:
    spec = describe_call(
        (Attention(weights=array(2), bias=None),), {"o": collections.OrderedDict()}
    )
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize("copy", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_copy_of_a_spec_json_cannot_hold_is_the_spec_itself(copy: Any) -> None:
    # Before: copy and deepcopy went through __reduce__ (to_json, then from_json), which
    # refused a str constant holding a surrogate pair as two code points (a TreeSpec's copy
    # is itself)
    spec = describe_call(("\ud83d\ude00", array(2)))
    assert copy(spec) is spec


def test_constructor_rejects_specs_of_other_shapes() -> None:
    with pytest.raises(DualgraphError, match=r"^args: the args spec must describe a tuple"):
        CallSpec(dualgraph.describe([array(2)]), dualgraph.describe({}))
    with pytest.raises(DualgraphError, match=r"^kwargs: the kwargs spec must describe a dict"):
        CallSpec(dualgraph.describe(()), dualgraph.describe(()))


@pytest.mark.parametrize("entry", ["False", 0, None], ids=repr)
def test_a_call_grad_mask_coerces_nothing_but_bools(entry: Any) -> None:
    with pytest.raises(
        DualgraphError, match=r"grad mask\[2\] \(the array at \S+\): expected a bool"
    ):
        describe_call(*sample_call()).with_grad_mask([False, True, entry, True])


def test_comparing_a_call_spec_with_an_object_whose_class_cannot_be_read_is_unequal() -> None:
    # Before: __eq__'s isinstance test leaked the object's own ValueError
    spec = describe_call((array(2),), {})
    assert (spec == ClassUnreadable()) is False
    assert (spec != ClassUnreadable()) is True


@dualgraph.register_dataclass
@dataclasses.dataclass
class _Halved:
    x: Any

    def __post_init__(self) -> None:
        self.x = self.x / 2


@pytest.mark.parametrize("root", ["args", "kwargs"])
def test_a_refused_rebuild_names_the_call_path(root: str) -> None:
    # Before: 'unflatten: [1][0]: rebuilding ...', the path from the tree's own root
    tree = [_Halved(array(1))]
    spec = describe_call((None, tree), {}) if root == "args" else describe_call((), {"k": tree})
    path = r"args\[1\]\[0\]" if root == "args" else r"kwargs\['k'\]\[0\]"
    with pytest.raises(DualgraphError, match=rf"^unflatten: {path}: rebuilding a \S*_Halved"):
        spec.unflatten([array(1)])


def test_a_tree_spec_names_the_root_it_is_given_when_a_rebuild_is_refused() -> None:
    spec = dualgraph.describe({"out": _Halved(array(1))})
    with pytest.raises(DualgraphError, match=r"^unflatten: output\['out'\]: rebuilding a "):
        spec.unflatten([array(1)], root="output")
    with pytest.raises(DualgraphError, match=r"^root must be a str"):
        spec.unflatten([array(1)], root=3)  # type: ignore[arg-type]
