"""The key order of a call's dicts: what a spec lets vary, and a compiled program cannot.

A spec matches a dict whatever its key order (its leaves flatten by sorted key), but a function
traced or captured once saw the sample's order, and whatever follows that order (``d.values()``,
a concatenation or a sum over the dict) is fixed in the program: another order would give the
plain function another result than the program. :class:`KeyOrders` records where each plain dict
of two keys or more is, with its keys in the sample's order, and refuses a call whose dict comes
in another order, naming its path. The keyword arguments themselves bind by name, except those
a function collects in its ``**kwargs``: given the function, their order is kept too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ._call import CallSpec
from ._containers import DataclassNode, DictNode, NamedTupleNode
from ._errors import SpecMismatchError
from ._nodes import Node
from ._paths import Attr, Index, Key, PathEntry, format_path
from ._spec import TreeSpec

__all__ = ["KeyOrders"]

#: How to reach a child from its parent: (read as an attribute?, the key, index or name).
_Step = tuple[bool, Any]


class KeyOrders:
    """The plain dicts of a call (two keys or more, the kwargs themselves left out) and their
    keys in the sample's order, and the keywords ``fn`` collects in its ``**kwargs`` (when
    given); :meth:`check` refuses a call with another order.

    Made once from the call's spec; a call without such dicts costs nothing to check.

    >>> import numpy as np
    >>> from dualgraph import describe_call
    >>> orders = KeyOrders(describe_call(({"b": np.ones(1), "a": np.ones(1)},)))
    >>> orders.check(({"a": np.ones(1), "b": np.ones(1)},), {})
    Traceback (most recent call last):
    ...
    dualgraph.SpecMismatchError: args[0]: a dict with its keys in the order ['a', 'b'], ...
    """

    __slots__ = ("_collected", "_dicts")

    def __init__(self, call_spec: CallSpec, /, fn: Callable[..., Any] | None = None) -> None:
        self._dicts = (
            *_dicts_of(call_spec.args_spec, "args", skip_root=False),
            *_dicts_of(call_spec.kwargs_spec, "kwargs", skip_root=True),
        )
        keywords = call_spec.kwargs_spec._nodes[0].keys  # type: ignore[attr-defined]
        collected = _collected_keywords(fn, keywords) if fn is not None else ()
        self._collected = collected if len(collected) > 1 else ()

    def __bool__(self) -> bool:
        return bool(self._dicts or self._collected)

    def check(self, args: Any, kwargs: Any, /) -> None:
        """Raise :class:`~dualgraph.SpecMismatchError` naming the first dict of ``(args,
        kwargs)`` whose keys come in another order than the sample's; the call must already
        match the spec otherwise (every step on the way is there)."""
        found = self.difference(args, kwargs)
        if found is None:
            return
        path, keys, expected = found
        if path == "kwargs":
            raise SpecMismatchError(
                f"kwargs: the keywords {list(keys)!r} go to the function's **kwargs in "
                f"this order, compiled for the order {list(expected)!r}; whatever "
                "follows their order would not follow this call's; pass them in the "
                "compiled order",
                path="kwargs",
            )
        raise SpecMismatchError(
            f"{path}: a dict with its keys in the order {list(keys)!r}, compiled for the "
            f"order {list(expected)!r}; the program runs the function as it was traced, so "
            "whatever follows the key order (d.values(), a concatenation or a sum over "
            "the dict) would not follow this call's; pass the keys in the compiled order",
            path=path,
        )

    def difference(
        self, args: Any, kwargs: Any, /
    ) -> tuple[str, tuple[Any, ...], tuple[Any, ...]] | None:
        """``(path, the call's keys, the sample's keys)`` of the first order that differs, or
        ``None``; the path is ``kwargs`` for the keywords the function collects. Each adapter
        words its own error from it; the call must already match the spec."""
        if self._collected:
            collected = set(self._collected)
            found = tuple(key for key in kwargs if key in collected)
            if found != self._collected:
                return "kwargs", found, self._collected
        for path, in_kwargs, steps, keys in self._dicts:
            node = kwargs if in_kwargs else args
            for is_attr, step in steps:
                node = getattr(node, step) if is_attr else node[step]
            if tuple(node) != keys:
                return path, tuple(node), keys
        return None


def _dicts_of(
    spec: TreeSpec, root: str, *, skip_root: bool
) -> list[tuple[str, bool, tuple[_Step, ...], tuple[Any, ...]]]:
    """``(path, in kwargs, steps from the root, keys)`` of each plain dict of two keys or more."""
    nodes = spec._nodes
    layout = spec._get_layout()
    found = []
    for index, node in enumerate(nodes):
        if type(node) is not DictNode or node.arity < 2 or (skip_root and index == 0):
            continue
        steps: list[_Step] = []
        child = index
        while child > 0:
            parent = layout.parent[child]
            entry = layout.entry[child]
            assert entry is not None
            steps.append(_step(nodes[parent], entry))
            child = parent
        path = format_path(layout.entries(index), root)
        found.append((path, root == "kwargs", tuple(reversed(steps)), node.keys))
    return found


def _collected_keywords(fn: Callable[..., Any], keywords: tuple[Any, ...]) -> tuple[str, ...]:
    """The ``keywords`` (in order) that ``fn`` collects in its ``**kwargs``; none when it has
    no ``**kwargs`` or its signature cannot be read."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing known
        return ()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return ()
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return tuple(key for key in keywords if key not in named)


def _step(parent: Node, entry: PathEntry) -> _Step:
    """How to read the child at ``entry`` of an object of the node ``parent``: as the spec does
    (a namedtuple by position, a dataclass field as an attribute)."""
    if isinstance(entry, Index):
        return False, entry.index
    if isinstance(entry, Key):
        return False, entry.key
    assert isinstance(entry, Attr)
    if isinstance(parent, NamedTupleNode):
        return False, parent.fields.index(entry.name)
    assert isinstance(parent, DataclassNode)
    return True, entry.name
