"""Shape buckets: one graphed callable, several input shapes, one pool (``buckets=``).

Graphed and eager twins see the same inputs in a random order of shapes: outputs, input grads,
parameter grads and trained weights are bit-identical on the CPU (within ``TOLERANCES`` on a
GPU); padded calls (``fallback="pad"``) match eager up to rounding. CUDA tests also check that a
replay of one bucket leaves what another bucket handed out alone, and the memory bound: the pool
of all buckets is at most 1.25x the pool of the largest bucket captured alone.
"""

from __future__ import annotations

import copy
import functools
import gc
import importlib
import logging
import random
import weakref
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_cases import (
    BACKENDS,
    CUDA,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    assert_tensors_match,
    assert_trees_match,
    device_of,
    fresh_copy,
    isolation,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError, SpecMismatchError
from dualgraph.models.torch_vit import VisionEncoder, ViTBlock

#: Padded calls run other kernels' sizes than eager: equal up to rounding, not bit for bit.
PAD_TOLERANCE = (1e-5, 1e-5)


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def twins(build: Any, device: torch.device) -> tuple[nn.Module, nn.Module]:
    module = build().to(device)
    twin = build().to(device)
    twin.load_state_dict(module.state_dict())
    return module, twin


def encoder_sizes(backend: str) -> tuple[dict[str, int], list[int]]:
    """Encoder settings and three image sizes: 196, 256 and 324 tokens on a GPU, 4/9/16 on a CPU."""
    if backend == CUDA:
        return {"image_size": 224, "patch_size": 16, "dim": 64, "depth": 2, "heads": 4}, [
            224,
            256,
            288,
        ]
    return {"image_size": 24, "patch_size": 8, "dim": 16, "depth": 2, "heads": 2}, [16, 24, 32]


def tokens(device: torch.device, length: int, batch: int = 2, dim: int = 16) -> torch.Tensor:
    return torch.randn(batch, length, dim, device=device, requires_grad=True)


def block_buckets(device: torch.device, lengths: tuple[int, ...] = (5, 7, 9)) -> list[Any]:
    return [(tokens(device, n),) for n in lengths]


def loss_and_grads(
    module: nn.Module, x: torch.Tensor, **kwargs: Any
) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    hidden, _ = module(x, **kwargs)
    loss = hidden.square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
    return loss.item(), x.grad.clone(), grads  # type: ignore[union-attr]


# -- training on several shapes matches eager ------------------------------------------------


@pytest.fixture
def deterministic_cudnn() -> Any:
    """cuDNN's conv weight grads differ from run to run otherwise (seen on the H200)."""
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = saved


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
@pytest.mark.usefixtures("deterministic_cudnn")
def test_encoder_trained_on_sizes_in_random_order_matches_eager(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    settings, sizes = encoder_sizes(backend)
    encoder, twin = twins(lambda: VisionEncoder(**settings), device)

    def images(size: int) -> torch.Tensor:
        return torch.randn(2, 3, size, size, device=device)

    dgt.make_graphed_callables(
        encoder, buckets=[(images(s),) for s in sizes], param_grads=param_grads, backend=backend
    )
    assert len(dgt.diagnostics(encoder).buckets) == 3
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (encoder, twin)]
    order = random.Random(0).choices(sizes, k=9)
    assert set(order) == set(sizes)
    for step, size in enumerate(order):
        batch = images(size)
        outputs = encoder(batch)
        expected = twin(batch.clone())
        assert_trees_match(outputs, expected, tolerance(backend))
        for out in (outputs, expected):
            (out["hidden"].square().mean() + out["pooled"].abs().mean()).backward()
        for (name, p), q in zip(encoder.named_parameters(), twin.parameters(), strict=True):
            assert_tensors_match(
                p.grad, q.grad, f"step {step} ({size} px): grad of {name}", tolerance(backend)
            )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
    for (name, p), q in zip(encoder.named_parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.detach(), q.detach(), f"trained {name}", tolerance(backend))
    assert dgt.diagnostics(encoder).replays == len(order)
    assert [b.calls for b in dgt.diagnostics(encoder).buckets] == [order.count(s) for s in sizes]


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_alternating_buckets_with_grads_accumulating_across_them_match_eager(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(
        block, buckets=block_buckets(device), backend=backend, param_grads=param_grads
    )
    for length in (5, 9, 5, 7, 9, 7, 5):  # grads accumulate across buckets: no zero_grad
        x = tokens(device, length)
        x_eager = fresh_copy(x)
        with torch.no_grad():  # a forward-only call of another bucket in between changes nothing
            block(tokens(device, 7 if length != 7 else 9))
        loss, x_grad, grads = loss_and_grads(block, x)
        eager_loss, eager_x_grad, eager_grads = loss_and_grads(twin, x_eager)
        assert loss == eager_loss or backend == CUDA
        assert_tensors_match(x_grad, eager_x_grad, f"input grad ({length})", tolerance(backend))
        for i, (g, e) in enumerate(zip(grads, eager_grads, strict=True)):
            assert_tensors_match(g, e, f"parameter {i} grad ({length})", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_of_one_bucket_survive_replays_of_the_others(backend: str) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(block, buckets=block_buckets(device), backend=backend)
    x5, x7, x9 = tokens(device, 5), tokens(device, 7), tokens(device, 9)
    with torch.no_grad():
        kept = block(x5)[0]  # aliases bucket 0's static output
        block(x9)
        block(x7)
        expected = twin(x5)[0]
    assert_tensors_match(
        kept, expected, "bucket 0's output after buckets 2 and 1 ran", tolerance(backend)
    )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_in_graph_and_autograd_grads_land_in_one_grad_per_parameter(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    block, _ = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(
        block, buckets=block_buckets(device), backend=backend, param_grads=param_grads
    )
    block(tokens(device, 5))[0].sum().backward()
    grads = [p.grad for p in block.parameters()]
    block(tokens(device, 9))[0].sum().backward()
    assert all(p.grad is g for p, g in zip(block.parameters(), grads, strict=True))
    old = block.fc1.weight.grad
    kept = old.clone()  # type: ignore[union-attr]
    block.zero_grad(set_to_none=True)
    block(tokens(device, 7))[0].sum().backward()
    assert block.fc1.weight.grad is not None and block.fc1.weight.grad is not old
    assert torch.equal(old, kept), "a .grad kept after zero_grad changed"


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_shares_one_accumulator_per_parameter_across_buckets(
    backend: str,
) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(
        block, buckets=block_buckets(device), backend=backend, param_grads="auto"
    )
    plans = [runner.plan for runner in runner_of(block).runners]  # type: ignore[union-attr]
    first = plans[0]
    # no grad buffer per parameter: every bucket's backward graph adds into the accumulators
    assert all(plan.buffers.param_grads == (None,) * len(plan.params.params) for plan in plans)
    assert all(plan.params.accumulators == first.params.accumulators for plan in plans)
    params = list(block.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    per_bucket = sum(
        t.numel() * t.element_size()
        for plan in plans
        for t in (*plan.buffers.grad_outputs, *plan.buffers.input_grads)
        if t is not None
    )
    assert dgt.diagnostics(block).static_grad_bytes == per_bucket + grad_bytes
    for length in (5, 9, 7, 5):  # .grad accumulates across buckets
        x = tokens(device, length)
        block(x)[0].square().sum().backward()
        twin(x.detach().clone().requires_grad_())[0].square().sum().backward()
    for p, e in zip(params, twin.parameters(), strict=True):
        assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
    assert all(p.grad is a for p, a in zip(params, first.params.accumulators, strict=True))
    assert dgt.diagnostics(block).param_grads_through_autograd == 0
    block.fc1.bias.register_hook(lambda grad: grad * 2)  # a hook: autograd, in every bucket
    twin.fc1.bias.register_hook(lambda grad: grad * 2)
    for length in (9, 5):
        x = tokens(device, length)
        block(x)[0].square().sum().backward()
        twin(x.detach().clone().requires_grad_())[0].square().sum().backward()
    for p, e in zip(params, twin.parameters(), strict=True):
        assert_tensors_match(p.grad, e.grad, "parameter grad after a hook", tolerance(backend))
    assert dgt.diagnostics(block).param_grads_through_autograd == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_sums_a_bucket_and_an_eager_fallback_in_one_backward_as_eager_does(
    backend: str,
) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(
        block, buckets=block_buckets(device), backend=backend, fallback="eager"
    )

    def loss(module: nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum((module(x)[0].square().sum() for x in xs), torch.zeros((), device=device))

    for lengths in ((5, 6), (8, 9), (7, 6)):  # a bucket and no bucket (eager), either order
        xs = [tokens(device, n) for n in lengths]
        loss(block, xs).backward()  # .grad accumulates: eager adds the sum of both uses' grads
        loss(twin, [x.detach().clone().requires_grad_() for x in xs]).backward()
        for p, e in zip(block.parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
    report = dgt.diagnostics(block)
    assert (report.eager_calls, report.param_grads_through_autograd) == (3, 3)
    x = tokens(device, 9)  # the eager graphs are gone: the bucket adds into .grad itself again
    loss(block, [x]).backward()
    loss(twin, [x.detach().clone().requires_grad_()]).backward()
    for p, e in zip(block.parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, e.grad, "parameter grad", tolerance(backend))
    assert dgt.diagnostics(block).param_grads_through_autograd == 3


class _NotesLongCalls(nn.Module):
    """Sets a flag of its own on calls longer than any bucket: Python no replay runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.saw_long = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 3:
            self.saw_long = True
        return self.fc(x).tanh()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["module", "function"])
def test_a_value_the_forward_sets_in_an_eager_fallback_is_no_change(backend: str, how: str) -> None:
    # The eager fallback ran the forward's Python, which set saw_long; the next bucket call
    # read that as the caller's change since capture and was refused.
    device = device_of(backend)
    module = _NotesLongCalls().to(device)
    callable_: Any = module
    if how == "function":  # a frozen module it closes over
        module.requires_grad_(False)

        def step(x: torch.Tensor) -> torch.Tensor:
            return module(x)

        callable_ = step
    graphed = dgt.make_graphed_callables(
        callable_,
        buckets=[(torch.randn(n, 4, device=device, requires_grad=True),) for n in (2, 3)],
        backend=backend,
        fallback="eager",
    )
    graphed(torch.randn(5, 4, device=device, requires_grad=True)).sum().backward()  # eager
    assert module.saw_long
    graphed(torch.randn(2, 4, device=device, requires_grad=True)).sum().backward()  # a bucket
    module.saw_long = False  # the caller's own change: still refused
    name = "_NotesLongCalls.saw_long" if how == "module" else "closed over module.saw_long"
    with pytest.raises(DualgraphError, match=f"{name}: was True at capture and is False"):
        graphed(torch.randn(2, 4, device=device))


# -- one replay in flight ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_backward_after_another_bucket_replayed_is_refused(backend: str) -> None:
    device = device_of(backend)
    block, _ = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(block, buckets=block_buckets(device), backend=backend)
    first, _ = block(tokens(device, 5))
    second, _ = block(tokens(device, 9))  # may overwrite the activations of the first
    second.sum().backward()
    with pytest.raises(DualgraphError, match="backward of an earlier replay after a later forward"):
        first.sum().backward()
    del first
    x = tokens(device, 5)
    block(x)[0].sum().backward()  # the bucket works again
    assert x.grad is not None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_eager_call_between_a_replay_and_its_backward_leaves_the_backward_valid(
    backend: str,
) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(
        block, buckets=block_buckets(device), backend=backend, fallback="eager"
    )
    x, y = tokens(device, 5), tokens(device, 6)  # y has no bucket: it runs eagerly
    x_eager, y_eager = fresh_copy(x), fresh_copy(y)
    (block(x)[0].square().mean() + block(y)[0].square().mean()).backward()
    (twin(x_eager)[0].square().mean() + twin(y_eager)[0].square().mean()).backward()
    assert_tensors_match(x.grad, x_eager.grad, "replayed input's grad", tolerance(backend))
    assert_tensors_match(y.grad, y_eager.grad, "eager input's grad", tolerance(backend))
    for (name, p), q in zip(block.named_parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, q.grad, f"grad of {name}", tolerance(backend))


# -- calls of other shapes -------------------------------------------------------------------


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_an_unknown_shape_is_an_error_naming_the_path_and_the_buckets(backend: str) -> None:
    device = device_of(backend)
    block, _ = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(block, buckets=block_buckets(device), backend=backend)
    with pytest.raises(SpecMismatchError) as error:
        block(tokens(device, 6))
    assert error.value.path == "args[0]"
    assert str(error.value).startswith(
        "args[0]: got shape [2, 6, 16], which no bucket of ViTBlock takes (fallback='error'"
    )
    assert "the buckets take args[0]=[2, 5, 16] | args[0]=[2, 7, 16] | args[0]=[2, 9, 16]" in str(
        error.value
    )


def test_the_error_names_the_input_that_matches_no_bucket() -> None:
    def fn(x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return x * mask

    buckets = [(torch.randn(2, n),) for n in (3, 5)]
    masks = [{"mask": torch.randn(2, n)} for n in (3, 5)]
    graphed = dgt.make_graphed_callables(fn, buckets=buckets, sample_kwargs=masks)
    with pytest.raises(SpecMismatchError) as error:
        graphed(torch.randn(2, 3), mask=torch.randn(2, 4))
    assert error.value.path == "kwargs['mask']"
    with pytest.raises(SpecMismatchError) as error:  # each shape is a bucket's, not together
        graphed(torch.randn(2, 3), mask=torch.randn(2, 5))
    assert error.value.path == "kwargs['mask']"
    assert "args[0]=[2, 3], kwargs['mask']=[2, 3] | args[0]=[2, 5]" in str(error.value)


class EveryLeafBlock(nn.Module):
    """Returns a differentiable tensor, None, constants, an int and a bool tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.proj(x)
        return h, None, {"n": 3, "top": h.argmax(dim=-1), "on": h > 0, "scale": 0.5}


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_an_unknown_shape_runs_eagerly_with_the_full_output_contract(backend: str) -> None:
    device = device_of(backend)
    module, twin = twins(EveryLeafBlock, device)
    buckets = [(torch.randn(n, 8, device=device, requires_grad=True),) for n in (2, 4)]
    dgt.make_graphed_callables(module, buckets=buckets, backend=backend, fallback="eager")
    for rows in (3, 4, 5, 3):
        x = torch.randn(rows, 8, device=device, requires_grad=True)
        x_eager = fresh_copy(x)
        outputs, expected = module(x), twin(x_eager)
        assert_trees_match(outputs, expected, tolerance(backend) if rows == 4 else None)
        outputs[0].square().sum().backward()
        expected[0].square().sum().backward()
        assert_tensors_match(x.grad, x_eager.grad, "input grad", tolerance(backend))
        assert_tensors_match(
            module.proj.weight.grad, twin.proj.weight.grad, "weight grad", tolerance(backend)
        )
    report = dgt.diagnostics(module)
    assert (report.eager_calls, report.replays) == (3, 1)


def test_an_eager_call_must_return_the_buckets_output_structure() -> None:
    def fn(x: torch.Tensor) -> Any:
        return (x * 2, None) if x.shape[0] < 4 else (x * 2, x)

    graphed = dgt.make_graphed_callables(
        fn, buckets=[(torch.randn(n),) for n in (1, 2)], fallback="eager"
    )
    assert graphed(torch.randn(3))[1] is None
    returned = (
        r"output\[1\]: the eager call returned a float32 tensor where the buckets return None"
    )
    with pytest.raises(SpecMismatchError, match=returned):
        graphed(torch.randn(5))


def test_an_eager_call_returning_another_container_is_refused_naming_it() -> None:
    def fn(x: torch.Tensor) -> Any:
        return (x * 2,) if x.shape[0] < 4 else [x * 2]  # one leaf path, [0], in both

    graphed = dgt.make_graphed_callables(
        fn, buckets=[(torch.randn(n),) for n in (1, 2)], fallback="eager"
    )
    assert type(graphed(torch.randn(3))) is tuple
    returned = (
        r"output: the eager call returned a list of length 1 where the buckets return a tuple of "
        r"length 1; a graphed callable returns one output structure"
    )
    with pytest.raises(SpecMismatchError, match=returned):
        graphed(torch.randn(5))


OUTPUTS_BY_LENGTH = {  # the outputs for a short sample, then for a long one
    "a list, then a tuple": (
        lambda y: [y, 1],
        lambda y: (y, 1),
        "output is a tuple of length 2 but a list of length 2",
    ),
    "None, then a tensor": (
        lambda y: (y, None),
        lambda y: (y, y),
        r"output\[1\] is a float32 tensor but None",
    ),
    "one constant, then another": (
        lambda y: (y, 2),
        lambda y: (y, 3),
        r"output\[1\] is int 3 but int 2",
    ),
    "float32, then float64": (
        lambda y: y,
        lambda y: y.double(),
        "output is a float64 tensor but a float32 tensor",
    ),
    "a key more": (
        lambda y: {"y": y},
        lambda y: {"y": y, "z": y},
        r"output\['z'\] is a float32 tensor but nothing",
    ),
}


class OutputsByLength(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.short, self.long, _ = OUTPUTS_BY_LENGTH[case]

    def forward(self, x: torch.Tensor) -> Any:
        y = self.proj(x)
        return self.short(y) if x.shape[0] < 4 else self.long(y)


@pytest.mark.parametrize("case", list(OUTPUTS_BY_LENGTH))
@pytest.mark.parametrize("fallback", ["error", "eager"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_buckets_whose_outputs_differ_in_more_than_shapes_are_refused_naming_the_output(
    backend: str, fallback: str, case: str
) -> None:
    device = device_of(backend)
    module = OutputsByLength(case).to(device)
    buckets = [(torch.randn(n, 4, device=device),) for n in (2, 5)]
    message = (
        rf"^buckets\[1\]: {OUTPUTS_BY_LENGTH[case][2]} in buckets\[0\]; buckets differ only in the "
        r"shapes of their tensors, and a graphed callable returns one output structure"
    )
    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(module, buckets=buckets, backend=backend, fallback=fallback)
    assert module.proj.weight.grad is None
    dgt.make_graphed_callables(module, buckets=buckets[:1], backend=backend)  # graphs anew
    assert dgt.diagnostics(module).buckets[0].shapes == {"args[0]": (2, 4)}


@pytest.mark.parametrize("fallback", ["error", "eager", "pad"])
def test_an_unknown_shape_of_the_wrong_dtype_is_refused_under_any_fallback(fallback: str) -> None:
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dims = {"args[0]": 1, "output[0]": 1} if fallback == "pad" else None
    dgt.make_graphed_callables(
        block, buckets=block_buckets(torch.device("cpu")), fallback=fallback, dynamic_dims=dims
    )
    with pytest.raises(SpecMismatchError, match=r"args\[0\]: expected a float32 tensor on cpu"):
        block(torch.randn(2, 6, 16, dtype=torch.float64))
    assert dgt.diagnostics(block).eager_calls == 0


# -- fallback="pad" ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "param_grads"), [*GRAPH_GRAD_MODES, pytest.param("eager", "autograd", id="eager")]
)
def test_padded_calls_match_eager_on_the_unpadded_input(backend: str, param_grads: str) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(
        block,
        buckets=block_buckets(device),
        backend=backend,
        param_grads=param_grads,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
    )
    for length in (3, 5, 8, 6, 9, 1):
        x = tokens(device, length)
        x_eager = fresh_copy(x)
        exact = length in (5, 7, 9)
        close = tolerance(backend) if exact else (tolerance(backend) or PAD_TOLERANCE)
        loss, x_grad, grads = loss_and_grads(block, x)
        eager_loss, eager_x_grad, eager_grads = loss_and_grads(twin, x_eager)
        assert x_grad.shape == (2, length, 16)
        assert_tensors_match(torch.tensor(loss), torch.tensor(eager_loss), "loss", close)
        assert_tensors_match(x_grad, eager_x_grad, f"input grad ({length})", close)
        for i, (g, e) in enumerate(zip(grads, eager_grads, strict=True)):
            assert_tensors_match(g, e, f"parameter {i} grad ({length})", close)
        block.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
    report = dgt.diagnostics(block)
    assert report.padded_calls == 4
    assert [(b.length, b.calls, b.padded_calls) for b in report.buckets] == [
        (5, 3, 2),
        (7, 1, 1),
        (9, 2, 1),
    ]


def masked_mean(
    x: torch.Tensor, *, mask: torch.Tensor, valid_length: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position values and a mean over the valid positions only."""
    weighted = torch.tanh(x) * mask
    if valid_length is None:
        return weighted, weighted.mean(dim=1)
    keep = torch.arange(x.shape[1], device=x.device) < valid_length
    return weighted, (weighted * keep).sum(dim=1) / valid_length


def test_pad_pads_every_declared_input_and_cuts_every_declared_output() -> None:
    buckets = [(torch.randn(2, n, requires_grad=True),) for n in (4, 8)]
    masks = [{"mask": torch.rand(2, n) > 0.5} for n in (4, 8)]
    graphed = dgt.make_graphed_callables(
        masked_mean,
        buckets=buckets,
        sample_kwargs=masks,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "kwargs['mask']": 1, "output[0]": 1},
    )
    x = torch.randn(2, 6, requires_grad=True)
    mask = torch.rand(2, 6) > 0.5  # a bool tensor, padded with False
    x_eager = fresh_copy(x)
    weighted, mean = graphed(x, mask=mask)
    expected_weighted, expected_mean = masked_mean(x_eager, mask=mask)
    assert weighted.shape == (2, 6) and mean.shape == (2,)
    assert_tensors_match(weighted, expected_weighted, "per position", PAD_TOLERANCE)
    assert_tensors_match(mean, expected_mean, "mean over valid positions", PAD_TOLERANCE)
    (weighted.sum() + mean.sum()).backward()
    (expected_weighted.sum() + expected_mean.sum()).backward()
    assert_tensors_match(x.grad, x_eager.grad, "input grad", PAD_TOLERANCE)
    with pytest.raises(SpecMismatchError, match=r"kwargs\['mask'\]: length 5 along dim 1, but"):
        graphed(x, mask=torch.rand(2, 5) > 0.5)


class Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.norm(x)


def in_place(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    x.mul_(2)
    return x.sum(dim=1)


class MeanPool(nn.Module):
    """A mean over every position: it takes valid_length but counts the padding too."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.proj(x).mean(dim=1)


def unmasked_softmax(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    return torch.softmax(x, dim=1)  # padded zeros get weight exp(0) too


def length_constant(x: torch.Tensor, valid_length: Any = None) -> tuple[torch.Tensor, int]:
    return x * 2, x.shape[1]  # a padded call would return the bucket's length


def list_or_tuple(x: torch.Tensor, valid_length: Any = None) -> Any:
    y = x * 2
    return [y, 1] if x.shape[1] < 4 else (y, 1)  # a padded call would return a tuple


def dtype_of_the_length(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    return (x * 2).double() if x.shape[1] < 4 else x * 2  # a padded call would return float32


REFUSED_PADDING = {
    "no valid_length": (
        lambda: lambda x: x * 2,
        [(torch.randn(2, n),) for n in (3, 5)],
        {"args[0]": 1, "output": 1},
        "takes no 'valid_length' argument, so it could not tell padding from data",
    ),
    "batch norm": (
        Normalized,
        [(torch.randn(2, 4, n),) for n in (3, 5)],
        {"args[0]": 2, "output": 2},
        r"Normalized.norm is a BatchNorm1d, whose statistics run over positions",
    ),
    "output not cut back": (
        lambda: ViTBlock(16, 2),
        [(torch.randn(2, n, 16),) for n in (3, 5)],
        {"args[0]": 1},
        r"output\[0\] dim 1 changes with the length \(3, 5 across buckets\) but is not in "
        r"dynamic_dims",
    ),
    "output with the length in two dims": (
        lambda: lambda x, valid_length=None: x[:, :, None] * x[:, None, :],
        [(torch.randn(2, n),) for n in (3, 5)],
        {"args[0]": 1, "output": 1},
        r"output dim 2 changes with the length \(3, 5 across buckets\) but is not in "
        r"dynamic_dims, so a padded call could not be cut back; dynamic_dims cuts one dim per "
        r"output \(dim 1 there\)",
    ),
    "output dim of another size": (
        lambda: ViTBlock(16, 2),
        [(torch.randn(2, n, 16),) for n in (3, 5)],
        {"args[0]": 1, "output[0]": 2},
        r"output\[0\] dim 2 has size 16 in buckets\[0\], whose length is 3",
    ),
    "padded input updated in place": (
        lambda: in_place,
        [(torch.randn(2, n),) for n in (3, 5)],
        {"args[0]": 1},
        r"updates args\[0\] in place, but a padded call passes it a padded copy",
    ),
    "a mean that counts the padding": (
        MeanPool,
        [(torch.randn(2, n, 4),) for n in (3, 5)],
        {"args[0]": 1},
        r"MeanPool: output differs \(by up to .*\) when a call of length 3 is padded to 5 \(with",
    ),
    "a mean that counts the padding, one bucket": (
        MeanPool,
        [(torch.randn(2, 6, 4),)],
        {"args[0]": 1},
        r"MeanPool: output differs .* when a call of length 3 is padded to 6",
    ),
    "an unmasked softmax over positions": (
        lambda: unmasked_softmax,
        [(torch.randn(2, n),) for n in (3, 5)],
        {"args[0]": 1, "output": 1},
        r"unmasked_softmax: output differs .* when a call of length 3 is padded to 5",
    ),
    "a constant of the length": (
        lambda: length_constant,
        [(torch.randn(2, 5),)],
        {"args[0]": 1, "output[0]": 1},
        r"length_constant: output\[1\] is int 5, not int 2, when a call of length 2 is padded to 5",
    ),
    "a container that changes with the length": (
        lambda: list_or_tuple,
        [(torch.randn(2, 5),)],
        {"args[0]": 1, "output[0]": 1},
        r"list_or_tuple: output is a tuple of length 2, not a list of length 2, when a call of "
        r"length 2 is padded to 5",
    ),
    "a dtype that changes with the length": (
        lambda: dtype_of_the_length,
        [(torch.randn(2, 5),)],
        {"args[0]": 1, "output": 1},
        r"dtype_of_the_length: output is a float32 tensor, not a float64 tensor, when a call of "
        r"length 2 is padded to 5",
    ),
    "no input dim": (
        lambda: ViTBlock(16, 2),
        [(torch.randn(2, n, 16),) for n in (3, 5)],
        {"output[0]": 1},
        "dynamic_dims names no input dim",
    ),
    "unknown input path": (
        lambda: ViTBlock(16, 2),
        [(torch.randn(2, n, 16),) for n in (3, 5)],
        {"args[1]": 1},
        r"dynamic_dims: args\[1\] is not an input tensor",
    ),
    "dim out of range": (
        lambda: ViTBlock(16, 2),
        [(torch.randn(2, n, 16),) for n in (3, 5)],
        {"args[0]": 3},
        r"args\[0\] has 3 dims, so it has no dim 3",
    ),
    "no dynamic_dims": (
        lambda: ViTBlock(16, 2),
        [(torch.randn(2, n, 16),) for n in (3, 5)],
        None,
        "fallback='pad' needs dynamic_dims=",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_PADDING))
def test_pad_refuses_what_it_cannot_make_correct(case: str) -> None:
    build, buckets, dims, message = REFUSED_PADDING[case]
    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(build(), buckets=buckets, fallback="pad", dynamic_dims=dims)


def skips_a_class_token(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """The sum over positions after the first, its length counted down in place."""
    if valid_length is None:
        return x[:, 1:].sum(dim=1)
    valid_length -= 1  # an in-place update of the tensor every call of that length gets
    keep = torch.arange(x.shape[1] - 1, device=x.device) < valid_length
    return (x[:, 1:] * keep[None, :, None]).sum(dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_refuses_a_callable_that_updates_valid_length_in_place(backend: str) -> None:
    # Every call of one length was handed one valid_length tensor, which the callable counted
    # down: the second call of a length saw another length, silently another sum (on the
    # eager backend too); the padding check took the moved length for random numbers.
    device = device_of(backend)
    with pytest.raises(
        DualgraphError,
        match=r"skips_a_class_token updates kwargs\['valid_length'\] in place, but every later "
        r"call of that length is handed the same tensor, which would then tell it another "
        r"length \((found by its capture|it held \d+, then \d+)",
    ):
        dgt.make_graphed_callables(
            skips_a_class_token,
            buckets=[(torch.randn(2, n, 3, device=device),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1},
            backend=backend,
        )


class TokenTypes(nn.Module):
    """Token embeddings plus the embedding of their type, from a table of one row (RoBERTa's
    token types: all zeros); per position, so padding changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.types = nn.Embedding(1, 4)

    def forward(
        self, tokens: torch.Tensor, types: torch.Tensor, valid_length: Any = None
    ) -> torch.Tensor:
        return self.tokens(tokens) + self.types(types)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_takes_token_ids_of_a_table_of_one_row(backend: str) -> None:
    """Token types of zeros given ones by the check are out of the table's range: the call
    raises there and cannot be judged on them (on CUDA integers keep their samples' values,
    where an index out of range is a device-side assert); the padding is right."""
    model = TokenTypes()
    buckets = [(torch.randint(0, 10, (2, n)), torch.zeros(2, n, dtype=torch.int64)) for n in (4, 8)]
    twin = copy.deepcopy(model)
    dgt.make_graphed_callables(
        model,
        buckets=buckets,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
        backend=backend,
    )
    tokens, types = torch.randint(0, 10, (2, 6)), torch.zeros(2, 6, dtype=torch.int64)
    assert_tensors_match(model(tokens, types), twin(tokens, types), "pad", None)


def attends_unless_flagged(x: torch.Tensor, padded: torch.Tensor, valid_length: Any = None) -> Any:
    """Self-attention masking the keys flagged as padding (key_padding_mask: True = padding);
    it takes valid_length but ignores it, so the padding fallback='pad' adds (flagged False)
    is attended."""
    scores = (x @ x.transpose(1, 2)).masked_fill(padded[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ x


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_checks_a_padding_flag_of_false_with_its_hidden_states_of_zeros_filled_alone(
    backend: str,
) -> None:
    # Samples of zeros for both: flags given True with the hidden states flag every key as
    # padding, so the call's output is NaN and cannot be judged; the hidden states given values
    # with the flags left False find the attended padding (the check before the previous
    # commit did; with it, this callable passed and its padded calls came back off eager's).
    device = device_of(backend)
    with pytest.raises(
        DualgraphError,
        match=r"attends_unless_flagged: output differs .* when a call of length 4 is padded to "
        r"8 .*\(with its all-zero padded inputs given values in \(0, 1\)\)",
    ):
        dgt.make_graphed_callables(
            attends_unless_flagged,
            buckets=[
                (
                    torch.zeros(2, n, 4, device=device),
                    torch.zeros(2, n, dtype=torch.bool, device=device),
                )
                for n in (4, 8)
            ],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
            backend=backend,
        )


def masked_sum_and_length(x: torch.Tensor, valid_length: Any = None) -> tuple[Any, ...]:
    """A sum over the first valid_length positions, and the length it summed over."""
    if valid_length is None:
        valid_length = torch.tensor(x.shape[1], device=x.device)
    keep = torch.arange(x.shape[1], device=x.device) < valid_length
    return (x * keep[None, :, None]).sum(dim=1), valid_length


@pytest.mark.parametrize("length", [5, 8], ids=["padded", "exact"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_output_that_is_valid_length_is_the_callers_own_on_every_call(
    backend: str, length: int
) -> None:
    # The output was the one valid_length tensor every call of that length is told: the caller
    # counting it down in place (n -= 1) made the next call of that length sum one position
    # fewer, silently, and two calls handed out one tensor (eager's are each the caller's own).
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        masked_sum_and_length,
        buckets=[(torch.randn(2, n, 3, device=device),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1},
        backend=backend,
    )
    x = torch.randn(2, length, 3, device=device)
    _, first = graphed(x)
    first -= 1
    total, second = graphed(x)
    assert second is not first and int(second) == length
    assert_tensors_match(total, x.sum(dim=1), "the sum after the change", tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_checks_a_mean_that_counts_the_padding_on_samples_of_zeros(backend: str) -> None:
    # Samples of zeros (shapes for a capture) are what padding adds: the padded call equalled
    # the call whatever the callable did with the padding, so a mean counting it passed the
    # check and every padded call of real values came back off eager's, silently.
    device = device_of(backend)
    with pytest.raises(
        DualgraphError,
        match=r"MeanPool: output differs .* when a call of length 4 is padded to 8 .*\(with its "
        r"all-zero padded inputs given values in \(0, 1\)\)",
    ):
        dgt.make_graphed_callables(
            MeanPool().to(device),
            buckets=[(torch.zeros(2, n, 4, device=device),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1},
            backend=backend,
        )


class CountsPadding(nn.Module):
    """Token embeddings, with their mean over every position added (``counts="tokens"``) or
    scaled by the share of flagged positions (``counts="flags"``): it takes valid_length but
    counts the padding."""

    def __init__(self, counts: str) -> None:
        super().__init__()
        self.counts = counts
        self.embed = nn.Embedding(10, 4)

    def forward(
        self, tokens: torch.Tensor, flags: torch.Tensor, valid_length: Any = None
    ) -> torch.Tensor:
        hidden = self.embed(tokens)
        if self.counts == "tokens":
            return hidden + hidden.mean(dim=1, keepdim=True)
        return hidden * flags.float().mean(dim=1)[:, None, None]


@pytest.mark.parametrize("counts", ["tokens", "flags"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_checks_integer_and_bool_inputs_on_samples_of_zeros(backend: str, counts: str) -> None:
    # Token ids of zeros and a mask of False (shapes for a capture) are the padding itself, so
    # a padded call equalled the call whatever the callable counted: the check let a mean over
    # the padded tokens' embeddings (or the share of flagged positions) through, and a padded
    # call of real tokens came back off eager's, silently.
    device = device_of(backend)
    if counts == "tokens" and device.type == "cuda":
        # run AC: integer ids are given 1 on the CPU only (README: on CUDA a table of one row
        # makes 1 a device-side assert, which would leave the process unusable)
        pytest.skip("all-zero integer ids are not refilled on CUDA")
    tokens = torch.zeros(2, 8, dtype=torch.int64, device=device)
    flags = torch.ones(2, 8, dtype=torch.bool, device=device)
    if counts == "flags":  # only the flags are zeros
        tokens, flags = tokens + 3, ~flags
    with pytest.raises(
        DualgraphError,
        match=r"CountsPadding: output differs .* when a call of length 4 is padded to 8 .*\(with "
        r"its all-zero padded inputs given nonzero values\)",
    ):
        dgt.make_graphed_callables(
            CountsPadding(counts).to(device),
            buckets=[(tokens[:, :n], flags[:, :n]) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
            backend=backend,
        )


def sums_off_by_one(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """A sum over positions whose mask drops the last real one when told valid_length."""
    if valid_length is None:
        return x.sum(dim=1)
    keep = torch.arange(x.shape[1], device=x.device) < valid_length - 1
    return (x * keep).sum(dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_refuses_a_callable_that_told_its_full_length_differs_from_eager(
    backend: str,
) -> None:
    # Every replay, padded or exact, is told valid_length, eager calls it without; the check
    # compared padded calls with unpadded ones both told, so a mask off by one passed and every
    # graphed call came back off eager's, silently (verify's eager side is told it too).
    device = device_of(backend)
    with pytest.raises(
        DualgraphError,
        match=r"sums_off_by_one: output differs \(by up to .*\) between a call of length 4 told "
        r"valid_length=4 .* and the same call without valid_length \(as eager calls it\)",
    ):
        dgt.make_graphed_callables(
            sums_off_by_one,
            buckets=[(torch.randn(2, n, device=device),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1},
            backend=backend,
        )


def scales_by_its_weights(
    x: torch.Tensor, *, weights: torch.Tensor, valid_length: Any = None
) -> torch.Tensor:
    weights.mul_(2)  # a keyword sorted after valid_length, padded and updated in place
    return x * weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_refuses_an_update_of_a_padded_keyword_sorted_after_valid_length(
    backend: str,
) -> None:
    # The capture named its inputs with valid_length among the keywords (sorted), the buckets
    # without: the updated kwargs['weights'] was taken for another input and let through, so a
    # padded call updated a padded copy and the caller's tensor stayed as it was (eager doubles
    # it); the eager backend never checked.
    device = device_of(backend)
    with pytest.raises(
        DualgraphError,
        match=r"scales_by_its_weights updates kwargs\['weights'\] in place, but a padded call "
        r"passes it a padded copy",
    ):
        dgt.make_graphed_callables(
            scales_by_its_weights,
            buckets=[(torch.randn(2, n, device=device),) for n in (4, 8)],
            sample_kwargs=[{"weights": torch.randn(2, n, device=device)} for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "kwargs['weights']": 1, "output": 1},
            backend=backend,
        )


class CountedMean(MeanPool):
    """A mean over the valid positions, with dropout and a buffer its forward updates."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        self.calls.add_(1)
        hidden = self.drop(self.proj(x))
        if valid_length is None:
            return hidden.mean(dim=1)
        keep = (torch.arange(x.shape[1], device=x.device) < valid_length)[:, None]
        return (hidden * keep).sum(dim=1) / valid_length


def three_layouts(
    x: torch.Tensor, valid_length: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position outputs in three layouts: as x, transposed, and positions outermost."""
    y = torch.tanh(x)
    return y * 2, (y * 3).transpose(1, 2), (y * 4).transpose(0, 1).contiguous()


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_padded_outputs_cut_back_have_eagers_layout(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        three_layouts,
        buckets=[(torch.randn(2, n, 4, device=device, requires_grad=True),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1, "output[1]": 2, "output[2]": 0},
    )
    x = torch.randn(2, 6, 4, device=device, requires_grad=True)
    x_eager = fresh_copy(x)
    outputs = graphed(x)
    expected = three_layouts(x_eager)
    for k, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        assert (out.shape, out.stride()) == (want.shape, want.stride()), f"output[{k}]"
        assert out.is_contiguous() is want.is_contiguous(), f"output[{k}]"
        assert_tensors_match(out, want, f"output[{k}]", tolerance(backend) or PAD_TOLERANCE)
    sum(out.reshape(-1)[::3].sum() for out in outputs).backward()  # reads through the strides
    sum(out.reshape(-1)[::3].sum() for out in expected).backward()
    assert_tensors_match(x.grad, x_eager.grad, "input grad", tolerance(backend) or PAD_TOLERANCE)
    outputs[0].view(-1)  # eager's output is contiguous: so is the cut


def passed_through(
    x: torch.Tensor, valid_length: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input itself (as a residual stream or HF's hidden states pass it on), and one
    result returned twice."""
    y = torch.tanh(x)
    return x, y, y


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_padded_calls_return_the_callers_input_and_one_output_twice_as_eager(
    backend: str,
) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        passed_through,
        buckets=[(torch.randn(2, n, device=device, requires_grad=True),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1, "output[1]": 1, "output[2]": 1},
    )
    x = torch.randn(2, 6, device=device, requires_grad=True)
    same, y, again = graphed(x)
    assert same is x  # an in-place change through it is the caller's, as in eager
    assert again is y
    assert_tensors_match(y, torch.tanh(x), "output[1]", tolerance(backend) or PAD_TOLERANCE)


def tripled_if_one_tensor(
    query: torch.Tensor, key: torch.Tensor, valid_length: Any = None
) -> torch.Tensor:
    """Branches on identity, as ``nn.MultiheadAttention`` packs its projections where
    ``query is key``."""
    return query * 3 if query is key else query + key


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_a_padded_call_passing_one_tensor_twice_hands_the_callable_one_padded_tensor(
    backend: str,
) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        tripled_if_one_tensor,
        buckets=[
            tuple(torch.randn(2, n, device=device, requires_grad=True) for _ in range(2))
            for n in (4, 8)
        ],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
    )
    x = torch.randn(2, 6, device=device, requires_grad=True)
    twin = x.detach().clone().requires_grad_()
    out = graphed(x, x)
    expected = tripled_if_one_tensor(twin, twin)
    assert_tensors_match(out, expected, "output", tolerance(backend) or PAD_TOLERANCE)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_tensors_match(x.grad, twin.grad, "args[0].grad", tolerance(backend) or PAD_TOLERANCE)


def scaled_by_requires_grad(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    return x * (2.0 if x.requires_grad else 3.0)


def scaled_by_leaf(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    return x * (2.0 if x.is_leaf else 3.0)


@pytest.mark.parametrize(
    ("fn", "call"),
    [
        (scaled_by_requires_grad, "no_grad"),
        (scaled_by_requires_grad, "inference_mode"),
        (scaled_by_leaf, "leaf"),
        (scaled_by_leaf, "computed"),
    ],
    ids=["requires_grad-no_grad", "requires_grad-inference_mode", "leaf", "computed"],
)
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_padded_call_takes_the_branch_its_callers_input_flags_take_in_eager(
    backend: str, fn: Any, call: str
) -> None:
    # The padded copy is no leaf where the caller's tensor requires grad, and requires no grad
    # under no_grad: the callable reading them must see the caller's, as eager's call does.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        fn,
        buckets=[(torch.randn(2, n, device=device, requires_grad=True),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
    )
    leaf = torch.randn(2, 6, device=device, requires_grad=True)
    twin = leaf.detach().clone().requires_grad_()
    if call in ("no_grad", "inference_mode"):
        with getattr(torch, call)():
            out, expected = graphed(leaf), fn(twin)
    else:
        x, x_twin = (leaf * 1.5, twin * 1.5) if call == "computed" else (leaf, twin)
        out, expected = graphed(x), fn(x_twin)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert_tensors_match(leaf.grad, twin.grad, "grad", tolerance(backend) or PAD_TOLERANCE)
    assert_tensors_match(out, expected, "output", tolerance(backend) or PAD_TOLERANCE)


class _PaddedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.fc(x)  # saves x for the weight's grad


@pytest.mark.parametrize("length", [4, 5], ids=["exact", "padded"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_inference_tensor_the_backward_reads_is_refused_padded_or_not(
    backend: str, length: int
) -> None:
    # eager raises 'Inference tensors cannot be saved for backward'; a padded call's copy is
    # no inference tensor, so its replay ran where eager raises
    device = device_of(backend)
    module = _PaddedLinear().to(device)
    dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(2, n, 3, device=device),) for n in (4, 6)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
    )
    with torch.inference_mode():
        x = torch.randn(2, length, 3, device=device)
    with pytest.raises(DualgraphError, match=r"^args\[0\]: an inference tensor"):
        module(x)
    assert module(x.clone()).shape == (2, length, 3)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_padded_call_refuses_an_earlier_output_it_would_hand_back_overwritten(
    backend: str,
) -> None:
    # y, cut back from the 8 bucket's static output[1] (a view: cut along the outermost dim),
    # passed back in padded to the same bucket: the replay overwrote that buffer, and output[0],
    # the caller's y handed back, held this call's tanh(y) where eager's holds y's values.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        passed_through,
        buckets=[(torch.randn(n, 3, device=device),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 0, "output[0]": 0, "output[1]": 0, "output[2]": 0},
    )
    _, y, _ = graphed(torch.randn(6, 3, device=device))
    assert y._base is not None  # a view of the static output, not a copy
    kept = y.clone()
    with pytest.raises(
        DualgraphError, match=r"args\[0\] shares memory with output\[1\] of an earlier call"
    ):
        graphed(y)
    assert torch.equal(y, kept)  # nothing replayed
    values = kept.clone()
    same, again, _ = graphed(kept)
    assert same is kept and torch.equal(same, values)
    assert_tensors_match(again, torch.tanh(kept), "output[1]", tolerance(backend) or PAD_TOLERANCE)


def views_of_cut_output(
    x: torch.Tensor, valid_length: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x)
    return h, h[:, :, 0]  # in eager, an in-place change through one is seen through the other


def view_of_padded_input(
    x: torch.Tensor, valid_length: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tanh(x), x[:, :, 0]  # in eager, a view of the caller's x


def view_of_uncut_output(
    x: torch.Tensor, valid_length: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    pooled = x.sum(dim=1)  # the padding adds zeros: a length-free output
    return pooled, pooled[0]


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
@pytest.mark.parametrize(
    ("fn", "dims", "message"),
    [
        (
            views_of_cut_output,
            {"output[0]": 1, "output[1]": 1},
            r"output\[1\] is a view of output\[0\]",
        ),
        (
            view_of_padded_input,
            {"output[0]": 1, "output[1]": 1},
            r"output\[1\] is a view of args\[0\]",
        ),
    ],
    ids=["view of an output", "view of a padded input"],
)
def test_pad_refuses_outputs_that_view_a_cut_output_or_a_padded_input(
    backend: str, fn: Any, dims: dict[str, int], message: str
) -> None:
    device = device_of(backend)
    with pytest.raises(DualgraphError, match="fallback='pad': .*" + message):
        dgt.make_graphed_callables(
            fn,
            buckets=[(torch.randn(2, n, 3, device=device),) for n in (4, 8)],
            backend=backend,
            fallback="pad",
            dynamic_dims={"args[0]": 1, **dims},
        )


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_padded_calls_keep_a_view_of_an_output_that_is_not_cut(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        view_of_uncut_output,
        buckets=[(torch.randn(2, n, 3, device=device),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1},
    )
    pooled, first = graphed(torch.randn(2, 6, 3, device=device))
    first.zero_()
    assert not pooled[0].any()  # shared as in eager


def halves(x: torch.Tensor, valid_length: Any = None) -> tuple[torch.Tensor, ...]:
    return torch.tanh(x).chunk(2, dim=-1)  # one storage, no element shared: apart in eager too


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_padded_calls_cut_back_outputs_that_share_a_storage_but_no_element(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        halves,
        buckets=[(torch.randn(2, n, 4, device=device),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1, "output[1]": 1},
    )
    x = torch.randn(2, 6, 4, device=device)
    for out, want in zip(graphed(x), halves(x), strict=True):
        assert_tensors_match(out, want, "output", tolerance(backend) or PAD_TOLERANCE)


class ExpOfLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.linear(x).exp()  # its backward reads its output


class ExpOfLinearReadingRequiresGrad(nn.Module):
    """Its backward reads its output and its input; it branches on its input's requires_grad,
    so a call whose input needs no grad (the samples' do) runs eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return (self.linear(x) * (0.5 if x.requires_grad else 0.25)).exp()


def _padded_replay_then_padded_eager_call(
    backend: str,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded call replayed (its backward pending), then a padded call the bucket's runner
    runs eagerly; the inputs and outputs of both."""
    device = device_of(backend)
    graphed = ExpOfLinearReadingRequiresGrad().to(device)
    dgt.make_graphed_callables(
        graphed,
        buckets=[(torch.randn(2, n, 4, device=device, requires_grad=True),) for n in (3, 5)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
    )
    replayed = torch.randn(2, 4, 4, device=device, requires_grad=True)
    replayed_out = graphed(replayed)
    eager = torch.randn(2, 4, 4, device=device)
    eager_out = graphed(eager)
    assert dgt.diagnostics(graphed).eager_calls == 1
    return graphed, replayed, replayed_out, eager, eager_out


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("changed", ["input", "output"])
def test_a_padded_call_run_eagerly_is_not_checked_as_the_replay_before_it(
    backend: str, changed: str
) -> None:
    # The padded call's bookkeeping noted the eager call's input and cut output on the latest
    # replay's node: a change to them, which eager allows, refused that replay's backward.
    _, replayed, replayed_out, eager, eager_out = _padded_replay_then_padded_eager_call(backend)
    (eager if changed == "input" else eager_out).add_(1)
    replayed_out.sum().backward()
    assert replayed.grad is not None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("changed", ["input", "output"])
def test_a_padded_call_run_eagerly_keeps_the_checks_of_the_replay_before_it(
    backend: str, changed: str
) -> None:
    # ... and dropped the replay's own: its input or cut output changed in place, its backward
    # ran with the values of the call (eager's raises).
    graphed, replayed, replayed_out, _, _ = _padded_replay_then_padded_eager_call(backend)
    with torch.no_grad():
        (replayed if changed == "input" else replayed_out).add_(1)
    with pytest.raises(DualgraphError, match=r"modified in place after the (call|replay)"):
        replayed_out.sum().backward()
    assert replayed.grad is None and graphed.linear.weight.grad is None


def aux_loss_under_grad(
    x: torch.Tensor, valid_length: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-position values, with an auxiliary loss first only under grad mode."""
    h = torch.tanh(x)
    if torch.is_grad_enabled():
        return {"aux": h.sum(), "h": h}
    return {"h": h}


def graph_aux_loss_under_grad(backend: str = "emulate") -> Any:
    return dgt.make_graphed_callables(
        aux_loss_under_grad,
        buckets=[(torch.randn(2, n, requires_grad=True),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output['h']": 1},
    )


def test_pad_check_cuts_the_outputs_of_a_callable_returning_more_under_grad() -> None:
    # The grad comparison cut the grad runs' outputs where the no-grad runs' lay: output[0]
    # there is the auxiliary loss, a 0-dim tensor ('narrow() cannot be applied to a 0-dim').
    graphed = graph_aux_loss_under_grad()
    x = torch.randn(2, 6, requires_grad=True)
    x_eager = fresh_copy(x)
    out, expected = graphed(x), aux_loss_under_grad(x_eager)
    assert out.keys() == expected.keys() and out["h"].shape == (2, 6)
    assert_trees_match(out, expected, PAD_TOLERANCE)
    (out["aux"] + out["h"].square().sum()).backward()
    (expected["aux"] + expected["h"].square().sum()).backward()
    assert_tensors_match(x.grad, x_eager.grad, "input grad", PAD_TOLERANCE)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_a_padded_call_run_eagerly_cuts_eagers_outputs_of_another_structure(backend: str) -> None:
    # A padded call under no_grad runs eagerly (the callable reads grad mode) and returns
    # eager's {'h'}; cutting it by the capture's structure raised "['aux']: missing".
    graphed = graph_aux_loss_under_grad(backend)
    graphed(torch.randn(2, 6, requires_grad=True))
    x = torch.randn(2, 6)
    with torch.no_grad():
        out = graphed(x)
        expected = aux_loss_under_grad(x)
    assert out.keys() == {"h"} and out["h"].shape == (2, 6)
    assert_trees_match(out, expected, PAD_TOLERANCE)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("length", [6, 8], ids=["padded", "exact"])
def test_a_cut_output_the_backward_reads_may_not_be_changed_in_place(
    backend: str, param_grads: str, length: int
) -> None:
    # Cut along a dim that is not the outermost, a padded call's output is a copy of the static
    # output: changed in place, it left the static output (which the backward reads) as it was,
    # and the backward ran where eager's raises.
    device = device_of(backend)
    graphed, twin = twins(ExpOfLinear, device)
    dgt.make_graphed_callables(
        graphed,
        buckets=[(torch.randn(2, n, 4, device=device, requires_grad=True),) for n in (4, 8)],
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        param_grads=param_grads,
    )
    x = torch.randn(2, length, 4, device=device, requires_grad=True)
    out = graphed(x)
    out.mul_(2)
    with pytest.raises(DualgraphError) as info:
        out.sum().backward()
    assert "output was modified in place after the replay, but the backward reads it" in str(
        info.value
    )
    assert x.grad is None and graphed.linear.weight.grad is None  # refused before any add
    eager = twin(fresh_copy(x))
    eager.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager.sum().backward()  # eager refuses it too
    x_eager = fresh_copy(x)
    graphed(x).sum().backward()  # an output left unchanged runs, as eager's does
    twin(x_eager).sum().backward()
    assert_tensors_match(x.grad, x_eager.grad, "x.grad", tolerance(backend) or PAD_TOLERANCE)


def concatenated(d: dict[str, torch.Tensor], valid_length: Any = None) -> torch.Tensor:
    return torch.cat(list(d.values()), dim=-1) * 2  # follows the dict's key order


@pytest.mark.parametrize("length", [4, 5], ids=["padded", "exact"])
def test_pad_refuses_a_dict_in_another_key_order_as_an_exact_call_does(length: int) -> None:
    buckets = [({"a": torch.randn(2, n, 3), "b": torch.randn(2, n, 4)},) for n in (3, 5)]
    graphed = dgt.make_graphed_callables(
        concatenated,
        buckets=buckets,
        fallback="pad",
        dynamic_dims={"args[0]['a']": 1, "args[0]['b']": 1, "output": 1},
    )
    swapped = {"b": torch.randn(2, length, 4), "a": torch.randn(2, length, 3)}
    with pytest.raises(SpecMismatchError, match=r"args\[0\]: a dict with its keys in the order"):
        graphed(swapped)  # padding rebuilt it in the captured order: another result than eager's
    ordered = {"a": swapped["a"], "b": swapped["b"]}
    assert_tensors_match(graphed(ordered), concatenated(ordered), "output", PAD_TOLERANCE)


def joined(x: torch.Tensor, valid_length: Any = None, **parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, *parts.values()], dim=-1) * 2  # follows the order of the keywords


def _joined_samples(n: int) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    return (torch.randn(2, n, 2),), {"a": torch.randn(2, n, 3), "b": torch.randn(2, n, 4)}


@pytest.mark.parametrize("backend", ["emulate", "eager"])
@pytest.mark.parametrize("length", [4, 5], ids=["padded", "exact"])
def test_keywords_collected_by_var_kwargs_in_another_order_are_refused(
    length: int, backend: str
) -> None:
    samples = [_joined_samples(n) for n in (3, 5)]
    graphed = dgt.make_graphed_callables(
        joined,
        buckets=[args for args, _ in samples],
        sample_kwargs=[kwargs for _, kwargs in samples],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "kwargs['a']": 1, "kwargs['b']": 1, "output": 1},
        backend=backend,
    )
    (x,), kwargs = _joined_samples(length)
    with pytest.raises(SpecMismatchError, match=r"^kwargs: the keywords \['b', 'a'\] go to"):
        graphed(x, b=kwargs["b"], a=kwargs["a"])  # a replay would concatenate a before b
    assert [bucket.calls for bucket in dgt.diagnostics(graphed).buckets] == [0, 0]
    out = graphed(x, **kwargs)
    assert_tensors_match(out, joined(x, **kwargs), "output", PAD_TOLERANCE)


def test_bucket_samples_with_collected_keywords_in_another_order_are_refused() -> None:
    (x3,), first = _joined_samples(3)
    (x5,), second = _joined_samples(5)
    swapped = {"b": second["b"], "a": second["a"]}
    with pytest.raises(
        DualgraphError,
        match=r"^buckets\[1\]: kwargs: the keywords \['b', 'a'\] go to the callable's "
        r"\*\*kwargs in this order, captured in the order \['a', 'b'\] \(as buckets\[0\] has it\)",
    ):
        dgt.make_graphed_callables(joined, buckets=[(x3,), (x5,)], sample_kwargs=[first, swapped])

    def named(x: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, a, b], dim=-1)

    graphed = dgt.make_graphed_callables(  # named keywords bind in any order
        named, buckets=[(x3,), (x5,)], sample_kwargs=[first, swapped]
    )
    assert torch.equal(graphed(x5, **swapped), named(x5, **second))


def always_dropout(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    return torch.nn.functional.dropout(x, 0.5, training=True)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_checks_at_capture_that_padding_stays_out_of_the_outputs(backend: str) -> None:
    buckets = [(torch.randn(2, n, 4),) for n in (3, 5)]
    with pytest.raises(DualgraphError, match=r"MeanPool: output differs .* padded to 5"):
        dgt.make_graphed_callables(
            MeanPool(),
            buckets=buckets,
            fallback="pad",
            dynamic_dims={"args[0]": 1},
            backend=backend,
        )
    # a callable that masks passes; the check leaves its mode, buffers and the RNG as found
    module, twin = twins(CountedMean, torch.device("cpu"))
    state = torch.get_rng_state()
    graphed = dgt.make_graphed_callables(
        module, buckets=buckets, fallback="pad", dynamic_dims={"args[0]": 1}, backend=backend
    )
    assert module.training and module.drop.training and int(module.calls) == 0
    assert torch.equal(torch.get_rng_state(), state) or backend != "eager"
    x = torch.randn(2, 4, 4)
    module.eval()
    twin.eval()
    assert_tensors_match(module(x), twin(x), "eval mode, eager", None)
    module.train()
    assert graphed is module
    # a function that always draws random numbers cannot be judged: it is let through
    dgt.make_graphed_callables(
        always_dropout, buckets=buckets, fallback="pad", dynamic_dims={"args[0]": 1, "output": 1}
    )


def dropout_with_scores(x: torch.Tensor, valid_length: Any = None) -> Any:
    """Draws random numbers, and returns a score per position that dynamic_dims leaves out."""
    hidden = F.dropout(x, 0.1, training=True)
    return hidden, hidden.sum(-1)


def dropout_masked_off_by_one(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """Draws random numbers, and told its full length masks its last position too."""
    hidden = F.dropout(x, 0.1, training=True)
    if valid_length is None:
        return hidden
    keep = torch.arange(x.shape[1], device=x.device) < valid_length - 1
    return hidden * keep[:, None]


def test_pad_refuses_an_uncut_output_dim_of_a_callable_drawing_random_numbers() -> None:
    """One bucket (no other to compare output shapes with) and random draws (no values to
    compare): a padded call handed out scores of the bucket's length, silently."""
    with pytest.raises(
        DualgraphError, match=r"output\[1\] has shape \[2, 8\] instead of \[2, 4\] .* padded to 8"
    ):
        dgt.make_graphed_callables(
            dropout_with_scores,
            buckets=[(torch.randn(2, 8, 4, requires_grad=True),)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output[0]": 1},
            backend="emulate",
        )


def test_pad_compares_told_and_untold_calls_of_a_callable_drawing_random_numbers() -> None:
    """Told and untold, one seed draws the same numbers: the mask off by one is found."""
    with pytest.raises(DualgraphError, match=r"told valid_length=4 .*\(a mask off by one"):
        dgt.make_graphed_callables(
            dropout_masked_off_by_one,
            buckets=[(torch.randn(2, 8, 4, requires_grad=True),)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend="emulate",
        )


class TrainingStatistics(nn.Module):
    """Centres features by statistics over positions while training (a normalization of its
    own, no BatchNorm), by a running mean in eval mode, where padding changes nothing."""

    def __init__(self, use_batch_mean: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.use_batch_mean = use_batch_mean
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        hidden = self.drop(self.proj(x))
        if not self.training:
            return hidden - self.running_mean
        mean = hidden.mean(dim=(0, 1))  # counts the padded positions
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * mean)
        return hidden - mean if self.use_batch_mean else hidden


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_checks_a_module_captured_in_training_mode_in_that_mode(backend: str) -> None:
    """Its replays run in training mode, where the mean counts the padding: a check in eval
    mode alone let it through, and padded calls came back off eager."""
    module = TrainingStatistics()
    with pytest.raises(
        DualgraphError, match=r"TrainingStatistics: output differs .* in training mode"
    ):
        dgt.make_graphed_callables(
            module,
            buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )
    # the check leaves modes, dropout and buffers as they were
    assert module.training and module.drop.training and module.drop.p == 0.5
    assert torch.equal(module.running_mean, torch.zeros(4))


class FunctionalDropoutCentred(nn.Module):
    """Dropout called as a function (as ViTBlock does), then, while training only, centred by
    a mean over positions that counts the padding: ``"dropout"`` by ``F.dropout``, ``"attention"``
    by the attention dropout of ``F.scaled_dot_product_attention``, ``"rrelu"`` a randomized
    leaky ReLU (``nn.RReLU``'s) in its place."""

    def __init__(self, dropout: str) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        hidden = self.proj(x)
        if self.dropout == "dropout":
            hidden = F.dropout(hidden, 0.25, self.training)
        elif self.dropout == "rrelu":
            hidden = F.rrelu(hidden, training=self.training)
        else:
            keep = torch.arange(x.shape[1], device=x.device) < (
                x.shape[1] if valid_length is None else valid_length
            )
            p = 0.25 if self.training else 0.0
            hidden = F.scaled_dot_product_attention(hidden, hidden, hidden, keep, p)
        if self.training:
            hidden = hidden - hidden.mean(1, keepdim=True)  # counts the padded positions
        return hidden


def dropout_then_unmasked_mean(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    hidden = F.dropout(x, 0.5, training=True)  # draws in eval mode too
    return hidden - hidden.mean(1, keepdim=True)  # counts the padded positions


@pytest.mark.parametrize("backend", ["emulate", "eager"])
@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda: FunctionalDropoutCentred("dropout"), " in training mode"),
        (lambda: FunctionalDropoutCentred("attention"), " in training mode"),
        (lambda: FunctionalDropoutCentred("rrelu"), " in training mode"),
        (lambda: dropout_then_unmasked_mean, ""),
    ],
    ids=["F.dropout", "attention dropout_p", "F.rrelu", "always drawing"],
)
def test_pad_checks_the_values_of_a_callable_calling_dropout_as_a_function(
    make: Any, where: str, backend: str
) -> None:
    """Functional dropout drew random numbers in the check, which then compared shapes only: a
    mean over positions counting the padding went through, and every padded call came back off
    eager's (by 0.29 in the mean over 3000 calls, the dropout's noise 0.01). The check now runs
    functional dropout at p=0, as it sets dropout modules."""
    fn = make()
    state = torch.get_rng_state()
    with pytest.raises(DualgraphError, match=rf"output differs .* padded to 8 .*{where}"):
        dgt.make_graphed_callables(
            fn,
            buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )
    assert getattr(fn, "training", True)
    # the check leaves no mode behind: functional dropout draws again, from where it was
    torch.set_rng_state(state)
    x = torch.ones(2, 64)
    assert not torch.equal(F.dropout(x, 0.5, training=True), x)


def test_pad_lets_a_masked_callable_calling_dropout_as_a_function_through() -> None:
    """ViTBlock's F.dropout in training mode: checked by its values now, and masked, it passes;
    its replays still draw."""
    block = ViTBlock(dim=8, heads=2, dropout=0.25)
    graphed = dgt.make_graphed_callables(
        block,
        buckets=[(torch.randn(2, n, 8, requires_grad=True),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
        backend="emulate",
    )
    x = torch.randn(2, 5, 8)
    first, _ = graphed(x)
    second, _ = graphed(x)
    assert first.shape == (2, 5, 8) and not torch.equal(first, second)


class CentredUnderGrad(nn.Module):
    """Adds a mean over positions, counting the padding, only where grad mode is on (as every
    replay of a training step runs): a value it takes no grad through."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        hidden = self.proj(x)
        if torch.is_grad_enabled():
            hidden = hidden + hidden.detach().mean(1, keepdim=True)
        return hidden


class RunningMeanUnderGrad(nn.Module):
    """Keeps a running mean over positions, counting the padding, only in a training step's
    forward (grad mode on), as some modules keep a statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        hidden = self.proj(x)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * hidden.mean(dim=(0, 1)))
        return hidden


@pytest.mark.parametrize("backend", ["emulate", "eager"])
@pytest.mark.parametrize(
    ("make", "what"),
    [(CentredUnderGrad, "output"), (RunningMeanUnderGrad, r"buffer running_mean \(updated")],
    ids=["output", "buffer"],
)
def test_pad_checks_a_call_under_grad_mode(make: Any, what: str, backend: str) -> None:
    """The check compared outputs and buffers under no_grad only, and under grad mode only the
    grads, which a detached mean does not change: the leak went through, and every padded call
    under grad mode came back (or left its running mean) off eager's."""
    with pytest.raises(
        DualgraphError, match=rf"{what}.* differs .* padded to 8 .*, with grad enabled \(as replays"
    ):
        dgt.make_graphed_callables(
            make(),
            buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_checks_the_buffers_a_padded_call_updates(backend: str) -> None:
    """The outputs ignore the padding, but the running mean the call keeps counts it."""
    with pytest.raises(
        DualgraphError, match=r"buffer running_mean \(updated by the call\) differs"
    ):
        dgt.make_graphed_callables(
            TrainingStatistics(use_batch_mean=False),
            buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )


class PositionCounter(torch.nn.Module):
    """Keeps an integer count of the positions it has seen, padded ones included."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        with torch.no_grad():
            self.seen.add_(x.shape[1])  # counts the padded positions
        return self.proj(x)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_names_an_integer_buffer_as_expected_and_as_found(backend: str) -> None:
    """An integer buffer the padded call updates otherwise is named with both values."""
    with pytest.raises(
        DualgraphError,
        match=r"buffer seen \(updated by the call\) differs \(at \[\]: 8 instead of 4\)",
    ):
        dgt.make_graphed_callables(
            PositionCounter(),
            buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )


def unmasked_peak(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    return x.amax(dim=1)  # a padded zero wins wherever every value of the call is below zero


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_checks_a_max_over_positions_where_zero_padding_would_win(backend: str) -> None:
    """A max over 16 or more random positions is almost never below zero, so the samples'
    values let an unmasked max through, and a call of log probabilities (all below zero) came
    back with zeros. The check also shifts the padded inputs below and above zero."""
    torch.manual_seed(0)
    with pytest.raises(
        DualgraphError, match=r"unmasked_peak: output differs .* shifted below zero"
    ):
        dgt.make_graphed_callables(
            unmasked_peak,
            buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (32, 64)],
            fallback="pad",
            dynamic_dims={"args[0]": 1},
            backend=backend,
        )


def fast_path_at_eight(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """A softmax over positions that masks the padding, but for lengths that are a multiple of
    8, where a "fast path" forgets the mask."""
    if x.shape[1] % 8 == 0 or valid_length is None:
        return torch.softmax(x, dim=1)
    keep = torch.arange(x.shape[1], device=x.device) < valid_length
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=1)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_checks_every_bucket_a_call_can_be_padded_into(backend: str) -> None:
    """Calls of length 5 to 8 are padded to the middle bucket, whose capture forgets the mask; a
    check of the smallest bucket padded to the largest alone would not see it."""
    buckets = [(torch.randn(2, n, requires_grad=True),) for n in (4, 8, 12)]
    with pytest.raises(
        DualgraphError, match=r"fast_path_at_eight: output differs .* length 5 is padded to 8 "
    ):
        dgt.make_graphed_callables(
            fast_path_at_eight,
            buckets=buckets,
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )


class TokenLengths(nn.Module):
    """The length of each projected token: no position mixes with another, but the backward of
    sqrt at a zero (padded) token is inf, and inf times its zero grad is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        h = self.proj(x)
        return torch.sqrt((h * h).sum(-1))


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_checks_at_capture_that_padding_stays_out_of_the_grads(backend: str) -> None:
    buckets = [(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)]
    with pytest.raises(
        DualgraphError,
        match=r"TokenLengths: the grad of parameter proj.weight differs \(by up to nan.* "
        r"padded positions reach the grads",
    ):
        dgt.make_graphed_callables(
            TokenLengths(),
            buckets=buckets,
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend=backend,
        )


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((2, 10, 16), r"args\[0\]: length 10 along dim 1 is longer than any bucket"),
        ((3, 6, 16), r"args\[0\]: got shape \[3, 6, 16\], which no bucket of ViTBlock takes"),
        ((2, 0, 16), r"args\[0\]: length 0 along dim 1"),
        ((7,), r"args\[0\]: got shape \[7\] \(1 dims\); fallback='pad' pads dim 1 of a 3-dim"),
        ((), r"args\[0\]: got shape \[\] \(0 dims\); fallback='pad' pads dim 1 of a 3-dim"),
    ],
    ids=["longer", "other dims", "empty", "fewer dims", "0-d"],
)
def test_pad_refuses_calls_no_bucket_can_hold(shape: tuple[int, ...], message: str) -> None:
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dgt.make_graphed_callables(
        block,
        buckets=block_buckets(torch.device("cpu")),
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
    )
    with pytest.raises(SpecMismatchError, match=message):
        block(torch.randn(shape))
    with pytest.raises(SpecMismatchError, match=r"kwargs\['valid_length'\]: ViTBlock passes"):
        block(torch.randn(2, 5, 16), valid_length=5)


@pytest.mark.parametrize("length", [5, 7], ids=["padded", "exact"])
@pytest.mark.parametrize("kind", ["module", "function"])
def test_pad_refuses_valid_length_passed_by_position_as_by_keyword(kind: str, length: int) -> None:
    # was refused blaming the sample for leaving valid_length to its default, and told to
    # graph with valid_length in the sample call, which fallback='pad' refuses
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    graphed: Any = block
    if kind == "function":
        graphed = dgt.make_graphed_callables(
            _masked_rows,
            buckets=[(torch.randn(2, n, 16), torch.ones(2, n)) for n in (5, 7, 9)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
        )
        args: tuple[Any, ...] = (torch.randn(2, length, 16), torch.ones(2, length))
        name = "_masked_rows"
    else:
        dgt.make_graphed_callables(
            block,
            buckets=block_buckets(torch.device("cpu")),
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output[0]": 1},
        )
        args = (torch.randn(2, length, 16),)
        name = "ViTBlock"
    at = len(args)
    with pytest.raises(
        SpecMismatchError, match=rf"^args\[{at}\]: {name} passes valid_length itself under"
    ) as info:
        graphed(*args, torch.tensor(3))
    assert info.value.path == f"args[{at}]"
    out = graphed(*args, None)  # its default, as eager takes it
    assert (out[0] if isinstance(out, tuple) else out).shape == (2, length, 16)


@pytest.mark.parametrize("length", [5, 7], ids=["padded", "exact"])
@pytest.mark.parametrize("kind", ["module", "function"])
def test_pad_takes_valid_length_none_passed_by_keyword_as_by_position(
    kind: str, length: int
) -> None:
    """Its default, None, passed by keyword was refused as a length passed in ('passes
    valid_length itself ... leave it out'), where eager takes it and so did the same call
    passing it by position; now both run as eager, padded or exact."""
    block, twin = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    graphed: Any = block
    eager: Any = twin
    if kind == "function":
        graphed = dgt.make_graphed_callables(
            _masked_rows,
            buckets=[(torch.randn(2, n, 16), torch.ones(2, n)) for n in (5, 7, 9)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
        )
        eager = _masked_rows
        args: tuple[Any, ...] = (torch.randn(2, length, 16), torch.ones(2, length))
    else:
        dgt.make_graphed_callables(
            block,
            buckets=block_buckets(torch.device("cpu")),
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output[0]": 1},
        )
        args = (torch.randn(2, length, 16),)

    def first(out: Any) -> torch.Tensor:
        return out[0] if isinstance(out, tuple) else out

    expected = first(eager(*args, valid_length=None))
    by_keyword = first(graphed(*args, valid_length=None))
    assert_tensors_match(by_keyword, expected, "valid_length=None by keyword", (1e-5, 1e-5))
    by_position = first(graphed(*args, None))
    assert_tensors_match(by_position, expected, "valid_length=None by position", (1e-5, 1e-5))


def test_the_log_says_which_bucket_a_call_was_padded_to_and_why_one_was_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dgt.make_graphed_callables(
        block,
        buckets=block_buckets(torch.device("cpu")),
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
    )
    with caplog.at_level(logging.DEBUG, logger="dualgraph.torch.buckets"):
        block(tokens(torch.device("cpu"), 6))
    assert caplog.messages == [
        "ViTBlock: bucket 1 (args[0]=[2, 7, 16]) served a call, padded from length 6 to 7"
    ]
    plain, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dgt.make_graphed_callables(plain, buckets=block_buckets(torch.device("cpu")))
    caplog.clear()
    level = caplog.at_level(logging.DEBUG, logger="dualgraph.torch.buckets")
    with level, pytest.raises(SpecMismatchError, match=r"^args\[0\]: got shape \[2, 6, 16\]"):
        plain(tokens(torch.device("cpu"), 6))
    assert caplog.messages[0].startswith(
        "ViTBlock: a call was refused: args[0]: got shape [2, 6, 16], which no bucket"
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_bucket_capture_names_the_bucket_and_leaves_the_module_as_it_was(
    backend: str,
) -> None:
    class FailsAtSeven(ViTBlock):
        def forward(self, x: torch.Tensor, valid_length: Any = None) -> Any:
            if x.shape[1] == 7:
                raise ValueError("seven tokens")
            return super().forward(x, valid_length)

    device = device_of(backend)
    block = FailsAtSeven(16, 2).to(device)
    with pytest.raises(DualgraphError) as error:
        dgt.make_graphed_callables(block, buckets=block_buckets(device), backend=backend)
    assert str(error.value).startswith(
        f"capturing FailsAtSeven[args[0]=[2, 7, 16]] ({backend}) failed during warmup: "
        "ValueError: seven tokens"
    )
    assert "forward" not in block.__dict__
    assert block(tokens(device, 6))[0].shape == (2, 6, 16)
    dgt.make_graphed_callables(block, buckets=block_buckets(device, (5, 9)), backend=backend)
    assert dgt.diagnostics(block).backend == backend


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_bucket_capture_lets_the_buckets_captured_before_it_go(backend: str) -> None:
    """While the error is held, the graphs, pool and static buffers of the buckets captured
    before the failing one are not kept by it (on CUDA, that pool's memory)."""
    seen: list[Any] = []

    class FailsOnFive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(weakref.ref(x))
            if x.shape[0] == 5:
                raise ValueError("five rows")
            return self.fc(x)

    device = device_of(backend)
    module = FailsOnFive().to(device)
    buckets = [(torch.randn(n, 4, device=device, requires_grad=True),) for n in (5, 9)]
    importlib.import_module("torch._dynamo")  # its first import leaves a cycle through frames
    gc.disable()  # only reference counts may free them
    try:
        with pytest.raises(CaptureError, match="five rows") as caught:
            dgt.make_graphed_callables(module, buckets=buckets, backend=backend)
        assert seen and [ref() for ref in seen] == [None] * len(seen)
        del caught
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_padding_refused_after_capture_lets_the_captured_buckets_go(backend: str) -> None:
    seen: list[Any] = []

    class SeenMeanPool(MeanPool):
        def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
            seen.append(weakref.ref(x))
            return super().forward(x, valid_length)

    device = device_of(backend)
    buckets = [(torch.randn(2, n, 4, device=device),) for n in (3, 5)]
    importlib.import_module("torch._dynamo")  # its first import leaves a cycle through frames
    gc.disable()  # only reference counts may free them
    try:
        with pytest.raises(DualgraphError, match="output differs") as caught:
            dgt.make_graphed_callables(
                SeenMeanPool().to(device),
                buckets=buckets,
                fallback="pad",
                dynamic_dims={"args[0]": 1},
                backend=backend,
            )
        assert seen and [ref() for ref in seen] == [None] * len(seen)
        del caught
    finally:
        gc.enable()


# -- bad requests ----------------------------------------------------------------------------------


BAD_REQUESTS = {
    "dtype differs": (
        {"buckets": [(torch.randn(2, 3),), (torch.randn(2, 5, dtype=torch.float64),)]},
        r"buckets\[1\]: args\[0\] is float64 on cpu but float32 on cpu in buckets\[0\]",
    ),
    "requires_grad differs": (  # said "float32 on cpu but float32 on cpu, requiring grad"
        {"buckets": [(torch.randn(2, 3, requires_grad=True),), (torch.randn(2, 5),)]},
        r"buckets\[1\]: args\[0\] is float32 on cpu, not requiring grad but float32 on cpu, "
        r"requiring grad in buckets\[0\]",
    ),
    "structure differs": (
        {"buckets": [(torch.randn(2, 3),), (torch.randn(2, 5), None)]},
        r"buckets\[1\]: .*buckets differ only in the shapes",
    ),
    "a constant differs after a tensor": (
        {"buckets": [(torch.randn(2, 3), 1), (torch.randn(2, 5), 2)]},
        r"buckets\[1\]: args\[1\]: expected int 1, got int 2 \(as buckets\[0\] has it\)",
    ),
    "a None where a tensor was, after a tensor": (
        {"buckets": [(torch.randn(2, 3), torch.ones(1)), (torch.randn(2, 5), None)]},
        r"buckets\[1\]: args\[1\]: expected a float32 tensor, got None \(as buckets\[0\] has it\)",
    ),
    "a list where a dict of int keys was": (  # said "args[0][1]: expected a float32 tensor,
        # got nothing": a list's and a dict's leaf paths have one text
        {"buckets": [({1: torch.randn(2, 3)},), ([torch.randn(2, 5), torch.randn(2, 5)],)]},
        r"buckets\[1\]: args\[0\]: expected a dict with keys \[1\], got a list of length 2 \(as "
        r"buckets\[0\] has it\)",
    ),
    "a dict in another key order": (
        {
            "buckets": [
                (torch.randn(2, 3), {"a": torch.ones(1), "b": torch.ones(1)}),
                (torch.randn(2, 5), {"b": torch.ones(1), "a": torch.ones(1)}),
            ]
        },
        r"buckets\[1\]: args\[1\]: a dict with its keys in the order \['b', 'a'\], captured in the "
        r"order \['a', 'b'\] \(as buckets\[0\] has it\)",
    ),
    "same shapes twice": (
        {"buckets": [(torch.randn(2, 3),), (torch.randn(2, 3),)]},
        r"buckets\[1\] has the same input shapes as buckets\[0\]",
    ),
    "empty": ({"buckets": []}, "buckets= is a non-empty list"),
    "sample_args too": (
        {"sample_args": (torch.randn(2, 3),), "buckets": [(torch.randn(2, 3),)]},
        "not both",
    ),
    "fallback without buckets": (
        {"sample_args": (torch.randn(2, 3),), "fallback": "eager"},
        "go with buckets=",
    ),
    "dynamic_dims without pad": (
        {"buckets": [(torch.randn(2, 3),)], "dynamic_dims": {"args[0]": 1}},
        "dynamic_dims= goes with fallback='pad'",
    ),
    "unknown fallback": (
        {"buckets": [(torch.randn(2, 3),)], "fallback": "resize"},
        "fallback must be one of",
    ),
    "kwargs per bucket of another count": (
        {"buckets": [(torch.randn(2, 3),)], "sample_kwargs": [{}, {}]},
        "a list with one dict",
    ),
    "no samples": ({}, "sample_args is required"),
    "valid_length passed by position": (  # was a TypeError at warmup, naming no sample
        {
            "buckets": [(torch.randn(2, n), None) for n in (3, 5)],
            "fallback": "pad",
            "dynamic_dims": {"args[0]": 1, "output": 1},
        },
        r"^buckets\[0\]: args\[1\] is .*double's 'valid_length' parameter, which fallback='pad' "
        r"passes itself \(by keyword\); leave it out of the sample",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_bucket_requests_are_refused(case: str) -> None:
    options, message = BAD_REQUESTS[case]

    def double(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return x * 2

    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(double, **options)


def test_buckets_for_several_callables_or_a_pool_are_refused() -> None:
    layers = (nn.Linear(3, 3), nn.Linear(3, 3))
    with pytest.raises(DualgraphError, match="buckets= graphs one callable"):
        dgt.make_graphed_callables(layers, buckets=[(torch.randn(2, 3),)])
    with pytest.raises(DualgraphError, match="pool= cannot go with buckets="):
        dgt.make_graphed_callables(layers[0], buckets=[(torch.randn(2, 3),)], pool=(0, 1))
    assert not hasattr(layers[0], "_dualgraph_graphed")


# -- diagnostics, logs, copies ---------------------------------------------------------------------


def test_diagnostics_count_each_buckets_calls_and_bytes() -> None:
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dgt.make_graphed_callables(block, buckets=block_buckets(torch.device("cpu")), fallback="eager")
    for length in (9, 5, 9, 6):
        block(tokens(torch.device("cpu"), length))
    report = dgt.diagnostics(block)
    assert isinstance(report, dgt.BucketedDiagnostics)
    assert [b.shapes for b in report.buckets] == [{"args[0]": (2, n, 16)} for n in (5, 7, 9)]
    assert [b.calls for b in report.buckets] == [1, 0, 2]
    assert (report.replays, report.eager_calls, report.fallback) == (3, 1, "eager")
    last = [b.last_used for b in report.buckets]
    assert last[1] is None and last[0] is not None and last[2] is not None and last[0] <= last[2]
    assert [b.static_input_bytes for b in report.buckets] == [2 * n * 16 * 4 for n in (5, 7, 9)]
    assert report.static_input_bytes == sum(b.static_input_bytes for b in report.buckets)
    parameter_bytes = sum(p.numel() * 4 for p in block.parameters())
    assert report.static_grad_bytes < sum(b.static_grad_bytes for b in report.buckets)
    assert report.static_grad_bytes >= parameter_bytes  # one set of parameter grads for all
    assert report.pool_bytes == report.largest_bucket_pool_bytes == 0  # no pool on the CPU


class _ScalesByGradMode(nn.Module):
    """Branches on grad mode: a call under no_grad runs it eagerly instead of replaying."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if torch.is_grad_enabled() else 3.0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_buckets_call_run_eagerly_is_counted_as_an_eager_call_not_a_replay(
    backend: str,
) -> None:
    device = device_of(backend)
    module = _ScalesByGradMode().to(device)
    buckets = [(torch.randn(n, 4, device=device, requires_grad=True),) for n in (2, 3)]
    dgt.make_graphed_callables(module, buckets=buckets, backend=backend)
    module(torch.randn(2, 4, device=device, requires_grad=True))
    with torch.no_grad():
        module(torch.randn(3, 4, device=device))
    report = dgt.diagnostics(module)
    assert (report.replays, report.eager_calls) == (1, 1)
    assert [b.calls for b in report.buckets] == [1, 1]  # each bucket served one call


def test_the_log_says_which_bucket_served_a_call_and_why_one_fell_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dgt.make_graphed_callables(block, buckets=block_buckets(torch.device("cpu")), fallback="eager")
    with caplog.at_level(logging.DEBUG, logger="dualgraph.torch.buckets"):
        block(tokens(torch.device("cpu"), 7))
        block(tokens(torch.device("cpu"), 4))
    assert caplog.messages == [
        "ViTBlock: bucket 1 (args[0]=[2, 7, 16]) served a call",
        "ViTBlock: a call of args[0]=[2, 4, 16] matches no bucket; fallback='eager': it runs "
        "eagerly",
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dualgraph.torch.buckets"):
        block(tokens(torch.device("cpu"), 7))
    assert caplog.messages == []


def test_a_copy_of_a_bucketed_module_is_a_plain_module() -> None:
    block, _ = twins(lambda: ViTBlock(16, 2), torch.device("cpu"))
    dgt.make_graphed_callables(block, buckets=block_buckets(torch.device("cpu")))
    clone = copy.deepcopy(block)
    assert clone(torch.randn(2, 4, 16))[0].shape == (2, 4, 16)  # any shape: eager
    assert clone.qkv.weight is not block.qkv.weight
    dgt.restore(block)
    assert block(torch.randn(2, 4, 16))[0].shape == (2, 4, 16)


def test_a_bucketed_function_repr_and_copy() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    graphed = dgt.make_graphed_callables(double, buckets=[(torch.ones(2),), (torch.ones(3),)])
    assert repr(graphed) == (
        "BucketedCallable('test_a_bucketed_function_repr_and_copy.<locals>.double', "
        "backend='emulate', buckets=2, fallback='error')"
    )
    assert copy.copy(graphed) is double
    assert [runner.name for runner in graphed.runners] == [
        "test_a_bucketed_function_repr_and_copy.<locals>.double[args[0]=[2]]",
        "test_a_bucketed_function_repr_and_copy.<locals>.double[args[0]=[3]]",
    ]


# -- memory: one pool sized by the largest bucket (GPU) -------------------------------------------


@pytest.mark.cuda
def test_pool_of_all_buckets_is_at_most_a_quarter_larger_than_the_largest_alone() -> None:
    device = device_of(CUDA)
    settings, sizes = encoder_sizes(CUDA)
    batch = 8

    def images(size: int) -> torch.Tensor:
        return torch.randn(batch, 3, size, size, device=device)

    alone = VisionEncoder(**settings).to(device)
    dgt.make_graphed_callables(alone, buckets=[(images(max(sizes)),)])
    largest = dgt.diagnostics(alone).pool_bytes
    encoder = VisionEncoder(**settings).to(device)
    dgt.make_graphed_callables(encoder, buckets=[(images(s),) for s in sizes])
    report = dgt.diagnostics(encoder)
    assert largest > 0 and report.pool_bytes > 0
    # Against the largest captured alone, and against the same pool after its first capture
    # (that of the largest bucket): a one-time allocation such as cuBLAS's workspace for the
    # capture stream lands in whichever pool is captured first in the process.
    for reference in (largest, report.largest_bucket_pool_bytes):
        assert report.pool_bytes <= 1.25 * reference, (
            f"pool of {len(sizes)} buckets {report.pool_bytes} B vs the largest alone {reference} B"
        )
    separate = 0
    for size in sizes:  # what one pool per bucket would take
        one = VisionEncoder(**settings).to(device)
        dgt.make_graphed_callables(one, buckets=[(images(size),)])
        separate += dgt.diagnostics(one).pool_bytes
    assert report.pool_bytes < 0.8 * separate


@pytest.mark.cuda
def test_cuda_buckets_keep_outputs_and_grads_outside_the_pool() -> None:
    device = device_of(CUDA)
    block = ViTBlock(16, 2).to(device)
    dgt.make_graphed_callables(block, buckets=block_buckets(device))
    pools = {
        tuple(segment["segment_pool_id"])
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    }
    assert pools, "no private pool found"
    ranges = [
        (segment["address"], segment["address"] + segment["total_size"])
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) in pools
    ]
    for runner in runner_of(block).runners:  # type: ignore[union-attr]
        plan = runner.plan
        kept = [
            *plan.buffers.outputs,
            *plan.buffers.input_grads,
            *plan.buffers.param_grads,
            *plan.buffers.grad_outputs,
            *plan.params.accumulators,
        ]
        for tensor in kept:
            if tensor is not None and tensor.numel():
                address = tensor.data_ptr()
                assert not any(start <= address < end for start, end in ranges), runner.name


@pytest.mark.parametrize("fallback", ["error", "eager"])
@pytest.mark.parametrize(
    ("backend", "param_grads", "kind"),
    [
        pytest.param(*p.values, kind, marks=p.marks, id=f"{p.id}-{kind}")
        for p in GRAPH_GRAD_MODES
        if p.values[1] != "autograd"
        for kind in ("plain", "inputs")
        if not (p.values[1] == "in_graph" and kind == "inputs")
    ],
)
def test_a_grad_kept_after_zero_grad_is_never_written_by_a_bucket(
    backend: str, param_grads: str, kind: str, fallback: str
) -> None:
    # The buckets share the accumulators and count who holds them once all are built: a
    # reference of the capture's own counted then hid the user's one, whose tensor the next
    # backward (in-graph, or into zeroed accumulators for autograd's copies) overwrote.
    device = device_of(backend)
    layer, twin = twins(lambda: nn.Linear(4, 4), device)
    samples = [(torch.randn(n, 4, device=device),) for n in (2, 3)]
    dgt.make_graphed_callables(
        layer, buckets=samples, backend=backend, param_grads=param_grads, fallback=fallback
    )
    for n in (3, 2, 3):
        x = torch.randn(n, 4, device=device)
        for module in (layer, twin):
            module(x).square().sum().backward()
        held = [(m.weight.grad, m.weight.grad.clone()) for m in (layer, twin)]
        for module in (layer, twin):
            module.zero_grad(set_to_none=True)
        x = torch.randn(5 - n, 4, device=device)  # the other bucket
        for module in (layer, twin):
            loss = module(x).square().sum()
            if kind == "inputs":  # "auto": autograd's copies, from zeroed accumulators
                loss.backward(inputs=[module.weight, module.bias])
            else:
                loss.backward()
        for module, (grad, values) in zip((layer, twin), held, strict=True):
            assert_tensors_match(grad, values, "a .grad kept after zero_grad(set_to_none=True)")
            assert module.weight.grad is not grad
        assert_tensors_match(layer.weight.grad, twin.weight.grad, "weight grad")


def _bucket_buffers(graphed: Any) -> list[torch.Tensor]:
    """Every static buffer of every bucket, cloned."""
    tensors = []
    for runner in runner_of(graphed).runners:
        buffers = runner.plan.buffers
        for tensor in (*buffers.inputs, *buffers.outputs, *buffers.grad_outputs):
            tensors.append(tensor.detach().clone().view(torch.uint8))  # NaN equals itself
    return tensors


@pytest.mark.parametrize("refused", ["dtype", "autocast", "shape", "tree"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_refused_call_leaves_the_pending_backward_of_another_bucket_valid(
    backend: str, refused: str
) -> None:
    device = device_of(backend)
    block, twin = twins(lambda: ViTBlock(16, 2), device)
    dgt.make_graphed_callables(block, buckets=block_buckets(device), backend=backend)
    x = tokens(device, 5)
    hidden, _ = block(x)
    before = _bucket_buffers(block)
    report = copy.deepcopy(dgt.diagnostics(block))
    expected, message = {
        "dtype": (
            SpecMismatchError,
            r"^args\[0\]: expected float32\[2, 9, 16\] on .*, got float64",
        ),
        "autocast": (
            DualgraphError,
            r"^ViTBlock\[args\[0\]=\[2, 9, 16\]\]: called under torch\.autocast",
        ),
        "shape": (SpecMismatchError, r"^args\[0\]: got shape \[2, 6, 16\], which no bucket"),
        "tree": (SpecMismatchError, r"^kwargs\['extra'\]: unexpected entry int 1"),
    }[refused]
    with pytest.raises(expected, match=message):
        if refused == "dtype":  # bucket 2's shape, another dtype: found by shape, then refused
            block(torch.randn(2, 9, 16, device=device, dtype=torch.float64))
        elif refused == "autocast":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                block(tokens(device, 9))
        elif refused == "shape":
            block(tokens(device, 6))
        else:
            block(tokens(device, 9), extra=1)
    for k, (a, b) in enumerate(zip(_bucket_buffers(block), before, strict=True)):
        assert torch.equal(a, b), f"static buffer {k} changed"
    after = dgt.diagnostics(block)
    assert [b.calls for b in after.buckets] == [b.calls for b in report.buckets]
    assert after.replays == report.replays
    x_eager = fresh_copy(x)
    expected, _ = twin(x_eager)
    hidden.square().mean().backward()  # the earlier call's backward runs as it would have
    expected.square().mean().backward()
    assert_tensors_match(x.grad, x_eager.grad, "input grad", tolerance(backend))
    for (name, p), q in zip(block.named_parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, q.grad, f"grad of {name}", tolerance(backend))


class _HalvesACache(nn.Module):
    """Halves a (2, 4, 4) buffer of its own in place, then reads its input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("cache", torch.ones(2, 4, 4))

    def forward(self, x: torch.Tensor, valid_length: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            self.cache.mul_(0.5)
        return self.linear(x)


def test_a_padded_input_sharing_memory_with_a_buffer_the_callable_updates_is_refused() -> None:
    # The replay is handed a padded copy of the caller's tensor, so the check on the replay's
    # inputs never saw that the caller's shares memory with the buffer: eager reads it after the
    # update, the padded copy was made before (silently another output).
    module = _HalvesACache()
    dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(2, 3, 4),), (torch.randn(2, 5, 4),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="emulate",
    )
    before = module.cache.clone()
    with pytest.raises(DualgraphError, match=r"args\[0\] shares memory with _HalvesACache\.cache"):
        module(module.cache)
    assert torch.equal(module.cache, before)
    assert module(module.cache.clone()).shape == (2, 4, 4)  # a copy is padded as before


def _doubles_its_state_then_reads_x(
    x: torch.Tensor, state: torch.Tensor, valid_length: Any = None
) -> torch.Tensor:
    state.mul_(2)
    return x.sum(1) + state.sum()


@pytest.mark.parametrize("how", ["view", "from_numpy"])
def test_an_updated_input_sharing_memory_with_a_padded_input_is_refused(how: str) -> None:
    # The replay is handed a padded copy of x, so its check of inputs sharing memory with one
    # it updates saw none: eager reads the doubled row through the caller's x, the padded copy
    # was made before (silently another output).
    graphed = dgt.make_graphed_callables(
        _doubles_its_state_then_reads_x,
        buckets=[(torch.randn(4, 3), torch.randn(3)), (torch.randn(8, 3), torch.randn(3))],
        fallback="pad",
        dynamic_dims={"args[0]": 0, "output": 0},
        backend="emulate",
    )
    earlier = graphed(torch.randn(3, 3), torch.randn(3))
    earlier_value = earlier.clone()
    x = torch.randn(3, 3)
    # from_numpy of a numpy view: another storage over the same bytes
    state = x[1] if how == "view" else torch.from_numpy(x.numpy()[1])
    x_before = x.clone()
    with pytest.raises(
        SpecMismatchError, match=r"^args\[1\] and args\[0\] share memory, and .* updates args\[1\]"
    ):
        graphed(x, state)
    assert torch.equal(x, x_before), "the refused call updated the caller's tensor"
    assert torch.equal(earlier, earlier_value), "the refused call wrote a static buffer"
    x, state = torch.randn(3, 3), torch.randn(3)
    x_eager, state_eager = x.clone(), state.clone()
    assert torch.equal(graphed(x, state), _doubles_its_state_then_reads_x(x_eager, state_eager))
    assert torch.equal(state, state_eager)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_a_callable_raising_in_the_padding_check_is_a_capture_error_and_leaves_it_usable(
    backend: str,
) -> None:
    class FailsPadded(nn.Module):  # the padding check runs it in eval mode
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
            self.calls += 1
            if not self.training:
                raise ValueError("not in training")
            return self.fc(x)

    module = FailsPadded()
    buckets = [(torch.randn(n, 4, requires_grad=True),) for n in (2, 3)]
    dims = {"args[0]": 0, "output": 0}
    with pytest.raises(CaptureError, match=r"padding check.*not in training"):
        dgt.make_graphed_callables(
            module, buckets=buckets, backend=backend, fallback="pad", dynamic_dims=dims
        )
    assert torch.equal(module.calls, torch.zeros(()))
    assert module(torch.ones(2, 4), valid_length=torch.tensor(2)).shape == (2, 4)


def _masked_rows(x: torch.Tensor, mask: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """Per-position rows times a per-position mask: both follow the length."""
    return torch.tanh(x) * mask[..., None]


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_a_padding_check_failing_on_an_input_left_out_of_dynamic_dims_names_it(
    backend: str,
) -> None:
    # The mask follows the length but is not declared: the check's short call cuts x alone,
    # and the callable's own error (a size mismatch) named no input.
    buckets = [(torch.randn(2, n, 4, requires_grad=True), torch.ones(2, n)) for n in (4, 6)]
    with pytest.raises(
        CaptureError,
        match=r"size of tensor.*\. args\[1\] \(dim 1\): holds each bucket's length but is not in "
        r"dynamic_dims.*declare it \('args\[1\]': 1\)$",
    ):
        dgt.make_graphed_callables(
            _masked_rows,
            buckets=buckets,
            backend=backend,
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
        )
    declared = dgt.make_graphed_callables(
        _masked_rows,
        buckets=buckets,
        backend=backend,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "args[1]": 1, "output": 1},
    )
    x, mask = torch.randn(2, 5, 4), (torch.rand(2, 5) > 0.5).float()
    torch.testing.assert_close(declared(x, mask), _masked_rows(x, mask))


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_one_backward_through_two_buckets_is_refused_before_any_grad_changes(
    backend: str, param_grads: str
) -> None:
    """A replay of one bucket expires the other's pending backward; one backward through both
    runs the later one's first, which must not add its grads before the earlier one refuses."""
    device = device_of(backend)
    layer = nn.Linear(8, 8).to(device)
    graphed = dgt.make_graphed_callables(
        layer,
        buckets=[(torch.randn(n, 8, device=device, requires_grad=True),) for n in (2, 4)],
        backend=backend,
        param_grads=param_grads,
    )
    xs = [torch.randn(n, 8, device=device, requires_grad=True) for n in (2, 4)]
    first, second = graphed(xs[0]), graphed(xs[1])
    with pytest.raises(DualgraphError, match="earlier replay"):
        (first.sum() + second.sum()).backward()
    assert xs[1].grad is None
    assert all(p.grad is None for p in layer.parameters())
    second.sum().backward()
    assert xs[1].grad is not None


class _FusedWgrad(torch.autograd.Function):
    """Fused weight-grad accumulation (TE's fuse_wgrad_accumulation): the backward adds into
    ``weight.main_grad`` and sets ``grad_added_to_main_grad``; autograd gets a dummy grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.weight = weight
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        weight.main_grad.add_(grad.flatten(0, -2).t() @ x.flatten(0, -2))
        weight.grad_added_to_main_grad = True
        return grad @ weight, torch.zeros_like(weight)


class FusedWgradTokens(nn.Module):
    """A per-token projection (padding stays out of it) with fused weight-grad accumulation."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.weight.main_grad = torch.zeros(4, 4)  # type: ignore[attr-defined]
        self.weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return _FusedWgrad.apply(x, self.weight)


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs' features; ``masked``: over the positions
    ``valid_length`` says are the call's own, else over every position (padding too)."""

    def __init__(self, masked: bool = True) -> None:
        super().__init__()
        self.masked = masked
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.scaled(x, valid_length)

    def scaled(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        length = x.shape[1] if valid_length is None or not self.masked else valid_length
        keep = (torch.arange(x.shape[1], device=x.device) < length)[None, :, None]
        with torch.no_grad():
            mean = (x * keep).sum((0, 1)) / (length * x.shape[0])
            self.mean.mul_(0.9).add_(0.1 * mean)
        return x * 2


def _graphed_by(how: str, stat: RunningMean) -> Any:
    """``stat``'s work as a function closing over it, or as its method."""
    if how == "method":
        return stat.scaled

    def scaled(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return stat(x, valid_length)

    return scaled


@pytest.mark.parametrize("how", ["function", "method"])
def test_pad_check_leaves_the_buffers_a_function_or_method_names_as_it_found_them(
    how: str,
) -> None:
    """The check's eager calls updated the running mean of the module a graphed function names
    (or a graphed method's module), and nothing put it back: graphing moved it."""
    stat = RunningMean()
    dgt.make_graphed_callables(
        _graphed_by(how, stat),
        buckets=[(torch.randn(2, 8, 4),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="emulate",
    )
    assert torch.equal(stat.mean, torch.zeros(4))


@pytest.mark.parametrize("how", ["function", "method"])
def test_pad_refuses_a_function_or_method_whose_buffer_update_counts_the_padding(
    how: str,
) -> None:
    """A module's own buffers were compared; those a graphed function names, or a graphed
    method's module's, were not: padded calls updated them with the padding counted."""
    with pytest.raises(DualgraphError, match=r"buffer .*mean \(updated by the call\) differs"):
        dgt.make_graphed_callables(
            _graphed_by(how, RunningMean(masked=False)),
            buckets=[(torch.randn(2, 8, 4),)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend="emulate",
        )


def _centred_by(body: nn.Module, masked: bool) -> Any:
    """A function closing over ``body`` that centres its features over positions: the
    positions ``valid_length`` says are the call's own (``masked``), or all of them."""

    def centred(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        hidden = body(x)
        if not masked or valid_length is None:
            return hidden - hidden.mean(1, keepdim=True)
        keep = (torch.arange(x.shape[1], device=x.device) < valid_length)[None, :, None]
        return hidden - (hidden * keep).sum(1, keepdim=True) / valid_length

    return centred


def test_pad_checks_a_function_naming_a_module_with_dropout_with_its_dropout_off() -> None:
    """The modules a function names kept their training mode and dropout in the check, which
    then took the function for one drawing random numbers and let a mean counting the padding
    through; a module graphed itself gets eval mode (and dropout at p=0 in its own modes)."""
    body = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).requires_grad_(False)
    with pytest.raises(DualgraphError, match=r"centred: output differs .* padded to 8"):
        dgt.make_graphed_callables(
            _centred_by(body, masked=False),
            buckets=[(torch.randn(2, 8, 4),)],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend="emulate",
        )
    # masked, it passes, its modules' modes and dropout as they were
    dgt.make_graphed_callables(
        _centred_by(body, masked=True),
        buckets=[(torch.randn(2, 8, 4),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="emulate",
    )
    assert body.training and body[1].training and body[1].p == 0.1


class Totalled(nn.Module):
    """Adds its hidden states, summed over positions, into a total passed in (updated in
    place); ``masked``: over the positions ``valid_length`` says are the call's own."""

    def __init__(self, masked: bool, off_by: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.masked = masked
        self.off_by = off_by  # a mask off by one where 1

    def forward(self, x: torch.Tensor, total: torch.Tensor, valid_length: Any = None) -> Any:
        hidden = self.fc(x)
        kept = hidden
        if self.masked and valid_length is not None:
            keep = torch.arange(x.shape[1], device=x.device) < valid_length - self.off_by
            kept = hidden * keep[:, None]
        with torch.no_grad():
            total.add_(kept.sum(1))
        return hidden


@pytest.mark.parametrize("masked", [False, True])
def test_pad_compares_an_input_the_call_updates_in_place(masked: bool) -> None:
    """An input updated in place (not padded) was left out of the check: a total counting the
    padded positions (fc(0) is the bias) came back into the caller's tensor off eager's."""
    module = Totalled(masked)
    twin = copy.deepcopy(module)
    graph = functools.partial(
        dgt.make_graphed_callables,
        module,
        buckets=[(torch.randn(2, 8, 4, requires_grad=True), torch.zeros(2, 4))],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="emulate",
    )
    if not masked:
        with pytest.raises(DualgraphError, match=r"args\[1\] \(updated by the call\) differs"):
            graph()
        return
    graph()
    x = torch.randn(2, 5, 4, requires_grad=True)
    total, expected = torch.zeros(2, 4), torch.zeros(2, 4)
    module(x, total)
    twin(x, expected)
    assert_tensors_match(total, expected, "the total", PAD_TOLERANCE)


def test_pad_compares_an_input_updated_in_place_told_and_untold() -> None:
    """Told its full length, the call masked its last position out of the total (its outputs
    do not show it): padded and unpadded calls, both told, agree, and every replay, told,
    updated the caller's total off eager's untold one."""
    with pytest.raises(
        DualgraphError, match=r"args\[1\] \(updated by the call\) differs .* told valid_length"
    ):
        dgt.make_graphed_callables(
            Totalled(masked=True, off_by=1),
            buckets=[(torch.randn(2, 8, 4, requires_grad=True), torch.zeros(2, 4))],
            fallback="pad",
            dynamic_dims={"args[0]": 1, "output": 1},
            backend="emulate",
        )


class Scaled(nn.Module):
    """Scales its input by a buffer it only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("how", ["module", "function"])
def test_pad_check_moves_no_version_of_a_buffer_the_callable_only_reads(how: str) -> None:
    """Each of the check's calls copied the buffers back in with copy_, moving their version:
    a pending backward that saved one (as eager BatchNorm saves its running statistics)
    then failed, where graphing changes nothing eager sees."""
    module = Scaled()
    weight = torch.randn(4, requires_grad=True)
    pending = (weight * module.scale).sum()  # saves the buffer for the weight's grad

    def scaled(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return module(x, valid_length)

    dgt.make_graphed_callables(
        module if how == "module" else scaled,
        buckets=[(torch.randn(2, 8, 4),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="emulate",
    )
    pending.backward()
    assert torch.equal(weight.grad, module.scale)


def test_pad_check_takes_an_expanded_tensor_a_function_only_reads() -> None:
    """The check writes the tensors a function names back before each call; an expanded one
    (one element seen four times) cannot be written, and graphing failed for a function that
    only reads it."""
    bias = torch.ones(1).expand(4)

    def shifted(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return x + bias

    graphed = dgt.make_graphed_callables(
        shifted,
        buckets=[(torch.randn(2, 8, 4),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="emulate",
    )
    x = torch.randn(2, 5, 4)
    assert torch.equal(graphed(x), x + 1)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_check_leaves_a_fused_main_grad_and_its_flag_as_it_found_them(backend: str) -> None:
    """The padding check runs the callable's backward, which adds into main_grad itself and
    sets the flag: graphing must leave them as they were, as a capture does."""
    module = FusedWgradTokens()
    dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(2, n, 4, requires_grad=True),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    assert not module.weight.main_grad.any()  # type: ignore[attr-defined]
    assert module.weight.grad_added_to_main_grad is False  # type: ignore[attr-defined]


def doubled_drawing_on_the_host(x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """Per position (padding stays out), drawing from Python's ``random`` and numpy's global
    generator on the host (a sampled log line, a host-side augmentation) without using them."""
    random.random()
    np.random.rand()
    return x * 2


def test_the_padding_check_leaves_pythons_and_numpys_random_streams_as_it_found_them() -> None:
    """The check runs the callable eagerly, which eager would not have done; it put back only
    torch's generator, so a seeded run drew other host numbers after graphing succeeded. The
    eager backend runs nothing else while graphing: every draw seen is the check's."""
    random.seed(1)
    np.random.seed(1)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    dgt.make_graphed_callables(
        doubled_drawing_on_the_host,
        buckets=[(torch.randn(2, n, 4),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend="eager",
    )
    assert random.getstate() == python_state
    after = np.random.get_state()
    assert after[1].tolist() == numpy_state[1].tolist() and after[2] == numpy_state[2]


def masked_attention_pool(
    x: torch.Tensor, mask: torch.Tensor, valid_length: Any = None
) -> torch.Tensor:
    """Attention pooling over positions with a float keep-mask (1 keep, 0 drop), turned into an
    additive one as BERT-style models do: zero padding of the mask masks the padded positions."""
    scores = x.sum(-1) + (1.0 - mask) * -1e9
    return (torch.softmax(scores, dim=1).unsqueeze(-1) * x).sum(1)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_accepts_a_float_keep_mask_padded_with_zeros(backend: str) -> None:
    """Shifted below or above zero, a mask of ones and zeros is no mask any more (its ones
    become -1 or 3, its padded zeros stay): a correct masked call was refused."""
    torch.manual_seed(0)
    buckets = [(torch.randn(2, n, 4, requires_grad=True), torch.ones(2, n)) for n in (4, 8)]
    graphed = dgt.make_graphed_callables(
        masked_attention_pool,
        buckets=buckets,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "args[1]": 1},
        backend=backend,
    )
    x = torch.randn(2, 6, 4)
    assert_tensors_match(
        graphed(x, torch.ones(2, 6)), masked_attention_pool(x, torch.ones(2, 6)), "pad", None
    )


def masked_bce(probs: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
    """Binary cross-entropy of probabilities against a target of ones, per position (masked
    by cutting the output back): defined only for probabilities, it raises outside [0, 1]."""
    return F.binary_cross_entropy(probs, torch.ones_like(probs), reduction="none")


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_lets_through_a_callable_that_refuses_its_shifted_inputs(backend: str) -> None:
    """Shifted below or above zero, probabilities are none: the callable's own error there
    (binary_cross_entropy's range check) refused a correct callable; it cannot be judged on
    such values and is let through, as where its outputs are not finite."""
    torch.manual_seed(0)
    buckets = [(torch.rand(2, n, requires_grad=True),) for n in (4, 8)]
    graphed = dgt.make_graphed_callables(
        masked_bce,
        buckets=buckets,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    probs = torch.rand(2, 6)
    assert_tensors_match(graphed(probs), masked_bce(probs), "pad", None)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_pad_never_shifts_an_input_whose_values_keep_to_one_side_of_zero(backend: str) -> None:
    """Values on one side of zero may be a domain (probabilities, indices, lengths): shifted
    out of it, binary_cross_entropy or an index op is a device-side assert on CUDA, which no
    except catches and which leaves the process unusable. Only inputs taking both signs are
    shifted (for one-sided ones a padded zero already wins a max or min on the samples)."""
    seen: list[torch.Tensor] = []

    def recording_bce(probs: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        seen.append(probs.detach().clone())
        return masked_bce(probs)

    torch.manual_seed(0)
    buckets = [(torch.rand(2, n, requires_grad=True),) for n in (4, 8)]
    dgt.make_graphed_callables(
        recording_bce,
        buckets=buckets,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    assert seen and all(bool((t >= 0).all() and (t <= 1).all()) for t in seen)


class TagsItsTokens(nn.Module):
    """A per-token layer that marks its output (as Transformer Engine's fuser does)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        y = self.fc(x)
        y._do_not_clear = True  # type: ignore[attr-defined]
        return y


class MarksItsTokens(nn.Module):
    """A per-token layer that marks its input (as Transformer Engine's fuser does)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        x._do_not_clear = True  # type: ignore[attr-defined]
        return self.fc(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padded_calls_input_carries_what_the_callable_set_on_it(backend: str) -> None:
    # A padded call hands the callable (or the replay, which sets it again) a padded copy of
    # the caller's tensor: the mark went on the copy, where eager's goes on the caller's.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        MarksItsTokens().to(device),
        buckets=[(torch.randn(2, n, 4, device=device),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    for length in (3, 4, 6, 8):
        x = torch.randn(2, length, 4, device=device)
        assert graphed(x).shape == (2, length, 4)
        assert vars(x) == {"_do_not_clear": True}, length


class ScalesByItsTokens(nn.Module):
    """A per-token layer scaling by a value its caller hangs on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.fc(x) * getattr(x, "scale", 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padded_call_hands_the_callable_what_the_callers_tensor_carries(backend: str) -> None:
    # The padded copy carried none of the caller's attributes: the callable (or the capture,
    # whose static inputs carried none of the samples') scaled by 1.0 where eager's by 2.0.
    device = device_of(backend)
    module = ScalesByItsTokens().to(device)
    twin = copy.deepcopy(module)
    samples = [(torch.randn(2, n, 4, device=device),) for n in (4, 8)]
    for (sample,) in samples:
        sample.scale = 2.0  # type: ignore[attr-defined]
    graphed = dgt.make_graphed_callables(
        module,
        buckets=samples,
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    for length in (3, 4, 6, 8):
        x = torch.randn(2, length, 4, device=device)
        x.scale = 2.0  # type: ignore[attr-defined]
        assert torch.equal(graphed(x), twin(x)), length


class AttendsToItsTokens(nn.Module):
    """A per-token layer that turns its input's requires_grad on (a saliency map's pattern:
    ``x.grad`` after the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        x.requires_grad_()
        return self.fc(x).tanh()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_padded_call_turns_on_the_callers_tensor_the_callable_turns_on(backend: str) -> None:
    # A call whose tensor does not require grad runs eagerly (its sample's did), but a padded
    # one ran on a padded copy, which the callable turned on instead: the caller's x kept
    # requires_grad False and never got a grad, where eager's call turns it on.
    device = device_of(backend)
    module = AttendsToItsTokens().to(device)
    twin = copy.deepcopy(module)
    dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(2, n, 4, device=device, requires_grad=True),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    for length in (3, 4, 6, 8):
        x = torch.randn(2, length, 4, device=device)
        x_twin = x.clone()
        module(x).square().sum().backward()
        twin(x_twin).square().sum().backward()
        assert x.requires_grad and x.grad is not None, length
        assert_tensors_match(x.grad, x_twin.grad, "args[0].grad", PAD_TOLERANCE)


class PerToken(nn.Module):
    """A per-token layer whose backward reads its input (for the weight's grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> torch.Tensor:
        return self.fc(x).tanh()


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_padded_call_passing_an_inference_tensor_the_backward_reads_is_refused_as_eager(
    backend: str, param_grads: str
) -> None:
    # Eager raises 'Inference tensors cannot be saved for backward', and so does an exact call;
    # a padded call replayed on a padded copy (no inference tensor) and trained, silently.
    device = device_of(backend)
    module, twin = twins(PerToken, device)
    dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(2, n, 4, device=device),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
        param_grads=param_grads,
    )
    pending = module(torch.randn(2, 4, 4, device=device))  # a backward pending across it
    x = torch.randn(2, 3, 4, device=device)
    with torch.inference_mode():
        inference = x.clone()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        twin(inference)
    with pytest.raises(SpecMismatchError, match=r"^args\[0\]: an inference tensor"):
        module(inference)
    pending.square().sum().backward()  # the refused call replayed nothing
    assert module.fc.weight.grad is not None
    with torch.no_grad():  # no backward follows: eager takes it, and so does a replay
        assert_tensors_match(module(inference), twin(inference), "output", PAD_TOLERANCE)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_refused_padded_call_leaves_the_callers_requires_grad_as_it_was(backend: str) -> None:
    # The caller's tensor was turned on before the replay checked the call: a padded call
    # refused (here under an autocast the capture had not) left x requiring grad.
    device = device_of(backend)
    module = AttendsToItsTokens().to(device)
    twin = copy.deepcopy(module)
    dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(2, n, 4, device=device, requires_grad=True),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    x = torch.randn(2, 3, 4, device=device)
    with (
        torch.autocast(device.type, dtype=torch.bfloat16),
        pytest.raises(DualgraphError, match="captured outside torch"),
    ):
        module(x)
    assert not x.requires_grad
    x_twin = x.clone()
    module(x).square().sum().backward()  # the next good call, as eager's
    twin(x_twin).square().sum().backward()
    assert x.requires_grad and x.grad is not None
    assert_tensors_match(x.grad, x_twin.grad, "args[0].grad", PAD_TOLERANCE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padded_calls_output_carries_what_the_callable_set_on_it(backend: str) -> None:
    # A padded call hands out a copy cut back to the call's length: it lacked the attributes
    # the callable set on its output (which a replay sets again), where eager's output has them.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        TagsItsTokens().to(device),
        buckets=[(torch.randn(2, n, 4, device=device),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output": 1},
        backend=backend,
    )
    for length in (3, 4, 6, 8):
        y = graphed(torch.randn(2, length, 4, device=device))
        assert y.shape == (2, length, 4) and vars(y) == {"_do_not_clear": True}, length


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.trace.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_bucketed_call_under_torch_jit_trace_is_refused_naming_the_trace(backend: str) -> None:
    """The trace's sizes match no bucket: the call leaked StopIteration from the search for
    the differing input, where a graphed callable's replay refuses the trace by name."""
    device = device_of(backend)
    layer = nn.Linear(4, 4).to(device)
    buckets = [(torch.randn(rows, 4, device=device),) for rows in (2, 3)]
    dgt.make_graphed_callables(layer, buckets=buckets, backend=backend)
    with torch.no_grad(), pytest.raises(DualgraphError, match=r"^Linear: called under torch\.jit"):
        torch.jit.trace(layer, torch.randn(3, 4, device=device))
    x = torch.randn(3, 4, device=device)
    with torch.no_grad():  # still replays
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
