"""Memory of one pipeline stage graphed with slots or a schedule, against eager on the same order.

Run: ``python benchmarks/bench_pipeline_memory.py [--json FILE]`` (GPU: ViT-S-sized blocks in
bf16; CPU: small float32 blocks on the ``emulate`` backend). The stage is the first of
``--stages`` under 1F1B with ``--microbatches`` micro-batches a step, the one with the most
micro-batches in flight (``--stages``); it holds ``--layers`` ViT blocks. A step runs the stage's
order: each forward on a fresh input that requires grad, each backward with a fresh output grad,
the oldest first; the parameter grads accumulate.

Variants: ``eager``; ``schedule`` (``schedule=`` the stage's order: one pool, a graph pair per
micro-batch, buffers shared between micro-batches never in flight together); ``slots``
(``slots=`` the micro-batches in flight: a pool per slot); each with parameter grads through
autograd and in the graph (``in_graph``).

Columns: "held" is what the graphs keep between steps: on the GPU their pools (every
segment) and the static buffers outside them; on the CPU, with no pools, the static buffers
(the in-graph accumulators aside: they are the parameters' ``.grad``). "step" is the transient
peak of a step above what was allocated before it: on the GPU the allocator's; on the CPU the
activations saved for backward that are alive at once. "total" is their sum, "x eager" its
ratio to eager's, "per mb" the total per micro-batch in flight, "pools" the graph pools,
"slots" the replay slots per block, "reused" the static buffer bytes that micro-batches never
in flight together share.

The variants are graphed one after another in one process. Each graph pool holds only what its
own captures put there: one-time allocations a capture would make on torch's capture stream
(cuBLAS's workspaces, 32 MiB per thread on an H200) are made outside any pool before capturing,
so the first variant graphed is not charged for them (it once was: 64 MiB more than the same
layout graphed second).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch
from torch import nn

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock
from dualgraph.torch import _replay_backends

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "cuda": {"layers": 3, "dim": 384, "heads": 6, "tokens": 197, "batch": 8, "dtype": "bfloat16"},
    "cpu": {"layers": 2, "dim": 64, "heads": 4, "tokens": 16, "batch": 4, "dtype": "float32"},
}


def example() -> ModuleType:
    """``examples/pipeline_schedule.py``, whose memory counters this benchmark uses."""
    spec = importlib.util.spec_from_file_location(
        "pipeline_example", ROOT / "examples" / "pipeline_schedule.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


class StageBlocks(nn.Module):
    """The blocks of one stage, as the example's ``Stage`` holds them (``.blocks``)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


def measure(
    variant: str,
    param_grads: str,
    blocks: Sequence[nn.Module],
    schedule: dgt.Schedule,
    args: argparse.Namespace,
    counters: ModuleType,
) -> dict[str, Any]:
    """Graph ``blocks`` as ``variant`` says, run two steps, and count memory on the second."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    stage = StageBlocks(copy.deepcopy(list(blocks)))
    shape = (args.batch, args.tokens, args.dim)
    pools_before = counters.graph_pools(args.device)
    if variant != "eager":
        how = (
            {"schedule": schedule} if variant == "schedule" else {"slots": max(schedule.in_flight)}
        )
        dgt.make_graphed_callables(
            tuple(stage.blocks),
            tuple(
                (torch.randn(shape, device=device, dtype=dtype, requires_grad=True),)
                for _ in stage.blocks
            ),
            param_grads=param_grads,
            **how,
        )
    pools = {
        pool: segments
        for pool, segments in counters.graph_pools(args.device).items()
        if pool not in pools_before
    }
    held = counters.held_bytes([stage], pools)

    def step() -> None:
        in_flight = []
        for c in schedule.order:
            if c > 0:
                h = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                for block in stage.blocks:
                    h, _ = block(h)
                in_flight.append(h)
            else:
                out = in_flight.pop(0)
                out.backward(torch.randn_like(out))
                del out
        stage.zero_grad(set_to_none=True)

    step()  # lazy allocations (cuBLAS workspaces, ...) happen here
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - resident
    else:
        buffers, accumulators = counters.graph_buffers([stage])
        saved = counters.SavedActivations(
            {t.untyped_storage().data_ptr() for t in (*buffers, *accumulators)}
        )
        counting = torch.autograd.graph.saved_tensors_hooks(
            saved.pack, lambda holder: holder.tensor
        )
        # An emulated replay keeps its activations from the caller's saved-tensor hooks (as a
        # graph keeps them in its pool); its own hooks are swapped for the counting ones here.
        with counting, mock.patch.object(_replay_backends, "_OWN_SAVED_TENSORS", counting):
            step()
        peak = saved.peak
    report = dgt.diagnostics(stage.blocks[0]) if variant != "eager" else None
    return {
        "variant": variant if variant == "eager" else f"{variant} {param_grads}",
        "held": held,
        "step": peak,
        "total": held + peak,
        "pools": len(pools),
        "slots": report.slots if report is not None else 0,
        "reused": report.reused_buffer_bytes if report is not None else 0,
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    for name in ("layers", "dim", "heads", "tokens", "batch"):
        parser.add_argument("--" + name, type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="write the results there")
    args = parser.parse_args(argv)
    for name, value in SIZES[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    counters = example()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    blocks = [ViTBlock(args.dim, args.heads).to(args.device, dtype) for _ in range(args.layers)]
    schedule = dgt.Schedule.one_f_one_b(stages=args.stages, microbatches=args.microbatches, stage=0)
    print(
        f"one pipeline stage: {args.layers} ViT blocks (dim {args.dim}, {args.heads} heads, "
        f"{args.tokens} tokens, batch {args.batch}, {args.dtype} on {args.device}); 1F1B, first "
        f"of {args.stages} stages, {args.microbatches} micro-batches, {schedule.in_flight[0]} in "
        "flight at most"
    )
    results = [measure("eager", "autograd", blocks, schedule, args, counters)]
    for variant in ("schedule", "slots"):
        for param_grads in ("autograd", "in_graph"):
            results.append(measure(variant, param_grads, blocks, schedule, args, counters))
    eager_total = results[0]["total"]
    in_flight = schedule.in_flight[0]
    print(
        f"{'variant':<20}{'held MiB':>10}{'step MiB':>10}{'total MiB':>11}{'x eager':>9}"
        f"{'per mb MiB':>12}{'pools':>7}{'slots':>7}{'reused MiB':>12}"
    )
    for row in results:
        row["per_microbatch"] = row["total"] / in_flight
        print(
            f"{row['variant']:<20}{row['held'] / 2**20:>10.2f}{row['step'] / 2**20:>10.2f}"
            f"{row['total'] / 2**20:>11.2f}{row['total'] / eager_total:>9.2f}"
            f"{row['per_microbatch'] / 2**20:>12.2f}{row['pools']:>7}{row['slots']:>7}"
            f"{row['reused'] / 2**20:>12.2f}"
        )
    print(f"per mb: the total over the {in_flight} micro-batches in flight at most")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1
            )
        )
    return results


if __name__ == "__main__":
    main()
