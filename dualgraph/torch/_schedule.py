"""Pipeline schedules: the order of one training step's forwards and backwards on one stage.

A :class:`Schedule` is data: a sequence of signed chunk numbers, as Transformer Engine's
``_order`` writes it. ``+c`` is the forward of the next micro-batch through model chunk ``c``
(numbered from 1), ``-c`` the backward of the oldest micro-batch whose forward went through
chunk ``c`` and whose backward has not. :meth:`Schedule.one_f_one_b` and
:meth:`Schedule.interleaved` build the orders of the 1F1B and interleaved 1F1B schedules (as
Megatron-LM runs them) for one stage.

>>> schedule = Schedule.one_f_one_b(stages=4, microbatches=8, stage=0)
>>> schedule.order
(1, 1, 1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, -1, -1, -1)
>>> schedule.microbatches, schedule.chunks, schedule.in_flight
(8, 1, (4,))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import DualgraphError

__all__ = ["Schedule", "ScheduledPass", "expand"]

#: The longest order a schedule may have (a bound on capture work, not a pipeline limit).
MAX_ORDER = 1 << 16


@dataclass(frozen=True)
class Schedule:
    """The order of one step's passes on one pipeline stage; repeats every step.

    ``order`` holds ``+c`` (forward through chunk ``c``, numbered from 1) and ``-c``
    (backward through chunk ``c``); every chunk from 1 to the largest appears, each with the
    same number of forwards (the micro-batches of a step) and as many backwards, and no
    backward comes before its forward. ``layers_per_chunk`` says how many of the callables
    graphed together belong to each chunk (in the order given): by default they are split evenly.

    >>> Schedule((1, 2, -2, -1)).in_flight
    (1, 1)
    >>> Schedule((1, -1, -1, 1))
    Traceback (most recent call last):
    ...
    dualgraph.DualgraphError: schedule order[2]: a backward through chunk 1 with no forward ...
    """

    order: tuple[int, ...]
    layers_per_chunk: tuple[int, ...] | None = None
    chunks: int = field(init=False, repr=False, compare=False)
    microbatches: int = field(init=False, repr=False, compare=False)
    #: For each chunk, the most micro-batches in flight at once (forward run, backward not).
    in_flight: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        order = _checked_order(self.order)
        object.__setattr__(self, "order", order)
        chunks = max(abs(c) for c in order)
        forwards = [0] * chunks
        backwards = [0] * chunks
        in_flight = [0] * chunks
        for position, c in enumerate(order):
            chunk = abs(c) - 1
            if c > 0:
                forwards[chunk] += 1
                in_flight[chunk] = max(in_flight[chunk], forwards[chunk] - backwards[chunk])
            else:
                backwards[chunk] += 1
                if backwards[chunk] > forwards[chunk]:
                    raise DualgraphError(
                        f"schedule order[{position}]: a backward through chunk {-c} with no "
                        "forward through it in flight"
                    )
        for chunk in range(chunks):
            if forwards[chunk] == 0:
                raise DualgraphError(
                    f"schedule: chunk {chunk + 1} never runs (chunks are numbered 1 to {chunks}, "
                    "and each runs every micro-batch)"
                )
            if forwards[chunk] != forwards[0] or backwards[chunk] != forwards[chunk]:
                raise DualgraphError(
                    f"schedule: chunk {chunk + 1} has {forwards[chunk]} forwards and "
                    f"{backwards[chunk]} backwards, chunk 1 {forwards[0]} forwards; every chunk "
                    "runs the forward and the backward of every micro-batch of the step once"
                )
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "microbatches", forwards[0])
        object.__setattr__(self, "in_flight", tuple(in_flight))
        if self.layers_per_chunk is not None:
            layers = self.layers_per_chunk
            if (
                not isinstance(layers, tuple | list)
                or len(layers) != chunks
                or any(type(n) is not int or n < 1 for n in layers)
            ):
                raise DualgraphError(
                    f"schedule: layers_per_chunk must hold one positive int per chunk ({chunks}), "
                    f"got {layers!r}"
                )
            object.__setattr__(self, "layers_per_chunk", tuple(layers))

    @classmethod
    def one_f_one_b(cls, *, stages: int, microbatches: int, stage: int) -> Schedule:
        """1F1B on ``stage`` (from 0) of ``stages``: warm-up forwards, then alternating, then
        the remaining backwards.

        Stage ``s`` runs ``stages - s - 1`` forwards before its steady phase, in which each
        forward is followed by the oldest backward; at most ``stages - s`` micro-batches are in
        flight.

        >>> Schedule.one_f_one_b(stages=2, microbatches=3, stage=0).order
        (1, 1, -1, 1, -1, -1)
        """
        _check_counts(stages=stages, microbatches=microbatches, stage=stage)
        warmup = min(stages - stage - 1, microbatches)
        steady = microbatches - warmup
        order = [1] * warmup + [1, -1] * steady + [-1] * warmup
        return cls(tuple(order))

    @classmethod
    def interleaved(cls, *, stages: int, microbatches: int, chunks: int, stage: int) -> Schedule:
        """Interleaved 1F1B on ``stage`` of ``stages``, each stage holding ``chunks`` chunks.

        The model is cut into ``stages * chunks`` pieces; stage ``s`` holds pieces ``s``,
        ``s + stages``, ... (its chunks 1, 2, ...). Micro-batches go through the chunks in groups
        of ``stages`` (so ``microbatches`` is a multiple of ``stages``); stage ``s`` warms up with
        ``2 * (stages - s - 1) + (chunks - 1) * stages`` forwards, as Megatron-LM's schedule does.

        >>> Schedule.interleaved(stages=2, microbatches=2, chunks=2, stage=1).order
        (1, 1, 2, -2, 2, -2, -1, -1)
        """
        _check_counts(stages=stages, microbatches=microbatches, stage=stage, chunks=chunks)
        if microbatches % stages:
            raise DualgraphError(
                f"interleaved schedule: microbatches ({microbatches}) must be a multiple of "
                f"stages ({stages})"
            )
        total = microbatches * chunks
        warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
        group = stages * chunks

        def forward_chunk(k: int) -> int:
            return (k % group) // stages + 1

        def backward_chunk(k: int) -> int:
            return chunks - (k % group) // stages

        order = [forward_chunk(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward_chunk(warmup + k), -backward_chunk(k)]
        order += [-backward_chunk(k) for k in range(total - warmup, total)]
        return cls(tuple(order))

    def chunk_sizes(self, callables: int) -> tuple[int, ...]:
        """How many of ``callables`` (graphed together, in order) each chunk holds."""
        if self.layers_per_chunk is not None:
            if sum(self.layers_per_chunk) != callables:
                raise DualgraphError(
                    f"schedule: layers_per_chunk {self.layers_per_chunk} adds up to "
                    f"{sum(self.layers_per_chunk)} callables, but {callables} were given"
                )
            return self.layers_per_chunk
        if callables % self.chunks:
            raise DualgraphError(
                f"schedule: {callables} callable(s) do not split evenly into its {self.chunks} "
                "chunks; pass Schedule(order, layers_per_chunk=(...)) to say how many each holds"
            )
        return (callables // self.chunks,) * self.chunks


@dataclass(frozen=True)
class ScheduledPass:
    """One replay of one step: the forward or backward of ``callable`` for ``microbatch``.

    ``buffers`` is the set of static input buffers that micro-batch uses: micro-batches of a
    chunk that are never in flight together share one (there are ``in_flight`` sets).
    """

    callable: int
    chunk: int
    microbatch: int
    backward: bool
    buffers: int


def expand(schedule: Schedule, callables: int) -> tuple[ScheduledPass, ...]:
    """Every replay of one step, in order: each chunk's callables forward, then in reverse.

    >>> [(p.callable, p.microbatch, p.backward) for p in expand(Schedule((1, 1, -1, -1)), 2)]
    ... # doctest: +NORMALIZE_WHITESPACE
    [(0, 0, False), (1, 0, False), (0, 1, False), (1, 1, False),
     (1, 0, True), (0, 0, True), (1, 1, True), (0, 1, True)]
    """
    sizes = schedule.chunk_sizes(callables)
    first = [sum(sizes[:chunk]) for chunk in range(len(sizes))]
    started = [0] * schedule.chunks
    finished = [0] * schedule.chunks
    free: list[list[int]] = [[] for _ in range(schedule.chunks)]
    colours: list[dict[int, int]] = [{} for _ in range(schedule.chunks)]
    used = [0] * schedule.chunks
    passes: list[ScheduledPass] = []
    for c in schedule.order:
        chunk = abs(c) - 1
        members = range(first[chunk], first[chunk] + sizes[chunk])
        if c > 0:
            microbatch = started[chunk]
            started[chunk] += 1
            if free[chunk]:
                colour = min(free[chunk])
                free[chunk].remove(colour)
            else:
                colour = used[chunk]
                used[chunk] += 1
            colours[chunk][microbatch] = colour
            passes += [ScheduledPass(i, chunk, microbatch, False, colour) for i in members]
        else:
            microbatch = finished[chunk]
            finished[chunk] += 1
            colour = colours[chunk][microbatch]
            free[chunk].append(colour)
            passes += [ScheduledPass(i, chunk, microbatch, True, colour) for i in reversed(members)]
    return tuple(passes)


def _checked_order(order: object) -> tuple[int, ...]:
    if isinstance(order, str | bytes) or not isinstance(order, Sequence):
        raise DualgraphError(
            f"schedule order must be a sequence of ints (+c forward, -c backward of chunk c), "
            f"got {type(order).__name__}"
        )
    if not order:
        raise DualgraphError("schedule order is empty")
    if len(order) > MAX_ORDER:
        raise DualgraphError(f"schedule order has {len(order)} passes; at most {MAX_ORDER}")
    for position, c in enumerate(order):
        if type(c) is not int or c == 0:
            raise DualgraphError(
                f"schedule order[{position}]: expected a nonzero int (+c forward, -c backward "
                f"of chunk c, from 1), got {c!r}"
            )
    return tuple(order)


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        lowest = 0 if name == "stage" else 1
        if type(value) is not int or value < lowest:
            raise DualgraphError(f"{name} must be an int >= {lowest}, got {value!r}")
    passes = 2 * counts["microbatches"] * counts.get("chunks", 1)
    if passes > MAX_ORDER:
        raise DualgraphError(f"a schedule of {passes} passes; at most {MAX_ORDER}")
    if counts["stage"] >= counts["stages"]:
        raise DualgraphError(
            f"stage must be below stages ({counts['stages']}), got {counts['stage']}"
        )
