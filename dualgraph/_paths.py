"""Typed leaf paths: how each child is reached, shown as ``[1]['aux_loss']`` or ``args[0].mask``.

A path is a tuple of entries from a tree's root: :class:`Index` (a tuple or list position),
:class:`Key` (a mapping key) and :class:`Attr` (a namedtuple or dataclass field). Messages show
a path as the Python accessor expression; the root itself shows as ``<root>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._leaves import MAX_INT_BITS, int_size

__all__ = ["Attr", "Index", "Key", "PathEntry", "format_path", "show_path"]


@dataclass(frozen=True, slots=True)
class Index:
    """A position in a tuple or list: ``[0]``.

    >>> str(Index(0))
    '[0]'
    """

    index: int

    def __str__(self) -> str:
        return f"[{self.index}]"


@dataclass(frozen=True, slots=True)
class Key:
    """A key of a dict or ``OrderedDict`` (``str`` or ``int``): ``['mask']``.

    >>> str(Key("mask")), str(Key(3))
    ("['mask']", '[3]')
    """

    key: str | int

    def __str__(self) -> str:
        key = self.key
        # an unexpected key, too long to print (see _nodes.clip)
        if type(key) is int and key.bit_length() > MAX_INT_BITS:
            return f"[<{int_size(key)}>]"
        try:
            return f"[{key!r}]"
        except Exception:  # a key a caller passed (an unexpected entry) that cannot print
            return f"[<{type(self.key).__name__}>]"


@dataclass(frozen=True, slots=True)
class Attr:
    """A field of a namedtuple or dataclass: ``.hidden``.

    >>> str(Attr("hidden"))
    '.hidden'
    """

    name: str

    def __str__(self) -> str:
        return f".{self.name}"


#: One step of a path.
PathEntry = Index | Key | Attr


def format_path(entries: tuple[PathEntry, ...], /, root: str = "") -> str:
    """The accessor expression of a path, after ``root`` (e.g. ``"args"``).

    >>> format_path((Index(1), Key("out"), Attr("aux_loss")))
    "[1]['out'].aux_loss"
    >>> format_path((Key("mask"),), root="kwargs")
    "kwargs['mask']"
    """
    return root + "".join([str(entry) for entry in entries])


def show_path(path: str, /) -> str:
    """A path for messages: the tree's root has the empty path and shows as ``<root>``.

    >>> show_path(""), show_path("[0]")
    ('<root>', '[0]')
    """
    return path or "<root>"
