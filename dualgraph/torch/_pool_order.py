"""Callables graphed together share one memory pool: which replays expire a pending backward.

:func:`dualgraph.torch.make_graphed_callables` captures the forwards of callables graphed
together in the order given, then their backwards in reverse, all into one pool
(``_capture.py``). During a capture the caching allocator hands a graph blocks of the pool that
no live tensor holds, and each replay writes them again. The activations of callable ``k`` live
from its forward's capture to its backward's, so the graphs captured in between (the forwards
and backwards of the callables after it) kept out of their blocks, and all others may not have:
the forwards of earlier callables (captured before them, their temporaries freed) and the
backwards of earlier callables (captured after them, once they were freed). So while a backward
of ``k`` is pending, a replay of any graph of an earlier callable may overwrite what it reads,
and on CUDA it would then compute wrong grads without a word.

:class:`PoolOrder` follows that rule on every backend, so that a CPU run refuses what a GPU run
would get wrong: each callable holds a :class:`PoolPlace` (where its forward and its backward
were captured), every replay reports itself, and one that may have overwritten a pending
backward's activations expires it; that backward then raises, saying why. The rule lets
through every order that is safe: the captured one (forwards in order, backwards in reverse,
as a model runs its layers), later callables replayed while an earlier backward is pending, an
earlier callable replayed when no later backward is pending.

The pending backwards it tracks nest (each captured inside the one below it), so they form a
stack, and a replay pops the ones it expires: amortized constant work per replay.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from .._errors import DualgraphError

__all__ = ["PoolOrder", "PoolPlace", "places_in_capture_order"]


class PoolOrder:
    """The callables whose graphs share one pool, and their backwards pending now.

    ``lock``: shared by the callables' replays, so that no two of them run at once (they would
    write the same memory at once on CUDA).
    """

    __slots__ = ("_pending", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (place, generation) of each pending backward, each captured inside the one below
        self._pending: list[tuple[PoolPlace, int]] = []

    def replayed(self, place: PoolPlace, at: int, what: str) -> None:
        """A graph of ``place``'s callable, captured at ``at``, replays: expire what it may
        overwrite (the pending backwards whose activations were not alive at ``at``)."""
        pending = self._pending
        while pending:
            other, generation = pending[-1]
            if other.forward_at < at < other.backward_at:
                return  # and so are those below it, whose captures enclose its own
            pending.pop()
            if other is not place:  # its own earlier replays: the callable refuses them itself
                other.expired = generation
                other.expired_by = (place, what)


class PoolPlace:
    """Where one callable's forward and backward were captured in its :class:`PoolOrder`."""

    __slots__ = ("backward_at", "expired", "expired_by", "forward_at", "index", "name", "order")

    def __init__(
        self, order: PoolOrder, index: int, name: str, forward_at: int, backward_at: int
    ) -> None:
        self.order = order
        self.index = index
        self.name = name
        self.forward_at = forward_at
        self.backward_at = backward_at
        self.expired = -1  # the generation of the replay whose backward was expired last
        self.expired_by: tuple[PoolPlace, str] | None = None

    @property
    def label(self) -> str:
        return f"callable {self.index} ({self.name})"

    def forward_replayed(self, generation: int, pending: bool) -> None:
        """Its forward replays (as ``generation``); ``pending``: its backward may follow."""
        self.order.replayed(self, self.forward_at, "forward")
        if pending:
            self.order._pending.append((self, generation))

    def backward_replayed(self) -> None:
        """Its backward (of the latest forward replay) replays."""
        self.order.replayed(self, self.backward_at, "backward")

    def expired_error(self) -> DualgraphError:
        """Why the backward of the replay :attr:`expired` names is refused."""
        assert self.expired_by is not None
        other, what = self.expired_by
        return DualgraphError(
            f"{self.label} of the callables graphed together: a {what} replay of {other.label} "
            "ran after this replay's forward and may have overwritten the activations its "
            "backward reads (callables graphed together share one memory pool, and a graph may "
            "reuse memory that was free when it was captured: on CUDA this backward would give "
            "wrong grads). Run them in the captured order, forwards in the order given and "
            "backwards in reverse, each later callable's backward before an earlier callable "
            "runs again; or graph callables that run in another order with separate "
            "make_graphed_callables calls (each then gets a pool of its own)"
        )


def places_in_capture_order(names: Sequence[str]) -> list[PoolPlace]:
    """Places for callables captured together (forwards in order, then backwards in reverse,
    as :func:`dualgraph.torch._capture.capture` captures them), all in one new order."""
    order = PoolOrder()
    last = 2 * len(names) - 1
    return [PoolPlace(order, i, name, i, last - i) for i, name in enumerate(names)]
