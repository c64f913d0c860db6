"""What happens once, at capture: static buffers, warmup, graphs, and the finished plan.

``"cuda"`` follows the rules of CUDA graph capture: warmup iterations on a side stream, then the
forward graphs of all callables in execution order, then their backward graphs in reverse order,
all in one memory pool (``_capture_cuda.py``). ``"emulate"`` builds the same static buffers
without a graph and an :class:`EmulatedReplay` that re-runs the callable on them, so aliasing
mistakes show up on a CPU (``_capture_emulated.py``). Both warm up the same way (``_warmup.py``,
which also says what the first warmup call is inspected for) and gather what they learn about
each callable in a ``_Capture`` (``_capture_state.py``); a failure becomes a
:class:`CaptureError` naming the callable and the phase (``_capture_failure.py``).

Either way :func:`capture` returns one frozen :class:`ReplayPlan` per callable.
:func:`capture_copies` captures several copies of each callable (replay slots, each with its own
static buffers and graphs, ``_slots.py``) in an order and into pools a :class:`CaptureLayout`
chooses; the callable is warmed up once, and its copies learn what warmup found.

With ``results_outside_pool`` (shape buckets, ``_buckets.py``) the graphs copy their outputs and
grads into static buffers allocated outside the pool, so that everything left in the pool is
written by a replay before that replay reads it; and ``param_grad_buffers`` (with
``param_accumulators`` under ``param_grads="auto"``) lets captures of one callable share their
parameter grad buffers (or in-graph accumulators).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._capture_cuda import capture_cuda
from ._capture_emulated import capture_emulated
from ._capture_failure import (
    Progress,
    Refused,
    describe_failure,
    recover_cuda,
    release_failed_attempt,
    repair_cuda_rng,
)
from ._capture_state import _Capture
from ._closed_over import classes_read_once
from ._grad_checks import held_by_a_graph
from ._hooks import NO_HOOKS, CallableHooks
from ._host_state import record_host_state, refuse_parameters_off_device
from ._inputs import InputGuard
from ._missed_attributes import attributes_missed
from ._nesting import capture_scope
from ._param_attributes import parameter_attributes_kept
from ._params import suspended_tensor_hooks
from ._plan import Backend, ParamGradsMode, ReplayPlan
from ._probe import LintMode, WarmupProbe, attach_probes, with_lint_findings

__all__ = [
    "CaptureLayout",
    "CaptureOptions",
    "CaptureRequest",
    "CaptureStep",
    "capture",
    "capture_copies",
    "repair_cuda_rng",
]


@dataclass(frozen=True)
class CaptureRequest:
    """One callable to capture: its forward, its module (if any) and its checked samples."""

    name: str
    fn: Callable[..., Any]
    module: torch.nn.Module | None
    inputs: InputGuard
    sample_tensors: tuple[torch.Tensor, ...]
    # Static buffers for the parameter grads (one per parameter that requires grad), shared with
    # other captures of the same callable: "autograd" (and "auto" without accumulators) copy the
    # grads into them, "in_graph" adds them (they are the accumulators). ``None``: new ones.
    param_grad_buffers: tuple[torch.Tensor, ...] | None = None
    # "auto": the accumulators (the parameters' .grad) its backward graph adds those grads into,
    # shared the same way. ``None``: new ones.
    param_accumulators: tuple[torch.Tensor, ...] | None = None
    # What runs around the callable besides its graphs: the context of its Python, capture-time
    # hooks around each warmup and capture forward and backward, replay hooks (``_hooks.py``).
    hooks: CallableHooks = NO_HOOKS


@dataclass(frozen=True)
class CaptureOptions:
    """The options of :func:`dualgraph.torch.make_graphed_callables` that shape a capture."""

    backend: Backend
    num_warmup_iters: int
    allow_unused_input: bool
    pool: Any
    capture_error_mode: str
    clone_outputs: bool
    param_grads: ParamGradsMode
    # "cuda": static outputs and grads are buffers allocated outside the pool, which the graphs
    # copy into; the pool then holds only memory a replay writes before it reads it.
    results_outside_pool: bool = False
    # "cuda": static outputs only are such buffers (a schedule's: a graph captured before a set
    # of outputs existed replays before it in every later step, and may write its memory).
    outputs_outside_pool: bool = False
    lint: LintMode = "auto"  # issue 19 hook: the capture lint of the first warmup iteration


def capture(requests: Sequence[CaptureRequest], options: CaptureOptions) -> list[ReplayPlan]:
    """Warm up and capture every request (in order); one finished plan each.

    Raises :class:`CaptureError` naming the callable, the phase and the cause; then no capture
    is left open, buffers and hooks are as they were, and the CUDA RNG works.
    """
    return [plans[0] for plans in capture_copies(requests, options, _OneEach())]


@dataclass(frozen=True)
class CaptureStep:
    """One graph to capture (``"cuda"``): the forward or the backward of one copy, into a pool.

    ``pool`` ``None`` means the pool shared by the whole capture (``options.pool``, or a new one).
    """

    copy: _Capture
    backward: bool
    pool: Any = None


class CaptureLayout(Protocol):
    """Which copies of each callable to capture, and the order and pools of their graphs."""

    def copies(self, index: int, make: Callable[..., _Capture]) -> list[_Capture]:
        """The copies of request ``index``; ``make(like=..., buffers_from=...)`` builds one."""
        ...

    def steps(self, copies: Sequence[Sequence[_Capture]]) -> list[CaptureStep]:
        """Every graph to capture, in capture order (``"cuda"`` only)."""
        ...


class _OneEach:
    """One copy per callable: forwards in the order given, backwards in reverse, one pool."""

    def copies(self, index: int, make: Callable[..., _Capture]) -> list[_Capture]:
        return [make()]

    def steps(self, copies: Sequence[Sequence[_Capture]]) -> list[CaptureStep]:
        items = [item for group in copies for item in group]
        return [CaptureStep(item, False) for item in items] + [
            CaptureStep(item, True) for item in reversed(items)
        ]


def capture_copies(
    requests: Sequence[CaptureRequest], options: CaptureOptions, layout: CaptureLayout
) -> list[list[ReplayPlan]]:
    """Like :func:`capture`, with the copies and graph order ``layout`` gives: plans per request."""
    progress = Progress(before=sys.exc_info()[1])
    probes: list[WarmupProbe] = []  # issue 19 hook: lint and memory plan, for the error too
    try:
        # a graphed callable called inside is refused (the caller's saved-tensor hooks are kept
        # from the capture's activations around every entry point, in _graphed.py)
        with capture_scope(progress):
            return _capture_copies(requests, options, layout, progress, probes)
    except Exception as error:
        if options.backend == "cuda":
            recover_cuda()
        failure = with_lint_findings(  # issue 19 hook
            describe_failure(error, progress, options.backend), probes, error
        )
        probes.clear()  # they hold the static inputs; this frame stays in the error's traceback
        release_failed_attempt(error, progress.before)
        raise failure from error
    except BaseException as interrupted:  # KeyboardInterrupt, SystemExit: passed on as they are
        probes.clear()
        release_failed_attempt(interrupted, progress.before)
        raise


def _capture_copies(
    requests: Sequence[CaptureRequest],
    options: CaptureOptions,
    layout: CaptureLayout,
    progress: Progress,
    probes: list[WarmupProbe],
) -> list[list[ReplayPlan]]:
    # A function of its own, so that a failure leaves no frame running that holds the copies
    # (see release_failed_attempt).
    copies: list[list[_Capture]] = []
    shared = _shared_parameters(requests)
    with classes_read_once():  # nothing runs yet: each class's code and attributes read once
        for index, request in enumerate(requests):
            progress.name = request.name
            make = functools.partial(_Capture, request, options, shared=shared)
            copies.append(layout.copies(index, make))
            probes.append(copies[-1][0].probe)  # issue 19 hook: the warmed-up original's
    captures = [item for group in copies for item in group]
    _refuse_parameters_held_by_graphs(captures, progress)
    for item in captures:
        if item.like is None:
            progress.name = item.name
            refuse_parameters_off_device(item, options.backend)
    with contextlib.ExitStack() as restore:
        for item in captures:
            if item.like is not None:
                continue  # shares the module and parameters of its original
            if item.module_tensors is not None:
                restore.enter_context(item.module_tensors.left_as_found())
            else:  # a function or method: the tensors its code names that it updates, put back
                restore.enter_context(item.closure_updates.watching(item.request.fn))
            if options.param_grads != "in_graph":  # grads may go through autograd
                restore.enter_context(suspended_tensor_hooks(item.params))
        # Megatron's main_grad (and its flag) that the warmup's backward adds into: put back
        set_by_callables = restore.enter_context(
            parameter_attributes_kept(
                param for item in captures if item.like is None for param in item.params
            )
        )
        with attributes_missed(_recorded_classes(captures)) as missed:
            if options.backend == "cuda":
                capture_cuda(captures, layout.steps(copies), options, progress)
            else:
                capture_emulated(captures, options, progress)
        for item in captures:
            if item.like is None:
                for record in (item.module_tensors, item.code_tensors):
                    if record is not None:
                        record.note_looked_up(missed)
        for item in captures:
            if item.like is None and item.code_tensors is not None:
                # The plain values of the modules a function's code names, as capture left
                # them (a module's own: left_as_found): the graphs hold what it computed.
                item.code_tensors.record_attributes()
    for item in captures:
        item.param_flags = set_by_callables.of(item.params)
        item.param_memory = set_by_callables.written(item.params, item.param_names)
    for item in captures:  # buffers put back, the updated ones known (left_as_found)
        if item.like is None:
            progress.name = item.name
            record_host_state(item, options.backend)
    progress.phase = "planning"
    plans = [[item.plan() for item in group] for group in copies]
    attach_probes([group[0].diagnostics for group in plans], probes)  # issue 19 hook
    return plans


def _recorded_classes(captures: Sequence[_Capture]) -> list[type]:
    """The classes of the modules whose lookups in vain a capture keeps (``note_looked_up``): a
    module's own and its submodules', those a function's code names (not the module that only
    hangs them together, which nothing calls)."""
    return [
        type(module)
        for item in captures
        if item.like is None
        for record, root in ((item.module_tensors, True), (item.code_tensors, False))
        if record is not None
        for module in ((record.root, *record.modules) if root else record.modules)
        if module is not None
    ]


def _refuse_parameters_held_by_graphs(captures: Sequence[_Capture], progress: Progress) -> None:
    """Refuse a parameter whose ``AccumulateGrad`` node an autograd graph alive keeps.

    A node keeps the stream it was made on; a CUDA warmup and capture run on streams of their
    own, so the capture's backward would make that stream wait on the capturing one, which fails
    the capture (torch warns of the mismatch first). Found before anything is run or allocated,
    by ``"emulate"`` too, so that a CPU run shows what a GPU run would refuse. A graph that is
    garbage kept only by a reference cycle is collected first (once, and only when something
    would be refused, so that the usual capture pays nothing).
    """
    held = [
        (item.name, name, param)
        for item in captures
        if item.like is None
        for name, param in zip(item.param_names, item.params, strict=True)
        if held_by_a_graph(param)
    ]
    if held:
        gc.collect()
    for item_name, name, param in held:
        if held_by_a_graph(param):
            progress.name = item_name
            item = next(item for item in captures if item.name == item_name)
            why = "an output or loss kept from a call before graphing, or DistributedDataParallel"
            kept = _graph_kept_in_an_attribute(item.request.module)
            if kept is not None:
                why = (
                    f"{kept} is a tensor attribute that keeps an autograd graph, as torch's "
                    "deprecated weight_norm and spectral_norm keep `weight`: use "
                    "torch.nn.utils.parametrizations instead"
                )
            raise Refused(
                f"{name}'s AccumulateGrad node is held by an autograd graph that is still "
                f"alive ({why}): that node stays on the stream it was made on, "
                "and the capture's backward would wait on it from inside the graph. Delete "
                "the references to that graph (e.g. `del loss`) before graphing, and graph "
                "the layers before wrapping the model in DDP"
            )


def _graph_kept_in_an_attribute(module: torch.nn.Module | None) -> str | None:
    """The name of the first plain tensor attribute of ``module`` (or a submodule) that keeps
    an autograd graph (has a ``grad_fn``), or ``None``."""
    if module is None:
        return None
    root = type(module).__name__
    for prefix, submodule in module.named_modules():
        for key, value in vars(submodule).items():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                return f"{root}.{prefix}.{key}" if prefix else f"{root}.{key}"
    return None


def _shared_parameters(requests: Sequence[CaptureRequest]) -> frozenset[int]:
    """The ids of the parameters that more than one of the callables holds (tied weights)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for request in requests:
        if request.module is not None:
            for param in request.module.parameters():  # each once per module
                (shared if id(param) in seen else seen).add(id(param))
    return frozenset(shared)
