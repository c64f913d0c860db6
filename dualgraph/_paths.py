"""Readable leaf paths such as ``[1]['aux_loss']`` or ``args[0].mask``."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

__all__ = ["EntryKind", "join_path", "show_path"]

#: How a child is reached from its container: by position, by mapping key, or by field name.
EntryKind = Literal["index", "key", "attr"]


def join_path(parent: str, entry: Hashable, kind: EntryKind) -> str:
    """The path of a child reached from ``parent`` through ``entry``.

    >>> join_path(join_path("", 1, "index"), "aux_loss", "key")
    "[1]['aux_loss']"
    >>> join_path("args[0]", "mask", "attr")
    'args[0].mask'
    """
    if kind == "attr":
        return f"{parent}.{entry}"
    if kind == "key":
        return f"{parent}[{entry!r}]"
    return f"{parent}[{entry}]"


def show_path(path: str) -> str:
    """A path for messages: the tree's root has the empty path and shows as ``<root>``.

    >>> show_path(""), show_path("[0]")
    ('<root>', '[0]')
    """
    return path or "<root>"
