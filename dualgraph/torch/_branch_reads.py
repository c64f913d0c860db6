"""Whether a callable's Python reads what tells eager's calls apart: grad mode, inputs' flags.

A graph replays the kernels of the branch its capture took. Python that branches on grad mode
(``torch.is_grad_enabled()``: ``nn.TransformerEncoderLayer``'s fast path, a checkpoint taken
only ``if self.training and torch.is_grad_enabled()``) or on an input's ``requires_grad``
takes another branch in eager when called under ``torch.no_grad()``, or with inputs whose
``requires_grad`` differs from the samples'. The inspected warmup forward watches for such
reads, so that those calls can run eagerly (:class:`GraphedCallable`) where a replay would
silently differ.

Grad mode reads are seen through ``torch.is_grad_enabled`` and
``torch.is_inference_mode_enabled`` (and their ``torch._C`` names), replaced in the capturing
thread while the forward runs (:class:`WatchedFunction`); a read by a grad mode context manager
saving the mode it puts back is no branch. ``requires_grad``, ``grad_fn`` and ``is_leaf`` reads
are seen through descriptors ``torch.Tensor`` holds meanwhile (not a function mode: with one
active, torch's fast-path checks stop at ``has_torch_function`` before reading grad mode): of
an input, they are that input's flag; of a tensor the callable computed, they tell grad mode
and the inputs' flags alike. An input's ``requires_grad`` turned on (``x.requires_grad_()``,
``x.requires_grad = True``: eager's call turns the caller's tensor's on, and its outputs
depend on it) counts as a read of it.

>>> import torch
>>> x = torch.ones(2, requires_grad=True)
>>> with branch_reads([x]) as seen:
...     y = x * 2 if torch.is_grad_enabled() and x.requires_grad else x
>>> seen.grad_mode, seen.requires_grad
(True, (0,))
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.autograd.grad_mode
import torch.utils.hooks
from torch.nn.modules._functions import BackwardHookFunction

from ._watched_function import WatchedFunction

__all__ = ["MODE_READ_WATCH", "BranchReads", "branch_reads"]

_ADAPTER_DIR = os.path.dirname(os.path.abspath(__file__))
#: Where reads of grad mode save the mode to put it back (``no_grad().__enter__``): no branch.
_SAVING_FILES = frozenset({torch.autograd.grad_mode.__file__})
#: Where reads of grad mode choose only whether a backward hook's identity node is recorded
#: (a submodule's ``register_full_backward_hook``): the forward's values are the same, and
#: without grad mode there is no backward to hook, so a replay under no_grad is eager's.
_BACKWARD_HOOK_FILES = frozenset({torch.utils.hooks.__file__})
_HOOK_FORWARD = BackwardHookFunction.forward.__code__
#: Its forward and the comprehension in it (a code of its own before Python 3.12).
_BACKWARD_HOOK_CODES = frozenset(
    {_HOOK_FORWARD, *(c for c in _HOOK_FORWARD.co_consts if isinstance(c, types.CodeType))}
)
#: What a tensor tells of the autograd history recorded for it.
_RECORD_FLAGS = frozenset({"requires_grad", "grad_fn", "is_leaf"})


class BranchReads:
    """What :func:`branch_reads` saw: whether grad mode was read, and of which inputs (their
    positions) ``requires_grad`` was, and ``grad_fn`` or ``is_leaf``."""

    __slots__ = ("_all", "_history", "_inputs", "_requires_grad", "_turned_on", "grad_mode")

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.grad_mode = False
        self._inputs = {id(t): i for i, t in enumerate(inputs)}
        self._all = tuple(range(len(inputs)))
        self._requires_grad: set[int] = set()
        self._history: set[int] = set()
        self._turned_on: set[int] = set()

    @property
    def requires_grad(self) -> tuple[int, ...]:
        """The inputs whose ``requires_grad`` the forward's Python read, in order."""
        return tuple(sorted(self._requires_grad))

    @property
    def history(self) -> tuple[int, ...]:
        """The inputs whose ``grad_fn`` or ``is_leaf`` the forward's Python read, in order: they
        tell a leaf (as every input is at capture) from a tensor computed under grad."""
        return tuple(sorted(self._history))

    @property
    def turned_on(self) -> tuple[int, ...]:
        """The inputs whose ``requires_grad`` the forward's Python turned on, in order."""
        return tuple(sorted(self._turned_on))

    def note_flag_set(self, tensor: Any) -> None:
        """Note that ``tensor``'s ``requires_grad`` was turned on (``x.requires_grad_()``): of
        an input, eager's call turns the caller's tensor's on, so a call whose tensor's differs
        from its sample's takes another branch (its outputs depend on it), as after a read."""
        position = self._inputs.get(id(tensor))
        if position is not None:
            self._requires_grad.add(position)
            self._turned_on.add(position)

    def note_flag_read(
        self, tensor: Any, *, of_grad_mode: bool = True, of_history: bool = False
    ) -> None:
        """Note a read of ``tensor``'s ``requires_grad`` (``grad_fn``, ``is_leaf``: then
        ``of_history``, as they also tell whether an input is a leaf);
        ``of_grad_mode=False`` where the reader's branch matters only with grad mode on."""
        position = self._inputs.get(id(tensor))
        if position is not None:
            self._requires_grad.add(position)
            if of_history:
                self._history.add(position)
        elif isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
            # computed from the inputs under grad mode: its flag tells both
            self.grad_mode = self.grad_mode or of_grad_mode
            self._requires_grad.update(self._all)


def _from_the_callable(frame: Any) -> bool:
    file = frame.f_code.co_filename
    return file not in _SAVING_FILES and not file.startswith(_ADAPTER_DIR)


def _for_a_backward_hook(frame: Any) -> bool:
    code = frame.f_code
    return code in _BACKWARD_HOOK_CODES or code.co_filename in _BACKWARD_HOOK_FILES


def _noting_mode_read(found: Any, watchers: Callable[[], list[BranchReads]]) -> Any:
    def watched() -> bool:
        frame = sys._getframe(1)
        if _from_the_callable(frame) and not _for_a_backward_hook(frame):
            for seen in watchers():
                seen.grad_mode = True
        return bool(found())

    return watched


#: The code of the replacement that watches a read (the capture lint looks past its frame).
MODE_READ_WATCH = _noting_mode_read(None, list).__code__

_WATCHED = tuple(
    WatchedFunction(owner, name, _noting_mode_read)
    for owner in (torch, torch._C)
    for name in ("is_grad_enabled", "is_inference_mode_enabled")
)


class _WatchedFlag:
    """A tensor's flag (``requires_grad``) read through ``found`` (torch's descriptor), noting
    each read by the callable; named as the flag, as torch's is (the lint names reads so)."""

    def __init__(self, found: Any, watchers: Callable[[], list[BranchReads]]) -> None:
        self.__name__ = found.__name__
        self._found = found
        self._watchers = watchers
        self._of_history = found.__name__ != "requires_grad"  # grad_fn, is_leaf

    def __get__(self, tensor: Any, owner: Any = None) -> Any:
        if tensor is None:
            return self
        frame = sys._getframe(1)
        if _from_the_callable(frame):
            of_grad_mode = not _for_a_backward_hook(frame)
            for seen in self._watchers():
                seen.note_flag_read(tensor, of_grad_mode=of_grad_mode, of_history=self._of_history)
        return self._found.__get__(tensor, owner)

    def __set__(self, tensor: Any, value: Any) -> None:
        self._found.__set__(tensor, value)  # torch's refuses where the flag cannot be set
        if value and _from_the_callable(sys._getframe(1)):  # requires_grad, the one settable
            for seen in self._watchers():
                seen.note_flag_set(tensor)


def _noting_flag_set(found: Any, watchers: Callable[[], list[BranchReads]]) -> Any:
    """``Tensor.requires_grad_`` (``found``), noting each call by the callable turning a
    tensor's ``requires_grad`` on."""

    def requires_grad_(tensor: Any, requires_grad: bool = True) -> Any:
        result = found(tensor, requires_grad)  # torch's refuses where the flag cannot be set
        if requires_grad and _from_the_callable(sys._getframe(1)):
            for seen in watchers():
                seen.note_flag_set(tensor)
        return result

    return requires_grad_


_WATCHED_FLAGS = tuple(
    WatchedFunction(torch.Tensor, name, _WatchedFlag) for name in sorted(_RECORD_FLAGS)
)


_ALL_WATCHED = (
    *_WATCHED,
    *_WATCHED_FLAGS,
    WatchedFunction(torch.Tensor, "requires_grad_", _noting_flag_set),
)


@contextlib.contextmanager
def branch_reads(inputs: Sequence[torch.Tensor]) -> Iterator[BranchReads]:
    """Watch, in this thread, the reads of grad mode and of ``inputs``' ``requires_grad``."""
    seen = BranchReads(inputs)
    # begin/end rather than a context manager each in an ExitStack: every warmup forward
    # enters these seven (35 us a warmup that way, a fifth of its own Python)
    begun: list[WatchedFunction[BranchReads]] = []
    try:
        for watched in _ALL_WATCHED:
            watched.begin(seen)
            begun.append(watched)
        yield seen
    finally:
        failure: BaseException | None = None
        for watched in reversed(begun):  # each ended, whatever another raises
            try:
                watched.end(seen)
            except BaseException as error:  # raised once the others have ended
                failure = failure or error
        if failure is not None:
            raise failure
