"""A failed capture: the :class:`CaptureError` that names the callable, the phase and the cause,
and the repair that leaves CUDA usable afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import traceback
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CaptureError, DualgraphError
from ._lint import CaptureLintError

__all__ = [
    "Progress",
    "Refused",
    "describe_failure",
    "recover_cuda",
    "release_failed_attempt",
    "released_on_failure",
    "repair_cuda_rng",
]


class Refused(DualgraphError):
    """A capture refused on purpose; its message is the cause, without a type name."""


def repair_cuda_rng() -> None:
    """Make the CUDA RNG usable again after a capture that touched it failed.

    Without this every later CUDA RNG call fails with "Offset increment outside graph capture
    encountered unexpectedly" (docs/cuda_graphs.md); re-installing the generator's own state
    fixes it.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    for generator in torch.cuda.default_generators:
        generator.graphsafe_set_state(generator.clone_state())


@contextlib.contextmanager
def released_on_failure() -> Iterator[None]:
    """Free what the frames a failure of the block left hold (:func:`release_failed_attempt`).

    Around a whole graphing: besides the capture's own frames, those of what failed after some
    graphs were captured (a later shape bucket, a check of all of them) hold those graphs, their
    pool and their static buffers, for as long as the error is held.
    """
    before = sys.exc_info()[1]
    try:
        yield
    except BaseException as error:
        release_failed_attempt(error, before)
        raise


def release_failed_attempt(error: BaseException, before: BaseException | None = None) -> None:
    """Free what the frames of a failed capture still hold: the tensors and autograd graphs of
    its warmup and capture (the traceback keeps its line numbers, not its locals).

    The error's traceback holds every frame it left, and the frame that catches it holds the
    error in turn, so they would live on until a garbage collection. A forward that failed
    half-way leaves a graph whose ``AccumulateGrad`` nodes were made on the capture's side
    stream; while they live, every backward through those parameters runs them there (one more
    cross-stream wait, and torch's stream-mismatch warning), and a later capture of the same
    module waits on that stream from inside its graph, which fails it.

    Only the attempt's own frames are cleared. ``before`` is the error the caller was handling
    when the capture began (``sys.exc_info()[1]`` then): the chain reaches it, but it and its
    frames are the caller's, to read in a debugger. Frames still running (the caller's) and
    those of live generators are left alone: clearing a suspended generator's frame closes the
    generator under its owner (a finished generator's frame is cleared as any other).

    >>> def fails(x):
    ...     y = x * 2
    ...     raise ValueError("failed")
    >>> try:
    ...     fails(torch.ones(1))
    ... except ValueError as error:
    ...     release_failed_attempt(error)
    ...     frames = [f for f, _ in traceback.walk_tb(error.__traceback__)]
    >>> frames[-1].f_locals
    {}
    """
    frames = {
        id(frame): frame
        for current in _own_errors(error, before)
        for frame, _ in traceback.walk_tb(current.__traceback__)
    }
    cleared, cells = _clear(frames.values(), _of_live_generators(frames))
    if cells:
        _empty_unused_cells(cleared, cells)


def _clear(
    frames: Iterable[types.FrameType], live: set[int]
) -> tuple[list[types.FrameType], dict[int, types.CellType]]:
    """Clear ``frames`` but those of ``live`` generators and those still running; the frames
    cleared, and the cells of their own variables that inner functions close over."""
    cleared: list[types.FrameType] = []
    cells: dict[int, types.CellType] = {}
    for frame in frames:
        if id(frame) in live:
            continue
        own = _cells_made_by(frame) if frame.f_code.co_cellvars else {}
        try:
            frame.clear()
        except RuntimeError:  # still running
            continue
        cleared.append(frame)
        cells.update(own)
        # A snapshot of its locals taken earlier (the capture lint's walk reads f_locals; a
        # debugger) outlives clear() before Python 3.13; reading f_locals again drops it.
        frame.f_locals  # noqa: B018
    return cleared, cells


_GENERATOR_CODE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _of_live_generators(frames: dict[int, types.FrameType]) -> set[int]:
    """The ids among ``frames`` that a generator or coroutine not finished yet runs (a
    finished one lets go of its frame); one scan of the heap, where any could be one."""
    candidates = [frame for frame in frames.values() if frame.f_code.co_flags & _GENERATOR_CODE]
    if not candidates:
        return set()
    live: set[int] = set()
    for referrer in gc.get_referrers(*candidates):
        if isinstance(referrer, types.GeneratorType):
            live.add(id(referrer.gi_frame))
        elif isinstance(referrer, types.CoroutineType):
            live.add(id(referrer.cr_frame))
        elif isinstance(referrer, types.AsyncGeneratorType):
            live.add(id(referrer.ag_frame))
    return live & frames.keys()


def _cells_made_by(frame: types.FrameType) -> dict[int, types.CellType]:
    """The cells of ``frame``'s own variables that inner functions close over (not those of
    an enclosing scope, which its function was given)."""
    held = gc.get_referents(frame)
    given: set[int] = set()
    for item in held:
        if isinstance(item, types.FunctionType) and item.__code__ is frame.f_code:
            given = {id(cell) for cell in item.__closure__ or ()}
    return {
        id(item): item
        for item in held
        if isinstance(item, types.CellType) and id(item) not in given
    }


def _empty_unused_cells(
    frames: Sequence[types.FrameType], cells: dict[int, types.CellType]
) -> None:
    """Empty the ``cells`` of the cleared ``frames`` that only closures nothing can call any
    more still hold.

    A cleared frame still holds its function, and so an inner function it ran holds its cells:
    torch's ``Module._call_impl`` runs a module's hooks through such a closure over the
    module's inputs and output, which keep the half-built graph. A closure something besides
    these frames holds may run again (a hook the forward registered), and keeps its cells. Two
    scans of the heap (:func:`gc.get_referrers`), on this failure path only.
    """
    ours = {id(frame) for frame in frames}
    functions = {
        id(held): held
        for frame in frames
        for held in gc.get_referents(frame)
        if isinstance(held, types.FunctionType)
        and held.__code__ is frame.f_code
        and held.__closure__ is not None
    }
    elsewhere = _held_elsewhere(functions, ours) if functions else set()
    closures = {
        id(function.__closure__) for key, function in functions.items() if key not in elsewhere
    }
    in_use = _held_elsewhere(cells, ours | closures)
    for key, cell in cells.items():
        if key not in in_use:
            with contextlib.suppress(ValueError):  # empty already
                del cell.cell_contents


def _held_elsewhere(objects: dict[int, Any], allowed: set[int]) -> set[int]:
    """The ids among ``objects`` that something besides ``allowed`` (ids) refers to."""
    allowed = allowed | {id(objects), id(sys._getframe(1))}
    held: set[int] = set()
    for referrer in gc.get_referrers(*objects.values()):
        if id(referrer) not in allowed:
            held.update(id(ref) for ref in gc.get_referents(referrer) if id(ref) in objects)
    return held


def _chain(error: BaseException | None, stop: frozenset[int] = frozenset()) -> list[BaseException]:
    """``error`` and every error it was raised from or during, each once, none of ``stop``."""
    found: list[BaseException] = []
    seen = set(stop)
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        pending += (current.__cause__, current.__context__)
    return found


def _own_errors(error: BaseException, before: BaseException | None) -> list[BaseException]:
    """The errors of ``error``'s chain raised by the attempt, not those the caller handled."""
    return _chain(error, frozenset(map(id, _chain(before))))


def recover_cuda() -> None:
    with contextlib.suppress(RuntimeError):  # the failed capture's own error is reported
        torch.cuda.synchronize()
    repair_cuda_rng()


@dataclass
class Progress:
    """Where a capture is, so that a failure can name the callable and the phase."""

    name: str = ""
    phase: str = "setup"
    # The error the caller was handling when the capture began (``sys.exc_info()[1]``): a failure's
    # chain reaches it, but it is no part of the attempt.
    before: BaseException | None = None


def describe_failure(error: BaseException, progress: Progress, backend: str) -> CaptureError:
    """A :class:`CaptureError` naming the callable, the phase and the root cause."""
    own = {id(raised) for raised in _own_errors(error, progress.before)}
    root = error
    while (
        (context := root.__context__) is not None
        and root.__cause__ is None
        and id(context) in own  # the caller's error is not the attempt's cause
        and context is not root
    ):
        root = context
    cause = _show(root)
    if root is not error:
        cause += f" (then {_show(error)})"
    name = progress.name
    hint = ""
    if "capture" in progress.phase and "operation not permitted when stream is capturing" in cause:
        hint = " (a CPU sync such as .item(), .cpu() or printing a tensor cannot be captured)"
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            hint = (
                " (anomaly mode is on: its NaN check reads each backward node's grads on the host,"
                " a CPU sync a capture cannot hold; capture outside it or with"
                " torch.autograd.set_detect_anomaly(True, check_nan=False))"
            )
    if "CUDA generator not in capture mode" in cause:
        # torch's words for a generator the graph has not registered (lint="auto" is off on CUDA)
        hint = (
            " (a torch.Generator of your own draws random numbers inside the callable: a capture"
            " registers only each device's default generator and Transformer Engine's RNG"
            " tracker; draw from the default one, seeded with torch.cuda.manual_seed, and"
            " lint='error' names the line)"
        )
    if "legacy stream depend on a capturing blocking stream" in cause:
        hint = (
            " (is the model already wrapped in DistributedDataParallel? Graph its layers first,"
            " then wrap it: see docs/ddp.md)"
        )
    where = f"capturing {name} ({backend})" if name else f"capturing ({backend})"
    return CaptureError(f"{where} failed during {progress.phase}: {cause}{hint}")


def _show(error: BaseException) -> str:
    # CUDA errors append several lines of generic advice; the first line is the cause.
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(error, Refused | CaptureLintError) or type(error) is DualgraphError:
        return first
    return f"{type(error).__name__}: {first}"
