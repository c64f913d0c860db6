"""Pipeline-parallel training of a vision encoder on one device: 1F1B with graphed blocks.

A ViT encoder (``dualgraph.models.torch_vit``) is cut into ``--stages`` pipeline stages of
``--layers`` blocks each (the first also embeds the patches, the last also pools and
classifies). Every step trains on ``--microbatches`` micro-batches with the 1F1B schedule: stage
``s`` runs ``stages - s - 1`` forwards, then alternates a forward and the oldest backward, then
runs the backwards left, so up to ``stages - s`` micro-batches are in flight on it. One device
runs all stages, each pass as soon as the pass it depends on has run, as the stages would in
parallel. Three variants train from one seed on the same batches:

- ``eager``: no graphs, the reference;
- ``dualgraph schedule``: each stage's blocks graphed with ``schedule=`` its 1F1B order: a graph
  pair per micro-batch, captured in that order into one pool, every replay checked against it;
- ``dualgraph slots``: each stage's blocks graphed with ``slots=`` its micro-batches in flight:
  a pool per slot, replays in any order.

It prints per variant the step time (median over steps), the memory (what the graphs hold, the
transient peak of a step, and their sum against eager's) and whether its losses match eager's.
Exit code 1 if a loss is off.

    python examples/pipeline_schedule.py                 # GPU: ViT-S/16 in bf16; CPU: small
    python examples/pipeline_schedule.py --device cpu --steps 2
    python examples/pipeline_schedule.py --batch 2       # GPU only: host-bound micro-batches

On a GPU the default is ViT-S/16-sized (4 stages of 3 blocks, dim 384, 6 heads, 196 tokens) in
bf16, 8 micro-batches of 8 images. On a CPU it is 4 stages of 1 block of dim 32, float32, on the
``emulate`` backend (the static buffers of the graphs, the blocks re-run on them), where graphed
losses equal eager's exactly; there the memory is counted: static buffers, and the activations
saved for backward while micro-batches are in flight.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import VisionEncoder
from dualgraph.torch import _replay_backends

CLASSES = 10
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"layers": 3, "dim": 384, "heads": 6, "image_size": 224, "patch": 16, "batch": 8,
             "dtype": "bfloat16", "steps": 20, "warmup": 3},
    "cpu": {"layers": 1, "dim": 32, "heads": 2, "image_size": 16, "patch": 8, "batch": 2,
            "dtype": "float32", "steps": 3, "warmup": 1},
}  # fmt: skip
LOSS_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # relative, on a GPU; the CPU is exact


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    has_cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if has_cuda else "cpu")
    parser.add_argument("--stages", type=positive_int, default=4, help="pipeline stages")
    parser.add_argument("--microbatches", type=positive_int, default=8, help="per step")
    for flag, what in [
        ("layers", "blocks per stage"),
        ("dim", "model width"),
        ("heads", "attention heads"),
        ("image_size", "image side in pixels"),
        ("patch", "patch side"),
        ("batch", "images per micro-batch"),
        ("steps", "timed steps per variant"),
        ("warmup", "untimed steps per variant, first"),
    ]:
        gpu, cpu = DEFAULTS["cuda"][flag], DEFAULTS["cpu"][flag]
        parser.add_argument(
            "--" + flag.replace("_", "-"),
            type=positive_int,
            help=f"{what} (default: {gpu} on a GPU, {cpu} on the CPU)",
        )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--param-grads", choices=["auto", "autograd", "in_graph"], default="auto",
        help="how graphed blocks hand parameter grads on (default: %(default)s)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not has_cuda:
        parser.error("--device cuda: no CUDA device is available")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.image_size % args.patch:
        parser.error(f"--image-size ({args.image_size}) must be a multiple of --patch")
    return args


# -- the model, cut into stages ------------------------------------------------------------------


class Stage(nn.Module):
    """Some blocks of the encoder; the first stage embeds patches, the last classifies."""

    def __init__(self, encoder: VisionEncoder, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = encoder.patch_embed if first else None
        self.pos_embed = encoder.pos_embed if first else None
        self.blocks = nn.ModuleList(encoder.blocks[i] for i in blocks)
        self.norm = encoder.norm if last else None
        self.head = nn.Linear(encoder.norm.normalized_shape[0], CLASSES) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x, _ = block(x)  # a graphed block returns (hidden, None) as the eager one does
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x).mean(dim=1))
        return x


def make_stages(args: argparse.Namespace, dtype: torch.dtype) -> list[Stage]:
    encoder = VisionEncoder(
        image_size=args.image_size, patch_size=args.patch, dim=args.dim,
        depth=args.stages * args.layers, heads=args.heads,
    )  # fmt: skip
    stages = [
        Stage(encoder, range(s * args.layers, (s + 1) * args.layers), s == 0, s == args.stages - 1)
        for s in range(args.stages)
    ]
    return [stage.to(args.device, dtype) for stage in stages]


def one_device_order(schedules: Sequence[dgt.Schedule]) -> list[tuple[int, int, bool]]:
    """``(stage, micro-batch, backward)`` passes in rounds: each stage's next pass, once ready."""
    position, forwards, backwards = [0] * len(schedules), [0] * len(schedules), [0] * len(schedules)
    done: set[tuple[int, int, bool]] = set()
    last = len(schedules) - 1
    order: list[tuple[int, int, bool]] = []
    while len(order) < sum(len(s.order) for s in schedules):
        for s, schedule in enumerate(schedules):
            if position[s] == len(schedule.order):
                continue
            backward = schedule.order[position[s]] < 0
            mb = backwards[s] if backward else forwards[s]
            if backward:
                ready = (s + 1, mb, True) in done or (s == last and (s, mb, False) in done)
            else:
                ready = s == 0 or (s - 1, mb, False) in done
            if ready:
                order.append((s, mb, backward))
                done.add((s, mb, backward))
                position[s] += 1
                (backwards if backward else forwards)[s] += 1
    return order


# -- variants ------------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    stages: list[Stage]
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    held_bytes: int = 0  # what its graphs keep between steps (buffers, pools)
    step_peak_bytes: int = 0  # the transient peak of a step above that


def build_variants(args: argparse.Namespace, dtype: torch.dtype) -> list[Variant]:
    torch.manual_seed(0)
    reference = make_stages(args, dtype)
    schedules = [
        dgt.Schedule.one_f_one_b(stages=args.stages, microbatches=args.microbatches, stage=s)
        for s in range(args.stages)
    ]
    tokens = (args.image_size // args.patch) ** 2
    variants = []
    for name in ("eager", "dualgraph schedule", "dualgraph slots"):
        stages = copy.deepcopy(reference)
        pools_before = graph_pools(args.device)
        for s, stage in enumerate(stages):
            if name == "eager":
                continue
            sample = torch.randn(args.batch, tokens, args.dim, device=args.device, dtype=dtype)
            how = {"schedule": schedules[s]} if "schedule" in name else {"slots": args.stages - s}
            dgt.make_graphed_callables(
                tuple(stage.blocks),
                tuple((sample.clone().requires_grad_(),) for _ in stage.blocks),
                param_grads=args.param_grads,
                **how,
            )
        pools = {
            pool: segments
            for pool, segments in graph_pools(args.device).items()
            if pool not in pools_before
        }
        held = held_bytes(stages, pools)
        optimizer = torch.optim.AdamW([p for stage in stages for p in stage.parameters()], 1e-3)
        variants.append(Variant(name, stages, optimizer, held_bytes=held))
    return variants


def graph_pools(device: str) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """GPU: each CUDA graph pool's segments, ``(address, size)``; none on the CPU."""
    if device != "cuda":
        return {}
    pools: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):  # (0, 0): the default pool, not a graph's
            pools.setdefault(pool, []).append((segment["address"], segment["total_size"]))
    return pools


def held_bytes(stages: Sequence[Stage], pools: dict[tuple[int, ...], list[tuple[int, int]]]) -> int:
    """What the graphs of ``stages`` keep: their pools, and static buffers outside them.

    On the CPU (no pools): every static buffer, less the in-graph accumulators, which are the
    parameters' ``.grad`` (which every variant has, and the CPU count leaves out).
    """
    segments = [segment for pool in pools.values() for segment in pool]

    def in_a_pool(tensor: torch.Tensor) -> bool:
        address = tensor.data_ptr()
        return any(start <= address < start + size for start, size in segments)

    buffers, accumulators = graph_buffers(stages)
    if not pools:
        return sum(nbytes(t) for t in buffers)
    outside = [t for t in (*buffers, *accumulators) if not in_a_pool(t)]
    return sum(size for _, size in segments) + sum(nbytes(t) for t in outside)


def graph_buffers(stages: Sequence[Stage]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The static buffers of every graphed block, each once, and the in-graph accumulators.

    An internal view of the graphed blocks (their slots' plans), for counting memory only.
    """
    from dualgraph import DualgraphError
    from dualgraph.torch._modules import runner_of

    buffers: dict[int, torch.Tensor] = {}
    accumulators: dict[int, torch.Tensor] = {}
    for stage in stages:
        for block in stage.blocks:
            try:
                runner = runner_of(block)
            except DualgraphError:  # an eager block
                continue
            for replay in getattr(runner, "_replays", (runner,)):  # slots, or one
                plan = replay.plan
                for t in (
                    *plan.buffers.inputs, *plan.buffers.outputs, *plan.buffers.grad_outputs,
                    *plan.buffers.input_grads, *plan.buffers.param_grads,
                ):  # fmt: skip
                    if t is not None:
                        buffers[id(t)] = t
                for t in plan.params.accumulators:
                    if t is not None:
                        accumulators[id(t)] = t
    return list(buffers.values()), list(accumulators.values())


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# -- training ------------------------------------------------------------------------------------


def train_step(
    variant: Variant,
    order: Sequence[tuple[int, int, bool]],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """One step of the pipeline: every pass in order, then AdamW; the summed loss."""
    last = len(variant.stages) - 1
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    wire: dict[tuple[int, int], torch.Tensor] = {}  # what one stage sends the next
    total = torch.zeros((), device=batches[0][0].device)
    for stage, mb, backward in order:
        images, labels = batches[mb]
        if not backward:
            x = images if stage == 0 else wire.pop((stage - 1, mb)).requires_grad_()
            y = variant.stages[stage](x)
            if stage == last:
                y = F.cross_entropy(y.float(), labels) / len(batches)
                total += y.detach()
            else:
                wire[(stage, mb)] = y.detach()
            inputs[(stage, mb)], outputs[(stage, mb)] = x, y
            continue
        y, x = outputs.pop((stage, mb)), inputs.pop((stage, mb))
        torch.autograd.backward(y, None if stage == last else wire.pop((stage, mb)))
        if stage > 0:
            wire[(stage - 1, mb)] = x.grad  # type: ignore[assignment]
    variant.optimizer.step()
    variant.optimizer.zero_grad(set_to_none=True)
    return total.item()


class SavedActivations:
    """The bytes of tensors saved for backward that are alive, and their peak (CPU memory).

    Counted per storage, leaving out parameters and ``exclude`` (static buffers, counted apart).
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.now, self.peak = exclude, {}, 0, 0

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        holder = _Holder(tensor)
        if key in self.exclude or isinstance(tensor, nn.Parameter):
            return holder
        if key not in self.live:
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            self.live[key] = [0, storage.nbytes()]
        self.live[key][0] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Holder:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def measure_step(variant: Variant, run_step: Callable[[], float], device: str) -> float:
    """Run a step, recording its transient memory peak; its loss."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        loss = run_step()
        torch.cuda.synchronize()
        variant.step_peak_bytes = torch.cuda.max_memory_allocated() - resident
        return loss
    buffers, accumulators = graph_buffers(variant.stages)
    counter = SavedActivations({t.untyped_storage().data_ptr() for t in (*buffers, *accumulators)})
    counting = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda holder: holder.tensor)
    # An emulated replay keeps its activations from the caller's saved-tensor hooks (as a graph
    # keeps them in its pool); its own hooks are swapped for the counting ones here.
    with counting, mock.patch.object(_replay_backends, "_OWN_SAVED_TENSORS", counting):
        loss = run_step()
    variant.step_peak_bytes = counter.peak
    return loss


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def mib(size: float) -> str:
    return f"{size / 2**20:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    tokens = (args.image_size // args.patch) ** 2
    backend = "cuda" if device == "cuda" else "emulate (no GPU: static buffers, blocks re-run)"
    print(
        f"pipeline: {args.stages} stages x {args.layers} blocks (dim {args.dim}, {tokens} "
        f"tokens), {args.microbatches} micro-batches of {args.batch} a step, 1F1B, {args.dtype}; "
        f"dualgraph backend {backend}"
    )
    variants = build_variants(args, dtype)
    schedules = [
        dgt.Schedule.one_f_one_b(stages=args.stages, microbatches=args.microbatches, stage=s)
        for s in range(args.stages)
    ]
    order = one_device_order(schedules)
    in_flight = ", ".join(str(s.in_flight[0]) for s in schedules)
    print(f"micro-batches in flight per stage at most: {in_flight}")
    data = torch.Generator().manual_seed(1)

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = args.image_size
        return [
            (
                torch.randn(args.batch, 3, size, size, generator=data).to(device, dtype),
                torch.randint(0, CLASSES, (args.batch,), generator=data).to(device),
            )
            for _ in range(args.microbatches)
        ]

    # Warm-up steps are not timed; the last of them measures memory (lazy allocations done).
    for index in range(args.warmup + args.steps):
        step_batches = batches()
        for variant in variants[index % 3 :] + variants[: index % 3]:  # rotated each step
            run_step = functools.partial(train_step, variant, order, step_batches)
            if index == args.warmup - 1:
                variant.losses.append(measure_step(variant, run_step, device))
                continue
            synchronize(device)
            start = time.perf_counter()
            variant.losses.append(run_step())
            synchronize(device)
            if index >= args.warmup:
                variant.step_ms.append(1e3 * (time.perf_counter() - start))

    eager = variants[0]
    eager_ms = statistics.median(eager.step_ms) if eager.step_ms else float("nan")
    eager_total = eager.held_bytes + eager.step_peak_bytes
    print(
        f"\n{'variant':<20}{'ms/step':>9}{'x eager':>9}{'held MiB':>10}{'step MiB':>10}"
        f"{'total MiB':>11}{'x eager':>9}"
    )
    failures = []
    for variant in variants:
        ms = statistics.median(variant.step_ms) if variant.step_ms else float("nan")
        total = variant.held_bytes + variant.step_peak_bytes
        print(
            f"{variant.name:<20}{ms:>9.2f}{eager_ms / ms:>9.2f}{mib(variant.held_bytes):>10}"
            f"{mib(variant.step_peak_bytes):>10}{mib(total):>11}{total / eager_total:>9.2f}"
        )
    print(
        "held: what graphs keep between steps (static buffers; on a GPU their pools); step: the "
        "transient peak of a step (on the CPU: activations saved for backward)"
    )
    for variant in variants[1:]:
        worst = worst_relative_difference(variant.losses, eager.losses)
        tolerance = 0.0 if device == "cpu" else LOSS_TOLERANCE[args.dtype]
        ok = worst <= tolerance  # False for a NaN
        verdict = "losses match eager" if ok else "LOSSES DIFFER from eager"
        steps = len(eager.losses)
        print(f"{variant.name}: {verdict}: {steps} steps, largest relative difference {worst:.3g}")
        if not ok:
            failures.append(variant.name)
    print("pipeline_schedule: " + ("OK" if not failures else "FAILED: " + ", ".join(failures)))
    return 1 if failures else 0


def worst_relative_difference(losses: Sequence[float], eager: Sequence[float]) -> float:
    """The largest ``|loss - eager| / |eager|`` over the steps; NaN where one is NaN.

    (numpy's max keeps a NaN, which Python's max drops after a finite value; a NaN passes no
    ``worst <= tolerance``.)

    >>> worst_relative_difference([2.0, float("nan")], [2.0, 2.0])
    nan
    """
    differences = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, eager, strict=True)]
    return float(np.max(differences, initial=0.0))


if __name__ == "__main__":
    sys.exit(main())
