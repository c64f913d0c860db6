"""Spec documents: JSON in, validated nodes out (and back), within fixed bounds.

A document is a small object (format, version, and one list of rows per tree); a tree is its
nodes in pre-order, one flat JSON list per node, e.g. ``["tuple",2]``, ``["array","float32",
[2,3],true]``, ``["none"]``. The format never nests, so reading it never recurses, whatever the
depth of the tree. Every row is checked by its node class; anything malformed is a
:class:`~dualgraph.DualgraphError` naming the path of the row where it was found.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ._containers import CONTAINER_KINDS
from ._errors import DualgraphError
from ._nodes import (
    MAX_INT_BITS,
    MAX_NODES,
    ArrayLeaf,
    ConstLeaf,
    Node,
    NodeError,
    NoneLeaf,
    clip,
    clip_text,
    is_instance,
)
from ._paths import PathEntry, format_path, show_path

__all__ = [
    "MAX_INT_CHARS",
    "MAX_JSON_CHARS",
    "next_entries",
    "read_document",
    "read_tree",
    "write_document",
]

#: The longest document :func:`read_document` parses (characters).
MAX_JSON_CHARS = 256 * 2**20

_NODE_KINDS: tuple[type[Node], ...] = (NoneLeaf, ConstLeaf, ArrayLeaf, *CONTAINER_KINDS)
_NODE_CLASSES: dict[str, type[Node]] = {cls.tag: cls for cls in _NODE_KINDS}


def write_document(kind: str, version: int, trees: dict[str, list[list[Any]]]) -> str:
    """The canonical JSON text: sorted keys, no spaces, ASCII only."""
    document: dict[str, Any] = {"format": kind, "version": version, **trees}
    try:
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as error:  # e.g. an int beyond this interpreter's str-conversion limit
        raise DualgraphError(f"cannot write the {kind} as JSON: {error}") from None
    if len(text) > MAX_JSON_CHARS:  # what is written must read back (long str constants, keys)
        name = kind.rpartition(".")[2]
        raise DualgraphError(
            f"cannot write the {kind} as JSON: {len(text)} characters, over the limit of "
            f"{MAX_JSON_CHARS} that {name}.from_json reads"
        )
    return text


def read_document(text: Any, kind: str, version: int, trees: Sequence[str]) -> dict[str, Any]:
    """Parse ``text`` and check its format, version and keys; ``trees`` name its row lists."""
    name = kind.rpartition(".")[2]
    if is_instance(text, (bytes, bytearray, memoryview)):
        try:
            size = text.nbytes if is_instance(text, memoryview) else len(text)
            # UTF-8 takes at most 4 bytes a character: more bytes than that are over the limit
            # in any case, refused before they are copied and decoded whole
            if size > 4 * MAX_JSON_CHARS:
                raise DualgraphError(
                    f"{name} JSON of {size} bytes is over the limit of {MAX_JSON_CHARS} "
                    "characters (UTF-8: 4 bytes a character at most)"
                )
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as error:
            raise DualgraphError(f"not a {name} JSON document: not UTF-8 ({error})") from None
        except DualgraphError:
            raise
        except Exception as error:  # a released memoryview, one of a buffer that went away
            raise DualgraphError(
                f"a {name} JSON document could not be read from the "
                f"{type(text).__name__} ({type(error).__name__}: {clip_text(error)})"
            ) from None
    if type(text) is not str:
        raise DualgraphError(f"a {name} JSON document is a str, got {type(text).__name__}")
    if len(text) > MAX_JSON_CHARS:
        raise DualgraphError(
            f"{name} JSON of {len(text)} characters is over the limit of {MAX_JSON_CHARS}"
        )
    try:
        document = json.loads(
            text, object_pairs_hook=_without_repeated_keys, parse_int=_bounded_int
        )
    except DualgraphError:
        raise
    except (ValueError, RecursionError, MemoryError) as error:
        raise DualgraphError(f"not a {name} JSON document: {clip_text(error, 200)}") from None
    if type(document) is _RepeatedKeys:
        raise DualgraphError(
            f"malformed {name} JSON: the key {clip(document.repeated)} appears twice in the "
            "document"
        )
    if type(document) is not dict or document.get("format") != kind:
        raise DualgraphError(f"not a {name} JSON document (format must be {kind!r})")
    found = document.get("version")
    if type(found) is not int or found != version:
        raise DualgraphError(
            f"{name} JSON version {clip(found)} is not supported "
            f"(this dualgraph reads version {version})"
        )
    expected = {"format", "version", *trees}
    for key in document:
        if key not in expected:
            raise DualgraphError(f"malformed {name} JSON: unknown key {clip(key)}")
    for key in trees:
        if key not in document:
            raise DualgraphError(f"malformed {name} JSON: {key!r} is missing")
    # What is read must write back: the canonical text escapes every non-ASCII character (6
    # characters, 12 beyond the BMP), so a document within the limit can be written over it.
    if len(text) * 12 > MAX_JSON_CHARS and not text.isascii():
        written = _canonical_length(document)
        if written > MAX_JSON_CHARS:
            raise DualgraphError(
                f"{name} JSON written back (non-ASCII characters as \\u escapes) would have "
                f"{written} characters, over the limit of {MAX_JSON_CHARS}: {name}.to_json could "
                "not write what it read"
            )
    return document


def _canonical_length(document: dict[str, Any]) -> int:
    """The length of ``document`` as :func:`write_document` writes it (0 if it cannot be
    written: its rows are then refused as malformed)."""
    try:
        return len(json.dumps(document, sort_keys=True, separators=(",", ":")))
    except (ValueError, RecursionError):
        return 0


#: The most characters of an int in a document: any int of at most MAX_INT_BITS, signed.
MAX_INT_CHARS = len(str(-(2**MAX_INT_BITS)))


def _bounded_int(text: str) -> int:
    """An int of the document, refused before it is converted if it is longer than any a spec
    takes: converting n digits takes time quadratic in n, and a program may have lifted the
    interpreter's limit (``sys.set_int_max_str_digits(0)``)."""
    if len(text) > MAX_INT_CHARS:
        raise ValueError(  # json.loads passes it on: read_document words it
            f"an int of {len(text)} digits is over the {MAX_INT_BITS}-bit limit of a spec"
        )
    return int(text)


class _RepeatedKeys(dict[str, Any]):
    """A JSON object that names a key twice. No node row holds an object (each checks the exact
    types of its values), so one inside a tree is refused with its row's path; the document
    itself is refused by :func:`read_document`."""

    repeated: str

    def __repr__(self) -> str:
        return f"<an object naming the key {clip(self.repeated)} twice>"


def _without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        marked = _RepeatedKeys(document)
        marked.repeated = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        return marked
    return document


def read_tree(rows: Any, what: str, root: str = "", key: str | None = None) -> tuple[Node, ...]:
    """The nodes of a tree's rows (pre-order), each validated; ``root`` starts error paths, and
    ``key`` (``root``, or ``"tree"`` where it is empty) names the document's list of the rows,
    where an error says which row it found wrong."""
    key = key if key is not None else root or "tree"
    if type(rows) is not list or not rows:
        raise _malformed(
            what, root, [], f"a tree is a non-empty list of node rows, got {clip(rows)}"
        )
    if len(rows) > MAX_NODES:
        raise _malformed(
            what, root, [], f"a tree has at most {MAX_NODES} nodes, this one {len(rows)}"
        )
    nodes: list[Node] = []
    append = nodes.append
    # Equal rows make one node: looked up by repr, which tells JSON values apart by type too.
    # (Not by the node itself: ints hash by value modulo 2**61 - 1, so a document could make
    # any number of nodes of one hash, and a dict of n of them takes time quadratic in n; str
    # hashes are randomized per process.)
    by_repr: dict[str, Node] = {}
    expected = 1  # how many more nodes the rows must hold
    count = len(rows)
    for index, row in enumerate(rows):
        if not expected:
            message = f"{count - index} rows follow the end of the tree"
            raise _malformed(what, root, nodes, message, key)
        try:
            text = repr(row)
        except RecursionError:
            text = ""
        node = by_repr.get(text) if text else None
        if node is None:
            node = _node_of_row(row, count - index - expected, what, root, nodes, key)
            if text:
                by_repr[text] = node
        elif node.arity > count - index - expected:
            node = _node_of_row(row, count - index - expected, what, root, nodes, key)
        append(node)
        expected += node.arity - 1
    assert not expected  # each row's children were checked to fit in the rows after it
    return tuple(nodes)


def _node_of_row(
    row: Any, max_arity: int, what: str, root: str, nodes: list[Node], key: str
) -> Node:
    if type(row) is not list or not row or type(row[0]) is not str:
        message = f"a node row is a list starting with its kind, got {clip(row)}"
        raise _malformed(what, root, nodes, message, key)
    cls = _NODE_CLASSES.get(row[0])
    if cls is None:
        raise _malformed(what, root, nodes, f"unknown node kind {clip(row[0])}", key)
    try:
        node: Node = cls.from_row(row, max_arity)
    except NodeError as error:
        raise _malformed(what, root, nodes, str(error), key) from None
    except Exception as error:  # a check above missed a case: still a malformed row
        message = f"unreadable row {clip(row)} ({type(error).__name__}: {clip_text(error)})"
        raise _malformed(what, root, nodes, message, key) from None
    return node


def _malformed(
    what: str, root: str, nodes: Sequence[Node], message: str, key: str | None = None
) -> DualgraphError:
    """The error for the row after ``nodes``, naming that row's path in the tree and, given the
    ``key`` of the document's list of rows, where the row stands in that list: a tree path such
    as ``[1]`` is no index into the rows (``tree[1]`` is the row of another node)."""
    path = show_path(format_path(next_entries(nodes), root))
    row = "" if key is None else f" (row {len(nodes)} of the document's {_quoted(key)} list)"
    return DualgraphError(f"malformed {what} JSON at {path}: {message}{row}")


def _quoted(key: str) -> str:
    """A document's key as JSON writes it (``"tree"``), clipped."""
    return clip_text(json.dumps(key), 40)


def next_entries(nodes: Sequence[Node]) -> tuple[PathEntry, ...]:
    """The path of the node that comes after ``nodes`` (a pre-order prefix of a tree).

    Once the tree is complete this is the path of its innermost unfinished container's
    position, so for a tree that ends early it names where the rows stop.
    """
    # [entries of the container's children, how many of them have come]
    open_containers: list[list[Any]] = []
    for node in nodes:
        if open_containers:
            open_containers[-1][1] += 1
        if node.arity:
            open_containers.append([node.entries, 0])  # type: ignore[attr-defined]
        while open_containers and open_containers[-1][1] == len(open_containers[-1][0]):
            open_containers.pop()
    if not open_containers:
        return ()
    # Each open container is inside its last child so far, except the innermost one.
    path = [entries[done - 1] for entries, done in open_containers[:-1]]
    entries, done = open_containers[-1]
    return (*path, entries[done])
