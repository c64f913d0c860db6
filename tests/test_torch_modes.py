"""The torch function and dispatch modes a call runs under (``_modes.py``).

A mode entered around an eager call sees every op of the callable and may change it (a mode
rewriting ops, a ``torch.device`` context placing what factory calls make); a CUDA replay runs
the kernels captured under the modes of capture, through none. A call or a backward under other
modes than capture's is refused by name before any buffer is written; observers (a
``FlopCounterMode``) are let be; a call under the modes of capture equals eager under them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from entry_points import ENTRY_POINTS, Decays, batch, call_length, graphed_on
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from torch_cases import GRAPH_BACKENDS, assert_tensors_match, device_of, tolerance

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch._modes import modes_meaning, modes_now, show_modes
from dualgraph.torch._modules import runner_of


class DoubledLinears(TorchFunctionMode):
    """Doubles what ``F.linear`` returns: eager's result under it is not the captured one."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


class NegatedAdds(TorchDispatchMode):
    """Turns every ``aten.add.Tensor`` into a subtraction, forward and backward ops alike."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.add.Tensor:
            return torch.ops.aten.sub.Tensor(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _graphed(backend: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 8).to(device_of(backend))
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    return module, dgt.make_graphed_callables(module, (sample,), backend=backend)


def _buffers(graphed: Any) -> list[torch.Tensor]:
    graphed = runner_of(graphed)
    return [t.clone() for t in (*graphed.static_inputs, *graphed.static_outputs)]


def _assert_untouched(graphed: Any, kept: list[torch.Tensor]) -> None:
    graphed = runner_of(graphed)
    now = (*graphed.static_inputs, *graphed.static_outputs)
    for buffer, before in zip(now, kept, strict=True):
        assert torch.equal(buffer.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("mode", [DoubledLinears, NegatedAdds])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_call_under_a_mode_capture_did_not_run_under_is_refused_before_any_buffer_is_written(
    backend: str, mode: type
) -> None:
    _, graphed = _graphed(backend)
    kept, generation = _buffers(graphed), runner_of(graphed).generation
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    with mode(), pytest.raises(DualgraphError, match=rf"Linear: called under .*{mode.__name__}, "):
        graphed(x)
    assert runner_of(graphed).generation == generation
    _assert_untouched(graphed, kept)
    graphed(x).sum().backward()  # and the callable still works outside it


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_callable_captured_under_a_mode_replays_under_another_of_its_kind_as_eager(
    backend: str,
) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 8).to(device_of(backend))
    twin = torch.nn.Linear(8, 8).to(device_of(backend))
    twin.load_state_dict(module.state_dict())
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    with DoubledLinears():
        graphed = dgt.make_graphed_callables(module, (sample,), backend=backend)
    for _ in range(3):
        x = torch.randn(4, 8, device=device_of(backend))
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        with DoubledLinears():  # another instance of the mode: the same meaning
            out = graphed(xg)
            expected = twin(xe)
        out.sum().backward()
        expected.sum().backward()
        assert_tensors_match(out, expected, "output", tolerance(backend))
        assert_tensors_match(xg.grad, xe.grad, "input grad", tolerance(backend))
        assert_tensors_match(
            module.weight.grad, twin.weight.grad, "weight grad", tolerance(backend)
        )
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    with pytest.raises(DualgraphError, match="called under no torch function or dispatch mode, "):
        graphed(x)


def test_a_default_device_set_after_capture_is_refused_and_the_cpu_context_is_no_change() -> None:
    made = []

    def shifted(x: torch.Tensor) -> torch.Tensor:
        offset = torch.ones(8)  # placed by the default device: eager's would be meta under it
        made.append(offset.device)
        return x + offset.to(x.device)

    graphed = dgt.make_graphed_callables(  # the lint refuses a CPU tensor made inside
        shifted, (torch.randn(4, 8, requires_grad=True),), backend="emulate", lint="off"
    )
    made.clear()
    x = torch.randn(4, 8)
    with torch.device("cpu"):  # eager's own default: nothing to refuse
        assert torch.equal(graphed(x), x + 1)
    with (
        torch.device("meta"),
        pytest.raises(
            DualgraphError, match=r"called under torch\.device\('meta'\) as the default device"
        ),
    ):
        graphed(x)
    assert made == [torch.device("cpu")]  # the refused call ran nothing
    torch.set_default_device("meta")
    try:
        with pytest.raises(DualgraphError, match=r"torch\.device\('meta'\)"):
            graphed(x)
    finally:
        torch.set_default_device(None)
    assert torch.equal(graphed(x), x + 1)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_flop_counter_around_a_call_and_its_backward_is_let_be(backend: str) -> None:
    module, graphed = _graphed(backend)
    twin = torch.nn.Linear(8, 8).to(device_of(backend))
    twin.load_state_dict(module.state_dict())
    x = torch.randn(4, 8, device=device_of(backend))
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with FlopCounterMode(display=False):
        out = graphed(xg)
        out.sum().backward()
    expected = twin(xe)
    expected.sum().backward()
    assert_tensors_match(out, expected, "output", tolerance(backend))
    assert_tensors_match(xg.grad, xe.grad, "input grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_under_a_mode_its_forward_did_not_run_under_is_refused(backend: str) -> None:
    module, graphed = _graphed(backend)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    out = graphed(x)
    with (
        NegatedAdds(),
        pytest.raises(DualgraphError, match=r"its backward ran under .*NegatedAdds"),
    ):
        out.sum().backward()
    assert x.grad is None
    assert module.weight.grad is None


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_call_under_a_mode_is_refused_on_every_entry_point(entry: str) -> None:
    module = Decays()
    graphed = graphed_on(entry, module)
    before = module.stats.clone()
    with DoubledLinears(), pytest.raises(DualgraphError, match="DoubledLinears"):
        graphed(batch(call_length(entry)))
    assert torch.equal(module.stats, before)  # the replay did not run


def test_the_meaning_of_the_modes_names_classes_and_the_default_device() -> None:
    assert modes_now() == ()
    with DoubledLinears(), torch.device("meta"), NegatedAdds():
        meaning = modes_meaning(modes_now())
    assert meaning == (DoubledLinears, NegatedAdds, ("device", torch.device("meta")))
    assert show_modes(meaning) == (
        f"{__name__}.DoubledLinears, {__name__}.NegatedAdds, "
        "torch.device('meta') as the default device"
    )
    with FlopCounterMode(display=False):
        assert modes_meaning(modes_now()) == ()
