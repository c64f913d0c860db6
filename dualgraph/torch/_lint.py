"""Capture lint: what in a callable a CUDA graph cannot hold, and where in the user's code it is.

:func:`lint` runs a callable once, forward and backward, under a ``TorchFunctionMode`` (the calls
Python code makes: ``.item()``, ``.cpu()``, ``print(tensor)``, ``torch.zeros(...)``) and a
``TorchDispatchMode`` (every ATen op, the backward's included: ``nonzero``, boolean-mask indexing,
copies between devices, random ops with their own generator, in-place writes, and the ops whose
kernels read values on the host themselves, such as ``torch.linalg.cholesky``) and, through
``sys.setprofile``, the Python calls no torch mode sees (``random``, ``numpy.random``,
``torch.manual_seed``, ``torch.cuda.synchronize``). Each finding names
the callable, the op, the module path (``blocks.3.attn``), the phase, and the first source line
outside torch and dualgraph. ``make_graphed_callables`` runs the same lint during its first warmup
iteration (``cuda`` and ``emulate``) and refuses to capture on an error (``lint="error"``, the
default).

On a CPU the lint reasons about the device a real capture would use: inputs, parameters and
whatever is made from them (``*_like``, ``x.new_*``, ``device=x.device``) would be on the GPU;
tensors made with no device, or ``device="cpu"``, would stay on the CPU. So ``.item()`` or
``torch.arange(n)`` inside a callable is reported on a CPU as it would fail on a GPU.

>>> import torch
>>> def scale(x):
...     return x / x.abs().max().item()
>>> report = lint(scale, torch.randn(4, requires_grad=True))
>>> report.ok, report.findings[0].kind, report.findings[0].op
(False, 'host sync', 'Tensor.item')
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import linecache
import logging
import os
import random
import sys
import sysconfig
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .._errors import CaptureError
from ._branch_reads import MODE_READ_WATCH
from ._host_rng import numpy_position
from ._op_watch import OpObserver, code_of, tensors_in
from ._rng_rewinds import RNG_STATE_WATCHES

__all__ = [
    "CaptureLint",
    "CaptureLintError",
    "LintFinding",
    "LintReport",
    "lint",
]

Severity = Literal["error", "warning"]

HOST_SYNC = "host sync"
DATA_DEPENDENT_SHAPE = "data-dependent shape"
TENSOR_CONTROL_FLOW = "control flow on a tensor"
HOST_TENSOR = "CPU tensor made in the callable"
CROSS_DEVICE_COPY = "cross-device copy"
UNREGISTERED_GENERATOR = "unregistered RNG generator"
INPUT_MUTATION = "input updated in place"
BACKWARD_INPUT_MUTATION = "input updated in place during backward"
PARAMETER_MUTATION = "parameter updated in place"
ATTRIBUTE_MUTATION = "tensor attribute updated in place"
HOST_RANDOM = "random number drawn on the host"
RNG_RESEEDED = "torch's RNG set in the callable"
GRAD_MODE_READ = "grad mode read in the callable"
HOST_CLOCK = "host clock read in the callable"

#: Every kind of finding, and whether it is an error (a real capture fails, a replay would differ
#: from eager, or ``make_graphed_callables`` refuses it) or a warning (works, at a cost).
KINDS: dict[str, Severity] = {
    HOST_SYNC: "error",
    DATA_DEPENDENT_SHAPE: "error",
    TENSOR_CONTROL_FLOW: "error",
    HOST_TENSOR: "error",
    CROSS_DEVICE_COPY: "error",
    UNREGISTERED_GENERATOR: "error",
    INPUT_MUTATION: "warning",
    BACKWARD_INPUT_MUTATION: "error",
    PARAMETER_MUTATION: "error",
    ATTRIBUTE_MUTATION: "error",
    HOST_RANDOM: "error",
    RNG_RESEEDED: "error",
    GRAD_MODE_READ: "warning",
    HOST_CLOCK: "error",
}


@dataclass(frozen=True)
class LintFinding:
    """One thing a CUDA graph cannot hold (or holds differently from eager), and where it is.

    ``module`` is the path of the innermost module running (``"blocks.3.attn"``; ``""`` at the
    callable's top level or where no module runs); ``file``/``line``/``code`` are the first frame
    outside torch and dualgraph, ``None`` when the op came from torch itself (e.g. a backward
    kernel); ``count`` is how many times the same op ran at the same place.
    """

    kind: str
    callable: str
    op: str
    detail: str
    module: str = ""
    phase: str = "forward"
    file: str | None = None
    line: int | None = None
    code: str = ""
    count: int = 1

    @property
    def severity(self) -> Severity:
        """``"error"`` or ``"warning"``, by :data:`KINDS`."""
        return KINDS[self.kind]

    @property
    def location(self) -> str:
        """``file:line`` (the file's name only), or ``torch`` when the op came from torch itself."""
        if self.file is None or self.line is None:
            return "torch"
        return f"{os.path.basename(self.file)}:{self.line}"

    def __str__(self) -> str:
        where = f"at {self.location}" if self.file is not None else "in torch's code"
        if self.module:
            where += f" in {self.module}"
        if self.phase != "forward":
            where += f" ({self.phase})"
        times = f" ({self.count}x)" if self.count > 1 else ""
        lines = [f"{self.severity}: {self.kind}: {self.op} {where}{times}"]
        if self.code:
            lines.append(f"    {self.code}")
        lines += textwrap.wrap(self.detail, 96, initial_indent="  ", subsequent_indent="  ")
        return "\n".join(lines)


@dataclass(frozen=True)
class LintReport:
    """The findings of one lint pass over one or more callables.

    ``str(report)`` lists them, errors first, each with its source line (and what to do, the
    first time each advice applies); ``ok`` says whether a capture may go ahead (no errors;
    warnings do not block it).
    """

    callables: tuple[str, ...]
    findings: tuple[LintFinding, ...] = ()

    @property
    def ok(self) -> bool:
        """No error-level finding."""
        return not self.errors

    @property
    def errors(self) -> tuple[LintFinding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[LintFinding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    def merged(self, other: LintReport) -> LintReport:
        """Both reports' callables and findings, in order."""
        return LintReport(self.callables + other.callables, self.findings + other.findings)

    def __str__(self) -> str:
        names = ", ".join(self.callables) or "nothing"
        if not self.findings:
            return f"capture lint of {names}: nothing found"
        counts = [
            f"{n} {word}{'s' if n != 1 else ''}"
            for n, word in ((len(self.errors), "error"), (len(self.warnings), "warning"))
            if n
        ]
        lines = [f"capture lint of {names}: {', '.join(counts)}"]
        explained: set[str] = set()
        for finding in (*self.errors, *self.warnings):
            prefix = f"[{finding.callable}] " if len(self.callables) > 1 else ""
            shown = (prefix + str(finding)).splitlines()
            if finding.detail in explained:  # the same advice once is enough
                shown = shown[: 2 if finding.code else 1]
            explained.add(finding.detail)
            lines.extend("  " + line for line in shown)
        return "\n".join(lines)


class CaptureLintError(CaptureError):
    """A capture refused (or failed) where the capture lint found errors; ``report`` has them."""

    def __init__(self, message: str, report: LintReport) -> None:
        super().__init__(message)
        self.report = report


def lint(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> LintReport:
    """Run ``fn(*args, **kwargs)`` once, forward and backward, and report what a graph can't hold.

    Tensors in ``args``/``kwargs`` are cloned first (with their ``requires_grad``), the backward
    runs ``torch.autograd.grad`` (no ``.grad`` is touched) with ones as output grads, and the
    RNG states and the buffers of ``fn`` (when it is a module or a module's method) are put back
    afterwards, so the model is left as it was. See the module docstring for what is found.

    >>> layer = torch.nn.Linear(4, 4)
    >>> print(lint(layer, torch.randn(2, 4)))
    capture lint of Linear: nothing found
    """
    from ._probe import probe_once

    report, _ = probe_once(fn, args, kwargs, lint=True, memory=False)
    assert report is not None
    return report


# -- the observer ---------------------------------------------------------------------------------


class CaptureLint(OpObserver):
    """Lint everything that runs inside ``with`` blocks (forward and backward); see :func:`lint`.

    ``inputs``, ``params`` and ``attributes`` (a module's plain tensor attributes, which a
    capture refuses to see updated) are ``(path, tensor)`` pairs: in-place writes to them are
    reported by that path. ``root`` is the module whose submodule paths name findings (the
    callable's module). ``generators``: generators a capture registers besides the default
    ones (those of Transformer Engine's RNG tracker). ``fn`` is the callable: findings are what
    runs inside it (or in its backward), never what the code around it (dualgraph's warmup)
    runs.
    Enter it as often as needed; :meth:`report` collects everything seen so far.
    """

    def __init__(
        self,
        name: str,
        *,
        inputs: Sequence[tuple[str, torch.Tensor]] = (),
        params: Sequence[tuple[str, torch.Tensor]] = (),
        attributes: Sequence[tuple[str, torch.Tensor]] = (),
        root: torch.nn.Module | None = None,
        generators: Sequence[Any] = (),
        fn: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.root = root
        # The callable's frame (or its root module's call) bounds the user's code on the stack.
        self._code = code_of(fn) if fn is not None else code_of(root)
        tensors = [t for _, t in (*inputs, *params)]
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        #: The device a capture runs on; ``None`` on a CPU, where the lint reasons about a GPU.
        self.capture_device: torch.device | None = cuda
        self._watched: dict[int, tuple[str, str]] = {}
        # and their version counters, to catch in-place writes no op's schema declared
        self._versions: list[tuple[str, str, torch.Tensor, int]] = []
        for kind, pairs in (
            (ATTRIBUTE_MUTATION, attributes),
            (PARAMETER_MUTATION, params),
            (INPUT_MUTATION, inputs),
        ):
            for path, tensor in pairs:
                self._watched[_storage_id(tensor)] = (kind, path)
                self._versions.append((kind, path, tensor, tensor._version))
        self._mutated: set[str] = set()
        self._generators = {_generator_key(g) for g in generators}
        self._findings: dict[tuple[Any, ...], LintFinding] = {}
        self._lock = threading.Lock()
        self._suppressed = 0
        self._calls = 0  # function-mode calls in progress (their ATen ops are theirs)
        self._draws = 0  # random ATen ops seen (a call that ran one drew random numbers)
        # On a CPU: tensors that would stay on the CPU under a real capture, and the device
        # objects read off tensors that would be on the GPU (``device=x.device`` follows x).
        self._host = WeakIdKeyDictionary()
        self._gpu_devices: dict[int, torch.device] = {}
        self._module_names: dict[int, str] | None = None
        # autograd node id -> (node, where the forward made it), until close()
        self._node_sites: dict[int, tuple[Any, tuple[str | None, int | None, str, str]]] = {}

    def contexts(self) -> Sequence[AbstractContextManager[Any]]:
        """The function mode (torch's Python-level calls) and the profile function (other
        Python calls); ATen ops come through :meth:`before_op`."""
        return (_FunctionLint(self), _HostCallLint(self))

    def finish(self) -> None:
        """Catch in-place writes no op declared, through the version counters."""
        self._check_versions()

    def _check_versions(self) -> None:
        for kind, path, tensor, version in self._versions:
            if tensor._version != version and path not in self._mutated:
                self._mutated.add(path)
                detail = _MUTATION[kind].format(path) + _UNSEEN_WRITE
                self._record(LintFinding(kind, self.name, f"an in-place write to {path}", detail))

    def close(self) -> None:
        """Forget the autograd nodes noted during the forward (they keep its graph alive)."""
        self._node_sites.clear()
        self._gpu_devices.clear()

    def report(self) -> LintReport:
        """What was found so far, in the order first seen."""
        with self._lock:
            return LintReport((self.name,), tuple(self._findings.values()))

    # -- devices, as a real capture would see them ------------------------------------------------

    @property
    def simulated(self) -> bool:
        """Whether the lint reasons about a GPU it does not run on (inputs on the CPU)."""
        return self.capture_device is None

    @property
    def device_name(self) -> str:
        return "the GPU" if self.capture_device is None else str(self.capture_device)

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` would live on the GPU under a real capture."""
        if self.capture_device is not None:
            return bool(tensor.is_cuda)
        return tensor.device.type != "meta" and tensor not in self._host

    def _target_on_device(self, device: Any) -> bool | None:
        """Whether a ``device=`` argument means the capture's device; ``None`` when absent."""
        if device is None:
            return None
        if isinstance(device, torch.Tensor):
            return self.on_device(device)
        if self.simulated and self._gpu_devices.get(id(device)) is device:
            return True  # read off a tensor that would be on the GPU: device=x.device
        if isinstance(device, int):
            return True  # a CUDA device index
        try:
            kind = torch.device(device).type
        except (TypeError, RuntimeError):
            return None
        if kind == "meta":
            return None  # no data, on no device: neither the host nor the GPU
        return kind == "cuda" if not self.simulated else kind != "cpu"

    def _mark(self, outputs: Any, host: bool) -> None:
        for tensor in tensors_in(outputs):
            if host:
                self._host[tensor] = True
            elif tensor in self._host:
                del self._host[tensor]

    # -- recording --------------------------------------------------------------------------------

    def add(
        self, kind: str, op: str, detail: str, *, caller: types.FrameType | None = None
    ) -> None:
        """Record a finding at the current place in the user's code (or at ``caller``'s frame).

        An op of the backward is placed at the forward call that made its autograd node. A
        forward op that dualgraph's own code ran around the callable (its warmup bookkeeping) or
        inside it (a nested graphed module's replay) is not the user's, and is not recorded.
        """
        node = torch._C._current_autograd_node()
        phase = "forward" if node is None else "backward"
        frame, module, in_callable = self._where(caller)
        if node is None and not in_callable:
            return
        site = _site_of(frame, module)
        if site[0] is None and node is not None:
            known = self._node_sites.get(id(node))
            if known is not None and known[0] is node:
                site = known[1]
        file, line, code, module = site
        self._record(LintFinding(kind, self.name, op, detail, module, phase, file, line, code))

    def _record(self, finding: LintFinding) -> None:
        f = finding
        key = (f.kind, f.op, f.module, f.phase, f.file, f.line)
        with self._lock:
            seen = self._findings.get(key)
            self._findings[key] = finding if seen is None else replace(seen, count=seen.count + 1)

    def _remember_nodes(self, outputs: Sequence[torch.Tensor]) -> None:
        """Note where the forward made each output's autograd node, for the backward's findings."""
        site = None
        for tensor in outputs:
            node = tensor.grad_fn
            if node is None or id(node) in self._node_sites:
                continue
            if site is None:
                frame, module, _ = self._where()
                site = _site_of(frame, module)
            self._node_sites[id(node)] = (node, site)

    def _where(
        self, start: types.FrameType | None = None
    ) -> tuple[types.FrameType | None, str, bool]:
        """The innermost frame of the user's code, the innermost module's path, and whether the
        current op runs inside the callable (and not in dualgraph's own code).

        Walks out from here to the callable's frame (or its root module's call): torch's frames
        and the lint's own are skipped; user code is any other frame met before a frame of
        dualgraph's own, which means dualgraph, not the user, runs the op. An op with no user
        frame (a backward kernel, a module of torch's own) is "in torch's code". Without a known
        callable, the walk stops at the first frame of dualgraph, as at the callable's edge.
        """
        frame: types.FrameType | None = start if start is not None else sys._getframe(1)
        user: types.FrameType | None = None
        module: torch.nn.Module | None = None
        bounded = self._code is not None or self.root is not None
        dualgraph_runs_it = False
        while frame is not None:
            code = frame.f_code
            file = code.co_filename
            if code in RNG_STATE_WATCHES:  # the warmup's watch around torch's RNG functions
                frame = frame.f_back
                continue
            if file in _MACHINERY_FILES or file.startswith(_TORCH_DIR):
                if code.co_name in _MODULE_CALLS and file == _MODULE_FILE:
                    candidate = frame.f_locals.get("self")
                    if isinstance(candidate, torch.nn.Module):
                        if module is None:  # (not `or`: an empty container module is falsy)
                            module = candidate
                        if candidate is self.root:
                            break
            elif file.startswith(_ADAPTER_DIR):
                if not bounded:
                    break
                dualgraph_runs_it = dualgraph_runs_it or user is None
            elif user is None and not dualgraph_runs_it:
                user = frame
            if code is self._code:
                break
            frame = frame.f_back
        in_callable = frame is not None or not bounded
        return user, self._module_path(module), in_callable and not dualgraph_runs_it

    def _module_path(self, module: torch.nn.Module | None) -> str:
        if module is None or module is self.root:
            return ""
        if self._module_names is None:
            self._module_names = {}
            if self.root is not None:
                self._module_names = {id(m): n for n, m in self.root.named_modules() if n}
        return self._module_names.get(id(module), type(module).__name__)

    # -- what the function mode checks ----------------------------------------------------------

    def before_call(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Check a call before it runs; ``True`` when it was reported (its inner ops are not)."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _GRAD_RECORD_READS:
            if first is not None and first.grad_fn is not None:
                self._grad_record_read(name)
            return False
        if name in _SYNC_CALLS:
            tensors = tensors_in((args, kwargs))
            if any(self.on_device(t) for t in tensors):
                kind = TENSOR_CONTROL_FLOW if name == "Tensor.__bool__" else HOST_SYNC
                self.add(kind, _SYNC_CALLS[name][0], _SYNC_CALLS[name][1])
                return True
            return False
        if first is not None and name in _MOVES:
            return self._check_move(name, first, args, kwargs)
        return False

    def _grad_record_read(self, name: str) -> None:
        """Report the user's read of whether autograd recorded a tensor the callable computed
        (``h.requires_grad``, ``h.grad_fn``, ``h.is_leaf``): it tells grad mode as
        ``torch.is_grad_enabled()`` does. Torch's own reads (MultiheadAttention's fast-path
        check) are not the user's."""
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename in _MACHINERY_FILES:
            frame = frame.f_back
        if frame is None:
            return
        file = frame.f_code.co_filename
        if file.startswith((_TORCH_DIR, _ADAPTER_DIR)):
            return
        if _made_by_the_user(frame, (), self._code):
            self.add(GRAD_MODE_READ, name, _GRAD_RECORD_HINT, caller=frame)

    def _check_move(
        self, name: str, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> bool:
        target_on: bool | None
        if name == "Tensor.copy_":
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if not isinstance(source, torch.Tensor):
                return False
            source_on, target_on = self.on_device(source), self.on_device(tensor)
        else:
            source_on = self.on_device(tensor)
            target = _move_target(name, args, kwargs)
            target_on = {"Tensor.cuda": True, "Tensor.cpu": False}.get(name)
            if target_on is None:
                target_on = self._target_on_device(target)
            if target_on is None:
                return False
            other_gpu = _real_device(target) not in (None, tensor.device)
            if not self.simulated and source_on and target_on and other_gpu:
                self.add(CROSS_DEVICE_COPY, f"{name}({target})", _OTHER_GPU)
                return True
        if source_on and not target_on:
            self.add(HOST_SYNC, name, _DEVICE_TO_HOST)
            return True
        if target_on and not source_on:
            self.add(CROSS_DEVICE_COPY, name, _HOST_TO_DEVICE)
            return True
        return False

    def after_call(
        self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
    ) -> None:
        """Follow devices through a call (on a CPU) and report tensors made on the host."""
        if name == "Tensor.device":
            owner = args[0] if args else None
            if self.simulated and isinstance(owner, torch.Tensor) and self.on_device(owner):
                self._gpu_devices[id(out)] = out
            return
        outputs = tensors_in(out)
        if not outputs or all(t.is_meta for t in outputs):
            return  # a meta tensor holds no data, on no device
        if torch._C._current_autograd_node() is None and any(t.grad_fn for t in outputs):
            self._remember_nodes(outputs)
        inputs = tensors_in((args, kwargs))
        device = kwargs.get("device")
        if name in _MOVES:
            if self.simulated:
                target = _move_target(name, args, kwargs) if name != "Tensor.copy_" else None
                to_host = name == "Tensor.cpu" or (
                    target is not None and self._target_on_device(target) is False
                )
                to_device = name == "Tensor.cuda" or (
                    target is not None and self._target_on_device(target) is True
                )
                if to_host or to_device:
                    self._mark(out, host=to_host)
                elif inputs and not self.on_device(inputs[0]):
                    self._mark(out, host=True)
            return
        target_on = self._target_on_device(device)
        if self.simulated:
            if target_on is None:
                if inputs:
                    target_on = any(self.on_device(t) for t in inputs)
                else:  # no tensor in, no device=: the default device, the CPU here
                    target_on = torch.get_default_device().type != "cpu"
            self._mark(out, host=not target_on)
            if target_on and _copies_host_data(name, args, kwargs):
                self.add(CROSS_DEVICE_COPY, name, _HOST_DATA_TO_DEVICE)
                return
        else:
            if _copies_host_data(name, args, kwargs) and any(t.is_cuda for t in outputs):
                self.add(CROSS_DEVICE_COPY, name, _HOST_DATA_TO_DEVICE)
                return
            target_on = any(t.is_cuda for t in outputs)
        made_here = not inputs or device is not None
        if made_here and not target_on and any(t.dim() > 0 for t in outputs):
            how = "device='cpu'" if device is not None else "no device="
            self.add(HOST_TENSOR, f"{name} ({how})", _HOST_TENSOR.format(self.device_name))

    def after_draw(self, name: str, out: Any) -> None:
        """Report a call that drew random numbers into tensors that would stay on the host
        (``torch.rand([])`` with no ``device=``, as a layer drop draws its coin): a graph keeps
        what the host computed from them at capture (a branch, a Python number), where eager
        draws again on every call. Draws into tensors on the device are the graph's own."""
        outputs = [t for t in tensors_in(out) if not t.is_meta]  # meta: no data, no device
        if outputs and not any(map(self.on_device, outputs)):
            self.add(HOST_RANDOM, name, _HOST_DRAW)

    # -- what the dispatch mode checks ----------------------------------------------------------

    def after_op(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
    ) -> None:
        """A tensor made from host data that the function mode does not see: on the host.

        ``torch.from_numpy`` and the legacy ``torch.Tensor([...])`` constructor pass no
        function mode; their ATen op, ``lift_fresh``, outside any call the function mode saw,
        is the only trace of them.
        """
        if func is not _LIFT_FRESH or self._calls or self._suppressed or not self.simulated:
            return
        self._mark(out, host=True)
        if any(t.dim() > 0 for t in tensors_in(out)):
            self.add(
                HOST_TENSOR,
                "a tensor from host data (torch.from_numpy, torch.Tensor([...]))",
                _HOST_TENSOR.format(self.device_name),
            )

    def before_op(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Check one ATen op (forward or backward), unless a call reported already runs it."""
        if not self._suppressed:
            self.check_op(func, args, kwargs)

    def check_op(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Check one ATen op (forward or backward)."""
        checks = _OP_CHECKS.get(func)
        if checks is None:
            checks = _op_checks(func)
        if checks is _NOTHING_TO_CHECK:  # most ops: one lookup
            return
        name, generators, written, host_reads, seeded = checks
        if seeded:  # a random op: the call that ran it says whether it drew on the host
            self._draws += 1
        op = f"aten.{name}"
        for position, argument in host_reads:
            value = next(_arguments(((position, argument),), args, kwargs))
            if value is True or (isinstance(value, torch.Tensor) and self.on_device(value)):
                self.add(HOST_SYNC, f"{op}({argument}=...)", _HOST_READ_ARGUMENTS[argument])
        if name == "histc":
            low, high = (0 if v is None else v for v in _arguments(_HISTC_RANGE, args, kwargs))
            if low == high and self.on_device(args[0]):  # the range is the input's own
                self.add(HOST_SYNC, f"{op}(min=max)", _HISTC_HINT)
        if name in _SYNC_OPS or name in _SHAPE_OPS or name in _INDEX_OPS or name in _COPY_OPS:
            tensors = tensors_in((args, kwargs))
            on_device = [t for t in tensors if self.on_device(t)]
            if name in _SYNC_OPS and on_device:
                if name == "_local_scalar_dense" and _anomaly_checks_nan_here():
                    # the engine's own isnan().any() read, not the user's: say what turns it off
                    self.add(HOST_SYNC, f"{op} (anomaly mode's NaN check)", _ANOMALY_NAN_CHECK)
                else:
                    self.add(HOST_SYNC, op, _SYNC_OPS[name])
            elif name in _SHAPE_OPS and on_device:
                if not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
                    self.add(DATA_DEPENDENT_SHAPE, op, _SHAPE_OPS[name])
            elif name in _INDEX_OPS and on_device and _has_mask_index(args, kwargs):
                self.add(DATA_DEPENDENT_SHAPE, f"{op} with a boolean mask", _MASK_INDEX)
            elif name in _COPY_OPS and self.capture_device is not None:
                self._check_copy_op(op, name, args, kwargs)
        for value in _arguments(generators, args, kwargs):
            if isinstance(value, torch.Generator) and not self._registered(value):
                self.add(UNREGISTERED_GENERATOR, f"{op}(generator=...)", _GENERATOR)
        for tensor in tensors_in(list(_arguments(written, args, kwargs))):
            watched = self._watched.get(_storage_id(tensor))
            if watched is not None:
                kind, path = watched
                if kind == INPUT_MUTATION and torch._C._current_autograd_node() is not None:
                    kind = BACKWARD_INPUT_MUTATION
                self._mutated.add(path)
                self.add(kind, f"{op} on {path}", _MUTATION[kind].format(path))

    def _check_copy_op(
        self, op: str, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        if name == "copy_":
            target, source = args[0], args[1] if len(args) > 1 else kwargs.get("src")
            if not isinstance(source, torch.Tensor):
                return
            source_device, target_device = source.device, target.device
        else:
            source = args[0]
            source_device = source.device
            target_device = kwargs.get("device") or source_device
        if source_device == target_device or "meta" in (source_device.type, target_device.type):
            return
        if source_device.type == "cuda" and target_device.type != "cuda":
            self.add(HOST_SYNC, op, _DEVICE_TO_HOST)
        elif target_device.type == "cuda" and source_device.type != "cuda":
            self.add(CROSS_DEVICE_COPY, op, _HOST_TO_DEVICE)
        else:
            self.add(CROSS_DEVICE_COPY, op, _OTHER_GPU)

    def _registered(self, generator: torch.Generator) -> bool:
        key = _generator_key(generator)
        return key in self._generators or key in _default_generator_keys()


class _FunctionLint(TorchFunctionMode):
    def __init__(self, lint: CaptureLint) -> None:
        super().__init__()
        self.lint = lint

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        lint = self.lint
        if lint._suppressed:
            return func(*args, **kwargs)
        name = _call_name(func)
        reported = lint.before_call(name, args, kwargs)
        lint._calls += 1
        lint._suppressed += reported
        draws = lint._draws
        try:
            out = func(*args, **kwargs)
        finally:
            lint._calls -= 1
            lint._suppressed -= reported
        lint.after_call(name, args, kwargs, out)
        if lint._draws != draws:
            lint.after_draw(name, out)
        return out


class _HostCallLint:
    """Python calls that no torch mode sees, through ``sys.setprofile`` while the lint runs.

    A profiler already set (``cProfile``, a debugger's) is left alone, and these calls are then
    not looked for. A call is reported at the innermost frame of the user's code, unless it runs
    inside another reported call (``random.uniform`` calling ``Random.random`` is one finding)
    or inside an import the callable set off.
    """

    def __init__(self, lint: CaptureLint) -> None:
        self.lint = lint
        self._installed = False
        self._numpy_position: Any = None

    def __enter__(self) -> _HostCallLint:
        # numpy's random functions are compiled and make no profile event: their state moves
        self._numpy_position = numpy_position()
        if sys.getprofile() is None:
            sys.setprofile(self._profile)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            self._installed = False
            sys.setprofile(None)
        if numpy_position() != self._numpy_position:
            detail = _HOST_CALL_HINTS[HOST_RANDOM] + _NUMPY_UNSEEN
            self.lint._record(
                LintFinding(HOST_RANDOM, self.lint.name, "numpy.random's global generator", detail)
            )

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        # called on every Python and C call and return while the lint runs: kept short
        if event == "call":
            found = _HOST_PYTHON_CALLS.get(frame.f_code)
            # seeding a generator of the callable's own (random.Random(3)) is no change of the
            # process's stream
            if found is not None and (
                frame.f_code is not _SEEDS_HOST_STREAM or frame.f_locals.get("self") is _INST
            ):
                self._report(found, frame.f_back)
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, random.Random):
                self._report(_host_c_call(arg), frame)
            elif arg in _OS_RANDOM:  # os.urandom: what uuid4 and secrets draw from
                self._report((HOST_RANDOM, _OS_RANDOM[arg], ()), _outside_the_stdlib(frame))
            elif arg in _CLOCKS:
                # a log record's time is no clock read of the callable's (nor is a collector
                # callback's: _made_by_the_user leaves those out)
                if not frame.f_code.co_filename.startswith(_LOGGING_DIR):
                    self._report((HOST_CLOCK, _CLOCKS[arg], ()), frame)
            elif arg is _IS_GRAD_ENABLED or arg is _IS_INFERENCE_MODE_ENABLED:
                # through warmup's watch of the read (a replacement): its caller's
                caller = frame.f_back if frame.f_code is MODE_READ_WATCH else frame
                if caller is not None and not caller.f_code.co_filename.startswith(_ADAPTER_DIR):
                    self._report((GRAD_MODE_READ, f"torch.{arg.__name__}", ()), caller)

    def _report(
        self, found: tuple[str, str, tuple[str, ...]] | None, caller: types.FrameType | None
    ) -> None:
        if found is None or caller is None or self.lint._suppressed:
            return
        kind, op, library = found
        code = self.lint._code
        if _made_by_the_user(caller, library, code) and not _importing(caller, code):
            self.lint.add(kind, op, _HOST_CALL_HINTS[kind], caller=caller)


def _made_by_the_user(
    frame: types.FrameType | None, library: tuple[str, ...], callable_code: Any
) -> bool:
    """Whether the call from ``frame`` is the user's: not the library's own code running for a
    call reported itself (``random.uniform`` calling ``Random.random``, ``torch.manual_seed``
    seeding every device), nor code torch runs (``torch.compile`` keeping the RNG states around
    a compilation, a mode or hook torch calls inside an op). Between the user's frame and the
    callable's, only module calls, custom autograd Functions and torch's wrappers around a
    function (``torch._disable_dynamo``) may stand."""
    while frame is not None and frame.f_code.co_filename.startswith(library):
        if frame.f_code in _HOST_PYTHON_CALLS:
            return False
        frame = frame.f_back
    collecting = _gc_callback_codes()
    while frame is not None and frame.f_code is not callable_code:
        code = frame.f_code
        file = code.co_filename
        if code in collecting:  # the interpreter runs gc.callbacks wherever a collection starts
            return False
        if code in RNG_STATE_WATCHES:  # the warmup's watch around torch's RNG functions
            frame = frame.f_back
            continue
        if file.startswith(_ADAPTER_DIR):
            return True  # the callable's edge (dualgraph's frames around it)
        if code in _HOST_PYTHON_CALLS:
            return False
        if file.startswith(_TORCH_DIR) and not _passed_through(code):
            return False
        frame = frame.f_back
    return True


def _gc_callback_codes() -> frozenset[types.CodeType]:
    """The code of each function in ``gc.callbacks`` (hypothesis and profilers time each
    collection there): what runs in them runs where a collection starts, not as the callable's
    (read on a finding's path only)."""
    return frozenset(
        code
        for callback in gc.callbacks
        if isinstance(code := getattr(callback, "__code__", None), types.CodeType)
    )


def _passed_through(code: types.CodeType) -> bool:
    """Torch's frames that stand between a callable and its own code: module calls, custom
    autograd Functions, wrappers of functions torch exports."""
    file = code.co_filename
    if file in _TORCH_WRAPPER_FILES or file == _FUNCTION_FILE:
        return True
    return file == _MODULE_FILE and code.co_name in _MODULE_CALLS


def _importing(frame: types.FrameType | None, callable_code: Any) -> bool:
    """Whether an import runs between ``frame`` and the callable's frame: the callable set off
    an import (sympy draws a random number as it loads), which runs once, not on every call."""
    while frame is not None and frame.f_code is not callable_code:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _host_c_call(fn: Any) -> tuple[str, str, tuple[str, ...]] | None:
    """``(kind, op, library)`` of a call of a C function the lint reports, else ``None``."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, random.Random):
        if fn.__name__ in _NOT_DRAWS:
            return None
        return HOST_RANDOM, f"{type(owner).__name__}.{fn.__name__}", _RANDOM_FILES
    return None


# -- tables of what is reported, and why -----------------------------------------------------------


_SYNC_HINT = (
    "A capture cannot wait for a value to reach the host, so a real capture fails here. "
    "Keep the value on the device (torch.where, masking, clamp) or compute it before the call."
)
_PRINT_HINT = (
    "Printing a tensor reads its values on the host, which a capture cannot do; print outside "
    "the graphed callable."
)
_CONTROL_FLOW_HINT = (
    "Python branches on a tensor value (if tensor:, while, assert, and/or) read it on the host, "
    "which a capture cannot do; and a graph would keep the branch taken at capture forever. "
    "Use torch.where or compute the condition outside the callable."
)
#: Python-level calls that read a tensor's values on the host: op shown, and why.
_SYNC_CALLS: dict[str, tuple[str, str]] = {
    "Tensor.item": ("Tensor.item", _SYNC_HINT),
    "Tensor.tolist": ("Tensor.tolist", _SYNC_HINT),
    "Tensor.numpy": ("Tensor.numpy", _SYNC_HINT),
    "Tensor.__array__": ("numpy.asarray(tensor)", _SYNC_HINT),
    "Tensor.__int__": ("int(tensor)", _SYNC_HINT),
    "Tensor.__float__": ("float(tensor)", _SYNC_HINT),
    "Tensor.__complex__": ("complex(tensor)", _SYNC_HINT),
    "Tensor.__index__": ("operator.index(tensor)", _SYNC_HINT),
    "Tensor.__contains__": ("value in tensor", _SYNC_HINT),
    "Tensor.__bool__": ("bool(tensor)", _CONTROL_FLOW_HINT),
    "Tensor.__repr__": ("print(tensor)", _PRINT_HINT),
    "Tensor.__str__": ("str(tensor)", _PRINT_HINT),
    "Tensor.__format__": ("f'{tensor}'", _PRINT_HINT),
    "torch.equal": ("torch.equal", _SYNC_HINT),
    "Tensor.equal": ("Tensor.equal", _SYNC_HINT),
    "torch.allclose": ("torch.allclose", _SYNC_HINT),
    "Tensor.allclose": ("Tensor.allclose", _SYNC_HINT),
}
_KERNEL_SYNC_HINT = (
    "Its kernel reads values on the host (to check for errors, or to run on the CPU), so torch "
    "documents it as synchronizing with the CPU on CUDA; a capture cannot wait for that. Use "
    "the *_ex variant without error checks (linalg.cholesky_ex, inv_ex, solve_ex, "
    "lu_factor_ex: check info after the call) or compute it outside the graphed callable."
)
_CTC_HINT = (
    "torch.nn.functional.ctc_loss's CUDA kernels copy the lengths to the host and offsets they "
    "compute there back to the device (forward and backward), which a capture cannot do. "
    "Return the log-probabilities from the callable and compute the CTC loss after the call."
)
#: Arguments whose value makes an op's kernel read values on the host: a device tensor there
#: (``torch.normal``'s ``std``, checked for negative values), or ``True`` (``check_errors`` of the
#: ``linalg.*_ex`` ops, which reads their info).
_HOST_READ_ARGUMENTS = {
    "std": "torch.normal with a tensor std checks it for negative values on the host. "
    + _SYNC_HINT,
    "check_errors": "check_errors=True reads the info tensor on the host to raise on a failure, "
    "which a capture cannot do. Pass check_errors=False and check info after the call.",
}
#: ATen ops that read a value on the host (reached from torch's own code, or from backward).
_SYNC_OPS = {
    "_local_scalar_dense": "Reads a tensor value on the host (.item(), int(), float() or bool() "
    "inside torch). " + _SYNC_HINT,
    "equal": _SYNC_HINT,
    "allclose": _SYNC_HINT,
    "is_nonzero": _CONTROL_FLOW_HINT,
    # Kernels that read values on the host themselves, below the dispatch mode (torch documents
    # them as synchronizing with the CPU on CUDA): the op is the only trace of the read.
    "_linalg_check_errors": _KERNEL_SYNC_HINT,  # linalg.cholesky, inv, solve, lu_factor, ...
    "_linalg_eigh": _KERNEL_SYNC_HINT,  # linalg.eigh, eigvalsh (and pinv, matrix_rank, ...)
    "_linalg_svd": _KERNEL_SYNC_HINT,  # linalg.svd, svdvals (and pinv, matrix_rank, cond, ...)
    "linalg_eig": _KERNEL_SYNC_HINT,  # linalg.eig, eigvals
    # CTC loss: the CUDA kernels copy the lengths to the host and the targets' offsets, made
    # there, back to the device (forward and backward)
    "_ctc_loss": _CTC_HINT,
    "_ctc_loss_backward": _CTC_HINT,
}
#: What a backward in anomaly mode reads on the host: every node's grads, checked for NaN.
_ANOMALY_NAN_CHECK = (
    "Anomaly mode is on (torch.autograd.set_detect_anomaly(True) or detect_anomaly()): it "
    "checks each backward node's grads for NaN on the host, which a capture cannot do. Graph "
    "outside anomaly mode, or with set_detect_anomaly(True, check_nan=False); a replay's backward "
    "in anomaly mode then runs under param_grads='auto' or 'autograd'."
)


def _anomaly_checks_nan_here() -> bool:
    """Whether a backward op now runs under anomaly mode's NaN checks (each node's grads read)."""
    return (
        torch._C._current_autograd_node() is not None
        and torch.is_anomaly_enabled()
        and torch.is_anomaly_check_nan_enabled()
    )


#: ``torch.histc``'s ``min`` and ``max``: where they are equal (by default both 0), the CUDA
#: kernel reads the input's minimum and maximum on the host to make the range.
_HISTC_RANGE = ((2, "min"), (3, "max"))
_HISTC_HINT = (
    "torch.histc with min == max (the default, 0 and 0) takes its range from the input: the "
    "CUDA kernel reads the input's minimum and maximum on the host, which a capture cannot "
    "wait for. Pass the range (min=..., max=..., min < max)."
)
_SHAPE_HINT = (
    "Its output's shape depends on tensor values, which the host must read (a sync) and which a "
    "graph would freeze at the capture's values. Use a fixed-size form: torch.where(mask, x, 0), "
    "masked_fill, nonzero_static, or repeat_interleave(..., output_size=n)."
)
_SHAPE_OPS = {
    name: _SHAPE_HINT
    for name in (
        "nonzero",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "bincount",
        "repeat_interleave",
    )
}
_INDEX_OPS = frozenset({"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"})
_MASK_INDEX = (
    "Indexing with a boolean mask (x[mask], x[mask] = v) turns the mask into indices on the host "
    "(a sync), and the result's shape depends on the mask. Use torch.where(mask, x, other) or "
    "x.masked_fill(~mask, 0) to keep shapes fixed."
)
_COPY_OPS = frozenset({"_to_copy", "copy_"})
_DEVICE_TO_HOST = (
    "Copies a tensor to the CPU: the host waits for the GPU, which a capture cannot do. Return "
    "the tensor from the callable and move it after the call."
)
_HOST_TO_DEVICE = (
    "Copies a CPU tensor to the GPU inside the callable: a capture fails on a copy from pageable "
    "memory, and a captured copy from pinned memory would replay the same host buffer forever. "
    "Make the tensor on the device (device=x.device), or pass it in as an input."
)
_HOST_DATA_TO_DEVICE = (
    "Makes a tensor on the GPU from host data (a list, a number, a numpy array): a host-to-device "
    "copy that a capture cannot hold, and whose values a graph would freeze. Register the values "
    "as a buffer, pass them as an input, or build them with torch.full/arange on the device."
)
_OTHER_GPU = (
    "Copies between two GPUs inside the callable; a graph captures the work of one device's "
    "stream. Keep the callable on one device."
)
_HOST_TENSOR = (
    "Makes a tensor on the CPU inside the callable; under a capture on {} it stays on the CPU: "
    "moving it to the GPU is a copy the graph cannot repeat, mixing it with GPU tensors fails, "
    "and work on it is not replayed. Make it on the input's device (device=x.device, "
    "torch.zeros_like(x)) or register it as a buffer."
)
_GENERATOR = (
    "Draws random numbers from a generator that is not the default CUDA generator, the only one "
    "a capture registers (with Transformer Engine's RNG tracker, when TE is imported): a real "
    "capture fails, or a replay repeats the same numbers. Use the default generator (seed it with "
    "torch.cuda.manual_seed) or register yours with the graph."
)
_MUTATION = {
    INPUT_MUTATION: (
        "Updates the input {} in place. A replay writes the graph's static copy of the input, "
        "and dualgraph copies it back into your tensor after each forward, as eager would leave "
        "it: one extra copy per call. Return the new value as an output to avoid the copy."
    ),
    BACKWARD_INPUT_MUTATION: (
        "Updates the input {} in place during backward; dualgraph hands in-place updates back "
        "to the caller after the forward only, so it refuses to capture this. Update the input "
        "in the forward, or outside the graphed callable."
    ),
    PARAMETER_MUTATION: (
        "Updates the parameter {} in place inside the callable: warmup and capture would change "
        "it already and every replay repeats the update, so dualgraph refuses to capture it. "
        "Register it as a buffer, or update it outside the graphed callable."
    ),
}
_MUTATION[ATTRIBUTE_MUTATION] = (
    "Updates the module's plain tensor attribute {} (neither a parameter nor a buffer) in place "
    "inside the callable: warmup and capture would change it already and every replay would "
    "repeat the update, so dualgraph refuses to capture it. Register it as a buffer "
    "(register_buffer), or update it outside the graphed callable."
)
_UNSEEN_WRITE = (
    " Its version counter moved though no op seen wrote to it (a write through a C++ extension "
    "or a view the lint does not see), so no line is known."
)

_NUMPY_UNSEEN = (
    " numpy's functions are compiled and show no call to the lint, so no line is known: its "
    "global generator's state moved during the call."
)

#: Calls that move a tensor between devices.
_MOVES = frozenset({"Tensor.to", "Tensor.cpu", "Tensor.cuda", "Tensor.copy_"})
#: Factories that copy host data (lists, numbers, numpy arrays) into a new tensor.
_FROM_HOST_DATA = frozenset(
    {"torch.tensor", "torch.as_tensor", "torch.asarray", "Tensor.new_tensor", "torch.from_numpy"}
)

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_SEEDED = torch.Tag.nondeterministic_seeded

_MODULE_CALLS = frozenset({"_call_impl", "_wrapped_call_impl"})
_MODULE_FILE = torch.nn.Module._call_impl.__code__.co_filename
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ADAPTER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: The files of the lint, the memory probe and their shared dispatch mode: their frames are
#: skipped, not a stop.
_MACHINERY_FILES = frozenset(
    [
        *(
            os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
            for name in ("_lint.py", "_memory_plan.py", "_op_watch.py")
        ),
        contextlib.__file__,  # the context managers the lint is entered through
    ]
)


# -- helpers --------------------------------------------------------------------------------------


def _site_of(frame: types.FrameType | None, module: str) -> tuple[str | None, int | None, str, str]:
    """``(file, line, code, module path)`` of ``frame`` (``None``s for no frame: torch's code)."""
    if frame is None:
        return None, None, "", module
    file, line = frame.f_code.co_filename, frame.f_lineno
    return file, line, linecache.getline(file, line).strip(), module


def _call_name(func: Any) -> str:
    """A readable name for what the function mode sees: ``Tensor.item``, ``torch.zeros``."""
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a tensor property, e.g. Tensor.device
        owner = getattr(func, "__self__", None)
        return f"Tensor.{getattr(owner, '__name__', '?')}"
    qualname = getattr(func, "__qualname__", "") or name
    owner, _, attribute = qualname.rpartition(".")
    if owner in ("TensorBase", "Tensor", "_TensorBase"):
        return f"Tensor.{attribute}"
    if owner == "_VariableFunctionsClass":
        return f"torch.{attribute}"
    module = getattr(func, "__module__", None) or "torch"
    if module == "torch" or module.startswith("torch."):
        return f"{module}.{qualname}"
    return qualname or repr(func)


def _move_target(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The device (or tensor) ``.to``/``.cuda`` moves to; ``None`` when it keeps the device."""
    if "device" in kwargs and kwargs["device"] is not None:
        return kwargs["device"]
    if name == "Tensor.cuda":
        return args[1] if len(args) > 1 else None
    if name != "Tensor.to":
        return None
    for value in args[1:]:
        if isinstance(value, torch.Tensor | torch.device | str | int) and not isinstance(
            value, bool
        ):
            return value
    other = kwargs.get("other")
    return other if isinstance(other, torch.Tensor) else None


def _real_device(target: Any) -> torch.device | None:
    if isinstance(target, torch.Tensor):
        return target.device
    try:
        device = torch.device(target)
    except (TypeError, RuntimeError):
        return None
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _copies_host_data(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a factory call copies host data (not a tensor) into its new tensor."""
    if name not in _FROM_HOST_DATA:
        return False
    position = 1 if name == "Tensor.new_tensor" else 0
    data = args[position] if len(args) > position else kwargs.get("data", kwargs.get("obj"))
    return not tensors_in(data)


def _has_mask_index(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in (indices or ())
    )


#: Per ATen op: ``(name, generator arguments, written arguments, host-read arguments, seeded)``
#: (each argument as ``(position, name)``; ``seeded``: it draws random numbers, ATen's tag
#: ``nondeterministic_seeded``), or ``_NOTHING_TO_CHECK`` for an op that is in no table, draws
#: nothing, takes no generator, writes to no argument and has no argument of
#: ``_HOST_READ_ARGUMENTS`` (``torch.normal``'s ``std``, any op's ``check_errors``): the lint's
#: cost for most ops is one dict lookup.
_OP_CHECKS: dict[Any, Any] = {}
_NOTHING_TO_CHECK = ("", (), (), (), False)


def _op_checks(func: Any) -> Any:
    name = func.overloadpacket.__name__
    try:
        arguments = list(func._schema.arguments)
    except AttributeError:
        arguments = []
    generators = tuple((i, a.name) for i, a in enumerate(arguments) if "Generator" in str(a.type))
    written = tuple(
        (i, a.name)
        for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    host_reads = tuple(
        (i, a.name)
        for i, a in enumerate(arguments)
        if a.name == "check_errors" or (name == "normal" and a.name == "std")
    )
    tabled = (
        name in _SYNC_OPS
        or name in _SHAPE_OPS
        or name in _INDEX_OPS
        or name in _COPY_OPS
        or name == "histc"
    )
    seeded = _SEEDED in getattr(func, "tags", ())
    checks = (
        (name, generators, written, host_reads, seeded)
        if tabled or generators or written or host_reads or seeded
        else _NOTHING_TO_CHECK
    )
    _OP_CHECKS[func] = checks
    return checks


def _arguments(
    positions: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[Any]:
    """The values of an op's arguments at ``positions`` (passed by position or by name)."""
    for index, name in positions:
        yield args[index] if index < len(args) else kwargs.get(name)


def _generator_key(generator: Any) -> int:
    """What identifies a generator: its C++ object. A generator reaches the dispatch mode as a
    new Python object each time (even the default ones), so ``is`` never matches there."""
    return int(getattr(generator, "_cdata", id(generator)))


def _default_generator_keys() -> set[int]:
    """The default generators, which a capture registers itself, by whatever name the code uses
    (``torch.cuda.default_generators[i]``, ``torch.default_generator``, ``torch.random``'s...):
    every CUDA device's, and the CPU's, which on a CPU stands for the GPU's (on a GPU, a CPU
    generator draws CPU tensors, which are findings of their own)."""
    keys = {_generator_key(torch.default_generator)}
    if torch.cuda.is_initialized():
        keys.update(_generator_key(g) for g in torch.cuda.default_generators)
    return keys


def _storage_id(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage()._cdata)
    except Exception:  # sparse tensors, wrapper subclasses: no storage of their own
        return id(tensor)


#: Python calls that no torch mode sees, reported by ``(kind, op, the library's files)``: a call
#: from the library's own files is part of a call already reported.
_RANDOM_FILES = (random.__file__,)
#: Where torch wraps functions it exports (``torch.manual_seed`` once ``torch._dynamo`` loaded).
_TORCH_WRAPPER_FILES = frozenset(
    os.path.join(_TORCH_DIR, *name.split("/")) for name in ("_compile.py", "_dynamo/eval_frame.py")
)
_FUNCTION_FILE = torch.autograd.function.__file__
#: The host clocks a forward may read (``time.time()`` for a schedule, a seed, a decay), by the
#: name a finding gives them: ``time``'s, and ``datetime``'s, which read the clock in compiled
#: code (no ``time.time()`` call to see).
_CLOCKS = {
    **{
        getattr(time, name): f"time.{name}"
        for name in (
            "time",
            "time_ns",
            "perf_counter",
            "perf_counter_ns",
            "monotonic",
            "monotonic_ns",
            "process_time",
            "process_time_ns",
            "thread_time",
            "thread_time_ns",
        )
    },
    datetime.datetime.now: "datetime.datetime.now",
    datetime.datetime.utcnow: "datetime.datetime.utcnow",
    datetime.datetime.today: "datetime.datetime.today",
    datetime.date.today: "datetime.date.today",
}
#: The operating system's random bytes (``uuid.uuid4()``, ``secrets`` and ``SystemRandom`` read
#: them too), compiled: no ``random`` call to see.
_OS_RANDOM = {
    getattr(os, name): f"os.{name}" for name in ("urandom", "getrandom") if hasattr(os, name)
}
#: Python's own library (``uuid``, ``secrets``), without the packages installed beside it.
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_SITE_DIR = sysconfig.get_paths()["purelib"] + os.sep


def _outside_the_stdlib(frame: types.FrameType | None) -> types.FrameType | None:
    """The frame that called into Python's own library (``uuid.uuid4()`` reading
    ``os.urandom``): the user's line, as for a draw through ``random``.

    >>> import sys
    >>> _outside_the_stdlib(sys._getframe()) is sys._getframe()
    True
    """
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_STDLIB_DIR) or file.startswith(_SITE_DIR):
            return frame
        frame = frame.f_back
    return None


#: logging stamps each record with time.time(): a log call is no clock read of the callable's
_LOGGING_DIR = os.path.dirname(logging.__file__)
#: What ``random`` offers besides draws: reading, restoring and seeding its state.
_NOT_DRAWS = frozenset({"getstate", "setstate", "seed"})
_HOST_CALL_HINTS = {
    HOST_RANDOM: (
        "Draws a random number on the host (Python's random, numpy.random), or seeds the "
        "host's stream: a CUDA graph keeps the number drawn at capture and every replay reuses "
        "it (and seeds nothing), where eager draws a new one (or restarts the stream) on each "
        "call. Draw on the device from torch's default generator (torch.rand(..., "
        "device=x.device)), or draw outside the callable and pass the value in as a tensor."
    ),
    RNG_RESEEDED: (
        "Sets torch's RNG state inside the callable: a replay does not run it, so where eager "
        "restarts the random stream on every call, the replays draw on from the generator's "
        "offset (and a real capture may refuse it). Seed outside the graphed callable."
    ),
    HOST_SYNC: "Waits on the host for the GPU. " + _SYNC_HINT,
    HOST_CLOCK: (
        "Reads the host's clock: a CUDA graph keeps what the callable computed from the time "
        "read at capture and every replay reuses it, where eager reads the clock on each call "
        "(a replay runs no Python: timing inside the callable measures nothing either). Read "
        "the clock outside the callable and pass what depends on it in as a tensor."
    ),
    GRAD_MODE_READ: (
        "Reads grad mode: a graph replays what the callable did with grad on at capture, so a "
        "call under torch.no_grad() or inference_mode() runs the callable eagerly instead "
        "(diagnostics' eager_calls counts them), where warmup saw the read. Decide outside "
        "the callable, or graph a copy for evaluation, to replay those calls too."
    ),
}
#: What a tensor tells of the autograd graph recorded for it: for a tensor the callable computed
#: from tensors that require grad, what grad mode was (``requires_grad`` is False, ``grad_fn``
#: None and ``is_leaf`` True under ``torch.no_grad()``); an input's or a parameter's is the same
#: either way.
_GRAD_RECORD_READS = frozenset({"Tensor.requires_grad", "Tensor.grad_fn", "Tensor.is_leaf"})
_GRAD_RECORD_HINT = (
    "Reads whether autograd recorded a tensor the callable computed, which tells grad mode: "
    "under torch.no_grad() or inference_mode() eager reads False (no grad_fn), where a graph "
    "replays what the callable did with grad on at capture, so such calls run the callable "
    "eagerly instead (diagnostics' eager_calls counts them). Decide outside the callable, or "
    "graph a copy for evaluation, to replay those calls too."
)
_HOST_DRAW = (
    "Draws random numbers from torch's CPU generator into a tensor on the host (no device=, or "
    "device='cpu'): a CUDA graph keeps the numbers drawn at capture and whatever the host did "
    "with them (a branch taken, a Python number), where eager draws new ones on each call (a "
    "layer drop skips the layer on some calls only). Draw on the device (torch.rand((), "
    "device=x.device)) and keep the result a tensor (torch.where), or draw outside the callable "
    "and pass the value in."
)
_IS_GRAD_ENABLED = torch.is_grad_enabled
_IS_INFERENCE_MODE_ENABLED = torch.is_inference_mode_enabled


def _python_calls() -> dict[types.CodeType, tuple[str, str, tuple[str, ...]]]:
    calls: dict[types.CodeType, tuple[str, str, tuple[str, ...]]] = {}
    for cls in (random.Random, random.SystemRandom):
        for name, method in vars(cls).items():
            # not what only reads or sets the state: torch.compile keeps it around a compilation
            public = isinstance(method, types.FunctionType) and not name.startswith("_")
            if public and name not in _NOT_DRAWS:
                calls[method.__code__] = (HOST_RANDOM, f"Random.{name}", _RANDOM_FILES)
    # the process's stream only (_SEEDS_HOST_STREAM); not setstate, which torch.compile calls
    # around a compilation from wherever it starts
    calls[random.Random.seed.__code__] = (HOST_RANDOM, "random.seed", ())
    seeding = {
        "torch.manual_seed": torch.manual_seed,
        "torch.seed": torch.seed,
        "torch.set_rng_state": torch.set_rng_state,
        **{
            f"torch.cuda.{name}": getattr(torch.cuda, name)
            for name in (
                "manual_seed",
                "manual_seed_all",
                "seed",
                "seed_all",
                "set_rng_state",
                "set_rng_state_all",
            )
        },
    }
    for op, function in seeding.items():
        calls[function.__code__] = (RNG_RESEEDED, op, ())
    syncs = {
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "torch.cuda.Stream.synchronize": torch.cuda.Stream.synchronize,
        "torch.cuda.Event.synchronize": torch.cuda.Event.synchronize,
    }
    for op, function in syncs.items():
        calls[function.__code__] = (HOST_SYNC, op, ())
    return calls


_HOST_PYTHON_CALLS = _python_calls()
#: Python's random stream, which ``random.seed`` seeds (the module's functions are this
#: instance's methods); seeding another instance is not reported.
_INST = random._inst
_SEEDS_HOST_STREAM = random.Random.seed.__code__
