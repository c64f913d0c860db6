"""The module attributes a callable looked up and did not find during warmup and capture.

A forward reading an optional attribute (``getattr(self, "mask", None)``, ``hasattr(self,
"scale")``) took the branch without it at capture; the graphs replay that branch. A tensor or
object set under that name after capture (``model.mask = torch.tensor(...)``) is one eager's
forward would use and the graphs never read. An attribute set under another name (a hook of the
graphed module keeping its output: ``module.previous = output``) was never looked up, so it is
no change.

A lookup that misses a module's ``__dict__`` and class ends in ``nn.Module.__getattr__`` (which
then raises ``AttributeError``): watched by wrapping that method for the extent of a capture.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> with attributes_missed() as missed:
...     _ = getattr(layer, "mask", None)
>>> "mask" in missed[id(layer.__dict__)]
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["attributes_missed"]


@contextlib.contextmanager
def attributes_missed() -> Iterator[dict[int, set[str]]]:
    """Note, per module ``__dict__`` (by id), the names ``nn.Module.__getattr__`` did not find
    while this runs; put the method back after."""
    missed: dict[int, set[str]] = {}
    module_class = torch.nn.Module
    found = module_class.__getattr__

    def watched(self: torch.nn.Module, name: str) -> object:
        try:
            return found(self, name)
        except AttributeError:
            missed.setdefault(id(self.__dict__), set()).add(name)
            raise

    module_class.__getattr__ = watched  # type: ignore[method-assign,assignment]
    try:
        yield missed
    finally:
        module_class.__getattr__ = found  # type: ignore[method-assign]
