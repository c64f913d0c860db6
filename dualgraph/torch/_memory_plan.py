"""Memory plan: what the static buffers and the graphs' memory pool will hold, before capture.

:func:`memory_plan` runs a callable once, forward and backward, watching every tensor torch
allocates (a ``TorchDispatchMode``; a storage's release is seen through a weak reference) and
every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``; tensors
packed by hooks inside the callable, such as activation checkpointing's, are not counted). From
that it gives, per callable:

- the static input, output and grad buffer bytes a capture makes (as ``diagnostics()`` counts
  them after capture);
- the activations saved for backward (bytes of the distinct storages the forward made and
  autograd saved);
- the peak of the tensors alive at once during the forward and the backward;
- the expected pool size: the live tensors replayed in capture order (all forwards, then all
  backwards in reverse), each block rounded as the CUDA caching allocator rounds it (512 B), each
  kind of segment as it sizes them (2 MiB for blocks up to 1 MiB, 20 MiB for blocks under 10 MiB,
  larger blocks in segments of their own rounded to 2 MiB). It is a model: cuBLAS/cuDNN
  workspaces are not tensors and do not appear, and fragmentation is ignored.

``make_graphed_callables`` makes the same plan during its first warmup iteration and keeps it in
``diagnostics(graphed).memory_plan``, with the pool size measured after capture beside it. A plan
made on the CPU counts what the CPU kernels allocate; GPU kernels (flash attention, cuDNN) can save
different tensors, so plan on the GPU for exact numbers.

>>> import torch
>>> plan = memory_plan(torch.nn.Linear(256, 256), torch.randn(64, 256, requires_grad=True))
>>> plan.callables[0].static_output_bytes, plan.callables[0].saved_activation_bytes
(65536, 0)
>>> print(plan)  # doctest: +ELLIPSIS
memory plan (bytes; the pool is measured after capture)
callable  static in  static out  static grads  saved activations  forward peak ...
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ._op_watch import OpWatch

__all__ = ["CallableMemory", "MemoryPlan", "MemoryProbe", "memory_plan"]

_KIB = 1024
_MIB = 1024 * _KIB
#: The CUDA caching allocator's sizes (c10/cuda/CUDACachingAllocator.cpp, default settings).
_MIN_BLOCK = 512
_SMALL_BLOCK = 1 * _MIB  # blocks up to this size come from small segments
_SMALL_SEGMENT = 2 * _MIB
_LARGE_SEGMENT = 20 * _MIB  # segment for blocks under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 * _MIB  # blocks from here get a segment of their own...
_ROUND_LARGE = 2 * _MIB  # ...rounded up to this


@dataclass(frozen=True)
class CallableMemory:
    """The memory of one captured callable, in bytes; see the module docstring."""

    name: str
    static_input_bytes: int
    static_output_bytes: int
    static_grad_bytes: int
    saved_activation_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    expected_pool_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """Per-callable memory and the expected size of the pool all of them share.

    ``pool_bytes`` is the pool's size measured after a CUDA capture (``None`` before capture and
    off the GPU). ``print(plan)`` shows a table; ``rich`` renders it as a rich table.
    """

    callables: tuple[CallableMemory, ...]
    expected_pool_bytes: int
    pool_bytes: int | None = None

    def with_measured_pool(self, pool_bytes: int | None) -> MemoryPlan:
        """The same plan with the pool size a capture measured."""
        return replace(self, pool_bytes=pool_bytes)

    def _rows(self) -> tuple[list[str], list[list[str]]]:
        titles = [
            "callable",
            "static in",
            "static out",
            "static grads",
            "saved activations",
            "forward peak",
            "backward peak",
            "pool (expected)",
            "pool (measured)",
        ]
        measured = "-" if self.pool_bytes is None else format_bytes(self.pool_bytes)
        rows = [
            [
                c.name,
                *(
                    format_bytes(n)
                    for n in (
                        c.static_input_bytes,
                        c.static_output_bytes,
                        c.static_grad_bytes,
                        c.saved_activation_bytes,
                        c.forward_peak_bytes,
                        c.backward_peak_bytes,
                        c.expected_pool_bytes,
                    )
                ),
                measured if len(self.callables) == 1 else "",
            ]
            for c in self.callables
        ]
        if len(self.callables) > 1:
            rows.append(
                ["all (one pool)", *[""] * 6, format_bytes(self.expected_pool_bytes), measured]
            )
        return titles, rows

    def __str__(self) -> str:
        titles, rows = self._rows()
        widths = [max(len(row[i]) for row in [titles, *rows]) for i in range(len(titles))]
        lines = ["memory plan (bytes; the pool is measured after capture)"]
        for row in [titles, *rows]:
            cells = [
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __rich__(self) -> Any:
        """A ``rich.table.Table`` of the plan (``rich`` is optional; only this imports it)."""
        table_type = importlib.import_module("rich.table").Table
        titles, rows = self._rows()
        table = table_type(title="memory plan (the pool is measured after capture)")
        for i, title in enumerate(titles):
            table.add_column(title, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        return table


def memory_plan(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> MemoryPlan:
    """Plan the memory a capture of ``fn(*args, **kwargs)`` would take, from one run.

    Runs forward and backward once as :func:`dualgraph.torch.lint` does (inputs cloned, no
    ``.grad`` touched, RNG and buffers put back), on the device of the inputs. Parameter grads
    are counted as the default ``param_grads="auto"`` holds them: a grad buffer and a ``.grad``
    accumulator each.

    >>> layer = torch.nn.Linear(4, 4)
    >>> memory_plan(layer, torch.randn(2, 4)).callables[0].static_grad_bytes  # out grad, 2x W, b
    192
    """
    from ._probe import probe_once

    _, plan = probe_once(fn, args, kwargs, lint=False, memory=True)
    assert plan is not None
    return plan


def plan_of(probes: Sequence[MemoryProbe], static: Sequence[tuple[int, int, int]]) -> MemoryPlan:
    """A plan for callables captured together: ``static[i]`` = (input, output, grad) bytes."""
    callables = tuple(
        probe.callable_memory(*sizes) for probe, sizes in zip(probes, static, strict=True)
    )
    pool = _Pool()
    for probe in probes:
        pool.replay(probe.forward_events)
    for probe in reversed(probes):
        pool.replay(probe.backward_events)
    return MemoryPlan(callables, pool.expected_bytes())


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``20.0 MiB``."""
    if n < _KIB:
        return f"{n} B"
    for unit, size in (("GiB", _MIB * _KIB), ("MiB", _MIB), ("KiB", _KIB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors' elements, as ``diagnostics()`` counts static buffers."""
    return sum(t.numel() * t.element_size() for t in tensors)


# -- watching one run ----------------------------------------------------------------------------


class MemoryProbe:
    """Watch the tensors a callable's forward and backward allocate; see the module docstring.

    Enter it around the forward and around the backward (once, or each in its own ``with``).
    Allocations are counted from the callable's own code during the forward: when ``fn`` (the
    callable) is given, tensors made outside it before the backward starts (the output grads a
    warmup makes, say) are left out, as a capture allocates those outside its pool.
    """

    def __init__(self, name: str, fn: Callable[..., Any] | None = None) -> None:
        self.name = name
        self._code = _code_of(fn)
        # re-entrant: a release (a weakref callback) can run inside the bookkeeping, when an
        # allocation there starts a garbage collection
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}  # storage id -> block size, for storages alive now
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._saved: dict[int, int] = {}  # storage id -> bytes, of saved activations
        self._events: list[tuple[bool, int]] = []  # (in backward, +/- block size)
        self._first_backward: int | None = None
        self._last_backward = -1
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> MemoryProbe:
        stack = contextlib.ExitStack()
        stack.enter_context(self.watching())
        self._entered.append(stack)
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered.pop().close()

    @contextlib.contextmanager
    def watching(self, *, dispatch: bool = True) -> Iterator[None]:
        """Watch what runs inside; ``dispatch=False`` leaves the ATen ops to a shared
        :class:`~dualgraph.torch._op_watch.OpWatch` that calls :meth:`after_op`."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self._saved_hooks()))
            if dispatch:
                stack.enter_context(OpWatch(after=[self]))
            yield

    def close(self) -> None:
        """Stop following releases (what is alive now stays counted as alive)."""
        with self._lock:
            self._refs.clear()

    # -- what it measured ------------------------------------------------------------------------

    @property
    def forward_events(self) -> list[int]:
        """Block sizes allocated (+) and released (-) during the forward, in order."""
        end = len(self._events) if self._first_backward is None else self._first_backward
        return [delta for _, delta in self._events[:end]]

    @property
    def backward_events(self) -> list[int]:
        """The same during the backward, up to its last op (later releases are outputs'/grads')."""
        if self._first_backward is None:
            return []
        return [delta for _, delta in self._events[self._first_backward : self._last_backward + 1]]

    def callable_memory(
        self, static_input_bytes: int, static_output_bytes: int, static_grad_bytes: int
    ) -> CallableMemory:
        forward, backward = _Pool(), _Pool()
        forward.replay(self.forward_events)
        backward.replay(self.forward_events)
        backward.reset_peak()
        backward.replay(self.backward_events)
        alone = _Pool()
        alone.replay(self.forward_events)
        alone.replay(self.backward_events)
        return CallableMemory(
            name=self.name,
            static_input_bytes=static_input_bytes,
            static_output_bytes=static_output_bytes,
            static_grad_bytes=static_grad_bytes,
            saved_activation_bytes=sum(self._saved.values()),
            forward_peak_bytes=forward.peak_bytes(),
            backward_peak_bytes=backward.peak_bytes(),
            expected_pool_bytes=alone.expected_bytes(),
        )

    # -- bookkeeping -----------------------------------------------------------------------------

    def after_op(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
    ) -> None:
        """Count the storages an ATen op allocated (forward or backward)."""
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward:
            with self._lock:
                if self._first_backward is None:
                    self._first_backward = len(self._events)
                if _returns_alias(func):  # a view or an in-place op: nothing new
                    self._last_backward = len(self._events) - 1
                    return
        elif _returns_alias(func) or (self._first_backward is None and not self._inside_callable()):
            return
        argument_storages: set[int] | None = None
        for tensor in _tensors_in(out):
            storage = _storage_of(tensor)
            if storage is None:
                continue
            key = int(storage._cdata)
            if key in self._sizes:
                continue
            if argument_storages is None:  # an op whose schema hides an alias (_unsafe_view)
                argument_storages = _storages_of((*args, *kwargs.values()))
            if key in argument_storages or storage.nbytes() == 0:
                continue
            size = _block_size(storage.nbytes())
            with self._lock:
                self._sizes[key] = size
                self._refs[key] = weakref.ref(storage, functools.partial(self._released, key))
                self._events.append((in_backward, size))
        if in_backward:  # what happened up to here (releases included) was during the backward
            with self._lock:
                self._last_backward = len(self._events) - 1

    def _released(self, key: int, _ref: Any) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if self._refs.pop(key, None) is None or size is None:
                return  # released after close(), or never counted
            self._events.append((self._first_backward is not None, -size))

    def note_saved(self, tensors: Sequence[Any]) -> None:
        """Count tensors saved for backward that another pack hook collected.

        Only the innermost ``saved_tensors_hooks`` see what autograd saves: code that packs the
        forward's saved tensors itself (an adapter inspecting them) hands them over here.
        """
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._count_saved(tensor)

    def _count_saved(self, tensor: torch.Tensor) -> None:
        storage = _storage_of(tensor)
        if storage is not None:
            key = int(storage._cdata)
            if key in self._sizes:
                self._saved[key] = storage.nbytes()

    def _saved_hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
        """Pack hooks that count, then hand over to the hooks active here (if any)."""
        try:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        except (AttributeError, TypeError):  # a torch without it: nothing outside to hand over to
            outer = None
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor: torch.Tensor) -> Any:
            self._count_saved(tensor)
            return tensor if outer_pack is None else outer_pack(tensor)

        def unpack(packed: Any) -> Any:
            return packed if outer_unpack is None else outer_unpack(packed)

        return pack, unpack

    def _inside_callable(self) -> bool:
        if self._code is None:
            return True
        import sys

        frame = sys._getframe(3)
        while frame is not None:
            if frame.f_code is self._code:
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False


class _Pool:
    """Live bytes by kind of segment, their peaks, and the segments those peaks need."""

    def __init__(self) -> None:
        self.live = [0, 0, 0]  # small blocks, blocks under 10 MiB, larger blocks
        self.peak = [0, 0, 0]
        self.total = 0
        self.total_peak = 0

    def replay(self, events: Sequence[int]) -> None:
        for delta in events:
            kind = _segment_kind(abs(delta))
            self.live[kind] += delta
            self.total += delta
            if delta > 0:
                self.peak[kind] = max(self.peak[kind], self.live[kind])
                self.total_peak = max(self.total_peak, self.total)

    def reset_peak(self) -> None:
        self.peak = list(self.live)
        self.total_peak = self.total

    def peak_bytes(self) -> int:
        return self.total_peak

    def expected_bytes(self) -> int:
        small, medium, large = self.peak
        return (
            _round_up(small, _SMALL_SEGMENT)
            + _round_up(medium, _LARGE_SEGMENT)
            + _round_up(large, _ROUND_LARGE)
        )


_RETURNS_ALIAS: dict[Any, bool] = {}


def _returns_alias(func: Any) -> bool:
    """Whether an op's schema says all its outputs alias arguments (views, in-place, ``out=``)."""
    aliases = _RETURNS_ALIAS.get(func)
    if aliases is None:
        try:
            returns = func._schema.returns
        except AttributeError:
            returns = ()
        aliases = bool(returns) and all(r.alias_info is not None for r in returns)
        _RETURNS_ALIAS[func] = aliases
    return aliases


def _segment_kind(size: int) -> int:
    if size <= _SMALL_BLOCK:
        return 0
    return 1 if size < _MIN_LARGE_ALLOC else 2


def _block_size(nbytes: int) -> int:
    """The size of the block the CUDA caching allocator hands out for ``nbytes``."""
    size = _round_up(max(nbytes, 1), _MIN_BLOCK)
    return _round_up(size, _ROUND_LARGE) if size >= _MIN_LARGE_ALLOC else size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _storage_of(tensor: torch.Tensor) -> Any:
    try:
        return tensor.untyped_storage()
    except Exception:  # sparse tensors, wrapper subclasses: no storage of their own
        return None


def _storages_of(arguments: Sequence[Any]) -> set[int]:
    """The storages of an op's tensor arguments (and of tensors in list arguments)."""
    keys = set()
    for value in arguments:
        for tensor in value if isinstance(value, list | tuple) else (value,):
            if isinstance(tensor, torch.Tensor):
                storage = _storage_of(tensor)
                if storage is not None:
                    keys.add(int(storage._cdata))
    return keys


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # most ops return one tensor
        return [tree]
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, tuple | list):
            stack.extend(reversed(item))
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
    return found


def _code_of(fn: Any) -> Any:
    """The code object whose frame is on the stack while ``fn`` runs (``None`` if none is)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward  # an instance-level forward, or the class's
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None and callable(fn):  # an object with a __call__ method
        call = type(fn).__dict__.get("__call__")
        code = getattr(call, "__code__", None)
    return code
