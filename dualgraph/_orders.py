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
from ._containers import DataclassNode, DictNode, NamedTupleNode, _tuple_item
from ._errors import SpecMismatchError
from ._nodes import Node, clip
from ._paths import Attr, Index, Key, PathEntry, format_path
from ._spec import TreeSpec
from ._spelling import binding_signature

__all__ = ["KeyOrders", "key_order_difference"]

#: One step of the walk from the call's roots to its dicts, in pre-order: (the slot of the
#: object it reads from, how it is read (see :data:`_BY_KEY`), the key, index or name, the
#: dict's keys in the sample's order or ``None`` for a container on the way, the node's index in
#: its spec, the root's name). Slot 0 is ``args``, 1 ``kwargs``, and each step's object takes the
#: next slot.
_Step = tuple[int, int, Any, "tuple[Any, ...] | None", int, str]

#: How a step reads its child: ``obj[key]`` (a tuple, list or dict), ``getattr(obj, name)`` (a
#: dataclass field), or the tuple's own item (a namedtuple, whose class may override indexing).
_BY_KEY, _BY_ATTR, _BY_TUPLE_ITEM = range(3)


class KeyOrders:
    """The plain dicts of a call (two keys or more, the kwargs themselves left out) and their
    keys in the sample's order, and the keywords ``fn`` collects in its ``**kwargs`` (when
    given); :meth:`check` refuses a call with another order.

    Made once from the call's spec; a call without such dicts costs nothing to check. A check
    reads each container on the way to the dicts once, so it takes time linear in their number
    whatever the depth; paths are only made for an error.

    >>> import numpy as np
    >>> from dualgraph import describe_call
    >>> orders = KeyOrders(describe_call(({"b": np.ones(1), "a": np.ones(1)},)))
    >>> orders.check(({"a": np.ones(1), "b": np.ones(1)},), {})
    Traceback (most recent call last):
    ...
    dualgraph.SpecMismatchError: args[0]: a dict with its keys in the order ['a', 'b'], ...
    """

    __slots__ = ("_collected", "_specs", "_steps")

    def __init__(self, call_spec: CallSpec, /, fn: Callable[..., Any] | None = None) -> None:
        args_steps = _steps_to_dicts(call_spec.args_spec, "args", 0, 2, skip_root=False)
        self._steps: tuple[_Step, ...] = (
            *args_steps,
            *_steps_to_dicts(
                call_spec.kwargs_spec, "kwargs", 1, 2 + len(args_steps), skip_root=True
            ),
        )
        self._specs = {"args": call_spec.args_spec, "kwargs": call_spec.kwargs_spec}
        keywords = call_spec.kwargs_spec._nodes[0].keys  # type: ignore[attr-defined]
        # Fewer than two keywords have no order to keep: the signature is not read (a graphed
        # callable's capture read it for each block, ~0.1 ms each on a CPU).
        collected = (
            _collected_keywords(fn, keywords) if fn is not None and len(keywords) > 1 else ()
        )
        self._collected = collected if len(collected) > 1 else ()

    def __bool__(self) -> bool:
        return bool(self._steps or self._collected)

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
                f"kwargs: the keywords {clip(list(keys), 300)} go to the function's **kwargs "
                f"in this order, compiled for the order {clip(list(expected), 300)}; whatever "
                "follows their order would not follow this call's; pass them in the "
                "compiled order",
                path="kwargs",
            )
        raise SpecMismatchError(
            f"{path}: a dict with its keys in the order {clip(list(keys), 300)}, compiled for "
            f"the order {clip(list(expected), 300)}; the program runs the function as it was "
            "traced, so whatever follows the key order (d.values(), a concatenation or a sum "
            "over the dict) would not follow this call's; pass the keys in the compiled order",
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
        if not self._steps:
            return None
        objects = [args, kwargs]
        append = objects.append
        for start, how, step, keys, index, root in self._steps:
            obj = objects[start]
            if how == _BY_KEY:
                obj = obj[step]
            else:
                obj = getattr(obj, step) if how == _BY_ATTR else _tuple_item(obj, step)
            if keys is not None and tuple(obj) != keys:
                path = format_path(self._specs[root]._get_layout().entries(index), root)
                return path, tuple(obj), keys
            append(obj)
        return None


def _steps_to_dicts(
    spec: TreeSpec, root: str, root_slot: int, first_slot: int, *, skip_root: bool
) -> list[_Step]:
    """The steps (see :data:`_Step`) from the spec's root to each plain dict of two keys or
    more, each container on the way read once; their objects take slots from ``first_slot``."""
    nodes = spec._nodes
    layout = spec._get_layout()
    dicts = {
        index
        for index, node in enumerate(nodes)
        if type(node) is DictNode and node.arity >= 2 and not (skip_root and index == 0)
    }
    if not dicts:
        return []
    on_the_way = bytearray(len(nodes))  # the dicts and the containers above them
    on_the_way[0] = 1
    for index in dicts:
        while not on_the_way[index]:
            on_the_way[index] = 1
            index = layout.parent[index]
    slot_of = {0: root_slot}
    steps: list[_Step] = []
    for index in range(1, len(nodes)):  # pre-order: each parent's slot is known before it
        if not on_the_way[index]:
            continue
        parent = layout.parent[index]
        entry = layout.entry[index]
        assert entry is not None
        how, step = _step(nodes[parent], entry)
        keys = nodes[index].keys if index in dicts else None  # type: ignore[attr-defined]
        slot_of[index] = first_slot + len(steps)
        steps.append((slot_of[parent], how, step, keys, index, root))
    return steps


def _collected_keywords(fn: Callable[..., Any], keywords: tuple[Any, ...]) -> tuple[str, ...]:
    """The ``keywords`` (in order) that ``fn`` collects in its ``**kwargs``; none when it has
    no ``**kwargs`` or its signature cannot be read."""
    try:
        parameters = binding_signature(fn).parameters.values()
    except Exception:  # no signature to read (a builtin, a __signature__ that raises)
        return ()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return ()
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return tuple(key for key in keywords if key not in named)


def _step(parent: Node, entry: PathEntry) -> tuple[int, Any]:
    """How to read the child at ``entry`` of an object of the node ``parent``: as the spec does
    (a namedtuple by its tuple's item, a dataclass field as an attribute)."""
    if isinstance(entry, Index):
        return _BY_KEY, entry.index
    if isinstance(entry, Key):
        return _BY_KEY, entry.key
    assert isinstance(entry, Attr)
    if isinstance(parent, NamedTupleNode):
        return _BY_TUPLE_ITEM, parent.fields.index(entry.name)
    assert isinstance(parent, DataclassNode)
    return _BY_ATTR, entry.name


def key_order_difference(
    expected: TreeSpec, found: TreeSpec, /
) -> tuple[str, tuple[Any, ...], tuple[Any, ...]] | None:
    """``(path, expected keys, found keys)`` for the first dict whose keys come in another order
    in ``found`` than in ``expected``, two specs that :meth:`~dualgraph.TreeSpec.check` found
    alike otherwise (a spec matches a dict in any order); ``None`` when every order agrees.

    >>> from dualgraph import describe
    >>> key_order_difference(describe([{"a": 1, "b": 2}]), describe([{"b": 2, "a": 1}]))
    ('[0]', ('a', 'b'), ('b', 'a'))
    """
    pairs = zip(expected._nodes, found._nodes, strict=True)
    for index, (mine, theirs) in enumerate(pairs):
        if isinstance(mine, DictNode) and isinstance(theirs, DictNode) and mine.keys != theirs.keys:
            return format_path(expected._get_layout().entries(index)), mine.keys, theirs.keys
    return None
