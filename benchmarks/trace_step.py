"""What one training step asks of CUDA and of the autograd engine, per variant (torch.profiler).

``python benchmarks/trace_step.py [--workload tiny --batch 8] [--steps 20]`` on a GPU: builds
``bench_torch_replay.py``'s variants of one workload, runs ``--steps`` steps of each under
``torch.profiler`` (CPU and CUDA activities) and prints, per step: how often each CUDA runtime
call ran (kernel and graph launches, copies, event records, stream waits) with its CPU time,
and the operators with the most CPU time of their own. Counts are exact; times carry the
profiler's own cost, so compare them between variants, not with ``bench_torch_replay.py``.

Example: a variant that records an event and makes a stream wait on every step, where its
peers do not, shows ``cudaEventRecord`` and ``cudaStreamWaitEvent`` at 1.0 per step.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from bench_torch_replay import build_variants, workloads
from torch.profiler import ProfilerActivity, profile


def per_step(variant: Any, steps: int) -> tuple[list[tuple[str, float, float]], list[Any]]:
    """``(name, calls per step, CPU us per step)`` of each CUDA runtime call, and the
    profiler's averages (for the operator table)."""
    for _ in range(5):
        variant.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            variant.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    runtime = [
        (event.key, event.count / steps, event.self_cpu_time_total / steps)
        for event in averages
        if event.key.startswith(("cuda", "cu")) and "Synchronize" not in event.key
    ]
    return sorted(runtime, key=lambda row: -row[1]), list(averages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=["torch", "dualgraph", "dg-in-graph"])
    parser.add_argument("--top", type=int, default=12)
    options = parser.parse_args()
    (work,) = [w for w in workloads([options.workload]) if w.batch == options.batch]
    print(work.describe())
    variants = build_variants(work, "")
    for name in options.variants:
        runtime, averages = per_step(variants[name], options.steps)
        print(f"\n== {name}: CUDA runtime calls per step (count, CPU us)")
        for key, count, micros in runtime:
            print(f"  {key:<40} {count:6.2f} {micros:9.1f}")
        own = sorted(
            (e for e in averages if not e.key.startswith(("cuda", "cu"))),
            key=lambda e: -e.self_cpu_time_total,
        )[: options.top]
        print(f"== {name}: operators by CPU time of their own, per step (count, us)")
        for event in own:
            print(
                f"  {event.key[:60]:<60} {event.count / options.steps:6.2f} "
                f"{event.self_cpu_time_total / options.steps:9.1f}"
            )


if __name__ == "__main__":
    main()
