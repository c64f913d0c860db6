"""A function of torch's replaced while captures watch its calls, one replacement for all.

Capture watches a few of torch's functions for its extent (``nn.Module.__getattr__``,
``torch._C._set_grad_enabled``). Replacing the function on entry and putting back the one found
on exit goes wrong where watches do not end in the order they began: two threads capturing at
once (each thread's capture scope is its own), where the first to end puts back the original
and the last puts back the first's replacement, for good (every later call then runs it, and
its notes grow without end). Here one replacement stands while any watch runs, and the function
is put back when the last ends; the replacement tells the watches of the calling thread only
(an outer and a nested capture's alike), so another thread's calls are not a capture's; a
watch begun with ``every_thread=True`` hears every thread's calls (a backward: the autograd
engine runs CUDA devices' backward functions in threads of its own).

>>> import types
>>> box = types.SimpleNamespace(double=lambda x: 2 * x)
>>> def noting(found, watchers):
...     def noted(x):
...         for seen in watchers():
...             seen.append(x)
...         return found(x)
...     return noted
>>> original = box.double
>>> with WatchedFunction(box, "double", noting).watching([]) as seen:
...     _ = box.double(3)
>>> seen, box.double is original
([3], True)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["WatchedFunction"]

W = TypeVar("W")


class WatchedFunction(Generic[W]):
    """``owner.name`` replaced by ``wrap(found, watchers)`` while any :meth:`watching` runs;
    ``watchers()`` is the calling thread's list of watchers (objects the replacement notes
    calls in), innermost last."""

    __slots__ = (
        "_count",
        "_everywhere",
        "_found",
        "_local",
        "_lock",
        "_name",
        "_own",
        "_owner",
        "_wrap",
    )

    def __init__(
        self,
        owner: object,
        name: str,
        wrap: Callable[[Any, Callable[[], list[W]]], Any],
    ) -> None:
        self._owner = owner
        self._name = name
        self._wrap = wrap
        self._lock = threading.Lock()
        self._local = threading.local()
        self._count = 0  # watches running, in all threads
        self._found: Any = None
        self._own = True  # whether owner holds it itself (not inherited: then deleted again)
        self._everywhere: list[W] = []  # watchers of every thread's calls

    @property
    def running(self) -> bool:
        """Whether a watch runs in any thread (the function replaced)."""
        return bool(self._count)

    def _watchers(self) -> list[W]:
        try:
            found: list[W] = self._local.watchers
        except AttributeError:
            found = self._local.watchers = []
        return found

    def _told(self) -> list[W]:
        """The watchers a call in this thread tells: this thread's, then every thread's."""
        own = self._watchers()
        return own + self._everywhere if self._everywhere else own

    @contextlib.contextmanager
    def watching(self, watcher: W, *, every_thread: bool = False) -> Iterator[W]:
        """Note this thread's calls (every thread's with ``every_thread``) in ``watcher`` while
        the block runs; the function is put back when no watch runs in any thread, however the
        block ends."""
        self.begin(watcher, every_thread=every_thread)
        try:
            yield watcher
        finally:
            self.end(watcher)

    def begin(self, watcher: W, *, every_thread: bool = False) -> None:
        """:meth:`watching`'s start, for a caller that enters several watches at once (each
        :meth:`end` called once, however its block ends)."""
        with self._lock:
            if not self._count:
                self._found = getattr(self._owner, self._name)
                self._own = self._name in vars(self._owner)
                setattr(self._owner, self._name, self._wrap(self._found, self._told))
            self._count += 1
            if every_thread:  # a new list: a call iterating the old one meanwhile is unhurt
                self._everywhere = [*self._everywhere, watcher]
        if not every_thread:
            self._watchers().append(watcher)

    def end(self, watcher: W) -> None:
        """:meth:`watching`'s end: ``watcher`` no longer notes; the function is put back if no
        watch runs in any thread."""
        # Only this watch's begin puts its watcher among every thread's (a new list each time,
        # read whole): where the list read now holds none, no later one will.
        everywhere = self._everywhere
        if everywhere and any(watcher is other for other in everywhere):
            with self._lock:
                self._everywhere = [w for w in self._everywhere if w is not watcher]
        watchers = self._watchers()
        # by identity (a watcher may compare equal to another: two empty dicts)
        if watchers and watchers[-1] is watcher:  # the latest: usually the one ending
            del watchers[-1]
        else:
            for i in range(len(watchers) - 1, -1, -1):
                if watchers[i] is watcher:
                    del watchers[i]
                    break
        with self._lock:
            self._count -= 1
            if not self._count:
                if self._own:
                    setattr(self._owner, self._name, self._found)
                else:  # a class's attribute inherited from a base: inherited again
                    delattr(self._owner, self._name)
                self._found = None
