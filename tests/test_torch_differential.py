"""Differential fuzzing of the torch adapter: graphed (emulate backend, CPU, fp32) against eager.

Each example builds a small module (Linear, LayerNorm, GELU/ReLU, residual adds, dropout with
``p=0``, a frozen sub-layer, a buffer it updates in place as a running mean (in place, through
``.data``, or read by a product that saves it), a weight tied between two layers and a layer
registered twice), captured in train or eval mode, an output tree (tuple, dict, namedtuple or
list, a nested dict in it) mixing tensors that require grad (a float64 one among them), bool
and detached ones, inputs and views of
inputs, the buffer, ``None``, ints, strings and a kwarg's constants, and a program of calls:
replays with fresh inputs (some without grad), grads accumulated across them, ``zero_grad``
with and without ``set_to_none``, calls under ``torch.no_grad()``, ``train()``/``eval()``
switches (eager fallbacks), a changed constant or an input requiring grad unlike its sample
(refused), backward of a subset of the outputs, ``torch.autograd.grad`` of the inputs (and
parameters), ``retain_graph=True`` and a second backward, a call's backward after later calls
and steps, optimizer steps (SGD with momentum, Adam foreach).

A second property does the same for the parts of real models (:class:`Parts`): an embedding
(``padding_idx``; ``max_norm``, which renormalizes its weight in the forward and is refused at
capture), BatchNorm (train and eval, its running statistics compared after each call),
LayerNorm, RMSNorm, GroupNorm, Conv1d/2d, dropout (the same seed both sides), scaled dot-product
attention (causal, or a bool or additive mask kwarg; its dropout in training),
``relu_``/``add_`` on intermediates, a submodule called twice, a frozen layer, a buffer counted
up in the forward, an embedding tied to the head, integer token ids, non-contiguous views,
constants and nested containers out; and calls interleaved with ``no_grad``/``inference_mode``
calls, ``train()``/``eval()``, one submodule's mode changed (refused naming it), ``zero_grad``,
SGD-momentum/AdamW steps, ``.data`` updates, ``load_state_dict``, a parameter frozen or replaced
(refused naming it), an optional kwarg passed as ``None`` where the sample had a tensor or the
reverse (refused naming it), backward of two calls' summed losses, ``backward(inputs=...)``,
``torch.autograd.grad`` and ``retain_graph``. Every refusal must name what it refuses;
:data:`REFUSALS` counts them.

A third runs the autograd features a training loop uses (:class:`FeatureProgram`) on a small
residual block graphed through each entry point whose calls may come in any order: parameter
post-accumulate-grad hooks reading every ``.grad``, a backward on another thread, an incoming
grad of another dtype and layout, ``zero_grad`` between forward and backward, fused and foreach
AdamW, ``no_grad`` and ``inference_mode`` calls, ``torch.autograd.grad``, a backward under
``inference_mode``, a retained or hooked output.

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
import contextlib
import copy
import dataclasses
import threading
from typing import Any

import pytest
import torch
from entry_points import call_length, graphed_on
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
    "wide",
    "positive",
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
            "wide": h.double() * 1.5,  # float64, its grad cast back to float32
            "positive": h > 0,
        }
        leaves = [values[kind] for kind in self.outputs]
        inner = {"aux": leaves.pop(), "n": len(leaves)} if len(leaves) > 1 else None
        items = [*leaves, inner]
        if self.container == "tuple":
            return tuple(items)
        if self.container == "dict":
            return {f"k{i}": v for i, v in enumerate(items)}
        if self.container == "list":
            return items
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
        container=draw(st.sampled_from(["tuple", "dict", "namedtuple", "list"])),
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
    elif isinstance(expected, tuple | list):
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
        elif isinstance(node, tuple | list):
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


# -- model parts: norms, convolutions, embeddings, attention, token ids --------------------------

SEQ = 5
VOCAB = 7

PART_OPS = (
    "embed",
    "proj",
    "batchnorm",
    "layernorm",
    "rmsnorm",
    "conv1d",
    "conv2d",
    "attention",
    "relu_",
    "add_",
    "shared",
    "frozen",
    "count",
    "transpose",
    "extra",
    "dropout",
    "groupnorm",
)
#: What an output leaf of a model part may be: ``t`` and ``strided`` are views that are not
#: contiguous, ``running_mean`` and ``calls`` buffers, ``tokens`` an integer input handed back.
PART_OUTPUTS = (
    "h",
    "t",
    "strided",
    "logits",
    "pooled",
    "nested",
    "calls",
    "running_mean",
    "tokens",
    "count",
    "none",
    "int",
    "bool",
    "str",
)
PART_BACKWARDS = ("none", "all", "inputs", "grad_params", "grad_inputs", "retain_twice")
PART_STEPS = (
    "call",
    "call",
    "call",
    "pair",
    "no_grad",
    "train",
    "eval",
    "zero",
    "step",
    "data",
    "load",
    "switch",
    "sub_eval",
    "freeze",
    "rebind",
    "inference",
)


class Parts(nn.Module):
    """The parts of real models (norms, convolutions, an embedding, attention) in ``ops``'
    order on ``x`` of shape (batch, seq, width), with token ids; returns ``outputs``' leaves
    in a dict with a nested dict and a tuple."""

    def __init__(self, ops: list[str], outputs: list[str], embedding: str, tied: bool) -> None:
        super().__init__()
        self.ops = ops
        self.outputs = outputs
        self.embed = nn.Embedding(
            VOCAB,
            WIDTH,
            padding_idx=0 if embedding == "padding" else None,
            max_norm=1.0 if embedding == "max_norm" else None,
        )
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.batchnorm = nn.BatchNorm1d(WIDTH)
        self.layernorm = nn.LayerNorm(WIDTH)
        self.rmsnorm = nn.RMSNorm(WIDTH)
        self.groupnorm = nn.GroupNorm(2, WIDTH)
        self.dropout = nn.Dropout(0.25)
        self.conv1d = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.conv2d = nn.Conv2d(1, 2, 3, padding=1)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.offset = nn.Parameter(torch.randn(WIDTH))
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:  # one Parameter used by the embedding and the output head
            self.head.weight = self.embed.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(
        self,
        tokens: torch.Tensor,
        x: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
    ) -> Any:
        h = x
        for op in self.ops:
            if op == "embed":
                h = h + self.embed(tokens)
            elif op == "proj":
                h = self.proj(h)
            elif op == "batchnorm":  # over the width as channels: a transposed layout
                h = self.batchnorm(h.transpose(1, 2)).transpose(1, 2)
            elif op in ("layernorm", "rmsnorm", "dropout"):
                h = getattr(self, op)(h)
            elif op == "groupnorm":  # channels second, as for images
                h = self.groupnorm(h.transpose(1, 2)).transpose(1, 2)
            elif op == "conv1d":
                h = self.conv1d(h.transpose(1, 2)).transpose(1, 2)
            elif op == "conv2d":
                h = self.conv2d(h.unsqueeze(1)).sum(1)
            elif op == "attention":
                q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)
                p = 0.2 if self.training else 0.0  # attention dropout, as in training
                if attn_mask is None:
                    attended = nn.functional.scaled_dot_product_attention(
                        q, k, v, dropout_p=p, is_causal=True
                    )[:, 0]
                else:
                    attended = nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=attn_mask, dropout_p=p
                    ).squeeze(1)
                h = h + attended
            elif op == "relu_":  # in place on an intermediate
                h = self.proj(h)
                h.relu_()
            elif op == "add_":
                h = h * 2.0
                h.add_(self.offset)
            elif op == "shared":  # one submodule called twice
                h = self.shared(torch.tanh(self.shared(h)))
            elif op == "frozen":
                h = self.frozen(h)
            elif op == "count":
                if self.training:
                    self.calls += 1
            elif op == "transpose":
                h = h.transpose(0, 1).contiguous().transpose(0, 1)
            elif op == "extra" and extra is not None:
                h = h + extra
        values = {
            "h": h,
            "t": h.transpose(1, 2),
            "strided": h[:, ::2],
            "logits": self.head(h),
            "pooled": h.mean(1),
            "nested": {"inner": {"sum": (h.sum(-1), None, 3)}, "flag": False},
            "calls": self.calls,
            "running_mean": self.batchnorm.running_mean,
            "tokens": tokens,
            "count": tokens.ne(0).sum(),
            "none": None,
            "int": 3,
            "bool": True,
            "str": "part",
        }
        out = {kind: values[kind] for kind in self.outputs}
        return {"out": out, "pair": (len(out), "end")}


@dataclasses.dataclass
class PartsProgram:
    """A model of parts, its sample call and the steps run on it and on its eager twin."""

    ops: list[str]
    outputs: list[str]
    embedding: str
    tied: bool
    mode: str
    clone: bool
    x_grad: bool
    mask_given: bool
    float_mask: bool
    extra_given: bool
    extra_grad: bool
    optimizer: str
    captured_training: bool
    steps: list[tuple[str, str, int, bool]]
    seed: int


@st.composite
def parts_programs(draw: st.DrawFn) -> PartsProgram:
    ops = draw(st.lists(st.sampled_from(PART_OPS), min_size=1, max_size=6))
    outputs = draw(st.lists(st.sampled_from(PART_OUTPUTS), min_size=1, max_size=5, unique=True))
    differentiable = ("h", "t", "strided", "logits", "pooled", "nested")
    if not any(kind in differentiable for kind in outputs):
        outputs.insert(draw(st.integers(0, len(outputs))), "h")
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(PART_STEPS),
                st.sampled_from(PART_BACKWARDS),
                st.integers(0, 63),
                st.booleans(),
            ),
            min_size=2,
            max_size=8,
        )
    )
    return PartsProgram(
        ops=ops,
        outputs=outputs,
        embedding=draw(st.sampled_from(["plain", "padding", "max_norm"])),
        tied=draw(st.booleans()),
        mode=draw(st.sampled_from(["auto", "autograd", "in_graph"])),
        clone=draw(st.booleans()),
        x_grad=draw(st.booleans()),
        mask_given=draw(st.booleans()),
        float_mask=draw(st.booleans()),
        extra_given=draw(st.booleans()),
        extra_grad=draw(st.booleans()),
        optimizer=draw(st.sampled_from(["sgd", "adamw"])),
        captured_training=draw(st.sampled_from([True, True, False])),
        steps=steps,
        seed=draw(st.integers(0, 2**16)),
    )


#: How often each refusal was met (by what it names), for a local run's report.
REFUSALS: collections.Counter[str] = collections.Counter()


def refused(error: DualgraphError, *names: str) -> str:
    """The first of ``names`` the refusal's message names (it must name one)."""
    message = str(error)
    for name in names:
        if name in message:
            REFUSALS[name] += 1
            event(f"refused: {name}")
            return name
    raise AssertionError(f"a refusal naming none of {names}: {message}")


class PartsSide:
    """One side of a parts program: the module, its optimizer, its latest inputs."""

    def __init__(self, module: nn.Module, optimizer: str) -> None:
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(params, lr=0.1, momentum=0.9)
            if optimizer == "sgd"
            else torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        )

    def call(self, inputs: dict[str, Any]) -> Any:
        return self.module(inputs["tokens"], inputs["x"], **inputs["kwargs"])

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]


def parts_inputs(
    program: PartsProgram, generator: torch.Generator, switch: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same new inputs twice; ``switch`` ("attn_mask" or "extra") passes that optional
    kwarg as the sample did not (a tensor for ``None``, or ``None``)."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    x = torch.randn(BATCH, SEQ, WIDTH, generator=generator)
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=generator) > 0.3
    mask[..., 0] = True  # every query attends one key at least: no NaN rows
    if program.float_mask:  # additive, as HF's extended attention masks
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    extra = torch.randn(SEQ, WIDTH, generator=generator)

    def copy_of() -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if program.mask_given != (switch == "attn_mask"):
            kwargs["attn_mask"] = mask.clone()
        if program.extra_given != (switch == "extra"):
            kwargs["extra"] = extra.clone().requires_grad_(program.extra_grad)
        return {
            "tokens": tokens.clone(),
            "x": x.clone().requires_grad_(program.x_grad),
            "kwargs": kwargs,
        }

    return copy_of(), copy_of()


def float_inputs(inputs: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in (inputs["x"], *inputs["kwargs"].values()) if t.requires_grad]


def handed_back(inputs: dict[str, Any], module: nn.Module) -> tuple[torch.Tensor, ...]:
    return (inputs["tokens"], inputs["x"], *inputs["kwargs"].values(), *module.buffers())


def loss_leaving_out(tree: Any, handed: tuple[torch.Tensor, ...], pick: int) -> Any:
    """``loss_of`` with the views of another output (``t``, ``strided``) left out: their grads
    reach that output outside the replay, summed before what flows into it inside, where
    eager adds every use's grad in one order (last-bit differences, as for a tensor used
    inside and outside a callable: README)."""
    views = tuple(tree["out"][kind] for kind in ("t", "strided") if kind in tree["out"])
    return loss_of(tree, (*handed, *views), pick, False)


def parts_backward(
    graphed: PartsSide,
    eager: PartsSide,
    losses: tuple[Any, Any],
    inputs: tuple[dict[str, Any], dict[str, Any]],
    program: PartsProgram,
    backward: str,
    pick: int,
    where: str,
    replayed: bool,
    stale: bool,
    renamed: set[str],
) -> None:
    """The same backward (or ``torch.autograd.grad``) on both sides: ``inputs`` backward of a
    subset of the parameters and inputs; a refusal must name what it refuses and leave every
    grad as it was (the twin then skips the step)."""
    if losses[0] is None or losses[1] is None:
        assert losses[0] is None and losses[1] is None, f"{where}: loss None-ness"
        return
    assert same_bits(losses[0].detach(), losses[1].detach()), f"{where}: loss"
    leaves = [float_inputs(i) for i in inputs]
    sides = (graphed, eager)
    targets = [[*leaf, *side.trainable()] for leaf, side in zip(leaves, sides, strict=True)]
    if backward == "grad_inputs":
        targets = leaves
    elif backward == "grad_params":
        targets = [side.trainable() for side in sides]
    elif backward == "inputs":
        targets = [[t for k, t in enumerate(ts) if pick >> (k % 6) & 1] for ts in targets]
    watched = [*leaves[0], *graphed.trainable()]
    before = grads_now(watched)
    try:
        if backward.startswith("grad_"):
            if not targets[0]:
                return
            got = torch.autograd.grad(losses[0], targets[0], allow_unused=True)
        elif backward == "inputs":
            if not targets[0]:
                return
            losses[0].backward(inputs=targets[0])
        else:
            losses[0].backward(retain_graph=backward == "retain_twice")
    except DualgraphError as error:
        assert replayed, f"{where}: an eager fallback refused: {error}"
        # a parameter frozen or replaced since capture is refused at the backward (the
        # forward ran as eager's: buffers compared), before any grad
        names = [*renamed, *(["after a later forward replay"] if stale else [])]
        if program.mode == "in_graph":
            names.append("captured with param_grads='in_graph'")
        refused(error, *names)
        for t, b in zip(watched, before, strict=True):
            assert_same_grad(t.grad, b, f"{where}: a refused backward changed .grad")
        return
    asked = {id(t) for t in targets[0]}
    only_parameters = not any(id(t) in asked for t in leaves[0])
    if (
        program.mode == "in_graph"
        and replayed
        and backward in ("inputs", "grad_params")
        and only_parameters
    ):
        # README: a backward asking for parameters only never reaches an 'in_graph' replay:
        # autograd.grad gives None, backward(inputs=params) leaves .grad as it was
        if backward.startswith("grad_"):
            assert all(g is None for g in got), f"{where}: in_graph parameter grads"
        for t, b in zip(watched, before, strict=True):
            assert_same_grad(t.grad, b, f"{where}: in_graph parameters-only backward")
        event("in_graph: a backward of parameters only leaves them as they were")
        return
    if backward.startswith("grad_"):
        expected = torch.autograd.grad(losses[1], targets[1], allow_unused=True)
        for k, (a, e) in enumerate(zip(got, expected, strict=True)):
            assert_same_grad(a, e, f"{where}: autograd.grad[{k}]")
        return
    if backward == "inputs":
        losses[1].backward(inputs=targets[1])
    else:
        losses[1].backward(retain_graph=backward == "retain_twice")
    for k, (a, e) in enumerate(zip(*leaves, strict=True)):
        assert_same_grad(a.grad, e.grad, f"{where}: input {k}.grad")
    if backward == "retain_twice":
        assert_same_state(graphed.module, eager.module, f"{where} first backward")
        try:
            losses[0].backward()
        except DualgraphError as error:
            assert replayed, f"{where}: {error}"
            refused(error, "second backward through the same replay")
            return
        losses[1].backward()


def run_parts_program(program: PartsProgram) -> None:
    torch.manual_seed(program.seed)
    module = Parts(program.ops, program.outputs, program.embedding, program.tied)
    twin = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(program.seed)
    sample, _ = parts_inputs(program, generator)
    for m in (module, twin):
        m.train(program.captured_training)
    try:
        dgt.make_graphed_callables(
            module,
            (sample["tokens"], sample["x"]),
            sample_kwargs=sample["kwargs"],
            backend="emulate",
            param_grads=program.mode,
            clone_outputs=program.clone,
            allow_unused_input=True,
        )
    except DualgraphError as error:
        # Embedding(max_norm=...) renormalizes its weight in the forward: refused, the
        # module left as it was
        assert program.embedding == "max_norm" and "embed" in program.ops, str(error)
        refused(error, "embed.weight: the callable updates this parameter in place")
        assert_same_state(module, twin, "after a refused capture")
        return
    assert_same_state(module, twin, "after capture")
    graphed, eager = PartsSide(module, program.optimizer), PartsSide(twin, program.optimizer)
    earlier: Any = None  # the losses and inputs of the call before, for "pair"
    renamed: set[str] = set()  # what a forward may be refused naming
    replays = 0
    for n, (step, backward, pick, flag) in enumerate(program.steps):
        where = f"step {n} ({step}, {backward}, pick {pick}, flag {flag})"
        if step in ("train", "eval"):
            for m in (module, twin):
                m.train(step == "train")
        elif step == "zero":
            for side in (graphed, eager):
                side.optimizer.zero_grad(set_to_none=flag)
        elif step == "step":
            for side in (graphed, eager):
                side.optimizer.step()
            earlier = None  # eager's backward of a call before would raise (a weight stepped)
        elif step == "freeze":  # a parameter frozen (or unfrozen) between calls
            for m in (module, twin):
                m.proj.weight.requires_grad_(not m.proj.weight.requires_grad)
            earlier = None
            renamed.add("proj.weight")
        elif step == "rebind":  # a parameter replaced by a new one between calls
            for m in (module, twin):
                m.proj.weight = nn.Parameter(m.proj.weight.detach() * 0.5)
            earlier = None
            renamed.add("proj.weight")
        elif step == "sub_eval":  # one submodule in the other mode than the whole module's
            inputs = parts_inputs(program, generator)
            for m in (module, twin):
                m.batchnorm.train(not m.training)
            torch.manual_seed(program.seed + n)
            try:
                outs = (graphed.call(inputs[0]), None)
            except DualgraphError as error:
                assert module.training == program.captured_training, f"{where}: {error}"
                refused(error, "batchnorm")
                assert_same_state(module, twin, f"{where}: a refused call")
            else:
                torch.manual_seed(program.seed + n)
                outs = (outs[0], eager.call(inputs[1]))
                held = (handed_back(inputs[0], module), handed_back(inputs[1], twin))
                assert_same_tree(outs[0], outs[1], f"{where}: output", held)
            finally:
                for m in (module, twin):
                    m.batchnorm.train(m.training)
        elif step == "data":  # in place through .data: no version counter moves
            for m in (module, twin):
                for p in m.parameters():
                    p.data.mul_(0.75).add_(0.125)
        elif step == "load":
            state = {
                k: v * 0.5 if v.is_floating_point() else v for k, v in twin.state_dict().items()
            }
            for m in (module, twin):
                m.load_state_dict(state)
            earlier = None
        elif step == "switch":
            name = "attn_mask" if flag else "extra"
            inputs = parts_inputs(program, generator, name)
            if module.training == program.captured_training:
                with pytest.raises(DualgraphError, match=rf"kwargs\['{name}'\]"):
                    graphed.call(inputs[0])
                REFUSALS[f"kwargs['{name}'] None vs tensor"] += 1
            else:
                torch.manual_seed(program.seed + n)
                graphed_out = graphed.call(inputs[0])
                torch.manual_seed(program.seed + n)
                outs = (graphed_out, eager.call(inputs[1]))
                held = (handed_back(inputs[0], module), handed_back(inputs[1], twin))
                assert_same_tree(outs[0], outs[1], f"{where}: output", held)
        else:
            inputs = parts_inputs(program, generator)
            with (
                torch.inference_mode() if step == "inference" else contextlib.nullcontext(),
                torch.set_grad_enabled(step not in ("no_grad", "inference")),
            ):
                torch.manual_seed(program.seed + n)  # dropout: the same masks both sides
                try:
                    outs = (graphed.call(inputs[0]), None)
                except DualgraphError as error:
                    # refused by name (a parameter frozen or replaced since capture), nothing
                    # changed; the twin skips the call
                    refused(error, *renamed)
                    assert_same_state(module, twin, f"{where}: a refused call")
                    continue
                after = torch.get_rng_state()
                torch.manual_seed(program.seed + n)
                outs = (outs[0], eager.call(inputs[1]))
                assert torch.equal(after, torch.get_rng_state()), f"{where}: random numbers drawn"
            replayed = module.training == program.captured_training
            replays += replayed
            held = (handed_back(inputs[0], module), handed_back(inputs[1], twin))
            assert_same_tree(outs[0], outs[1], f"{where}: output", held)
            assert_same_state(module, twin, f"{where} after the forward")
            event(f"parts {step}, {'replayed' if replayed else 'eager fallback'}")
            losses = tuple(
                loss_leaving_out(o, handed_back(i, m), pick)
                for o, i, m in zip(outs, inputs, (module, twin), strict=True)
            )
            if step == "pair" and earlier is not None and None not in (*losses, *earlier[0]):
                # the backward of the sum of two calls' losses (the earlier one's replay is
                # stale: refused by name where it replayed)
                both = tuple(a + b for a, b in zip(earlier[0], losses, strict=True))
                pair_inputs = tuple(
                    {
                        "x": a["x"],
                        "kwargs": {
                            **a["kwargs"],
                            **{f"{k}2": v for k, v in b["kwargs"].items()},
                            "x2": b["x"],
                        },
                    }
                    for a, b in zip(earlier[1], inputs, strict=True)
                )
                parts_backward(
                    graphed,
                    eager,
                    both,
                    pair_inputs,
                    program,
                    "all",
                    pick,
                    where,
                    replayed or earlier[2],
                    replays > earlier[3] + 1 or (replayed and earlier[2]),
                    renamed,
                )
                if replayed != earlier[2]:
                    # one replay, one eager call: a parameter used in both gets the replay's
                    # sum of its uses, then the eager call's one by one (README: last bits)
                    for p, q in zip(graphed.trainable(), eager.trainable(), strict=True):
                        if p.grad is not None and q.grad is not None:
                            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5), where
                            q.grad = p.grad.clone()
                earlier = None
            elif step == "call" and backward != "none":
                parts_backward(
                    graphed,
                    eager,
                    losses,
                    inputs,
                    program,
                    backward,
                    pick,
                    where,
                    replayed,
                    False,
                    renamed,
                )
                earlier = None
            elif step != "no_grad":
                earlier = (losses, inputs, replayed, replays)
        assert_same_state(module, twin, where)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(parts_programs())
def test_graphed_model_parts_equal_their_eager_copy_over_random_programs(
    program: PartsProgram,
) -> None:
    run_parts_program(program)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


# -- autograd features a training loop uses ------------------------------------------------------

#: Entry points whose calls may come in any order (a schedule's may not); ``graphed_on``'s.
FEATURE_ENTRIES = ("plain", "clone_outputs", "together", "slots", "buckets")
#: One forward each, then (but for ``no_grad`` and ``inference``) one backward of some kind.
FEATURE_STEPS = (
    "backward",
    "thread",
    "incoming",
    "zero_between",
    "fused_step",
    "foreach_step",
    "no_grad",
    "inference",
    "autograd_grad",
    "inference_backward",
    "retained_output",
    "output_hook",
)


class Residual(nn.Module):
    """A Linear, LayerNorm, tanh and Linear, plus its input: ``graphed_on``'s calling convention."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.second = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, valid_length: torch.Tensor | None = None) -> torch.Tensor:
        return self.second(self.norm(self.first(x)).tanh()) + x


@dataclasses.dataclass
class FeatureProgram:
    entry: str
    param_grads: str
    hooks: bool  # post-accumulate-grad hooks reading every .grad, put on before the first call
    steps: list[tuple[str, bool]]  # (step, whether its input requires grad)
    seed: int


@st.composite
def feature_programs(draw: st.DrawFn) -> FeatureProgram:
    return FeatureProgram(
        entry=draw(st.sampled_from(FEATURE_ENTRIES)),
        param_grads=draw(st.sampled_from(["auto", "autograd", "in_graph"])),
        hooks=draw(st.booleans()),
        steps=draw(
            st.lists(
                st.tuples(st.sampled_from(FEATURE_STEPS), st.sampled_from([True, True, False])),
                min_size=1,
                max_size=6,
            )
        ),
        seed=draw(st.integers(0, 2**16)),
    )


def _seen(tensor: torch.Tensor | None) -> Any:
    """What eager's caller can see of a tensor: None, or its flags and bits."""
    if tensor is None:
        return None
    flags = (tensor.dtype, tuple(tensor.shape), tensor.requires_grad, tensor.is_inference())
    return flags, tensor.detach().clone().view(torch.int32).tolist()


def run_features(
    program: FeatureProgram,
    module: nn.Module,
    call: Any,
    length: int,
    log: list[Any],
    until: int | None = None,
) -> None:
    """``program`` on ``module`` (called through ``call``), each thing a caller sees in ``log``;
    stops at the first error, logged (a DualgraphError: its step's index, and whether every
    .grad is as before), or at step ``until``'s backward."""
    generator = torch.Generator().manual_seed(program.seed)
    params = list(module.parameters())
    if program.hooks:
        for i, param in enumerate(params):
            param.register_post_accumulate_grad_hook(
                lambda _, i=i: log.append(("hook", i, [_seen(p.grad) for p in params]))
            )
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for index, (step, requires_grad) in enumerate(program.steps):
        x = torch.randn(2, length, 4, generator=generator).requires_grad_(requires_grad)
        if step in ("no_grad", "inference"):
            with torch.no_grad() if step == "no_grad" else torch.inference_mode():
                out = call(x)
            log.append((step, _seen(out.clone())))  # an inference tensor's flag differs: README
            continue
        out = call(x)
        log.append(("out", _seen(out)))
        if index == until:
            return
        before = [_seen(p.grad) for p in params]
        try:
            loss = out.square().sum()
            if step == "zero_between":
                module.zero_grad(set_to_none=requires_grad)
            if step == "thread":
                raised: list[BaseException] = []

                def backward(
                    loss: torch.Tensor = loss, raised: list[BaseException] = raised
                ) -> None:
                    try:
                        loss.backward()
                    except BaseException as error:  # handed to this thread
                        raised.append(error)

                thread = threading.Thread(target=backward)
                thread.start()
                thread.join()
                if raised:
                    raise raised[0]
            elif step == "incoming":  # float64, transposed
                incoming = torch.randn(4, length, 2, generator=generator, dtype=torch.float64)
                out.backward(incoming.permute(2, 1, 0))
            elif step == "autograd_grad":
                wanted = [x, *params] if requires_grad else params
                log.append(("grads", [_seen(g) for g in torch.autograd.grad(loss, wanted)]))
            elif step == "inference_backward":
                with torch.inference_mode():
                    loss.backward()
            elif step == "retained_output":
                out.retain_grad()
                loss.backward()
                log.append(("retained", _seen(out.grad)))
            elif step == "output_hook":
                out.register_hook(lambda grad: grad * 2)
                loss.backward()
            else:
                loss.backward()
            if step in ("fused_step", "foreach_step"):
                if step not in optimizers:
                    fused = step == "fused_step"
                    optimizers[step] = torch.optim.AdamW(
                        params, lr=0.01, fused=fused, foreach=None if fused else True
                    )
                optimizers[step].step()
                optimizers[step].zero_grad()
        except DualgraphError as error:
            unchanged = before == [_seen(p.grad) for p in params] and x.grad is None
            log.append(("refused", index, str(error), unchanged))
            return
        except RuntimeError as error:  # eager's own error, which eager raises too
            log.append(("error", index, type(error).__name__, str(error)))
            return
        log.append(("grads", _seen(x.grad), [_seen(p.grad) for p in params]))


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(feature_programs())
def test_graphed_module_equals_its_eager_copy_under_autograd_features(
    program: FeatureProgram,
) -> None:
    # parameter hooks reading every .grad, a backward on another thread, incoming grads of
    # another dtype and layout, zero_grad between forward and backward, fused and foreach
    # optimizers, no_grad and inference_mode calls, torch.autograd.grad, a backward under
    # inference_mode, a retained or hooked output; on every entry point calls may take in any
    # order, bit for bit. A refusal only under "in_graph" (its README limits), naming it and
    # changing no .grad; eager is then compared up to that step.
    module = Residual()
    twin = copy.deepcopy(module)
    graphed = graphed_on(program.entry, module, param_grads=program.param_grads)
    length = call_length(program.entry)
    ours: list[Any] = []
    run_features(program, module, graphed, length, ours)
    until = None
    if ours[-1][0] == "refused":
        _, until, message, unchanged = ours.pop()
        assert program.param_grads == "in_graph", message
        assert "param_grads='in_graph'" in message and unchanged, message
        event(f"refused under in_graph: {program.steps[until][0]}")
    elif ours[-1][0] == "error" and "appears to not have been used in the graph" in ours[-1][3]:
        # README: under "in_graph", torch.autograd.grad of the parameters alone finds none of
        # them in the graph (torch's own error, before anything ran)
        _, until, _, message = ours.pop()
        assert program.param_grads == "in_graph", message
        assert program.steps[until] == ("autograd_grad", False), message
        event("in_graph: torch.autograd.grad of parameters alone")
    theirs: list[Any] = []
    run_features(program, twin, twin, length, theirs, until)
    assert ours == theirs
