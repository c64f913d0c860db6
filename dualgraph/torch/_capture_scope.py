"""What this thread is capturing now: a graphed callable called inside a capture is refused.

Graphs do not nest. A graphed callable called while another callable is warmed up or captured
would copy its inputs into its static buffers inside the other's graph and replay a graph of its
own there: on CUDA, a graph launched while another is being captured, whose copies the outer
graph keeps and whose replay it does not (or a failed capture); on ``"emulate"``, a callable that
re-runs Python every call and so would seem to work. Both backends refuse it the same way, at
the call, before the callable's buffers or state are touched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .._errors import DualgraphError
from ._capture_failure import Progress

__all__ = ["CAPTURE", "capture_scope", "nested_call"]


class _Scope(threading.local):
    """``progress``: the capture this thread is running (``None``: none)."""

    progress: Progress | None = None


#: Read by every graphed call (one attribute of a thread-local): ``CAPTURE.progress``.
CAPTURE = _Scope()


@contextlib.contextmanager
def capture_scope(progress: Progress) -> Iterator[None]:
    """The block warms up and captures the callables ``progress`` follows, in this thread."""
    outer = CAPTURE.progress
    CAPTURE.progress = progress
    try:
        yield
    finally:
        CAPTURE.progress = outer


def nested_call(name: str) -> DualgraphError:
    """The error for graphed callable ``name`` called inside this thread's capture."""
    progress = CAPTURE.progress
    outer = progress.name if progress is not None and progress.name else "another callable"
    return DualgraphError(
        f"{name} is graphed and was called while {outer} is being captured: graphs do not "
        "nest (the outer graph would keep the copies into its buffers, not its replay). Graph "
        f"{outer} with the original callable inside (a module: dualgraph.torch.restore it "
        f"first, or graph {outer} before its parts), or graph the two side by side as "
        "callables graphed together, each called on its own, in the order they run"
    )
