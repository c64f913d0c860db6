"""Several micro-batches in flight per graphed callable: replay slots.

A graphed callable holds one set of static buffers and activations: one replay in flight (its
forward run, its backward not yet). Pipeline schedules keep several micro-batches in flight, so
:class:`SlottedCallable` holds several *slots*, each a complete replay of its own (a
:class:`SlotReplay`: static inputs, outputs, grads, a forward and a backward graph and the
activations between them). A forward takes a slot; the backward of that replay finds its slot
through autograd (the replay's ``ctx``), in whatever order backwards come.

Graphs that share a memory pool are safe only when replayed in an order compatible with their
capture: a graph may use, for its own activations and temporaries, memory that another graph's
activations occupy at other times. Two layouts make that so by construction:

- ``slots=k`` (:class:`SlotLayout`): each slot of each callable captures into a pool of its own,
  forward then backward. No two slots share memory, so slots replay in any order, as many in
  flight as there are slots; a forward with every slot in flight is refused.
- ``schedule=`` (:class:`ScheduleLayout`): the callables graphed together get one slot per
  micro-batch of the step, all captured into one pool in the schedule's order, the order a step
  runs them in. Each replay is checked against the schedule (:class:`ScheduleCursor`) and one
  out of order is refused before it touches a buffer. Within a step every graph replays exactly
  where it was captured, so memory the pool reuses between graphs is reused in replay as it was
  in capture. Memory then follows the schedule as eager's does: the activations of the
  micro-batches in flight, not of all of them. Micro-batches never in flight together share
  static buffers: inputs, outputs and grads (:attr:`CaptureDiagnostics.reused_buffer_bytes`).

Why not fewer graphs in one pool: with ``k`` slots reused across more micro-batches, the
first forward captured had no other slot in flight, so its temporaries may sit where another
slot's activations were captured later; in the steady state that forward replays while that
slot is in flight and overwrites them. A capture order is safe for a replay order only if every
graph, whenever it replays, finds in flight no activations that were not in flight when it was
captured; one graph per micro-batch, in schedule order, is the simple order that satisfies it.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import CaptureError, DualgraphError
from .._spec import TreeSpec
from ._ambient import autograd_records
from ._capture import CaptureOptions, CaptureRequest, CaptureStep, _Capture, capture_copies
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._eager_graphs import EagerGraphs
from ._grad_checks import will_engine_execute_node
from ._inputs import same_tensor_twice
from ._nesting import SCOPE, called_again_inside, inside_another
from ._replay import GraphedCallable
from ._schedule import MAX_ORDER, Schedule, ScheduledPass, expand

__all__ = [
    "ScheduleCursor",
    "ScheduleLayout",
    "SlotLayout",
    "SlotReplay",
    "SlottedCallable",
    "capture_slotted",
    "checked_slots",
    "reset_slots_of",
]

_Node = Any  # an autograd node (the replay Function's backward object)
_requires_grad = operator.attrgetter("requires_grad")
_current_graph_task_id = torch._C._current_graph_task_id


class SlotReplay(GraphedCallable):
    """One slot of a :class:`SlottedCallable`: a complete replay with buffers of its own.

    Its backward asks the slotted callable first (is this backward in order?) and tells it
    afterwards (the slot is free again).
    """

    __slots__ = ("_backward_task", "_dropped", "_front", "_probe", "index")

    def __init__(self, plan: Any, index: int) -> None:
        super().__init__(plan)
        self.index = index
        self._front: SlottedCallable | None = None
        self._probe: tuple[torch.Tensor, ...] = ()
        self._dropped = -1  # the generation of the replay in flight that reset_slots dropped
        self._backward_task = -1  # the autograd graph task that ran its last backward

    def drop(self) -> None:
        """Refuse the backward of the replay in flight here (``reset_slots``): its buffers are
        free for the next forward, and with a schedule shared with other micro-batches."""
        self._dropped = self._generation
        self.expire_backward()

    def _forward(self, tensors: Sequence[torch.Tensor], grad_enabled: bool = False) -> Any:
        front = self._front
        if (
            grad_enabled
            and front is not None
            and isinstance(front._gate, ScheduleCursor)
            and not any(map(_requires_grad, tensors))  # the inputs, then the edge tensors
        ):
            # No autograd node will follow, so no backward; refused before a buffer is written.
            raise front._gate.no_backward(front)
        outputs = super()._forward(tensors, grad_enabled)
        if grad_enabled:  # under the replay Function: its differentiable outputs get its node
            self._probe = outputs
        return outputs

    def _eagerly(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        replay_kwargs: Mapping[str, Any] | None,
    ) -> Any:
        """A call the replay declines (the callable's Python reads an input's ``requires_grad``
        and the call's differs) runs eagerly with free slots; a schedule refuses it before it
        runs: every forward of a scheduled step replays its micro-batch."""
        front = self._front
        if front is not None and isinstance(front._gate, ScheduleCursor):
            raise self._refuse_eager_in_schedule(front._gate, args, kwargs)
        return super()._eagerly(args, kwargs, replay_kwargs)

    def _refuse_eager_in_schedule(
        self, cursor: ScheduleCursor, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> DualgraphError:
        tensors = self._inputs.tensors(args, kwargs)
        paths = self._inputs.paths
        due = (
            "and the call would run eagerly, outside the schedule, where "
            f"{cursor.describe(cursor.passes[cursor.position])} is due. Nothing ran. Every "
            "forward of a scheduled step replays its micro-batch: "
        )
        flags = self._flags_read or ()
        found = next(
            ((paths[i], flag) for i, flag in flags if tensors[i].requires_grad is not flag), None
        )
        if found is None:
            computed = next((i for i in self._history_read or () if not tensors[i].is_leaf), None)
            if computed is not None:
                return DualgraphError(
                    f"{paths[computed]}: {self.name}'s Python reads whether this input is a leaf "
                    "(grad_fn, is_leaf); its sample was one and this call's is computed under "
                    f"grad, so eager's branch may differ from the replay's {due}pass a leaf "
                    "(a detached copy requiring grad), or graph with samples like the calls"
                )
        twice = same_tensor_twice(paths, tensors) if found is None else None
        if twice is not None:
            earlier, path = twice
            return DualgraphError(
                f"{path}: the same tensor as {earlier}, where the replay's inputs are buffers of "
                f"their own: {self.name}'s Python may tell them apart by identity (query is "
                f"key), so eager's branch may differ from the replay's {due}pass tensors of "
                "their own (clone())"
            )
        own = self._own_param_passed(tensors) if found is None else None
        if own is not None:
            path, name = own
            return DualgraphError(
                f"{path}: {name} or a view of it, a parameter whose grad the "
                "backward graph adds into .grad, where eager sums this input's grad with the "
                f"callable's own first (the sums round otherwise), {due}pass a detached copy, "
                "or graph with param_grads='autograd'"
            )
        path, wanted = found or ("an input", True)
        sample, call = ("did", "does not") if wanted else ("did not", "does")
        return DualgraphError(
            f"{path}: {self.name}'s Python reads whether this input requires grad; its sample "
            f"{sample} and this call's {call}, so eager's branch may differ from the replay's "
            f"{due}pass inputs requiring grad as the samples did, or graph with samples like the "
            "calls"
        )

    def node(self) -> _Node | None:
        """The autograd node of the replay just run (``None``: no backward can follow it).

        Any output that carries grad carries it: which ones do depends on the call (an output
        that only inputs reach needs none where they need none), so none is picked in advance.
        """
        for output in self._probe:
            node = output.grad_fn
            if node is not None:
                return node
        return None

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
        front = self._front
        assert front is not None
        lock = front._lock
        if not lock.acquire(False):
            raise front._busy()
        try:
            if generation == self._dropped:
                raise self._dropped_error()
            front._gate.check_backward(front, self.index)
            result = super()._backward(
                generation,
                needs_input_grad,
                inputs,
                grads,
                through_autograd,
                results_seen,
                replay_node,
            )
            self._backward_task = _current_graph_task_id()
            front._pending[self.index] = None
            front._gate.finished(front, self.index)
            return result
        finally:
            lock.release()

    def _dropped_error(self) -> DualgraphError:
        return DualgraphError(
            f"{self.name}: the backward of a replay that dualgraph.torch.reset_slots "
            f"dropped (slot {self.index}, in flight when the slots were reset); its "
            "buffers and activations belong to the replays after the reset. Run the "
            "forward again"
        )

    def stale_backward(self, generation: int) -> DualgraphError | None:
        """Also dropped by ``reset_slots``; a backward that ran in this very backward (one
        backward through several slots) is no refusal."""
        if generation == self._dropped:
            return self._dropped_error()
        if (
            generation == self._generation
            and self._backward_generation == generation
            and self._backward_task == _current_graph_task_id()
        ):
            return None
        return super().stale_backward(generation)

    def _params_used_elsewhere(self) -> bool:
        """Whether this backward also runs through another slot's replay (``"auto"`` asks).

        Eager sums the grads a parameter gets from every use in one backward, then adds the sum
        into ``.grad``; adding each slot's grads into ``.grad`` in turn would round differently.
        Then every slot of this backward hands its grads to autograd, which sums them as eager.
        """
        if super()._params_used_elsewhere():  # a call run eagerly (_eagerly)
            return True
        front = self._front
        assert front is not None
        for index, recent in enumerate(front._recent):
            if index == self.index or recent is None:
                continue
            node = recent()
            # Asked only in a plain .backward(), which GraphedCallable finds through the same
            # function (so it exists whenever it is asked).
            if node is not None and will_engine_execute_node(node):  # type: ignore[misc]
                return True
        return False


class SlottedCallable:
    """A graphed callable with several replay slots (see the module docstring).

    Calling it replays in a slot its gate gives (a free one, or the schedule's); ``slots`` is
    their number, ``in_flight`` the slots whose backward is pending.

    ``copy.copy``, ``copy.deepcopy`` and pickling give the ungraphed callable, as for
    :class:`GraphedCallable`.
    """

    __slots__ = (
        "_gate",
        "_lock",
        "_pending",
        "_recent",
        "_replays",
        "_unique_bytes",
        "backend",
        "name",
    )

    def __init__(self, replays: Sequence[SlotReplay], gate: FreeSlots | ScheduleCursor) -> None:
        first = replays[0]
        self.name = first.name
        self.backend = first.backend
        self._replays: tuple[SlotReplay, ...] = tuple(replays)
        self._gate = gate
        self._lock = gate.lock
        # Per slot: a weak reference to the autograd node of the replay in flight there.
        self._pending: list[weakref.ref[_Node] | None] = [None] * len(replays)
        # Per slot: the same for its latest replay, kept after its backward has run (until the
        # node dies), so that another slot's backward can tell whether one backward ran both.
        self._recent: list[weakref.ref[_Node] | None] = [None] * len(replays)
        for replay in replays:
            replay._front = self
        self._unique_bytes = _buffer_bytes(replays)

    # -- what a caller sees -------------------------------------------------------------------

    @property
    def spec(self) -> TreeSpec:
        """The output spec recorded at capture."""
        return self._replays[0].spec

    @property
    def eager_graphs(self) -> EagerGraphs | None:
        """Whether a graph of an eager call of it is alive (shared by its slots, ``"auto"``)."""
        return self._replays[0].eager_graphs

    @property
    def slots(self) -> int:
        """How many replays can be in flight at once (one per micro-batch with a schedule)."""
        return len(self._replays)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """The slots whose forward has replayed and whose backward is still to come."""
        return tuple(i for i in range(len(self._replays)) if self._is_in_flight(i))

    @property
    def diagnostics(self) -> CaptureDiagnostics:
        """Every slot together: buffers counted once, pools summed (or the shared one), capture
        times and replays summed."""
        parts = [replay.diagnostics for replay in self._replays]
        first = parts[0]
        inputs, outputs, grads, reused = self._unique_bytes
        shared_pool = isinstance(self._gate, ScheduleCursor)
        return CaptureDiagnostics(
            name=self.name,
            backend=self.backend,
            static_input_bytes=inputs,
            static_output_bytes=outputs,
            static_grad_bytes=grads,
            pool_bytes=first.pool_bytes if shared_pool else sum(p.pool_bytes for p in parts),
            capture_seconds=sum(p.capture_seconds for p in parts),  # each slot's own capture
            has_backward_graph=first.has_backward_graph,
            replays=sum(p.replays for p in parts),
            eager_calls=sum(p.eager_calls for p in parts),
            param_grads_through_autograd=sum(p.param_grads_through_autograd for p in parts),
            # the lint and the memory plan ran once per callable, in its first slot's capture
            lint=next((p.lint for p in parts if p.lint is not None), None),
            memory_plan=next((p.memory_plan for p in parts if p.memory_plan is not None), None),
            slots=len(self._replays),
            in_flight=self.in_flight,
            reused_buffer_bytes=reused,
        )

    def __repr__(self) -> str:
        first = self._replays[0]
        return (
            f"SlottedCallable({self.name!r}, backend={self.backend!r}, slots={len(self._replays)}, "
            f"inputs=({first._inputs.describe()}), outputs={first.spec!r})"
        )

    def __copy__(self) -> EagerCallable:
        return self._replays[0].__copy__()

    def __deepcopy__(self, memo: dict[int, Any]) -> EagerCallable:
        return self._replays[0].__deepcopy__(memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._replays[0].__reduce__()

    # -- a call --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if SCOPE.outer is not None:  # inside another graph, before a slot is taken (_nesting.py)
            return inside_another(self.name, self._replays[0].plan.fn, args, kwargs)
        lock = self._lock
        if not lock.acquire(False):
            raise self._busy()
        try:
            index = self._gate.take(self, autograd_records())
            replay = self._replays[index]
            try:
                outputs = replay(*args, **kwargs)
                node = replay.node()
            finally:
                replay._probe = ()
            if node is not None:  # a replay in flight: its backward is to come
                self._pending[index] = self._recent[index] = weakref.ref(node)
                self._gate.started(self, index)
            elif isinstance(self._gate, ScheduleCursor):
                raise self._gate.no_backward(self)
            return outputs
        finally:
            lock.release()

    def drop_in_flight(self) -> None:
        """Free every slot; the backwards of the replays in flight will raise (reset_slots)."""
        for index, replay in enumerate(self._replays):
            if self._is_in_flight(index):
                replay.drop()
        self._pending = [None] * len(self._replays)

    def _is_in_flight(self, index: int) -> bool:
        pending = self._pending[index]
        return pending is not None and pending() is not None

    def _busy(self) -> DualgraphError:
        if called_again_inside(self._lock):
            return DualgraphError(
                f"{self.name}: called from inside its own call in this thread (a replay hook, "
                "or code its replay runs), while its slots are in use: a graphed callable runs "
                "one call at a time; call it once that call returned"
            )
        return DualgraphError(
            f"{self.name}: called while another thread is running it (or a callable scheduled "
            "with it); its slots and schedule are kept by one thread at a time"
        )


class FreeSlots:
    """``slots=k``: a forward takes the lowest free slot; backwards come in any order.

    A slot is free when its replay's backward has run, or when nothing can run it any more (its
    outputs, and everything computed from them, are gone).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def take(self, front: SlottedCallable, grad_enabled: bool) -> int:
        for attempt in range(2):
            for index in range(len(front._replays)):
                if not front._is_in_flight(index):
                    return index
            if attempt == 0:
                gc.collect()  # outputs dropped in a reference cycle free their slot too
        slots = ", ".join(map(str, range(len(front._replays))))
        raise DualgraphError(
            f"{front.name}: all {len(front._replays)} slots are in flight (slots {slots}: forward "
            "replayed, backward not yet run); another forward would overwrite the activations "
            "of one of them. Run a backward first, drop the outputs of a replay you will not "
            "backpropagate, or capture with more slots"
        )

    def started(self, front: SlottedCallable, index: int) -> None:
        pass

    def check_backward(self, front: SlottedCallable, index: int) -> None:
        pass

    def finished(self, front: SlottedCallable, index: int) -> None:
        pass

    def reset(self, front: SlottedCallable) -> None:
        front.drop_in_flight()


class ScheduleCursor:
    """``schedule=``: where a step is in the schedule, shared by the callables graphed together.

    Every replay must be the next pass of the step (:func:`expand`): a forward of the right
    callable (it takes that micro-batch's slot), or the backward of the right micro-batch (found
    through autograd). Anything else is refused before it touches a buffer.
    """

    def __init__(self, schedule: Schedule, passes: Sequence[ScheduledPass]) -> None:
        self.lock = threading.Lock()
        self.schedule = schedule
        self.passes = tuple(passes)
        self.position = 0
        self.fronts: list[SlottedCallable] = []  # in callable order, set once built

    def take(self, front: SlottedCallable, grad_enabled: bool) -> int:
        expected = self.passes[self.position]
        if not grad_enabled:
            raise DualgraphError(
                f"{front.name}: called with grad disabled, but it replays a pipeline schedule "
                "in which every forward is followed by its backward; evaluate the module in "
                "eval mode (it then runs eagerly) or graph a copy of it separately"
            )
        if expected.backward or self.fronts[expected.callable] is not front:
            raise self._out_of_order(front, "a forward")
        return expected.microbatch

    def started(self, front: SlottedCallable, index: int) -> None:
        self.position = (self.position + 1) % len(self.passes)

    def check_backward(self, front: SlottedCallable, index: int) -> None:
        expected = self.passes[self.position]
        if (
            not expected.backward
            or self.fronts[expected.callable] is not front
            or expected.microbatch != index
        ):
            raise self._out_of_order(front, f"the backward of micro-batch {index}")

    def finished(self, front: SlottedCallable, index: int) -> None:
        self.position = (self.position + 1) % len(self.passes)

    def reset(self, front: SlottedCallable) -> None:
        self.position = 0
        for member in self.fronts:
            member.drop_in_flight()

    def no_backward(self, front: SlottedCallable) -> DualgraphError:
        """The error for a scheduled forward that left nothing for its backward to run on."""
        return DualgraphError(
            f"{front.name}: {self.describe(self.passes[self.position])} ran with no input or "
            "parameter requiring grad, so no backward can follow it, and in a schedule every "
            "forward takes a backward; pass inputs that require grad, as at capture"
        )

    def refuses_calls(self, front: SlottedCallable, calls: int) -> DualgraphError | None:
        """The refusal that ``calls`` forwards of ``front``, each followed at once by its
        backward (as :func:`dualgraph.torch.verify` runs them), would meet from where the step is
        now, found before any runs; ``None`` when they are the schedule's next passes."""
        total = len(self.passes)
        for k in range(2 * min(calls, total)):
            position = (self.position + k) % total
            scheduled = self.passes[position]
            backward = k % 2 == 1
            if (
                self.fronts[scheduled.callable] is not front
                or scheduled.backward != backward
                or (backward and scheduled.microbatch != self.passes[position - 1].microbatch)
            ):
                wanted = "the backward of the forward before it" if backward else "a forward"
                return DualgraphError(
                    f"{front.name}: verify runs {calls} call(s) of it, each forward followed by "
                    f"its backward, but pass {position + 1} of {total} of its schedule's step "
                    f"is {self.describe(scheduled)} where verify would run {wanted}: the "
                    "schedule would refuse it half-way. Nothing ran; verify a copy graphed "
                    "without the schedule, or with a schedule of one micro-batch in flight"
                )
        return None

    def describe(self, scheduled: ScheduledPass) -> str:
        """``the backward of Block for micro-batch 3 (chunk 2)``."""
        kind = "backward" if scheduled.backward else "forward"
        name = self.fronts[scheduled.callable].name
        chunk = f" (chunk {scheduled.chunk + 1})" if self.schedule.chunks > 1 else ""
        return f"the {kind} of {name} for micro-batch {scheduled.microbatch}{chunk}"

    def _out_of_order(self, front: SlottedCallable, what: str) -> DualgraphError:
        expected = self.passes[self.position]
        stuck = ""
        if expected.backward:
            owner = self.fronts[expected.callable]
            if not owner._is_in_flight(expected.microbatch):
                stuck = (
                    "; nothing can run that backward any more (the outputs of that forward are "
                    "gone), so start the step over"
                )
        in_flight = ", ".join(
            f"{member.name} {list(member.in_flight)}" for member in self.fronts if member.in_flight
        )
        return DualgraphError(
            f"{front.name}: {what} is out of schedule order: pass {self.position + 1} of "
            f"{len(self.passes)} of the step is {self.describe(expected)}{stuck}. In flight "
            f"(micro-batch slots): {in_flight or 'none'}. Graphs that share a memory pool replay "
            "safely only in their capture order, the schedule's; run its passes in order, or "
            "call dualgraph.torch.reset_slots(...) to drop the replays in flight and start the "
            "step over"
        )


# -- capture -------------------------------------------------------------------------------------


class SlotLayout:
    """``slots=k``: ``k`` copies of each callable, each slot capturing into a pool of its own."""

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def copies(self, index: int, make: Any) -> list[_Capture]:
        first = make()
        return [first] + [make(like=first) for _ in range(self.slots - 1)]

    def steps(self, copies: Sequence[Sequence[_Capture]]) -> list[CaptureStep]:
        steps = []
        for group in copies:
            for item in group:
                pool = torch.cuda.graph_pool_handle()
                steps += [CaptureStep(item, False, pool), CaptureStep(item, True, pool)]
        return steps


class ScheduleLayout:
    """``schedule=``: a copy per micro-batch, captured in the schedule's order into one pool.

    Micro-batches of a chunk that are never in flight together share static input and
    grad-output buffers (those are written at a replay's start and read until its backward ends).
    """

    def __init__(self, schedule: Schedule, callables: int) -> None:
        self.schedule = schedule
        self.passes = expand(schedule, callables)

    def copies(self, index: int, make: Any) -> list[_Capture]:
        colours = {
            p.microbatch: p.buffers for p in self.passes if p.callable == index and not p.backward
        }
        first: _Capture = make()
        donors = {colours[0]: first}
        copies = [first]
        for microbatch in range(1, self.schedule.microbatches):
            colour = colours[microbatch]
            donor = donors.get(colour)
            item = make(like=first, buffers_from=donor)
            donors.setdefault(colour, item)
            copies.append(item)
        return copies

    def steps(self, copies: Sequence[Sequence[_Capture]]) -> list[CaptureStep]:
        return [CaptureStep(copies[p.callable][p.microbatch], p.backward) for p in self.passes]


def capture_slotted(
    requests: Sequence[CaptureRequest],
    options: CaptureOptions,
    *,
    slots: int | None,
    schedule: Schedule | None,
) -> list[SlottedCallable]:
    """Capture ``requests`` with ``slots`` slots each, or by ``schedule``; one callable each."""
    if schedule is not None:
        layout = ScheduleLayout(schedule, len(requests))
        # A set of static outputs made in the pool would be alive only from its first forward's
        # capture on: the graphs captured before it (earlier micro-batches' forwards) may use
        # that memory, and they replay again at the start of every later step, over outputs the
        # caller still holds. Outside the pool, only the graphs of its own set write them.
        options = dataclasses.replace(options, outputs_outside_pool=True)
        plans = capture_copies(requests, options, layout)
        for request, group in zip(requests, plans, strict=True):
            if not group[0].has_backward:
                raise CaptureError(
                    f"capturing {request.name} ({options.backend}) for a schedule: it has no "
                    "backward (no output requires grad, or nothing takes a grad), but every "
                    "micro-batch of a schedule runs a forward and a backward; graph it without "
                    "the schedule"
                )
        cursor = ScheduleCursor(schedule, layout.passes)
        fronts = [_build(group, cursor) for group in plans]
        cursor.fronts = fronts
    else:
        assert slots is not None
        plans = capture_copies(requests, options, SlotLayout(slots))
        fronts = [_build(group, FreeSlots()) for group in plans]
    for front in fronts:
        GraphedCallable.join(front._replays)
    return fronts


def _build(plans: Sequence[Any], gate: FreeSlots | ScheduleCursor) -> SlottedCallable:
    return SlottedCallable([SlotReplay(plan, i) for i, plan in enumerate(plans)], gate)


def _buffer_bytes(replays: Sequence[SlotReplay]) -> tuple[int, int, int, int]:
    """Static input, output and grad bytes of all slots (each buffer once), and the bytes that
    slots share instead of each holding its own (the in-graph accumulators aside: those are the
    parameters' ``.grad``, one each whatever the slots)."""
    seen: set[int] = set()
    reused = 0

    def count(tensors: Sequence[torch.Tensor | None]) -> int:
        nonlocal reused
        size = 0
        for tensor in tensors:
            if tensor is None:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if id(tensor) in seen:
                reused += nbytes
            else:
                seen.add(id(tensor))
                size += nbytes
        return size

    inputs = outputs = grads = 0
    for replay in replays:
        buffers = replay.plan.buffers
        inputs += count(buffers.inputs)
        outputs += count(buffers.outputs)
        grads += count([*buffers.grad_outputs, *buffers.input_grads, *buffers.param_grads])
    shared = [t for t in replays[0].plan.params.accumulators if t is not None]
    grads += sum(t.numel() * t.element_size() for t in shared)
    return inputs, outputs, grads, reused


def reset_slots_of(front: Any) -> None:
    """Drop the replays in flight (their backwards will raise) and start a schedule over."""
    if not isinstance(front, SlottedCallable):
        raise DualgraphError(
            f"{front.name} was graphed with one slot; reset_slots is for callables graphed with "
            "slots= or schedule="
        )
    lock = front._lock
    if not lock.acquire(False):
        raise front._busy()
    try:
        front._gate.reset(front)
    finally:
        lock.release()


def checked_slots(
    slots: Any, schedule: Any, *, callables: int, pool: Any
) -> tuple[int | None, Schedule | None]:
    """The ``slots`` and ``schedule`` options, checked: ``(None, None)`` for one slot each."""
    if slots is not None and (type(slots) is not int or slots < 1):
        raise DualgraphError(f"slots must be an int >= 1, got {slots!r}")
    if slots is not None and slots > MAX_ORDER:
        raise DualgraphError(
            f"slots={slots}: at most {MAX_ORDER} (each slot is a capture of its own, with its "
            "own buffers)"
        )
    if schedule is None:
        if slots is None or slots == 1:
            return None, None
        if pool is not None:
            raise DualgraphError(
                f"slots={slots} captures each slot into a memory pool of its own (so that slots "
                "replay in any order); it cannot share the pool passed as pool="
            )
        return slots, None
    if slots is not None:
        raise DualgraphError(
            "pass slots or schedule, not both: with a schedule, each callable gets one slot per "
            "micro-batch of the step, and micro-batches never in flight together share buffers"
        )
    if pool is not None:
        # Its graphs are safe in one pool because they replay in the order they were captured
        # in; another call's graphs there replay at other times, and either may overwrite what
        # the other's pending backwards read (no order between them is checked).
        raise DualgraphError(
            "schedule= captures every micro-batch's graphs into a memory pool of their own, "
            "in the schedule's order, which is what makes their replays safe; it cannot share "
            "the pool passed as pool= with graphs replayed outside the schedule"
        )
    if not isinstance(schedule, Schedule):
        schedule = Schedule(schedule)
    schedule.chunk_sizes(callables)  # the callables split into the schedule's chunks
    return None, schedule
