"""What the capture lint and the memory probe add to ``make_graphed_callables``' capture time.

Graphs a stack of ``dualgraph.models.torch_vit.ViTBlock`` s (one callable per block, as the demo
does) three ways, interleaved over several rounds, each time with fresh blocks:

- ``lint="error"``: the default, the lint and the memory probe observe the first warmup call;
- ``lint="off"``: the memory probe alone (the plan in ``diagnostics()``);
- ``no probe``: neither (the adapter's capture alone), for the baseline.

Times are the process's CPU time on a CPU (other processes on a shared machine then matter
less) and wall time on a GPU, where the capture synchronises the device.

    python benchmarks/bench_capture_lint.py                  # 12 ViT-S blocks, batch 2, CPU
    python benchmarks/bench_capture_lint.py --device cuda    # the same on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from unittest import mock

import torch

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock
from dualgraph.torch._probe import WarmupProbe

MODES = ("no probe", "off", "error")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Capture time of ViT blocks with and without the capture lint."
    )
    parser.add_argument("--depth", type=int, default=12, help="blocks, one callable each")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per mode")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args(argv)
    for name in ("depth", "dim", "heads", "tokens", "batch", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.dim % args.heads:
        parser.error("--dim must be a multiple of --heads")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    return args


def capture_seconds(args: argparse.Namespace, mode: str) -> float:
    """Seconds one ``make_graphed_callables`` call over fresh blocks takes in ``mode``."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    blocks = tuple(
        ViTBlock(args.dim, args.heads, dropout=0.1).to(device) for _ in range(args.depth)
    )
    samples = tuple(
        (torch.randn(args.batch, args.tokens, args.dim, device=device, requires_grad=True),)
        for _ in blocks
    )
    clock: Callable[[], float] = time.perf_counter if args.device == "cuda" else time.process_time
    unobserved = mock.patch.multiple(
        WarmupProbe, __enter__=lambda probe: probe, __exit__=lambda probe, *exc: None
    )
    with unobserved if mode == "no probe" else contextlib.nullcontext():
        start = clock()
        dgt.make_graphed_callables(blocks, samples, lint="off" if mode == "no probe" else mode)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return clock() - start


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = "cuda" if args.device == "cuda" else "emulate"
    print(
        f"{args.depth} ViTBlock(dim={args.dim}, heads={args.heads}), input "
        f"[{args.batch}, {args.tokens}, {args.dim}], backend {backend}, {args.rounds} rounds"
    )
    capture_seconds(args, "error")  # first use: imports, kernels, caches
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(capture_seconds(args, mode))
    medians = {mode: statistics.median(seconds) for mode, seconds in times.items()}
    base = medians["no probe"]
    for mode in MODES:
        extra = medians[mode] - base
        print(
            f"{mode:>8}: {medians[mode] * 1e3:8.1f} ms (median)  +{extra * 1e3:6.1f} ms "
            f"({100 * extra / base:+5.1f}%, {extra * 1e3 / args.depth:.2f} ms per block)"
        )
    return medians


if __name__ == "__main__":
    main()
