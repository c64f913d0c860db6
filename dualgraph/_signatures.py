"""A function's signature, read once for many callables while :func:`signatures_read_once` runs.

Graphing twelve blocks of one class reads twelve bound methods of one ``forward``: the same
signature each time (``inspect.signature`` costs about 25 us a function). Within
:func:`signatures_read_once` (the setup of one graphing call, where nothing runs in between that
could change a function) a function's signature, or that of a bound method of it, is read once,
keyed by the function and by what its signature is read from (its code, defaults, keyword
defaults, ``__signature__`` and ``__wrapped__``), each kept alive with it so that no other
object takes its id meanwhile. Outside, every call reads anew.

>>> class Block:
...     def forward(self, x, scale=2.0):
...         return x
>>> with signatures_read_once():
...     first, second = signature_of(Block().forward), signature_of(Block().forward)
>>> first is second, str(first)
(True, '(x, scale=2.0)')
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["signature_of", "signatures_read_once"]

#: Per function (and how it is read), what it was read from and its signature, while
#: :func:`signatures_read_once` runs: ``None`` outside.
_READ: contextvars.ContextVar[dict[tuple[Any, ...], tuple[Any, ...]] | None] = (
    contextvars.ContextVar("dualgraph_signatures_read", default=None)
)


@contextlib.contextmanager
def signatures_read_once() -> Iterator[None]:
    """Within: :func:`signature_of` reads each function's signature once."""
    token = _READ.set({})
    try:
        yield
    finally:
        _READ.reset(token)


def signature_of(fn: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature(fn, follow_wrapped=False)`` (the signature a call binds to: a
    wrapper's own, never the one it wraps; raising as it raises), read once per function and
    what its signature is read from while :func:`signatures_read_once` runs: a plain function, or a
    method bound to any object (whose signature leaves out its first parameter, whatever the
    object); any other callable is read anew."""
    read = _READ.get()
    method = type(fn) is types.MethodType
    function = fn.__func__ if method else fn  # type: ignore[attr-defined]
    if (
        read is None
        or type(function) is not types.FunctionType
        or "__signature__" in function.__dict__
        or "__wrapped__" in function.__dict__
    ):
        return inspect.signature(fn, follow_wrapped=False)
    sources = (function, function.__code__, function.__defaults__, function.__kwdefaults__)
    key = (method, *map(id, sources))
    found = read.get(key)
    if found is None:
        found = read[key] = (
            *sources,
            inspect.signature(fn, follow_wrapped=False),
        )  # the sources kept alive
    signature: inspect.Signature = found[-1]
    return signature
