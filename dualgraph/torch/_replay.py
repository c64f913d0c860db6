"""What happens on every call of a graphed callable (the hot path).

A call validates its inputs, copies them into the static input buffers, replays the forward
graph and hands back the static outputs, rebuilt into the captured output tree (``None`` leaves
and constants restored). Under autograd the replay is one :class:`torch.autograd.Function` whose
backward copies the incoming grads into the static grad buffers and replays the backward graph.
Everything a call needs was precomputed at capture time (see ``_capture.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._errors import DualgraphError
from .._spec import TreeSpec
from ._inputs import InputGuard

if TYPE_CHECKING:  # issue 19 hook: the lint report and memory plan kept with the diagnostics
    from ._lint import LintReport
    from ._memory_plan import MemoryPlan

__all__ = ["CaptureDiagnostics", "GraphedCallable", "autocast_state"]


@dataclass
class CaptureDiagnostics:
    """Sizes and times of one captured callable.

    ``pool_bytes`` is the size of the CUDA memory pool that all callables captured together share
    (the same number on each of them): the allocator's segments of that pool, else the memory
    the capture left allocated; 0 off the GPU. ``lint`` holds the capture lint's findings
    (``None`` with ``lint="off"``) and ``memory_plan`` the memory plan, with the measured pool
    beside it on the GPU (both ``None`` when no warmup iteration ran).
    """

    name: str
    backend: str
    static_input_bytes: int = 0
    static_output_bytes: int = 0
    static_grad_bytes: int = 0
    pool_bytes: int = 0
    capture_seconds: float = 0.0
    has_backward_graph: bool = False
    replays: int = field(default=0)
    # issue 19 hook: set after capture by dualgraph.torch._probe.attach_probes
    lint: LintReport | None = None
    memory_plan: MemoryPlan | None = None


class GraphedCallable:
    """A captured callable; calling it replays (see the module docstring).

    Built by :func:`dualgraph.torch.make_graphed_callables`; the attributes are filled in by
    the capture.
    """

    def __init__(self, name: str, fn: Callable[..., Any], guard: InputGuard, backend: str) -> None:
        self.name = name
        self.fn = fn
        self.guard = guard
        self.backend = backend
        self.static_inputs: list[torch.Tensor] = []
        self.static_args: tuple[Any, ...] = ()  # the static inputs in the callable's own tree
        self.static_kwargs: dict[str, Any] = {}
        self.cuda_graphs: list[torch.cuda.CUDAGraph] = []  # kept alive with the callable
        # Parameters whose grads the backward computes, and the tensors passed to the replay
        # Function after the inputs: the parameters themselves ("autograd" param grads), or one
        # empty anchor that keeps the replay in the autograd graph ("in_graph" param grads).
        self.params: tuple[torch.Tensor, ...] = ()
        self.edge_params: tuple[torch.Tensor, ...] = ()
        self.param_grads = "autograd"
        self.param_grad_buffers: list[torch.Tensor] = []
        self.params_with_grad: tuple[bool, ...] = ()
        self.out_spec: TreeSpec | None = None
        self.static_outputs: list[torch.Tensor] = []
        self.diff_outputs: tuple[int, ...] = ()
        self.nondiff_outputs: tuple[int, ...] = ()
        self.static_grad_outputs: list[torch.Tensor] = []
        self.static_grad_inputs: tuple[torch.Tensor | None, ...] = ()
        self.replay_forward: Callable[[bool], None] = _not_captured
        self.replay_backward: Callable[[], None] = _not_captured
        self.clone_outputs = False
        self.autocast_state: tuple[Any, ...] = ()
        self.generation = 0
        self.backward_generation = -1
        self.diagnostics = CaptureDiagnostics(name=name, backend=backend)
        self._has_backward = False
        self._param_buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def finish(self) -> None:
        """Precompute what the hot path reads, once the capture filled in the buffers."""
        self._has_backward = bool(self.diff_outputs) and (
            any(g is not None for g in self.static_grad_inputs) or bool(self.param_grad_buffers)
        )
        self.diagnostics.has_backward_graph = self._has_backward
        self._param_buffers = tuple(
            (param, buffer)
            for param, buffer, used in zip(
                self.params, self.param_grad_buffers, self.params_with_grad
            )
            if used
        )

    @property
    def spec(self) -> TreeSpec:
        """The output spec recorded at capture."""
        assert self.out_spec is not None
        return self.out_spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = self.guard.tensors(args, kwargs)
        if autocast_state() != self.autocast_state:
            raise DualgraphError(
                f"{self.name}: called with autocast state {autocast_state()} but captured with "
                f"{self.autocast_state}; a graph replays the precision it was captured in"
            )
        if self.param_grad_buffers and _ddp_is_running():
            raise DualgraphError(
                f"{self.name}: captured with param_grads='in_graph', whose parameter grads bypass "
                "the autograd hooks DistributedDataParallel all-reduces through; capture with "
                "param_grads='autograd' to train under DDP"
            )
        self.diagnostics.replays += 1
        if self._has_backward and torch.is_grad_enabled():
            outputs = _Replay.apply(self, *tensors, *self.edge_params)
        else:
            # Grad mode may be on (nothing differentiable to replay), and autograd refuses
            # copies into static inputs that are leaves requiring grad.
            with torch.no_grad():
                outputs = self.run_forward(tensors, False)
        return self.out_spec.unflatten(outputs)  # type: ignore[union-attr]

    # -- the two halves of a replay -----------------------------------------------------------

    def copy_inputs(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
        for static, tensor in zip(self.static_inputs, tensors):
            if static.data_ptr() != tensor.data_ptr():
                static.copy_(tensor)

    def backward_into_param_grads(self) -> None:
        """Replay the backward graph, which adds the parameter grads into static buffers.

        Keeps the ``.grad`` contract: a ``.grad`` set to ``None`` (``zero_grad``) starts from
        zero, one the user replaced is carried over, and afterwards each ``.grad`` is its buffer.
        """
        pending = None
        for param, buffer in self._param_buffers:
            if param.grad is not buffer:
                if pending is None:
                    pending = []
                pending.append((param, buffer, param.grad))
        if pending:
            zeroed = [buffer for _, buffer, grad in pending if grad is None]
            if zeroed:
                torch._foreach_zero_(zeroed)
            for _, buffer, grad in pending:
                if grad is not None:
                    buffer.copy_(grad)
        self.replay_backward()
        if pending:
            for param, buffer, _ in pending:
                param.grad = buffer

    def run_forward(
        self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], grad_enabled: bool
    ) -> tuple[torch.Tensor, ...]:
        """Copy the inputs in, replay the forward, hand back the static outputs.

        Runs with grad mode off: inside the replay Function, or under ``no_grad`` from a call.
        """
        self.copy_inputs(tensors)
        self.generation += 1  # a pending backward would now read overwritten activations
        self.replay_forward(grad_enabled)
        if self.clone_outputs:
            return tuple(o.clone() for o in self.static_outputs)
        return tuple(o.detach() for o in self.static_outputs)


class _Replay(torch.autograd.Function):
    """One replay under autograd: the forward graph, then (on backward) the backward graph."""

    @staticmethod
    def forward(
        ctx: Any, graphed: GraphedCallable, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs = graphed.run_forward(inputs, True)
        ctx.graphed = graphed
        ctx.generation = graphed.generation
        ctx.set_materialize_grads(False)
        if graphed.nondiff_outputs:
            ctx.mark_non_differentiable(*(outputs[i] for i in graphed.nondiff_outputs))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        graphed: GraphedCallable = ctx.graphed
        if ctx.generation != graphed.generation:
            raise DualgraphError(
                f"{graphed.name}: backward of an earlier replay after a later forward replay "
                "overwrote the activations it needs; run each replay's backward before the "
                "next forward of the same callable"
            )
        if graphed.backward_generation == ctx.generation:
            raise DualgraphError(
                f"{graphed.name}: a second backward through the same replay; the backward graph "
                "may reuse the memory of activations it has consumed, so each replay supports "
                "one backward (retain_graph=True cannot keep a graph's activations)"
            )
        graphed.backward_generation = ctx.generation
        for static, index in zip(graphed.static_grad_outputs, graphed.diff_outputs):
            grad = grads[index]
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        if graphed.param_grad_buffers:
            graphed.backward_into_param_grads()
        else:
            graphed.replay_backward()
        # The static grad tensors themselves (not detached aliases) go back to autograd: being
        # referenced here, they are never stolen into a ``.grad``, so gradient accumulation over
        # several replays stays correct (the bug of pytorch issue 181723).
        return (None, *graphed.static_grad_inputs)


def autocast_state() -> tuple[Any, ...]:
    """``()`` outside autocast, else the autocast dtype per device type (False where off)."""
    if not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        return ()
    return (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
    )


def _ddp_is_running() -> bool:
    # DDP marks the module whose forward is running (public hook for TorchDynamo).
    ddp = torch.nn.parallel.DistributedDataParallel
    return getattr(ddp, "_active_ddp_module", None) is not None


def _not_captured(*_: Any) -> None:
    raise DualgraphError("this callable was not captured")
