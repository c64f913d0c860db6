"""Host-resident state (``_host_state.py``): tensors a graphed callable reaches besides its
inputs that are not on the graphs' device (a 0-d CPU ``self.temperature`` of a CUDA-graphed
module). A CUDA graph keeps what the host read from them at capture, so a change afterwards is
refused at the next call, naming the tensor.

On a CPU, ``emulate`` runs everything on the CPU, where nothing is host-resident; the tests
emulate a graph device (``graph_device``), so that the CPU shows what a GPU run refuses. The
tests marked ``cuda`` run the real thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from entry_points import ENTRY_POINTS, batch, call_length, graphed_on
from torch import nn
from torch_cases import capture_error

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch import _host_state


@pytest.fixture
def graph_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulated graphs run on ``cuda:0``: the CPU's tensors are host-resident to them."""
    monkeypatch.setattr(
        _host_state, "graphs_device", lambda backend, samples: torch.device("cuda", 0)
    )


@pytest.fixture
def host_tensors(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Emulated graphs on ``cuda:0`` to which the tensors whose ids the test adds here (and
    only those) are host-resident."""
    marked: set[int] = set()
    monkeypatch.setattr(
        _host_state, "graphs_device", lambda backend, samples: torch.device("cuda", 0)
    )
    monkeypatch.setattr(_host_state, "_off", lambda tensor, device: id(tensor) in marked)
    return marked


class Tempered(nn.Module):
    """Divides by a 0-d plain tensor attribute, which ``module.cuda()`` leaves on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.tensor(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.temperature


class ScaledByABuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _x() -> torch.Tensor:
    return torch.randn(2, 4, requires_grad=True)


def _fill(module: Tempered) -> None:
    module.temperature.fill_(3.0)


def _copy(module: Tempered) -> None:
    module.temperature.copy_(torch.tensor(3.0))


def _assign_data(module: Tempered) -> None:
    module.temperature.data = torch.tensor(3.0)


def _rebind(module: Tempered) -> None:
    module.temperature = torch.tensor(3.0)


@pytest.mark.usefixtures("graph_device")
@pytest.mark.parametrize("change", [_fill, _copy, _assign_data, _rebind])
def test_a_host_tensor_attribute_changed_after_capture_is_refused_naming_it(
    change: Callable[[Tempered], None],
) -> None:
    # On CUDA every replay divided by the capture's 2.0, whatever the attribute held since.
    module = Tempered()
    graphed = dgt.make_graphed_callables(module, (_x(),), backend="emulate")
    graphed(_x())
    replays = dgt.diagnostics(graphed).replays
    change(module)
    x = _x()
    with pytest.raises(DualgraphError, match=r"Tempered\.temperature: a tensor on cpu \(where "):
        graphed(x)
    assert dgt.diagnostics(graphed).replays == replays  # refused before anything ran


@pytest.mark.usefixtures("graph_device")
@pytest.mark.parametrize("change", [_fill, _copy, _assign_data, _rebind])
def test_a_host_tensor_changed_after_capture_is_refused_with_its_value_then_and_now(
    change: Callable[[Tempered], None],
) -> None:
    module = Tempered()
    graphed = dgt.make_graphed_callables(module, (_x(),), backend="emulate")
    change(module)
    with pytest.raises(
        DualgraphError, match=r"Tempered\.temperature: .*\(it was 2\.0 and is 3\.0\)"
    ):
        graphed(_x())


@pytest.mark.usefixtures("graph_device")
def test_a_host_tensor_set_again_to_its_own_value_is_no_change() -> None:
    module = Tempered()
    graphed = dgt.make_graphed_callables(module, (_x(),), backend="emulate")
    module.temperature.fill_(2.0)  # a version bump, the same bytes
    x = _x()
    for _ in range(2):
        torch.testing.assert_close(graphed(x), x / 2.0, rtol=0, atol=0)


@pytest.mark.usefixtures("graph_device")
def test_a_host_buffer_changed_after_capture_is_refused_naming_it() -> None:
    module = ScaledByABuffer()  # persistent=False, kept on the CPU by its user
    graphed = dgt.make_graphed_callables(module, (_x(),), backend="emulate")
    module.scale.copy_(torch.tensor(3.0))
    with pytest.raises(DualgraphError, match=r"ScaledByABuffer\.scale: a tensor on cpu"):
        graphed(_x())


@pytest.mark.usefixtures("graph_device")
def test_a_host_tensor_a_function_closes_over_changed_after_capture_is_refused() -> None:
    scale = torch.tensor(2.0)
    graphed = dgt.make_graphed_callables(lambda x: x * scale, (_x(),), backend="emulate")
    graphed(_x())
    scale.fill_(3.0)
    with pytest.raises(DualgraphError, match=r"closed over scale: a tensor on cpu"):
        graphed(_x())


@pytest.mark.usefixtures("graph_device")
def test_a_host_tensor_attribute_of_a_graphed_methods_module_changed_is_refused() -> None:
    module = Tempered()
    graphed = dgt.make_graphed_callables(module.forward, (_x(),), backend="emulate")
    module.temperature.fill_(3.0)
    with pytest.raises(DualgraphError, match=r"Tempered\.temperature: a tensor on cpu"):
        graphed(_x())


class TemperedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.temperature = torch.tensor(2.0)

    def forward(self, x: torch.Tensor, valid_length: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(x) / self.temperature


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_host_tensor_changed_after_capture_is_refused_on_every_entry_point(
    entry: str, host_tensors: set[int]
) -> None:
    module = TemperedLinear()
    host_tensors.add(id(module.temperature))
    graphed = graphed_on(entry, module)
    x = batch(call_length(entry))
    graphed(x).sum().backward()  # a step (a schedule's forward and backward)
    module.temperature.fill_(3.0)
    with pytest.raises(DualgraphError, match=r"temperature: a tensor on cpu \(where the graphs"):
        graphed(x)
    module.temperature.fill_(2.0)  # set back: the replays hold what they were captured with
    graphed(x).sum().backward()


class WithAHostParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.usefixtures("graph_device")
def test_a_parameter_off_the_graphs_device_is_refused_at_capture() -> None:
    # Its grads and optimizer steps are host work no replay repeats.
    message = capture_error(WithAHostParameter(), (_x(),), backend="emulate")
    assert "WithAHostParameter.scale: a parameter on cpu, where the graphs run on cuda:0" in message


class CountsOnTheHost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * 2


@pytest.mark.usefixtures("graph_device")
def test_a_host_buffer_the_callable_updates_is_refused_at_capture_and_put_back() -> None:
    # No replay would count: a graph replays the device's kernels only.
    module = CountsOnTheHost()
    message = capture_error(module, (_x(),), backend="emulate")
    assert "CountsOnTheHost.calls: a tensor on cpu the callable updates in place" in message
    assert module.calls.item() == 0


def test_on_the_cpu_emulate_follows_a_changed_tensor_attribute_as_eager_does() -> None:
    # All on the CPU: nothing is host-resident to graphs that run there.
    module = Tempered()
    graphed = dgt.make_graphed_callables(module, (_x(),), backend="emulate")
    module.temperature.fill_(4.0)
    x = _x()
    torch.testing.assert_close(graphed(x), x / 4.0, rtol=0, atol=0)


def test_graphs_device_is_the_samples_device() -> None:
    assert _host_state.graphs_device("emulate", (torch.ones(1),)) == torch.device("cpu")
    assert _host_state.graphs_device("emulate", ()) is None


@pytest.mark.cuda
@pytest.mark.parametrize("change", [_fill, _rebind])
def test_a_cpu_tensor_attribute_of_a_cuda_graphed_module_changed_is_refused(
    change: Callable[[Tempered], None],
) -> None:
    module = Tempered().cuda()  # the plain attribute stays on the CPU
    assert module.temperature.device.type == "cpu"
    x = torch.randn(2, 4, device="cuda", requires_grad=True)
    graphed = dgt.make_graphed_callables(module, (x,))
    torch.testing.assert_close(graphed(x), x / 2.0)
    change(module)
    with pytest.raises(DualgraphError, match=r"Tempered\.temperature: a tensor on cpu \(where "):
        graphed(x)


@pytest.mark.cuda
def test_a_cpu_parameter_of_a_cuda_graphed_module_is_refused_at_capture() -> None:
    module: Any = WithAHostParameter()
    x = torch.randn(2, 4, device="cuda", requires_grad=True)
    message = capture_error(module, (x,))
    assert "WithAHostParameter.scale: a parameter on cpu, where the graphs run on cuda:0" in message
