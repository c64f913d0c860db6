"""Any tree a user can build works, or fails cleanly: deep trees, wide trees, cycles, limits.

Speed targets for large trees live in benchmarks/bench_spec.py; these tests keep sizes small
enough to run in a few seconds.
"""

from __future__ import annotations

import collections
import json
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
from trees import EncoderOutput, array, assert_same_tree

from dualgraph import DualgraphError, SpecMismatchError, TreeSpec, describe
from dualgraph import _json as json_module
from dualgraph import _spec as spec_module

DEPTH = 10_000


class Wrapper(NamedTuple):
    inner: Any
    tag: Any


WRAPS: dict[str, Callable[[Any], Any]] = {
    "list": lambda t: [t],
    "tuple": lambda t: (t, None),
    "dict": lambda t: {"k": t, "n": 1},
    "ordereddict": lambda t: collections.OrderedDict(k=t),
    "namedtuple": lambda t: Wrapper(t, "w"),
    "dataclass": lambda t: EncoderOutput(hidden=t, pooled=None),
}


def deep(wrap: Callable[[Any], Any], depth: int, leaf: Any) -> Any:
    tree = leaf
    for _ in range(depth):
        tree = wrap(tree)
    return tree


@pytest.mark.parametrize("kind", list(WRAPS))
def test_a_tree_ten_thousand_levels_deep_works_end_to_end(kind: str) -> None:
    wrap = WRAPS[kind]
    tree = deep(wrap, DEPTH, array(2))
    spec = describe(tree)
    loaded = TreeSpec.from_json(spec.to_json())
    assert loaded == spec and hash(loaded) == hash(spec)
    (x,) = loaded.flatten(tree, check=True)
    rebuilt = loaded.unflatten([x])
    assert type(rebuilt) is type(tree)
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert repr(spec).startswith("TreeSpec(")
    (leaf,) = spec.arrays
    assert len(leaf.entries) == DEPTH and leaf.path.startswith(str(leaf.entries[0]))
    with pytest.raises(SpecMismatchError) as caught:
        spec.check(deep(wrap, DEPTH, array(3)))
    assert str(caught.value).endswith("expected float32[2], got float32[3]")
    assert len(caught.value.path) > DEPTH


def test_a_mismatch_deep_down_names_its_whole_path() -> None:
    spec = describe(deep(WRAPS["list"], 3000, None))
    with pytest.raises(SpecMismatchError) as caught:
        spec.flatten(deep(WRAPS["list"], 3000, 1))
    assert caught.value.path == "[0]" * 3000


def test_a_wide_tree_runs_on_the_walker_with_the_same_results() -> None:
    tree = {"layers": [(array(2), None, {"n": i}) for i in range(5000)]}
    spec = describe(tree)
    assert spec.source is None  # too large to generate code for
    loaded = TreeSpec.from_json(spec.to_json())
    assert loaded == spec
    arrays = loaded.flatten(tree, check=True)
    assert len(arrays) == 5000 and arrays[17] is tree["layers"][17][0]
    assert_same_tree(loaded.unflatten(arrays), tree)
    tree["layers"][4321] = (array(2), None, {"n": -1})
    with pytest.raises(SpecMismatchError, match=r"^\['layers'\]\[4321\]\[2\]\['n'\]: expected int"):
        loaded.check(tree)


def test_a_list_containing_itself_is_refused_naming_where() -> None:
    loop: list[Any] = [array(2)]
    loop.append({"again": loop})
    with pytest.raises(DualgraphError, match=r"^\[1\]\['again'\]: the tree contains itself"):
        describe(loop)


def test_a_dict_containing_itself_is_refused() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(DualgraphError, match=r"^\['self'\]: the tree contains itself"):
        describe(loop)


def test_the_same_object_twice_is_no_cycle() -> None:
    shared = [array(2)]
    spec = describe((shared, shared, {"a": shared}))
    assert spec.num_arrays == 3


def test_describe_refuses_a_tree_over_the_node_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_module, "MAX_NODES", 100)
    describe([None] * 98)
    with pytest.raises(DualgraphError, match="the tree has more than 100 nodes, a spec's limit"):
        describe([[None] * 50, [None] * 50])


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "ordereddict"])
def test_a_container_over_the_node_limit_is_refused_before_its_node_is_made(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Before: its node was made first, a path entry (and for a dict, a checked key) per child:
    # describing a list of 20 million Nones took 19 s and 1.7 GB before it was refused
    from dualgraph import _containers

    made: list[int] = []
    container = _containers.Container.__init__

    def counting(self: Any, key: Any, entries: Any) -> None:
        made.append(len(entries))
        container(self, key, entries)

    monkeypatch.setattr(_containers.Container, "__init__", counting)
    monkeypatch.setattr(spec_module, "MAX_NODES", 100)
    children = [None] * 150
    tree = {
        "list": children,
        "tuple": tuple(children),
        "dict": dict(enumerate(children)),
        "ordereddict": collections.OrderedDict(enumerate(children)),
    }[kind]
    with pytest.raises(DualgraphError, match=r"<root>: the tree has more than 100 nodes"):
        describe(tree)
    assert made == []


def test_from_json_refuses_a_tree_over_the_node_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    text = describe([None] * 200).to_json()
    monkeypatch.setattr(json_module, "MAX_NODES", 100)
    with pytest.raises(DualgraphError, match="a tree has at most 100 nodes, this one 201"):
        TreeSpec.from_json(text)


def test_deep_json_inside_a_row_is_a_clean_error() -> None:
    text = '{"format":"dualgraph.TreeSpec","version":2,"tree":[["none", %s]]}'
    with pytest.raises(DualgraphError, match="not a TreeSpec JSON document"):
        TreeSpec.from_json(text % ("[" * 100_000 + "]" * 100_000))
    nested = "[" * 500 + "]" * 500  # parses, and is still no row
    with pytest.raises(DualgraphError, match="a none row is"):
        TreeSpec.from_json(text % nested)


def test_json_rows_of_a_deep_tree_stay_flat() -> None:
    rows = json.loads(describe(deep(WRAPS["dict"], 100, None)).to_json())["tree"]
    assert all(isinstance(part, (str, int, bool)) or part == ["k", "n"] for r in rows for part in r)


def test_numpy_arrays_of_every_shape_kind_share_leaf_nodes() -> None:
    tree = [np.zeros((2, 3), np.float32) for _ in range(100)]
    nodes = describe(tree)._nodes
    assert len({id(node) for node in nodes[1:]}) == 1


def comb_document(depth: int) -> str:
    """A tree with a leaf at every level: its leaves' paths hold ~depth**2 / 2 entries."""
    rows = [["tuple", 2], ["array", "float32", [1], True]] * depth + [["none"]]
    return json.dumps({"format": "dualgraph.TreeSpec", "version": 2, "tree": rows})


def test_leaf_paths_over_the_size_limit_are_refused_before_they_are_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 0.5 MB document (a comb 20,000 levels deep) made spec.paths build 600 MB of strings
    # in 37 s; a 2 MB one, 10 GB.
    monkeypatch.setattr(spec_module, "MAX_PATH_CHARS", 10_000)
    spec = TreeSpec.from_json(comb_document(100))  # its paths: 3 * 100 * 101 / 2 characters
    for read in (lambda: spec.paths, lambda: spec.leaves, lambda: spec.arrays):
        with pytest.raises(DualgraphError, match=r"leaf paths .* 15[14]50 characters, over the"):
            read()
    assert len(TreeSpec.from_json(comb_document(50)).paths) == 51
    assert spec.num_arrays == 100 and len(spec.flatten(spec.unflatten([array(1)] * 100))) == 100


def test_repr_of_a_deep_spine_hands_each_container_text_of_its_own_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pasting each child's whole text into its parent's copies a deep tree's text once per
    # level: a 4.5 MB document of 80,000 nested dicts with 50-character keys took a minute to
    # print, one of the 2**20 nodes a spec takes, days. The text handed to show stays linear.
    from dualgraph._containers import DictNode

    handed = []
    show = DictNode.show

    def counting(self: DictNode, parts: Any) -> str:
        handed.append(sum(map(len, parts)))
        return show(self, parts)

    monkeypatch.setattr(DictNode, "show", counting)
    depth = 2_000
    spec = describe(deep(lambda t: {"k" * 50: t}, depth, None))
    shown = repr(spec)
    assert shown == "TreeSpec(" + ("{'" + "k" * 50 + "': ") * depth + "None" + "}" * depth + ")"
    assert sum(handed) < 20 * depth


def test_repr_shows_a_class_whose_name_holds_a_nul_as_a_whole() -> None:
    Odd = collections.namedtuple("Odd", ["x", "y"])  # type: ignore[name-match]
    Odd.__qualname__ = "Odd\x000\x00"
    spec = describe(Odd([np.zeros(2, np.float32)], {"k": None}))
    assert repr(spec) == "TreeSpec(Odd\x000\x00(x=[float32[2](grad)], y={'k': None}))"
