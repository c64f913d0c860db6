"""Where two leaf lists differ in more than array shapes: kinds, constants, paths."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .._nodes import show_constant
from .._spec import LeafSpec

__all__ = ["difference_but_shapes"]


def difference_but_shapes(
    expected: Sequence[LeafSpec], found: Sequence[LeafSpec]
) -> tuple[str, str, str] | None:
    """Where two leaf lists first differ in more than array shapes, as ``(path, expected,
    found)`` with each side shown; None where they differ in shapes only.

    >>> from dualgraph import describe
    >>> difference_but_shapes(describe((1, None)).leaves, describe((1, 2.0)).leaves)
    ('[1]', 'None', 'float 2.0')
    """
    for a, b in itertools.zip_longest(expected, found):
        if a is not None and b is not None and a.path != b.path:
            b = None  # nothing at a's path
        if (
            a is None
            or b is None
            or a.kind != b.kind
            or (a.kind == "const" and repr(a.value) != repr(b.value))
        ):
            return (a or b).path, _show_leaf(a), _show_leaf(b)
    return None


def _show_leaf(leaf: LeafSpec | None) -> str:
    if leaf is None:
        return "nothing"
    if leaf.kind == "array":
        return f"a {leaf.dtype} tensor"
    if leaf.kind == "const":
        return f"{type(leaf.value).__name__} {show_constant(leaf.value)}"  # type: ignore[arg-type]
    return "None"
