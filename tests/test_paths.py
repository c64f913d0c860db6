"""Typed path entries, and paths shown as Python accessor expressions."""

from __future__ import annotations

import dataclasses

import pytest
from trees import TREES, leaf_at

import dualgraph
from dualgraph import Attr, Index, Key, describe
from dualgraph._paths import PathEntry, format_path, show_path


@pytest.mark.parametrize(
    ("entry", "shown"),
    [
        (Index(0), "[0]"),
        (Key("mask"), "['mask']"),
        (Key(3), "[3]"),
        (Key("it's"), '["it\'s"]'),
        (Attr("hidden"), ".hidden"),
    ],
    ids=["index", "str-key", "int-key", "quoted-key", "attr"],
)
def test_each_entry_shows_as_its_accessor(entry: PathEntry, shown: str) -> None:
    assert str(entry) == shown


def test_entries_of_different_kinds_differ_even_when_they_show_alike() -> None:
    assert str(Index(1)) == str(Key(1))
    assert Index(1) != Key(1)


def test_entries_are_frozen_and_hashable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Index(0).index = 1  # type: ignore[misc]
    assert len({Index(0), Index(0), Key(0)}) == 2


def test_format_path_joins_entries_after_a_root() -> None:
    entries = (Index(1), Key("out"), Attr("aux_loss"))
    assert format_path(entries) == "[1]['out'].aux_loss"
    assert format_path(entries, root="args") == "args[1]['out'].aux_loss"
    assert format_path(()) == ""


def test_show_path_names_the_root() -> None:
    assert show_path("") == "<root>"
    assert show_path("kwargs['mask']") == "kwargs['mask']"


@pytest.mark.parametrize("name", list(TREES))
def test_leaf_entries_reach_the_leaf_and_show_as_its_path(name: str) -> None:
    tree = TREES[name]()
    for leaf in describe(tree).leaves:
        assert format_path(leaf.entries) == leaf.path
        found = tree
        for entry in leaf.entries:
            if isinstance(entry, Index):
                found = found[entry.index]
            elif isinstance(entry, Key):
                found = found[entry.key]
            else:
                found = getattr(found, entry.name)
        assert found is leaf_at(tree, leaf.path)


def test_entries_tell_an_int_key_from_an_index() -> None:
    leaves = describe(({1: None}, [None, None])).leaves
    assert leaves[0].entries == (Index(0), Key(1))
    assert leaves[2].entries == (Index(1), Index(1))


def test_path_entries_are_exported() -> None:
    assert (dualgraph.Index, dualgraph.Key, dualgraph.Attr) == (Index, Key, Attr)


def test_a_key_that_cannot_print_shows_its_type() -> None:
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert str(Key(10**5000)) == "[<an int of 16610 bits>]"  # never converted to text
    assert format_path((Index(0), Key(Unprintable())), "kwargs") == "kwargs[0][<Unprintable>]"  # type: ignore[arg-type]
