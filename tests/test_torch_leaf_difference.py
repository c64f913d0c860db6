"""difference_but_shapes: where two leaf lists differ in more than array shapes."""

from __future__ import annotations

import torch

from dualgraph import describe
from dualgraph.torch._leaf_difference import difference_but_shapes


def leaves(tree: object) -> tuple:
    return describe(tree).leaves


def test_shapes_alone_are_no_difference() -> None:
    assert difference_but_shapes(leaves((torch.zeros(2), 3)), leaves((torch.zeros(5), 3))) is None


def test_kind_dtype_constant_and_missing_leaves_are_named_by_path() -> None:
    assert difference_but_shapes(leaves((torch.zeros(2), None)), leaves((torch.zeros(2), 1))) == (
        "[1]",
        "None",
        "int 1",
    )
    assert difference_but_shapes(leaves({"a": 1.0}), leaves({"a": float("nan")})) == (
        "['a']",
        "float 1.0",
        "float nan",
    )
    assert difference_but_shapes(leaves((1, 2)), leaves((1,))) == ("[1]", "int 2", "nothing")
    assert difference_but_shapes(leaves((1,)), leaves((1, None))) == ("[1]", "nothing", "None")
    assert difference_but_shapes(leaves({"a": 1}), leaves({"b": 1})) == (
        "['a']",
        "int 1",
        "nothing",
    )


def test_a_dtype_difference_is_not_a_structure_difference() -> None:
    # dtypes are checked with device and grad, by the caller
    assert (
        difference_but_shapes(
            leaves((torch.zeros(2),)), leaves((torch.zeros(2, dtype=torch.int64),))
        )
        is None
    )
