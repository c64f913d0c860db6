"""The hot-path functions of a spec: generated straight-line code, or the walker for big trees."""

from __future__ import annotations

import collections
import dataclasses
import gc
import linecache
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from trees import TREES, Attention, EncoderOutput, array, assert_same_tree

import dualgraph
from dualgraph import DualgraphError, describe
from dualgraph import _compile as compile_module

Describe = Callable[[Any], dualgraph.TreeSpec]


@pytest.fixture(params=["generated", "walker"])
def spec_of(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Describe:
    """``describe`` with generated code, or with the walker that runs trees over the limit."""
    if request.param == "walker":
        monkeypatch.setattr(compile_module, "COMPILE_LIMIT", 0)
    return describe


@pytest.mark.parametrize("name", list(TREES))
def test_generated_code_and_walker_give_the_same_results(name: str, spec_of: Describe) -> None:
    tree = TREES[name]()
    spec = spec_of(tree)
    arrays = spec.flatten(tree, check=True)
    assert [id(a) for a in arrays] == [id(a) for a in spec.flatten(tree)]
    assert_same_tree(spec.unflatten(arrays), tree)


def test_walker_has_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_module, "COMPILE_LIMIT", 3)
    assert describe((None, None)).source is not None
    assert describe((None, None, None)).source is None


def test_generated_code_is_straight_line_whatever_the_depth() -> None:
    tree: Any = array(2)
    for level in range(300):
        tree = [tree] if level % 2 else {"x": tree}
    source = describe(tree).source
    assert source is not None
    assert " for " not in source and "while " not in source
    for line in source.splitlines():
        assert line.startswith("def ") or (line.startswith("    ") and line[4] != " ")
    assert max(line.count("(") for line in source.splitlines()) < 10


def test_every_statement_carries_its_path_as_a_comment() -> None:
    source = describe({"layers": [(array(2), None)], "n": 3}).source
    assert source is not None
    lines = source.splitlines()
    assert any(line.endswith("is None: return None  # ['layers'][0][0]") for line in lines)
    assert "# ['n']" in source
    assert "# <root>" in source


def test_comments_cannot_be_broken_out_of() -> None:
    key = "x\nimport os  # \u2028 \r"
    spec = describe({key: array(2)})
    source = spec.source
    assert source is not None
    assert "\nimport os" not in source and "\u2028" not in source and "\r" not in source
    assert all(line.isascii() for line in source.splitlines())
    assert spec.flatten({key: array(2)}, check=True)[0].shape == (2,)


def test_long_paths_are_clipped_in_comments() -> None:
    tree: Any = None
    for _ in range(200):
        tree = {"a_long_key_name": tree}
    source = describe(tree).source
    assert source is not None
    assert max(len(line) for line in source.splitlines()) < 300


def test_field_names_keys_and_constants_are_bound_never_pasted() -> None:
    tree = {"secret_key": Attention(weights=array(2), bias="secret_value")}
    source = describe(tree).source
    assert source is not None
    code = "\n".join(line.partition("  #")[0] for line in source.splitlines())
    assert "secret_key" in source  # in the comments only
    for word in ("secret_key", "weights", "bias", "secret_value", "Attention"):
        assert word not in code


def test_source_is_registered_in_linecache_under_a_filename_of_its_own() -> None:
    spec = describe((array(2), "only here"))
    filename = spec._program._code.filename  # type: ignore[union-attr]
    assert filename.startswith("<dualgraph spec ")
    assert "".join(linecache.getlines(filename)) == spec.source
    other = describe((array(3), None))
    assert other._program._code.filename != filename  # type: ignore[union-attr]


def test_linecache_entry_goes_after_the_last_spec_using_it() -> None:
    spec = describe({"linecache_entry_under_test": array(2)})
    filename = spec._program._code.filename  # type: ignore[union-attr]
    assert filename in linecache.cache
    del spec
    gc.collect()
    describe({"the_next_spec_compiled": array(2)})  # entries of dead specs go at a compile
    assert filename not in linecache.cache


def test_a_spec_compiled_again_keeps_its_linecache_entry() -> None:
    spec = describe({"compiled_twice": array(2)})
    filename = spec._program._code.filename  # type: ignore[union-attr]
    del spec
    gc.collect()
    again = describe({"compiled_twice": array(2)})
    assert again._program._code.filename == filename  # type: ignore[union-attr]
    describe({"another_spec": array(2)})
    assert "".join(linecache.getlines(filename)) == again.source


def test_a_spec_dying_while_linecache_checks_its_cache_breaks_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # checkcache walks a list of the cache's keys and stats real files; a garbage collection
    # there may finalize a spec's code, whose entry must still be there when the walk reaches it
    source = tmp_path / "stale.py"
    source.write_text("x = 1\n")
    linecache.cache[str(source)] = (0, 0.0, ["x = 1\n"], str(source))  # stale: gets a stat
    holder = [describe({"dies_during_checkcache": array(2)})]
    filename = holder[0]._program._code.filename  # type: ignore[union-attr]
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        holder.clear()  # the last spec using the code goes mid-walk
        gc.collect()
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    linecache.checkcache()  # no KeyError
    monkeypatch.undo()
    describe({"the_next_spec_compiled": array(3)})
    assert filename not in linecache.cache


class _TakenMeanwhile(list):  # type: ignore[type-arg]
    """Retired filenames that another thread takes between the test for one and the pop."""

    def __len__(self) -> int:
        return super().__len__() + 1


def test_retired_linecache_entries_taken_by_another_thread_break_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the pop after the test found the list empty, and its IndexError failed describe
    monkeypatch.setattr(compile_module, "_RETIRED", _TakenMeanwhile(["<dualgraph spec gone>"]))
    spec = describe({"compiled_while_another_thread_forgets": array(2)})
    assert spec.source is not None


def test_a_traceback_through_generated_code_shows_the_generated_line() -> None:
    @dualgraph.register_dataclass
    @dataclasses.dataclass
    class Checked:
        value: Any

        def __post_init__(self) -> None:
            if (self.value < 0).any():
                raise ValueError("negative")

    spec = describe({"out": [Checked(array(2) ** 2)]})
    with pytest.raises(DualgraphError) as caught:
        spec.unflatten([-np.ones(2)])
    assert str(caught.value).startswith("unflatten: ['out'][0]: rebuilding a ")
    cause = caught.value.__cause__
    assert isinstance(cause, ValueError)
    frames = traceback.extract_tb(cause.__traceback__)
    generated = [frame for frame in frames if frame.filename.startswith("<dualgraph spec ")]
    assert generated and "# ['out'][0]" in (generated[0].line or "")


def test_flatten_returns_none_on_a_structure_mismatch_instead_of_raising(
    spec_of: Describe,
) -> None:
    program = spec_of((array(2), None))._program
    assert program.flatten([array(2), None]) is None
    assert program.flatten((array(2),)) is None
    assert program.flatten((array(2), 0)) is None
    assert program.flatten((None, None)) is None


def test_only_check_compares_shapes_and_dtypes(spec_of: Describe) -> None:
    program = spec_of([array(2)])._program
    wrong = [array(3, dtype="float16")]
    assert program.flatten(wrong) == wrong
    assert program.check(wrong) is None


def test_container_types_are_matched_exactly(spec_of: Describe) -> None:
    # A namedtuple is a tuple subclass, an OrderedDict a dict subclass: neither is accepted.
    assert spec_of((None, 1))._program.flatten(Attention(None, 1)) is None
    assert spec_of({"a": None})._program.flatten(collections.OrderedDict(a=None)) is None


def test_dict_keys_are_matched_as_a_set(spec_of: Describe) -> None:
    program = spec_of({"a": None, "b": None})._program
    assert program.flatten({"b": None, "a": None}) == []
    assert program.flatten({"a": None}) is None
    assert program.flatten({"a": None, "b": None, "c": None}) is None


def test_ordered_dict_keys_are_matched_in_order(spec_of: Describe) -> None:
    program = spec_of(collections.OrderedDict(b=None, a=None))._program
    assert program.flatten(collections.OrderedDict(b=None, a=None)) == []
    assert program.flatten(collections.OrderedDict(a=None, b=None)) is None


@pytest.mark.parametrize(
    ("constant", "rejected"),
    [(3, 3.0), (True, 1), ("vit", "deit"), (float("nan"), 0.0), (float("-inf"), float("inf"))],
    ids=["int", "bool", "str", "nan", "inf"],
)
def test_constants_are_matched_by_type_and_value(
    constant: Any, rejected: Any, spec_of: Describe
) -> None:
    program = spec_of(constant)._program
    assert program.flatten(constant) == []
    assert program.flatten(rejected) is None


def test_unflatten_rebuilds_a_one_element_tuple_as_a_tuple(spec_of: Describe) -> None:
    assert spec_of((array(2),))._program.unflatten(["x"]) == ("x",)


def test_unflatten_rebuilds_empty_containers(spec_of: Describe) -> None:
    tree = ((), [], {}, collections.OrderedDict())
    rebuilt = spec_of(tree)._program.unflatten([])
    assert rebuilt == tree
    assert type(rebuilt[3]) is collections.OrderedDict


def test_unflatten_builds_new_lists_and_dicts_every_time(spec_of: Describe) -> None:
    program = spec_of(([None], {"a": None}))._program
    first, second = program.unflatten([]), program.unflatten([])
    assert first[0] is not second[0] and first[1] is not second[1]


def test_unflatten_rebuilds_namedtuples_and_dataclasses(spec_of: Describe) -> None:
    tree = EncoderOutput(hidden=Attention(weights=array(2), bias=None), pooled=-0.0)
    rebuilt = spec_of(tree)._program.unflatten(["w"])
    assert rebuilt == EncoderOutput(hidden=Attention(weights="w", bias=None), pooled=-0.0)
    assert str(rebuilt.pooled) == "-0.0"


def test_unflatten_keeps_the_users_dict_key_order(spec_of: Describe) -> None:
    rebuilt = spec_of({"zeta": array(2), "alpha": array(3)})._program.unflatten(["a", "z"])
    assert list(rebuilt.items()) == [("zeta", "z"), ("alpha", "a")]


def test_specs_of_equal_trees_share_one_program(monkeypatch: pytest.MonkeyPatch) -> None:
    first = describe({"hidden": array(2), "aux": None, "n": 3})
    generated: list[object] = []
    generate = compile_module._generate
    monkeypatch.setattr(compile_module, "_generate", lambda *a: generated.append(a) or generate(*a))
    again = describe({"hidden": array(2), "aux": None, "n": 3})
    assert again._program is first._program and not generated
    reordered = describe({"aux": None, "hidden": array(2), "n": 3})
    assert reordered._program is not first._program and generated  # rebuilt in its key order
    assert list(reordered.unflatten(["h"])) == ["aux", "hidden", "n"]
    assert list(again.unflatten(["h"])) == ["hidden", "aux", "n"]


@pytest.mark.parametrize(
    ("tree", "sibling"),
    [
        ((array(2), 1), (array(2), True)),
        ((array(2), 1), (array(2), 1.0)),
        ((array(2), 0.0), (array(2), -0.0)),
        ({1: array(2)}, {"1": array(2)}),
        ((array(2), None), [array(2), None]),
        (collections.OrderedDict(a=array(2), b=None), {"a": array(2), "b": None}),
        ((array(2),), (array(3),)),
    ],
    ids=["int-bool", "int-float", "zero-sign", "key-type", "tuple-list", "ordered", "shape"],
)
def test_trees_that_differ_get_programs_of_their_own(tree: Any, sibling: Any) -> None:
    spec, other = describe(tree), describe(sibling)
    assert spec._program is not other._program
    for source, described in ((tree, spec), (sibling, other)):
        rebuilt = described._program.unflatten(described._program.flatten(source))
        assert_same_tree(rebuilt, source)
        assert repr(rebuilt) == repr(source)  # constants of their own type, keys as given


def test_classes_of_the_same_name_get_programs_of_their_own() -> None:
    def point_class() -> type:
        return collections.namedtuple("Point", ["x", "y"])

    first, second = point_class(), point_class()
    spec, other = describe(first(array(2), None)), describe(second(array(2), None))
    assert spec._program is not other._program
    assert type(other.unflatten(["x"])) is second
    assert other._program.flatten(first("x", None)) is None


def test_a_shared_program_goes_with_the_last_spec_using_it() -> None:
    specs = [describe({"shared_program_under_test": array(2)}) for _ in range(3)]
    filename = specs[0]._program._code.filename  # type: ignore[union-attr]
    del specs[:2]
    gc.collect()
    describe({"compiled_meanwhile": array(2)})
    assert filename in linecache.cache  # one spec still uses it
    del specs
    gc.collect()
    describe({"compiled_after": array(2)})
    assert filename not in linecache.cache
