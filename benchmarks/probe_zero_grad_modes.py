"""The step after ``optimizer.zero_grad()`` against the accumulating step, in one process.

``bench_torch_replay.py --zero-grad`` times one mode per run, and two runs on the GPU machine
differ by more than the variants do (run U: eager 11.7 ms in one, 15.0 in the other). This probe
times the same graphed blocks with each ``--modes`` way of clearing the grads (``none``: they
accumulate; ``set_to_none``: every ``.grad`` ``None``, torch's default; ``zeros``), interleaved
round by round, so that what ``set_to_none`` costs each wrapper is read within one run::

    python benchmarks/probe_zero_grad_modes.py --workload sdpa --batch 2 --rounds 7
    python benchmarks/probe_zero_grad_modes.py --baseline .baseline2   # and another dualgraph/

Variants: ``torch`` (``torch.cuda.make_graphed_callables``), ``dualgraph`` (default
``param_grads``), ``dg-in-graph``, and with ``--baseline`` the same two of that copy
(``-before``). Prints ms per step (CUDA events, medians) and the difference per block. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import bench_torch_replay as bench
import torch

import dualgraph.torch as dgt


def graphed_variants(work: bench.Workload, baseline: str) -> dict[str, tuple[Any, bool]]:
    """Each wrapper's graphed blocks, and whether they return a tuple."""

    def blocks() -> tuple[torch.nn.Module, ...]:
        torch.manual_seed(0)
        made = [work.block(work.dim, work.heads) for _ in range(work.blocks)]
        return tuple(block.cuda().to(work.dtype) for block in made)

    def samples() -> tuple[Any, ...]:
        return tuple(
            (torch.randn(*work.shape, device="cuda", dtype=work.dtype, requires_grad=True),)
            for _ in range(work.blocks)
        )

    wrapped = tuple(bench.HiddenOnly(b) for b in blocks())
    variants: dict[str, tuple[Any, bool]] = {
        "torch": (torch.cuda.make_graphed_callables(wrapped, samples()), False)
    }
    packages = [("", dgt)] + ([("-before", bench.baseline_package(baseline))] if baseline else [])
    for suffix, package in packages:
        for name, mode in (("dualgraph", "auto"), ("dg-in-graph", "in_graph")):
            graphed = package.make_graphed_callables(
                blocks(), samples(), backend="cuda", param_grads=mode
            )
            variants[name + suffix] = (graphed, True)
    return variants


def steps_by_mode(
    variants: dict[str, tuple[Any, bool]], inputs: torch.Tensor, modes: list[str]
) -> dict[tuple[str, str], Callable[[], None]]:
    """A step per variant and zero-grad mode: the same graphed blocks, cleared otherwise."""
    steps = {}
    for mode in modes:
        bench.ZERO_GRAD = mode  # read by bench.clearing when the step is made
        for name, (graphed, tuple_out) in variants.items():
            steps[(name, mode)] = bench.training_step(graphed, inputs, tuple_out=tuple_out)
    return steps


def timed(
    steps: dict[tuple[str, str], Callable[[], None]], rounds: int, count: int
) -> dict[tuple[str, str], float]:
    """Median ms per step of each, over rounds that each start one step later."""
    for step in steps.values():
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    order = list(steps)
    for round_ in range(rounds):
        shift = round_ % len(order)
        for key in order[shift:] + order[:shift]:
            step = steps[key]
            step()  # the first step after another mode's: not timed
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                step()
            end.record()
            end.synchronize()
            samples[key].append(start.elapsed_time(end) / count)
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="sdpa", choices=["vit", "sdpa", "tiny"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["none", "set_to_none"])
    parser.add_argument("--baseline", default="", help="a directory holding another dualgraph/")
    args = parser.parse_args()
    work = next(w for w in bench.workloads([args.workload]) if w.batch == args.batch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {work.describe()}")
    inputs = torch.randn(*work.shape, device="cuda", dtype=work.dtype)
    variants = graphed_variants(work, args.baseline)
    times = timed(steps_by_mode(variants, inputs, args.modes), args.rounds, args.steps)
    first = args.modes[0]
    print(f"| variant | {' | '.join(args.modes)} (ms/step) | per block vs {first} (us) |")
    print("| --- |" + " ---: |" * (len(args.modes) + 1))
    for name in variants:
        row = [times[(name, mode)] for mode in args.modes]
        extra = ", ".join(
            f"{mode} {(ms - row[0]) * 1000 / work.blocks:+.1f}"
            for mode, ms in zip(args.modes[1:], row[1:], strict=True)
        )
        print(f"| {name} | {' | '.join(f'{ms:.3f}' for ms in row)} | {extra} |")


if __name__ == "__main__":
    main()
