"""What happens on every call of a graphed callable (the hot path).

A call checks its inputs, the module's parameters and the ambient state (autocast, TE's FP8
autocast) against the plan, copies the inputs into the static input buffers, replays the
forward and hands back the static outputs, rebuilt into the captured output tree (``None``
leaves and constants restored). Under autograd the replay is one :class:`torch.autograd.Function`
whose backward copies the incoming grads into the static grad buffers, replays the backward and
hands the grads on as eager would: input grads as tensors of their own, parameter grads to
``.grad``. Everything a call needs was fixed at capture, in the :class:`ReplayPlan`
(``_capture.py`` builds it); :class:`EmulatedReplay` is the ``"emulate"`` backend's stand-in for
the two graphs.

The plan's replay hooks (``_replay_hooks.py``) run around the forward and the backward replay;
Transformer Engine's FP8 autocast check and bookkeeping are among them (``_te_precision.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from .._errors import DualgraphError
from .._spec import TreeSpec
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._params import requires_grad_changed, suspended_tensor_hooks
from ._plan import ReplayPlan
from ._replay_hooks import ReplayCall

__all__ = ["CudaGraphForward", "EmulatedReplay", "GraphedCallable", "autocast_state"]

_detach = torch.Tensor.detach
_is = operator.is_
_grad = operator.attrgetter("grad")
_tensor_hooks = operator.attrgetter("_backward_hooks")
_in_graph_flags = operator.attrgetter(
    "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"
)
_is_any_autocast_enabled = getattr(
    torch._C, "_is_any_autocast_enabled", lambda: autocast_state() != ()
)
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)
# A leaf's AccumulateGrad node (made if none is alive): torch.autograd.graph's, without the
# GradientEdge that get_gradient_edge wraps it in.
_grad_accumulator = getattr(
    torch.autograd.graph, "_get_grad_fn_or_grad_acc", lambda t: get_gradient_edge(t).node
)


class GraphedCallable:
    """A captured callable; calling it replays (see the module docstring).

    Built complete from a :class:`ReplayPlan` by :func:`dualgraph.torch.make_graphed_callables`.
    ``copy.copy``, ``copy.deepcopy`` and pickling give the ungraphed callable instead (an
    :class:`EagerCallable` of a copy of the function): a copy never shares static buffers.
    """

    __slots__ = (
        "_accumulators",
        "_ambient_checks",
        "_autocast",
        "_backward_checks",
        "_backward_generation",
        "_clone_outputs",
        "_ddp_check",
        "_edge_nones",
        "_edges",
        "_first_param",
        "_generation",
        "_grad_outputs",
        "_has_backward",
        "_holder_baseline",
        "_hooks",
        "_in_graph_accumulators",
        "_in_graph_expected",
        "_in_graph_params",
        "_input_grads",
        "_inputs",
        "_lock",
        "_module_tensors",
        "_mutated",
        "_nondiff_outputs",
        "_out_spec",
        "_output_versions",
        "_param_grads",
        "_params",
        "_plan_params",
        "_replay_backward",
        "_replay_call",
        "_replay_forward",
        "_saved_outputs",
        "_sentinel_node",
        "_sentinel_param",
        "_static_inputs",
        "_static_outputs",
        "backend",
        "diagnostics",
        "name",
        "plan",
    )

    def __init__(self, plan: ReplayPlan, *, lock: threading.Lock | None = None) -> None:
        # ``lock``: one shared by callables whose graphs share activations (shape buckets), so
        # that no two of them replay at once.
        buffers, params = plan.buffers, plan.params
        self.plan = plan
        self.name = plan.name
        self.backend = plan.backend
        self.diagnostics: CaptureDiagnostics = dataclasses.replace(plan.diagnostics)
        self._inputs = plan.inputs
        self._module_tensors = plan.module_tensors
        self._out_spec = plan.outputs
        self._static_inputs = buffers.inputs
        self._static_outputs = buffers.outputs
        self._replay_forward = buffers.replay_forward
        self._replay_backward = buffers.replay_backward
        self._has_backward = plan.has_backward
        self._nondiff_outputs = plan.nondiff_outputs
        self._grad_outputs = tuple(zip(buffers.grad_outputs, plan.diff_outputs, strict=True))
        self._edges = params.edges
        self._input_grads = tuple(
            (1 + i, grad) for i, grad in enumerate(buffers.input_grads) if grad is not None
        )
        # Positions among the Function's inputs (and so its grads): the callable itself, the
        # input tensors, then the edge tensors (the parameters, or the in-graph anchor).
        self._first_param = 1 + len(buffers.inputs)
        self._edge_nones = (None,) * len(self._edges)
        self._params = params.params if params.mode == "autograd" else ()
        # A tuple of its own (the plan holds another): a static grad referenced from Python only
        # through one container could count as unreferenced, and AccumulateGrad would steal it.
        self._param_grads = tuple([*buffers.param_grads]) if params.mode == "autograd" else ()
        # A leaf node that runs in every ``.backward()`` through a replay, and never in
        # ``torch.autograd.grad``: see ``_is_plain_backward``. The in-graph anchor's node is
        # ours to keep; a parameter's is looked up during the backward (when the replay's graph
        # holds it): kept here, it would outlive the step with the stream it was made on.
        self._sentinel_node = params.anchor_node if params.mode == "in_graph" else None
        self._sentinel_param = self._params[0] if self._params else None
        self._accumulators = tuple(
            (param, accumulator, name)
            for param, accumulator, name in zip(
                params.params, params.accumulators, params.names, strict=True
            )
            if accumulator is not None
        )
        self._saved_outputs = () if plan.clone_outputs else plan.saved_outputs
        self._output_versions: tuple[int, ...] = ()
        self._mutated = plan.mutated_inputs
        self._clone_outputs = plan.clone_outputs
        self._autocast = plan.autocast
        self._hooks = plan.replay_hooks
        self._replay_call: ReplayCall | None = None  # the hooks' view of the replay in flight
        self._in_graph_params = tuple(entry[0] for entry in self._accumulators)
        self._plan_params = params.params if params.mode == "in_graph" else ()
        self._in_graph_expected = ((True, None, None),) * len(self._plan_params)
        self._in_graph_accumulators = tuple(entry[1] for entry in self._accumulators)
        self._ddp_check = bool(self._accumulators)
        # Anything besides "no autocast now, none at capture" needs the full check.
        self._ambient_checks = bool(self._autocast) or self._ddp_check
        self._lock = threading.Lock() if lock is None else lock
        self._generation = 0
        self._backward_generation = -1
        self._backward_checks = bool(self._saved_outputs) or bool(self._accumulators)
        self._holder_baseline = self._holder_counts()

    # -- what a caller sees -------------------------------------------------------------------

    @property
    def spec(self) -> TreeSpec:
        """The output spec recorded at capture."""
        return self._out_spec

    @property
    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """The static input buffers (args first, then kwargs): each call copies into them."""
        return self._static_inputs

    @property
    def static_outputs(self) -> tuple[torch.Tensor, ...]:
        """The static output buffers, which outputs alias unless ``clone_outputs=True``."""
        return self._static_outputs

    @property
    def generation(self) -> int:
        """How many forward replays have run: a backward pairs with the latest one only."""
        return self._generation

    def expire_backward(self) -> None:
        """Refuse the backward of the latest replay from now on: its activations are gone.

        For callables whose graphs share one pool's activations (shape buckets): a replay of
        one overwrites what the pending backward of another would read.
        """
        self._generation += 1

    def recount_holders(self) -> None:
        """Take the present holders of the in-graph accumulators as their owners.

        For callables that share accumulators (shape buckets), once all of them are built; a
        holder beyond these (a ``.grad`` kept after ``zero_grad(set_to_none=True)``) then counts.
        """
        self._holder_baseline = self._holder_counts()

    def __repr__(self) -> str:
        return (
            f"GraphedCallable({self.name!r}, backend={self.backend!r}, "
            f"inputs=({self._inputs.describe()}), outputs={self._out_spec!r})"
        )

    def __copy__(self) -> EagerCallable:
        return EagerCallable(self.name, self.plan.fn, self._inputs)

    def __deepcopy__(self, memo: dict[int, Any]) -> EagerCallable:
        return EagerCallable(self.name, copy.deepcopy(self.plan.fn, memo), self._inputs)

    def __reduce__(self) -> tuple[Any, ...]:
        return EagerCallable, (self.name, self.plan.fn, self._inputs)

    # -- the forward ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._lock.acquire(False):  # never waits: a second thread is refused
            raise self._busy()
        try:
            hooks = self._hooks
            if hooks is not None:
                kwargs, replay_kwargs = hooks.split_kwargs(kwargs)
            grad_enabled = torch.is_grad_enabled()
            tensors = self._inputs.tensors(args, kwargs, grad_enabled)
            if self._module_tensors is not None:
                self._module_tensors.check(grad_enabled=grad_enabled)
            if self._ambient_checks or _is_any_autocast_enabled():
                self._check_ambient_state()
            if self._mutated:
                self._check_mutated_inputs_are_apart(tensors)
            if hooks is not None:
                call = self._replay_call = hooks.before_forward(
                    self.backend, grad_enabled and self._has_backward, replay_kwargs
                )
            self.diagnostics.replays += 1
            if self._has_backward and grad_enabled:
                if _are_functorch_transforms_active():
                    raise DualgraphError(
                        f"{self.name}: called under a torch.func transform (vmap, grad, ...); a "
                        "graph replays fixed buffers and cannot be transformed"
                    )
                # ``_Replay.apply`` without its Python wrapper, which only unwraps dead functorch
                # wrappers (of the inputs here; parameters never are) on the way.
                outputs = _apply_replay(self, *map(_unwrap_if_dead, tensors), *self._edges)
            else:
                # Grad mode may be on (nothing differentiable to replay), and autograd refuses
                # copies into static inputs that are leaves requiring grad.
                with torch.no_grad():
                    outputs = self._forward(tensors)
            if self._mutated:
                self._copy_back(tensors)
            if hooks is None:
                return self._out_spec.unflatten(outputs)
            result = self._out_spec.unflatten(outputs)
            hooks.after_forward(call, result)
            return result
        finally:
            self._lock.release()

    def _forward(self, tensors: Sequence[torch.Tensor], grad_enabled: bool = False) -> Any:
        """Copy the inputs in, replay the forward, hand back the static outputs (grad mode off)."""
        # ``tensors`` may go on with the replay Function's edge tensors: zip stops at the inputs.
        for static, tensor in zip(self._static_inputs, tensors, strict=False):
            static.copy_(tensor)  # torch skips a copy of a tensor onto itself
        self._generation += 1  # a pending backward would now read overwritten activations
        self._replay_forward(grad_enabled)
        if self._saved_outputs:
            outputs = self._static_outputs
            self._output_versions = tuple(outputs[i]._version for i in self._saved_outputs)
        if self._clone_outputs:
            return tuple(o.clone() for o in self._static_outputs)
        return tuple(map(_detach, self._static_outputs))

    def _check_ambient_state(self) -> None:
        if self._autocast:
            if autocast_state() != self._autocast:
                raise self._ambient_mismatch("autocast state", autocast_state(), self._autocast)
        elif _is_any_autocast_enabled():
            raise self._ambient_mismatch("autocast state", autocast_state(), self._autocast)
        if self._ddp_check and _ddp_is_running():
            raise DualgraphError(
                f"{self.name}: captured with param_grads='in_graph', whose parameter grads bypass "
                "the autograd hooks DistributedDataParallel all-reduces through; capture with "
                "param_grads='autograd' to train under DDP"
            )

    def _ambient_mismatch(self, what: str, now: Any, captured: Any) -> DualgraphError:
        return DualgraphError(
            f"{self.name}: called with {what} {now} but captured with {captured}; a graph "
            "replays the precision it was captured in"
        )

    def _check_mutated_inputs_are_apart(self, tensors: Sequence[torch.Tensor]) -> None:
        paths = self._inputs.paths
        for i in self._mutated:
            mutated = tensors[i]
            if mutated.numel() == 0:
                continue
            storage = mutated.untyped_storage().data_ptr()
            for j, other in enumerate(tensors):
                if j != i and other.numel() and other.untyped_storage().data_ptr() == storage:
                    raise DualgraphError(
                        f"{self.name}: {paths[i]} and {paths[j]} share memory, and the callable "
                        f"updates {paths[i]} in place: eager would see the update through "
                        f"{paths[j]}, a replay would not; pass tensors that do not share memory"
                    )

    def _copy_back(self, tensors: Sequence[torch.Tensor]) -> None:
        # The callable updated these inputs in place (found at capture): as in eager, the
        # caller's tensors get the update.
        with torch.no_grad():
            for i in self._mutated:
                tensors[i].copy_(self._static_inputs[i])

    def _busy(self) -> DualgraphError:
        return DualgraphError(
            f"{self.name}: called while another thread is running it; a graphed callable has one "
            "set of static buffers, so concurrent calls would overwrite each other's inputs, "
            "outputs and grads. Call it from one thread at a time (separate graphed callables "
            "may run in separate threads)"
        )

    # -- the backward --------------------------------------------------------------------------

    def _backward(
        self,
        generation: int,
        needs_input_grad: tuple[bool, ...],
        inputs: Sequence[torch.Tensor],
        grads: Sequence[Any],
    ) -> tuple[torch.Tensor | None, ...]:
        if not self._lock.acquire(False):
            raise self._busy()
        try:
            plain = self._is_plain_backward()
            if (
                generation != self._generation
                or self._backward_generation == generation
                or self._backward_checks
            ):
                self._check_backward(generation, plain)
            if self._param_grads and not all(needs_input_grad[self._first_param :]):
                raise self._frozen_since_capture(needs_input_grad)
            self._backward_generation = generation
            hooks, call = self._hooks, self._replay_call
            if hooks is not None and call is not None:
                hooks.before_backward(call)
            for static, index in self._grad_outputs:
                grad = grads[index]
                if grad is None:
                    static.zero_()
                else:
                    static.copy_(grad)
            if self._accumulators:
                self._backward_into_accumulators()
            else:
                self._replay_backward()  # type: ignore[misc]
            if hooks is not None and call is not None:
                hooks.after_backward(call)
            return self._hand_out_grads(needs_input_grad, inputs, plain)
        finally:
            self._lock.release()

    def _frozen_since_capture(self, needs_input_grad: Sequence[bool]) -> DualgraphError:
        names = self.plan.params.names
        for name, needed in zip(names, needs_input_grad[self._first_param :], strict=True):
            if not needed:
                return requires_grad_changed(name, True)
        return DualgraphError(f"{self.name}: a parameter was frozen after capture")

    def _check_backward(self, generation: int, plain: bool) -> None:
        if generation != self._generation:
            raise DualgraphError(
                f"{self.name}: backward of an earlier replay after a later forward replay "
                "overwrote the activations it needs; run each replay's backward before the "
                "next forward of the same callable"
            )
        if self._backward_generation == generation:
            raise DualgraphError(
                f"{self.name}: a second backward through the same replay; the backward graph "
                "may reuse the memory of activations it has consumed, so each replay supports "
                "one backward (retain_graph=True cannot keep a graph's activations)"
            )
        if self._saved_outputs:
            outputs = self._static_outputs
            for i, version in zip(self._saved_outputs, self._output_versions, strict=True):
                if outputs[i]._version != version:
                    path = self._out_spec.array_paths[i]
                    raise DualgraphError(
                        f"{self.name}: output{path} was modified in place after the replay, but "
                        "the backward reads it (eager would raise: a variable needed for "
                        "gradient computation has been modified by an inplace operation); "
                        "change a copy (clone_outputs=True, or dualgraph.torch.owned)"
                    )
        if self._accumulators:
            self._check_in_graph_backward(plain)

    def _hand_out_grads(
        self, needs_input_grad: tuple[bool, ...], inputs: Sequence[torch.Tensor], plain: bool
    ) -> tuple[torch.Tensor | None, ...]:
        """The grads for autograd, never a static buffer that anyone could keep.

        The next backward replay overwrites the static grad buffers, while eager hands each
        backward new tensors. A buffer goes out as it is only where it is consumed at once: a
        plain ``.backward()`` (not ``torch.autograd.grad``, which returns what it captures)
        delivers it to an ``AccumulateGrad`` (a leaf, a parameter: it copies or adds into
        ``.grad``) or to another replay's backward (it copies into its own static buffer), and
        no hook or ``retain_grad`` sees it. Everywhere else it goes out as a copy.
        """
        result: list[torch.Tensor | None] = [None] * self._first_param
        for position, grad in self._input_grads:
            if needs_input_grad[position]:
                tensor = inputs[position - 1]
                if (
                    plain
                    and not tensor._backward_hooks
                    and not tensor.retains_grad
                    and (tensor.grad_fn is None or type(tensor.grad_fn) is _REPLAY_BACKWARD)
                ):
                    result[position] = grad
                else:
                    result[position] = grad.clone()
        if not self._param_grads:
            return (*result, *self._edge_nones)
        if plain and not any(map(_tensor_hooks, self._params)):
            return (*result, *self._param_grads)  # each goes straight into its AccumulateGrad
        for param_grad, param in zip(self._param_grads, self._params, strict=True):
            if param_grad is not None and (not plain or param._backward_hooks):
                param_grad = param_grad.clone()  # a hook or torch.autograd.grad may keep it
            result.append(param_grad)
        return tuple(result)

    def _is_plain_backward(self) -> bool:
        """Whether this backward accumulates into ``.grad`` (not ``torch.autograd.grad``).

        Asked of a leaf's ``AccumulateGrad`` node (a parameter's, or the in-graph anchor):
        the engine runs it in a ``.backward()``, never in ``torch.autograd.grad`` (where it
        raises for a leaf whose grad is captured).
        """
        node = self._sentinel_node
        if node is None and self._sentinel_param is not None:
            node = _grad_accumulator(self._sentinel_param)
        if node is None or _will_engine_execute_node is None:
            return False
        try:
            return bool(_will_engine_execute_node(node))
        except RuntimeError:
            return False

    # -- param_grads="in_graph" ----------------------------------------------------------------

    def _check_in_graph_backward(self, plain: bool) -> None:
        # One pass over the parameters: still trainable, and no hook that in-graph grads would
        # skip (an empty hook dict, left by a removed hook, is looked at on the slow path).
        if tuple(map(_in_graph_flags, self._plan_params)) != self._in_graph_expected:
            for param, name in zip(self._plan_params, self.plan.params.names, strict=True):
                if not param.requires_grad:
                    raise requires_grad_changed(name, True)
                if param._backward_hooks or param._post_accumulate_grad_hooks:
                    raise DualgraphError(
                        f"{self.name}: {name} has a grad hook, which param_grads='in_graph' "
                        "would never run (the backward graph adds the grad into .grad itself); "
                        "capture with param_grads='autograd' to use parameter hooks"
                    )
        if not plain:
            raise DualgraphError(
                f"{self.name}: captured with param_grads='in_graph', whose backward adds the "
                "parameter grads into .grad; this backward leaves the parameters out "
                "(torch.autograd.grad, or backward(inputs=...)), and would still change "
                ".grad. Capture with param_grads='autograd' for that"
            )

    def _backward_into_accumulators(self) -> None:
        """Replay the backward graph, which adds the parameter grads into static accumulators.

        Keeps eager's ``.grad`` contract. A ``.grad`` that is its accumulator is added to in
        place. A ``.grad`` set to ``None`` (``zero_grad``) starts from zero in a tensor nobody
        else holds: the accumulator itself if it is free, else a new tensor (whoever still holds
        the accumulator, e.g. the old ``.grad``, sees no change). A ``.grad`` the user set is
        added to in place, keeping its identity.
        """
        if all(map(_is, map(_grad, self._in_graph_params), self._in_graph_accumulators)):
            self._replay_backward()  # type: ignore[misc]  # every .grad is its accumulator
            return
        held = [
            any(map(operator.gt, counts, baseline))  # more holders than when nobody held it
            for counts, baseline in zip(self._holder_counts(), self._holder_baseline, strict=True)
        ]
        pending = [
            (param, accumulator, param.grad, accumulator.clone() if shared else None)
            for (param, accumulator, _), shared in zip(self._accumulators, held, strict=True)
            if param.grad is not accumulator
        ]
        zeroed = [accumulator for _, accumulator, grad, _ in pending if grad is None]
        if zeroed:
            torch._foreach_zero_(zeroed)
        for _, accumulator, grad, _ in pending:
            if grad is not None:
                accumulator.copy_(grad)
        self._replay_backward()  # type: ignore[misc]
        for param, accumulator, grad, saved in pending:
            if grad is not None:
                grad.copy_(accumulator)
            elif saved is None:
                param.grad = accumulator
            else:
                param.grad = accumulator.clone()
            if saved is not None:
                accumulator.copy_(saved)

    def _holder_counts(self) -> tuple[tuple[int, int, int], ...]:
        # References to each accumulator from Python, from C++ (another tensor's .grad, a saved
        # tensor), and to its memory (views). Compared with the counts at construction, taken
        # through this same method, they tell whether anyone else holds an accumulator.
        return tuple(_holders(entry[1]) for entry in self._accumulators)


def _holders(tensor: torch.Tensor) -> tuple[int, int, int]:
    storage = tensor.untyped_storage()
    return (
        sys.getrefcount(tensor),
        tensor._use_count(),  # type: ignore[attr-defined]
        torch._C._storage_Use_Count(storage._cdata),
    )


class _Replay(torch.autograd.Function):
    """One replay under autograd: the forward graph, then (on backward) the backward graph."""

    @staticmethod
    def forward(
        ctx: Any, graphed: GraphedCallable, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs = graphed._forward(inputs, True)
        ctx.graphed = graphed
        ctx.inputs = inputs
        ctx.generation = graphed._generation
        ctx.set_materialize_grads(False)
        if graphed._nondiff_outputs:
            ctx.mark_non_differentiable(*(outputs[i] for i in graphed._nondiff_outputs))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        graphed: GraphedCallable = ctx.graphed
        return graphed._backward(ctx.generation, ctx.needs_input_grad, ctx.inputs, grads)


_REPLAY_BACKWARD = _Replay._backward_cls
# The C ``apply`` that ``torch.autograd.Function.apply`` ends in.
_apply_replay = super(torch.autograd.Function, _Replay).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_are_functorch_transforms_active = torch._C._are_functorch_transforms_active
_NO_HOOKS = contextlib.nullcontext()


class CudaGraphForward:
    """A forward graph as the plan calls it: ``replay(grad_enabled)`` (the graph ignores it)."""

    __slots__ = ("_replay",)

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self._replay = graph.replay

    def __call__(self, grad_enabled: bool) -> None:
        self._replay()


class EmulatedReplay:
    """The ``"emulate"`` backend's forward and backward "graphs": the callable, re-run.

    :meth:`forward` runs the callable on the static inputs and copies its outputs into the
    static outputs; :meth:`backward` differentiates that run with the static grad outputs and
    copies the grads into the static grad buffers (``grad_targets``, one per differentiable
    input, ``None`` where nothing is kept) or adds them into ``accumulators`` (in-graph
    parameter grads). The same buffers are read and written as by CUDA graphs, so aliasing
    mistakes show up on a CPU.
    """

    __slots__ = (
        "_accumulate",
        "_allow_unused",
        "_args",
        "_diff_inputs",
        "_diff_outputs",
        "_fn",
        "_grad_outputs",
        "_hooked_params",
        "_kwargs",
        "_live",
        "_out_spec",
        "_static_outputs",
        "_targets",
    )

    def __init__(
        self,
        *,
        fn: Any,
        static_args: tuple[Any, ...],
        static_kwargs: dict[str, Any],
        out_spec: TreeSpec,
        static_outputs: tuple[torch.Tensor, ...],
        diff_outputs: tuple[int, ...],
        diff_inputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        grad_targets: tuple[torch.Tensor | None, ...],
        accumulators: tuple[torch.Tensor | None, ...],
        allow_unused: bool,
        hooked_params: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._fn = fn
        self._args = static_args
        self._kwargs = static_kwargs
        self._out_spec = out_spec
        self._static_outputs = static_outputs
        self._diff_outputs = diff_outputs
        self._diff_inputs = diff_inputs
        self._grad_outputs = grad_outputs
        self._targets = tuple(
            (k, target) for k, target in enumerate(grad_targets) if target is not None
        )
        self._accumulate = tuple(
            (k, accumulator)
            for k, accumulator in enumerate(accumulators)
            if accumulator is not None
        )
        self._allow_unused = allow_unused
        self._hooked_params = hooked_params
        self._live: list[torch.Tensor] = []

    def forward(self, grad_enabled: bool) -> None:
        with torch.set_grad_enabled(grad_enabled):
            outputs = self._fn(*self._args, **self._kwargs)
        flat = self._out_spec.flatten(outputs, check=True, root="output")
        self._live = [flat[i] for i in self._diff_outputs] if grad_enabled else []
        for static, tensor in zip(self._static_outputs, flat, strict=True):
            static.copy_(tensor.detach())

    def backward(self) -> None:
        live, self._live = self._live, []  # one backward per forward, as with a graph
        if not live:
            raise DualgraphError("backward without a forward under autograd")
        # Parameter hooks run once, when the replay hands the grads to autograd, as after a
        # graph's backward (which has them suspended during capture).
        hooks = suspended_tensor_hooks(self._hooked_params) if self._any_hooks() else _NO_HOOKS
        with hooks:
            grads = torch.autograd.grad(
                live,
                self._diff_inputs,
                grad_outputs=self._grad_outputs,
                allow_unused=self._allow_unused,
            )
        for k, target in self._targets:
            grad = grads[k]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad)
        pairs = [(acc, grads[k]) for k, acc in self._accumulate if grads[k] is not None]
        if pairs:
            torch._foreach_add_([acc for acc, _ in pairs], [grad for _, grad in pairs])

    def _any_hooks(self) -> bool:
        return any(map(_tensor_hooks, self._hooked_params))


def autocast_state() -> tuple[Any, ...]:
    """``()`` outside autocast, else the autocast dtype per device type (False where off)."""
    if not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        return ()
    return (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
    )


_DDP = torch.nn.parallel.DistributedDataParallel


def _ddp_is_running() -> bool:
    # DDP marks the module whose forward is running (public hook for TorchDynamo).
    return getattr(_DDP, "_active_ddp_module", None) is not None
