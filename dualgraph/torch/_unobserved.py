"""A block of dualgraph's own tensor ops, hidden from what watches the user's call.

Warmup and the RNG watch read and compare tensors (a copy of an input's bytes, a generator's
state) while the lint's ``TorchFunctionMode`` and the memory probe's dispatch mode watch the
callable: those ops are no ops of the callable's, so neither mode may see them.

>>> import torch
>>> with unobserved():
...     torch.ones(2).sum().item()
2.0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["unobserved"]


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Run the block with torch function handling and the current dispatch modes off."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield
