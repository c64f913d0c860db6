"""Graphs do not nest: a graphed callable called inside another callable's capture or replay.

Inside a capture (warmup included) it is refused, naming both, before its buffers, slots or
buckets change. A callable graphed after the one that calls it (a submodule graphed after its
parent, or graphed together with it) ran its original code in the outer capture; on
``"emulate"``, whose replay re-runs the outer Python, it runs that code too, as the outer graph
does on CUDA.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch_cases import (
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    assert_grads_match,
    assert_tensors_match,
    capture_error,
    device_of,
    grads_of,
    isolation,
    parameter_names,
    parameters_of,
    tolerance,
)

import dualgraph.torch as dgt


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


# -- inside a capture: refused ------------------------------------------------------------------


def _graphed_sin(backend: str) -> Any:
    sample = torch.randn(3, device=device_of(backend), requires_grad=True)
    return dgt.make_graphed_callables(torch.sin, (sample,), backend=backend)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_graphed_function_called_inside_another_capture_is_refused(backend: str) -> None:
    # Graphs do not nest: the outer capture would hold the copies into the inner's buffers,
    # not the inner's replay (on CUDA a graph launched while another is being captured).
    inner = _graphed_sin(backend)
    replays = inner.diagnostics.replays

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) * 2

    sample = torch.randn(3, device=device_of(backend), requires_grad=True)
    message = capture_error(outer, (sample,), backend=backend)
    assert f"outer ({backend}) failed during warmup" in message
    assert "sin is graphed and was called while" in message
    assert "outer is being captured" in message
    assert "graphs do not nest" in message and "restore" in message
    assert inner.diagnostics.replays == replays  # refused before its replay
    x = torch.randn(3, device=device_of(backend), requires_grad=True)
    inner(x).sum().backward()  # and it works on
    assert_tensors_match(x.grad, x.detach().cos(), "x.grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_graphed_submodule_called_inside_its_parents_capture_is_refused(backend: str) -> None:
    # Its parameters are the parent's, so no closure check catches it.
    device = device_of(backend)
    parent = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(parent[0], (sample,), backend=backend)
    message = capture_error(parent, (sample,), backend=backend)
    assert "Linear is graphed and was called while Sequential is being captured" in message
    assert "_dualgraph_graphed" not in vars(parent)
    parent[0](sample).sum().backward()  # the submodule replays on


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_slotted_callable_called_inside_a_capture_is_refused_before_taking_a_slot(
    backend: str,
) -> None:
    device = device_of(backend)
    stage = nn.Linear(4, 4).to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(stage, (sample,), backend=backend, slots=2)

    def outer(x: torch.Tensor) -> torch.Tensor:
        return stage(x).relu()

    message = capture_error(outer, (sample,), backend=backend)
    assert "Linear is graphed and was called while" in message
    assert "outer is being captured" in message
    assert dgt.diagnostics(stage).in_flight == ()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_bucketed_callable_called_inside_a_capture_is_refused(backend: str) -> None:
    device = device_of(backend)
    layer = nn.Linear(4, 4).to(device)
    buckets = [(torch.randn(n, 4, device=device, requires_grad=True),) for n in (2, 3)]
    dgt.make_graphed_callables(layer, buckets=buckets, backend=backend)

    def outer(x: torch.Tensor) -> torch.Tensor:
        return layer(x).relu()

    message = capture_error(outer, buckets[0], backend=backend)
    assert "Linear is graphed and was called while" in message
    assert "outer is being captured" in message


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_graphed_callable_called_in_the_second_of_two_captures_leaves_both_ungraphed(
    backend: str,
) -> None:
    inner = _graphed_sin(backend)
    device = device_of(backend)
    first = nn.Linear(3, 3).to(device)
    weights = [p.detach().clone() for p in first.parameters()]

    def second(x: torch.Tensor) -> torch.Tensor:
        return inner(x) + 1

    samples = tuple((torch.randn(3, device=device, requires_grad=True),) for _ in range(2))
    message = capture_error((first, second), samples, backend=backend)
    assert "failed during warmup" in message and "second is being captured" in message
    assert "_dualgraph_graphed" not in vars(first)
    assert all(torch.equal(p, w) for p, w in zip(first.parameters(), weights, strict=True))
    assert all(p.grad is None for p in first.parameters())
    dgt.make_graphed_callables(first, samples[0], backend=backend)  # graphs fine on its own


# -- inside an emulated replay: the original code, as the outer graph runs it -------------------


def _parent(device: torch.device) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(device)


def _train_like_eager(parent: nn.Module, twin: nn.Module, backend: str) -> None:
    for _ in range(3):
        x = torch.randn(2, 4, device=device_of(backend), requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        (parent(x) ** 2).sum().backward()
        (twin(x_twin) ** 2).sum().backward()
        assert_tensors_match(x.grad, x_twin.grad, "x.grad", tolerance(backend))
        assert_grads_match(
            grads_of(parameters_of(parent)),
            grads_of(parameters_of(twin)),
            parameter_names(parent),
            tolerance(backend),
        )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_submodule_graphed_after_its_parent_runs_inside_the_parents_replay_as_captured(
    backend: str, param_grads: str
) -> None:
    # On CUDA the parent's graph holds the submodule's kernels; the emulated replay replayed
    # the submodule's own graph instead (counted its replays, expired its pending backward,
    # and under in_graph refused the backward through it).
    device = device_of(backend)
    parent = _parent(device)
    twin = copy.deepcopy(parent)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    dgt.make_graphed_callables(parent, sample, backend=backend, param_grads=param_grads)
    dgt.make_graphed_callables(parent[0], sample, backend=backend, param_grads=param_grads)
    _train_like_eager(parent, twin, backend)
    assert dgt.diagnostics(parent[0]).replays == 0
    parent[0](sample[0])  # called on its own, it replays
    assert dgt.diagnostics(parent[0]).replays == 1


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_parent_and_its_submodule_graphed_together_train_like_eager(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    parent = _parent(device)
    twin = copy.deepcopy(parent)
    samples = tuple((torch.randn(2, 4, device=device, requires_grad=True),) for _ in range(2))
    dgt.make_graphed_callables(
        (parent, parent[0]), samples, backend=backend, param_grads=param_grads
    )
    _train_like_eager(parent, twin, backend)
    assert dgt.diagnostics(parent[0]).replays == 0


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_slotted_submodule_graphed_after_its_parent_keeps_its_slots_free(backend: str) -> None:
    device = device_of(backend)
    parent = _parent(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    dgt.make_graphed_callables(parent, sample, backend=backend)
    dgt.make_graphed_callables(parent[0], sample, backend=backend, slots=2)
    out = parent(sample[0])
    assert dgt.diagnostics(parent[0]).in_flight == ()
    out.sum().backward()
