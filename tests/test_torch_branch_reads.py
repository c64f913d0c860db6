"""Warmup's watch of the reads of grad mode and of inputs' requires_grad (Python's branches)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dualgraph.torch as dgt
from dualgraph.torch import _branch_reads
from dualgraph.torch._branch_reads import branch_reads


def test_a_no_grad_block_inside_the_callable_is_no_read_of_grad_mode() -> None:
    # no_grad().__enter__ reads grad mode to put it back: it branches on nothing
    x = torch.ones(2, requires_grad=True)
    with branch_reads([x]) as seen, torch.no_grad():
        _ = x * 2
    assert not seen.grad_mode and seen.requires_grad == ()


#: Each name a callable may read grad mode by, looked up when called.
_MODE_READS = {
    "torch.is_grad_enabled": lambda: torch.is_grad_enabled(),
    "torch._C.is_grad_enabled": lambda: torch._C.is_grad_enabled(),
    "torch.is_inference_mode_enabled": lambda: torch.is_inference_mode_enabled(),
}


@pytest.mark.parametrize("read", sorted(_MODE_READS))
def test_each_name_of_grad_mode_is_seen(read: str) -> None:
    with branch_reads(()) as seen:
        _MODE_READS[read]()
    assert seen.grad_mode


@pytest.mark.parametrize("flag", ["requires_grad", "grad_fn", "is_leaf"])
def test_reading_a_computed_tensors_flag_reads_grad_mode_and_every_inputs_flag(flag: str) -> None:
    x, y = torch.ones(2, requires_grad=True), torch.ones(2)
    with branch_reads([x, y]) as seen:
        getattr(x * y, flag)
    assert seen.grad_mode and seen.requires_grad == (0, 1)


def test_reading_an_inputs_flag_names_that_input_only() -> None:
    x, y = torch.ones(2), torch.ones(2)
    with branch_reads([x, y]) as seen:
        _ = y.requires_grad
    assert not seen.grad_mode and seen.requires_grad == (1,)


@pytest.mark.parametrize(
    ("flag", "history"), [("requires_grad", ()), ("grad_fn", (0,)), ("is_leaf", (0,))]
)
def test_reading_an_inputs_grad_fn_or_is_leaf_reads_whether_it_is_a_leaf(
    flag: str, history: tuple[int, ...]
) -> None:
    x = torch.ones(2, requires_grad=True)
    with branch_reads([x]) as seen:
        getattr(x, flag)
    assert seen.requires_grad == (0,) and seen.history == history


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_transformer_layer_reads_grad_mode_in_eval_only(training: bool) -> None:
    # its fast path (eval, grad off) is another kernel; in training it never looks
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).train(training)
    x = torch.randn(2, 3, 8, requires_grad=True)
    with branch_reads([x]) as seen:
        layer(x)
    assert seen.grad_mode is not training


@pytest.mark.parametrize("how", ["requires_grad_", "attribute"])
def test_turning_an_inputs_requires_grad_on_counts_as_reading_it(how: str) -> None:
    # eager's call turns the caller's tensor's on: a call whose tensor differs from the
    # sample's branches otherwise (its outputs depend on it)
    x, y, z = torch.ones(2), torch.ones(2), torch.ones(2)
    with branch_reads([x, y]) as seen:
        if how == "requires_grad_":
            y.requires_grad_()
            x.requires_grad_(False)  # no read: refused at capture where x required grad
        else:
            y.requires_grad = True
        z.requires_grad_()  # no input
    assert seen.requires_grad == seen.turned_on == (1,) and not seen.grad_mode
    assert y.requires_grad and "requires_grad_" not in vars(torch.Tensor)


def test_setting_requires_grad_while_watched_sets_it() -> None:
    x = torch.ones(2)
    with branch_reads([x]):
        x.requires_grad = True
    assert x.requires_grad and "requires_grad" not in vars(torch.Tensor)


def test_the_warmup_calls_of_a_callable_install_the_flag_watches_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each warmup forward replaced torch.Tensor's requires_grad, grad_fn and is_leaf and put them
    # back: a change to torch.Tensor, which drops the interpreter's caches of lookups on every
    # tensor class (about 0.1 ms of the next forward of a ViT block). They stay meanwhile.
    installed: list[str] = []
    watched_flag = _branch_reads._WatchedFlag

    def noting(found: Any, watchers: Any) -> Any:
        installed.append(found.__name__)
        return watched_flag(found, watchers)

    for watch in _branch_reads._WATCHED_FLAGS:
        monkeypatch.setattr(watch, "_wrap", noting)
    layer = nn.Linear(4, 4)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4),), num_warmup_iters=3)
    assert sorted(installed) == ["grad_fn", "is_leaf", "requires_grad"]
    assert "requires_grad" not in vars(torch.Tensor)
