"""What a plan calls as its graphs: a CUDA graph's forward, the ``"emulate"`` backend's re-run
of the callable (:class:`EmulatedReplay`), and the addition of grads into accumulators.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import DualgraphError
from .._spec import TreeSpec
from ._layouts import copy_laid_out, expanded_dims
from ._nesting import replay_scope
from ._params import suspended_tensor_hooks
from ._saved_hooks import KEEPING_ACTIVATIONS

__all__ = ["CudaGraphForward", "EmulatedReplay", "accumulate_into"]

_tensor_hooks = operator.attrgetter("_backward_hooks")
_NO_HOOKS = contextlib.nullcontext()
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_clear_autocast_cache = torch.clear_autocast_cache
_OWN_SAVED_TENSORS = KEEPING_ACTIVATIONS


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
        "_expanded",
        "_fn",
        "_grad_outputs",
        "_hooked_params",
        "_kwargs",
        "_live",
        "_out_spec",
        "_saved",
        "_saved_live",
        "_static_outputs",
        "_targets",
        "incoming",
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
        saved_outputs: tuple[int, ...] = (),
    ) -> None:
        self._fn = fn
        self._args = static_args
        self._kwargs = static_kwargs
        self._out_spec = out_spec
        self._static_outputs = static_outputs
        self._expanded = tuple(bool(expanded_dims(static)) for static in static_outputs)
        self._diff_outputs = diff_outputs
        self._diff_inputs = diff_inputs
        self._grad_outputs = grad_outputs
        self._targets = tuple(
            (k, target) for k, target in enumerate(grad_targets) if target is not None
        )
        # Into the memory the accumulators have now, as a graph's add is captured on it: a
        # ``.grad`` that is an accumulator may be moved elsewhere later (``grad.data = ...``),
        # and a graph still adds where it was (``_replay.py`` sees to it).
        self._accumulate = tuple(
            (k, accumulator.detach())
            for k, accumulator in enumerate(accumulators)
            if accumulator is not None
        )
        self._allow_unused = allow_unused
        self._hooked_params = hooked_params
        self._live: list[torch.Tensor] = []
        # The outputs the backward reads that the replay hands out as its static outputs, and
        # this run's own tensors of them (see :meth:`backward`).
        self._saved = saved_outputs
        self._saved_live: list[tuple[torch.Tensor, torch.Tensor]] = []
        # The grads the caller handed the replay (set before each backward; None for a missing
        # one): an op's backward may round differently by their layout (BatchNorm's, for an
        # expanded grad such as ``.sum()``'s), and eager differentiates with them as they are.
        self.incoming: tuple[torch.Tensor | None, ...] | None = None

    def forward(self, grad_enabled: bool) -> None:
        # A graph keeps its activations to itself; so does this run: the caller's saved-tensor
        # hooks (a non-reentrant checkpoint around the replay, offloading) never see them.
        own = _OWN_SAVED_TENSORS if _top_saved_tensors_hooks(False) is not None else _NO_HOOKS
        # An autocast the callable enters while another autocast context is open keeps its
        # weight cache across calls: a cast of a static input (a leaf, as its tensor is for
        # eager) made by an earlier run would be found again, holding that run's values.
        _clear_autocast_cache()
        # Graphed callables it calls run their original code, as the graph of this one does.
        # A run with no backward to follow (nothing differentiable goes out) keeps grad mode on,
        # as its capture did: its own torch.autograd.grad (forces, -dE/dx) needs it, and a
        # graph replays what was captured whatever the caller's mode (a callable whose Python
        # reads grad mode runs eagerly under no_grad instead).
        records = grad_enabled or not self._diff_outputs
        with torch.set_grad_enabled(records), own, replay_scope():
            outputs = self._fn(*self._args, **self._kwargs)
        flat = self._out_spec.flatten(outputs, check=True, root="output")
        self._live = [flat[i] for i in self._diff_outputs] if grad_enabled else []
        statics = self._static_outputs
        self._saved_live = [(statics[i], flat[i]) for i in self._saved] if grad_enabled else []
        # Through ``.data``, which has a version counter of its own: a graph writes its outputs
        # without autograd knowing, and the replay (``_replay.py``) tells autograd itself.
        for static, expanded, tensor in zip(statics, self._expanded, flat, strict=True):
            if expanded:  # eager's repeats memory (stride 0): written through one slice
                copy_laid_out(static.data, tensor.detach())
            else:
                static.data.copy_(tensor.detach())

    def backward(self) -> None:
        live, self._live = self._live, []  # one backward per forward, as with a graph
        incoming, self.incoming = self.incoming, None
        if not live:
            raise DualgraphError("backward without a forward under autograd")
        saved_live, self._saved_live = self._saved_live, []
        # A graph's backward reads the static outputs' memory, so a change the caller made
        # there unseen by autograd (``out.data.mul_(2)``, as eager's backward would read it) is
        # what it differentiates with; this run's backward reads its own tensors: give them
        # the static outputs' values, through ``.data`` (no version moves, as in the graph).
        for static, own in saved_live:
            copy_laid_out(own.data, static)
        grad_outputs: Sequence[torch.Tensor] = self._grad_outputs
        allow_unused = self._allow_unused
        if incoming is not None:  # the static buffers hold the same values (copied before)
            given = [
                (out, grad) for out, grad in zip(live, incoming, strict=True) if grad is not None
            ]
            if given and len(given) < len(live):
                # Outputs left out of the loss: eager's backward never reaches their ops, so
                # neither does this one (a zero grad through them would add 0.0, turning a
                # -0.0 into 0.0, or 0 * inf = NaN, where eager adds nothing); what only they
                # reach gets no grad (the replay hands out None there, see _unreached).
                live = [out for out, _ in given]
                grad_outputs = [grad for _, grad in given]
                allow_unused = True
            else:
                grad_outputs = tuple(
                    static if grad is None else grad
                    for grad, static in zip(incoming, grad_outputs, strict=True)
                )
        # Parameter hooks run once, when the replay hands the grads to autograd, as after a
        # graph's backward (which has them suspended during capture).
        hooks = suspended_tensor_hooks(self._hooked_params) if self._any_hooks() else _NO_HOOKS
        inputs = self._diff_inputs
        # A parameter frozen since the forward gets no grad (a graph would compute it, and
        # autograd would skip it); the others are computed as usual.
        wanted = [k for k, t in enumerate(inputs) if t.requires_grad]
        with hooks:
            some = torch.autograd.grad(
                live,
                [inputs[k] for k in wanted] if len(wanted) < len(inputs) else inputs,
                grad_outputs=grad_outputs,
                allow_unused=allow_unused,
            )
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        for k, computed in zip(wanted, some, strict=True):
            grads[k] = computed
        for k, target in self._targets:
            grad = grads[k]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad)
        pairs = [
            (acc, g) for acc, g in ((acc, grads[k]) for k, acc in self._accumulate) if g is not None
        ]
        if pairs:
            torch._foreach_add_([acc for acc, _ in pairs], [g for _, g in pairs])

    def _any_hooks(self) -> bool:
        return any(map(_tensor_hooks, self._hooked_params))


def accumulate_into(
    accumulators: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None]
) -> Callable[[], None] | None:
    """A call that adds each grad into its accumulator (one ``_foreach_add_``), or ``None``.

    Pairs where either side is ``None`` (an unused parameter) are left out. Called once inside
    a capture, it records the addition into a graph; called on every replay, it is the
    ``"emulate"`` backend's stand-in for that graph.

    >>> total, grad = torch.zeros(2), torch.ones(2)
    >>> add = accumulate_into([total, None], [grad, torch.ones(3)])
    >>> add()
    >>> add()
    >>> total
    tensor([2., 2.])
    """
    pairs = [
        (a, g) for a, g in zip(accumulators, grads, strict=False) if a is not None and g is not None
    ]
    if not pairs:
        return None
    targets, sources = [a for a, _ in pairs], [g for _, g in pairs]

    def accumulate() -> None:
        torch._foreach_add_(targets, sources)

    return accumulate
