"""Whether a callable draws random numbers from an RNG state it set itself to one it did not
read in the same pass (forward or backward): a graph would draw other numbers than eager.

Eager restarts the generator at the absolute position set. A graph's random ops draw at the
position its replay starts from plus an offset of its own, and a state set during a capture only
moves that offset (a seed set there is kept only if it is the seed already in use, else the
capture fails): so the replays draw on where eager restarts.

- In the backward: ``torch.utils.checkpoint`` with ``preserve_rng_state=True`` (its default)
  recomputing dropout sets the state read in the forward, so that eager redraws the forward's
  masks. The forward and the backward are two graphs, replayed from two positions: the
  backward graph would draw other masks than the forward graph did, and the grads would
  silently be those of other masks.
- In the forward: ``torch.manual_seed(s)`` (or a state kept from elsewhere) before a draw gives
  eager the same numbers on every call, where the replays draw new ones on every call.

The ``"emulate"`` backend runs the callable again, so it would hide both. A state read and set
back within the same pass (``torch.random.fork_rng`` around draws of its own) is fine: offsets
within one graph line up as eager's positions do. So is setting a state no draw follows (every
checkpoint of a part without random ops).

The warmup's first forward and backward are watched, each apart, through ``torch.get_rng_state``,
``set_rng_state`` and ``manual_seed`` and their ``torch.cuda`` twins (what ``checkpoint``,
``fork_rng`` and ``torch.manual_seed`` call): a set to a state not read in the same pass, after
which the generator moves before the next set or the pass's end, is what is refused.

>>> import torch
>>> state = torch.get_rng_state()
>>> with rng_rewinds() as seen:
...     torch.set_rng_state(state)
...     _ = torch.rand(2)
>>> seen.draws_from_rewound_state
True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._unobserved import unobserved as _unobserved
from ._watched_function import WatchedFunction

__all__ = ["RNG_STATE_WATCHES", "RewindsSeen", "rng_rewinds"]


class RewindsSeen:
    """What :func:`rng_rewinds` saw: the states read, those set that were not read (with
    how to read the generator each set, and what it held just after), and whether a generator
    moved on from such a set state."""

    __slots__ = ("draws_from_rewound_state", "read", "set_foreign")

    def __init__(self) -> None:
        self.read: list[torch.Tensor] = []
        self.set_foreign: list[tuple[Callable[[], torch.Tensor], torch.Tensor]] = []
        self.draws_from_rewound_state = False

    def settle(self) -> None:
        """Note whether a generator moved since a foreign state was set in it (a draw)."""
        for read_now, just_set in self.set_foreign:
            if not torch.equal(read_now(), just_set):
                self.draws_from_rewound_state = True
        self.set_foreign.clear()

    def was_read(self, state: torch.Tensor) -> bool:
        return any(
            read.shape == state.shape and torch.equal(read, state.to(read.dtype))
            for read in self.read
        )


def _noting_reads(found: Any, watchers: Callable[[], list[RewindsSeen]]) -> Any:
    def watched(*args: Any, **kwargs: Any) -> Any:
        state = found(*args, **kwargs)
        with _unobserved():
            for seen in watchers():
                seen.read.append(state.clone())
        return state

    return watched


def _noting_sets(
    reader_of: Callable[..., Callable[[], torch.Tensor] | None],
) -> Callable[[Any, Callable[[], list[RewindsSeen]]], Any]:
    # ``reader_of(*args, **kwargs)``: how to read the generator a set with those arguments set
    # (``None`` where the set has not taken effect yet), through the getter itself, where no
    # watch replaces it (reading to compare is no read of the callable's)
    def wrap(found: Any, watchers: Callable[[], list[RewindsSeen]]) -> Any:
        def watched(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            with _unobserved():
                for seen in watchers():
                    seen.settle()
            found(new_state, *args, **kwargs)
            with _unobserved():
                foreign = [seen for seen in watchers() if not seen.was_read(new_state)]
                read_now = reader_of(*args, **kwargs) if foreign else None
                if read_now is not None:
                    just_set = read_now()
                    for seen in foreign:
                        seen.set_foreign.append((read_now, just_set))

        return watched

    return wrap


def _cpu_reader() -> Callable[[], torch.Tensor]:
    return torch.random.get_rng_state


def _cuda_reader(device: Any = "cuda") -> Callable[[], torch.Tensor] | None:
    """The getter of the device a ``torch.cuda.set_rng_state(state, device)`` set, bound to its
    index now (``"cuda"`` means the current device, which may change before the comparison:
    ``checkpoint`` sets each device's state inside ``torch.cuda.device(i)``)."""
    if not torch.cuda.is_initialized():  # the set waits for CUDA's start
        return None
    if isinstance(device, str):
        device = torch.device(device)
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    return functools.partial(torch.cuda.random.get_rng_state, index)


def _noting_seeds(
    readers_of: Callable[[], list[Callable[[], torch.Tensor]]],
) -> Callable[[Any, Callable[[], list[RewindsSeen]]], Any]:
    # a seed is a state no pass read: every generator it seeds is noted as set to a foreign one
    def wrap(found: Any, watchers: Callable[[], list[RewindsSeen]]) -> Any:
        def watched(seed: Any, *args: Any, **kwargs: Any) -> Any:
            with _unobserved():
                for seen in watchers():
                    seen.settle()
            result = found(seed, *args, **kwargs)
            with _unobserved():
                for read_now in readers_of() if watchers() else ():
                    just_set = read_now()
                    for seen in watchers():
                        seen.set_foreign.append((read_now, just_set))
            return result

        return watched

    return wrap


def _current_cuda_device() -> list[Callable[[], torch.Tensor]]:
    reader = _cuda_reader()
    return [] if reader is None else [reader]


def _every_cuda_device() -> list[Callable[[], torch.Tensor]]:
    if not torch.cuda.is_initialized():
        return []
    return [
        functools.partial(torch.cuda.random.get_rng_state, index)
        for index in range(torch.cuda.device_count())
    ]


_WATCHED = (
    WatchedFunction(torch, "get_rng_state", _noting_reads),
    WatchedFunction(torch, "set_rng_state", _noting_sets(_cpu_reader)),
    WatchedFunction(torch, "manual_seed", _noting_seeds(lambda: [_cpu_reader()])),
    WatchedFunction(torch.cuda, "get_rng_state", _noting_reads),
    WatchedFunction(torch.cuda, "set_rng_state", _noting_sets(_cuda_reader)),
    WatchedFunction(torch.cuda, "manual_seed", _noting_seeds(_current_cuda_device)),
    WatchedFunction(torch.cuda, "manual_seed_all", _noting_seeds(_every_cuda_device)),
)


#: The replacements' code: the lint looks past them to the code that called torch's function.
RNG_STATE_WATCHES = frozenset(
    {
        _noting_reads(None, list).__code__,
        _noting_sets(_cpu_reader)(None, list).__code__,
        _noting_seeds(list)(None, list).__code__,
    }
)


@contextlib.contextmanager
def rng_rewinds(*, every_thread: bool = False) -> Iterator[RewindsSeen]:
    """Watch this thread's (with ``every_thread``, every thread's: a backward's, whose CUDA
    functions the autograd engine runs in threads of its own) reads, sets and seeds of torch's
    CPU and CUDA RNG states for a draw from a state set to one not read inside the block."""
    seen = RewindsSeen()
    # begin/end rather than a context manager each in an ExitStack (as branch_reads): each
    # inspected warmup enters these seven twice, its forward's and its backward's
    begun: list[WatchedFunction[RewindsSeen]] = []
    try:
        for watched in _WATCHED:
            watched.begin(seen, every_thread=every_thread)
            begun.append(watched)
        yield seen
    finally:
        failure: BaseException | None = None
        for watched in reversed(begun):  # each ended, whatever another raises
            try:
                watched.end(seen)
            except BaseException as error:  # raised once the others have ended
                failure = failure or error
        if failure is not None:
            raise failure
    with _unobserved():
        seen.settle()
