"""One forward and backward of a callable under observation: the lint and the memory plan.

:func:`probe_once` is what :func:`~dualgraph.torch.lint` and :func:`~dualgraph.torch.memory_plan`
run: a pass that leaves the model as it was (inputs cloned, grads through ``torch.autograd.grad``,
RNG states and module buffers put back). :class:`WarmupProbe` is the same observation hooked into
the first warmup iteration of a capture, so that it costs no extra call of the callable.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> report, plan = probe_once(layer, (torch.ones(1, 2),), {}, lint=True, memory=True)
>>> report.ok, plan.callables[0].name
(True, 'Linear')
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, get_args

import optree
import torch

from .._call import describe_call
from .._containers import NAMESPACE
from .._errors import CaptureError, DualgraphError, DualgraphWarning
from ._ambient import outside_autocast, outside_inference_mode
from ._closed_over import closed_over_tensors, modules_named_by, plain_tensor_attributes
from ._lint import CaptureLint, CaptureLintError, LintReport
from ._memory_plan import MemoryPlan, MemoryProbe, plan_of, tensor_bytes
from ._module_attributes import module_attributes, put_back
from ._op_watch import OpObserver, observing
from ._param_attributes import parameter_attributes_kept
from ._params import is_tensor_subclass, write_back
from ._process_state import kept_process_state
from ._te_state import fp8_state_kept

__all__ = [
    "LintMode",
    "WarmupProbe",
    "attach_probes",
    "check_lint_mode",
    "cloned_inputs",
    "probe_once",
    "raise_on_lint_errors",
    "with_lint_findings",
]

#: What a capture does with the lint's errors: refuse (``"error"``), warn and capture anyway
#: (``"warn"``), or not lint at all (``"off"``).
LintMode = Literal["auto", "error", "warn", "off"]
_LINT_MODES = get_args(LintMode)


def check_lint_mode(mode: str) -> None:
    if mode not in _LINT_MODES:
        raise DualgraphError(f"lint must be one of {_LINT_MODES}, got {mode!r}")


def probe_once(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    lint: bool,
    memory: bool,
) -> tuple[LintReport | None, MemoryPlan | None]:
    """Run ``fn`` forward and backward once under the lint and/or the memory probe.

    A graphed ``fn`` (what ``make_graphed_callables`` returned) is observed through the callable
    behind it, which is what a capture runs.
    """
    if not callable(fn):
        raise DualgraphError(f"{type(fn).__name__} {fn!r} is not callable")
    # what a capture runs, outside inference mode as make_graphed_callables captures
    with outside_inference_mode(), _ungraphed(fn) as fn:
        return _probe_once(fn, args, kwargs, lint=lint, memory=memory)


def _probe_once(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    lint: bool,
    memory: bool,
) -> tuple[LintReport | None, MemoryPlan | None]:
    name = name_of(fn)
    root = module_of(fn)
    args_clone, kwargs_clone, inputs = cloned_inputs(tuple(args), dict(kwargs))
    params = list(root.named_parameters()) if root is not None else []
    observers: list[OpObserver] = []
    capture_lint = memory_probe = None
    if lint:
        capture_lint = CaptureLint(
            name,
            inputs=inputs,
            params=params,
            attributes=_attributes_of(root),
            root=root,
            generators=_registered_generators(),
            fn=fn,
        )
        observers.append(capture_lint)
    if memory:
        memory_probe = MemoryProbe(name, fn)
        observers.append(memory_probe)

    with _model_kept(root, fn):
        try:
            with observing(observers), torch.enable_grad():
                outputs = fn(*args_clone, **kwargs_clone)
            flat = [t for t in _leaves(outputs) if isinstance(t, torch.Tensor)]
            differentiable = [t for t in flat if t.requires_grad]
            inputs_needing_grad = [t for _, t in inputs if t.requires_grad]
            targets = inputs_needing_grad + [p for _, p in params if p.requires_grad]
            grads: Sequence[torch.Tensor | None] = ()
            if differentiable and targets:
                cotangents = [torch.ones_like(t) for t in differentiable]
                with observing(observers), outside_autocast():  # as the capture's backward
                    grads = torch.autograd.grad(
                        differentiable, targets, cotangents, allow_unused=True
                    )
            report = capture_lint.report() if capture_lint is not None else None
            plan = None
            if memory_probe is not None:
                grad_bytes = tensor_bytes(differentiable)
                # one buffer per grad: an input's, and a parameter's (param_grads="auto", the
                # default, adds into its .grad accumulator inside the backward graph, and frees
                # the grad it computed in the pool)
                grad_bytes += tensor_bytes([g for g in grads if g is not None])
                param_grads = grads[len(inputs_needing_grad) :]
                if not any(is_tensor_subclass(p) for _, p in params):
                    memory_probe.release(param_grads)
                static = (tensor_bytes([t for _, t in inputs]), tensor_bytes(flat), grad_bytes)
                plan = plan_of([memory_probe], [static])
        except Exception as error:
            if capture_lint is not None:
                _note_findings(error, capture_lint.report())
            raise
        finally:
            if memory_probe is not None:
                memory_probe.close()
            if capture_lint is not None:
                capture_lint.close()
    return report, plan


def _note_findings(error: Exception, report: LintReport) -> None:
    """Add the lint's findings so far to the callable's own ``error`` as a note (which a
    traceback shows, Python 3.11 on): they often explain it (a data-dependent shape before a
    backward that is not implemented), and the error itself must reach the caller as raised."""
    if not report.findings:
        return
    note = f"The capture lint had found, before this error:\n{report}"
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:  # Python 3.10: no add_note; __notes__ is where 3.11 keeps them
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


class WarmupProbe:
    """The lint and the memory probe around the first warmup iteration of one callable.

    ``with probe:`` observes the first time and does nothing afterwards, so a warmup loop can
    wrap every iteration. ``fn`` is what the warmup calls, ``module`` the module being graphed
    (``None`` for a function): in-place writes to any of its parameters are findings, as the
    adapter refuses them. ``inputs`` are the static input buffers, ``paths`` their paths.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        module: torch.nn.Module | None,
        inputs: Sequence[torch.Tensor],
        paths: Sequence[str],
        lint: LintMode,
        backend: str = "emulate",
        results_outside_pool: bool = False,
    ) -> None:
        check_lint_mode(lint)
        # "auto": on emulate the lint is the only thing that can report what a real capture
        # would reject, so it refuses; on cuda the real capture is the authority, and the
        # warmup runs unobserved (no dispatch mode in the way of the capture, no findings that
        # the capture itself would not confirm).
        self.observed = not (lint == "auto" and backend == "cuda")
        if lint == "auto":
            lint = "error" if backend == "emulate" else "off"
        self.mode = lint
        self.lint: CaptureLint | None = None
        if lint != "off":
            self.lint = CaptureLint(
                name,
                inputs=list(zip(paths, inputs, strict=True)),
                params=list(module.named_parameters()) if module is not None else [],
                root=module,
                generators=_registered_generators(),
                fn=fn,
            )
        self.memory = MemoryProbe(name, fn)
        #: The capture copies outputs and grads out of its pool (shape buckets on cuda).
        self.results_outside_pool = results_outside_pool
        self.static_input_bytes = tensor_bytes(inputs)
        self.used = False
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> WarmupProbe:
        if not self.used and self.observed:
            self.used = True
            self._stack = contextlib.ExitStack()
            observers: list[OpObserver] = [self.memory]
            if self.lint is not None:
                observers.insert(0, self.lint)
            self._stack.enter_context(observing(observers))
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            try:
                stack.close()
            finally:
                self.memory.close()
                if self.lint is not None:
                    self.lint.close()

    def note_saved(self, tensors: Sequence[Any]) -> None:
        """Tensors the forward saved for backward, collected by the adapter's own pack hook
        (which, being inside the probe's, is the one autograd calls)."""
        self.memory.note_saved(tensors)

    def report(self) -> LintReport | None:
        """The lint's findings (``None`` with ``lint="off"`` or before the warmup ran)."""
        return self.lint.report() if self.lint is not None and self.used else None


def raise_on_lint_errors(probes: Sequence[WarmupProbe]) -> None:
    """After warmup, before capture: refuse (``"error"``) or warn (``"warn"``) on lint errors."""
    reports = [p.report() for p in probes]
    found = [r for r in reports if r is not None and not r.ok]
    if not found:
        return
    report = _merged(found)
    mode = probes[0].mode
    if mode == "error":
        raise CaptureLintError(
            "the capture lint found what a graphed callable cannot do (lint='warn' captures "
            f"anyway, lint='off' skips the lint)\n{report}",
            report,
        )
    if mode == "warn":
        warnings.warn(
            f"capturing despite the capture lint's errors (lint='warn'):\n{report}",
            DualgraphWarning,
            stacklevel=_caller_level(),
        )


def with_lint_findings(
    error: CaptureError, probes: Sequence[WarmupProbe], cause: BaseException
) -> CaptureError:
    """The error a failed capture raises, carrying the lint's findings when there are any.

    ``error`` names the callable, the phase and the first line of ``cause``; the findings follow.
    """
    if isinstance(cause, CaptureLintError):
        return CaptureLintError(f"{error}\n{cause.report}", cause.report)
    reports = [r for r in (p.report() for p in probes) if r is not None and r.findings]
    if not reports:
        return error
    report = _merged(reports)
    return CaptureLintError(f"{error}\nThe capture lint had found:\n{report}", report)


def attach_probes(diagnostics: Sequence[Any], probes: Sequence[WarmupProbe]) -> None:
    """After capture: each callable's lint report and the plan of the shared pool."""
    for diag, probe in zip(diagnostics, probes, strict=True):
        diag.lint = probe.report()
    if not all(p.used for p in probes):
        return
    static = [
        (probe.static_input_bytes, d.static_output_bytes, d.static_grad_bytes)
        for probe, d in zip(probes, diagnostics, strict=True)
    ]
    results_in_pool = not probes[0].results_outside_pool
    plan = plan_of([p.memory for p in probes], static, results_in_pool=results_in_pool)
    pool = diagnostics[0].pool_bytes if diagnostics[0].backend == "cuda" else None
    plan = plan.with_measured_pool(pool)
    for diag in diagnostics:
        diag.memory_plan = plan


def name_of(fn: Any) -> str:
    """The name findings and plans give a callable: a module's class, a function's qualname."""
    root = module_of(fn)
    if root is not None:
        return type(root).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def module_of(fn: Any) -> torch.nn.Module | None:
    """The module a callable is, or whose method it is."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


# -- helpers --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _ungraphed(fn: Any) -> Iterator[Any]:
    """``fn``, or the callable behind it when it was graphed (a module keeps its hooks)."""
    # imported here: the adapter's modules import this one
    from ._modules import runner_of, the_module_of_its_forward
    from ._verify import eager_twin

    fn = the_module_of_its_forward(fn)  # a graphed module's forward: the module, run eagerly
    try:
        runner_of(fn)
    except DualgraphError:  # not made by make_graphed_callables (a copy of a graphed module)
        yield fn
        return
    with eager_twin(fn) as twin:
        yield twin


@contextlib.contextmanager
def _model_kept(root: torch.nn.Module | None, fn: Callable[..., Any]) -> Iterator[None]:
    """Put the process's state (the RNG states, grad mode, autocast and torch's numerics
    settings, which a call failing half-way may leave changed: :func:`kept_process_state`), the
    module's tensors (buffers, parameters a call updates in place, plain tensor attributes such
    as a cache), its submodules' Python attributes and its parameters' own (``main_grad``)
    back; and, for a function or method, those of the modules and the tensors its code names
    (a closed-over BatchNorm's running statistics, a global counter tensor), and Transformer
    Engine's FP8 state (:func:`fp8_state_kept`: an autocast's mark, scales, amax histories). The
    tools run nothing a training step would: the module is left as they found it."""
    named = modules_named_by(fn)
    attributes = module_attributes(root, *named)
    modules = [m for m in (root, *named) if m is not None]
    tensors = {id(b): b for m in modules for b in m.buffers()}
    others = [
        *(p for m in modules for p in m.parameters()),
        *(t for m in modules for _, t in plain_tensor_attributes(m)),
        *(t for _, t in closed_over_tensors(fn)),
    ]
    for tensor in others:  # plain memory only: a subclass (an FP8 weight) is its own business
        if _storage_key(tensor) is not None:
            tensors.setdefault(id(tensor), tensor)
    kept = [(t, t.detach().clone()) for t in tensors.values()]
    # Transformer Engine's: the autocast's "first FP8 module" mark, scales, amax histories
    fp8 = fp8_state_kept(*modules)
    try:
        # a fused weight-grad accumulation's main_grad and flag (_param_attributes.py)
        with (
            kept_process_state(),
            parameter_attributes_kept(root.parameters() if root is not None else ()),
            fp8.keeping_layers_run(),  # and a TE layer the module does not own, when it runs
        ):
            yield
    finally:
        for tensor, saved in kept:
            write_back(tensor, saved)
        put_back(attributes)
        fp8.put_back()


def _attributes_of(root: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    """The plain tensor attributes of ``root`` a capture refuses to see updated in place: those
    sharing no memory with a buffer (a view of a running statistic is updated with it)."""
    if root is None:
        return []
    buffers = {_storage_key(b) for b in root.buffers()}
    return [
        (path, t) for path, t in plain_tensor_attributes(root) if _storage_key(t) not in buffers
    ]


def _registered_generators() -> list[Any]:
    """Generators a capture registers besides the default CUDA ones: Transformer Engine's."""
    if "transformer_engine.pytorch" not in sys.modules:
        return []
    from ._transformer_engine import _rng_generator_states

    return _rng_generator_states()


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside dualgraph (the user's capture call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True, namespace=NAMESPACE)


def cloned_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """Clones of the tensors in ``args``/``kwargs`` (``requires_grad`` kept) and their paths.

    The paths are the call spec's (:func:`dualgraph.describe_call`), as the input guard and its
    errors name leaves: ``args[0]``, ``kwargs['state']['count']``.

    >>> x = torch.ones(2, requires_grad=True)
    >>> _, kwargs, inputs = cloned_inputs((x,), {"cache": {"n": torch.zeros(1)}})
    >>> [(path, t.requires_grad, t is x) for path, t in inputs]
    [('args[0]', True, False), ("kwargs['cache']['n']", False, False)]
    """
    spec = describe_call(args, kwargs)
    leaves = _clones(spec.flatten(args, kwargs))
    args_clone, kwargs_clone = spec.unflatten(leaves)
    inputs = [
        (path, leaf)
        for path, leaf in zip(spec.array_paths, leaves, strict=True)
        if isinstance(leaf, torch.Tensor)
    ]
    return args_clone, kwargs_clone, inputs


def _clones(leaves: Sequence[Any]) -> list[Any]:
    """Clones of the tensor leaves (``requires_grad`` kept) that share memory as the leaves do.

    The call the tools run is the caller's call: a tensor passed twice stays one tensor, and
    tensors that view one storage (``x`` and ``x[0]``) view one cloned storage, at the same
    offsets and strides, so an in-place update through one is seen through the others, and
    a replay refuses such a call as it would the caller's. A tensor sharing no memory is cloned
    alone (its storage may be much larger than it).
    """
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for leaf in leaves:
        key = _storage_key(leaf)
        if key is not None:
            group = groups.setdefault(key, [])
            if not any(t is leaf for t in group):
                group.append(leaf)
    clones: dict[int, torch.Tensor] = {}  # id of an original -> its clone
    for group in groups.values():
        if len(group) == 1:
            continue
        storage = group[0].untyped_storage().clone()
        for tensor in group:
            clone = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
            clone.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
            clones[id(tensor)] = clone.requires_grad_(tensor.requires_grad)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found = clones.get(id(leaf))
            if found is None:  # alone, or not plain memory; the same one again if repeated
                found = clones[id(leaf)] = leaf.detach().clone().requires_grad_(leaf.requires_grad)
            leaf = found
        out.append(leaf)
    return out


def _storage_key(tensor: Any) -> tuple[torch.device, int] | None:
    """Which memory a plain dense tensor views (``None`` for anything else, and no memory)."""
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return None
    if tensor.layout != torch.strided or tensor.is_meta or tensor.is_conj() or tensor.is_neg():
        return None  # (a conjugate or negative view reads its memory through a flag set_ drops)
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return tensor.device, storage.data_ptr()


def _merged(reports: Sequence[LintReport]) -> LintReport:
    merged = reports[0]
    for report in reports[1:]:
        merged = merged.merged(report)
    return merged
