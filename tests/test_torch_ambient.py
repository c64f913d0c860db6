"""The numerics settings a replay runs in (``_ambient.py``): each call must find them as captured.

A CUDA graph replays the kernels, the precision and the dtypes chosen at capture; eager chooses
again on every call under the present default dtype, TF32 setting, deterministic algorithms and
attention kernels. A call under other settings is refused by name before any buffer is written,
and a call under the captured ones still equals eager.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from entry_points import ENTRY_POINTS, LENGTH, Decays, batch, call_length, graphed_on
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_cases import GRAPH_BACKENDS, assert_tensors_match, device_of, runner_of, tolerance

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch._ambient import NUMERICS_NAMES, kept_settings, numerics_state


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def _tf32_matmuls() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


@contextlib.contextmanager
def _deterministic(on: bool = True, warn_only: bool = False) -> Iterator[None]:
    saved = torch.are_deterministic_algorithms_enabled()
    saved_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved, warn_only=saved_warn_only)


@contextlib.contextmanager
def _mha_fastpath(on: bool) -> Iterator[None]:
    saved = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(on)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(saved)


#: A setting changed after capture, and the name the refusal gives it.
CHANGES: dict[str, tuple[Callable[[], Any], str]] = {
    "default_dtype": (lambda: _default_dtype(torch.float64), "torch.get_default_dtype()"),
    "tf32_matmuls": (_tf32_matmuls, "torch.backends.cuda.matmul.fp32_precision"),
    "deterministic": (_deterministic, "torch.are_deterministic_algorithms_enabled()"),
    "sdpa_kernel": (
        lambda: sdpa_kernel(SDPBackend.MATH),
        "torch.backends.cuda.flash_sdp_enabled()",
    ),
    "mha_fastpath": (
        lambda: _mha_fastpath(False),
        "torch.backends.mha.get_fastpath_enabled()",
    ),
}


def _attend(x: torch.Tensor) -> torch.Tensor:
    """An attention, a matmul, and a tensor made in the default dtype."""
    q = x.unsqueeze(0)
    out = F.scaled_dot_product_attention(q, q, q)[0] @ x.t()
    return out + torch.ones(out.shape[-1], device=x.device)


def test_the_names_cover_every_setting_read() -> None:
    assert len(NUMERICS_NAMES) == len(numerics_state())


def test_a_matmul_precision_left_to_its_default_reads_as_full_precision() -> None:
    # "none" defers to the generic setting (full fp32); dualgraph.parity sets "ieee" around its
    # calls, which must not count as a change
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "none"
        before = numerics_state()
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert numerics_state() == before
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def test_kept_settings_puts_back_every_numerics_setting_left_changed() -> None:
    # what a forward failing half-way may leave: an sdpa_kernel entered, never left, and
    # settings changed through torch's newer API
    before = numerics_state()
    put_back = kept_settings()
    sdpa_kernel(SDPBackend.MATH).__enter__()
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.backends.mha.set_fastpath_enabled(False)
    assert numerics_state() != before
    put_back()
    assert numerics_state() == before


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_call_under_another_numerics_setting_is_refused_before_any_buffer_is_written(
    backend: str, change: str
) -> None:
    setting, name = CHANGES[change]
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        _attend, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
    )
    kept = [t.clone() for t in (*graphed.static_inputs, *graphed.static_outputs)]
    generation = graphed.generation
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with setting(), pytest.raises(DualgraphError, match=f"called with {re.escape(name)} is"):
        graphed(x)
    assert graphed.generation == generation
    for buffer, before in zip((*graphed.static_inputs, *graphed.static_outputs), kept, strict=True):
        # by bytes: an output buffer never written holds what its memory held (NaN != NaN)
        assert torch.equal(buffer.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_callable_captured_under_a_setting_replays_under_it_as_eager(
    backend: str, change: str
) -> None:
    setting, _ = CHANGES[change]
    device = device_of(backend)
    with setting():
        graphed = dgt.make_graphed_callables(
            _attend, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
        )
        for _ in range(2):
            x = torch.randn(4, 8, device=device, dtype=torch.get_default_dtype())
            xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            out, expected = graphed(xg), _attend(xe)
            assert out.dtype == expected.dtype
            out.sum().backward()
            expected.sum().backward()
            assert_tensors_match(out, expected, "output", tolerance(backend))
            assert_tensors_match(xg.grad, xe.grad, "input grad", tolerance(backend))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_call_under_another_numerics_setting_is_refused_on_every_entry_point(entry: str) -> None:
    module = Decays()
    graphed = graphed_on(entry, module)
    before = module.stats.clone()
    with _deterministic(), pytest.raises(DualgraphError, match=r"called with torch\.are_determ"):
        graphed(batch(call_length(entry)))
    assert torch.equal(module.stats, before)  # the replay did not run


# "together" builds its other module in the block: under inference mode, with inference weights
@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e != "together"])
def test_graphing_under_inference_mode_captures_as_outside_it(entry: str) -> None:
    # inference mode records no autograd graph to capture a backward from; a graphing inside
    # it (an evaluation loop that graphs lazily) failed with "Inference tensors do not track
    # version counter"
    module = Decays()
    twin = copy.deepcopy(module)
    if entry in ("function", "method"):
        twin.requires_grad_(False)
    with torch.inference_mode():
        graphed = graphed_on(entry, module)
    x = batch(LENGTH)
    xe = x.detach().clone().requires_grad_()
    out, expected = graphed(x), twin(xe)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, xe.grad)
    assert torch.equal(module.stats, twin.stats)  # warmup's updates undone, as outside it
    if entry == "schedule":  # every forward of a schedule is followed by its backward
        return
    with torch.inference_mode():
        x = batch(LENGTH)
        assert torch.equal(graphed(x), twin(x))


def test_a_setting_changed_after_calls_under_the_captured_one_is_refused() -> None:
    # Each call compares the getters' readings with those an earlier call found to mean the
    # captured settings: readings that mean the same ("none" and "ieee") replay, and any other
    # reading, after any number of calls, is still refused.
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "none"
        graphed = dgt.make_graphed_callables(
            _attend, (torch.randn(4, 8, requires_grad=True),), backend="emulate"
        )
        x = torch.randn(4, 8, requires_grad=True)
        graphed(x)
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        graphed(x)
        graphed(x)
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        refused = pytest.raises(DualgraphError, match=r"matmul\.fp32_precision is 'tf32'")
        with refused:
            graphed(x)
        torch.backends.cuda.matmul.fp32_precision = "none"
        graphed(x)
        with _deterministic(), pytest.raises(DualgraphError, match="deterministic"):
            graphed(x)
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_change_of_deterministic_warn_only_after_capture_is_refused(backend: str) -> None:
    # Captured where a nondeterministic op only warned: eager raises at it once warn_only is
    # off, where a replay of the captured kernels would run silently.
    device = device_of(backend)
    with _deterministic(warn_only=True):
        graphed = dgt.make_graphed_callables(
            _attend, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
        )
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with _deterministic(warn_only=True):
        graphed(x)
    name = re.escape("torch.is_deterministic_algorithms_warn_only_enabled() is False")
    with _deterministic(warn_only=False), pytest.raises(DualgraphError, match=name):
        graphed(x)


@contextlib.contextmanager
def _fill_uninitialized_memory(on: bool) -> Iterator[None]:
    saved = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = on  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = saved  # type: ignore[attr-defined]


def _first_rows_doubled(x: torch.Tensor) -> torch.Tensor:
    """Rows 0 and 1 of ``x`` doubled into a fresh buffer whose other rows are left as made."""
    out = torch.empty_like(x)
    out[:2] = x[:2] * 2
    return out


@pytest.mark.parametrize("fill_at_capture", [False, True], ids=["filled-now", "unfilled-now"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_change_of_fill_uninitialized_memory_after_capture_is_refused(
    backend: str, fill_at_capture: bool
) -> None:
    # With deterministic algorithms on, eager fills what torch.empty makes (NaN in rows 2 and 3
    # here) where fill_uninitialized_memory is on, and leaves it where off; a replay keeps
    # capture's choice (a fill kernel captured, or the pool's stale memory).
    device = device_of(backend)
    with _deterministic(), _fill_uninitialized_memory(fill_at_capture):
        graphed = dgt.make_graphed_callables(
            _first_rows_doubled, (torch.randn(4, 8, device=device),), backend=backend
        )
        graphed(torch.randn(4, 8, device=device))
    name = re.escape(
        f"torch.utils.deterministic.fill_uninitialized_memory is {not fill_at_capture}"
    )
    with (
        _deterministic(),
        _fill_uninitialized_memory(not fill_at_capture),
        pytest.raises(DualgraphError, match=name),
    ):
        graphed(torch.randn(4, 8, device=device))


def test_fill_uninitialized_memory_without_deterministic_algorithms_is_no_change() -> None:
    # torch.empty fills only under deterministic algorithms: with them off the flag changes
    # nothing
    graphed = dgt.make_graphed_callables(
        _attend, (torch.randn(4, 8, requires_grad=True),), backend="emulate"
    )
    x = torch.randn(4, 8, requires_grad=True)
    expected = graphed(x).detach().clone()
    with _deterministic(on=False), _fill_uninitialized_memory(False):
        assert torch.equal(graphed(x), expected)


def test_warn_only_without_deterministic_algorithms_is_no_change() -> None:
    # warn_only says how deterministic algorithms refuse an op: with them off it changes nothing
    graphed = dgt.make_graphed_callables(
        _attend, (torch.randn(4, 8, requires_grad=True),), backend="emulate"
    )
    x = torch.randn(4, 8, requires_grad=True)
    expected = graphed(x).detach().clone()
    with _deterministic(on=False, warn_only=True):
        assert torch.equal(graphed(x), expected)


class _PaddedSelfAttention(torch.nn.Module):
    """A frozen ``nn.MultiheadAttention`` in eval, batch first, given a key padding mask: the
    conditions of its fast path (``torch._native_multi_head_attention``)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.register_buffer("padding", torch.arange(5) >= torch.tensor([5, 3, 4])[:, None])
        self.eval().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, key_padding_mask=self.padding, need_weights=False)[0]


def _graphed_attention() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A :class:`_PaddedSelfAttention` graphed (``emulate``, which runs its forward again, so
    that it meets torch's check of the flag) and an eager twin of it."""
    torch.manual_seed(0)
    module = _PaddedSelfAttention()
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(module, (torch.randn(3, 5, 16),), backend="emulate")
    return graphed, twin


@pytest.mark.parametrize("fastpath", [True, False])
def test_self_attention_replays_as_eager_under_the_captured_mha_fastpath(fastpath: bool) -> None:
    with _mha_fastpath(fastpath):
        graphed, twin = _graphed_attention()
        for _ in range(2):
            x = torch.randn(3, 5, 16)
            assert_tensors_match(graphed(x), twin(x), "output")


def test_turning_the_mha_fastpath_off_after_capture_is_refused() -> None:
    # Eager then leaves torch._native_multi_head_attention for the other path (other kernels;
    # on the CPU a sequence whose keys are all padded gives NaN on the fast path, zeros on the
    # other); a CUDA replay would run the fast path's kernels captured.
    graphed, _ = _graphed_attention()
    name = re.escape("torch.backends.mha.get_fastpath_enabled() is False, captured with True")
    with _mha_fastpath(False), pytest.raises(DualgraphError, match=name):
        graphed(torch.randn(3, 5, 16))


#: Settings that choose a backward's kernels again when eager's backward runs, changed between a
#: forward and its backward, and the name the refusal gives each.
BACKWARD_CHANGES = {change: CHANGES[change] for change in ("tf32_matmuls", "deterministic")}


@pytest.mark.parametrize("change", list(BACKWARD_CHANGES))
@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_under_another_matmul_or_determinism_setting_is_refused_and_can_run_after(
    backend: str, param_grads: str, change: str
) -> None:
    # The forward ran under the captured settings; eager's backward chooses its matmul kernels
    # (TF32) and raises at nondeterministic ops under the settings it runs in, where a graph's
    # backward replays what capture chose: a backward run after the setting changed is refused
    # by name, and once the setting is back the same backward runs, equal to eager's.
    setting, name = BACKWARD_CHANGES[change]
    device = device_of(backend)
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 8, device=device)
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(
        module,
        (torch.randn(4, 8, device=device, requires_grad=True),),
        backend=backend,
        param_grads=param_grads,
    )
    x = torch.randn(4, 8, device=device, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    loss = graphed(x).sum()
    with setting(), pytest.raises(DualgraphError, match=f"its backward ran with {re.escape(name)}"):
        loss.backward(retain_graph=True)
    assert x.grad is None and module.weight.grad is None
    loss.backward()
    twin(x_eager).sum().backward()
    tol = tolerance(backend)
    assert_tensors_match(x.grad, x_eager.grad, "input grad", tol)
    assert_tensors_match(module.weight.grad, twin.weight.grad, "weight grad", tol)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_under_another_default_dtype_runs_as_eagers(backend: str) -> None:
    # The default dtype and the attention kernels are the forward's choice (grads take the
    # forward's dtypes; an attention's backward is its forward op's): not refused at backward.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        _attend, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
    )
    x = torch.randn(4, 8, device=device, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    loss = graphed(x).sum()
    expected = _attend(x_eager).sum()
    with _default_dtype(torch.float64), sdpa_kernel(SDPBackend.MATH):
        loss.backward()
        expected.backward()
    assert_tensors_match(x.grad, x_eager.grad, "input grad", tolerance(backend))


# -- cuDNN's settings: compared for callables whose capture ran a convolution ---------------------


@contextlib.contextmanager
def _cudnn_flag(name: str, value: Any) -> Iterator[None]:
    owner: Any = torch.backends.cudnn
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    saved = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)


#: A cuDNN setting changed after capture (as torch.backends.cudnn names it, and the other value
#: it takes), and the name the refusal gives it.
CUDNN_CHANGES: dict[str, tuple[Callable[[], Any], str]] = {
    "conv_tf32": (
        lambda: _cudnn_flag("conv.fp32_precision", "ieee"),
        "torch.backends.cudnn.conv.fp32_precision",
    ),
    "deterministic": (
        lambda: _cudnn_flag("deterministic", True),
        "torch.backends.cudnn.deterministic",
    ),
    "enabled": (lambda: _cudnn_flag("enabled", False), "torch.backends.cudnn.enabled"),
    "benchmark": (lambda: _cudnn_flag("benchmark", True), "torch.backends.cudnn.benchmark"),
}


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


def _graphed_conv(backend: str, **options: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    device = device_of(backend)
    torch.manual_seed(0)
    module = _ConvNet().to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 2, 5, 5, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, **options)
    return module, twin


@pytest.mark.parametrize("change", list(CUDNN_CHANGES))
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_convolution_called_under_another_cudnn_setting_is_refused_naming_it(
    backend: str, change: str
) -> None:
    # A graph replays the cuDNN kernels chosen at capture (TF32 convolutions: ~1e-3 off), where
    # eager's convolution chooses again under the present settings: refused by name, before any
    # buffer is written; under the captured settings again it runs as eager.
    setting, name = CUDNN_CHANGES[change]
    module, twin = _graphed_conv(backend)
    x = torch.randn(2, 2, 5, 5, device=device_of(backend), requires_grad=True)
    with setting(), pytest.raises(DualgraphError, match=f"called with {re.escape(name)} is"):
        module(x)
    assert_tensors_match(module(x), twin(x), "output", tolerance(backend))


@pytest.mark.parametrize("change", list(CUDNN_CHANGES))
@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_convolutions_backward_under_another_cudnn_setting_is_refused_and_can_run_after(
    backend: str, param_grads: str, change: str
) -> None:
    # eager's convolution backward chooses its algorithms again when it runs (under the
    # settings then), a graph's replays capture's
    setting, name = CUDNN_CHANGES[change]
    module, twin = _graphed_conv(backend, param_grads=param_grads)
    x = torch.randn(2, 2, 5, 5, device=device_of(backend), requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    loss = module(x).sum()
    with setting(), pytest.raises(DualgraphError, match=f"its backward ran with {re.escape(name)}"):
        loss.backward(retain_graph=True)
    assert x.grad is None and module.conv.weight.grad is None
    loss.backward()
    twin(x_eager).sum().backward()
    tol = tolerance(backend)
    assert_tensors_match(x.grad, x_eager.grad, "input grad", tol)
    assert_tensors_match(module.conv.weight.grad, twin.conv.weight.grad, "weight grad", tol)


def _functional_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv1d(x, w)


class _FrozenConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 1, 3).requires_grad_(False)
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).detach())  # no node of the convolution reaches the output


class _Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(2, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize(
    ("found_by", "change"),
    [
        ("a convolution's node", ("deterministic", True)),
        ("a convolution module", ("deterministic", True)),
        ("an RNN module", ("rnn.fp32_precision", "ieee")),
    ],
    ids=["node", "frozen_conv_module", "rnn_module"],
)
def test_a_convolution_or_rnn_is_found_by_its_node_or_its_module(
    found_by: str, change: tuple[str, Any]
) -> None:
    sample = torch.randn(1, 1, 4)
    if found_by == "a convolution's node":
        w = torch.randn(1, 1, 3)  # the node comes from the input
        sample.requires_grad_()
        graphed: Any = dgt.make_graphed_callables(
            functools.partial(_functional_conv, w=w), (sample,), backend="emulate"
        )
    elif found_by == "a convolution module":
        graphed = dgt.make_graphed_callables(_FrozenConv(), (sample,), backend="emulate")
    else:
        sample = torch.randn(1, 3, 2)
        graphed = dgt.make_graphed_callables(_Recurrent(), (sample,), backend="emulate")
    with _cudnn_flag(*change), pytest.raises(DualgraphError, match=re.escape(change[0])):
        graphed(torch.randn(*sample.shape, requires_grad=sample.requires_grad))


def test_a_convolution_compares_the_convolutions_precision_not_the_rnns() -> None:
    # dualgraph.parity sets both to full precision: each callable follows the one it runs
    module, _ = _graphed_conv("emulate")
    with _cudnn_flag("rnn.fp32_precision", "ieee"):
        module(torch.randn(2, 2, 5, 5, requires_grad=True)).sum().backward()


def test_a_callable_without_a_convolution_reads_no_cudnn_setting() -> None:
    # dualgraph.parity runs its calls with convolutions in full precision: a callable that ran
    # no cuDNN op must not be refused there, nor pay for reading the settings
    module = torch.nn.Linear(4, 4)
    dgt.make_graphed_callables(module, (torch.randn(2, 4, requires_grad=True),), backend="emulate")
    for change in CUDNN_CHANGES.values():
        with change[0]():
            module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert runner_of(module).plan.cudnn is None


@pytest.mark.cuda
def test_a_convolution_under_another_tf32_setting_gives_eagers_result_or_is_refused() -> None:
    # the numeric effect on a GPU: capture's TF32 convolution is ~1e-3 off eager's fp32 one
    module, twin = _graphed_conv("cuda")
    x = torch.randn(2, 2, 5, 5, device="cuda", requires_grad=True) * 10
    with _cudnn_flag("conv.fp32_precision", "ieee"):
        expected = twin(x)
        try:
            out = module(x)
        except DualgraphError as refused:
            assert "torch.backends.cudnn.conv.fp32_precision" in str(refused)
            return
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
