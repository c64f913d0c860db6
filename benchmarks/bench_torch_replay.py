"""Training-step time of graphed block stacks: eager, torch, TE and dualgraph against the floor.

Run on a CUDA machine: ``python benchmarks/bench_torch_replay.py [--rounds 5 --steps 20]``.
Every variant of one workload is built in one process and timed in interleaved rounds (median
of rounds; each round runs ``--steps`` steps, ``--tiny-steps`` for the tiny workload, between two
CUDA events). A step is forward +
backward with loss ``h.float().sum()`` and fresh input leaves; parameter grads accumulate.
``--zero-grad set_to_none`` sets every parameter's ``.grad`` to ``None`` first in each step (as
torch's default ``optimizer.zero_grad()``: the backward starts new sums), ``zeros`` zeroes them
in place (``set_to_none=False``); ``none`` (the default) clears nothing. The ``floor`` graph
always accumulates (a CUDA graph cannot make new ``.grad`` tensors), so under another choice it
is the floor of the accumulating step.

Workloads (``--workloads``; default all):

- ``vit``: 12 ``dualgraph.models.torch_vit.ViTBlock`` (explicit softmax attention), bf16,
  dim 384, 6 heads, 197 tokens, at batch 2 (host-bound) and batch 32 (GPU-bound).
- ``sdpa``: 12 pre-norm ViT-S blocks with ``F.scaled_dot_product_attention`` (one
  ``Linear(384, 1152)`` for qkv, ``Linear(384, 384)``, LayerNorms, ``Linear(384, 1536)``, GELU,
  ``Linear(1536, 384)``), same sizes; less GPU time per block, so host overhead weighs more.
- ``tiny``: one ``Linear(64, 64)`` at batch 8, fp32: almost nothing but host overhead.

Variants:

- ``eager``: the plain modules.
- ``torch``: ``torch.cuda.make_graphed_callables`` per block; it cannot take the blocks'
  ``(hidden, None)`` output, so it graphs a wrapper returning ``hidden`` alone.
- ``te``: Transformer Engine's ``make_graphed_callables`` per block (only where TE imports).
- ``dualgraph``: ``dualgraph.torch.make_graphed_callables`` per block, default options
  (``param_grads="auto"``: a plain ``.backward()`` adds the parameter grads into ``.grad`` in a
  graph, the parameters stay autograd inputs).
- ``dg-autograd``: the same with ``param_grads="autograd"`` (the default before ``"auto"``).
- ``dg-in-graph``: the same with ``param_grads="in_graph"``.
- ``dg-encoder`` / ``dg-encoder-in-graph``: the whole stack as one dualgraph callable (default
  options / ``param_grads="in_graph"``).
- ``dg-before`` / ``dg-in-graph-before``: ``--baseline DIR`` loads another copy of the package
  (``DIR/dualgraph``, e.g. the last release) beside this one, to compare two versions in one run
  (``dg-before`` is that version's default).
- ``floor``: one raw CUDA graph of the whole step (forward, backward, grad accumulation).

Also measured per graphed variant: capture time and memory held after capture (growth of the
allocator's allocated and reserved bytes; the same measure for every wrapper); capture time
again as the median of ``--capture-rounds`` interleaved rounds in which each wrapper graphs
fresh blocks (no first-use cost of the process in it: the variants above were graphed first);
memory held
after one training step (allocated growth from before the capture: pool, static buffers and
the ``.grad`` tensors, which some wrappers allocate at capture and others at the first
backward; for ``eager`` the ``.grad`` tensors alone), and for ``tiny``
the host time per call (CPU side: ``--host-calls`` calls without waiting for the GPU).
``--json`` writes every number; ``--plot`` a bar chart (ms per step per variant, PNG).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dualgraph
import dualgraph.torch as dgt
from dualgraph.models.torch_vit import ViTBlock

Step = Callable[[], None]


class SdpaBlock(nn.Module):
    """Pre-norm ViT block with flash attention (``F.scaled_dot_product_attention``).

    ``forward(x)`` returns ``(x, None)`` like :class:`~dualgraph.models.torch_vit.ViTBlock`.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        batch, tokens, dim = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        mixed = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(mixed)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, None


class TinyBlock(nn.Module):
    """One ``Linear(dim, dim)`` returning ``(y, None)``: a call that is all host overhead."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        del heads
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(x), None


class HiddenOnly(nn.Module):
    """What torch.cuda.make_graphed_callables needs: a block returning a tensor, not (h, None)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


class Stack(nn.Module):
    """The blocks as one callable returning ``(hidden, None)``."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        for block in self.blocks:
            x = block(x)[0]
        return x, None


@dataclass(frozen=True)
class Workload:
    """One stack of blocks and the shape of its input."""

    name: str
    block: Callable[[int, int], nn.Module]
    blocks: int
    batch: int
    tokens: int
    dim: int
    heads: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.batch, self.tokens, self.dim) if self.tokens else (self.batch, self.dim)

    def describe(self) -> str:
        tokens = f", {self.tokens} tokens" if self.tokens else ""
        return (
            f"{self.name}: {self.blocks} x {self.block.__name__}, batch {self.batch}{tokens}, "
            f"dim {self.dim}, {str(self.dtype).removeprefix('torch.')}, fwd+bwd"
        )


def workloads(names: list[str]) -> list[Workload]:
    table = {
        "vit": [Workload("vit", ViTBlock, 12, b, 197, 384, 6, torch.bfloat16) for b in (2, 32)],
        "sdpa": [Workload("sdpa", SdpaBlock, 12, b, 197, 384, 6, torch.bfloat16) for b in (2, 32)],
        "tiny": [Workload("tiny", TinyBlock, 1, 8, 0, 64, 1, torch.float32)],
    }
    return [w for name in names for w in table[name]]


@dataclass
class Built:
    """A variant's step, and what its capture cost."""

    step: Step
    capture_s: float = 0.0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    after_step_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def measured(capture: Callable[[], Any]) -> tuple[Any, float, int, int]:
    """Run ``capture``; its result, seconds, and the growth of allocated and reserved bytes."""
    gc.collect()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    start = time.perf_counter()
    result = capture()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    gc.collect()
    grown = torch.cuda.memory_allocated() - allocated, torch.cuda.memory_reserved() - reserved
    return result, seconds, *grown


ZERO_GRAD = "none"  # --zero-grad: what each step does to the grads before it runs


def clearing(blocks: Any) -> Step:
    """What ``optimizer.zero_grad(set_to_none=...)`` (``ZERO_GRAD``) does to the blocks' grads."""
    params = [p for block in blocks if hasattr(block, "parameters") for p in block.parameters()]

    def set_to_none() -> None:
        for param in params:
            param.grad = None

    def zeros() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    return {"none": lambda: None, "set_to_none": set_to_none, "zeros": zeros}[ZERO_GRAD]


def training_step(blocks: Any, inputs: torch.Tensor, *, tuple_out: bool) -> Step:
    """Forward + backward of the stack on a fresh leaf copy of ``inputs`` (its grads cleared
    first as ``--zero-grad`` says)."""
    clear = clearing(blocks)

    def step() -> None:
        clear()
        x = inputs.detach().requires_grad_()
        for block in blocks:
            x = block(x)[0] if tuple_out else block(x)
        x.float().sum().backward()

    return step


@functools.cache
def transformer_engine() -> Any:
    """``transformer_engine.pytorch``, or None (the reason printed once) where it does not load."""
    try:
        import transformer_engine.pytorch as te
    except Exception as error:  # ImportError, or TE failing to load its CUDA libraries
        print(f"te variant skipped: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return te


@functools.cache
def baseline_package(directory: str) -> Any:
    """``DIR/dualgraph`` imported as ``dualgraph_baseline.torch`` beside the current package."""
    root = Path(directory) / "dualgraph"
    spec = importlib.util.spec_from_file_location(
        "dualgraph_baseline", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dualgraph_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("dualgraph_baseline.torch")


def build_variants(work: Workload, baseline: str) -> dict[str, Built]:
    """Every variant of one workload, each with its own copy of the same weights."""
    inputs = torch.randn(*work.shape, device="cuda", dtype=work.dtype)

    def blocks() -> nn.ModuleList:
        torch.manual_seed(0)
        made = nn.ModuleList(work.block(work.dim, work.heads) for _ in range(work.blocks))
        return made.cuda().to(work.dtype)

    def samples(count: int = work.blocks) -> tuple[Any, ...]:
        return tuple(
            (torch.randn(*work.shape, device="cuda", dtype=work.dtype, requires_grad=True),)
            for _ in range(count)
        )

    def add(name: str, capture: Callable[[], Any], *, tuple_out: bool) -> None:
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graphed, seconds, allocated, reserved = measured(capture)
        step = training_step(graphed, inputs, tuple_out=tuple_out)
        step()  # the first step allocates what a wrapper leaves for it (the .grad tensors)
        torch.cuda.synchronize()
        gc.collect()
        after_step = torch.cuda.memory_allocated() - before
        variants[name] = Built(step, seconds, allocated, reserved, after_step)

    variants: dict[str, Built] = {}
    eager_blocks = blocks()
    add("eager", lambda: eager_blocks, tuple_out=True)

    wrapped = tuple(HiddenOnly(b) for b in blocks())
    add("torch", lambda: torch.cuda.make_graphed_callables(wrapped, samples()), tuple_out=False)
    te = transformer_engine()
    if te is not None:
        te_blocks = tuple(blocks())
        add("te", lambda: te.make_graphed_callables(te_blocks, samples()), tuple_out=True)
    packages = [("", dgt)] + ([("-before", baseline_package(baseline))] if baseline else [])
    for suffix, package in packages:
        per_block, in_graph = tuple(blocks()), tuple(blocks())
        add(
            "dualgraph" if not suffix else "dg-before",
            lambda p=package, b=per_block: p.make_graphed_callables(b, samples(), backend="cuda"),
            tuple_out=True,
        )
        if not suffix:
            explicit = tuple(blocks())
            add(
                "dg-autograd",
                lambda b=explicit: dgt.make_graphed_callables(
                    b, samples(), backend="cuda", param_grads="autograd"
                ),
                tuple_out=True,
            )
        add(
            f"dg-in-graph{suffix}",
            lambda p=package, b=in_graph: p.make_graphed_callables(
                b, samples(), backend="cuda", param_grads="in_graph"
            ),
            tuple_out=True,
        )
    if work.blocks > 1:
        stack, stack_in_graph = Stack(blocks()), Stack(blocks())
        add(
            "dg-encoder",
            lambda: (dgt.make_graphed_callables(stack, samples(1)[0], backend="cuda"),),
            tuple_out=True,
        )
        add(
            "dg-encoder-in-graph",
            lambda: (
                dgt.make_graphed_callables(
                    stack_in_graph, samples(1)[0], backend="cuda", param_grads="in_graph"
                ),
            ),
            tuple_out=True,
        )
    variants["floor"] = Built(*floor_step(blocks(), inputs))
    return variants


def capture_times(work: Workload, rounds: int, baseline: str) -> dict[str, float]:
    """Median seconds to graph the blocks, per wrapper, over interleaved rounds.

    Each round graphs fresh copies of the blocks with every wrapper in turn (torch, TE where it
    imports, dualgraph's default, ``"in_graph"`` and ``--baseline``'s default); building the
    blocks and samples is not timed, and each result is freed before the next. All wrappers
    have graphed once already (``build_variants``), so no first-use cost of a process is in it.
    """

    def blocks() -> list[nn.Module]:
        torch.manual_seed(0)
        return [work.block(work.dim, work.heads).cuda().to(work.dtype) for _ in range(work.blocks)]

    def samples() -> tuple[Any, ...]:
        return tuple(
            (torch.randn(*work.shape, device="cuda", dtype=work.dtype, requires_grad=True),)
            for _ in range(work.blocks)
        )

    wrappers: dict[str, Callable[[list[nn.Module], tuple[Any, ...]], Any]] = {
        "torch": lambda b, s: torch.cuda.make_graphed_callables(tuple(HiddenOnly(m) for m in b), s),
        "dualgraph": lambda b, s: dgt.make_graphed_callables(tuple(b), s, backend="cuda"),
        "dg-in-graph": lambda b, s: dgt.make_graphed_callables(
            tuple(b), s, backend="cuda", param_grads="in_graph"
        ),
    }
    te = transformer_engine()
    if te is not None:
        wrappers["te"] = lambda b, s: te.make_graphed_callables(tuple(b), s)
    if baseline:
        before = baseline_package(baseline)
        wrappers["dg-before"] = lambda b, s: before.make_graphed_callables(
            tuple(b), s, backend="cuda"
        )
    seconds: dict[str, list[float]] = {name: [] for name in wrappers}
    for _ in range(rounds):
        for name, wrap in wrappers.items():
            made, inputs = blocks(), samples()
            gc.collect()
            torch.cuda.synchronize()
            start = time.perf_counter()
            graphed = wrap(made, inputs)
            torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
            del graphed, made, inputs
            gc.collect()
            torch.cuda.empty_cache()
    return {name: statistics.median(values) for name, values in seconds.items()}


def floor_step(blocks: nn.ModuleList, inputs: torch.Tensor) -> tuple[Step, float, int, int, int]:
    """One raw CUDA graph of the whole step: the least a step can cost."""
    static_x = inputs.detach().clone().requires_grad_()

    def whole_step() -> None:
        x = static_x
        for block in blocks:
            x = block(x)[0]
        x.float().sum().backward()

    def capture() -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                whole_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            whole_step()
        return graph

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph, seconds, allocated, reserved = measured(capture)
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, seconds, allocated, reserved, torch.cuda.memory_allocated() - before


def time_variants(variants: dict[str, Built], rounds: int, steps: int) -> dict[str, float]:
    """Median ms per step of each variant over interleaved rounds (CUDA events)."""
    for built in variants.values():  # warm every variant before timing any
        for _ in range(3):
            built.step()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, built in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                built.step()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / steps)
    return {name: statistics.median(values) for name, values in samples.items()}


def host_us_per_call(variants: dict[str, Built], rounds: int, calls: int) -> dict[str, float]:
    """CPU time of one step, the GPU idle at the start of each batch of calls (median of rounds)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, built in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                built.step()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def report(work: Workload, times: dict[str, float], variants: dict[str, Built]) -> list[str]:
    floor, peer = times["floor"], times["torch"]
    lines = [
        f"| {work.name} batch {work.batch} | variant | ms/step | x floor | x torch | capture s "
        "| allocated MiB | reserved MiB | after 1 step MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ms in times.items():
        built = variants[name]
        capture = f"{built.capture_s:.3f}" if name != "eager" else ""
        mib = (
            (f"{built.allocated_bytes / 2**20:.1f}", f"{built.reserved_bytes / 2**20:.1f}")
            if name != "eager"
            else ("", "")
        )
        lines.append(
            f"| | {name} | {ms:.3f} | {ms / floor:.2f} | {ms / peer:.2f} | {capture} "
            f"| {mib[0]} | {mib[1]} | {built.after_step_bytes / 2**20:.1f} |"
        )
    return lines


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, v in results.items() if isinstance(v, dict) and "ms_per_step" in v]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        times = results[key]["ms_per_step"]
        names = list(times)
        colors = [
            "#2ca02c" if n == "floor" else "#1f77b4" if n.startswith("d") else "#7f7f7f"
            for n in names
        ]
        ax.bar(range(len(names)), [times[n] for n in names], color=colors)
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(key, fontsize=9)
        ax.set_ylabel("ms per step (fwd+bwd)")
    fig.suptitle(f"{results['device']}: median of interleaved rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads", nargs="+", default=["vit", "sdpa", "tiny"], choices=["vit", "sdpa", "tiny"]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--tiny-steps", type=int, default=200, help="steps per round of the tiny workload"
    )
    parser.add_argument("--host-calls", type=int, default=200)
    parser.add_argument(
        "--capture-rounds", type=int, default=3, help="interleaved rounds of capture timing"
    )
    parser.add_argument("--baseline", default="", help="a directory holding another dualgraph/")
    parser.add_argument("--json", default="", help="write every number here")
    parser.add_argument("--plot", default="", help="write a bar chart (PNG) here")
    parser.add_argument(
        "--zero-grad", default="none", choices=["none", "set_to_none", "zeros"],
        help="clear the parameter grads before each step: set_to_none (torch's default "
        "optimizer.zero_grad()), zeros (set_to_none=False), none (grads accumulate)",
    )  # fmt: skip
    args = parser.parse_args()
    global ZERO_GRAD
    ZERO_GRAD = args.zero_grad
    if not torch.cuda.is_available():
        sys.exit("bench_torch_replay needs a CUDA device")
    versions = {"torch": torch.__version__, "dualgraph": dualgraph.__version__}
    te = transformer_engine()
    if te is not None:
        versions["transformer_engine"] = importlib.metadata.version("transformer_engine")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions,
        "config": vars(args),
    }
    print(f"{results['device']}, {versions}; medians of {args.rounds} interleaved rounds")
    for work in workloads(args.workloads):
        variants = build_variants(work, args.baseline)
        steps = args.tiny_steps if work.name == "tiny" else args.steps
        times = time_variants(variants, args.rounds, steps)
        entry: dict[str, Any] = {
            "workload": work.describe(),
            "ms_per_step": times,
            "capture_s": {n: b.capture_s for n, b in variants.items() if n != "eager"},
            "allocated_bytes": {n: b.allocated_bytes for n, b in variants.items() if n != "eager"},
            "reserved_bytes": {n: b.reserved_bytes for n, b in variants.items() if n != "eager"},
            "after_step_bytes": {n: b.after_step_bytes for n, b in variants.items()},
        }
        print(f"\n{work.describe()}")
        print("\n".join(report(work, times, variants)))
        if work.name == "tiny":
            host = host_us_per_call(variants, args.rounds, args.host_calls)
            entry["host_us_per_call"] = host
            print(
                "host us per call (CPU side): " + ", ".join(f"{n} {v:.1f}" for n, v in host.items())
            )
        del variants
        gc.collect()
        torch.cuda.empty_cache()
        if args.capture_rounds:
            captures = capture_times(work, args.capture_rounds, args.baseline)
            entry["capture_s_median"] = captures
            print(
                f"capture s (median of {args.capture_rounds} interleaved rounds): "
                + ", ".join(f"{n} {v:.3f}" for n, v in captures.items())
            )
        results[f"{work.name}-b{work.batch}"] = entry
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
