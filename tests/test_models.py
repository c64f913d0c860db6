"""dualgraph.models: the PyTorch ViT and its JAX twin agree, eager and graphed, CPU and GPU."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest
import torch

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.models import jax_vit
from dualgraph.models.torch_vit import VisionEncoder, ViTBlock
from dualgraph.parity import ParityReport, assert_parity

DIM, HEADS, TOKENS, BATCH = 64, 4, 16, 2
jax_block = functools.partial(jax_vit.vit_block, heads=HEADS)
jax_encoder = functools.partial(jax_vit.vision_encoder, heads=HEADS)


def make_block(device: str = "cpu", dtype: torch.dtype = torch.float32) -> ViTBlock:
    torch.manual_seed(0)
    return ViTBlock(DIM, HEADS).to(device, dtype)


def make_encoder(device: str = "cpu", dtype: torch.dtype = torch.float32) -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(dim=DIM, depth=2, heads=HEADS).to(device, dtype)


def hidden_states(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, TOKENS, DIM, generator=generator).to(device, dtype)


def images(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 3, 32, 32, generator=generator).to(device, dtype)


def check_parity(
    torch_fn: Any, jax_fn: Any, module: torch.nn.Module, x: torch.Tensor
) -> ParityReport:
    params = jax_vit.params_from_state_dict(module.state_dict())
    return assert_parity(
        torch_fn, jax_fn, (x,), params=params, params_from_torch=jax_vit.params_from_state_dict
    )


def graph_blocks(encoder: VisionEncoder, backend: str, capture_error_mode: str = "global") -> None:
    """Replace each block of ``encoder`` by its graphed self (one shared capture, in order)."""
    device, dtype = encoder.pos_embed.device, encoder.pos_embed.dtype
    samples = tuple(
        (hidden_states(device, dtype).requires_grad_(),) for _ in range(len(encoder.blocks))
    )
    graphed = dgt.make_graphed_callables(
        tuple(encoder.blocks), samples, backend=backend, capture_error_mode=capture_error_mode
    )
    for i, block in enumerate(graphed):
        encoder.blocks[i] = block


# -- the models ----------------------------------------------------------------------------------


def test_a_block_returns_hidden_and_none() -> None:
    hidden, extra = make_block()(hidden_states())
    assert hidden.shape == (BATCH, TOKENS, DIM) and extra is None


def test_the_encoder_returns_hidden_pooled_and_no_aux_loss() -> None:
    out = make_encoder()(images())
    assert list(out) == ["hidden", "pooled", "aux_loss"]
    assert out["pooled"].shape == (BATCH, DIM) and out["aux_loss"] is None
    torch.testing.assert_close(out["pooled"], out["hidden"].mean(dim=1))


def test_every_torch_parameter_has_a_jax_path_holding_its_values() -> None:
    # random values everywhere: an initialization's ones and zeros (layer norms, biases) would
    # let a leaf read from the wrong tensor, or not read at all, pass
    generator = torch.Generator().manual_seed(2)
    state = {
        name: torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for name, t in make_encoder().state_dict().items()
    }
    params = jax_vit.params_from_state_dict(state)
    for name, tensor in state.items():
        leaf = params
        for key in jax_vit.param_path(name):
            leaf = leaf[key]
        # Linear weights are transposed (JAX multiplies x @ w); every other tensor is as it is
        expected = tensor.numpy().T if tensor.ndim == 2 else tensor.numpy()
        np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=name, strict=True)


def test_the_jax_model_imports_no_torch() -> None:
    # its loader reads torch tensors' lazy bits through the core's helper, which calls their
    # methods without importing torch: a JAX-only program never pays for (or needs) torch
    code = (
        "import sys, dualgraph.models.jax_vit; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith('dualgraph.torch')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert found.stdout.strip() == "[]"


def test_params_go_to_the_default_jax_device() -> None:
    # They went to jax.devices()[0], where a reference compiled under jax.default_device(d)
    # for d refused them.
    code = (
        "import os\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
        "import jax, numpy as np\n"
        "from dualgraph.models import jax_vit\n"
        "state = {'pos_embed': np.ones((1, 2, 3), np.float32)}\n"
        "with jax.default_device(jax.devices()[1]):\n"
        "    params = jax_vit.params_from_state_dict(state)\n"
        "print(params['pos'].devices() == {jax.devices()[1]})\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "True"


def test_a_lazily_conjugated_tensor_is_read_as_its_values() -> None:
    lazy = torch.tensor([[1 + 2j, 3 - 4j]], dtype=torch.complex64).conj()
    params = jax_vit.params_from_state_dict({"pos_embed": lazy})
    np.testing.assert_array_equal(np.asarray(params["pos"]), lazy.resolve_conj().numpy())


def test_a_lazily_negated_tensor_is_read_with_its_sign() -> None:
    # DLPack carries memory, not torch's negative bit: the values came with the other sign
    lazy = torch._neg_view(torch.arange(1.0, 7.0).reshape(1, 2, 3))
    params = jax_vit.params_from_state_dict({"pos_embed": lazy})
    np.testing.assert_array_equal(np.asarray(params["pos"]), lazy.resolve_neg().numpy())


def test_an_unknown_parameter_name_is_refused() -> None:
    with pytest.raises(DualgraphError, match=r"'blocks\.0\.gate\.weight'"):
        jax_vit.params_from_state_dict({"blocks.0.gate.weight": torch.zeros(2, 2)})


def test_a_float64_state_dict_without_64_bit_jax_is_refused() -> None:
    with pytest.raises(DualgraphError, match="64-bit mode is off"):
        jax_vit.params_from_state_dict(make_block(dtype=torch.float64).state_dict())


def test_an_int64_state_dict_entry_without_64_bit_jax_is_refused() -> None:
    state = {"pos_embed": torch.tensor([2**40], dtype=torch.int64)}
    with pytest.raises(DualgraphError, match=r"'pos_embed'\] is int64.* compute it as int32"):
        jax_vit.params_from_state_dict(state)


# -- parity on the CPU ---------------------------------------------------------------------------


def test_block_matches_jax_in_float32() -> None:
    block = make_block()
    report = check_parity(block, jax_block, block, hidden_states())
    assert report.entries[0].path == "output[0]" and len(report.entries) == 2 + 12


def test_encoder_matches_jax_in_float32() -> None:
    encoder = make_encoder()
    report = check_parity(encoder, jax_encoder, encoder, images())
    assert [e.path for e in report.entries[:3]] == [
        "output['hidden']",
        "output['pooled']",
        "grad args[0]",
    ]


def test_graphed_block_matches_jax_in_float32() -> None:
    block = make_block()
    graphed = dgt.make_graphed_callables(
        block, (hidden_states().requires_grad_(),), backend="emulate"
    )
    check_parity(graphed, jax_block, block, hidden_states())


def test_graphed_block_with_in_graph_param_grads_matches_jax_in_float32() -> None:
    block = make_block()
    sample = (hidden_states().requires_grad_(),)
    graphed = dgt.make_graphed_callables(block, sample, backend="emulate", param_grads="in_graph")
    report = check_parity(graphed, jax_block, block, hidden_states())
    assert "grad params['fc2']['w']" in [entry.path for entry in report.entries]


def test_encoder_with_graphed_blocks_matches_jax_in_float32() -> None:
    encoder = make_encoder()
    graph_blocks(encoder, "emulate")
    check_parity(encoder, jax_encoder, encoder, images())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_block_matches_jax_in_low_precision_on_the_cpu(dtype: torch.dtype) -> None:
    # Two independent low-precision computations (torch's CPU kernels, XLA's): they differ by
    # rounding, and the default tolerances of the dtype hold them.
    block = make_block(dtype=dtype)
    report = check_parity(block, jax_block, block, hidden_states(dtype=dtype))
    assert report.worst.max_abs > 0 and report.worst.usage < 0.5


# -- parity on the GPU (JAX on the GPU too) ------------------------------------------------------

# JAX works from threads of its own beside torch here; captures are thread-local so that no other
# thread's CUDA call can invalidate them (one bf16 capture here failed once under "global" with
# CUBLAS_STATUS_EXECUTION_FAILED; the cause was not found, and a JAX worker thread did not
# reproduce it).
GPU_DTYPES = [torch.float32, torch.bfloat16]
# torch's one-time note when its autograd thread first meets cuBLAS (that thread has no CUDA
# context yet); harmless, and not ours to fix.
cublas_note = pytest.mark.filterwarnings(
    "ignore:Attempting to run cuBLAS, but there was no current"
)


@pytest.mark.cuda
@cublas_note
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cuda_graphed_block_matches_jax_on_the_gpu(dtype: torch.dtype) -> None:
    assert jax.devices()[0].platform == "gpu"
    block = make_block("cuda", dtype)
    sample = hidden_states("cuda", dtype).requires_grad_()
    graphed = dgt.make_graphed_callables(
        block, (sample,), backend="cuda", capture_error_mode="thread_local"
    )
    report = check_parity(graphed, jax_block, block, hidden_states("cuda", dtype))
    assert {entry.dtype for entry in report.entries} == {str(dtype).removeprefix("torch.")}


@pytest.mark.cuda
@cublas_note
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_encoder_with_cuda_graphed_blocks_matches_jax_on_the_gpu(dtype: torch.dtype) -> None:
    assert jax.devices()[0].platform == "gpu"
    encoder = make_encoder("cuda", dtype)
    graph_blocks(encoder, "cuda", capture_error_mode="thread_local")
    check_parity(encoder, jax_encoder, encoder, images("cuda", dtype))
