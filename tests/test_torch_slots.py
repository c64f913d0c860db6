"""Several micro-batches in flight per graphed callable: ``slots=`` and ``schedule=``.

The pipeline tests simulate a 4-stage pipeline on one device (``pipeline_cases.py``): 1F1B and
interleaved 1F1B (2 chunks per stage), 8 micro-batches a step, three AdamW steps. Each stage
is graphed with slots (a pool per slot: any order) or with its schedule (one pool, order
checked), and the losses, parameter grads and parameters must equal those of the same eager
pipeline: bit for bit on the CPU (``emulate``), within ``TOLERANCES`` on a GPU.
"""

from __future__ import annotations

import copy
import gc
import importlib
import pickle
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import Pass, Pipeline, device_order, make_data, make_pieces, samples
from test_torch_transformer_engine import BF16, VisionLayer, needs_te, te_dynamo_warning
from test_torch_transformer_engine import _hidden as te_hidden
from torch import nn
from torch_cases import (
    CUDA,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    TinyMLP,
    assert_tensors_match,
    device_of,
    isclose_fraction,
    isolation,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError, SpecMismatchError

STAGES, MICROBATCHES, STEPS = 4, 8, 3


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def schedules(kind: str) -> list[dgt.Schedule]:
    """The schedule of each stage: ``1f1b``, or ``interleaved`` with 2 chunks per stage."""
    if kind == "1f1b":
        return [
            dgt.Schedule.one_f_one_b(stages=STAGES, microbatches=MICROBATCHES, stage=s)
            for s in range(STAGES)
        ]
    return [
        dgt.Schedule.interleaved(stages=STAGES, microbatches=MICROBATCHES, chunks=2, stage=s)
        for s in range(STAGES)
    ]


def graph_stages(
    pieces: Sequence[nn.Module],
    stage_schedules: Sequence[dgt.Schedule],
    layout: str,
    device: torch.device,
    **options: Any,
) -> None:
    """Graph each stage's pieces together: with its schedule, or with as many slots as it needs."""
    for stage, schedule in enumerate(stage_schedules):
        indices = [chunk * STAGES + stage for chunk in range(schedule.chunks)]
        args, kwargs = zip(*(samples(i, device) for i in indices), strict=True)
        how = {"schedule": schedule} if layout == "schedule" else {"slots": max(schedule.in_flight)}
        dgt.make_graphed_callables(
            tuple(pieces[i] for i in indices), args, sample_kwargs=kwargs, **how, **options
        )


def train(
    pipeline: Pipeline, pieces: Sequence[nn.Module], steps: int = STEPS
) -> tuple[list[list[float]], list[list[torch.Tensor]]]:
    """``steps`` AdamW steps; the losses and the parameter grads of each step."""
    params = [p for piece in pieces for p in piece.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        losses.append(pipeline.step())
        grads.append([p.grad.detach().clone() for p in params])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def assert_pipelines_match(
    graphed: Sequence[nn.Module],
    eager: Sequence[nn.Module],
    order: Sequence[Pass],
    device: torch.device,
    backend: str,
) -> None:
    data = make_data(MICROBATCHES, device)
    graphed_losses, graphed_grads = train(Pipeline(graphed, order, STAGES, data), graphed)
    eager_losses, eager_grads = train(Pipeline(eager, order, STAGES, data), eager)
    if tolerance(backend) is None:
        assert graphed_losses == eager_losses
    else:
        torch.testing.assert_close(graphed_losses, eager_losses, atol=1e-5, rtol=1e-5)
    for step, (actual, expected) in enumerate(zip(graphed_grads, eager_grads, strict=True)):
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tensors_match(a, e, f"step {step}, grad {k}", tolerance(backend))
    params = [p for piece in graphed for p in piece.parameters()]
    eager_params = [p for piece in eager for p in piece.parameters()]
    for k, (a, e) in enumerate(zip(params, eager_params, strict=True)):
        assert_tensors_match(a.detach(), e.detach(), f"parameter {k}", tolerance(backend))


# -- pipelines equal eager -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["schedule", "slots"])
@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_pipeline_step_equals_eager_after_three_optimizer_steps(
    layout: str, kind: str, backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    stage_schedules = schedules(kind)
    graphed, eager = make_pieces(STAGES * stage_schedules[0].chunks, device)
    graph_stages(graphed, stage_schedules, layout, device, backend=backend, param_grads=param_grads)
    assert_pipelines_match(graphed, eager, device_order(stage_schedules), device, backend)


@pytest.mark.parametrize("layout", ["schedule", "slots"])
def test_a_pipeline_with_dropout_equals_eager_drawing_the_same_numbers(layout: str) -> None:
    # emulate re-runs each piece, so its draws come in eager's order; a graph draws its own
    device = torch.device("cpu")
    stage_schedules = schedules("1f1b")
    graphed, eager = make_pieces(STAGES, device, dropout=0.25)
    graph_stages(graphed, stage_schedules, layout, device, backend="emulate")
    order = device_order(stage_schedules)
    data = make_data(MICROBATCHES, device)
    torch.manual_seed(1)
    graphed_losses, _ = train(Pipeline(graphed, order, STAGES, data), graphed, steps=2)
    torch.manual_seed(1)
    eager_losses, _ = train(Pipeline(eager, order, STAGES, data), eager, steps=2)
    assert graphed_losses == eager_losses


@pytest.mark.parametrize("layout", ["schedule", "slots"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_pipeline_under_autocast_equals_eager_under_autocast(layout: str, backend: str) -> None:
    device = device_of(backend)
    stage_schedules = schedules("interleaved")
    graphed, eager = make_pieces(2 * STAGES, device)

    def autocast() -> torch.autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)

    with autocast():
        graph_stages(graphed, stage_schedules, layout, device, backend=backend)
    data = make_data(MICROBATCHES, device)
    order = device_order(stage_schedules)
    # the forward passes under autocast, the backward passes outside (torch's AMP recipe)
    graphed_losses, graphed_grads = train(
        Pipeline(graphed, order, STAGES, data, forward_under=autocast), graphed, 2
    )
    eager_losses, eager_grads = train(
        Pipeline(eager, order, STAGES, data, forward_under=autocast), eager, 2
    )
    if backend == CUDA:
        torch.testing.assert_close(graphed_losses, eager_losses, atol=1e-2, rtol=1e-2)
        return
    assert graphed_losses == eager_losses
    for actual, expected in zip(graphed_grads, eager_grads, strict=True):
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tensors_match(a, e, f"grad {k}")


# -- slots ---------------------------------------------------------------------------------------


def _graph(fn: Any, backend: str, *, grad: bool = True, **options: Any) -> Any:
    device = device_of(backend)
    sample = torch.randn(4, 8, device=device, requires_grad=grad)
    return dgt.make_graphed_callables(fn, (sample,), backend=backend, **options)


def _x(backend: str, grad: bool = True) -> torch.Tensor:
    return torch.randn(4, 8, device=device_of(backend), requires_grad=grad)


def _snapshot(graphed: Any) -> list[torch.Tensor]:
    """Every static buffer of every slot, cloned."""
    tensors: list[torch.Tensor] = []
    for replay in runner_of(graphed)._replays:
        buffers = replay.plan.buffers
        for tensor in (
            *buffers.inputs,
            *buffers.outputs,
            *buffers.grad_outputs,
            *buffers.input_grads,
            *buffers.param_grads,
        ):
            if tensor is not None:
                tensors.append(tensor.detach().clone())
    return tensors


def _assert_same_bits(after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    assert len(after) == len(before)
    for k, (a, b) in enumerate(zip(after, before, strict=True)):  # NaN in an unwritten buffer too
        bits_a, bits_b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"static buffer {k} changed"


def _assert_unchanged(graphed: Any, before: list[torch.Tensor]) -> None:
    _assert_same_bits(_snapshot(graphed), before)


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_backwards_in_any_order_find_their_slots_and_match_eager(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    model = TinyMLP().to(device)
    twin = copy.deepcopy(model)
    graphed = _graph(model, backend, slots=3, param_grads=param_grads)
    xs = [_x(backend) for _ in range(3)]
    eager_xs = [x.detach().clone().requires_grad_() for x in xs]
    outputs = [graphed(x) for x in xs]
    expected = [twin(x) for x in eager_xs]
    for k in (2, 0, 1):  # backwards in another order than the forwards
        assert_tensors_match(
            outputs[k].detach(), expected[k].detach(), "output", tolerance(backend)
        )
        outputs[k].square().sum().backward()
        expected[k].square().sum().backward()
        assert_tensors_match(xs[k].grad, eager_xs[k].grad, "input grad", tolerance(backend))
        for p, e in zip(model.parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
    assert dgt.diagnostics(graphed).in_flight == ()


# "in_graph" adds each slot's grads into .grad in turn, where eager adds their sum: the last bit
# may differ once .grad holds something (README: param_grads).
@pytest.mark.parametrize("param_grads", ["auto", "autograd"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_one_backward_through_several_slots_matches_eager(backend: str, param_grads: str) -> None:
    device = device_of(backend)
    model = TinyMLP().to(device)
    twin = copy.deepcopy(model)
    graphed = _graph(model, backend, slots=2, param_grads=param_grads)
    for _ in range(3):  # .grad accumulates: eager adds the sum of both uses' grads into it
        xs = [_x(backend) for _ in range(2)]
        (graphed(xs[0]) * graphed(xs[1])).sum().backward()  # both replays in one autograd pass
        eager_xs = [x.detach().clone().requires_grad_() for x in xs]
        (twin(eager_xs[0]) * twin(eager_xs[1])).sum().backward()
        for x, e in zip(xs, eager_xs, strict=True):
            assert_tensors_match(x.grad, e.grad, "input grad", tolerance(backend))
        for p, e in zip(model.parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
    # "auto": each slot saw the other in its backward and handed its grads to autograd
    assert dgt.diagnostics(graphed).param_grads_through_autograd == 6


@pytest.mark.parametrize("layout", ["slots", "schedule"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_adds_each_slots_grads_into_one_grad_per_parameter(backend: str, layout: str) -> None:
    device = device_of(backend)
    model = TinyMLP().to(device)
    twin = copy.deepcopy(model)
    options: dict[str, Any] = {"slots": 2}
    if layout == "schedule":
        options = {"schedule": dgt.Schedule.one_f_one_b(stages=2, microbatches=4, stage=0)}
    graphed = _graph(model, backend, param_grads="auto", **options)
    replays = runner_of(graphed)._replays
    accumulators = replays[0].plan.params.accumulators
    assert all(r.plan.params.accumulators == accumulators for r in replays)
    for _ in range(2):  # a step of 1F1B for the first of 2 stages: F F B F B F B B
        xs = [_x(backend) for _ in range(4)]
        eager_xs = [x.detach().clone().requires_grad_() for x in xs]
        outputs, expected = [graphed(xs[0])], [twin(eager_xs[0])]
        for k in range(1, 4):
            outputs.append(graphed(xs[k]))
            expected.append(twin(eager_xs[k]))
            outputs[k - 1].square().sum().backward()
            expected[k - 1].square().sum().backward()
        outputs[3].square().sum().backward()
        expected[3].square().sum().backward()
        for x, e in zip(xs, eager_xs, strict=True):
            assert_tensors_match(x.grad, e.grad, "input grad", tolerance(backend))
        for p, e in zip(model.parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
        assert all(p.grad is a for p, a in zip(model.parameters(), accumulators, strict=True))
    assert dgt.diagnostics(graphed).param_grads_through_autograd == 0  # one slot per backward
    model.fc1.bias.register_hook(lambda grad: grad * 2)  # a hook: autograd, in any slot
    twin.fc1.bias.register_hook(lambda grad: grad * 2)
    xs = [_x(backend) for _ in range(2)]
    eager_xs = [x.detach().clone().requires_grad_() for x in xs]
    if layout == "schedule":
        dgt.reset_slots(graphed)
    first, second = graphed(xs[0]), graphed(xs[1])
    first.sum().backward()
    twin(eager_xs[0]).sum().backward()
    if layout == "schedule":  # its next passes: F B, then B
        third = graphed(_x(backend))
    second.sum().backward()
    twin(eager_xs[1]).sum().backward()
    for p, e in zip(model.parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, e.grad, "parameter grad after a hook", tolerance(backend))
    assert dgt.diagnostics(graphed).param_grads_through_autograd == 2
    if layout == "schedule":
        del third


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_stays_valid_while_other_slots_replay(backend: str) -> None:
    graphed = _graph(TinyMLP().to(device_of(backend)), backend, slots=3)
    first = graphed(_x(backend))
    kept = first.detach().clone()
    later = [graphed(_x(backend)) for _ in range(2)]
    later[0].sum().backward()
    graphed(_x(backend))  # reuses the freed slot, not the first one's
    assert_tensors_match(first.detach(), kept, "the first output")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_more_forwards_in_flight_than_slots_are_refused_before_touching_buffers(
    backend: str,
) -> None:
    graphed = _graph(TinyMLP().to(device_of(backend)), backend, slots=2)
    outputs = [graphed(_x(backend)) for _ in range(2)]
    before = _snapshot(graphed)
    with pytest.raises(DualgraphError) as info:
        graphed(_x(backend))
    assert str(info.value).startswith(
        "TinyMLP: all 2 slots are in flight (slots 0, 1: forward replayed, backward not yet run)"
    )
    _assert_unchanged(graphed, before)
    with torch.no_grad(), pytest.raises(DualgraphError, match="all 2 slots are in flight"):
        graphed(_x(backend, grad=False))  # a forward without grad would overwrite them too
    _assert_unchanged(graphed, before)
    outputs.pop(0).sum().backward()
    graphed(_x(backend))


class Joined(nn.Module):
    """Concatenates the keyword tensors its ``**parts`` collects, in the call's order."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, **parts: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, *parts.values()]) * self.weight


@pytest.mark.parametrize("layout", [{"slots": 2}, {"schedule": [1, -1]}], ids=["slots", "schedule"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_keywords_collected_by_var_kwargs_in_another_order_are_refused_before_touching_buffers(
    backend: str, layout: dict[str, Any]
) -> None:
    device = device_of(backend)
    module = Joined().to(device)
    eager = copy.deepcopy(module)
    a, b = torch.randn(1, 8, device=device), torch.randn(2, 8, device=device)
    graphed = dgt.make_graphed_callables(
        module, (_x(backend),), sample_kwargs={"a": a, "b": b}, backend=backend, **layout
    )
    before = _snapshot(graphed)
    with pytest.raises(SpecMismatchError, match=r"^kwargs: the keywords \['b', 'a'\] go to"):
        graphed(_x(backend), b=b, a=a)  # a replay would concatenate a before b
    _assert_unchanged(graphed, before)
    x = _x(backend)
    twin = x.detach().clone().requires_grad_()
    out, want = graphed(x, a=a, b=b), eager(twin, a=a, b=b)  # the slot, or the schedule's pass
    assert_tensors_match(out, want, "output", tolerance(backend))
    out.sum().backward()
    want.sum().backward()
    assert_tensors_match(x.grad, twin.grad, "input grad", tolerance(backend))
    assert_tensors_match(module.weight.grad, eager.weight.grad, "weight grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_slot_whose_outputs_are_dropped_is_free_again(backend: str) -> None:
    graphed = _graph(TinyMLP().to(device_of(backend)), backend, slots=2)
    kept = graphed(_x(backend))
    graphed(_x(backend))  # dropped at once: nothing can run its backward
    loss = graphed(_x(backend)).sum()  # a tensor computed from the outputs holds the replay
    assert dgt.diagnostics(graphed).in_flight == (0, 1)
    with pytest.raises(DualgraphError, match="all 2 slots are in flight"):
        graphed(_x(backend))
    del loss
    assert dgt.diagnostics(graphed).in_flight == (0,)
    kept.sum().backward()
    assert dgt.diagnostics(graphed).in_flight == ()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_call_without_grad_holds_no_slot(backend: str) -> None:
    graphed = _graph(TinyMLP().to(device_of(backend)), backend, slots=2)
    with torch.no_grad():
        for _ in range(3):
            graphed(_x(backend, grad=False))
    assert dgt.diagnostics(graphed).in_flight == ()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_after_its_slot_was_reset_and_reused_is_refused(backend: str) -> None:
    graphed = _graph(TinyMLP().to(device_of(backend)), backend, slots=1 + 1)
    stale = graphed(_x(backend))
    dgt.reset_slots(graphed)
    assert dgt.diagnostics(graphed).in_flight == ()
    fresh = graphed(_x(backend))  # slot 0 again
    with pytest.raises(DualgraphError, match=r"reset_slots dropped \(slot 0"):
        stale.sum().backward()
    fresh.sum().backward()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_each_slot_draws_fresh_random_numbers(backend: str) -> None:
    def drop(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, True)

    graphed = _graph(drop, backend, slots=2)
    ones = torch.ones(4, 8, device=device_of(backend), requires_grad=True)
    in_flight = [graphed(ones) for _ in range(2)]  # slots 0 and 1
    masks = [out.detach() != 0 for out in in_flight]
    for out in in_flight:
        out.sum().backward()
    with torch.no_grad():  # slot 0 again, twice
        masks += [graphed(ones.detach()) != 0 for _ in range(2)]
    for mask in masks:
        assert isclose_fraction(mask.float().mean().item(), 0.5, spread=0.25)
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), f"replays {j} and {i} drew the same"


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_module_with_slots_restores_copies_and_pickles_as_eager(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    _graph(module, backend, slots=2)
    assert isinstance(runner_of(module), dgt.SlottedCallable)
    assert "slots=2" in repr(runner_of(module))
    copied = copy.deepcopy(module)
    copied(torch.randn(3, 8, device=device))  # eager: any batch
    restored = pickle.loads(pickle.dumps(module))
    restored(torch.randn(5, 8, device=device))
    assert dgt.restore(module) is module
    module(torch.randn(2, 8, device=device))


def test_a_function_with_slots_copies_as_an_eager_callable() -> None:
    graphed = _graph(torch.tanh, "emulate", slots=2)
    assert isinstance(graphed, dgt.SlottedCallable)
    assert isinstance(copy.copy(graphed), dgt.EagerCallable)
    assert isinstance(copy.deepcopy(graphed), dgt.EagerCallable)
    assert isinstance(pickle.loads(pickle.dumps(graphed)), dgt.EagerCallable)


def test_a_second_thread_is_refused_while_one_runs_a_slotted_callable() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(10)
        return x * 2

    graphed = _graph(slow, "emulate", slots=2)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            graphed(_x("emulate")).sum().backward()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    worker = threading.Thread(target=call)
    worker.start()
    assert entered.wait(10)
    with pytest.raises(DualgraphError, match="called while another thread is running it"):
        graphed(_x("emulate"))
    release.set()
    worker.join(10)
    assert not errors


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_diagnostics_count_each_slots_buffers(backend: str) -> None:
    one = dgt.diagnostics(_graph(TinyMLP().to(device_of(backend)), backend))
    graphed = _graph(TinyMLP().to(device_of(backend)), backend, slots=3)
    three = dgt.diagnostics(graphed)
    assert (three.slots, three.in_flight, three.reused_buffer_bytes) == (3, (), 0)
    assert three.static_input_bytes == 3 * one.static_input_bytes
    assert three.static_output_bytes == 3 * one.static_output_bytes
    # the default "auto": the slots share one accumulator (.grad) per parameter
    accumulators = sum(p.numel() * p.element_size() for p in TinyMLP().parameters())
    assert three.static_grad_bytes == 3 * (one.static_grad_bytes - accumulators) + accumulators
    if backend == CUDA:  # a pool per slot, each counted
        pools = [replay.diagnostics.pool_bytes for replay in runner_of(graphed)._replays]
        assert one.pool_bytes > 0 and min(pools) > 0 and three.pool_bytes == sum(pools)


@pytest.mark.parametrize("layout", [{"slots": 2}, {"schedule": [1, 1, -1, -1]}])
def test_diagnostics_keep_the_lint_report_and_the_memory_plan(layout: dict[str, Any]) -> None:
    # the slots' diagnostics were built without them: None, where a plain capture keeps both
    graphed = _graph(TinyMLP(), "emulate", lint="error", **layout)
    report = dgt.diagnostics(graphed)
    assert report.lint is not None and report.lint.callables == ("TinyMLP",)
    assert report.memory_plan is not None
    assert [c.name for c in report.memory_plan.callables] == ["TinyMLP"]


@pytest.mark.parametrize("layout", [{"slots": 3}, {"schedule": [1, 1, -1, -1]}])
def test_diagnostics_count_the_capture_time_of_every_slot(layout: dict[str, Any]) -> None:
    # each slot is a capture of its own; the time reported was the first slot's alone (shape
    # buckets sum theirs)
    graphed = _graph(TinyMLP(), "emulate", **layout)
    parts = [replay.diagnostics.capture_seconds for replay in runner_of(graphed)._replays]
    assert all(part > 0 for part in parts)
    assert dgt.diagnostics(graphed).capture_seconds == pytest.approx(sum(parts))


# -- schedules -----------------------------------------------------------------------------------


def _scheduled(backend: str, schedule: Any, count: int = 1, **options: Any) -> tuple[Any, ...]:
    device = device_of(backend)
    modules = tuple(TinyMLP().to(device) for _ in range(count))
    args = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in modules)
    graphed = dgt.make_graphed_callables(
        modules, args, backend=backend, schedule=schedule, **options
    )
    return tuple(graphed)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_out_of_order_forward_is_refused_before_touching_buffers(backend: str) -> None:
    (graphed,) = _scheduled(backend, dgt.Schedule.one_f_one_b(stages=2, microbatches=3, stage=0))
    outputs = [graphed(_x(backend)) for _ in range(2)]
    before = _snapshot(graphed)
    with pytest.raises(DualgraphError) as info:
        graphed(_x(backend))  # the schedule wants the backward of micro-batch 0 now
    assert str(info.value).startswith(
        "TinyMLP: a forward is out of schedule order: pass 3 of 6 of the step is the backward of "
        "TinyMLP for micro-batch 0. In flight (micro-batch slots): TinyMLP [0, 1]."
    )
    _assert_unchanged(graphed, before)
    with pytest.raises(DualgraphError, match="the backward of micro-batch 1 is out of schedule"):
        outputs[1].sum().backward()
    _assert_unchanged(graphed, before)
    outputs[0].sum().backward()  # in order: fine
    graphed(_x(backend))


class Second(TinyMLP):
    """A second chunk member, with a name of its own in messages."""


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_callables_of_a_chunk_run_in_turn_forward_then_in_reverse(backend: str) -> None:
    device = device_of(backend)
    modules = (TinyMLP().to(device), Second().to(device))
    args = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in modules)
    first, second = dgt.make_graphed_callables(
        modules, args, backend=backend, schedule=[1, 1, -1, -1]
    )
    outputs = [second(first(_x(backend)))]
    before = _snapshot(first) + _snapshot(second)
    with pytest.raises(DualgraphError) as info:
        second(_x(backend))
    assert "pass 3 of 8 of the step is the forward of TinyMLP for micro-batch 1" in str(info.value)
    _assert_same_bits(_snapshot(first) + _snapshot(second), before)
    outputs.append(second(first(_x(backend))))
    with pytest.raises(DualgraphError) as info:
        outputs[1].sum().backward()
    assert "pass 5 of 8 of the step is the backward of Second for micro-batch 0" in str(info.value)
    outputs[0].sum().backward()  # Second's backward, then TinyMLP's
    outputs[1].sum().backward()
    assert dgt.diagnostics(first).in_flight == dgt.diagnostics(second).in_flight == ()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_call_without_grad_is_refused(backend: str) -> None:
    (graphed,) = _scheduled(backend, [1, -1])
    with torch.no_grad(), pytest.raises(DualgraphError, match="called with grad disabled"):
        graphed(_x(backend, grad=False))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_step_abandoned_half_way_starts_over_after_reset(backend: str) -> None:
    (graphed,) = _scheduled(backend, [1, 1, -1, -1])
    stale = graphed(_x(backend))
    dropped = graphed(_x(backend))
    del dropped
    stale.sum().backward()
    with pytest.raises(DualgraphError, match="nothing can run that backward any more"):
        graphed(_x(backend))
    dgt.reset_slots(graphed)
    first = graphed(_x(backend))
    with pytest.raises(DualgraphError, match="out of schedule order"):
        stale.sum().backward()
    second = graphed(_x(backend))
    first.sum().backward()
    second.sum().backward()
    assert dgt.diagnostics(graphed).in_flight == ()


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_schedule_shares_buffers_between_microbatches_never_in_flight_together(
    backend: str, param_grads: str
) -> None:
    schedule = dgt.Schedule.one_f_one_b(stages=2, microbatches=6, stage=0)  # 2 in flight
    (graphed,) = _scheduled(backend, schedule, param_grads=param_grads)
    replays = runner_of(graphed)._replays
    assert len(replays) == 6
    for k in range(2, 6):  # micro-batch k reuses the buffers of micro-batch k % 2
        same, other = replays[k % 2].plan.buffers, replays[k].plan.buffers
        assert same.inputs == other.inputs and same.outputs == other.outputs
        assert same.grad_outputs == other.grad_outputs
        assert same.input_grads == other.input_grads and same.param_grads == other.param_grads
    assert replays[0].static_inputs[0] is not replays[1].static_inputs[0]
    report = dgt.diagnostics(graphed)
    slots = dgt.diagnostics(_graph(TinyMLP().to(device_of(backend)), backend, slots=2,
                                   param_grads=param_grads))  # fmt: skip
    assert report.slots == 6
    assert report.static_input_bytes == slots.static_input_bytes
    assert report.static_output_bytes == slots.static_output_bytes
    assert report.static_grad_bytes == slots.static_grad_bytes
    accumulators = sum(p.numel() * 4 for p in TinyMLP().parameters())
    if param_grads != "autograd":  # one .grad per parameter: not a per-slot buffer
        per_slot = (slots.static_grad_bytes - accumulators) // 2
    else:
        per_slot = slots.static_grad_bytes // 2
    per_slot += (slots.static_input_bytes + slots.static_output_bytes) // 2
    assert report.reused_buffer_bytes == 4 * per_slot


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_and_grads_of_a_schedule_land_in_the_shared_buffers(backend: str) -> None:
    device = device_of(backend)
    model = TinyMLP().to(device)
    twin = copy.deepcopy(model)
    (graphed,) = dgt.make_graphed_callables(
        (model,),
        ((torch.randn(4, 8, device=device, requires_grad=True),),),
        backend=backend,
        schedule=[1, -1, 1, -1, 1, -1],  # one in flight: three micro-batches, one set of buffers
    )
    for _ in range(3):
        x = _x(backend)
        e = x.detach().clone().requires_grad_()
        out, expected = graphed(x), twin(e)
        assert_tensors_match(out.detach(), expected.detach(), "output", tolerance(backend))
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_tensors_match(x.grad, e.grad, "input grad", tolerance(backend))
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, q.grad, "parameter grad", tolerance(backend))


class _Residual(nn.Module):
    """``x + tanh(fc(x)) * 2``: temporaries of the output's size, freed within the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_output_stays_valid_into_the_next_step_until_its_set_is_reused(
    backend: str,
) -> None:
    """The second set of buffers holds the step's last micro-batch's output: the next step's
    first forward (the graph captured before that set existed) must leave it alone."""
    (graphed,) = dgt.make_graphed_callables(
        (_Residual().to(device_of(backend)),),
        ((_x(backend),),),
        backend=backend,
        schedule=[1, 1, -1, 1, -1, 1, -1, -1],  # micro-batches 0 and 2 share a set, 1 and 3
    )
    outputs, backwards = [], 0
    for c in [1, 1, -1, 1, -1, 1, -1, -1]:
        if c > 0:
            outputs.append(graphed(_x(backend)))  # all kept, as for logging
        else:
            outputs[backwards].square().sum().backward()
            backwards += 1
    kept = outputs[3].detach()
    expected = kept.clone()
    graphed(_x(backend))  # the next step's micro-batch 0
    _assert_same_bits([kept], [expected])


@pytest.mark.cuda
def test_on_a_gpu_a_schedules_static_outputs_lie_outside_its_pool() -> None:
    """Each set of static outputs is a buffer of its own, not pool memory that a graph captured
    before it (an earlier micro-batch's forward) writes at the start of every step."""
    device = device_of(CUDA)
    first, second = dgt.make_graphed_callables(
        (_Residual().to(device), _Residual().to(device)),
        ((_x(CUDA),), (_x(CUDA),)),
        schedule=dgt.Schedule.one_f_one_b(stages=3, microbatches=6, stage=0),
    )
    ranges = [
        (segment["address"], segment["address"] + segment["total_size"])
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    ]
    assert ranges, "no private pool found"
    for graphed in (first, second):
        for replay in runner_of(graphed)._replays:
            for output in replay.plan.buffers.outputs:
                address = output.data_ptr()
                assert not any(start <= address < end for start, end in ranges), replay.index


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_schedule_needs_a_backward(backend: str) -> None:
    with pytest.raises(CaptureError, match="for a schedule: it has no backward"):
        dgt.make_graphed_callables(
            lambda x: x.argmax(-1), (_x(backend),), backend=backend, schedule=[1, -1]
        )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_schedule_refused_after_capture_lets_its_graphs_go(backend: str) -> None:
    """The refusal comes once the copies are captured; while the error is held, their graphs
    and static buffers are not kept by it."""
    seen: list[Any] = []

    def no_backward(x: torch.Tensor) -> torch.Tensor:
        seen.append(weakref.ref(x))
        return x.argmax(-1)

    importlib.import_module("torch._dynamo")  # its first import leaves a cycle through frames
    gc.disable()  # only reference counts may free them
    try:
        with pytest.raises(CaptureError, match="for a schedule: it has no backward") as caught:
            dgt.make_graphed_callables(
                no_backward, (_x(backend),), backend=backend, schedule=[1, -1]
            )
        assert seen and [ref() for ref in seen] == [None] * len(seen)
        del caught
    finally:
        gc.enable()


# -- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"slots": 0}, "slots must be an int >= 1, got 0"),
        ({"slots": True}, "slots must be an int >= 1, got True"),
        ({"slots": 2.0}, "slots must be an int >= 1, got 2.0"),
        ({"slots": 10**9}, r"slots=1000000000: at most 65536 \(each slot is a capture"),
        ({"slots": 2, "schedule": [1, -1]}, "pass slots or schedule, not both"),
        ({"schedule": [1, 0]}, r"schedule order\[1\]: expected a nonzero int"),
        ({"schedule": [1, 2, -2, -1]}, "1 callable.* do not split evenly into its 2 chunks"),
        ({"schedule": "1,-1"}, "schedule order must be a sequence of ints"),
    ],
)
def test_bad_slot_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),), **options)


@pytest.mark.cuda
def test_slots_cannot_share_a_pool_passed_in() -> None:
    pool = torch.cuda.graph_pool_handle()
    with pytest.raises(DualgraphError, match="each slot into a memory pool of its own"):
        _graph(TinyMLP().cuda(), CUDA, slots=2, pool=pool)


class _BranchesOnRequiresGrad(nn.Module):
    """Normalizes over the batch (a running count moves on each training forward), then
    scales by 2 where its input requires grad, by 3 where not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * (2.0 if x.requires_grad else 3.0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_call_that_would_run_eagerly_is_refused_before_it_runs(backend: str) -> None:
    # The call's input needs no grad where the sample's did, and the forward reads it: it runs
    # eagerly. Under a schedule it ran (the batch norm counting a batch), then was refused as
    # having 'no input or parameter requiring grad', which the parameters are.
    device = device_of(backend)
    module = _BranchesOnRequiresGrad().to(device)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, schedule=[1, -1])
    with pytest.raises(
        DualgraphError,
        match=r"args\[0\]: _BranchesOnRequiresGrad's Python reads whether this input requires "
        r"grad; its sample did and this call's does not.*forward of _BranchesOnRequiresGrad "
        r"for micro-batch 0 is due. Nothing ran",
    ):
        module(torch.randn(3, 4, device=device))
    assert module.norm.num_batches_tracked.item() == 0
    module(torch.randn(3, 4, device=device, requires_grad=True)).sum().backward()  # the step
    assert module.norm.num_batches_tracked.item() == 1
    assert module.fc.weight.grad is not None


class _BranchesOnLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if x.is_leaf else 3.0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_call_of_a_tensor_computed_under_grad_read_as_a_leaf_is_refused(
    backend: str,
) -> None:
    device = device_of(backend)
    module = _BranchesOnLeaf().to(device)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, schedule=[1, -1])
    computed = torch.randn(3, 4, device=device, requires_grad=True) * 2
    with pytest.raises(
        DualgraphError,
        match=r"args\[0\]: _BranchesOnLeaf's Python reads whether this input is a leaf "
        r"\(grad_fn, is_leaf\); its sample was one and this call's is computed under grad.*"
        r"Nothing ran",
    ):
        module(computed)
    assert dgt.diagnostics(module).in_flight == ()
    module(computed.detach().requires_grad_()).sum().backward()  # the step, replayed
    assert module.fc.weight.grad is not None


def test_a_schedule_cannot_share_a_pool_passed_in() -> None:
    # Another call's graphs in the schedule's pool replay outside the schedule's order: a replay
    # of the stage could overwrite the activations of the other's pending backward (on CUDA,
    # wrong grads), and no order between them was checked (a plain graph there is refused).
    pool = (0, 7)  # what torch.cuda.graph_pool_handle() gives; emulate takes it as a name
    first = nn.Linear(4, 4)
    dgt.make_graphed_callables(first, (torch.randn(2, 4, requires_grad=True),), pool=pool)
    stage = nn.Linear(4, 4)
    with pytest.raises(DualgraphError, match=r"schedule= captures .* cannot share the pool"):
        dgt.make_graphed_callables(
            stage, (torch.randn(2, 4, requires_grad=True),), schedule=[1, -1], pool=pool
        )
    assert stage(torch.ones(2, 4)).grad_fn is not None  # left as it was: eager


def test_one_slot_is_the_plain_graphed_callable() -> None:
    graphed = _graph(torch.tanh, "emulate", slots=1)
    assert isinstance(graphed, dgt.GraphedCallable)
    assert dgt.diagnostics(graphed).slots == 1


def test_reset_slots_needs_a_slotted_callable() -> None:
    with pytest.raises(DualgraphError, match="graphed with one slot"):
        dgt.reset_slots(_graph(torch.tanh, "emulate"))


def test_the_eager_backend_ignores_slots_and_schedules() -> None:
    graphed = _graph(torch.tanh, "eager", slots=3)
    assert isinstance(graphed, dgt.EagerCallable)
    graphed = _graph(torch.tanh, "eager", schedule=[1, -1])
    assert isinstance(graphed, dgt.EagerCallable)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_replay_with_nothing_requiring_grad_holds_no_slot(backend: str) -> None:
    graphed = _graph(torch.tanh, backend, slots=2)  # a function: no parameters
    for _ in range(3):
        out = graphed(_x(backend, grad=False))  # under grad mode, but nothing requires grad
        assert out.grad_fn is None
    assert dgt.diagnostics(graphed).in_flight == ()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_forward_that_no_backward_can_follow_is_refused(backend: str) -> None:
    graphed = _graph(torch.tanh, backend, schedule=[1, -1])
    before = _snapshot(graphed)
    with pytest.raises(DualgraphError, match="ran with no input or parameter requiring grad"):
        graphed(_x(backend, grad=False))
    _assert_unchanged(graphed, before)  # refused before its replay
    assert runner_of(graphed)._replays[0].generation == 0
    out = graphed(_x(backend))  # the schedule did not move on
    out.sum().backward()


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
@pytest.mark.parametrize(
    "how", [{"slots": 2}, {"schedule": [1, 1, -1, -1]}], ids=["slots", "schedule"]
)
def test_a_transformer_engine_layer_with_two_in_flight_matches_eager(how: dict[str, Any]) -> None:
    layer = VisionLayer().cuda()
    eager = copy.deepcopy(layer)
    graphed = dgt.make_graphed_callables(layer, (te_hidden(),), backend="cuda", **how)
    for _ in range(2):  # two steps of two micro-batches, both in flight
        xs = [te_hidden() for _ in range(2)]
        eager_xs = [x.detach().clone().requires_grad_() for x in xs]
        outputs = [graphed(x) for x in xs]
        expected = [eager(x) for x in eager_xs]
        for (hidden, extra), (hidden_eager, _) in zip(outputs, expected, strict=True):
            assert extra is None
            torch.testing.assert_close(hidden, hidden_eager, **BF16)
            hidden.float().square().mean().backward()
            hidden_eager.float().square().mean().backward()
        for x, e in zip(xs, eager_xs, strict=True):
            torch.testing.assert_close(x.grad, e.grad, **BF16)
    for (name, param), param_eager in zip(
        layer.named_parameters(), eager.parameters(), strict=True
    ):
        torch.testing.assert_close(param.grad, param_eager.grad, **BF16, msg=name)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_hook_runs_once_per_replay_in_any_slot(backend: str) -> None:
    device = device_of(backend)
    model = TinyMLP().to(device)
    twin = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    expected: list[torch.Tensor] = []
    model.fc1.weight.register_hook(lambda grad: seen.append(grad.clone()))
    twin.fc1.weight.register_hook(lambda grad: expected.append(grad.clone()))
    graphed = _graph(model, backend, slots=2)
    xs = [_x(backend) for _ in range(2)]
    outputs = [graphed(x) for x in xs]
    eager_outputs = [twin(x.detach().clone().requires_grad_()) for x in xs]
    for k in (1, 0):
        outputs[k].square().sum().backward()
        eager_outputs[k].square().sum().backward()
    assert len(seen) == len(expected) == 2
    for a, e in zip(seen, expected, strict=True):
        assert_tensors_match(a, e, "hooked grad", tolerance(backend))


class _FirstWithoutGrad(nn.Module):
    """Returns first an output that carries no grad in the test's calls, then the hidden state."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.first = first
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lin(h).tanh()
        if self.first == "int mask":
            return (hidden > 0).int(), hidden
        if self.first == "detached":
            return hidden.detach() * 2, hidden
        return x * 2, hidden  # "input only": needs grad only where x does (not in these calls)


@pytest.mark.parametrize("first", ["int mask", "detached", "input only"])
@pytest.mark.parametrize("layout", ["slots", "schedule"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_slots_track_a_replay_whose_first_output_carries_no_grad(
    backend: str, layout: str, first: str
) -> None:
    device = device_of(backend)
    model = _FirstWithoutGrad(first).to(device)
    twin = copy.deepcopy(model)
    how: dict[str, Any] = {"slots": 2} if layout == "slots" else {"schedule": [1, 1, -1, -1]}
    sample = (_x(backend, grad=first == "input only"), _x(backend))
    graphed = dgt.make_graphed_callables(model, sample, backend=backend, **how)
    for _ in range(2):  # two micro-batches in flight, backwards oldest first; .grad accumulates
        xs = [_x(backend, grad=False) for _ in range(2)]
        hs = [_x(backend) for _ in range(2)]
        eager_hs = [h.detach().clone().requires_grad_() for h in hs]
        outputs = [graphed(x, h) for x, h in zip(xs, hs, strict=True)]
        assert dgt.diagnostics(graphed).in_flight == (0, 1)
        expected = [twin(x, h) for x, h in zip(xs, eager_hs, strict=True)]
        for k in range(2):
            assert_tensors_match(outputs[k][0], expected[k][0], "first output", tolerance(backend))
            assert outputs[k][0].requires_grad is expected[k][0].requires_grad is False
            assert_tensors_match(outputs[k][1].detach(), expected[k][1].detach(), "hidden")
            outputs[k][1].square().sum().backward()
            expected[k][1].square().sum().backward()
            assert_tensors_match(hs[k].grad, eager_hs[k].grad, "input grad", tolerance(backend))
        for p, e in zip(model.parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
    assert dgt.diagnostics(graphed).in_flight == ()


@pytest.mark.parametrize("layout", ["slots", "schedule"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_backward_of_a_replay_in_flight_at_reset_is_refused(backend: str, layout: str) -> None:
    device = device_of(backend)
    model = TinyMLP().to(device)
    twin = copy.deepcopy(model)
    how: dict[str, Any] = {"slots": 2} if layout == "slots" else {"schedule": [1, 1, -1, -1]}
    graphed = _graph(model, backend, **how)
    stale = [graphed(_x(backend)) for _ in range(2)]
    dgt.reset_slots(graphed)
    assert dgt.diagnostics(graphed).in_flight == ()
    before = _snapshot(graphed)
    for k in (1, 0):  # nothing has reused slot 1 yet: its buffers hold the dropped replay still
        with pytest.raises(DualgraphError, match=rf"reset_slots dropped \(slot {k}, in flight"):
            stale[k].sum().backward()
    _assert_unchanged(graphed, before)
    assert all(p.grad is None for p in model.parameters())
    xs = [_x(backend) for _ in range(2)]
    eager_xs = [x.detach().clone().requires_grad_() for x in xs]
    outputs = [graphed(x) for x in xs]  # the slots work on, the schedule from its start
    with pytest.raises(DualgraphError, match=r"reset_slots dropped \(slot 0"):
        stale[0].sum().backward()
    for out, x in zip(outputs, eager_xs, strict=True):
        out.square().sum().backward()
        twin(x).square().sum().backward()
    for x, e in zip(xs, eager_xs, strict=True):
        assert_tensors_match(x.grad, e.grad, "input grad", tolerance(backend))
    for p, e in zip(model.parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))


def _grads_of(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("how", ["overwritten", "retained", "reset"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_backward_through_a_slot_that_cannot_run_it_is_refused_before_any_grad_changes(
    backend: str, param_grads: str, how: str
) -> None:
    """One backward through two slots, one of which will refuse (its backward already ran with
    retain_graph=True, or reset_slots dropped it): the later replay's backward runs first in the
    engine, and must not add its grads before the earlier one refuses."""
    model = TinyMLP().to(device_of(backend))
    graphed = _graph(model, backend, slots=2, param_grads=param_grads)
    xs = [_x(backend) for _ in range(2)]
    first = graphed(xs[0])
    if how == "retained":  # slot 1 next, slot 0 keeps the replay whose backward ran
        second = graphed(xs[1])
        first.sum().backward(retain_graph=True)
    else:
        if how == "overwritten":
            first.sum().backward(retain_graph=True)
        else:
            dgt.reset_slots(graphed)
        second = graphed(xs[1])  # slot 0 again: free after the backward, or after the reset
    before = _grads_of(model)
    with pytest.raises(DualgraphError, match=r"earlier replay|second backward|reset_slots dropped"):
        (first.sum() + second.sum()).backward()
    assert xs[1].grad is None
    for k, (now, then) in enumerate(zip(_grads_of(model), before, strict=True)):
        assert (now is None) == (then is None), k
        if now is not None:
            assert torch.equal(now, then), f"parameter {k}'s grad changed before the refusal"
    assert dgt.diagnostics(graphed).in_flight != ()  # the second replay's backward can still run
    second.sum().backward()
    assert xs[1].grad is not None


class _ScalesByGradMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if torch.is_grad_enabled() else 3.0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_eager_calls_of_every_slot_are_counted_together(backend: str) -> None:
    # a call under no_grad of a callable reading grad mode runs eagerly, in whichever slot
    module = _ScalesByGradMode().to(device_of(backend))
    _graph(module, backend, slots=2)
    with torch.no_grad():
        module(_x(backend, grad=False))
    assert dgt.diagnostics(module).eager_calls == 1


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(a)) * b


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_call_passing_one_tensor_twice_is_refused_before_it_runs(
    backend: str,
) -> None:
    # One tensor at two inputs runs eagerly (its Python may tell them apart by identity); under
    # a schedule that is refused, naming the second, before anything ran.
    device = device_of(backend)
    module = _Pair().to(device)
    samples = [torch.randn(3, 4, device=device, requires_grad=True) for _ in range(2)]
    dgt.make_graphed_callables(module, tuple(samples), backend=backend, schedule=[1, -1])
    x = torch.randn(3, 4, device=device, requires_grad=True)
    with pytest.raises(
        DualgraphError,
        match=r"^args\[1\]: the same tensor as args\[0\], where the replay's inputs are buffers "
        r"of their own: _Pair's Python may tell them apart by identity .*forward of _Pair for "
        r"micro-batch 0 is due. Nothing ran.* pass tensors of their own \(clone\(\)\)$",
    ):
        module(x, x)
    assert module.norm.num_batches_tracked.item() == 0
    module(x, x.clone()).sum().backward()  # the step
    assert module.norm.num_batches_tracked.item() == 1


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_scheduled_call_passing_its_own_parameter_is_refused_before_it_runs(
    backend: str,
) -> None:
    # A call passing a parameter whose grad the graph adds into .grad runs eagerly (eager sums
    # that input's grad with the callable's own first); under a schedule that is refused,
    # naming the input and the parameter, before anything ran.
    device = device_of(backend)
    module = _Pair().to(device)
    module.fc = nn.Linear(3, 3).to(device)
    module.norm = nn.BatchNorm1d(3).to(device)
    samples = [torch.randn(3, 3, device=device, requires_grad=True) for _ in range(2)]
    dgt.make_graphed_callables(module, tuple(samples), backend=backend, schedule=[1, -1])
    x = torch.randn(3, 3, device=device, requires_grad=True)
    with pytest.raises(
        DualgraphError,
        match=r"^args\[1\]: _Pair\.fc\.weight or a view of it, a parameter whose grad the "
        r"backward graph adds into \.grad, .*forward of _Pair for micro-batch 0 is due\. "
        r"Nothing ran\..* pass a detached copy, or graph with param_grads='autograd'$",
    ):
        module(x, module.fc.weight.t())
    assert module.norm.num_batches_tracked.item() == 0
    module(x, module.fc.weight.detach()).sum().backward()  # the step
    assert module.norm.num_batches_tracked.item() == 1
