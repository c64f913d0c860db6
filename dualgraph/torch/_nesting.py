"""Graphs do not nest: a graphed callable called inside another callable's capture or replay.

A graphed callable called while another callable is warmed up or captured would copy its
inputs into its static buffers inside the other's graph and replay a graph of its own there: on
CUDA a graph launched while another is being captured, whose copies the outer graph keeps and
whose replay it does not (or a failed capture); on ``"emulate"`` a callable that re-runs Python
every call and so would seem to work. Both backends refuse it, at the call, before the
callable's buffers or state are touched.

A callable graphed *after* the one that calls it (a submodule graphed after its parent, or
graphed together with it) ran its original code in the outer capture, so the outer graph
replays that code as captured. The ``"emulate"`` backend re-runs the outer callable's Python,
which now reaches the graphed one: there it runs the original code too, as the outer graph does
on CUDA, instead of replaying (which would touch its buffers, its pending backward and its
pool, and route grads through its own backward).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._errors import DualgraphError
from ._capture_failure import Progress

__all__ = ["SCOPE", "capture_scope", "called_again_inside", "inside_another", "replay_scope"]

#: ``SCOPE.outer`` while an emulated replay runs a callable's Python.
_REPLAY = "replay"


class _Scope(threading.local):
    """``outer``: the capture this thread is running (its :class:`Progress`), ``"replay"``
    inside an emulated replay, ``None`` outside both."""

    outer: Progress | str | None = None


#: Read by every graphed call (one attribute of a thread-local): ``SCOPE.outer``.
SCOPE = _Scope()


@contextlib.contextmanager
def _inside(outer: Progress | str) -> Iterator[None]:
    previous = SCOPE.outer
    SCOPE.outer = outer
    try:
        yield
    finally:
        SCOPE.outer = previous


def capture_scope(progress: Progress) -> contextlib.AbstractContextManager[None]:
    """The block warms up and captures the callables ``progress`` follows, in this thread."""
    return _inside(progress)


def replay_scope() -> contextlib.AbstractContextManager[None]:
    """The block runs a callable's Python as an emulated replay of its graph."""
    return _inside(_REPLAY)


def inside_another(
    name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    """Graphed callable ``name`` called inside :data:`SCOPE`'s capture or emulated replay.

    Refused inside a capture; inside an emulated replay, ``original`` runs (eagerly, as the
    outer graph replays it).
    """
    outer = SCOPE.outer
    if not isinstance(outer, Progress):
        return original(*args, **kwargs)
    being_captured = outer.name or "another callable"
    raise DualgraphError(
        f"{name} is graphed and was called while {being_captured} is being captured: graphs do "
        "not nest (the outer graph would keep the copies into its buffers, not its replay). "
        f"Graph {being_captured} with the original callable inside (a module: "
        f"dualgraph.torch.restore it first, or graph {being_captured} before its parts), or graph "
        "the two side by side as callables graphed together, each called on its own, in the "
        "order they run"
    )


def called_again_inside(lock: Any) -> bool:
    """Whether a graphed call refused because ``lock`` is held was made inside a call holding
    it in this thread (a replay hook calling the callable, or code its call runs), rather than
    while another thread runs one. For the refusal's message only: it walks the stack.

    >>> called_again_inside(threading.Lock())
    False
    """
    try:
        frame: Any = sys._getframe(3)  # past this function, ``_busy`` and the refused call's
    except ValueError:  # a stack this shallow holds no call
        return False
    while frame is not None:
        for name in ("self", "front"):  # a runner's method, a slot's (its front holds the lock)
            owner = frame.f_locals.get(name)
            if hasattr(type(owner), "_busy") and getattr(owner, "_lock", None) is lock:
                return True
        frame = frame.f_back
    return False
