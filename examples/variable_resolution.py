"""Train a vision encoder on images of mixed resolutions: eager vs dualgraph shape buckets.

The encoder (``dualgraph.models.torch_vit.VisionEncoder``, whose learned positions are
interpolated for other image sizes) with a classification head trains with AdamW on batches
whose resolution changes from step to step, in a random order. From one seed it trains twice on
the same batches:

- ``eager``: no graphs, the reference;
- ``dualgraph buckets``: the whole encoder graphed once per resolution with
  ``make_graphed_callables(encoder, buckets=[...])``: one forward and backward graph per size,
  all in one memory pool; each call replays the graphs of its size.

It prints the time per step of both (median), whether the losses match eager's, how many steps
each bucket served, and the memory of the buckets' one pool against the alternative of padding
every batch to the largest size: one graph at the largest size (its pool, and its time per step
when every batch runs at that size), and against one pool per size. Exit code 1 if a loss is
off.

    python examples/variable_resolution.py                  # CPU: small encoder, 16/24/32 px
    python examples/variable_resolution.py --device cuda    # GPU: ViT-S/16, 224/256/288 px, bf16

On a CPU the dualgraph backend is ``emulate`` (the static buffers of the graphs, no graph), so
times show no speedup and there is no pool; the losses must equal eager's bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import VisionEncoder

CLASSES = 10

DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {
        "sizes": "224,256,288",
        "patch": 16,
        "dim": 384,
        "layers": 12,
        "heads": 6,
        "batch": 32,
        "dtype": "bfloat16",
        "steps": 30,
    },
    "cpu": {
        "sizes": "16,24,32",
        "patch": 8,
        "dim": 32,
        "layers": 2,
        "heads": 2,
        "batch": 4,
        "dtype": "float32",
        "steps": 9,
    },
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train (default: cuda when available)",
    )
    parser.add_argument(
        "--sizes", help="image sizes in pixels, comma separated (default: by device)"
    )
    parser.add_argument("--patch", type=int, help="patch size (default: 16 on a GPU, 8 on the CPU)")
    parser.add_argument("--dim", type=int, help="width (default: 384 on a GPU, 32 on the CPU)")
    parser.add_argument("--layers", type=int, help="blocks (default: 12 on a GPU, 2 on the CPU)")
    parser.add_argument("--heads", type=int, help="attention heads (default: 6 / 2)")
    parser.add_argument("--batch", type=int, help="images per step (default: 32 / 4)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="(default: bf16 / fp32)")
    parser.add_argument("--steps", type=int, help="training steps (default: 30 / 9)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.sizes = sorted({int(size) for size in str(args.sizes).split(",")})
    except ValueError:
        parser.error(f"--sizes: comma-separated integers, got {args.sizes!r}")
    for name in ("patch", "dim", "layers", "heads", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer")
    if any(size < args.patch or size % args.patch for size in args.sizes):
        parser.error(f"--sizes {args.sizes}: each a multiple of --patch ({args.patch})")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    return args


class Model(torch.nn.Module):
    """The encoder and a linear head on its pooled output."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.encoder = VisionEncoder(
            image_size=args.sizes[0],
            patch_size=args.patch,
            dim=args.dim,
            depth=args.layers,
            heads=args.heads,
        )
        self.head = torch.nn.Linear(args.dim, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(images)["pooled"])


def loss_tolerance(device: torch.device, dtype: torch.dtype) -> float:
    """How far a graphed loss may be from eager's, relative to the loss.

    The CPU (emulate: eager's kernels on the same values, no padding) is bit for bit in every
    dtype; on a GPU (TF32 off) a kernel choice may differ within the dtype's rounding.

    >>> loss_tolerance(torch.device("cpu"), torch.bfloat16)
    0.0
    """
    if device.type == "cpu":
        return 0.0
    return 1e-5 if dtype == torch.float32 else 2e-2


def worst_relative_difference(losses: Sequence[float], eager: Sequence[float]) -> float:
    """The largest ``|loss - eager| / max(1, |eager|)`` over the steps; NaN where one is NaN.

    (numpy's max keeps a NaN, which Python's max drops after a finite value; a NaN passes no
    ``worst <= tolerance``.)

    >>> worst_relative_difference([2.0, float("nan")], [2.0, 2.0])
    nan
    """
    differences = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, eager, strict=True)]
    return float(np.max(differences, initial=0.0))


def batches(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[Any]:
    """``(images, labels)`` per step; each size as often as the others, in a random order."""
    order = [args.sizes[step % len(args.sizes)] for step in range(args.steps)]
    random.Random(args.seed).shuffle(order)
    generator = torch.Generator().manual_seed(args.seed)
    data = []
    for size in order:
        images = torch.randn(args.batch, 3, size, size, generator=generator)
        labels = torch.randint(CLASSES, (args.batch,), generator=generator)
        data.append((images.to(device, dtype), labels.to(device)))
    return data


def train(
    model: Model,
    data: Sequence[Any],
    device: torch.device,
    resize: Callable[[Any], Any] | None = None,
) -> tuple[list[float], list[float]]:
    """Losses and seconds per step of AdamW on ``data``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, seconds = [], []
    for images, labels in data:
        if resize is not None:
            images = resize(images)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, seconds


def median_ms(seconds: Sequence[float], skip: int) -> float:
    """Median step time in ms, leaving out the first ``skip`` steps (allocator warmup)."""
    return 1e3 * statistics.median(seconds[skip:] or seconds)


def mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        # torch's one-time note when its autograd thread first meets cuBLAS during a capture
        warnings.filterwarnings("ignore", "Attempting to run cuBLAS, but there was no current")
        # full float32 products and a deterministic patch-embedding convolution, so that eager
        # agrees with itself (and so with the graphs) to the last bit
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(args.seed)
    eager = Model(args).to(device, dtype)
    graphed = copy.deepcopy(eager)
    data = batches(args, device, dtype)

    def sample(size: int) -> torch.Tensor:
        return torch.randn(args.batch, 3, size, size, device=device, dtype=dtype)

    start = time.perf_counter()
    dgt.make_graphed_callables(graphed.encoder, buckets=[(sample(s),) for s in args.sizes])
    capture_seconds = time.perf_counter() - start
    report = dgt.diagnostics(graphed.encoder)
    print(
        f"variable_resolution: {args.layers} blocks of dim {args.dim}, batch {args.batch}, "
        f"{args.dtype} on {device}, sizes {args.sizes} px, {args.steps} steps in random order; "
        f"dualgraph backend {report.backend}, {len(args.sizes)} buckets captured in "
        f"{capture_seconds:.2f} s"
    )
    eager_losses, eager_seconds = train(eager, data, device)
    losses, seconds = train(graphed, data, device)
    skip = len(args.sizes)  # each size's first step allocates
    eager_ms, graphed_ms = median_ms(eager_seconds, skip), median_ms(seconds, skip)
    print(f"eager               {eager_ms:9.2f} ms/step")
    print(f"dualgraph buckets   {graphed_ms:9.2f} ms/step ({eager_ms / graphed_ms:.2f}x eager)")
    calls = ", ".join(
        f"{args.sizes[b.index]} px: {b.calls}" for b in dgt.diagnostics(graphed.encoder).buckets
    )
    print(f"steps per bucket: {calls}")

    tolerance = loss_tolerance(device, dtype)
    worst = worst_relative_difference(losses, eager_losses)
    ok = worst <= tolerance  # False for a NaN
    verdict = "match" if ok else "differ from"
    print(
        f"dualgraph buckets: losses {verdict} eager: {len(losses)} steps, largest relative "
        f"difference {worst:.3g} (tolerance {tolerance:g})"
    )

    if device.type == "cuda":
        largest = max(args.sizes)
        padded = copy.deepcopy(eager)
        dgt.make_graphed_callables(padded.encoder, buckets=[(sample(largest),)])
        padded_pool = dgt.diagnostics(padded.encoder).pool_bytes

        def pad(images: torch.Tensor) -> torch.Tensor:
            extra = largest - images.shape[-1]
            return torch.nn.functional.pad(images, (0, extra, 0, extra))

        _, padded_seconds = train(padded, data, device, resize=pad)
        separate = 0
        for size in args.sizes:
            one = copy.deepcopy(eager)
            dgt.make_graphed_callables(one.encoder, buckets=[(sample(size),)])
            separate += dgt.diagnostics(one.encoder).pool_bytes
            del one
        pool = report.pool_bytes
        padded_ms = median_ms(padded_seconds, 1)
        print(
            f"one graph at {largest} px (every batch padded to it): {padded_ms:9.2f} ms/step, "
            f"pool {mib(padded_pool)}"
        )
        print(
            f"pool memory: buckets {mib(pool)} = {pool / padded_pool:.2f}x one graph at "
            f"{largest} px; one pool per size would take {mib(separate)}"
        )
    else:
        print("pool memory: none on the CPU (the emulate backend has no CUDA pool)")
    print("variable_resolution: OK" if ok else "variable_resolution: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
