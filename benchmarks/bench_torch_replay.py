"""Training-step time of a ViT-S-like block stack: eager vs per-block graphs vs one whole graph.

Run on a CUDA machine: ``python benchmarks/bench_torch_replay.py [--blocks 12 --batch 2]``.
Each step is forward + backward of ``--blocks`` ViT blocks (bf16, 197 tokens, dim 384, 6 heads).

Variants, timed in interleaved rounds (median of rounds, each round ``--steps`` steps between
CUDA events):

- ``eager``: the plain module.
- ``torch``: ``torch.cuda.make_graphed_callables`` per block. It crashes on the blocks'
  ``(hidden, None)`` output, so this variant graphs a wrapper that returns ``hidden`` alone
  (what users must write today).
- ``te``: Transformer Engine's ``make_graphed_callables`` per block, ``(hidden, None)`` as is
  (only where ``transformer_engine`` imports; skipped with the reason otherwise).
- ``dualgraph``: ``dualgraph.torch.make_graphed_callables`` per block, ``(hidden, None)`` as is.
- ``dg-in-graph``: the same with ``param_grads="in_graph"`` (parameter grads accumulated inside
  the backward graph instead of through autograd).
- ``whole-graph``: one raw CUDA graph of the entire step (forward, backward, grad accumulation);
  the floor that per-block graphing can approach.

Also measured: ``replay host us``, the host time of one per-block call (forward + backward,
divided by blocks) with the GPU work made tiny (batch 1, dim 64, 4 tokens).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock


class HiddenOnly(torch.nn.Module):
    """What torch.cuda.make_graphed_callables needs: a block returning a tensor, not (h, None)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


def make_blocks(n: int, dim: int, heads: int, dtype: torch.dtype, seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(ViTBlock(dim, heads) for _ in range(n)).cuda().to(dtype)


def run_stack(blocks: Any, x: torch.Tensor, *, tuple_out: bool) -> torch.Tensor:
    for block in blocks:
        x = block(x)[0] if tuple_out else block(x)
    return x


def sample_args(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    """One ``(x,)`` sample per block, as the graphing wrappers take them."""
    return tuple(
        (torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True),) for _ in range(count)
    )


def training_step(blocks: Any, inputs: torch.Tensor, *, tuple_out: bool) -> Callable[[], None]:
    """One forward + backward of the stack on a fresh leaf view of ``inputs``."""

    def step() -> None:
        x = inputs.detach().requires_grad_()
        run_stack(blocks, x, tuple_out=tuple_out).float().sum().backward()

    return step


@functools.cache
def transformer_engine() -> Any:
    """``transformer_engine.pytorch``, or None (the reason printed once) where it does not load."""
    try:
        import transformer_engine.pytorch as te
    except Exception as error:  # ImportError, or TE failing to load its CUDA libraries
        print(f"te variant skipped: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return te


def build_variants(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    dtype = torch.bfloat16
    shape = (args.batch, args.tokens, args.dim)
    inputs = torch.randn(*shape, device="cuda", dtype=dtype)

    def blocks() -> torch.nn.ModuleList:  # every variant gets its own copy of the same weights
        return make_blocks(args.blocks, args.dim, args.heads, dtype, 0)

    def samples() -> tuple[Any, ...]:
        return sample_args(args.blocks, shape, dtype)

    variants: dict[str, Callable[[], None]] = {}
    variants["eager"] = training_step(blocks(), inputs, tuple_out=True)

    wrapped = tuple(HiddenOnly(b) for b in blocks())
    torch_graphed = torch.cuda.make_graphed_callables(wrapped, samples())
    variants["torch"] = training_step(torch_graphed, inputs, tuple_out=False)

    te = transformer_engine()
    if te is not None:
        te_graphed = te.make_graphed_callables(tuple(blocks()), samples())
        variants["te"] = training_step(te_graphed, inputs, tuple_out=True)

    dg_graphed = dgt.make_graphed_callables(tuple(blocks()), samples(), backend="cuda")
    variants["dualgraph"] = training_step(dg_graphed, inputs, tuple_out=True)

    fast_graphed = dgt.make_graphed_callables(
        tuple(blocks()), samples(), backend="cuda", param_grads="in_graph"
    )
    variants["dg-in-graph"] = training_step(fast_graphed, inputs, tuple_out=True)

    whole_blocks = blocks()
    static_x = inputs.detach().clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run_stack(whole_blocks, static_x, tuple_out=True).float().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_stack(whole_blocks, static_x, tuple_out=True).float().sum().backward()
    variants["whole-graph"] = graph.replay
    return variants


def time_variants(
    variants: dict[str, Callable[[], None]], rounds: int, steps: int
) -> dict[str, float]:
    for fn in variants.values():  # warm every variant before timing any
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / steps)
    return {name: statistics.median(values) for name, values in samples.items()}


def host_overhead_us(rounds: int, calls: int) -> dict[str, float]:
    """Host time per block call (fwd+bwd) when the GPU work is tiny: the replay path's own cost."""
    args = argparse.Namespace(batch=1, tokens=4, dim=64, heads=4, blocks=8)
    variants = build_variants(args)
    del variants["whole-graph"]
    result: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            result[name].append((time.perf_counter() - start) / calls / args.blocks * 1e6)
    return {name: statistics.median(values) for name, values in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_torch_replay needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.cuda.get_device_name()
    results: dict[str, Any] = {"device": device, "config": vars(args)}
    for batch in sorted({args.batch, 32}):
        args.batch = batch
        variants = build_variants(args)
        times = time_variants(variants, args.rounds, args.steps)
        floor = times["whole-graph"]
        results[f"batch{batch}"] = times
        print(
            f"\n{device}: {args.blocks} ViT blocks, batch {batch}, {args.tokens} tokens, "
            f"dim {args.dim}, bf16, fwd+bwd; median of {args.rounds} interleaved rounds"
        )
        print(f"{'variant':<12} {'ms/step':>9} {'x floor':>8} {'x torch':>8}")
        for name, ms in times.items():
            print(f"{name:<12} {ms:9.3f} {ms / floor:8.2f} {ms / times['torch']:8.2f}")
        del variants
        torch.cuda.empty_cache()
    overhead = host_overhead_us(args.rounds, 50)
    results["host_us_per_block_call"] = overhead
    print("\nhost time per block call (fwd+bwd), tiny GPU work, median:")
    for name, us in overhead.items():
        print(f"{name:<12} {us:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
