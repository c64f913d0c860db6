"""Host time of dualgraph's own per-call path: what a replay costs besides the graphs themselves.

Runs anywhere (``python benchmarks/bench_host_overhead.py``; CPU by default, ``--device cuda``
on a GPU). Each workload is graphed with the ``"emulate"`` backend (on a GPU also ``"cuda"``),
then its replays are swapped for no-ops, so a call does everything a real call does (input
checks, the parameter and ambient checks, the copies into static buffers, the autograd
Function, the ``.grad`` handling) except running the callable: what is left is the adapter's
host cost, the number a CUDA replay adds to its graph launches. ``eager`` (the plain blocks)
and ``empty`` (the same step with the blocks taken out) frame it; ``torch-like`` is the blocks
with the per-call path of ``torch.cuda.make_graphed_callables``, replays no-ops alike.

A step is: a fresh leaf input, every block called in turn, ``h.sum().backward()``; parameter
grads accumulate across steps. ``--zero-grad`` clears them first in each step, as a training
loop's ``optimizer.zero_grad()`` does: ``set_to_none`` sets every parameter's ``.grad`` to
``None`` (torch's default, so the backward starts new sums: the path most loops take),
``zeros`` zeroes them in place (``set_to_none=False``); ``none`` (the default) clears nothing.
``--no-grad`` times an evaluation step instead: the blocks' forwards under ``torch.no_grad()``.
Medians of ``--rounds`` interleaved rounds of ``--steps``
steps, in microseconds per step (CPU time of the process on a CPU, one torch thread; wall
time on a GPU); ``--baseline DIR`` also loads ``DIR/dualgraph`` (another
version of the package) to compare in one run.

Workloads: ``tiny`` (one ``Linear(64, 64)``, batch 8) and ``vit`` (12
``dualgraph.models.torch_vit.ViTBlock``, dim 64, 4 heads, 8 tokens, batch 2, per-block
callables; small sizes, since only the host path is timed), and ``vit-encoder`` (the same 12
blocks graphed as one callable).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock

Step = Callable[[], None]
MODES = ("auto", "autograd", "in_graph")


class Tiny(nn.Module):
    """One ``Linear`` returning ``(y, None)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(x), None


class Stack(nn.Module):
    """Blocks as one callable returning ``(hidden, None)``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        for block in self.blocks:
            x = block(x)[0]
        return x, None


def make_blocks(workload: str, device: torch.device) -> tuple[list[nn.Module], tuple[int, ...]]:
    torch.manual_seed(0)
    if workload == "tiny":
        return [Tiny(64).to(device)], (8, 64)
    blocks: list[nn.Module] = [ViTBlock(64, 4).to(device) for _ in range(12)]
    if workload == "vit-encoder":
        return [Stack(blocks)], (2, 8, 64)
    return blocks, (2, 8, 64)


ZERO_GRAD = ("none", "set_to_none", "zeros")


def clearing(blocks: list[Any], zero_grad: str) -> Step:
    """What ``optimizer.zero_grad(set_to_none=...)`` does to the blocks' parameters' grads."""
    params = [p for block in blocks for p in block.parameters()]

    def set_to_none() -> None:
        for param in params:
            param.grad = None

    def zeros() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    return {"none": lambda: None, "set_to_none": set_to_none, "zeros": zeros}[zero_grad]


def step_of(
    blocks: list[Any],
    shape: tuple[int, ...],
    device: torch.device,
    zero_grad: str = "none",
    no_grad: bool = False,
) -> Step:
    inputs = torch.randn(*shape, device=device)
    clear = clearing(blocks, zero_grad)

    def evaluation() -> None:
        with torch.no_grad():
            x = inputs
            for block in blocks:
                x = block(x)[0]

    if no_grad:
        return evaluation

    def step() -> None:
        clear()
        x = inputs.detach().requires_grad_()
        for block in blocks:
            x = block(x)[0]
        x.sum().backward()

    return step


def like_torchs_wrapper(module: nn.Module, sample: torch.Tensor) -> nn.Module:
    """``module`` with the per-call path of ``torch.cuda.make_graphed_callables`` (its
    ``Graphed`` Function: copies into static inputs, the replay, detached static outputs; in the
    backward, copies into static grads and the static input and parameter grads handed to
    autograd), its replays no-ops: the reference issue 15's targets are set against. torch's
    own refuses the ``None`` output; this one hands back the tensors and puts the ``None``
    back, as a wrapper returning the tensors alone would."""
    params = tuple(p for p in module.parameters() if p.requires_grad)
    static_inputs = (sample.detach().clone(), *params)
    flat, spec = torch.utils._pytree.tree_flatten(module(sample))
    static_outputs = tuple(o.detach() for o in flat if o is not None)
    nones = [i for i, o in enumerate(flat) if o is None]
    static_grad_outputs = tuple(map(torch.empty_like, static_outputs))
    static_grad_inputs = tuple(map(torch.empty_like, static_inputs))

    def replay() -> None:
        return None

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if static_inputs[0].data_ptr() != inputs[0].data_ptr():
                static_inputs[0].copy_(inputs[0])
            replay()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
            for static, grad in zip(static_grad_outputs, grads, strict=True):
                if static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
            replay()
            return tuple(b.detach() for b in static_grad_inputs)

    def forward(x: torch.Tensor) -> Any:
        outputs = list(Graphed.apply(*torch.utils._pytree.arg_tree_leaves(x), *params))
        for i in nones:
            outputs.insert(i, None)
        return torch.utils._pytree.tree_unflatten(outputs, spec)

    module.forward = forward  # type: ignore[method-assign]
    return module


def without_replays(package: Any, module: nn.Module) -> None:
    """Make every replay of a graphed module a no-op: only the adapter's own path is left."""
    runner = importlib.import_module(package.__name__ + "._modules").runner_of(module)

    def nothing(*args: Any) -> None:
        return None

    for slot in ("_replay_forward", "_replay_backward", "_replay_accumulate"):
        if getattr(runner, slot, None) is not None:
            setattr(runner, slot, nothing)


def build(
    workload: str,
    device: torch.device,
    backends: list[str],
    packages: dict[str, Any],
    zero_grad: str = "none",
    no_grad: bool = False,
) -> dict[str, Step]:
    variants: dict[str, Step] = {}
    blocks, shape = make_blocks(workload, device)
    variants["eager"] = step_of(blocks, shape, device, zero_grad, no_grad)
    variants["empty"] = step_of([], shape, device, zero_grad, no_grad)
    blocks, shape = make_blocks(workload, device)
    wrapped = [like_torchs_wrapper(block, torch.randn(*shape, device=device)) for block in blocks]
    variants["torch-like"] = step_of(wrapped, shape, device, zero_grad, no_grad)
    for suffix, package in packages.items():
        for backend in backends:
            for mode in MODES:
                if mode not in get_args(package._graphed.ParamGrads):
                    continue  # an older version without this mode
                blocks, shape = make_blocks(workload, device)
                sample = tuple(
                    (torch.randn(*shape, device=device, requires_grad=True),) for _ in blocks
                )
                graphed = package.make_graphed_callables(
                    tuple(blocks), sample, backend=backend, param_grads=mode
                )
                for block in graphed:
                    without_replays(package, block)
                variants[f"{backend}-{mode}{suffix}"] = step_of(
                    list(graphed), shape, device, zero_grad, no_grad
                )
    return variants


def time_steps(variants: dict[str, Step], rounds: int, steps: int, device: torch.device) -> Any:
    # On a CPU the whole step runs in this process's one thread: its CPU time is what other
    # processes on a shared machine cannot inflate. On a GPU the backward runs on autograd's
    # device thread, so wall time is taken (the GPU idles: the replays are no-ops).
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in variants.values():
        for _ in range(3):
            step()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_ in range(rounds):
        # Each round starts one variant later: a variant's place in the round (what ran just
        # before it) biases its time by up to 20% on a shared CPU, the same for every round.
        shift = round_ % len(order)
        for name, step in order[shift:] + order[:shift]:
            sync()
            start = clock()
            for _ in range(steps):
                step()
            samples[name].append((clock() - start) / steps * 1e6)
            sync()
    return {name: statistics.median(values) for name, values in samples.items()}


def baseline_package(directory: str) -> Any:
    root = Path(directory) / "dualgraph"
    spec = importlib.util.spec_from_file_location(
        "dualgraph_baseline", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dualgraph_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("dualgraph_baseline.torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--workloads", nargs="+", default=["tiny", "vit", "vit-encoder"],
        choices=["tiny", "vit", "vit-encoder"],
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--baseline", default="", help="a directory holding another dualgraph/")
    parser.add_argument("--json", default="", help="write every number here")
    parser.add_argument(
        "--zero-grad", default="none", choices=ZERO_GRAD,
        help="clear the parameter grads before each step: set_to_none (torch's default "
        "optimizer.zero_grad()), zeros (set_to_none=False), none (grads accumulate)",
    )  # fmt: skip
    parser.add_argument(
        "--no-grad", action="store_true",
        help="time an evaluation step instead: the blocks' forwards under torch.no_grad()",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)  # host overhead is one thread's work; more threads only contend
    backends = ["emulate"] + (["cuda"] if device.type == "cuda" else [])
    packages = {"": dgt} | ({"-before": baseline_package(args.baseline)} if args.baseline else {})
    results: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    for workload in args.workloads:
        times = time_steps(
            build(workload, device, backends, packages, args.zero_grad, args.no_grad),
            args.rounds,
            args.steps,
            device,
        )
        results[workload] = times
        results["zero_grad"] = args.zero_grad
        results["no_grad"] = args.no_grad
        empty = times["empty"]
        kind = "forward under no_grad" if args.no_grad else "fwd+bwd"
        print(
            f"\n{workload}: us per step ({kind}, zero_grad {args.zero_grad}), "
            f"medians of {args.rounds} rounds"
        )
        print("| variant | us/step | minus empty step |")
        print("| --- | ---: | ---: |")
        for name, us in times.items():
            print(f"| {name} | {us:.1f} | {us - empty:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
