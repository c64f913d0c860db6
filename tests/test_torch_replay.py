"""The replay: the autograd Function around each call, output aliasing, and the generation check.

White-box tests of :class:`dualgraph.torch.GraphedCallable`: what a call returns (views of the
static outputs, or clones), how grads leave the static grad buffers (copied into ``.grad``, never
stolen), and which orders of forward and backward replays are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch_cases import (
    CASES,
    CUDA,
    TOLERANCES,
    assert_grads_match,
    assert_tensors_match,
    cuda_hygiene,
    device_of,
    grads_of,
    parameter_names,
    parameters_of,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError

GRAPH_BACKENDS = ["emulate", pytest.param(CUDA, marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    torch.manual_seed(0)
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    with cuda_hygiene():
        yield


def tolerance(backend: str) -> tuple[float, float] | None:
    return TOLERANCES[torch.float32] if backend == CUDA else None


def _exp_and_sin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.exp(), x.sin()


def _graph(fn: Any, *shapes: tuple[int, ...], backend: str, **options: Any) -> Any:
    device = device_of(backend)
    samples = tuple(torch.randn(*shape, device=device, requires_grad=True) for shape in shapes)
    return dgt.make_graphed_callables(fn, samples, backend=backend, **options)


def _linear(backend: str, **options: Any) -> tuple[nn.Linear, nn.Linear, Any]:
    """A graphed ``Linear(4, 3)`` (input requires grad), its eager twin, and its GraphedCallable."""
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (sample,), backend=backend, **options)
    return layer, twin, layer.forward.__dualgraph__


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_every_forward_replay_advances_the_generation(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    assert graphed.generation == 0
    graphed(torch.randn(3, device=device_of(backend), requires_grad=True))
    with torch.no_grad():
        graphed(torch.randn(3, device=device_of(backend)))
    assert graphed.generation == 2
    assert graphed.diagnostics.replays == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_each_replay_may_run_its_backward_before_the_next_forward(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    for _ in range(3):
        x = torch.randn(3, device=device_of(backend), requires_grad=True)
        a, b = graphed(x)
        (a + b).sum().backward()
        expected = (x.exp() + x.cos()).detach()
        assert_tensors_match(x.grad, expected, "x.grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_backward_after_a_later_forward_replay_is_refused(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    x = torch.randn(3, device=device_of(backend), requires_grad=True)
    first, _ = graphed(x)
    graphed(torch.randn(3, device=device_of(backend), requires_grad=True))
    with pytest.raises(DualgraphError) as info:
        first.sum().backward()
    assert str(info.value) == (
        "_exp_and_sin: backward of an earlier replay after a later forward replay overwrote the "
        "activations it needs; run each replay's backward before the next forward of the same "
        "callable"
    )
    assert x.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_forward_replay_without_grad_also_invalidates_a_pending_backward(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    first, _ = graphed(torch.randn(3, device=device_of(backend), requires_grad=True))
    with torch.no_grad():
        graphed(torch.randn(3, device=device_of(backend)))
    with pytest.raises(DualgraphError, match="backward of an earlier replay"):
        first.sum().backward()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_replays_of_other_callables_leave_a_pending_backward_valid(backend: str) -> None:
    device = device_of(backend)
    samples = tuple((torch.randn(3, device=device, requires_grad=True),) for _ in range(2))
    first, second = dgt.make_graphed_callables((torch.exp, torch.sin), samples, backend=backend)
    x = torch.randn(3, device=device, requires_grad=True)
    second(first(x)).sum().backward()  # forwards in order, backwards in reverse
    expected = (x.exp().cos() * x.exp()).detach()
    assert_tensors_match(x.grad, expected, "x.grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_are_views_of_the_static_outputs(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    outputs = graphed(torch.randn(3, device=device_of(backend), requires_grad=True))
    pointers = [t.data_ptr() for t in graphed.static_outputs]
    assert [t.data_ptr() for t in outputs] == pointers


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_clone_outputs_returns_tensors_apart_from_the_static_outputs(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend, clone_outputs=True)
    outputs = graphed(torch.randn(3, device=device_of(backend), requires_grad=True))
    pointers = {t.data_ptr() for t in graphed.static_outputs}
    assert not pointers & {t.data_ptr() for t in outputs}
    assert all(t.requires_grad for t in outputs)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_hang_on_one_replay_node(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    a, b = graphed(torch.randn(3, device=device_of(backend), requires_grad=True))
    assert a.grad_fn is b.grad_fn
    assert type(a.grad_fn).__name__ == "_ReplayBackward"


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_non_differentiable_outputs_have_no_history(backend: str) -> None:
    def split(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x * 2, x.argmax(), x.detach() + 1

    graphed = _graph(split, (5,), backend=backend)
    doubled, index, shifted = graphed(torch.randn(5, device=device_of(backend), requires_grad=True))
    assert doubled.requires_grad
    assert (index.requires_grad, index.grad_fn, shifted.requires_grad, shifted.grad_fn) == (
        False,
        None,
        False,
        None,
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_calls_without_grad_return_outputs_without_history(backend: str) -> None:
    layer, _, graphed = _linear(backend)
    x = torch.randn(2, 4, device=device_of(backend))
    with torch.no_grad():
        assert not layer(x).requires_grad
    with torch.inference_mode():
        assert not layer(x).requires_grad
    assert graphed.generation == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_inputs_that_need_no_grad_give_outputs_without_history(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    a, b = graphed(torch.randn(3, device=device_of(backend)))  # no parameters to reach either
    assert not (a.requires_grad or b.requires_grad)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_grads_are_copied_out_of_the_static_grad_buffers(backend: str) -> None:
    layer, twin, graphed = _linear(backend)
    static = {g.data_ptr() for g in graphed.static_grad_inputs if g is not None}
    xs = [torch.randn(2, 4, device=device_of(backend), requires_grad=True) for _ in range(2)]
    layer(xs[0]).square().sum().backward()
    grads = [xs[0].grad, layer.weight.grad, layer.bias.grad]
    assert not static & {g.data_ptr() for g in grads}  # not stolen: each .grad is the user's own
    first = xs[0].grad.clone()
    layer(xs[1]).square().sum().backward()
    assert_tensors_match(xs[0].grad, first, "x.grad")  # the next backward replay left it alone
    for x in xs:
        twin(x.detach()).square().sum().backward()
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        parameter_names(layer),
        tolerance(backend),
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_left_out_of_the_loss_gets_a_zero_grad(backend: str) -> None:
    # ``materialize_grads`` is off: the replay must zero the static grad of an unused output,
    # not leave there what the previous backward wrote.
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    device = device_of(backend)
    x = torch.randn(3, device=device, requires_grad=True)
    a, b = graphed(x)
    (a + b).sum().backward()
    x = torch.randn(3, device=device, requires_grad=True)
    a, _ = graphed(x)
    a.sum().backward()
    assert_tensors_match(x.grad, x.detach().exp(), "x.grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_static_input_buffer_passed_back_in_is_not_copied_onto_itself(backend: str) -> None:
    layer, twin, graphed = _linear(backend)
    static = graphed.static_inputs[0]
    with torch.no_grad():
        out = layer(static.detach())
        assert_tensors_match(out, twin(static.detach()), "output", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_replay_function_takes_the_parameters_as_inputs(backend: str) -> None:
    case = CASES["mlp"]
    fn, _ = case.make(device_of(backend))
    dgt.make_graphed_callables(fn, case.draw(device_of(backend))[0], backend=backend)
    graphed = fn.forward.__dualgraph__
    assert graphed.params == tuple(fn.parameters())
    assert len(graphed.static_grad_inputs) == len(graphed.static_inputs) + len(graphed.params)
    assert graphed.static_grad_inputs[0] is None  # the input was captured without grad


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_param_grads_leave_the_parameters_out_of_the_replay_function(
    backend: str,
) -> None:
    case = CASES["mlp"]
    fn, _ = case.make(device_of(backend))
    sample = case.draw(device_of(backend))[0]
    dgt.make_graphed_callables(fn, sample, backend=backend, param_grads="in_graph")
    graphed = fn.forward.__dualgraph__
    (anchor,) = graphed.edge_params  # keeps the replay in the autograd graph
    assert anchor.numel() == 0 and anchor.requires_grad
    assert graphed.static_grad_inputs == (None, None)  # nothing flows back to the anchor
    assert [b.shape for b in graphed.param_grad_buffers] == [p.shape for p in fn.parameters()]


@pytest.mark.parametrize("backend", ["emulate", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_second_backward_through_one_replay_is_refused(backend: str) -> None:
    device = "cuda" if backend == "cuda" else "cpu"
    layer = torch.nn.Linear(4, 4, device=device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(layer, (sample,), backend=backend)
    loss = graphed(torch.randn(2, 4, device=device, requires_grad=True)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(DualgraphError, match="second backward through the same replay"):
        loss.backward()
    del loss
