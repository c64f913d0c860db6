"""A spec's hot-path functions: flatten, check and unflatten, generated or walked.

A spec knows its whole tree when it is made, so for a tree of up to :data:`COMPILE_LIMIT` nodes
it writes straight-line code once: a type (and length or key) test per container, direct
indexing per child, a test per leaf, and one statement per container to rebuild it. The code
never nests, whatever the tree's depth; constants, keys, field names and classes are bound
values in the functions' namespace, never pasted into the source. Each statement carries its
node's path as a comment, and the source is registered in :mod:`linecache` under a filename of
its own, so a traceback through it shows the line. A larger tree is run by a loop over its
nodes instead (the same results, without the cost of compiling a huge function).

Specs of equal nodes (as a capture describes the same call for each of its layers) share one
program, made for the first of them and kept while any of them lives.

``flatten`` and ``check`` return ``None`` on a mismatch; the spec then explains it (slow path).
"""

from __future__ import annotations

import hashlib
import linecache
import weakref
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

import numpy as np

from ._containers import NamedContainer
from ._leaves import same_float, signature_of
from ._nodes import ArrayLeaf, ConstLeaf, Container, Leaf, Node

__all__ = ["COMPILE_LIMIT", "Program", "compile_program"]

#: The most nodes a spec generates code for; larger specs walk their nodes in a loop.
COMPILE_LIMIT = 1000
_COMMENT_LENGTH = 100

Flatten = Callable[[Any], "list[Any] | None"]


class Program:
    """The hot-path functions of one spec (see the module docstring)."""

    __slots__ = ("__weakref__", "_code", "check", "flatten", "source", "unflatten")

    def __init__(
        self,
        flatten: Flatten,
        check: Flatten,
        unflatten: Callable[[Sequence[Any]], Any],
        source: str | None,
        code: _Code | None = None,
    ) -> None:
        self.flatten = flatten
        self.check = check
        self.unflatten = unflatten
        self.source = source
        self._code = code  # keeps the linecache entry of the source alive


def compile_program(
    nodes: Sequence[Node], paths: Callable[[], Sequence[str]], *, walk: bool = False
) -> Program:
    """The functions for ``nodes`` (pre-order, children in flatten order); generated code up to
    :data:`COMPILE_LIMIT` nodes. ``paths()`` gives each node's path, for comments. ``walk``: a
    loop over the nodes whatever their number (a spec used once: generating code costs more).
    """
    if walk or len(nodes) > COMPILE_LIMIT:
        return _walker(nodes)
    key = _program_key(nodes)
    program = _PROGRAMS.get(key)
    if program is None:
        program = _PROGRAMS[key] = _generate(nodes, paths())
    return program


#: The programs of the specs alive, by their nodes (see :func:`_program_key`).
_PROGRAMS: weakref.WeakValueDictionary[tuple[Any, ...], Program] = weakref.WeakValueDictionary()


def _program_key(nodes: Sequence[Node]) -> tuple[Any, ...]:
    """What the generated code of ``nodes`` depends on: the nodes (which compare by value: a
    constant with its type, an array by shape and dtype, a mapping by its keys, a class by
    identity), and the fields of each class (read from the class, not part of its node's key)."""
    fields = tuple(node.fields for node in nodes if isinstance(node, NamedContainer))
    return (tuple(nodes), fields)


# -- generated code ------------------------------------------------------------------------------


class _Code:
    """A compiled source and its linecache entry, shared by the specs with the same source."""

    __slots__ = ("__weakref__", "code", "filename")

    def __init__(self, source: str) -> None:
        digest = hashlib.sha1(source.encode("utf-8", "backslashreplace")).hexdigest()[:16]
        self.filename = f"<dualgraph spec {digest}>"
        self.code: CodeType = compile(source, self.filename, "exec")
        lines = [line + "\n" for line in source.splitlines()]
        linecache.cache[self.filename] = (len(source), None, lines, self.filename)
        _LIVE[self.filename] = self
        # Not popped by the finalizer itself: it may run (a garbage collection) while
        # linecache.checkcache walks a list of the cache's keys, which then fails on the key.
        weakref.finalize(self, _RETIRED.append, self.filename)


_CODES: weakref.WeakValueDictionary[str, _Code] = weakref.WeakValueDictionary()
_LIVE: weakref.WeakValueDictionary[str, _Code] = weakref.WeakValueDictionary()
#: Filenames whose code is gone; their linecache entries go at the next compile.
_RETIRED: list[str] = []


def _code_of(source: str) -> _Code:
    _forget_retired()
    code = _CODES.get(source)
    if code is None:
        code = _CODES[source] = _Code(source)
    return code


def _forget_retired() -> None:
    """Drop the linecache entries of codes that are gone (unless compiled again since)."""
    while _RETIRED:
        try:
            filename = _RETIRED.pop()
        except IndexError:  # another thread took the last one since the test above
            break
        if filename not in _LIVE:
            linecache.cache.pop(filename, None)


def _comment(path: str) -> str:
    """A path as a comment: printable ASCII only (no newline can end it), clipped."""
    text = ascii(path or "<root>")[1:-1]
    if len(text) > _COMMENT_LENGTH:
        text = "..." + text[-(_COMMENT_LENGTH - 3) :]
    return "  # " + text


class _Writer:
    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {
            "_signature": signature_of,
            "_same_float": same_float,
            "_ndarray": np.ndarray,
            "_getattr": getattr,
        }

    def bind(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name


def _structure(
    nodes: Sequence[Node], paths: Sequence[str], writer: _Writer, *, full: bool
) -> tuple[list[str], list[str]]:
    """Statements testing ``t`` against ``nodes``, and the array variables in flatten order."""
    lines: list[str] = []
    arrays: list[str] = []
    pending: list[str] = ["t"]  # the variable of each node still to come; the top is next
    for index, node in enumerate(nodes):
        var = pending.pop()
        comment = _comment(paths[index])
        if isinstance(node, Leaf):
            if isinstance(node, ArrayLeaf):
                arrays.append(var)
            lines.append(f"if {node.guard(var, writer.bind, full=full)}: return None{comment}")
            continue
        assert isinstance(node, Container)
        lines.append(f"if {node.guard(var, writer.bind)}: return None{comment}")
        children = [f"v{index}_{j}" for j in range(node.arity)]
        for j, child in enumerate(children):
            lines.append(f"{child} = {node.child(var, j, writer.bind)}")
        pending.extend(reversed(children))
    return lines, arrays


def _rebuild(nodes: Sequence[Node], paths: Sequence[str], writer: _Writer) -> tuple[list[str], str]:
    """Statements rebuilding the tree from ``a`` (innermost containers first), and its name."""
    lines: list[str] = []
    values: list[str] = []
    count = sum(isinstance(node, ArrayLeaf) for node in nodes)
    for index in range(len(nodes) - 1, -1, -1):
        node = nodes[index]
        if isinstance(node, ArrayLeaf):
            count -= 1
            values.append(f"a[{count}]")
        elif isinstance(node, ConstLeaf):
            values.append(writer.bind(node.value, "c"))
        elif isinstance(node, Leaf):
            values.append("None")
        else:
            assert isinstance(node, Container)
            parts = [values.pop() for _ in range(node.arity)]
            source = node.rebuild_source(parts, writer.bind)
            lines.append(f"r{index} = {source}{_comment(paths[index])}")
            values.append(f"r{index}")
    return lines, values[0]


def _generate(nodes: Sequence[Node], paths: Sequence[str]) -> Program:
    writer = _Writer()
    flatten_lines, flatten_arrays = _structure(nodes, paths, writer, full=False)
    check_lines, check_arrays = _structure(nodes, paths, writer, full=True)
    rebuild_lines, rebuilt = _rebuild(nodes, paths, writer)
    source = "\n".join(
        [
            "def flatten(t):",
            *(f"    {line}" for line in flatten_lines),
            f"    return [{', '.join(flatten_arrays)}]",
            "def check(t):",
            *(f"    {line}" for line in check_lines),
            f"    return [{', '.join(check_arrays)}]",
            "def unflatten(a):",
            *(f"    {line}" for line in rebuild_lines),
            f"    return {rebuilt}",
            "",
        ]
    )
    code = _code_of(source)
    namespace = writer.namespace
    exec(code.code, namespace)
    return Program(namespace["flatten"], namespace["check"], namespace["unflatten"], source, code)


# -- the walker for large trees ------------------------------------------------------------------

_CONTAINER, _NONE, _CONST, _ARRAY = range(4)  # Node.op


def _walker(nodes: Sequence[Node]) -> Program:
    """The functions as one loop over the nodes, for trees too large to generate code for."""

    num_arrays = sum(node.op == _ARRAY for node in nodes)

    def walk(tree: Any, full: bool) -> list[Any] | None:
        arrays: list[Any] = []
        stack = [tree]
        pop, extend, found = stack.pop, stack.extend, arrays.append
        for node in nodes:
            obj = pop()
            op = node.op
            if op == _CONTAINER:
                children = node.children_of(obj)  # type: ignore[attr-defined]
                if children is None:
                    return None
                extend(reversed(children))
            elif op == _ARRAY:
                if obj is None or (full and not node.matches(obj)):  # type: ignore[attr-defined]
                    return None
                found(obj)
            elif not node.matches(obj):  # type: ignore[attr-defined]
                return None
        return arrays

    def flatten(tree: Any) -> list[Any] | None:
        return walk(tree, False)

    def check(tree: Any) -> list[Any] | None:
        return walk(tree, True)

    def unflatten(arrays: Sequence[Any]) -> Any:
        values: list[Any] = []
        push = values.append
        count = num_arrays
        for node in reversed(nodes):
            op = node.op
            if op == _CONTAINER:
                start = len(values) - node.arity
                parts = values[start:]
                del values[start:]
                parts.reverse()
                push(node.rebuild(parts))  # type: ignore[attr-defined]
            elif op == _ARRAY:
                count -= 1
                push(arrays[count])
            elif op == _CONST:
                push(node.value)  # type: ignore[attr-defined]
            else:
                push(None)
        return values[0]

    return Program(flatten, check, unflatten, None)
