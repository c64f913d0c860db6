"""The module attributes a callable looked up and did not find during warmup and capture.

A forward reading an optional attribute (``getattr(self, "mask", None)``, ``hasattr(self,
"scale")``) took the branch without it at capture; the graphs replay that branch. A tensor or
object set under that name after capture (``model.mask = torch.tensor(...)``) is one eager's
forward would use and the graphs never read. An attribute set under another name (a hook of the
graphed module keeping its output: ``module.previous = output``) was never looked up, so it is
no change.

A lookup that misses a module's ``__dict__`` and class ends in ``nn.Module.__getattr__`` (which
then raises ``AttributeError``): watched for the extent of a capture, in its thread
(:class:`WatchedFunction`: put back when the last capture of any thread ends).

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> with attributes_missed() as missed:
...     _ = getattr(layer, "mask", None)
>>> "mask" in missed[id(layer.__dict__)]
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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

    return watched


_GETATTR: WatchedFunction[Missed] = WatchedFunction(torch.nn.Module, "__getattr__", _noting_misses)


@contextlib.contextmanager
def attributes_missed() -> Iterator[Missed]:
    """Note, per module ``__dict__`` (by id), the names ``nn.Module.__getattr__`` did not find
    in this thread while this runs."""
    with _GETATTR.watching({}) as missed:
        yield missed
