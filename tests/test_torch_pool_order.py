"""Callables graphed together share one memory pool: which replay orders are safe, which refused.

Graphed together, the forwards are captured in the order given and the backwards in reverse,
into one pool. A graph may reuse memory that was free while it was captured, so a replay of an
earlier callable (its forward, or its backward before a later one's) may overwrite what a later
callable's pending backward reads. Both backends refuse that backward the same way; the orders
a model runs its layers in (and any order that is safe on CUDA) keep working.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch_cases import (
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    assert_grads_match,
    assert_tensors_match,
    device_of,
    grads_of,
    isolation,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def _layers(backend: str, count: int = 2, **options: Any) -> tuple[tuple[nn.Module, ...], Any]:
    """``count`` Linear layers graphed together (in place) and their eager twins."""
    device = device_of(backend)
    layers = tuple(nn.Linear(4, 4).to(device) for _ in range(count))
    twins = tuple(nn.Linear(4, 4).to(device) for _ in range(count))
    for layer, twin in zip(layers, twins, strict=True):
        twin.load_state_dict(layer.state_dict())
    samples = tuple((torch.randn(2, 4, device=device, requires_grad=True),) for _ in layers)
    dgt.make_graphed_callables(layers, samples, backend=backend, **options)
    return layers, twins


def _x(backend: str) -> torch.Tensor:
    return torch.randn(2, 4, device=device_of(backend), requires_grad=True)


def _assert_a_step_trains_like_eager(
    layers: tuple[nn.Module, ...], twins: tuple[nn.Module, ...], backend: str
) -> None:
    """A full step in the captured order (from fresh .grads) gives the twins' output and grads."""
    for module in (*layers, *twins):
        module.zero_grad(set_to_none=True)
    x = _x(backend)
    x_twin = x.detach().clone().requires_grad_()
    out, expected = x, x_twin
    for layer, twin in zip(layers, twins, strict=True):
        out, expected = layer(out), twin(expected)
    assert_tensors_match(out.detach(), expected.detach(), "output", tolerance(backend))
    out.sum().backward()
    expected.sum().backward()
    assert_tensors_match(x.grad, x_twin.grad, "x.grad", tolerance(backend))
    params = [p for layer in layers for p in layer.parameters()]
    twin_params = [p for twin in twins for p in twin.parameters()]
    names = [
        f"{i}.{name}" for i, layer in enumerate(layers) for name, _ in layer.named_parameters()
    ]
    assert_grads_match(grads_of(params), grads_of(twin_params), names, tolerance(backend))


# -- refused: a later callable's backward after an earlier callable replayed ----------------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_forward_of_an_earlier_callable_expires_a_later_ones_pending_backward(
    backend: str,
) -> None:
    (first, second), _ = _layers(backend)
    out = second(_x(backend))
    with torch.no_grad():
        first(_x(backend))  # its graph may reuse the memory of second's activations
    with pytest.raises(DualgraphError, match=r"graphed together, .* one memory pool") as error:
        out.sum().backward()
    message = str(error.value)
    assert "callable 1" in message and "forward replay of callable 0" in message
    assert "captured order" in message and "separate" in message
    assert all(p.grad is None for p in second.parameters())  # refused before any .grad


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_of_an_earlier_callable_first_expires_a_later_ones_pending_backward(
    backend: str,
) -> None:
    (first, second), _ = _layers(backend)
    early, late = first(_x(backend)), second(_x(backend))
    early.sum().backward()  # captured after second's backward: may reuse its activations
    with pytest.raises(DualgraphError, match="backward replay of callable 0") as error:
        late.sum().backward()
    assert "callable 1" in str(error.value)
    assert all(p.grad is None for p in second.parameters())


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_earlier_callable_expires_every_later_pending_backward(backend: str) -> None:
    layers, _ = _layers(backend, count=3)
    x = _x(backend)
    middle = layers[1](x)
    last = layers[2](middle)
    with torch.no_grad():
        layers[0](_x(backend))
    with pytest.raises(DualgraphError, match="callable 2"):
        last.sum().backward()
    with pytest.raises(DualgraphError, match="callable 1"):
        middle.sum().backward()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_expired_backward_stays_refused_after_later_replays(backend: str) -> None:
    (first, second), _ = _layers(backend)
    stale = second(_x(backend))
    first(_x(backend)).sum().backward()
    fresh = second(_x(backend))  # a new replay of second: the old one stays expired
    with pytest.raises(DualgraphError, match="replay of callable 0"):
        stale.sum().backward()
    fresh.sum().backward()  # the new one is fine (first's graphs have not run since)
    assert all(p.grad is not None for p in second.parameters())


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_one_backward_through_an_expired_replay_and_a_later_one_changes_no_grad(
    backend: str, param_grads: str
) -> None:
    # The engine runs the later replay's backward (first's) before second's refuses: first's
    # grads were added into .grad, or handed to autograd, before the refusal.
    (first, second), _ = _layers(backend, param_grads=param_grads)
    late = second(_x(backend))
    early = first(_x(backend))  # its graph may reuse the memory of second's activations
    with pytest.raises(DualgraphError, match=r"callable 1 .* forward replay of callable 0"):
        (late.sum() + early.sum()).backward()
    assert all(p.grad is None for layer in (first, second) for p in layer.parameters())
    del late, early
    first(_x(backend)).sum().backward()  # the next step runs (nothing was marked as run)
    assert all(p.grad is not None for p in first.parameters())


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_pool_keeps_the_nodes_of_expired_replays_only_while_they_live(backend: str) -> None:
    (first, second), _ = _layers(backend)
    expired = runner_of(first)._expired_nodes
    for _ in range(50):  # second's graph dropped each time, after first expired it
        late = second(_x(backend))
        first(_x(backend))
        del late
    assert len(expired) < 16
    assert sum(ref() is not None for ref in expired) == 0
    first(_x(backend)).sum().backward()  # and a backward checks nothing alive


# -- allowed: the captured order, and every order that is safe on CUDA ----------------------------


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_training_in_the_captured_order_with_grad_accumulation_matches_eager(
    backend: str, param_grads: str
) -> None:
    layers, twins = _layers(backend, count=3, param_grads=param_grads)
    for _step in range(3):
        for _micro in range(2):  # grads accumulate over two micro-batches
            x = _x(backend)
            x_twin = x.detach().clone().requires_grad_()
            out, out_twin = x, x_twin
            for layer, twin in zip(layers, twins, strict=True):
                out, out_twin = layer(out), twin(out_twin)
            (out * out).sum().backward()
            (out_twin * out_twin).sum().backward()
            assert_tensors_match(x.grad, x_twin.grad, "x.grad", tolerance(backend))
        for layer, twin in zip(layers, twins, strict=True):
            assert_grads_match(
                grads_of(list(layer.parameters())),
                grads_of(list(twin.parameters())),
                ["weight", "bias"],
                tolerance(backend),
            )
            for params in (layer.parameters(), twin.parameters()):
                for p in params:
                    p.grad = None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_later_callable_may_replay_while_an_earlier_backward_is_pending(backend: str) -> None:
    # Every graph of the second callable was captured while the first's activations were alive.
    (first, second), (first_twin, _second_twin) = _layers(backend)
    x = _x(backend)
    pending = first(x)
    with torch.no_grad():
        second(_x(backend))
    second(_x(backend)).sum().backward()
    pending.sum().backward()
    x_twin = x.detach().clone().requires_grad_()
    first_twin(x_twin).sum().backward()
    assert_tensors_match(x.grad, x_twin.grad, "x.grad", tolerance(backend))
    assert_grads_match(
        grads_of(list(first.parameters())),
        grads_of(list(first_twin.parameters())),
        ["weight", "bias"],
        tolerance(backend),
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_earlier_callable_may_replay_when_no_later_backward_is_pending(backend: str) -> None:
    layers, twins = _layers(backend)
    first, second = layers
    second(_x(backend)).sum().backward()  # its backward ran: nothing of it is pending
    for _ in range(2):
        first(_x(backend)).sum().backward()
    with torch.no_grad():
        second(_x(backend))  # pending nothing either
    first(_x(backend)).sum().backward()
    _assert_a_step_trains_like_eager(layers, twins, backend)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_step_may_start_over_before_the_earlier_backward_ran(backend: str) -> None:
    # An abandoned step (say, a loss that was never backpropagated): its pending backwards are
    # simply never run, and the next step in order works.
    layers, twins = _layers(backend)
    first, second = layers
    second(first(_x(backend)))
    _assert_a_step_trains_like_eager(layers, twins, backend)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_reentrant_checkpoint_around_callables_graphed_together_trains_like_eager(
    backend: str,
) -> None:
    # Its backward replays both forwards again, with grad, then both backwards: captured order.
    (first, second), (first_twin, second_twin) = _layers(backend)
    x = _x(backend)
    x_twin = x.detach().clone().requires_grad_()
    for a, b, tensor in ((first, second, x), (first_twin, second_twin, x_twin)):
        out = checkpoint(lambda v, a=a, b=b: b(a(v)).square(), tensor, use_reentrant=True)
        out.sum().backward()
    assert_tensors_match(x.grad, x_twin.grad, "x.grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_non_reentrant_checkpoint_recomputing_them_is_refused_as_such(backend: str) -> None:
    # The recomputation replays the first callable inside the backward, which also expires the
    # second's pending backward; the error names the checkpoint, the cause the user can change.
    (first, second), _ = _layers(backend)
    out = checkpoint(lambda v: second(first(v)).square(), _x(backend), use_reentrant=False)
    with pytest.raises(DualgraphError, match="non-reentrant activation checkpoint"):
        out.sum().backward()


# -- one thread at a time for callables that share a pool ----------------------------------------


def test_callables_graphed_together_refuse_calls_from_two_threads_at_once() -> None:
    # Concurrent replays of graphs that share a pool would write the same memory at once.
    entered, release = threading.Event(), threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(10)
        return x * 2

    samples = tuple((torch.randn(3),) for _ in range(2))
    first, second = dgt.make_graphed_callables((slow, torch.sin), samples, backend="emulate")
    worker = threading.Thread(target=first, args=(torch.randn(3),))
    worker.start()
    try:
        assert entered.wait(10)
        with pytest.raises(DualgraphError, match="graphed together with it"):
            second(torch.randn(3))
    finally:
        release.set()
        worker.join()
    second(torch.randn(3))  # free again


# -- outputs: an earlier callable's forward may overwrite a later callable's outputs -------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_earlier_forward_counts_as_an_in_place_change_of_later_outputs(backend: str) -> None:
    # The second callable's outputs may lie where the first's forward graph keeps temporaries:
    # an eager op that saved one raises at backward instead of using what is there now.
    (first, second), _ = _layers(backend)
    with torch.no_grad():
        target = second(_x(backend))
    weight = torch.randn(2, 4, device=device_of(backend), requires_grad=True)
    loss = (weight * target).sum()
    first(_x(backend))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert weight.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_later_forward_leaves_earlier_outputs_alone(backend: str) -> None:
    # Outputs of the first callable stay alive while the later graphs are captured: kept out.
    (first, second), _ = _layers(backend)
    with torch.no_grad():
        target = first(_x(backend))
    weight = torch.randn(2, 4, device=device_of(backend), requires_grad=True)
    loss = (weight * target).sum()
    second(_x(backend)).sum().backward()
    loss.backward()
    assert_tensors_match(weight.grad, target, "weight.grad", tolerance(backend))


def _keeps_its_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.tanh() * 2, x


def _also_keeps_its_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.exp(), x


@pytest.mark.parametrize("together", [True, False], ids=["together", "separate_calls"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_earlier_callable_refuses_a_later_ones_output_it_would_hand_back(
    backend: str, together: bool
) -> None:
    # The first callable returns its input; given the second's output, its forward replay may
    # overwrite that output (pool memory free when the first was captured) before handing it
    # back: on CUDA output[1] would not hold the input's values, silently.
    device = device_of(backend)
    samples = ((torch.randn(3, device=device),), (torch.randn(3, device=device),))
    if together:
        first, second = dgt.make_graphed_callables(
            (_keeps_its_input, _also_keeps_its_input), samples, backend=backend
        )
    else:  # the second call joins the pool later: the first learns of its outputs then
        pool = torch.cuda.graph_pool_handle() if backend == "cuda" else POOL
        first = dgt.make_graphed_callables(_keeps_its_input, samples[0], backend=backend, pool=pool)
        second = dgt.make_graphed_callables(
            _also_keeps_its_input, samples[1], backend=backend, pool=pool
        )
    with torch.no_grad():
        later, _ = second(first(torch.randn(3, device=device))[0])
        with pytest.raises(DualgraphError, match=r"args\[0\] shares memory with an output of"):
            first(later)
        kept = later.clone()
        doubled, same = first(kept)
    assert same is kept
    assert_tensors_match(doubled, kept.tanh() * 2, "output[0]", tolerance(backend))


# -- callables graphed by separate calls into one pool= -------------------------------------------

POOL = (0, 7)  # a pool handle (the emulate backend keeps none; the order is tracked all the same)


def _separately(backend: str) -> tuple[nn.Module, nn.Module, Any]:
    device = device_of(backend)
    pool = torch.cuda.graph_pool_handle() if backend == "cuda" else POOL
    layers = (nn.Linear(4, 4).to(device), nn.Linear(4, 4).to(device))
    for layer in layers:  # the first call's graphs come first in the pool, both of them
        sample = (torch.randn(2, 4, device=device, requires_grad=True),)
        dgt.make_graphed_callables(layer, sample, backend=backend, pool=pool)
    return layers[0], layers[1], pool


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_later_calls_callable_expires_a_pending_backward_of_an_earlier_calls(
    backend: str,
) -> None:
    # The second call's forward was captured after the first's backward freed its activations.
    first, second, _ = _separately(backend)
    x = _x(backend)
    out = second(first(x))
    with pytest.raises(DualgraphError, match="forward replay of callable 1") as error:
        out.sum().backward()
    assert "callable 0" in str(error.value) and "pool=" in str(error.value)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_callables_of_separate_calls_into_one_pool_run_one_after_the_other(backend: str) -> None:
    first, second, _ = _separately(backend)
    for _ in range(2):
        first(_x(backend)).sum().backward()
        second(_x(backend)).sum().backward()
    assert all(p.grad is not None for p in (*first.parameters(), *second.parameters()))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_earlier_calls_backward_counts_as_an_in_place_change_of_a_later_calls_outputs(
    backend: str,
) -> None:
    # The second call's outputs may lie in memory the first call's backward graph freed.
    first, second, _ = _separately(backend)
    with torch.no_grad():
        target = second(_x(backend))
    out = first(_x(backend))
    weight = torch.randn(2, 4, device=device_of(backend), requires_grad=True)
    loss = (weight * target).sum()  # saves target, after first's forward replay
    out.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_pool_order_ends_with_its_callables() -> None:
    first, second, pool = _separately("emulate")
    del first, second
    gc.collect()
    layer = nn.Linear(4, 4)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, requires_grad=True),), pool=pool)
    x = _x("emulate")
    layer(x).sum().backward()  # callable 0 of a new order: nothing captured before it lives
    assert runner_of(layer)._pool.index == 0


# -- one callable's output as the next one's input -------------------------------------------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_changed_in_place_before_the_next_callable_takes_it_trains_like_eager(
    backend: str,
) -> None:
    # The first's output aliases its static buffer; the second copies the changed values in,
    # and the grads flow back through the in-place change as in eager.
    layers, twins = _layers(backend)
    for _ in range(2):
        x = _x(backend)
        x_twin = x.detach().clone().requires_grad_()
        for (first, second), tensor in ((layers, x), (twins, x_twin)):
            hidden = first(tensor)
            hidden.mul_(2)
            (second(hidden) ** 2).sum().backward()
        assert_tensors_match(x.grad, x_twin.grad, "x.grad", tolerance(backend))
        for layer, twin in zip(layers, twins, strict=True):
            assert_grads_match(
                grads_of(list(layer.parameters())),
                grads_of(list(twin.parameters())),
                ["weight", "bias"],
                tolerance(backend),
            )
