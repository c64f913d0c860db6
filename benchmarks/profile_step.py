"""Where the host time of a graphed training step and of a capture goes (cProfile).

``python benchmarks/profile_step.py [--workload sdpa] [--batch 2] [--steps 50]`` on a GPU: 12
blocks of ``bench_torch_replay.py``'s workload, graphed per block by dualgraph (default mode)
and by ``torch.cuda.make_graphed_callables``; for each, the capture and then ``--steps`` training
steps run under :mod:`cProfile`; printed: the capture's functions by cumulative time (after a
first, unprofiled capture of each) and the steps' functions by time of their own (the C++
autograd engine shows as the ``run_backward`` call it is inside). Read it beside
``bench_torch_replay.py``'s timings, which this script does not replace: a profiler slows the
Python it watches. ``--baseline DIR`` also profiles ``DIR/dualgraph`` (another version) in the
same process; ``--param-grads`` picks dualgraph's mode.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from collections.abc import Callable
from typing import Any

import bench_torch_replay
import torch
from bench_torch_replay import HiddenOnly, baseline_package, training_step, workloads

import dualgraph.torch as dgt


def profiled(label: str, run: Callable[[], Any], top: int, order: str = "tottime") -> Any:
    """Run ``run`` under cProfile; print its ``top`` functions by ``order``; its result."""
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    result = profile.runcall(run)
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats(order).print_stats(top)
    print(f"== {label}")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="sdpa")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=22)
    parser.add_argument(
        "--capture-own-time", action="store_true", help="also profile a capture by own time"
    )
    parser.add_argument("--param-grads", default="auto", help="dualgraph's param_grads= mode")
    parser.add_argument(
        "--baseline", default="", help="also profile DIR/dualgraph (another version) in the run"
    )
    parser.add_argument(
        "--zero-grad", default="none", choices=["none", "set_to_none", "zeros"],
        help="clear the parameter grads before each step (as bench_torch_replay.py's option)",
    )  # fmt: skip
    options = parser.parse_args()
    bench_torch_replay.ZERO_GRAD = options.zero_grad
    (work,) = [w for w in workloads([options.workload]) if w.batch == options.batch]
    print(f"{work.describe()}, grads before each step: {options.zero_grad}")

    def blocks() -> torch.nn.ModuleList:
        torch.manual_seed(0)
        made = torch.nn.ModuleList(work.block(work.dim, work.heads) for _ in range(work.blocks))
        return made.cuda().to(work.dtype)

    def samples() -> tuple[Any, ...]:
        return tuple(
            (torch.randn(*work.shape, device="cuda", dtype=work.dtype, requires_grad=True),)
            for _ in range(work.blocks)
        )

    inputs = torch.randn(*work.shape, device="cuda", dtype=work.dtype)
    # A first capture of each outside the profile: the process's first CUDA kernels, cuBLAS
    # handles and imports are paid there, so the profiled captures compare like with like.
    mode = options.param_grads
    dgt.make_graphed_callables(tuple(blocks()), samples(), param_grads=mode)
    torch.cuda.make_graphed_callables(tuple(HiddenOnly(x) for x in blocks()), samples())

    def ours(package: Any = dgt) -> Callable[[], Any]:
        made, given = tuple(blocks()), samples()  # built outside the profile
        return lambda: package.make_graphed_callables(made, given, param_grads=mode)

    def theirs() -> Callable[[], Any]:
        made, given = tuple(HiddenOnly(x) for x in blocks()), samples()
        return lambda: torch.cuda.make_graphed_callables(made, given)

    variants: list[tuple[str, Callable[[], Callable[[], Any]], bool]] = [
        ("dualgraph", ours, True),
        ("torch", theirs, False),
    ]
    if options.baseline:
        before = baseline_package(options.baseline)
        variants.insert(1, ("dualgraph-before", lambda: ours(before), True))
    for name, capture, tuple_out in variants:
        graphed = profiled(f"{name}: capture", capture(), options.top, "cumulative")
        if options.capture_own_time:  # a second capture, its functions by time of their own
            profiled(f"{name}: capture, own time", capture(), options.top)
        step = training_step(graphed, inputs, tuple_out=tuple_out)
        for _ in range(5):
            step()

        def steps(step: Callable[[], None] = step) -> None:
            for _ in range(options.steps):
                step()

        profiled(f"{name}: {options.steps} steps", steps, options.top)


if __name__ == "__main__":
    main()
