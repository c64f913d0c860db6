"""difference_but_shapes: where two trees differ in more than array shapes."""

from __future__ import annotations

import collections

import pytest
import torch

from dualgraph import describe
from dualgraph.torch._leaf_difference import difference_but_shapes

Pair = collections.namedtuple("Pair", "first second")


def difference(expected: object, found: object, **options: bool) -> tuple[str, str, str] | None:
    return difference_but_shapes(describe(expected), describe(found), **options)


def test_shapes_alone_are_no_difference() -> None:
    assert difference((torch.zeros(2), 3), (torch.zeros(5), 3)) is None


def test_kind_dtype_constant_and_missing_leaves_are_named_by_path() -> None:
    assert difference((torch.zeros(2), None), (torch.zeros(2), 1)) == ("[1]", "None", "int 1")
    assert difference({"a": 1.0}, {"a": float("nan")}) == ("['a']", "float 1.0", "float nan")
    assert difference((1, 2), (1,)) == ("[1]", "int 2", "nothing")
    assert difference([1], [1, None]) == ("[1]", "nothing", "None")
    assert difference({"a": 1}, {"b": 1}) == ("['a']", "int 1", "nothing")
    assert difference({"a": 1}, {"a": 1, "b": None}) == ("['b']", "nothing", "None")


CONTAINERS = {
    "a list for a tuple": ([torch.zeros(2)], (torch.zeros(3),), "a list of length 1", "a tuple"),
    "a list for a dict of int keys": (
        {0: torch.zeros(2)},
        [torch.zeros(3)],
        "a dict with keys [0]",
        "a list of length 1",
    ),
    "a tuple for a namedtuple": (Pair(torch.zeros(2), 1), (torch.zeros(3), 1), "Pair", "a tuple"),
    "a dict in another key order": ({"a": 1, "b": 2}, {"b": 2, "a": 1}, "['a', 'b']", "['b', 'a']"),
}


@pytest.mark.parametrize("case", list(CONTAINERS))
def test_a_container_of_another_kind_with_the_same_leaf_paths_is_a_difference(case: str) -> None:
    expected, found, want, got = CONTAINERS[case]
    path, shown_expected, shown_found = difference(expected, found)  # type: ignore[misc]
    assert path == ""
    assert want in shown_expected
    assert got in shown_found


def test_constants_compare_with_their_type_and_a_float_by_its_exact_text() -> None:
    assert difference((float("nan"),), (-float("nan"),)) == ("[0]", "float nan", "float -nan")
    assert difference((0.0,), (-0.0,)) == ("[0]", "float 0.0", "float -0.0")
    assert difference((1,), (True,)) == ("[0]", "int 1", "bool True")
    assert difference((float("nan"),), (float("nan"),)) is None


def test_a_dtype_is_a_difference_unless_left_to_the_caller() -> None:
    float32, bfloat16 = (torch.zeros(2),), (torch.zeros(5, dtype=torch.bfloat16),)
    assert difference(float32, bfloat16) == ("[0]", "a float32 tensor", "a bfloat16 tensor")
    # buckets' inputs: dtypes are checked with device and grad, by the caller
    assert difference(float32, bfloat16, dtypes=False) is None


def test_the_grad_flag_is_no_difference() -> None:
    assert difference((torch.zeros(2, requires_grad=True),), (torch.zeros(3),)) is None
