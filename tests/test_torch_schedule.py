"""``dualgraph.torch.Schedule``: pipeline orders as data, checked, and expanded into passes."""

from __future__ import annotations

import pytest
from pipeline_cases import device_order

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch._schedule import MAX_ORDER, expand


def test_1f1b_first_stage_warms_up_then_alternates_then_cools_down() -> None:
    order = dgt.Schedule.one_f_one_b(stages=4, microbatches=8, stage=0).order
    assert order == (1, 1, 1) + (1, -1) * 5 + (-1, -1, -1)


@pytest.mark.parametrize("stage", range(4))
def test_1f1b_keeps_at_most_stages_minus_stage_in_flight(stage: int) -> None:
    schedule = dgt.Schedule.one_f_one_b(stages=4, microbatches=8, stage=stage)
    assert schedule.in_flight == (4 - stage,)
    assert schedule.microbatches == 8 and schedule.chunks == 1


def test_1f1b_with_fewer_microbatches_than_stages_runs_them_all_forward_first() -> None:
    assert dgt.Schedule.one_f_one_b(stages=4, microbatches=2, stage=0).order == (1, 1, -1, -1)


def test_interleaved_order_of_the_first_of_two_stages() -> None:
    schedule = dgt.Schedule.interleaved(stages=2, microbatches=4, chunks=2, stage=0)
    assert schedule.order == (1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1)
    assert schedule.chunks == 2 and schedule.microbatches == 4
    assert schedule.in_flight == (4, 2)


@pytest.mark.parametrize(
    ("stages", "microbatches", "chunks"), [(4, 8, 1), (4, 8, 2), (2, 4, 3), (4, 4, 2), (3, 6, 2)]
)
def test_the_stages_schedules_run_without_deadlock(
    stages: int, microbatches: int, chunks: int
) -> None:
    if chunks == 1:
        schedules = [
            dgt.Schedule.one_f_one_b(stages=stages, microbatches=microbatches, stage=s)
            for s in range(stages)
        ]
    else:
        schedules = [
            dgt.Schedule.interleaved(
                stages=stages, microbatches=microbatches, chunks=chunks, stage=s
            )
            for s in range(stages)
        ]
    order = device_order(schedules)
    assert len(order) == 2 * stages * chunks * microbatches


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ((), "schedule order is empty"),
        ("1-1", "schedule order must be a sequence of ints"),
        ((1, 0, -1), r"schedule order\[1\]: expected a nonzero int .* got 0"),
        ((1, True, -1), r"schedule order\[1\]: expected a nonzero int .* got True"),
        ((1, 1.0, -1), r"schedule order\[1\]: expected a nonzero int .* got 1.0"),
        ((-1, 1), r"schedule order\[0\]: a backward through chunk 1 with no forward"),
        ((1, -1, 1), "chunk 1 has 2 forwards and 1 backwards"),
        ((1, -1, 3, -3), "chunk 2 never runs"),
        ((1, 2, -1, -2, 1, -1), "chunk 2 has 1 forwards and 1 backwards, chunk 1 2 forwards"),
    ],
)
def test_a_malformed_order_is_refused_naming_where(order: object, message: str) -> None:
    with pytest.raises(DualgraphError, match=message):
        dgt.Schedule(order)  # type: ignore[arg-type]


def test_an_order_too_long_is_refused() -> None:
    with pytest.raises(DualgraphError, match=f"at most {MAX_ORDER}"):
        dgt.Schedule((1,) * MAX_ORDER + (-1,) * MAX_ORDER)
    with pytest.raises(DualgraphError, match=f"at most {MAX_ORDER}"):
        dgt.Schedule.one_f_one_b(stages=2, microbatches=MAX_ORDER, stage=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 0, "microbatches": 2, "stage": 0}, "stages must be an int >= 1, got 0"),
        ({"stages": 2, "microbatches": 0, "stage": 0}, "microbatches must be an int >= 1, got 0"),
        ({"stages": 2, "microbatches": 2, "stage": 2}, "stage must be below stages"),
        ({"stages": 2, "microbatches": 2, "stage": -1}, "stage must be an int >= 0, got -1"),
        ({"stages": 2.0, "microbatches": 2, "stage": 0}, "stages must be an int >= 1, got 2.0"),
    ],
)
def test_1f1b_counts_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(DualgraphError, match=message):
        dgt.Schedule.one_f_one_b(**kwargs)  # type: ignore[arg-type]


def test_interleaved_needs_microbatches_in_groups_of_stages() -> None:
    with pytest.raises(DualgraphError, match=r"microbatches \(6\) must be a multiple of stages"):
        dgt.Schedule.interleaved(stages=4, microbatches=6, chunks=2, stage=0)


def test_callables_split_evenly_over_chunks_unless_told() -> None:
    schedule = dgt.Schedule((1, 2, -2, -1))
    assert schedule.chunk_sizes(4) == (2, 2)
    with pytest.raises(DualgraphError, match=r"3 callable.* do not split evenly into its 2 chunks"):
        schedule.chunk_sizes(3)
    assert dgt.Schedule((1, 2, -2, -1), layers_per_chunk=(1, 2)).chunk_sizes(3) == (1, 2)
    with pytest.raises(DualgraphError, match="adds up to 3 callables, but 4 were given"):
        dgt.Schedule((1, 2, -2, -1), layers_per_chunk=(1, 2)).chunk_sizes(4)


@pytest.mark.parametrize("layers", [(1,), (1, 0), (1, 2.0), "12"])
def test_layers_per_chunk_holds_one_positive_int_per_chunk(layers: object) -> None:
    with pytest.raises(DualgraphError, match="layers_per_chunk must hold one positive int"):
        dgt.Schedule((1, 2, -2, -1), layers_per_chunk=layers)  # type: ignore[arg-type]


def test_expand_runs_a_chunks_callables_forward_then_in_reverse() -> None:
    passes = expand(dgt.Schedule((1, 2, -2, -1)), 4)
    assert [(p.callable, p.backward) for p in passes] == [
        (0, False), (1, False), (2, False), (3, False),
        (3, True), (2, True), (1, True), (0, True),
    ]  # fmt: skip
    assert {p.chunk for p in passes[:2]} == {0} and {p.chunk for p in passes[2:6]} == {1}


def test_expand_shares_buffers_between_microbatches_never_in_flight_together() -> None:
    schedule = dgt.Schedule.one_f_one_b(stages=3, microbatches=6, stage=0)
    forwards = [p for p in expand(schedule, 1) if not p.backward]
    assert [p.buffers for p in forwards] == [0, 1, 2, 0, 1, 2]
    passes = expand(schedule, 1)
    for buffers in range(3):  # no two micro-batches with one set of buffers overlap
        live = 0
        for p in passes:
            if p.buffers == buffers:
                live += -1 if p.backward else 1
                assert live in (0, 1)
