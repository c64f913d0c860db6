"""Identities, classes and dict sizes of fixed objects, compared per call in one C call.

A replay checks, per call, that a module's parameters, buffers and submodules still hang where
they did, that its plain values and the training flags are the objects of capture, and that no
entry was added to its dicts: dozens of dict look-ups and ``is`` tests a module, each a
bytecode or two. TorchDynamo's guard manager (``RootGuardManager``, C++) runs such a tree of
checks in one call. :class:`ObjectGuard` builds one; where torch has none, or one that does not
answer as those tests do (a private API, which another torch may change), :meth:`ObjectGuard.
made` is ``None`` and the caller keeps its own tests.

Each check is at least as strict as the Python test it stands for (identity where Python may
compare by ``==``; a key absent where ``dict.get`` may find ``None``): ``check()`` being
``True`` means those tests pass; ``False`` says nothing, and the caller's tests decide.

Example::

    guard = ObjectGuard()
    guard.holds(module._parameters, "weight", module.weight)
    guard.size(module._parameters, 2)
    check = guard.made()  # None: no guard to be had
    check()  # False once module.weight = nn.Parameter(...) (say)
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["ObjectGuard"]

_PLAIN_DICTS = (dict, OrderedDict)  # what the guard's dict look-ups read as Python does
_MISSING = object()
_answers_as_python: bool | None = None  # the self-test's answer, once asked


def _manager_kind() -> Any:
    from torch._dynamo.guards import GuardManagerType  # a heavy import: at the first guard

    return GuardManagerType.GUARD_MANAGER


class ObjectGuard:
    """A tree of checks of fixed objects; :meth:`made` turns it into one C call."""

    __slots__ = ("_checks", "_objects")

    def __init__(self) -> None:
        self._objects: list[Any] = []  # the roots the checks start from (held: ids stay theirs)
        self._checks: list[tuple[str, int, Any, Any]] = []

    def _root(self, value: Any) -> int:
        for i, known in enumerate(self._objects):
            if known is value:
                return i
        self._objects.append(value)
        return len(self._objects) - 1

    def holds(self, mapping: dict[Any, Any], key: Any, value: Any) -> None:
        """``mapping[key] is value`` (``value`` may be :data:`ObjectGuard.ABSENT`: no key)."""
        self._checks.append(("holds", self._root(mapping), key, value))

    def size(self, mapping: dict[Any, Any], length: int) -> None:
        """``len(mapping) == length``."""
        self._checks.append(("size", self._root(mapping), length, None))

    def is_a(self, value: Any, cls: type) -> None:
        """``type(value) is cls``."""
        self._checks.append(("is_a", self._root(value), cls, None))

    def attribute(self, value: Any, name: str, attribute: Any) -> None:
        """``getattr(value, name) is attribute``."""
        self._checks.append(("attribute", self._root(value), name, attribute))

    #: what :meth:`holds` takes for a key that must be absent
    ABSENT: Any = _MISSING

    def made(self) -> Callable[[], bool] | None:
        """The checks as one call (``True``: every check passes), or ``None``: no guard to be
        had (no such class in this torch, one that answers otherwise, a dict of another kind)."""
        if not _guards_answer_as_python():
            return None
        return self._built()

    def _built(self) -> Callable[[], bool] | None:
        if any(
            kind in ("holds", "size") and type(self._objects[root]) not in _PLAIN_DICTS
            for kind, root, _, _ in self._checks
        ):
            return None  # a dict subclass may look keys up otherwise than the guard's C does
        try:
            from torch._C._dynamo.guards import RootGuardManager

            kind_of_manager = _manager_kind()
            root_manager = RootGuardManager()
            objects = tuple(self._objects)
            managers = [
                root_manager.tuple_getitem_manager(i, f"o[{i}]", value, kind_of_manager)
                for i, value in enumerate(objects)
            ]
            for kind, root, what, value in self._checks:
                manager = managers[root]
                source = f"o[{root}]"
                if kind == "holds" and value is _MISSING:
                    manager.add_dict_contains_guard(
                        False, what, [f"{what!r} not in {source}"], None
                    )
                elif kind == "holds":
                    manager.dict_getitem_manager(
                        what, f"{source}[{what!r}]", value, kind_of_manager
                    ).add_id_match_guard(id(value), [f"{source}[{what!r}] is"], None)
                elif kind == "size":
                    manager.add_dict_length_check_guard(what, [f"len({source})"], None)
                elif kind == "is_a":
                    manager.add_type_match_guard(id(what), [f"type({source})"], None)
                else:
                    manager.getattr_manager(
                        what, f"{source}.{what}", value, kind_of_manager
                    ).add_id_match_guard(id(value), [f"{source}.{what} is"], None)
        except Exception:  # another torch's signatures: the caller's own tests
            return None
        check = functools.partial(root_manager.check, objects)
        # what is compared by id or class is held while the check lives: another object made
        # at a freed one's address would have its id
        check.held = tuple(value for _, _, _, value in self._checks)  # type: ignore[attr-defined]
        return check


def _guards_answer_as_python() -> bool:
    """Whether this torch's guard manager passes the objects as they are and fails each kind
    of change the checks stand for (asked once)."""
    global _answers_as_python
    if _answers_as_python is None:
        _answers_as_python = False
        try:
            _answers_as_python = _self_test()
        except Exception:  # pragma: no cover - another torch's behaviour
            _answers_as_python = False
    return _answers_as_python


class _Probe:
    flag: Any


def _self_test() -> bool:
    value, flag = _Probe(), True
    value.flag = flag
    entries: dict[str, Any] = {"value": value}
    guard = ObjectGuard()
    guard.holds(entries, "value", value)
    guard.holds(entries, "absent", _MISSING)
    guard.size(entries, 1)
    guard.is_a(value, _Probe)
    guard.attribute(value, "flag", flag)
    check = guard._built()
    if check is None or check() is not True:
        return False
    answers = []
    for change, undo in (
        (
            lambda: entries.__setitem__("value", _Probe()),
            lambda: entries.__setitem__("value", value),
        ),
        (lambda: entries.pop("value"), lambda: entries.__setitem__("value", value)),
        (lambda: entries.__setitem__("absent", None), lambda: entries.pop("absent")),
        (lambda: entries.__setitem__("other", value), lambda: entries.pop("other")),
        (lambda: setattr(value, "flag", 1), lambda: setattr(value, "flag", flag)),
        (lambda: delattr(value, "flag"), lambda: setattr(value, "flag", flag)),
        (lambda: setattr(value, "__class__", type("_Other", (), {})), lambda: None),
    ):
        change()
        answers.append(check())
        undo()
    return answers == [False] * 7
