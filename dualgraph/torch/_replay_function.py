"""One replay under autograd: the :class:`torch.autograd.Function` a graphed call applies.

Its forward and backward call back into the :class:`GraphedCallable` (``_replay.py``); the
engine calls its backward node directly, without torch's Python lookup.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any
from weakref import ref as _weakref

import torch

from .._errors import DualgraphError
from ._ambient import ddp_is_running as _ddp_is_running

if TYPE_CHECKING:
    from ._replay import GraphedCallable

__all__ = ["REPLAY_BACKWARD", "SecondBackwardError", "apply_replay", "watch_handed_out"]

_is_grad_enabled = torch.is_grad_enabled
_are_functorch_transforms_active = torch._C._are_functorch_transforms_active
_enter_vmap = torch._C._vmapmode_increment_nesting
_leave_vmap = torch._C._vmapmode_decrement_nesting


_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_is_functorch_batched = torch._C._functorch.is_batchedtensor


def _any_batched(grads: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a grad is a vmap's batched tensor. The vmap levels the backward reads are the
    calling thread's: where the engine runs it on a device's own thread (CUDA), they read as
    none under ``is_grads_batched=True``, and only the grads tell."""
    for grad in grads:
        if grad is not None and (_is_legacy_batched(grad) or _is_functorch_batched(grad)):
            return True
    return False


_version = operator.attrgetter("_version")


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
        # Checked by a backward through several replays. The nodes of replays whose backward
        # is over go first (their graphs are freed by the next call, as a rule): a backward
        # then finds only its own node, and pays one length test instead of a pass over them.
        nodes = graphed._nodes
        while nodes and nodes[0]() is None:
            nodes.popleft()
        nodes.append(_weakref(ctx))
        # "auto": DDP all-reduces through the parameters' AccumulateGrad hooks (its forward is
        # over by the backward, so it is asked now), and hooks on a parameter's AccumulateGrad
        # node itself need them too (found before this replay's node kept them).
        ctx.under_ddp = graphed._auto and (graphed._nodes_watched or _ddp_is_running())
        ctx.materialize_grads = False  # set_materialize_grads(False), without its frame
        # An output that only inputs and parameters needing no grad in this call reach needs
        # none (an input passed without, a parameter frozen since capture).
        frozen = graphed.params_frozen(ctx.needs_input_grad)
        nondiff = (
            graphed.nondiff_outputs_of(inputs, frozen)
            if frozen or graphed._input_only_outputs
            else graphed._nondiff_outputs
        )
        if nondiff:
            ctx.mark_non_differentiable(*(outputs[i] for i in nondiff))
        if graphed._read_by_backward:  # as saved tensors' versions: checked at backward
            ctx.versions = tuple(map(_version, graphed._read_by_backward))
        # and the inputs' it reads, as seen at capture for the grads the capture needed: a call
        # needing others may read others (x * y saves y only for x's grad), so it is not
        # checked (no false refusal of what eager runs; no refusal in that rare call either)
        if (
            graphed._saved_inputs
            and not frozen
            and ctx.needs_input_grad[1 : graphed._first_param] == graphed._captured_input_grads
        ):
            try:
                ctx.input_versions = graphed.input_versions(inputs)
            except RuntimeError:  # an inference tensor has no version counter
                graphed.refuse_inference_inputs(inputs)
                raise
        if graphed._used_inside:  # weakly: a node holding its outputs would keep them alive
            ctx.used_inside = tuple((k, _weakref(outputs[k])) for k in graphed._used_inside)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # Whether this backward runs under a vmap: ``is_grads_batched=True`` (torch's own vmap,
        # whose level only entering one more tells), or a ``torch.func`` transform.
        level = _enter_vmap()
        _leave_vmap()
        graphed: GraphedCallable = ctx.graphed
        if level > 1 or _are_functorch_transforms_active() or _any_batched(grads):
            raise DualgraphError(
                f"{graphed.name}: a batched backward (torch.autograd.grad(..., "
                "is_grads_batched=True) or a torch.func transform) cannot be replayed: a graph "
                "takes one grad per output into fixed buffers. Loop over the grads, or run this "
                "callable eagerly (dualgraph.torch.restore)"
            )
        versions = ctx.versions
        if versions and tuple(map(_version, graphed._read_by_backward)) != versions:
            # says which, and raises
            graphed._refuse_changed_since_forward(versions, ctx.needs_input_grad)
        if ctx.used_inside:
            graphed._refuse_grads_watched_inside(ctx.used_inside)
        if _is_grad_enabled():  # create_graph=True: a second backward must raise
            return _backward_once_differentiable(ctx, *grads)
        return graphed._backward(
            ctx.generation,
            ctx.needs_input_grad,
            ctx.inputs,
            grads,
            ctx.under_ddp,
            ctx.post_hooked,
            ctx,  # the node itself: its edges lead to the parameters' nodes
        )


def _backward_building_graph(
    ctx: Any, *grads: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    # create_graph=True: eager's AccumulateGrad then makes .grad a new tensor with a graph of its
    # own, so the parameter grads go through autograd ("auto"), or are refused ("in_graph").
    graphed: GraphedCallable = ctx.graphed
    return graphed._backward(
        ctx.generation, ctx.needs_input_grad, ctx.inputs, grads, True, ctx.post_hooked, ctx
    )


class SecondBackwardError(DualgraphError, RuntimeError):
    """A second backward through a replay's grads (a gradient penalty, a Hessian): refused.

    A ``RuntimeError`` too, as torch's own ``once_differentiable`` refusal is.
    """


def _twice(name: str) -> str:
    """What a second backward through a replay's grads raises: torch's words, and ours."""
    return (
        f"{name}: trying to differentiate twice a function that was marked with "
        "@once_differentiable: the grads of a graphed callable's backward replay have no graph "
        "of their own to differentiate (a gradient penalty, a Hessian, a second derivative); "
        "run this callable eagerly for that (dualgraph.torch.restore, or the function itself)"
    )


class _RefusingASecondBackward(torch.autograd.Function):
    """Hands the grads of a backward run with ``create_graph=True`` on as they are; its own
    backward (differentiating them) raises :class:`SecondBackwardError` naming the callable.

    Its inputs past the first ``count`` (the replay's inputs and incoming grads that need grad)
    are edges only: ``torch.autograd.grad`` runs just the nodes on a path to what it asks for.
    """

    @staticmethod
    def forward(ctx: Any, name: str, count: int, *tensors: torch.Tensor | None) -> Any:
        ctx.name = name
        return tensors[:count]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise SecondBackwardError(_twice(ctx.name))


def _refusing_a_second_backward(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    alias = grad.detach()
    alias.requires_grad_(True)
    return alias


def _backward_once_differentiable(
    ctx: Any, *grads: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    # The engine runs a backward with grad mode off unless create_graph=True; then eager's grads
    # have a graph of their own (through the parameters, or the inputs), and these raise when
    # differentiated. ``once_differentiable`` does that only where an incoming grad requires
    # grad: a gradient penalty of ``y.sum()``'s grads (ones) would silently add nothing.
    with torch.no_grad():
        results = _backward_building_graph(ctx, *grads)
    # A later backward through this replay (the penalty's, through the outputs again) is
    # refused as the second derivative it belongs to, whichever node the engine reaches first.
    ctx.built_graph = True
    # The refusing node also takes the replay's inputs (parameters included) and the incoming
    # grads that need grad: ``torch.autograd.grad(penalty, x)`` runs only nodes on a path to
    # ``x``, and a node hung off leaves of its own would be skipped (a Hessian or a
    # ``functional.jvp`` silently zero, not refused).
    reached = [t for t in (*ctx.inputs, *grads) if t is not None and t.requires_grad]
    return tuple(
        _RefusingASecondBackward.apply(
            ctx.graphed.name, len(results), *map(_refusing_a_second_backward, results), *reached
        )
    )


def _noting_hooks(register: Any, *, sees_results: bool) -> Any:
    def register_noted(node: Any, hook: Any) -> Any:
        # A node hook sees the grads coming in, and may keep them: a replay feeding this node
        # then hands it copies, not its static input grad buffers (``GraphedCallable``). A post
        # hook also sees what this node hands on: its replay then hands out copies too.
        node.hooked = True
        if sees_results:
            node.post_hooked = True
        return register(node, hook)

    return register_noted


REPLAY_BACKWARD: Any = _Replay._backward_cls
# The engine calls a Function's backward node through its ``apply``, which torch defines in
# Python to find the user's ``backward`` (or ``vjp``) on every call; this node calls ours
# directly (docs/cuda_graphs.md).
REPLAY_BACKWARD.apply = _Replay.backward
REPLAY_BACKWARD.hooked = False
REPLAY_BACKWARD.post_hooked = False
REPLAY_BACKWARD.used_inside = ()  # (position, weak reference) of outputs used inside
# whether its edges lead to views of the parameters, made in eager's order (_grad_order.py)
REPLAY_BACKWARD.params_viewed = False
REPLAY_BACKWARD.versions = ()  # of the parameters and buffers the backward reads
REPLAY_BACKWARD.input_versions = ()  # of the inputs the backward reads
# (input index, caller's tensor, its version) of a padded call's inputs the backward reads
REPLAY_BACKWARD.padded_callers = ()
REPLAY_BACKWARD.built_graph = False  # its backward ran with create_graph=True
_NodeBase = torch._C._FunctionBase
REPLAY_BACKWARD.register_prehook = _noting_hooks(_NodeBase.register_prehook, sees_results=False)
REPLAY_BACKWARD.register_hook = _noting_hooks(_NodeBase.register_hook, sees_results=True)
# The C ``apply`` that ``torch.autograd.Function.apply`` ends in.
apply_replay = super(torch.autograd.Function, _Replay).apply


def watch_handed_out(replaced: dict[int, torch.Tensor], outputs: Any) -> None:
    """Check the tensors handed out in place of a replay's outputs (``replaced``: by the id of the
    output each stands for, e.g. cut back from a padded call) for a watched grad, as the outputs.

    A hook or ``retain_grad`` on one that other outputs are computed from would see only what
    the loss sends to it directly, where eager's grad includes the rest (``used_inside``).
    """
    for output in outputs:
        node: Any = getattr(output, "grad_fn", None)
        watched = getattr(node, "used_inside", ())
        if watched:
            extra = []
            for k, output_ref in watched:
                stand_in = replaced.get(id(output_ref()))
                if stand_in is not None:
                    extra.append((k, _weakref(stand_in)))
            node.used_inside = (*watched, *extra)
            return  # one node per replay: every output of it shares it
