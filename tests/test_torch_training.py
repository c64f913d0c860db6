"""Graphed vs eager training: outputs, input and parameter grads, accumulation, optimizer steps.

The graphed callable and an eager twin with the same weights see the same fresh random inputs;
on the CPU their outputs, gradients and trained parameters must be identical bit for bit, on the
GPU within ``TOLERANCES`` (TF32 off). Each test runs on ``emulate`` (and ``eager`` where it
applies) on the CPU and on ``cuda`` on a GPU; ``in_graph`` variants accumulate parameter grads
inside the backward graph.

CUDA tests keep no autograd graph alive across a capture (docs/cuda_graphs.md): losses are built and
consumed inside helpers.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_cases import (
    BACKENDS,
    CASES,
    CUDA,
    GRAD_MODES,
    GRAPH_BACKENDS,
    TOLERANCES,
    GatedOutput,
    Summary,
    TinyMLP,
    assert_grads_match,
    assert_tensors_match,
    assert_trees_match,
    backward_of,
    device_of,
    fresh_copy,
    grads_of,
    isclose_fraction,
    isolation,
    loss_of,
    parameter_names,
    parameters_of,
    runner_of,
    tensors_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.models.torch_vit import VisionEncoder, ViTBlock


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def step_grads(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> list[Any]:
    """Forward, backward of ``loss_of``, and the parameters' grads; no graph outlives the call."""
    backward_of(fn(*args, **(kwargs or {})))
    grads = grads_of(parameters_of(fn))
    fn.zero_grad(set_to_none=True)
    return grads


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backward_graph_when_nothing_is_differentiable(backend: str) -> None:
    device = device_of(backend)
    x = torch.randn(3, 5, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(CASES["frozen_function"].build(), (x,), backend=backend)
    assert not dgt.diagnostics(graphed).has_backward_graph
    if backend != "eager":
        assert runner_of(graphed).plan.buffers.grad_outputs == ()
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
@pytest.mark.parametrize(
    "optimizer", ["SGD", "Adam", "AdamW-foreach", "AdamW-fused", "SGD-fused", "Adam-single-tensor"]
)
def test_training_steps_match_eager(backend: str, param_grads: str, optimizer: str) -> None:
    # the multi-tensor (foreach) and fused kernels read every .grad at once: under "in_graph"
    # and "auto" those are the graph's accumulators
    case = CASES["mlp"]
    device = device_of(backend)
    fn, twin = case.make(device)
    args, _ = case.draw(device)
    dgt.make_graphed_callables(fn, args, backend=backend, param_grads=param_grads)
    make_optimizer = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        "SGD-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
        "Adam-single-tensor": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
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


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_an_amp_step_with_a_grad_scaler_and_clipping_matches_eager(
    backend: str, param_grads: str
) -> None:
    # torch's AMP recipe around a module graphed under autocast: each micro-batch's scaled loss
    # backward outside autocast, then unscale_, clip_grad_norm_, step and update. The scaler
    # and the clipping rewrite every .grad in place (under "in_graph" and "auto", the graph's
    # accumulators, which the next micro-batch adds into); an infinite micro-batch makes the
    # step skipped and the scale halved.
    case = CASES["mlp"]
    device = device_of(backend)
    fn, twin = case.make(device)
    args, _ = case.draw(device)
    with _autocast(backend, cache_enabled=False):
        dgt.make_graphed_callables(fn, args, backend=backend, param_grads=param_grads)
    scalers, optimizers = [], []
    for module in (fn, twin):
        scalers.append(torch.amp.GradScaler(device.type, init_scale=2.0**16, growth_interval=2))
        optimizers.append(torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=True))
    tol = tolerance(backend, torch.bfloat16)
    scales = []
    for step in range(5):
        batches = [case.draw(device)[0][0] for _ in range(2)]
        if step == 2:
            batches[1] = batches[1] * float("inf")
        for module, scaler, optimizer in zip((fn, twin), scalers, optimizers, strict=True):
            for x in batches:
                with _autocast(backend, cache_enabled=False):
                    outputs = module(x)
                scaler.scale(loss_of(outputs)).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=0.5)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"step {step}"
        scales.append(scalers[0].get_scale())
        for (name, p), q in zip(fn.named_parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.detach(), q.detach(), f"step {step} {name}", tol)
    assert scales == [2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**17]  # step 2 skipped, halved


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
        with _autocast(backend, cache_enabled=False):  # torch's AMP recipe: the forward
            out, expected = fn(x), twin(x)
        assert out.dtype == torch.bfloat16
        assert_trees_match(out, expected, tol)
        backward_of(out)  # and the backward outside autocast
        backward_of(expected)
        assert_grads_match(
            grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), parameter_names(fn), tol
        )
        fn.zero_grad()
        twin.zero_grad()


class _Float32Matmul(torch.autograd.Function):
    """``x @ w`` in float32 whatever the autocast, and a backward that is plain ops (no
    ``torch.amp.custom_bwd``): under an autocast they compute in its dtype, as a custom
    function's backward does in eager."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ w.float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return (grad @ w.t()).to(x.dtype), (x.t() @ grad).to(w.dtype)


class _Float32Layer(torch.nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16, device=device) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_Float32Matmul.apply(x, self.weight))


def _float32_layer_graphed_under_autocast(
    backend: str, **options: Any
) -> tuple[_Float32Layer, _Float32Layer]:
    """A :class:`_Float32Layer` graphed under a bfloat16 autocast, and its eager twin."""
    device = device_of(backend)
    torch.manual_seed(0)
    module = _Float32Layer(device)
    twin = copy.deepcopy(module)
    with _autocast(backend, cache_enabled=False):
        dgt.make_graphed_callables(
            module,
            (torch.randn(8, 16, device=device, requires_grad=True),),
            backend=backend,
            **options,
        )
    return module, twin


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_outside_autocast_after_a_forward_under_it_equals_eagers(
    backend: str, param_grads: str
) -> None:
    # Captured under autocast, the backward graph was captured under it too, where torch's AMP
    # recipe (and eager's `.backward()` called after the autocast block) runs the backward
    # outside: a custom function's backward matmuls ran in bfloat16 in the graph, in float32 in
    # eager (CUDA; the CPU's emulate runs the backward when called). Bit for bit with eager.
    device = device_of(backend)
    tol = tolerance(backend)  # float32's on the GPU: a bfloat16 backward is far outside it
    module, twin = _float32_layer_graphed_under_autocast(backend, param_grads=param_grads)
    for _ in range(3):
        x = torch.randn(8, 16, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        with _autocast(backend, cache_enabled=False):
            out, expected = module(x), twin(x_eager)
        (out * out).sum().backward()
        (expected * expected).sum().backward()
        assert_tensors_match(out, expected, "output", tol)
        assert_tensors_match(x.grad, x_eager.grad, "input grad", tol)
        assert_tensors_match(module.weight.grad, twin.weight.grad, "weight grad", tol)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_under_autocast_is_refused_before_any_grad_and_runs_outside_it(
    backend: str,
) -> None:
    # Eager's backward under an autocast runs its ops under it (a custom function's matmuls
    # in bfloat16); the graphs' backward was captured outside autocast.
    device = device_of(backend)
    tol = tolerance(backend)  # float32's on the GPU: a bfloat16 backward is far outside it
    module, twin = _float32_layer_graphed_under_autocast(backend)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    with _autocast(backend, cache_enabled=False):
        loss = module(x).sum()
        refused = r"its backward ran under torch\.autocast\('(cpu|cuda)', dtype=torch\.bfloat16\)"
        with pytest.raises(DualgraphError, match=refused):
            loss.backward(retain_graph=True)
        expected = twin(x_eager).sum()
    assert x.grad is None and module.weight.grad is None
    loss.backward()
    expected.backward()
    assert_tensors_match(x.grad, x_eager.grad, "input grad", tol)
    assert_tensors_match(module.weight.grad, twin.weight.grad, "weight grad", tol)


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
    with pytest.raises(DualgraphError, match=r"called outside torch\.autocast but captured under"):
        under_autocast(x)
    refused = r"^TinyMLP: called under torch\.autocast\(.*\) but captured outside torch\.autocast"
    with _autocast(backend, cache_enabled=False), pytest.raises(DualgraphError, match=refused):
        plain(x)


def test_an_autocast_refusal_says_in_words_what_the_call_ran_under_and_the_capture() -> None:
    # it said "called with autocast state () but captured with (False, torch.bfloat16)"
    module = TinyMLP()
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        dgt.make_graphed_callables(module, (torch.randn(4, 8),), backend="emulate")
    with pytest.raises(DualgraphError) as error:
        module(torch.randn(4, 8))
    assert str(error.value).startswith(
        "TinyMLP: called outside torch.autocast but captured under "
        "torch.autocast('cpu', dtype=torch.bfloat16)"
    )
    with (
        torch.autocast("cpu", dtype=torch.float16, cache_enabled=False),
        pytest.raises(
            DualgraphError,
            match=r"called under torch.autocast\('cpu', dtype="
            r"torch.float16\) but captured under torch.autocast\('cpu', dtype="
            r"torch.bfloat16\)",
        ),
    ):
        module(torch.randn(4, 8))


# -- modules with state besides their parameters -------------------------------------------------


class Normed(nn.Module):
    """Linear, BatchNorm (running statistics and a batch count), ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.fc(x)))


@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_batchnorm_running_statistics_follow_eager(backend: str, param_grads: str) -> None:
    """Warmup and capture leave the statistics as they were; each replay updates them once."""
    device = device_of(backend)
    module, twin = Normed().to(device), Normed().to(device)
    twin.load_state_dict(module.state_dict())
    dgt.make_graphed_callables(
        module, (torch.randn(8, 6, device=device),), backend=backend, param_grads=param_grads
    )
    assert_trees_match(dict(module.norm.named_buffers()), dict(twin.norm.named_buffers()))
    for _ in range(3):
        x = torch.randn(8, 6, device=device)
        backward_of(module(x))
        backward_of(twin(x))
        buffers = dict(module.norm.named_buffers())
        assert_trees_match(buffers, dict(twin.norm.named_buffers()), tolerance(backend))
        assert_grads_match(
            grads_of(parameters_of(module)),
            grads_of(parameters_of(twin)),
            parameter_names(module),
            tolerance(backend),
        )
    assert int(module.norm.num_batches_tracked) == 3
    module.eval()
    twin.eval()
    x = torch.randn(8, 6, device=device)
    assert_tensors_match(module(x).detach(), twin(x).detach(), "eval output", tolerance(backend))


# -- pools and precisions ------------------------------------------------------------------------


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


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_bfloat16_module_matches_eager(backend: str) -> None:
    # on the CPU (emulate) bit for bit, as every dtype there
    device = device_of(backend)
    fn, twin = CASES["mlp"].make(device)
    fn, twin = fn.to(torch.bfloat16), twin.to(torch.bfloat16)
    dgt.make_graphed_callables(
        fn, (torch.randn(4, 8, device=device, dtype=torch.bfloat16),), backend=backend
    )
    tol = tolerance(backend, torch.bfloat16)
    for _ in range(3):
        x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
        out, expected = fn(x), twin(x)
        assert_trees_match(out, expected, tol)
        backward_of(out)
        backward_of(expected)
        assert_grads_match(
            grads_of(parameters_of(fn)), grads_of(parameters_of(twin)), parameter_names(fn), tol
        )
        fn.zero_grad()
        twin.zero_grad()


class _OwnAutocast(nn.Module):
    """A forward that enters an autocast of its own (its weight cache on: torch's default)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, cache_enabled=True):
            return self.lin(x).float()


@pytest.mark.parametrize(
    "outer",
    [{"enabled": False}, {"dtype": torch.bfloat16, "cache_enabled": False}],
    ids=["disabled", "cache_off"],
)
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_autocast_inside_the_forward_under_an_open_autocast_casts_each_calls_input(
    backend: str, outer: dict[str, Any]
) -> None:
    # The inner autocast's weight cache outlived it (an autocast context was still open), so
    # a replay found the warmup's cast of the static input: every call computed the sample's.
    device = device_of(backend)
    module = _OwnAutocast(device)
    twin = copy.deepcopy(module)
    tol = tolerance(backend, torch.bfloat16)
    with torch.autocast(device.type, **outer):
        dgt.make_graphed_callables(
            module, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
        )
        for _ in range(2):
            x = torch.randn(4, 8, device=device, requires_grad=True)
            out = module(x)
            # Eager's own cache would keep the twin's weight cast of before the step below as
            # long as the outer autocast is open (torch empties it when the outermost exits);
            # a replay casts its weights afresh (README): compared with eager's fresh casts.
            torch.clear_autocast_cache()
            assert_trees_match(out, twin(x), tol)
            with torch.no_grad():  # an optimizer step between calls
                module.lin.weight.add_(0.5)
                twin.lin.weight.add_(0.5)
