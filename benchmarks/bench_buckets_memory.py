"""Memory of shape buckets: one pool for several resolutions vs the largest alone, and vs one each.

Run on a CUDA machine: ``python benchmarks/bench_buckets_memory.py [--json out.json]``.
For each workload (the reference ``VisionEncoder``, bf16, TF32 off) it graphs:

- ``largest alone``: the largest resolution only (``buckets=[largest]``): what padding every
  batch to the largest size takes, and the reference of the bound;
- ``buckets``: every resolution as one bucketed callable (one pool);
- ``one pool per size``: each resolution graphed on its own, summed.

and prints each pool's size (the allocator's segments of the pool), the ratio of ``buckets`` to
``largest alone`` (the claim: at most 1.25) and the capture time. It then replays the buckets in
a random order for ``--steps`` training steps and checks the pool did not grow. Exit code 1 if a
ratio is over ``--bound``.

Workloads: ViT-S/16-sized (12 blocks, dim 384, 6 heads) at 224/256/288 px (196/256/324 tokens)
at batch 32 and batch 8, and a 2-block dim-64 encoder at batch 2 (parameters weigh more there).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import VisionEncoder

SIZES = (224, 256, 288)


@dataclass
class Workload:
    name: str
    depth: int
    dim: int
    heads: int
    batch: int


WORKLOADS = (
    Workload("vit-s batch 32", 12, 384, 6, 32),
    Workload("vit-s batch 8", 12, 384, 6, 8),
    Workload("small batch 2", 2, 64, 4, 2),
)


@dataclass
class Result:
    workload: str
    largest_alone_bytes: int
    buckets_bytes: int
    separate_bytes: int
    ratio: float
    capture_seconds: float
    grew_in_training: int


def encoder(workload: Workload, device: torch.device) -> VisionEncoder:
    model = VisionEncoder(
        image_size=SIZES[0],
        patch_size=16,
        dim=workload.dim,
        depth=workload.depth,
        heads=workload.heads,
    )
    return model.to(device, torch.bfloat16)


def images(workload: Workload, size: int, device: torch.device) -> torch.Tensor:
    return torch.randn(workload.batch, 3, size, size, device=device, dtype=torch.bfloat16)


def pool_of(workload: Workload, sizes: tuple[int, ...], device: torch.device) -> tuple[Any, int]:
    model = encoder(workload, device)
    dgt.make_graphed_callables(model, buckets=[(images(workload, s, device),) for s in sizes])
    return model, dgt.diagnostics(model).pool_bytes


def measure(workload: Workload, steps: int, device: torch.device) -> Result:
    _, largest = pool_of(workload, (max(SIZES),), device)
    start = time.perf_counter()
    model, pool = pool_of(workload, SIZES, device)
    seconds = time.perf_counter() - start
    separate = sum(pool_of(workload, (size,), device)[1] for size in SIZES)
    rng = random.Random(0)
    for _ in range(steps):
        out = model(images(workload, rng.choice(SIZES), device))
        (out["hidden"].float().square().mean() + out["pooled"].float().mean()).backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    grew = dgt.diagnostics(model).pool_bytes - pool
    return Result(workload.name, largest, pool, separate, pool / largest, seconds, grew)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps (default: 12)")
    parser.add_argument("--bound", type=float, default=1.25, help="the claim (default: 1.25)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    results = [measure(workload, args.steps, device) for workload in WORKLOADS]
    mib = 2**20
    print(
        f"{'workload':16} {'largest alone MiB':>18} {'buckets MiB':>12} {'x largest':>10} "
        f"{'one per size MiB':>17} {'capture s':>10} {'grew B':>7}"
    )
    for r in results:
        print(
            f"{r.workload:16} {r.largest_alone_bytes / mib:18.1f} {r.buckets_bytes / mib:12.1f} "
            f"{r.ratio:10.3f} {r.separate_bytes / mib:17.1f} {r.capture_seconds:10.2f} "
            f"{r.grew_in_training:7d}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    over = [r.workload for r in results if r.ratio > args.bound or r.grew_in_training]
    print(f"bound {args.bound}x: " + ("OK" if not over else f"FAILED for {', '.join(over)}"))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
