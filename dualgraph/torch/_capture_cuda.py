"""The ``"cuda"`` backend's capture: warmup on a side stream, then the graphs, into pools.

The forward and backward graph of each copy are captured in the order the
:class:`CaptureLayout`'s steps give (by default forwards in order, backwards in reverse, one
pool); where the parameter grads go into accumulators (``"auto"``, ``"in_graph"``), the backward
graph adds them there itself. The device is synchronized and the allocator's cache emptied once
before the first graph, not before each (:func:`capturing`).
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._ambient import outside_autocast
from ._blas_workspaces import capture_stream, prime_capture_stream
from ._capture_failure import Progress
from ._capture_state import _Capture, grad_output_buffers
from ._layouts import copy_laid_out, empty_from_layout
from ._probe import raise_on_lint_errors
from ._replay_backends import CudaGraphForward, accumulate_into
from ._transformer_engine import transformer_engine_capture
from ._warmup import module_tensors_kept, warmup, watches_held

if TYPE_CHECKING:
    from ._capture import CaptureOptions, CaptureStep

__all__ = ["capture_cuda"]


def capture_cuda(
    captures: Sequence[_Capture],
    steps: Sequence[CaptureStep],
    options: CaptureOptions,
    progress: Progress,
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
    progress: Progress,
    device: torch.device,
    extra_generators: Sequence[Any],
) -> None:
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    shared_pool = options.pool if options.pool is not None else torch.cuda.graph_pool_handle()
    mode: Any = options.capture_error_mode
    side_stream = torch.cuda.Stream(device)
    side_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side_stream), watches_held():
        for item in captures:
            if item.like is not None:  # copies of a callable learn from its warmup
                continue
            progress.name, progress.phase = item.name, "warmup"
            with module_tensors_kept(item):
                for i in range(max(1, options.num_warmup_iters)):
                    with item.probe:  # issue 19 hook: observes the first iteration only
                        grads = warmup(item, options.allow_unused_input, inspect=i == 0)
            if options.results_outside_pool:
                item.grad_layouts = tuple(None if g is None else g.detach() for g in grads)
            del grads
    torch.cuda.current_stream(device).wait_stream(side_stream)
    torch.cuda.synchronize(device)
    # What torch.cuda.graph does before every graph, once for all of them: the warmup's cached
    # blocks go back to the device, for the pools to take.
    torch.cuda.empty_cache()
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
        kept = tuple(empty_from_layout(layout) for layout in layouts)
        # Outputs that are a parameter, a buffer or a closed-over tensor (or view one): buffers
        # of their own as well, which the graph copies them into. The static output would be
        # that memory itself, whose version every replay then moves (a backward of another slot
        # reading that weight refused) and which a change through the output would change.
        outside = (
            {i: empty_from_layout(layout) for i, layout in item.outside_outputs}
            if not kept and item.buffers_from is None
            else {}
        )
        with (
            item.request.hooks.around("forward"),  # capture-time hooks: outside the graph
            capturing(forward_graph, pool, mode),
        ):
            flat = item.record_outputs(item.run())  # (reads Python objects only)
            for static, tensor in zip(kept, flat, strict=False):  # none without kept buffers
                copy_laid_out(static, tensor.detach())
            for i, static in outside.items():
                copy_laid_out(static, flat[i].detach())
            item.copy_into_donor(outputs=flat)
        live_outputs[id(item)] = flat
        del flat
        donor = item.buffers_from
        item.static_outputs = (
            donor.static_outputs
            if donor is not None
            else kept
            or tuple(outside.get(i, t.detach()) for i, t in enumerate(live_outputs[id(item)]))
        )
        item.replay_forward = CudaGraphForward(forward_graph)
        item.graphs.append(forward_graph)
    del live_outputs  # forwards without a backward step: their activations go back to the pool
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    sizes = _pool_bytes(pools, device)
    fallback = max(0, torch.cuda.memory_allocated(device) - allocated_before)
    for item in captures:
        item.pool_bytes = sum(sizes[i] for i in item_pools[id(item)]) if any(sizes) else fallback
        item.seconds = elapsed


def _capture_backward(
    item: _Capture,
    flat: list[torch.Tensor],
    pool: Any,
    options: CaptureOptions,
    progress: Progress,
    extra_generators: Sequence[Any],
) -> None:
    """Capture the backward graph of ``item`` from its forward's outputs ``flat``."""
    mode: Any = options.capture_error_mode
    progress.name, progress.phase = item.name, "backward capture"
    # The outputs handed out as another tensor (an input, a view of one or of another output)
    # are left out: their grads go to that tensor, never through the replay (as in emulate's).
    taken = item.backward_outputs
    differentiable = [flat[item.diff_outputs[k]] for k in taken]
    diff_inputs = item.diff_inputs()
    # one per differentiable output (as emulate's), also where every one is handed out
    item.grad_outputs = grad_output_buffers(item, flat)
    if differentiable and diff_inputs:
        # outside the pool (results_outside_pool), unless the grads go into a donor's buffers
        layouts = item.grad_layouts if item.buffers_from is None else ()
        buffers = item.grad_buffers(layouts) if layouts else ()
        item.grad_layouts = ()
        backward_graph = _new_graph(extra_generators)
        grads: tuple[torch.Tensor | None, ...]
        with (
            item.request.hooks.around("backward"),  # capture-time hooks: outside the graph
            capturing(backward_graph, pool, mode),
            outside_autocast(),  # where torch's AMP recipe runs a backward (the replay's check)
        ):
            grads = torch.autograd.grad(
                differentiable,
                diff_inputs,
                grad_outputs=[item.grad_outputs[k] for k in taken],
                only_inputs=True,
                # an input reached only through a handed-out output gets its grad there (the
                # warmup refused the unused ones already)
                allow_unused=options.allow_unused_input or len(taken) < len(item.diff_outputs),
            )
            accumulate = accumulate_into(
                item.fused_accumulators, grads[len(item.grad_input_indices) :]
            )
            if accumulate is not None:
                accumulate()
            if buffers:
                grads = item.keep_grads(grads, buffers)
            item.copy_into_donor(grads=grads)
        item.after_backward()  # what a hook of its backward left on its modules (Python only)
        item.place_grads(grads)
        item.replay_backward = backward_graph.replay
        item.graphs.append(backward_graph)
        # The parameter grads the graph added into .grad are the pool's to reuse: a frame of
        # this function kept past its return (a traceback) must not keep them allocated.
        del grads, accumulate
    del flat, differentiable


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any, mode: Any) -> Iterator[None]:
    """Capture what the block runs into ``graph``, on torch's capture stream, into ``pool``.

    ``torch.cuda.graph`` without what it does before every graph (wait for the device, give the
    allocator's cached blocks back, empty the pinned host cache): :func:`capture_cuda` does that
    once for all the graphs of a capture. Like ``torch.cuda.graph``, it ends the capture when the
    block raises (an error of ``capture_end`` then carries the block's as its context), and it
    also always leaves the capture stream.
    """
    # The autocast weight cache outlives an autocast a forward enters and leaves while another
    # autocast context is open (one with enabled=False, as `enabled=use_amp` gives, or of
    # another device): the warmup's casts of the static inputs and parameters would be found
    # there, and the graph would read those fixed tensors (the samples' values, the weights
    # before any step) instead of casting. Emptied before, so every cast is captured, and after,
    # so that no eager code finds the graph's memory there.
    torch.clear_autocast_cache()
    with torch.cuda.stream(capture_stream()):
        graph.capture_begin(pool, capture_error_mode=mode)
        try:
            yield
        finally:
            with warnings.catch_warnings():
                # A forward whose every output is handed out as another tensor (an input, a
                # view of one) launches no kernel: its graph is empty, and replays as nothing.
                # torch warns of the wrong stream or device then, which this capture rules out.
                warnings.filterwarnings("ignore", _EMPTY_GRAPH, UserWarning)
                graph.capture_end()
            torch.clear_autocast_cache()


_EMPTY_GRAPH = r"The CUDA Graph is empty"


def _new_graph(extra_generators: Sequence[Any]) -> torch.cuda.CUDAGraph:
    # torch registers the default CUDA generator itself; others (TE's RNG tracker) must be
    # registered so that dropout draws fresh values on every replay.
    graph = torch.cuda.CUDAGraph()
    for generator_state in extra_generators:
        graph.register_generator_state(generator_state)
    return graph


def _pool_bytes(pools: Sequence[Any], device: torch.device) -> list[int]:
    """Bytes of the segments the CUDA caching allocator holds for each of ``pools`` (0 for one
    it cannot tell), from one snapshot of the allocator (it lists every segment of the process).
    """
    wanted: list[tuple[Any, ...] | None] = []
    for pool in pools:
        try:
            wanted.append(tuple(pool))
        except TypeError:  # not an (id, id) handle
            wanted.append(None)
    sizes: dict[tuple[Any, ...] | None, int] = dict.fromkeys(wanted, 0)
    if any(key is not None for key in wanted):
        try:
            segments = torch.cuda.memory_snapshot()
        except RuntimeError:
            segments = []
        for segment in segments:
            key = tuple(segment.get("segment_pool_id", ()))
            if key in sizes and segment.get("device", device.index) == device.index:
                sizes[key] += int(segment.get("total_size", 0))
    sizes[None] = 0
    return [sizes[key] for key in wanted]


def _device_of(captures: Sequence[_Capture]) -> torch.device:
    for item in captures:
        for tensor in (*item.static_inputs, *item.params):
            if tensor.is_cuda:
                return tensor.device
    return torch.device("cuda", torch.cuda.current_device())
