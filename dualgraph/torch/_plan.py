"""The replay plan: everything a capture fixed, from which a graphed callable is built complete.

A :class:`ReplayPlan` is frozen. Its parts follow what later work replicates:

- :class:`StaticBuffers`: one set of static buffers and the replayers (graphs, or the
  ``"emulate"`` stand-in) that read and write them, i.e. one replay in flight. Several
  micro-batches in flight would each get one.
- the specs and index tuples (inputs, outputs, which outputs are differentiable, which inputs
  the callable updates in place): one per input shape, so a shape bucket would get its own.
- :class:`ParamLayout`: the parameters whose grads the backward computes and how those grads
  reach ``.grad`` (through autograd, added inside the graph, or chosen per backward), shared by
  every slot and bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._spec import TreeSpec
from ._ambient import CudnnSettings
from ._diagnostics import CaptureDiagnostics
from ._inputs import InputGuard
from ._output_aliases import OutputAliases
from ._params import ModuleTensors
from ._replay_hooks import ReplayHookRunner

__all__ = ["Backend", "ParamGradsMode", "ParamLayout", "ReplayPlan", "StaticBuffers"]

#: The backends that capture a plan ("eager" has none).
Backend = Literal["cuda", "emulate"]
#: How parameter grads reach ``.grad``: see :class:`ParamLayout`.
ParamGradsMode = Literal["auto", "autograd", "in_graph"]


@dataclass(frozen=True, eq=False)
class StaticBuffers:
    """One set of static buffers and the replays that read and write them.

    ``input_grads`` lines up with ``inputs`` (``None`` where an input takes no grad) and
    ``param_grads`` with :attr:`ParamLayout.params` (``None`` for a parameter the callable does
    not use, and for every parameter whose grads the backward graph adds into its accumulator:
    ``"in_graph"``, and ``"auto"`` wherever it has accumulators). ``replay_backward`` is ``None``
    when nothing differentiable comes out, or nothing takes a grad.
    """

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    grad_outputs: tuple[torch.Tensor, ...]
    input_grads: tuple[torch.Tensor | None, ...]
    param_grads: tuple[torch.Tensor | None, ...]
    replay_forward: Callable[[bool], None]
    replay_backward: Callable[[], None] | None
    graphs: tuple[Any, ...] = ()  # CUDA graphs, kept alive with the plan

    def __post_init__(self) -> None:
        if len(self.input_grads) != len(self.inputs):
            raise ValueError("input_grads must line up with inputs")


@dataclass(frozen=True, eq=False)
class ParamLayout:
    """The parameters whose grads the backward computes, and how the grads reach ``.grad``.

    ``"autograd"``: the parameters are inputs of the replay's autograd Function (``edges``),
    and their grads go back through autograd, so hooks and DDP see them. The plan holds no
    parameter's ``AccumulateGrad`` node: a node kept alive keeps the stream it was made on,
    and a later capture of the same parameters (another bucket, another call of
    ``make_graphed_callables``) would have to synchronise with it inside the capture.

    ``"in_graph"``: the backward graph adds the grads into ``accumulators`` (one per
    parameter, ``None`` for an unused one); a single empty ``anchor`` tensor is the Function's
    only extra input, which keeps the replay in the autograd graph.

    ``"auto"``: both. The parameters and then the ``anchor`` are inputs of the Function (so
    ``torch.autograd.grad`` and ``backward(inputs=...)`` reach them), and the backward graph
    adds the grads into ``accumulators`` as under ``"in_graph"``. A plain ``.backward()`` that
    nothing else watches keeps that sum in ``.grad`` and hands autograd ``None`` for the
    parameters; any other backward replays into zeroed accumulators (what they held put back
    after) and hands autograd copies of the grads, as ``"autograd"`` would. The anchor's node
    tells the two kinds of backward apart. Without accumulators (tied or tensor-subclass
    parameters) ``"auto"`` hands the grads on as ``"autograd"`` does. As with ``"autograd"``,
    no parameter's ``AccumulateGrad`` node is kept.
    """

    mode: ParamGradsMode
    params: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    accumulators: tuple[torch.Tensor | None, ...]  # "in_graph", "auto": one per parameter
    anchor: torch.Tensor | None = None
    anchor_node: Any = None
    # positions among params in the order eager's backward reaches them, noted at the inspected
    # warmup (empty: not noted); "auto" and "autograd" keep it where a parameter has a hook
    grad_order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.params)
        if not (len(self.names) == len(self.accumulators) == n):
            raise ValueError("names and accumulators must line up with params")

    @property
    def edges(self) -> tuple[torch.Tensor, ...]:
        """The tensors passed to the replay Function after the inputs."""
        anchor = () if self.anchor is None else (self.anchor,)
        if self.mode == "autograd":
            return self.params
        if self.mode == "auto":
            return (*self.params, *anchor)
        return anchor


@dataclass(frozen=True, eq=False)
class ReplayPlan:
    """What one capture of one callable produced; :class:`GraphedCallable` is built from it.

    Index tuples count output tensors in the output spec's flatten order and input tensors in
    the input guard's order (args first, then kwargs). ``reach``: for each input that takes a
    grad (in that order, see ``grad_inputs``) and then each parameter of ``params``, the
    positions in ``diff_outputs`` of the outputs whose graph reaches it; ``None`` where every
    output reaches all of them (``_reach.py``).
    """

    name: str
    backend: Backend
    fn: Callable[..., Any]
    inputs: InputGuard
    outputs: TreeSpec
    diff_outputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]  # outputs the backward reads: changing them in place is refused
    # outputs other outputs are computed from: a grad watched at one of them is refused
    used_inside: tuple[int, ...]
    # outputs eager's call under no_grad gives history (the callable turns grad mode on
    # itself): such a call is refused
    records_under_no_grad: tuple[int, ...]
    # parameters and buffers (positions among module_tensors, or code_tensors for a function)
    # the backward reads: changing one in place between a replay and its backward is refused,
    # as eager refuses it
    saved_module_tensors: tuple[int, ...]
    mutated_inputs: tuple[int, ...]  # inputs the callable updates in place: copied back
    module_tensors: ModuleTensors | None
    # a function's or method's: the modules and tensors its code names (_closed_over.py),
    # checked on every call as a module's own are
    code_tensors: ModuleTensors | None
    params: ParamLayout
    buffers: StaticBuffers
    clone_outputs: bool
    autocast: tuple[Any, ...]
    numerics: tuple[Any, ...]  # _ambient.numerics_state() at capture: each call must match it
    # where it ran a convolution or an RNN (_cudnn_ops): the cuDNN settings its calls and
    # backwards compare, and their readings at capture; else None (nothing read)
    cudnn: tuple[CudnnSettings, tuple[Any, ...]] | None
    replay_hooks: ReplayHookRunner | None  # run outside the graphs around every replay
    diagnostics: CaptureDiagnostics
    reach: tuple[frozenset[int], ...] | None = None
    grad_inputs: tuple[int, ...] = ()  # the inputs the backward differentiates for
    # outputs that are, or view, other outputs or inputs in eager: handed out so
    output_aliases: OutputAliases | None = None
    # (output position, its attributes): plain values the callable set on a tensor it returns
    # (TE's fuser marks its outputs `_do_not_clear`), set again on each replay's output
    output_attributes: tuple[tuple[int, dict[str, Any]], ...] = ()
    # (input position, its attributes): plain values the callable set on an input tensor (TE's
    # fuser marks its inputs `_do_not_clear`), set again on each call's input
    input_attributes: tuple[tuple[int, dict[str, Any]], ...] = ()
    # a function's (not a module's): the tensors its code names that it updates in place
    closure_updates: tuple[tuple[str, torch.Tensor], ...] = ()
    # (position among the parameters, its __dict__, name, value): what the callable's Python
    # set on its parameters during graphing (grad_added_to_main_grad); a CUDA replay's backward
    # sets them again, as eager's backward does
    param_flags: tuple[tuple[int, dict[str, Any], str, Any], ...] = ()
    # (path, a parameter's __dict__, name, tensor, address): the tensor attributes of its
    # parameters the callable wrote into during graphing (main_grad); a CUDA graph writes there
    param_memory: tuple[tuple[str, dict[str, Any], str, torch.Tensor, int], ...] = ()
    # a function's: the tensors its code names that the backward reads (as saved_module_tensors)
    saved_closure_tensors: tuple[tuple[str, torch.Tensor], ...] = ()
    # inputs the backward reads (an input to a Linear, saved for its weight's grad): the
    # caller's tensor changed in place between a replay and its backward is refused, as eager's
    # backward raises; an input only added is not saved, and may change
    saved_inputs: tuple[int, ...] = ()
    # of mutated_inputs, those updated without a version bump (``x.data.mul_(2)``, a kernel's
    # running statistics): copied back without one, as eager moved none
    quietly_mutated_inputs: tuple[int, ...] = ()
    # the context the callable's eager twin runs in (``verify``), as on the "eager" backend:
    # a Transformer Engine autocast of its own precision, or None
    eager_context: Callable[[], AbstractContextManager[Any]] | None = None
    # whether the forward's Python read grad mode (torch.is_grad_enabled()), and the inputs
    # whose requires_grad it read: a call under no_grad, or with those inputs' requires_grad
    # other than their samples', runs eagerly (a replay would take the capture's branch)
    reads_grad_mode: bool = False
    reads_requires_grad: tuple[int, ...] = ()
    # the inputs whose grad_fn or is_leaf it read (each a leaf at capture): a call passing a
    # tensor computed under grad there (grad_fn set, not a leaf) runs eagerly
    reads_history: tuple[int, ...] = ()
    # the inputs whose requires_grad it turns on (x.requires_grad_(), counted among those read):
    # a padded call turns the caller's tensor's on before padding, as eager's call turns it on
    turns_requires_grad_on: tuple[int, ...] = ()
    # _modes.modes_meaning() at capture: the torch function and dispatch modes each call and its
    # backward must run under (a CUDA replay runs through none)
    modes: tuple[Any, ...] = ()

    @property
    def nondiff_outputs(self) -> tuple[int, ...]:
        """The outputs that take no part in backward."""
        diff = set(self.diff_outputs)
        return tuple(i for i in range(len(self.buffers.outputs)) if i not in diff)

    @property
    def has_backward(self) -> bool:
        """Whether a call under autograd hangs the outputs on a backward replay."""
        return self.buffers.replay_backward is not None
