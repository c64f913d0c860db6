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
- what the graphs keep in the pool: the outputs and grads a capture computes there and keeps as
  static buffers (the tensors still alive when the backward ends; none for shape buckets on
  cuda, whose captures copy them to buffers outside the pool);
- the expected pool size: the allocations and releases replayed in capture order (all forwards,
  then all backwards in reverse) through a model of the CUDA caching allocator's placement:
  blocks rounded to 512 B, best fit among the free blocks, blocks split and merged, new segments
  of 2 MiB for blocks up to 1 MiB, of 20 MiB for blocks under 10 MiB, of their own size rounded
  to 2 MiB above. Segments are never given back during a capture, so the pool is every segment
  the replay made: the kept results, the activations and temporaries alive at the peak, and the
  room the segments leave around them. Allocations that are not tensors do not appear: kernels'
  scratch (small) and cuBLAS workspaces, which a capture makes for its stream only once per
  process and thread, before its first capture (see ``_blas_workspaces.py``), outside any pool.

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

import functools
import importlib
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ._op_watch import OpObserver, code_of, tensors_in
from ._saved_hooks import own_saved_tensors_hooks

__all__ = ["CallableMemory", "MemoryPlan", "MemoryProbe", "memory_plan"]

_KIB = 1024
_MIB = 1024 * _KIB
#: The CUDA caching allocator's sizes (c10/cuda/CUDACachingAllocator.cpp, default settings).
_MIN_BLOCK = 512  # blocks are multiples of this
_SMALL_BLOCK = 1 * _MIB  # blocks up to this size come from the small pool's segments
_SMALL_SEGMENT = 2 * _MIB
_LARGE_SEGMENT = 20 * _MIB  # the segment for blocks under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 * _MIB  # blocks from here get a segment of their own...
_ROUND_LARGE = 2 * _MIB  # ...rounded up to this


@dataclass(frozen=True)
class CallableMemory:
    """The memory of one captured callable, in bytes; see the module docstring.

    ``kept_in_pool_bytes`` is the part of ``expected_pool_bytes`` the graphs keep: outputs and
    grads computed in the pool (blocks as the allocator rounds them).
    """

    name: str
    static_input_bytes: int
    static_output_bytes: int
    static_grad_bytes: int
    saved_activation_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    expected_pool_bytes: int
    kept_in_pool_bytes: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """Per-callable memory and the expected size of the pool all of them share.

    ``kept_in_pool_bytes`` is what the graphs of all callables keep in that pool. ``pool_bytes``
    is the pool's size measured after a CUDA capture (``None`` before capture and off the GPU).
    ``print(plan)`` shows a table; ``rich`` renders it as a rich table.
    """

    callables: tuple[CallableMemory, ...]
    expected_pool_bytes: int
    pool_bytes: int | None = None
    kept_in_pool_bytes: int = 0

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
            "kept in pool",
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
                        c.kept_in_pool_bytes,
                        c.expected_pool_bytes,
                    )
                ),
                measured if len(self.callables) == 1 else "",
            ]
            for c in self.callables
        ]
        if len(self.callables) > 1:
            rows.append(
                [
                    "all (one pool)",
                    *[""] * 6,
                    format_bytes(self.kept_in_pool_bytes),
                    format_bytes(self.expected_pool_bytes),
                    measured,
                ]
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
    are counted as the default ``param_grads="auto"`` holds them: one ``.grad`` accumulator each,
    which the backward graph adds into.

    >>> layer = torch.nn.Linear(4, 4)
    >>> memory_plan(layer, torch.randn(2, 4)).callables[0].static_grad_bytes  # out grad, W, b
    112
    """
    from ._probe import probe_once

    _, plan = probe_once(fn, args, kwargs, lint=False, memory=True)
    assert plan is not None
    return plan


def plan_of(
    probes: Sequence[MemoryProbe],
    static: Sequence[tuple[int, int, int]],
    *,
    results_in_pool: bool = True,
) -> MemoryPlan:
    """A plan for callables captured together: ``static[i]`` = (input, output, grad) bytes.

    ``results_in_pool=False``: the capture copies outputs and grads into buffers outside the
    pool and lets the pool's go (shape buckets on cuda): the pool keeps nothing.
    """
    callables = tuple(
        probe.callable_memory(*sizes, results_in_pool=results_in_pool)
        for probe, sizes in zip(probes, static, strict=True)
    )
    pool = CachingAllocatorModel()
    for index, probe in enumerate(probes):
        pool.replay(probe.forward_events, tag=index)
    for index, probe in reversed(list(enumerate(probes))):
        pool.replay(probe.backward_events, tag=index)
    kept = pool.allocated_bytes if results_in_pool else 0
    return MemoryPlan(callables, pool.reserved_bytes, kept_in_pool_bytes=kept)


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

#: One allocation (``+bytes``) or release (``-bytes``) of the storage ``key`` (unique among the
#: storages alive at once).
Event = tuple[int, int]


class MemoryProbe(OpObserver):
    """Watch the tensors a callable's forward and backward allocate; see the module docstring.

    Enter it around the forward and around the backward (once, or each in its own ``with``).
    Allocations are counted from the callable's own code during the forward: when ``fn`` (the
    callable) is given, tensors made outside it before the backward starts (the output grads a
    warmup makes, say) are left out, as a capture allocates those outside its pool.
    """

    def __init__(self, name: str, fn: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.name = name
        self._code = code_of(fn)
        # re-entrant: a release (a weakref callback) can run inside the bookkeeping, when an
        # allocation there starts a garbage collection
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}  # storage key -> bytes, for storages alive now
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._saved: dict[int, int] = {}  # storage key -> bytes, of saved activations
        self._events: list[Event] = []
        self._first_backward: int | None = None
        self._last_backward = -1

    def contexts(self) -> Sequence[AbstractContextManager[Any]]:
        """Saved-tensor hooks that count what autograd saves; ATen ops come through
        :meth:`after_op`."""
        return (own_saved_tensors_hooks(*self._saved_hooks()),)

    def close(self) -> None:
        """Stop following releases (what is alive now stays counted as alive)."""
        with self._lock:
            self._refs.clear()

    # -- what it measured ------------------------------------------------------------------------

    @property
    def forward_events(self) -> list[Event]:
        """Storages allocated and released during the forward, in order."""
        end = len(self._events) if self._first_backward is None else self._first_backward
        return self._events[:end]

    @property
    def backward_events(self) -> list[Event]:
        """The same during the backward, up to its last op (later releases are outputs'/grads')."""
        if self._first_backward is None:
            return []
        return self._events[self._first_backward : self._last_backward + 1]

    def callable_memory(
        self,
        static_input_bytes: int,
        static_output_bytes: int,
        static_grad_bytes: int,
        *,
        results_in_pool: bool = True,
    ) -> CallableMemory:
        forward = _LiveBytes()
        forward.replay(self.forward_events)
        backward = _LiveBytes()
        backward.replay(self.forward_events)
        backward.peak = backward.live
        backward.replay(self.backward_events)
        alone = CachingAllocatorModel()
        alone.replay(self.forward_events)
        alone.replay(self.backward_events)
        return CallableMemory(
            name=self.name,
            static_input_bytes=static_input_bytes,
            static_output_bytes=static_output_bytes,
            static_grad_bytes=static_grad_bytes,
            saved_activation_bytes=sum(self._saved.values()),
            forward_peak_bytes=forward.peak,
            backward_peak_bytes=backward.peak,
            expected_pool_bytes=alone.reserved_bytes,
            kept_in_pool_bytes=alone.allocated_bytes if results_in_pool else 0,
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
        for tensor in tensors_in(out):
            storage = _storage_of(tensor)
            if storage is None:
                continue
            key = int(storage._cdata)
            if key in self._sizes:
                continue
            if argument_storages is None:  # an op whose schema hides an alias (_unsafe_view)
                argument_storages = _storages_of((*args, *kwargs.values()))
            if key in argument_storages or storage.nbytes() == 0 or tensor.is_meta:
                continue
            size = storage.nbytes()
            with self._lock:
                self._sizes[key] = size
                self._refs[key] = weakref.ref(storage, functools.partial(self._released, key))
                self._events.append((key, size))
        if in_backward:  # what happened up to here (releases included) was during the backward
            with self._lock:
                self._last_backward = len(self._events) - 1

    def release(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Count ``tensors`` as released when the backward ends, where a capture frees them.

        The parameter grads a backward graph adds into ``.grad`` accumulators
        (``param_grads="auto"``, ``"in_graph"``) are temporaries of its pool, not kept results.
        """
        with self._lock:
            if self._first_backward is None:
                return
            for tensor in tensors:
                storage = None if tensor is None else _storage_of(tensor)
                if storage is None:
                    continue
                key = int(storage._cdata)
                size = self._sizes.pop(key, None)
                if self._refs.pop(key, None) is None or size is None:
                    continue
                self._last_backward += 1
                self._events.insert(self._last_backward, (key, -size))

    def _released(self, key: int, _ref: Any) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if self._refs.pop(key, None) is None or size is None:
                return  # released after close(), or never counted
            self._events.append((key, -size))

    def note_saved(self, tensors: Sequence[Any]) -> None:
        """Count tensors saved for backward that another pack hook collected.

        Only the innermost ``saved_tensors_hooks`` see what autograd saves: code that packs the
        forward's saved tensors itself (an adapter inspecting them) hands them over here.
        """
        if not self._sizes:  # no storage seen made (an unobserved probe): none to count
            return
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
            # detached: a saved output packed as itself would hold its own node for good
            return tensor.detach() if outer_pack is None else outer_pack(tensor)

        def unpack(packed: Any) -> Any:
            return packed if outer_unpack is None else outer_unpack(packed)

        return pack, unpack

    def _inside_callable(self) -> bool:
        if self._code is None:
            return True
        frame = sys._getframe(3)
        while frame is not None:
            if frame.f_code is self._code:
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False


# -- the pool, as the caching allocator would lay it out ----------------------------------------


class _LiveBytes:
    """Bytes of the storages alive at once (as the allocator's blocks), and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def replay(self, events: Sequence[Event]) -> None:
        for _, delta in events:
            self.live += _round_size(delta) if delta > 0 else -_round_size(-delta)
            self.peak = max(self.peak, self.live)


@dataclass
class _Block:
    start: int
    size: int
    segment: int
    small: bool
    free: bool = True


@dataclass
class CachingAllocatorModel:
    """Where the CUDA caching allocator would place a sequence of allocations in one pool.

    A model of its placement with default settings, for one stream (a capture's): a request is
    rounded up to 512 B; the smallest free block of its kind that fits serves it (the lowest
    address among equals), split when what remains is a block of its kind (512 B or more in
    small segments, more than 1 MiB in large ones); a block released merges with free neighbours
    in its segment; with no block to serve a request, a new segment is made, and never given back
    (the pool of a graph keeps every segment). ``reserved_bytes`` is then the pool's size.

    >>> pool = CachingAllocatorModel()
    >>> pool.replay([(1, 32 * _MIB), (2, 8 * _MIB), (1, -32 * _MIB), (3, 16 * _MIB)])
    >>> pool.reserved_bytes // _MIB, pool.allocated_bytes // _MIB  # 32 MiB and 20 MiB segments
    (52, 24)
    """

    reserved_bytes: int = 0
    allocated_bytes: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)  # by start address
    _free: dict[bool, set[int]] = field(default_factory=lambda: {True: set(), False: set()})
    _live: dict[tuple[Any, int], _Block] = field(default_factory=dict)
    _segments: itertools.count[int] = field(default_factory=itertools.count)

    def replay(self, events: Sequence[Event], tag: Any = None) -> None:
        """Apply ``events``; ``tag`` keeps apart the storage keys of different callables."""
        for key, delta in events:
            if delta > 0:
                self._live[(tag, key)] = self.malloc(delta)
            else:
                block = self._live.pop((tag, key), None)
                if block is not None:
                    self.free(block)

    def malloc(self, nbytes: int) -> _Block:
        size = _round_size(nbytes)
        small = size <= _SMALL_BLOCK
        fits = [self._blocks[s] for s in self._free[small] if self._blocks[s].size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.start))
            self._free[small].discard(block.start)
        else:
            segment = _allocation_size(size)
            block = _Block(self.reserved_bytes, segment, next(self._segments), small)
            self._blocks[block.start] = block
            self.reserved_bytes += segment
        remaining = block.size - size
        if remaining >= _MIN_BLOCK if small else remaining > _SMALL_BLOCK:
            rest = _Block(block.start + size, remaining, block.segment, small)
            self._blocks[rest.start] = rest
            self._free[small].add(rest.start)
            block.size = size
        block.free = False
        self.allocated_bytes += block.size
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        self.allocated_bytes -= block.size
        after = self._blocks.get(block.start + block.size)
        if after is not None and after.free and after.segment == block.segment:
            self._free[block.small].discard(after.start)
            del self._blocks[after.start]
            block.size += after.size
        before = next(
            (
                b
                for s in self._free[block.small]
                if (b := self._blocks[s]).start + b.size == block.start
                and b.segment == block.segment
            ),
            None,
        )
        if before is not None:
            del self._blocks[block.start]
            before.size += block.size
            return
        self._free[block.small].add(block.start)


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


def _round_size(nbytes: int) -> int:
    """The size of the block the CUDA caching allocator hands out for ``nbytes``."""
    return _round_up(max(nbytes, 1), _MIN_BLOCK)


def _allocation_size(size: int) -> int:
    """The size of the segment the caching allocator makes for a block of ``size``."""
    if size <= _SMALL_BLOCK:
        return _SMALL_SEGMENT
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_SEGMENT
    return _round_up(size, _ROUND_LARGE)


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
