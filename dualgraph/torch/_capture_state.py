"""What is learned about one callable while it is captured, then its :class:`ReplayPlan`.

A ``_Capture`` holds the static buffers of one callable (or of one copy of it: a replay slot)
and what its warmup and capture found: the output spec, which outputs are differentiable or
saved for backward, which inputs it updates in place, its graphs or their emulated stand-ins.
``plan()`` freezes all of it into the plan a :class:`GraphedCallable` replays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn.parameter import is_lazy

from .._errors import DualgraphError
from .._spec import TreeSpec, describe
from ._ambient import CudnnSettings, autocast_state, cudnn_settings, numerics_state
from ._capture_failure import Refused
from ._closed_over import (
    ClosureUpdates,
    class_values,
    code_tensors,
    forward_values,
)
from ._diagnostics import CaptureDiagnostics
from ._held_tensors import modules_named_by
from ._inputs import unsupported_tensor
from ._layouts import Layout, clone_placed_like, copy_laid_out, layout_of
from ._modes import modes_meaning, modes_now
from ._module_side_effects import SideEffects, globals_named
from ._output_aliases import OutputAliases
from ._params import ModuleTensors, is_tensor_subclass
from ._plan import ParamLayout, ReplayPlan, StaticBuffers
from ._probe import WarmupProbe

if TYPE_CHECKING:
    from ._capture import CaptureOptions, CaptureRequest

__all__ = ["grad_output_buffers"]


class _Capture:
    """The static buffers and facts of one callable, gathered during capture (then a plan).

    A copy made ``like`` another (a replay slot of the same callable) shares its module,
    parameters and in-graph accumulators and learns what its warmup found. One made with
    ``buffers_from`` another (a replay never in flight with it) also shares all its static
    buffers: inputs and grad outputs, and the outputs and grads its graphs copy into the
    other's (the other's graphs wrote them where they were computed).
    """

    def __init__(
        self,
        request: CaptureRequest,
        options: CaptureOptions,
        *,
        like: _Capture | None = None,
        buffers_from: _Capture | None = None,
        shared: frozenset[int] = frozenset(),
    ) -> None:
        # ``shared``: the ids of parameters that other callables captured with this one hold.
        self.request = request
        self.options = options
        self.name = request.name
        self.like = like
        self.buffers_from = buffers_from
        self.static_inputs: tuple[torch.Tensor, ...] = (
            buffers_from.static_inputs
            if buffers_from is not None
            else tuple(
                clone_placed_like(t).requires_grad_(t.requires_grad) for t in request.sample_tensors
            )
        )
        # what the callable's Python reads of the samples' attributes (x.scale) it reads there
        request.inputs.carried.give(self.static_inputs)
        self.static_args, self.static_kwargs = request.inputs.unflatten(self.static_inputs)
        self.grad_input_indices = tuple(
            i for i, t in enumerate(self.static_inputs) if t.requires_grad
        )
        self._learned_nothing_yet()
        # the plain values its Python set on its parameters during graphing (Megatron's
        # grad_added_to_main_grad), found at the end of capture: set again by CUDA replays
        self.param_flags: tuple[tuple[int, dict[str, Any], str, Any], ...] = ()
        # the tensor attributes of its parameters it wrote into (main_grad), where they were
        self.param_memory: tuple[tuple[str, dict[str, Any], str, torch.Tensor, int], ...] = ()
        self.module_tensors: ModuleTensors | None
        self.code_tensors: ModuleTensors | None
        self.closure_updates: ClosureUpdates
        self.param_names: tuple[str, ...]
        self.params: tuple[torch.Tensor, ...]
        self.accumulators: tuple[torch.Tensor | None, ...]
        self.in_graph_grads: bool  # the parameter grads go into accumulators, not autograd only
        # positions among params in the order eager's backward reaches them (_grad_order.py)
        self.grad_order: tuple[int, ...] = ()
        if like is None:
            self._own_parameters(shared)
        else:
            self.module_tensors = like.module_tensors
            self.code_tensors = like.code_tensors
            self.closure_updates = like.closure_updates
            self.param_names, self.params = like.param_names, like.params
            self.in_graph_grads = like.in_graph_grads
            self.accumulators = like.accumulators  # one .grad per parameter, whatever the copy

    def _own_parameters(self, shared: frozenset[int]) -> None:
        options = self.options
        module = self.request.module
        if module is not None:
            tensors = itertools.chain(module.named_parameters(), module.named_buffers())
            lazy = [name for name, tensor in tensors if is_lazy(tensor)]
            if lazy:
                raise Refused(
                    f"{lazy[0]} is not initialized yet (a lazy module); run the module once "
                    "before graphing it"
                )
        self.module_tensors = None
        if module is not None:
            self.module_tensors = ModuleTensors.of(module)
            # what the forwards' own code reads from its globals, checked as attributes are
            self.module_tensors.note_code_values(*forward_values(module))
            # and what they read from their modules' classes
            self.module_tensors.note_class_values(class_values(module))
        # A function's or method's: what its code names, checked per call as a module's own.
        self.code_tensors = code_tensors(self.request.fn) if module is None else None
        self.closure_updates = ClosureUpdates()  # a function's: found during capture
        named = (
            [(name, p) for name, p in module.named_parameters() if p.requires_grad]
            if module is not None
            else []
        )
        prefix = f"{type(module).__name__}." if module is not None else ""
        self.param_names = tuple(prefix + name for name, _ in named)
        self.params = tuple(p for _, p in named)
        if options.param_grads == "in_graph":
            for name, param in zip(self.param_names, self.params, strict=True):
                if param._backward_hooks or param._post_accumulate_grad_hooks:
                    raise Refused(
                        f"{name} has a grad hook, which param_grads='in_graph' would never run "
                        "(the backward graph adds the grad into .grad itself); capture with "
                        "param_grads='autograd' to use parameter hooks"
                    )
            for name, param in zip(self.param_names, self.params, strict=True):
                if param.is_complex():
                    raise Refused(
                        f"{name} is {str(param.dtype).removeprefix('torch.')}, whose grads "
                        "param_grads='in_graph' cannot add into .grad as eager does: torch adds "
                        "complex tensors as a + 1 * b, a complex product that turns the other "
                        "part of an infinite one into NaN and may flip a zero's sign, so a sum "
                        "started for a .grad that is None is not the grad eager sets it to; "
                        "capture with param_grads='auto' or 'autograd'"
                    )
                if is_tensor_subclass(param):
                    raise Refused(
                        f"{name} is a {type(param).__name__} (a tensor subclass, e.g. "
                        "Transformer Engine's FP8 weights), whose grads param_grads='in_graph' "
                        "cannot add into .grad as eager does; capture with param_grads='auto' "
                        "or 'autograd'"
                    )
        # "auto" adds grads into .grad itself only where each parameter's grad comes from this
        # callable alone. Eager sums the grads of a parameter that several callables use (tied
        # weights) before adding them to .grad; adding them one callable at a time would round
        # differently, so such callables hand their grads to autograd, which sums them first.
        # So do callables with a tensor-subclass parameter (Transformer Engine's FP8 weights):
        # eager's .grad of one is a plain tensor that AccumulateGrad makes; and with a complex
        # one: torch's complex add (a + 1 * b) keeps neither -0.0 nor an infinite part's partner
        # (inf + 1j becomes inf + nanj), so no sum started at -0.0 gives the grad itself, which
        # eager's .grad is after zero_grad(), nor does a copy made by multiplying by one.
        self.in_graph_grads = options.param_grads == "in_graph" or (
            options.param_grads == "auto"
            and not any(id(p) in shared for p in self.params)
            and not any(map(is_tensor_subclass, self.params))
            and not any(p.is_complex() for p in self.params)
        )
        given = (
            self.request.param_grad_buffers
            if options.param_grads == "in_graph"
            else self.request.param_accumulators
        )
        self.accumulators = (
            (given if given is not None else _zeros_like_each(self.params))
            if self.in_graph_grads
            else ()
        )

    def _learned_nothing_yet(self) -> None:
        # learned during warmup and capture
        self.out_spec: TreeSpec | None = None
        self.diff_outputs: tuple[int, ...] = ()
        self.saved_outputs: tuple[int, ...] = ()
        # outputs that share memory with a parameter, buffer or closed-over tensor, and layouts
        self.outside_outputs: tuple[tuple[int, Layout], ...] = ()
        self.used_inside: tuple[int, ...] = ()
        # outputs a call under no_grad gives history (the callable turns grad mode on itself)
        self.records_under_no_grad: tuple[int, ...] = ()
        # whether the forward's Python read grad mode, and which inputs' requires_grad it read
        self.reads_grad_mode = False
        # the inspected warmup ran a convolution or another op cuDNN may compute (_cudnn_ops)
        self.cudnn_ops = (False, False)  # (convolution, rnn)
        self.reads_requires_grad: tuple[int, ...] = ()
        # and of which inputs grad_fn or is_leaf (a leaf at capture, as every input is)
        self.reads_history: tuple[int, ...] = ()
        # and which inputs' requires_grad it turned on (x.requires_grad_(): padded calls)
        self.turns_requires_grad_on: tuple[int, ...] = ()
        self.saved_module_tensors: tuple[int, ...] = ()
        self.saved_closure_tensors: tuple[tuple[str, torch.Tensor], ...] = ()
        self.saved_inputs: tuple[int, ...] = ()
        self.output_aliases: OutputAliases | None = None
        # plain values the callable set on the tensors it returns: (position, attributes)
        self.output_attributes: tuple[tuple[int, dict[str, Any]], ...] = ()
        # what the callable's Python leaves on its modules, watched from call to call
        self._side_effects: SideEffects | None = None
        # plain values the callable set on its input tensors: (position, attributes)
        self.input_attributes: tuple[tuple[int, dict[str, Any]], ...] = ()
        self.reach: tuple[frozenset[int], ...] | None = None
        self.mutated: set[int] = set()
        self.mutated_quietly: set[int] = set()  # of those, updated without a version bump
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self.grad_outputs: tuple[torch.Tensor, ...] = ()
        self.input_grads: tuple[torch.Tensor | None, ...] = (None,) * len(self.static_inputs)
        self.param_grads: tuple[torch.Tensor | None, ...] = ()
        self.replay_forward: Callable[[bool], None] | None = None
        self.replay_backward: Callable[[], None] | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.seconds = 0.0
        self.pool_bytes = 0
        self.warmup_grads: tuple[torch.Tensor | None, ...] = ()
        # results_outside_pool: how the last warmup's outputs and grads were laid out (outputs
        # only with outputs_outside_pool, as the first warmup laid them out)
        self.output_layouts: tuple[Layout, ...] = ()
        self.grad_layouts: tuple[torch.Tensor | None, ...] = ()
        # issue 19 hook: the lint and the memory plan observe the first warmup iteration
        self.probe = WarmupProbe(
            self.request.name,
            self.request.fn,
            module=self.request.module,
            inputs=self.static_inputs,
            paths=self.request.inputs.paths,
            lint=self.options.lint,
            backend=self.options.backend,
            results_outside_pool=self.options.results_outside_pool,
        )

    def learn_from(self, original: _Capture) -> None:
        """Take over what the warmup of ``original`` (the same callable) found."""
        # where its warmup handed the parameter grads to autograd (see take_grad_layouts)
        self.in_graph_grads, self.accumulators = original.in_graph_grads, original.accumulators
        self.out_spec, self.diff_outputs = original.out_spec, original.diff_outputs
        self.saved_outputs = original.saved_outputs
        self.outside_outputs = original.outside_outputs
        self.used_inside = original.used_inside
        self.records_under_no_grad = original.records_under_no_grad
        self.reads_grad_mode = original.reads_grad_mode
        self.cudnn_ops = original.cudnn_ops
        self.reads_requires_grad = original.reads_requires_grad
        self.reads_history = original.reads_history
        self.turns_requires_grad_on = original.turns_requires_grad_on
        self.saved_module_tensors = original.saved_module_tensors
        self.saved_closure_tensors = original.saved_closure_tensors
        self.saved_inputs = original.saved_inputs
        self.output_aliases = original.output_aliases
        self.output_attributes = original.output_attributes
        self.input_attributes = original.input_attributes
        self.reach = original.reach
        self.grad_order = original.grad_order  # each replay's hooks in eager's order
        self.mutated = set(original.mutated)
        self.mutated_quietly = set(original.mutated_quietly)
        self.warmup_grads = original.warmup_grads
        self.output_layouts, self.grad_layouts = original.output_layouts, original.grad_layouts

    def take_grad_layouts(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Hand the parameter grads to autograd where a warmup's are not strided (sparse).

        ``nn.Embedding(sparse=True)`` and ``EmbeddingBag(sparse=True)`` give sparse grads, and
        eager's ``.grad`` is then sparse (the calls' grads concatenated): a dense accumulator
        would hand out a dense ``.grad`` of other values' rounding. ``"auto"`` therefore takes
        autograd for this callable's parameters (as ``"autograd"`` does); ``"in_graph"``,
        which only adds into dense accumulators, is refused naming the parameter.

        >>> # Embedding(10, 4, sparse=True) under "in_graph": refused, naming Embedding.weight
        """
        params = grads[len(self.grad_input_indices) :]
        for name, grad in zip(self.param_names, params, strict=True):
            if grad is None or grad.layout is torch.strided:
                continue
            if self.options.param_grads == "in_graph":
                raise Refused(
                    f"{name}: its backward gives a {grad.layout} grad (a sparse embedding), "
                    "which eager keeps as a sparse .grad; param_grads='in_graph' adds the grads "
                    "into a dense .grad: capture with param_grads='auto' or 'autograd'"
                )
            self.in_graph_grads, self.accumulators = False, ()
            return

    def take_returned_parameters(self, out_paths: Sequence[str]) -> None:
        """Hand the parameter grads to autograd where an output is a parameter requiring grad.

        The replay hands out that parameter itself (``return h, self.weight``), as eager does;
        what the loss sends to it goes to its ``.grad`` through autograd, where eager sums it
        with the callable's own grad for it before adding that to ``.grad``. Accumulators
        would add the callable's grad on their own, rounding otherwise: ``"auto"`` therefore
        takes autograd for this callable's parameters; ``"in_graph"`` is refused naming them.
        """
        aliases = self.output_aliases
        if aliases is None or not self.in_graph_grads:
            return
        step = next(
            (s for s in aliases.steps if s.parameter is not None and s.parameter.requires_grad),
            None,
        )
        if step is None:
            return
        if self.options.param_grads == "in_graph":
            name = next(
                (
                    n
                    for n, p in zip(self.param_names, self.params, strict=True)
                    if p is step.parameter
                ),
                "a parameter",
            )
            raise Refused(
                f"output{out_paths[step.output]} is the parameter {name} itself, which a replay "
                "hands out as eager does; its grad then reaches .grad through autograd, beside "
                "what param_grads='in_graph' adds into .grad in the graph, rounding otherwise "
                "than eager's one sum: capture with param_grads='auto' or 'autograd', or return "
                "a .clone() of it"
            )
        self.in_graph_grads, self.accumulators = False, ()

    def run(self) -> Any:
        """One call of the callable on the static inputs; one after the first that changes
        its modules' containers or tensor attributes again is refused (_module_side_effects)."""
        if self._side_effects is None:
            module = self.request.module
            fn = self.request.fn
            self._side_effects = (
                SideEffects([(type(module).__name__, module)])
                if module is not None
                else SideEffects(modules_named_by(fn), globals_named(fn))
            )
        return self._side_effects.run(
            lambda: self.request.hooks.call(self.request.fn, self.static_args, self.static_kwargs)
        )

    def after_backward(self) -> None:
        """After a backward of a call :meth:`run` made: one after the first call's that changed
        its modules' containers or tensor attributes (a hook its forward registered) is
        refused (_module_side_effects)."""
        if self._side_effects is not None:
            self._side_effects.after_backward()

    @property
    def fuses_accumulation(self) -> bool:
        """Whether the backward graph adds the parameter grads into the accumulators itself.

        ``"in_graph"`` always; ``"auto"`` wherever it has accumulators (its replay then either
        keeps that sum in ``.grad``, or, where autograd must see the grads, replays into zeroed
        accumulators and hands their copies on): no parameter grad buffer of its own, and one
        backward graph.
        """
        return self.options.param_grads == "in_graph" or (
            self.options.param_grads == "auto" and self.in_graph_grads
        )

    @property
    def fused_accumulators(self) -> tuple[torch.Tensor | None, ...]:
        """The accumulators the backward graph itself adds into (see :attr:`fuses_accumulation`)."""
        return self.accumulators if self.fuses_accumulation else ()

    @property
    def backward_outputs(self) -> tuple[int, ...]:
        """The positions among :attr:`diff_outputs` of the outputs the backward differentiates:
        those the replay hands out as its own (see :attr:`OutputAliases.handed_out`).

        ``return h, x[0]`` differentiates ``h`` alone: ``x[0]`` is handed out as a view of the
        caller's ``x``, which takes its grad directly, as eager's does.
        """
        aliases = self.output_aliases
        if aliases is None:
            return tuple(range(len(self.diff_outputs)))
        handed = aliases.handed_out
        return tuple(k for k, i in enumerate(self.diff_outputs) if i not in handed)

    def diff_inputs(self) -> tuple[torch.Tensor, ...]:
        """What the backward differentiates for: inputs that require grad, then parameters."""
        return tuple(self.static_inputs[i] for i in self.grad_input_indices) + self.params

    def record_outputs(self, outputs: Any) -> list[torch.Tensor]:
        """The output tensors, checked; the first call fixes the spec, later ones must match it."""
        known = self.out_spec
        if known is not None and not self.options.results_outside_pool:
            # Later calls (warmup, capture): one pass of the spec's compiled check (structure,
            # constants, shapes, dtypes) and the grad flags, instead of describing them anew.
            try:
                flat = known.flatten(outputs, check=True)
            except DualgraphError:
                flat = None
            if (
                flat is not None
                and all(isinstance(t, torch.Tensor) and unsupported_tensor(t) is None for t in flat)
                and tuple(t.requires_grad for t in flat) == known.grad_mask
            ):
                return flat
        spec = describe(outputs, root="output")
        flat = spec.flatten(outputs)
        for path, leaf in zip(spec.array_paths, flat, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise Refused(
                    f"output{path}: expected a torch tensor, got "
                    f"{type(leaf).__module__}.{type(leaf).__qualname__} (outputs of a torch "
                    "callable hold tensors, None and int/float/bool/str constants)"
                )
            why = unsupported_tensor(leaf)
            if why is not None:
                raise Refused(f"output{path}: a graph cannot return {why}")
        if self.options.results_outside_pool or self.options.outputs_outside_pool:
            self.output_layouts = tuple(map(layout_of, flat))
        if self.out_spec is None:
            self.out_spec = spec
            self.diff_outputs = tuple(i for i, grad in enumerate(spec.grad_mask) if grad)
        elif spec != self.out_spec:
            raise Refused(
                f"the outputs differ from one call to the next ({self.out_spec!r}, then "
                f"{spec!r}); a graph replays one call's structure"
            )
        return flat

    def grad_buffers(self, grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """Static buffers (outside any pool) for grads laid out like ``grads``, ``None`` for none.

        Parameter grads go into the given ``param_grad_buffers``; where the backward adds them into
        the accumulators itself (:attr:`fuses_accumulation`) the entry is the accumulator.
        """
        n = len(self.grad_input_indices)
        given = self.request.param_grad_buffers
        buffers: list[torch.Tensor | None] = []
        for k, grad in enumerate(grads):
            if grad is None:
                buffers.append(None)
            elif k >= n and self.fuses_accumulation:
                buffers.append(self.accumulators[k - n])
            elif k >= n and given is not None and grad.layout is torch.strided:
                buffers.append(given[k - n])  # (a sparse grad gets a sparse buffer of its own)
            else:
                buffers.append(torch.zeros_like(grad))
        return tuple(buffers)

    def keep_grads(
        self, grads: Sequence[torch.Tensor | None], buffers: Sequence[torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, ...]:
        """Copy ``grads`` into their :meth:`grad_buffers` (in the backward graph); the buffers."""
        # Where accumulation is fused, the parameter grads were added into the accumulators already.
        copied = len(self.grad_input_indices) if self.fuses_accumulation else None
        for k, (buffer, grad) in enumerate(zip(buffers, grads, strict=True)):
            if (grad is None) != (buffer is None):
                raise Refused(
                    "the captured backward gives grads to other inputs or parameters than the "
                    "warmup did; a graph replays one call's structure"
                )
            if grad is not None and buffer is not None and (copied is None or k < copied):
                buffer.copy_(grad)
        return tuple(buffers)

    def place_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Spread the grads of :meth:`diff_inputs` over the inputs and the parameters."""
        n = len(self.grad_input_indices)
        input_grads: list[torch.Tensor | None] = [None] * len(self.static_inputs)
        for i, grad in zip(self.grad_input_indices, grads[:n], strict=True):
            input_grads[i] = grad
        self.input_grads = tuple(input_grads)
        param_grads = tuple(grads[n:])
        if not self.fuses_accumulation:
            self.param_grads = param_grads
        if self.accumulators:  # as with autograd, a parameter the callable does not use keeps
            self.accumulators = tuple(  # .grad None
                acc if grad is not None else None
                for acc, grad in zip(self.accumulators, param_grads, strict=True)
            )
        donor = self.buffers_from
        if donor is not None:  # the grads were copied into the donor's buffers
            self.input_grads, self.param_grads = donor.input_grads, donor.param_grads

    def copy_into_donor(
        self, outputs: Sequence[torch.Tensor] = (), grads: Sequence[torch.Tensor | None] = ()
    ) -> None:
        """Copy outputs, or the grads of :meth:`diff_inputs`, into the donor's static buffers.

        Captured into this copy's graphs, so that its replays leave their results where the
        donor's do (with no donor, nothing to do).
        """
        donor = self.buffers_from
        if donor is None:
            return
        for static, output in zip(donor.static_outputs, outputs, strict=False):
            copy_laid_out(static, output.detach())  # (an expanded one through one slice)
        targets: list[torch.Tensor | None] = [donor.input_grads[i] for i in self.grad_input_indices]
        if not self.fuses_accumulation:
            targets += donor.param_grads
        for target, grad in zip(targets, grads, strict=False):
            if target is not None and grad is not None:
                target.copy_(grad)

    def plan(self) -> ReplayPlan:
        assert self.out_spec is not None and self.replay_forward is not None
        options = self.options
        params = self.params
        if not self._has_backward():
            self.replay_backward = None
            self.accumulators = ()
        if options.param_grads == "auto":
            # The anchor tells a plain .backward() from the others (GraphedCallable
            # ._is_plain_backward): needed where parameter grads are computed.
            anchor = (
                torch.empty(0, device=params[0].device, requires_grad=True)
                if params and self.replay_backward is not None
                else None
            )
            layout = ParamLayout(
                mode="auto",
                params=params,
                names=self.param_names,
                accumulators=self.accumulators or (None,) * len(params),
                anchor=anchor,
                anchor_node=None if anchor is None else get_gradient_edge(anchor).node,
                grad_order=self.grad_order,
            )
            param_grads = self.param_grads or (None,) * len(params)
        elif options.param_grads == "autograd":
            layout = ParamLayout(
                mode="autograd",
                params=params,
                names=self.param_names,
                accumulators=(None,) * len(params),
                grad_order=self.grad_order,
            )
            param_grads = self.param_grads or (None,) * len(params)
        else:
            anchor = torch.empty(0, device=params[0].device, requires_grad=True) if params else None
            layout = ParamLayout(
                mode="in_graph",
                params=params,
                names=self.param_names,
                accumulators=self.accumulators or (None,) * len(params),
                anchor=anchor,
                anchor_node=None if anchor is None else get_gradient_edge(anchor).node,
            )
            param_grads = (None,) * len(params)
        buffers = StaticBuffers(
            inputs=self.static_inputs,
            outputs=self.static_outputs,
            grad_outputs=self.grad_outputs,
            input_grads=self.input_grads,
            param_grads=param_grads,
            replay_forward=self.replay_forward,
            replay_backward=self.replay_backward,
            graphs=tuple(self.graphs),
        )
        kept_grads = [g for g in (*self.input_grads, *param_grads) if g is not None]
        kept_grads += [a for a in layout.accumulators if a is not None]
        diagnostics = CaptureDiagnostics(
            name=self.name,
            backend=options.backend,
            static_input_bytes=_bytes(self.static_inputs),
            static_output_bytes=_bytes(self.static_outputs),
            static_grad_bytes=_bytes([*self.grad_outputs, *kept_grads]),
            pool_bytes=self.pool_bytes,
            capture_seconds=self.seconds,
            has_backward_graph=buffers.replay_backward is not None,
        )
        return ReplayPlan(
            name=self.name,
            backend=options.backend,
            fn=self.request.fn,
            inputs=self.request.inputs,
            outputs=self.out_spec,
            diff_outputs=self.diff_outputs,
            saved_outputs=self.saved_outputs,
            used_inside=self.used_inside,
            records_under_no_grad=self.records_under_no_grad,
            reads_grad_mode=self.reads_grad_mode,
            reads_requires_grad=self.reads_requires_grad,
            reads_history=self.reads_history,
            turns_requires_grad_on=self.turns_requires_grad_on,
            saved_module_tensors=self.saved_module_tensors,
            saved_closure_tensors=self.saved_closure_tensors,
            saved_inputs=self.saved_inputs,
            output_aliases=self.output_aliases,
            output_attributes=self.output_attributes,
            input_attributes=self.input_attributes,
            mutated_inputs=tuple(sorted(self.mutated)),
            quietly_mutated_inputs=tuple(sorted(self.mutated_quietly)),
            module_tensors=self.module_tensors,
            code_tensors=self.code_tensors,
            closure_updates=self.closure_updates.updated,
            param_flags=self.param_flags,
            param_memory=self.param_memory,
            params=layout,
            buffers=buffers,
            clone_outputs=options.clone_outputs,
            autocast=autocast_state(),
            numerics=numerics_state(),
            cudnn=self._cudnn_settings(),
            modes=modes_meaning(modes_now()),
            replay_hooks=self.request.hooks.replay,
            eager_context=self.request.hooks.run_eager,
            diagnostics=diagnostics,
            reach=self.reach,
            grad_inputs=self.grad_input_indices,
        )

    def _cudnn_settings(self) -> tuple[CudnnSettings, tuple[Any, ...]] | None:
        """The cuDNN settings its replays compare, and their readings now (``None`` where it
        ran no convolution or RNN)."""
        convolution, rnn = self.cudnn_ops
        settings = cudnn_settings(convolution=convolution, rnn=rnn)
        return None if settings is None else (settings, settings.read())

    def _has_backward(self) -> bool:
        if not self.backward_outputs or self.replay_backward is None:
            return False
        grads = (*self.input_grads, *self.param_grads, *self.accumulators)
        return any(g is not None for g in grads)


def grad_output_buffers(item: _Capture, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The static grad-output buffers: new, or those of the copy ``item`` shares buffers with."""
    donor = item.buffers_from
    if donor is not None and donor.grad_outputs:
        return donor.grad_outputs
    return tuple(torch.empty_like(flat[i].detach()) for i in item.diff_outputs)


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _zeros_like_each(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A zeroed tensor like each of ``tensors``, zeroed in one batched call (one kernel launch
    for all of them on a GPU, where ``zeros_like`` launches one each).

    >>> [t.tolist() for t in _zeros_like_each([torch.ones(2), torch.ones(1, dtype=torch.int64)])]
    [[0.0, 0.0], [0]]
    """
    made = [torch.empty_like(t) for t in tensors]
    if made:
        torch._foreach_zero_(made)
    return tuple(made)
