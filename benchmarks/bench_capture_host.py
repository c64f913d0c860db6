"""Host time of a capture on a CPU (``"emulate"``), against the eager work it cannot avoid.

``python benchmarks/bench_capture_host.py [--blocks 12] [--repeats 7]``: 12
``ViTBlock(64, 4)`` blocks, samples ``(2, 8, 64)`` requiring grad, captured together with
``lint="off"`` and the warmup probe unobserved (as a CUDA capture runs it by default); the median
of ``--repeats`` captures, beside the median of a plain eager loop of the same 4 forward and
backward calls per block (3 warmup iterations and the capture: the floor of what a capture does).
The difference is dualgraph's own host work at capture.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock
from dualgraph.torch import _probe


def _unobserved() -> None:
    """Run the warmup probe as a CUDA capture with ``lint="auto"`` does: not observing."""
    init = _probe.WarmupProbe.__init__

    def patched(self: _probe.WarmupProbe, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self.observed = False

    _probe.WarmupProbe.__init__ = patched  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile one more capture")
    options = parser.parse_args()
    _unobserved()
    torch.set_num_threads(1)  # two cores shared: threads only add noise
    torch.manual_seed(0)

    def blocks() -> tuple[ViTBlock, ...]:
        return tuple(ViTBlock(64, 4) for _ in range(options.blocks))

    def samples() -> tuple[tuple[torch.Tensor], ...]:
        return tuple((torch.randn(2, 8, 64, requires_grad=True),) for _ in range(options.blocks))

    def capture() -> float:
        made, given = blocks(), samples()
        start = time.thread_time()
        dgt.make_graphed_callables(made, given, lint="off")
        return time.thread_time() - start

    def eager() -> float:
        made, given = blocks(), samples()
        start = time.thread_time()
        for block, (x,) in zip(made, given, strict=True):
            params = [p for p in block.parameters() if p.requires_grad]
            for _ in range(4):
                hidden, _ = block(x)
                torch.autograd.grad([hidden], [x, *params], [torch.ones_like(hidden)])
        return time.thread_time() - start

    for _ in range(2):  # first calls: imports, allocator
        capture()
        eager()
    captures, eagers = [], []
    for _ in range(options.repeats):  # interleaved
        captures.append(capture())
        eagers.append(eager())
    cap, floor = statistics.median(captures) * 1e3, statistics.median(eagers) * 1e3
    print(
        f"capture {cap:.2f} ms, eager floor {floor:.2f} ms, overhead {cap - floor:.2f} ms "
        "(medians, CPU time of this thread)"
    )
    if options.profile:
        import cProfile
        import pstats

        made, given = blocks(), samples()
        profile = cProfile.Profile()
        profile.runcall(dgt.make_graphed_callables, made, given, lint="off")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(60)


if __name__ == "__main__":
    main()
