"""What runs around one graphed callable besides its graphs, gathered in one object.

:class:`CallableHooks` holds, for one callable:

- ``run``: the context its Python runs in during warmup, capture and ``"emulate"`` replays
  (a Transformer Engine autocast); ``run_eager`` the one for calls on the ``"eager"`` backend;
- ``observers``: what brackets each warmup and capture forward and backward, outside the graph
  being captured (capture-time hooks, ``_capture_hooks.py``);
- ``replay``: the replay hooks (``_replay_hooks.py``).

The capture (``_capture.py``) and the replay (``_replay.py``) ask it at fixed points;
:data:`NO_HOOKS` runs nothing and costs nothing.

>>> NO_HOOKS.call(max, (1, 2), {})
2
>>> with NO_HOOKS.around("forward"):
...     pass
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import DualgraphError
from ._capture_hooks import CaptureTimeHooks
from ._replay_hooks import ReplayHookRunner, ReplayHooks
from ._te_precision import TECallable

__all__ = ["NO_HOOKS", "CallableHooks", "CaptureObserver", "hooks_per_callable"]

_NULL = contextlib.nullcontext()


class CaptureObserver(Protocol):
    """Something that brackets each warmup and capture forward or backward of a callable."""

    def around(self, phase: str) -> AbstractContextManager[Any]:
        """A context around one ``"forward"`` or ``"backward"``, outside any graph capture."""
        ...


@dataclass(frozen=True, eq=False)
class CallableHooks:
    """What runs around one callable besides its graphs (see the module docstring)."""

    run: Callable[[], AbstractContextManager[Any]] | None = None
    run_eager: Callable[[], AbstractContextManager[Any]] | None = None
    observers: tuple[CaptureObserver, ...] = ()
    replay: ReplayHookRunner | None = None

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` in the ``run`` context (a warmup or capture call)."""
        if self.run is None:
            return fn(*args, **kwargs)
        with self.run():
            return fn(*args, **kwargs)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, or a function that calls it in the ``run`` context (``"emulate"`` replays)."""
        if self.run is None:
            return fn
        return functools.partial(_run_in, self.run, fn)

    def around(self, phase: str) -> AbstractContextManager[Any]:
        """The observers' contexts around one warmup or capture ``phase``, outside the graph."""
        if not self.observers:
            return _NULL
        return self._observed(phase)

    @contextlib.contextmanager
    def _observed(self, phase: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for observer in self.observers:
                stack.enter_context(observer.around(phase))
            yield


NO_HOOKS = CallableHooks()


def _run_in(
    run: Callable[[], AbstractContextManager[Any]],
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    with run():
        return fn(*args, **kwargs)


def hooks_per_callable(
    names: Sequence[str],
    targets: Sequence[Any],
    *,
    replay_hooks: Any,
    capture_time_hooks: Any,
    te: Sequence[TECallable] | None,
) -> list[CallableHooks]:
    """The :class:`CallableHooks` of each callable graphed together, from the user's options
    (checked here) and Transformer Engine's part (``te``, one per callable, or ``None``)."""
    count = len(names)
    users = _one_each("replay_hooks", replay_hooks, count, ReplayHooks, "a ReplayHooks")
    given = _capture_hooks_each(capture_time_hooks, count)
    result = []
    for index, (name, target, user, hooks) in enumerate(
        zip(names, targets, users, given, strict=True)
    ):
        te_part = te[index] if te is not None else None
        observers: list[CaptureObserver] = []
        if te_part is not None and te_part.precision.active:
            observers.append(te_part)  # notes the TE modules the captured forwards run
        capture_hooks = CaptureTimeHooks.parse(name, target, hooks)
        if not capture_hooks.empty:
            observers.append(capture_hooks)
        internal = () if te_part is None else (te_part.replay_hooks(),)
        kwargs = () if te_part is None else te_part.replay_kwargs()
        runner = (
            ReplayHookRunner(name, index, internal=internal, user=user, kwargs=kwargs)
            if internal or user is not None
            else None
        )
        run = run_eager = None
        if te_part is not None and te_part.runs_in_autocast:
            run = te_part.run
            if not te_part.precision.follows_ambient:  # else the caller's autocast applies
                run_eager = te_part.run_eager
        result.append(CallableHooks(run, run_eager, tuple(observers), runner))
    return result


def _one_each(option: str, value: Any, count: int, cls: type, expected: str) -> list[Any]:
    """One value (or ``None``) per callable: ``value`` for all, or a sequence with one each."""
    if value is None or isinstance(value, cls):
        return [value] * count
    if isinstance(value, tuple | list) and len(value) == count:
        for i, item in enumerate(value):
            if item is not None and not isinstance(item, cls):
                raise DualgraphError(
                    f"{option}[{i}] must be {expected} or None, got {type(item).__name__}"
                )
        return list(value)
    raise DualgraphError(
        f"{option} must be {expected} (for every callable) or a tuple with one (or None) per "
        f"callable ({count}), got {type(value).__name__}"
        + (f" of {len(value)}" if isinstance(value, tuple | list) else "")
    )


def _capture_hooks_each(value: Any, count: int) -> list[Any]:
    # As Transformer Engine takes them: a list with one dict (or None) per callable; for one
    # callable, its dict alone too.
    if value is None:
        return [None] * count
    if isinstance(value, Mapping) and count == 1:
        return [value]
    if isinstance(value, tuple | list) and len(value) == count:
        return list(value)
    raise DualgraphError(
        f"capture_time_hooks must be a list with one dict (or None) per callable ({count})"
        + (", or for one callable its dict" if count == 1 else "")
        + f", got {type(value).__name__}"
        + (f" of {len(value)}" if isinstance(value, tuple | list) else "")
    )
