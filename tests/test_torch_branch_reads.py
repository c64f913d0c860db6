"""Warmup's watch of the reads of grad mode and of inputs' requires_grad (Python's branches)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_transformer_layer_reads_grad_mode_in_eval_only(training: bool) -> None:
    # its fast path (eval, grad off) is another kernel; in training it never looks
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).train(training)
    x = torch.randn(2, 3, 8, requires_grad=True)
    with branch_reads([x]) as seen:
        layer(x)
    assert seen.grad_mode is not training


def test_setting_requires_grad_while_watched_sets_it() -> None:
    x = torch.ones(2)
    with branch_reads([x]):
        x.requires_grad = True
    assert x.requires_grad and "requires_grad" not in vars(torch.Tensor)
