"""Differential fuzzing of the torch adapter: graphed (emulate backend, CPU, fp32) against eager.

Each example builds a small module (Linear, LayerNorm, GELU/ReLU, residual adds, dropout with
``p=0``, a frozen sub-layer, a buffer it updates in place as a running mean (in place, through
``.data``, or read by a product that saves it), a weight tied between two layers and a layer
registered twice), captured in train or eval mode, an output tree (tuple, dict or namedtuple,
a nested dict in it) mixing tensors that require grad, detached ones, inputs and views of
inputs, the buffer, ``None``, ints, strings and a kwarg's constants, and a program of calls:
replays with fresh inputs (some without grad), grads accumulated across them, ``zero_grad``
with and without ``set_to_none``, calls under ``torch.no_grad()``, ``train()``/``eval()``
switches (eager fallbacks), a changed constant or an input requiring grad unlike its sample
(refused), backward of a subset of the outputs, ``torch.autograd.grad`` of the inputs (and
parameters), ``retain_graph=True`` and a second backward, a call's backward after later calls
and steps, optimizer steps (SGD with momentum, Adam foreach).

A deep copy of the module runs the same program eagerly; outputs (bits, ``None`` positions,
constants, ``requires_grad``, inputs handed back as the caller's tensors), input grads,
parameter grads, parameter values and buffers must be equal bit for bit. A
:class:`DualgraphError` is accepted only where the README documents it, and must leave every
grad as it was; the eager twin then skips that step too.

Example (one program, as the property runs it)::

    run_program(Program(ops=["inp", "gelu"], outputs=["h", "none"], ..., steps=[...]))
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import dualgraph.torch as dgt
from dualgraph import DualgraphError

WIDTH = 4
BATCH = 3

LAYER_OPS = (
    "inp",
    "hidden",
    "norm",
    "gelu",
    "relu",
    "residual",
    "drop",
    "frozen",
    "running",
    "running_data",
    "running_mul",
    "gate",
    "scale",
    "head",
    "twin",
    "mask",
)
#: What an output leaf may be. Inputs returned ("x", "gate", "mask") and views of them
#: ("x_view") are handed out but left out of losses: their grad then arrives beside the
#: replay's own sum, which the README says can differ from eager's in the last bit.
OUTPUT_KINDS = (
    "h",
    "mid",
    "z",
    "detached",
    "argmax",
    "none",
    "int",
    "str",
    "scale",
    "tag",
    "buffer",
    "x",
    "x_view",
    "gate",
    "mask",
    "frozen_x",
)
DIFFERENTIABLE = ("h", "mid", "z")
BACKWARDS = ("none", "all", "subset", "grad_inputs", "grad_all", "retain_twice", "grad_retained")
#: "keep": a call whose backward waits for a later "late" step
STEPS = ("call", "call", "keep", "late", "no_grad", "const", "train", "eval", "zero", "step")

_NAMEDTUPLES: dict[int, type] = {}


def namedtuple_of(size: int) -> type:
    """One namedtuple class per field count (module level, so pickling and describe see it)."""
    if size not in _NAMEDTUPLES:
        _NAMEDTUPLES[size] = collections.namedtuple(  # type: ignore[misc]
            f"Out{size}", [f"f{i}" for i in range(size)]
        )
    return _NAMEDTUPLES[size]


class Composed(nn.Module):
    """Layers applied in the order ``ops`` names; returns the leaves ``outputs`` names."""

    def __init__(self, ops: list[str], outputs: list[str], container: str, tied: bool) -> None:
        super().__init__()
        self.ops = ops
        self.outputs = outputs
        self.container = container
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.0)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(WIDTH, WIDTH, bias=False)
        if tied:  # a weight tied between two layers, a layer registered twice
            self.head.weight = self.inp.weight
            self.twin = self.hidden
        else:
            self.twin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("running", torch.ones(WIDTH))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        *,
        gate: torch.Tensor,
        scale: float = 1.0,
        tag: str = "t",
    ) -> Any:
        h = x
        mid = None
        for op in self.ops:
            if op in ("inp", "hidden", "norm", "drop", "frozen", "head", "twin"):
                h = getattr(self, op)(h)
            elif op == "gelu":
                h = nn.functional.gelu(h)
            elif op == "relu":
                h = torch.relu(h)
            elif op == "residual":
                h = h + self.hidden(h)
            elif op in ("running", "running_data", "running_mul"):
                if self.training:  # as BatchNorm: statistics move in training only
                    statistic = h.detach().abs().mean(0)
                    if op == "running_data":  # no version counter moves
                        self.running.data.mul_(0.5).add_(statistic, alpha=0.5)
                    else:
                        with torch.no_grad():
                            self.running.mul_(0.5).add_(statistic, alpha=0.5)
                # a product saves the buffer for backward, a difference does not
                h = h * self.running if op == "running_mul" else h - self.running
            elif op == "gate":
                h = h * gate
            elif op == "scale":
                h = h * scale
            elif op == "mask":
                h = h * mask
            if mid is None:
                mid = h
        values = {
            "h": h,
            # one tensor handed out twice is left out (README: last-bit grads); an input
            # handed out twice is not (dropout with p=0 returns its input)
            "mid": mid if mid is not h or mid is x else mid * 1.0,
            "z": torch.tanh(h) * 2.0,
            "detached": h.detach() + 1.0,
            "argmax": h.argmax(dim=-1),
            "none": None,
            "int": 7,
            "str": "s",
            "scale": scale,
            "tag": tag,
            "buffer": self.running,
            "x": x,
            "x_view": x[0],
            "gate": gate,
            "mask": mask,
            # requires grad as the call's x does, whatever the sample's did
            "frozen_x": self.frozen(x),
        }
        leaves = [values[kind] for kind in self.outputs]
        inner = {"aux": leaves.pop(), "n": len(leaves)} if len(leaves) > 1 else None
        items = [*leaves, inner]
        if self.container == "tuple":
            return tuple(items)
        if self.container == "dict":
            return {f"k{i}": v for i, v in enumerate(items)}
        return namedtuple_of(len(items))(*items)


@dataclasses.dataclass
class Program:
    """A module, its sample call and the steps run on it and on its eager twin."""

    ops: list[str]
    outputs: list[str]
    container: str
    tied: bool
    mode: str
    clone: bool
    x_grad: bool
    gate_grad: bool
    scale: float
    optimizer: str
    captured_training: bool
    steps: list[tuple[str, str, int, bool, int]]
    seed: int


@st.composite
def programs(draw: st.DrawFn) -> Program:
    ops = draw(st.lists(st.sampled_from(LAYER_OPS), min_size=1, max_size=6))
    # one update of the buffer a call: a product saving it, updated again later in the same
    # forward, fails eager's own backward
    running = [k for k, op in enumerate(ops) if op.startswith("running")]
    ops = [op for k, op in enumerate(ops) if k not in running[1:]]
    outputs = draw(st.lists(st.sampled_from(OUTPUT_KINDS), min_size=1, max_size=6, unique=True))
    if not any(kind in DIFFERENTIABLE for kind in outputs):
        outputs.insert(draw(st.integers(0, len(outputs))), "h")
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(STEPS),
                st.sampled_from(BACKWARDS),
                st.integers(0, 63),
                st.booleans(),
                st.sampled_from([0, 0, 1, 2, 3]),
            ),
            min_size=2,
            max_size=8,
        )
    )
    kept = [k for k, step in enumerate(steps) if step[0] == "keep"]
    if kept and not any(step[0] == "late" for step in steps[kept[0] :]):
        steps.append(("late", "all", 0, False, 0))  # the backward a kept call waits for
    return Program(
        ops=ops,
        outputs=outputs,
        container=draw(st.sampled_from(["tuple", "dict", "namedtuple"])),
        tied=draw(st.booleans()),
        mode=draw(st.sampled_from(["auto", "autograd", "in_graph"])),
        clone=draw(st.booleans()),
        x_grad=draw(st.booleans()),
        gate_grad=draw(st.booleans()),
        scale=draw(st.sampled_from([0.5, 2.0, -1.25])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        captured_training=draw(st.sampled_from([True, True, False])),
        steps=steps,
        seed=draw(st.integers(0, 2**16)),
    )


# -- comparing -----------------------------------------------------------------------------------


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bit for bit: ``-0.0`` is not ``0.0`` (``torch.equal`` says it is).

    >>> same_bits(torch.tensor([-0.0]), torch.tensor([0.0]))
    False
    """
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    if actual.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
        actual, expected = actual.contiguous().view(as_int), expected.contiguous().view(as_int)
    return torch.equal(actual, expected)


def assert_same_tree(
    actual: Any, expected: Any, where: str, inputs: tuple[tuple[torch.Tensor, ...], ...] = ((), ())
) -> None:
    """Same container types and keys, ``None`` and constants, tensors bit for bit with eager's
    ``requires_grad``; an input eager returns (or a view of it) is the caller's tensor (or a
    view of it) on the graphed side too (``inputs``: each side's, in order)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.requires_grad == expected.requires_grad, f"{where}: requires_grad"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert same_bits(actual.detach(), expected.detach()), f"{where}: {actual} vs {expected}"
        for mine, theirs in zip(*inputs, strict=True):
            assert (actual is mine) == (expected is theirs), f"{where}: the input itself"
            assert (actual._base is mine) == (expected._base is theirs), f"{where}: a view"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys"
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{where}[{key!r}]", inputs)
    elif isinstance(expected, tuple):
        assert len(actual) == len(expected), f"{where}: length"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{where}[{i}]", inputs)
    else:
        assert repr(actual) == repr(expected), f"{where}: {actual!r} vs {expected!r}"


def assert_same_grad(
    actual: torch.Tensor | None, expected: torch.Tensor | None, where: str
) -> None:
    """Bit for bit (``-0.0`` is not ``0.0``), ``None`` where eager's is."""
    assert (actual is None) == (expected is None), f"{where}: {actual} vs {expected}"
    if actual is not None and expected is not None:
        assert same_bits(actual, expected), f"{where}: {actual} vs {expected}"


def assert_same_state(graphed: nn.Module, eager: nn.Module, where: str) -> None:
    """Parameters (values and ``.grad``) and buffers equal bit for bit."""
    pairs = zip(graphed.named_parameters(), eager.named_parameters(), strict=True)
    for (name, p), (_, q) in pairs:
        assert same_bits(p.detach(), q.detach()), f"{where}: {name} {p} vs {q}"
        assert_same_grad(p.grad, q.grad, f"{where}: {name}.grad")
    buffers = zip(graphed.named_buffers(), eager.named_buffers(), strict=True)
    for (name, b), (_, c) in buffers:
        assert same_bits(b, c), f"{where}: buffer {name} {b} vs {c}"


def grads_now(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def differentiable_leaves(tree: Any) -> list[torch.Tensor]:
    """The output tensors that require grad, in tree order."""
    leaves = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, tuple):
            stack.extend(reversed(node))
        elif isinstance(node, torch.Tensor) and node.requires_grad:
            leaves.append(node)
    return leaves


def loss_of(tree: Any, inputs: tuple[torch.Tensor, ...], pick: int, subset: bool) -> Any:
    """A weighted sum of the chosen differentiable outputs (an input returned left out: see
    OUTPUT_KINDS); ``None`` when there is none."""
    chosen = [
        t for t in differentiable_leaves(tree) if not any(t is i or t._base is i for i in inputs)
    ]
    if subset:
        chosen = [t for k, t in enumerate(chosen) if pick >> k & 1] or chosen[:1]
    if not chosen:
        return None
    return sum((t * (k + 1.5)).sum() for k, t in enumerate(chosen))


# -- running one program -------------------------------------------------------------------------


class Side:
    """One side of the comparison: a module, its optimizer, and the inputs of its latest call."""

    def __init__(self, module: nn.Module, optimizer: str) -> None:
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(params, lr=0.1, momentum=0.9)
            if optimizer == "sgd"
            else torch.optim.Adam(params, lr=0.01, foreach=True)
        )

    def call(self, inputs: tuple[torch.Tensor, ...], scale: float) -> Any:
        x, mask, gate = inputs
        return self.module(x, mask, gate=gate, scale=scale, tag="t")

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]


def fresh_inputs(
    program: Program, generator: torch.Generator, drop: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The same new inputs twice, one copy each side; ``drop`` passes x and gate without grad
    where the sample had it (README: allowed, never the reverse)."""
    x = torch.randn(BATCH, WIDTH, generator=generator)
    mask = (torch.rand(BATCH, WIDTH, generator=generator) > 0.3).float()
    gate = torch.randn(WIDTH, generator=generator)
    flags = (program.x_grad and not drop & 1, False, program.gate_grad and not drop & 2)

    def copy_of() -> tuple[torch.Tensor, ...]:
        return tuple(
            t.clone().requires_grad_(flag) for t, flag in zip((x, mask, gate), flags, strict=True)
        )

    return copy_of(), copy_of()


def is_documented_refusal(error: DualgraphError, backward: str, mode: str, why: str) -> bool:
    """A refusal the README documents for this step: ``why`` is "second" (a second backward
    through one replay), "stale" (a later forward replay overwrote what it needs) or ""."""
    message = str(error)
    if why == "second":
        return "second backward through the same replay" in message
    if why == "stale":
        return "backward of an earlier replay after a later forward replay" in message
    if mode == "in_graph" and backward.startswith("grad_"):
        return "captured with param_grads='in_graph'" in message
    return False


def run_backward(
    graphed: Side,
    eager: Side,
    outs: tuple[Any, Any],
    inputs: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    program: Program,
    backward: str,
    pick: int,
    where: str,
    replayed: bool,
    stale: bool = False,
    losses: list[Any] | None = None,
) -> None:
    """Backward (or ``torch.autograd.grad``) of the same loss on both sides; ``replayed``:
    the graphed side's call replayed (the module in its capture's training mode); ``stale``:
    a forward replay ran since; ``losses``: computed at the call (a later replay overwrites
    its outputs, README), else now."""
    if losses is None:
        subset = backward == "subset"
        losses = [loss_of(o, i, pick, subset) for o, i in zip(outs, inputs, strict=True)]
    if losses[0] is None or losses[1] is None:
        assert losses[0] is None and losses[1] is None, f"{where}: loss None-ness"
        return
    assert same_bits(losses[0].detach(), losses[1].detach()), f"{where}: loss"
    leaves = [[t for t in i if t.requires_grad] for i in inputs]
    if backward.startswith("grad_"):
        targets = [
            [*leaf, *(side.trainable() if backward != "grad_inputs" else [])]
            for leaf, side in zip(leaves, (graphed, eager), strict=True)
        ]
        if not targets[0]:
            return
        before = grads_now([*leaves[0], *graphed.trainable()])
        try:
            got = torch.autograd.grad(losses[0], targets[0], allow_unused=True, retain_graph=True)
        except DualgraphError as error:
            assert replayed and is_documented_refusal(error, backward, program.mode, ""), (
                f"{where}: {error}"
            )
            event("refused: autograd.grad under in_graph")
            for t, b in zip([*leaves[0], *graphed.trainable()], before, strict=True):
                assert_same_grad(t.grad, b, f"{where}: a refused grad changed .grad")
            return
        if program.mode == "in_graph" and replayed and not leaves[0]:
            # README: asking for parameters only never reaches the replay, so nothing refuses
            # it; torch returns None for them under allow_unused
            assert all(g is None for g in got), f"{where}: in_graph parameter grads"
            event("in_graph: autograd.grad of parameters only gives None")
            return
        expected = torch.autograd.grad(losses[1], targets[1], allow_unused=True, retain_graph=True)
        for k, (a, e) in enumerate(zip(got, expected, strict=True)):
            assert_same_grad(a, e, f"{where}: autograd.grad[{k}]")
        if backward == "grad_retained":  # then a backward through the same graph
            second_backward(graphed, eager, losses, leaves, where, replayed)
        return
    retain = backward == "retain_twice"
    watched = [*leaves[0], *graphed.trainable()]
    before = grads_now(watched)
    refusal: Exception | None = None
    try:
        losses[0].backward(retain_graph=retain)
    except (DualgraphError, RuntimeError) as error:
        refusal = error
    stale_refusal = (
        isinstance(refusal, DualgraphError)
        and replayed
        and stale
        and is_documented_refusal(refusal, backward, "", "stale")
    )
    if stale_refusal:
        event("refused: backward of an earlier replay")
        for t, b in zip(watched, before, strict=True):
            assert_same_grad(t.grad, b, f"{where}: a refused backward changed .grad")
        return
    try:
        losses[1].backward(retain_graph=retain)
    except RuntimeError as error:
        # eager raises (a tensor the backward reads was changed in place since the call: a
        # weight stepped, the buffer updated): the graphed side must have raised too
        assert "modified by an inplace operation" in str(error), f"{where}: {error}"
        assert refusal is not None, f"{where}: eager raised {error}, graphed ran"
        if isinstance(refusal, DualgraphError):
            # refused by name before any grad was added, where eager's engine added those
            # it reached before raising: the twin takes the graphed side's grads
            event("refused as eager: a tensor changed in place before the backward")
            for t, b in zip(watched, before, strict=True):
                assert_same_grad(t.grad, b, f"{where}: a refused backward changed .grad")
            for p, q in zip(graphed.trainable(), eager.trainable(), strict=True):
                q.grad = None if p.grad is None else p.grad.clone()
        else:  # an eager call's backward (the other training mode) raised as the twin's
            assert not replayed and type(refusal) is type(error), f"{where}: {refusal!r}"
            event("raised as eager: an eager fallback's backward")
        return
    if isinstance(refusal, DualgraphError) and "(this call's does not)" in str(refusal):
        # README: a weight stepped before the backward of a call whose inputs need fewer
        # grads than the samples' is refused (eager's may run), before any grad was added
        event("refused: a weight changed before the backward of a call needing fewer grads")
        assert replayed, f"{where}: {refusal}"
        for t, b in zip(watched, before, strict=True):
            assert_same_grad(t.grad, b, f"{where}: a refused backward changed .grad")
        for t in leaves[1]:
            t.grad = None  # eager's inputs got theirs; the graphed side's got none
        for p, q in zip(graphed.trainable(), eager.trainable(), strict=True):
            q.grad = None if p.grad is None else p.grad.clone()
        return
    assert refusal is None, f"{where}: graphed raised {refusal!r} where eager ran"
    for k, (a, e) in enumerate(zip(*leaves, strict=True)):
        assert_same_grad(a.grad, e.grad, f"{where}: input {k}.grad")
    if retain:
        assert_same_state(graphed.module, eager.module, f"{where} first backward")
        second_backward(graphed, eager, losses, leaves, where, replayed)


def second_backward(
    graphed: Side,
    eager: Side,
    losses: list[Any],
    leaves: list[list[torch.Tensor]],
    where: str,
    replayed: bool,
) -> None:
    """Another backward of losses whose graph was retained: refused by name where it goes
    through a replay again (README), leaving every grad as it was; as eager's elsewhere."""
    watched = [*leaves[0], *graphed.trainable()]
    before = grads_now(watched)
    try:
        losses[0].backward()
    except DualgraphError as error:
        assert replayed and is_documented_refusal(error, "", "", "second"), f"{where}: {error}"
        event("refused: a second backward")
        for t, b in zip(watched, before, strict=True):
            assert_same_grad(t.grad, b, f"{where}: a refused backward changed .grad")
        return
    losses[1].backward()
    for k, (a, e) in enumerate(zip(*leaves, strict=True)):
        assert_same_grad(a.grad, e.grad, f"{where}: input {k}.grad after the second backward")


def run_program(program: Program) -> None:
    torch.manual_seed(program.seed)
    module = Composed(program.ops, program.outputs, program.container, program.tied)
    twin = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(program.seed)
    sample, _ = fresh_inputs(program, generator, 0)
    for side in (module, twin):
        side.train(program.captured_training)
    dgt.make_graphed_callables(
        module,
        (sample[0], sample[1]),
        sample_kwargs={"gate": sample[2], "scale": program.scale, "tag": "t"},
        backend="emulate",
        param_grads=program.mode,
        clone_outputs=program.clone,
        allow_unused_input=True,
    )
    graphed, eager = Side(module, program.optimizer), Side(twin, program.optimizer)
    assert_same_state(module, twin, "after capture")

    def held(inputs: tuple[tuple[torch.Tensor, ...], ...]) -> tuple[tuple[torch.Tensor, ...], ...]:
        # an output that is a buffer (or views one) is the module's on both sides
        return (
            (*inputs[0], *module.buffers()),
            (*inputs[1], *twin.buffers()),
        )

    pending: Any = None  # a call kept for a later backward: outputs, inputs, replayed, count
    replays_since = 0  # forward replays so far
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # .grad tensors set to None, and copies
    for n, (step, backward, pick, flag, drop) in enumerate(program.steps):
        where = f"step {n} ({step}, {backward}, pick {pick}, flag {flag}, drop {drop})"
        if step == "train" or step == "eval":
            for side in (graphed, eager):
                side.module.train(step == "train")
        elif step == "zero":
            if flag:  # README: a .grad kept across zero_grad(set_to_none=True) is never written
                kept = [(g, g.clone()) for p in module.parameters() if (g := p.grad) is not None]
            for side in (graphed, eager):
                side.optimizer.zero_grad(set_to_none=flag)
        elif step == "step":
            for side in (graphed, eager):
                side.optimizer.step()
        elif step == "const":
            # README: a changed constant is refused before any buffer is written; a call in
            # the other training mode runs the forward eagerly, as the twin does
            # (and so is a tensor requiring grad where the sample's did not: drop's bits
            # choose which of the two a call changes)
            inputs = fresh_inputs(program, generator, drop)
            scale = program.scale * 2.0 if drop != 3 or program.gate_grad else program.scale
            if scale == program.scale:
                for side in inputs:
                    side[2].requires_grad_(True)
            if module.training == program.captured_training:
                path = r"kwargs\['scale'\]" if scale != program.scale else r"kwargs\['gate'\]"
                with pytest.raises(DualgraphError, match=path):
                    graphed.call(inputs[0], scale)
            else:
                outs = (graphed.call(inputs[0], scale), eager.call(inputs[1], scale))
                assert_same_tree(outs[0], outs[1], f"{where}: output", held(inputs))
        elif step == "late":
            if pending is None:
                continue
            event("backward of a call kept since")
            outs, inputs, replayed, since, losses = pending
            pending = None
            stale = replays_since > since
            run_backward(
                graphed, eager, outs, inputs, program, "all", pick, where, replayed, stale, losses
            )
        else:
            inputs = fresh_inputs(program, generator, drop)
            with torch.set_grad_enabled(step != "no_grad"):
                outs = (
                    graphed.call(inputs[0], program.scale),
                    eager.call(inputs[1], program.scale),
                )
            # a call in the other training mode than capture's runs eagerly
            replayed = module.training == program.captured_training
            replays_since += replayed
            assert_same_tree(outs[0], outs[1], f"{where}: output", held(inputs))
            assert_same_state(module, twin, f"{where} after the forward")
            event(f"{step}, {'replayed' if replayed else 'eager fallback'}")
            if step == "keep":
                losses = [loss_of(o, i, 0, False) for o, i in zip(outs, inputs, strict=True)]
                pending = (outs, inputs, replayed, replays_since, losses)
            elif step == "call" and backward != "none":
                event(f"backward {backward}")
                run_backward(graphed, eager, outs, inputs, program, backward, pick, where, replayed)
        assert_same_state(module, twin, where)
        for grad, value in kept:
            assert same_bits(grad, value), f"{where}: a .grad kept since zero_grad was written"


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_graphed_module_equals_its_eager_copy_over_random_programs(program: Program) -> None:
    run_program(program)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
