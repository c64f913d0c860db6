"""Replay hooks: host code around every forward and backward replay, on every backend.

Each test records the events a :class:`~dualgraph.torch.ReplayHooks` sees and checks them
against what the calls did: the same events on ``emulate``, ``eager`` and ``cuda``, with slots,
buckets and their eager fallback, and the per-call state carried from a forward's hooks to its
backward's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch_cases import (
    CUDA,
    GRAD_MODES,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    TinyMLP,
    device_of,
    isolation,
    runner_of,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


class Recorder:
    """Replay hooks that log ``(hook, name, index)`` and keep the calls they saw."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.outputs: list[Any] = []
        self.calls: list[dgt.ReplayCall] = []

    def hooks(self) -> dgt.ReplayHooks:
        return dgt.ReplayHooks(
            before_forward=lambda call: self._log("before_forward", call),
            after_forward=self._after_forward,
            before_backward=lambda call: self._log("before_backward", call),
            after_backward=lambda call: self._log("after_backward", call),
        )

    def _after_forward(self, call: dgt.ReplayCall) -> None:
        self.outputs.append(call.outputs)
        self._log("after_forward", call)

    def _log(self, hook: str, call: dgt.ReplayCall) -> None:
        self.events.append((hook, call.name, call.index))
        self.calls.append(call)

    def names(self) -> list[str]:
        return [event[0] for event in self.events]


def _x(device: torch.device, grad: bool = True) -> torch.Tensor:
    return torch.randn(4, 8, device=device, requires_grad=grad)


ONE_REPLAY = ["before_forward", "after_forward", "before_backward", "after_backward"]


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_each_replay_runs_the_four_hooks_in_order_on_every_backend(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    recorder = Recorder()
    model = dgt.make_graphed_callables(
        TinyMLP().to(device),
        (_x(device),),
        backend=backend,
        param_grads=param_grads,
        replay_hooks=recorder.hooks(),
    )
    assert recorder.events == []  # warmup and capture run no replay hook
    for _ in range(2):
        out = model(_x(device))
        assert recorder.outputs[-1] is out  # after_forward sees what the call returns
        out.square().sum().backward()
    assert recorder.names() == ONE_REPLAY * 2
    assert {event[1:] for event in recorder.events} == {("TinyMLP", 0)}
    call = recorder.calls[0]
    assert call.backend == backend and call.backward_expected and call.outputs is None
    assert call is recorder.calls[3]  # one ReplayCall per replay, forward to backward


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "autograd"]
)
@pytest.mark.parametrize("layout", ["one", "slots", "buckets"])
def test_after_backward_sees_the_grads_a_graph_adds_into_grad(
    backend: str, param_grads: str, layout: str
) -> None:
    """Where a graph adds the parameter grads (``"auto"``'s accumulate graph, ``"in_graph"``),
    ``after_backward`` runs once they are in ``.grad``."""
    device = device_of(backend)
    module = TinyMLP().to(device)
    seen: list[list[torch.Tensor]] = []
    hooks = dgt.ReplayHooks(
        after_backward=lambda call: seen.append([p.grad.clone() for p in module.parameters()])
    )
    options: dict[str, Any] = {
        "backend": backend,
        "param_grads": param_grads,
        "replay_hooks": hooks,
    }
    if layout == "buckets":
        buckets = [(torch.randn(n, 8, device=device, requires_grad=True),) for n in (4, 6)]
        model = dgt.make_graphed_callables(module, buckets=buckets, **options)
    else:
        slots = 2 if layout == "slots" else None
        model = dgt.make_graphed_callables(module, (_x(device),), slots=slots, **options)
    for step in range(3):
        model(_x(device)).square().sum().backward()
        assert len(seen) == step + 1
        for grad, param in zip(seen[-1], module.parameters(), strict=True):
            assert torch.equal(grad, param.grad)
    assert dgt.diagnostics(model).param_grads_through_autograd == 0


@pytest.mark.parametrize(
    "backend", ["emulate", "eager", pytest.param(CUDA, marks=pytest.mark.cuda)]
)
def test_a_call_without_grad_runs_only_the_forward_hooks(backend: str) -> None:
    device = device_of(backend)
    recorder = Recorder()
    model = dgt.make_graphed_callables(
        TinyMLP().to(device), (_x(device),), backend=backend, replay_hooks=recorder.hooks()
    )
    with torch.no_grad():
        model(_x(device, grad=False))
    assert recorder.names() == ["before_forward", "after_forward"]
    assert recorder.calls[0].backward_expected is False


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_each_slot_carries_its_own_call_from_forward_to_backward(backend: str) -> None:
    device = device_of(backend)
    seen: list[tuple[str, int]] = []
    counter = iter(range(100))

    def tag(call: dgt.ReplayCall) -> None:
        call.state["micro_batch"] = next(counter)

    hooks = dgt.ReplayHooks(
        before_forward=tag,
        after_backward=lambda call: seen.append(("backward", call.state["micro_batch"])),
    )
    model = dgt.make_graphed_callables(
        TinyMLP().to(device), (_x(device),), backend=backend, slots=2, replay_hooks=hooks
    )
    first, second = model(_x(device)), model(_x(device))
    second.sum().backward()
    first.sum().backward()
    assert seen == [("backward", 1), ("backward", 0)]


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_one_hooks_object_serves_every_callable_and_a_tuple_gives_one_each(backend: str) -> None:
    recorder, other = Recorder(), Recorder()
    first, second = dgt.make_graphed_callables(
        (TinyMLP(), torch.nn.Linear(8, 8)),
        ((_x(torch.device("cpu")),), (_x(torch.device("cpu")),)),
        backend=backend,
        replay_hooks=recorder.hooks(),
    )
    second(first(_x(torch.device("cpu")))).sum().backward()
    assert recorder.events == [
        ("before_forward", "TinyMLP", 0),
        ("after_forward", "TinyMLP", 0),
        ("before_forward", "Linear", 1),
        ("after_forward", "Linear", 1),
        ("before_backward", "Linear", 1),
        ("after_backward", "Linear", 1)
        if backend != "eager"
        else ("before_backward", "TinyMLP", 0),
        ("before_backward", "TinyMLP", 0)
        if backend != "eager"
        else ("after_backward", "Linear", 1),
        ("after_backward", "TinyMLP", 0),
    ]
    recorder.events.clear()
    first, second = dgt.make_graphed_callables(
        (TinyMLP(), torch.nn.Linear(8, 8)),
        ((_x(torch.device("cpu")),), (_x(torch.device("cpu")),)),
        backend=backend,
        replay_hooks=(None, other.hooks()),
    )
    second(first(_x(torch.device("cpu")))).sum().backward()
    assert recorder.events == []
    assert [event[1] for event in other.events] == ["Linear"] * 4


def test_hooks_run_for_every_bucket_and_for_calls_that_fall_back_to_eager() -> None:
    recorder = Recorder()
    double = dgt.make_graphed_callables(
        lambda x: x * 2,
        buckets=[(torch.ones(2, requires_grad=True),), (torch.ones(3, requires_grad=True),)],
        fallback="eager",
        backend="emulate",
        replay_hooks=recorder.hooks(),
    )
    for n in (3, 2, 5):  # bucket, bucket, eager fallback
        double(torch.ones(n, requires_grad=True)).sum().backward()
    assert recorder.names() == ONE_REPLAY * 3
    assert [call.backend for call in recorder.calls[::4]] == ["emulate", "emulate", "eager"]


def test_a_hook_that_raises_names_itself_and_the_callable_and_changes_nothing() -> None:
    def refuse(call: dgt.ReplayCall) -> None:
        raise ValueError("tracker is full")

    model = dgt.make_graphed_callables(
        TinyMLP(),
        (_x(torch.device("cpu")),),
        backend="emulate",
        replay_hooks=dgt.ReplayHooks(before_forward=refuse),
    )
    runner = dgt.diagnostics(model)
    before = [t.clone() for t in runner_of(model).static_inputs]
    with pytest.raises(ValueError, match="tracker is full") as info:
        model(_x(torch.device("cpu")))
    assert "raised in the before_forward replay hook of TinyMLP" in "".join(
        getattr(info.value, "__notes__", [])
    )
    after = runner_of(model).static_inputs
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert runner.replays == 0


def test_a_backward_hook_that_raises_propagates_out_of_backward() -> None:
    def refuse(call: dgt.ReplayCall) -> None:
        raise RuntimeError("no more backwards")

    model = dgt.make_graphed_callables(
        TinyMLP(),
        (_x(torch.device("cpu")),),
        backend="emulate",
        replay_hooks=dgt.ReplayHooks(after_backward=refuse),
    )
    out = model(_x(torch.device("cpu")))
    with pytest.raises(RuntimeError, match="no more backwards") as info:
        out.sum().backward()
    assert "raised in the after_backward replay hook of TinyMLP" in "".join(
        getattr(info.value, "__notes__", [])
    )


def test_a_hook_that_returns_a_value_is_refused() -> None:
    model = dgt.make_graphed_callables(
        TinyMLP(),
        (_x(torch.device("cpu")),),
        backend="emulate",
        replay_hooks=dgt.ReplayHooks(before_forward=lambda call: 1),
    )
    with pytest.raises(DualgraphError, match="the before_forward replay hook returned int"):
        model(_x(torch.device("cpu")))


@pytest.mark.parametrize(
    ("replay_hooks", "message"),
    [
        (print, "replay_hooks must be a ReplayHooks .* got builtin_function_or_method"),
        ((dgt.ReplayHooks(),), r"replay_hooks must be a ReplayHooks .* \(2\), got tuple of 1"),
        ((None, 3), r"replay_hooks\[1\] must be a ReplayHooks or None, got int"),
    ],
)
def test_replay_hooks_are_checked(replay_hooks: Any, message: str) -> None:
    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(
            (torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
            ((torch.ones(1, 2),), (torch.ones(1, 2),)),
            backend="emulate",
            replay_hooks=replay_hooks,
        )


def test_a_replay_hook_must_be_callable() -> None:
    with pytest.raises(DualgraphError, match=r"ReplayHooks\.after_forward must be a callable"):
        dgt.ReplayHooks(after_forward="count")  # type: ignore[arg-type]


def test_a_step_counter_counts_replayed_micro_batches() -> None:
    steps = {"micro_batches": 0}

    def count(call: dgt.ReplayCall) -> None:
        steps["micro_batches"] += 1

    model = dgt.make_graphed_callables(
        TinyMLP(),
        (_x(torch.device("cpu")),),
        backend="emulate",
        replay_hooks=dgt.ReplayHooks(after_backward=count),
    )
    for _ in range(3):
        model(_x(torch.device("cpu"))).sum().backward()
    assert steps["micro_batches"] == 3


@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize("hook", ["before_forward", "after_forward", "before_backward"])
def test_a_replay_hook_calling_its_own_callable_is_refused_as_a_call_inside_its_call(
    hook: str, slots: int | None
) -> None:
    # The refusal blamed 'another thread', which there was none of.
    graphed: Any = None

    def again(call: dgt.ReplayCall) -> None:
        graphed(torch.ones(2, 4))

    graphed = dgt.make_graphed_callables(
        torch.nn.Linear(4, 4),
        (torch.ones(2, 4, requires_grad=True),),
        backend="emulate",
        replay_hooks=dgt.ReplayHooks(**{hook: again}),
        slots=slots,
    )
    with pytest.raises(DualgraphError) as info:
        graphed(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert str(info.value).startswith(
        "Linear: called from inside its own call in this thread (a replay hook, or code its "
        "replay runs), while its "
    )
