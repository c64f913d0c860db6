"""Leaf paths: Python accessor expressions, with the root shown as ``<root>`` in messages."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from dualgraph._paths import EntryKind, join_path, show_path


@pytest.mark.parametrize(
    ("entry", "kind", "path"),
    [
        (0, "index", "args[0]"),
        ("mask", "key", "args['mask']"),
        (3, "key", "args[3]"),
        ("it's", "key", 'args["it\'s"]'),
        ("hidden", "attr", "args.hidden"),
    ],
    ids=["index", "str-key", "int-key", "quoted-key", "attr"],
)
def test_join_path_writes_the_accessor_for_each_entry_kind(
    entry: Hashable, kind: EntryKind, path: str
) -> None:
    assert join_path("args", entry, kind) == path


def test_join_path_from_the_root_starts_with_the_accessor() -> None:
    assert join_path("", 1, "index") == "[1]"
    assert join_path("", "x", "attr") == ".x"


def test_join_path_composes() -> None:
    path = join_path(join_path(join_path("", 1, "index"), "out", "key"), "aux_loss", "attr")
    assert path == "[1]['out'].aux_loss"


def test_show_path_names_the_root() -> None:
    assert show_path("") == "<root>"


def test_show_path_leaves_other_paths_unchanged() -> None:
    assert show_path("kwargs['mask']") == "kwargs['mask']"
