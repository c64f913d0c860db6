"""Graphs that share one memory pool: which replays expire a pending backward or outputs.

:func:`dualgraph.torch.make_graphed_callables` captures the forwards of callables graphed
together in the order given, then their backwards in reverse, all into one pool
(``_capture.py``); callables graphed by later calls with the same ``pool=`` are captured into
it after them. During a capture the caching allocator hands a graph blocks of the pool that no
live tensor holds, and each replay writes them again. So a replay of graph ``g`` may overwrite
any tensor of the pool that was not alive when ``g`` was captured:

- the activations of callable ``k`` live from its forward's capture to its backward's: while a
  backward of ``k`` is pending, a replay of a graph captured before its forward or after its
  backward (together: any graph of an earlier callable) may overwrite what it reads, and on
  CUDA it would compute wrong grads without a word;
- the outputs of callable ``k`` live from its forward's capture on: a graph captured before
  that (together: the forward of an earlier callable) may overwrite them.

:class:`PoolOrder` follows these rules on every backend, so that a CPU run refuses what a GPU
run would get wrong. Each callable holds a :class:`PoolPlace` (where its forward and backward
were captured) and reports each replay. A replay that may have overwritten a pending backward's
activations expires it: that backward then raises, saying why. One that may have overwritten
another callable's outputs counts as an in-place change of them, as a replay of the callable
itself does, so that an eager op that saved one raises at backward. Every order that is safe
passes: the captured one (forwards in order, backwards in reverse, as a model runs its layers),
later callables replayed while an earlier backward is pending, an earlier callable replayed
when no later backward is pending.

The pending backwards nest (each captured inside the one below it), so they form a stack, and a
replay pops the ones it expires: amortized constant work per replay.

One backward may run through an expired replay and a valid one of another callable (``b =
second(x); a = first(y); (a + b).sum().backward()``): the engine may run the valid one first,
which would add its grads before the expired one refuses. So the order keeps, weakly, the
autograd nodes of the replays it expired (:attr:`PoolOrder.expired_nodes`, only while alive),
and each backward of its callables checks those it reaches first (``_replay.py``): refused
before anything is added, as within one callable. A backward pays one list test while none is.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .._errors import DualgraphError
from ._saved_hooks import saved_copies_kept

__all__ = ["PoolOrder", "PoolPlace", "places_in_capture_order", "settle_outputs"]

_increment_version = torch._C._increment_version
_NONE: tuple[torch.Tensor, ...] = ()


class PoolOrder:
    """The callables whose graphs share one pool, in capture order, and the pending backwards.

    ``lock``: shared by the callables' replays, so that no two of them run at once (they would
    write the same memory at once on CUDA).
    """

    __slots__ = (
        "__weakref__",
        "_pending",
        "_places",
        "_prune_at",
        "callables",
        "captured",
        "expired_nodes",
        "lock",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Weakly, the autograd nodes of the replays whose backward it expired; the list object
        # stays the same (callables hold it), pruned of dead ones as it grows.
        self.expired_nodes: list[weakref.ref[Any]] = []
        self._prune_at = 8
        self.captured = 0  # graphs captured into the pool so far (positions taken)
        self.callables = 0
        self._places: list[weakref.ref[PoolPlace]] = []
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
                self._keep_node_of(other, generation)

    def _keep_node_of(self, place: PoolPlace, generation: int) -> None:
        """Keep, weakly, the autograd node of ``place``'s replay ``generation``, if alive."""
        # the callable's latest few replays' nodes (a snapshot: its forward appends outside the
        # pool's lock)
        for ref in reversed(tuple(place.nodes)):
            node = ref()
            if node is not None and node.generation == generation and node.graphed._pool is place:
                nodes = self.expired_nodes
                nodes.append(ref)
                if len(nodes) >= self._prune_at:
                    nodes[:] = [ref for ref in nodes if ref() is not None]
                    self._prune_at = 2 * len(nodes) + 8
                return

    def places(self) -> list[PoolPlace]:
        """The places alive, in capture order."""
        alive = [place for ref in self._places if (place := ref()) is not None]
        self._places = [weakref.ref(place) for place in alive]
        return alive


class PoolPlace:
    """Where one callable's forward and backward were captured in its :class:`PoolOrder`."""

    __slots__ = (
        "__weakref__",
        "backward_at",
        "backward_overwrites",
        "expired",
        "expired_by",
        "forward_at",
        "forward_overwrites",
        "index",
        "name",
        "nodes",
        "order",
        "outputs",
    )

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
        self.outputs: tuple[torch.Tensor, ...] = ()  # those its callers hold (settle_outputs)
        # Weak references to the autograd nodes of its callable's latest replays (its own
        # collection, which the callable sets; see PoolOrder._keep_node_of).
        self.nodes: Sequence[weakref.ref[Any]] = ()
        # the outputs of other callables each replay may overwrite (settle_outputs)
        self.forward_overwrites = _NONE
        self.backward_overwrites = _NONE

    @property
    def label(self) -> str:
        return f"callable {self.index} ({self.name})"

    def forward_replayed(self, generation: int, pending: bool) -> None:
        """Its forward replays (as ``generation``); ``pending``: its backward may follow."""
        self.order.replayed(self, self.forward_at, "forward")
        if pending:
            self.order._pending.append((self, generation))
        if self.forward_overwrites:
            saved_copies_kept(self.forward_overwrites)  # under allow_mutation_on_saved_tensors
            _increment_version(self.forward_overwrites)

    def backward_replayed(self) -> None:
        """Its backward (of the latest forward replay) replays."""
        self.order.replayed(self, self.backward_at, "backward")
        if self.backward_overwrites:
            saved_copies_kept(self.backward_overwrites)  # under allow_mutation_on_saved_tensors
            _increment_version(self.backward_overwrites)

    def expired_error(self) -> DualgraphError:
        """Why the backward of the replay :attr:`expired` names is refused."""
        assert self.expired_by is not None
        other, what = self.expired_by
        return DualgraphError(
            f"{self.label}, among the callables captured into one memory pool: a {what} replay "
            f"of {other.label} ran after this replay's forward and may have overwritten the "
            "activations its backward reads (callables graphed together, or with one pool=, "
            "share one memory pool, and a graph may reuse memory that was free when it was "
            "captured: on CUDA this backward would give wrong grads). Run them in the captured "
            "order (callables graphed by an earlier call first), forwards in the order given and "
            "backwards in reverse, each later callable's backward before an earlier callable "
            "runs again; for several micro-batches in flight graph with slots= or schedule=; "
            "graph callables that run in another order with separate make_graphed_callables "
            "calls and no shared pool= (each then gets a pool of its own)"
        )


#: The order of each pool passed as ``pool=``, while a callable captured into it is alive.
_ORDERS: weakref.WeakValueDictionary[Hashable, PoolOrder] = weakref.WeakValueDictionary()


def places_in_capture_order(names: Sequence[str], pool: Any = None) -> list[PoolPlace]:
    """Places for callables just captured together (forwards in order, then backwards in
    reverse, as :func:`dualgraph.torch._capture.capture` captures them): in a new order, or,
    given the ``pool=`` they were captured into, after the callables captured there before."""
    key = _key_of(pool)
    order = None if key is None else _ORDERS.get(key)
    if order is None:
        order = PoolOrder()
        if key is not None:
            _ORDERS[key] = order
    first, last = order.captured, order.captured + 2 * len(names) - 1
    places = [
        PoolPlace(order, order.callables + i, name, first + i, last - i)
        for i, name in enumerate(names)
    ]
    order.captured = last + 1
    order.callables += len(names)
    order._places += [weakref.ref(place) for place in places]
    return places


def settle_outputs(places: Sequence[PoolPlace], outputs: Sequence[Sequence[torch.Tensor]]) -> None:
    """Give ``places`` the outputs their callables' callers hold (none for cloned outputs), and
    every place of their order the outputs that each of its replays may overwrite: those of the
    callables whose forward was captured after that graph."""
    for place, held in zip(places, outputs, strict=True):
        place.outputs = tuple(held)
    everyone = places[0].order.places()
    for place in everyone:
        for at, attribute in (
            (place.forward_at, "forward_overwrites"),
            (place.backward_at, "backward_overwrites"),
        ):
            later = tuple(t for other in everyone if other.forward_at > at for t in other.outputs)
            setattr(place, attribute, later)


def _key_of(pool: Any) -> Hashable | None:
    """What identifies a ``pool=`` handle (a ``(id, id)`` tuple on CUDA), ``None`` for none."""
    if pool is None:
        return None
    try:
        key = tuple(pool)
        hash(key)
    except TypeError:
        return ("object", id(pool))
    return key
