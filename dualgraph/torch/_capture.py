"""What happens once, at capture: static buffers, warmup, forward and backward graphs.

``"cuda"`` follows the rules of CUDA graph capture: warmup iterations on a side stream, then the
forward graphs of all callables in execution order, then their backward graphs in reverse order,
all in one memory pool. ``"emulate"`` builds the same static buffers without a graph and re-runs
the callable on them, so aliasing mistakes show up on a CPU too.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CaptureError, DualgraphError
from .._spec import TreeSpec, describe
from ._probe import WarmupProbe, raise_on_lint_errors
from ._replay import GraphedCallable
from ._transformer_engine import transformer_engine_capture

__all__ = [
    "Progress",
    "capture_cuda",
    "capture_emulated",
    "prepare_static_inputs",
    "repair_cuda_rng",
]


@dataclass
class Progress:
    """Where a capture is, so that a failure can name the callable and the phase."""

    name: str = ""
    phase: str = "setup"


def prepare_static_inputs(graphed: GraphedCallable, sample_tensors: Sequence[torch.Tensor]) -> None:
    """Static input buffers: owned copies of the sample tensors, with their ``requires_grad``."""
    graphed.static_inputs = [
        t.detach().clone().requires_grad_(t.requires_grad) for t in sample_tensors
    ]
    n_args = graphed.guard.num_args_tensors
    graphed.static_args = graphed.guard.args_spec.unflatten(graphed.static_inputs[:n_args])
    graphed.static_kwargs = graphed.guard.kwargs_spec.unflatten(graphed.static_inputs[n_args:])
    graphed.diagnostics.static_input_bytes = _bytes(graphed.static_inputs)


def capture_emulated(
    graphs: Sequence[GraphedCallable],
    *,
    num_warmup_iters: int,
    allow_unused_input: bool,
    progress: Progress,
    probes: Sequence[WarmupProbe],
) -> None:
    """Static buffers and replay functions that re-run each callable instead of a graph."""
    for graphed, probe in zip(graphs, probes, strict=True):
        progress.name = graphed.name
        start = time.perf_counter()
        progress.phase = "warmup"
        grads: tuple[torch.Tensor | None, ...] = ()
        for _ in range(max(1, num_warmup_iters)):
            with probe:  # issue 19 hook: observes the first iteration only
                grads = _forward_backward(graphed, allow_unused_input, record=True)
        raise_on_lint_errors([probe])  # issue 19 hook
        progress.phase = "capture"
        with torch.enable_grad():
            outputs = _run(graphed)
        flat = _record_outputs(graphed, outputs)
        graphed.static_outputs = [torch.empty_like(t.detach()) for t in flat]
        graphed.static_grad_outputs = [
            torch.empty_like(flat[i].detach()) for i in graphed.diff_outputs
        ]
        if graphed.static_grad_outputs and _diff_inputs(graphed):
            _spread_grads(graphed, [None if g is None else torch.zeros_like(g) for g in grads])
        _install_emulated_replay(graphed, allow_unused_input)
        _finish(graphed, time.perf_counter() - start)


def capture_cuda(
    graphs: Sequence[GraphedCallable],
    *,
    num_warmup_iters: int,
    allow_unused_input: bool,
    pool: Any,
    progress: Progress,
    capture_error_mode: str,
    probes: Sequence[WarmupProbe],
) -> None:
    """Warm up on a side stream, then capture forward graphs in order, backward in reverse."""
    device = _device_of(graphs)
    caller_stream = torch.cuda.current_stream(device)
    # The garbage collector may destroy an unreachable CUDA graph while another one is being
    # captured, which fails the capture (pytorch PR 161037); it waits until the capture is over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with transformer_engine_capture() as te_generators:
            _capture_cuda(
                graphs,
                device,
                num_warmup_iters,
                allow_unused_input,
                pool,
                progress,
                te_generators,
                capture_error_mode,
                probes,
            )
    finally:
        if gc_was_enabled:
            gc.enable()
        # When a capture is invalidated (a CPU sync inside it), ``torch.cuda.graph.__exit__``
        # raises from ``capture_end`` before it leaves its stream context, which would leave
        # torch's capture stream current for all later work; give the caller its stream back.
        torch.cuda.set_stream(caller_stream)


def _capture_cuda(
    graphs: Sequence[GraphedCallable],
    device: torch.device,
    num_warmup_iters: int,
    allow_unused_input: bool,
    pool: Any,
    progress: Progress,
    extra_generators: Sequence[Any],
    capture_error_mode: str,
    probes: Sequence[WarmupProbe],
) -> None:
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    side_stream = torch.cuda.Stream(device)
    side_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side_stream):
        for graphed, probe in zip(graphs, probes, strict=True):
            progress.name, progress.phase = graphed.name, "warmup"
            for _ in range(num_warmup_iters):
                with probe:  # issue 19 hook: observes the first iteration only
                    _forward_backward(graphed, allow_unused_input, record=False)
    torch.cuda.current_stream(device).wait_stream(side_stream)
    torch.cuda.synchronize(device)
    raise_on_lint_errors(probes)  # issue 19 hook: before anything is captured
    allocated_before = torch.cuda.memory_allocated(device)

    live_outputs: dict[int, list[torch.Tensor]] = {}
    for graphed in graphs:
        progress.name, progress.phase = graphed.name, "forward capture"
        forward_graph = _new_graph(extra_generators)
        with torch.cuda.graph(forward_graph, pool=pool, capture_error_mode=capture_error_mode):
            outputs = _run(graphed)
        flat = _record_outputs(graphed, outputs)
        del outputs
        live_outputs[id(graphed)] = flat
        graphed.static_outputs = [t.detach() for t in flat]
        graphed.replay_forward = _replayer(forward_graph)
        graphed.cuda_graphs.append(forward_graph)

    for graphed in reversed(graphs):
        progress.name, progress.phase = graphed.name, "backward capture"
        flat = live_outputs.pop(id(graphed))
        differentiable = [flat[i] for i in graphed.diff_outputs]
        diff_inputs = _diff_inputs(graphed)
        if differentiable and diff_inputs:
            graphed.static_grad_outputs = [torch.empty_like(t.detach()) for t in differentiable]
            backward_graph = _new_graph(extra_generators)
            with torch.cuda.graph(backward_graph, pool=pool, capture_error_mode=capture_error_mode):
                grads = torch.autograd.grad(
                    differentiable,
                    diff_inputs,
                    grad_outputs=graphed.static_grad_outputs,
                    only_inputs=True,
                    allow_unused=allow_unused_input,
                )
                accumulate_param_grads(graphed, grads)
            _spread_grads(graphed, grads)
            graphed.replay_backward = backward_graph.replay
            graphed.cuda_graphs.append(backward_graph)
        del flat, differentiable
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    pool_bytes = _pool_bytes(pool, device) or max(
        0, torch.cuda.memory_allocated(device) - allocated_before
    )
    for graphed in graphs:
        graphed.diagnostics.pool_bytes = pool_bytes
        _finish(graphed, elapsed)


def repair_cuda_rng() -> None:
    """Make the CUDA RNG usable again after a capture that touched it failed.

    Without this every later CUDA RNG call fails with "Offset increment outside graph capture
    encountered unexpectedly" (see FIELD-NOTES); re-installing the generator's own state fixes it.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    for generator in torch.cuda.default_generators:
        generator.graphsafe_set_state(generator.clone_state())


def describe_failure(error: BaseException, progress: Progress, backend: str) -> CaptureError:
    """A :class:`CaptureError` naming the callable, the phase and the root cause."""
    root = error
    while root.__context__ is not None and root.__cause__ is None and root is not root.__context__:
        root = root.__context__
    cause = f"{type(root).__name__}: {_first_line(root)}"
    if root is not error:
        cause += f" (then {type(error).__name__}: {_first_line(error)})"
    hint = ""
    if "capture" in progress.phase and "operation not permitted when stream is capturing" in cause:
        hint = " (a CPU sync such as .item(), .cpu() or printing a tensor cannot be captured)"
    if "legacy stream depend on a capturing blocking stream" in cause:
        hint = (
            " (is the model already wrapped in DistributedDataParallel? Graph its layers first,"
            " then wrap it: see docs/ddp.md)"
        )
    return CaptureError(
        f"capturing {progress.name} ({backend}) failed during {progress.phase}: {cause}{hint}"
    )


def _first_line(error: BaseException) -> str:
    # CUDA errors append several lines of generic advice; the first line is the cause.
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


# -- shared steps ---------------------------------------------------------------------------------


def _run(graphed: GraphedCallable) -> Any:
    return graphed.fn(*graphed.static_args, **graphed.static_kwargs)


def _diff_inputs(graphed: GraphedCallable) -> list[torch.Tensor]:
    return [t for t in graphed.static_inputs if t.requires_grad] + list(graphed.params)


def prepare_params(graphed: GraphedCallable, params: Sequence[torch.Tensor], mode: str) -> None:
    """Which parameters get grads, and how they reach ``.grad`` (see ``GraphedCallable``)."""
    graphed.params = tuple(params)
    graphed.param_grads = mode
    if mode == "autograd" or not params:
        graphed.edge_params = graphed.params
        return
    graphed.param_grad_buffers = [torch.zeros_like(p) for p in params]
    graphed.edge_params = (torch.empty(0, device=params[0].device, requires_grad=True),)


def _forward_backward(
    graphed: GraphedCallable, allow_unused_input: bool, *, record: bool
) -> tuple[torch.Tensor | None, ...]:
    with torch.enable_grad():
        outputs = _run(graphed)
    flat = _output_tensors(graphed, describe(outputs), outputs)
    differentiable = [t for t in flat if t.requires_grad]
    diff_inputs = _diff_inputs(graphed)
    if not (differentiable and diff_inputs):
        return ()
    grads = torch.autograd.grad(
        differentiable,
        diff_inputs,
        grad_outputs=[torch.ones_like(t) for t in differentiable],
        only_inputs=True,
        allow_unused=allow_unused_input,
    )
    return tuple(grads) if record else ()


def _output_tensors(graphed: GraphedCallable, spec: TreeSpec, outputs: Any) -> list[torch.Tensor]:
    flat = spec.flatten(outputs)
    for path, leaf in zip(spec.array_paths, flat):
        if not isinstance(leaf, torch.Tensor):
            raise DualgraphError(
                f"{graphed.name}: output{path}: expected a torch tensor, got "
                f"{type(leaf).__module__}.{type(leaf).__qualname__} (outputs of a torch callable "
                "hold tensors, None and int/float/bool/str constants)"
            )
    return flat


def _record_outputs(graphed: GraphedCallable, outputs: Any) -> list[torch.Tensor]:
    spec = describe(outputs)
    flat = _output_tensors(graphed, spec, outputs)
    graphed.out_spec = spec
    mask = spec.grad_mask
    graphed.diff_outputs = tuple(i for i, grad in enumerate(mask) if grad)
    graphed.nondiff_outputs = tuple(i for i, grad in enumerate(mask) if not grad)
    return flat


def _spread_grads(graphed: GraphedCallable, grads: Sequence[torch.Tensor | None]) -> None:
    """Place the grads of the differentiable inputs at their slots among all replay inputs."""
    slots = _all_diff_slots(graphed)
    spread: list[torch.Tensor | None] = [None] * (len(graphed.static_inputs) + len(graphed.params))
    for slot, grad in zip(slots, grads, strict=True):
        spread[slot] = grad
    if graphed.param_grad_buffers:  # parameter grads stay inside the graph
        spread, param_grads = (
            spread[: len(graphed.static_inputs)],
            spread[len(graphed.static_inputs) :],
        )
        spread += [None] * len(graphed.edge_params)
        # As with autograd, a parameter the callable does not use keeps its ``.grad`` None.
        graphed.params_with_grad = tuple(grad is not None for grad in param_grads)
    graphed.static_grad_inputs = tuple(spread)


def accumulate_param_grads(graphed: GraphedCallable, grads: Sequence[torch.Tensor | None]) -> None:
    """Add the parameter part of ``grads`` into the static parameter grad buffers."""
    if not graphed.param_grad_buffers:
        return
    param_grads = grads[len(grads) - len(graphed.params) :]
    pairs = [(b, g) for b, g in zip(graphed.param_grad_buffers, param_grads) if g is not None]
    if pairs:
        torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs])


def _install_emulated_replay(graphed: GraphedCallable, allow_unused_input: bool) -> None:
    live: list[torch.Tensor] = []
    diff_inputs = _diff_inputs(graphed)
    spec = graphed.spec
    # grads come in _all_diff_slots order; which of them land in a static grad buffer
    copies = [
        (graphed.static_grad_inputs[slot], k)
        for k, slot in enumerate(_all_diff_slots(graphed))
        if slot < len(graphed.static_grad_inputs) and graphed.static_grad_inputs[slot] is not None
    ]

    def replay_forward(grad_enabled: bool) -> None:
        with torch.set_grad_enabled(grad_enabled):
            outputs = _run(graphed)
        flat = spec.flatten(outputs)
        live[:] = [flat[i] for i in graphed.diff_outputs] if grad_enabled else []
        for static, tensor in zip(graphed.static_outputs, flat):
            static.copy_(tensor.detach())

    def replay_backward() -> None:
        if not live:
            raise DualgraphError(f"{graphed.name}: backward without a forward under autograd")
        grads = torch.autograd.grad(
            live,
            diff_inputs,
            grad_outputs=graphed.static_grad_outputs,
            allow_unused=allow_unused_input,
        )
        accumulate_param_grads(graphed, grads)
        for static, k in copies:
            grad = grads[k]
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)

    graphed.replay_forward = replay_forward
    graphed.replay_backward = replay_backward


def _all_diff_slots(graphed: GraphedCallable) -> list[int]:
    slots = [i for i, t in enumerate(graphed.static_inputs) if t.requires_grad]
    return slots + [len(graphed.static_inputs) + j for j in range(len(graphed.params))]


def _finish(graphed: GraphedCallable, seconds: float) -> None:
    graphed.diagnostics.static_output_bytes = _bytes(graphed.static_outputs)
    grad_buffers = [g for g in graphed.static_grad_inputs if g is not None]
    grad_buffers += graphed.param_grad_buffers
    graphed.diagnostics.static_grad_bytes = _bytes(graphed.static_grad_outputs + grad_buffers)
    graphed.diagnostics.capture_seconds = seconds
    graphed.finish()


def _new_graph(extra_generators: Sequence[Any]) -> torch.cuda.CUDAGraph:
    # torch registers the default CUDA generator itself; others (TE's RNG tracker) must be
    # registered so that dropout draws fresh values on every replay.
    graph = torch.cuda.CUDAGraph()
    for generator_state in extra_generators:
        graph.register_generator_state(generator_state)
    return graph


def _replayer(graph: torch.cuda.CUDAGraph) -> Any:
    def replay(_grad_enabled: bool) -> None:
        graph.replay()

    return replay


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


def _device_of(graphs: Sequence[GraphedCallable]) -> torch.device:
    for graphed in graphs:
        for tensor in (*graphed.static_inputs, *graphed.params):
            if tensor.is_cuda:
                return tensor.device
    return torch.device("cuda", torch.cuda.current_device())


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
