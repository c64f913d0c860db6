"""Capture-time hooks (Transformer Engine's ``capture_time_hooks``): run around each warmup and
capture forward and backward, with the module, outside the graph; never at replay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch_cases import GRAPH_BACKENDS, TinyMLP, device_of, isolation

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError
from dualgraph.torch._capture_hooks import HOOK_KINDS

WARMUP = 2


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def _logging_hooks(log: list[tuple[str, Any, bool]]) -> dict[str, dict[str, Any]]:
    def hook(kind: str) -> Any:
        def run(target: Any) -> None:
            # where it runs: never inside a graph being captured
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            log.append((kind, target, capturing))

        return run

    return {kind: {"log": hook(kind)} for kind in HOOK_KINDS}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_hooks_run_around_every_warmup_and_capture_call_and_never_at_replay(
    backend: str,
) -> None:
    device = device_of(backend)
    log: list[tuple[str, Any, bool]] = []
    module = TinyMLP().to(device)
    graphed = dgt.make_graphed_callables(
        module,
        (torch.randn(4, 8, device=device, requires_grad=True),),
        backend=backend,
        num_warmup_iters=WARMUP,
        capture_time_hooks=_logging_hooks(log),
    )
    one_call = ["forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks"]
    # emulate captures the forward only (a replay re-runs it); cuda captures both
    captured = one_call if backend == "cuda" else one_call[:2]
    assert [kind for kind, _, _ in log] == one_call * WARMUP + captured
    assert all(target is module for _, target, _ in log)
    assert not any(capturing for _, _, capturing in log)
    log.clear()
    for _ in range(2):
        graphed(torch.randn(4, 8, device=device, requires_grad=True)).sum().backward()
    assert log == []


def test_a_function_is_given_to_its_hooks_and_one_callable_takes_its_dict_alone() -> None:
    seen: list[Any] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    dgt.make_graphed_callables(
        double,
        (torch.ones(2),),
        backend="emulate",
        num_warmup_iters=1,
        capture_time_hooks={"forward_pre_hooks": {0: seen.append}},
    )
    assert seen == [double, double]  # one warmup, one capture


def test_each_callable_gets_its_own_hooks() -> None:
    seen: list[str] = []
    first, second = TinyMLP(), TinyMLP()
    dgt.make_graphed_callables(
        (first, second),
        ((torch.randn(4, 8),), (torch.randn(4, 8),)),
        backend="emulate",
        num_warmup_iters=1,
        capture_time_hooks=[None, {"forward_hooks": {"b": lambda m: seen.append("second")}}],
    )
    assert seen == ["second", "second"]


def test_a_hook_that_returns_a_value_fails_the_capture_and_leaves_the_module_as_it_was() -> None:
    module = TinyMLP()
    with pytest.raises(CaptureError, match=r"capture_time_hooks\['forward_hooks'\]\['x'\] of "):
        dgt.make_graphed_callables(
            module,
            (torch.randn(4, 8),),
            backend="emulate",
            capture_time_hooks={"forward_hooks": {"x": lambda m: "done"}},
        )
    assert "forward" not in module.__dict__


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"forward_hook": {}}, "unknown key 'forward_hook'"),
        ({"forward_hooks": [print]}, r"capture_time_hooks\['forward_hooks'\] for TinyMLP must be"),
        ({"forward_hooks": {1: 2}}, r"\['forward_hooks'\]\[1\] for TinyMLP is not callable"),
        ([{}, {}], r"list with one dict \(or None\) per callable \(1\).*got list of 2"),
        (print, "capture_time_hooks must be a list"),
        ([print], "capture_time_hooks for TinyMLP must be a dict"),
    ],
)
def test_capture_time_hooks_are_checked(given: Any, message: str) -> None:
    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(
            TinyMLP(), (torch.randn(4, 8),), backend="emulate", capture_time_hooks=given
        )
