"""Whether a callable turns grad mode on itself, so that eager records history under no_grad.

A callable that enters ``torch.enable_grad()`` (or ``torch.set_grad_enabled(True)``; a force
field taking ``-dE/dx`` in its forward) records history even when called under
``torch.no_grad()``: eager's outputs then require grad and send grads to the inputs and
parameters. A replay under ``no_grad`` records nothing, so such a call is refused.

Warmup's first forward runs with grad on, where such a callable sets grad mode on while it is
on already (what no other code does: leaving its own ``no_grad`` sets it on while it is off).
Only then is one more forward run, under ``no_grad``, to learn which outputs record history.
``torch._C._set_grad_enabled`` is watched in the capturing thread (:class:`WatchedFunction`).

>>> import torch
>>> with turns_grad_mode_on() as seen:
...     with torch.enable_grad():
...         pass
>>> seen.on_while_on
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._watched_function import WatchedFunction

__all__ = ["GradModeSeen", "turns_grad_mode_on"]


class GradModeSeen:
    """What :func:`turns_grad_mode_on` saw: whether grad mode was set on while on."""

    __slots__ = ("on_while_on",)

    def __init__(self) -> None:
        self.on_while_on = False


def _noting_on_while_on(found: Any, watchers: Callable[[], list[GradModeSeen]]) -> Any:
    is_enabled = torch.is_grad_enabled

    def watched(enabled: bool) -> None:
        if enabled and is_enabled():
            for seen in watchers():
                seen.on_while_on = True
        found(enabled)

    return watched


_SET_GRAD_ENABLED: WatchedFunction[GradModeSeen] = WatchedFunction(
    torch._C, "_set_grad_enabled", _noting_on_while_on
)


@contextlib.contextmanager
def turns_grad_mode_on() -> Iterator[GradModeSeen]:
    """Watch ``torch._C._set_grad_enabled`` (which ``enable_grad`` and ``set_grad_enabled``
    call) in this thread for a call setting grad mode on while it is on."""
    with _SET_GRAD_ENABLED.watching(GradModeSeen()) as seen:
        yield seen
