"""The replay: what a call returns, the order of forward and backward replays, the plan behind it.

White-box tests of :class:`dualgraph.torch.GraphedCallable`: outputs are views of the static
outputs (or clones), the outputs hang on one autograd node, which orders of forward and backward
replays are refused, what the frozen plan holds, and what the diagnostics count.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import threading
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from entry_points import ENTRY_POINTS, WITH_PARAMETERS, Decays, batch, call_length, graphed_on
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch_cases import (
    BACKENDS,
    CASES,
    CUDA,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    assert_grads_match,
    assert_tensors_match,
    assert_trees_match,
    backward_of,
    device_of,
    fresh_copy,
    grads_of,
    isolation,
    parameter_names,
    parameters_of,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError
from dualgraph.models.torch_vit import ViTBlock


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def _exp_and_sin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.exp(), x.sin()


def _graph(fn: Any, *shapes: tuple[int, ...], backend: str, **options: Any) -> Any:
    device = device_of(backend)
    samples = tuple(torch.randn(*shape, device=device, requires_grad=True) for shape in shapes)
    return dgt.make_graphed_callables(fn, samples, backend=backend, **options)


# -- outputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_alias_static_buffers_the_next_replay_overwrites(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    first, _ = graphed(torch.randn(3, device=device_of(backend)))
    first_values = first.clone()
    second, _ = graphed(torch.randn(3, device=device_of(backend)))
    assert first.data_ptr() == second.data_ptr() == graphed.static_outputs[0].data_ptr()
    assert torch.equal(first, second) and not torch.equal(first, first_values)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("earlier", ["without_grad", "after_its_backward"])
def test_an_eager_op_that_saved_an_overwritten_output_raises_at_backward_as_in_eager(
    backend: str, earlier: str
) -> None:
    # A target computed by the same graphed callable without grad (DQN's, BYOL's), or an
    # output kept past its backward, read by an eager op that saves it: the next replay
    # overwrites it, as an in-place op would in eager, and the backward must refuse the new
    # values as eager refuses an input changed in place. A CUDA graph writes its outputs behind
    # autograd's back, so w.grad was silently the later replay's output.
    device = device_of(backend)
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    w = torch.randn(3, device=device, requires_grad=True)
    if earlier == "without_grad":
        with torch.no_grad():
            target, _ = graphed(torch.randn(3, device=device))
    else:
        target, _ = graphed(torch.randn(3, device=device, requires_grad=True))
        target.sum().backward()
    kept = (target * w).sum()  # mul saves target for w's grad
    x = torch.randn(3, device=device, requires_grad=True)
    out, _ = graphed(x)
    # After its backward, target still carries the first replay's node, which this backward
    # also reaches: that replay's refusal comes first, before the later replay adds anything.
    error: Any = RuntimeError if earlier == "without_grad" else DualgraphError
    message = "modified by an inplace operation" if earlier == "without_grad" else "earlier replay"
    with pytest.raises(error, match=message):
        (kept + out.sum()).backward()
    assert w.grad is None
    if earlier == "after_its_backward":
        assert x.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_with_clone_outputs_an_earlier_output_saved_by_an_eager_op_keeps_its_values(
    backend: str,
) -> None:
    device = device_of(backend)
    graphed = _graph(_exp_and_sin, (3,), backend=backend, clone_outputs=True)
    w = torch.randn(3, device=device, requires_grad=True)
    with torch.no_grad():
        target, _ = graphed(torch.randn(3, device=device))
    expected = target.clone()
    kept = (target * w).sum()
    out, _ = graphed(torch.randn(3, device=device, requires_grad=True))
    (kept + out.sum()).backward()
    assert w.grad is not None
    assert_tensors_match(w.grad, expected, "w grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_clone_outputs_gives_owned_outputs_that_train_like_eager(backend: str) -> None:
    device = device_of(backend)
    fn, twin = CASES["mlp"].make(device)
    dgt.make_graphed_callables(
        fn, (torch.randn(4, 8, device=device),), backend=backend, clone_outputs=True
    )
    if backend != "eager":
        static = {t.data_ptr() for t in runner_of(fn).static_outputs}
    xs = [torch.randn(4, 8, device=device) for _ in range(2)]
    first = fn(xs[0])
    assert first.requires_grad
    backward_of(first)  # before the next forward: it needs this replay's activations
    second = fn(xs[1])
    assert first.data_ptr() != second.data_ptr()
    if backend != "eager":
        assert not static & {first.data_ptr(), second.data_ptr()}
    expected = twin(xs[0])
    assert_trees_match(first, expected, tolerance(backend))
    backward_of(expected)
    assert_grads_match(
        grads_of(parameters_of(fn)),
        grads_of(parameters_of(twin)),
        parameter_names(fn),
        tolerance(backend),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_owned_keeps_one_tensor_returned_twice_one_tensor(backend: str) -> None:
    # A replay hands out `return h, h` as one tensor, as eager does; owned cloned each leaf
    # apart, so an in-place change through one was no longer seen through the other.
    device = device_of(backend)

    def twice(x: torch.Tensor) -> dict[str, Any]:
        h = x.tanh()
        return {"last": h, "all": (h * 2, h)}

    graphed = dgt.make_graphed_callables(
        twice, (torch.randn(2, 4, device=device, requires_grad=True),), backend=backend
    )
    outputs = graphed(torch.randn(2, 4, device=device, requires_grad=True))
    assert outputs["last"] is outputs["all"][1]
    mine = dgt.owned(outputs)
    assert mine["last"] is mine["all"][1] and mine["last"] is not outputs["last"]
    backward_of(mine)  # autograd kept


@pytest.mark.parametrize("backend", BACKENDS)
def test_owned_gives_outputs_the_next_replay_cannot_touch(backend: str) -> None:
    case = CASES["every_leaf"]
    device = device_of(backend)
    fn, twin = case.make(device)
    args, kwargs = case.draw(device)
    dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    args, kwargs = case.draw(device)
    eager_args, eager_kwargs = fresh_copy((args, kwargs))
    first = dgt.owned(fn(*args, **kwargs))
    backward_of(first)  # owned outputs keep their autograd history
    next_args, next_kwargs = case.draw(device)
    fn(*next_args, **next_kwargs)  # a replay that overwrites the static outputs
    expected = twin(*eager_args, **eager_kwargs)
    assert_trees_match(first, expected, tolerance(backend))
    backward_of(expected)
    assert_tensors_match(args[0].grad, eager_args[0].grad, "args[0]", tolerance(backend))


_LAID_OUT = {
    "real_part": lambda h: h.real,
    "every_other_column": lambda h: h[:, ::2],
    "transposed": lambda h: h.t(),
    "conjugate": lambda h: h.conj(),
    "negative_view": lambda h: torch._neg_view(h),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("layout", sorted(_LAID_OUT))
@pytest.mark.parametrize("clone_outputs", [False, True])
def test_outputs_are_laid_out_as_eagers(backend: str, layout: str, clone_outputs: bool) -> None:
    # the emulate backend made every output with empty_like, and clone_outputs cloned them: a
    # non-dense view (h.real) came back contiguous, a conjugate view resolved, where eager (and a
    # CUDA graph's own output) keep them
    device = device_of(backend)
    view = _LAID_OUT[layout]
    weight = torch.randn(4, 6, dtype=torch.complex64, device=device)

    def laid_out(x: torch.Tensor) -> torch.Tensor:
        return view(x * weight)

    sample = torch.randn(4, 6, dtype=torch.complex64, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        laid_out, (sample,), backend=backend, clone_outputs=clone_outputs
    )
    x = torch.randn(4, 6, dtype=torch.complex64, device=device, requires_grad=True)
    out, expected = graphed(x), laid_out(x)
    assert (out.stride(), out.is_conj(), out.is_neg()) == (
        expected.stride(),
        expected.is_conj(),
        expected.is_neg(),
    )
    assert torch.equal(
        out.detach().resolve_conj().resolve_neg(), expected.detach().resolve_conj().resolve_neg()
    )


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
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (sample,), backend=backend)
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        assert not layer(x).requires_grad
    with torch.inference_mode():
        assert not layer(x).requires_grad
    assert runner_of(layer).generation == 2


class RaisesWhenTold(nn.Module):
    """A Linear whose forward raises while ``failing[0]`` is set (a flag no replay compares)."""

    def __init__(self, failing: list[bool]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self._failing = failing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._failing[0]:
            raise ValueError("failed on purpose")
        return self.fc(x)


@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize("backend", ["eager", "emulate"])
def test_a_call_that_raised_is_not_counted_as_a_replay(backend: str, slots: int | None) -> None:
    # an emulated replay runs the callable again, which may raise; an eager call that raised
    # was never counted
    failing = [False]
    options = {} if slots is None else {"slots": slots}
    graphed = dgt.make_graphed_callables(
        RaisesWhenTold(failing),
        (torch.randn(2, 4, requires_grad=True),),
        backend=backend,
        **options,
    )
    graphed(torch.randn(2, 4, requires_grad=True)).sum().backward()
    failing[0] = True
    with pytest.raises(ValueError, match="failed on purpose"):
        graphed(torch.randn(2, 4, requires_grad=True))
    assert dgt.diagnostics(graphed).replays == 1
    failing[0] = False
    graphed(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert dgt.diagnostics(graphed).replays == 2


def test_a_forward_drops_the_nodes_of_replays_whose_backward_is_over() -> None:
    # so that a backward through one replay finds its own node alone (no pass over the others)
    layer = nn.Linear(4, 3)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, requires_grad=True),), backend="emulate")
    for _ in range(3):
        layer(torch.randn(2, 4)).sum().backward()
    kept = layer(torch.randn(2, 4))
    assert [ref() is not None for ref in runner_of(layer)._nodes] == [True]
    kept.sum().backward()


#: torch's forward-mode AD scripts its decompositions on first use (torch 2.13 warns).
TORCH_JVP_IMPORT = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


@TORCH_JVP_IMPORT
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("grad", [False, True])
def test_a_dual_tensor_input_is_refused_naming_its_path(backend: str, grad: bool) -> None:
    # A graph cannot carry a forward-mode tangent: without grad the replay dropped it (the
    # output had none, eager's has one), with grad torch raised NotImplementedError (no jvp).
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    twin = fresh_copy(layer)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, device=device),), backend=backend)
    static = [t.clone() for t in runner_of(layer).static_inputs]
    x, tangent = torch.randn(2, 4, device=device), torch.randn(2, 4, device=device)
    with torch.set_grad_enabled(grad), fwAD.dual_level():
        with pytest.raises(DualgraphError, match=r"args\[0\] is a dual tensor"):
            layer(fwAD.make_dual(x, tangent))
        assert all(map(torch.equal, runner_of(layer).static_inputs, static))  # refused before
        # A plain input inside a dual level replays as usual.
        out = layer(x)
        assert fwAD.unpack_dual(out).tangent is None
        assert_tensors_match(out.detach(), twin(x).detach(), "output", tolerance(backend))


TRANSFORMS: dict[str, Any] = {
    "vmap": lambda f, x: torch.func.vmap(f)(x.expand(3, *x.shape)),
    "grad": lambda f, x: torch.func.grad(lambda v: f(v).sum())(x),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
}


@TORCH_JVP_IMPORT
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_a_call_under_a_torch_func_transform_is_refused(
    backend: str, grad: bool, transform: str
) -> None:
    # Refused with grad or without (vmap without grad failed in torch's copy into the static
    # input, torch.func.grad with a SpecMismatchError about requires_grad).
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    dgt.make_graphed_callables(layer, (torch.randn(4, device=device),), backend=backend)
    static = [t.clone() for t in runner_of(layer).static_inputs]
    with (
        torch.set_grad_enabled(grad),
        pytest.raises(DualgraphError, match=r"torch\.func transform"),
    ):
        TRANSFORMS[transform](layer, torch.randn(4, device=device))
    assert all(map(torch.equal, runner_of(layer).static_inputs, static))


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.trace.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("frozen", [False, True], ids=["no_grad", "frozen"])
def test_a_call_under_torch_jit_trace_is_refused(backend: str, frozen: bool) -> None:
    """The trace kept the replay's buffers as constants: the traced module gave the traced
    call's output for every input, silently (where no output required grad)."""
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device).requires_grad_(not frozen)
    twin = copy.deepcopy(layer)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, device=device),), backend=backend)
    static = [t.clone() for t in runner_of(layer).static_inputs]
    with (
        torch.set_grad_enabled(not frozen),
        pytest.raises(DualgraphError, match=r"^Linear: called under torch\.jit\.trace; "),
    ):
        torch.jit.trace(layer, torch.randn(2, 4, device=device))
    assert all(map(torch.equal, runner_of(layer).static_inputs, static))
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():  # still replays, as eager computes
        assert_tensors_match(layer(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(layer).replays == 1


def _graphed_linear(backend: str, param_grads: str) -> tuple[nn.Linear, torch.device]:
    """A ``Linear(4, 3)`` graphed on ``backend`` for samples ``(2, 4)``, and its device."""
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    dgt.make_graphed_callables(
        layer,
        (torch.randn(2, 4, device=device, requires_grad=True),),
        backend=backend,
        param_grads=param_grads,
    )
    return layer, device


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_batched_backward_is_refused_before_it_writes_anything(
    backend: str, param_grads: str
) -> None:
    # torch.autograd.grad(..., is_grads_batched=True) runs the backward under vmap: the copy of a
    # batch of grads into the static grad buffer leaked torch's vmap error from inside.
    layer, device = _graphed_linear(backend, param_grads)
    x = torch.randn(2, 4, device=device, requires_grad=True)
    out = layer(x)
    static = [t.clone() for t in runner_of(layer).plan.buffers.grad_outputs]
    batch = torch.randn(5, 2, 3, device=device)
    with pytest.raises(DualgraphError, match="is_grads_batched"):
        torch.autograd.grad(out, x, grad_outputs=batch, is_grads_batched=True)
    now = runner_of(layer).plan.buffers.grad_outputs  # by bytes: a NaN there is no change
    assert all(
        map(torch.equal, [t.view(torch.uint8) for t in now], [t.view(torch.uint8) for t in static])
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_inputs_that_need_no_grad_give_outputs_without_history(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    a, b = graphed(torch.randn(3, device=device_of(backend)))  # no parameters to reach either
    assert not (a.requires_grad or b.requires_grad)


@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_inference_mode_records_no_history_even_with_grad_enabled_inside(
    backend: str, param_grads: str, slots: int | None
) -> None:
    # torch.enable_grad() inside torch.inference_mode() turns grad mode on, but inference mode
    # still records nothing: eager's outputs have no history, and no backward can follow
    device = device_of(backend)
    layer, twin = nn.Linear(4, 4).to(device), nn.Linear(4, 4).to(device)
    twin.load_state_dict(layer.state_dict())
    dgt.make_graphed_callables(
        layer,
        (torch.randn(2, 4, device=device, requires_grad=True),),
        backend=backend,
        param_grads=param_grads,
        slots=slots,
    )
    x = torch.randn(2, 4, device=device, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        out, expected = layer(x), twin(x)
    assert (out.requires_grad, out.grad_fn) == (expected.requires_grad, expected.grad_fn)
    assert_tensors_match(out, expected, "output", tolerance(backend))
    assert layer.weight.grad is None and x.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_static_input_buffer_passed_back_in_gives_the_same_result(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    static = graphed.static_inputs[0].detach()
    with torch.no_grad():
        outputs = graphed(static)
    assert_trees_match(outputs, _exp_and_sin(static.clone()), tolerance(backend))


class _InputsAndWeights(nn.Module):
    """Outputs that parameters reach, and outputs that only one input or the other reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.proj(x), {"x": x * 2, "y": y.exp(), "both": x * y, "same_x": x}


@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_an_output_only_inputs_without_grad_reach_needs_no_grad_as_in_eager(
    backend: str, param_grads: str, slots: int | None
) -> None:
    # Captured with both inputs requiring grad; a call where one does not must give the
    # outputs only it reaches no history (eager's requires_grad), and their grads as eager's.
    device = device_of(backend)
    fn, twin = _InputsAndWeights().to(device), _InputsAndWeights().to(device)
    twin.load_state_dict(fn.state_dict())
    samples = tuple(torch.randn(3, 4, device=device, requires_grad=True) for _ in range(2))
    dgt.make_graphed_callables(fn, samples, backend=backend, param_grads=param_grads, slots=slots)
    for x_grad, y_grad in [(False, True), (True, False), (False, False), (True, True)]:
        for _ in range(2):  # grads accumulate over two replays
            args = tuple(
                torch.randn(3, 4, device=device).requires_grad_(flag) for flag in (x_grad, y_grad)
            )
            eager_args = fresh_copy(args)
            outputs = fn(*args)
            expected = twin(*eager_args)
            assert_trees_match(outputs, expected, tolerance(backend))
            backward_of(outputs)
            backward_of(expected)
            # "same_x" is x itself, as in eager: its grad reaches x directly and is added to the
            # replay's sum of the other three, where eager adds the four one by one (last bit).
            assert_grads_match(
                grads_of(list(args)),
                grads_of(list(eager_args)),
                ["x", "y"],
                tolerance(backend) or (1e-6, 1e-6),
            )
    assert_grads_match(
        grads_of(parameters_of(fn)),
        grads_of(parameters_of(twin)),
        parameter_names(fn),
        tolerance(backend),
    )


class _AuxLossWithGradOnly(nn.Module):
    """Returns an auxiliary loss where it trains (grad on, its input requiring grad), ``None``
    where not: an output structure that follows the branch, as a mixture of experts' may."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.fc(x)
        trains = torch.is_grad_enabled() if self.branch == "grad_mode" else x.requires_grad
        return h, (h.square().mean() if trains else None)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("branch", ["grad_mode", "requires_grad"])
def test_a_call_run_eagerly_returns_eagers_outputs_whatever_their_structure(
    backend: str, branch: str
) -> None:
    # The call runs the callable eagerly because its branch may differ from capture's; the
    # structure of what that branch returns is eager's to choose.
    device = device_of(backend)
    module = _AuxLossWithGradOnly(branch).to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend)
    x = torch.randn(2, 4, device=device)
    with torch.no_grad() if branch == "grad_mode" else contextlib.nullcontext():
        out, aux = module(x)
        expected, expected_aux = twin(x)
    assert aux is None and expected_aux is None
    assert_tensors_match(out, expected, "output[0]", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1


class _FrozenForceField(nn.Module):
    """Energy and forces of a frozen potential, ``-dE/dx`` taken inside without keeping a graph
    (an inference-time force field): nothing it returns is differentiable."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.requires_grad_(False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = pos.detach().requires_grad_()
        energy = self.fc(pos).tanh().sum()
        (grad,) = torch.autograd.grad(energy, pos)
        return energy.detach(), -grad


def test_an_emulated_replay_without_a_backward_runs_with_grad_on_as_captured() -> None:
    # Nothing it returns is differentiable, so its replay has no backward, and "emulate" re-ran
    # the callable under no_grad, where its own torch.autograd.grad raised ('element 0 of
    # tensors does not require grad') on every call; eager computes the forces, and so does a
    # CUDA graph, whose forward was captured with grad on, as the warmups run.
    module = _FrozenForceField()
    twin = copy.deepcopy(module)
    dgt.make_graphed_callables(module, (torch.randn(5, 3),), backend="emulate")
    for _ in range(2):
        pos = torch.randn(5, 3)
        assert_trees_match(module(pos), twin(pos))
    assert dgt.diagnostics(module).replays == 2


# -- the order of forward and backward replays ---------------------------------------------------


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


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_backward_of_an_earlier_replay_after_a_later_forward_is_refused(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    fn, twin = CASES["mlp"].make(device)
    dgt.make_graphed_callables(
        fn, (torch.randn(4, 8, device=device),), backend=backend, param_grads=param_grads
    )
    xs = [torch.randn(4, 8, device=device) for _ in range(2)]
    first = fn(xs[0])
    second = fn(xs[1])
    with pytest.raises(DualgraphError) as info:
        first.sum().backward()
    assert str(info.value) == (
        "TinyMLP: backward of an earlier replay after a later forward replay overwrote the "
        "activations it needs; run each replay's backward before the next forward of the same "
        "callable"
    )
    assert all(p.grad is None for p in fn.parameters())  # no silent wrong grads
    second.sum().backward()  # the latest replay's backward is still right
    twin(xs[1]).sum().backward()
    assert_grads_match(
        grads_of(parameters_of(fn)),
        grads_of(parameters_of(twin)),
        parameter_names(fn),
        tolerance(backend),
    )


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
def test_a_second_backward_through_one_replay_is_refused(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (2, 4), backend=backend)
    a, _ = graphed(torch.randn(2, 4, device=device_of(backend), requires_grad=True))
    loss = a.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(DualgraphError, match="second backward through the same replay"):
        loss.backward()
    del loss


def test_eager_backend_allows_backward_in_any_order() -> None:
    fn, twin = CASES["mlp"].make(torch.device("cpu"))
    dgt.make_graphed_callables(fn, (torch.randn(4, 8),), backend="eager")
    xs = [torch.randn(4, 8) for _ in range(2)]
    first, second = fn(xs[0]), fn(xs[1])
    first.sum().backward()
    second.sum().backward()
    twin(xs[0]).sum().backward()
    twin(xs[1]).sum().backward()
    assert_grads_match(
        grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), parameter_names(fn)
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


class _RootAndDouble(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 3
        return h.sqrt(), h * 2


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_output_left_out_of_the_loss_adds_nothing_to_the_grads_on_emulate(
    param_grads: str,
) -> None:
    # The emulated backward differentiated every output, giving one left out of the loss a
    # zero grad: its sqrt's backward at 0 made 0 * inf = NaN in x.grad, and where the loss
    # sent -0.0 the zero added to it gave 0.0; eager's backward never reaches that output.
    graphed = _RootAndDouble()
    sample = torch.rand(2, 3, requires_grad=True)
    dgt.make_graphed_callables(graphed, (sample,), backend="emulate", param_grads=param_grads)
    for scale in (1.0, -0.0):
        x = torch.tensor([[0.0, 1.0, 4.0], [0.5, 0.0, 2.0]])
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        for net, leaf in ((graphed, mine), (_RootAndDouble(), theirs)):
            _, double = net(leaf)
            (double * scale).sum().backward()
        assert theirs.grad is not None and mine.grad is not None
        assert torch.equal(mine.grad, theirs.grad), (mine.grad, theirs.grad)  # no NaN
        assert torch.equal(mine.grad.signbit(), theirs.grad.signbit())


class TwoHeads(nn.Module):
    """Two outputs, each with parameters (and an input) of its own: a loss may use one only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x).tanh(), self.b(x * z).tanh()


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_what_only_an_output_left_out_of_the_loss_depends_on_gets_no_grad(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    module, twin = TwoHeads().to(device), TwoHeads().to(device)
    twin.load_state_dict(module.state_dict())
    samples = (torch.randn(2, 4, device=device, requires_grad=True),) * 2
    dgt.make_graphed_callables(module, samples, backend=backend, param_grads=param_grads)
    # both heads, then one at a time; .grad accumulates over two steps before each zero_grad
    for step, heads in enumerate(((0, 1), (0,), (1,), (0,), (0,), (0, 1))):
        inputs = [torch.randn(2, 4, device=device, requires_grad=True) for _ in range(2)]
        copies = [t.detach().clone().requires_grad_() for t in inputs]
        for net, (x, z) in ((module, inputs), (twin, copies)):
            outputs = net(x, z)
            sum(outputs[i].square().sum() for i in heads).backward()
        names = [f"step {step}: {name}" for name in ("x", "z", *parameter_names(module))]
        assert_grads_match(
            grads_of([*inputs, *parameters_of(module)]),
            grads_of([*copies, *parameters_of(twin)]),
            names,
            tolerance(backend),
        )
        if step % 2:
            module.zero_grad(set_to_none=True)
            twin.zero_grad(set_to_none=True)


def _expanded_grad(param: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, device=param.device).expand_as(param)


def _inference_grad(param: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones_like(param)


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
@pytest.mark.parametrize("make", [_expanded_grad, _inference_grad])
def test_a_grad_no_add_could_write_is_left_alone_where_only_an_output_left_out_reaches_it(
    backend: str, param_grads: str, make: Any
) -> None:
    # eager never reaches the head left out of the loss; "in_graph" put its .grad's values back
    # by writing into it, which raised for such a .grad
    device = device_of(backend)
    module, twin = TwoHeads().to(device), TwoHeads().to(device)
    twin.load_state_dict(module.state_dict())
    samples = (torch.randn(2, 4, device=device, requires_grad=True),) * 2
    dgt.make_graphed_callables(module, samples, backend=backend, param_grads=param_grads)
    for net in (module, twin):
        net.b.weight.grad = make(net.b.weight)
    mine = module.b.weight.grad
    for step in range(2):
        x, z = torch.randn(2, 4, device=device), torch.randn(2, 4, device=device)
        for net in (module, twin):
            net(x, z)[0].square().sum().backward()
        assert_grads_match(
            grads_of(parameters_of(module)),
            grads_of(parameters_of(twin)),
            [f"step {step}: {name}" for name in parameter_names(module)],
            tolerance(backend),
        )
    assert module.b.weight.grad is mine


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "in_graph"]
)
def test_hooks_of_what_only_an_output_left_out_of_the_loss_reaches_are_not_called(
    backend: str, param_grads: str
) -> None:
    # The replay's node has an edge to every input and parameter: the engine ran the hooks of
    # those it gave None (a tensor hook got None, `grad * 2` raised a TypeError), where eager's
    # backward never reaches them. A hook sees a grad as soon as the loss uses its head again.
    device = device_of(backend)
    module, twin = TwoHeads().to(device), TwoHeads().to(device)
    twin.load_state_dict(module.state_dict())
    samples = (torch.randn(2, 4, device=device, requires_grad=True),) * 2
    dgt.make_graphed_callables(module, samples, backend=backend, param_grads=param_grads)
    calls: dict[str, list[Any]] = {"graphed": [], "eager": []}
    for net, seen in ((module, calls["graphed"]), (twin, calls["eager"])):
        net.b.weight.register_hook(lambda grad: grad * 2)
        net.b.bias.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append("post"))
        torch.autograd.graph.register_multi_grad_hook(
            (net.a.weight, net.b.weight),
            lambda grads, seen=seen: seen.append([g is None for g in grads]),
        )
        torch.autograd.graph.register_multi_grad_hook(
            (net.b.bias, net.a.bias),
            lambda grad, seen=seen: seen.append(grad.shape),
            mode="any",
        )
    posts = 0
    for step, heads in enumerate(((0,), (0, 1), (0,), (1,))):
        inputs = [torch.randn(2, 4, device=device, requires_grad=True) for _ in range(2)]
        copies = [t.detach().clone().requires_grad_() for t in inputs]
        for net, (x, z), seen in (
            (module, inputs, calls["graphed"]),
            (twin, copies, calls["eager"]),
        ):
            z.register_hook(lambda grad, seen=seen: seen.append("z") or grad * 2)
            outputs = net(x, z)
            sum(outputs[i].square().sum() for i in heads).backward()
        # (in another order: the replay's node hands every grad on at once)
        graphed, eager = (sorted(map(repr, calls[k])) for k in ("graphed", "eager"))
        assert graphed == eager, f"step {step}: hook calls"
        posts += graphed.count("'post'")
        for seen in calls.values():
            seen.clear()
        names = [f"step {step}: {name}" for name in ("x", "z", *parameter_names(module))]
        assert_grads_match(
            grads_of([*inputs, *parameters_of(module)]),
            grads_of([*copies, *parameters_of(twin)]),
            names,
            tolerance(backend),
        )
    assert posts == 2


# -- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_plan_is_frozen_and_the_callable_is_built_from_it(backend: str) -> None:
    graphed = _graph(_exp_and_sin, (3,), backend=backend)
    plan = graphed.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.clone_outputs = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.buffers.inputs = ()  # type: ignore[misc]
    assert graphed.static_inputs is plan.buffers.inputs
    assert graphed.static_outputs is plan.buffers.outputs
    assert graphed.spec is plan.outputs
    assert (plan.diff_outputs, plan.nondiff_outputs, plan.has_backward) == ((0, 1), (), True)
    assert not hasattr(graphed, "__dict__")  # no attribute can be added after construction


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_backward_runs_only_over_differentiable_outputs(backend: str) -> None:
    case = CASES["every_leaf"]
    fn, _ = case.make(device_of(backend))
    args, kwargs = case.draw(device_of(backend))
    dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    plan = runner_of(fn).plan
    mask = plan.outputs.grad_mask
    assert mask.count(True) == 4 and mask.count(False) == 3
    assert plan.diff_outputs == tuple(i for i, grad in enumerate(mask) if grad)
    assert [t.shape for t in plan.buffers.grad_outputs] == [
        t.shape for t, grad in zip(plan.buffers.outputs, mask, strict=True) if grad
    ]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_autograd_param_grads_make_the_parameters_replay_inputs(backend: str) -> None:
    case = CASES["mlp"]
    fn, _ = case.make(device_of(backend))
    sample = case.draw(device_of(backend))[0]
    dgt.make_graphed_callables(fn, sample, backend=backend, param_grads="autograd")
    params = runner_of(fn).plan.params
    assert params.mode == "autograd"
    assert params.edges == params.params == tuple(fn.parameters())
    assert params.names == tuple(f"TinyMLP.{name}" for name, _ in fn.named_parameters())
    buffers = runner_of(fn).plan.buffers
    assert buffers.input_grads == (None,)  # the input was captured without grad
    assert [g.shape for g in buffers.param_grads] == [p.shape for p in fn.parameters()]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_param_grads_keep_the_parameters_inputs_and_add_into_accumulators_in_the_backward(
    backend: str,
) -> None:
    case = CASES["mlp"]
    fn, _ = case.make(device_of(backend))
    dgt.make_graphed_callables(fn, case.draw(device_of(backend))[0], backend=backend)
    plan = runner_of(fn).plan
    params = plan.params
    assert params.mode == "auto"  # the default
    *edges, anchor = params.edges  # the parameters, so torch.autograd.grad reaches them
    assert tuple(edges) == params.params == tuple(fn.parameters())
    assert anchor.numel() == 0 and anchor.requires_grad and params.anchor_node is not None
    shapes = [p.shape for p in fn.parameters()]
    # no grad buffer per parameter: the backward graph adds into the accumulators itself
    assert plan.buffers.param_grads == (None,) * len(shapes)
    assert [a.shape for a in params.accumulators] == shapes
    if backend == "cuda":  # one forward and one backward graph
        assert len(plan.buffers.graphs) == 2


def test_auto_param_grads_of_a_function_need_no_anchor() -> None:
    sample = torch.randn(3, requires_grad=True)
    graphed = dgt.make_graphed_callables(torch.sin, (sample,), backend="emulate")
    params = graphed.plan.params
    assert (params.mode, params.edges, params.anchor) == ("auto", (), None)
    assert not graphed(torch.randn(3)).requires_grad  # no parameter, no grad: as in eager


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_param_grads_leave_the_parameters_out_of_the_replay_inputs(backend: str) -> None:
    case = CASES["mlp"]
    fn, _ = case.make(device_of(backend))
    sample = case.draw(device_of(backend))[0]
    dgt.make_graphed_callables(fn, sample, backend=backend, param_grads="in_graph")
    params = runner_of(fn).plan.params
    (anchor,) = params.edges  # keeps the replay in the autograd graph
    assert anchor.numel() == 0 and anchor.requires_grad
    assert runner_of(fn).plan.buffers.param_grads == (None,) * 4
    assert [a.shape for a in params.accumulators] == [p.shape for p in fn.parameters()]


# -- diagnostics ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_diagnostics_count_static_buffer_bytes(backend: str, param_grads: str) -> None:
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    x = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (x,), backend=backend, param_grads=param_grads)
    report = dgt.diagnostics(layer)
    assert (report.name, report.backend, report.has_backward_graph) == ("Linear", backend, True)
    assert report.static_input_bytes == 2 * 4 * 4  # x
    assert report.static_output_bytes == 2 * 3 * 4  # y
    # dy, dx, dW, db: a static dW and db ("autograd"), or the .grad accumulators the backward
    # graph adds them into ("auto", "in_graph"): one buffer per parameter either way
    assert report.static_grad_bytes == (2 * 3 + 2 * 4 + 3 * 4 + 3) * 4
    assert report.capture_seconds > 0
    assert report.replays == 0
    layer(x)
    layer(x)
    assert report.replays == 2


def test_eager_backend_diagnostics_count_calls_only() -> None:
    layer = nn.Linear(4, 3)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4),), backend="eager")
    layer(torch.randn(2, 4))
    report = dgt.diagnostics(layer)
    assert (report.backend, report.replays, report.has_backward_graph) == ("eager", 1, False)
    assert report.static_input_bytes == report.static_output_bytes == report.pool_bytes == 0


def test_emulate_backend_reports_no_pool() -> None:
    layer = nn.Linear(4, 3)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4),), backend="emulate")
    assert dgt.diagnostics(layer).pool_bytes == 0


@pytest.mark.cuda
def test_callables_graphed_together_share_one_pool() -> None:
    blocks = tuple(ViTBlock(dim=16, heads=2).cuda() for _ in range(2))
    samples = tuple((torch.randn(2, 5, 16, device="cuda", requires_grad=True),) for _ in blocks)
    dgt.make_graphed_callables(blocks, samples, backend=CUDA)
    reports = [dgt.diagnostics(block) for block in blocks]
    assert reports[0].pool_bytes > 0
    assert reports[0].pool_bytes == reports[1].pool_bytes
    assert all(r.capture_seconds > 0 and r.has_backward_graph for r in reports)


# -- what a plan keeps alive ---------------------------------------------------------------------


def _mark_accumulate_grad_nodes(params: Any) -> None:
    for param in params:
        torch.autograd.graph.get_gradient_edge(param).node.metadata["marked"] = True


def _marked_accumulate_grad_nodes(params: Any) -> list[bool]:
    # a node still alive keeps its metadata; one made anew starts with none
    return ["marked" in torch.autograd.graph.get_gradient_edge(p).node.metadata for p in params]


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_graphed_callable_keeps_no_parameters_accumulate_grad_node_alive(
    backend: str, param_grads: str
) -> None:
    # An AccumulateGrad node kept alive keeps the stream it was made on; a later capture of the
    # same parameters then has to synchronise with that stream inside the capture, which CUDA
    # refuses (the legacy stream). Nothing of a plan, a replay or a finished step may keep one.
    block = ViTBlock(dim=16, heads=2).to(device_of(backend))
    params = list(block.parameters())
    x = torch.randn(2, 5, 16, device=device_of(backend), requires_grad=True)
    graphed = dgt.make_graphed_callables(block, (x,), backend=backend, param_grads=param_grads)
    _mark_accumulate_grad_nodes(params)
    assert not any(_marked_accumulate_grad_nodes(params)), "the capture left nodes alive"
    graphed(x.detach().clone().requires_grad_())[0].float().sum().backward()
    _mark_accumulate_grad_nodes(params)
    assert not any(_marked_accumulate_grad_nodes(params)), "a training step left nodes alive"
    del graphed


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("path", ["hook", "autograd_grad", "backward_inputs"])
def test_auto_keeps_no_accumulate_grad_node_alive_on_its_autograd_paths(
    backend: str, path: str
) -> None:
    # the backwards "auto" hands to autograd look the parameters' nodes up; none may outlive them
    block = ViTBlock(dim=16, heads=2).to(device_of(backend))
    params = list(block.parameters())
    x = torch.randn(2, 5, 16, device=device_of(backend), requires_grad=True)
    graphed = dgt.make_graphed_callables(block, (x,), backend=backend, param_grads="auto")
    handle = block.fc1.bias.register_hook(lambda grad: grad) if path == "hook" else None
    for _ in range(2):
        loss = graphed(x.detach().clone().requires_grad_())[0].float().sum()
        if path == "autograd_grad":
            grads = torch.autograd.grad(loss, params[:2])
            assert all(g is not None for g in grads)
            del grads
        elif path == "backward_inputs":
            loss.backward(inputs=params[:2])
        else:
            loss.backward()
        del loss
        _mark_accumulate_grad_nodes(params)
        assert not any(_marked_accumulate_grad_nodes(params)), f"a step ({path}) left nodes alive"
    assert dgt.diagnostics(graphed).param_grads_through_autograd == 2
    if handle is not None:
        handle.remove()
    del graphed


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_parameters_graphed_again_after_training_steps_capture_and_match_eager(
    backend: str, param_grads: str
) -> None:
    # on cuda, the second capture once failed: the first plan kept the parameters' AccumulateGrad
    # nodes, made on the caller's (legacy) stream, alive
    device = device_of(backend)
    torch.manual_seed(0)
    block = ViTBlock(dim=16, heads=2).to(device)
    twin = fresh_copy(block)
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    first = dgt.make_graphed_callables(block, (x,), backend=backend, param_grads=param_grads)
    first(x)[0].float().sum().backward()
    twin(x)[0].float().sum().backward()
    # some of the same parameters (fc1's), in another module graphed while the first graphs live
    tied, twin_tied = nn.Linear(16, 64).to(device), nn.Linear(16, 64).to(device)
    tied.weight, tied.bias = block.fc1.weight, block.fc1.bias
    twin_tied.weight, twin_tied.bias = twin.fc1.weight, twin.fc1.bias
    y = torch.randn(2, 9, 16, device=device, requires_grad=True)
    second = dgt.make_graphed_callables(tied, (y,), backend=backend, param_grads=param_grads)
    second(y).float().sum().backward()
    twin_tied(y).float().sum().backward()
    first(x)[0].float().sum().backward()
    twin(x)[0].float().sum().backward()
    assert_grads_match(
        grads_of(parameters_of(block)),
        grads_of(parameters_of(twin)),
        parameter_names(block),
        tolerance(backend),
    )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
@pytest.mark.parametrize("hooks", ["non_reentrant_checkpoint", "save_on_cpu"])
def test_a_replay_inside_saved_tensor_hooks_trains_like_eager(
    backend: str, param_grads: str, hooks: str
) -> None:
    # A graph keeps its activations to itself: the caller's saved-tensor hooks (non-reentrant
    # checkpointing around the graphed callable, offloading) never see them. The emulated replay,
    # which re-runs the callable under autograd, once handed them to the caller's hooks: the
    # checkpoint then re-ran the callable inside its own backward.
    device = device_of(backend)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    twin = fresh_copy(block)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(block, (sample,), backend=backend, param_grads=param_grads)

    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if hooks == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return module(x).square().sum()
        return checkpoint(module, x, use_reentrant=False).square().sum()

    for _ in range(2):
        x = torch.randn(4, 8, device=device)
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        run(block, inputs[0]).backward()
        run(twin, inputs[1]).backward()
        assert_tensors_match(inputs[0].grad, inputs[1].grad, "args[0] grad", tolerance(backend))
        assert_grads_match(
            grads_of(parameters_of(block)),
            grads_of(parameters_of(twin)),
            parameter_names(block),
            tolerance(backend),
        )


class _DropsASigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        torch.sigmoid(h)  # dropped: autograd saved its output for a backward that never comes
        return h * 2


def test_an_emulated_replay_inside_saved_tensor_hooks_leaves_no_dropped_graph_behind() -> None:
    # The emulated replay packs its saved tensors with hooks of its own there; packed as
    # themselves, a dropped result held its own node for good (a cycle no collection frees),
    # and the parameters' AccumulateGrad nodes with it: graphing the module again was refused.
    module = _DropsASigmoid()
    sample = (torch.randn(4, 8, requires_grad=True),)
    dgt.make_graphed_callables(module, sample, backend="emulate")
    with torch.autograd.graph.save_on_cpu():
        module(torch.randn(4, 8)).sum().backward()
    dgt.restore(module)
    dgt.make_graphed_callables(module, sample, backend="emulate")


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_reentrant_checkpoint_around_a_function_calling_the_replay_trains_like_eager(
    backend: str, param_grads: str
) -> None:
    # Its forward replays without grad; its backward replays again, with grad, and runs that
    # replay's backward: one backward per forward replay.
    device = device_of(backend)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    twin = fresh_copy(block)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(block, (sample,), backend=backend, param_grads=param_grads)
    for _ in range(2):
        x = torch.randn(4, 8, device=device)
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        for module, tensor in zip((block, twin), inputs, strict=True):
            layer = checkpoint(lambda v, m=module: m(v).square(), tensor, use_reentrant=True)
            layer.sum().backward()
        assert_tensors_match(inputs[0].grad, inputs[1].grad, "args[0] grad", tolerance(backend))
        assert_grads_match(
            grads_of(parameters_of(block)),
            grads_of(parameters_of(twin)),
            parameter_names(block),
            tolerance(backend),
        )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_non_reentrant_checkpoint_that_recomputes_the_replay_is_refused_saying_so(
    backend: str, param_grads: str
) -> None:
    # Its backward re-runs the function to get what ``square`` saved, so the graphed callable
    # replays again inside the backward, over the activations its first replay's backward
    # needs. The error says so (it said "after a later forward replay", which the user never
    # called), and the module trains on afterwards.
    device = device_of(backend)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    twin = fresh_copy(block)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(block, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    layer = checkpoint(lambda v: block(v).square(), x, use_reentrant=False)
    with pytest.raises(DualgraphError, match="non-reentrant activation checkpoint"):
        layer.sum().backward()
    del layer
    assert x.grad is None
    for module in (block, twin):
        module.zero_grad(set_to_none=True)
        checkpoint(module, x, use_reentrant=False).square().sum().backward()
    assert_grads_match(
        grads_of(parameters_of(block)),
        grads_of(parameters_of(twin)),
        parameter_names(block),
        tolerance(backend),
    )
    # A call made twice outside any backward keeps its own message.
    first = block(x)
    block(x)
    with pytest.raises(DualgraphError, match="after a later forward replay"):
        first.sum().backward()


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (a user op failing inside the callable)."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if _FailingBackward.armed:
            raise ValueError("failing backward")
        return grad


class _FailsInBackward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(self.fc(x))


@pytest.mark.parametrize("param_grads", ["auto", "in_graph"])
def test_a_backward_that_raises_leaves_a_kept_grad_as_it_was(param_grads: str) -> None:
    """Eager never writes a ``.grad`` kept across ``zero_grad(set_to_none=True)``, even when
    the next backward fails half-way (``emulate`` re-runs the user's backward, which may raise)."""
    torch.manual_seed(0)
    model = _FailsInBackward()
    dgt.make_graphed_callables(
        model, (torch.randn(2, 4, requires_grad=True),), backend="emulate", param_grads=param_grads
    )
    model(torch.randn(2, 4)).sum().backward()
    kept = model.fc.weight.grad
    assert kept is not None
    values = kept.clone()
    model.zero_grad(set_to_none=True)
    _FailingBackward.armed = True
    try:
        with pytest.raises(ValueError, match="failing backward"):
            model(torch.randn(2, 4)).sum().backward()
    finally:
        _FailingBackward.armed = False
    assert model.fc.weight.grad is None
    assert torch.equal(kept, values)


class _Scales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


#: Where ``x * w``'s grad towards ``w`` is ``-0.0`` (at ``x = -0.0``) and ``+0.0``, and not zero.
_SIGNED_ZEROS_AND_ONES = torch.tensor([-0.0, 0.0, -1.0, 1.0])


def _eager_and_graphed(eager: nn.Module, param_grads: str) -> tuple[nn.Module, nn.Module]:
    """``eager`` and a copy of it graphed (emulate) on a sample of four elements."""
    graphed = copy.deepcopy(eager)
    dgt.make_graphed_callables(
        graphed, (torch.randn(4),), backend="emulate", param_grads=param_grads
    )
    return eager, graphed


@pytest.mark.parametrize("param_grads", ["auto", "in_graph", "autograd"])
@pytest.mark.parametrize("backward", ["plain", "through autograd", "torch.autograd.grad"])
def test_a_negative_zero_grad_reaches_the_parameter_as_in_eager(
    param_grads: str, backward: str
) -> None:
    """Eager's ``AccumulateGrad`` sets a ``.grad`` that is ``None`` to the grad itself: at an
    ``x`` of ``-0.0``, the grad of ``x * w`` towards ``w`` is ``-0.0``; zeroed accumulators
    gave ``0.0 + -0.0 = 0.0`` (the sign of zero is what ``1 / grad`` or ``copysign`` read)."""
    if param_grads == "in_graph" and backward != "plain":
        pytest.skip("in_graph refuses parameter hooks and torch.autograd.grad")
    eager, graphed = _eager_and_graphed(_Scales(), param_grads)
    x = _SIGNED_ZEROS_AND_ONES
    signs = []
    for model in (eager, graphed):
        if backward == "through autograd":  # "auto" hands autograd copies of the grads
            model.weight.register_hook(lambda grad: grad)
        grads = []
        for _ in range(2):  # set from None, then added to
            loss = model(x).sum()
            if backward == "torch.autograd.grad":
                grads.append(torch.autograd.grad(loss, [model.weight])[0])
            else:
                loss.backward()
                grads.append(model.weight.grad.clone())
        signs.append([grad.signbit().tolist() for grad in grads])
    assert signs[1] == signs[0] == [[True, False, True, False]] * 2


class _ScalesOfTwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.single = nn.Parameter(torch.ones(4))
        self.wide = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.single + (x.double() * self.wide).float()


@pytest.mark.parametrize("param_grads", ["auto", "in_graph"])
def test_negative_zero_grads_reach_parameters_of_two_dtypes_after_zero_grad(
    param_grads: str,
) -> None:
    """Accumulators of two dtypes start each step after ``zero_grad()`` (every ``.grad``
    ``None``) at ``-0.0`` in one copy per dtype: each ``.grad`` is the grad itself, as eager's."""
    eager, graphed = _eager_and_graphed(_ScalesOfTwoDtypes(), param_grads)
    x = _SIGNED_ZEROS_AND_ONES
    signs = []
    for model in (eager, graphed):
        seen = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            seen.append([p.grad.signbit().tolist() for p in (model.single, model.wide)])
        signs.append(seen)
    assert signs[1] == signs[0] == [[[True, False, True, False]] * 2] * 3


class _ComplexScales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(self.weight) * x


#: Rows where the grad of ``view_as_real(w) * x`` towards a complex ``w`` is ``-0.0 - 1j``,
#: ``inf + 1j`` and ``2 + 3j``: torch's complex add (``a + 1 * b``) of the first into ``-0.0``
#: gives ``0.0 - 1j``, of the second ``inf + nanj``.
_COMPLEX_GRAD_PARTS = torch.tensor([[-0.0, -1.0], [float("inf"), 1.0], [2.0, 3.0]])


@pytest.mark.parametrize("backward", ["plain", "through autograd", "torch.autograd.grad"])
def test_a_complex_parameters_grad_keeps_zero_signs_and_infinities_as_in_eager(
    backward: str,
) -> None:
    """Under ``"auto"``, a sum started at ``-0.0`` is the grad itself for real dtypes only: a
    complex one came back with ``0.0 - 1j`` for eager's ``-0.0 - 1j`` and ``inf + nanj`` for
    ``inf + 1j``; a complex parameter's grads go through autograd, which sets ``.grad`` to the
    grad and adds into it as eager does."""
    eager = _ComplexScales()
    graphed = copy.deepcopy(eager)
    dgt.make_graphed_callables(graphed, (torch.randn(3, 2),), backend="emulate")
    bits = []
    for model in (eager, graphed):
        if backward == "through autograd":
            model.weight.register_hook(lambda grad: grad)
        grads = []
        for _ in range(2):  # set from None, then added to
            loss = model(_COMPLEX_GRAD_PARTS).sum()
            if backward == "torch.autograd.grad":
                grads.append(torch.autograd.grad(loss, [model.weight])[0])
            else:
                loss.backward()
                grads.append(model.weight.grad.clone())
        bits.append([torch.view_as_real(grad).view(torch.int32).tolist() for grad in grads])
    assert bits[1] == bits[0]
    assert bits[0][0] == _COMPLEX_GRAD_PARTS.view(torch.int32).tolist()  # the grad itself


def test_in_graph_refuses_a_complex_parameter_naming_it() -> None:
    """``"in_graph"`` adds the grads into ``.grad`` in its graph, which for a complex parameter
    gives other bits than eager's ``.grad`` after ``zero_grad()`` (see above): refused."""
    with pytest.raises(CaptureError, match=r"_ComplexScales\.weight is complex64.*'auto'"):
        dgt.make_graphed_callables(
            _ComplexScales(), (torch.randn(3, 2),), backend="emulate", param_grads="in_graph"
        )


def test_a_backward_that_raises_through_autograd_leaves_the_accumulated_grad() -> None:
    """``"auto"`` with a parameter hook replays into zeroed accumulators; a backward failing
    there must leave the ``.grad`` accumulated so far as eager leaves it."""
    torch.manual_seed(0)
    model = _FailsInBackward()
    twin = _FailsInBackward()
    twin.load_state_dict(model.state_dict())
    dgt.make_graphed_callables(model, (torch.randn(2, 4, requires_grad=True),), backend="emulate")
    x = torch.randn(2, 4)
    for m in (model, twin):
        m(x).sum().backward()  # .grad is the graph's accumulator now
        m.fc.weight.register_hook(lambda grad: grad)  # the next backward goes through autograd
        _FailingBackward.armed = True
        try:
            with pytest.raises(ValueError, match="failing backward"):
                m(x).sum().backward()
        finally:
            _FailingBackward.armed = False
    assert twin.fc.weight.grad is not None and model.fc.weight.grad is not None
    assert torch.equal(model.fc.weight.grad, twin.fc.weight.grad)


# -- each rule on every entry point (entry_points.py) -------------------------------------------


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_inference_mode_records_no_history_even_with_grad_enabled_on_every_entry_point(
    entry: str,
) -> None:
    module = Decays()
    twin = copy.deepcopy(module)
    graphed = graphed_on(entry, module)
    x = batch(call_length(entry))
    with torch.inference_mode(), torch.enable_grad():
        if entry == "schedule":  # a scheduled pass needs its backward: refused before replaying
            stats = module.stats.clone()
            with pytest.raises(DualgraphError, match="grad disabled"):
                graphed(x)
            assert torch.equal(module.stats, stats)
            return
        out, expected = graphed(x), twin(x)
    assert (out.requires_grad, out.grad_fn) == (expected.requires_grad, expected.grad_fn)
    assert_tensors_match(out, expected, "output", tolerance("emulate"))


class _EnablesGrad(Decays):
    """Decays with grad mode turned on by its own forward (as a force field taking -dE/dx)."""

    def forward(
        self,
        x: torch.Tensor,
        shift: torch.Tensor | None = None,
        valid_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with torch.enable_grad():
            return super().forward(x, shift, valid_length)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_call_under_no_grad_of_a_callable_enabling_grad_itself_is_refused_on_every_entry_point(
    entry: str,
) -> None:
    # Eager's call under torch.no_grad() records history inside the forward's enable_grad (its
    # output requires grad, x and the weights get grads); a replay under no_grad recorded none.
    module = _EnablesGrad()
    twin = copy.deepcopy(module)
    if entry in ("function", "method"):
        twin.requires_grad_(False)
    graphed = graphed_on(entry, module)
    length = call_length(entry)
    x = batch(length)
    with torch.no_grad():
        assert twin(x.detach().clone().requires_grad_()).requires_grad  # eager records
        stats = module.stats.clone()
        refusal = "grad disabled" if entry == "schedule" else r"^output: .* turns it on itself"
        with pytest.raises(DualgraphError, match=refusal):
            graphed(x)
    assert torch.equal(module.stats, stats)  # refused before the replay ran
    for _ in range(2):  # with grad on, as eager: values, input and weight grads, accumulated
        x = batch(length)
        xe = x.detach().clone().requires_grad_()
        out, expected = graphed(x), twin(xe)
        assert out.requires_grad == expected.requires_grad
        assert_tensors_match(out, expected, "output", tolerance("emulate"))
        out.sum().backward()
        expected.sum().backward()
        assert_tensors_match(x.grad, xe.grad, "input grad", tolerance("emulate"))
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert_tensors_match(p.grad, q.grad, "param grad", tolerance("emulate"))
    if entry == "schedule":  # every scheduled forward needs its backward
        return
    with torch.inference_mode():  # eager records nothing there either: replayed
        x = batch(length)
        out, expected = graphed(x), twin(x)
        assert (out.requires_grad, expected.requires_grad) == (False, False)
        assert_tensors_match(out, expected, "output", tolerance("emulate"))


class _GradModeOwnOnly(nn.Module):
    """Turns grad mode on for a part whose history no output keeps (a detached target)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            h = self.linear(x)
        with torch.no_grad():
            target = self.linear(x) * 2
        return h.detach().tanh(), target


def test_a_callable_enabling_grad_for_what_no_output_keeps_is_replayed_under_no_grad() -> None:
    module = _GradModeOwnOnly()
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(module, (batch(),), backend="emulate")
    with torch.no_grad():
        for _ in range(2):
            x = batch()
            out, expected = graphed(x), twin(x)
            assert [o.requires_grad for o in out] == [e.requires_grad for e in expected]
            assert_trees_match(out, expected, tolerance("emulate"))


class _ForcesOfFeatures(nn.Module):
    """Forces as -dE/dh of features computed before its own enable_grad: under no_grad they
    record nothing, and its autograd.grad raises (eager's call under no_grad fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        with torch.enable_grad():
            energy = self.head(h.tanh()).square().sum()
            (forces,) = torch.autograd.grad(energy, h, create_graph=True)
        return -forces


def test_a_callable_whose_forward_raises_under_no_grad_is_graphed_and_refused_there() -> None:
    # The forward run under no_grad to find the outputs that record history raised, and with it
    # the capture, of a callable eager runs with grad on (graphed before that forward was run).
    module = _ForcesOfFeatures()
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(module, (batch().requires_grad_(),), backend="emulate")
    x = batch().requires_grad_()
    assert_trees_match(graphed(x), twin(x), tolerance("emulate"))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="does not require grad"):
            twin(x)  # eager
        with pytest.raises(DualgraphError, match=r"^output: .* called with grad mode off"):
            graphed(x)


#: A length whose call replays another graph than a call of ``call_length(entry)`` does (another
#: shape bucket); with slots, the call made while the first is in flight takes the other slot.
OTHER_LENGTH = {"buckets": 5, "pad": 3}


@pytest.mark.parametrize("entry", [e for e in WITH_PARAMETERS if e != "schedule"])
def test_in_graph_refuses_a_grad_forward_after_any_forward_ran_inside_ddp_on_every_entry_point(
    entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each shape bucket and each slot kept its own mark: once an evaluation under DDP had run in
    # one bucket (or slot), a forward with grad outside DDP's forward (a reentrant checkpoint's
    # recompute) replayed in another was not refused, and its grads bypassed DDP's all-reduce.
    # (A schedule refuses a forward without grad on its own.)
    module = Decays()
    graphed = graphed_on(entry, module, param_grads="in_graph")
    length = call_length(entry)
    in_flight = graphed(batch(length))
    if entry != "slots":  # one replay in flight at a time
        backward_of(in_flight)
    ddp = torch.nn.parallel.DistributedDataParallel
    with monkeypatch.context() as inside:  # what DDP's forward sets while it runs
        inside.setattr(ddp, "_active_ddp_module", module, raising=False)
        with torch.no_grad():
            graphed(batch(OTHER_LENGTH.get(entry, length)))
    if entry == "slots":
        backward_of(in_flight)
    kept = [p.grad.clone() for p in module.parameters()]
    with pytest.raises(DualgraphError, match="param_grads='autograd' to train under DDP"):
        graphed(batch(length))
    assert all(torch.equal(p.grad, k) for p, k in zip(module.parameters(), kept, strict=True))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_batched_backward_is_refused_on_every_entry_point(entry: str) -> None:
    module = Decays()
    graphed = graphed_on(entry, module)
    x = batch(call_length(entry))
    out = graphed(x)
    with pytest.raises(DualgraphError, match="is_grads_batched"):
        torch.autograd.grad(out, x, torch.randn(5, *out.shape), is_grads_batched=True)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_hook_that_calls_the_replay_before_its_backward_is_refused_naming_hooks(
    backend: str, param_grads: str
) -> None:
    # A forward replay during the backward overwrote the pending replay's activations; the error
    # blamed a checkpoint the user never used.
    device = device_of(backend)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(device)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(block, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    out = block(x)
    out.register_hook(lambda grad: grad * block(torch.randn_like(grad)).detach())
    with pytest.raises(DualgraphError, match=r"Or a hook .* called it before this backward"):
        out.sum().backward()
    assert x.grad is None


def _overlapping_grads(layer: nn.Linear) -> None:
    flat = torch.zeros(16, device=layer.weight.device)
    layer.weight.grad, layer.bias.grad = flat.view(4, 4), flat[:4]


def _expanded_weight_grad(layer: nn.Linear) -> None:
    layer.weight.grad = _expanded_grad(layer.weight)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("param_grads", "spoil"),
    [
        ("in_graph", _expanded_weight_grad),
        ("in_graph", _overlapping_grads),
        ("auto", _overlapping_grads),
    ],
)
def test_a_backward_refused_before_it_replays_stays_pending_for_a_retry(
    backend: str, param_grads: str, spoil: Any
) -> None:
    # The refusal said "nothing was changed", but the replay's backward was already marked as
    # run: the retry, with .grad mended, was refused as a second backward, where eager's runs.
    device = device_of(backend)
    layer, twin = nn.Linear(4, 4).to(device), nn.Linear(4, 4).to(device)
    twin.load_state_dict(layer.state_dict())
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    dgt.make_graphed_callables(layer, sample, backend=backend, param_grads=param_grads)
    x = torch.randn(2, 4, device=device)
    loss = layer(x).square().sum()
    spoil(layer)
    with pytest.raises(DualgraphError, match=r"Linear\.(weight|bias)"):
        loss.backward(retain_graph=True)
    layer.weight.grad = layer.bias.grad = None
    loss.backward()
    twin(x).square().sum().backward()
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        parameter_names(layer),
        tolerance(backend),
    )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_replay_hook_failing_before_the_backward_leaves_it_pending_for_a_retry(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    failures = [RuntimeError("the step counter is not ready")]

    def before_backward(call: Any) -> None:
        if failures:
            raise failures.pop()

    layer, twin = nn.Linear(4, 4).to(device), nn.Linear(4, 4).to(device)
    twin.load_state_dict(layer.state_dict())
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    hooks = dgt.ReplayHooks(before_backward=before_backward)
    dgt.make_graphed_callables(
        layer, sample, backend=backend, param_grads=param_grads, replay_hooks=hooks
    )
    x = torch.randn(2, 4, device=device)
    loss = layer(x).square().sum()
    with pytest.raises(RuntimeError, match="the step counter is not ready"):
        loss.backward(retain_graph=True)
    loss.backward()
    twin(x).square().sum().backward()
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        parameter_names(layer),
        tolerance(backend),
    )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_batched_backward_on_the_engines_device_thread_is_refused(
    backend: str, param_grads: str
) -> None:
    # On CUDA the engine runs a replay's backward on the device's own thread, where the caller's
    # vmap level (is_grads_batched=True) reads as none: the batched grads themselves must tell.
    # Here the node's backward is called from a thread without a vmap level, with such a grad.
    layer, device = _graphed_linear(backend, param_grads)
    out = layer(torch.randn(2, 4, device=device, requires_grad=True))
    static = [t.clone() for t in runner_of(layer).plan.buffers.grad_outputs]
    raised: list[BaseException] = []

    def backward_elsewhere() -> None:
        batched = torch._add_batch_dim(torch.randn(5, 2, 3, device=device), 0, 1)
        try:
            out.grad_fn.apply(batched)
        except BaseException as error:  # handed to the test's thread
            raised.append(error)

    worker = threading.Thread(target=backward_elsewhere)
    worker.start()
    worker.join()
    assert len(raised) == 1 and isinstance(raised[0], DualgraphError), raised
    assert "is_grads_batched" in str(raised[0])
    # By bytes: the buffer holds what its memory held (a NaN there is not equal to itself).
    now = runner_of(layer).plan.buffers.grad_outputs
    bytes_now = [t.view(torch.uint8) for t in now]
    assert all(map(torch.equal, bytes_now, [t.view(torch.uint8) for t in static]))


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_one_backward_through_a_stale_replay_and_the_latest_is_refused_before_any_grad_changes(
    backend: str, param_grads: str
) -> None:
    """The engine runs the later replay's backward first: it must not add its grads before the
    earlier replay (overwritten by it) refuses, as nothing is added on any other refusal."""
    layer = nn.Linear(8, 8).to(device_of(backend))
    graphed = _graph(layer, (4, 8), backend=backend, param_grads=param_grads)
    layer(torch.randn(4, 8, device=device_of(backend))).sum().backward()  # .grad holds something
    before = [p.grad.clone() for p in layer.parameters()]
    xs = [torch.randn(4, 8, device=device_of(backend), requires_grad=True) for _ in range(2)]
    first, second = graphed(xs[0]), graphed(xs[1])
    with pytest.raises(DualgraphError, match="earlier replay"):
        (first.sum() + second.sum()).backward()
    assert xs[1].grad is None
    for k, (p, then) in enumerate(zip(layer.parameters(), before, strict=True)):
        assert torch.equal(p.grad, then), f"parameter {k}'s grad changed before the refusal"
    second.sum().backward()  # the latest replay's backward still runs
    assert xs[1].grad is not None


@pytest.mark.parametrize("frozen_first", [False, True])
def test_plain_backward_check_asks_the_parameter_node_on_the_replay_edge(
    monkeypatch: pytest.MonkeyPatch, frozen_first: bool
) -> None:
    # "autograd": whether a backward is a plain .backward() is asked of a parameter's
    # AccumulateGrad node, read off the replay's own edge (the first parameter still trainable),
    # never the input's node next to it.
    import dualgraph.torch._replay as replay_module
    from dualgraph.torch._grad_checks import grad_accumulator

    layer = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    (graphed,) = dgt.make_graphed_callables(
        (layer,), ((x,),), backend="emulate", param_grads="autograd"
    )
    asked: list[Any] = []
    expected: list[Any] = []
    real = replay_module._will_engine_execute_node
    assert real is not None

    def recording(node: Any) -> bool:
        asked.append(node)
        expected.append(grad_accumulator(layer.bias if frozen_first else layer.weight))
        return bool(real(node))

    monkeypatch.setattr(replay_module, "_will_engine_execute_node", recording)
    out = graphed(torch.randn(2, 3, requires_grad=True))
    if frozen_first:  # frozen since the forward: its edge is there, another parameter is asked
        layer.weight.requires_grad_(False)
    out.sum().backward()
    assert asked and asked[0] is expected[0]


@pytest.mark.parametrize("change", ["double", "half"])
def test_a_call_fitting_a_module_changed_after_capture_is_refused_naming_the_parameter(
    change: str,
) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    graphed = dgt.make_graphed_callables(
        model, (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    getattr(graphed, change)()
    batch_of_its_dtype = torch.randn(2, 4, dtype=graphed[0].weight.dtype)
    with pytest.raises(DualgraphError) as refused:
        graphed(batch_of_its_dtype)  # as the changed module takes: the change is the cause
    message = str(refused.value)
    assert message.startswith("Sequential.0.weight: the parameter's memory changed"), message
    assert "the call's input was refused too: args[0]: expected float32[2, 4]" in message


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_a_weight_stepped_before_a_backward_needing_fewer_grads_is_not_said_to_fail_eager(
    param_grads: str,
) -> None:
    # Found by test_torch_differential.py: captured with x requiring grad, called with x that
    # does not; eager's Linear then saves no weight (only x, for the weight's grad) and its
    # backward runs after an optimizer step, while the replay's graph reads the weight for the
    # captured grad of x. The refusal said "eager would raise", which was false: it now names
    # the input whose grad the call does not need and says eager may run.
    layer = nn.Linear(4, 4)
    dgt.make_graphed_callables(
        layer, (torch.randn(3, 4, requires_grad=True),), backend="emulate", param_grads=param_grads
    )
    twin = copy.deepcopy(layer)
    twin_out = twin(torch.randn(3, 4))
    out = layer(torch.randn(3, 4))
    with torch.no_grad():
        layer.weight.mul_(0.5)
        twin.weight.mul_(0.5)
    twin_out.sum().backward()  # eager runs
    with pytest.raises(DualgraphError) as refused:
        out.sum().backward()
    message = str(refused.value)
    assert "Linear.weight was modified in place" in message, message
    assert "captured with args[0] requiring grad (this call's does not)" in message, message
    assert "eager would raise" not in message, message
    assert layer.weight.grad is None


class _HandsBackItsInput(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.gelu(x) * mask, x


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_input_handed_back_keeps_the_negative_zeros_of_its_grad_bit_for_bit(
    param_grads: str,
) -> None:
    # Found by test_torch_differential.py: the output that is the input itself never gets a
    # grad through the replay (its grad goes to the caller's tensor directly), and the backward
    # set its incoming grad to 0.0, which the graph added to the grad of the input's use inside:
    # -0.0 + 0.0 is 0.0, so x.grad had 0.0 where eager's (gelu's slope times a masked 0) is -0.0.
    graphed = _HandsBackItsInput()
    dgt.make_graphed_callables(
        graphed,
        (torch.randn(3, 4, requires_grad=True), torch.ones(3, 4)),
        backend="emulate",
        param_grads=param_grads,
    )
    x = torch.full((3, 4), -2.0)  # gelu's slope is negative there
    mask = torch.zeros(3, 4)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    (graphed(mine, mask)[0].sum() * 1.5).backward()
    (_HandsBackItsInput()(theirs, mask)[0].sum() * 1.5).backward()
    assert theirs.grad is not None and theirs.grad.signbit().all()  # eager's: -0.0
    assert mine.grad is not None and torch.equal(mine.grad.signbit(), theirs.grad.signbit())


class _HandsBackARowOfItsInput(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.gelu(x) * mask, x[0]


def test_a_view_of_an_input_handed_back_keeps_the_negative_zeros_of_its_grad() -> None:
    # The graph differentiated the view too (its grad None, filled), and select's backward
    # padded the other rows with 0.0: x.grad had 0.0 there where eager's is -0.0. Outputs handed
    # out as another tensor are now left out of the captured backward.
    graphed = _HandsBackARowOfItsInput()
    dgt.make_graphed_callables(
        graphed, (torch.randn(3, 4, requires_grad=True), torch.ones(3, 4)), backend="emulate"
    )
    x, mask = torch.full((3, 4), -2.0), torch.zeros(3, 4)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    (graphed(mine, mask)[0].sum() * 1.5).backward()
    (_HandsBackARowOfItsInput()(theirs, mask)[0].sum() * 1.5).backward()
    assert theirs.grad is not None and theirs.grad.signbit().all()
    assert mine.grad is not None and torch.equal(mine.grad.signbit(), theirs.grad.signbit())


class _HandsBackARowOfItsOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        return h, h[0]


class _ViewAndHeadOfItsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h[0], self.head(h)


def test_a_view_of_an_output_beside_a_layer_on_that_output_sums_hs_grad_within_rounding() -> None:
    # h takes three grads: its own, h[0]'s (handed out as a view of h: its select backward runs
    # outside the replay, before it) and the head's (inside). Eager adds them as its engine
    # reaches them, (own + head) + row; the replay gets (own + row) and adds the head's inside:
    # lin's bias grad may differ in the last bit (README, rounding of incoming grads: 4.8e-7 for
    # this seed on one CPU, equal on another, whose kernels round otherwise), never more.
    torch.manual_seed(19)
    graphed = _ViewAndHeadOfItsOutput()
    eager = copy.deepcopy(graphed)
    x = torch.randn(3, 4)
    dgt.make_graphed_callables(graphed, (x,), backend="emulate")
    for net in (graphed, eager):
        h, row, out = net(x)
        (h.sum() * 1.5 + (row * 2.5).sum() + (out * 3.5).sum()).backward()
    for name in ("lin.weight", "lin.bias", "head.weight", "head.bias"):
        mine, theirs = graphed.get_parameter(name).grad, eager.get_parameter(name).grad
        assert mine is not None and theirs is not None, name
        torch.testing.assert_close(mine, theirs, rtol=2e-7, atol=1e-6, msg=name)


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_a_view_of_an_output_handed_back_keeps_the_negative_zeros_of_its_grad(
    param_grads: str,
) -> None:
    # h[0] is handed out as a view of the h handed out, which takes its grad; the graph also
    # differentiated the replay's own h[0] (its grad None, zeroed), whose select backward added
    # 0.0 to h's grad: -0.0 + 0.0 is 0.0 in the rows h[0] does not cover.
    graphed = _HandsBackARowOfItsOutput()
    sample = torch.randn(3, 4, requires_grad=True)
    dgt.make_graphed_callables(graphed, (sample,), backend="emulate", param_grads=param_grads)
    for _ in range(2):
        x = torch.randn(3, 4)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        for net, leaf in ((graphed, mine), (_HandsBackARowOfItsOutput(), theirs)):
            h, _ = net(leaf)
            (h * torch.full_like(h, -0.0)).sum().backward()
        assert theirs.grad is not None and theirs.grad.signbit().all()  # eager's: -0.0
        assert mine.grad is not None and torch.equal(mine.grad.signbit(), theirs.grad.signbit())


def _tells_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Branches on identity, as nn.MultiheadAttention does for ``query is key``."""
    return a.sin() * 2 if a is b else a.sin() + b.cos()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_call_passing_one_tensor_at_two_inputs_runs_as_eager_tells_them_apart(
    backend: str,
) -> None:
    # A replay's inputs are buffers of their own: the graph ran the branch of distinct tensors,
    # a.sin() + b.cos(), where eager's call of (x, x) gives x.sin() * 2, silently.
    device = device_of(backend)
    samples = tuple(torch.randn(3, device=device, requires_grad=True) for _ in range(2))
    graphed = dgt.make_graphed_callables(_tells_apart, samples, backend=backend)
    for _ in range(2):
        x = torch.randn(3, device=device, requires_grad=True)
        twin = x.detach().clone().requires_grad_()
        out, want = graphed(x, x), _tells_apart(twin, twin)
        assert_tensors_match(out, want, "output", tolerance(backend))
        out.sum().backward()
        want.sum().backward()
        assert_tensors_match(x.grad, twin.grad, "grad", tolerance(backend))
    assert dgt.diagnostics(graphed).eager_calls == 2
    x, z = (torch.randn(3, device=device, requires_grad=True) for _ in range(2))
    assert_tensors_match(graphed(x, z), _tells_apart(x, z), "output", tolerance(backend))
    assert dgt.diagnostics(graphed).replays == 1  # distinct tensors replay


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_self_attention_graphed_with_distinct_samples_matches_eager_bit_for_bit(
    backend: str, param_grads: str
) -> None:
    # mha(x, x, x): eager packs the three projections into one where query is key is value,
    # the graph (its inputs distinct buffers) projects each apart: x.grad was 1e-7 off.
    device = device_of(backend)
    module = nn.MultiheadAttention(16, 4, batch_first=True).to(device)
    twin = copy.deepcopy(module)
    samples = tuple(torch.randn(2, 5, 16, device=device, requires_grad=True) for _ in range(3))
    dgt.make_graphed_callables(
        module,
        samples,
        sample_kwargs={"need_weights": False},
        backend=backend,
        param_grads=param_grads,
    )
    for _ in range(2):
        x = torch.randn(2, 5, 16, device=device, requires_grad=True)
        y = x.detach().clone().requires_grad_()
        out, want = module(x, x, x, need_weights=False)[0], twin(y, y, y, need_weights=False)[0]
        out.square().sum().backward()
        want.square().sum().backward()
        assert_tensors_match(out, want, "output", tolerance(backend))
        assert_grads_match(
            grads_of([x, *parameters_of(module)]),
            grads_of([y, *parameters_of(twin)]),
            ["x", *parameter_names(module)],
            tolerance(backend),
        )


class _DoubledOnMaking(collections.namedtuple("_DoubledOnMaking", "h n")):
    """A namedtuple whose __new__ converts what it is given (here: doubles h)."""

    def __new__(cls, h: Any, n: Any) -> _DoubledOnMaking:
        return super().__new__(cls, h * 2, n)


def test_owned_refuses_a_namedtuple_whose_new_would_change_its_values_again() -> None:
    # Before: optree's tree_map rebuilt it by calling the class bare: h doubled a second time
    # (2 -> 4), silently
    made = _DoubledOnMaking(torch.ones(2), 3)
    with pytest.raises(
        DualgraphError,
        match=r"^unflatten: \[1\]: rebuilding a \S*_DoubledOnMaking raised DualgraphError: .* "
        r"did not keep its items as given",
    ):
        dgt.owned((None, made))


def test_owned_keeps_an_ordereddicts_own_order() -> None:
    # Before: optree rebuilt it in the insertion order beneath: move_to_end undone
    moved = collections.OrderedDict(a=torch.ones(1), b=torch.zeros(1))
    moved.move_to_end("a")
    mine = dgt.owned({"out": moved})["out"]
    assert list(mine) == ["b", "a"] and mine["a"] is not moved["a"]
    assert torch.equal(mine["a"], moved["a"])


def test_owned_clones_a_namedtuple_tensor_met_twice_once() -> None:
    # Guard: the spec's walk keeps owned's sharing of a tensor met twice
    pair = collections.namedtuple("pair", "first again")
    h = torch.ones(2)
    mine = dgt.owned([pair(h, h), h])
    assert type(mine[0]) is pair and mine[0].first is mine[0].again is mine[1]
    assert mine[1] is not h


class _Exp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).exp()  # exp's backward reads its output


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_an_output_changed_through_data_before_backward_is_differentiated_as_changed(
    backend: str, param_grads: str
) -> None:
    # Eager's backward (and a graph's, which reads the static output's memory) reads the
    # output as the caller left it through .data; emulate's backward read its own run's copy.
    device = device_of(backend)
    sample = torch.randn(3, device=device, requires_grad=True)
    graphed, twin = _Exp().to(device), _Exp().to(device)
    dgt.make_graphed_callables(graphed, (sample,), backend=backend, param_grads=param_grads)
    for _ in range(2):
        x = torch.randn(3, device=device)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        for net, leaf in ((graphed, mine), (twin, theirs)):
            out = net(leaf)
            out.data.mul_(2)
            out.sum().backward()
        assert mine.grad is not None and theirs.grad is not None
        assert_tensors_match(mine.grad, theirs.grad, "x.grad", tolerance(backend))
        assert_grads_match([graphed.w.grad], [twin.w.grad], ["w"], tolerance(backend))


class _ScalesByAnInput(nn.Module):
    """A layer whose second input may be its own weight (or a view of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * scale + x.sin() * scale


_OWN_WEIGHT = {
    "itself": lambda weight: weight,
    "a_slice": lambda weight: weight[:, :],
    "transposed": lambda weight: weight.t(),
}


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
@pytest.mark.parametrize("passed", sorted(_OWN_WEIGHT))
def test_a_call_passing_its_own_parameter_as_an_input_gives_eagers_grads(
    backend: str, param_grads: str, passed: str
) -> None:
    # Eager sums the weight's grad through the input with its grad inside the layer before
    # adding the sum into .grad; "auto" and "in_graph" added the graph's share into .grad and
    # autograd the input's after it: fc.weight.grad 3e-8 to 1.2e-7 off from the second step.
    device = device_of(backend)
    module = _ScalesByAnInput().to(device)
    twin = copy.deepcopy(module)
    samples = tuple(torch.randn(3, 3, device=device, requires_grad=True) for _ in range(2))
    dgt.make_graphed_callables(module, samples, backend=backend, param_grads=param_grads)
    view = _OWN_WEIGHT[passed]
    for step in range(3):
        if step == 2:
            module.zero_grad()
            twin.zero_grad()
        x = torch.randn(3, 3, device=device, requires_grad=True)
        y = x.detach().clone().requires_grad_()
        out, want = module(x, view(module.fc.weight)), twin(y, view(twin.fc.weight))
        (out.square().sum() * 3).backward()
        (want.square().sum() * 3).backward()
        assert_tensors_match(out, want, "output", tolerance(backend))
        assert_grads_match(
            grads_of([x, *parameters_of(module)]),
            grads_of([y, *parameters_of(twin)]),
            ["x", *parameter_names(module)],
            tolerance(backend),
        )
    calls = dgt.diagnostics(module)
    assert (calls.replays, calls.eager_calls) == ((3, 0) if param_grads == "autograd" else (0, 3))


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_detached_copy_of_its_own_parameter_replays(backend: str, param_grads: str) -> None:
    # Only a parameter whose grad an input carries back runs eagerly: a detached one, a view
    # made under no_grad, or a call without grad, replay.
    device = device_of(backend)
    module = _ScalesByAnInput().to(device)
    samples = tuple(torch.randn(3, 3, device=device, requires_grad=True) for _ in range(2))
    dgt.make_graphed_callables(module, samples, backend=backend, param_grads=param_grads)
    x = torch.randn(3, 3, device=device, requires_grad=True)
    module(x, module.fc.weight.detach()).sum().backward()
    with torch.no_grad():
        view = module.fc.weight.t()  # a view that needs no grad
        module(x, module.fc.weight)
    module(x, view).sum().backward()
    calls = dgt.diagnostics(module)
    assert (calls.replays, calls.eager_calls) == (3, 0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_replay_and_a_call_passing_its_own_parameter_sum_their_grads_as_eager(
    backend: str,
) -> None:
    # Under "auto", the eager call's graph alive sends the replay's parameter grads through
    # autograd, which sums both calls' grads before adding them to .grad, as eager does.
    device = device_of(backend)
    module = _ScalesByAnInput().to(device)
    twin = copy.deepcopy(module)
    samples = tuple(torch.randn(3, 3, device=device, requires_grad=True) for _ in range(2))
    dgt.make_graphed_callables(module, samples, backend=backend)
    for _ in range(3):
        x, scale, z = (torch.randn(3, 3, device=device, requires_grad=True) for _ in range(3))
        mine = (x, scale, z)
        y, twin_scale, w = theirs = tuple(t.detach().clone().requires_grad_() for t in mine)
        (module(x, scale).square().sum() + module(z, module.fc.weight).square().sum()).backward()
        (twin(y, twin_scale).square().sum() + twin(w, twin.fc.weight).square().sum()).backward()
        assert_grads_match(
            grads_of([*mine, *parameters_of(module)]),
            grads_of([*theirs, *parameters_of(twin)]),
            ["x", "scale", "z", *parameter_names(module)],
            tolerance(backend),
        )
    calls = dgt.diagnostics(module)
    assert (calls.replays, calls.eager_calls) == (3, 3)


# -- a backward under inference mode ------------------------------------------------------------


def _inference_flags(module: nn.Module) -> list[bool | None]:
    return [None if p.grad is None else p.grad.is_inference() for p in module.parameters()]


@pytest.mark.parametrize("entry", WITH_PARAMETERS)
@pytest.mark.parametrize("param_grads", ["auto", "autograd"])
def test_a_backward_under_inference_mode_makes_new_grads_inference_tensors_as_eager(
    entry: str, param_grads: str
) -> None:
    # eager's AccumulateGrad makes a .grad that was None an inference tensor there (and adds
    # into it in place after); "auto" handed out its accumulators, ordinary tensors, silently
    module = Decays()
    twin = copy.deepcopy(module)
    graphed = graphed_on(entry, module, param_grads=param_grads)
    for call in (graphed, twin):
        generator = torch.Generator().manual_seed(3)
        for _ in range(2):
            x = torch.randn(2, call_length(entry), 4, generator=generator, requires_grad=True)
            loss = call(x).square().sum()
            with torch.inference_mode():
                loss.backward()
    assert _inference_flags(module) == _inference_flags(twin) == [True, True]
    for ours, eagers in zip(module.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, eagers.grad)


@pytest.mark.parametrize("entry", WITH_PARAMETERS)
def test_in_graph_refuses_a_backward_under_inference_mode_that_would_make_a_new_grad(
    entry: str,
) -> None:
    module = Decays()
    graphed = graphed_on(entry, module, param_grads="in_graph")
    x = batch(call_length(entry))
    loss = graphed(x).square().sum()
    with (
        torch.inference_mode(),
        pytest.raises(
            DualgraphError,
            match=r"Decays\.linear\.weight: \.grad is None and this backward runs under "
            r"torch\.inference_mode\(\).*nothing was changed",
        ),
    ):
        loss.backward(retain_graph=True)  # for the retry below
    assert x.grad is None and _inference_flags(module) == [None, None]
    loss.backward()  # outside inference mode, as eager's
    assert _inference_flags(module) == [False, False]


# -- a second backward through a replay's grads --------------------------------------------------


@pytest.mark.parametrize("entry", WITH_PARAMETERS)
@pytest.mark.parametrize("param_grads", ["auto", "autograd"])
def test_a_gradient_penalty_through_a_replay_is_a_dualgraph_error_naming_it_with_nothing_changed(
    entry: str, param_grads: str
) -> None:
    # torch's own node (DelayedError) raised a bare RuntimeError, which a caller catching
    # DualgraphError (as for every other refusal) let through
    module = Decays()
    graphed = graphed_on(entry, module, param_grads=param_grads)
    x = batch(call_length(entry))
    y = graphed(x)
    (grad,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(
        DualgraphError, match=r"^Decays(\[[^:]*\])?: trying to differentiate twice.*restore"
    ):
        (y.sum() + grad.square().sum()).backward()
    assert x.grad is None and all(p.grad is None for p in module.parameters())


# -- incoming grads laid out otherwise, and a backward on another thread -------------------------


def _incoming_grad(kind: str, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """An incoming grad for an output of ``shape``, in another dtype or memory layout."""
    rows, columns = shape
    if kind == "float64":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "bfloat16":
        return torch.randn(shape, generator=generator).bfloat16()
    if kind == "transposed":
        return torch.randn(columns, rows, generator=generator).t()
    if kind == "every_other_column":
        return torch.randn(rows, 2 * columns, generator=generator)[:, ::2]
    if kind == "expanded_row":
        return torch.randn(1, columns, generator=generator).expand(shape)
    assert kind == "expanded_scalar"  # stride 0 in every dim
    return torch.randn((), generator=generator).expand(shape)


INCOMING_KINDS = [
    "float64",
    "bfloat16",
    "transposed",
    "every_other_column",
    "expanded_row",
    "expanded_scalar",
]
_HOW = [
    pytest.param(*p.values, how, id=f"{p.id}-{how}", marks=p.marks)
    for p in GRAPH_GRAD_MODES
    for how in ("backward", "autograd_grad")
    if how == "backward" or p.values[1] != "in_graph"  # in_graph refuses autograd.grad
]


@pytest.mark.parametrize("kind", INCOMING_KINDS)
@pytest.mark.parametrize(("backend", "param_grads", "how"), _HOW)
def test_incoming_grads_of_another_dtype_or_layout_give_eagers_grads(
    backend: str, param_grads: str, how: str, kind: str
) -> None:
    # eager's engine casts an incoming grad to the output's dtype and hands the layer its
    # strides (a LayerNorm's backward rounds by them); the replay copies it into its buffer
    device = device_of(backend)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(device)
    twin = copy.deepcopy(model)
    sample = torch.randn(5, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(model, (sample,), backend=backend, param_grads=param_grads)
    results = []
    for module in (model, twin):
        generator = torch.Generator().manual_seed(5)
        got = []
        for _ in range(3):  # fresh inputs, the parameter grads accumulating
            x = torch.randn(5, 4, generator=generator).to(device).requires_grad_()
            incoming = _incoming_grad(kind, (5, 3), generator).to(device)
            out = module(x)
            if how == "backward":
                out.backward(incoming)
                got.append(x.grad)
            else:
                got.extend(torch.autograd.grad(out, [x, *module.parameters()], incoming))
        results.append([*got, *grads_of(parameters_of(module))])
    for i, (ours, eagers) in enumerate(zip(*results, strict=True)):
        assert_tensors_match(ours, eagers, f"grad {i}", tolerance(backend))


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_backward_run_on_another_thread_gives_eagers_grads(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(device)
    twin = copy.deepcopy(model)
    sample = torch.randn(5, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(model, (sample,), backend=backend, param_grads=param_grads)
    results = []
    for module in (model, twin):
        generator = torch.Generator().manual_seed(5)
        got = []
        for _ in range(3):
            x = torch.randn(5, 4, generator=generator).to(device).requires_grad_()
            loss = module(x).square().sum()
            worker = threading.Thread(target=loss.backward)  # as a pipeline's helper might
            worker.start()
            worker.join()
            got.append(x.grad)
        results.append([*got, *grads_of(parameters_of(module))])
    for i, (ours, eagers) in enumerate(zip(*results, strict=True)):
        assert_tensors_match(ours, eagers, f"grad {i}", tolerance(backend))


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.left(x).tanh(), self.right(x)


def test_in_graph_under_inference_mode_leaves_a_parameter_eager_never_reaches_alone() -> None:
    # the right head's .grad is None only because the loss leaves its output out: eager's
    # backward never reaches it, so it makes no new .grad there (nor anywhere: the left head's
    # are added into in place), and the backward runs as eager's
    module = _TwoHeads()
    twin = copy.deepcopy(module)
    sample = torch.randn(5, 4, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend="emulate", param_grads="in_graph")
    for call in (module, twin):
        generator = torch.Generator().manual_seed(2)
        for inference in (False, True):
            x = torch.randn(5, 4, generator=generator, requires_grad=True)
            loss = call(x)[0].square().sum()
            with torch.inference_mode(inference):
                loss.backward()
    assert _inference_flags(module) == _inference_flags(twin) == [False, False, None, None]
    for ours, eagers in zip(module.parameters(), twin.parameters(), strict=True):
        assert (ours.grad is None and eagers.grad is None) or torch.equal(ours.grad, eagers.grad)


@pytest.mark.parametrize("param_grads", ["auto", "in_graph"])
def test_a_plain_backward_compares_the_parameters_in_one_chain_of_tests(
    monkeypatch: pytest.MonkeyPatch, param_grads: str
) -> None:
    # The usual backward (no hook, every .grad its accumulator) answers its per-parameter
    # comparisons with the chains made at construction (_chains.py), without a pass of
    # attrgetters; a hook put on later still takes the passes, and is run or refused as before.
    from dualgraph.torch import _replay

    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    dgt.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), backend="emulate", param_grads=param_grads
    )
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    passes = []
    flags, grad = _replay._in_graph_flags, _replay._grad
    monkeypatch.setattr(_replay, "_in_graph_flags", lambda p: passes.append("flags") or flags(p))
    monkeypatch.setattr(_replay, "_grad", lambda p: passes.append("grad") or grad(p))
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert passes == []
    hooked = []
    module[0].weight.register_hook(lambda g: hooked.append(g) or g)
    loss = module(torch.randn(2, 4, requires_grad=True)).sum()
    if param_grads == "in_graph":
        with pytest.raises(DualgraphError, match="has a grad hook"):
            loss.backward()
    else:
        loss.backward()
        assert len(hooked) == 1
    assert "flags" in passes


def test_the_backward_chains_hold_no_reference_to_an_accumulator() -> None:
    # The backward counts each accumulator's references to tell an old .grad still held: a
    # chain holding one would count among them.
    module = nn.Linear(4, 4)
    dgt.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), backend="emulate", param_grads="in_graph"
    )
    runner = runner_of(module)
    held = [cell.cell_contents for cell in runner._sums_in_place.__closure__]
    accumulators = runner._in_graph_accumulators
    assert accumulators and not any(value is a for value in held for a in accumulators)
