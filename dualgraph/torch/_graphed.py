"""``make_graphed_callables``: capture callables, then hand back replaying ones."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

import optree
import torch

from .._containers import NAMESPACE
from .._errors import CaptureError, DualgraphError
from .._spec import TreeSpec, describe
from ._capture import (
    Progress,
    capture_cuda,
    capture_emulated,
    describe_failure,
    prepare_params,
    prepare_static_inputs,
    repair_cuda_rng,
)
from ._inputs import InputGuard
from ._probe import LintMode, WarmupProbe, attach_probes, check_lint_mode, with_lint_findings
from ._replay import CaptureDiagnostics, GraphedCallable, autocast_state

__all__ = ["EagerCallable", "diagnostics", "make_graphed_callables", "owned", "restore"]

Backend = Literal["auto", "cuda", "emulate", "eager"]
ParamGrads = Literal["autograd", "in_graph"]
CaptureErrorMode = Literal["global", "thread_local", "relaxed"]
_BACKENDS = ("auto", "cuda", "emulate", "eager")
_CAPTURE_ERROR_MODES = get_args(CaptureErrorMode)


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    *,
    sample_kwargs: Any = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    backend: Backend = "auto",
    clone_outputs: bool = False,
    param_grads: ParamGrads = "autograd",
    capture_error_mode: CaptureErrorMode = "global",
    lint: LintMode = "error",
) -> Any:
    """Capture forward and backward CUDA graphs of callables whose outputs are any tree.

    Same calling convention as ``torch.cuda.make_graphed_callables``: one callable (a module
    or a function) with ``sample_args`` a tuple of args, or a tuple of callables with a tuple of
    such tuples (``sample_kwargs`` likewise). Several callables are captured in the order given,
    which must be the order they run in, and share one memory pool. A module's ``forward`` is
    replaced (the module is returned) and falls back to the original when its ``training``
    mode differs from capture time; a function comes back as a :class:`GraphedCallable`.

    Outputs may hold ``None``, int/float/bool/str constants, and tensors that need no grad: they
    come back exactly, and backward flows only through the tensors that required grad at
    capture (the output spec's grad mask). Calls are validated against the samples first
    (:class:`dualgraph.SpecMismatchError` naming the path, e.g. ``kwargs['mask']``).

    Output tensors alias static buffers that the next replay overwrites, as in torch and TE;
    pass ``clone_outputs=True`` (or use :func:`owned`) to get tensors you own. Each replay's
    backward must run before the next forward replay of the same callable.

    ``param_grads``: ``"autograd"`` (default) returns parameter grads through autograd, so
    ``.grad`` hooks and ``DistributedDataParallel`` see them. ``"in_graph"`` adds them into
    static ``.grad`` buffers inside the backward graph: much less host work per replay, the
    same ``.grad`` values (accumulation and ``zero_grad`` included), but no autograd hooks fire
    for parameters, so it is not for DDP or anything else that hooks parameter grads.

    ``capture_error_mode`` (``"cuda"`` only) is torch's: under ``"global"`` (default) a CUDA
    call of *another* thread that is unsafe during capture (a ``cudaMalloc`` by a data loader or
    prefetcher on the same GPU) invalidates the capture; ``"thread_local"`` lets other threads be.

    ``lint``: the first warmup iteration runs under the capture lint (see
    :func:`dualgraph.torch.lint`) on ``"cuda"`` and ``"emulate"`` (``"eager"`` has no warmup),
    so that a CPU run with ``"emulate"`` reports what a real capture would reject. ``"error"``
    (default) raises a :class:`~dualgraph.torch.CaptureLintError` listing the findings before
    anything is captured; ``"warn"`` issues a :class:`~dualgraph.DualgraphWarning` and captures
    anyway (a capture that then fails carries the findings); ``"off"`` skips the lint. Findings
    and the memory plan are in ``diagnostics(graphed).lint`` and ``.memory_plan``.

    Backends: ``"cuda"`` real graphs; ``"emulate"`` the same static-buffer semantics without a
    graph (re-runs the callable on the static buffers; finds aliasing bugs on a CPU); ``"eager"``
    a plain call with input validation; ``"auto"``: cuda when a sample tensor is on a CUDA
    device, else eager.

    >>> layer = torch.nn.Linear(4, 4)
    >>> graphed = make_graphed_callables(layer, (torch.randn(2, 4),), backend="emulate")
    >>> graphed(torch.randn(2, 4)).shape
    torch.Size([2, 4])
    """
    if backend not in _BACKENDS:
        raise DualgraphError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if param_grads not in ("autograd", "in_graph"):
        raise DualgraphError(f"param_grads must be 'autograd' or 'in_graph', got {param_grads!r}")
    if capture_error_mode not in _CAPTURE_ERROR_MODES:
        raise DualgraphError(
            f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, got {capture_error_mode!r}"
        )
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args, sample_kwargs = (callables,), (sample_args,), (sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = (None,) * len(callables)
    check_lint_mode(lint)
    _check_samples(callables, sample_args, sample_kwargs)
    backend = _resolve_backend(backend, sample_args, sample_kwargs)
    if backend != "eager":
        _check_autocast()

    if backend == "eager":
        results: list[Any] = []
        for fn, kwargs, args in zip(callables, sample_kwargs, sample_args):
            eager = EagerCallable(_name_of(fn), _forward_of(fn), InputGuard(args, kwargs))
            results.append(_install(fn, eager))
        return results[0] if single else tuple(results)

    graphs: list[GraphedCallable] = []
    probes: list[WarmupProbe] = []  # issue 19 hook
    for fn, args, kwargs in zip(callables, sample_args, sample_kwargs):
        graphed = GraphedCallable(_name_of(fn), _forward_of(fn), InputGuard(args, kwargs), backend)
        tensors = graphed.guard.tensors(tuple(args), dict(kwargs or {}))
        prepare_static_inputs(graphed, tensors)
        params = (
            [p for p in fn.parameters() if p.requires_grad]
            if isinstance(fn, torch.nn.Module)
            else []
        )
        prepare_params(graphed, params, param_grads)
        graphed.clone_outputs = clone_outputs
        graphed.autocast_state = autocast_state()
        graphs.append(graphed)
        probes.append(  # issue 19 hook: lint and memory plan of the first warmup iteration
            WarmupProbe(
                graphed.name,
                graphed.fn,
                inputs=graphed.static_inputs,
                paths=graphed.guard.paths,
                params=params,
                lint=lint,
            )
        )

    progress = Progress()
    try:
        if backend == "cuda":
            capture_cuda(
                graphs,
                num_warmup_iters=num_warmup_iters,
                allow_unused_input=allow_unused_input,
                pool=pool,
                progress=progress,
                capture_error_mode=capture_error_mode,
                probes=probes,
            )
        else:
            capture_emulated(
                graphs,
                num_warmup_iters=num_warmup_iters,
                allow_unused_input=allow_unused_input,
                progress=progress,
                probes=probes,
            )
    except Exception as error:
        if backend == "cuda":
            _recover_after_failed_capture()
        failure = describe_failure(error, progress, backend)
        raise with_lint_findings(failure, probes, error) from error  # issue 19 hook
    attach_probes([graphed.diagnostics for graphed in graphs], probes)  # issue 19 hook

    results = [_install(fn, graphed) for fn, graphed in zip(callables, graphs)]
    return results[0] if single else tuple(results)


class EagerCallable:
    """The ``"eager"`` backend: validate the inputs, then call the original callable."""

    def __init__(self, name: str, fn: Callable[..., Any], guard: InputGuard) -> None:
        self.name = name
        self.fn = fn
        self.guard = guard
        self.backend = "eager"
        self.out_spec: TreeSpec | None = None
        self.diagnostics = CaptureDiagnostics(name=name, backend="eager")

    @property
    def spec(self) -> TreeSpec:
        """The output spec, recorded at the first call."""
        if self.out_spec is None:
            raise DualgraphError(
                f"{self.name}: the eager backend records its spec at the first call"
            )
        return self.out_spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.guard.tensors(args, kwargs)
        outputs = self.fn(*args, **kwargs)
        if self.out_spec is None:
            self.out_spec = describe(outputs)
        else:
            self.out_spec.flatten(outputs)
        self.diagnostics.replays += 1
        return outputs


def diagnostics(graphed: Any, /) -> CaptureDiagnostics:
    """Static buffer bytes, pool size and capture time of a graphed module or callable."""
    return _runner_of(graphed).diagnostics


def owned(tree: Any, /) -> Any:
    """The same tree with every tensor cloned (autograd kept): outputs the next replay can't touch.

    >>> a, b = owned((torch.ones(2), None))
    >>> b is None
    True
    """
    return optree.tree_map(
        lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf,
        tree,
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def restore(module: torch.nn.Module, /) -> torch.nn.Module:
    """Give a graphed module its original ``forward`` back."""
    forward = module.__dict__.get("forward")
    if forward is None or not hasattr(forward, "__dualgraph_previous__"):
        raise DualgraphError(f"{type(module).__name__} is not a graphed module")
    previous = forward.__dualgraph_previous__
    if previous is None:
        del module.forward
    else:
        module.forward = previous
    return module


def _runner_of(graphed: Any) -> GraphedCallable | EagerCallable:
    if isinstance(graphed, GraphedCallable | EagerCallable):
        return graphed
    forward = getattr(graphed, "forward", None)
    runner = getattr(forward, "__dualgraph__", None)
    if runner is None:
        raise DualgraphError(f"{graphed!r} was not made by dualgraph.torch.make_graphed_callables")
    return runner


def _install(fn: Any, runner: GraphedCallable | EagerCallable) -> Any:
    if not isinstance(fn, torch.nn.Module):
        return runner
    module = fn
    previous = module.__dict__.get("forward")
    original_forward = module.forward
    training_at_capture = module.training

    def forward(*args: Any, **kwargs: Any) -> Any:
        if module.training == training_at_capture:
            return runner(*args, **kwargs)
        return original_forward(*args, **kwargs)

    forward.__dualgraph__ = runner  # type: ignore[attr-defined]
    forward.__dualgraph_previous__ = previous  # type: ignore[attr-defined]
    module.forward = forward
    return module


def _forward_of(fn: Any) -> Callable[..., Any]:
    # A module's own forward, so that its hooks run once, around the replay, and not in the graph.
    return fn.forward if isinstance(fn, torch.nn.Module) else fn


def _name_of(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_samples(callables: Sequence[Any], sample_args: Any, sample_kwargs: Any) -> None:
    if not isinstance(sample_args, tuple) or len(sample_args) != len(callables):
        raise DualgraphError(
            f"sample_args must be a tuple with one tuple of args per callable ({len(callables)})"
        )
    if not isinstance(sample_kwargs, tuple) or len(sample_kwargs) != len(callables):
        raise DualgraphError(
            f"sample_kwargs must be a tuple with one dict (or None) per callable ({len(callables)})"
        )
    for fn, args, kwargs in zip(callables, sample_args, sample_kwargs):
        name = _name_of(fn)
        if not callable(fn):
            raise DualgraphError(f"{fn!r} is not callable")
        if not isinstance(args, tuple):
            raise DualgraphError(f"{name}: sample args must be a tuple, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise DualgraphError(
                f"{name}: sample kwargs must be a dict, got {type(kwargs).__name__}"
            )
        if (
            isinstance(fn, torch.nn.Module)
            and "forward" in fn.__dict__
            and hasattr(fn.__dict__["forward"], "__dualgraph__")
        ):
            raise DualgraphError(f"{name} is already graphed; call dualgraph.torch.restore first")


def _resolve_backend(backend: str, sample_args: Any, sample_kwargs: Any) -> str:
    leaves = optree.tree_leaves((sample_args, sample_kwargs), namespace=NAMESPACE)
    on_cuda = any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in leaves)
    if backend == "auto":
        return "cuda" if on_cuda else "eager"
    if backend == "cuda" and not torch.cuda.is_available():
        raise DualgraphError(
            "backend='cuda' needs a CUDA device; use 'emulate' or 'eager' on a CPU"
        )
    if backend == "cuda" and not on_cuda:
        raise DualgraphError("backend='cuda' needs sample tensors on a CUDA device")
    return backend


def _check_autocast() -> None:
    enabled = torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    if enabled and torch.is_autocast_cache_enabled():
        raise CaptureError(
            "capturing under torch.autocast needs cache_enabled=False: the autocast weight cache "
            "would hold casts made during capture, and replays would read stale weights. Use "
            "torch.autocast(..., cache_enabled=False)"
        )


def _recover_after_failed_capture() -> None:
    with contextlib.suppress(RuntimeError):  # the failed capture's own error is reported
        torch.cuda.synchronize()
    repair_cuda_rng()
