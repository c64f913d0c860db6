"""A check against eager: does a graphed callable still compute what its eager twin computes?

:func:`verify` runs the graphed callable for ``steps`` calls with their backward, then puts the
model back as it was and runs the original (eager) callable the same way from the same state: the
same parameters and buffers, the same CPU and CUDA RNG states, ``.grad`` starting from ``None`` and
accumulating over the steps on both sides (a ``main_grad`` from its values). It compares, leaf by
leaf and step by step: the outputs (the ``None`` and constant positions, which tensors require grad,
and which output is another output, an input, a buffer or a view of one, as well as the values), the
grads of the inputs that require grad, the parameters' ``.grad``, and the inputs, buffers (a graphed
function's: what :func:`closed_over_tensors` finds) and tensor attributes of the parameters (a fused
weight-grad accumulation's ``main_grad``, where the backward adds the weight grad and hands autograd
a dummy) the calls changed, the trained parameters a call changed (an optimizer step in its
backward, which leaves no ``.grad``), and the state torch's generators (the CPU's, each GPU's) are
left in where a call drew from them: a replay that draws other numbers than eager, or none where
eager draws on the host (a layer drop's coin), leaves what draws next in training other numbers.
Both sides backpropagate the same seeded random output grads; from step 2 on, where several outputs
require grad, each step leaves one out of the backward in turn (``report.left_out``; not under a
``schedule=``, whose next pass must be that backward), as a loss of some outputs does, so a replay
that gives an output no loss used a stale grad differs. A call that shape buckets pad
(``fallback="pad"``) reaches the eager side as it reaches the replay: padded, with ``valid_length``,
its outputs cut back; the capture compared that with the call as it is, up to rounding, at a few
lengths per bucket, and verify compares them again at the length of the call it runs (a leaf
``padding``, failing with the capture check's refusal). Afterwards parameters, buffers, ``.grad``
(the same tensor objects, with their values), the RNG states (torch's, Python's ``random``, numpy's
global one) and the Python attributes of the module and its submodules (a counter ``self.calls +=
1``) are as they were; the last two are not reset between the sides, since a graph on the GPU does
not rerun Python. With replay slots (``slots=k``) the steps replay the slots in turn, step ``i``
slot ``(i - 1) % k``: ``steps >= k`` verifies every slot. Usable in a training script between steps
(after ``optimizer.step()``, not between a forward and its backward); like any replay, the calls
overwrite the static outputs of earlier replays.

Inputs vary. Step 1 gets the inputs as given; each later step gets them with every floating
(and complex) tensor scaled toward zero by a step's factor (31/32, 15/16, 29/32, 7/8, then
again), the same values on both sides; integers and bools stay as given (indices must stay in
range). So a replay that ignores its new inputs (a static input buffer left with step 1's
values) differs from eager from step 2 on. A factor below 1 is used rather than a shift or a
factor above 1 because it keeps every range that holds zero: probabilities stay in ``[0, 1]``,
``tanh`` outputs in ``[-1, 1]``, a positive scale positive, a float index in ``[0, n)``; zeros,
signs and infinities stay as they are, and nothing overflows (a mask's ``finfo.min`` neither).
What the caller passed is never changed: each call gets clones. An input all of integers,
bools or zeros gives the later steps the same values again; the report's ``varied_steps`` says
which steps got other values, and ``str()`` says so.

Tolerances. On the CPU every dtype must match exactly, the sign of a zero too (``0.0 == -0.0``, but
``1 / x`` tells them apart): the emulate and eager backends run the same kernels in the same order.
On the GPU a replay runs the kernels eager runs, but kernels that
accumulate with atomics (``index_add``, scatter backward, cuDNN weight grads unless
``torch.backends.cudnn.deterministic``) differ between any two runs, eager ones included; so a
leaf passes where ``|graphed - eager| <= atol * scale + rtol * |eager|`` elementwise, ``scale``
being the leaf's largest ``|eager|`` (at least 1), with ``torch.testing.assert_close``'s
per-dtype defaults:

===================  ==========  ==========
dtype (on the GPU)   rtol        atol
===================  ==========  ==========
float64, complex128  1e-7        1e-7
float32, complex64   1.3e-6      1e-5
float16              1e-3        1e-5
bfloat16             1.6e-2      1e-5
float8 (all)         1.25e-1     1.25e-1
integers, bool       exact       exact
===================  ==========  ==========

``rtol=``/``atol=`` (numbers ``>= 0``) override them for every floating leaf.

Randomness. Both sides start from the same RNG states. Under ``emulate`` and ``eager`` the
replay re-runs the callable, so dropout draws the same masks as eager. Under ``cuda``, torch's
graph-safe Philox RNG gives each random kernel in a replay the offset the CUDA generator holds at
replay time plus the offset it had inside the capture, which is the offset eager gives it; so the
same masks are expected when the graph and eager draw in the same order (``test_torch_verify.py``
has a CUDA test with dropout). Random numbers drawn from anything else (a generator of your own,
Transformer Engine's RNG tracker) are not reset by ``verify``: compare with such dropout off.

>>> import torch, dualgraph.torch as dgt
>>> layer = dgt.make_graphed_callables(
...     torch.nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),), backend="emulate")
>>> report = verify(layer, torch.randn(2, 4, requires_grad=True))
>>> report.ok, report.worst_path
(True, 'step 1 output')
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from .._call import describe_call
from .._errors import DualgraphError, SpecMismatchError
from .._spec import TreeSpec, describe
from ._ambient import outside_autocast
from ._buckets import BucketedCallable
from ._closed_over import closed_over_tensors, modules_named_by
from ._graphed import diagnostics
from ._inputs import same_tensor_twice
from ._leaves import dtype_name
from ._module_attributes import module_attributes, put_back
from ._modules import runner_of, the_module_of_its_forward, training_at_capture
from ._param_attributes import parameter_attributes_kept
from ._params import is_tensor_subclass, same_bits, set_versions, write_back
from ._probe import cloned_inputs, module_of
from ._process_state import kept_process_state
from ._replay import GraphedCallable
from ._slots import FreeSlots, ScheduleCursor, SlottedCallable
from ._te_state import fp8_state_kept

__all__ = ["CUDA_TOLERANCES", "LeafCheck", "VerifyReport", "eager_twin", "verify"]

#: ``dtype -> (rtol, atol)`` for floating leaves on the GPU; on the CPU everything is exact.
CUDA_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    **{
        getattr(torch, name): (1.25e-1, 1.25e-1)
        for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
        if hasattr(torch, name)
    },
}


@dataclass(frozen=True)
class LeafCheck:
    """One compared leaf: ``score`` is the worst ``|diff| / allowed`` (``inf`` on an exact miss).

    ``problem`` describes a difference that has no number (a ``None`` where eager has a tensor,
    another output structure); such a leaf never passes.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    rtol: float
    atol: float
    score: float
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.score <= 1.0


@dataclass(frozen=True)
class VerifyReport:
    """Every leaf compared over the steps, and the verdict; ``str()`` is a table, worst first."""

    name: str
    backend: str
    steps: int
    checks: tuple[LeafCheck, ...] = field(default=())
    #: the steps (1-based, as in the leaves' paths) whose inputs differed from the given ones
    varied_steps: tuple[int, ...] = ()
    #: ``(step, output path)`` for the steps whose backward left an output out (no grad for
    #: it, as a loss of some outputs only gives): from step 2 on, one in turn where several
    #: outputs require grad
    left_out: tuple[tuple[int, str], ...] = ()

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failures(self) -> tuple[LeafCheck, ...]:
        return tuple(check for check in self.checks if not check.ok)

    @property
    def worst(self) -> LeafCheck | None:
        """The leaf furthest from (or over) its tolerance; problems first."""
        return max(self.checks, key=lambda c: (bool(c.problem), _finite(c.score)), default=None)

    @property
    def worst_path(self) -> str | None:
        worst = self.worst
        return None if worst is None else worst.path

    def __str__(self) -> str:
        worst = self.worst
        what = f"{self.name} ({self.backend}), {self.steps} step{'s' * (self.steps != 1)}"
        if worst is None:
            header = f"verify {what}: nothing to compare"
        elif self.ok:
            leaves = (
                "1 leaf matches" if len(self.checks) == 1 else f"{len(self.checks)} leaves match"
            )
            header = (
                f"verify OK: {what}: {leaves} eager (worst: {worst.path}, "
                f"max abs {worst.max_abs:.3g}, {_finite(worst.score):.3g} of its tolerance)"
            )
        else:
            header = (
                f"verify FAILED: {what}: {len(self.failures)} of {len(self.checks)} leaves differ "
                f"from eager (worst: {worst.path}"
                + (f": {worst.problem})" if worst.problem else f", max abs {worst.max_abs:.3g})")
            )
        if self.steps > 1:
            header += "\n" + _inputs_line(self.steps, self.varied_steps)
        if self.left_out:
            header += "\nbackward: every output in step 1; " + "; ".join(
                f"step {step}: {path} left out of the backward" for step, path in self.left_out
            )
        if self.backend == "eager":
            header += "\n(the eager backend runs the callable itself: both sides are eager)"
        titles = ("leaf", "dtype", "shape", "max abs", "max rel", "rtol", "atol", "score", "")
        rows = [
            (
                c.path,
                c.dtype,
                "[" + ", ".join(map(str, c.shape)) + "]",
                f"{c.max_abs:.3g}",
                f"{c.max_rel:.3g}",
                f"{c.rtol:.2g}",
                f"{c.atol:.2g}",
                f"{c.score:.3g}",
                "ok" if c.ok else "FAIL",
            )
            for c in self.checks
            if not c.problem
        ]
        widths = [max(len(row[i]) for row in [titles, *rows]) for i in range(len(titles))]
        lines = [header]
        if rows:
            for row in [titles, *rows]:
                cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=True)]
                lines.append("  ".join(cells).rstrip())
        lines += [f"{c.path}: FAIL: {c.problem}" for c in self.checks if c.problem]
        return "\n".join(lines)


def verify(
    graphed: Any,
    /,
    *args: Any,
    steps: int = 2,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> VerifyReport:
    """Run ``graphed`` and its eager twin ``steps`` times from the same state; compare everything.

    ``graphed`` is what :func:`~dualgraph.torch.make_graphed_callables` returned (a module or a
    :class:`~dualgraph.torch.GraphedCallable`), ``args``/``kwargs`` one call's inputs (cloned for
    each call on each side, ``requires_grad`` kept; from step 2 on the floating ones scaled, the
    same on both sides: ``varied_steps`` in the report). The keywords ``steps``, ``rtol`` and
    ``atol`` are verify's own. Parameter grads and buffers are compared for graphed modules,
    and buffers for a graphed method of a module; for a graphed function, the tensors and
    modules' buffers its own code names from its closure or its globals
    (:func:`closed_over_tensors`), compared and put back as buffers are. See the module
    docstring for tolerances, RNG and the inputs of later steps.
    Raises :class:`~dualgraph.DualgraphError` when the graphed call would not replay (a module
    whose ``training`` mode differs from capture time runs eagerly, as does a call of shapes no
    bucket takes under ``fallback="eager"``).

    >>> import torch, dualgraph.torch as dgt
    >>> double = dgt.make_graphed_callables(
    ...     lambda x: (x * 2, None), (torch.ones(3),), backend="emulate")
    >>> print(verify(double, torch.arange(3.0), steps=1))  # doctest: +NORMALIZE_WHITESPACE
    verify OK: <lambda> (emulate), 1 step: 1 leaf matches eager (worst: step 1 output[0],
    max abs 0, 0 of its tolerance)
    leaf             dtype    shape  max abs  max rel  rtol  atol  score
    step 1 output[0] float32  [3]    0        0        0     0     0      ok
    """
    if not isinstance(steps, int) or steps < 1:
        raise DualgraphError(f"steps must be a positive int, got {steps!r}")
    graphed = the_module_of_its_forward(graphed)  # module.forward verifies the module
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not _is_tolerance(value):
            raise DualgraphError(f"{name} must be a number >= 0, got {value!r}")
    info = diagnostics(graphed)
    runner = runner_of(graphed)
    scheduled = False
    if isinstance(runner, SlottedCallable) and isinstance(runner._gate, ScheduleCursor):
        scheduled = True
        refusal = runner._gate.refuses_calls(runner, steps)
        if refusal is not None:  # before anything runs: a half-run step would stay in flight
            raise refusal
    # outputs left out of later steps' backwards, in turn; not under a schedule, whose next pass
    # must be the backward (a backward of the rest alone may not reach the replay: return x, h)
    leave_out = not scheduled
    # a graphed module, or the module whose method was graphed (its parameters are frozen: the
    # capture refuses a function whose outputs depend on parameters it does not take)
    original = _original(graphed)
    module = graphed if isinstance(graphed, torch.nn.Module) else module_of(original)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad] if module else []
    buffers = [(f"buffer {n}", b) for n, b in module.named_buffers()] if module else []
    if module is None:
        buffers += closed_over_tensors(original)
    # what a fused weight-grad accumulation's backward adds into (main_grad): compared and put
    # back as buffers are, since the .grad autograd gets there is a dummy
    buffers += _parameter_tensors(params)

    # Transformer Engine's FP8 scales, amax histories and autocast mark: kept as the rest
    fp8 = fp8_state_kept(module)
    # the process's state (RNG, grad mode, autocast, numerics settings) is put back at the end;
    # torch's RNG also between the sides, which start from the same draws. Python's and numpy's
    # streams and the modes are not: a graph on the GPU does not rerun Python, so a difference
    # they make is one a replay would make too.
    with kept_process_state() as process, _state_kept(params, buffers, module, original) as state:
        # fallback="pad": the capture checked padding at a few lengths; this call's is checked
        # here, since the eager side below gets the call padded as the replay does
        padding = (
            runner.padding_difference(tuple(args), dict(kwargs))
            if isinstance(runner, BucketedCallable)
            else None
        )
        try:
            replays, eager_calls = info.replays, info.eager_calls
            with _each_slot_in_turn(runner) as before_step:
                graphed_steps = _run_steps(
                    graphed, args, kwargs, steps, params, buffers, before_step, leave_out
                )
            # read afresh: a slotted callable's diagnostics are made at each read
            after = diagnostics(graphed)
            replayed = after.replays - replays
            if replayed != steps:
                raise DualgraphError(
                    f"{info.name}: {steps} calls replayed {replayed} times, so there is nothing "
                    f"to verify: "
                    f"{_why_eager(graphed, after.eager_calls > eager_calls, args, kwargs)}"
                )
            _restore(params, buffers, state)
            process.put_back_torch_rng()
            fp8.put_back()
            with eager_twin(graphed, as_replayed=True) as eager, _eager_context(graphed):
                eager_steps = _run_steps(
                    eager, args, kwargs, steps, params, buffers, leave_out=leave_out
                )
        finally:
            fp8.put_back()

    checks: list[LeafCheck] = []
    if padding is not None:
        checks.append(LeafCheck("padding", "", (), math.inf, math.inf, 0.0, 0.0, math.inf, padding))
    for step, (ours, theirs) in enumerate(zip(graphed_steps, eager_steps, strict=True), 1):
        checks += _compare_step(f"step {step} ", ours, theirs, rtol, atol)
    varied = tuple(step for step, ours in enumerate(graphed_steps, 1) if ours.varied)
    left_out = tuple(
        (step, ours.left_out) for step, ours in enumerate(graphed_steps, 1) if ours.left_out
    )
    return VerifyReport(info.name, info.backend, steps, tuple(checks), varied, left_out)


def _parameter_tensors(
    params: Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """The parameters' own public tensor attributes (``main_grad``), labelled by path.

    >>> weight = torch.nn.Parameter(torch.ones(2))
    >>> weight.main_grad = torch.zeros(2)
    >>> [label for label, _ in _parameter_tensors([("fc.weight", weight)])]
    ['attribute fc.weight.main_grad']
    """
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for path, param in params:
        if is_tensor_subclass(param):
            continue  # a subclass's attributes (an FP8 weight's) are its data and caches
        for name, value in param.__dict__.items():
            if (
                not name.startswith("_")
                and isinstance(value, torch.Tensor)
                and value.layout == torch.strided
                and not value.is_meta
                and id(value) not in seen
            ):
                seen.add(id(value))
                found.append((f"attribute {path}.{name}", value))
    return found


def _same_tensor_twice(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """The paths of the first tensor a call passes at two inputs, as the call spells them."""
    spec = describe_call(tuple(args), dict(kwargs))
    found = [
        (path, leaf)
        for path, leaf in zip(
            spec.array_paths, spec.flatten(tuple(args), dict(kwargs)), strict=True
        )
        if isinstance(leaf, torch.Tensor)
    ]
    return same_tensor_twice([path for path, _ in found], [leaf for _, leaf in found])


def _why_eager(
    graphed: Any,
    branched: bool = False,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Why calls of ``graphed`` ran eagerly instead of replaying (``branched``: the diagnostics
    counted eager calls, of a callable whose Python reads grad mode or ``requires_grad``, or of
    a call passing one tensor at several inputs: ``args``, ``kwargs``)."""
    captured = training_at_capture(graphed) if isinstance(graphed, torch.nn.Module) else None
    if captured is not None and captured != graphed.training:
        return (
            "a graphed module whose training mode differs from capture time runs eagerly "
            "(set .train()/.eval() as at capture)"
        )
    twice = _same_tensor_twice(args, kwargs or {}) if branched else None
    if twice is not None:
        earlier, path = twice
        return (
            f"{path} is the same tensor as {earlier}, and a call passing one tensor at several "
            "inputs runs eagerly (the callable's Python may tell them apart by identity, where "
            "a replay's inputs are buffers of their own); pass tensors of their own (clone())"
        )
    runner = runner_of(graphed)
    if branched and not (isinstance(runner, BucketedCallable) and runner.fallback == "eager"):
        return (
            "its Python reads grad mode or an input's requires_grad (seen at warmup), so a "
            "call whose inputs' requires_grad differs from the samples' (or, where it reads "
            "grad_fn or is_leaf, whose input is no leaf) runs eagerly (pass inputs requiring "
            "grad as the samples did, leaves where those are read)"
        )
    return (
        'with fallback="eager", a call of shapes no bucket takes runs eagerly (pass inputs '
        "of a bucket's shapes)"
    )


# -- one side ------------------------------------------------------------------------------------


@dataclass
class _Step:
    """What one call and its backward left: outputs, grads, and changed inputs and buffers."""

    spec: TreeSpec
    outputs: list[torch.Tensor]
    input_grads: dict[str, torch.Tensor | None]
    param_grads: dict[str, torch.Tensor | None]
    after: dict[str, torch.Tensor]  # "input args[0]", "buffer bn.running_mean", ...: after it
    changed: set[str]  # the keys of ``after`` whose values the call changed
    # per output leaf, what it is or views among the outputs, inputs and the module's tensors
    # (:func:`_relations`; "" for a tensor of its own)
    relations: list[str] = field(default_factory=list)
    # torch's generators after the call ("torch's RNG (CPU)", "torch's RNG (cuda:0)", ...), and
    # those the call (forward and backward) moved
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    rng_changed: set[str] = field(default_factory=set)
    varied: bool = False  # whether its inputs' values differed from the given ones (_vary_inputs)
    left_out: str = ""  # the output given no grad in the backward ("output[0]"), or ""
    # the parameters the call (an optimizer step in its backward) changed, by label
    # ("parameter fc.weight"), with their values after it; unchanged ones are not kept
    params_after: dict[str, torch.Tensor] = field(default_factory=dict)


def _run_steps(
    call: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    steps: int,
    params: Sequence[tuple[str, torch.Tensor]],
    buffers: Sequence[tuple[str, torch.Tensor]],
    before_step: Callable[[int], None] | None = None,
    leave_out: bool = True,
) -> list[_Step]:
    for _, param in params:
        param.grad = None
    given = _given_tensors(args, kwargs)
    results = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        call_args, call_kwargs, inputs = cloned_inputs(tuple(args), dict(kwargs))
        varied = _vary_inputs(inputs, given, step)
        before = {f"input {p}": t.detach().clone() for p, t in inputs}
        before.update({label: b.detach().clone() for label, b in buffers})
        rng_before = _torch_rng_states()
        params_before = [p.detach().clone() for _, p in params]
        with torch.enable_grad():
            out = call(*call_args, **call_kwargs)
        spec = describe(out, root="output")
        flat = spec.flatten(out)
        outputs = [_owned(t) for t in flat]
        relations = _relations(spec, flat, inputs, [*params, *buffers])
        live = [
            (path, t)
            for path, t in zip(spec.array_paths, flat, strict=True)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # from step 2 on, with several outputs requiring grad, one is left out of the backward in
        # turn (a loss of some outputs only): its replay gets no grad for it, as training's may
        left_out = (step - 1) % len(live) if leave_out and step and len(live) > 1 else None
        if live:
            cotangents = [_cotangent(t, step, i) for i, (_, t) in enumerate(live)]
            kept = [i for i in range(len(live)) if i != left_out]
            with outside_autocast():  # torch's AMP recipe: autocast wraps the forward alone
                torch.autograd.backward([live[i][1] for i in kept], [cotangents[i] for i in kept])
        after = {f"input {p}": t.detach().clone() for p, t in inputs}
        after.update({label: b.detach().clone() for label, b in buffers})
        rng = _torch_rng_states()
        params_after = {
            f"parameter {name}": param.detach().clone()
            for (name, param), was in zip(params, params_before, strict=True)
            if not same_bits(param.detach(), was)
        }
        del params_before
        results.append(
            _Step(
                spec=spec,
                outputs=outputs,
                input_grads={p: _owned(t.grad) for p, t in inputs if t.requires_grad},
                param_grads={n: _owned(p.grad) for n, p in params},
                after=after,
                # bit for bit: by value a NaN is never itself, and -0.0 is 0.0
                changed={key for key, value in after.items() if not same_bits(value, before[key])},
                varied=varied,
                left_out="" if left_out is None else f"output{live[left_out][0]}",
                params_after=params_after,
                relations=relations,
                rng=rng,
                rng_changed={
                    key
                    for key, state in rng.items()
                    if key not in rng_before or not torch.equal(state, rng_before[key])
                },
            )
        )
    return results


_OWN = "a tensor of its own"


def _relations(
    spec: TreeSpec,
    flat: Sequence[Any],
    inputs: Sequence[tuple[str, torch.Tensor]],
    module_tensors: Sequence[tuple[str, torch.Tensor]],
) -> list[str]:
    """What each output leaf is, or is a view of, among the outputs before it, the call's inputs
    and the module's parameters and buffers: ``"output[0] itself"``, ``"a view of args[0]"``,
    ``""`` for a tensor of its own (or a view of a tensor none of those is). A replay promises
    eager's relations (one tensor returned twice is one object, ``h.t()`` a view of ``h``, an
    input returned is the caller's tensor), which values alone do not show.

    >>> x = torch.ones(2, 2)
    >>> h = x * 2
    >>> out = (h, h, h.t(), x, x[0], torch.ones(1))
    >>> spec = describe(out, root="output")
    >>> _relations(spec, spec.flatten(out), [("args[0]", x)], [])
    ['', 'output[0] itself', 'a view of output[0]', 'args[0] itself', 'a view of args[0]', '']
    """
    named: dict[int, str] = {}
    for label, tensor in module_tensors:
        named.setdefault(id(tensor), label)
    for path, tensor in inputs:
        named.setdefault(id(tensor), path.removeprefix("input "))
    found: list[str] = []
    for path, leaf in zip(spec.array_paths, flat, strict=True):
        if not isinstance(leaf, torch.Tensor):
            found.append("")
            continue
        if id(leaf) in named:
            found.append(f"{named[id(leaf)]} itself")
            continue
        base = leaf._base if leaf._is_view() else None
        found.append(
            "" if base is None or id(base) not in named else f"a view of {named[id(base)]}"
        )
        named[id(leaf)] = f"output{path}"
    return found


def _torch_rng_states() -> dict[str, torch.Tensor]:
    """Torch's default generators' states: the CPU's, and each GPU's where CUDA is initialised
    (a replay moves a GPU's offset as eager's kernels do; a draw on the host it does not
    repeat)."""
    states = {"torch's RNG (CPU)": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"torch's RNG (cuda:{index})"] = state
    return states


class _SlotInTurn(FreeSlots):
    """``slots=k`` under verify: step ``i`` (0-based) takes slot ``i % k``, so that ``k`` steps
    replay every slot (each step's backward frees its slot, so the lowest free one, slot 0,
    would take them all); a slot in flight from before verify is passed over as usual."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots = slots
        self.step = 0

    def take(self, front: SlottedCallable, grad_enabled: bool) -> int:
        index = self.step % self.slots
        if not front._is_in_flight(index):
            return index
        return super().take(front, grad_enabled)

    def set_step(self, step: int) -> None:
        self.step = step


@contextlib.contextmanager
def _each_slot_in_turn(runner: Any) -> Iterator[Callable[[int], None] | None]:
    """For a callable with replay slots (``slots=k``): a function telling it which step runs
    next, each step then replaying slot ``step % k``; the usual choice is back afterwards.
    ``None`` for one slot or a schedule (which picks its own slots)."""
    if not (isinstance(runner, SlottedCallable) and type(runner._gate) is FreeSlots):
        yield None
        return
    usual = runner._gate
    turn = _SlotInTurn(len(runner._replays))
    runner._gate = turn
    try:
        yield turn.set_step
    finally:
        runner._gate = usual


@contextlib.contextmanager
def eager_twin(graphed: Any, *, as_replayed: bool = False) -> Iterator[Callable[..., Any]]:
    """The original callable behind ``graphed``, called the way ``graphed`` is called.

    The runner (a :class:`GraphedCallable`'s plan, an :class:`EagerCallable`, a
    :class:`BucketedCallable`) keeps the callable it runs: for a module, the ``forward`` it had
    at capture. A graphed module is called as a module (its hooks run), with that ``forward``
    in place of the graphed one for the call. ``as_replayed``: handed its inputs as a replay is
    (shape buckets under ``fallback="pad"``: padded, with ``valid_length``, outputs cut back).
    """
    original = _original(graphed)
    runner = runner_of(graphed)
    if as_replayed and isinstance(runner, BucketedCallable):
        original = runner.eager_call(original)
    if not isinstance(graphed, torch.nn.Module):
        yield original
        return
    installed = graphed.__dict__["forward"]
    graphed.__dict__["forward"] = original
    try:
        yield graphed
    finally:
        graphed.__dict__["forward"] = installed


def _eager_context(graphed: Any) -> contextlib.AbstractContextManager[Any]:
    """The context the ``"eager"`` backend calls the callable in (a Transformer Engine autocast
    of the precision it was graphed with), or none."""
    runner = runner_of(graphed)
    if isinstance(runner, SlottedCallable):
        runner = runner._replays[0]
    if isinstance(runner, GraphedCallable):
        run = runner.plan.eager_context
    else:  # EagerCallable, BucketedCallable
        run = runner._hooks.run_eager
    return contextlib.nullcontext() if run is None else run()


def _original(graphed: Any) -> Callable[..., Any]:
    """What the runner behind ``graphed`` runs (for a module, its ``forward`` at capture)."""
    runner = runner_of(graphed)
    if isinstance(runner, SlottedCallable):
        runner = runner._replays[0]  # every slot replays the same callable
    return runner.plan.fn if isinstance(runner, GraphedCallable) else runner.fn


# -- the inputs of later steps -------------------------------------------------------------------

#: what steps 2, 3, 4, 5 (then 6, 7, ... in turn) scale the floating inputs by; below 1, so every
#: range that holds zero is kept (the module docstring says why)
_INPUT_FACTORS = (31 / 32, 15 / 16, 29 / 32, 7 / 8)


def _input_factor(step: int) -> float:
    """What a 0-based step scales the floating inputs by: 1 for the first.

    >>> [_input_factor(step) for step in range(6)]
    [1.0, 0.96875, 0.9375, 0.90625, 0.875, 0.96875]
    """
    return 1.0 if step == 0 else _INPUT_FACTORS[(step - 1) % len(_INPUT_FACTORS)]


def _given_tensors(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The caller's input tensors, in the order :func:`cloned_inputs` lists their clones."""
    spec = describe_call(tuple(args), dict(kwargs))
    leaves = spec.flatten(tuple(args), dict(kwargs))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _vary_inputs(
    inputs: Sequence[tuple[str, torch.Tensor]], given: Sequence[torch.Tensor], step: int
) -> bool:
    """Set the floating clones in ``inputs`` to their given tensor's values times the step's
    factor; whether any value is now other than given (not when all are zeros, or integers).

    Each clone is written from its given tensor rather than scaled in place: clones sharing
    memory (``x`` and ``x[0]``) would be scaled twice. Scaling is elementwise, so what they
    share gets one value.

    >>> x = torch.tensor([1.0, 0.0])
    >>> _, _, inputs = cloned_inputs((x, torch.tensor([3])), {})
    >>> _vary_inputs(inputs, [x, torch.tensor([3])], 1), inputs[0][1], inputs[1][1], x
    (True, tensor([0.9688, 0.0000]), tensor([3]), tensor([1., 0.]))
    """
    factor = _input_factor(step)
    if factor == 1.0:
        return False
    varied = False
    with torch.no_grad():
        for (_, clone), original in zip(inputs, given, strict=True):
            if not _scalable(clone):
                continue
            # float16, bfloat16 and float8 are scaled in float32 (float8 has no CPU multiply)
            wide = torch.promote_types(original.dtype, torch.float32)
            values = original.detach().to(wide)
            clone.copy_(values * factor)
            now = clone.detach().to(wide)
            varied = varied or bool(((now != values) & ~(now.isnan() & values.isnan())).any())
    return varied


def _scalable(tensor: torch.Tensor) -> bool:
    """A plain dense floating or complex tensor (a subclass's values are its own business)."""
    return (
        type(tensor) is torch.Tensor
        and (tensor.is_floating_point() or tensor.is_complex())
        and tensor.layout == torch.strided
        and not tensor.is_meta
    )


def _inputs_line(steps: int, varied: Sequence[int]) -> str:
    """The report's line on which inputs the steps ran on.

    >>> _inputs_line(3, (2, 3))
    'inputs: step 1 as given; steps 2, 3 with the floating ones scaled by 31/32, 15/16'
    >>> print(_inputs_line(2, ()))
    inputs: step 1 as given; step 2 the same (no floating input other than zeros): a replay that
    ignores new inputs would pass
    """
    parts = ["step 1 as given"]
    if varied:
        factors = ", ".join(str(Fraction(_input_factor(step - 1))) for step in varied[:4])
        parts.append(f"{_step_list(varied)} with the floating ones scaled by {factors}")
    same = [step for step in range(2, steps + 1) if step not in varied]
    if same:
        parts.append(
            f"{_step_list(same)} the same (no floating input other than zeros): a replay that "
            "ignores new inputs would pass"
        )
    return "inputs: " + "; ".join(parts)


def _step_list(steps: Sequence[int]) -> str:
    return f"step{'s' * (len(steps) != 1)} " + ", ".join(map(str, steps))


# -- state kept and put back -----------------------------------------------------------------------


@dataclass
class _State:
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    grads: list[tuple[torch.Tensor | None, torch.Tensor | None]]  # the object, its values


@contextlib.contextmanager
def _state_kept(
    params: Sequence[tuple[str, torch.Tensor]],
    buffers: Sequence[tuple[str, torch.Tensor]],
    module: torch.nn.Module | None,
    original: Callable[..., Any],
) -> Iterator[_State]:
    """The saved module state; on exit everything is put back, ``.grad`` objects and values
    included, and so are the Python attributes of the module's and of the modules the callable's
    code names (a closed-over module's counter) and the parameters' own (``main_grad``).
    The process's (RNG, modes, settings) is :func:`kept_process_state`'s."""
    attributes = module_attributes(module, *modules_named_by(original))
    # their version counters too: verify's own calls move those of .grad (the replays add into
    # it) and of buffers a call updates in place, which the caller's training never saw
    versioned = _versioned(
        [p for _, p in params], [b for _, b in buffers], [p.grad for _, p in params]
    )
    versions = [tensor._version for tensor in versioned]
    with torch.no_grad():
        state = _State(
            params=[p.detach().clone() for _, p in params],
            buffers=[b.detach().clone() for _, b in buffers],
            grads=[(p.grad, _owned(p.grad)) for _, p in params],
        )
    try:
        # a fused weight-grad accumulation's main_grad and flag (_param_attributes.py)
        with parameter_attributes_kept(p for _, p in params):
            yield state
    finally:
        put_back(attributes)
        _restore(params, buffers, state)
        for (_, param), (grad, values) in zip(params, state.grads, strict=True):
            if grad is not None and values is not None:
                write_back(grad, values)
            param.grad = grad
        set_versions(zip(versioned, versions, strict=True))


def _versioned(*groups: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The tensors of ``groups`` that have a version counter (not an inference tensor), once.

    >>> weight = torch.ones(2)
    >>> with torch.inference_mode():
    ...     frozen = torch.ones(2)
    >>> [t is weight for t in _versioned([weight, None], [frozen, weight])]
    [True]
    """
    found: dict[int, torch.Tensor] = {}
    for group in groups:
        for tensor in group:
            if isinstance(tensor, torch.Tensor) and not tensor.is_inference():
                found.setdefault(id(tensor), tensor)
    return list(found.values())


def _restore(
    params: Sequence[tuple[str, torch.Tensor]],
    buffers: Sequence[tuple[str, torch.Tensor]],
    state: _State,
) -> None:
    """Parameters and buffers as saved; ``.grad`` set to ``None`` (put back at the end).

    Written back through ``.data`` (:func:`write_back`): no version counter moves, since verify
    runs nothing the caller's training step would, and a backward pending from a call before
    verify (that saved a weight) must still run, as it would without verify.
    """
    for (_, param), saved in zip(params, state.params, strict=True):
        write_back(param, saved)
        param.grad = None
    for (_, buffer), saved in zip(buffers, state.buffers, strict=True):
        write_back(buffer, saved)


# -- comparing -----------------------------------------------------------------------------------


def _compare_step(
    prefix: str, ours: _Step, theirs: _Step, rtol: float | None, atol: float | None
) -> list[LeafCheck]:
    checks: list[LeafCheck] = []
    problem = _structure_problem(ours, theirs)
    if problem:
        checks.append(_problem(prefix + "output", problem))
    else:
        for path, a, b, graphed_is, eager_is in zip(
            theirs.spec.array_paths,
            ours.outputs,
            theirs.outputs,
            ours.relations,
            theirs.relations,
            strict=True,
        ):
            check = _compare(f"{prefix}output{path}", a, b, rtol, atol)
            if graphed_is != eager_is and check.ok:
                check = _problem(
                    check.path,
                    f"graphed {graphed_is or _OWN}, eager {eager_is or _OWN}",
                )
            checks.append(check)
    for mine, other in (
        (ours.input_grads, theirs.input_grads),
        (ours.param_grads, theirs.param_grads),
    ):
        for name, expected in other.items():
            checks.append(_compare(f"{prefix}grad {name}", mine.get(name), expected, rtol, atol))
    for key in sorted(ours.changed | theirs.changed):  # inputs and buffers a call changed
        path = f"{prefix}{key} after the call"
        checks.append(_compare(path, ours.after[key], theirs.after[key], rtol, atol))
    for key in sorted(ours.params_after.keys() | theirs.params_after.keys()):
        path = f"{prefix}{key} after the call"
        graphed_value, eager_value = ours.params_after.get(key), theirs.params_after.get(key)
        if graphed_value is None or eager_value is None:
            which = "eager" if graphed_value is None else "graphed"
            checks.append(_problem(path, f"only the {which} call changed it"))
        else:
            checks.append(_compare(path, graphed_value, eager_value, rtol, atol))
    for key in sorted(ours.rng_changed | theirs.rng_changed):  # the generators a call drew from
        checks.append(_compare_rng(f"{prefix}{key} after the call", ours.rng[key], theirs.rng[key]))
    return checks


def _compare_rng(path: str, actual: torch.Tensor, expected: torch.Tensor) -> LeafCheck:
    """A generator's state after the call: the same bytes, or a problem (the graphed call drew
    other random numbers than eager's, so whatever draws next gets other numbers).

    >>> state = torch.get_rng_state()
    >>> _compare_rng("rng", state, state).ok, _compare_rng("rng", state, state + 1).ok
    (True, False)
    """
    if torch.equal(actual, expected):
        return LeafCheck(path, dtype_name(expected.dtype), tuple(expected.shape), 0, 0, 0, 0, 0)
    return _problem(
        path,
        "the graphed call left the generator in another state than eager's (it drew other "
        "random numbers, or as many on the host that a graph does not draw again): what "
        "draws next in training (dropout, a shuffle) gets other numbers than in eager",
    )


def _structure_problem(ours: _Step, theirs: _Step) -> str:
    if ours.spec == theirs.spec:
        return ""
    try:
        theirs.spec.check(ours.spec.unflatten(ours.outputs), root="output")
    except SpecMismatchError as error:
        return f"graphed and eager outputs differ in structure: {error}"
    differ = [
        f"output{path} requires grad {g} (eager: {e})"
        for path, g, e in zip(
            theirs.spec.array_paths, ours.spec.grad_mask, theirs.spec.grad_mask, strict=True
        )
        if g != e
    ]
    return "; ".join(differ) or f"specs differ: {ours.spec} vs eager {theirs.spec}"


def _compare(
    path: str, actual: Any, expected: Any, rtol: float | None, atol: float | None
) -> LeafCheck:
    if expected is None or actual is None:
        if expected is None and actual is None:
            return LeafCheck(path, "", (), 0.0, 0.0, 0.0, 0.0, 0.0)
        which = "graphed" if actual is None else "eager"
        return _problem(path, f"None in {which}, a tensor in the other")
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return _problem(path, f"expected a tensor, got {type(actual).__name__}")
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return _problem(
            path,
            f"graphed {dtype_name(actual.dtype)}{list(actual.shape)} vs eager "
            f"{dtype_name(expected.dtype)}{list(expected.shape)}",
        )
    if actual.layout != expected.layout:
        return _problem(path, f"graphed {actual.layout} vs eager {expected.layout}")
    if expected.layout != torch.strided:  # a sparse .grad (nn.Embedding(sparse=True)): its values
        actual, expected = actual.detach().to_dense(), expected.detach().to_dense()
    if not (expected.is_floating_point() or expected.is_complex()):
        return _compare_exactly(path, actual, expected)
    leaf_rtol, leaf_atol = _tolerance(expected, rtol, atol)
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a = actual.detach().to(wide)
    b = expected.detach().to(wide)
    if leaf_rtol == 0 and leaf_atol == 0:
        other_sign = _zero_of_the_other_sign(a, b)
        if other_sign:
            return _problem(path, other_sign)
    diff = (a - b).abs()
    diff = torch.where(_same_values(a, b), torch.zeros_like(diff), diff)
    diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
    magnitude = b.abs()
    finite = torch.where(magnitude.isfinite(), magnitude, torch.zeros_like(magnitude))
    scale = max(1.0, float(finite.max())) if finite.numel() else 1.0
    # never below 0: a negative allowance would score every difference as passing
    allowed = (leaf_atol * scale + leaf_rtol * finite).clamp_min(0.0)
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)
    relative = torch.where((diff == 0) | (magnitude == 0), torch.zeros_like(diff), diff / magnitude)
    return LeafCheck(
        path,
        dtype_name(expected.dtype),
        tuple(expected.shape),
        float(diff.max()) if diff.numel() else 0.0,
        float(relative.max()) if relative.numel() else 0.0,
        leaf_rtol,
        leaf_atol,
        float(ratio.max()) if ratio.numel() else 0.0,
    )


def _same_values(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Where two tensors hold the same values, a NaN matching a NaN; a complex element only where
    each part does (``isnan`` of a complex is true where either part is NaN).

    >>> nan = float("nan")
    >>> _same_values(torch.tensor([complex(nan, 1), complex(nan, 1)]),
    ...              torch.tensor([complex(nan, 1), complex(nan, 5)]))
    tensor([ True, False])
    """
    if actual.is_complex():
        return _same_values(actual.real, expected.real) & _same_values(actual.imag, expected.imag)
    return (actual == expected) | (actual.isnan() & expected.isnan())


def _zero_of_the_other_sign(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where an exact comparison finds ``0.0`` against ``-0.0``, which ``==`` calls equal and
    ``1 / x``, ``copysign`` or ``atan2`` tell apart, say where (else ``""``).

    >>> _zero_of_the_other_sign(torch.tensor([1.0, 0.0]), torch.tensor([1.0, -0.0]))
    'a zero of the other sign at [1]: graphed 0.0, eager -0.0 (exact: every bit must match)'
    """
    a = torch.view_as_real(actual) if actual.is_complex() else actual
    b = torch.view_as_real(expected) if expected.is_complex() else expected
    differ = (a == 0) & (b == 0) & (a.signbit() != b.signbit())
    if not bool(differ.any()):
        return ""
    where = [int(i) for i in differ.nonzero()[0]]
    if actual.is_complex():
        where = where[:-1]  # the last index picks the real or imaginary part
    return (
        f"a zero of the other sign at {where}: graphed {float(a[differ][0])}, eager "
        f"{float(b[differ][0])} (exact: every bit must match)"
    )


def _compare_exactly(path: str, actual: torch.Tensor, expected: torch.Tensor) -> LeafCheck:
    """Integers and bools: equal or not, the differences computed as Python ints.

    A detour through float64 would round integers beyond 2**53 (``2**60`` and ``2**60 + 1``
    would compare equal).
    """
    differ = actual.detach() != expected.detach()
    max_abs = max_rel = score = 0.0
    if bool(differ.any()):
        mine = actual.detach()[differ].tolist()
        theirs = expected.detach()[differ].tolist()
        gaps = [abs(int(a) - int(b)) for a, b in zip(mine, theirs, strict=True)]
        max_abs = float(max(gaps))
        max_rel = max(gap / abs(int(b)) if b else 0.0 for gap, b in zip(gaps, theirs, strict=True))
        score = math.inf
    shape = tuple(expected.shape)
    return LeafCheck(path, dtype_name(expected.dtype), shape, max_abs, max_rel, 0.0, 0.0, score)


def _tolerance(tensor: torch.Tensor, rtol: float | None, atol: float | None) -> tuple[float, float]:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0.0, 0.0
    default = CUDA_TOLERANCES.get(tensor.dtype, (0.0, 0.0)) if tensor.is_cuda else (0.0, 0.0)
    return (default[0] if rtol is None else rtol), (default[1] if atol is None else atol)


def _is_tolerance(value: Any) -> bool:
    """A real number ``>= 0`` (``inf`` allowed: it passes every finite difference)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value >= 0  # False for NaN


def _problem(path: str, text: str) -> LeafCheck:
    return LeafCheck(path, "", (), math.inf, math.inf, 0.0, 0.0, math.inf, problem=text)


def _finite(score: float) -> float:
    return score if math.isfinite(score) else float("inf")


def _owned(tensor: Any) -> Any:
    return tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor


def _cotangent(output: torch.Tensor, step: int, index: int) -> torch.Tensor:
    """The same random output grad on both sides: seeded by step and output, CPU-generated."""
    generator = torch.Generator().manual_seed(1_000_003 * step + index)
    dtype = torch.complex128 if output.is_complex() else torch.float64
    values = torch.randn(output.shape, generator=generator, dtype=dtype)
    return values.to(dtype=output.dtype, device=output.device)
