"""A block of dualgraph's own tensor ops, hidden from what watches the user's call.

Warmup and the RNG watch read and compare tensors (a copy of an input's bytes, a generator's
state) while the lint's ``TorchFunctionMode`` and the memory probe's dispatch mode watch the
callable: those ops are no ops of the callable's, so neither mode may see them.

A capture enters it a dozen times per callable, mostly with no dispatch mode on: then nothing is
taken off the mode stacks (torch's ``_disable_current_modes`` would take none, after importing
its mode classes anew on every call), and it is a plain object rather than a generator.

>>> import torch
>>> with unobserved():
...     torch.ones(2).sum().item()
2.0
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["unobserved"]

_len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack


class unobserved:
    """Run the block with torch function handling and the current dispatch modes off."""

    __slots__ = ("_function", "_modes")

    def __enter__(self) -> None:
        self._function = torch._C.DisableTorchFunction()
        self._function.__enter__()
        self._modes: contextlib.AbstractContextManager[Any] | None = None
        if _len_torch_dispatch_stack() or _len_torch_dispatch_stack_pre_dispatch():
            modes = _disable_current_modes()
            try:
                modes.__enter__()
            except BaseException:
                self._function.__exit__(None, None, None)
                raise
            self._modes = modes

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self._modes is not None:
                self._modes.__exit__(kind, error, traceback)
        finally:
            self._function.__exit__(kind, error, traceback)
