"""The example trees every core test walks through, and how tests compare trees.

``TREES`` maps a name to a builder; each call returns a fresh tree: the same structure, shapes,
dtypes and constants, but new array objects holding new values.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import optree

import dualgraph

try:  # bfloat16 for numpy; it comes with jax
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None

#: The dtype names of the table whose arrays carry a gradient (numpy: floating or complex).
GRAD_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})

_rng = np.random.default_rng(0)


def array(*shape: int, dtype: Any = "float32") -> np.ndarray:
    """A new array of random values."""
    return _rng.standard_normal(shape).astype(dtype)


class Attention(NamedTuple):
    weights: Any
    bias: Any


LayerOutput = collections.namedtuple("LayerOutput", ["hidden", "attention", "cache"])


@dualgraph.register_dataclass
@dataclasses.dataclass
class EncoderOutput:
    hidden: Any
    pooled: Any
    aux_loss: Any = None


def _nested_namedtuple() -> LayerOutput:
    return LayerOutput(
        hidden=array(2, 4, 8),
        attention=Attention(weights=array(2, 4, 4), bias=None),
        cache=(array(2, 4, 8), array(2, 4, 8)),
    )


def _ordered_dict() -> collections.OrderedDict[str, Any]:
    # Keys deliberately not in sorted order.
    return collections.OrderedDict([("zeta", array(3)), ("alpha", None), ("mid", 3)])


def _mixed_dtypes() -> dict[str, Any]:
    tree = {
        "float32": array(2, 3),
        "float16": array(4, dtype="float16"),
        "int64": array(2, dtype="int64"),
        "bool": array(5, dtype="bool"),
        "complex64": array(2, dtype="complex64"),
    }
    if ml_dtypes is not None:
        tree["bfloat16"] = array(2, 3, dtype=ml_dtypes.bfloat16)
    return tree


def _constants() -> tuple[Any, ...]:
    return (0, -7, 2**70, 1.5, 1e-310, 0.0, -0.0, math.nan, math.inf, -math.inf, True, False)


def _strings() -> dict[str, Any]:
    return {"name": "vit-b/16", "empty": "", "unicode": "naïve ✓", "it's": 'say "hi"'}


def _deep() -> Any:
    tree: Any = array(2)
    for level in range(24):
        wrap = level % 6
        if wrap == 0:
            tree = (tree, None)
        elif wrap == 1:
            tree = [level, tree]
        elif wrap == 2:
            tree = {"inner": tree, "level": level}
        elif wrap == 3:
            tree = Attention(weights=tree, bias=None)
        elif wrap == 4:
            tree = collections.OrderedDict(inner=tree)
        else:
            tree = EncoderOutput(hidden=tree, pooled=float(level))
    return tree


TREES: dict[str, Callable[[], Any]] = {
    "vit_layer": lambda: (array(2, 16, 64), None),
    "encoder_dict": lambda: {"hidden": array(2, 16, 64), "pooled": array(2, 64), "aux_loss": None},
    "none": lambda: None,
    "array": lambda: array(3, 4),
    "scalar_array": lambda: array(),
    "zero_size_array": lambda: array(0, 4),
    "constant": lambda: 16,
    "empty_tuple": lambda: (),
    "empty_containers": lambda: ((), [], {}, collections.OrderedDict()),
    "one_tuple": lambda: (array(2),),
    "list_of_layers": lambda: [(array(2, 8), None) for _ in range(3)],
    "nested_namedtuple": _nested_namedtuple,
    "ordered_dict": _ordered_dict,
    "dataclass": lambda: EncoderOutput(hidden=array(2, 8), pooled=array(2)),
    "int_keyed_dict": lambda: {3: array(2), 1: None, 2: 5},
    "mixed_key_dict": lambda: {"b": array(2), 1: None, "a": 2},
    "mixed_dtypes": _mixed_dtypes,
    "constants": _constants,
    "strings": _strings,
    "deep": _deep,
}


def leaves_of(tree: Any) -> list[Any]:
    """Every leaf of ``tree`` (``None`` and constants included) in optree's order."""
    return optree.tree_leaves(tree, none_is_leaf=True, namespace="dualgraph")


def leaf_at(tree: Any, path: str) -> Any:
    """The object a spec path names; paths are Python accessor expressions, so evaluate one."""
    return eval(f"tree{path}", {"tree": tree})


def replace_leaves(tree: Any, change: Callable[[int, Any], Any]) -> Any:
    """``tree`` with its ``i``-th leaf (optree order, ``None`` included) replaced by ``change``."""
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True, namespace="dualgraph")
    return optree.tree_unflatten(treedef, [change(i, leaf) for i, leaf in enumerate(leaves)])


def float_bits(value: float) -> int:
    """The 64 bits of a float: what tells -0.0 from 0.0 and one NaN from another."""
    return int.from_bytes(struct.pack("<d", value), "little")


def assert_same_tree(actual: Any, expected: Any, path: str = "") -> None:
    """Containers of the same type (dict key order included), equal arrays, same constants."""
    where = path or "<root>"
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if expected is None:
        return
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        np.testing.assert_array_equal(actual, expected, err_msg=where)
    elif type(expected) is float:
        # By bits: -0.0 is not 0.0, NaN equals itself, and a NaN keeps its sign and payload.
        assert float_bits(actual) == float_bits(expected), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, (bool, int, str)):
        assert repr(actual) == repr(expected), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            name = field.name
            assert_same_tree(getattr(actual, name), getattr(expected, name), f"{path}.{name}")
    else:
        assert isinstance(expected, (tuple, list)), f"{where}: unexpected {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{path}[{i}]")
