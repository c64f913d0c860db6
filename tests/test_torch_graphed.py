"""``dualgraph.torch.make_graphed_callables``: the API, and graphed vs eager on every example.

Each behaviour is checked on the backends it applies to: ``emulate`` (static buffers, no graph)
and ``eager`` on the CPU, ``cuda`` (real graphs) on a GPU. The graphed callable and an eager twin
with the same weights see the same fresh random inputs; on the CPU their outputs, gradients and
trained parameters must be identical bit for bit, on the GPU within ``TOLERANCES`` (TF32 off).

CUDA tests keep no autograd graph alive across a capture (FIELD-NOTES): losses are built and
consumed inside helpers, and a failed capture's exception is dropped before the next one.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_cases import (
    CASES,
    CUDA,
    TOLERANCES,
    GatedOutput,
    Summary,
    TinyMLP,
    assert_grads_match,
    assert_tensors_match,
    assert_trees_match,
    backward_of,
    cuda_hygiene,
    device_of,
    fresh_copy,
    grads_of,
    isclose_fraction,
    parameter_names,
    parameters_of,
    tensors_of,
)

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError, SpecMismatchError
from dualgraph.models.torch_vit import VisionEncoder, ViTBlock

BACKENDS = ["emulate", "eager", pytest.param(CUDA, marks=pytest.mark.cuda)]
#: The backends with static buffers: outputs alias them, capture can fail, grads go through them.
GRAPH_BACKENDS = ["emulate", pytest.param(CUDA, marks=pytest.mark.cuda)]
#: ``(backend, param_grads)``: parameter grads returned through autograd, or added into static
#: ``.grad`` buffers inside the backward graph (the eager backend has no graph to add them in).
GRAD_MODES = [
    pytest.param("emulate", "autograd", id="emulate"),
    pytest.param("emulate", "in_graph", id="emulate-in_graph"),
    pytest.param("eager", "autograd", id="eager"),
    pytest.param(CUDA, "autograd", marks=pytest.mark.cuda, id="cuda"),
    pytest.param(CUDA, "in_graph", marks=pytest.mark.cuda, id="cuda-in_graph"),
]
GRAPH_GRAD_MODES = [p for p in GRAD_MODES if p.values[0] != "eager"]


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    torch.manual_seed(0)
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    with cuda_hygiene():
        yield


def tolerance(backend: str, dtype: torch.dtype = torch.float32) -> tuple[float, float] | None:
    """``None`` (bit for bit) on the CPU; the dtype's tolerance on the GPU."""
    return TOLERANCES[dtype] if backend == CUDA else None


def runner_of(graphed: Any) -> Any:
    """The GraphedCallable (or EagerCallable) behind a graphed module or function."""
    return graphed.forward.__dualgraph__ if isinstance(graphed, nn.Module) else graphed


def capture_error(fn: Any, args: tuple[Any, ...], **options: Any) -> str:
    """The message of the CaptureError that graphing ``fn`` raises; nothing of it is kept alive."""
    try:
        dgt.make_graphed_callables(fn, args, **options)
    except CaptureError as error:
        return str(error)
    raise AssertionError(f"graphing {fn!r} raised no CaptureError")


def step_grads(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> list[Any]:
    """Forward, backward of ``loss_of``, and the parameters' grads; no graph outlives the call."""
    backward_of(fn(*args, **(kwargs or {})))
    grads = grads_of(parameters_of(fn))
    fn.zero_grad(set_to_none=True)
    return grads


# -- the API -------------------------------------------------------------------------------------


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(DualgraphError, match="backend must be one of"):
        dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),), backend="xla")  # type: ignore[arg-type]


def test_unknown_param_grads_mode_is_rejected() -> None:
    with pytest.raises(DualgraphError, match="param_grads must be 'autograd' or 'in_graph'"):
        dgt.make_graphed_callables(
            TinyMLP(),
            (torch.randn(4, 8),),
            backend="emulate",
            param_grads="fused",  # type: ignore[arg-type]
        )


def test_unknown_capture_error_mode_is_rejected() -> None:
    with pytest.raises(DualgraphError, match="capture_error_mode must be one of"):
        dgt.make_graphed_callables(
            TinyMLP(),
            (torch.randn(4, 8),),
            backend="emulate",
            capture_error_mode="strict",  # type: ignore[arg-type]
        )


def test_auto_backend_is_eager_for_cpu_samples() -> None:
    graphed = dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),))
    assert dgt.diagnostics(graphed).backend == "eager"


@pytest.mark.cuda
def test_auto_backend_is_cuda_for_cuda_samples() -> None:
    module = TinyMLP().cuda()
    graphed = dgt.make_graphed_callables(module, (torch.randn(4, 8, device="cuda"),))
    assert dgt.diagnostics(graphed).backend == "cuda"


def test_cuda_backend_needs_cuda_samples() -> None:
    with pytest.raises(DualgraphError, match="backend='cuda' needs"):
        dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),), backend="cuda")


def test_sample_args_need_one_tuple_per_callable() -> None:
    modules = (TinyMLP(), TinyMLP())
    with pytest.raises(DualgraphError, match="one tuple of args per callable"):
        dgt.make_graphed_callables(modules, ((torch.randn(4, 8),),), backend="emulate")
    with pytest.raises(DualgraphError, match="sample args must be a tuple"):
        dgt.make_graphed_callables(TinyMLP(), [torch.randn(4, 8)], backend="emulate")


def test_sample_tensors_must_be_torch_tensors() -> None:
    with pytest.raises(DualgraphError, match=r"args\[0\]: .* must be torch tensors"):
        dgt.make_graphed_callables(lambda x: x, (np.zeros(3, np.float32),), backend="emulate")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_comes_back_with_its_forward_replaced(backend: str) -> None:
    module = TinyMLP().to(device_of(backend))
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device=device_of(backend)),), backend=backend
    )
    assert graphed is module
    assert "forward" in module.__dict__
    assert dgt.diagnostics(module).backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_function_comes_back_as_a_graphed_callable(backend: str) -> None:
    graphed = dgt.make_graphed_callables(
        torch.sin, (torch.randn(3, device=device_of(backend)),), backend=backend
    )
    kind = dgt.EagerCallable if backend == "eager" else dgt.GraphedCallable
    assert isinstance(graphed, kind)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tuple_of_callables_comes_back_as_a_tuple(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    graphed = dgt.make_graphed_callables(
        (module, torch.tanh),
        ((torch.randn(4, 8, device=device),), (torch.randn(4, 8, device=device),)),
        backend=backend,
    )
    assert isinstance(graphed, tuple) and len(graphed) == 2
    assert graphed[0] is module
    x = torch.randn(4, 8, device=device)
    assert_tensors_match(graphed[1](x), torch.tanh(x), "tanh", tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphing_a_graphed_module_again_is_rejected(backend: str) -> None:
    module = TinyMLP().to(device_of(backend))
    sample = (torch.randn(4, 8, device=device_of(backend)),)
    dgt.make_graphed_callables(module, sample, backend=backend)
    with pytest.raises(DualgraphError, match=r"already graphed; call dualgraph\.torch\.restore"):
        dgt.make_graphed_callables(module, sample, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_gives_the_module_its_forward_back(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    assert dgt.restore(module) is module
    assert "forward" not in module.__dict__
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(module)
    with torch.no_grad():
        assert module(torch.randn(7, 8, device=device)).shape == (7, 8)  # eager: any batch size
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    assert dgt.diagnostics(module).backend == backend


def test_restore_rejects_a_module_that_is_not_graphed() -> None:
    with pytest.raises(DualgraphError, match="TinyMLP is not a graphed module"):
        dgt.restore(TinyMLP())


def test_diagnostics_reject_a_plain_callable() -> None:
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(TinyMLP())


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_runs_eagerly_when_its_training_mode_differs_from_capture(backend: str) -> None:
    device = device_of(backend)
    module = ViTBlock(dim=16, heads=2, dropout=0.5).to(device)
    twin = ViTBlock(dim=16, heads=2, dropout=0.5).to(device)
    twin.load_state_dict(module.state_dict())
    dgt.make_graphed_callables(module, (torch.randn(2, 5, 16, device=device),), backend=backend)
    replays = dgt.diagnostics(module).replays

    module.eval()
    twin.eval()
    x = torch.randn(2, 5, 16, device=device)
    hidden, extra = module(x)
    expected, _ = twin(x)
    assert extra is None
    assert_tensors_match(hidden.detach(), expected.detach(), "hidden", tolerance(backend))
    assert dgt.diagnostics(module).replays == replays  # the original forward ran, not a replay
    if backend != "eager":
        static = {t.data_ptr() for t in runner_of(module).static_outputs}
        assert hidden.data_ptr() not in static

    module.train()
    with torch.no_grad():
        module(x)
    assert dgt.diagnostics(module).replays == replays + 1


# -- outputs and gradients match eager -----------------------------------------------------------


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_and_grads_match_eager(name: str, backend: str, param_grads: str) -> None:
    case = CASES[name]
    device = device_of(backend)
    fn, twin = case.make(device)
    sample_args, sample_kwargs = case.draw(device)
    graphed = dgt.make_graphed_callables(
        fn, sample_args, sample_kwargs=sample_kwargs, backend=backend, param_grads=param_grads
    )
    names = parameter_names(fn)
    for _ in range(3):
        args, kwargs = case.draw(device)
        eager_args, eager_kwargs = fresh_copy((args, kwargs))
        outputs = graphed(*args, **kwargs)
        expected = twin(*eager_args, **eager_kwargs)
        assert_trees_match(outputs, expected, tolerance(backend))
        if not case.differentiable:
            continue
        backward_of(outputs)
        backward_of(expected)
        inputs = [t for t in tensors_of((args, kwargs)) if t.requires_grad]
        eager_inputs = [t for t in tensors_of((eager_args, eager_kwargs)) if t.requires_grad]
        input_names = [f"input {i}" for i in range(len(inputs))]
        assert_grads_match(
            grads_of(inputs), grads_of(eager_inputs), input_names, tolerance(backend)
        )
        assert_grads_match(
            grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), names, tolerance(backend)
        )
        for module in {id(m): m for m in (fn, twin) if isinstance(m, nn.Module)}.values():
            module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_leaves_and_constants_survive_replay(backend: str) -> None:
    case = CASES["every_leaf"]
    fn, _ = case.make(device_of(backend))
    args, kwargs = case.draw(device_of(backend))
    dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    for _ in range(2):
        args, kwargs = case.draw(device_of(backend))
        _, none, extras, _, summary, gated = fn(*args, **kwargs)
        assert none is None and extras["mask"] is None
        assert summary.note is None and gated.attention is None
        constants = [extras[key] for key in ("scale", "count", "name", "on")]
        assert constants == [0.5, 3, "every", True]
        assert [type(c) for c in constants] == [float, int, str, bool]


@pytest.mark.parametrize("backend", BACKENDS)
def test_container_types_are_preserved(backend: str) -> None:
    case = CASES["every_leaf"]
    fn, _ = case.make(device_of(backend))
    args, kwargs = case.draw(device_of(backend))
    dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    outputs = fn(*args, **kwargs)
    assert type(outputs) is tuple
    assert type(outputs[2]) is dict
    assert list(outputs[2]) == ["scale", "aux", "mask", "count", "name", "on"]  # not sorted
    assert type(outputs[3]) is list
    assert type(outputs[4]) is Summary
    assert type(outputs[5]) is GatedOutput


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_bool_and_detached_outputs_need_no_grad(backend: str) -> None:
    case = CASES["every_leaf"]
    fn, _ = case.make(device_of(backend))
    args, kwargs = case.draw(device_of(backend))
    dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    outputs = fn(*args, **kwargs)
    indices, positive, detached = outputs[3]
    assert (indices.dtype, positive.dtype) == (torch.int64, torch.bool)
    assert not (indices.requires_grad or positive.requires_grad or detached.requires_grad)
    assert outputs[0].requires_grad and outputs[2]["aux"].requires_grad
    assert runner_of(fn).spec.grad_mask == tuple(t.requires_grad for t in tensors_of(outputs))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_backward_runs_only_over_differentiable_outputs(backend: str) -> None:
    case = CASES["every_leaf"]
    fn, _ = case.make(device_of(backend))
    args, kwargs = case.draw(device_of(backend))
    dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    runner = runner_of(fn)
    mask = runner.spec.grad_mask
    assert mask.count(True) == 4 and mask.count(False) == 3
    assert len(runner.static_grad_outputs) == mask.count(True)
    assert [t.shape for t in runner.static_grad_outputs] == [
        t.shape for t, grad in zip(runner.static_outputs, mask, strict=True) if grad
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backward_graph_when_nothing_is_differentiable(backend: str) -> None:
    device = device_of(backend)
    x = torch.randn(3, 5, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(CASES["frozen_function"].build(), (x,), backend=backend)
    assert not dgt.diagnostics(graphed).has_backward_graph
    if backend != "eager":
        assert runner_of(graphed).static_grad_outputs == []
    for _ in range(2):
        x = torch.randn(3, 5, device=device, requires_grad=True)
        indices, exp, none = graphed(x)
        assert none is None
        assert not (indices.requires_grad or exp.requires_grad)
        assert_tensors_match(indices, x.argmax(dim=-1), "indices")
        assert_tensors_match(exp, x.detach().exp(), "exp", tolerance(backend))


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_grads_reach_tensor_args_kwargs_and_parameters(backend: str, param_grads: str) -> None:
    case = CASES["every_leaf"]
    fn, twin = case.make(device_of(backend))
    args, kwargs = case.draw(device_of(backend))
    dgt.make_graphed_callables(
        fn, args, sample_kwargs=kwargs, backend=backend, param_grads=param_grads
    )
    args, kwargs = case.draw(device_of(backend))
    eager_args, eager_kwargs = fresh_copy((args, kwargs))
    backward_of(fn(*args, **kwargs))
    backward_of(twin(*eager_args, **eager_kwargs))
    x, shift = args[0], kwargs["shift"]
    assert x.grad is not None and shift.grad is not None
    assert args[1]["gate"].grad is None  # captured without requires_grad
    assert all(p.grad is not None for p in fn.parameters())
    tol = tolerance(backend)
    assert_tensors_match(x.grad, eager_args[0].grad, "args[0]", tol)
    assert_tensors_match(shift.grad, eager_kwargs["shift"].grad, "kwargs['shift']", tol)
    assert_grads_match(
        grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), parameter_names(fn), tol
    )


def _scale_first(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    return x * 2


class HalfUsed(nn.Module):
    """A module with a parameter its forward never touches."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_unused_input_is_a_capture_error_without_allow_unused_input(backend: str) -> None:
    device = device_of(backend)
    x, y = (torch.randn(3, device=device, requires_grad=True) for _ in range(2))
    message = capture_error(_scale_first, (x, y), backend=backend)
    assert message.startswith(f"capturing _scale_first ({backend}) failed during warmup: ")
    assert "not have been used in the graph" in message
    message = capture_error(
        HalfUsed().to(device), (torch.randn(2, 4, device=device),), backend=backend
    )
    assert "not have been used in the graph" in message


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_unused_input_gets_no_grad_with_allow_unused_input(backend: str, param_grads: str) -> None:
    device = device_of(backend)
    x, y = (torch.randn(3, device=device, requires_grad=True) for _ in range(2))
    graphed = dgt.make_graphed_callables(
        _scale_first, (x, y), backend=backend, param_grads=param_grads, allow_unused_input=True
    )
    x, y = (torch.randn(3, device=device, requires_grad=True) for _ in range(2))
    graphed(x, y).sum().backward()
    assert y.grad is None
    assert_tensors_match(x.grad, torch.full_like(x, 2.0), "args[0]")

    module = HalfUsed().to(device)
    dgt.make_graphed_callables(
        module,
        (torch.randn(2, 4, device=device),),
        backend=backend,
        param_grads=param_grads,
        allow_unused_input=True,
    )
    module(torch.randn(2, 4, device=device)).sum().backward()
    assert module.unused.weight.grad is None and module.unused.bias.grad is None
    assert module.used.weight.grad is not None


# -- gradient accumulation and training ----------------------------------------------------------


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_gradient_accumulation_over_replays_matches_eager(
    backend: str, param_grads: str, set_to_none: bool
) -> None:
    case = CASES["vit_block"]
    device = device_of(backend)
    fn, twin = case.make(device)
    args, _ = case.draw(device)
    dgt.make_graphed_callables(fn, args, backend=backend, param_grads=param_grads)
    for _ in range(2):  # the second round accumulates into zeroed (or new) .grad tensors
        for _ in range(3):
            (x,), _ = case.draw(device)
            backward_of(fn(x))
            backward_of(twin(x.detach().clone()))
        assert_grads_match(
            grads_of(parameters_of(fn)),
            grads_of(parameters_of(twin)),
            parameter_names(fn),
            tolerance(backend),
        )
        fn.zero_grad(set_to_none=set_to_none)
        twin.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_training_steps_match_eager(backend: str, param_grads: str, optimizer: str) -> None:
    case = CASES["mlp"]
    device = device_of(backend)
    fn, twin = case.make(device)
    args, _ = case.draw(device)
    dgt.make_graphed_callables(fn, args, backend=backend, param_grads=param_grads)
    make_optimizer = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    }[optimizer]
    optimizers = [make_optimizer(m.parameters()) for m in (fn, twin)]
    for _ in range(4):
        (x,), _ = case.draw(device)
        for module, opt in zip((fn, twin), optimizers, strict=True):
            opt.zero_grad(set_to_none=True)
            for _ in range(2):  # two micro-batches per step
                backward_of(module(x))
            opt.step()
        for (name, p), q in zip(fn.named_parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.detach(), q.detach(), name, tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_param_grads_keep_the_grad_contract(backend: str) -> None:
    """``.grad`` becomes the static buffer; ``None`` restarts from zero; a user's value is kept."""
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    dgt.make_graphed_callables(
        layer, (torch.randn(2, 4, device=device),), backend=backend, param_grads="in_graph"
    )
    buffers = runner_of(layer).param_grad_buffers
    tol = tolerance(backend)

    def both(step: Any) -> None:
        x = torch.randn(2, 4, device=device)
        for module in (layer, twin):
            step(module)
            backward_of(module(x))
        assert layer.weight.grad is buffers[0] and layer.bias.grad is buffers[1]
        assert_grads_match(
            grads_of(parameters_of(layer)), grads_of(parameters_of(twin)), ["weight", "bias"], tol
        )

    both(lambda m: None)
    both(lambda m: None)  # accumulates
    both(lambda m: m.zero_grad(set_to_none=True))
    both(lambda m: m.zero_grad(set_to_none=False))
    both(lambda m: setattr(m.weight, "grad", torch.ones_like(m.weight)))  # replaced by the user


def _encoder_loss(outputs: dict[str, Any]) -> torch.Tensor:
    assert outputs["aux_loss"] is None
    return outputs["hidden"].square().mean() + outputs["pooled"].sin().sum()


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_vit_encoder_graphed_per_block_trains_like_eager(backend: str, param_grads: str) -> None:
    """The seed scenario: blocks returning ``(hidden, None)`` graphed in one call, one pool."""
    device = device_of(backend)
    # Dropout's draws only match eager where the same generator calls happen (not in a CUDA graph).
    dropout = 0.0 if backend == CUDA else 0.1
    options = {"image_size": 16, "patch_size": 8, "dim": 16, "depth": 3, "heads": 2}
    encoder = VisionEncoder(**options, dropout=dropout).to(device)
    twin = VisionEncoder(**options, dropout=dropout).to(device)
    twin.load_state_dict(encoder.state_dict())
    samples = tuple(
        (torch.randn(2, 4, 16, device=device, requires_grad=True),) for _ in encoder.blocks
    )
    blocks = dgt.make_graphed_callables(
        tuple(encoder.blocks), samples, backend=backend, param_grads=param_grads
    )
    assert all(a is b for a, b in zip(blocks, encoder.blocks, strict=True))
    if backend == CUDA:
        pools = {dgt.diagnostics(block).pool_bytes for block in blocks}
        assert len(pools) == 1 and pools.pop() > 0
    # On a GPU, Adam would turn rounding noise in grads that are zero in exact math (the key
    # bias's: softmax ignores a shift shared by a row) into steps of size lr; SGD does not.
    if backend == CUDA:
        optimizers = [
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (encoder, twin)
        ]
    else:
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (encoder, twin)]
    for step in range(3):
        images = torch.randn(2, 3, 16, 16, device=device)
        outputs = []
        for model, opt in zip((encoder, twin), optimizers, strict=True):
            torch.manual_seed(step)
            out = model(images)
            _encoder_loss(out).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            outputs.append({key: owned_detached(value) for key, value in out.items()})
            del out
        assert_trees_match(outputs[0], outputs[1], tolerance(backend))
        for (name, p), q in zip(encoder.named_parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.detach(), q.detach(), name, tolerance(backend))


def owned_detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


# -- RNG -----------------------------------------------------------------------------------------


def _dropped(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, 0.5, training=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_draws_fresh_masks_on_every_replay(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        _dropped, (torch.ones(64, 64, device=device, requires_grad=True),), backend=backend
    )
    masks = []
    for _ in range(3):
        x = torch.ones(64, 64, device=device, requires_grad=True)
        out = graphed(x)
        kept = out.detach() != 0
        out.sum().backward()
        assert torch.equal(x.grad != 0, kept)  # the backward replay used its forward's mask
        assert isclose_fraction(kept.float().mean().item(), 0.5)
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_dropout_matches_eager_under_the_same_seed(backend: str) -> None:
    block = ViTBlock(dim=16, heads=2, dropout=0.25)
    twin = ViTBlock(dim=16, heads=2, dropout=0.25)
    twin.load_state_dict(block.state_dict())
    dgt.make_graphed_callables(block, (torch.randn(2, 5, 16, requires_grad=True),), backend=backend)
    for seed in range(3):
        x = torch.randn(2, 5, 16)
        torch.manual_seed(seed)
        hidden, _ = block(x)
        torch.manual_seed(seed)
        expected, _ = twin(x)
        assert_tensors_match(hidden.detach(), expected.detach(), "hidden")
        backward_of(hidden)
        backward_of(expected)
        assert_grads_match(
            grads_of(parameters_of(block)), grads_of(parameters_of(twin)), parameter_names(block)
        )
        block.zero_grad()
        twin.zero_grad()


# -- autocast ------------------------------------------------------------------------------------


def _autocast(backend: str, **options: Any) -> torch.autocast:
    return torch.autocast(device_of(backend).type, dtype=torch.bfloat16, **options)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_autocast_capture_needs_the_cache_disabled(backend: str) -> None:
    module = TinyMLP().to(device_of(backend))
    with _autocast(backend), pytest.raises(CaptureError, match=r"cache_enabled=False"):
        dgt.make_graphed_callables(
            module, (torch.randn(4, 8, device=device_of(backend)),), backend=backend
        )
    assert "forward" not in module.__dict__


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_autocast_capture_matches_eager_autocast(backend: str) -> None:
    case = CASES["mlp"]
    device = device_of(backend)
    fn, twin = case.make(device)
    args, _ = case.draw(device)
    tol = tolerance(backend, torch.bfloat16)
    with _autocast(backend, cache_enabled=False):
        dgt.make_graphed_callables(fn, args, backend=backend)
        for _ in range(3):
            (x,), _ = case.draw(device)
            out, expected = fn(x), twin(x)
            assert out.dtype == torch.bfloat16
            assert_trees_match(out, expected, tol)
            backward_of(out)
            backward_of(expected)
            assert_grads_match(
                grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), parameter_names(fn), tol
            )
            fn.zero_grad()
            twin.zero_grad()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_calls_outside_the_captured_autocast_state_are_rejected(backend: str) -> None:
    device = device_of(backend)
    under_autocast = TinyMLP().to(device)
    plain = TinyMLP().to(device)
    with _autocast(backend, cache_enabled=False):
        dgt.make_graphed_callables(
            under_autocast, (torch.randn(4, 8, device=device),), backend=backend
        )
    dgt.make_graphed_callables(plain, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    with pytest.raises(DualgraphError, match="called with autocast state"):
        under_autocast(x)
    with _autocast(backend, cache_enabled=False), pytest.raises(DualgraphError, match="autocast"):
        plain(x)


# -- validation of every call --------------------------------------------------------------------


def _bad_calls(device: torch.device) -> dict[str, tuple[Any, str]]:
    """Per name: a change to valid ``(args, kwargs)`` of ``gated``, and the message it must give."""
    on = f"on {device}"

    def nested(**changes: Any) -> Any:
        return lambda args, kwargs: ((args[0], {**args[1], **changes}), kwargs)

    def kwarg(**changes: Any) -> Any:
        return lambda args, kwargs: (args, {**kwargs, **changes})

    return {
        "shape": (
            lambda args, kwargs: ((torch.randn(3, 8, device=device), args[1]), kwargs),
            f"args[0]: expected float32[2, 8] {on}, got float32[3, 8] {on}",
        ),
        "dtype": (
            lambda args, kwargs: ((args[0].double(), args[1]), kwargs),
            f"args[0]: expected float32[2, 8] {on}, got float64[2, 8] {on}",
        ),
        "nested_shape": (
            nested(mask=torch.rand(2, 9, device=device)),
            f"args[1]['mask']: expected float32[2, 8] {on}, got float32[2, 9] {on}",
        ),
        "none_for_a_tensor": (
            nested(mask=None),
            "args[1]['mask']: expected float32[2, 8], got None",
        ),
        "missing_key": (
            lambda args, kwargs: ((args[0], {"bias": args[1]["bias"]}), kwargs),
            "args[1]['mask']: missing (expected float32[2, 8])",
        ),
        "list_for_a_dict": (
            lambda args, kwargs: ((args[0], list(args[1].values())), kwargs),
            "args[1]: expected a dict with keys ['mask', 'bias'], got a list of length 2",
        ),
        "too_few_args": (
            lambda args, kwargs: ((args[0],), kwargs),
            "args: expected a tuple of length 2, got a tuple of length 1",
        ),
        "missing_kwarg": (
            lambda args, kwargs: (args, {"scale": kwargs["scale"]}),
            "kwargs['mask']: missing (expected float32[2, 8])",
        ),
        "unexpected_kwarg": (kwarg(extra=1), "kwargs['extra']: unexpected entry int 1"),
        "changed_constant_kwarg": (
            kwarg(scale=3.0),
            "kwargs['scale']: expected float 2.0, got float 3.0",
        ),
        "kwarg_shape": (
            kwarg(mask=torch.rand(2, 7, device=device)),
            f"kwargs['mask']: expected float32[2, 8] {on}, got float32[2, 7] {on}",
        ),
        "requires_grad_not_captured": (
            nested(mask=torch.rand(2, 8, device=device, requires_grad=True)),
            "args[1]['mask']: requires grad, but was captured without requires_grad, so no "
            "gradient would reach it; pass a sample that requires grad when capturing",
        ),
    }


BAD_CALLS = sorted(_bad_calls(torch.device("cpu")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD_CALLS)
def test_rejected_call_names_the_path(backend: str, bad: str) -> None:
    case = CASES["gated_function"]
    device = device_of(backend)
    args, kwargs = case.draw(device)
    graphed = dgt.make_graphed_callables(case.build(), args, sample_kwargs=kwargs, backend=backend)
    change, message = _bad_calls(device)[bad]
    bad_args, bad_kwargs = change(*case.draw(device))
    with pytest.raises(SpecMismatchError) as info:
        graphed(*bad_args, **bad_kwargs)
    assert str(info.value) == message
    assert info.value.path == message.partition(":")[0]


@pytest.mark.cuda
def test_rejected_call_names_the_wrong_device() -> None:
    case = CASES["gated_function"]
    args, kwargs = case.draw(torch.device("cuda"))
    graphed = dgt.make_graphed_callables(case.build(), args, sample_kwargs=kwargs, backend=CUDA)
    with pytest.raises(SpecMismatchError) as info:
        graphed(args[0].detach().cpu(), args[1], **kwargs)
    device = args[0].device
    assert (
        str(info.value) == f"args[0]: expected float32[2, 8] on {device}, got float32[2, 8] on cpu"
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("bad", BAD_CALLS)
def test_rejected_call_leaves_static_inputs_unchanged(backend: str, bad: str) -> None:
    case = CASES["gated_function"]
    device = device_of(backend)
    args, kwargs = case.draw(device)
    graphed = dgt.make_graphed_callables(case.build(), args, sample_kwargs=kwargs, backend=backend)
    before = [t.detach().clone() for t in graphed.static_inputs]
    change, message = _bad_calls(device)[bad]
    bad_args, bad_kwargs = change(*case.draw(device))  # the valid leaves hold new values
    with pytest.raises(SpecMismatchError) as info:
        graphed(*bad_args, **bad_kwargs)
    assert str(info.value) == message
    for i, (static, saved) in enumerate(zip(graphed.static_inputs, before, strict=True)):
        assert_tensors_match(static.detach(), saved, f"static input {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_call_after_a_rejected_call_is_correct(backend: str) -> None:
    case = CASES["gated_function"]
    device = device_of(backend)
    args, kwargs = case.draw(device)
    fn = case.build()
    graphed = dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    for bad in BAD_CALLS:
        change, _ = _bad_calls(device)[bad]
        bad_args, bad_kwargs = change(*case.draw(device))
        with pytest.raises(SpecMismatchError):
            graphed(*bad_args, **bad_kwargs)
        args, kwargs = case.draw(device)
        eager_args, eager_kwargs = fresh_copy((args, kwargs))
        outputs = graphed(*args, **kwargs)
        expected = fn(*eager_args, **eager_kwargs)
        assert_trees_match(outputs, expected, tolerance(backend))
        backward_of(outputs)
        backward_of(expected)
        assert_grads_match(
            grads_of([args[0], args[1]["bias"], kwargs["mask"]]),
            grads_of([eager_args[0], eager_args[1]["bias"], eager_kwargs["mask"]]),
            ["args[0]", "args[1]['bias']", "kwargs['mask']"],
            tolerance(backend),
        )


# -- failed capture ------------------------------------------------------------------------------


class Exploding(nn.Module):
    """Raises from its forward from the ``fail_at``-th call on (``None``: never)."""

    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # some GPU work first, so that a capture is not empty
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ValueError("exploded on purpose")
        return h


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("phase", ["warmup", "capture"])
def test_failed_capture_names_the_callable_and_the_cause(backend: str, phase: str) -> None:
    warmup = 3
    module = Exploding(fail_at=1 if phase == "warmup" else warmup + 1).to(device_of(backend))
    sample = (torch.randn(2, 8, device=device_of(backend)),)
    message = capture_error(module, sample, backend=backend, num_warmup_iters=warmup)
    during = "forward capture" if phase == "capture" and backend == CUDA else phase
    assert message == (
        f"capturing Exploding ({backend}) failed during {during}: ValueError: exploded on purpose"
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_failed_capture_leaves_the_module_usable_and_graphable(backend: str) -> None:
    device = device_of(backend)
    module = Exploding(fail_at=2).to(device)
    twin = Exploding(fail_at=None).to(device)
    twin.load_state_dict(module.state_dict())
    capture_error(module, (torch.randn(2, 8, device=device),), backend=backend)
    gc.collect()
    assert "forward" not in module.__dict__  # not graphed

    module.fail_at = None
    x = torch.randn(2, 8, device=device)
    assert_grads_match(
        step_grads(module, (x,)),
        step_grads(twin, (x,)),
        parameter_names(module),
        tolerance(backend),
    )

    dgt.make_graphed_callables(module, (torch.randn(2, 8, device=device),), backend=backend)
    for _ in range(2):
        x = torch.randn(2, 8, device=device)
        assert_tensors_match(module(x).detach(), twin(x).detach(), "output", tolerance(backend))


class SyncsAfterDropout(nn.Module):
    """Draws a dropout mask, then reads a value back to the CPU: fine eagerly, not in a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc(x), 0.25, self.training)
        if self.sync and h.sum().item() > 1e30:  # never true; .item() is the point
            h = h * 0
        return h


class CudaMallocWorker:
    """Another thread that keeps calling cudaMalloc (fresh sizes, cache emptied between)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        step = 0
        while not self.stop.is_set():
            try:  # 1 to 64 MiB, so memory stays bounded while a capture defers empty_cache
                torch.empty((1 + step % 64) << 18, device="cuda")
                torch.cuda.empty_cache()
            except Exception:  # refused during a global-mode capture: the point of the worker
                pass
            step += 1
            self.started.set()

    def __enter__(self) -> CudaMallocWorker:
        self.thread.start()
        assert self.started.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.mark.cuda
def test_capture_error_mode_decides_whether_another_threads_cuda_malloc_breaks_capture() -> None:
    torch.manual_seed(0)
    module = TinyMLP().cuda()
    eager = TinyMLP().cuda()
    eager.load_state_dict(module.state_dict())
    sample = torch.randn(4, 8, device="cuda", requires_grad=True)
    with CudaMallocWorker():
        message = capture_error(module, (sample,), backend=CUDA)  # the default, "global"
        assert "forward" not in module.__dict__  # the failed capture left the module as it was
        dgt.make_graphed_callables(
            module, (sample,), backend=CUDA, capture_error_mode="thread_local"
        )
    assert message.startswith("capturing TinyMLP (cuda) failed during ")
    for _ in range(3):  # fresh inputs; parameter grads accumulate over the replays
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, out_eager = module(x), eager(x_eager)
        torch.testing.assert_close(out, out_eager)
        out.square().sum().backward()
        out_eager.square().sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    torch.testing.assert_close(grads_of(parameters_of(module)), grads_of(parameters_of(eager)))


@pytest.mark.cuda
def test_cpu_sync_in_capture_fails_cleanly_and_cuda_keeps_working() -> None:
    module = SyncsAfterDropout().cuda()
    stream = torch.cuda.current_stream()
    message = capture_error(module, (torch.ones(16, 32, device="cuda"),), backend=CUDA)
    gc.collect()
    assert message.startswith("capturing SyncsAfterDropout (cuda) failed during forward capture: ")
    assert "forward" not in module.__dict__
    assert torch.cuda.current_stream() == stream  # not torch's capture stream

    # The capture drew from the CUDA generator before it failed: the generator must still work.
    assert torch.randn(1000, device="cuda").std().item() > 0.5
    kept = F.dropout(torch.ones(1000, device="cuda"), 0.5).ne(0).float().mean().item()
    assert isclose_fraction(kept, 0.5)
    step_grads(module, (torch.randn(16, 32, device="cuda"),))  # eager, .item() included
    torch.cuda.synchronize()

    module.sync = False
    sample = torch.ones(16, 32, device="cuda", requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=CUDA)
    masks = []
    for _ in range(2):
        x = torch.ones(16, 32, device="cuda", requires_grad=True)
        out = module(x)
        out.sum().backward()
        kept = out.detach() != 0
        assert isclose_fraction(kept.float().mean().item(), 0.75)
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.cuda
def test_cuda_capture_holds_automatic_garbage_collection_and_gives_it_back() -> None:
    # The collector may destroy an unreachable graph during another capture (pytorch PR 161037).
    seen: list[bool] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return x * 2

    assert gc.isenabled()
    sample = torch.ones(4, device="cuda", requires_grad=True)
    graphed = dgt.make_graphed_callables(double, (sample,), backend=CUDA, num_warmup_iters=1)
    assert seen == [False, False]  # one warmup, one capture
    assert gc.isenabled()
    torch.testing.assert_close(
        graphed(torch.full((4,), 3.0, device="cuda")), torch.full((4,), 6.0, device="cuda")
    )

    def fails(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    assert "boom" in capture_error(fails, (sample,), backend=CUDA)
    assert gc.isenabled()


# -- outputs alias static buffers ----------------------------------------------------------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_alias_static_buffers_the_next_replay_overwrites(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    first = module(torch.randn(4, 8, device=device))
    first_values = first.detach().clone()
    second = module(torch.randn(4, 8, device=device))
    assert first.data_ptr() == second.data_ptr()
    assert torch.equal(first, second)
    assert not torch.equal(first.detach(), first_values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_clone_outputs_gives_owned_outputs(backend: str) -> None:
    device = device_of(backend)
    fn, twin = CASES["mlp"].make(device)
    dgt.make_graphed_callables(
        fn, (torch.randn(4, 8, device=device),), backend=backend, clone_outputs=True
    )
    xs = [torch.randn(4, 8, device=device) for _ in range(2)]
    first = fn(xs[0])
    backward_of(first)  # before the next forward: it needs this replay's activations
    second = fn(xs[1])
    assert first.data_ptr() != second.data_ptr()
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


# -- backward order ------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_backward_of_an_earlier_replay_after_a_later_forward_is_an_error(
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
    with pytest.raises(DualgraphError, match="backward of an earlier replay after a later forward"):
        first.sum().backward()
    assert all(p.grad is None for p in fn.parameters())  # no silent wrong grads
    second.sum().backward()  # the latest replay's backward is still right
    twin(xs[1]).sum().backward()
    assert_grads_match(
        grads_of(parameters_of(fn)),
        grads_of(parameters_of(twin)),
        parameter_names(fn),
        tolerance(backend),
    )


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
    assert report.static_grad_bytes == (2 * 3 + 2 * 4 + 3 * 4 + 3) * 4  # dy, dx, dW, db
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


@pytest.mark.cuda
def test_a_pool_handle_can_be_shared_by_separate_calls_that_run_in_capture_order() -> None:
    # Separate calls share a pool safely when each callable's forward and backward replay in
    # the order they were captured (a tuple in one call lifts that: forwards, then backwards).
    pool = torch.cuda.graph_pool_handle()
    pairs = [CASES["mlp"].make(torch.device("cuda")) for _ in range(2)]
    for fn, _ in pairs:
        dgt.make_graphed_callables(fn, (torch.randn(4, 8, device="cuda"),), backend=CUDA, pool=pool)
    for _ in range(3):
        for fn, twin in pairs:
            x = torch.randn(4, 8, device="cuda")
            tol = TOLERANCES[torch.float32]
            assert_tensors_match(fn(x).detach(), twin(x).detach(), "output", tol)
            assert_grads_match(
                step_grads(fn, (x,)), step_grads(twin, (x,)), parameter_names(fn), tol
            )


@pytest.mark.cuda
def test_bfloat16_module_matches_eager() -> None:
    fn, twin = CASES["mlp"].make(torch.device("cuda"))
    fn, twin = fn.to(torch.bfloat16), twin.to(torch.bfloat16)
    dgt.make_graphed_callables(
        fn, (torch.randn(4, 8, device="cuda", dtype=torch.bfloat16),), backend=CUDA
    )
    tol = TOLERANCES[torch.bfloat16]
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
        out, expected = fn(x), twin(x)
        assert_trees_match(out, expected, tol)
        backward_of(out)
        backward_of(expected)
        assert_grads_match(
            grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), parameter_names(fn), tol
        )
        fn.zero_grad()
        twin.zero_grad()


def test_a_non_tensor_array_output_is_refused_naming_its_path() -> None:
    def returns_numpy(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        return x * 2, np.zeros(2, np.float32)

    with pytest.raises(CaptureError) as caught:
        dgt.make_graphed_callables(returns_numpy, (torch.ones(2),), backend="emulate")
    assert "output[1]: expected a torch tensor, got numpy.ndarray" in str(caught.value)
