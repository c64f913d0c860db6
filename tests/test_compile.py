"""The per-spec generated flatten / check / unflatten functions of the hot path."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
from trees import TREES, Attention, EncoderOutput, array

from dualgraph import describe
from dualgraph._compile import _same_float, compile_spec, signature_of
from dualgraph._containers import qualified_name


def array_node(*shape: int, dtype: str = "float32") -> dict[str, Any]:
    return {"leaf": "array", "shape": list(shape), "dtype": dtype, "grad": True}


NONE = {"leaf": "none"}


def test_signature_of_a_numpy_array_is_shape_and_dtype_name() -> None:
    assert signature_of(np.zeros((2, 3), np.int64)) == ((2, 3), "int64")


def test_signature_of_a_numpy_subclass_uses_the_numpy_description() -> None:
    assert signature_of(np.ma.masked_array(np.zeros(2, np.float16))) == ((2,), "float16")


@pytest.mark.parametrize("leaf", [None, 1.0, "x", [np.zeros(2)]], ids=repr)
def test_signature_of_a_non_array_is_none(leaf: Any) -> None:
    assert signature_of(leaf) is None


@pytest.mark.parametrize(
    ("found", "expected", "same"),
    [
        (1.5, 1.5, True),
        (float("nan"), float("nan"), True),
        (float("inf"), float("inf"), True),
        (1.5, 2.5, False),
        (float("nan"), 1.5, False),
        (1, 1.0, False),
        (True, 1.0, False),
        (np.float64(1.5), 1.5, False),
    ],
    ids=["equal", "nan", "inf", "different", "nan-vs-number", "int", "bool", "numpy-scalar"],
)
def test_same_float_needs_a_python_float_equal_or_both_nan(
    found: Any, expected: float, same: bool
) -> None:
    assert _same_float(found, expected) is same


def test_generated_code_is_straight_line() -> None:
    source = describe(TREES["deep"]())._compiled.source
    assert " for " not in source and "while " not in source


def test_flatten_returns_arrays_in_the_given_positions() -> None:
    node = {"node": "dict", "keys": ["zeta", "alpha"], "children": [array_node(2), array_node(3)]}
    compiled = compile_spec(node, [1, 0])
    zeta, alpha = array(2), array(3)
    assert compiled.flatten({"zeta": zeta, "alpha": alpha}) == [alpha, zeta]


def test_unflatten_reads_arrays_from_the_given_positions_in_the_nodes_key_order() -> None:
    node = {"node": "dict", "keys": ["zeta", "alpha"], "children": [array_node(2), array_node(3)]}
    compiled = compile_spec(node, [1, 0])
    rebuilt = compiled.unflatten(["first", "second"])
    assert list(rebuilt.items()) == [("zeta", "second"), ("alpha", "first")]


def test_flatten_returns_none_on_a_structure_mismatch_instead_of_raising() -> None:
    compiled = compile_spec({"node": "tuple", "children": [array_node(2), NONE]}, [0])
    assert compiled.flatten([array(2), None]) is None
    assert compiled.flatten((array(2),)) is None
    assert compiled.flatten((array(2), 0)) is None


def test_flatten_returns_none_for_none_in_an_array_slot() -> None:
    compiled = compile_spec({"node": "tuple", "children": [array_node(2)]}, [0])
    assert compiled.flatten((None,)) is None


def test_top_level_array_slot_rejects_none() -> None:
    compiled = compile_spec(array_node(2), [0])
    assert compiled.flatten(None) is None
    assert compiled.check(None) is None


def test_only_check_compares_shapes_and_dtypes() -> None:
    compiled = compile_spec({"node": "list", "children": [array_node(2)]}, [0])
    wrong = [array(3, dtype="float16")]
    assert compiled.flatten(wrong) == wrong
    assert compiled.check(wrong) is None


def test_check_returns_the_arrays_when_everything_matches() -> None:
    compiled = compile_spec({"node": "list", "children": [array_node(2), array_node(1)]}, [0, 1])
    arrays = [array(2), array(1)]
    assert compiled.check(arrays) == arrays


def test_container_types_are_matched_exactly() -> None:
    # A namedtuple is a tuple subclass, an OrderedDict a dict subclass: neither is accepted.
    assert (
        compile_spec({"node": "tuple", "children": [NONE]}, []).flatten(Attention(None, 1)) is None
    )
    node = {"node": "dict", "keys": ["a"], "children": [NONE]}
    assert compile_spec(node, []).flatten(collections.OrderedDict(a=None)) is None


def test_dict_keys_are_matched_as_a_set() -> None:
    node = {"node": "dict", "keys": ["a", "b"], "children": [NONE, NONE]}
    compiled = compile_spec(node, [])
    assert compiled.flatten({"b": None, "a": None}) == []
    assert compiled.flatten({"a": None}) is None
    assert compiled.flatten({"a": None, "b": None, "c": None}) is None


@pytest.mark.parametrize(
    ("constant", "accepted", "rejected"),
    [
        ({"type": "int", "value": 3}, 3, 3.0),
        ({"type": "bool", "value": True}, True, 1),
        ({"type": "str", "value": "vit"}, "vit", "deit"),
        ({"type": "float", "value": "nan"}, float("nan"), 0.0),
        ({"type": "float", "value": "-inf"}, float("-inf"), float("inf")),
    ],
    ids=["int", "bool", "str", "nan", "inf"],
)
def test_constants_are_matched_by_type_and_value(
    constant: dict[str, Any], accepted: Any, rejected: Any
) -> None:
    compiled = compile_spec({"leaf": "const", **constant}, [])
    assert compiled.flatten(accepted) == []
    assert compiled.flatten(rejected) is None


def test_unflatten_rebuilds_a_one_element_tuple_as_a_tuple() -> None:
    compiled = compile_spec({"node": "tuple", "children": [array_node(2)]}, [0])
    assert compiled.unflatten(["x"]) == ("x",)


def test_unflatten_rebuilds_empty_containers() -> None:
    node = {
        "node": "tuple",
        "children": [
            {"node": "tuple", "children": []},
            {"node": "list", "children": []},
            {"node": "dict", "keys": [], "children": []},
            {"node": "ordereddict", "keys": [], "children": []},
        ],
    }
    rebuilt = compile_spec(node, []).unflatten([])
    assert rebuilt == ((), [], {}, collections.OrderedDict())
    assert type(rebuilt[3]) is collections.OrderedDict


def test_unflatten_rebuilds_namedtuples_and_dataclasses_by_field() -> None:
    node = {
        "node": "dataclass",
        "type": qualified_name(EncoderOutput),
        "fields": ["hidden", "pooled", "aux_loss"],
        "children": [
            {
                "node": "namedtuple",
                "type": qualified_name(Attention),
                "fields": ["weights", "bias"],
                "children": [array_node(2), NONE],
            },
            {"leaf": "const", "type": "float", "value": "-0.0"},
            NONE,
        ],
    }
    rebuilt = compile_spec(node, [0]).unflatten(["w"])
    assert rebuilt == EncoderOutput(hidden=Attention(weights="w", bias=None), pooled=-0.0)
    assert str(rebuilt.pooled) == "-0.0"
