"""The module attributes a callable looked up and did not find during warmup and capture.

A forward reading an optional attribute (``getattr(self, "mask", None)``, ``hasattr(self,
"scale")``) took the branch without it at capture; the graphs replay that branch. A tensor or
object set under that name after capture (``model.mask = torch.tensor(...)``) is one eager's
forward would use and the graphs never read. An attribute set under another name (a hook of the
graphed module keeping its output: ``module.previous = output``) was never looked up, so it is
no change.

A lookup that misses a module's ``__dict__`` and class ends in ``nn.Module.__getattr__`` (which
then raises ``AttributeError``): watched for the extent of a capture, in its thread
(:class:`WatchedFunction`: put back when the last capture of any thread ends). A capture
watches it on the classes of the modules it records, where each finds ``nn.Module``'s
(``Linear.__getattr__`` set, then deleted again): setting an attribute of ``nn.Module``
itself makes the interpreter update every subclass torch defines (about 350, 0.4 ms each way);
a class of its own has few or none. A class with a ``__getattr__`` of its own (which may catch
``nn.Module``'s ``AttributeError``) has ``nn.Module``'s watched instead, as all had before.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> with attributes_missed() as missed:
...     _ = getattr(layer, "mask", None)
>>> "mask" in missed[id(layer.__dict__)]
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._watched_function import WatchedFunction

__all__ = ["attributes_missed"]

#: Per module ``__dict__`` (by id), the names looked up in vain.
Missed = dict[int, set[str]]


def _noting_misses(found: Any, watchers: Callable[[], list[Missed]]) -> Any:
    def watched(self: torch.nn.Module, name: str) -> object:
        try:
            return found(self, name)
        except AttributeError:
            for missed in watchers():
                missed.setdefault(id(self.__dict__), set()).add(name)
            raise

    watched._notes_misses = True  # type: ignore[attr-defined]
    return watched


def _modules_getattr(self: torch.nn.Module, name: str) -> object:
    # nn.Module's as it is at the call: watched there too while a capture with a class of its
    # own runs (the watches of both hear the lookup)
    return torch.nn.Module.__getattr__(self, name)


def _noting_misses_of_class(_found: Any, watchers: Callable[[], list[Missed]]) -> Any:
    return _noting_misses(_modules_getattr, watchers)


_GETATTR: WatchedFunction[Missed] = WatchedFunction(torch.nn.Module, "__getattr__", _noting_misses)

#: The watches of the classes watched on their own now, by class; one per class, shared by the
#: captures of all threads, dropped when its last watch ends (a class is not kept alive here).
_CLASS_WATCHES: dict[type, WatchedFunction[Missed]] = {}
_CLASS_WATCHES_LOCK = threading.Lock()


def _finds_modules_getattr(cls: type) -> bool:
    """Whether a lookup on a ``cls`` ends in ``nn.Module.__getattr__`` (through no
    ``__getattr__`` of another class but this module's watches)."""
    for klass in cls.__mro__:
        own = vars(klass).get("__getattr__")
        if klass is torch.nn.Module:
            return True
        if own is not None and not getattr(own, "_notes_misses", False):
            return False
    return False


@contextlib.contextmanager
def attributes_missed(classes: Iterable[type] | None = None) -> Iterator[Missed]:
    """Note, per module ``__dict__`` (by id), the names ``nn.Module.__getattr__`` did not find
    in this thread while this runs: for the modules of ``classes`` (watched on those classes
    where each finds ``nn.Module``'s), or of every class (``None``).

    >>> layer, relu = torch.nn.Linear(2, 2), torch.nn.ReLU()
    >>> with attributes_missed([torch.nn.Linear]) as missed:
    ...     _ = getattr(layer, "mask", None), getattr(relu, "inplace_", None)
    >>> [sorted(names) for names in missed.values()], "__getattr__" in vars(torch.nn.Linear)
    ([['mask']], False)
    """
    found = None if classes is None else list(dict.fromkeys(classes))
    if found is None or not all(
        cls is not torch.nn.Module and _finds_modules_getattr(cls) for cls in found
    ):
        with _GETATTR.watching({}) as missed:
            yield missed
        return
    noted: Missed = {}
    begun: list[tuple[type, WatchedFunction[Missed]]] = []
    try:
        with _CLASS_WATCHES_LOCK:
            for cls in found:
                watch = _CLASS_WATCHES.get(cls)
                if watch is None:
                    watch = WatchedFunction(cls, "__getattr__", _noting_misses_of_class)
                    _CLASS_WATCHES[cls] = watch
                watch.begin(noted)
                begun.append((cls, watch))
        yield noted
    finally:
        with _CLASS_WATCHES_LOCK:
            for cls, watch in reversed(begun):
                watch.end(noted)
                if not watch.running:
                    del _CLASS_WATCHES[cls]
