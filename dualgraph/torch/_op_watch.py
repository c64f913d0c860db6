"""Observers of what a callable runs: one ``TorchDispatchMode`` shows every ATen op to all of them.

The capture lint checks an op before it runs, the memory probe looks at what it allocated after;
observing both through one mode halves the cost of the mode machinery (each Python dispatch mode
adds a few microseconds to every op, and a warmup iteration runs hundreds of ops per block).

:class:`OpObserver` is what the lint and the memory probe share: entered with ``with`` (as often
as needed), or several at once through :func:`observing`, which gives them one :class:`OpWatch`.

>>> import torch
>>> class Count(OpObserver):
...     ops = 0
...     def before_op(self, func, args, kwargs):
...         self.ops += 1
>>> count = Count()
>>> with count:
...     _ = torch.ones(2) + 1
>>> count.ops
2
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpObserver", "OpWatch", "code_of", "observing", "tensors_in"]


class _Before(Protocol):
    def before_op(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None: ...


class _After(Protocol):
    def after_op(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
    ) -> None: ...


_Observer = TypeVar("_Observer", bound="OpObserver")


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


class OpObserver:
    """Watches what runs inside ``with`` blocks; its ATen ops through an :class:`OpWatch`.

    A subclass defines ``before_op`` and/or ``after_op`` (called around every ATen op), the
    other context managers it needs (:meth:`contexts`: a function mode, saved-tensor hooks) and
    what to do after each watched block (:meth:`finish`, run even when the block raised).
    """

    def __init__(self) -> None:
        self._entered: list[contextlib.ExitStack] = []

    def contexts(self) -> Sequence[AbstractContextManager[Any]]:
        """Context managers entered (in order) around each watched block, besides the op watch."""
        return ()

    def finish(self) -> None:
        """Called after each watched block (after its contexts are exited)."""

    @contextlib.contextmanager
    def watching(self, *, dispatch: bool = True) -> Iterator[None]:
        """Watch what runs inside; ``dispatch=False`` leaves the ATen ops to a shared
        :class:`OpWatch` (:func:`observing` gives one to several observers)."""
        try:
            with contextlib.ExitStack() as stack:
                for context in self.contexts():
                    stack.enter_context(context)
                if dispatch:
                    stack.enter_context(_op_watch_of([self]))
                yield
        finally:
            self.finish()

    def __enter__(self: _Observer) -> _Observer:
        stack = contextlib.ExitStack()
        stack.enter_context(self.watching())
        self._entered.append(stack)
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered.pop().close()


@contextlib.contextmanager
def observing(observers: Sequence[OpObserver]) -> Iterator[None]:
    """The observers, in order, their ATen ops watched through one :class:`OpWatch`."""
    with contextlib.ExitStack() as stack:
        for observer in observers:
            stack.enter_context(observer.watching(dispatch=False))
        stack.enter_context(_op_watch_of(observers))
        yield


def _op_watch_of(observers: Sequence[OpObserver]) -> OpWatch:
    return OpWatch(
        before=[o for o in observers if callable(getattr(o, "before_op", None))],  # type: ignore[misc]
        after=[o for o in observers if callable(getattr(o, "after_op", None))],  # type: ignore[misc]
    )


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` (nested tuples, lists and mappings), in order."""
    if isinstance(tree, torch.Tensor):  # most calls and ops take or return one tensor
        return [tree]
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, tuple | list):
            stack.extend(reversed(item))
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
    return found


def code_of(fn: Any) -> Any:
    """The code object whose frame is on the stack while ``fn`` runs (``None`` if none is).

    >>> def double(x):
    ...     return 2 * x
    >>> code_of(functools.partial(double, 3)) is double.__code__
    True
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward  # an instance-level forward, or the class's
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None and callable(fn):  # an object with a __call__ method
        call = type(fn).__dict__.get("__call__")
        code = getattr(call, "__code__", None)
    return code
