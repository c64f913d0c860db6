"""``kept_process_state``: the RNG streams, grad mode, autocast and numerics settings a run of the
user's callable may leave changed, put back (always, or only where the block fails)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dualgraph.torch._process_state import kept_process_state


@pytest.fixture(autouse=True)
def _process_state_kept() -> Iterator[None]:
    # the tests change the process's state on purpose: never leave it to the next test
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.set_autocast_enabled("cpu", False)


def _process_state() -> tuple[Any, ...]:
    return (
        torch.get_rng_state(),
        random.getstate(),
        repr(np.random.get_state()),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
    )


def _change_everything() -> None:
    torch.rand(3)
    random.random()
    np.random.rand()
    torch.set_grad_enabled(False)
    torch.set_autocast_enabled("cpu", True)
    torch.set_autocast_dtype("cpu", torch.float16)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_the_process_state_is_put_back_after_the_block() -> None:
    before = _process_state()
    with kept_process_state():
        _change_everything()
    assert _same(_process_state(), before)


@pytest.mark.parametrize("on_failure_only", [False, True])
def test_the_process_state_is_put_back_when_the_block_fails(on_failure_only: bool) -> None:
    before = _process_state()
    with pytest.raises(KeyboardInterrupt), kept_process_state(on_failure_only=on_failure_only):
        _change_everything()
        raise KeyboardInterrupt
    assert _same(_process_state(), before)


def test_on_failure_only_a_block_that_succeeds_keeps_what_it_changed() -> None:
    # a graphing that succeeds leaves the RNG where its warmups took it, as eager calls would
    before = torch.get_rng_state()
    with kept_process_state(on_failure_only=True):
        torch.rand(3)
        torch.set_grad_enabled(False)
    assert not torch.equal(torch.get_rng_state(), before)
    assert not torch.is_grad_enabled()


def test_torch_rng_can_be_put_back_midway_alone() -> None:
    # verify starts both of its sides from the same torch draws, not from the same modes
    with kept_process_state() as kept:
        first = torch.rand(3)
        python_draw = random.random()
        torch.set_grad_enabled(False)
        kept.put_back_torch_rng()
        assert torch.equal(torch.rand(3), first)
        assert random.random() != python_draw
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
