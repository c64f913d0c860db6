"""Shape buckets: one graphed callable that serves several input shapes from one memory pool.

:func:`capture_buckets` captures one plan (a forward and a backward graph) per sample call, in one
pool, and :class:`BucketedCallable` dispatches each call on its input shapes (a dict lookup) to the
matching plan's :class:`GraphedCallable`. A call whose shapes match no bucket follows ``fallback``:
``"error"`` (a :class:`SpecMismatchError` naming the path and the buckets), ``"eager"`` (the
callable runs eagerly) or ``"pad"`` (its ``dynamic_dims`` are padded with zeros to the smallest
bucket that holds them, the callable gets ``valid_length=``, and the outputs are cut back).

Why one pool sized by the largest bucket is correct (the buckets share all of it):

- Each bucket is captured with ``results_outside_pool``: its static inputs, outputs, grad
  buffers and grad-of-output buffers are allocated outside the pool (the graphs copy outputs and
  grads into them), and the parameter grad buffers and accumulators (the ``.grad`` that
  ``"in_graph"`` and ``"auto"`` add into) are one set shared by all buckets. So a bucket's
  replay reads from the pool only what the same replay, or for a backward the forward it pairs
  with, wrote there.
- Buckets are captured one after the other, forward then backward, largest input first; after a
  bucket's capture nothing of it is alive in the pool, so the next bucket's capture reuses the
  same memory: the pool grows to the largest bucket's need, not the sum.
- Buckets replay one at a time: they share one lock (a second thread is refused), and a replay
  of another bucket expires the pending backward of the last one (its activations may have been
  overwritten), which then raises instead of reading them.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import operator
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .._call import CallSpec
from .._errors import DualgraphError, SpecMismatchError
from .._spec import TreeSpec, describe
from ._capture import CaptureOptions, CaptureRequest, capture
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._hooks import NO_HOOKS, CallableHooks
from ._inputs import InputGuard
from ._leaves import dtype_name
from ._lint import LintReport
from ._memory_plan import MemoryPlan
from ._params import grad_buffer_like, is_tensor_subclass
from ._replay import GraphedCallable
from ._replay_hooks import call_eagerly

__all__ = [
    "VALID_LENGTH",
    "BucketDiagnostics",
    "BucketedCallable",
    "BucketedDiagnostics",
    "EagerGraphs",
    "Fallback",
    "capture_buckets",
]

#: The logger that says, at DEBUG, which bucket served each call and why a call fell back.
logger = logging.getLogger("dualgraph.torch.buckets")

Fallback = Literal["error", "eager", "pad"]

#: The keyword argument through which ``fallback="pad"`` tells the callable how many positions
#: along the dynamic dims are real (a 0-d int64 tensor); the rest are zero padding.
VALID_LENGTH = "valid_length"

_shape = operator.attrgetter("shape")
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided

#: Modules whose statistics run across positions, so that padding would change them.
_POSITION_STATISTICS: tuple[type, ...] = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.GroupNorm,
)


@dataclass
class BucketDiagnostics:
    """One bucket of a bucketed callable: its input shapes, how it was used, its bytes.

    ``shapes`` maps each input tensor's path to its shape; ``length`` is its length along the
    dynamic dims (``fallback="pad"`` only). ``calls`` counts the calls it served, ``padded_calls``
    those of them that were padded up to it; ``last_used`` is the ``time.time()`` of the latest.
    ``pool_growth_bytes`` is how much its capture grew the shared pool (0 when an earlier,
    larger bucket's memory sufficed). ``lint`` and ``memory_plan`` are those of its capture (see
    :class:`CaptureDiagnostics`).

    >>> BucketDiagnostics(index=0, shapes={"args[0]": (2, 8)}).calls
    0
    """

    index: int
    shapes: dict[str, tuple[int, ...]]
    length: int | None = None
    calls: int = 0
    padded_calls: int = 0
    last_used: float | None = None
    static_input_bytes: int = 0
    static_output_bytes: int = 0
    static_grad_bytes: int = 0
    pool_growth_bytes: int = 0
    capture_seconds: float = 0.0
    # issue 19 hook: the capture lint's report and the memory plan of this bucket's capture
    lint: LintReport | None = None
    memory_plan: MemoryPlan | None = None


@dataclass
class BucketedDiagnostics(CaptureDiagnostics):
    """:class:`CaptureDiagnostics` of a bucketed callable, with one entry per bucket.

    ``pool_bytes`` is the shared pool's size after every bucket was captured, and
    ``largest_bucket_pool_bytes`` its size after the first capture, that of the largest bucket
    into the empty pool (what that bucket alone needs): their ratio shows what the smaller
    buckets added. Byte counts of static buffers count a buffer shared by buckets once.
    ``replays`` counts the calls that replayed a bucket, ``eager_calls`` those that ran eagerly
    (``fallback="eager"``), ``padded_calls`` those padded up to a bucket (``fallback="pad"``).
    ``lint`` merges the buckets' lint reports and ``memory_plan`` is the largest bucket's (the
    pool is sized by it); each bucket's are in ``buckets``.

    >>> BucketedDiagnostics(name="ViTBlock", backend="emulate").buckets
    ()
    """

    fallback: str = "error"
    buckets: tuple[BucketDiagnostics, ...] = ()
    largest_bucket_pool_bytes: int = 0
    eager_calls: int = 0
    padded_calls: int = 0


class _Bucket:
    """One bucket: the callable that replays it, its shapes, and what padding needs of it."""

    __slots__ = ("cut", "diagnostics", "full_length", "index", "length", "runner", "shapes")

    def __init__(
        self,
        index: int,
        shapes: tuple[torch.Size, ...],
        runner: GraphedCallable | EagerCallable,
        diagnostics: BucketDiagnostics,
        length: int | None,
        full_length: torch.Tensor | None,
    ) -> None:
        self.index = index
        self.shapes = shapes
        self.runner = runner
        self.diagnostics = diagnostics
        self.length = length
        self.full_length = full_length  # valid_length of a call of exactly this bucket's length
        self.cut: tuple[tuple[int, int], ...] | None = None  # (output array, dim), found lazily


@dataclass(frozen=True)
class _Padding:
    """``fallback="pad"``: which input dims share the dynamic length, which output dims follow.

    ``inputs`` and ``outputs`` hold ``(array index, dim)``; output indices are resolved against
    each bucket's output spec, from ``output_paths``.
    """

    inputs: tuple[tuple[int, int], ...]
    input_paths: tuple[str, ...]
    output_paths: tuple[tuple[str, int], ...]  # (path after "output", dim as declared)

    def length_of(self, shapes: Sequence[Sequence[int]]) -> int:
        """A call's length along the dynamic dims; raises where two dynamic dims disagree."""
        (first, first_dim), *rest = self.inputs
        length = shapes[first][first_dim]
        for (index, dim), path in zip(rest, self.input_paths[1:], strict=True):
            other = shapes[index][dim]
            if other != length:
                raise SpecMismatchError(
                    f"{path}: length {other} along dim {dim}, but {self.input_paths[0]} has "
                    f"length {length} along dim {first_dim}; the dims in dynamic_dims share one "
                    "length",
                    path=path,
                )
        return int(length)

    def fixed_shapes(self, shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """The shapes with each dynamic dim replaced by -1: what a padded bucket must match."""
        fixed = [tuple(shape) for shape in shapes]
        for index, dim in self.inputs:
            shape = list(fixed[index])
            shape[dim] = -1
            fixed[index] = tuple(shape)
        return tuple(fixed)


class BucketedCallable:
    """A callable graphed for several input shapes (buckets) that share one memory pool.

    Made by :func:`dualgraph.torch.make_graphed_callables` with ``buckets=``; calling it
    replays the bucket whose input shapes the call has, or follows ``fallback`` (see the module
    docstring). The rules of a graphed callable hold for the whole of it: outputs alias the
    static buffers of the bucket that served the call (the next call of that bucket overwrites
    them), and each replay's backward runs before the next replay of *any* bucket.

    >>> import torch, dualgraph.torch as dgt
    >>> double = dgt.make_graphed_callables(
    ...     lambda x: x * 2, buckets=[(torch.ones(2),), (torch.ones(3),)], backend="emulate"
    ... )
    >>> double(torch.ones(3))
    tensor([2., 2., 2.])
    >>> [bucket.calls for bucket in dgt.diagnostics(double).buckets]
    [0, 1]
    """

    def __init__(
        self,
        *,
        name: str,
        fn: Callable[..., Any],
        guard: InputGuard,
        buckets: Sequence[_Bucket],
        fallback: Fallback,
        padding: _Padding | None,
        diagnostics: BucketedDiagnostics,
        out_spec: TreeSpec | None,
        eager_graphs: EagerGraphs | None = None,
        hooks: CallableHooks = NO_HOOKS,
    ) -> None:
        self.name = name
        self.fn = fn
        self.backend = diagnostics.backend
        self.fallback = fallback
        self._diagnostics = diagnostics
        self._guard = guard
        self._spec = guard.spec
        self._buckets = tuple(buckets)
        self._by_shapes = {bucket.shapes: bucket for bucket in buckets}
        self._padding = padding
        self._groups: dict[tuple[tuple[int, ...], ...], tuple[list[int], list[_Bucket]]] = {}
        if padding is not None:
            for bucket in sorted(buckets, key=operator.attrgetter("length")):
                lengths, members = self._groups.setdefault(
                    padding.fixed_shapes(bucket.shapes), ([], [])
                )
                lengths.append(bucket.length)  # type: ignore[arg-type]
                members.append(bucket)
        self._lengths: dict[int, torch.Tensor] = {}
        self._out_spec = out_spec
        self._graphed = diagnostics.backend != "eager"
        self._last: _Bucket | None = None
        self._eager_graphs = eager_graphs
        self._hooks = hooks  # for calls that fall back to eager

    @property
    def diagnostics(self) -> BucketedDiagnostics:
        """What :func:`dualgraph.torch.diagnostics` reports: the buckets' counts summed."""
        self._diagnostics.param_grads_through_autograd = sum(
            runner.diagnostics.param_grads_through_autograd for runner in self.runners
        )
        return self._diagnostics

    @property
    def runners(self) -> tuple[GraphedCallable | EagerCallable, ...]:
        """The callable that serves each bucket, in the order the buckets were given."""
        return tuple(bucket.runner for bucket in self._buckets)

    def __repr__(self) -> str:
        return (
            f"BucketedCallable({self.name!r}, backend={self.backend!r}, "
            f"buckets={len(self._buckets)}, fallback={self.fallback!r})"
        )

    def __copy__(self) -> Callable[..., Any]:
        return self.fn  # a copy runs eagerly: it never shares static buffers

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        return copy.deepcopy(self.fn, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return copy.copy, (self.fn,)

    # -- a call --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._padding is not None and VALID_LENGTH in kwargs:
            raise SpecMismatchError(
                f"kwargs['{VALID_LENGTH}']: {self.name} passes {VALID_LENGTH} itself under "
                "fallback='pad' (how many positions along the dynamic dims are not padding); "
                "leave it out",
                path=f"kwargs['{VALID_LENGTH}']",
            )
        tensors = self._spec.flatten(args, kwargs)
        try:
            bucket = self._by_shapes.get(tuple(map(_shape, tensors)))
        except (AttributeError, TypeError):  # a leaf that is no tensor: explained below
            bucket = None
        if bucket is None:
            return self._unmatched(args, kwargs, tensors)
        if bucket.full_length is not None:
            kwargs[VALID_LENGTH] = bucket.full_length
        return self._replay(bucket, args, kwargs, None)

    def _replay(
        self, bucket: _Bucket, args: tuple[Any, ...], kwargs: dict[str, Any], padded: int | None
    ) -> Any:
        last = self._last
        if bucket is not last:
            # This replay may overwrite the activations the last bucket's backward would read.
            if last is not None and self._graphed:
                last.runner.expire_backward()  # type: ignore[union-attr]
            self._last = bucket
        if logger.isEnabledFor(logging.DEBUG):
            how = "" if padded is None else f", padded from length {padded} to {bucket.length}"
            logger.debug(
                "%s: bucket %d (%s) served a call%s",
                self.name,
                bucket.index,
                self._show(bucket.shapes),
                how,
            )
        outputs = bucket.runner(*args, **kwargs)
        diagnostics = bucket.diagnostics
        diagnostics.calls += 1
        diagnostics.last_used = time.time()
        self._diagnostics.replays += 1
        if padded is not None:
            diagnostics.padded_calls += 1
            self._diagnostics.padded_calls += 1
        return outputs

    def _unmatched(self, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]) -> Any:
        """A call whose shapes are no bucket's: checked as a bucket call would be, then fallback."""
        self._check_tensors(tensors)
        if self._padding is not None:
            return self._padded(tensors)
        shapes = tuple(map(_shape, tensors))
        if self.fallback == "eager":
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "%s: a call of %s matches no bucket; fallback='eager': it runs eagerly",
                    self.name,
                    self._show(shapes),
                )
            replay_hooks = self._hooks.replay
            if replay_hooks is None:
                outputs = self.fn(*args, **kwargs)
            else:  # the hooks run around an eager call as around a replay
                outputs = call_eagerly(
                    replay_hooks, self.fn, args, kwargs, check=_checked, run=self._hooks.run_eager
                )
            self._check_outputs(outputs)
            if self._eager_graphs is not None and self._out_spec is not None:
                self._eager_graphs.track(self._out_spec.flatten(outputs))
            self._diagnostics.eager_calls += 1
            return outputs
        error = self._no_bucket(shapes)
        logger.debug("%s: a call was refused: %s", self.name, error)
        raise error

    def _padded(self, tensors: list[torch.Tensor]) -> Any:
        padding = self._padding
        assert padding is not None
        shapes = tuple(map(_shape, tensors))
        length = padding.length_of(shapes)
        group = self._groups.get(padding.fixed_shapes(shapes))
        path = padding.input_paths[0]
        dim = padding.inputs[0][1]
        if group is None:
            raise self._no_bucket(
                shapes,
                f"fallback='pad' pads only along dynamic_dims ({self._show_dynamic()}), and no "
                "bucket has this call's other dims",
            )
        lengths, members = group
        position = bisect.bisect_left(lengths, length)
        if position == len(lengths):
            raise SpecMismatchError(
                f"{path}: length {length} along dim {dim} is longer than any bucket of "
                f"{self.name} takes (at most {lengths[-1]}); fallback='pad' pads a call up to a "
                "bucket, never cuts it",
                path=path,
            )
        if length < 1:
            raise SpecMismatchError(
                f"{path}: length 0 along dim {dim}: fallback='pad' needs at least one position "
                "that is not padding",
                path=path,
            )
        bucket = members[position]
        extra = bucket.length - length  # type: ignore[operator]
        padded = list(tensors)
        for index, dim in padding.inputs:
            tensor = tensors[index]
            padded[index] = F.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (0, extra))
        args, kwargs = self._spec.unflatten(padded)
        kwargs[VALID_LENGTH] = self._length_tensor(length, bucket)
        outputs = self._replay(bucket, args, kwargs, length)
        return self._cut(bucket, outputs, length)

    def _length_tensor(self, length: int, bucket: _Bucket) -> torch.Tensor:
        tensor = self._lengths.get(length)
        if tensor is None:
            assert bucket.full_length is not None
            tensor = torch.full_like(bucket.full_length, length)
            self._lengths[length] = tensor
        return tensor

    def _cut(self, bucket: _Bucket, outputs: Any, length: int) -> Any:
        """The outputs with each declared output dim cut back to the call's length."""
        cut = bucket.cut
        if cut is None:
            cut = bucket.cut = _output_cuts(self._padding, bucket.runner.spec)  # type: ignore[arg-type]
        if not cut:
            return outputs
        spec = bucket.runner.spec
        flat = spec.flatten(outputs)
        for index, dim in cut:
            flat[index] = flat[index].narrow(dim, 0, length)
        return spec.unflatten(flat)

    # -- checks and messages -------------------------------------------------------------------

    def _check_tensors(self, tensors: Sequence[Any]) -> None:
        """What a bucket would check of each input tensor, but its shape."""
        error = self._guard.first_mismatch(tensors, torch.is_grad_enabled(), shapes=False)
        if error is not None:
            raise error

    def _check_outputs(self, outputs: Any) -> None:
        """An eager call returns the tree a replay would: containers, None, constants, dtypes."""
        spec = self._out_spec
        if spec is None:
            return
        try:
            flat = spec.flatten(outputs)
        except SpecMismatchError:
            raise _output_difference(spec, outputs) from None
        for leaf, tensor in zip(spec.arrays, flat, strict=True):
            if not isinstance(tensor, torch.Tensor) or dtype_name(tensor.dtype) != leaf.dtype:
                found = (
                    dtype_name(tensor.dtype)
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise SpecMismatchError(
                    f"output{leaf.path}: the eager call returned {found} where the buckets "
                    f"return {leaf.dtype}; a graphed callable returns one output structure",
                    path=f"output{leaf.path}",
                )

    def _no_bucket(self, shapes: tuple[Any, ...], why: str = "") -> SpecMismatchError:
        paths = self._guard.paths
        position = _differing_position(shapes, [bucket.shapes for bucket in self._buckets])
        path = paths[position]
        shape = list(shapes[position])
        reason = why or (
            "fallback='error'; capture a bucket of this shape, or pass fallback='eager' or "
            "fallback='pad'"
        )
        buckets = " | ".join(self._show(bucket.shapes) for bucket in self._buckets)
        return SpecMismatchError(
            f"{path}: got shape {shape}, which no bucket of {self.name} takes ({reason}); the "
            f"buckets take {buckets}",
            path=path,
        )

    def _show(self, shapes: Sequence[Sequence[int]]) -> str:
        """The shapes of the inputs whose shapes differ across buckets (all, with one bucket)."""
        paths = self._guard.paths
        varying = [
            i
            for i in range(len(paths))
            if len({tuple(bucket.shapes[i]) for bucket in self._buckets}) > 1
        ] or list(range(len(paths)))
        return ", ".join(f"{paths[i]}={list(shapes[i])}" for i in varying)

    def _show_dynamic(self) -> str:
        assert self._padding is not None
        return ", ".join(
            f"{path} dim {dim}"
            for path, (_, dim) in zip(self._padding.input_paths, self._padding.inputs, strict=True)
        )


def _output_difference(spec: TreeSpec, outputs: Any) -> SpecMismatchError:
    """How an eager call's outputs differ from the buckets' in structure (shapes aside)."""
    actual = describe(outputs, root="output")
    pairs = itertools.zip_longest(spec.leaves, actual.leaves)
    for expected, found in pairs:
        if (
            expected is None
            or found is None
            or (expected.path, expected.kind)
            != (
                found.path,
                found.kind,
            )
            or (expected.kind == "const" and repr(expected.value) != repr(found.value))
        ):
            path = "output" + (expected or found).path
            return SpecMismatchError(
                f"{path}: the eager call returned {_show_leaf(found)} where the buckets return "
                f"{_show_leaf(expected)}; a graphed callable returns one output structure",
                path=path,
            )
    return SpecMismatchError(
        f"output: the eager call returned {actual!r}, the buckets {spec!r}", path="output"
    )


def _show_leaf(leaf: Any) -> str:
    if leaf is None:
        return "nothing"
    if leaf.kind == "array":
        return f"a {leaf.dtype} tensor"
    if leaf.kind == "const":
        return repr(leaf.value)
    return "None"


def _differing_position(shapes: Sequence[Any], buckets: Sequence[Sequence[Any]]) -> int:
    """The input to name for a call no bucket takes.

    The first whose shape no bucket has there; else (each shape is some bucket's, but not all of
    them one bucket's) the first that differs from the bucket agreeing on the most inputs.
    """
    for i, shape in enumerate(shapes):
        if all(tuple(bucket[i]) != tuple(shape) for bucket in buckets):
            return i
    closest = max(buckets, key=lambda b: sum(map(operator.eq, map(tuple, b), map(tuple, shapes))))
    return next(i for i, shape in enumerate(shapes) if tuple(closest[i]) != tuple(shape))


def _output_cuts(padding: _Padding, spec: TreeSpec) -> tuple[tuple[int, int], ...]:
    """``(output array index, dim)`` for each output dim declared in ``dynamic_dims``."""
    cuts = []
    for path, dim in padding.output_paths:
        if path not in spec.array_paths:
            raise DualgraphError(
                f"dynamic_dims: output{path} is not a tensor of the outputs (they are "
                f"{', '.join('output' + p for p in spec.array_paths) or 'none'})"
            )
        index = spec.array_paths.index(path)
        ndim = len(spec.arrays[index].shape or ())
        if not -ndim <= dim < ndim:
            raise DualgraphError(
                f"dynamic_dims: output{path} has {ndim} dims, so it has no dim {dim}"
            )
        cuts.append((index, dim % ndim))
    return tuple(cuts)


class EagerGraphs:
    """Whether an autograd graph of the eager fallback is alive (``param_grads="auto"``).

    Such a graph gives the parameters grads of its own; a bucket's backward that ran in the same
    backward and added its grads into ``.grad`` itself would round differently from eager's sum
    of both, so while one is alive the buckets hand their grads to autograd (which sums them).
    A graph is tracked through a token in the metadata of its output nodes: it dies with them.

    >>> graphs = EagerGraphs()
    >>> out = torch.ones(2, requires_grad=True) * 2
    >>> graphs.track([out, None])
    >>> graphs()
    True
    >>> del out
    >>> graphs()
    False
    """

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = 0

    def __call__(self) -> bool:
        return self.alive > 0

    def track(self, outputs: Sequence[Any]) -> None:
        """Count the graph behind ``outputs`` (flat leaves) as alive until their nodes die."""
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        nodes = {id(node): node for node in map(_grad_fn, tensors) if node is not None}
        if not nodes:
            return
        token = _Token()
        weakref.finalize(token, self._release)
        self.alive += 1
        for node in nodes.values():
            node.metadata["dualgraph.eager_fallback"] = token

    def _release(self) -> None:
        self.alive -= 1


class _Token:
    """Lives as long as the autograd nodes whose metadata hold it."""


def _grad_fn(tensor: torch.Tensor) -> Any:
    return tensor.grad_fn


# -- capture -------------------------------------------------------------------------------------


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
    guards, expected = _bucket_guards(samples)
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
    padding, lengths = _padding_of(request, guard, shapes)
    if padding is not None:
        _check_padding_can_be_correct(request)
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
                names[i], request.fn, InputGuard(args, kwargs), request.hooks
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
        shared = _shared_param_grads(request.module)
        # "auto": the accumulators too (the parameters' .grad), one each for every bucket
        accumulators = (
            _shared_param_grads(request.module)
            if options.param_grads == "auto" and not _any_tensor_subclass(request.module)
            else None
        )
        before = 0
        for rank, i in enumerate(_largest_first(samples, guards)):
            args, kwargs = samples[i]
            kwargs = _with_length(kwargs, full_lengths[i])
            inputs = InputGuard(args, kwargs)
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
        if padding is not None:
            _check_padded_plans(request, padding, plans, lengths, guard, shapes)
        # "auto": while the eager fallback's graph is alive, the buckets' grads go to autograd
        if options.param_grads == "auto" and request.fallback == "eager":
            eager_graphs = EagerGraphs()
        runners = [
            GraphedCallable(plan, lock=request.shared_lock, other_uses=eager_graphs)
            for plan in plans
        ]
        for runner in runners:
            runner.recount_holders()  # every sibling that shares the accumulators exists now
        for diag, plan, growth in zip(diagnostics, plans, pool_bytes, strict=True):
            diag.static_input_bytes = plan.diagnostics.static_input_bytes
            diag.static_output_bytes = plan.diagnostics.static_output_bytes
            diag.static_grad_bytes = plan.diagnostics.static_grad_bytes
            diag.capture_seconds = plan.diagnostics.capture_seconds
            diag.pool_growth_bytes = growth
            diag.lint = plan.diagnostics.lint  # issue 19 hook
            diag.memory_plan = plan.diagnostics.memory_plan
    if padding is not None:
        _check_padding_is_masked(request, padding, guards, lengths, shapes)
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
    )


def _checked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An eager fallback's inputs were checked before the fallback was chosen."""


def _bucket_guards(
    samples: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
) -> tuple[list[InputGuard], tuple[tuple[torch.dtype, torch.device, bool], ...]]:
    """One input guard per bucket, each checked to differ from the first in shapes only; and
    the ``(dtype, device, requires_grad)`` of each input tensor."""
    guards = []
    for i, (args, kwargs) in enumerate(samples):
        try:
            guards.append(InputGuard(args, kwargs))
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
        for path, tensor, kind in zip(first.paths, tensors, expected, strict=True):
            found = (tensor.dtype, tensor.device, tensor.requires_grad)
            if found != kind:
                raise DualgraphError(
                    f"buckets[{i}]: {path} is {_kind(*found)} but {_kind(*kind)} in buckets[0]; "
                    "buckets differ only in the shapes of their tensors"
                )
    return guards, expected


def _difference_but_shapes(expected: CallSpec, found: CallSpec) -> str | None:
    """Where two calls' specs first differ in more than array shapes (None: in shapes only)."""
    for root in ("args", "kwargs"):
        left = getattr(expected, f"{root}_spec").leaves
        right = getattr(found, f"{root}_spec").leaves
        for a, b in itertools.zip_longest(left, right):
            if a is None:
                return f"{root}{b.path}: got {_show_input(b)}, expected nothing"
            if b is None or a.path != b.path:
                return f"{root}{a.path}: expected {_show_input(a)}, got nothing there"
            if a.kind != b.kind or (a.kind == "const" and repr(a.value) != repr(b.value)):
                return f"{root}{a.path}: expected {_show_input(a)}, got {_show_input(b)}"
    return None


def _show_input(leaf: Any) -> str:
    if leaf.kind == "array":
        return f"a {leaf.dtype} tensor"
    if leaf.kind == "const":
        return f"{type(leaf.value).__name__} {leaf.value!r}"
    return "None"


def _kind(dtype: torch.dtype, device: torch.device, requires_grad: bool) -> str:
    grad = ", requiring grad" if requires_grad else ""
    return f"{dtype_name(dtype)} on {device}{grad}"


def _padding_of(
    request: BucketRequest, guard: InputGuard, shapes: Sequence[tuple[torch.Size, ...]]
) -> tuple[_Padding | None, list[int | None]]:
    """The padding layout of ``fallback="pad"`` (checked), and each bucket's length."""
    dims = request.dynamic_dims
    if request.fallback != "pad":
        if dims is not None:
            raise DualgraphError("dynamic_dims= goes with fallback='pad' (the dims it pads)")
        return None, [None] * len(shapes)
    if not isinstance(dims, Mapping) or not dims:
        raise DualgraphError(
            "fallback='pad' needs dynamic_dims=: the input dims it may pad, and the output dims "
            "to cut back, by path, e.g. {'args[0]': 1, 'output[0]': 1}"
        )
    for _, kwargs in request.samples:
        if VALID_LENGTH in kwargs:
            raise DualgraphError(
                f"sample kwargs hold '{VALID_LENGTH}', which fallback='pad' passes itself"
            )
    inputs: list[tuple[int, int]] = []
    input_paths: list[str] = []
    outputs: list[tuple[str, int]] = []
    for path, dim in dims.items():
        if not isinstance(path, str) or type(dim) is not int:
            raise DualgraphError(
                f"dynamic_dims maps a path (str) to a dim (int), got {path!r}: {dim!r}"
            )
        if path.startswith("output"):
            outputs.append((path[len("output") :], dim))
            continue
        if path not in guard.paths:
            raise DualgraphError(
                f"dynamic_dims: {path} is not an input tensor (they are "
                f"{', '.join(guard.paths)}; outputs are named output...)"
            )
        index = guard.paths.index(path)
        ndims = {len(key[index]) for key in shapes}
        ndim = ndims.pop()
        if ndims:
            raise DualgraphError(f"dynamic_dims: {path} has a different number of dims per bucket")
        if not -ndim <= dim < ndim:
            raise DualgraphError(f"dynamic_dims: {path} has {ndim} dims, so it has no dim {dim}")
        inputs.append((index, dim % ndim))
        input_paths.append(path)
    if not inputs:
        raise DualgraphError("dynamic_dims names no input dim for fallback='pad' to pad")
    padding = _Padding(tuple(inputs), tuple(input_paths), tuple(outputs))
    lengths: list[int | None] = []
    for i, key in enumerate(shapes):
        try:
            length = padding.length_of(key)
        except SpecMismatchError as error:
            raise DualgraphError(f"buckets[{i}]: {error}") from None
        if length < 1:
            raise DualgraphError(f"buckets[{i}]: length 0 along the dynamic dims")
        lengths.append(length)
    return padding, lengths


def _check_padding_can_be_correct(request: BucketRequest) -> None:
    """Refuse ``fallback="pad"`` where padding would change results the callable cannot fix."""
    if not _accepts_valid_length(request.fn):
        raise DualgraphError(
            f"fallback='pad': {request.name} takes no '{VALID_LENGTH}' argument, so it could not "
            "tell padding from data (attention would attend to it, means would count it); give "
            f"it a '{VALID_LENGTH}=None' keyword argument and mask with it"
        )
    if request.module is not None:
        for path, module in request.module.named_modules():
            if isinstance(module, _POSITION_STATISTICS):
                where = f"{request.name}.{path}" if path else request.name
                raise DualgraphError(
                    f"fallback='pad': {where} is a {type(module).__name__}, whose statistics "
                    "run over positions, so padded positions would change them; use "
                    "fallback='eager' or 'error', or buckets without padding"
                )


def _check_padded_plans(
    request: BucketRequest,
    padding: _Padding,
    plans: Sequence[Any],
    lengths: Sequence[int | None],
    guard: InputGuard,
    shapes: Sequence[tuple[torch.Size, ...]],
) -> None:
    """Refuse what pad cannot cut back or copy back, now that the outputs are known."""
    padded = {index for index, _ in padding.inputs}
    cuts_per_bucket = []
    for i, (plan, length) in enumerate(zip(plans, lengths, strict=True)):
        for index in plan.mutated_inputs:
            if index in padded:
                raise DualgraphError(
                    f"fallback='pad': {request.name} updates {guard.paths[index]} in place, but a "
                    "padded call passes it a padded copy, so the caller's tensor would not see "
                    "the update"
                )
        cuts = _output_cuts(padding, plan.outputs)
        for index, dim in cuts:
            size = plan.outputs.arrays[index].shape[dim]
            if size != length:
                path = plan.outputs.array_paths[index]
                raise DualgraphError(
                    f"dynamic_dims: output{path} dim {dim} has size {size} in buckets[{i}], "
                    f"whose length is {length}; only dims of the bucket's length can be cut back"
                )
        cuts_per_bucket.append(set(cuts))
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(shapes):
        groups.setdefault(padding.fixed_shapes(key), []).append(i)
    for members in groups.values():
        first = plans[members[0]].outputs
        for index, leaf in enumerate(first.arrays):
            for dim in range(len(leaf.shape or ())):
                sizes = {plans[i].outputs.arrays[index].shape[dim] for i in members}
                if len(sizes) > 1 and (index, dim) not in cuts_per_bucket[members[0]]:
                    declared = dict(padding.output_paths).get(leaf.path)
                    fix = (
                        f"add 'output{leaf.path}': {dim}"
                        if declared is None
                        else f"dynamic_dims cuts one dim per output (dim {declared} there), so "
                        "use fallback='eager' or 'error' for a callable that returns it"
                    )
                    raise DualgraphError(
                        f"fallback='pad': output{leaf.path} dim {dim} changes with the length "
                        f"({', '.join(map(str, sorted(sizes)))} across buckets) but is not in "
                        f"dynamic_dims, so a padded call could not be cut back; {fix}"
                    )


def _check_padding_is_masked(
    request: BucketRequest,
    padding: _Padding,
    guards: Sequence[InputGuard],
    lengths: Sequence[int | None],
    shapes: Sequence[tuple[torch.Size, ...]],
) -> None:
    """Refuse a callable whose outputs change when a call is padded (it ignores padding).

    Per group of buckets that pad into one another, a short call (the smallest bucket's sample,
    or the only bucket's cut to half its length) runs eagerly as it is and padded to the group's
    largest length with ``valid_length``; the outputs, cut back, must agree up to rounding. A
    module runs in eval mode (dropout off); a callable that still draws random numbers (its
    reference differs under two seeds) cannot be judged and is let through.
    """
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(shapes):
        groups.setdefault(padding.fixed_shapes(key), []).append(i)
    for members in groups.values():
        ordered = sorted(members, key=lambda i: lengths[i])  # type: ignore[arg-type, return-value]
        short, long = ordered[0], ordered[-1]
        full: int = lengths[long]  # type: ignore[assignment]
        length: int = lengths[short] if short != long else full // 2  # type: ignore[assignment]
        if length < 1:
            continue  # a single bucket of length 1: no call can be padded into it
        tensors = [t.detach().clone() for t in guards[short].tensors(*request.samples[short])]
        for index, dim in padding.inputs:
            tensors[index] = tensors[index].narrow(dim, 0, length)
        _compare_padded(request, padding, guards[short], tensors, length, full)


def _compare_padded(
    request: BucketRequest,
    padding: _Padding,
    guard: InputGuard,
    tensors: list[torch.Tensor],
    length: int,
    full: int,
) -> None:
    padded = list(tensors)
    for index, dim in padding.inputs:
        tensor = tensors[index]
        padded[index] = F.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (0, full - length))
    device = tensors[padding.inputs[0][0]].device
    valid = torch.full((), length, dtype=torch.int64, device=device)
    module = request.module
    modes = [(m, m.training) for m in module.modules()] if module is not None else []
    buffers = [(b, b.detach().clone()) for b in module.buffers()] if module is not None else []
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})

    def run(inputs: list[torch.Tensor], seed: int) -> Any:
        args, kwargs = guard.unflatten([t.clone() for t in inputs])
        torch.manual_seed(seed)
        return request.hooks.call(request.fn, args, {**kwargs, VALID_LENGTH: valid})

    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            if module is not None:
                module.eval()
            reference = run(tensors, 0)
            if _difference(reference, run(tensors, 1), ()) is not None:
                return  # it draws random numbers: the two calls cannot be compared
            found = run(padded, 0)
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    spec = describe(found)
    difference = _difference(reference, found, _output_cuts(padding, spec), length)
    if difference is not None:
        raise DualgraphError(
            f"fallback='pad': {request.name}: {difference} when a call of length {length} is "
            f"padded to {full} (with {VALID_LENGTH}={length}): padded positions reach what it "
            f"returns for the call's own. It must keep them out of whatever mixes positions "
            f"(mask attention, count only the first {VALID_LENGTH} positions in a mean or sum, "
            "mask a softmax over positions); or use fallback='eager' or 'error'"
        )


def _difference(
    expected: Any, found: Any, cuts: Sequence[tuple[int, int]], length: int = 0
) -> str | None:
    """How ``found`` (its ``cuts`` narrowed to ``length``) differs from ``expected``, or None."""
    spec, other = describe(expected), describe(found)
    if [(leaf.path, leaf.kind) for leaf in spec.leaves] != [
        (leaf.path, leaf.kind) for leaf in other.leaves
    ]:
        return f"output has another structure ({other!r}, not {spec!r})"
    for leaf, twin in zip(spec.leaves, other.leaves, strict=True):
        if leaf.kind == "const" and leaf.value != twin.value:
            return f"output{leaf.path} is {twin.value!r}, not {leaf.value!r},"
    arrays = other.flatten(found)
    for index, dim in cuts:
        arrays[index] = arrays[index].narrow(dim, 0, length)
    for leaf, a, b in zip(spec.arrays, spec.flatten(expected), arrays, strict=True):
        if a.shape != b.shape:
            return f"output{leaf.path} has shape {list(b.shape)} instead of {list(a.shape)}"
        if a.dtype.is_floating_point or a.dtype.is_complex:
            # 32-bit on a GPU: TF32 convolutions (torch's default) round differently per shape
            rtol = (1e-2 if a.is_cuda else 1e-3) if a.element_size() >= 4 else 3e-2
            scale = a.abs().max().item() if a.numel() else 0.0
            gap = (a - b).abs().max().item() if a.numel() else 0.0
            if not gap <= rtol * scale + 1e-6:  # also refuses NaN
                return (
                    f"output{leaf.path} differs (by up to {gap:.3g}, of values up to {scale:.3g})"
                )
        elif not torch.equal(a, b):
            return f"output{leaf.path} differs"
    return None


def _accepts_valid_length(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: warmup will tell
        return True
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == VALID_LENGTH and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in parameters
    )


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
