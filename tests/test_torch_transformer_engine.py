"""Transformer Engine support: per-callable precision, the FP8 bookkeeping of every replay, weight
caching, capture-time behaviour and TE's entry points.

Two halves:

- **Everywhere** (no TE, no GPU): a stand-in for TE (``te_stand_in.py``) that keeps TE's global
  FP8 state as TE 2.20 does, and a TE-like layer under delayed scaling. The argument checks, the
  autocast each callable is captured in, the checks of every replay, and graphed training against
  eager training with the stand-in (scales, amax histories, outputs, grads and weights equal bit
  for bit over three SGD steps of two micro-batches, with and without weight caching).
- **CUDA with TE** (the ``[te]`` extra; skipped otherwise, and per recipe where the GPU lacks it,
  by TE's own ``is_*_available`` checks): Transformer Engine's graphed-vs-eager test
  (``tests/pytorch/test_cuda_graphs.py``) re-expressed: seven modules, three dtypes, no FP8 and
  the delayed, current and block scaling recipes, FP8 weights on and off, weight caching on and
  off, three SGD steps of two micro-batches; outputs, grads, weights and FP8 scales equal to eager
  bit for bit. A one-line summary per recipe is printed at the end of the file's tests.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from te_stand_in import (
    Chain,
    CustomRecipe,
    DelayedScaling,
    FakeFP8Linear,
    FakeFP8Weight,
    Float8CurrentScaling,
    FutureRecipe,
    StandIn,
    fp8_weight_linear,
)

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError
from dualgraph.torch._transformer_engine import transformer_engine_capture

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

#: Per recipe, how many graphed-vs-eager CUDA cases passed, failed and skipped.
SUMMARY: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for recipe, counts in sorted(SUMMARY.items()):
        line = (
            f"TE graphed vs eager, recipe {recipe}: {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['skipped']} skipped; param_grads='auto' took "
            f"autograd in {counts['autograd backwards']} of {counts['graphed backwards']} "
            "graphed backwards (FP8 weights always do)"
        )
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)


@pytest.fixture(autouse=True)
def _fresh_te_state() -> Iterator[None]:
    yield
    manager = _real_manager()
    if manager is not None:
        manager.reset()


def _real_manager() -> Any:
    module = sys.modules.get("transformer_engine.pytorch.quantization")
    manager = getattr(module, "FP8GlobalStateManager", None)
    return manager if callable(getattr(manager, "reset", None)) else None


# -- the capture context (everywhere, with the stand-in) ------------------------------------------


@pytest.mark.skipif(_HAS_TE, reason="TE is installed: the no-TE case is not reachable")
def test_capture_context_is_a_no_op_without_transformer_engine() -> None:
    with transformer_engine_capture() as generators:
        assert generators == []
    assert "transformer_engine.pytorch" not in sys.modules


def test_capture_context_marks_the_capture_and_yields_te_rng_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    with transformer_engine_capture() as generators:
        assert te.capturing
        assert generators == ["tracker-state-a", "tracker-state-b"]
    assert not te.capturing
    assert te.log == ["capture start", "capture end"]


def test_capture_context_ends_the_mark_when_the_capture_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), transformer_engine_capture():
        raise RuntimeError("boom")
    assert not te.capturing
    assert te.log == ["capture start", "capture end"]


def test_capture_context_leaves_an_outer_te_capture_marked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    te.capturing = True  # inside TE's own make_graphed_callables
    with transformer_engine_capture():
        pass
    assert te.capturing
    assert te.log == []


def test_capture_context_registers_no_generators_without_graph_safe_rng(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    monkeypatch.setattr(te.distributed, "graph_safe_rng_available", lambda: False)
    with transformer_engine_capture() as generators:
        assert generators == []


# -- without Transformer Engine -----------------------------------------------------------------


def test_dualgraph_torch_imports_and_graphs_without_importing_transformer_engine() -> None:
    program = (
        "import sys, torch, dualgraph.torch as dgt\n"
        "layer = dgt.make_graphed_callables(torch.nn.Linear(2, 2), (torch.ones(1, 2),))\n"
        "layer(torch.ones(1, 2)).sum().backward()\n"
        "assert 'transformer_engine' not in sys.modules, 'dualgraph imported TE'\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=300)


@pytest.mark.parametrize(
    "option",
    [
        {"enabled": True},
        {"recipe": object()},
        {"amax_reduction_group": object()},
        {"calibrating": False},
        {"cache_quantized_params": True},
    ],
    ids=lambda option: next(iter(option)),
)
def test_te_arguments_without_transformer_engine_are_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, option: dict[str, Any]
) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # does not import
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(DualgraphError, match="are Transformer Engine's, which does not import"):
        dgt.make_graphed_callables(layer, (torch.ones(1, 2),), backend="emulate", **option)
    assert "forward" not in layer.__dict__


# -- the arguments --------------------------------------------------------------------------------


def _two(te: StandIn) -> tuple[torch.nn.Module, torch.nn.Module]:
    return te.linear("a", seed=1), te.linear("b", seed=2)


def _samples(count: int = 2) -> tuple[tuple[torch.Tensor], ...]:
    return tuple((torch.ones(2, 4, requires_grad=True),) for _ in range(count))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"enabled": "yes"}, "enabled must be a bool, got str"),
        ({"enabled": (True,)}, r"enabled is one value for every callable or a tuple .* \(2\)"),
        ({"enabled": (True, 1)}, r"enabled\[1\] must be a bool, got int"),
        ({"calibrating": 1}, "calibrating must be a bool, got int"),
        ({"recipe": "delayed"}, "recipe must be a transformer_engine.common.recipe.Recipe"),
        ({"amax_reduction_group": "world"}, "amax_reduction_group must be a torch.distributed"),
        ({"cache_quantized_params": 1}, "cache_quantized_params must be a bool, got int"),
    ],
)
def test_te_arguments_are_checked(
    monkeypatch: pytest.MonkeyPatch, option: dict[str, Any], message: str
) -> None:
    te = StandIn().install(monkeypatch)
    with pytest.raises(DualgraphError, match=message):
        dgt.make_graphed_callables(_two(te), _samples(), backend="emulate", **option)


def test_each_callable_is_warmed_up_and_captured_in_its_own_autocast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    dgt.make_graphed_callables(
        _two(te),
        _samples(),
        backend="emulate",
        num_warmup_iters=2,
        enabled=(False, True),
        recipe=recipe,
    )
    entered = [line for line in te.log if line.startswith("enter")]
    assert entered == (
        ["enter enabled=True calibrating=False graph=True"]  # saving b's FP8 state
        + ["enter enabled=False calibrating=False graph=True"] * 3  # a: 2 warmups, 1 capture
        + ["enter enabled=True calibrating=False graph=True"] * 3
    )
    assert not [line for line in te.log if line.startswith(("join", "update"))]


def test_calibrating_is_one_value_or_one_per_callable(monkeypatch: pytest.MonkeyPatch) -> None:
    te = StandIn().install(monkeypatch)
    dgt.make_graphed_callables(
        _two(te), _samples(), backend="emulate", num_warmup_iters=1, calibrating=(True, False)
    )
    entered = [line for line in te.log if line.startswith("enter")]
    assert entered.count("enter enabled=False calibrating=True graph=True") == 3  # save + 2 calls
    assert entered.count("enter enabled=False calibrating=False graph=True") == 2


def test_without_arguments_the_ambient_autocast_is_the_capture_autocast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    with te.fp8(DelayedScaling()):
        dgt.make_graphed_callables(te.linear("a"), (torch.ones(2, 4),), num_warmup_iters=1)
    entered = [line for line in te.log if line.startswith("enter")]
    assert (
        entered
        == ["enter enabled=True calibrating=False graph=False"]
        + ["enter enabled=True calibrating=False graph=True"] * 3
    )
    assert te.log[-1] == "update forward"  # the caller's autocast exits as in eager: no joins


def test_capture_leaves_fp8_scales_histories_and_buffers_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    layer = te.linear("a")
    for _ in range(2):  # eager steps: the layer has joined the buffers and has a history
        with te.fp8(recipe):
            out = layer(torch.randn(2, 4, requires_grad=True))
        out.sum().backward()
    del out  # its graph would keep the weight's AccumulateGrad node (refused at capture)
    before = layer.get_fp8_meta_tensors()
    joined = list(te.joined)
    dgt.make_graphed_callables(
        layer, (torch.randn(2, 4),), backend="emulate", enabled=True, recipe=recipe
    )
    after = layer.get_fp8_meta_tensors()
    for key in before:
        assert all(torch.equal(b, a) for b, a in zip(before[key], after[key], strict=True))
    assert te.joined == joined


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
def test_capture_leaves_the_fp8_state_of_a_te_layer_the_module_does_not_own_as_it_was(
    monkeypatch: pytest.MonkeyPatch, trained: bool
) -> None:
    """Only the module's own layers were kept before warmup: one held in a plain list kept the
    amaxes of the warmup and capture calls in its histories (the next update's scales were the
    samples', not eager's), or a fresh one had histories where eager's are zeros."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()

    class Outer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.hidden = [inner]  # not a submodule

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hidden[0](self.fc(x))

    inner = te.linear("inner")
    inner.weight.requires_grad_(False)
    model = Outer(inner)
    if trained:  # an eager step: the layer has scales and histories
        with te.fp8(recipe):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    before = inner.get_fp8_meta_tensors() or {
        key: [torch.ones(1), torch.zeros(recipe.amax_history_len, 1)]  # as TE makes it
        for key in ("scaling_fwd", "scaling_bwd")
    }
    sample = (5 * torch.ones(2, 4, requires_grad=True),)
    dgt.make_graphed_callables(model, sample, backend="emulate", enabled=True, recipe=recipe)
    after = inner.get_fp8_meta_tensors()
    for key in ("scaling_fwd", "scaling_bwd"):
        assert all(torch.equal(b, a) for b, a in zip(before[key], after[key], strict=True)), key


@pytest.mark.parametrize("length", [2, 8])
def test_a_recipe_with_another_history_length_graphs_a_layer_trained_under_another(
    monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """A layer trained (or loaded) with 4-step amax histories, graphed under a recipe of another
    length: TE gives it histories of the new length at its first forward, so the put-back of
    its FP8 state did not fit them (torch's RuntimeError). The histories take the recipe's
    length before they are kept, and training then equals eager's under the new recipe."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling(amax_history_len=length)

    def train(graphed: bool) -> list[torch.Tensor]:
        te.reset()
        generator = torch.Generator().manual_seed(4)
        layer: Any = te.linear("a", seed=1)
        for _ in range(2):  # trained under 4-step histories
            with te.fp8(DelayedScaling(amax_history_len=4)):
                out = layer(torch.randn(2, 4, generator=generator, requires_grad=True))
            out.sum().backward()
        del out
        model = layer
        if graphed:
            sample = (torch.ones(2, 4, requires_grad=True),)
            model = dgt.make_graphed_callables(
                layer, sample, backend="emulate", enabled=True, recipe=recipe
            )
        record = []
        for _ in range(2):
            with te.fp8(recipe):
                out = model(torch.randn(2, 4, generator=generator, requires_grad=True))
            out.backward(torch.randn(2, 4, generator=generator))
            record.append(out.detach().clone())
        fp8 = layer.get_fp8_meta_tensors()
        assert fp8["scaling_fwd"][1].shape[0] == length
        return [*record, layer.weight.grad, *fp8["scaling_fwd"], *fp8["scaling_bwd"]]

    graphed, eager = train(graphed=True), train(graphed=False)
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        assert torch.equal(a, b), f"[{i}] differs from eager"


def test_a_failed_put_back_of_the_fp8_state_is_a_capture_error_naming_the_callable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)

    def refuse(self: Any, saved: Any = None) -> None:
        raise RuntimeError("shapes differ")

    monkeypatch.setattr(FakeFP8Linear, "reset_fp8_meta_tensors", refuse)
    with pytest.raises(CaptureError) as info:
        dgt.make_graphed_callables(
            te.linear("a"), (torch.ones(2, 4),), backend="emulate", enabled=True
        )
    assert str(info.value) == (
        "capturing FakeFP8Linear: putting back the FP8 scales and amax histories of its "
        "Transformer Engine layers failed: RuntimeError: shapes differ"
    )


def test_a_te_layer_the_forward_runs_but_the_module_does_not_own_keeps_its_scales_updated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frozen TE layer held outside the module's submodules (a plain list, a closure) that
    its forward runs: it was not noted at capture, so no replay joined it to TE's buffers and
    its scales never moved, where eager's are updated every step."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()

    class Outer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.hidden = [inner]  # not a submodule

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hidden[0](self.fc(x))

    def train(graphed: bool) -> list[torch.Tensor]:
        te.reset()
        torch.manual_seed(0)
        inner = te.linear("inner")
        inner.weight.requires_grad_(False)
        model = Outer(inner)
        if graphed:
            sample = (torch.ones(2, 4, requires_grad=True),)
            model = dgt.make_graphed_callables(
                model, sample, backend="emulate", enabled=True, recipe=recipe
            )
        generator = torch.Generator().manual_seed(2)
        record = []
        for _ in range(3):
            with te.fp8(recipe):
                out = model(torch.randn(2, 4, generator=generator, requires_grad=True))
            out.backward(torch.randn(2, 4, generator=generator))
            record.append(out.detach().clone())
        fp8 = inner.get_fp8_meta_tensors()
        return [*record, *fp8["scaling_fwd"], *fp8["scaling_bwd"]]

    graphed, eager = train(graphed=True), train(graphed=False)
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        assert torch.equal(a, b), f"[{i}] differs from eager"


def test_verify_keeps_the_fp8_state_of_a_te_layer_the_module_does_not_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any replay joined it to TE's buffers, such a layer's scales and histories were
    kept by no one: the graphed side's updates reached the eager side's start (verify FAILED
    on equal computations) and stayed after verify."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()

    class Outer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.hidden = [inner]  # not a submodule

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hidden[0](self.fc(x))

    inner = te.linear("inner")
    inner.weight.requires_grad_(False)
    sample = (torch.ones(2, 4, requires_grad=True),)
    graphed = dgt.make_graphed_callables(
        Outer(inner), sample, backend="emulate", enabled=True, recipe=recipe
    )
    with te.fp8(recipe):
        before = inner.get_fp8_meta_tensors()
        report = dgt.verify(graphed, 5 * torch.randn(2, 4, requires_grad=True), steps=2)
        after = inner.get_fp8_meta_tensors()
    assert report.ok, str(report)
    for key in ("scaling_fwd", "scaling_bwd"):
        assert all(torch.equal(a, b) for a, b in zip(before[key], after[key], strict=True)), key


class _HoldsInAPlainList(torch.nn.Module):
    """Runs a model it holds in a plain list: not a submodule, its layers not its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.hidden = [model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden[0](self.fc(x))


@pytest.mark.parametrize("owned", [True, False], ids=["owned", "in_a_plain_list"])
@pytest.mark.parametrize("tool", ["lint", "memory_plan"])
def test_lint_and_memory_plan_leave_the_fp8_state_as_they_found_it(
    monkeypatch: pytest.MonkeyPatch, tool: str, owned: bool
) -> None:
    """Their eager forward and backward under the caller's FP8 autocast recorded amaxes, took
    the region's "first FP8 module" mark (so the step's own first layer did not update the
    backward scales) and updated the backward scales: a lint changed training. Layers the
    model does not own (held in a plain list, not yet in TE's buffers: fresh ones here) too:
    they are left as TE makes them at their first forward, ones and zeros."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    layers = [te.linear(f"layer{i}", seed=i) for i in range(2)]
    model: torch.nn.Module = Chain(layers)
    if owned:
        with te.fp8(recipe):  # an eager step: the layers have scales and histories
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    else:
        model = _HoldsInAPlainList(model)
    fresh = {key: [torch.ones(1), torch.zeros(4, 1)] for key in ("scaling_fwd", "scaling_bwd")}
    with te.fp8(recipe):
        before = [layer.get_fp8_meta_tensors() or fresh for layer in layers]
        getattr(dgt, tool)(model, 3 * torch.randn(2, 4, requires_grad=True))
        assert te.first is True  # the mark is still the caller's
        after = [layer.get_fp8_meta_tensors() or fresh for layer in layers]
    for kept, now in zip(before, after, strict=True):
        for key in ("scaling_fwd", "scaling_bwd"):
            assert all(torch.equal(a, b) for a, b in zip(kept[key], now[key], strict=True)), key


# -- recipes -------------------------------------------------------------------------------------


def test_a_recipe_dualgraph_does_not_know_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    layer = te.linear("a")
    with pytest.raises(CaptureError) as info:
        dgt.make_graphed_callables(
            layer, (torch.ones(2, 4),), backend="emulate", enabled=True, recipe=FutureRecipe()
        )
    assert str(info.value).startswith(
        "capturing FakeFP8Linear under Transformer Engine's recipe recipe_type=FutureRecipe is "
        "not supported"
    )
    assert "forward" not in layer.__dict__
    with te.fp8(FutureRecipe()), pytest.raises(CaptureError, match="recipe_type=FutureRecipe"):
        dgt.make_graphed_callables(layer, (torch.ones(2, 4),), backend="emulate")


def test_delayed_scaling_graphs_modules_and_refuses_functions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    layer = te.linear("a")
    with pytest.raises(CaptureError, match="is supported for modules only"):
        dgt.make_graphed_callables(
            lambda x: layer(x), (torch.ones(2, 4),), backend="emulate", enabled=True
        )


def test_a_custom_recipe_with_delayed_scaling_quantizers_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    layer = te.linear("a")
    with pytest.raises(CaptureError) as info:
        dgt.make_graphed_callables(
            layer,
            (torch.ones(2, 4),),
            backend="emulate",
            enabled=True,
            recipe=CustomRecipe(delayed_quantizers=True),
        )
    assert "failed during warmup: Transformer Engine's recipe recipe_type=CustomRecipe asks " in (
        str(info.value)
    )
    assert "forward" not in layer.__dict__
    dgt.make_graphed_callables(
        te.linear("b"), (torch.ones(2, 4),), backend="emulate", enabled=True, recipe=CustomRecipe()
    )


# -- every replay -------------------------------------------------------------------------------


def test_a_callable_captured_in_fp8_replays_only_inside_its_autocast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    layer = dgt.make_graphed_callables(
        te.linear("a"), (torch.ones(2, 4),), backend="emulate", enabled=True, recipe=recipe
    )
    with pytest.raises(DualgraphError) as info:
        layer(torch.ones(2, 4))
    assert str(info.value) == (
        "FakeFP8Linear: captured with enabled=True, so it replays inside "
        "te.autocast(enabled=True, recipe=recipe_type=DelayedScaling, margin=0, "
        "amax_history_len=4) (as its eager forward would run, and whose exit updates the FP8 "
        "scales), but it was called under no FP8 te.autocast"
    )
    with te.fp8(DelayedScaling(margin=1)), pytest.raises(DualgraphError, match="margin=1"):
        layer(torch.ones(2, 4))
    with te.fp8(DelayedScaling()):  # an equal recipe
        layer(torch.ones(2, 4))
    group = object()
    monkeypatch.setattr("dualgraph.torch._te_precision._is_group", lambda value: True)
    with te.fp8(recipe, amax_reduction_group=group), pytest.raises(DualgraphError):
        layer(torch.ones(2, 4))


def test_a_high_precision_callable_replays_under_any_autocast_in_high_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    twin = te.linear("twin")
    layer = dgt.make_graphed_callables(
        te.linear("a"), (torch.ones(2, 4),), backend="emulate", enabled=False
    )
    x = torch.randn(2, 4)
    with te.fp8(DelayedScaling()):
        out = layer(x)
    assert torch.equal(out, x @ twin.weight.t())  # the same seed: the same weight
    assert not [line for line in te.log if line.startswith("join")]


def test_without_arguments_replays_must_match_the_capture_autocast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    with te.fp8(Float8CurrentScaling()):
        layer = dgt.make_graphed_callables(te.linear("a"), (torch.ones(2, 4),), backend="emulate")
        layer(torch.ones(2, 4))
    with pytest.raises(DualgraphError) as info:
        layer(torch.ones(2, 4))
    assert str(info.value) == (
        "FakeFP8Linear: called under no FP8 te.autocast but captured under "
        "te.autocast(enabled=True, recipe=recipe_type=Float8CurrentScaling); a graph replays "
        "the precision it was captured in"
    )
    plain = dgt.make_graphed_callables(te.linear("b"), (torch.ones(2, 4),), backend="emulate")
    with te.fp8(Float8CurrentScaling()), pytest.raises(DualgraphError, match="captured under no"):
        plain(torch.ones(2, 4))


@pytest.mark.parametrize("graphed", ["function", "module"])
@pytest.mark.parametrize("outside", ["no autocast", "calibrating"])
def test_te_flags_its_forward_sets_from_the_autocast_are_no_change_of_the_callers(
    monkeypatch: pytest.MonkeyPatch, graphed: str, outside: str
) -> None:
    # TE's forward sets fp8, fp8_calibration, ... from TE's global state before it reads them.
    # After an eager step in FP8 (the flags already True at graphing), an eager evaluation of
    # the layers outside FP8 (or a calibration) set them otherwise, and the next graphed step
    # was refused as a change of the caller's ("fp8: was True at capture and is False").
    te = StandIn().install(monkeypatch)
    recipe = Float8CurrentScaling()
    model = Chain([te.linear("a", seed=1), te.linear("b", seed=2)])
    if graphed == "function":
        model.requires_grad_(False)  # a frozen encoder a step closes over
    x = torch.randn(2, 4, requires_grad=True)
    with te.fp8(recipe):
        model(x).sum().backward()
        expected = model(x).detach()

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    target: Any = step if graphed == "function" else model
    sample = (torch.ones(2, 4, requires_grad=True),)
    run = dgt.make_graphed_callables(target, sample, backend="emulate", enabled=True, recipe=recipe)
    with te.fp8(recipe):
        run(x)
    with torch.no_grad():
        if outside == "calibrating":
            with te.autocast(enabled=False, calibrating=True, recipe=recipe):
                model.layers[0](x)
        else:
            model.layers[0](x)
    assert model.layers[0].fp8 is False
    with te.fp8(recipe):
        assert torch.equal(run(x), expected)
    model.layers[1].sequence_parallel = True  # a setting of the caller's: still refused
    with te.fp8(recipe), pytest.raises(DualgraphError, match=r"layers\.1\.sequence_parallel: was"):
        run(x)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_te_bookkeeping_runs_before_the_user_hooks(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    hooks = dgt.ReplayHooks(
        before_forward=lambda call: te.log.append("user before_forward"),
        after_backward=lambda call: te.log.append("user after_backward"),
    )
    layer = dgt.make_graphed_callables(
        te.linear("a"),
        (torch.ones(2, 4, requires_grad=True),),
        backend=backend,
        enabled=True,
        recipe=recipe,
        replay_hooks=hooks,
    )
    te.log.clear()
    with te.fp8(recipe):
        out = layer(torch.ones(2, 4, requires_grad=True))
    out.sum().backward()
    steps = [line for line in te.log if not line.startswith(("enter", "exit"))]
    # a replay joins the buffers once its forward ran, as an eager call's forward does
    assert steps == [
        "user before_forward",
        "join a",
        "update forward",
        "update backward",
        "user after_backward",
    ]


def test_a_call_refused_by_a_replay_hook_leaves_the_fp8_books_as_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call its before_forward hook refuses never ran: it takes no "first FP8 module" mark
    and joins no buffer, as on the eager backend. The retry takes the mark, and its backward
    updates the backward scales."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    refused: list[str] = []

    def refuse_once(call: dgt.ReplayCall) -> None:
        if not refused:
            refused.append(call.name)
            raise RuntimeError("not yet")

    def steps(backend: str) -> tuple[list[str], Any]:
        te.reset()
        refused.clear()
        layer = te.linear("a")
        graphed = dgt.make_graphed_callables(
            layer,
            (torch.ones(2, 4, requires_grad=True),),
            backend=backend,
            enabled=True,
            recipe=recipe,
            replay_hooks=dgt.ReplayHooks(before_forward=refuse_once),
        )
        te.log.clear()
        generator = torch.Generator().manual_seed(1)
        for step in range(2):
            x = torch.randn(2, 4, generator=generator, requires_grad=True)
            with te.fp8(recipe):
                if step == 0:
                    with pytest.raises(RuntimeError, match="not yet"):
                        graphed(x)
                out = graphed(x)
            out.backward(torch.randn(2, 4, generator=generator))
        return [line for line in te.log if line.startswith(("join", "update"))], layer

    replayed, layer = steps("emulate")
    eager, twin = steps("eager")
    assert replayed == eager == ["join a"] + ["update forward", "update backward"] * 2
    for key, tensors in layer.get_fp8_meta_tensors().items():
        expected = twin.get_fp8_meta_tensors()[key]
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))


@pytest.mark.parametrize("precision", ["enabled", "ambient", "high"])
@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_verify_of_an_fp8_callable_runs_both_sides_from_one_te_state_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch, precision: str, backend: str
) -> None:
    """Both sides start from the same FP8 scales, histories and "first FP8 module" mark, the
    eager side in the autocast the eager backend gives it (``enabled=False``: high precision);
    verify then leaves them, and other layers in TE's buffers, as it found them."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    layer, other = te.linear("a", seed=1), te.linear("other", seed=2)
    sample = (torch.ones(2, 4, requires_grad=True),)
    if precision == "ambient":
        with te.fp8(recipe):
            graphed = dgt.make_graphed_callables(layer, sample, backend=backend)
    else:
        enabled = precision == "enabled"
        graphed = dgt.make_graphed_callables(
            layer, sample, backend=backend, enabled=enabled, recipe=recipe
        )
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):  # training steps: scales and histories that are not ones and zeros
        with te.fp8(recipe):
            out = other(graphed(3 * torch.randn(2, 4, generator=generator, requires_grad=True)))
        out.sum().backward()
    x = 5 * torch.randn(2, 4, generator=generator, requires_grad=True)
    with te.fp8(recipe):
        before = [layer.get_fp8_meta_tensors(), other.get_fp8_meta_tensors(), te.first]
        report = dgt.verify(graphed, x, steps=2)
        after = [layer.get_fp8_meta_tensors(), other.get_fp8_meta_tensors(), te.first]
    assert report.ok, str(report)
    assert before[-1] is after[-1] is True  # the mark is the caller's again
    if precision == "high":  # the layer never ran in FP8
        assert before[0] is None and after[0] is None
        before, after = before[1:], after[1:]
    for kept, now in zip(before[:-1], after[:-1], strict=True):
        for key in ("scaling_fwd", "scaling_bwd"):
            assert all(torch.equal(a, b) for a, b in zip(kept[key], now[key], strict=True))


@pytest.mark.parametrize("precision", ["enabled", "ambient"])
def test_verify_of_a_callable_under_current_scaling_keeps_no_fp8_history(
    monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """Under a recipe that keeps no scales or histories (TE's recipe state has none: asking it
    for them raises), verify keeps and puts back only what there is."""
    te = StandIn().install(monkeypatch)
    recipe = Float8CurrentScaling()
    layer, other = te.linear("a", seed=1), te.linear("other", seed=2)
    with te.fp8(DelayedScaling()):  # another layer, in TE's buffers
        other(torch.randn(2, 4, requires_grad=True)).sum().backward()
    sample = (torch.ones(2, 4, requires_grad=True),)
    with te.fp8(recipe):
        if precision == "ambient":
            graphed = dgt.make_graphed_callables(layer, sample, backend="emulate")
        else:
            graphed = dgt.make_graphed_callables(
                layer, sample, backend="emulate", enabled=True, recipe=recipe
            )
        report = dgt.verify(graphed, torch.randn(2, 4, requires_grad=True), steps=2)
    assert report.ok, str(report)


def test_a_layer_run_under_current_scaling_is_graphed_under_delayed_scaling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its recipe state has no scales to keep: TE gives it a new delayed-scaling state at its
    first forward under the recipe, so graphing keeps it as a new layer's (ones and zeros)."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()

    def train(graphed: bool) -> list[torch.Tensor]:
        te.reset()
        generator = torch.Generator().manual_seed(6)
        layer: Any = te.linear("a", seed=1)
        with te.fp8(Float8CurrentScaling()):
            layer(torch.randn(2, 4, generator=generator, requires_grad=True)).sum().backward()
        model = layer
        if graphed:
            sample = (torch.ones(2, 4, requires_grad=True),)
            model = dgt.make_graphed_callables(
                layer, sample, backend="emulate", enabled=True, recipe=recipe
            )
        record = []
        for _ in range(2):
            with te.fp8(recipe):
                out = model(torch.randn(2, 4, generator=generator, requires_grad=True))
            out.backward(torch.randn(2, 4, generator=generator))
            record.append(out.detach().clone())
        fp8 = layer.get_fp8_meta_tensors()
        return [*record, layer.weight.grad, *fp8["scaling_fwd"], *fp8["scaling_bwd"]]

    graphed, eager = train(graphed=True), train(graphed=False)
    for i, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        assert torch.equal(a, b), f"[{i}] differs from eager"


@pytest.mark.parametrize("other", ["history_length", "current_scaling"])
def test_a_replay_after_an_eager_call_replaced_a_layers_fp8_state_is_refused(
    monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """An eager call of a graphed layer under a recipe of another amax history length (an
    evaluation under TE's default recipe) or kind gives it new scale and history tensors, as TE
    does: the graphs read and update the ones of capture, which TE no longer updates."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    layer = te.linear("a")
    graphed = dgt.make_graphed_callables(
        layer,
        (torch.ones(2, 4, requires_grad=True),),
        backend="emulate",
        enabled=True,
        recipe=recipe,
    )
    with te.fp8(recipe):
        graphed(torch.ones(2, 4, requires_grad=True)).sum().backward()
    graphed.eval()  # runs its forward eagerly
    evaluation = DelayedScaling(amax_history_len=8) if other == "history_length" else None
    with torch.no_grad(), te.fp8(evaluation or Float8CurrentScaling()):
        graphed(torch.ones(2, 4))
    graphed.train()
    with te.fp8(recipe), pytest.raises(DualgraphError) as info:
        graphed(torch.ones(2, 4, requires_grad=True))
    assert str(info.value).startswith(
        "FakeFP8Linear: the FP8 scales and amax histories of its Transformer Engine layer "
        "FakeFP8Linear (scaling_fwd) are other tensors than at capture"
    )


# -- weight caching -----------------------------------------------------------------------------


def test_weight_caching_needs_is_first_microbatch_on_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    layer = dgt.make_graphed_callables(
        te.linear("a"),
        (torch.ones(2, 4),),
        backend="emulate",
        enabled=True,
        cache_quantized_params=True,
    )
    with te.fp8(), pytest.raises(DualgraphError) as info:
        layer(torch.ones(2, 4))
    assert str(info.value).startswith(
        "FakeFP8Linear: kwargs['is_first_microbatch'] is missing: captured with "
        "cache_quantized_params=True, every call passes is_first_microbatch=True"
    )
    with te.fp8(), pytest.raises(DualgraphError, match=r"expected a bool .* got int"):
        layer(torch.ones(2, 4), is_first_microbatch=1)
    with te.fp8():
        layer(torch.ones(2, 4), is_first_microbatch=True)
        assert te.skip is not None and te.skip.item() == 0  # cast the weight again
        layer(torch.ones(2, 4), is_first_microbatch=False)
        assert te.skip.item() == 1  # reuse the cast


def test_weight_caching_leaves_is_first_microbatch_out_of_the_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    with pytest.raises(DualgraphError, match="leave is_first_microbatch out of sample_kwargs"):
        dgt.make_graphed_callables(
            te.linear("a"),
            (torch.ones(2, 4),),
            sample_kwargs={"is_first_microbatch": True},
            backend="emulate",
            cache_quantized_params=True,
        )
    with pytest.raises(DualgraphError, match="does not combine with buckets="):
        dgt.make_graphed_callables(
            te.linear("b"), buckets=[(torch.ones(2, 4),)], cache_quantized_params=True
        )


def test_on_the_eager_backend_the_callable_gets_is_first_microbatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    te = StandIn().install(monkeypatch)
    seen: list[Any] = []
    layer = te.linear("a")
    layer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("is_first_microbatch")),
        with_kwargs=True,
    )
    graphed = dgt.make_graphed_callables(
        layer, (torch.ones(2, 4),), backend="eager", enabled=True, cache_quantized_params=True
    )
    with te.fp8():
        graphed(torch.ones(2, 4), is_first_microbatch=True)
        graphed(torch.ones(2, 4), is_first_microbatch=False)
    assert seen == [True, False]


# -- graphed training equals eager training, with the stand-in ------------------------------------


def _train_stand_in(
    te: StandIn, *, graphing: str | None, caching: bool, backend: str, eager_first: bool = False
) -> dict[str, Any]:
    """Three SGD steps of two micro-batches of a three-layer stand-in model under delayed
    scaling (after one eager step, with ``eager_first``); everything that must equal eager's."""
    te.reset()
    layers = [te.linear(f"layer{i}", seed=i) for i in range(3)]
    recipe = DelayedScaling()
    if eager_first:  # as a run that graphs after its first steps: TE's state and caches exist
        kwargs = {"is_first_microbatch": True} if caching else {}
        with te.fp8(recipe):
            out = Chain(layers)(torch.ones(2, 4, requires_grad=True), **kwargs)
        out.sum().backward()
        del out
        with torch.no_grad():
            for layer in layers:
                layer.weight -= 0.1 * layer.weight.grad
                layer.weight.grad = None
    options: dict[str, Any] = {
        "backend": backend,
        "enabled": True,
        "recipe": recipe,
        "cache_quantized_params": caching,
        "num_warmup_iters": 2,
    }
    sample = torch.ones(2, 4, requires_grad=True)
    samples = tuple((torch.ones(2, 4, requires_grad=True),) for _ in layers)
    if graphing == "whole":
        model = dgt.make_graphed_callables(Chain(layers), (sample,), **options)
    elif graphing == "ambient":  # no precision arguments: the autocast around the capture
        del options["enabled"], options["recipe"]
        with te.fp8(recipe):
            model = dgt.make_graphed_callables(Chain(layers), (sample,), **options)
    elif graphing in ("per_layer", "slots"):
        slots = 2 if graphing == "slots" and backend != "eager" else None
        model = Chain(
            list(dgt.make_graphed_callables(tuple(layers), samples, **options, slots=slots))
        )
    else:
        model = Chain(layers)
    te.log.clear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7)
    record: dict[str, Any] = {"outputs": []}
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        for micro_batch in range(2):
            x = torch.randn(2, 4, generator=generator, requires_grad=True)
            grad = torch.randn(2, 4, generator=generator)
            kwargs = {"is_first_microbatch": micro_batch == 0} if caching else {}
            with te.fp8(recipe):
                out = model(x, **kwargs)
            out.backward(grad)
            record["outputs"].append(out.detach().clone())
            record["outputs"].append(x.grad.clone())
        optimizer.step()
    record["weights"] = [layer.weight.detach().clone() for layer in layers]
    record["grads"] = [layer.weight.grad.clone() for layer in layers]
    record["fp8"] = [
        tensor
        for layer in layers
        for pair in layer.get_fp8_meta_tensors().values()
        for tensor in pair
    ]
    record["updates"] = [line for line in te.log if line.startswith("update")]
    te.log.clear()
    return record


@pytest.mark.parametrize("graphing", ["whole", "per_layer", "ambient", "slots"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "caching"])
@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_graphed_training_under_delayed_scaling_equals_eager_with_the_stand_in(
    monkeypatch: pytest.MonkeyPatch, graphing: str, caching: bool, backend: str
) -> None:
    te = StandIn().install(monkeypatch)
    graphed = _train_stand_in(te, graphing=graphing, caching=caching, backend=backend)
    eager = _train_stand_in(te, graphing=None, caching=caching, backend=backend)
    assert graphed["updates"] == eager["updates"] == ["update forward", "update backward"] * 6
    for key in ("outputs", "weights", "grads", "fp8"):
        for i, (a, b) in enumerate(zip(graphed[key], eager[key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}] differs from eager"


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "caching"])
def test_graphing_after_an_eager_step_equals_eager_with_the_stand_in(
    monkeypatch: pytest.MonkeyPatch, caching: bool
) -> None:
    # The layers' FP8 flags, scales, buffers joined and cast-weight caches from an eager step
    # (then an optimizer step) exist when graphing: the usual order of a training run.
    te = StandIn().install(monkeypatch)
    options = {"caching": caching, "backend": "emulate", "eager_first": True}
    graphed = _train_stand_in(te, graphing="whole", **options)  # type: ignore[arg-type]
    eager = _train_stand_in(te, graphing=None, **options)  # type: ignore[arg-type]
    assert graphed["updates"] == eager["updates"]
    for key in ("outputs", "weights", "grads", "fp8"):
        for i, (a, b) in enumerate(zip(graphed[key], eager[key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}] differs from eager"


def test_the_stand_in_notices_a_missed_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: without the replay's backward update, scales differ."""
    te = StandIn().install(monkeypatch)
    monkeypatch.setattr(
        "dualgraph.torch._te_precision.TECallable._after_backward", lambda self, call: None
    )
    graphed = _train_stand_in(te, graphing="whole", caching=False, backend="emulate")
    eager = _train_stand_in(te, graphing=None, caching=False, backend="emulate")
    assert graphed["updates"] != eager["updates"]
    assert not all(torch.equal(a, b) for a, b in zip(graphed["fp8"], eager["fp8"], strict=True))


# -- FP8 weights (tensor-subclass parameters) and param_grads -----------------------------------


@pytest.mark.parametrize("layout", ["one", "buckets", "slots"])
def test_auto_hands_the_grads_of_fp8_weights_to_autograd_as_eager(layout: str) -> None:
    """Eager's ``.grad`` of an FP8 weight is a plain tensor that ``AccumulateGrad`` makes;
    ``"auto"`` never adds it into an accumulator made like the weight (another FP8 tensor):
    it hands every such callable's grads to autograd."""
    layer, eager = fp8_weight_linear(), fp8_weight_linear()
    assert type(torch.zeros_like(layer.weight)) is FakeFP8Weight  # the danger, as in TE
    options: dict[str, Any] = {"backend": "emulate"}
    if layout == "buckets":
        options["buckets"] = [(torch.ones(n, 4, requires_grad=True),) for n in (2, 3)]
        graphed = dgt.make_graphed_callables(layer, **options)
    else:
        slots = 2 if layout == "slots" else None
        graphed = dgt.make_graphed_callables(
            layer, (torch.ones(2, 4, requires_grad=True),), slots=slots, **options
        )
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):  # grads accumulate over micro-batches
        x = torch.randn(2, 4, generator=generator)
        graphed(x).square().sum().backward()
        eager(x).square().sum().backward()
    assert dgt.diagnostics(graphed).param_grads_through_autograd == 3
    for param, expected in zip(layer.parameters(), eager.parameters(), strict=True):
        assert param.grad is not None and torch.equal(param.grad, expected.grad)


def test_in_graph_refuses_fp8_weights_naming_the_parameter() -> None:
    with pytest.raises(CaptureError, match=r"Linear\.weight is a FakeFP8Weight .*param_grads="):
        dgt.make_graphed_callables(
            fp8_weight_linear(),
            (torch.ones(2, 4, requires_grad=True),),
            backend="emulate",
            param_grads="in_graph",
        )


# -- CUDA with Transformer Engine -----------------------------------------------------------------


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


def _quantization(recipe: object | None) -> Any:
    import transformer_engine.pytorch as te

    if recipe is None:
        return contextlib.nullcontext()
    return te.autocast(enabled=True, recipe=recipe)


def _train_and_compare(recipe: object | None, tolerance: dict[str, float]) -> None:
    import copy

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


def _skip_without(available: Callable[..., Any], what: str) -> None:
    ok, reason = available(return_reason=True)
    if not ok:
        pytest.skip(f"{what} not available on this GPU (TE says: {reason})")


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

    _skip_without(te.is_fp8_available, "FP8")
    _train_and_compare(recipe.Float8CurrentScaling(), FP8)


# Transformer Engine's graphed-vs-eager test, re-expressed. Small sizes, as TE's "small" config:
# batch 2, 32 tokens, 2 heads of 32 (hidden 64), three layers.
TE_BATCH, TE_SEQ, TE_HEADS, TE_HEAD_DIM, TE_LAYERS = 2, 32, 2, 32, 3
TE_HIDDEN = TE_HEADS * TE_HEAD_DIM
TE_MODULES = [
    "linear",
    "transformer",
    "layernorm_mlp_nocheckpoint",
    "layernorm_mlp_checkpoint",
    "layernorm_linear",
    "mha",
    "linear_op",
]
TE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TE_RECIPES = ["none", "delayed", "current", "block"]
te_warnings = pytest.mark.filterwarnings("ignore::UserWarning:transformer_engine")


def _te_layers(module: str, dtype: torch.dtype) -> list[torch.nn.Module]:
    import transformer_engine.pytorch as te
    import transformer_engine.pytorch.ops as te_ops

    def one() -> torch.nn.Module:
        if module == "linear":
            return te.Linear(TE_HIDDEN, TE_HIDDEN, device="cuda", params_dtype=dtype)
        if module == "transformer":
            return te.TransformerLayer(
                TE_HIDDEN,
                TE_HIDDEN,
                TE_HEADS,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                fuse_qkv_params=True,
                params_dtype=dtype,
            )
        if module.startswith("layernorm_mlp"):
            return te.LayerNormMLP(
                TE_HIDDEN, TE_HIDDEN, params_dtype=dtype, checkpoint=module.endswith("_checkpoint")
            )
        if module == "layernorm_linear":
            return te.LayerNormLinear(TE_HIDDEN, TE_HIDDEN, params_dtype=dtype)
        if module == "mha":
            return te.MultiheadAttention(
                TE_HIDDEN, TE_HEADS, attention_dropout=0.0, params_dtype=dtype, fuse_qkv_params=True
            )
        return te_ops.Sequential(te_ops.Linear(TE_HIDDEN, TE_HIDDEN, dtype=dtype))

    return [one() for _ in range(TE_LAYERS)]


def _te_recipe(name: str) -> Any:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    if name == "none":
        return None
    if name == "block":
        _skip_without(te.is_fp8_block_scaling_available, "FP8 block scaling")
        return recipe.Float8BlockScaling()
    _skip_without(te.is_fp8_available, "FP8")
    return recipe.DelayedScaling() if name == "delayed" else recipe.Float8CurrentScaling()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values as a plain tensor (an FP8 weight dequantized)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.detach()
    return tensor.dequantize().detach()  # TE's QuantizedTensor


def _fp8_state(layers: list[torch.nn.Module], recipe: Any) -> list[torch.Tensor]:
    """The FP8 scales and amax histories of every TE module, under delayed scaling (the other
    recipes keep none).

    Not those of ``DotProductAttention``: without the recipe's ``fp8_dpa`` it computes in high
    precision and never reads them, and TE's own graphed callables (and dualgraph's, alike) do
    not add its metadata to the global amax buffers, where eager TE does.
    """
    import transformer_engine.pytorch as te

    found: list[torch.Tensor] = []
    if recipe is None or not recipe.delayed():
        return found
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, te.DotProductAttention):
                continue
            tensors = getattr(module, "get_fp8_meta_tensors", None)
            saved = tensors() if callable(tensors) else None
            if isinstance(saved, dict):
                found += [t for key in sorted(saved) for t in saved[key]]
    return found


def _train_te(
    module: str,
    dtype: torch.dtype,
    recipe: Any,
    *,
    fp8_params: bool,
    caching: bool,
    graphing: str | None,
    paths: collections.Counter[str] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Three SGD steps of two micro-batches of three ``module`` layers, graphed or eager.

    Graphed with the default ``param_grads="auto"``; ``paths`` counts the graphed backwards and
    those that handed the parameter grads to autograd."""
    import transformer_engine.pytorch as te

    te.quantization.FP8GlobalStateManager.reset()
    fp8 = recipe is not None
    torch.manual_seed(1234)
    torch.cuda.manual_seed(1234)
    with te.quantized_model_init(enabled=fp8_params, recipe=recipe):
        layers = _te_layers(module, dtype)
    shape = (TE_SEQ, TE_BATCH, TE_HIDDEN)
    options: dict[str, Any] = {
        "backend": "cuda",
        "num_warmup_iters": 2,
        "enabled": fp8,
        "recipe": recipe,
        "cache_quantized_params": caching,
    }
    if graphing == "whole":
        sample = torch.ones(shape, device="cuda", dtype=dtype, requires_grad=True)
        model = dgt.make_graphed_callables(torch.nn.Sequential(*layers), (sample,), **options)
        graphed = [model]
    elif graphing == "per_layer":
        samples = tuple(
            (torch.ones(shape, device="cuda", dtype=dtype, requires_grad=True),) for _ in layers
        )
        graphed = list(dgt.make_graphed_callables(tuple(layers), samples, **options))
        model = Chain(graphed)
    else:
        graphed = []
        model = Chain(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    generator = torch.Generator().manual_seed(5678)
    record: dict[str, list[torch.Tensor]] = {"outputs": [], "input grads": []}
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        for micro_batch in range(2):
            x = torch.randn(shape, generator=generator).to("cuda", dtype).requires_grad_()
            grad = torch.randn(shape, generator=generator).to("cuda", dtype)
            kwargs = {"is_first_microbatch": micro_batch == 0} if caching else {}
            with te.autocast(enabled=fp8, recipe=recipe):
                out = model(x, **kwargs)
            out.backward(grad)
            record["outputs"].append(out.detach().clone())
            record["input grads"].append(x.grad.clone())
        optimizer.step()
    torch.cuda.synchronize()
    if paths is not None:
        for callable_ in graphed:
            paths["graphed backwards"] += 6
            paths["autograd backwards"] += dgt.diagnostics(callable_).param_grads_through_autograd
    params = [p for layer in layers for p in layer.parameters()]
    record["weights"] = [_plain(p).clone() for p in params]
    record["grads"] = [p.grad.clone() for p in params if p.grad is not None]
    record["fp8 scales"] = _fp8_state(layers, recipe)
    del model, optimizer, layers, graphed
    return record


#: Eager results by case, shared by its graphings.
_EAGER: dict[tuple[Any, ...], dict[str, list[torch.Tensor]]] = {}


def _te_cases() -> Iterator[Any]:
    """Every combination TE's test runs (less its backward overrides), as pytest params.

    Left out, as in TE's test: FP8 weights and weight caching without an FP8 recipe; weight
    caching for the operation fuser (TE's ops do not cache); block scaling for the operation
    fuser (TE does not support it in graphs). One graph of the whole model is run for delayed
    scaling only, whose bookkeeping is what differs between one graph and one per layer.
    """
    for graphing in ("per_layer", "whole"):
        for module in TE_MODULES:
            for dtype_name in TE_DTYPES:
                for recipe_name in TE_RECIPES:
                    for fp8_params in (False, True):
                        for caching in (False, True):
                            fp8 = recipe_name != "none"
                            if (fp8_params or caching) and not fp8:
                                continue
                            if module == "linear_op" and (caching or recipe_name == "block"):
                                continue
                            if graphing == "whole" and recipe_name != "delayed":
                                continue
                            weights = "fp8-weights" if fp8_params else "hp-weights"
                            cached = "caching" if caching else "no-caching"
                            yield pytest.param(
                                module,
                                dtype_name,
                                recipe_name,
                                fp8_params,
                                caching,
                                graphing,
                                id=f"{graphing}-{module}-{dtype_name}-{recipe_name}-{weights}-{cached}",
                            )


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
@te_warnings
@pytest.mark.parametrize(
    ("module", "dtype_name", "recipe_name", "fp8_params", "caching", "graphing"), list(_te_cases())
)
def test_te_graphed_training_equals_eager_bit_for_bit(
    module: str, dtype_name: str, recipe_name: str, fp8_params: bool, caching: bool, graphing: str
) -> None:
    counts = SUMMARY[recipe_name]
    outcome = "skipped"
    try:
        import transformer_engine.pytorch as te

        dtype = TE_DTYPES[dtype_name]
        if dtype is torch.bfloat16 and not te.is_bf16_available():
            pytest.skip("bf16 needs compute capability 8.0+")
        recipe = _te_recipe(recipe_name)
        if (
            recipe_name == "delayed"
            and module == "layernorm_mlp_checkpoint"
            and torch.cuda.get_device_capability() >= (10, 0)
        ):
            pytest.skip("TE: LayerNormMLP(checkpoint=True) under delayed scaling is not graphable")
        outcome = "failed"
        settings = {"fp8_params": fp8_params, "caching": caching}
        paths: collections.Counter[str] = collections.Counter()
        graphed = _train_te(module, dtype, recipe, graphing=graphing, paths=paths, **settings)
        if fp8_params:  # eager's .grad of an FP8 weight is a plain tensor: autograd makes it
            assert paths["autograd backwards"] == paths["graphed backwards"]
        counts.update(paths)
        key = (module, dtype_name, recipe_name, fp8_params, caching)
        if key not in _EAGER:  # the same for one graph and one per layer
            _EAGER[key] = _train_te(module, dtype, recipe, graphing=None, **settings)
        eager = _EAGER[key]
        for key, expected in eager.items():
            assert len(graphed[key]) == len(expected), key
            for i, (a, b) in enumerate(zip(graphed[key], expected, strict=True)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{key}[{i}]")
        outcome = "passed"
    finally:
        counts[outcome] += 1


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
@te_warnings
def test_te_first_and_last_layers_in_high_precision_equal_eager() -> None:
    """``enabled=(False, True, False)`` under delayed scaling equals eager TE with the outer
    layers in a ``te.autocast(enabled=False)`` inside the step's FP8 autocast."""
    import transformer_engine.pytorch as te

    recipe = _te_recipe("delayed")
    enabled = (False, True, False)

    def train(graphed: bool) -> list[torch.Tensor]:
        te.quantization.FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        layers = _te_layers("linear", torch.bfloat16)
        shape = (TE_SEQ, TE_BATCH, TE_HIDDEN)
        if graphed:
            samples = tuple(
                (torch.ones(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
                for _ in layers
            )
            steps: list[Any] = list(
                dgt.make_graphed_callables(tuple(layers), samples, enabled=enabled, recipe=recipe)
            )
        else:

            def precision(layer: torch.nn.Module, on: bool) -> Any:
                if on:  # in the step's autocast, as the graphed layer replays
                    return layer

                def high_precision(x: torch.Tensor) -> torch.Tensor:
                    with te.autocast(enabled=False, recipe=recipe):
                        return layer(x)

                return high_precision

            steps = [precision(layer, on) for layer, on in zip(layers, enabled, strict=True)]
        generator = torch.Generator().manual_seed(1)
        results = []
        for _ in range(4):
            x = torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)
            with te.autocast(enabled=True, recipe=recipe):
                for step in steps:
                    x = step(x)
            x.float().square().mean().backward()
            results.append(x.detach().clone())
        results += [p.grad.clone() for layer in layers for p in layer.parameters()]
        return results + _fp8_state(layers, recipe)

    for a, b in zip(train(True), train(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.cuda
@needs_te
@te_dynamo_warning
def test_te_delayed_scaling_replay_outside_its_autocast_is_refused() -> None:
    import transformer_engine.pytorch as te

    recipe = _te_recipe("delayed")
    layer = te.Linear(TE_HIDDEN, TE_HIDDEN, device="cuda")
    sample = torch.ones(TE_SEQ, TE_BATCH, TE_HIDDEN, device="cuda", requires_grad=True)
    graphed = dgt.make_graphed_callables(layer, (sample,), enabled=True, recipe=recipe)
    with pytest.raises(DualgraphError, match="captured with enabled=True, so it replays inside"):
        graphed(sample)
    with te.autocast(enabled=True, recipe=recipe):
        out = graphed(sample)
    out.sum().backward()


def test_fake_layers_are_te_modules_for_dualgraph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's layer is what dualgraph takes for a TE module (else tests above prove
    nothing about TE modules)."""
    te = StandIn().install(monkeypatch)
    from dualgraph.torch._transformer_engine import TransformerEngine

    entry_points = TransformerEngine.load()
    assert entry_points.base_module is not None
    assert isinstance(te.linear("a"), entry_points.base_module)
    assert isinstance(te.linear("a"), FakeFP8Linear)


class _TwoHeads(torch.nn.Module):
    """An FP8-weight layer and a plain one, each giving one output (a loss may leave one out)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8 = fp8_weight_linear(0)
        torch.manual_seed(1)
        self.plain = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fp8(x).tanh(), self.plain(x) * 2


def _graph_two_heads(model: torch.nn.Module, layout: str, param_grads: str) -> None:
    options: dict[str, Any] = {"backend": "emulate", "param_grads": param_grads}
    sample = (torch.ones(2, 4, requires_grad=True),)
    if layout == "slots":
        options["slots"] = 2
    elif layout == "schedule":
        options["schedule"] = [1, 1, -1, -1]
    dgt.make_graphed_callables(model, sample, **options)


@pytest.mark.parametrize("layout", ["one", "slots", "schedule"])
@pytest.mark.parametrize("param_grads", ["auto", "autograd"])
def test_fp8_weights_get_eagers_grads_in_every_mode_and_layout(
    layout: str, param_grads: str
) -> None:
    """A tensor-subclass parameter whose ``__torch_function__`` hands back plain tensors (as the
    stand-in's, and TE's dequantizing ops, do): ``"autograd"`` once gave its ``.grad`` ``None``
    (the lookup of its ``AccumulateGrad`` node found a fresh alias node instead)."""
    graphed, eager = _TwoHeads(), _TwoHeads()
    _graph_two_heads(graphed, layout, param_grads)
    generator = torch.Generator().manual_seed(5)
    for step in range(3):
        for model in (graphed, eager):
            model.zero_grad(set_to_none=step != 1)
        xs = [torch.randn(2, 4, generator=generator) for _ in range(2)]
        for model in (graphed, eager):
            inputs = [x.clone().requires_grad_() for x in xs]
            outputs = [model(x) for x in inputs] if layout != "one" else []
            for k, x in enumerate(inputs):
                fp8, plain = outputs[k] if outputs else model(x)
                (fp8.square().sum() + plain.sum()).backward()
            model.x_grads = [x.grad for x in inputs]  # type: ignore[assignment]
        for a, e in zip(graphed.x_grads, eager.x_grads, strict=True):  # type: ignore[arg-type]
            assert torch.equal(a, e)
        for (name, param), twin in zip(graphed.named_parameters(), eager.parameters(), strict=True):
            assert twin.grad is not None and type(twin.grad) is torch.Tensor
            assert param.grad is not None, f"step {step}: {name}.grad is None"
            assert type(param.grad) is torch.Tensor, name
            assert torch.equal(param.grad, twin.grad), f"step {step}: {name}"


@pytest.mark.parametrize("layout", ["one", "slots", "schedule"])
@pytest.mark.parametrize("param_grads", ["auto", "autograd"])
@pytest.mark.parametrize("loss", ["both", "plain_only"])
def test_hooks_of_fp8_weights_run_as_in_eager(layout: str, param_grads: str, loss: str) -> None:
    """Their tensor hooks run once per replay with eager's grad (the replay's own backward once
    ran them too, with the grads it computes, zeros for an output left out of the loss), and not
    at all where the loss leaves out every output that reaches them."""
    graphed, eager = _TwoHeads(), _TwoHeads()
    _graph_two_heads(graphed, layout, param_grads)
    seen: dict[str, list[Any]] = {"graphed": [], "eager": []}
    for key, model in (("graphed", graphed), ("eager", eager)):
        weight = model.fp8.weight
        weight.register_hook(lambda grad, key=key: seen[key].append(grad.clone()))
        weight.register_post_accumulate_grad_hook(
            lambda param, key=key: seen[key].append(("post", param.grad.clone()))
        )
    generator = torch.Generator().manual_seed(6)
    xs = [torch.randn(2, 4, generator=generator) for _ in range(2)]
    for model in (graphed, eager):
        inputs = [x.clone().requires_grad_() for x in xs]
        outputs = [model(x) for x in inputs] if layout != "one" else []
        for k, x in enumerate(inputs):
            fp8, plain = outputs[k] if outputs else model(x)
            (plain.sum() + (fp8.square().sum() if loss == "both" else 0)).backward()
    assert len(seen["eager"]) == (4 if loss == "both" else 0)
    assert len(seen["graphed"]) == len(seen["eager"])
    for a, e in zip(seen["graphed"], seen["eager"], strict=True):
        if isinstance(e, tuple):
            assert isinstance(a, tuple) and a[0] == e[0]
            a, e = a[1], e[1]
        assert torch.equal(a, e)
    assert (graphed.fp8.weight.grad is None) == (eager.fp8.weight.grad is None)


def _fp8_state_tensors(layers: list[Any]) -> list[torch.Tensor]:
    return [
        getattr(layer.fp8_meta[key], name)
        for layer in layers
        for key in ("scaling_fwd", "scaling_bwd")
        for name in ("scale", "amax_history")
    ]


@pytest.mark.parametrize("tool", ["verify", "lint", "capture"])
def test_the_fp8_state_put_back_moves_no_version_so_a_pending_backward_still_runs(
    monkeypatch: pytest.MonkeyPatch, tool: str
) -> None:
    """The scales and amax histories were put back with copy_, which moves their versions: a
    backward pending from before (an eager use of a scale, which saved it) then failed with
    'modified by an inplace operation', where without the tool it runs (verify's put-back of
    parameters and buffers keeps their versions since b17a103)."""
    te = StandIn().install(monkeypatch)
    recipe = DelayedScaling()
    layers = [te.linear(f"layer{i}", seed=i) for i in range(2)]
    model = Chain(layers)
    with te.fp8(recipe):  # an eager step: the layers have scales and histories
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    sample = 3 * torch.randn(2, 4, requires_grad=True)
    graphed = None
    if tool == "verify":
        graphed = dgt.make_graphed_callables(
            model, (sample,), backend="emulate", enabled=True, recipe=recipe
        )
    # inside the caller's autocast: leaving it updates the forward scales (eager's own doing)
    with te.fp8(recipe):
        tensors = _fp8_state_tensors(layers)
        versions = [t._version for t in tensors]
        x = torch.randn(2, 4, requires_grad=True)
        pending = (x * layers[0].fp8_meta["scaling_fwd"].scale).sum()  # saves the scale
        if tool == "verify":
            assert dgt.verify(graphed, sample, steps=2).ok
        elif tool == "lint":
            dgt.lint(model, sample)
        else:
            dgt.make_graphed_callables(
                model, (sample,), backend="emulate", enabled=True, recipe=recipe
            )
        assert [t._version for t in _fp8_state_tensors(layers)] == versions
        pending.backward()
    assert x.grad is not None
