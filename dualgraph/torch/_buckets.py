"""Shape buckets: one graphed callable that serves several input shapes from one memory pool.

:func:`capture_buckets` (``_bucket_capture.py``) captures one plan (a forward and a backward
graph) per sample call, in one pool, and :class:`BucketedCallable` dispatches each call on its
input shapes (a dict lookup) to the matching plan's :class:`GraphedCallable`. A call whose shapes
match no bucket follows ``fallback``: ``"error"`` (a :class:`SpecMismatchError` naming the path
and the buckets), ``"eager"`` (the callable runs eagerly) or ``"pad"`` (its ``dynamic_dims`` are
padded with zeros to the smallest bucket that holds them, the callable gets ``valid_length=``,
and the outputs are cut back; ``_padding.py`` holds its rules and the checks that padding cannot
change the results).

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
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .._errors import DualgraphError, SpecMismatchError
from .._spec import TreeSpec, describe
from ._address_ranges import first_sharing, storage_spans
from ._ambient import autograd_records
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._eager_graphs import EagerGraphs
from ._hooks import NO_HOOKS, CallableHooks
from ._inputs import InputGuard
from ._leaf_difference import difference_but_shapes
from ._leaves import dtype_name
from ._lint import LintReport
from ._memory_plan import MemoryPlan
from ._nesting import SCOPE, inside_another
from ._padding import VALID_LENGTH, Padding, cut_back, output_cuts, valid_length_position
from ._params import own_changes_taken_of
from ._replay import GraphedCallable, traced_call_refused
from ._replay_function import watch_handed_out
from ._replay_hooks import call_eagerly

__all__ = [
    "VALID_LENGTH",
    "BucketDiagnostics",
    "BucketedCallable",
    "BucketedDiagnostics",
    "Fallback",
]

#: Where a call's ``valid_length`` lies among a bucket's inputs (the keyword fallback='pad' adds).
_VALID_LENGTH_PATH = f"kwargs['{VALID_LENGTH}']"

#: The logger that says, at DEBUG, which bucket served each call and why a call fell back.
logger = logging.getLogger("dualgraph.torch.buckets")

Fallback = Literal["error", "eager", "pad"]

_shape = operator.attrgetter("shape")


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
    (``fallback="eager"``, or a bucket's call that ran its callable eagerly where its Python
    branches on grad mode or an input's ``requires_grad``), ``padded_calls`` those padded up to a
    bucket (``fallback="pad"``).
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

    __slots__ = (
        "cut",
        "diagnostics",
        "flag_reads",
        "full_length",
        "hands_out_length",
        "index",
        "length",
        "runner",
        "shapes",
        "turned_on",
    )

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
        # the padded inputs (the caller's positions) whose requires_grad the callable turns on
        self.turned_on: tuple[int, ...] | None = None  # found lazily, as cut
        # the inputs whose flags the callable reads (the caller's positions, the sample's
        # requires_grad, whether grad_fn or is_leaf was read): a padded call is judged by them
        self.flag_reads: tuple[tuple[int, bool, bool], ...] | None = None  # found lazily
        # An output is valid_length (or views it): the caller gets the tensor it was told, so
        # each call gets one of its own (the one tensor per length, changed in place through
        # an output, would tell every later call another length; eager's are the caller's own).
        # Not known of an eager runner, which returns what the callable returns.
        paths = runner.returned_input_paths
        self.hands_out_length = paths is None or _VALID_LENGTH_PATH in paths


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
        padding: Padding | None,
        diagnostics: BucketedDiagnostics,
        out_spec: TreeSpec | None,
        eager_graphs: EagerGraphs | None = None,
        hooks: CallableHooks = NO_HOOKS,
        padding_check: Callable[[Sequence[torch.Tensor], int, int], None] | None = None,
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
        # where valid_length stands among the positional parameters, for a call that passes
        # it there (refused as by keyword; read only when a call's spelling is not the sample's)
        self._valid_length_at = None if padding is None else valid_length_position(fn)
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
        # fallback="pad": the capture's padding check, for a call of another length (verify)
        self._padding_check = padding_check
        self._served = 0  # calls a bucket served (replayed, or run eagerly by its runner)
        self._fallback_calls = 0  # calls run eagerly under fallback="eager"
        # What each bucket compares per call (its module's tensors and plain values, or those a
        # function's code names), once each: an eager fallback runs the forward's Python, and
        # the values it sets (a flag, a counter) are its own, as in an emulated replay.
        records = (bucket.runner.checked_tensors for bucket in buckets)
        self._records = tuple({id(r): r for r in records if r is not None}.values())

    @property
    def diagnostics(self) -> BucketedDiagnostics:
        """What :func:`dualgraph.torch.diagnostics` reports: the buckets' counts summed."""
        report = self._diagnostics
        runners = [runner.diagnostics for runner in self.runners]
        report.param_grads_through_autograd = sum(
            runner.param_grads_through_autograd for runner in runners
        )
        # A bucket's runner runs a call eagerly where its Python would branch otherwise than at
        # capture (grad mode, an input's requires_grad): served by the bucket, but no replay.
        eagerly = sum(runner.eager_calls for runner in runners)
        report.replays = self._served - eagerly
        report.eager_calls = self._fallback_calls + eagerly
        return report

    @property
    def eager_graphs(self) -> EagerGraphs | None:
        """Whether a graph of an eager call of it is alive (shared by its buckets, ``"auto"``)."""
        runner = self._buckets[0].runner
        return runner.eager_graphs if isinstance(runner, GraphedCallable) else None

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
        if self._graphed and SCOPE.outer is not None:  # inside another graph (_nesting.py)
            return inside_another(self.name, self.fn, args, kwargs)
        if self._padding is not None and kwargs.get(VALID_LENGTH) is not None:
            # its default, None, passed explicitly is taken as eager takes it (as by position)
            raise self._passes_valid_length(f"kwargs['{VALID_LENGTH}']")
        tensors, args, kwargs = self._flattened(args, kwargs)
        try:
            bucket = self._by_shapes.get(tuple(map(_shape, tensors)))
        except (AttributeError, TypeError, RuntimeError):  # no tensor, or one without a shape
            bucket = None  # (a nested tensor): explained below
        if bucket is None:
            return self._unmatched(args, kwargs, tensors)
        told = bucket.full_length
        if told is not None:
            kwargs[VALID_LENGTH] = told.clone() if bucket.hands_out_length else told
        return self._replay(bucket, args, kwargs, None)

    def _flattened(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], tuple[Any, ...], dict[str, Any]]:
        """The call's tensors, args and kwargs, written as the samples were where the call
        spells its arguments otherwise (a keyword by position, a default passed or left out:
        :meth:`InputGuard.flattened_as_captured`)."""
        try:
            return self._spec.flatten(args, kwargs), args, kwargs
        except SpecMismatchError as error:
            at = self._valid_length_at
            if at is not None and len(args) > at and args[at] is not None:
                # the spelling check would blame the sample for leaving it to its default
                raise self._passes_valid_length(f"args[{at}]") from None
            return self._guard.flattened_as_captured(args, kwargs, error)

    def _passes_valid_length(self, path: str) -> SpecMismatchError:
        return SpecMismatchError(
            f"{path}: {self.name} passes {VALID_LENGTH} itself under fallback='pad' (how many "
            "positions along the dynamic dims are not padding); leave it out",
            path=path,
        )

    def _replay(
        self, bucket: _Bucket, args: tuple[Any, ...], kwargs: dict[str, Any], padded: int | None
    ) -> Any:
        last = self._last
        runner = bucket.runner
        if bucket is last or last is None or not self._graphed:
            outputs = runner(*args, **kwargs)
            self._last = bucket
        else:
            generation = runner.generation  # type: ignore[union-attr]
            try:
                outputs = runner(*args, **kwargs)
            finally:
                # Only a call the bucket accepted replays (and bumps its generation): that replay
                # may have overwritten the activations the last bucket's backward would read. A
                # call it refused (dtype, autocast, ...) leaves that backward valid.
                if runner.generation != generation:  # type: ignore[union-attr]
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
        diagnostics = bucket.diagnostics
        diagnostics.calls += 1
        diagnostics.last_used = time.time()
        self._served += 1
        if padded is not None:
            diagnostics.padded_calls += 1
            self._diagnostics.padded_calls += 1
        return outputs

    def _unmatched(self, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]) -> Any:
        """A call whose shapes are no bucket's: checked as a bucket call would be, then fallback."""
        if self.fallback != "eager" and torch._C._get_tracing_state() is not None:
            # the trace hands out sizes of its own, which match no bucket
            raise traced_call_refused(self.name)
        self._check_tensors(tensors)
        if self._padding is not None:
            # The padded call is rebuilt from the capture's spec, which puts every dict's keys
            # (and the keywords) in the captured order: the callable would see another order
            # than eager's.
            self._guard.check_key_orders(args, kwargs)
            return self._padded(tensors)
        shapes = tuple(map(_shape, tensors))
        if self.fallback == "eager":
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "%s: a call of %s matches no bucket; fallback='eager': it runs eagerly",
                    self.name,
                    self._show(shapes),
                )
            return self._call_eagerly(args, kwargs)
        error = self._no_bucket(shapes)
        logger.debug("%s: a call was refused: %s", self.name, error)
        raise error

    def _call_eagerly(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, branched: bool = False
    ) -> Any:
        """The callable run eagerly on the call's own tensors (``fallback="eager"``; or a padded
        call whose caller's tensors take another branch than the capture's, ``branched``, whose
        outputs are eager's, of whatever structure that branch returns)."""
        replay_hooks = self._hooks.replay
        with own_changes_taken_of(self._records):
            if replay_hooks is None:
                outputs = self.fn(*args, **kwargs)
            else:  # the hooks run around an eager call as around a replay
                outputs = call_eagerly(
                    replay_hooks,
                    self.fn,
                    args,
                    kwargs,
                    check=_checked,
                    run=self._hooks.run_eager,
                )
        if not branched:
            self._check_outputs(outputs)
        if self._eager_graphs is not None and self._out_spec is not None:
            try:
                flat = self._out_spec.flatten(outputs)
            except DualgraphError:  # another branch's structure
                flat = describe(outputs).flatten(outputs)
            self._eager_graphs.track(flat)
        self._fallback_calls += 1
        return outputs

    def _padded(self, tensors: list[torch.Tensor], run: Callable[..., Any] | None = None) -> Any:
        """The call padded to the smallest bucket that holds it, replayed there (or handed to
        ``run(*args, **kwargs)``: :meth:`eager_call`), its outputs cut back."""
        padding = self._padding
        assert padding is not None
        shapes = tuple(map(_shape, tensors))
        length = padding.length_of(shapes)
        group = self._groups.get(padding.fixed_shapes(shapes))
        path = padding.input_paths[0]
        dim = padding.inputs[0][1]
        if group is None:
            # named by the first input whose other dims no bucket has (a padded input's
            # length is any, up to the largest bucket's)
            position = _differing_position(
                padding.fixed_shapes(shapes),
                [padding.fixed_shapes(bucket.shapes) for bucket in self._buckets],
            )
            raise self._no_bucket(
                shapes,
                f"fallback='pad' pads only along dynamic_dims ({self._show_dynamic()}), and no "
                "bucket has this call's other dims",
                position,
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
        runner = bucket.runner
        if run is None and isinstance(runner, GraphedCallable):
            # The replay is handed padded copies: a caller's tensor sharing memory with a buffer
            # the callable updates is checked here, where eager would read it after the update.
            runner.check_inputs_sharing_updated_buffers(tensors, self._guard.paths)
            # and a caller's tensor handed out for a padded input the callable returns
            runner.check_returned_inputs(tensors, self._guard.paths)
            _refuse_updates_seen_through_padded(runner, tensors, self._guard.paths, padding)
            if any(tensors[index].is_inference() for index, _ in padding.inputs):
                _refuse_inference_padded(runner, tensors, self._guard.paths, bucket.full_length)
        turned_on = bucket.turned_on
        if turned_on is None:
            turned_on = bucket.turned_on = _turned_on_padded(runner, self._guard.paths, padding)
        turned = []
        for index in turned_on:
            # as eager's call turns the caller's tensor's on: the padded copy then carries its
            # history (a copy that does not is another leaf, which the callable's eager run
            # would turn on instead, and which no grad of the caller's tensor comes through)
            if not tensors[index].requires_grad:
                tensors[index].requires_grad_()
                turned.append(index)
        judged = False
        if run is None and isinstance(runner, GraphedCallable):
            reads = bucket.flag_reads
            if reads is None:
                reads = bucket.flag_reads = _flag_reads(runner, self._guard.paths)
            if reads:
                # The padded copies are no leaves where the caller's tensors require grad, and
                # require no grad under no_grad: the callable's Python, which reads them, would
                # see other flags than eager's call. Judged by the caller's tensors: a call
                # whose branch may differ from the capture's runs eagerly on them, unpadded,
                # as eager runs it; else the replay does not judge the copies again.
                if _branches_otherwise(tensors, reads, runner.reads_grad_mode):
                    logger.debug(
                        "%s: a call of length %d reads input flags other than the samples'; "
                        "it runs eagerly, unpadded",
                        self.name,
                        length,
                    )
                    args, kwargs = self._spec.unflatten(tensors)
                    return self._call_eagerly(args, kwargs, branched=True)
                judged = True
        extra = bucket.length - length  # type: ignore[operator]
        padded = list(tensors)
        # One tensor passed at several padded inputs (q and k of self-attention) is padded
        # once: the callable gets one tensor there, as eager's does (its Python may tell them
        # apart by identity, and the runner then runs it eagerly, as for any such call).
        made: dict[tuple[int, int], torch.Tensor] = {}
        for index, dim in padding.inputs:
            tensor = tensors[index]
            padded_copy = made.get((id(tensor), dim))
            if padded_copy is None:
                padded_copy = F.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (0, extra))
                made[id(tensor), dim] = padded_copy
                if tensor.__dict__:  # what the caller hung on it (x.scale), the callable reads
                    padded_copy.__dict__.update(tensor.__dict__)
            padded[index] = padded_copy
        args, kwargs = self._spec.unflatten(padded)
        kwargs[VALID_LENGTH] = self._length_tensor(length, bucket)
        replayed = False
        if run is None and isinstance(runner, GraphedCallable):
            generation = runner.generation
            try:
                if judged:
                    with runner.judged_flags():
                        outputs = self._replay(bucket, args, kwargs, length)
                else:
                    outputs = self._replay(bucket, args, kwargs, length)
            except DualgraphError:
                if runner.generation == generation:  # refused: the call changes nothing
                    for index in turned:
                        tensors[index].requires_grad_(False)
                raise
            # What follows notes this call's tensors on the replay just run; a call the runner
            # ran eagerly (its Python reads grad mode or requires_grad) left the latest replay
            # as it was, and its backward is eager's own.
            replayed = runner.generation != generation
            if replayed and runner.plan.saved_inputs:
                _note_padded_inputs(runner, tensors, self._guard.paths, padding)
        elif run is None:
            outputs = self._replay(bucket, args, kwargs, length)
            replayed = True
        else:
            outputs = run(*args, **kwargs)
        for index, _ in padding.inputs:
            if padded[index].__dict__:  # what the callable set on it (x.seen), as eager's input
                tensors[index].__dict__.update(padded[index].__dict__)
        callers = {id(padded[index]): tensors[index] for index, _ in padding.inputs}
        return self._cut(bucket, outputs, length, callers, replayed=replayed)

    def _length_tensor(self, length: int, bucket: _Bucket) -> torch.Tensor:
        """``valid_length`` of a call of ``length`` padded into ``bucket``: one tensor per
        length, or a new one where the caller gets it back (an output is valid_length)."""
        tensor = self._lengths.get(length)
        if tensor is None:
            assert bucket.full_length is not None
            tensor = torch.full_like(bucket.full_length, length)
            self._lengths[length] = tensor
        return tensor.clone() if bucket.hands_out_length else tensor

    def _cut(
        self,
        bucket: _Bucket,
        outputs: Any,
        length: int,
        callers: dict[int, torch.Tensor],
        replayed: bool = True,
    ) -> Any:
        """The outputs with each declared output dim cut back to the call's length.

        As eager returns them: an output that is a padded input (a replay hands out the input
        it was given, here the padded copy) is the caller's own tensor, and an output returned
        twice is one cut, returned twice.
        """
        cut = bucket.cut
        if cut is None:
            cut = bucket.cut = output_cuts(self._padding, bucket.runner.spec)  # type: ignore[arg-type]
        spec = bucket.runner.spec
        try:
            flat = spec.flatten(outputs)
        except DualgraphError:
            if replayed and isinstance(bucket.runner, GraphedCallable):
                raise
            # a call run eagerly (its Python branches on grad mode or requires_grad; any call
            # of the "eager" backend) returns eager's outputs, of whatever structure (which the
            # runner checked): cut those where the declared paths lie
            spec = describe(outputs)
            cut = output_cuts(self._padding, spec)  # type: ignore[arg-type]
            flat = spec.flatten(outputs)
        made: dict[int, torch.Tensor] = dict(callers)
        handed_out = tuple(flat)
        replaced: dict[int, torch.Tensor] = {}
        copies = []
        for index, dim in cut:
            tensor = flat[index]
            same = made.get(id(tensor))
            if same is None:
                same = made[id(tensor)] = replaced[id(tensor)] = cut_back(tensor, dim, length)
                if tensor.__dict__:  # what the callable set on it (y.tag), as eager's output has
                    same.__dict__.update(tensor.__dict__)
                if same.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
                    copies.append((index, same))  # cut_back copied it: another tensor's memory
            flat[index] = same
        if replayed:
            # a grad watched at a cut output other outputs are computed from is refused, as at
            # the replay's own output
            watch_handed_out(replaced, handed_out)
            if isinstance(bucket.runner, GraphedCallable):
                # and so is a copy changed in place whose output the backward reads
                bucket.runner.note_cut_copies(copies)
        for index, tensor in enumerate(flat):  # a padded input returned but not cut back
            if id(tensor) in callers:
                flat[index] = callers[id(tensor)]
        return spec.unflatten(flat)

    def eager_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` called as the buckets are (:func:`dualgraph.torch.verify`'s eager side).

        Under ``fallback="pad"`` a call of a bucket's length gets ``valid_length=`` and a shorter
        one is padded up to a bucket, run, and cut back, as a replay is: so the eager side runs
        the kernels the replay runs (bit for bit on the CPU), where eager on the call as it is
        agrees only up to rounding (the capture's padding check compared those). Else ``fn``.
        """
        if self._padding is None:
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            tensors, args, kwargs = self._flattened(args, kwargs)
            bucket = self._by_shapes.get(tuple(map(_shape, tensors)))
            if bucket is not None:
                return fn(*args, **{**kwargs, VALID_LENGTH: bucket.full_length})
            return self._padded(tensors, fn)

        return call

    def padding_difference(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why this call, padded up to its bucket (or told its length), would not give what
        eager gives for it as it is: the capture's padding check at the call's own length
        (:func:`dualgraph.torch.verify` asks, since the capture checks a few lengths only).
        None where it would, or where nothing pads the call (no ``fallback="pad"``, or no
        bucket holds it: the call itself says why).

        >>> import torch, dualgraph.torch as dgt
        >>> def f(x, valid_length=None):
        ...     return x * 2
        >>> g = dgt.make_graphed_callables(f, buckets=[(torch.ones(4),)], fallback="pad",
        ...     dynamic_dims={"args[0]": 0, "output": 0}, backend="emulate")
        >>> g.padding_difference((torch.ones(3),), {}) is None
        True
        """
        check = self._padding_check
        if check is None or self._padding is None:
            return None
        try:
            tensors = self._flattened(args, kwargs)[0]
            shapes = tuple(map(_shape, tensors))
            length = self._padding.length_of(shapes)
        except (SpecMismatchError, AttributeError, TypeError):  # the call itself refuses them
            return None
        group = self._groups.get(self._padding.fixed_shapes(shapes))
        if group is None or not 1 <= length <= group[0][-1]:
            return None
        lengths, members = group
        bucket = members[bisect.bisect_left(lengths, length)]
        try:
            check(tensors, length, bucket.length)  # type: ignore[arg-type]
        except DualgraphError as error:
            return str(error)
        return None

    # -- checks and messages -------------------------------------------------------------------

    def _check_tensors(self, tensors: Sequence[Any]) -> None:
        """What a bucket would check of each input tensor, but its shape."""
        error = self._guard.first_mismatch(tensors, autograd_records(), shapes=False)
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

    def _no_bucket(
        self, shapes: tuple[Any, ...], why: str = "", position: int | None = None
    ) -> SpecMismatchError:
        """The refusal of a call of ``shapes`` that no bucket takes, naming the input at
        ``position`` (by default, the one :func:`_differing_position` finds)."""
        paths = self._guard.paths
        if position is None:
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
    difference = difference_but_shapes(spec, actual)
    if difference is not None:
        where, expected, found = difference
        path = "output" + where
        return SpecMismatchError(
            f"{path}: the eager call returned {found} where the buckets return {expected}; "
            "a graphed callable returns one output structure",
            path=path,
        )
    return SpecMismatchError(
        f"output: the eager call returned {actual!r}, the buckets {spec!r}", path="output"
    )


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


def _refuse_updates_seen_through_padded(
    runner: GraphedCallable, tensors: Sequence[torch.Tensor], paths: Sequence[str], padding: Padding
) -> None:
    """Refuse a padded call where an input the callable updates in place shares memory with a
    padded input (``g(x, x[0])`` updating ``args[1]``): eager reads the update through the
    caller's ``x``, the replay a padded copy made before it (the replay's own check sees that
    copy, which shares nothing). ``tensors`` and ``paths`` are the caller's, in the guard's order.
    """
    mutated = runner.plan.mutated_inputs
    if not mutated:
        return
    index_of = {path: i for i, path in enumerate(paths)}
    runner_paths = runner.plan.inputs.paths
    spans = None  # every input's storage span, read once (the first updated non-empty one)
    for position in mutated:
        path = runner_paths[position]
        i = index_of.get(path)  # None: valid_length, refused at capture
        if i is None or not tensors[i].numel():
            continue
        if spans is None:
            spans = storage_spans(tensors)
        j = first_sharing(spans, i, (j for j, _ in padding.inputs))
        if j is not None:
            raise SpecMismatchError(
                f"{path} and {paths[j]} share memory, and {runner.name} updates {path} in "
                f"place: eager would see the update through {paths[j]}, a padded call "
                f"passes a padded copy of {paths[j]} made before it; pass tensors that do "
                "not share memory",
                path=path,
            )


def _turned_on_padded(
    runner: GraphedCallable | EagerCallable, paths: Sequence[str], padding: Padding
) -> tuple[int, ...]:
    """The padded inputs (their positions in the caller's order, ``paths``) whose
    ``requires_grad`` the callable turns on (``x.requires_grad_()``), as its capture found."""
    if not isinstance(runner, GraphedCallable) or not runner.plan.turns_requires_grad_on:
        return ()
    runner_paths = runner.plan.inputs.paths
    turned = {runner_paths[i] for i in runner.plan.turns_requires_grad_on}
    return tuple(index for index, _ in padding.inputs if paths[index] in turned)


def _flag_reads(
    runner: GraphedCallable, paths: Sequence[str]
) -> tuple[tuple[int, bool, bool], ...]:
    """The inputs whose flags the runner's callable reads: their positions in the caller's
    order (``paths``), their samples' ``requires_grad``, whether ``grad_fn`` or ``is_leaf`` was
    read (``valid_length``, the bucket's own tensor, left out)."""
    index_of = {path: i for i, path in enumerate(paths)}
    return tuple(
        (index_of[path], expected, history)
        for path, expected, history in runner.input_flags_read
        if path in index_of
    )


def _branches_otherwise(
    tensors: Sequence[torch.Tensor],
    reads: tuple[tuple[int, bool, bool], ...],
    reads_grad_mode: bool,
) -> bool:
    """Whether the caller's tensors (or grad mode) may take another branch than the capture's,
    whose inputs were leaves requiring grad as their samples, under grad."""
    if reads_grad_mode and not autograd_records():
        return True
    return any(
        tensors[i].requires_grad is not expected or (history and not tensors[i].is_leaf)
        for i, expected, history in reads
    )


def _refuse_inference_padded(
    runner: GraphedCallable,
    tensors: Sequence[torch.Tensor],
    paths: Sequence[str],
    full_length: torch.Tensor | None,
) -> None:
    """Refuse a padded call passing an inference tensor at a padded input the backward reads,
    as an exact call is refused (:meth:`GraphedCallable.refuse_padded_inference_inputs`).
    ``tensors`` and ``paths`` are the caller's, in the guard's order; ``valid_length`` stands
    at its own input."""
    index_of = {path: i for i, path in enumerate(paths)}
    in_runner_order = [
        tensors[index_of[path]] if path in index_of else full_length
        for path in runner.plan.inputs.paths
    ]
    runner.refuse_padded_inference_inputs(in_runner_order)  # type: ignore[arg-type]


def _note_padded_inputs(
    runner: GraphedCallable, tensors: Sequence[torch.Tensor], paths: Sequence[str], padding: Padding
) -> None:
    """Hand the replay just run the caller's tensors of its padded inputs (it read padded
    copies), so that one its backward reads, changed in place before it, is refused there.
    ``tensors`` and ``paths`` are the caller's, in the guard's order."""
    index_of = {path: i for i, path in enumerate(runner.plan.inputs.paths)}
    runner.note_padded_inputs(
        (index_of[paths[j]], tensors[j]) for j, _ in padding.inputs if paths[j] in index_of
    )


def _checked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An eager fallback's inputs were checked before the fallback was chosen."""
