"""Transformer Engine modules graph through dualgraph (bf16, and FP8 with current scaling).

Needs a CUDA GPU and the ``[te]`` extra; skipped otherwise. The layer returns ``(hidden, None)``
as Megatron's vision layers do, the case TE's own wrapper once needed a patch for.

Tolerances: the graph replays the same TE kernels as eager, so outputs and grads are compared
with bf16 tolerances (rtol 1.6e-2, atol 1e-2) in bf16, and FP8 tolerances (rtol 5e-2, atol 5e-2)
under FP8.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import dualgraph.torch as dgt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None,
        reason="needs transformer-engine (the [te] extra)",
    ),
]

SEQ, BATCH, HIDDEN, FFN, HEADS = 32, 2, 256, 1024, 4
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}
FP8 = {"rtol": 5e-2, "atol": 5e-2}


class VisionLayer(torch.nn.Module):
    """A TE transformer layer with Megatron's vision-layer output: ``(hidden, None)``."""

    def __init__(self) -> None:
        super().__init__()
        import transformer_engine.pytorch as te

        self.layer = te.TransformerLayer(
            HIDDEN,
            FFN,
            HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.bfloat16,
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.layer(hidden), None


def _hidden(requires_grad: bool = True) -> torch.Tensor:
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x.requires_grad_(requires_grad)


def _quantization(recipe: object | None):  # type: ignore[no-untyped-def]
    import contextlib

    import transformer_engine.pytorch as te

    if recipe is None:
        return contextlib.nullcontext()
    return te.autocast(enabled=True, recipe=recipe)


def _train_and_compare(recipe: object | None, tolerance: dict[str, float]) -> None:
    torch.manual_seed(0)
    layer = VisionLayer().cuda()
    eager = copy.deepcopy(layer)
    with _quantization(recipe):
        graphed = dgt.make_graphed_callables(layer, (_hidden(),), backend="cuda")
    for _ in range(3):  # grads accumulate over three replays, as over micro-batches
        x = _hidden()
        x_eager = x.detach().clone().requires_grad_()
        with _quantization(recipe):
            hidden, extra = graphed(x)
            hidden_eager, _ = eager(x_eager)
        assert extra is None
        torch.testing.assert_close(hidden, hidden_eager, **tolerance)
        hidden.float().square().mean().backward()
        hidden_eager.float().square().mean().backward()
        torch.testing.assert_close(x.grad, x_eager.grad, **tolerance)
    torch.cuda.synchronize()
    for (name, param), param_eager in zip(layer.named_parameters(), eager.parameters()):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, param_eager.grad, **tolerance, msg=name)


def test_te_transformer_layer_in_bf16_matches_eager_over_replays() -> None:
    _train_and_compare(None, BF16)


def test_te_transformer_layer_in_fp8_current_scaling_matches_eager_over_replays() -> None:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        pytest.skip(f"FP8 not available: {reason}")
    _train_and_compare(recipe.Float8CurrentScaling(), FP8)
