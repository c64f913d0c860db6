"""``make_graphed_callables``: check the request, capture, hand back replaying callables."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args, overload

import optree
import torch

from .._containers import NAMESPACE
from .._errors import CaptureError, DualgraphError, SpecMismatchError
from .._signatures import signatures_read_once
from .._spec import map_arrays
from ._ambient import outside_inference_mode
from ._bucket_capture import BucketRequest, capture_buckets
from ._buckets import BucketedCallable, Fallback
from ._capture import CaptureOptions, CaptureRequest, capture
from ._capture_failure import released_on_failure
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._hooks import hooks_per_callable
from ._inputs import InputGuard, input_off_device
from ._modules import eager_forward, install, is_graphed, runner_of, the_module_of_its_forward
from ._plan import ReplayPlan
from ._pool_order import places_in_capture_order, settle_outputs
from ._probe import LintMode
from ._process_state import kept_process_state
from ._replay import GraphedCallable
from ._replay_hooks import ReplayHooks
from ._saved_hooks import keeping_activations
from ._schedule import Schedule
from ._slots import SlottedCallable, capture_slotted, checked_slots, reset_slots_of
from ._te_precision import FIRST_MICROBATCH, PrecisionArgs, TECallable, capturing, te_callables

__all__ = ["diagnostics", "make_graphed_callables", "owned", "reset_slots"]

Backend = Literal["auto", "cuda", "emulate", "eager"]
ParamGrads = Literal["auto", "autograd", "in_graph"]
CaptureErrorMode = Literal["global", "thread_local", "relaxed"]

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


@overload
def make_graphed_callables(  # type: ignore[overload-overlap]
    callables: ModuleT,
    sample_args: Sequence[Any] | None = None,
    *,
    sample_kwargs: Mapping[str, Any] | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    backend: Backend = "auto",
    clone_outputs: bool = False,
    param_grads: ParamGrads = "auto",
    capture_error_mode: CaptureErrorMode = "global",
    buckets: Sequence[Sequence[Any]] | None = None,
    fallback: Fallback = "error",
    dynamic_dims: Mapping[str, int] | None = None,
    lint: LintMode = "auto",
    slots: int | None = None,
    schedule: Schedule | Sequence[int] | None = None,
    replay_hooks: ReplayHooks | Sequence[ReplayHooks | None] | None = None,
    capture_time_hooks: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    enabled: bool | Sequence[bool] | None = None,
    recipe: Any = None,
    amax_reduction_group: Any = None,
    calibrating: bool | Sequence[bool] | None = None,
    cache_quantized_params: bool = False,
) -> ModuleT: ...


@overload
def make_graphed_callables(
    callables: tuple[Any, ...] | list[Any],
    sample_args: Sequence[Sequence[Any]],
    *,
    sample_kwargs: Sequence[Mapping[str, Any] | None] | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    backend: Backend = "auto",
    clone_outputs: bool = False,
    param_grads: ParamGrads = "auto",
    capture_error_mode: CaptureErrorMode = "global",
    buckets: None = None,
    fallback: Literal["error"] = "error",
    dynamic_dims: None = None,
    lint: LintMode = "auto",
    slots: int | None = None,
    schedule: Schedule | Sequence[int] | None = None,
    replay_hooks: ReplayHooks | Sequence[ReplayHooks | None] | None = None,
    capture_time_hooks: Sequence[Mapping[str, Any] | None] | None = None,
    enabled: bool | Sequence[bool] | None = None,
    recipe: Any = None,
    amax_reduction_group: Any = None,
    calibrating: bool | Sequence[bool] | None = None,
    cache_quantized_params: bool = False,
) -> tuple[Any, ...]: ...


@overload
def make_graphed_callables(
    callables: Callable[..., Any],
    sample_args: Sequence[Any] | None = None,
    *,
    sample_kwargs: Mapping[str, Any] | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    backend: Backend = "auto",
    clone_outputs: bool = False,
    param_grads: ParamGrads = "auto",
    capture_error_mode: CaptureErrorMode = "global",
    buckets: Sequence[Sequence[Any]] | None = None,
    fallback: Fallback = "error",
    dynamic_dims: Mapping[str, int] | None = None,
    lint: LintMode = "auto",
    slots: int | None = None,
    schedule: Schedule | Sequence[int] | None = None,
    replay_hooks: ReplayHooks | Sequence[ReplayHooks | None] | None = None,
    capture_time_hooks: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    enabled: bool | Sequence[bool] | None = None,
    recipe: Any = None,
    amax_reduction_group: Any = None,
    calibrating: bool | Sequence[bool] | None = None,
    cache_quantized_params: bool = False,
) -> GraphedCallable | SlottedCallable | EagerCallable | BucketedCallable: ...


def make_graphed_callables(
    callables: Any,
    sample_args: Any = None,
    *,
    sample_kwargs: Any = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    backend: Backend = "auto",
    clone_outputs: bool = False,
    param_grads: ParamGrads = "auto",
    capture_error_mode: CaptureErrorMode = "global",
    buckets: Any = None,
    fallback: Fallback = "error",
    dynamic_dims: Mapping[str, int] | None = None,
    lint: LintMode = "auto",
    slots: int | None = None,
    schedule: Schedule | Sequence[int] | None = None,
    replay_hooks: Any = None,
    capture_time_hooks: Any = None,
    enabled: Any = None,
    recipe: Any = None,
    amax_reduction_group: Any = None,
    calibrating: Any = None,
    cache_quantized_params: bool = False,
) -> Any:
    """Capture forward and backward CUDA graphs of callables whose outputs are any tree.

    Same calling convention as ``torch.cuda.make_graphed_callables``: one callable (a module or
    a function) with its sample args, or a tuple of callables with one tuple of sample args
    each. Several callables are captured in the order given, which must be the order they run
    in, and share one memory pool: a backward whose activations a replay of an earlier callable
    may have overwritten raises (``_pool_order.py``). A module comes back graphed in place
    (its ``forward`` replays; it runs the original forward when its ``training`` mode differs
    from capture time); a function comes back as a :class:`GraphedCallable`.

    Outputs may hold ``None``, int/float/bool/str constants, and tensors that need no grad:
    they come back exactly, and backward flows only through the tensors that required grad at
    capture (the output spec's grad mask). Every call is checked before any static buffer is
    written (:class:`dualgraph.SpecMismatchError` naming the path, e.g. ``kwargs['mask']``).
    The rules that come with graphs (outputs alias static buffers, each replay's backward
    before the next forward, ...) are in the README.

    Args:
        callables: a module or function, or a tuple (or list) of them.
        sample_args: the positional args of one call (a tuple or list) for one callable, or a
            tuple of such for a tuple of callables. Shapes, dtypes, devices and
            ``requires_grad`` are those of every later call.
        sample_kwargs: the keyword args of one call (a dict), or a tuple of dicts (or ``None``)
            for a tuple of callables.
        num_warmup_iters: eager forward and backward calls before the capture (at least one
            runs; the first is inspected for in-place updates of inputs and saved outputs).
        allow_unused_input: allow inputs and parameters the outputs do not depend on (they get
            no grad), instead of failing the capture.
        pool: a CUDA graph memory pool handle to share (``"cuda"``); by default one new pool
            for the callables captured together. Callables graphed by several calls into one
            pool follow its capture order, as callables graphed together do. Not with
            ``slots=`` or ``schedule=``, whose graphs need pools of their own.
        backend: ``"cuda"`` real CUDA graphs; ``"emulate"`` the same static-buffer semantics
            without a graph (it re-runs the callable on the static buffers, so a CPU run
            exercises what a replay does); ``"eager"`` a plain call with input checks;
            ``"auto"`` (default): ``"cuda"`` when a sample tensor is on a CUDA device, else
            ``"emulate"``.
        clone_outputs: return outputs cloned out of the static buffers (see :func:`owned`).
        param_grads: how parameter grads reach ``.grad``. ``"auto"`` (default) decides per
            backward: the backward graph adds them into the ``.grad`` accumulators, and a plain
            ``loss.backward()`` keeps that sum with no per-parameter autograd work, unless a
            parameter has a hook, the forward ran
            under ``DistributedDataParallel``, or anomaly mode or ``create_graph`` is on; then,
            and for ``torch.autograd.grad`` or ``backward(inputs=...)``, they go through
            autograd. ``"autograd"`` always returns them through autograd. ``"in_graph"`` adds
            them inside the backward graph and leaves the parameters out of autograd: the
            least host work per replay, but no parameter hooks, DDP or ``torch.autograd.grad``
            for parameters (refused where it can tell).
        capture_error_mode: torch's (``"cuda"`` only): under ``"global"`` (default) a CUDA call
            of another thread that is unsafe during capture (a ``cudaMalloc`` by a data loader
            or prefetcher on the same GPU) invalidates the capture; ``"thread_local"`` lets
            other threads be.
        buckets: instead of ``sample_args``, for one callable: a list with one tuple of sample
            args per input shape (``sample_kwargs`` then a dict for all, or a list with one per
            bucket). Each bucket gets its own forward and backward graphs, all in one pool
            sized by the largest; a call replays the bucket of its input shapes (see
            :class:`BucketedCallable`).
        fallback: what a call of shapes no bucket has does: ``"error"`` (default) raises
            :class:`dualgraph.SpecMismatchError` naming the path and the buckets; ``"eager"``
            runs the callable eagerly; ``"pad"`` pads the ``dynamic_dims`` with zeros up to the
            smallest bucket that holds them, passes the callable ``valid_length=`` (a 0-d int64
            tensor: the positions before it are the call's, the rest padding) and cuts the
            declared output dims back.
        dynamic_dims: for ``fallback="pad"``: ``{path: dim}`` of the input dims to pad (they
            share one length) and the output dims to cut back, e.g.
            ``{"args[0]": 1, "output[0]": 1}``.
        lint: the first warmup iteration runs under the capture lint
            (:func:`dualgraph.torch.lint`). ``"auto"`` (default): ``"error"`` on
            ``"emulate"``, so that a CPU run reports what a real capture would reject, and no
            lint on ``"cuda"``, where the real capture is the authority and the warmup runs
            unobserved. ``"error"`` raises a :class:`~dualgraph.torch.CaptureLintError` listing
            the findings before anything is captured; ``"warn"`` issues a
            :class:`~dualgraph.DualgraphWarning` and captures anyway (a capture that then fails
            carries the findings: pass it on ``"cuda"`` to learn why a capture fails);
            ``"off"`` skips the lint.
            The findings and the memory plan are in ``diagnostics(graphed).lint`` and
            ``.memory_plan`` (``None`` on ``"cuda"`` under ``"auto"``: nothing watched the
            warmup; ``"off"`` still makes the plan).
        slots: replay slots per callable: up to ``slots`` replays in flight (forward run,
            backward pending), each in its own slot, with its own buffers and graphs captured
            into a memory pool of its own, so that they replay in any order; a backward finds
            its slot through autograd. Default: one.
        schedule: a pipeline schedule (:class:`Schedule`, or its order as a list of ints like
            Transformer Engine's ``_order``: ``+c`` forward and ``-c`` backward through chunk
            ``c``, callables split evenly over the chunks): each callable gets a slot per
            micro-batch of the step, all captured into one pool in the schedule's order, and
            every replay must follow that order (else :class:`DualgraphError`, before any buffer
            is touched). Memory then follows the schedule, as eager's does.
        replay_hooks: a :class:`ReplayHooks` (for every callable) or a tuple with one (or
            ``None``) per callable: host code run outside the graphs before and after each
            forward and backward replay (a step counter, an aux-loss tracker), on every backend.
        capture_time_hooks: as Transformer Engine's: a list with one dict (or ``None``) per
            callable (one callable: its dict), with keys among ``"forward_pre_hooks"``,
            ``"forward_hooks"``, ``"backward_pre_hooks"``, ``"backward_hooks"``, each a
            ``{hook_id: hook}`` dict; ``hook(module)`` runs around each warmup and capture
            forward or backward, outside the graph, and never at replay (e.g. FSDP's unshard and
            reshard).
        enabled, recipe, amax_reduction_group, calibrating: Transformer Engine's autocast
            arguments for each callable (one value, or a tuple with one per callable), as TE's
            ``make_graphed_callables`` takes them: each callable is warmed up and captured in
            ``te.autocast(enabled, calibrating, recipe, amax_reduction_group)`` (``recipe=None``:
            TE's default), so that e.g. the first and last layers stay in high precision. A
            callable captured with ``enabled=True`` replays inside a ``te.autocast`` of the
            same recipe and group (whose exit updates delayed-scaling scales, as in eager).
            Left out, callables are captured in the ``te.autocast`` around this call, and must
            replay in the same one. Needs TE (``pip install dualgraph[te]``).
        cache_quantized_params: cache the FP8 weights across the micro-batches of a step, as
            TE's weight caching does: every call then passes ``is_first_microbatch=True`` on a
            step's first micro-batch (the weights are cast again) and ``False`` on the others
            (the cached casts are reused); the replay takes it (the callable gets it only on
            the ``"eager"`` backend). Needs TE; not with ``buckets=``.

    Returns:
        The module (graphed in place), a :class:`GraphedCallable` for a function (an
        :class:`EagerCallable` on the ``"eager"`` backend), or a tuple of those.

    Raises:
        DualgraphError: a bad option or sample.
        CaptureError: warmup or capture failed; the message names the callable, the phase and
            the cause, and the module is left as it was; a
            :class:`~dualgraph.torch.CaptureLintError` (a subclass) when the capture lint
            found errors, or carries findings of a capture that failed.

    >>> layer = torch.nn.Linear(4, 4)
    >>> graphed = make_graphed_callables(layer, (torch.randn(2, 4),), backend="emulate")
    >>> graphed(torch.randn(2, 4)).shape
    torch.Size([2, 4])
    >>> stage = make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),), slots=2)
    >>> first, second = stage(torch.randn(2, 4)), stage(torch.randn(2, 4))  # two in flight
    >>> diagnostics(stage).in_flight
    (0, 1)
    """
    _check_choice("backend", backend, get_args(Backend))
    _check_choice("param_grads", param_grads, get_args(ParamGrads))
    _check_choice("capture_error_mode", capture_error_mode, get_args(CaptureErrorMode))
    _check_choice("fallback", fallback, get_args(Fallback))
    _check_choice("lint", lint, get_args(LintMode))
    if type(num_warmup_iters) is not int or num_warmup_iters < 0:
        raise DualgraphError(f"num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    _check_pool(pool)
    for option, flag in (
        ("clone_outputs", clone_outputs),
        ("allow_unused_input", allow_unused_input),
    ):
        if not isinstance(flag, bool):  # bool("no") would turn it on
            raise DualgraphError(f"{option} must be True or False, got {flag!r}")
    options = CaptureOptions(
        backend="emulate",  # set below
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=bool(allow_unused_input),
        pool=pool,
        capture_error_mode=capture_error_mode,
        clone_outputs=bool(clone_outputs),
        param_grads=param_grads,
        lint=lint,
    )
    precision = PrecisionArgs(
        enabled, recipe, amax_reduction_group, calibrating, cache_quantized_params
    )
    if buckets is not None:
        if slots is not None or schedule is not None:
            raise DualgraphError(
                "buckets= does not combine with slots= or schedule= (several shapes, or several "
                "micro-batches in flight: one of the two per callable)"
            )
        if cache_quantized_params:
            raise DualgraphError(
                "cache_quantized_params= does not combine with buckets= yet (a call's "
                "is_first_microbatch would have to pass the bucket lookup)"
            )
        extras = _Extras(precision, replay_hooks, capture_time_hooks)
        return _graph_buckets(
            callables,
            sample_args,
            sample_kwargs,
            buckets,
            backend,
            options,
            fallback,
            dynamic_dims,
            extras,
        )
    if fallback != "error" or dynamic_dims is not None:
        raise DualgraphError(
            "fallback= and dynamic_dims= go with buckets= (the shapes a call may have)"
        )
    if sample_args is None:
        raise DualgraphError("sample_args is required (or buckets=, one sample call per shape)")
    single = not isinstance(callables, tuple | list)
    fns, all_args, all_kwargs = _samples_per_callable(callables, sample_args, sample_kwargs, single)
    slots, schedule = checked_slots(slots, schedule, callables=len(fns), pool=pool)
    forwards = [_forward_of(fn) for fn in fns]
    with signatures_read_once():  # the blocks of a model: one forward's signature, read once
        guards = [
            InputGuard(args, kwargs, forward)
            for args, kwargs, forward in zip(all_args, all_kwargs, forwards, strict=True)
        ]
    resolved = _resolve_backend(backend, all_args, all_kwargs)
    names = [_name_of(fn) for fn in fns]
    if resolved == "cuda":
        _refuse_inputs_off_the_graphs_device(names if not single else [""], all_args, all_kwargs)
    _refuse_replay_kwargs_in_samples(cache_quantized_params, names, all_kwargs)
    te = te_callables(precision, names, fns, graphed=resolved != "eager")
    hooks = hooks_per_callable(
        names, fns, replay_hooks=replay_hooks, capture_time_hooks=capture_time_hooks, te=te
    )

    if resolved == "eager":
        results = [
            install(fn, EagerCallable(name, forward, guard, callable_hooks))
            for fn, forward, name, guard, callable_hooks in zip(
                fns, forwards, names, guards, hooks, strict=True
            )
        ]
        return results[0] if single else tuple(results)

    _check_autocast()
    requests = [
        CaptureRequest(
            name=name,
            fn=forward,
            module=fn if isinstance(fn, torch.nn.Module) else None,
            inputs=guard,
            sample_tensors=tuple(guard.tensors(tuple(args), dict(kwargs or {}))),
            hooks=callable_hooks,
        )
        for fn, forward, name, guard, args, kwargs, callable_hooks in zip(
            fns, forwards, names, guards, all_args, all_kwargs, hooks, strict=True
        )
    ]
    runners: list[GraphedCallable | SlottedCallable] = []
    options = dataclasses.replace(options, backend=resolved)
    with _graphing(te):
        if slots is None and schedule is None:
            runners.extend(_graphed_together(capture(requests, options), names, pool))
        else:
            runners.extend(capture_slotted(requests, options, slots=slots, schedule=schedule))
    results = [install(fn, runner) for fn, runner in zip(fns, runners, strict=True)]
    return results[0] if single else tuple(results)


def _graphed_together(
    plans: Sequence[ReplayPlan], names: Sequence[str], pool: Any
) -> list[GraphedCallable]:
    """The callables of plans captured together into one pool, after those captured into the
    same ``pool=`` before: which replays may overwrite what (``_pool_order.py``)."""
    if len(plans) == 1 and pool is None:  # a pool of its own: its own replays are all there is
        return [GraphedCallable(plans[0])]
    places = places_in_capture_order(names, pool)
    runners = [GraphedCallable(plan, pool=place) for plan, place in zip(plans, places, strict=True)]
    settle_outputs(places, [runner.exposed_outputs for runner in runners])
    return runners


def _graph_buckets(
    fn: Any,
    sample_args: Any,
    sample_kwargs: Any,
    buckets: Any,
    backend: Backend,
    options: CaptureOptions,
    fallback: Fallback,
    dynamic_dims: Mapping[str, int] | None,
    extras: _Extras,
) -> Any:
    """``make_graphed_callables(fn, buckets=...)``: check the request, capture, install."""
    if isinstance(fn, tuple | list):
        raise DualgraphError(
            "buckets= graphs one callable (whose buckets share one pool); graph each callable "
            "with its own buckets"
        )
    if sample_args is not None:
        raise DualgraphError(
            "pass the sample calls either as sample_args (one shape) or as buckets= (one per "
            "shape), not both"
        )
    if not isinstance(buckets, tuple | list) or not buckets:
        raise DualgraphError(
            f"buckets= is a non-empty list with one tuple of sample args per input shape, got "
            f"{buckets!r:.80}"
        )
    count = len(buckets)
    if sample_kwargs is None or isinstance(sample_kwargs, Mapping):
        kwargs_list = [sample_kwargs] * count
    elif isinstance(sample_kwargs, tuple | list) and len(sample_kwargs) == count:
        kwargs_list = list(sample_kwargs)
    else:
        raise DualgraphError(
            f"with buckets=, sample_kwargs is one dict for every bucket or a list with one dict "
            f"(or None) per bucket ({count})"
        )
    samples = []
    for args, kwargs in zip(buckets, kwargs_list, strict=True):
        _, (checked,), (kwargs,) = _samples_per_callable(fn, args, kwargs, True)
        samples.append((checked, dict(kwargs or {})))
    resolved = _resolve_backend(backend, [a for a, _ in samples], [k for _, k in samples])
    name = _name_of(fn)
    if resolved == "cuda":
        _refuse_inputs_off_the_graphs_device(
            [f"buckets[{i}]" for i in range(count)], *zip(*samples, strict=True)
        )
    te = te_callables(extras.precision, [name], [fn], graphed=resolved != "eager")
    (hooks,) = hooks_per_callable(
        [name],
        [fn],
        replay_hooks=extras.replay_hooks,
        capture_time_hooks=extras.capture_time_hooks,
        te=te,
    )
    if resolved != "eager":
        _check_autocast()
    request = BucketRequest(
        name=name,
        fn=_forward_of(fn),
        module=fn if isinstance(fn, torch.nn.Module) else None,
        samples=tuple(samples),
        backend=resolved,
        options=None if resolved == "eager" else dataclasses.replace(options, backend=resolved),
        fallback=fallback,
        dynamic_dims=dynamic_dims,
        hooks=hooks,
    )
    with _graphing(te):
        bucketed = capture_buckets(request)
    return install(fn, bucketed)


def diagnostics(graphed: Any, /) -> CaptureDiagnostics:
    """Static buffer bytes, pool size, capture time and replay count of a graphed object.

    >>> layer = make_graphed_callables(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
    >>> report = diagnostics(layer)
    >>> report.backend, report.static_input_bytes, report.replays
    ('emulate', 32, 0)
    """
    return runner_of(graphed).diagnostics


def reset_slots(graphed: Any, /) -> None:
    """Drop the replays in flight of a callable graphed with slots or a schedule; restart it.

    Their backwards then raise; a schedule starts its step over (for every callable graphed
    with it). For a step abandoned half-way, e.g. after an error.

    >>> stage = make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),), slots=2)
    >>> kept = stage(torch.randn(2, 4))
    >>> reset_slots(stage)
    >>> diagnostics(stage).in_flight
    ()
    """
    reset_slots_of(runner_of(graphed))


def owned(tree: Any, /) -> Any:
    """The same tree with every tensor cloned (autograd kept): outputs the next replay can't touch.

    A tensor met twice (``return h, h``, which a replay hands out as one tensor, as eager does)
    is cloned once and comes back twice, so that a change through one is seen through the other;
    tensors that view one another are cloned apart (each a tensor of its own). A tree holding a
    namedtuple or an ``OrderedDict`` is rebuilt as a spec rebuilds it (optree's own rebuild
    calls a namedtuple class bare, whose ``__new__`` would change its values a second time,
    and puts an ``OrderedDict`` back in insertion order, ``move_to_end`` undone): a class that
    changes the values it is given is refused naming the path, and such a tree must be one
    :func:`dualgraph.describe` takes (as a graphed callable's outputs are).

    >>> a, b = owned((torch.ones(2), None))
    >>> b is None
    True
    >>> h = torch.ones(2)
    >>> first, again = owned((h, h))
    >>> first is again and first is not h
    True
    """
    made: dict[int, torch.Tensor] = {}  # by id: the tree holds every tensor while this runs

    def own(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        copy = made.get(id(leaf))
        if copy is None:
            copy = made[id(leaf)] = leaf.clone()
        return copy

    leaves, structure = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
    if structure not in _PLAIN:
        stops = optree.tree_leaves(
            tree, is_leaf=_rebuilt_by_spec, none_is_leaf=True, namespace=NAMESPACE
        )
        if any(map(_rebuilt_by_spec, stops)):
            return map_arrays(own, tree)
        if len(_PLAIN) >= _MAX_PLAIN:
            _PLAIN.clear()
        _PLAIN[structure] = None
    return structure.unflatten(map(own, leaves))


# The optree structures owned met that hold no namedtuple or OrderedDict (optree rebuilds them
# as a spec would): looked up rather than looked for again on each call (0.2 us against 3 us).
# They hold only classes kept for good (registered dataclasses, optree's own registrations).
_PLAIN: dict[optree.PyTreeSpec, None] = {}
_MAX_PLAIN = 256


def _rebuilt_by_spec(obj: Any) -> bool:
    """Whether :func:`owned` rebuilds ``obj`` through a spec, not optree: a namedtuple or an
    ``OrderedDict`` (a registered dataclass's optree rebuild is a spec's already)."""
    return type(obj) is collections.OrderedDict or optree.is_namedtuple_instance(obj)


# -- checking the request ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Extras:
    """The options that shape what runs around the graphs: TE's precision, the hooks."""

    precision: PrecisionArgs
    replay_hooks: Any
    capture_time_hooks: Any


def _refuse_replay_kwargs_in_samples(
    cache_quantized_params: bool, names: Sequence[str], all_kwargs: Sequence[Any]
) -> None:
    if not cache_quantized_params:
        return
    for name, kwargs in zip(names, all_kwargs, strict=True):
        if kwargs and FIRST_MICROBATCH in kwargs:
            raise DualgraphError(
                f"{name}: leave {FIRST_MICROBATCH} out of sample_kwargs: with "
                "cache_quantized_params=True each call passes it, and the replay takes it (a "
                "capture casts the weights under a flag that each replay sets from it)"
            )


def _check_choice(option: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise DualgraphError(f"{option} must be one of {choices}, got {value!r}")


def _check_pool(pool: Any) -> None:
    """``pool=`` is ``None`` or what ``torch.cuda.graph_pool_handle()`` returns (two ints)."""
    if pool is None:
        return
    if not (isinstance(pool, tuple) and len(pool) == 2 and all(type(part) is int for part in pool)):
        raise DualgraphError(
            "pool must be None or a handle from torch.cuda.graph_pool_handle() (a tuple of two "
            f"ints), got {type(pool).__name__} {pool!r}"
        )


def _samples_per_callable(
    callables: Any, sample_args: Any, sample_kwargs: Any, single: bool
) -> tuple[list[Any], list[tuple[Any, ...]], list[Mapping[str, Any] | None]]:
    """``(callables, args, kwargs)`` as one list entry per callable, each checked."""
    if single:
        fns = [callables]
        args_list = [sample_args]
        kwargs_list = [sample_kwargs]
    else:
        fns = list(callables)
        count = len(fns)
        if not count:
            raise DualgraphError("callables is empty: pass at least one callable")
        if not isinstance(sample_args, tuple | list) or len(sample_args) != count:
            raise DualgraphError(
                f"sample_args must be a tuple with one tuple of args per callable ({count}), "
                f"got {_count_of(sample_args)}"
            )
        if sample_kwargs is None:
            sample_kwargs = (None,) * count
        if not isinstance(sample_kwargs, tuple | list) or len(sample_kwargs) != count:
            raise DualgraphError(
                f"sample_kwargs must be a tuple with one dict (or None) per callable ({count}), "
                f"got {_count_of(sample_kwargs)}"
            )
        args_list, kwargs_list = list(sample_args), list(sample_kwargs)
    checked_args = []
    for fn, args, kwargs in zip(fns, args_list, kwargs_list, strict=True):
        if not callable(fn):
            raise DualgraphError(f"{fn!r} is not callable")
        name = _name_of(fn)
        if not isinstance(args, tuple | list):
            raise DualgraphError(
                f"{name}: sample args must be a tuple (or list) of positional args, got "
                f"{type(args).__name__}"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise DualgraphError(
                f"{name}: sample kwargs must be a dict, got {type(kwargs).__name__}"
            )
        if isinstance(fn, torch.nn.Module) and is_graphed(fn):
            raise DualgraphError(f"{name} is already graphed; call dualgraph.torch.restore first")
        module = the_module_of_its_forward(fn)
        if module is not fn and is_graphed(module):  # its graphed forward: graphs do not nest
            raise DualgraphError(
                f"{type(module).__name__}.forward is the forward of a graphed module; graph the "
                "module itself, after dualgraph.torch.restore"
            )
        checked_args.append(tuple(args))
    if len({id(fn) for fn in fns}) != len(fns):
        raise DualgraphError("the same callable appears twice; each is captured once")
    return fns, checked_args, kwargs_list


def _count_of(samples: Any) -> str:
    if isinstance(samples, tuple | list):
        return str(len(samples))
    return f"a {type(samples).__name__}"


def _resolve_backend(
    backend: str, sample_args: Sequence[Any], sample_kwargs: Sequence[Any]
) -> Literal["cuda", "emulate", "eager"]:
    samples: Any = (tuple(sample_args), tuple(sample_kwargs))
    leaves: list[Any] = optree.tree_leaves(samples, none_is_leaf=True, namespace=NAMESPACE)
    on_cuda = any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in leaves)
    if backend == "auto":
        return "cuda" if on_cuda else "emulate"
    if backend == "cuda" and not torch.cuda.is_available():
        raise DualgraphError(
            "backend='cuda' needs a CUDA device; use 'emulate' or 'eager' on a CPU"
        )
    if backend == "cuda" and not on_cuda:
        raise DualgraphError("backend='cuda' needs sample tensors on a CUDA device")
    return backend  # type: ignore[return-value]


@contextlib.contextmanager
def _graphing(te: Sequence[TECallable] | None) -> Iterator[None]:
    """Around a graphing: the process as it was if it fails (RNG, modes, settings, the memory
    it took), outside inference mode, TE's capture state for ``te``; every run of the callable
    (warmups, lint, memory plan, the padding check) keeps its activations from the caller's
    saved-tensor hooks, as a replay does."""
    with (
        kept_process_state(on_failure_only=True),
        released_on_failure(),
        outside_inference_mode(),
        capturing(te),
        keeping_activations(),
    ):
        yield


def _refuse_inputs_off_the_graphs_device(
    labels: Sequence[str], sample_args: Sequence[Any], sample_kwargs: Sequence[Any]
) -> None:
    """Refuse a sample tensor that is not on the device the graphs are captured on (a CPU
    tensor, say a 0-d scale, next to CUDA ones). A graph holds the device's kernels only: what
    the callable does with a CPU tensor (a CPU scalar a CUDA kernel takes as its argument,
    ``.tolist()``, lengths for ``pack_padded_sequence``) runs once, at capture, and every replay
    would use the capture's values whatever the call passes; emulate runs on the CPU and cannot
    show it. ``labels``: one per sample call (``""`` for the only one), put before the path."""
    samples: Any = (tuple(map(tuple, sample_args)), [dict(k or {}) for k in sample_kwargs])
    leaves: list[Any] = optree.tree_leaves(samples, none_is_leaf=True, namespace=NAMESPACE)
    device = next(
        (leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_cuda), None
    )
    if device is None:  # not "cuda" then
        return
    for label, args, kwargs in zip(labels, sample_args, sample_kwargs, strict=True):
        found = input_off_device(tuple(args), kwargs, device)
        if found is not None:
            path, other = found
            where = f"{label}: {path}" if label else path
            raise SpecMismatchError(
                f"{where}: a tensor on {other}, where the graphs run on {device}: a graph replays "
                f"the {device.type} kernels it captured, so what the callable does with this "
                "tensor ran once, at capture, and every replay would keep that call's values "
                f"(a scalar read on the host, a copy to {device.type}); pass it on {device} (or "
                "as a Python number, which a call must then repeat)",
                path=path,
            )


def _check_autocast() -> None:
    enabled = torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    if enabled and torch.is_autocast_cache_enabled():
        raise CaptureError(
            "capturing under torch.autocast needs cache_enabled=False: the autocast weight cache "
            "would hold casts made during capture, and replays would read stale weights. Use "
            "torch.autocast(..., cache_enabled=False)"
        )


def _forward_of(fn: Any) -> Callable[..., Any]:
    # A module's own forward, so that its hooks run once, around the replay, and not in the graph.
    return eager_forward(fn) if isinstance(fn, torch.nn.Module) else fn


def _name_of(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__
