"""What happens on every call of a graphed callable (the hot path).

A call checks its inputs, the module's parameters and the ambient state (autocast, TE's FP8
autocast) against the plan, copies the inputs into the static input buffers, replays the
forward and hands back the static outputs, rebuilt into the captured output tree (``None``
leaves and constants restored). Under autograd the replay is one :class:`torch.autograd.Function`
whose backward copies the incoming grads into the static grad buffers, replays the backward and
hands the grads on as eager would: input grads as tensors of their own, parameter grads to
``.grad``, either through autograd or, where nothing needs them to pass through autograd
(``param_grads="auto"`` in a plain ``.backward()``, or ``"in_graph"``), added into ``.grad``
by a graph. Everything a call needs was fixed at capture, in the :class:`ReplayPlan`
(``_capture.py`` builds it). What it calls as its graphs is in ``_replay_backends.py``, the
autograd Function in ``_replay_function.py``, and the checks of ``.grad`` its backward makes
in ``_grad_checks.py``.

The plan's replay hooks (``_replay_hooks.py``) run around the forward and the backward replay
(``after_backward`` once the parameter grads that a graph adds are in ``.grad``); Transformer
Engine's FP8 autocast check and bookkeeping are among them (``_te_precision.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import operator
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.autograd.graph as _autograd_graph
from torch.utils._pytree import tree_leaves as _tree_leaves

from .._errors import DualgraphError, SpecMismatchError
from .._spec import TreeSpec
from ._address_ranges import StorageIndex, first_sharing, memory_of, storage_spans
from ._ambient import (
    BACKWARD_ENTRIES,
    autocast_state,
    backward_numerics,
    numerics_difference,
    show_autocast,
)
from ._ambient import ddp_is_running as _ddp_is_running
from ._ambient import numerics_readings as _numerics_readings
from ._ambient import numerics_state as _numerics_state
from ._ambient import state_of as _state_of
from ._carried_attributes import dict_of as _dict_of
from ._chains import Chain
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._eager_graphs import EagerGraphs
from ._grad_checks import aliases as _aliases
from ._grad_checks import grad_accumulator as _grad_accumulator
from ._grad_checks import grad_problem as _grad_problem
from ._grad_checks import grads_overlap as _grads_overlap
from ._grad_checks import holders as _holders
from ._grad_checks import in_place_refusal as _in_place_refusal
from ._grad_checks import span as _span
from ._grad_checks import will_engine_execute_node as _will_engine_execute_node
from ._grad_checks import will_execute_or_capture as _will_execute_or_capture
from ._grad_order import views_in_order
from ._inputs import own_parameter_at, own_parameter_passed
from ._layout_checks import Layouts
from ._layouts import copier_of
from ._modes import dispatch_modes_now, modes_meaning, of_dispatch, show_modes
from ._modes import modes_now as _modes_now
from ._nesting import SCOPE as _SCOPE
from ._nesting import called_again_inside, inside_another
from ._node_hooks import HeldNodes, node_hook_dicts
from ._params import ModuleTensors, own_changes_taken_of, requires_grad_changed
from ._plan import ReplayPlan
from ._pool_order import PoolPlace
from ._replay_backends import EmulatedReplay
from ._replay_function import REPLAY_BACKWARD as _REPLAY_BACKWARD
from ._replay_function import SecondBackwardError, watch_handed_out
from ._replay_function import apply_replay as _apply_replay
from ._replay_hooks import ReplayCall, call_eagerly
from ._saved_hooks import saved_copies_kept
from ._sum_start import SumStart
from ._sum_start import start_sums as _start_sums
from ._unreached_hooks import quiet_hooks as _quiet_hooks

__all__ = ["GraphedCallable", "traced_call_refused"]

_detach = torch.Tensor.detach
_chain = itertools.chain
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
# the mode stacks' depths: both 0 (no torch function or dispatch mode) on nearly every call
_function_depth = torch._C._len_torch_function_stack
_dispatch_depth = torch._C._len_torch_dispatch_stack
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_size = torch.Tensor.size
_current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward
_increment_version = torch._C._increment_version  # (tensors): as an in-place op does to each
_is = operator.is_
_refcount = sys.getrefcount
_use_count = torch.Tensor._use_count  # type: ignore[attr-defined]
_storage_use_count = torch._C._storage_Use_Count
# A parameter's grad_dtype (the dtype a new .grad must have; None: any), where torch has it
_has_grad_dtype = hasattr(torch.Tensor, "grad_dtype")
_grad_dtype = operator.attrgetter("grad_dtype") if _has_grad_dtype else (lambda _: None)
_grad = operator.attrgetter("grad")
_version = operator.attrgetter("_version")
_tensor_hooks = operator.attrgetter("_backward_hooks")
_requires_grad = operator.attrgetter("requires_grad")
_post_accumulate_hooks = operator.attrgetter("_post_accumulate_grad_hooks")
_is_anomaly_enabled = torch.is_anomaly_enabled
_is_anomaly_check_nan_enabled = torch.is_anomaly_check_nan_enabled
_in_graph_flags = operator.attrgetter(
    "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"
)


def _flags_chain(params: Sequence[torch.Tensor]) -> Callable[[], bool]:
    """Whether each of ``params`` is trainable with no tensor or post-accumulate hook (what
    ``_in_graph_flags`` reads as ``(True, None, None)``), as one chain of tests."""
    chain = Chain()
    for param in params:
        chain.test(
            "{}.requires_grad is True and {}._backward_hooks is None "
            "and {}._post_accumulate_grad_hooks is None",
            param,
            param,
            param,
        )
    return chain.compiled()


_is_any_autocast_enabled = getattr(
    torch._C, "_is_any_autocast_enabled", lambda: autocast_state() != ()
)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_NONE: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
_are_functorch_transforms_active = torch._C._are_functorch_transforms_active
_get_tracing_state = torch._C._get_tracing_state


def traced_call_refused(name: str) -> DualgraphError:
    """The refusal of a call under ``torch.jit.trace``, which would keep a replay's buffers as
    constants: the traced callable would give the traced call's results for every input."""
    return DualgraphError(
        f"{name}: called under torch.jit.trace; a replay copies the inputs into fixed buffers "
        "and hands out fixed buffers, which the trace would keep as constants (the traced "
        "callable would give this call's results for every input). Trace the module restored "
        "(dualgraph.torch.restore) or a copy of it (copy.deepcopy: copies run eagerly)"
    )


class _RefusedBeforeReplay(DualgraphError):
    """A backward refused before any graph replayed or any ``.grad`` was added to."""


class _RanInsideDdp:
    """Whether a forward of one graphed callable ran inside DDP's forward ("in_graph").

    One for every replay of the callable (its shape buckets, its slots): DDP manages the
    parameters they share, whichever graph the forward replayed.
    """

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False


class GraphedCallable:
    """A captured callable; calling it replays (see the module docstring).

    Built complete from a :class:`ReplayPlan` by :func:`dualgraph.torch.make_graphed_callables`.
    ``copy.copy``, ``copy.deepcopy`` and pickling give the ungraphed callable instead (an
    :class:`EagerCallable` of a copy of the function): a copy never shares static buffers.
    """

    __slots__ = (
        "_accumulator_layouts",
        "_accumulator_names",
        "_accumulator_positions",
        "_accumulator_spans",
        "_accumulators",
        "_aliases",
        "_ambient_checks",
        "_anchor_none",
        "_attributes_set",
        "_auto",
        "_autocast",
        "_backward_checks",
        "_backward_generation",
        "_captured_input_grads",
        "_carried",
        "_carried_any",
        "_checked_without_grad",
        "_clone_outputs",
        "_copiers",
        "_cudnn",
        "_cudnn_read",
        "_cut_copies",
        "_ddp",
        "_ddp_check",
        "_dispatch_modes",
        "_edge_nones",
        "_edges",
        "_edges_after_params",
        "_emulated",
        "_expired_nodes",
        "_first_param",
        "_flags_judged",
        "_flags_read",
        "_generation",
        "_grad_dtypes",
        "_grad_output_indices",
        "_grad_outputs",
        "_grad_outputs_taken",
        "_graph_grads",
        "_graph_grads_places",
        "_has_backward",
        "_held_nodes",
        "_history_read",
        "_holder_baseline",
        "_holder_probes",
        "_holder_totals_baseline",
        "_hooks",
        "_hooks_read_per_call",
        "_identities_checked",
        "_in_graph_accumulators",
        "_in_graph_expected",
        "_in_graph_params",
        "_input_grads",
        "_input_only_outputs",
        "_inputs",
        "_later_index",
        "_later_outputs_of",
        "_lock",
        "_modes",
        "_modes_read",
        "_module_storages",
        "_module_tensors",
        "_mutated",
        "_mutated_quietly",
        "_names_of",
        "_no_grads",
        "_node_hooked",
        "_nodes",
        "_nodes_watched",
        "_nondiff_outputs",
        "_numerics",
        "_numerics_read",
        "_other_uses",
        "_out_spec",
        "_output_reach",
        "_output_storages",
        "_output_versions",
        "_overwritten_outputs",
        "_own_params_checked",
        "_param_flags",
        "_param_grads",
        "_param_inputs",
        "_param_memory",
        "_params",
        "_params_unwatched",
        "_params_watched",
        "_plan_params",
        "_plan_params_unwatched",
        "_pool",
        "_reach_of_inputs",
        "_reach_of_params",
        "_reaching_every_output",
        "_read_by_backward",
        "_read_by_backward_names",
        "_reads_grad_mode",
        "_records_under_no_grad",
        "_replay_backward",
        "_replay_call",
        "_replay_forward",
        "_replayed_in_backward",
        "_returned_inputs",
        "_saved_inputs",
        "_saved_mutated",
        "_saved_outputs",
        "_sentinel_node",
        "_sentinel_param",
        "_static_inputs",
        "_static_outputs",
        "_storage_ids",
        "_storages",
        "_sum_start",
        "_sums_in_place",
        "_unreached_memo",
        "_unwatched",
        "_updated_storages",
        "_used_inside",
        "_used_inside_replaced",
        "_views_made_first",
        "backend",
        "diagnostics",
        "name",
        "plan",
    )

    def __init__(
        self,
        plan: ReplayPlan,
        *,
        lock: threading.Lock | None = None,
        other_uses: EagerGraphs | None = None,
        pool: PoolPlace | None = None,
    ) -> None:
        # ``lock``: one shared by callables whose graphs share activations (shape buckets), so
        # that no two of them replay at once. ``other_uses``: see _params_used_elsewhere.
        # ``pool``: its place among callables graphed together into one pool (whose lock it
        # then takes), whose replays may expire its pending backward (``_pool_order.py``).
        buffers, params = plan.buffers, plan.params
        self.plan = plan
        self.name = plan.name
        self.backend = plan.backend
        self.diagnostics: CaptureDiagnostics = dataclasses.replace(plan.diagnostics)
        self._inputs = plan.inputs
        # What each call checks: the module's own tensors, or those a function's code names.
        self._module_tensors = (
            plan.module_tensors if plan.module_tensors is not None else plan.code_tensors
        )
        self._out_spec = plan.outputs
        # Outputs that are, or view, other outputs or inputs in eager (None: none are).
        self._aliases = plan.output_aliases
        # plain values the callable set on the tensors it takes and returns, set on each call's
        # again: (on an output, position, attributes); one tuple, one test per call for both
        self._attributes_set = (
            *((False, i, a) for i, a in plan.input_attributes),
            *((True, k, a) for k, a in plan.output_attributes),
        )
        # the public attributes of the samples' tensors (x.scale), which the callable's Python
        # read at capture: a call's must be the same (names it sets on an input itself aside)
        self._carried = plan.inputs.carried
        self._carried_any = self._carried.any_expected
        for i, attributes in plan.input_attributes:
            self._carried.ignore(i, attributes)
        self._static_inputs = buffers.inputs
        self._static_outputs = buffers.outputs
        self._replay_forward = buffers.replay_forward
        if self._module_tensors is not None and isinstance(
            getattr(buffers.replay_forward, "__self__", None), EmulatedReplay
        ):
            # "emulate" re-runs the forward's Python, which may set numbers on its modules (a
            # counter) that a graph never would: they are no change of the caller's.
            self._replay_forward = _taking_own_changes(buffers.replay_forward, self._module_tensors)
        self._replay_backward = buffers.replay_backward
        # "emulate": its backward differentiates with the incoming grads themselves (see
        # EmulatedReplay.backward), so that it is eager's bit for bit whatever their layout.
        owner = getattr(buffers.replay_backward, "__self__", None)
        self._emulated = owner if isinstance(owner, EmulatedReplay) else None
        self._has_backward = plan.has_backward
        self._nondiff_outputs = plan.nondiff_outputs
        self._grad_outputs = tuple(zip(buffers.grad_outputs, plan.diff_outputs, strict=True))
        # Those the backward differentiates: an output handed out as another tensor (an input,
        # a view of one or of another output: ``OutputAliases.handed_out``) takes its grad
        # there, never through the replay, and the graphs leave it out (as eager's backward
        # never sees it); its static grad is never read, so never written.
        handed = frozenset() if plan.output_aliases is None else plan.output_aliases.handed_out
        self._grad_outputs_taken = tuple(
            (static, index) for static, index in self._grad_outputs if index not in handed
        )
        self._grad_output_indices = tuple(index for _, index in self._grad_outputs_taken)
        self._edges = params.edges
        self._input_grads = tuple(
            (1 + i, grad) for i, grad in enumerate(buffers.input_grads) if grad is not None
        )
        # Positions among the Function's inputs (and so its grads): the callable itself, the
        # input tensors, then the edge tensors (the parameters, or the in-graph anchor).
        self._first_param = 1 + len(buffers.inputs)
        self._edge_nones = (None,) * len(self._edges)
        through_autograd = params.mode != "in_graph"  # parameters are Function inputs
        self._params = params.params if through_autograd else ()
        # Where a parameter has a hook at a forward, the edges to the parameters go through
        # views made in this order, so that its backward reaches them in eager's order
        # (_grad_order.py; None: one parameter, or no order noted).
        reached = params.grad_order
        self._views_made_first: tuple[int, ...] | None = None
        if len(self._params) > 1 and reached:
            unreached = [i for i in range(len(self._params)) if i not in reached]
            self._views_made_first = (*unreached, *reversed(reached))
        self._edges_after_params = self._edges[len(self._params) :]  # "auto": the anchor
        # Whether a parameter has a hook: "autograd" (and "auto" without accumulators) reads
        # it at each forward (its host path is autograd's anyway); "auto" at its first
        # forward, then from each plain backward's look at the hooks (_nothing_watches_params),
        # which costs no forward a pass (None: not read yet).
        self._hooks_read_per_call = params.mode == "autograd" or not (
            params.mode == "auto" and any(a is not None for a in params.accumulators)
        )
        self._params_watched: bool | None = None
        # A tuple of its own (the plan holds another): a static grad referenced from Python only
        # through one container could count as unreferenced, and AccumulateGrad would steal it.
        self._param_grads = tuple([*buffers.param_grads]) if through_autograd else ()
        # "auto": the anchor comes last among the Function's inputs, after the parameters.
        self._anchor_none = (None,) if params.mode == "auto" and params.anchor is not None else ()
        # A leaf node that runs in every ``.backward()`` through a replay, and never in
        # ``torch.autograd.grad``: see ``_is_plain_backward``. The anchor's node ("in_graph",
        # "auto") is ours to keep; a parameter's is looked up during the backward (when the
        # replay's graph holds it): kept here, it would outlive the step with the stream it was
        # made on.
        self._sentinel_node = params.anchor_node if params.mode != "autograd" else None
        self._sentinel_param = (
            self._params[0] if params.mode == "autograd" and self._params else None
        )
        self._accumulators = tuple(
            (param, accumulator, name)
            for param, accumulator, name in zip(
                params.params, params.accumulators, params.names, strict=True
            )
            if accumulator is not None
        )
        # Where each accumulator's parameter lies among the parameters (for "auto"'s copies).
        self._accumulator_positions = tuple(
            i for i, accumulator in enumerate(params.accumulators) if accumulator is not None
        )
        # "auto" with accumulators: the backward graph adds the parameter grads into them, and a
        # backward either keeps that sum in .grad or hands autograd copies (_backward_into_copies)
        self._auto = params.mode == "auto" and bool(self._accumulators)
        self._saved_outputs = () if plan.clone_outputs else plan.saved_outputs
        # Outputs other outputs are computed from: eager's grad at one includes theirs share.
        self._used_inside = plan.used_inside
        # Of those, the ones handed out as another tensor (a view of an input or of another
        # output, made after the replay): that tensor is what a hook or retain_grad is put on.
        self._used_inside_replaced = tuple(k for k in plan.used_inside if k in handed)
        # Outputs eager's call under no_grad gives history (the callable enables grad itself).
        self._records_under_no_grad = plan.records_under_no_grad
        # The forward's Python branches on grad mode, or on some inputs' requires_grad (their
        # positions and their samples'): a call where eager's branch may differ from the
        # capture's runs eagerly (_eagerly). One test each on the way of a call.
        self._reads_grad_mode = plan.reads_grad_mode
        self._checked_without_grad = bool(plan.records_under_no_grad) or plan.reads_grad_mode
        self._flags_read = (
            tuple((i, plan.inputs.requires_grad[i]) for i in plan.reads_requires_grad) or None
        )
        # Of these, those whose grad_fn or is_leaf it read: each a leaf at capture, so a call's
        # tensor computed under grad (not a leaf) takes eager's other branch.
        self._history_read = plan.reads_history or None
        # Set by a shape bucket around a padded call it judged on the caller's tensors (the
        # padded copies are no leaves, and require no grad under no_grad): not judged again.
        self._flags_judged = False
        # A call passing one tensor at several inputs runs eagerly too: its Python may tell
        # them apart by identity (nn.MultiheadAttention packs its projections where query is
        # key), where the replay's inputs are buffers of their own, distinct at capture.
        # How many input tensors a call passes where there are two or more (else 0).
        count = len(plan.inputs.paths)
        self._identities_checked = count if count > 1 else 0
        # And so does one passing a parameter whose grad the backward graph adds into .grad
        # ("auto", "in_graph") as an input requiring grad, itself or a view of it: eager sums
        # that use's grad with the callable's own before adding the sum into .grad, where the
        # graph adds its share and autograd the input's after it, which rounds otherwise (from
        # the second accumulation on). The inputs whose samples required grad (a call's others
        # may not, under grad) and the ids of those parameters; None where there are none.
        added = (
            [param for param, _, _ in self._accumulators]
            if plan.has_backward and params.mode != "autograd"
            else []
        )
        positions = tuple(i for i, grad in enumerate(plan.inputs.requires_grad) if grad)
        self._own_params_checked = (
            (positions, frozenset(map(id, added))) if added and positions else None
        )
        if other_uses is None and self._auto:
            # the graphs of its calls run eagerly (_eagerly; a module's forward in the other
            # training mode) give the parameters grads too
            other_uses = EagerGraphs()
        self._other_uses = other_uses
        # The parameters and buffers the backward graph reads (where eager saves them): changed
        # in place before the backward, eager raises, and a graph would read the new values. A
        # function's module tensors are those its code names; the plan's saved_closure_tensors
        # add what else its code reaches (a module's plain tensor attributes, a cache).
        tensors = self._module_tensors
        read: dict[int, tuple[str, torch.Tensor]] = {}
        if tensors is not None:
            for i in plan.saved_module_tensors:
                read.setdefault(id(tensors.tensors[i]), (tensors.names[i], tensors.tensors[i]))
        for name, tensor in plan.saved_closure_tensors:
            read.setdefault(id(tensor), (name, tensor))
        self._read_by_backward = tuple(tensor for _, tensor in read.values())
        self._read_by_backward_names = tuple(name for name, _ in read.values())
        # The inputs the backward reads (found at warmup among what autograd saves): each
        # replay's node keeps the caller's tensors' versions, compared at its backward.
        self._saved_inputs = plan.saved_inputs
        # the inputs needing grad when it was seen which of them the backward reads
        self._captured_input_grads = plan.inputs.requires_grad
        # Of those, inputs the callable updates: their versions are taken after the copy back.
        self._saved_mutated = bool(set(plan.saved_inputs) & set(plan.mutated_inputs))
        self._output_versions: tuple[int, ...] = ()
        # Copies of saved outputs a padded call of buckets= handed out (note_cut_copies), weakly,
        # with their versions then: changed in place, eager's backward would raise.
        self._cut_copies: tuple[tuple[int, weakref.ref[torch.Tensor], int], ...] = ()
        self._mutated = plan.mutated_inputs
        self._mutated_quietly = frozenset(plan.quietly_mutated_inputs)
        self._clone_outputs = plan.clone_outputs
        # clone_outputs: each output copied laid out as eager's (a non-dense view, a conj bit)
        self._copiers = tuple(map(copier_of, self._static_outputs)) if plan.clone_outputs else ()
        # What a replay overwrites that the caller may hold: the outputs, unless they are clones.
        self._overwritten_outputs = () if plan.clone_outputs else self._static_outputs
        self._autocast = plan.autocast
        self._numerics = plan.numerics
        # cuDNN's settings at capture, for a callable that ran a cuDNN op (else None: not read)
        self._cudnn: tuple[Any, ...] | None = None
        self._cudnn_read: Callable[[], tuple[Any, ...]] | None = None
        if plan.cudnn is not None:
            self._cudnn_read, self._cudnn = plan.cudnn[0].read, plan.cudnn[1]
        # Getters' readings found to mean the captured settings (_ambient.numerics_readings):
        # a call that reads the same compares those alone.
        self._numerics_read: tuple[Any, ...] = ()
        # The torch function and dispatch modes of capture (_modes.py), and the mode objects last
        # found to mean them: a call under the same objects compares those alone.
        self._modes = plan.modes
        self._modes_read: tuple[Any, ...] = (None,)  # none yet: no stack of modes reads so
        # of those, the dispatch modes: a backward's kernels run through these alone
        self._dispatch_modes = of_dispatch(plan.modes)
        self._hooks = plan.replay_hooks
        self._replay_call: ReplayCall | None = None  # the hooks' view of the replay in flight
        # What the backward's Python set on the parameters at capture (Megatron's
        # grad_added_to_main_grad, read by its grad hook): a CUDA graph runs no Python, so its
        # backward replays set them; "emulate" runs the Python itself.
        self._param_flags = plan.param_flags if plan.backend == "cuda" else ()
        # The tensors of the parameters' own the graphs write into (main_grad), checked per
        # call: one rebound or moved since would miss the graph's grads, where eager's go there.
        self._param_memory = plan.param_memory if plan.backend == "cuda" else ()
        self._in_graph_params = tuple(entry[0] for entry in self._accumulators)
        self._plan_params = params.params if params.mode == "in_graph" else ()
        self._in_graph_expected = ((True, None, None),) * len(self._plan_params)
        # trainable, no tensor hook, no post-accumulate hook: what each parameter's flags read
        # when nothing watches it (_nothing_watches_params)
        self._unwatched = ((True, None, None),) * len(self._params)
        self._in_graph_accumulators = tuple(entry[1] for entry in self._accumulators)
        # The memory the backward graph adds into, as aliases of their own: an accumulator
        # handed out as .grad is the user's to move (``grad.data = bucket_view``, as DeepSpeed's
        # contiguous gradients do, or ``set_``) while staying .grad, and a graph adds where it
        # was at capture. Made before the holder counts below, which count them.
        self._graph_grads = tuple(map(_detach, self._in_graph_accumulators))
        # Their start at -0.0 where a .grad is None, in one kernel per dtype (_sum_start.py);
        # its views of that memory count among the holders from now on, as the aliases do.
        self._sum_start = SumStart(self._graph_grads)
        # Their addresses, and their sizes and strides (in one C call, _layout_checks.py): what
        # _backward_into_accumulators compares the accumulators' with (a .grad whose .data is a
        # prefix of its own memory keeps its address and strides).
        self._graph_grads_places = tuple(map(_data_ptr, self._graph_grads))
        self._accumulator_layouts = Layouts(
            self._in_graph_accumulators,
            tuple(map(_size, self._graph_grads)),
            tuple(map(_stride, self._graph_grads)),
        )
        self._accumulator_names = tuple(f"{self.name}: {entry[2]}" for entry in self._accumulators)
        # The usual answers of the backward's per-parameter passes, as chains of tests
        # (_chains.py): each parameter's flags as _unwatched (and _in_graph_expected) says, and
        # every .grad its accumulator where the graph adds (_backward_into_accumulators)
        self._params_unwatched = _flags_chain(self._params)
        self._plan_params_unwatched = _flags_chain(self._plan_params)
        # (the accumulators read from their tuple: a reference to each would count among its
        # holders, which the backward compares with their counts now)
        sums = Chain()
        held = sums.bind(self._in_graph_accumulators)
        for i, param in enumerate(self._in_graph_params):
            sums.tests.append(f"{sums.bind(param)}.grad is {held}[{i}]")
        for i, place in enumerate(self._graph_grads_places):
            sums.tests.append(f"_data_ptr({held}[{i}]) == {sums.bind(place)}")
        if self._accumulators:
            sums.test("{}.same()", self._accumulator_layouts)
        self._sums_in_place = sums.compiled()
        self._ddp_check = params.mode == "in_graph" and bool(self._accumulators)
        # A parameter's AccumulateGrad node kept with a hook on it at a forward (_node_hooks.py):
        # "auto" then hands the grads to autograd, which runs the node with them; "in_graph",
        # which never runs it, refuses it at the backward; "auto" and "autograd" run it in
        # eager's order (_grad_order.py).
        self._held_nodes = (
            HeldNodes(params.params, params.names)
            if self._auto or self._plan_params or self._views_made_first is not None
            else None
        )
        self._nodes_watched = False  # this forward found a node kept with a hook
        self._node_hooked: str | None = None  # "in_graph": a hooked node's parameter, by name
        self._ddp = _RanInsideDdp()  # shared by the callable's replays: see join
        # Anything besides "no autocast now, none at capture" needs the full check.
        self._ambient_checks = bool(self._autocast) or self._ddp_check
        self._pool = pool
        if pool is not None:
            lock = pool.order.lock
        self._lock = threading.Lock() if lock is None else lock
        self._generation = 0
        self._backward_generation = -1
        self._replayed_in_backward = False  # the last replay that overwrote a pending backward
        # Weakly, the autograd nodes of the latest replays with grad (of every slot or bucket:
        # see join). One backward may run through several; one that will refuse must refuse
        # before another has added anything (the engine runs the later replay's first).
        self._nodes: deque[Any] = deque(maxlen=_NODES_KEPT)
        # The nodes of the replays of callables graphed with it that the pool expired (the same
        # list for all of them): one backward through one of those refuses first.
        self._expired_nodes: list[Any] | None = None
        if pool is not None:
            pool.nodes = self._nodes
            self._expired_nodes = pool.order.expired_nodes
        self._backward_checks = bool(self._saved_outputs) or bool(self._plan_params)
        # Each accumulator with its storage's address for the holder counts; the storage objects
        # are kept alive here (each adds one constant reference to the memory).
        self._storages = tuple(acc.untyped_storage() for acc in self._in_graph_accumulators)
        self._holder_probes = tuple(
            (param, accumulator, storage._cdata)
            for (param, accumulator, _), storage in zip(
                self._accumulators, self._storages, strict=True
            )
        )
        self._storage_ids = tuple(storage._cdata for storage in self._storages)
        self._holder_baseline = self._holder_counts()
        self._holder_totals_baseline = self._holder_totals()
        # Every .grad None (after zero_grad()), and each parameter's grad_dtype its
        # accumulator's dtype (or none, where torch has no grad_dtype): where both hold,
        # grad_problem has nothing to find (_backward_into_accumulators).
        self._no_grads = (None,) * len(self._in_graph_params)
        self._grad_dtypes = tuple(
            accumulator.dtype if _has_grad_dtype else None
            for accumulator in self._in_graph_accumulators
        )
        # For the rare .grad that is not its accumulator: where the accumulators lie, and names.
        self._accumulator_spans = tuple(map(_span, self._in_graph_accumulators))
        self._names_of = dict(zip(self._in_graph_params, self._accumulator_names, strict=True))
        # Outputs left out of the loss: the inputs and parameters only they reach get no grad,
        # as in eager (_unreached). Empty where every output reaches every one of them.
        reach = plan.reach or ()
        grad_inputs = len(plan.grad_inputs)
        self._reach_of_inputs = (
            tuple(zip(plan.grad_inputs, reach[:grad_inputs], strict=True)) if reach else ()
        )
        self._reach_of_params = reach[grad_inputs:]
        self._unreached_memo: dict[frozenset[int], tuple[frozenset[int], frozenset[int]]] = {}
        self._input_only_outputs = _input_only_outputs(plan)
        # For a call with parameters frozen since capture: which inputs and parameters reach
        # each differentiable output (an output none that needs grad reaches needs none).
        self._output_reach = _output_reach(plan)
        # Where the parameters lie among the replay Function's inputs ("auto", "autograd").
        self._param_inputs = slice(self._first_param, self._first_param + len(self._params))
        # The inputs (positions among the Function's) that reach every differentiable output:
        # one that needs grad makes every output need grad, whatever the parameters.
        self._reaching_every_output = tuple(
            1 + i
            for i in plan.grad_inputs
            if all(i in reaching for _, reaching, _ in self._output_reach)
        )
        # Where the module's parameters and buffers live (they stay put: checked on every call),
        # for the inputs the callable updates in place (_check_mutated_inputs).
        module_tensors = plan.module_tensors if self._mutated else None
        self._module_storages = StorageIndex(
            ()
            if module_tensors is None
            else zip(module_tensors.names, module_tensors.tensors, strict=True)
        )
        # Where the buffers the callable updates in place live: an input sharing memory with
        # one would be read, in eager, after the update (check_inputs_sharing_updated_buffers);
        # a function's are found the same way.
        # None where there are none: the per-call test is then one identity comparison.
        updated = plan.module_tensors
        updated_storages = StorageIndex(
            [
                *(
                    ()
                    if updated is None
                    else ((updated.names[i], updated.tensors[i]) for i in updated.updated)
                ),
                *plan.closure_updates,
            ]
        )
        self._updated_storages = updated_storages if updated_storages else None
        # And where the static outputs live, which the caller holds views of (an earlier call's
        # outputs): the copy back of an update into one would write this call's outputs.
        # The inputs an output is, or views (``return x``, ``x[0]``), each with the first such
        # output: handed out as the caller's tensor, which, if it is an earlier call's output
        # (``h, prev = step(h)``), this replay overwrites before handing it out.
        returned: dict[int, int] = {}
        for step in self._aliases.input_views if self._aliases is not None else ():
            returned.setdefault(step.source, step.output)
        self._returned_inputs = tuple(returned.items())
        # the outputs of callables captured after it into its pool (_later_outputs), by the
        # tuple of them it was made from
        self._later_index: StorageIndex | None = None
        self._later_outputs_of: tuple[torch.Tensor, ...] | None = None
        self._output_storages = StorageIndex(
            (f"output{self._out_spec.array_paths[k]}", output)
            for k, output in enumerate(
                self._overwritten_outputs if self._mutated or returned else ()
            )
        )

    def params_frozen(self, needs_input_grad: tuple[bool, ...]) -> bool:
        """Whether a parameter frozen since capture may leave an output of this call without
        grad (``needs_input_grad``: the replay Function's)."""
        if not self._plan_params:  # "auto", "autograd": the parameters are Function inputs
            return not all(needs_input_grad[self._param_inputs])
        # "in_graph": they are not, and are looked at only where no input needing grad
        # reaches every output (the usual call in training has one: no pass over them)
        for position in self._reaching_every_output:
            if needs_input_grad[position]:
                return False
        return not all(map(_requires_grad, self._plan_params))

    def nondiff_outputs_of(
        self, inputs: Sequence[torch.Tensor], params_frozen: bool = False
    ) -> tuple[int, ...]:
        """The outputs that take no part in the backward of a call with these input tensors.

        Those of the capture, and those that only inputs and parameters reach which need no
        grad in this call (captured requiring grad: inputs passed without, parameters frozen
        since capture): as in eager, they come back without history.
        """
        nondiff = self._nondiff_outputs
        if params_frozen:
            params = self.plan.params.params
            for output, reaching, reaching_params in self._output_reach:
                if not any(inputs[i].requires_grad for i in reaching) and not any(
                    params[j].requires_grad for j in reaching_params
                ):
                    nondiff += (output,)
            return nondiff
        for output, reaching in self._input_only_outputs:
            if not any(inputs[i].requires_grad for i in reaching):
                nondiff += (output,)
        return nondiff

    # -- what a caller sees -------------------------------------------------------------------

    @property
    def spec(self) -> TreeSpec:
        """The output spec recorded at capture."""
        return self._out_spec

    @property
    def returned_input_paths(self) -> tuple[str, ...]:
        """The paths of the inputs an output is or views (``return x``, ``x[0]``), which a
        replay hands out as the caller's tensor itself."""
        return tuple(self._inputs.paths[i] for i, _ in self._returned_inputs)

    @property
    def input_flags_read(self) -> tuple[tuple[str, bool, bool], ...]:
        """The inputs whose flags the forward's Python reads, as ``(path, the sample's
        requires_grad, whether grad_fn or is_leaf was read)``; a call differing there runs
        eagerly (a shape bucket judges a padded call by the caller's tensors)."""
        history = self._history_read or ()
        return tuple(
            (self._inputs.paths[i], expected, i in history)
            for i, expected in self._flags_read or ()
        )

    @property
    def reads_grad_mode(self) -> bool:
        """Whether the forward's Python reads grad mode (a call without grad runs eagerly)."""
        return self._reads_grad_mode

    def judged_flags(self) -> contextlib.AbstractContextManager[None]:
        """Around a call whose tensors a shape bucket judged by the caller's (padded copies):
        the replay does not judge the copies' flags again."""
        return _FlagsJudged(self)

    @property
    def checked_tensors(self) -> ModuleTensors | None:
        """What each call checks: the module's own tensors and plain values, or those a
        function's code names (``None``: it names none)."""
        return self._module_tensors

    def _refuse_a_changed_module_first(self, refused: DualgraphError, grad_enabled: bool) -> None:
        """Raise the module's own refusal, if it changed since capture, before ``refused``.

        An input refused after the module itself was changed (``model.double()``, then a
        float64 batch as the module now takes) is the module's doing: the refusal names the
        parameter (``Sequential.0.weight``), not the input the change made the caller pass.
        """
        if self._module_tensors is None:
            return
        try:
            self._module_tensors.check(grad_enabled=grad_enabled)
        except DualgraphError as error:
            prefix = f"{self.name}: " if self.plan.module_tensors is None else ""
            error.args = (
                f"{prefix}{error} (the call's input was refused too: {refused})",
                *error.args[1:],
            )
            raise error from refused

    @property
    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """The static input buffers (args first, then kwargs): each call copies into them, one
        after another, so one passed back as another input (or a view of one) is read after
        it was written: pass a clone."""
        return self._static_inputs

    @property
    def static_outputs(self) -> tuple[torch.Tensor, ...]:
        """The static output buffers, which outputs alias unless ``clone_outputs=True``."""
        return self._static_outputs

    @property
    def generation(self) -> int:
        """How many forward replays have run: a backward pairs with the latest one only."""
        return self._generation

    @property
    def eager_graphs(self) -> EagerGraphs | None:
        """``"auto"``: whether a graph of an eager call of the callable is alive (then its
        replays' backwards hand the parameter grads to autograd, which sums them as eager);
        shared by its slots or buckets. ``None`` in the other modes."""
        return self._other_uses

    def expire_backward(self) -> None:
        """Refuse the backward of the latest replay from now on: its activations are gone.

        For callables whose graphs share one pool's activations (shape buckets): a replay of
        one overwrites what the pending backward of another would read.
        """
        self._generation += 1
        self._replayed_in_backward = False

    @property
    def exposed_outputs(self) -> tuple[torch.Tensor, ...]:
        """The static outputs its callers get views of (none with ``clone_outputs=True``)."""
        return () if self._clone_outputs else self._static_outputs

    @staticmethod
    def join(replays: Sequence[GraphedCallable]) -> None:
        """Make ``replays`` (one callable's shape buckets, or its slots) one callable to the
        checks that span calls, once all of them are built.

        They share their in-graph accumulators, whose present holders each takes as their
        owners (a holder beyond these, a ``.grad`` kept after ``zero_grad(set_to_none=True)``,
        then counts), whether a forward ran inside DDP's, the nodes of their latest replays,
        and (``"auto"``) whether a graph of a call any of them ran eagerly is alive.
        """
        ddp = replays[0]._ddp
        eager = next((r._other_uses for r in replays if r._other_uses is not None), None)
        # a backward through any two of them checks the other (_refuse_stale_in_this_backward)
        nodes: deque[Any] = deque(maxlen=_NODES_KEPT + 2 * len(replays))
        for replay in replays:
            replay._holder_baseline = replay._holder_counts()
            replay._holder_totals_baseline = replay._holder_totals()
            replay._ddp = ddp
            replay._nodes = nodes
            if replay._auto:
                replay._other_uses = eager
            if replay._pool is not None:
                replay._pool.nodes = nodes

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
        if _SCOPE.outer is not None:  # inside another callable's graph (_nesting.py)
            return inside_another(self.name, self.plan.fn, args, kwargs)
        if not self._lock.acquire(False):  # never waits: a second thread is refused
            raise self._busy()
        try:
            if _are_functorch_transforms_active():  # with grad or without: vmap, jvp, grad
                raise DualgraphError(
                    f"{self.name}: called under a torch.func transform (vmap, grad, jvp, ...); "
                    "a graph replays fixed buffers and cannot be transformed"
                )
            if _get_tracing_state() is not None:  # the trace would keep our buffers as constants
                raise traced_call_refused(self.name)
            hooks = self._hooks
            if hooks is not None:
                kwargs, replay_kwargs = hooks.split_kwargs(kwargs)
            # autograd_records(), inlined: inference mode records nothing
            grad_enabled = _is_grad_enabled() and not _is_inference_mode_enabled()
            if not grad_enabled and self._checked_without_grad:
                if self._records_under_no_grad:
                    self._refuse_no_grad()
                if self._reads_grad_mode:
                    return self._eagerly(args, kwargs, replay_kwargs if hooks is not None else None)
            try:
                tensors = self._inputs.checked_tensors(args, kwargs, grad_enabled)
            except DualgraphError as refused:  # the error path only: no cost per call
                self._refuse_a_changed_module_first(refused, grad_enabled)
                raise
            flags = self._flags_read
            count = self._identities_checked
            own = self._own_params_checked
            if (
                (
                    flags is not None
                    and not self._flags_judged
                    and (
                        _flags_differ(tensors, flags)
                        or (
                            self._history_read is not None
                            and _not_leaves(tensors, self._history_read)
                        )
                    )
                )
                or (
                    count
                    and (  # one tensor at two inputs: `is` for two (15 ns), a set of ids for more
                        tensors[0] is tensors[1]
                        if count == 2
                        else len({*map(id, tensors)}) != count
                    )
                )
                or (
                    own is not None and grad_enabled and own_parameter_at(tensors, *own) is not None
                )
            ):
                return self._eagerly(args, kwargs, replay_kwargs if hooks is not None else None)
            # a tensor carrying other public attributes (x.scale): one __dict__ test a tensor
            if (self._carried_any or any(map(_dict_of, tensors))) and self._carried.differ(tensors):
                raise self._carried.refusal(tensors)
            if _forward_ad._current_level >= 0:  # inside torch.autograd.forward_ad.dual_level()
                self._refuse_tangents(tensors)
            if self._module_tensors is not None:
                try:
                    self._module_tensors.check(grad_enabled=grad_enabled)
                except DualgraphError as error:
                    if self.plan.module_tensors is None:  # a function's, a method's: say whose
                        error.args = (f"{self.name}: {error}", *error.args[1:])
                    raise
            if self._param_memory and grad_enabled:
                self._check_param_memory()
            if self._ambient_checks or _is_any_autocast_enabled():
                self._check_ambient_state(grad_enabled)
            readings = _numerics_readings()
            if readings != self._numerics_read:
                if _state_of(readings) != self._numerics:
                    raise self._numerics_changed()
                self._numerics_read = readings
            cudnn = self._cudnn
            if cudnn is not None and self._cudnn_read() != cudnn:  # type: ignore[misc]
                raise self._cudnn_changed("called")
            if self._modes or _function_depth() or _dispatch_depth():
                self._check_modes()
            if self._mutated:
                self._check_mutated_inputs(tensors)
            if self._updated_storages is not None:
                self.check_inputs_sharing_updated_buffers(tensors)
            aliases = self._aliases
            if aliases is not None and aliases.input_views:
                aliases.check_inputs(
                    self.name, tensors, self._inputs.paths, self._out_spec.array_paths
                )
                if self._returned_inputs:
                    self.check_returned_inputs(tensors)
            if self._saved_inputs and self._has_backward and grad_enabled:
                for i in self._saved_inputs:  # one is_inference() a saved input
                    if tensors[i].is_inference():
                        self._refuse_inference_inputs_read(tensors)
                        break
            if hooks is not None:
                call = self._replay_call = hooks.before_forward(
                    self.backend, grad_enabled and self._has_backward, replay_kwargs
                )
            if self._has_backward and grad_enabled:
                held = self._held_nodes
                if held is not None:  # one pass over the parameters' reference counts
                    if held.unchanged():
                        self._nodes_watched = False
                        self._node_hooked = None
                    else:
                        self._nodes_watched = self._nodes_held(held)
                # ``_Replay.apply`` without its Python wrapper, which only unwraps dead functorch
                # wrappers (of the inputs here; parameters never are) on the way.
                edges = self._edges
                if self._views_made_first is not None:
                    watched = self._params_watched
                    if watched is None or self._hooks_read_per_call:
                        watched = self._params_watched = _params_hooked(self._params)
                    if watched or self._nodes_watched:
                        edges = self._edges_in_eager_order()
                outputs = _apply_replay(self, *map(_unwrap_if_dead, tensors), *edges)
                if edges is not self._edges:  # the node's edges lead to the views
                    self._nodes[-1]().params_viewed = True
            else:
                # Grad mode may be on (nothing differentiable to replay), and autograd refuses
                # copies into static inputs that are leaves requiring grad: torch.no_grad()'s
                # two calls, without its context manager's frames (or none, where it is off).
                if _is_grad_enabled():
                    _set_grad_enabled(False)
                    try:
                        outputs = self._forward(tensors)
                    finally:
                        _set_grad_enabled(True)
                else:
                    outputs = self._forward(tensors)
            # counted once it ran, as an eager call or a bucket's: an emulated replay re-runs
            # the callable, which may raise
            self.diagnostics.replays += 1
            if self._mutated:
                self._copy_back(tensors)
                if self._saved_mutated and self._has_backward and grad_enabled:
                    node = self._nodes[-1]()
                    if node.input_versions:  # checked for this call (see _replay_function)
                        node.input_versions = self.input_versions(tensors)
            if aliases is not None:  # under the caller's grad mode, as eager made them
                handed = aliases.hand_out(outputs, tensors)
                if self._used_inside_replaced and grad_enabled:
                    watch_handed_out(
                        {id(outputs[k]): handed[k] for k in self._used_inside_replaced}, outputs
                    )
                outputs = handed
            if self._attributes_set:
                for on_output, k, attributes in self._attributes_set:
                    (outputs if on_output else tensors)[k].__dict__.update(attributes)
            if hooks is None:
                return self._out_spec.unflatten(outputs)
            result = self._out_spec.unflatten(outputs)
            hooks.after_forward(call, result)
            return result
        finally:
            self._lock.release()

    def _edges_in_eager_order(self) -> tuple[torch.Tensor, ...]:
        """The Function's edge tensors with one view of each parameter, made in the reverse of
        the order eager's backward reaches them: the engine runs the last made first, so the
        parameters' hooks run in eager's order (_grad_order.py)."""
        views = views_in_order(self._params, self._views_made_first)  # type: ignore[arg-type]
        return (*views, *self._edges_after_params)

    def _eagerly(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        replay_kwargs: Mapping[str, Any] | None,
    ) -> Any:
        """Run the callable eagerly for a call where its Python would branch otherwise than at
        capture (grad mode off, or an input's ``requires_grad`` other than its sample's, where
        the forward read them; one tensor passed at several inputs, which its Python may tell
        by identity): a replay would run the capture's branch; or one passing a parameter whose
        grad the graph adds into ``.grad`` as an input (eager sums both uses' grads first). Its
        inputs are checked as a replay's; the values the forward's Python sets on its module are
        taken as its own (:func:`own_changes_taken_of`), as for a shape bucket's eager fallback.
        Its outputs are eager's, whatever their structure (``(h, None)`` where the capture's
        branch returned an auxiliary loss)."""
        plan = self.plan
        grad_enabled = _is_grad_enabled() and not _is_inference_mode_enabled()
        self._inputs.checked_tensors(args, kwargs, grad_enabled)
        records = [r for r in (plan.module_tensors, plan.code_tensors) if r is not None]
        hooks = self._hooks
        with own_changes_taken_of(records):
            if hooks is not None:  # the hooks run around an eager call as around a replay
                outputs = call_eagerly(
                    hooks,
                    plan.fn,
                    args,
                    {**kwargs, **(replay_kwargs or {})},
                    check=_checked_already,
                    run=plan.eager_context,
                )
            else:
                run = plan.eager_context
                with run() if run is not None else contextlib.nullcontext():
                    outputs = plan.fn(*args, **kwargs)
        if self._other_uses is not None:  # "auto": replays in its backward go through autograd
            try:
                flat = self._out_spec.flatten(outputs)
            except DualgraphError:  # eager's branch returns another structure: it is eager's
                flat = _tree_leaves(outputs)
            self._other_uses.track(flat)
        self.diagnostics.eager_calls += 1
        return outputs

    def _own_param_passed(self, tensors: Sequence[torch.Tensor]) -> tuple[str, str] | None:
        """The path of the first input that is, or views, a parameter whose grad the backward
        graph adds into ``.grad`` (a call :meth:`__call__` runs eagerly), and that parameter's
        name; ``None``: none is."""
        if self._own_params_checked is None:
            return None
        return own_parameter_passed(
            self._inputs.paths,
            tensors,
            [param for param, _, _ in self._accumulators],
            [name for _, _, name in self._accumulators],
        )

    def _refuse_no_grad(self) -> None:
        """Refuse a call under ``torch.no_grad()`` (not inference mode, where eager records
        nothing either) of a callable that turns grad mode on itself."""
        if _is_inference_mode_enabled():
            return
        paths = [f"output{self._out_spec.array_paths[i]}" for i in self._records_under_no_grad]
        raise DualgraphError(
            f"{', '.join(paths)}: {self.name} was called with grad mode off (torch.no_grad()), "
            "but the callable turns it on itself (torch.enable_grad(), "
            "torch.set_grad_enabled(True)), so eager's call records history there (outputs "
            "requiring grad, grads for the inputs and parameters; or raises, where the callable "
            "differentiates what then records none) where a replay records none; "
            "call it with grad mode on (detach what you do not train), or under "
            "torch.inference_mode(), where eager records nothing either"
        )

    def _nodes_held(self, held: HeldNodes) -> bool:
        """Whether a parameter's ``AccumulateGrad`` node is kept with a hook on it ("auto": then
        the grads go through autograd, which runs the node as eager does); for "in_graph", which
        parameter's (refused at the backward, before ``.grad`` is touched)."""
        hooked = held.hooked()
        if self._plan_params:
            self._node_hooked = hooked
            return False
        return hooked is not None

    def _forward(self, tensors: Sequence[torch.Tensor], grad_enabled: bool = False) -> Any:
        """Copy the inputs in, replay the forward, hand back the static outputs (grad mode off)."""
        # ``tensors`` may go on with the replay Function's edge tensors: zip stops at the inputs.
        for static, tensor in zip(self._static_inputs, tensors, strict=False):
            static.copy_(tensor)  # torch skips a copy of a tensor onto itself
        if self._backward_generation != self._generation:
            # A pending backward will be refused; say so better if a backward runs this replay
            # (a non-reentrant checkpoint recomputing its function).
            self._replayed_in_backward = _current_graph_task_id() != -1
        self._generation += 1  # a pending backward would now read overwritten activations
        if self._pool is not None:  # and so may those of callables graphed after it
            self._pool.forward_replayed(self._generation, grad_enabled)
        if _autograd_graph._allow_mutation_on_saved_tensors_enabled:
            saved_copies_kept(self._overwritten_outputs)
        self._replay_forward(grad_enabled)
        if self._overwritten_outputs:
            # The outputs of the last replay now hold this one's values: autograd must know,
            # so that an eager op that saved one of them raises at backward, as after eager's
            # in-place ops, instead of differentiating with the new values (a graph writes its
            # outputs without autograd seeing it).
            _increment_version(self._overwritten_outputs)
        if self._saved_outputs:
            outputs = self._static_outputs
            self._output_versions = tuple(outputs[i]._version for i in self._saved_outputs)
            self._cut_copies = ()
        if self._clone_outputs:
            return tuple(
                copy(o) for copy, o in zip(self._copiers, self._static_outputs, strict=True)
            )
        return tuple(map(_detach, self._static_outputs))

    def _check_ambient_state(self, grad_enabled: bool = True) -> None:
        if (autocast_state() != self._autocast) if self._autocast else _is_any_autocast_enabled():
            now = autocast_state()
            called = (
                "under torch.autocast of another device"
                if not now and _is_any_autocast_enabled()
                else show_autocast(now)
            )
            raise DualgraphError(
                f"{self.name}: called {called} but captured {show_autocast(self._autocast)}; a "
                "graph replays the precision it was captured in"
            )
        if self._ddp_check and (self._ddp.seen or _ddp_is_running()):
            # A forward that records no grad (evaluation under DDP) gives DDP nothing to
            # all-reduce. Once one ran inside DDP's forward, DDP manages the parameters: a
            # forward with grad outside it is refused too (reentrant checkpointing runs the
            # callable again in the backward, where DDP's forward is over).
            self._ddp.seen = True
            if grad_enabled:
                raise DualgraphError(
                    f"{self.name}: captured with param_grads='in_graph', whose parameter grads "
                    "bypass the autograd hooks DistributedDataParallel all-reduces through (this "
                    "callable ran inside DDP's forward); capture with param_grads='autograd' to "
                    "train under DDP"
                )

    def _check_modes(self) -> None:
        """Refuse a call under other torch function or dispatch modes than capture's: a CUDA
        replay runs through none of them, where eager's ops run through each."""
        modes = _modes_now()
        if modes == self._modes_read:  # the same mode objects as last time (by identity)
            return
        meaning = modes_meaning(modes)
        if meaning != self._modes:
            raise self._modes_changed("called", meaning, self._modes)
        self._modes_read = modes

    def _check_backward_modes(self) -> None:
        """Refuse a backward under other dispatch modes than capture's backward ran under (the
        autograd engine calls no function mode)."""
        meaning = modes_meaning(dispatch_modes_now())
        if meaning != self._dispatch_modes:
            raise self._modes_changed("its backward ran", meaning, self._dispatch_modes)

    def _modes_changed(
        self, when: str, meaning: tuple[Any, ...], captured: tuple[Any, ...]
    ) -> DualgraphError:
        return DualgraphError(
            f"{self.name}: {when} under {show_modes(meaning)}, captured under "
            f"{show_modes(captured)}; a graph replays the kernels captured under the modes of "
            "capture and runs through no mode, where eager's ops run through each. Call it under "
            "the modes of capture, or graph it again under these (a module after "
            "dualgraph.torch.restore)"
        )

    def _check_backward_numerics(self) -> None:
        """Refuse a backward under other matmul or determinism settings than capture's (set
        between the forward and its backward): eager's backward chooses its kernels under the
        settings it runs in, a graph replays the captured ones."""
        now = _numerics_state()
        if backward_numerics(now) != backward_numerics(self._numerics):
            raise DualgraphError(
                f"{self.name}: its backward ran with "
                f"{numerics_difference(now, self._numerics, BACKWARD_ENTRIES)}; "
                "a graph replays the backward kernels, precision and determinism chosen at "
                "capture, where eager's backward would choose again under this setting. Put "
                "the setting back before the backward (the call's forward ran under the "
                "captured one)"
            )

    def _backward_under_autocast(self) -> DualgraphError:
        now = autocast_state()
        ran = show_autocast(now) if now else "under torch.autocast of another device"
        return DualgraphError(
            f"{self.name}: its backward ran {ran}; the graphs' "
            "backward was captured outside autocast, where torch's AMP recipe runs a backward "
            "(autocast wraps the forward and the loss; the backward's ops run in the dtypes the "
            "forward chose), and eager's backward would run its ops under this autocast. Call "
            ".backward() outside torch.autocast"
        )

    def _cudnn_changed(self, when: str) -> DualgraphError:
        assert self.plan.cudnn is not None
        settings, captured = self.plan.cudnn
        return DualgraphError(
            f"{self.name}: {when} with {settings.difference(captured)}; its capture ran a "
            "convolution or an RNN, whose graph replays "
            "the cuDNN kernels, precision and algorithms chosen at capture, where eager's "
            "forward and backward would choose again under this setting (TF32 convolutions "
            "differ by ~1e-3). Call it (and its backward) under the captured setting, or graph "
            "it again under this one (a module after dualgraph.torch.restore)"
        )

    def _numerics_changed(self) -> DualgraphError:
        return DualgraphError(
            f"{self.name}: called with {numerics_difference(_numerics_state(), self._numerics)}; "
            "a graph replays the kernels, precision and dtypes chosen at capture, where eager "
            "would choose again under this setting. Call it under the captured setting, or graph "
            "it again under this one (a module after dualgraph.torch.restore)"
        )

    def _refuse_tangents(self, tensors: Sequence[torch.Tensor]) -> None:
        for path, tensor in zip(self._inputs.paths, tensors, strict=True):
            if _forward_ad.unpack_dual(tensor).tangent is not None:
                raise DualgraphError(
                    f"{self.name}: {path} is a dual tensor (forward-mode AD): a graph replays "
                    "fixed kernels on the values copied into its buffers and cannot carry the "
                    "tangent (a replay without grad dropped it: the output had none); pass its "
                    "primal, or run this callable eagerly (dualgraph.torch.restore)"
                )

    def _check_mutated_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse, before any buffer is written, what the copy back of an update cannot do as
        eager does: an input eager's update could not be written into (it would raise), or one
        that shares memory with another input or with a parameter or buffer of the module
        (eager would see the update through it)."""
        paths = self._inputs.paths
        spans = storage_spans(tensors)  # read once: an updated input is checked against each
        for i in self._mutated:
            why = _unwritable(tensors[i])
            if why is not None:
                raise DualgraphError(
                    f"{self.name}: {paths[i]}: the callable updates it in place, and {why}, so "
                    "eager's update would raise; pass a tensor of its own (clone())"
                )
            span = spans[i]
            if span is None:  # empty
                continue
            start, _, memory = span
            foreign = not memory.resizable()
            owner = self._module_storages.owner(memory, start, foreign)
            if owner is not None:
                raise DualgraphError(
                    f"{self.name}: {paths[i]} shares memory with {owner}, and the callable "
                    f"updates {paths[i]} in place: eager would see the update through {owner}, "
                    "a replay would not; pass a tensor of its own (clone())"
                )
            output = self._output_storages.owner(memory, start, foreign)
            if output is not None:
                raise DualgraphError(
                    f"{self.name}: {paths[i]} shares memory with {output} of an earlier call (a "
                    f"static buffer this replay overwrites), and the callable updates {paths[i]} "
                    "in place: the replay would write the update into this call's output; pass "
                    "a copy (clone(), or graph with clone_outputs=True)"
                )
            # By address range, not storage: two storages may hold the same memory (from_numpy
            # of overlapping numpy views, frombuffer, DLPack).
            j = first_sharing(spans, i)
            if j is not None:
                raise DualgraphError(
                    f"{self.name}: {paths[i]} and {paths[j]} share memory, and the callable "
                    f"updates {paths[i]} in place: eager would see the update through "
                    f"{paths[j]}, a replay would not; pass tensors that do not share memory"
                )

    def check_returned_inputs(
        self, tensors: Sequence[torch.Tensor], paths: Sequence[str] | None = None
    ) -> None:
        """Refuse, before any buffer is written, an input that an output is or views where it
        is an earlier call's output (a static buffer this replay overwrites), or an output of a
        callable captured after this one into its memory pool (which this forward replay may
        overwrite): the output handed out, the caller's tensor or a view of it, would hold
        other values than eager's (``h, previous = step(h)`` with ``step`` returning its input).

        ``paths``: of ``tensors``, where they are not this replay's inputs (a padded call's
        caller's tensors, which it hands out in place of the padded copies replayed).
        """
        own = self._output_storages
        later = self._later_outputs()
        if not own and later is None:
            return
        for i, k in self._returned_inputs:
            path = self._inputs.paths[i]
            if paths is None:
                tensor = tensors[i]
            elif path in paths:
                tensor = tensors[paths.index(path)]
            else:
                continue
            memory = memory_of(tensor)
            if memory is None:
                continue
            start, foreign = memory.data_ptr(), not memory.resizable()
            output = self._out_spec.array_paths[k]
            found = own.owner(memory, start, foreign)
            if found is not None:
                raise DualgraphError(
                    f"{self.name}: {path} shares memory with {found} of an earlier call (a "
                    f"static buffer this replay overwrites), and output{output} is {path} or a "
                    f"view of it, as in eager: handed out after the replay, it would hold this "
                    f"call's {found}, not {path}'s values; pass a copy (clone(), or graph with "
                    "clone_outputs=True)"
                )
            found = None if later is None else later.owner(memory, start, foreign)
            if found is not None:
                raise DualgraphError(
                    f"{self.name}: {path} shares memory with {found}, captured after this one "
                    f"into one memory pool (a static buffer this forward replay may overwrite, "
                    f"on CUDA), and output{output} is {path} or a view of it, as in eager: "
                    f"handed out after the replay, it may not hold {path}'s values; pass a copy "
                    "(clone(), or graph with clone_outputs=True)"
                )

    def _later_outputs(self) -> StorageIndex | None:
        """Where the outputs of the callables captured after this one into its memory pool lie
        (what its forward replay may overwrite), by callable; ``None``: none. Made again when
        another graphing joins the pool (``settle_outputs`` makes a new tuple then)."""
        pool = self._pool
        if pool is None or not pool.forward_overwrites:
            return None
        if self._later_outputs_of is not pool.forward_overwrites:
            self._later_index = StorageIndex(
                (f"an output of {other.label}", tensor)
                for other in pool.order.places()
                if other.forward_at > pool.forward_at
                for tensor in other.outputs
            )
            self._later_outputs_of = pool.forward_overwrites
        return self._later_index

    def check_inputs_sharing_updated_buffers(
        self, tensors: Sequence[torch.Tensor], paths: Sequence[str] | None = None
    ) -> None:
        """Refuse, before any buffer is written, an input that shares memory with a buffer the
        callable updates in place: eager would read the input after the update (as the callable
        has it), a replay reads what was copied into its static input before.

        ``paths``: of ``tensors``, where they are not this replay's inputs (a padded call's).
        """
        updated = self._updated_storages
        if updated is None:
            return
        paths = self._inputs.paths if paths is None else paths
        for path, tensor in zip(paths, tensors, strict=True):
            memory = memory_of(tensor)
            if memory is None:
                continue
            owner = updated.owner(memory, memory.data_ptr(), not memory.resizable())
            if owner is not None:
                raise DualgraphError(
                    f"{self.name}: {path} shares memory with {owner}, which the callable updates "
                    f"in place: eager would see the update through {path}, a replay reads the "
                    "copy made before it; pass a copy (clone())"
                )

    def _copy_back(self, tensors: Sequence[torch.Tensor]) -> None:
        # The callable updated these inputs in place (found at capture): as in eager, the
        # caller's tensors get the update.
        with torch.no_grad():
            for i in self._mutated:
                # Updated without a version bump in eager (through .data): copied back so too.
                target = tensors[i].data if i in self._mutated_quietly else tensors[i]
                target.copy_(self._static_inputs[i])

    def _busy(self) -> DualgraphError:
        if called_again_inside(self._lock):
            return DualgraphError(
                f"{self.name}: called from inside its own call in this thread (a replay hook, "
                "or code its replay runs), while its static buffers are in use"
                + (" (or those of a callable graphed together with it)" if self._pool else "")
                + ": a graphed callable runs one call at a time; call it once that call returned"
            )
        if self._pool is not None:
            return DualgraphError(
                f"{self.name}: called while another thread is running it or a callable graphed "
                "together with it; their graphs share one memory pool, so concurrent replays "
                "would overwrite each other's memory. Call them from one thread at a time (graph "
                "callables that run in separate threads with separate make_graphed_callables "
                "calls)"
            )
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
        through_autograd: bool = False,
        results_seen: bool = False,
        replay_node: Any = None,
    ) -> tuple[torch.Tensor | None, ...]:
        # ``through_autograd``: the parameter grads must pass through autograd (the forward ran
        # under DDP, or this backward builds a graph: create_graph=True). ``results_seen``: a
        # post hook on the replay's node sees (and may keep) the grads it hands on.
        # ``replay_node``: the replay's own autograd node, whose edges lead to the parameters'
        # AccumulateGrad nodes (_is_plain_backward).
        if not self._lock.acquire(False):
            raise self._busy()
        try:
            if self._dispatch_modes or _dispatch_depth():
                self._check_backward_modes()
            if _numerics_readings() != self._numerics_read:
                self._check_backward_numerics()
            cudnn = self._cudnn
            if cudnn is not None and self._cudnn_read() != cudnn:  # type: ignore[misc]
                raise self._cudnn_changed("its backward ran")
            if _is_any_autocast_enabled():
                raise self._backward_under_autocast()
            if through_autograd and self._plan_params:
                raise DualgraphError(
                    f"{self.name}: captured with param_grads='in_graph', whose backward graph "
                    "adds the parameter grads into .grad in place; under backward(create_graph="
                    "True) eager makes each .grad a new tensor with a graph of its own. Capture "
                    "with param_grads='auto' or 'autograd' for that"
                )
            node = self._sentinel_node
            if node is not None and _will_engine_execute_node is not None:
                # _is_plain_backward, inlined for the anchor ("auto", "in_graph"): one query
                try:
                    plain = bool(_will_engine_execute_node(node))
                except RuntimeError:  # raised where torch.autograd.grad captures that leaf
                    plain = False
            else:
                plain = self._is_plain_backward(replay_node)
            pool = self._pool
            if (
                generation != self._generation
                or self._backward_generation == generation
                or self._backward_checks
                or (pool is not None and pool.expired == generation)
            ):
                self._check_backward(generation, plain, replay_node)
            if self._param_grads and not all(needs_input_grad[self._first_param :]):
                raise self._frozen_since_capture(needs_input_grad)
            if len(self._nodes) > 1 and _will_engine_execute_node is not None:
                self._refuse_stale_in_this_backward(generation)
            if self._expired_nodes and _will_engine_execute_node is not None:
                self._refuse_stale_in_this_backward(generation, self._expired_nodes)
            if replay_node is not None:
                # An input the backward reads changed since the replay (after the refusals of
                # a stale replay, whose overwritten activations are the cause to name).
                versions = replay_node.input_versions
                if versions and (
                    self.input_versions(inputs) != versions or replay_node.padded_callers
                ):
                    error = self.changed_input(replay_node)
                    if error is not None:
                        raise error
            # Marked before the hooks and graphs run; a refusal made before anything is
            # replayed or added to (a replay hook's error, here; _RefusedBeforeReplay, from the
            # parameter grads' stage, below) unmarks it, so that a retry (the .grad mended,
            # retain_graph=True) runs it, as eager's would.
            pending = self._backward_generation
            self._backward_generation = generation
            if pool is not None:  # may expire the pending backwards of callables graphed after
                pool.backward_replayed()
            call = self._replay_call  # set by a forward only where there are replay hooks
            if call is not None:
                try:
                    self._hooks.before_backward(call)  # type: ignore[union-attr]
                except BaseException:
                    self._backward_generation = pending
                    raise
            for static, index in self._grad_outputs_taken:
                grad = grads[index]
                if grad is None:
                    static.zero_()
                else:
                    static.copy_(grad)
            if self._emulated is not None:
                self._emulated.incoming = tuple(map(grads.__getitem__, self._grad_output_indices))
            # positions among the Function's inputs, and among the parameters
            unreached_inputs, unreached_params = (
                self._unreached(grads) if self._reach_of_params or self._reach_of_inputs else _NONE
            )
            # The parameter grads autograd gets: the static buffers ("autograd"), copies
            # ("auto" when autograd must see them), or none (added into .grad by the graph).
            param_grads: tuple[torch.Tensor | None, ...] = ()
            if self._plan_params:  # "in_graph": the backward graph adds into .grad
                if unreached_params:
                    self._backward_leaving_alone(unreached_params)
                else:
                    self._backward_into_accumulators(self._replay_backward)  # type: ignore[arg-type]
            elif self._auto:
                added: bool | torch.Tensor = False  # False: autograd adds every grad
                if (
                    not unreached_params
                    and plain
                    and not through_autograd
                    and self._nothing_watches_params()
                    and not self._params_used_elsewhere()
                ):
                    # nothing needs the parameter grads to pass through autograd: the graph
                    # adds them, if every .grad is one it can add into (else autograd, as eager)
                    added = self._backward_into_accumulators(self._replay_backward)  # type: ignore[arg-type]
                if added is not True:
                    param_grads = self._backward_into_copies(None if added is False else added)
                    self.diagnostics.param_grads_through_autograd += 1
            else:
                self._replay_backward()  # type: ignore[misc]
                param_grads = self._param_grads
                if param_grads:
                    self.diagnostics.param_grads_through_autograd += 1
            if self._param_flags:
                for position, attributes, name, value in self._param_flags:
                    if position not in unreached_params:  # eager's backward never ran there
                        attributes[name] = value
            if call is not None:
                self._hooks.after_backward(call)  # type: ignore[union-attr]
            # copies made for this backward; where the edges lead to views of the parameters,
            # the view hands its AccumulateGrad a view of what it gets (which it may keep)
            owned = param_grads is not self._param_grads
            if not owned and param_grads and replay_node is not None and replay_node.params_viewed:
                param_grads = tuple(None if g is None else g.clone() for g in param_grads)
                owned = True
            if unreached_params and param_grads:
                param_grads = tuple(
                    None if i in unreached_params else grad for i, grad in enumerate(param_grads)
                )
                _quiet_hooks(self._params[i] for i in unreached_params)
            if unreached_inputs:
                _quiet_hooks(inputs[position - 1] for position in unreached_inputs)
            return self._hand_out_grads(
                needs_input_grad,
                inputs,
                plain and not results_seen,  # else every grad goes out as a copy
                param_grads,
                owned=owned,
                skip=unreached_inputs,
            )
        except _RefusedBeforeReplay:  # raised only after the mark below was made
            self._backward_generation = pending
            raise
        finally:
            self._lock.release()

    def _check_param_memory(self) -> None:
        for path, attributes, name, tensor, address in self._param_memory:
            now = attributes.get(name)
            if now is not tensor or tensor.data_ptr() != address:
                if not isinstance(now, torch.Tensor):
                    found = f"now {type(now).__name__}"
                elif now is tensor:
                    found = f"moved to {tensor.data_ptr():#x}"
                else:
                    found = f"now another tensor, at {now.data_ptr():#x}"
                raise DualgraphError(
                    f"{self.name}: {path} was rebound or moved since capture (at {address:#x} "
                    f"then, {found}), but the captured "
                    "backward adds into the memory it had then (fused grad accumulation into "
                    "main_grad), so eager's grads would go elsewhere; zero and reuse it in "
                    "place, or restore the module (dualgraph.torch.restore) and graph it again"
                )

    def _unreached(
        self, grads: Sequence[torch.Tensor | None]
    ) -> tuple[frozenset[int], frozenset[int]]:
        """The inputs (positions among the Function's) and parameters (positions among them)
        that only outputs without a grad reach: eager's backward never gets to them.

        Outputs the loss left out come with ``None`` (the Function does not materialize grads).
        Parameters that no output reaches at all have no grad anyway and are not counted.
        """
        missing = frozenset(
            k for k, (_, index) in enumerate(self._grad_outputs) if grads[index] is None
        )
        if not missing:
            return _NONE
        known = self._unreached_memo.get(missing)
        if known is None:
            inputs = frozenset(1 + i for i, reach in self._reach_of_inputs if reach <= missing)
            params = frozenset(
                i for i, reach in enumerate(self._reach_of_params) if reach and reach <= missing
            )
            known = self._unreached_memo[missing] = (inputs, params)
        return known

    def _backward_leaving_alone(self, unreached: frozenset[int]) -> None:
        """``"in_graph"``'s backward when parameters are unreached (:meth:`_unreached`): the
        graph adds a grad into every accumulator, so those parameters' ``.grad`` is ``None``
        meanwhile (the graph's share goes to a tensor of its own; eager looks at no such
        ``.grad``, one it could not add into included), and is hung back after."""
        params = self._plan_params
        kept = []
        for i in sorted(unreached):
            kept.append((params[i], params[i].grad))
            params[i].grad = None
        try:
            self._backward_into_accumulators(
                self._replay_backward,  # type: ignore[arg-type]
                left_alone=frozenset(id(params[i]) for i in unreached),
            )
        finally:
            for param, grad in kept:
                param.grad = grad

    def _nothing_watches_params(self) -> bool:
        """Whether ``.grad`` may be updated without the parameters' ``AccumulateGrad`` nodes.

        Those nodes run the parameters' hooks (``register_hook``,
        ``register_post_accumulate_grad_hook``, and so ``register_multi_grad_hook``), skip a
        parameter frozen since the forward (eager leaves its ``.grad`` alone), and anomaly mode
        checks the grads handed to them for NaN.
        """
        params = self._params
        # one chain of tests (or, where it fails, one pass), the usual case
        if self._params_unwatched() or tuple(map(_in_graph_flags, params)) == self._unwatched:
            self._params_watched = False  # (the next forward's edges: _grad_order.py)
            return not _is_anomaly_enabled()
        hooked = self._params_watched = _params_hooked(params)
        return not (hooked or not all(map(_requires_grad, params)) or _is_anomaly_enabled())

    def _params_used_elsewhere(self) -> bool:
        """Whether this backward may also bring the parameters grads from another use of them.

        Eager sums the grads a parameter gets from every use in one backward before adding the
        sum into ``.grad``; ``"auto"`` adding this replay's share into ``.grad`` itself would
        round differently, so then it hands the grads to autograd. Uses it can see: other slots
        (:class:`SlotReplay` overrides this), and the graphs of eager calls
        (:attr:`eager_graphs`): a shape-bucketed callable's eager fallback, calls run eagerly
        where the callable's Python reads grad mode or an input's ``requires_grad``
        (:meth:`_eagerly`), and a graphed module's forward in the other ``training`` mode.
        """
        other_uses = self._other_uses
        return other_uses is not None and other_uses.alive > 0

    def _refuse_changed_since_forward(
        self, versions: tuple[int, ...], needs_input_grad: Sequence[bool]
    ) -> None:
        """Refuse a backward whose graph would read a parameter or buffer changed in place
        since its forward replay (eager's backward raises, having saved it)."""
        error = self.changed_since_forward(versions, needs_input_grad)
        if error is not None:
            raise error

    def changed_since_forward(
        self, versions: tuple[int, ...], needs_input_grad: Sequence[bool]
    ) -> DualgraphError | None:
        """The refusal of :meth:`_refuse_changed_since_forward`, or ``None``.

        ``needs_input_grad``: the replay node's. Which tensors eager saves depends on which
        grads a call needs (a ``Linear`` saves its weight only for its input's grad): where the
        call's inputs need other grads than the samples' did, eager may not read the tensor and
        may run, so the refusal says that, not that eager would raise (the graph reads it all
        the same, and computes with the new values what this call's grads may depend on).
        """
        now = tuple(map(_version, self._read_by_backward))
        if now == versions:
            return None
        for name, before, after in zip(self._read_by_backward_names, versions, now, strict=True):
            if before != after:
                changed = (
                    f"{self.name}: {name} was modified in place (version {before} at the "
                    f"forward replay, {after} now) before the backward that reads it"
                )
                advice = "run the backward before changing it (optimizer.step() after backward)"
                needs = tuple(needs_input_grad[1 : self._first_param])
                if needs != self._captured_input_grads:
                    return DualgraphError(
                        f"{changed}: the backward graph was captured with "
                        f"{self._grad_difference(needs)} requiring grad (this call's does "
                        "not) and reads it for the grads the capture needed; eager, which saves "
                        "only what this call's grads need, "
                        f"may not have read it, but a replay cannot tell. Either {advice}, or "
                        "graph with samples requiring grad as the calls' inputs do"
                    )
                return DualgraphError(
                    f"{changed} (eager would raise: a variable needed for gradient computation "
                    f"has been modified by an inplace operation); {advice}"
                )
        return None

    def _grad_difference(self, needs: tuple[bool, ...]) -> str:
        """The inputs whose samples required grad where a call's do not (a call passing one
        requiring grad where its sample did not is refused before the replay), by path."""
        pairs = zip(self._inputs.paths, self._captured_input_grads, needs, strict=True)
        return ", ".join(path for path, captured, now in pairs if captured and not now)

    def input_versions(self, inputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The versions of the inputs the backward reads (``inputs``: the call's tensors)."""
        return tuple([inputs[i]._version for i in self._saved_inputs])

    def changed_input(self, node: Any) -> DualgraphError | None:
        """The refusal of the backward of replay ``node`` (its autograd node) that would read an
        input the caller changed in place since that replay (eager's backward raises, having
        saved it), or of a padded call's input: its caller's tensor (note_padded_inputs)."""
        inputs = node.inputs
        versions = node.input_versions
        for i, before in zip(self._saved_inputs, versions, strict=True):
            after = inputs[i]._version
            if after != before:
                return self._changed_input_error(i, before, after)
        for i, tensor, before in node.padded_callers:
            after = tensor._version
            if after != before:
                return self._changed_input_error(i, before, after)
        return None

    def _refuse_inference_inputs_read(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse, before anything is written, a call passing an inference tensor where this
        call's backward reads the input (:meth:`refuse_inference_inputs`); a call needing other
        grads than the capture's (an input passed without grad) may read none (``x * y`` saves
        ``y`` only for ``x``'s grad): its inputs are not checked, as their versions are not."""
        needs = (False, *(t.requires_grad for t in (*tensors, *self._edges)))
        if self.params_frozen(needs) or needs[1 : self._first_param] != self._captured_input_grads:
            return
        self.refuse_inference_inputs(tensors)

    def refuse_padded_inference_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """:meth:`_refuse_inference_inputs_read` for a padded call (``tensors``: its caller's,
        in this callable's input order): the replay reads padded copies, which are no inference
        tensors, where eager's call saves the caller's (and raises)."""
        if not (self._saved_inputs and self._has_backward and _is_grad_enabled()):
            return
        if _is_inference_mode_enabled():
            return
        if any(tensors[i].is_inference() for i in self._saved_inputs):
            self._refuse_inference_inputs_read(tensors)

    def refuse_inference_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Refuse a call with grad passing, where the backward reads an input, a tensor made
        under ``torch.inference_mode()`` (eager raises 'Inference tensors cannot be saved for
        backward'; a replay could tell no change of it from its version counter, it has none).
        """
        for i in self._saved_inputs:
            if inputs[i].is_inference():
                raise self._inference_input_error(i)

    def _inference_input_error(self, index: int) -> SpecMismatchError:
        path = self._inputs.paths[index]
        return SpecMismatchError(
            f"{path}: an inference tensor (made under torch.inference_mode()), which "
            f"the backward of {self.name} reads: eager raises 'Inference tensors cannot "
            "be saved for backward'. Pass a clone made outside inference mode, or call "
            "under torch.no_grad()",
            path=path,
        )

    def _changed_input_error(self, index: int, before: int, after: int) -> DualgraphError:
        return DualgraphError(
            f"{self.name}: {self._inputs.paths[index]} was modified in place after the call "
            f"(version {before} at the replay, {after} now), but the backward reads it (eager "
            "would raise: one of the variables needed for gradient computation has been "
            "modified by an inplace operation); change it after the backward, or pass a copy "
            "(x.clone()). An output of a graphed callable passed in changes with that "
            "callable's next replay too (clone it, or graph that one with clone_outputs=True)"
        )

    def note_padded_inputs(self, callers: Iterable[tuple[int, torch.Tensor]]) -> None:
        """The caller's tensors of the replay just run that a padded call handed it as padded
        copies (``(input index, caller's tensor)``): one the backward reads, changed in place
        before that backward, is refused there as an input of an exact call is (eager's
        backward reads the caller's tensor, and would raise). An inference tensor there was
        refused before the replay (:meth:`refuse_padded_inference_inputs`)."""
        saved = self._saved_inputs
        if not saved or not self._nodes:
            return
        node = self._nodes[-1]()
        if node is None or node.graphed is not self or node.generation != self._generation:
            return  # no backward follows this replay
        node.padded_callers = tuple(
            (i, tensor, tensor._version)
            for i, tensor in callers
            if i in saved and not tensor.is_inference()  # inference mode: no backward follows
        )

    def _refuse_grads_watched_inside(
        self, outputs: Sequence[tuple[int, Callable[[], torch.Tensor | None]]]
    ) -> None:
        """Refuse a hook or ``retain_grad`` on an output other outputs are computed from.

        Eager's grad at it includes what flows back from those outputs; a replay's grad at it
        is only what the loss sends to it directly (the rest stays inside the graph).
        """
        for k, output_ref in outputs:
            output = output_ref()
            if output is not None and (output._backward_hooks or output.retains_grad):
                path = self._out_spec.array_paths[k]
                raise DualgraphError(
                    f"{self.name}: output{path} has a hook or retains its grad, and is used inside "
                    "the callable to compute other outputs: eager's grad at it includes what "
                    "flows back from those, a replay's only what the loss sends to it directly "
                    "(the rest stays inside the graph). Graph the parts before and after it as "
                    "separate callables to watch the grad there"
                )

    def _refuse_stale_in_this_backward(
        self, generation: int, nodes: Iterable[Any] | None = None
    ) -> None:
        """Raise, before this backward touches anything, the refusal of another replay of this
        callable (or of its slots or buckets; ``nodes``: of a callable sharing its pool, which
        the pool expired) that the same backward reaches and whose own backward will refuse:
        one backward through two replays adds the grads of both or of neither."""
        for ref in self._nodes if nodes is None else nodes:
            node = ref()
            if node is None or (node.graphed is self and node.generation == generation):
                continue
            try:
                reached = _will_engine_execute_node(node)  # type: ignore[misc]
            except RuntimeError:  # asked of a node that torch.autograd.grad captures: none here
                reached = False
            if reached:
                error = node.graphed.stale_backward(node.generation)
                # and so does one whose inputs, parameters or buffers it reads changed since
                if error is None and node.versions:
                    error = node.graphed.changed_since_forward(node.versions, node.needs_input_grad)
                if error is None and node.input_versions:
                    error = node.graphed.changed_input(node)
                if error is not None:
                    raise error

    def stale_backward(self, generation: int) -> DualgraphError | None:
        """The error the backward of replay ``generation`` will raise, if it will: a later
        forward (or another bucket's) overwrote its activations, or its backward ran already."""
        pool = self._pool
        if (
            generation != self._generation
            or self._backward_generation == generation
            or (pool is not None and pool.expired == generation)
        ):
            try:
                self._check_backward(generation, True)
            except DualgraphError as error:
                return error
        return None

    def _frozen_since_capture(self, needs_input_grad: Sequence[bool]) -> DualgraphError:
        names = self.plan.params.names
        for name, needed in zip(names, needs_input_grad[self._first_param :], strict=True):
            if not needed:
                return requires_grad_changed(name, True)
        return DualgraphError(f"{self.name}: a parameter was frozen after capture")

    def _check_backward(self, generation: int, plain: bool, replay_node: Any = None) -> None:
        pool = self._pool
        if generation != self._generation and self._replayed_in_backward:
            raise DualgraphError(
                f"{self.name}: a forward replay ran during this backward and overwrote the "
                "activations that the backward of the earlier replay needs. Either a "
                "non-reentrant activation checkpoint (torch.utils.checkpoint, "
                "use_reentrant=False) whose function calls the graphed callable recomputes it "
                "there: checkpoint the graphed callable alone (checkpoint(graphed, x): it "
                "re-runs nothing), leave it out of the checkpointed function, or use "
                "use_reentrant=True. Or a hook (or a custom Function's backward) called it "
                "before this backward reached the replay: call it after the backward"
            )
        if pool is not None and pool.expired == generation:  # by a callable graphed before it
            raise pool.expired_error()
        if generation != self._generation:
            raise DualgraphError(
                f"{self.name}: backward of an earlier replay after a later forward replay "
                "overwrote the activations it needs; run each replay's backward before the "
                "next forward of the same callable"
            )
        if self._backward_generation == generation:
            if replay_node is not None and replay_node.built_graph:
                # its first backward built a graph (create_graph=True): a gradient penalty's
                # backward may reach this node before the refusing one (on CUDA it does)
                raise SecondBackwardError(
                    f"{self.name}: trying to differentiate twice through a replay whose backward "
                    "ran with create_graph=True (a gradient penalty, a Hessian, a second "
                    "backward through its outputs): the grads of a graphed callable's backward "
                    "have no graph of their own, and each replay supports one backward; run "
                    "this callable eagerly for that (dualgraph.torch.restore, or the function "
                    "itself)"
                )
            raise DualgraphError(
                f"{self.name}: a second backward through the same replay; the backward graph "
                "may reuse the memory of activations it has consumed, so each replay supports "
                "one backward (retain_graph=True cannot keep a graph's activations)"
            )
        if self._saved_outputs:
            outputs = self._static_outputs
            for i, version in zip(self._saved_outputs, self._output_versions, strict=True):
                if outputs[i]._version != version:
                    raise self._modified_output(i)
            for i, ref, version in self._cut_copies:
                cut = ref()
                if cut is not None and cut._version != version:
                    raise self._modified_output(i)
        if self._plan_params:
            self._check_in_graph_backward(plain)

    def _modified_output(self, index: int) -> DualgraphError:
        path = self._out_spec.array_paths[index]
        return DualgraphError(
            f"{self.name}: output{path} was modified in place after the replay, but "
            "the backward reads it (eager would raise: a variable needed for "
            "gradient computation has been modified by an inplace operation); "
            "change a copy (clone_outputs=True, or dualgraph.torch.owned)"
        )

    def note_cut_copies(self, copies: Iterable[tuple[int, torch.Tensor]]) -> None:
        """The outputs of the replay just run that a padded call handed out as copies cut back
        (``(output index, copy)``): a copy of an output the backward reads, changed in place
        before that backward, is refused there as a change of the output itself is (eager's
        output is that one tensor, and its backward would raise)."""
        saved = self._saved_outputs
        self._cut_copies = tuple(
            (index, weakref.ref(cut), cut._version)
            for index, cut in copies
            if index in saved and not cut.is_inference()  # inference mode: no backward follows
        )

    def _hand_out_grads(
        self,
        needs_input_grad: tuple[bool, ...],
        inputs: Sequence[torch.Tensor],
        plain: bool,
        param_grads: tuple[torch.Tensor | None, ...],
        *,
        owned: bool,
        skip: frozenset[int] = frozenset(),
    ) -> tuple[torch.Tensor | None, ...]:
        """The grads for autograd, never a static buffer that anyone could keep.

        The next backward replay overwrites the static grad buffers, while eager hands each
        backward new tensors. A buffer goes out as it is only where it is consumed at once: a
        plain ``.backward()`` (not ``torch.autograd.grad``, which returns what it captures)
        delivers it to an ``AccumulateGrad`` (a leaf, a parameter: it copies or adds into
        ``.grad``) or to another replay's backward (it copies into its own static buffer), and
        no hook (on the tensor, or on that replay's node) or ``retain_grad`` sees it. Everywhere
        else it goes out as a copy.

        ``param_grads``: one per parameter, or none (``()``: they are in ``.grad`` already, and
        autograd gets ``None``); ``owned``: they are copies of this backward's own, which go out
        as they are. ``skip``: inputs (their positions among the Function's) that get ``None``.
        """
        result: list[torch.Tensor | None] = [None] * self._first_param
        for position, grad in self._input_grads:
            if needs_input_grad[position] and position not in skip:
                tensor = inputs[position - 1]
                node: Any = tensor.grad_fn
                if (
                    plain
                    and not tensor._backward_hooks
                    and not tensor.retains_grad
                    and (
                        # a leaf: its AccumulateGrad adds the buffer into .grad, where nothing
                        # keeps it (with no .grad yet, it would clone the buffer: a copy then
                        # costs nothing more); a hook on that node would see the buffer itself
                        (node is None and tensor.grad is not None and not _node_hooked(tensor))
                        or (type(node) is _REPLAY_BACKWARD and not node.hooked)
                    )
                ):
                    result[position] = grad
                else:
                    result[position] = grad.clone()
        if not param_grads:
            return (*result, *self._edge_nones)
        if plain and (owned or not any(map(_tensor_hooks, self._params))):
            # each goes straight into its AccumulateGrad
            return (*result, *param_grads, *self._anchor_none)
        for param_grad, param in zip(param_grads, self._params, strict=True):
            if param_grad is not None and not plain and not _will_execute_or_capture(param):
                param_grad = None  # e.g. torch.autograd.grad(loss, x): not wanted, no copy
            elif param_grad is not None and not owned and (not plain or param._backward_hooks):
                param_grad = param_grad.clone()  # a hook or torch.autograd.grad may keep it
            result.append(param_grad)
        return (*result, *self._anchor_none)

    def _is_plain_backward(self, replay_node: Any = None) -> bool:
        """Whether this backward accumulates into ``.grad`` (not ``torch.autograd.grad``).

        Asked of a leaf's ``AccumulateGrad`` node (a parameter's, or the anchor): the engine
        runs it in a ``.backward()``, never in ``torch.autograd.grad`` (where it raises for a
        leaf whose grad is captured). The anchor, which no caller can name, answers ``True``
        only in a ``.backward()`` without ``inputs=``, which runs every node it reaches.
        ``replay_node``: the replay's autograd node, whose edges hold the parameters' nodes.
        """
        node = self._sentinel_node
        param = self._sentinel_param
        if node is None and param is not None:
            # Looked up, not kept (this backward's graph holds it): the first parameter's, or,
            # if it was frozen since the forward (no node to look up then), another's.
            position = 0
            if not param.requires_grad:
                position, param = next(
                    ((i, p) for i, p in enumerate(self._params) if p.requires_grad), (0, None)
                )
            if param is not None and replay_node is not None:
                # The node the replay's edge leads to, which the forward took from the
                # parameter (the same node a lookup finds while this graph holds it): read off
                # the edge, without the lookup's differentiated view_as. The edges are the
                # Function's tensor inputs' (the callable itself has none), hence the - 1. None
                # where the parameter needed no grad at the forward (no edge): looked up then.
                node = replay_node.next_functions[self._first_param - 1 + position][0]
                if node is not None and replay_node.params_viewed:  # the view's: its parameter's
                    node = node.next_functions[0][0]
            if node is None and param is not None:
                node = _grad_accumulator(param)
        if node is None or _will_engine_execute_node is None:
            return False
        try:
            return bool(_will_engine_execute_node(node))
        except RuntimeError:
            return False

    # -- param_grads="in_graph" ----------------------------------------------------------------

    def _check_in_graph_backward(self, plain: bool) -> None:
        if _is_anomaly_enabled() and _is_anomaly_check_nan_enabled():
            # Eager's anomaly mode raises at the first node that returns NaN, before any .grad
            # is added to; the graph adds the grads into .grad where nothing can check them.
            raise DualgraphError(
                f"{self.name}: a backward in anomaly mode (torch.autograd.detect_anomaly), whose "
                "NaN checks param_grads='in_graph' would skip: its graph adds the parameter "
                "grads into .grad itself (nothing was changed). Capture with "
                "param_grads='auto' to debug with anomaly mode"
            )
        # One pass over the parameters: still trainable, and no hook that in-graph grads would
        # skip (an empty hook dict, left by a removed hook, is looked at on the slow path).
        if self._node_hooked is not None:
            raise DualgraphError(
                f"{self.name}: {self._node_hooked}'s AccumulateGrad node has a hook (put on the "
                "node itself, as Megatron-LM's DDP and _apply_optimizer_in_backward do), which "
                "param_grads='in_graph' would never run: the backward graph adds the grad into "
                ".grad itself (nothing was changed). Capture with param_grads='auto' or "
                "'autograd' to use it"
            )
        if (
            not self._plan_params_unwatched()
            and tuple(map(_in_graph_flags, self._plan_params)) != self._in_graph_expected
        ):
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

    def _backward_into_accumulators(
        self, replay: Callable[[], None], left_alone: frozenset[int] = frozenset()
    ) -> bool | torch.Tensor:
        """Replay ``replay``, which adds the parameter grads into static accumulators.

        ``replay`` is the backward graph, which adds into the accumulators (``"in_graph"``, and
        ``"auto"`` with accumulators).

        Keeps eager's ``.grad`` contract. A ``.grad`` that is its accumulator is added to in
        place. A ``.grad`` set to ``None`` (``zero_grad``) starts from zero in a tensor nobody
        else holds: the accumulator itself if it is free, else a new tensor (whoever still holds
        the accumulator, e.g. the old ``.grad``, sees no change). A ``.grad`` the user set is
        added to in place, keeping its identity.

        A ``.grad`` no accumulator can stand in for (sparse, of another dtype, one eager's
        in-place add cannot write: expanded, overlapping, an inference tensor; or sharing memory
        with another parameter's ``.grad`` or accumulator, which eager adds into twice) is
        refused under ``"in_graph"``; under ``"auto"``, having written and replayed nothing,
        this returns ``False`` (autograd adds the grads instead), or, for a ``.grad`` eager's
        ``AccumulateGrad`` raises for, its parameter (autograd, handed its grad alone, raises
        eager's error, having changed no other ``.grad``: as eager where it reaches that
        parameter first). Either way, before anything is written. ``True``: ``.grad`` holds
        the sums.
        """
        # Every .grad its accumulator, and every accumulator still with the memory and layout
        # the graph adds into: one chain of tests, the backward's only cost per parameter here
        if self._sums_in_place():
            replay()  # every .grad is its accumulator, where the graph adds
            return True
        grads = tuple(map(_grad, self._in_graph_params))
        accumulators = self._in_graph_accumulators
        if _is_inference_mode_enabled() and any(grad is None for grad in grads):
            # A backward under torch.inference_mode(): eager's AccumulateGrad makes a .grad that
            # was None an inference tensor (a later backward outside it cannot add into it); an
            # accumulator handed out here would be an ordinary one. (``left_alone``: parameters
            # eager's backward never reaches, whose .grad is None meanwhile; by identity.)
            if self._auto:
                return False  # autograd's AccumulateGrad makes it, as eager's
            names = self._accumulator_names
            params = self._in_graph_params
            name = next(
                (
                    n
                    for n, p, g in zip(names, params, grads, strict=True)
                    if g is None and id(p) not in left_alone
                ),
                None,
            )
            if name is not None:
                raise _RefusedBeforeReplay(
                    f"{name}: .grad is None and this backward runs under "
                    "torch.inference_mode(), where eager makes the new .grad an inference tensor; "
                    "param_grads='in_graph' would hand out an ordinary one (nothing was changed): "
                    "run the backward outside inference mode, or capture with param_grads='auto'"
                )
        # Every accumulator where its memory lies (_same_place of each, in two C passes): the
        # usual case here, every .grad None after zero_grad()
        placed = (
            tuple(map(_data_ptr, accumulators)) == self._graph_grads_places
            and self._accumulator_layouts.same()
        )
        if (
            placed
            and grads == self._no_grads
            and tuple(map(_grad_dtype, self._in_graph_params)) == self._grad_dtypes
            and not self._accumulators_held()
        ):
            # What the loop below does for this case, in C passes: every .grad None, so nothing
            # adds in place; no accumulator held beyond its owners, so none is saved; each where
            # the graph adds, so each is handed out; grad_problem finds nothing (no .grad to
            # check, every grad_dtype the accumulator's dtype, as at capture).
            self._sum_start()  # as the loop's pending: the same memory here
            replay()
            for param, accumulator in zip(self._in_graph_params, accumulators, strict=True):
                param.grad = accumulator
            return True
        pending = []
        zeroed = []
        handed: list[torch.Tensor | None] = []  # what a .grad that is None becomes
        for (param, accumulator, storage), memory, grad, baseline, name in zip(
            self._holder_probes,
            self._graph_grads,
            grads,
            self._holder_baseline,
            self._accumulator_names,
            strict=True,
        ):
            try:
                adds_in_place = grad is not None and _aliases(grad, memory, name)
            except DualgraphError as error:  # a .grad in the graph's memory, laid out otherwise
                if self._auto and not _grads_overlap(grads):  # (two .grad sharing: refused)
                    return False  # autograd adds into it in place, as eager, memory put back
                raise _RefusedBeforeReplay(str(error)) from None
            if adds_in_place:
                continue  # the replay adds into .grad's memory itself
            # More holders than when nobody held it (fewer is no reason to copy): the old .grad,
            # a view or a detached alias of it is still in use and must not change.
            held = any(map(operator.gt, _holders(accumulator, storage), baseline))
            pending.append((param, memory, grad, memory.clone() if held else None))
            # An accumulator moved elsewhere (grad.data = ...) is the user's memory now.
            handed.append(accumulator if placed or _same_place(accumulator, memory) else None)
        problem = _grad_problem(pending, self._accumulator_spans, self._names_of)
        if problem is not None:
            name, found, raises_for, remedy = problem
            if found is not None:
                if self._auto:  # autograd adds into it as eager does
                    return False if raises_for is None else raises_for
                remedy = remedy or (
                    "set .grad to None or to a dense tensor of its own of the parameter's dtype"
                )
                raise _RefusedBeforeReplay(
                    f"{name}: {found}; param_grads='in_graph' cannot add into it as eager does "
                    f"(nothing was changed): {remedy}, or capture with param_grads='auto'"
                )
            if not _grads_overlap(grads):
                # Only the graph's grad buffer of another parameter (its old .grad, set here):
                # eager adds into this .grad once, as into any; the replay would write it first.
                if self._auto:
                    return False  # autograd adds into it, each accumulator put back after
                raise _RefusedBeforeReplay(
                    f"{name}: .grad shares memory with the graph's grad buffer of another "
                    "parameter (a .grad that parameter had, set here), into which the replay "
                    "adds that parameter's grad; param_grads='in_graph' cannot add into it as "
                    "eager does (nothing was changed): set .grad to a clone of it, or capture "
                    "with param_grads='auto'"
                )
            raise _RefusedBeforeReplay(
                f"{name}: .grad shares memory with another parameter's .grad: eager adds each "
                "parameter's grad into it in the order its backward reaches them, which a "
                "replay cannot reproduce; give each parameter a .grad of its own (views of one "
                "flat buffer that do not overlap work)"
            )
        # Only now, every .grad checked, are the accumulators written.
        for _, accumulator, grad, _ in pending:
            if grad is None:
                zeroed.append(accumulator)
            else:
                accumulator.copy_(grad)
        if zeroed:
            _start_sums(zeroed)
        try:
            replay()
        except BaseException:  # (emulate) put back what a kept .grad held; nothing else changed
            for _, accumulator, _, saved in pending:
                if saved is not None:
                    accumulator.copy_(saved)
            raise
        for (param, memory, grad, saved), own in zip(pending, handed, strict=True):
            if grad is not None:
                grad.copy_(memory)
            elif saved is None and own is not None:
                param.grad = own
            else:
                param.grad = memory.clone()
            if saved is not None:
                memory.copy_(saved)
        return True

    def _backward_into_copies(
        self, alone: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, ...]:
        """Replay the backward into zeroed accumulators; copies of the grads, one per parameter
        (``None`` for all but the parameter ``alone``, if given).

        ``"auto"`` where autograd must see the parameter grads (hooks, DDP, ``autograd.grad``,
        ``inputs=``, anomaly mode, a ``.grad`` no accumulator can stand in for): the graph adds
        into the accumulators, so they start from zero, and whatever they held (a ``.grad`` is
        often its accumulator) is put back after. The copies are this backward's own tensors,
        which autograd may keep (``torch.autograd.grad`` returns them; ``AccumulateGrad`` takes
        one as ``.grad``) while the next replay reuses the accumulators. Each step copies all
        the accumulators at once (``torch._foreach_mul`` by one: every value, ``-0.0`` and NaN
        included, comes out as it went in).
        """
        accumulators = self._graph_grads  # the memory, wherever a .grad has moved
        held = [
            memory
            for (_, accumulator, storage), memory, baseline in zip(
                self._holder_probes, self._graph_grads, self._holder_baseline, strict=True
            )
            if any(map(operator.gt, _holders(accumulator, storage), baseline))
        ]
        saved = list(torch._foreach_mul(held, 1.0)) if held else []
        self._sum_start()  # accumulators: the same memory
        try:
            self._replay_backward()  # type: ignore[misc]
            copies = torch._foreach_mul(accumulators, 1.0)
        finally:  # a backward that raised (emulate) leaves every .grad as it found it too
            if held:
                torch._foreach_copy_(held, saved)
        grads: list[torch.Tensor | None] = [None] * len(self._params)
        for position, copy_, param in zip(
            self._accumulator_positions, copies, self._in_graph_params, strict=True
        ):
            if alone is None or param is alone:
                grads[position] = copy_
        return tuple(grads)

    def _holder_totals(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The holder counts of every accumulator (_grad_checks.holders), as three C passes."""
        accumulators = self._in_graph_accumulators
        return (
            tuple(map(_refcount, accumulators)),
            tuple(map(_use_count, accumulators)),
            tuple(map(_storage_use_count, self._storage_ids)),
        )

    def _accumulators_held(self) -> bool:
        """Whether an accumulator has more holders than its owners (an old ``.grad`` in use):
        what _holders tells of each, for all at once, compared with the counts taken the same
        way at construction (and join)."""
        totals = self._holder_totals()
        baseline = self._holder_totals_baseline
        # the same counts, the usual case, in one comparison; only a difference is looked into
        # (fewer holders than the baseline is no reason to copy)
        return totals != baseline and any(
            any(map(operator.gt, counts, before))
            for counts, before in zip(totals, baseline, strict=True)
        )

    def _holder_counts(self) -> tuple[tuple[int, int, int], ...]:
        # The counts of each accumulator taken the way _backward_into_accumulators takes them
        # (the same references held on the way), at construction, when nobody else holds one.
        counts = []
        for _, accumulator, storage in self._holder_probes:
            counts.append(_holders(accumulator, storage))
        return tuple(counts)


def _params_hooked(params: Sequence[torch.Tensor]) -> bool:
    """Whether a parameter has a tensor hook or a post-accumulate-grad hook (two C passes)."""
    return any(map(_tensor_hooks, params)) or any(map(_post_accumulate_hooks, params))


def _flags_differ(tensors: Sequence[torch.Tensor], flags: tuple[tuple[int, bool], ...]) -> bool:
    """Whether an input whose ``requires_grad`` the forward read (``flags``: its position and
    its sample's) has another."""
    return any(tensors[i].requires_grad is not expected for i, expected in flags)


class _FlagsJudged:
    """:meth:`GraphedCallable.judged_flags`."""

    __slots__ = ("_runner",)

    def __init__(self, runner: GraphedCallable) -> None:
        self._runner = runner

    def __enter__(self) -> None:
        self._runner._flags_judged = True

    def __exit__(self, *exc: object) -> None:
        self._runner._flags_judged = False


def _not_leaves(tensors: Sequence[torch.Tensor], positions: tuple[int, ...]) -> bool:
    """Whether an input whose ``grad_fn`` or ``is_leaf`` the forward read (``positions``; a
    leaf at capture) is no leaf: computed under grad, it has a ``grad_fn``."""
    return any(not tensors[i].is_leaf for i in positions)


def _checked_already(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The inputs of an eager call a replay declined (:meth:`GraphedCallable._eagerly`) were
    checked before."""


def _node_hooked(leaf: torch.Tensor) -> bool:
    """Whether a leaf's ``AccumulateGrad`` node has a Python hook (that would see the grad)."""
    dicts = node_hook_dicts(leaf)
    return dicts is None or bool(dicts[0]) or bool(dicts[1])


#: Replays whose nodes a callable keeps (weakly) to check one backward through several: the
#: latest 8 (buckets and slots keep two more per bucket or slot). A backward that also reaches
#: an older replay still refuses, but only once the engine gets to it.
_NODES_KEPT = 8


def _taking_own_changes(replay: Callable[[bool], None], tensors: Any) -> Callable[[bool], None]:
    def replay_forward(grad_enabled: bool) -> None:
        with tensors.own_changes_taken():
            replay(grad_enabled)

    return replay_forward


def _same_place(tensor: torch.Tensor, memory: torch.Tensor) -> bool:
    """Whether ``tensor`` (an accumulator) still lies where ``memory`` (its alias) does."""
    return (
        tensor.data_ptr() == memory.data_ptr()
        and tensor.stride() == memory.stride()
        and tensor.shape == memory.shape
    )


_IN_PLACE_REFUSALS = {
    "overlap": "its elements share memory (an expanded tensor)",
    "inference": "it is an inference tensor, outside inference mode",
}


def _unwritable(tensor: torch.Tensor) -> str | None:
    """Why an in-place update cannot be written into ``tensor``, or ``None``."""
    refusal = _in_place_refusal(tensor)
    return None if refusal is None else _IN_PLACE_REFUSALS[refusal]


def _output_reach(
    plan: ReplayPlan,
) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
    """Each differentiable output, with the inputs and the parameters that reach it.

    Positions among the output tensors, the input tensors and the parameters.
    """
    grad_inputs = plan.grad_inputs
    reach = plan.reach
    params = range(len(plan.params.params))
    result = []
    for k, output in enumerate(plan.diff_outputs):
        if reach is None:  # every output reaches every input and parameter
            result.append((output, tuple(grad_inputs), tuple(params)))
            continue
        param_reach = reach[len(grad_inputs) :]
        result.append(
            (
                output,
                tuple(i for i, leaf in zip(grad_inputs, reach, strict=False) if k in leaf),
                tuple(j for j in params if k in param_reach[j]),
            )
        )
    return tuple(result)


def _input_only_outputs(plan: ReplayPlan) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Each differentiable output that no parameter reaches, with the inputs that reach it.

    Positions among the output tensors and among the input tensors. Such an output needs grad
    in a call only where one of those inputs does (see :meth:`GraphedCallable.nondiff_outputs_of`).
    """
    grad_inputs = plan.grad_inputs
    reach = plan.reach
    params = len(plan.params.params)
    result = []
    for k, output in enumerate(plan.diff_outputs):
        if reach is None:  # every output reaches every input and parameter
            if params:
                return ()
            reaching = grad_inputs
        else:
            if any(k in leaf for leaf in reach[len(grad_inputs) :]):
                continue
            reaching = tuple(i for i, leaf in zip(grad_inputs, reach, strict=False) if k in leaf)
        result.append((output, reaching))
    return tuple(result)
