"""The capture of shape buckets: one plan per bucket, into one pool, largest first.

:func:`capture_buckets` checks that the buckets differ in shapes only, captures each bucket's
plan (sharing parameter grad buffers and accumulators), and builds the
:class:`BucketedCallable` that dispatches among them (``_buckets.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._call import CallSpec
from .._errors import CaptureError, DualgraphError, SpecMismatchError
from ._buckets import (
    BucketDiagnostics,
    BucketedCallable,
    BucketedDiagnostics,
    Fallback,
    _Bucket,
)
from ._capture import CaptureOptions, CaptureRequest, capture
from ._capture_failure import Progress, describe_failure, release_failed_attempt
from ._eager import EagerCallable
from ._eager_graphs import EagerGraphs
from ._hooks import NO_HOOKS, CallableHooks
from ._inputs import InputGuard
from ._leaf_difference import difference_but_shapes
from ._leaves import dtype_name
from ._lint import LintReport
from ._padding import (
    VALID_LENGTH,
    Padding,
    check_padded_call,
    check_padded_plans,
    check_padding_can_be_correct,
    check_padding_is_masked,
    padding_of,
    undeclared_length_dims,
)
from ._params import grad_buffer_like, is_tensor_subclass
from ._replay import GraphedCallable

__all__ = ["BucketRequest", "capture_buckets"]


@dataclass(frozen=True)
class BucketRequest:
    """What :func:`capture_buckets` needs: one callable, one sample call per bucket, options."""

    name: str
    fn: Callable[..., Any]
    module: torch.nn.Module | None
    samples: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]
    backend: str
    options: CaptureOptions | None  # None on the "eager" backend
    fallback: Fallback = "error"
    dynamic_dims: Mapping[str, int] | None = None
    shared_lock: threading.Lock = field(default_factory=threading.Lock)
    hooks: CallableHooks = NO_HOOKS


def capture_buckets(request: BucketRequest) -> BucketedCallable:
    """Check the buckets, capture one plan per bucket into one pool, and build the dispatcher.

    Raises :class:`DualgraphError` for bad buckets or options and :class:`CaptureError` (naming
    the bucket) when a capture fails; then nothing is left captured.
    """
    samples = request.samples
    guards, expected = _bucket_guards(samples, request.fn)
    guard = guards[0]
    shapes = [
        tuple(t.shape for t in g.spec.flatten(*sample))
        for g, sample in zip(guards, samples, strict=True)
    ]
    for i, key in enumerate(shapes):
        if key in shapes[:i]:
            raise DualgraphError(
                f"buckets[{i}] has the same input shapes as buckets[{shapes.index(key)}]; each "
                "bucket is one shape"
            )
    padding, lengths = padding_of(request, guard, shapes)
    if padding is not None:
        check_padding_can_be_correct(request)
    # valid_length lives where the first padded input does
    device = expected[padding.inputs[0][0]][1] if padding is not None else None
    full_lengths: list[torch.Tensor | None] = [
        None if length is None else torch.full((), length, dtype=torch.int64, device=device)
        for length in lengths
    ]
    names = [f"{request.name}[{_show_shapes(guard.paths, key)}]" for key in shapes]
    runners: list[Any] = [None] * len(samples)
    diagnostics = [
        BucketDiagnostics(
            index=i,
            shapes={p: tuple(s) for p, s in zip(guard.paths, key, strict=True)},
            length=lengths[i],
        )
        for i, key in enumerate(shapes)
    ]
    plans: list[Any] = [None] * len(samples)
    pool_bytes = [0] * len(samples)
    largest_alone = 0
    largest = 0
    eager_graphs: EagerGraphs | None = None
    if request.options is None:  # the "eager" backend: input checks, no graphs
        for i, (args, kwargs) in enumerate(samples):
            kwargs = _with_length(kwargs, full_lengths[i])
            runners[i] = EagerCallable(
                names[i], request.fn, InputGuard(args, kwargs, request.fn), request.hooks
            )
    else:
        options = request.options
        if options.pool is not None:
            raise DualgraphError(
                "pool= cannot go with buckets=: a bucketed callable owns its pool, whose "
                "activations its buckets share, and which no other graph may write"
            )
        if options.backend == "cuda":
            options = dataclasses.replace(
                options, pool=torch.cuda.graph_pool_handle(), results_outside_pool=True
            )
        # "auto": the accumulators (the parameters' .grad) its backward graphs add into, one each
        # for every bucket; else (and for tensor-subclass parameters) one grad buffer each
        accumulators = (
            _shared_param_grads(request.module)
            if options.param_grads == "auto" and not _any_tensor_subclass(request.module)
            else None
        )
        shared = _shared_param_grads(request.module) if accumulators is None else None
        before = 0
        for rank, i in enumerate(_largest_first(samples, guards)):
            args, kwargs = samples[i]
            kwargs = _with_length(kwargs, full_lengths[i])
            inputs = InputGuard(args, kwargs, request.fn)
            (plan,) = capture(
                [
                    CaptureRequest(
                        name=names[i],
                        fn=request.fn,
                        module=request.module,
                        inputs=inputs,
                        sample_tensors=tuple(inputs.tensors(args, kwargs)),
                        param_grad_buffers=shared,
                        param_accumulators=accumulators,
                        hooks=request.hooks,
                    )
                ],
                options,
            )
            plans[i] = plan
            pool_bytes[i] = max(0, plan.diagnostics.pool_bytes - before)
            before = max(before, plan.diagnostics.pool_bytes)
            if rank == 0:
                largest_alone = plan.diagnostics.pool_bytes
                largest = i
        _check_output_structures(plans)
        if padding is not None:
            check_padded_plans(request, padding, plans, lengths, shapes)
        # "auto": while the eager fallback's graph is alive, the buckets' grads go to autograd
        if options.param_grads == "auto" and request.fallback == "eager":
            eager_graphs = EagerGraphs()
        # no reference of this capture's own to the accumulators may outlive it into the
        # holder counts taken below (each would hide one reference a user keeps)
        del accumulators, shared
        runners = [
            GraphedCallable(plan, lock=request.shared_lock, other_uses=eager_graphs)
            for plan in plans
        ]
        GraphedCallable.join(runners)
        for diag, plan, growth in zip(diagnostics, plans, pool_bytes, strict=True):
            diag.static_input_bytes = plan.diagnostics.static_input_bytes
            diag.static_output_bytes = plan.diagnostics.static_output_bytes
            diag.static_grad_bytes = plan.diagnostics.static_grad_bytes
            diag.capture_seconds = plan.diagnostics.capture_seconds
            diag.pool_growth_bytes = growth
            diag.lint = plan.diagnostics.lint  # issue 19 hook
            diag.memory_plan = plan.diagnostics.memory_plan
    if padding is not None:
        _check_padding(request, padding, guards, lengths, shapes)
    summary = BucketedDiagnostics(
        name=request.name,
        backend=request.backend,
        static_input_bytes=sum(d.static_input_bytes for d in diagnostics),
        static_output_bytes=sum(d.static_output_bytes for d in diagnostics),
        static_grad_bytes=_unique_grad_bytes(plans),
        pool_bytes=max((p.diagnostics.pool_bytes for p in plans if p is not None), default=0),
        capture_seconds=sum(d.capture_seconds for d in diagnostics),
        has_backward_graph=any(p is not None and p.has_backward for p in plans),
        fallback=request.fallback,
        buckets=tuple(diagnostics),
        largest_bucket_pool_bytes=largest_alone,
    )
    if plans[0] is not None:  # issue 19 hook: the capture lint and the memory plan
        reports = [d.lint for d in diagnostics if d.lint is not None]
        summary.lint = functools.reduce(LintReport.merged, reports) if reports else None
        summary.memory_plan = diagnostics[largest].memory_plan
    buckets = [
        _Bucket(i, tuple(key), runners[i], diagnostics[i], lengths[i], full_lengths[i])
        for i, key in enumerate(shapes)
    ]
    return BucketedCallable(
        name=request.name,
        fn=request.fn,
        guard=guard,
        buckets=buckets,
        fallback=request.fallback,
        padding=padding,
        diagnostics=summary,
        out_spec=plans[0].outputs if plans[0] is not None else None,
        eager_graphs=eager_graphs,
        hooks=request.hooks,
        padding_check=(
            None
            if padding is None
            else functools.partial(check_padded_call, request, padding, guard)
        ),
    )


def _bucket_guards(
    samples: Sequence[tuple[tuple[Any, ...], dict[str, Any]]], fn: Callable[..., Any]
) -> tuple[list[InputGuard], tuple[tuple[torch.dtype, torch.device, bool], ...]]:
    """One input guard per bucket of ``fn``, each checked to differ from the first in shapes
    only; and the ``(dtype, device, requires_grad)`` of each input tensor."""
    guards = []
    for i, (args, kwargs) in enumerate(samples):
        try:
            guards.append(InputGuard(args, kwargs, fn))
        except DualgraphError as error:
            raise type(error)(f"buckets[{i}]: {error}") from None
    first = guards[0]
    expected = tuple((t.dtype, t.device, t.requires_grad) for t in first.spec.flatten(*samples[0]))
    for i, (args, kwargs) in enumerate(samples):
        try:
            tensors = first.spec.flatten(args, kwargs)
        except SpecMismatchError as error:
            difference = _difference_but_shapes(first.spec, guards[i].spec) or str(error)
            raise DualgraphError(
                f"buckets[{i}]: {difference} (as buckets[0] has it); buckets differ only in the "
                "shapes of their tensors"
            ) from None
        order = first.key_order_difference(args, kwargs)
        if order is not None:  # a callable may follow a dict's key order, or its **kwargs'
            raise DualgraphError(
                f"buckets[{i}]: {order[0]}: {order[1]} (as buckets[0] has it); buckets differ "
                "only in the shapes of their tensors"
            )
        for path, tensor, kind in zip(first.paths, tensors, expected, strict=True):
            found = (tensor.dtype, tensor.device, tensor.requires_grad)
            if found != kind:
                grad = found[2] != kind[2]  # say it on both sides only where it differs
                raise DualgraphError(
                    f"buckets[{i}]: {path} is {_kind(*found, grad)} but {_kind(*kind, grad)} in "
                    "buckets[0]; buckets differ only in the shapes of their tensors"
                )
    return guards, expected


def _difference_but_shapes(expected: CallSpec, found: CallSpec) -> str | None:
    """Where two calls' specs first differ in more than array shapes (None: in shapes only)."""
    for root in ("args", "kwargs"):
        left = getattr(expected, f"{root}_spec")
        right = getattr(found, f"{root}_spec")
        # dtypes are checked with device and grad, once the structure is known to match
        difference = difference_but_shapes(left, right, dtypes=False)
        if difference is not None:
            path, want, got = difference
            return f"{root}{path}: expected {want}, got {got}"
    return None


def _check_output_structures(plans: Sequence[Any]) -> None:
    """Refuse buckets whose outputs differ in more than shapes (containers, ``None``, constants,
    dtypes): a graphed callable returns one output structure, the one an eager fallback is held
    to, so a bucket of its own would make calls of one callable disagree on it."""
    first = plans[0].outputs
    for i, plan in enumerate(plans[1:], start=1):
        difference = difference_but_shapes(first, plan.outputs)
        if difference is not None:
            path, want, got = difference
            raise DualgraphError(
                f"buckets[{i}]: output{path} is {got} but {want} in buckets[0]; buckets differ "
                "only in the shapes of their tensors, and a graphed callable returns one output "
                "structure"
            )


def _kind(dtype: torch.dtype, device: torch.device, requires_grad: bool, grad: bool) -> str:
    if not grad:
        return f"{dtype_name(dtype)} on {device}"
    return f"{dtype_name(dtype)} on {device}, {'' if requires_grad else 'not '}requiring grad"


def _show_shapes(paths: Sequence[str], shapes: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"{path}={list(shape)}" for path, shape in zip(paths, shapes, strict=True))


def _with_length(kwargs: dict[str, Any], length: torch.Tensor | None) -> dict[str, Any]:
    return kwargs if length is None else {**kwargs, VALID_LENGTH: length}


def _largest_first(
    samples: Sequence[tuple[tuple[Any, ...], dict[str, Any]]], guards: Sequence[InputGuard]
) -> list[int]:
    """Bucket indices, largest input first: its capture sizes the pool the others reuse."""

    def size(i: int) -> int:
        args, kwargs = samples[i]
        return sum(t.numel() * t.element_size() for t in guards[i].spec.flatten(args, kwargs))

    return sorted(range(len(samples)), key=lambda i: -size(i))


def _shared_param_grads(module: torch.nn.Module | None) -> tuple[torch.Tensor, ...] | None:
    """One grad buffer (or accumulator) per trainable parameter, for every bucket."""
    if module is None:
        return None
    return tuple(grad_buffer_like(p) for _, p in module.named_parameters() if p.requires_grad)


def _any_tensor_subclass(module: torch.nn.Module | None) -> bool:
    """Whether a trainable parameter is a tensor subclass ("auto" then takes autograd)."""
    return module is not None and any(
        is_tensor_subclass(p) for p in module.parameters() if p.requires_grad
    )


def _unique_grad_bytes(plans: Sequence[Any]) -> int:
    seen: dict[int, torch.Tensor] = {}
    for plan in plans:
        if plan is None:
            continue
        buffers = plan.buffers
        for tensor in (
            *buffers.grad_outputs,
            *buffers.input_grads,
            *buffers.param_grads,
            *plan.params.accumulators,
        ):
            if tensor is not None:
                seen[id(tensor)] = tensor
    return sum(t.numel() * t.element_size() for t in seen.values())


def _check_padding(
    request: BucketRequest,
    padding: Padding,
    guards: Sequence[InputGuard],
    lengths: Sequence[Any],
    shapes: Sequence[Any],
) -> None:
    """:func:`check_padding_is_masked`, the callable's own errors there named as a capture's."""
    progress = Progress(
        name=request.name,
        phase="the padding check (eager calls, one padded into a bucket)",
        before=sys.exc_info()[1],
    )
    try:
        check_padding_is_masked(request, padding, guards, lengths, shapes)
    except DualgraphError:
        raise
    except Exception as error:  # the callable's, as in a warmup: a CaptureError as there
        failure = describe_failure(error, progress, request.backend)
        release_failed_attempt(error, progress.before)
        undeclared = undeclared_length_dims(padding, guards[0].paths, lengths, shapes)
        if undeclared:
            # The check's short call cut the declared inputs only: an input that follows the
            # length but was left out is the likely cause, and the callable's error names no path.
            named = ", ".join(f"{path} (dim {dim})" for path, dim in undeclared)
            declare = ", ".join(f"{path!r}: {dim}" for path, dim in undeclared)
            failure = CaptureError(
                f"{failure}. {named}: holds each bucket's length but is not in dynamic_dims, so "
                "padding cuts and pads the declared inputs only and leaves it at a bucket's "
                f"length; if it follows the length, declare it ({declare})"
            )
        raise failure from error
