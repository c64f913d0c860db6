"""What a forward's Python leaves on its modules from one call to the next, which no replay
repeats: a list appended to (``self.aux_losses.append(loss)``, a mixture of experts' load
balancing losses), a dict entry set (``self.cache[key] = h``), either inside another list,
dict or tuple (``self.stats['aux'].append(loss)`` of a ``defaultdict(list)``), an attribute
rebound to a new tensor, container or tuple holding one (``self.last_attn = attn``,
``self.last = (h, attn)``); also from a hook its backward runs (``h.register_hook(lambda g:
self.grad_norms.append(g.norm()))``: :meth:`SideEffects.after_backward`).

Eager does it on every call; on CUDA a replay runs no Python, so the list stops growing and the
attribute keeps the tensor of capture (memory each replay overwrites), silently. The first call
of a capture may do it (a cache filled once, then read: the graphs read what it holds); a later
call (warmup or capture) doing it again is refused, naming the attribute, and the containers and
attributes are put back as they were before the first call. An iterator a later call advances
(``next(self.schedule)``: every replay would keep the item the capture took) is refused too,
found by its position (:func:`_position`); it cannot be moved back. One bound afresh on each
call (``self.it = iter(self.blocks)``) is left alone, as one held and not advanced is.

So is a list, dict, set, deque or iterator among the globals the code names (a graphed
function's, the ``forward`` of a watched module's class: ``AUX_LOSSES.append(loss)``); a
closure's are left alone (a list a test closes over to record calls).

Plain values (a counter ``self.calls += 1``, a flag) are left alone: README says a replay does
not repeat them. Transformer Engine's modules keep their own bookkeeping (``fp8_meta``) and
are not watched.

>>> import torch
>>> class Aux(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.losses = []
...     def forward(self, x):
...         self.losses.append(x.sum())
...         return x * 2
>>> aux = Aux()
>>> watch = SideEffects([("Aux", aux)])
>>> for _ in range(2):
...     try:
...         _ = watch.run(lambda: aux(torch.ones(1)))
...     except Refused as error:
...         print(str(error)[:62], aux.losses)
Aux.losses: the callable's Python changes this list in place o []
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import operator
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ._capture_failure import Refused
from ._closed_over import _names_loaded

__all__ = ["SideEffects", "globals_named"]

T = TypeVar("T")

#: what nn.Module keeps in every instance's __dict__ (parameters, hooks, flags): its own
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))

_CONTAINERS = (list, dict, set, collections.deque)

_MODULE_FORWARD = vars(torch.nn.Module)["forward"]


class _Position(tuple):
    """Where an iterator stands: compared by value, not identity."""


#: values a position holds as they are (the others by identity, by position or by length)
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)


def _position(iterator: Any) -> _Position:
    """Where ``iterator`` stands in its stream, as far as Python shows it without advancing it
    or reading a tensor: a generator's instruction and what its frame holds, a built-in's
    length hint (``iter(list)``, ``itertools.repeat``), ``itertools.count``'s next value, an
    object's plain attributes (a DataLoader's iterator's ``_num_yielded``), and the positions of
    the iterators each holds (``map``, ``zip``, ``islice`` over another), by value.

    >>> it = iter([1, 2, 3])
    >>> before = _position(it)
    >>> before == _position(it), next(it), before == _position(it)
    (True, 1, False)
    """
    return _Position(_parts(iterator, depth=3, seen=set()))


def _parts(value: Any, depth: int, seen: set[int]) -> list[Any]:
    seen.add(id(value))
    parts: list[Any] = [type(value).__name__]
    referents: list[Any] = []
    if isinstance(value, types.GeneratorType):
        frame = value.gi_frame
        if frame is None:
            return [*parts, "exhausted"]
        # Python 3.11 holds a generator's locals and stack in it, 3.10 in its frame
        referents = [*gc.get_referents(value), *gc.get_referents(frame)]
        parts.append(frame.f_lasti)
    elif type(value).__module__ in ("builtins", "itertools"):
        # Python 3.12 made itertools' types heap types, whose traversal visits their type too
        referents = [r for r in gc.get_referents(value) if r is not type(value)]
        if isinstance(value, itertools.count):
            # its next value shows only in its repr (numbers: no tensor is read)
            if all(type(r) in _PLAIN for r in referents):
                parts.append(repr(value))
        else:
            parts.append(operator.length_hint(value, -1))
    if hasattr(value, "__dict__") and not isinstance(value, types.GeneratorType):
        # a Python iterator: its plain attributes and the iterators it holds, by name
        for name, item in vars(value).items():
            if type(item) in _PLAIN:
                parts.append((name, item))
            elif _is_iterator(item) and depth > 0 and id(item) not in seen:
                parts.append((name, _parts(item, depth - 1, seen)))
        return parts
    for item in referents:
        for one in item if type(item) is tuple else (item,):  # zip's tuple of iterators
            if type(one) in _PLAIN:
                parts.append(one)
            elif _is_iterator(one):
                if depth > 0 and id(one) not in seen:
                    parts.append(_parts(one, depth - 1, seen))
            elif isinstance(one, list):
                parts.append(("len", len(one)))  # itertools.cycle's saved items
            else:
                parts.append(id(one))
    return parts


def _is_iterator(value: Any) -> bool:
    return isinstance(value, Iterator) and not isinstance(value, torch.Tensor)


def _contents(value: Any) -> list[Any]:
    """A shallow copy of a container's contents, compared item by item by identity (an
    iterator's: its position, by value)."""
    if isinstance(value, dict):
        return list(value.items())
    if _is_iterator(value):
        return [_position(value)]
    return list(value)


def _same_contents(a: list[Any], b: list[Any], is_dict: bool) -> bool:
    if len(a) != len(b):
        return False
    if is_dict:
        return all(k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(a, b, strict=True))
    return all(x is y or (type(x) is _Position and x == y) for x, y in zip(a, b, strict=True))


def _nested(value: Any, depth: int = 3) -> list[tuple[str, Any]]:
    """The lists, dicts, sets and deques inside a container (or a tuple), named by where they
    are (``['aux']``, ``[0][1]``), to ``depth`` levels: ``self.stats['aux'].append(loss)``
    changes none of the outer dict's entries.

    >>> _nested({"aux": [], "n": 1, "pair": ([], 2)})
    [("['aux']", []), ("['pair'][0]", [])]
    """
    if depth == 0 or isinstance(value, (str, bytes)):
        return []
    if isinstance(value, dict):
        items = list(value.items())[:_SCANNED]
    elif isinstance(value, (*_CONTAINERS, tuple)) and not isinstance(value, set):
        items = list(enumerate(value))[:_SCANNED]
    else:
        return []
    found: list[tuple[str, Any]] = []
    for key, item in items:
        if isinstance(item, (*_CONTAINERS, tuple)):
            where = f"[{key!r}]"
            if isinstance(item, _CONTAINERS):
                found.append((where, item))
            found.extend((where + inner, nested) for inner, nested in _nested(item, depth - 1))
    return found


#: how many items of each container :func:`_nested` looks into (a vocabulary list: its first)
_SCANNED = 4096


def _holds_state(value: tuple[Any, ...], depth: int = 3) -> bool:
    """Whether a tuple (or a namedtuple) holds a tensor or a container, in it or in a tuple it
    holds (``self.last = (h, attn)``): rebound on every call, it is held to what a tensor
    attribute is; a tuple of numbers (``torch.Size``) is a plain value.

    >>> _holds_state((torch.Size([2]), 3)), _holds_state(((torch.ones(1),), 3))
    (False, True)
    """
    if depth == 0 or not (type(value) is tuple or hasattr(value, "_fields")):
        return False
    return any(
        isinstance(item, (torch.Tensor, *_CONTAINERS))
        or (isinstance(item, tuple) and _holds_state(item, depth - 1))
        for item in value[:_SCANNED]
    )


def _put_contents(value: Any, contents: list[Any]) -> None:
    if _is_iterator(value) or isinstance(value, tuple):
        return  # an iterator cannot be moved back; a tuple does not change
    value.clear()
    if isinstance(value, dict):
        value.update(contents)
    elif isinstance(value, list):
        value.extend(contents)
    elif isinstance(value, set):
        value.update(contents)
    else:
        value.extend(contents)


def globals_named(fn: Any) -> list[tuple[str, Any]]:
    """The globals ``fn``'s own code names (through ``functools.partial`` and bound methods),
    as ``(name, value)``; its closure's cells are left out: a list a test or a debugging
    session closes over to record calls is theirs.

    Read from its instructions, nested code (a comprehension) included: an attribute named
    like a global (``self.losses``) is no global.

    >>> COUNTS = {}
    >>> def f(x):
    ...     COUNTS[x] = 1
    >>> [name for name, _ in globals_named(f)]
    ['COUNTS']
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    space = getattr(fn, "__globals__", {})
    return [(name, space[name]) for name in _names_loaded(code)[0] if name in space]


def _watched(value: Any) -> bool:
    if isinstance(value, tuple):
        return _holds_state(value)
    return isinstance(value, (torch.Tensor, *_CONTAINERS)) or _is_iterator(value)


def _changed_in_place(where: str, value: Any) -> str:
    kind = type(value).__name__
    if _is_iterator(value):
        return (
            f"{where}: the callable's Python advances this {kind} on every call (next(it)): "
            "eager takes the next item on each call, a replay runs no Python, so on CUDA every "
            "replay would keep what the capture took. Take the item outside the callable and "
            "pass it in (as a tensor where the kernels read it)"
        )
    return (
        f"{where}: the callable's Python changes this {kind} in place on every call "
        "(losses.append(loss), cache[key] = h): eager does it on each call, a replay runs no "
        "Python, so on CUDA it would stay as capture left it. Return what it adds as an output "
        "instead"
    )


def _is_nested(name: str) -> bool:
    """Whether a watched name is a container's inside another (``stats['aux']``), not an
    attribute of its own."""
    return name.endswith("]")


#: one module's watched attributes: name -> (the object, its contents where a container)
_State = dict[str, tuple[Any, list[Any] | None]]


class SideEffects:
    """Runs a callable's calls (:meth:`run`), refusing one after the first that changes the
    containers or tensor attributes of ``modules`` (``(name, module)`` roots; their
    submodules too)."""

    def __init__(
        self,
        modules: Sequence[tuple[str, torch.nn.Module]],
        named: Sequence[tuple[str, Any]] = (),
    ) -> None:
        seen: dict[int, tuple[str, torch.nn.Module]] = {}
        for name, root in modules:
            for path, module in root.named_modules(prefix=name):
                if type(module).__module__.startswith("transformer_engine"):
                    continue
                seen.setdefault(id(module), (path, module))
        self._modules = list(seen.values())
        # containers the code names (a closed-over list, a global dict), and those the forward
        # of each watched module's class names: (how it is named, the container)
        free: dict[int, tuple[str, Any]] = {}
        for name, value in named:
            if isinstance(value, _CONTAINERS) or _is_iterator(value):
                free.setdefault(id(value), (f"global {name}", value))
        for cls in dict.fromkeys(type(m) for _, m in self._modules):
            forward = vars(cls).get("forward")
            if forward is None or forward is _MODULE_FORWARD:
                continue
            for name, value in globals_named(forward):
                if isinstance(value, _CONTAINERS) or _is_iterator(value):
                    free.setdefault(
                        id(value), (f"{cls.__qualname__}.forward's global {name}", value)
                    )
        self._free = list(free.values())
        self._first: list[_State] | None = None
        # the state before the forward of the latest call after the first (None: none since)
        self._since: list[_State] | None = None

    def _state(self) -> list[_State]:
        # the named containers first, as one state keyed by position
        free: _State = {}
        for name, value in self._free:
            free[name] = (value, _contents(value))
            for where, inner in _nested(value):  # global ['aux'] lists
                free[name + where] = (inner, _contents(inner))
        states = [free]
        for _, module in self._modules:
            state: _State = {}
            for name, value in module.__dict__.items():
                # a plain value (most of a module's own: Linear's in_features) is never watched
                if type(value) in _PLAIN_TYPES or name in _MODULE_INTERNALS or not _watched(value):
                    continue
                if isinstance(value, torch.Tensor):
                    state[name] = (value, None)
                    continue
                state[name] = (value, _contents(value))
                for where, inner in _nested(value):  # self.stats['aux']: the outer's entries
                    state[name + where] = (inner, _contents(inner))
            states.append(state)
        return states

    def run(self, call: Callable[[], T]) -> T:
        """``call()``; after the first, refused where it changed what :class:`SideEffects`
        watches, everything watched put back as before the first call."""
        if not self._modules and not self._free:
            return call()
        before = self._state()
        if self._first is None:
            self._first = before
            return call()
        result = call()
        self._refuse_a_change(before)
        self._since = before
        return result

    def after_backward(self) -> None:
        """Refuse what the backward of the latest call after the first changed since its
        forward began: a hook its forward registers runs there (``h.register_hook(lambda g:
        self.grad_norms.append(g.norm()))``), which no replay's backward runs either."""
        since, self._since = self._since, None
        if since is not None:
            self._refuse_a_change(since)

    def _refuse_a_change(self, before: list[_State]) -> None:
        change = self._change(before, self._state())
        if change is not None:
            self._put_back()
            raise Refused(change)

    def _change(self, before: list[_State], after: list[_State]) -> str | None:
        for name, (value, contents) in after[0].items():
            then = before[0].get(name)
            # a container nested anew changed the one holding it, found first
            if (
                then is not None
                and then[0] is value
                and not _same_contents(then[1] or [], contents or [], isinstance(value, dict))
            ):
                return _changed_in_place(name, value)
        for (path, _), old, new in zip(self._modules, before[1:], after[1:], strict=True):
            for name, (value, contents) in new.items():
                where = f"{path}.{name}"
                kind = type(value).__name__
                if _is_nested(name) and (name not in old or old[name][0] is not value):
                    continue  # a container nested anew changed the one holding it, found first
                if name not in old or old[name][0] is not value:
                    if _is_iterator(value):
                        continue  # a fresh iterator each call (self.it = iter(self.blocks))
                    return (
                        f"{where}: the callable's Python sets this attribute to a new {kind} on "
                        "every call (self.last = h): eager's holds each call's, a replay runs no "
                        "Python (on CUDA it would keep the tensor of capture, overwritten by every "
                        "replay). Return it as an output instead"
                    )
                if contents is not None and not _same_contents(
                    old[name][1] or [], contents, isinstance(value, dict)
                ):
                    return _changed_in_place(where, value)
        return None

    def _put_back(self) -> None:
        """Every watched attribute and container as before the first call."""
        assert self._first is not None
        for value, contents in self._first[0].values():
            _put_contents(value, contents or [])
        for (_, module), first in zip(self._modules, self._first[1:], strict=True):
            now = module.__dict__
            for name in [n for n in now if n not in first and _watched(now[n])]:
                if name not in _MODULE_INTERNALS:
                    del now[name]
            for name, (value, contents) in first.items():
                if not _is_nested(name):
                    now[name] = value
                if contents is not None:
                    _put_contents(value, contents)
