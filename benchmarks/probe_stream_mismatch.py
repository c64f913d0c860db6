"""Which wrapper and which phase make autograd warn of an ``AccumulateGrad`` stream mismatch.

``python benchmarks/probe_stream_mismatch.py [--workload sdpa] [--baseline DIR]`` on a GPU.
Runs and run T's benchmark logs showed torch's "The AccumulateGrad node's stream does not match
the stream of the node that produced the incoming gradient" once per process (torch warns once),
which means a synchronisation per accumulation where it holds. Each variant runs here in a fresh
process (so torch's warn-once cannot hide it): capture, a first training step, then five more,
warnings recorded per phase. Printed: one line per variant and phase with the warnings seen.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_torch_replay import HiddenOnly, Stack, baseline_package, training_step, workloads
from torch import nn

import dualgraph.torch as dgt

VARIANTS = (
    "torch",
    "dualgraph",
    "dg-autograd",
    "dg-in-graph",
    "dg-encoder",
    "dg-encoder-in-graph",
    "dg-before",
)


def recorded(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``run()``'s result and the first line of every warning it raised."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run()
        torch.cuda.synchronize()
    return result, [f"{w.category.__name__}: {str(w.message).splitlines()[0][:110]}" for w in seen]


def probe(variant: str, workload: str, batch: int, baseline: str) -> None:
    """Capture ``variant``, step it six times, and print the warnings of each phase."""
    work = next(w for w in workloads([workload]) if w.batch == batch)
    torch.manual_seed(0)
    blocks = nn.ModuleList(work.block(work.dim, work.heads) for _ in range(work.blocks))
    blocks = blocks.cuda().to(work.dtype)
    inputs = torch.randn(*work.shape, device="cuda", dtype=work.dtype)

    def sample() -> tuple[torch.Tensor]:
        return (torch.randn(*work.shape, device="cuda", dtype=work.dtype, requires_grad=True),)

    samples = tuple(sample() for _ in blocks)
    package = baseline_package(baseline) if variant == "dg-before" else dgt
    modes = {
        "dg-autograd": "autograd",
        "dg-in-graph": "in_graph",
        "dg-encoder-in-graph": "in_graph",
    }
    mode = modes.get(variant, "auto")
    captures: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch.cuda.make_graphed_callables(
            tuple(HiddenOnly(b) for b in blocks), samples
        ),
        "encoder": lambda: (
            dgt.make_graphed_callables(Stack(blocks), sample(), backend="cuda", param_grads=mode),
        ),
        "blocks": lambda: package.make_graphed_callables(
            tuple(blocks), samples, backend="cuda", param_grads=mode
        ),
    }
    kind = "torch" if variant == "torch" else "encoder" if "encoder" in variant else "blocks"
    graphed, seen = recorded(captures[kind])
    print(f"{variant:22s} capture      {seen}")
    step = training_step(graphed, inputs, tuple_out=variant != "torch")
    _, seen = recorded(step)
    print(f"{variant:22s} first step   {seen}")
    _, seen = recorded(lambda: [step() for _ in range(5)])
    print(f"{variant:22s} steps 2-6    {seen}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="sdpa", choices=["vit", "sdpa", "tiny"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--baseline", default="", help="a directory holding another dualgraph/")
    parser.add_argument("--only", default="", help="probe this one variant (in this process)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_stream_mismatch needs a CUDA device")
    if args.only:
        probe(args.only, args.workload, args.batch, args.baseline)
        return
    for variant in VARIANTS:
        if variant == "dg-before" and not args.baseline:
            continue
        command = [sys.executable, __file__, "--only", variant, "--workload", args.workload]
        command += ["--batch", str(args.batch), "--baseline", args.baseline]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        print(done.stdout, end="")
        if done.returncode:
            print(f"{variant}: exit {done.returncode}: {done.stderr.strip()[-600:]}")


if __name__ == "__main__":
    main()
