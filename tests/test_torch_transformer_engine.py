"""Transformer Engine support: the capture context and TE's FP8 autocast state (everywhere, with
a stand-in for TE), and TE modules graphed through dualgraph in bf16 and FP8 with current scaling
(CUDA and the ``[te]`` extra; skipped otherwise), with delayed scaling refused. The layer returns
``(hidden, None)`` as Megatron's vision layers do, the case TE's own wrapper once needed a patch
for.

Tolerances: the graph replays the same TE kernels as eager, so outputs and grads are compared
with bf16 tolerances (rtol 1.6e-2, atol 1e-2) in bf16, and FP8 tolerances (rtol 5e-2, atol 5e-2)
under FP8.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types

import pytest
import torch

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError
from dualgraph.torch._transformer_engine import fp8_state, transformer_engine_capture

_HAS_TE = importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(not _HAS_TE, reason="needs transformer-engine (the [te] extra)")

SEQ, BATCH, HIDDEN, FFN, HEADS = 32, 2, 256, 1024, 4
# Seen on the H200 with TE 2.20.2: during the first (warmup) call, TorchDynamo, tracing one of
# TE's torch.compile'd fused ops, reads ``.grad`` of a non-leaf tensor and torch warns about it.
te_dynamo_warning = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}
FP8 = {"rtol": 5e-2, "atol": 5e-2}


class VisionLayer(torch.nn.Module):
    """A TE transformer layer with Megatron's vision-layer output: ``(hidden, None)``."""

    def __init__(self) -> None:
        super().__init__()
        import transformer_engine.pytorch as te

        self.layer = te.TransformerLayer(
            HIDDEN,
            FFN,
            HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.bfloat16,
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.layer(hidden), None


def _hidden(requires_grad: bool = True) -> torch.Tensor:
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x.requires_grad_(requires_grad)


def _quantization(recipe: object | None):  # type: ignore[no-untyped-def]
    import contextlib

    import transformer_engine.pytorch as te

    if recipe is None:
        return contextlib.nullcontext()
    return te.autocast(enabled=True, recipe=recipe)


def _train_and_compare(recipe: object | None, tolerance: dict[str, float]) -> None:
    torch.manual_seed(0)
    layer = VisionLayer().cuda()
    eager = copy.deepcopy(layer)
    with _quantization(recipe):
        graphed = dgt.make_graphed_callables(layer, (_hidden(),), backend="cuda")
    for _ in range(3):  # grads accumulate over three replays, as over micro-batches
        x = _hidden()
        x_eager = x.detach().clone().requires_grad_()
        with _quantization(recipe):
            hidden, extra = graphed(x)
            hidden_eager, _ = eager(x_eager)
        assert extra is None
        torch.testing.assert_close(hidden, hidden_eager, **tolerance)
        hidden.float().square().mean().backward()
        hidden_eager.float().square().mean().backward()
        torch.testing.assert_close(x.grad, x_eager.grad, **tolerance)
    torch.cuda.synchronize()
    for (name, param), param_eager in zip(
        layer.named_parameters(), eager.parameters(), strict=True
    ):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, param_eager.grad, **tolerance, msg=name)


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
def test_te_transformer_layer_in_bf16_matches_eager_over_replays() -> None:
    _train_and_compare(None, BF16)


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
def test_te_transformer_layer_in_fp8_current_scaling_matches_eager_over_replays() -> None:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        pytest.skip(f"FP8 not available: {reason}")
    _train_and_compare(recipe.Float8CurrentScaling(), FP8)


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
def test_te_transformer_layer_under_delayed_scaling_is_refused_naming_the_recipe() -> None:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        pytest.skip(f"FP8 not available: {reason}")
    layer = VisionLayer().cuda()
    with _quantization(recipe.DelayedScaling()), pytest.raises(CaptureError) as info:
        dgt.make_graphed_callables(layer, (_hidden(),), backend="cuda")
    assert "under Transformer Engine's FP8 recipe" in str(info.value)
    assert "DelayedScaling" in str(info.value)
    assert "forward" not in layer.__dict__


# -- the capture context and the FP8 state, with a stand-in for TE (runs everywhere) -------------


class DelayedScaling:
    """Stand-in for ``transformer_engine.common.recipe.DelayedScaling``."""

    @classmethod
    def delayed(cls) -> bool:
        return True

    def __repr__(self) -> str:
        return "recipe_type=DelayedScaling, margin=0"


class Float8CurrentScaling:
    """Stand-in for ``transformer_engine.common.recipe.Float8CurrentScaling``."""

    @classmethod
    def delayed(cls) -> bool:
        return False


class _FakeTransformerEngine:
    """Stand-in modules for the TE entry points dualgraph uses."""

    def __init__(self, *, graph_safe_rng: bool = True) -> None:
        self.fp8_enabled = False
        self.recipe: object = None
        fake = self

        class FP8GlobalStateManager:
            @classmethod
            def is_fp8_enabled(cls) -> bool:
                return fake.fp8_enabled

            @classmethod
            def get_fp8_recipe(cls) -> object:
                return fake.recipe

        self.quantization = types.ModuleType("transformer_engine.pytorch.quantization")
        self.quantization.FP8GlobalStateManager = FP8GlobalStateManager
        self.capturing = False
        self.events: list[str] = []
        self.generator_states = ["tracker-state-a", "tracker-state-b"]
        self.graph = types.ModuleType("transformer_engine.pytorch.graph")
        self.graph.is_graph_capturing = lambda: self.capturing
        self.graph.set_capture_start = self._start
        self.graph.set_capture_end = self._end
        self.distributed = types.ModuleType("transformer_engine.pytorch.distributed")
        self.distributed.graph_safe_rng_available = lambda: graph_safe_rng
        self.distributed.get_all_rng_states = lambda: {
            f"tracker{i}": s for i, s in enumerate(self.generator_states)
        }
        self.pytorch = types.ModuleType("transformer_engine.pytorch")
        self.pytorch.graph = self.graph
        self.pytorch.distributed = self.distributed
        self.pytorch.quantization = self.quantization

    def _start(self) -> None:
        self.capturing = True
        self.events.append("start")

    def _end(self) -> None:
        self.capturing = False
        self.events.append("end")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        top = types.ModuleType("transformer_engine")
        monkeypatch.setitem(sys.modules, "transformer_engine", top)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", self.pytorch)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.graph", self.graph)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.distributed", self.distributed)
        monkeypatch.setitem(
            sys.modules, "transformer_engine.pytorch.quantization", self.quantization
        )

    def fp8(self, recipe: object | None) -> None:
        """Enter (a recipe) or leave (``None``) TE's FP8 autocast."""
        self.fp8_enabled, self.recipe = recipe is not None, recipe


@pytest.mark.skipif(_HAS_TE, reason="TE is installed: the no-TE case is not reachable")
def test_capture_context_is_a_no_op_without_transformer_engine() -> None:
    with transformer_engine_capture() as generators:
        assert generators == []
    assert "transformer_engine.pytorch" not in sys.modules


def test_capture_context_marks_the_capture_and_yields_te_rng_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    with transformer_engine_capture() as generators:
        assert fake.capturing
        assert generators == ["tracker-state-a", "tracker-state-b"]
    assert not fake.capturing
    assert fake.events == ["start", "end"]


def test_capture_context_ends_the_mark_when_the_capture_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), transformer_engine_capture():
        raise RuntimeError("boom")
    assert not fake.capturing
    assert fake.events == ["start", "end"]


def test_capture_context_leaves_an_outer_te_capture_marked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    fake.capturing = True  # inside TE's own make_graphed_callables
    with transformer_engine_capture():
        pass
    assert fake.capturing
    assert fake.events == []


def test_capture_context_registers_no_generators_without_graph_safe_rng(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine(graph_safe_rng=False)
    fake.install(monkeypatch)
    with transformer_engine_capture() as generators:
        assert generators == []


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_fp8_state_is_none_without_transformer_engine_and_read_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not _HAS_TE:
        assert fp8_state() is None
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    assert fp8_state() == (False, None)
    fake.fp8(Float8CurrentScaling())
    assert fp8_state() == (True, "Float8CurrentScaling")


def test_capture_under_delayed_scaling_is_refused_naming_the_recipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    fake.fp8(DelayedScaling())
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError) as info:
        dgt.make_graphed_callables(layer, (torch.randn(2, 4),), backend="emulate")
    assert str(info.value).startswith(
        "capturing Linear under Transformer Engine's FP8 recipe recipe_type=DelayedScaling, "
        "margin=0 is not supported: with delayed scaling, TE updates the amax history and "
        "scales when an autocast region exits"
    )
    assert "forward" not in layer.__dict__


def test_replays_run_in_the_fp8_state_they_were_captured_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    fake.fp8(Float8CurrentScaling())
    graphed = dgt.make_graphed_callables(_double, (torch.ones(3),), backend="emulate")
    assert torch.equal(graphed(torch.ones(3)), torch.full((3,), 2.0))
    fake.fp8(None)
    with pytest.raises(DualgraphError) as info:
        graphed(torch.ones(3))
    assert str(info.value) == (
        "_double: called with Transformer Engine FP8 autocast (enabled, recipe) (False, None) "
        "but captured with (True, 'Float8CurrentScaling'); a graph replays the precision it was "
        "captured in"
    )


def test_replays_of_a_capture_without_fp8_are_refused_under_fp8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeTransformerEngine()
    fake.install(monkeypatch)
    graphed = dgt.make_graphed_callables(_double, (torch.ones(3),), backend="emulate")
    fake.fp8(Float8CurrentScaling())
    with pytest.raises(DualgraphError, match="Transformer Engine FP8 autocast"):
        graphed(torch.ones(3))
