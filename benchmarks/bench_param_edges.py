"""What a replay's parameter edges cost autograd, apart from dualgraph's own Python.

Under ``param_grads="auto"`` and ``"autograd"`` each call's autograd node takes the callable's
parameters as inputs (what lets ``torch.autograd.grad(loss, params)``, ``backward(inputs=...)``,
parameter hooks and DDP reach them), so ``Function.apply`` collects one edge per parameter and
every plain ``.backward()`` runs one ``AccumulateGrad`` per parameter and call, even with no
grad for it (the backward graph added it into ``.grad`` already). This times a chain of minimal
``autograd.Function`` calls (a ViT block's 12 parameters per call, 12 calls, a backward handing
``None`` to every parameter) against the same chain with one anchor leaf per call
(``"in_graph"``'s construction) and with none: ``python benchmarks/bench_param_edges.py``
(CPU time, one thread, medians of interleaved rounds, us per step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


class _Call(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *edges: torch.Tensor) -> torch.Tensor:
        ctx.edges = len(edges)
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(None,) * ctx.edges)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--params", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = [
        [torch.nn.Parameter(torch.randn(4)) for _ in range(args.params)] for _ in range(args.calls)
    ]
    anchors = [[torch.zeros((), requires_grad=True)] for _ in range(args.calls)]
    edges = {"parameters": params, "anchor": anchors, "none": [[]] * args.calls}
    sample = torch.randn(4)

    def step(per_call: list[list[torch.Tensor]], backward: bool) -> None:
        x = sample.detach().requires_grad_()
        for inputs in per_call:
            x = _Call.apply(x, *inputs)
        if backward:
            x.sum().backward()

    samples: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for name, per_call in edges.items():
            for backward in (False, True):
                label = f"{name}, {'forward+backward' if backward else 'forward'}"
                for _ in range(5 if round_ else 50):
                    step(per_call, backward)
                start = time.process_time()
                for _ in range(args.steps):
                    step(per_call, backward)
                elapsed = (time.process_time() - start) / args.steps * 1e6
                samples.setdefault(label, []).append(elapsed)
    print(f"{args.calls} calls of {args.params} parameters: us per step, medians")
    for label, values in samples.items():
        print(f"| {label} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
