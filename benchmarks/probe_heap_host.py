"""Host time per tiny graphed step against the size of the process's heap (a probe).

``python benchmarks/probe_heap_host.py [--objects 3000000]``: a ``Linear(64, 64)`` block graphed
by torch's ``make_graphed_callables`` and by dualgraph (``"auto"``), eager beside them; median
host µs per fwd+bwd step over interleaved rounds, and the garbage collections per 1000 steps,
first with the process as it is, then with ``--objects`` long-lived Python objects added (as a
large import such as Transformer Engine adds), then after ``gc.freeze()``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
from torch import nn

import dualgraph.torch as dgt

_collections = [0, 0, 0]


def _count(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _collections[info["generation"]] += 1


def _block(device: torch.device) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(device)


def _round(step: object, n: int) -> tuple[float, list[int]]:
    before = list(_collections)
    start = time.perf_counter()
    for _ in range(n):
        step()  # type: ignore[operator]
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / n * 1e6
    return elapsed, [a - b for a, b in zip(_collections, before, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=3_000_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    options = parser.parse_args()
    device = torch.device("cuda")
    sample = (torch.randn(8, 64, device=device, requires_grad=True),)
    torch_block = torch.cuda.make_graphed_callables(_block(device), sample)
    dg_block = _block(device)
    dgt.make_graphed_callables(dg_block, sample)
    dg_in_graph = _block(device)
    dgt.make_graphed_callables(dg_in_graph, sample, param_grads="in_graph")
    eager = _block(device)
    variants = {
        "eager": eager,
        "torch": torch_block,
        "dualgraph": dg_block,
        "dg-in-graph": dg_in_graph,
    }

    def stepper(module: Any) -> object:
        def step() -> None:
            x = torch.randn(8, 64, device=device, requires_grad=True)
            module(x).float().sum().backward()

        return step

    steps = {name: stepper(m) for name, m in variants.items()}
    gc.callbacks.append(_count)
    junk: list[list[int]] = []
    for phase in ("as is", f"+{options.objects} objects", "gc.freeze()"):
        if phase.startswith("+"):
            junk.extend([i] for i in range(options.objects))
            gc.collect()
        elif phase == "gc.freeze()":
            gc.freeze()
        times: dict[str, list[float]] = {name: [] for name in steps}
        counts: dict[str, list[int]] = {name: [0, 0, 0] for name in steps}
        for step in steps.values():
            _round(step, 30)  # warm
        for _ in range(options.rounds):
            for name, step in steps.items():
                t, c = _round(step, options.steps)
                times[name].append(t)
                counts[name] = [a + b for a, b in zip(counts[name], c, strict=True)]
        total = options.rounds * options.steps / 1000
        print(f"{phase}:")
        for name in steps:
            per = [round(c / total, 1) for c in counts[name]]
            median = statistics.median(times[name])
            print(f"  {name:12s} {median:8.1f} us/step, collections per 1000 steps {per}")
    print(len(junk))


if __name__ == "__main__":
    main()
