"""Host time of a capture on a CPU (``"emulate"``), against the eager work it cannot avoid.

``python benchmarks/bench_capture_host.py [--blocks 12] [--repeats 7]``: 12
``ViTBlock(64, 4)`` blocks, samples ``(2, 8, 64)`` requiring grad, captured together with
``lint="off"`` and the warmup probe unobserved (as a CUDA capture runs it by default); the median
of ``--repeats`` captures, beside the median of a plain eager loop of the same 4 forward and
backward calls per block (3 warmup iterations and the capture: the floor of what a capture does).
The difference is dualgraph's own host work at capture. ``--model tiny``: an ``nn.Linear(64, 64)``
per block instead (samples ``(8, 64)``; ``--blocks 1`` for one), where a capture's fixed costs
dominate. ``--baseline DIR`` also captures with ``DIR/dualgraph`` (another version), interleaved
with this one in the same process, each round in the other order, and prints the ratio of the
medians.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from typing import Any

import torch
from bench_host_overhead import baseline_package

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock
from dualgraph.torch import _probe


def _unobserved(probe: Any = _probe) -> None:
    """Run the warmup probe as a CUDA capture with ``lint="auto"`` does: not observing."""
    init = probe.WarmupProbe.__init__

    def patched(self: Any, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self.observed = False

    probe.WarmupProbe.__init__ = patched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default="vit", choices=["vit", "tiny"])
    parser.add_argument("--profile", action="store_true", help="cProfile one more capture")
    parser.add_argument("--baseline", default="", help="a directory holding another dualgraph/")
    options = parser.parse_args()
    _unobserved()
    packages: dict[str, Any] = {"": dgt}
    if options.baseline:
        packages["before"] = baseline_package(options.baseline)
        _unobserved(importlib.import_module("dualgraph_baseline.torch._probe"))
    torch.set_num_threads(1)  # two cores shared: threads only add noise
    torch.manual_seed(0)

    tiny = options.model == "tiny"

    def blocks() -> tuple[torch.nn.Module, ...]:
        return tuple(
            torch.nn.Linear(64, 64) if tiny else ViTBlock(64, 4) for _ in range(options.blocks)
        )

    def samples() -> tuple[tuple[torch.Tensor], ...]:
        shape = (8, 64) if tiny else (2, 8, 64)
        return tuple((torch.randn(*shape, requires_grad=True),) for _ in range(options.blocks))

    def capture(package: Any = dgt) -> float:
        made, given = blocks(), samples()
        start = time.thread_time()
        package.make_graphed_callables(made, given, lint="off")
        return time.thread_time() - start

    def eager() -> float:
        made, given = blocks(), samples()
        start = time.thread_time()
        for block, (x,) in zip(made, given, strict=True):
            params = [p for p in block.parameters() if p.requires_grad]
            for _ in range(4):
                hidden = block(x) if tiny else block(x)[0]
                torch.autograd.grad([hidden], [x, *params], [torch.ones_like(hidden)])
        return time.thread_time() - start

    for _ in range(2):  # first calls: imports, allocator
        for package in packages.values():
            capture(package)
        eager()
    captures: dict[str, list[float]] = {name: [] for name in packages}
    eagers = []
    for round_ in range(options.repeats):  # interleaved, each round in the other order
        names = list(packages)
        for name in names if round_ % 2 == 0 else names[::-1]:
            captures[name].append(capture(packages[name]))
        eagers.append(eager())
    floor = statistics.median(eagers) * 1e3
    medians = {name: statistics.median(times) * 1e3 for name, times in captures.items()}
    for name, cap in medians.items():
        print(
            f"capture{' ' + name if name else ''} {cap:.2f} ms, eager floor {floor:.2f} ms, "
            f"overhead {cap - floor:.2f} ms (medians, CPU time of this thread)"
        )
    if options.baseline:
        print(f"capture / capture before: {medians[''] / medians['before']:.3f}")
    if options.profile:
        import cProfile
        import pstats

        made, given = blocks(), samples()
        profile = cProfile.Profile()
        profile.runcall(dgt.make_graphed_callables, made, given, lint="off")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(60)


if __name__ == "__main__":
    main()
