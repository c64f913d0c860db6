"""What happens once, at capture: static buffers, warmup, graphs, and the finished plan.

``"cuda"`` follows the rules of CUDA graph capture: warmup iterations on a side stream, then the
forward graphs of all callables in execution order, then their backward graphs in reverse order,
all in one memory pool. ``"emulate"`` builds the same static buffers without a graph and an
:class:`EmulatedReplay` that re-runs the callable on them, so aliasing mistakes show up on a CPU.

The first warmup call of each callable is also inspected, because a graph replays kernels and
not Python, and some eager behaviour has to be carried over or refused up front:

- inputs the callable updates in place (their version counters move): each replay copies the
  update back into the caller's tensor; an update during backward is refused;
- outputs the backward reads (saved for backward): changing them in place is refused at backward;
- tensors that require grad but are neither inputs nor parameters (a closure over another
  module's weights): refused, since a replay would give them no gradient;
- the output structure must stay the same from call to call.

That first call also runs under the capture lint and the memory probe (``_probe.py``): the lint's
errors refuse the capture before anything is captured (``lint="error"``), and the findings and
the memory plan end up in each plan's diagnostics.

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
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks
from torch.nn.parameter import is_lazy

from .._errors import CaptureError, DualgraphError
from .._spec import TreeSpec, describe
from ._blas_workspaces import prime_capture_stream
from ._diagnostics import CaptureDiagnostics
from ._hooks import NO_HOOKS, CallableHooks
from ._inputs import InputGuard, unsupported_tensor
from ._leaves import dtype_name
from ._lint import CaptureLintError
from ._params import ModuleTensors, is_tensor_subclass, suspended_tensor_hooks
from ._plan import Backend, ParamGradsMode, ParamLayout, ReplayPlan, StaticBuffers
from ._probe import (
    LintMode,
    WarmupProbe,
    attach_probes,
    raise_on_lint_errors,
    with_lint_findings,
)
from ._replay import CudaGraphForward, EmulatedReplay, accumulate_into, autocast_state
from ._transformer_engine import transformer_engine_capture

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
    # other captures of the same callable: "autograd" and "auto" copy the grads into them,
    # "in_graph" adds them (they are the accumulators). ``None``: new ones.
    param_grad_buffers: tuple[torch.Tensor, ...] | None = None
    # "auto": the accumulators (the parameters' .grad) its accumulate graph adds those grads into,
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
    progress = _Progress()
    probes: list[WarmupProbe] = []  # issue 19 hook: lint and memory plan, for the error too
    try:
        copies: list[list[_Capture]] = []
        shared = _shared_parameters(requests)
        for index, request in enumerate(requests):
            progress.name = request.name
            make = functools.partial(_Capture, request, options, shared=shared)
            copies.append(layout.copies(index, make))
            probes.append(copies[-1][0].probe)  # issue 19 hook: the warmed-up original's
        captures = [item for group in copies for item in group]
        with contextlib.ExitStack() as restore:
            for item in captures:
                if item.like is not None:
                    continue  # shares the module and parameters of its original
                if item.module_tensors is not None:
                    restore.enter_context(item.module_tensors.left_as_found())
                if options.param_grads != "in_graph":  # grads may go through autograd
                    restore.enter_context(suspended_tensor_hooks(item.params))
            if options.backend == "cuda":
                _capture_cuda(captures, layout.steps(copies), options, progress)
            else:
                _capture_emulated(captures, options, progress)
        progress.phase = "planning"
        plans = [[item.plan() for item in group] for group in copies]
        attach_probes([group[0].diagnostics for group in plans], probes)  # issue 19 hook
        return plans
    except Exception as error:
        if options.backend == "cuda":
            _recover_cuda()
        failure = _describe_failure(error, progress, options.backend)
        raise with_lint_findings(failure, probes, error) from error  # issue 19 hook


def _shared_parameters(requests: Sequence[CaptureRequest]) -> frozenset[int]:
    """The ids of the parameters that more than one of the callables holds (tied weights)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for request in requests:
        if request.module is not None:
            for param in request.module.parameters():  # each once per module
                (shared if id(param) in seen else seen).add(id(param))
    return frozenset(shared)


# -- what is learned about one callable ----------------------------------------------------------


class _Refused(DualgraphError):
    """A capture refused on purpose; its message is the cause, without a type name."""


class _Capture:
    """The static buffers and facts of one callable, gathered during capture (then a plan).

    A copy made ``like`` another (a replay slot of the same callable) shares its module,
    parameters and in-graph accumulators and learns what its warmup found. One made with
    ``buffers_from`` another (a replay never in flight with it) also shares all its static
    buffers: inputs and grad outputs, and the outputs and grads its graphs copy into the
    other's (the other's graphs wrote them where they were computed).
    """

    def __init__(
        self,
        request: CaptureRequest,
        options: CaptureOptions,
        *,
        like: _Capture | None = None,
        buffers_from: _Capture | None = None,
        shared: frozenset[int] = frozenset(),
    ) -> None:
        # ``shared``: the ids of parameters that other callables captured with this one hold.
        self.request = request
        self.options = options
        self.name = request.name
        self.like = like
        self.buffers_from = buffers_from
        self.static_inputs: tuple[torch.Tensor, ...] = (
            buffers_from.static_inputs
            if buffers_from is not None
            else tuple(
                t.detach().clone().requires_grad_(t.requires_grad) for t in request.sample_tensors
            )
        )
        self.static_args, self.static_kwargs = request.inputs.unflatten(self.static_inputs)
        self.grad_input_indices = tuple(
            i for i, t in enumerate(self.static_inputs) if t.requires_grad
        )
        self._learned_nothing_yet()
        self.module_tensors: ModuleTensors | None
        self.param_names: tuple[str, ...]
        self.params: tuple[torch.Tensor, ...]
        self.accumulators: tuple[torch.Tensor | None, ...]
        self.in_graph_grads: bool  # the parameter grads go into accumulators, not autograd only
        if like is None:
            self._own_parameters(shared)
        else:
            self.module_tensors = like.module_tensors
            self.param_names, self.params = like.param_names, like.params
            self.in_graph_grads = like.in_graph_grads
            self.accumulators = like.accumulators  # one .grad per parameter, whatever the copy

    def _own_parameters(self, shared: frozenset[int]) -> None:
        options = self.options
        module = self.request.module
        if module is not None:
            tensors = itertools.chain(module.named_parameters(), module.named_buffers())
            lazy = [name for name, tensor in tensors if is_lazy(tensor)]
            if lazy:
                raise _Refused(
                    f"{lazy[0]} is not initialized yet (a lazy module); run the module once "
                    "before graphing it"
                )
        self.module_tensors = ModuleTensors.of(module) if module is not None else None
        named = (
            [(name, p) for name, p in module.named_parameters() if p.requires_grad]
            if module is not None
            else []
        )
        prefix = f"{type(module).__name__}." if module is not None else ""
        self.param_names = tuple(prefix + name for name, _ in named)
        self.params = tuple(p for _, p in named)
        if options.param_grads == "in_graph":
            for name, param in zip(self.param_names, self.params, strict=True):
                if param._backward_hooks or param._post_accumulate_grad_hooks:
                    raise _Refused(
                        f"{name} has a grad hook, which param_grads='in_graph' would never run "
                        "(the backward graph adds the grad into .grad itself); capture with "
                        "param_grads='autograd' to use parameter hooks"
                    )
            for name, param in zip(self.param_names, self.params, strict=True):
                if is_tensor_subclass(param):
                    raise _Refused(
                        f"{name} is a {type(param).__name__} (a tensor subclass, e.g. "
                        "Transformer Engine's FP8 weights), whose grads param_grads='in_graph' "
                        "cannot add into .grad as eager does; capture with param_grads='auto' "
                        "or 'autograd'"
                    )
        # "auto" adds grads into .grad itself only where each parameter's grad comes from this
        # callable alone. Eager sums the grads of a parameter that several callables use (tied
        # weights) before adding them to .grad; adding them one callable at a time would round
        # differently, so such callables hand their grads to autograd, which sums them first.
        # So do callables with a tensor-subclass parameter (Transformer Engine's FP8 weights):
        # eager's .grad of one is a plain tensor that AccumulateGrad makes.
        self.in_graph_grads = options.param_grads == "in_graph" or (
            options.param_grads == "auto"
            and not any(id(p) in shared for p in self.params)
            and not any(map(is_tensor_subclass, self.params))
        )
        given = (
            self.request.param_grad_buffers
            if options.param_grads == "in_graph"
            else self.request.param_accumulators
        )
        self.accumulators = (
            (given if given is not None else tuple(torch.zeros_like(p) for p in self.params))
            if self.in_graph_grads
            else ()
        )

    def _learned_nothing_yet(self) -> None:
        # learned during warmup and capture
        self.out_spec: TreeSpec | None = None
        self.diff_outputs: tuple[int, ...] = ()
        self.saved_outputs: tuple[int, ...] = ()
        self.mutated: set[int] = set()
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self.grad_outputs: tuple[torch.Tensor, ...] = ()
        self.input_grads: tuple[torch.Tensor | None, ...] = (None,) * len(self.static_inputs)
        self.param_grads: tuple[torch.Tensor | None, ...] = ()
        self.replay_forward: Callable[[bool], None] | None = None
        self.replay_backward: Callable[[], None] | None = None
        self.replay_accumulate: Callable[[], None] | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.seconds = 0.0
        self.pool_bytes = 0
        self.warmup_grads: tuple[torch.Tensor | None, ...] = ()
        # results_outside_pool: how the last warmup's outputs and grads were laid out
        self.output_layouts: tuple[tuple[torch.Tensor, torch.device], ...] = ()
        self.grad_layouts: tuple[torch.Tensor | None, ...] = ()
        # issue 19 hook: the lint and the memory plan observe the first warmup iteration
        self.probe = WarmupProbe(
            self.request.name,
            self.request.fn,
            module=self.request.module,
            inputs=self.static_inputs,
            paths=self.request.inputs.paths,
            lint=self.options.lint,
            backend=self.options.backend,
            results_outside_pool=self.options.results_outside_pool,
        )

    def learn_from(self, original: _Capture) -> None:
        """Take over what the warmup of ``original`` (the same callable) found."""
        self.out_spec, self.diff_outputs = original.out_spec, original.diff_outputs
        self.saved_outputs = original.saved_outputs
        self.mutated = set(original.mutated)
        self.warmup_grads = original.warmup_grads
        self.output_layouts, self.grad_layouts = original.output_layouts, original.grad_layouts

    def run(self) -> Any:
        return self.request.hooks.call(self.request.fn, self.static_args, self.static_kwargs)

    @property
    def fused_accumulators(self) -> tuple[torch.Tensor | None, ...]:
        """The accumulators the backward graph itself adds into (``"in_graph"`` only)."""
        return self.accumulators if self.options.param_grads == "in_graph" else ()

    def diff_inputs(self) -> tuple[torch.Tensor, ...]:
        """What the backward differentiates for: inputs that require grad, then parameters."""
        return tuple(self.static_inputs[i] for i in self.grad_input_indices) + self.params

    def record_outputs(self, outputs: Any) -> list[torch.Tensor]:
        """The output tensors, checked; the first call fixes the spec, later ones must match it."""
        spec = describe(outputs)
        flat = spec.flatten(outputs)
        for path, leaf in zip(spec.array_paths, flat, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise _Refused(
                    f"output{path}: expected a torch tensor, got "
                    f"{type(leaf).__module__}.{type(leaf).__qualname__} (outputs of a torch "
                    "callable hold tensors, None and int/float/bool/str constants)"
                )
            why = unsupported_tensor(leaf)
            if why is not None:
                raise _Refused(f"output{path}: a graph cannot return {why}")
        if self.options.results_outside_pool:
            self.output_layouts = tuple(_layout(t) for t in flat)
        if self.out_spec is None:
            self.out_spec = spec
            self.diff_outputs = tuple(i for i, grad in enumerate(spec.grad_mask) if grad)
        elif spec != self.out_spec:
            raise _Refused(
                f"the outputs differ from one call to the next ({self.out_spec!r}, then "
                f"{spec!r}); a graph replays one call's structure"
            )
        return flat

    def grad_buffers(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """Static buffers (outside any pool) for grads laid out like ``grads``, ``None`` for none.

        Parameter grads go into the given ``param_grad_buffers``; under ``"in_graph"`` the entry
        is the parameter's accumulator, which the backward adds into itself.
        """
        n = len(self.grad_input_indices)
        given = self.request.param_grad_buffers
        buffers: list[torch.Tensor | None] = []
        for k, grad in enumerate(grads):
            if grad is None:
                buffers.append(None)
            elif k >= n and self.options.param_grads == "in_graph":
                buffers.append(self.accumulators[k - n])
            elif k >= n and given is not None:
                buffers.append(given[k - n])
            else:
                buffers.append(torch.zeros_like(grad))
        return tuple(buffers)

    def keep_grads(
        self, grads: Sequence[torch.Tensor | None], buffers: Sequence[torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, ...]:
        """Copy ``grads`` into their :meth:`grad_buffers` (in the backward graph); the buffers."""
        # Under "in_graph" the parameter grads were added into their accumulators already.
        copied = len(self.grad_input_indices) if self.options.param_grads == "in_graph" else None
        for k, (buffer, grad) in enumerate(zip(buffers, grads, strict=True)):
            if (grad is None) != (buffer is None):
                raise _Refused(
                    "the captured backward gives grads to other inputs or parameters than the "
                    "warmup did; a graph replays one call's structure"
                )
            if grad is not None and buffer is not None and (copied is None or k < copied):
                buffer.copy_(grad)
        return tuple(buffers)

    def place_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Spread the grads of :meth:`diff_inputs` over the inputs and the parameters."""
        n = len(self.grad_input_indices)
        input_grads: list[torch.Tensor | None] = [None] * len(self.static_inputs)
        for i, grad in zip(self.grad_input_indices, grads[:n], strict=True):
            input_grads[i] = grad
        self.input_grads = tuple(input_grads)
        param_grads = tuple(grads[n:])
        if self.options.param_grads != "in_graph":
            self.param_grads = param_grads
        if self.accumulators:  # as with autograd, a parameter the callable does not use keeps
            self.accumulators = tuple(  # .grad None
                acc if grad is not None else None
                for acc, grad in zip(self.accumulators, param_grads, strict=True)
            )
        donor = self.buffers_from
        if donor is not None:  # the grads were copied into the donor's buffers
            self.input_grads, self.param_grads = donor.input_grads, donor.param_grads

    def copy_into_donor(
        self, outputs: Sequence[torch.Tensor] = (), grads: Sequence[torch.Tensor | None] = ()
    ) -> None:
        """Copy outputs, or the grads of :meth:`diff_inputs`, into the donor's static buffers.

        Captured into this copy's graphs, so that its replays leave their results where the
        donor's do (with no donor, nothing to do).
        """
        donor = self.buffers_from
        if donor is None:
            return
        for static, output in zip(donor.static_outputs, outputs, strict=False):
            static.copy_(output.detach())
        targets: list[torch.Tensor | None] = [donor.input_grads[i] for i in self.grad_input_indices]
        if self.options.param_grads != "in_graph":
            targets += donor.param_grads
        for target, grad in zip(targets, grads, strict=False):
            if target is not None and grad is not None:
                target.copy_(grad)

    def plan(self) -> ReplayPlan:
        assert self.out_spec is not None and self.replay_forward is not None
        options = self.options
        params = self.params
        if not self._has_backward():
            self.replay_backward = None
            self.replay_accumulate = None
            self.accumulators = ()
        if options.param_grads == "auto":
            # The anchor tells a plain .backward() from the others (GraphedCallable
            # ._is_plain_backward): needed where parameter grads are computed.
            anchor = (
                torch.empty(0, device=params[0].device, requires_grad=True)
                if params and self.replay_backward is not None
                else None
            )
            layout = ParamLayout(
                mode="auto",
                params=params,
                names=self.param_names,
                accumulators=self.accumulators or (None,) * len(params),
                anchor=anchor,
                anchor_node=None if anchor is None else get_gradient_edge(anchor).node,
            )
            param_grads = self.param_grads or (None,) * len(params)
        elif options.param_grads == "autograd":
            layout = ParamLayout(
                mode="autograd",
                params=params,
                names=self.param_names,
                accumulators=(None,) * len(params),
            )
            param_grads = self.param_grads or (None,) * len(params)
        else:
            anchor = torch.empty(0, device=params[0].device, requires_grad=True) if params else None
            layout = ParamLayout(
                mode="in_graph",
                params=params,
                names=self.param_names,
                accumulators=self.accumulators or (None,) * len(params),
                anchor=anchor,
                anchor_node=None if anchor is None else get_gradient_edge(anchor).node,
            )
            param_grads = (None,) * len(params)
        buffers = StaticBuffers(
            inputs=self.static_inputs,
            outputs=self.static_outputs,
            grad_outputs=self.grad_outputs,
            input_grads=self.input_grads,
            param_grads=param_grads,
            replay_forward=self.replay_forward,
            replay_backward=self.replay_backward,
            graphs=tuple(self.graphs),
            replay_accumulate=self.replay_accumulate,
        )
        kept_grads = [g for g in (*self.input_grads, *param_grads) if g is not None]
        kept_grads += [a for a in layout.accumulators if a is not None]
        diagnostics = CaptureDiagnostics(
            name=self.name,
            backend=options.backend,
            static_input_bytes=_bytes(self.static_inputs),
            static_output_bytes=_bytes(self.static_outputs),
            static_grad_bytes=_bytes([*self.grad_outputs, *kept_grads]),
            pool_bytes=self.pool_bytes,
            capture_seconds=self.seconds,
            has_backward_graph=buffers.replay_backward is not None,
        )
        return ReplayPlan(
            name=self.name,
            backend=options.backend,
            fn=self.request.fn,
            inputs=self.request.inputs,
            outputs=self.out_spec,
            diff_outputs=self.diff_outputs,
            saved_outputs=self.saved_outputs,
            mutated_inputs=tuple(sorted(self.mutated)),
            module_tensors=self.module_tensors,
            params=layout,
            buffers=buffers,
            clone_outputs=options.clone_outputs,
            autocast=autocast_state(),
            replay_hooks=self.request.hooks.replay,
            diagnostics=diagnostics,
        )

    def _has_backward(self) -> bool:
        if not self.diff_outputs or self.replay_backward is None:
            return False
        grads = (*self.input_grads, *self.param_grads, *self.accumulators)
        return any(g is not None for g in grads)


# -- warmup: shared by both backends -------------------------------------------------------------


def _warmup(
    item: _Capture, allow_unused: bool, *, inspect: bool
) -> tuple[torch.Tensor | None, ...]:
    """One eager forward and backward on the static buffers; the first one is inspected."""
    before = [t._version for t in item.static_inputs]
    saved: list[int] = []  # the storages of the tensors the forward saves for backward
    with torch.enable_grad(), item.request.hooks.around("forward"):
        if inspect:
            with saved_tensors_hooks(_keeper(saved, item.probe), _unpack):
                outputs = item.run()
        else:
            outputs = item.run()
    after_forward = [t._version for t in item.static_inputs]
    flat = item.record_outputs(outputs)
    differentiable = [flat[i] for i in item.diff_outputs]
    if inspect:
        item.saved_outputs = _saved_outputs(flat, saved)
        _refuse_foreign_leaves(item, flat)
    del outputs, saved
    diff_inputs = item.diff_inputs()
    grads: tuple[torch.Tensor | None, ...] = ()
    if differentiable and diff_inputs:
        with item.request.hooks.around("backward"):
            grads = tuple(
                torch.autograd.grad(
                    differentiable,
                    diff_inputs,
                    grad_outputs=[torch.ones_like(t) for t in differentiable],
                    allow_unused=allow_unused,
                )
            )
    paths = item.request.inputs.paths
    for i, (v0, v1, t) in enumerate(zip(before, after_forward, item.static_inputs, strict=True)):
        if t._version != v1:
            raise _Refused(
                f"{paths[i]} is updated in place during backward; dualgraph hands in-place "
                "updates back to the caller after the forward only"
            )
        if v1 != v0:
            item.mutated.add(i)
    return grads


def _keeper(saved: list[int], probe: WarmupProbe) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that notes the storage of each saved tensor, not the tensor: autograd keeps
    the hook (and so ``saved``) until the backward is over, and would keep the tensors too."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(_storage(tensor))
        probe.note_saved((tensor,))  # issue 19 hook: the probe's own pack hook is outside this one
        return tensor

    return pack


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr()) if tensor.numel() else 0
    except Exception:  # a tensor without a plain storage (e.g. a TE FP8 tensor)
        return 0


def _saved_outputs(flat: Sequence[torch.Tensor], saved: Sequence[int]) -> tuple[int, ...]:
    storages = set(saved) - {0}
    return tuple(i for i, t in enumerate(flat) if _storage(t) in storages)


def _refuse_foreign_leaves(item: _Capture, flat: Sequence[torch.Tensor]) -> None:
    """Refuse outputs that depend on leaves requiring grad besides the inputs and parameters."""
    known = {id(t) for t in item.diff_inputs()}
    # Python wrappers of autograd nodes are made on demand and die with their last reference,
    # so an id() seen here could come back for another node: keep every visited node alive.
    visited: list[Any] = []
    seen: set[int] = set()
    stack: list[Any] = []
    foreign: list[torch.Tensor] = []
    for tensor in flat:
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif tensor.requires_grad and id(tensor) not in known:
            foreign.append(tensor)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if isinstance(variable, torch.Tensor):
            if id(variable) not in known:
                foreign.append(variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    if foreign:
        shapes = ", ".join(sorted({f"{dtype_name(t.dtype)}{list(t.shape)}" for t in foreign}))
        owner = "parameters of the module" if item.request.module is not None else "arguments"
        raise _Refused(
            f"the outputs depend on {len(foreign)} tensor(s) that require grad but are neither "
            f"inputs nor {owner} ({shapes}), e.g. a closure over another module's weights; a "
            "replay would give them no gradient. Pass them as inputs, or graph the module that "
            "holds them"
        )


# -- the emulate backend -------------------------------------------------------------------------


def _capture_emulated(
    captures: Sequence[_Capture], options: CaptureOptions, progress: _Progress
) -> None:
    for item in captures:
        progress.name = item.name
        start = time.perf_counter()
        if item.like is None:
            progress.phase = "warmup"
            grads: tuple[torch.Tensor | None, ...] = ()
            for i in range(max(1, options.num_warmup_iters)):
                with item.probe:  # issue 19 hook: observes the first iteration only
                    grads = _warmup(item, options.allow_unused_input, inspect=i == 0)
            raise_on_lint_errors([item.probe])  # issue 19 hook
            item.warmup_grads = tuple(None if g is None else g.detach() for g in grads)
        else:
            item.learn_from(item.like)
        progress.phase = "capture"
        with torch.enable_grad(), item.request.hooks.around("forward"):
            flat = item.record_outputs(item.run())
        donor = item.buffers_from
        item.static_outputs = (
            donor.static_outputs
            if donor is not None
            else tuple(torch.empty_like(t.detach()) for t in flat)
        )
        item.grad_outputs = _grad_output_buffers(item, flat)
        del flat
        diff_inputs = item.diff_inputs()
        if item.grad_outputs and diff_inputs:
            item.place_grads(item.grad_buffers(item.warmup_grads))
        n = len(item.grad_input_indices)
        targets = tuple(item.input_grads[i] for i in item.grad_input_indices)
        targets += item.param_grads or (None,) * len(item.params)
        accumulators = (None,) * n + (item.fused_accumulators or (None,) * len(item.params))
        assert item.out_spec is not None
        replay = EmulatedReplay(
            fn=item.request.hooks.wrap(item.request.fn),
            static_args=item.static_args,
            static_kwargs=item.static_kwargs,
            out_spec=item.out_spec,
            static_outputs=item.static_outputs,
            diff_outputs=item.diff_outputs,
            diff_inputs=diff_inputs,
            grad_outputs=item.grad_outputs,
            grad_targets=targets,
            accumulators=accumulators,
            allow_unused=options.allow_unused_input,
            hooked_params=item.params if options.param_grads != "in_graph" else (),
        )
        item.replay_forward = replay.forward
        item.replay_backward = replay.backward
        if options.param_grads == "auto" and item.accumulators:
            item.replay_accumulate = accumulate_into(item.accumulators, item.param_grads)
        item.seconds = time.perf_counter() - start


# -- the cuda backend ----------------------------------------------------------------------------


def _grad_output_buffers(item: _Capture, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The static grad-output buffers: new, or those of the copy ``item`` shares buffers with."""
    donor = item.buffers_from
    if donor is not None and donor.grad_outputs:
        return donor.grad_outputs
    return tuple(torch.empty_like(flat[i].detach()) for i in item.diff_outputs)


def _capture_cuda(
    captures: Sequence[_Capture],
    steps: Sequence[CaptureStep],
    options: CaptureOptions,
    progress: _Progress,
) -> None:
    """Warm up on a side stream, then capture the graphs ``steps`` list, in that order."""
    device = _device_of(captures)
    caller_stream = torch.cuda.current_stream(device)
    # The garbage collector may destroy an unreachable CUDA graph while another one is being
    # captured, which fails the capture (docs/cuda_graphs.md); it waits until the capture is over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with transformer_engine_capture() as te_generators:
            _capture_cuda_graphs(captures, steps, options, progress, device, te_generators)
    finally:
        if gc_was_enabled:
            gc.enable()
        # When a capture is invalidated (a CPU sync inside it), ``torch.cuda.graph.__exit__``
        # raises from ``capture_end`` before it leaves its stream context, which would leave
        # torch's capture stream current for all later work; give the caller its stream back.
        torch.cuda.set_stream(caller_stream)


def _capture_cuda_graphs(
    captures: Sequence[_Capture],
    steps: Sequence[CaptureStep],
    options: CaptureOptions,
    progress: _Progress,
    device: torch.device,
    extra_generators: Sequence[Any],
) -> None:
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    shared_pool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    mode: Any = options.capture_error_mode
    side_stream = torch.cuda.Stream(device)
    side_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side_stream):
        for item in captures:
            if item.like is not None:  # copies of a callable learn from its warmup
                continue
            progress.name, progress.phase = item.name, "warmup"
            for i in range(max(1, options.num_warmup_iters)):
                with item.probe:  # issue 19 hook: observes the first iteration only
                    grads = _warmup(item, options.allow_unused_input, inspect=i == 0)
            if options.results_outside_pool:
                item.grad_layouts = tuple(None if g is None else g.detach() for g in grads)
            del grads
    torch.cuda.current_stream(device).wait_stream(side_stream)
    torch.cuda.synchronize(device)
    prime_capture_stream(device)  # cuBLAS's workspaces for the capture stream: not in the pool
    originals = [item for item in captures if item.like is None]
    raise_on_lint_errors([item.probe for item in originals])  # issue 19 hook: before any capture
    for item in captures:
        if item.like is not None:
            item.learn_from(item.like)
    allocated_before = torch.cuda.memory_allocated(device)

    live_outputs: dict[int, list[torch.Tensor]] = {}
    pools: list[Any] = []  # each pool once, in order of first use
    item_pools: dict[int, list[int]] = {id(item): [] for item in captures}
    for step in steps:
        item = step.copy
        pool = shared_pool if step.pool is None else step.pool
        if pool not in pools:
            pools.append(pool)
        if pools.index(pool) not in item_pools[id(item)]:
            item_pools[id(item)].append(pools.index(pool))
        if step.backward:
            flat = live_outputs.pop(id(item))
            _capture_backward(item, flat, pool, options, progress, extra_generators)
            del flat
            continue
        progress.name, progress.phase = item.name, "forward capture"
        forward_graph = _new_graph(extra_generators)
        # outside the pool (results_outside_pool), unless the outputs go into a donor's buffers
        layouts = item.output_layouts if item.buffers_from is None else ()
        kept = tuple(_empty(layout) for layout in layouts)
        with (
            item.request.hooks.around("forward"),  # capture-time hooks: outside the graph
            torch.cuda.graph(forward_graph, pool=pool, capture_error_mode=mode),
        ):
            flat = item.record_outputs(item.run())  # (reads Python objects only)
            for static, tensor in zip(kept, flat, strict=False):  # none without kept buffers
                static.copy_(tensor.detach())
            item.copy_into_donor(outputs=flat)
        live_outputs[id(item)] = flat
        del flat
        donor = item.buffers_from
        item.static_outputs = (
            donor.static_outputs
            if donor is not None
            else kept or tuple(t.detach() for t in live_outputs[id(item)])
        )
        item.replay_forward = CudaGraphForward(forward_graph)
        item.graphs.append(forward_graph)
    del live_outputs  # forwards without a backward step: their activations go back to the pool
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    sizes = [_pool_bytes(pool, device) for pool in pools]
    fallback = max(0, torch.cuda.memory_allocated(device) - allocated_before)
    for item in captures:
        item.pool_bytes = sum(sizes[i] for i in item_pools[id(item)]) if any(sizes) else fallback
        item.seconds = elapsed


def _capture_backward(
    item: _Capture,
    flat: list[torch.Tensor],
    pool: Any,
    options: CaptureOptions,
    progress: _Progress,
    extra_generators: Sequence[Any],
) -> None:
    """Capture the backward graph of ``item`` from its forward's outputs ``flat``."""
    mode: Any = options.capture_error_mode
    progress.name, progress.phase = item.name, "backward capture"
    differentiable = [flat[i] for i in item.diff_outputs]
    diff_inputs = item.diff_inputs()
    if differentiable and diff_inputs:
        item.grad_outputs = _grad_output_buffers(item, flat)
        # outside the pool (results_outside_pool), unless the grads go into a donor's buffers
        layouts = item.grad_layouts if item.buffers_from is None else ()
        buffers = item.grad_buffers(layouts) if layouts else ()
        item.grad_layouts = ()
        backward_graph = _new_graph(extra_generators)
        grads: tuple[torch.Tensor | None, ...]
        with (
            item.request.hooks.around("backward"),  # capture-time hooks: outside the graph
            torch.cuda.graph(backward_graph, pool=pool, capture_error_mode=mode),
        ):
            grads = torch.autograd.grad(
                differentiable,
                diff_inputs,
                grad_outputs=item.grad_outputs,
                only_inputs=True,
                allow_unused=options.allow_unused_input,
            )
            accumulate = accumulate_into(
                item.fused_accumulators, grads[len(item.grad_input_indices) :]
            )
            if accumulate is not None:
                accumulate()
            if buffers:
                grads = item.keep_grads(grads, buffers)
            item.copy_into_donor(grads=grads)
        item.place_grads(grads)
        item.replay_backward = backward_graph.replay
        item.graphs.append(backward_graph)
        if options.param_grads == "auto" and item.accumulators:
            item.replay_accumulate = _capture_accumulate(item, pool, mode)
    del flat, differentiable


def _capture_accumulate(item: _Capture, pool: Any, mode: Any) -> Callable[[], None] | None:
    """The ``"auto"`` mode's second graph: add the static parameter grads into the accumulators.

    Replayed after the backward graph only when the grads go to ``.grad`` without autograd. It
    allocates nothing, so it may be captured at any point among the pool's graphs.
    """
    accumulate = accumulate_into(item.accumulators, item.param_grads)
    if accumulate is None:
        return None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        accumulate()
    item.graphs.append(graph)
    return graph.replay


def _layout(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
    """What :func:`_empty` needs to allocate a buffer like ``tensor``, holding no memory."""
    return torch.empty_like(tensor, device="meta"), tensor.device


def _empty(layout: tuple[torch.Tensor, torch.device]) -> torch.Tensor:
    # empty_like keeps the strides of a dense tensor, and makes an expanded one contiguous
    like, device = layout
    return torch.empty_like(like, device=device)


def _new_graph(extra_generators: Sequence[Any]) -> torch.cuda.CUDAGraph:
    # torch registers the default CUDA generator itself; others (TE's RNG tracker) must be
    # registered so that dropout draws fresh values on every replay.
    graph = torch.cuda.CUDAGraph()
    for generator_state in extra_generators:
        graph.register_generator_state(generator_state)
    return graph


def _pool_bytes(pool: Any, device: torch.device) -> int:
    """Bytes of the segments the CUDA caching allocator holds for ``pool`` (0 if unknown)."""
    try:
        wanted = tuple(pool)
        segments = torch.cuda.memory_snapshot()
    except (TypeError, RuntimeError):
        return 0
    return sum(
        int(segment.get("total_size", 0))
        for segment in segments
        if tuple(segment.get("segment_pool_id", ())) == wanted
        and segment.get("device", device.index) == device.index
    )


def _device_of(captures: Sequence[_Capture]) -> torch.device:
    for item in captures:
        for tensor in (*item.static_inputs, *item.params):
            if tensor.is_cuda:
                return tensor.device
    return torch.device("cuda", torch.cuda.current_device())


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


def _recover_cuda() -> None:
    with contextlib.suppress(RuntimeError):  # the failed capture's own error is reported
        torch.cuda.synchronize()
    repair_cuda_rng()


# -- failures ------------------------------------------------------------------------------------


@dataclass
class _Progress:
    """Where a capture is, so that a failure can name the callable and the phase."""

    name: str = ""
    phase: str = "setup"


def _describe_failure(error: BaseException, progress: _Progress, backend: str) -> CaptureError:
    """A :class:`CaptureError` naming the callable, the phase and the root cause."""
    root = error
    while root.__context__ is not None and root.__cause__ is None and root is not root.__context__:
        root = root.__context__
    cause = _show(root)
    if root is not error:
        cause += f" (then {_show(error)})"
    name = progress.name
    hint = ""
    if "capture" in progress.phase and "operation not permitted when stream is capturing" in cause:
        hint = " (a CPU sync such as .item(), .cpu() or printing a tensor cannot be captured)"
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
    if isinstance(error, _Refused | CaptureLintError) or type(error) is DualgraphError:
        return first
    return f"{type(error).__name__}: {first}"


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
