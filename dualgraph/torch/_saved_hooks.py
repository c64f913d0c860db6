"""dualgraph's own saved-tensor hooks, pushed also where the caller disabled such hooks.

``torch.autograd.graph.disable_saved_tensors_hooks`` refuses hooks of the code it runs; the
warmup's and the memory plan's hooks only watch what autograd saves, so eager's forward and
backward run under them as without. torch cannot disable hooks while one is pushed, so the
callable's warmup runs with them enabled (hooks it pushes itself are not refused there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["own_saved_tensors_hooks"]

_disabled_message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_enable = torch._C._autograd._saved_tensors_hooks_enable
_disable = torch._C._autograd._saved_tensors_hooks_disable


@contextmanager
def own_saved_tensors_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]
) -> Iterator[None]:
    """``saved_tensors_hooks(pack, unpack)``, also inside ``disable_saved_tensors_hooks``."""
    message = _disabled_message()
    if message is None:
        with saved_tensors_hooks(pack, unpack):
            yield
        return
    _enable()  # torch refuses to disable hooks again while any is pushed: enabled meanwhile
    try:
        with saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _disable(message)
