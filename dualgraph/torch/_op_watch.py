"""One ``TorchDispatchMode`` that shows every ATen op to several observers.

The capture lint checks an op before it runs, the memory probe looks at what it allocated after;
observing both through one mode halves the cost of the mode machinery (each Python dispatch mode
adds a few microseconds to every op, and a warmup iteration runs hundreds of ops per block).

>>> import torch
>>> class Count:
...     ops = 0
...     def before_op(self, func, args, kwargs):
...         self.ops += 1
>>> count = Count()
>>> with OpWatch(before=[count]):
...     _ = torch.ones(2) + 1
>>> count.ops
2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpWatch"]


class _Before(Protocol):
    def before_op(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None: ...


class _After(Protocol):
    def after_op(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
    ) -> None: ...


class OpWatch(TorchDispatchMode):
    """Calls ``before_op`` of ``before`` and ``after_op`` of ``after`` around every ATen op."""

    def __init__(self, *, before: Sequence[_Before] = (), after: Sequence[_After] = ()) -> None:
        super().__init__()
        self.before = tuple(before)
        self.after = tuple(after)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for observer in self.before:
            observer.before_op(func, args, kwargs)
        out = func(*args, **kwargs)
        for watcher in self.after:
            watcher.after_op(func, args, kwargs, out)
        return out
