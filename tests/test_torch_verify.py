"""The check against eager: right graphed callables pass, wrong ones are caught at the leaf that
differs, the model is left as it was, and the report reads like the parity report.

``RIGHT`` is the table of graphed callables ``verify`` must pass: ``None``/constant/integer
outputs, kwargs, buffers (BatchNorm), dropout, hooks, in-graph parameter grads.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dualgraph
import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch import _verify
from dualgraph.torch._probe import cloned_inputs
from dualgraph.torch._replay import GraphedCallable
from dualgraph.torch._slots import SlotReplay


class Block(nn.Module):
    """Linear, LayerNorm, GELU, dropout; returns ``(hidden, None, {"ids": int64, "n": 3})``."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> Any:
        hidden = F.dropout(F.gelu(self.norm(self.fc(x))) * mask, self.dropout, self.training)
        return hidden, None, {"ids": hidden.argmax(-1), "n": 3}


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class Scales(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def hooked() -> nn.Module:
    module = nn.Linear(8, 8)
    module.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    module.register_forward_hook(lambda m, args, out: out + 1)
    return module


def scaled_tanh(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tanh(x * 3 + bias), (x > 0).sum()


def inputs(device: str = "cpu") -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(4, 8, device=device, requires_grad=True),), {}


RIGHT: dict[
    str,
    tuple[
        Callable[[], Any], Callable[[str], tuple[tuple[Any, ...], dict[str, Any]]], dict[str, Any]
    ],
] = {
    "tree-outputs-kwargs": (
        Block,
        lambda d: (
            (torch.randn(4, 8, device=d, requires_grad=True),),
            {"mask": torch.rand(4, 8, device=d)},
        ),
        {},
    ),
    "dropout": (
        lambda: Block(dropout=0.5),
        lambda d: (
            (torch.randn(4, 8, device=d, requires_grad=True),),
            {"mask": torch.ones(4, 8, device=d)},
        ),
        {},
    ),
    "batchnorm-buffers": (Normed, inputs, {}),
    "hooks": (hooked, inputs, {}),
    "in-graph-param-grads": (
        Block,
        lambda d: ((torch.randn(4, 8, device=d),), {"mask": torch.ones(4, 8, device=d)}),
        {"param_grads": "in_graph"},
    ),
    "function": (
        lambda: scaled_tanh,
        lambda d: (
            (
                torch.randn(4, 8, device=d, requires_grad=True),
                torch.randn(8, device=d, requires_grad=True),
            ),
            {},
        ),
        {},
    ),
}


def graphed_case(
    name: str, backend: str = "emulate", device: str = "cpu"
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    make, sample, options = RIGHT[name]
    fn = make()
    if isinstance(fn, nn.Module):
        fn = fn.to(device)
    args, kwargs = sample(device)
    graphed = dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend, **options)
    fresh_args, fresh_kwargs = sample(device)
    return graphed, fresh_args, fresh_kwargs


@pytest.mark.parametrize("name", RIGHT)
def test_a_right_graphed_callable_passes(name: str) -> None:
    graphed, args, kwargs = graphed_case(name)
    report = dgt.verify(graphed, *args, steps=3, **kwargs)
    assert report.ok, str(report)
    assert report.steps == 3 and report.backend == "emulate"
    paths = [check.path for check in report.checks]
    assert all(any(p.startswith(f"step {s} output") for p in paths) for s in (1, 2, 3))
    assert all(check.score == 0 for check in report.checks)  # exact on the CPU
    assert str(report).startswith("verify OK: ")


def test_every_output_input_grad_parameter_grad_and_changed_buffer_is_compared() -> None:
    graphed, args, _ = graphed_case("batchnorm-buffers")
    report = dgt.verify(graphed, *args, steps=2)
    assert [c.path for c in report.checks if c.path.startswith("step 2")] == [
        "step 2 output",
        "step 2 grad args[0]",
        "step 2 grad fc.weight",
        "step 2 grad fc.bias",
        "step 2 grad bn.weight",
        "step 2 grad bn.bias",
        "step 2 buffer bn.num_batches_tracked after the call",
        "step 2 buffer bn.running_mean after the call",
        "step 2 buffer bn.running_var after the call",
    ]


def test_none_and_constant_outputs_are_compared_by_structure() -> None:
    graphed, args, kwargs = graphed_case("tree-outputs-kwargs")
    report = dgt.verify(graphed, *args, steps=1, **kwargs)
    outputs = [c.path for c in report.checks if "output" in c.path]
    assert outputs == ["step 1 output[0]", "step 1 output[2]['ids']"]  # None and 3: structure


# -- wrong graphed callables ----------------------------------------------------------------------


def recycles_its_last_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    """A forward hook that zeroes the previous output to reuse its memory: fine eagerly, but a
    graphed module's outputs are one static buffer, so it zeroes the current output."""
    previous = module.__dict__.get("previous")
    if previous is not None:
        with torch.no_grad():
            previous.zero_()
    module.__dict__["previous"] = output


def test_verify_catches_a_hook_that_changes_a_static_output_buffer() -> None:
    module = nn.Linear(8, 8)
    module.register_forward_hook(recycles_its_last_output)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), backend="emulate"
    )
    report = dgt.verify(graphed, torch.randn(4, 8, requires_grad=True), steps=2)
    assert not report.ok
    assert [c.path for c in report.failures] == ["step 2 output"]
    assert report.worst_path == "step 2 output"
    assert str(report).startswith("verify FAILED: Linear (emulate), 2 steps: 1 of ")
    assert math.isinf(report.failures[0].score) and report.failures[0].max_abs > 0


def keep_first_static_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every replay after a callable's first run on its first inputs: the static input
    buffers are no longer copied into (the classic CUDA-graph bug of a stale input buffer)."""
    forward = GraphedCallable._forward
    replayed: set[int] = set()

    def stale(self: GraphedCallable, tensors: Any, grad_enabled: bool = False) -> Any:
        if id(self) in replayed:
            tensors = self.static_inputs  # a copy of a tensor onto itself is skipped
        replayed.add(id(self))
        return forward(self, tensors, grad_enabled)

    monkeypatch.setattr(GraphedCallable, "_forward", stale)


@pytest.mark.parametrize("name", RIGHT)
def test_verify_catches_a_replay_that_ignores_its_new_inputs(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphed, args, kwargs = graphed_case(name)
    keep_first_static_inputs(monkeypatch)
    report = dgt.verify(graphed, *args, steps=3, **kwargs)
    assert not report.ok and report.varied_steps == (2, 3)
    failed = {c.path.split(" ")[1] for c in report.failures}
    assert failed == {"2", "3"}, str(report)  # step 1 ran on what the buffers held: right
    assert any(c.path.startswith("step 2 output") for c in report.failures)


class DropsItselfNever(nn.Module):
    """A layer drop of probability 0: its coin, drawn from torch's CPU generator, never drops,
    so outputs and grads do not depend on it; a replay on the GPU does not draw it again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand([]) >= 0.0
        return self.fc(x) * keep


def replays_leave_the_cpu_generator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every replay leave torch's CPU generator where it was, as a CUDA graph does with a
    draw on the host: it is not part of the graph."""
    call = GraphedCallable.__call__

    def without_host_draws(self: GraphedCallable, *args: Any, **kwargs: Any) -> Any:
        state = torch.get_rng_state()
        try:
            return call(self, *args, **kwargs)
        finally:
            torch.set_rng_state(state)

    monkeypatch.setattr(GraphedCallable, "__call__", without_host_draws)


def test_verify_catches_a_replay_that_leaves_torchs_rng_elsewhere_than_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Same outputs and grads, but the graph drew fewer numbers: whatever draws next in training
    # (another layer's dropout, a shuffle) gets other numbers than it would in eager.
    graphed = dgt.make_graphed_callables(
        DropsItselfNever(), (torch.randn(2, 4, requires_grad=True),), backend="emulate", lint="off"
    )
    assert dgt.verify(graphed, torch.randn(2, 4, requires_grad=True)).ok  # draws as eager
    replays_leave_the_cpu_generator_alone(monkeypatch)
    report = dgt.verify(graphed, torch.randn(2, 4, requires_grad=True))
    assert not report.ok
    assert [c.path for c in report.failures] == [
        "step 1 torch's RNG (CPU) after the call",
        "step 2 torch's RNG (CPU) after the call",
    ]
    assert "another state than eager's" in report.failures[0].problem


class Aliases(nn.Module):
    """Outputs that share memory in eager: one tensor twice, a view of another output, the input."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return {"twice": (h, h), "view": (h, h.t()), "input": (x, h)}[self.kind]


def replays_hand_out_copies_of_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every replay hand out an output that is an input, another output or a view as a
    tensor of its own, with the same values and grads (the relations eager has are lost)."""
    call = GraphedCallable.__call__

    def copying(self: GraphedCallable, *args: Any, **kwargs: Any) -> Any:
        seen = [arg for arg in args if isinstance(arg, torch.Tensor)]
        copied = []
        for output in call(self, *args, **kwargs):
            aliased = output._is_view() or any(output is other for other in seen)
            copied.append(output.clone() if aliased else output)
            seen.append(output)
        return tuple(copied)

    monkeypatch.setattr(GraphedCallable, "__call__", copying)


@pytest.mark.parametrize(("kind", "failed"), [("twice", 1), ("view", 1), ("input", 0)])
def test_verify_catches_a_replay_whose_outputs_lose_eagers_aliasing(
    kind: str, failed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Same values and grads, but a change through one output is no longer seen through the other
    graphed = dgt.make_graphed_callables(
        Aliases(kind), (torch.randn(3, 4, requires_grad=True),), backend="emulate"
    )
    assert dgt.verify(graphed, torch.randn(3, 4, requires_grad=True)).ok
    replays_hand_out_copies_of_aliases(monkeypatch)
    report = dgt.verify(graphed, torch.randn(3, 4, requires_grad=True))
    assert [c.path for c in report.failures] == [
        f"step 1 output[{failed}]",
        f"step 2 output[{failed}]",
    ]
    eager = {"twice": "output[0] itself", "view": "a view of output[0]", "input": "args[0] itself"}
    assert report.failures[0].problem == f"graphed a tensor of its own, eager {eager[kind]}"


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, self.head(h)


def backwards_keep_the_grad_of_an_output_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every replay's backward take, for an output the loss left out, the grad of the last
    backward that had one (a static grad buffer left as it was instead of zeroed)."""
    backward = GraphedCallable._backward
    last: dict[int, Any] = {}

    def stale(
        self: GraphedCallable, generation: int, needs: Any, inputs: Any, grads: Any, *rest: Any
    ) -> Any:
        grads = [last.get(i) if g is None else g for i, g in enumerate(grads)]
        last.update((i, g) for i, g in enumerate(grads) if g is not None)
        return backward(self, generation, needs, inputs, grads, *rest)

    monkeypatch.setattr(GraphedCallable, "_backward", stale)


def test_verify_leaves_an_output_out_of_later_steps_backward_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A loss of one head only (an auxiliary output unused this step) gives the other no grad;
    # verify gave every output one, so a replay adding a stale grad for it passed.
    graphed = dgt.make_graphed_callables(
        TwoHeads(), (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    assert dgt.verify(graphed, torch.randn(2, 4, requires_grad=True), steps=3).ok
    backwards_keep_the_grad_of_an_output_left_out(monkeypatch)
    report = dgt.verify(graphed, torch.randn(2, 4, requires_grad=True), steps=3)
    failed = {c.path.split(" ")[1] for c in report.failures}
    assert failed == {"2", "3"}, str(report)
    assert "step 2 grad args[0]" in [c.path for c in report.failures]
    assert "step 2: output[0] left out of the backward" in str(report)


class StepsInBackward(nn.Module):
    """An optimizer in the backward: each weight takes an SGD step as its grad is accumulated,
    and its .grad is dropped (torch's _apply_optimizer_in_backward does as much)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        for param in self.parameters():
            param.register_post_accumulate_grad_hook(_sgd_step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _sgd_step(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.sub_(param.grad, alpha=0.1)
    param.grad = None


def replays_step_the_weight_twice(monkeypatch: pytest.MonkeyPatch, weight: torch.Tensor) -> None:
    """Make every replay's backward move ``weight`` once more, leaving every ``.grad`` as is (a
    step taken twice: by the graph, and by the hook)."""
    backward = GraphedCallable._backward

    def twice(self: GraphedCallable, *args: Any, **kwargs: Any) -> Any:
        grads = backward(self, *args, **kwargs)
        with torch.no_grad():
            weight.sub_(0.01)
        return grads

    monkeypatch.setattr(GraphedCallable, "_backward", twice)


def test_verify_compares_the_parameters_a_call_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The step leaves no .grad to compare: only the parameters show what the backward did
    module = StepsInBackward()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    weight = module.fc.weight.detach().clone()
    report = dgt.verify(graphed, torch.randn(2, 4, requires_grad=True))
    assert report.ok, str(report)
    assert "step 2 parameter fc.weight after the call" in [c.path for c in report.checks]
    assert torch.equal(module.fc.weight, weight)  # put back
    replays_step_the_weight_twice(monkeypatch, module.fc.weight)
    report = dgt.verify(graphed, torch.randn(2, 4, requires_grad=True))
    failed = [c.path for c in report.failures]
    # step 1's outputs and grads match: only the parameter shows it (step 2 then runs on it)
    assert [p for p in failed if p.startswith("step 1")] == [
        "step 1 parameter fc.weight after the call"
    ], str(report)
    assert "step 2 parameter fc.weight after the call" in failed


class ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.fc(x)


def test_a_schedule_callable_gets_every_output_in_every_backward() -> None:
    # A backward of x alone (h left out) never reaches the replay, and the schedule's next pass
    # is that backward: verify's next forward was refused, the step left half run.
    graphed = dgt.make_graphed_callables(
        ReturnsItsInput(),
        (torch.randn(3, 4, requires_grad=True),),
        backend="emulate",
        schedule=[1, -1],
    )
    report = dgt.verify(graphed, torch.randn(3, 4, requires_grad=True), steps=3)
    assert report.ok and report.left_out == (), str(report)
    graphed(torch.randn(3, 4, requires_grad=True))[1].sum().backward()  # the step goes on


def test_later_steps_scale_floating_inputs_and_keep_integers_and_bools() -> None:
    seen: list[tuple[torch.Tensor, ...]] = []

    def lookup(x: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        seen.append((x.detach().clone(), idx.clone(), keep.clone()))
        return x[idx] * keep

    sample = (torch.randn(5, 3, requires_grad=True), torch.tensor([4, 0]), torch.ones(3) > 0)
    graphed = dgt.make_graphed_callables(lookup, sample, backend="emulate")
    x, idx, keep = torch.randn(5, 3, requires_grad=True), torch.tensor([4, 1]), torch.ones(3) > 0
    given = x.detach().clone()
    seen.clear()
    report = dgt.verify(graphed, x, idx, keep, steps=3)
    assert report.ok and report.varied_steps == (2, 3)
    assert len(seen) == 6  # the emulated replays and the eager twin: one call a step each
    for side in (seen[:3], seen[3:]):
        for (x_seen, idx_seen, keep_seen), factor in zip(side, (1, 31 / 32, 15 / 16), strict=True):
            assert torch.equal(x_seen, given * factor)
            assert torch.equal(idx_seen, idx) and torch.equal(keep_seen, keep)
    assert torch.equal(x, given) and x.grad is None  # the caller's inputs as they were


def test_inputs_sharing_memory_are_scaled_once_and_keep_sharing_it() -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def rows(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        seen.append((x.clone(), first.clone()))
        return x.sum(0) + first

    base = torch.randn(4, 3)
    graphed = dgt.make_graphed_callables(rows, (base, base[0]), backend="emulate")
    seen.clear()
    assert dgt.verify(graphed, base, base[0], steps=2).ok
    x_seen, first_seen = seen[-1]  # the eager twin's second step
    assert torch.equal(x_seen, base * (31 / 32)) and torch.equal(first_seen, x_seen[0])


def test_the_report_says_which_steps_ran_on_other_inputs() -> None:
    graphed, args, _ = graphed_case("hooks")
    text = str(dgt.verify(graphed, *args, steps=3)).splitlines()[1]
    assert text == (
        "inputs: step 1 as given; steps 2, 3 with the floating ones scaled by 31/32, 15/16"
    )
    counts = dgt.make_graphed_callables(
        lambda n: (n * 2, None), (torch.arange(3),), backend="emulate"
    )
    report = dgt.verify(counts, torch.arange(3), steps=2)
    assert report.ok and report.varied_steps == ()
    assert "step 2 the same (no floating input other than zeros)" in str(report).splitlines()[1]


def test_verify_agrees_with_eager_about_an_input_updated_in_place() -> None:
    # Eager updates the caller's tensor, and so does a replay (the adapter copies the update
    # back); verify compares the input after the call on both sides.
    def accumulates(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(x.detach())
        return x * 2

    graphed = dgt.make_graphed_callables(
        accumulates, (torch.ones(3, requires_grad=True), torch.zeros(3)), backend="emulate"
    )
    total = torch.zeros(3)
    graphed(torch.ones(3), total)
    graphed_updates_the_caller = bool(total.ne(0).any())
    report = dgt.verify(graphed, torch.ones(3, requires_grad=True), torch.zeros(3), steps=1)
    after = [c for c in report.checks if c.path == "step 1 input args[1] after the call"]
    assert len(after) == 1
    assert after[0].ok and graphed_updates_the_caller and report.ok


class _FlipsTheSignOfItsState(nn.Module):
    """Negates a buffer of zeros in place (``0.0`` to ``-0.0``) and reads a buffer of NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(3))
        self.register_buffer("fill", torch.full((3,), math.nan))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.neg_()
        return x * self.scale + self.fill.nan_to_num()


def test_verify_compares_a_buffer_whose_zeros_the_call_turned_negative() -> None:
    # What the calls changed was found by value (torch.equal), by which -0.0 is 0.0: the
    # buffer was never compared after the call, so a replay leaving +0.0 would have passed.
    module = _FlipsTheSignOfItsState()
    dgt.make_graphed_callables(module, (torch.randn(3),), backend="emulate")
    report = dgt.verify(module, torch.randn(3), steps=1)
    paths = [check.path for check in report.checks]
    assert "step 1 buffer state after the call" in paths and report.ok


def test_verify_leaves_out_a_buffer_of_nan_the_call_never_wrote() -> None:
    # By value a NaN is never itself: the buffer was listed as changed by the call.
    module = _FlipsTheSignOfItsState()
    dgt.make_graphed_callables(module, (torch.randn(3),), backend="emulate")
    report = dgt.verify(module, torch.randn(3), steps=1)
    assert "step 1 buffer fill after the call" not in [check.path for check in report.checks]


def doubles_then_adds(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.mul_(2)
    return a + b


def test_inputs_passed_sharing_memory_are_verified_sharing_it() -> None:
    # The call verify checks is the caller's: views of one tensor stay views of one clone, so
    # the replay's refusal of this call comes out of verify instead of a match of another call.
    graphed = dgt.make_graphed_callables(
        doubles_then_adds, (torch.ones(3), torch.ones(3)), backend="emulate"
    )
    z = torch.randn(2, 3)
    with pytest.raises(DualgraphError, match=r"args\[0\] and args\[1\] share memory"):
        dgt.verify(graphed, z[0], z[0].view(3))


def test_one_tensor_passed_twice_is_said_to_run_eagerly() -> None:
    # A call passing one tensor at two inputs runs eagerly (the callable may tell them apart by
    # identity): verify said its Python reads requires_grad, which it does not.
    graphed = dgt.make_graphed_callables(
        doubles_then_adds, (torch.ones(3), torch.ones(3)), backend="emulate"
    )
    z = torch.randn(3)
    with pytest.raises(DualgraphError) as info:
        dgt.verify(graphed, z, z)
    assert str(info.value).endswith(
        "2 calls replayed 0 times, so there is nothing to verify: args[1] is the same tensor as "
        "args[0], and a call passing one tensor at several inputs runs eagerly (the callable's "
        "Python may tell them apart by identity, where a replay's inputs are buffers of their "
        "own); pass tensors of their own (clone())"
    )


def test_the_clones_of_the_inputs_share_memory_as_the_inputs_do() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    row, column = base[1], base[:, 2]
    args, kwargs, inputs = cloned_inputs((base, row), {"column": column, "again": base})
    clone, row_clone = args
    assert kwargs["again"] is clone and len(inputs) == 4
    storage = clone.untyped_storage().data_ptr()
    assert storage != base.untyped_storage().data_ptr()
    for original, copied in ((row, row_clone), (column, kwargs["column"])):
        assert copied.untyped_storage().data_ptr() == storage
        assert copied.storage_offset() == original.storage_offset()
        assert copied.stride() == original.stride() and torch.equal(copied, original)
    clone.zero_()
    assert not row_clone.any() and not kwargs["column"].any() and base.sum() == 66


def test_a_conjugate_view_of_another_input_is_cloned_with_its_values() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    (z_clone, conj_clone), _, _ = cloned_inputs((z, z.conj()), {})
    assert torch.equal(z_clone, z) and torch.equal(conj_clone, z.conj())


def test_a_tensor_sharing_no_memory_is_cloned_alone_with_its_requires_grad() -> None:
    x, y = torch.ones(2, requires_grad=True), torch.zeros(2)
    (x_clone, y_clone), _, _ = cloned_inputs((x, y), {})
    assert x_clone.requires_grad and x_clone.is_leaf and not y_clone.requires_grad
    assert x_clone.untyped_storage().nbytes() == 8


def test_a_bucketed_callable_is_verified_through_the_bucket_of_the_call() -> None:
    module = Block()
    graphed = dgt.make_graphed_callables(
        module,
        buckets=[(torch.randn(n, 8, requires_grad=True),) for n in (4, 2)],
        sample_kwargs={"mask": torch.ones(8)},
        backend="emulate",
    )
    for n in (2, 4):
        report = dgt.verify(graphed, torch.randn(n, 8, requires_grad=True), mask=torch.ones(8))
        assert report.ok, str(report)
        assert "step 2 grad fc.weight" in [c.path for c in report.checks]
    assert [bucket.calls for bucket in dgt.diagnostics(graphed).buckets] == [2, 2]


@pytest.mark.parametrize("length", [6, 8])
def test_a_padded_bucketed_call_is_verified_against_eager_on_the_call_as_replayed(
    length: int,
) -> None:
    """A call padded to a bucket runs kernels of the bucket's size: eager on the call as it is
    agrees up to rounding only, so verify compared a 1e-7 gap exactly and reported FAILED on a
    CPU. Its eager side now runs the call as the replay does (padded, valid_length, cut back);
    the capture's padding check compared it with the call as it is."""
    from dualgraph.models.torch_vit import ViTBlock

    torch.manual_seed(0)
    graphed = dgt.make_graphed_callables(
        ViTBlock(dim=16, heads=2),
        buckets=[(torch.randn(2, n, 16, requires_grad=True),) for n in (4, 8)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
        backend="emulate",
    )
    report = dgt.verify(graphed, torch.randn(2, length, 16, requires_grad=True))
    assert report.ok, str(report)
    assert "step 2 grad qkv.weight" in [c.path for c in report.checks]
    assert dgt.diagnostics(graphed).padded_calls == (2 if length == 6 else 0)


class BlockMaskedMean(nn.Module):
    """A mean over positions that masks in blocks of 4 positions: right where the call's length
    is a multiple of 4 (the length the capture's padding check tries, half the bucket's), off
    elsewhere, where it counts padded positions."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, valid_length: Any = None) -> Any:
        hidden = self.fc(x)
        if valid_length is None:
            return hidden, hidden.mean(1)
        blocks = (valid_length + 3) // 4 * 4
        keep = torch.arange(x.shape[1], device=x.device) < blocks
        return hidden, (hidden * keep[:, None]).sum(1) / valid_length


@pytest.mark.parametrize("length", [4, 5])
def test_verify_checks_padding_at_the_length_of_the_call_it_runs(length: int) -> None:
    """The capture checked padding at length 4 only; a call of length 5 padded to 8 differs
    from eager, and verify, whose eager side is padded as the replay is, said OK."""
    graphed = dgt.make_graphed_callables(
        BlockMaskedMean(),
        buckets=[(torch.randn(2, 8, 4, requires_grad=True),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
        backend="emulate",
    )
    report = dgt.verify(graphed, torch.randn(2, length, 4, requires_grad=True))
    if length == 4:
        assert report.ok, str(report)
        return
    assert [check.path for check in report.failures] == ["padding"], str(report)
    assert "output[1] differs" in report.failures[0].problem
    assert "a call of length 5 is padded to 8" in report.failures[0].problem


@pytest.mark.parametrize("length", [4, 5])
def test_a_padded_call_spelled_otherwise_than_the_sample_is_verified(length: int) -> None:
    """x passed by keyword where the sample passed it by position: the replay binds it as eager
    does; verify's eager side (padded as the replay) and its padding check refused it with
    'args[0]: missing'."""
    graphed = dgt.make_graphed_callables(
        BlockMaskedMean(),
        buckets=[(torch.randn(2, 8, 4, requires_grad=True),)],
        fallback="pad",
        dynamic_dims={"args[0]": 1, "output[0]": 1},
        backend="emulate",
    )
    report = dgt.verify(graphed, x=torch.randn(2, length, 4, requires_grad=True))
    if length == 4:
        assert report.ok, str(report)
        return
    assert [check.path for check in report.failures] == ["padding"], str(report)
    assert "a call of length 5 is padded to 8" in report.failures[0].problem


def test_a_module_that_would_run_eagerly_is_refused() -> None:
    graphed = dgt.make_graphed_callables(
        nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    graphed.eval()  # captured in training mode: an eval call falls back to eager
    with pytest.raises(DualgraphError, match=r"Linear: 2 calls replayed 0 times"):
        dgt.verify(graphed, torch.randn(2, 4))


@pytest.mark.parametrize("layout", [{"slots": 2}, {"schedule": [1, -1]}])
def test_a_callable_with_replay_slots_is_verified(layout: dict[str, Any]) -> None:
    # verify counted replays on a diagnostics() snapshot, which slots do not update: it refused
    # every slotted callable, blaming a training mode that had not changed.
    graphed = dgt.make_graphed_callables(
        Block(),
        (torch.randn(4, 8, requires_grad=True),),
        sample_kwargs={"mask": torch.ones(8)},
        backend="emulate",
        **layout,
    )
    report = dgt.verify(graphed, torch.randn(4, 8, requires_grad=True), mask=torch.ones(8))
    assert report.ok, str(report)
    assert "step 2 grad fc.weight" in [c.path for c in report.checks]
    assert dgt.diagnostics(graphed).replays == 2  # read afresh: counts verify's two calls


def slot_1_replays_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the replays of slot 1 (and only those) hand out an output of zeros, as a slot whose
    buffers another slot overwrites would."""
    forward = SlotReplay._forward

    def wrong(self: SlotReplay, tensors: Any, grad_enabled: bool = False) -> Any:
        outputs = forward(self, tensors, grad_enabled)
        if self.index == 1:
            with torch.no_grad():
                outputs[0].zero_()
        return outputs

    monkeypatch.setattr(SlotReplay, "_forward", wrong)


def test_verify_replays_every_slot_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each step runs forward then backward, freeing its slot: the lowest free slot (0) took every
    # step, and a wrong slot 1, used only with two micro-batches in flight, passed.
    graphed = dgt.make_graphed_callables(
        nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),), backend="emulate", slots=2
    )
    slot_1_replays_wrong(monkeypatch)
    report = dgt.verify(graphed, torch.randn(2, 4, requires_grad=True), steps=3)
    assert [c.path for c in report.failures] == ["step 2 output"], str(report)
    x = torch.randn(2, 4, requires_grad=True)
    assert graphed(x).abs().sum() > 0  # training takes slot 0 again, as before verify


@pytest.mark.parametrize(
    ("callables", "schedule", "message"),
    [
        (1, dgt.Schedule.one_f_one_b(stages=2, microbatches=2, stage=0), "the forward of Linear"),
        (
            2,
            dgt.Schedule((1, -1)),
            "the forward of Linear for micro-batch 0 where verify would run",
        ),
    ],
    ids=["two-in-flight", "two-layers"],
)
def test_verify_of_a_schedule_it_cannot_follow_is_refused_before_anything_runs(
    callables: int, schedule: Any, message: str
) -> None:
    """verify runs each forward then its backward; a schedule that wants another pass there
    refused verify's backward after its forward had run, leaving the step half-run: the next
    training step was refused until reset_slots."""
    layers = [nn.Linear(4, 4) for _ in range(callables)]
    graphed = dgt.make_graphed_callables(
        tuple(layers),
        tuple((torch.randn(3, 4, requires_grad=True),) for _ in layers),
        backend="emulate",
        schedule=schedule,
    )
    with pytest.raises(DualgraphError, match=rf"verify runs 2 call.*{message}.*Nothing ran"):
        dgt.verify(graphed[0], torch.randn(3, 4, requires_grad=True))
    assert all(layer.weight.grad is None for layer in layers)
    in_flight: list[torch.Tensor] = []
    for chunk in schedule.order:  # a training step still starts at its first pass
        if chunk > 0:
            x = torch.randn(3, 4, requires_grad=True)
            for layer in graphed:
                x = layer(x)
            in_flight.append(x)
        else:
            in_flight.pop(0).sum().backward()
    assert all(layer.weight.grad is not None for layer in layers)


def test_a_call_that_falls_back_to_eager_is_refused_naming_the_fallback() -> None:
    graphed = dgt.make_graphed_callables(
        nn.Linear(4, 4),
        buckets=[(torch.randn(n, 4, requires_grad=True),) for n in (2, 4)],
        fallback="eager",
        backend="emulate",
    )
    with pytest.raises(DualgraphError, match=r"2 calls replayed 0 times.*no bucket") as error:
        dgt.verify(graphed, torch.randn(3, 4))
    assert "training mode" not in str(error.value)


class _ScalesByRequiresGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if x.requires_grad else 3.0)


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"slots": 2},
        {"buckets": [(torch.randn(n, 4, requires_grad=True),) for n in (2, 3)]},
    ],
    ids=["plain", "slots", "buckets"],
)
def test_calls_run_eagerly_for_reading_requires_grad_are_refused_saying_so(
    layout: dict[str, Any],
) -> None:
    # the calls' input needs no grad where the samples' did, and the forward reads it: they run
    # eagerly. verify blamed a bucket fallback the callable did not have (or, with buckets,
    # which counted such calls as replays, compared eager with eager and said OK)
    if "buckets" not in layout:
        layout = {"sample_args": (torch.randn(2, 4, requires_grad=True),), **layout}
    graphed = dgt.make_graphed_callables(_ScalesByRequiresGrad(), backend="emulate", **layout)
    with pytest.raises(DualgraphError, match=r"replayed 0 times.*reads grad mode or an input's"):
        dgt.verify(graphed, torch.randn(2, 4))


def test_steps_must_be_a_positive_int() -> None:
    graphed, args, _ = graphed_case("hooks")
    with pytest.raises(DualgraphError, match=r"steps must be a positive int, got 0"):
        dgt.verify(graphed, *args, steps=0)


@pytest.mark.parametrize(
    "tolerance", [{"rtol": -1.0}, {"atol": -1.0}, {"rtol": math.nan}, {"atol": math.nan}]
)
def test_a_tolerance_that_is_negative_or_nan_is_refused(tolerance: dict[str, float]) -> None:
    # allowed = atol * scale + rtol * |eager| < 0 made every difference's score negative: "OK".
    graphed, args, _ = graphed_case("hooks")
    name = next(iter(tolerance))
    with pytest.raises(DualgraphError, match=rf"{name} must be a number >= 0, got "):
        dgt.verify(graphed, *args, **tolerance)


def test_a_negative_tolerance_never_passes_a_leaf_that_differs() -> None:
    check = _verify._compare("x", torch.tensor([1.0]), torch.tensor([5.0]), -1.0, -1.0)
    assert not check.ok


def test_the_eager_backend_is_compared_with_itself_and_says_so() -> None:
    graphed = dgt.make_graphed_callables(nn.Linear(4, 4), (torch.randn(2, 4),), backend="eager")
    report = dgt.verify(graphed, torch.randn(2, 4))
    assert report.ok and report.backend == "eager"
    assert "both sides are eager" in str(report)


def test_something_not_graphed_is_refused() -> None:
    with pytest.raises(DualgraphError, match=r"was not made by dualgraph"):
        dgt.verify(nn.Linear(2, 2), torch.ones(1, 2))


def test_verify_of_a_model_holding_graphed_blocks_names_them() -> None:
    # The refusal quoted the model's repr (its whole tree, hundreds of lines for a ViT) and did
    # not say that its blocks are what was graphed.
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    dgt.make_graphed_callables(model[1], (torch.randn(2, 4, requires_grad=True),))
    with pytest.raises(DualgraphError) as info:
        dgt.verify(model, torch.randn(2, 4))
    assert str(info.value) == (
        "Sequential (a module) was not made by dualgraph.torch.make_graphed_callables, but "
        "holds graphed submodules: 1; pass one of those (.get_submodule('1'))"
    )


def test_verify_of_a_copy_of_a_graphed_module_says_it_is_a_copy() -> None:
    module = dgt.make_graphed_callables(nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(DualgraphError, match=r"^Linear is a copy of a graphed module \(copy"):
        dgt.verify(copy.deepcopy(module), torch.randn(2, 4))


# -- the model is left as it was ----------------------------------------------------------------


@pytest.mark.parametrize("param_grads", ["autograd", "in_graph"])
def test_verify_puts_parameters_buffers_grads_and_rng_back(param_grads: str) -> None:
    module = Normed()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), backend="emulate", param_grads=param_grads
    )
    graphed(torch.randn(4, 8, requires_grad=True)).sum().backward()  # .grad set, stats moved
    x = torch.randn(4, 8, requires_grad=True)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    grads = {n: (p.grad, p.grad.clone()) for n, p in module.named_parameters()}
    rng = torch.get_rng_state()
    assert dgt.verify(graphed, x, steps=2).ok
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    for name, param in module.named_parameters():
        grad, values = grads[name]
        assert param.grad is grad and torch.equal(param.grad, values)
    assert torch.equal(torch.get_rng_state(), rng) and x.grad is None
    graphed(torch.randn(4, 8, requires_grad=True)).sum().backward()  # training goes on


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_verify_moves_no_version_counter_so_a_pending_backward_still_runs(param_grads: str) -> None:
    # A backward pending from before verify that saved the weight (an eager use of it, a tied
    # head) runs as it would without verify: verify puts the parameters, buffers and .grad back
    # without moving their versions ('modified by an inplace operation' otherwise).
    module = Normed()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), backend="emulate", param_grads=param_grads
    )
    graphed(torch.randn(4, 8, requires_grad=True)).sum().backward()  # .grad set
    pending = (torch.randn(4, 8, requires_grad=True) @ module.fc.weight.t()).sum()  # saves it
    tensors = [*module.parameters(), *module.buffers(), *(p.grad for p in module.parameters())]
    versions = [t._version for t in tensors]
    assert dgt.verify(graphed, torch.randn(4, 8, requires_grad=True), steps=2).ok
    assert [t._version for t in tensors] == versions
    before = module.fc.weight.grad.clone()
    pending.backward()
    assert not torch.equal(module.fc.weight.grad, before)


class FlipsCudnnBenchmark(nn.Module):
    """A forward that turns cuDNN's benchmark mode on (a flag no replay compares)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.backends.cudnn.benchmark = True
        return self.fc(x)


def test_verify_puts_torch_settings_its_calls_changed_back() -> None:
    module = FlipsCudnnBenchmark()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    try:
        torch.backends.cudnn.benchmark = False
        assert dgt.verify(graphed, torch.randn(2, 4, requires_grad=True), steps=2).ok
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = False


class Counts(nn.Module):
    """Keeps Python state a call changes: a counter, a list, an attribute added on first use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.fc.last_seen = self.calls
        return self.fc(x) * (1.0 + random.random() * 0 + float(np.random.rand()) * 0)


def test_verify_puts_modules_python_attributes_and_the_host_random_streams_back() -> None:
    module = Counts()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), backend="emulate", lint="off"
    )
    calls, attributes = module.calls, dict(module.fc.__dict__)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    assert dgt.verify(graphed, torch.randn(2, 4, requires_grad=True)).ok
    assert module.calls == calls and module.fc.__dict__ == attributes
    assert random.getstate() == python_state
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])


def test_a_graphed_method_has_its_modules_buffers_compared_and_put_back() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.fc(x))

    module = Encoder().requires_grad_(False)  # a method's parameters must be frozen
    graphed = dgt.make_graphed_callables(
        module.encode, (torch.randn(3, 4, requires_grad=True),), backend="emulate"
    )
    state = {k: v.clone() for k, v in module.state_dict().items()}
    report = dgt.verify(graphed, torch.randn(3, 4, requires_grad=True))
    assert report.ok, str(report)
    assert "step 2 buffer bn.running_mean after the call" in [c.path for c in report.checks]
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_a_graphed_functions_closed_over_module_buffers_are_compared_and_put_back() -> None:
    bn = nn.BatchNorm1d(4, affine=False)  # no parameters: a function may close over it
    graphed = dgt.make_graphed_callables(
        lambda x: bn(x) * 2, (torch.randn(3, 4, requires_grad=True),), backend="emulate"
    )
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    report = dgt.verify(graphed, torch.randn(3, 4, requires_grad=True))
    assert report.ok, str(report)
    assert "step 2 closed over bn.running_mean after the call" in [c.path for c in report.checks]
    assert all(torch.equal(v, state[k]) for k, v in bn.state_dict().items())


def test_verify_puts_the_python_attributes_of_a_closed_over_module_back() -> None:
    # Only a graphed module's (or a method's module's) attributes were kept: the counter of a
    # module a graphed function closes over kept both sides' calls.
    counts = Counts().requires_grad_(False)  # a function may close over frozen weights only
    graphed = dgt.make_graphed_callables(
        lambda x: counts(x) * 2,
        (torch.randn(2, 4, requires_grad=True),),
        backend="emulate",
        lint="off",  # its host draws are multiplied by zero
    )
    calls, attributes = counts.calls, dict(counts.fc.__dict__)
    assert dgt.verify(graphed, torch.randn(2, 4, requires_grad=True)).ok
    assert counts.calls == calls and counts.fc.__dict__ == attributes


def test_a_tensor_a_graphed_function_updates_in_place_is_compared_and_put_back() -> None:
    total = torch.zeros(4)

    def accumulate(x: torch.Tensor) -> torch.Tensor:
        total.add_(x.detach().sum(0))
        return x * 2

    graphed = dgt.make_graphed_callables(
        accumulate, (torch.randn(3, 4, requires_grad=True),), backend="emulate"
    )
    before = total.clone()
    report = dgt.verify(graphed, torch.randn(3, 4, requires_grad=True))
    assert report.ok, str(report)
    assert "step 1 closed over total after the call" in [c.path for c in report.checks]
    assert torch.equal(total, before)


def test_lint_puts_modules_python_attributes_back() -> None:
    module = Counts()
    dgt.lint(module, torch.randn(2, 4))
    assert module.calls == 0 and "last_seen" not in module.fc.__dict__


# -- comparing leaves ----------------------------------------------------------------------------


def test_on_the_cpu_every_dtype_is_compared_exactly() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.nextafter(a, torch.full_like(a, 10.0))  # one ulp away
    check = _verify._compare("leaf", b, a, None, None)
    assert (check.rtol, check.atol, check.ok, check.score) == (0.0, 0.0, False, math.inf)
    assert check.max_abs == pytest.approx(2.384185791015625e-07)
    assert _verify._compare("leaf", b, a, 1e-6, 0.0).ok  # an explicit tolerance
    assert _verify._compare("ids", torch.tensor([1, 2]), torch.tensor([1, 3]), 1.0, 1.0).ok is False


def test_integers_beyond_float64s_precision_are_compared_exactly() -> None:
    big = torch.tensor([2**60, 7], dtype=torch.int64)
    check = _verify._compare("ids", big + torch.tensor([1, 0]), big, None, None)
    assert (check.ok, check.max_abs, check.score) == (False, 1.0, math.inf)
    assert check.max_rel == 2.0**-60
    assert _verify._compare("ids", big.clone(), big, None, None).ok
    flags = torch.tensor([True, False])
    assert not _verify._compare("mask", ~flags, flags, 1.0, 1.0).ok


def strided_counter(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Takes another branch on a transposed input; a replay sees the sample's layout."""
    count = x.new_full((2,), 2**60, dtype=torch.int64)
    if x.is_contiguous():
        count = count + 1
    return x * 2, count


def test_an_int64_output_one_apart_at_2_to_the_60_fails_verify() -> None:
    graphed = dgt.make_graphed_callables(
        strided_counter, (torch.randn(4, 4, requires_grad=True),), backend="emulate"
    )
    report = dgt.verify(graphed, torch.randn(4, 4).t().requires_grad_(), steps=1)
    assert not report.ok and "verify FAILED" in str(report)
    assert [c.path for c in report.failures] == ["step 1 output[1]"]
    assert report.failures[0].max_abs == 1.0


def test_nan_at_the_same_places_matches_and_nowhere_else() -> None:
    nan = float("nan")
    assert _verify._compare(
        "leaf", torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]), None, None
    ).ok
    check = _verify._compare("leaf", torch.tensor([nan, 1.0]), torch.tensor([0.0, 1.0]), 1.0, 1.0)
    assert not check.ok and math.isinf(check.max_abs)


@pytest.mark.parametrize("tolerance", [None, 1.0])
def test_a_complex_nan_matches_only_where_the_other_part_matches_too(
    tolerance: float | None,
) -> None:
    # isnan() of a complex is true where either part is NaN: nan+1j against nan+5j passed
    nan = float("nan")
    eager = torch.tensor([complex(nan, 1.0), complex(2.0, 3.0)])
    assert _verify._compare("leaf", eager.clone(), eager, tolerance, tolerance).ok
    for other in (complex(nan, 5.0), complex(1.0, nan), complex(nan, nan)):
        graphed = torch.tensor([other, complex(2.0, 3.0)])
        check = _verify._compare("leaf", graphed, eager, tolerance, tolerance)
        assert not check.ok and math.isinf(check.max_abs), other


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_a_zero_of_the_other_sign_fails_an_exact_comparison(dtype: torch.dtype) -> None:
    # 0.0 == -0.0, but 1 / x and copysign tell them apart: on the CPU every bit must match
    graphed, eager = torch.tensor([1.0, 0.0], dtype=dtype), torch.tensor([1.0, -0.0], dtype=dtype)
    check = _verify._compare("grad w", graphed, eager, None, None)
    assert not check.ok
    assert check.problem.startswith("a zero of the other sign at [1]: graphed 0.0, eager -0.0")
    assert _verify._compare("grad w", graphed, eager, 1e-6, 0.0).ok  # a tolerance allows it
    assert _verify._compare("grad w", eager, eager.clone(), None, None).ok


def test_verify_passes_a_parameter_grad_of_negative_zeros_as_eager_gives_it() -> None:
    # the grad of x * w towards w at an x of -0.0 is -0.0 times the output grad: -0.0 where
    # that is positive, in eager and in every replay
    layer = Scales(8)
    graphed = dgt.make_graphed_callables(layer, (torch.randn(8),), backend="emulate")
    report = dgt.verify(graphed, torch.full((8,), -0.0))
    assert report.ok, str(report)
    assert [c.path for c in report.checks if "grad" in c.path] == [
        "step 1 grad weight",
        "step 2 grad weight",
    ]


def test_verify_compares_a_sparse_parameter_grad_by_its_values() -> None:
    # nn.Embedding(sparse=True)'s .grad is sparse in eager and graphed: verify leaked torch's
    # NotImplementedError (no == on a sparse tensor) instead of comparing it
    table = nn.Embedding(10, 4, sparse=True)
    ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
    graphed = dgt.make_graphed_callables(table, (ids,), backend="emulate")
    report = dgt.verify(graphed, ids)
    assert report.ok, str(report)
    assert "step 2 grad weight" in [c.path for c in report.checks]


def test_a_grad_of_another_layout_than_eager_is_a_problem() -> None:
    sparse = torch.eye(3).to_sparse()
    check = _verify._compare("grad w", torch.eye(3), sparse, None, None)
    assert (check.ok, check.problem) == (False, "graphed torch.strided vs eager torch.sparse_coo")
    assert not _verify._compare("grad w", (2 * torch.eye(3)).to_sparse(), sparse, None, None).ok


def test_a_missing_grad_shape_or_structure_is_a_problem_not_a_number() -> None:
    grad = _verify._compare("step 1 grad x", None, torch.ones(2), None, None)
    assert (grad.ok, grad.problem) == (False, "None in graphed, a tensor in the other")
    shape = _verify._compare("leaf", torch.ones(2), torch.ones(3), None, None)
    assert shape.problem == "graphed float32[2] vs eager float32[3]"

    def step(tree: Any) -> _verify._Step:
        spec = dualgraph.describe(tree)
        return _verify._Step(spec, spec.flatten(tree), {}, {}, {}, set())

    t = torch.ones(2)
    ours, theirs = step((t, None)), step((t, 3))
    (check,) = _verify._compare_step("step 1 ", ours, theirs, None, None)
    assert check.path == "step 1 output" and "output[1]" in check.problem
    differ = _verify._structure_problem(step((t,)), step((t.requires_grad_(),)))
    assert differ == "output[0] requires grad False (eager: True)"


def doubled(x: torch.Tensor) -> tuple[torch.Tensor, None]:
    return x * 2, None


def test_the_report_is_a_table_worst_leaf_in_the_header() -> None:
    graphed = dgt.make_graphed_callables(doubled, (torch.ones(3),), backend="emulate")
    lines = str(dgt.verify(graphed, torch.arange(3.0), steps=1)).splitlines()
    assert lines == [
        "verify OK: doubled (emulate), 1 step: 1 leaf matches eager (worst: step 1 output[0], "
        "max abs 0, 0 of its tolerance)",
        "leaf              dtype    shape  max abs  max rel  rtol  atol  score",
        "step 1 output[0]  float32  [3]    0        0        0     0     0      ok",
    ]


# -- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", RIGHT)
def test_on_cuda_a_right_graphed_callable_passes(name: str) -> None:
    graphed, args, kwargs = graphed_case(name, backend="cuda", device="cuda")
    report = dgt.verify(graphed, *args, steps=3, **kwargs)
    print(f"\n{report}")
    assert report.ok, str(report)
    floats = [c for c in report.checks if c.dtype == "float32"]
    assert floats and all((c.rtol, c.atol) == (1.3e-6, 1e-5) for c in floats)


@pytest.mark.cuda
def test_on_cuda_dropout_draws_the_same_masks_in_the_graph_and_in_eager() -> None:
    # Philox: a replay offsets each random kernel as eager does from the same generator state.
    graphed, args, kwargs = graphed_case("dropout", backend="cuda", device="cuda")
    report = dgt.verify(graphed, *args, steps=3, **kwargs)
    print(f"\n{report}")
    assert report.ok and all(c.max_abs == 0 for c in report.checks if "output" in c.path)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = 2.0
        self._scale = 2.0  # private: a replay's attribute check leaves it out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale * (self._scale / 2.0)


@pytest.mark.cuda
def test_on_cuda_verify_catches_python_state_baked_into_the_graph() -> None:
    module = Scaled().cuda()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device="cuda", requires_grad=True),)
    )
    module._scale = 3.0  # eager reads it on every call; the graph kept 2.0
    report = dgt.verify(graphed, torch.randn(4, 8, device="cuda", requires_grad=True), steps=1)
    print(f"\n{report}")
    assert not report.ok
    assert "step 1 output" in [c.path for c in report.failures]


@pytest.mark.cuda
def test_on_cuda_a_public_number_changed_after_capture_is_refused_before_verify_compares() -> None:
    module = Scaled().cuda()
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device="cuda", requires_grad=True),)
    )
    module.scale = 3.0  # public: every call compares it with capture's
    with pytest.raises(DualgraphError, match=r"Scaled\.scale: was 2\.0 at capture and is 3\.0"):
        dgt.verify(graphed, torch.randn(4, 8, device="cuda", requires_grad=True), steps=1)


@pytest.mark.cuda
def test_on_cuda_verify_catches_a_hook_that_changes_a_static_output_buffer() -> None:
    module = nn.Linear(8, 8).cuda()
    module.register_forward_hook(recycles_its_last_output)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device="cuda", requires_grad=True),)
    )
    report = dgt.verify(graphed, torch.randn(4, 8, device="cuda", requires_grad=True), steps=2)
    assert [c.path for c in report.failures][:1] == ["step 2 output"]


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
        ctx.weight.main_grad.add_(grad.t() @ x)
        ctx.weight.grad_added_to_main_grad = True
        return grad @ ctx.weight, torch.zeros_like(ctx.weight)


class _FusedWgradLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.weight.main_grad = torch.zeros(4, 4)  # type: ignore[attr-defined]
        self.weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedWgrad.apply(x, self.weight)


@pytest.mark.parametrize("tool", ["verify", "memory_plan"])
def test_the_tools_leave_a_fused_main_grad_and_its_flag_as_they_found_them(tool: str) -> None:
    # Run between steps (after zero_grad_buffer too), their backwards add into main_grad and
    # set the flag, which the next step would begin with.
    module = _FusedWgradLinear()
    x = torch.randn(2, 4, requires_grad=True)
    if tool == "verify":
        graphed = dgt.make_graphed_callables(module, (x,), backend="emulate")
        assert dgt.verify(graphed, x).ok
    else:
        dgt.memory_plan(module, x)
    assert not module.weight.main_grad.any()  # type: ignore[attr-defined]
    assert module.weight.grad_added_to_main_grad is False  # type: ignore[attr-defined]


class _ScaledFusedWgrad(torch.autograd.Function):
    """As :class:`_FusedWgrad`, the weight grad added into ``main_grad`` times ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.weight, ctx.scale = weight, scale
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        ctx.weight.main_grad.add_(grad.t() @ x * ctx.scale)
        return grad @ ctx.weight, torch.zeros_like(ctx.weight), None


class _CountingFusedWgradLinear(_FusedWgradLinear):
    """Its backward's ``main_grad`` share grows with a Python counter: on CUDA the graph keeps
    the count of capture, where eager's goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return _ScaledFusedWgrad.apply(x, self.weight, float(self.calls))


def test_verify_compares_what_the_backward_adds_into_a_fused_main_grad() -> None:
    # The .grad autograd gets is a dummy (zeros): the weight grad is main_grad's alone.
    module = _CountingFusedWgradLinear()
    x = torch.randn(2, 4, requires_grad=True)
    graphed = dgt.make_graphed_callables(module, (x,), backend="emulate")
    report = dgt.verify(graphed, x)
    assert not report.ok
    assert [c.path for c in report.failures] == [
        "step 1 attribute weight.main_grad after the call",
        "step 2 attribute weight.main_grad after the call",
    ]
    assert not module.weight.main_grad.any()  # type: ignore[attr-defined]
    plain = dgt.make_graphed_callables(_FusedWgradLinear(), (x,), backend="emulate")
    assert dgt.verify(plain, x).ok
