"""A vision encoder trained with every block graphed, side by side with eager, checked against JAX.

The encoder (``dualgraph.models.torch_vit.VisionEncoder``) has blocks that return
``(hidden, None)`` and returns ``{"hidden", "pooled", "aux_loss": None}``: the outputs
``torch.cuda.make_graphed_callables`` cannot capture. This script

1. builds the encoder with a classification head twice from one seed, and graphs every block of
   one copy with a single ``make_graphed_callables`` call (one shared memory pool);
2. trains both copies with AdamW on the same batches and fails (exit code 1) if their losses
   differ by more than the tolerance of the dtype;
3. cross-checks the graphed encoder's forward and backward against the JAX reference of the same
   encoder (``dualgraph.models.jax_vit``) with ``dualgraph.parity`` and prints its report;
4. prints a summary: backend, median step times, speedup, peak memory, parity.

    python examples/vision_encoder.py                 # CUDA graphs on a GPU, else the CPU
    python examples/vision_encoder.py --steps 3 --device cpu
    python examples/vision_encoder.py --dtype bfloat16 --layers 12 --dim 384 --heads 6 --batch 32

On a CPU the ``auto`` backend is ``emulate``: the same static input, output and grad buffers as a
CUDA graph, with the blocks re-run on them instead of a graph replay, so the path that real graphs
take (and its aliasing rules) is exercised without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from tqdm import tqdm

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import VisionEncoder

PATCH = 8
CLASSES = 10
#: How far the graphed loss may be from the eager one, relative to the loss, by (device, dtype).
#: Graphed and eager run the same kernels, so they agree exactly in practice; these bound what
#: a different kernel choice could change (float32 on a GPU with TF32 off).
LOSS_TOLERANCE = {
    ("cpu", "float32"): 1e-6,
    ("cuda", "float32"): 1e-5,
    ("cpu", "bfloat16"): 2e-2,
    ("cuda", "bfloat16"): 2e-2,
}


class Classifier(torch.nn.Module):
    """The encoder's pooled features through a linear head; the encoder's ``aux_loss`` kept."""

    def __init__(self, encoder: VisionEncoder, dim: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(dim, CLASSES)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.encoder(images)
        return self.head(out["pooled"]), out["aux_loss"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--layers", type=int, default=2, help="encoder blocks, all graphed")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32, help=f"a multiple of {PATCH}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        choices=["auto", "cuda", "emulate", "eager"],
        default="auto",
        help="auto: real CUDA graphs on a GPU, 'emulate' (static buffers, no graph) on a CPU",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.image_size % PATCH:
        parser.error(f"--image-size must be a multiple of {PATCH}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backend, why = choose_backend(args.backend, device)
    # JAX runs where torch does: on the CPU it must not take the GPU, and on the GPU it must not
    # reserve most of its memory up front. Both are read when JAX starts, so set them now.
    if device.type == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if device.type == "cuda":
        # torch's one-time note when its autograd thread first meets cuBLAS during a capture
        # (torch.cuda.make_graphed_callables prints it too); harmless.
        warnings.filterwarnings("ignore", "Attempting to run cuBLAS, but there was no current")
        # Full float32 products and a deterministic patch-embedding convolution, so that the
        # eager model agrees with itself (and so with the graphed one) to the last bit.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    torch.manual_seed(args.seed)
    encoder = VisionEncoder(
        image_size=args.image_size,
        patch_size=PATCH,
        dim=args.dim,
        depth=args.layers,
        heads=args.heads,
    )
    eager = Classifier(encoder, args.dim).to(device, dtype)
    graphed = copy.deepcopy(eager)
    tokens = (args.image_size // PATCH) ** 2
    print(
        f"vision encoder: {args.layers} blocks, dim {args.dim}, {args.heads} heads, "
        f"{tokens} tokens, batch {args.batch}, {args.dtype} on {device.type}; "
        f"backend {backend} ({why})"
    )

    # Every block graphed by one call: captured in order, one memory pool. The sample is the
    # hidden state a block sees: (batch, tokens, dim), requiring grad like the real one.
    sample = torch.randn(args.batch, tokens, args.dim, device=device, dtype=dtype)
    sample.requires_grad_()
    blocks = tuple(graphed.encoder.blocks)
    dgt.make_graphed_callables(blocks, tuple((sample,) for _ in blocks), backend=backend)

    run = train(eager, graphed, args, device, dtype)
    run["pool_bytes"] = dgt.diagnostics(blocks[0]).pool_bytes  # one pool, shared by all blocks
    tolerance = LOSS_TOLERANCE[(device.type, args.dtype)]
    losses_ok, loss_line = compare_losses(run["losses"], tolerance, device, args.dtype)
    print(loss_line)

    report = parity_report(graphed.encoder, args, device, dtype)
    print(report)

    print_summary(args, device, backend, why, run, loss_line, report)
    if not losses_ok:
        print(f"vision_encoder: FAILED: {loss_line}", file=sys.stderr)
        return 1
    if not report.ok:
        print(f"vision_encoder: FAILED: parity with JAX: {report.worst_path}", file=sys.stderr)
        return 1
    print("vision_encoder: OK")
    return 0


def choose_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """The dualgraph backend to use, and why."""
    if requested != "auto":
        return requested, "--backend"
    if device.type == "cuda":
        return "cuda", "real CUDA graphs"
    return "emulate", "no GPU: static buffers without a graph, so the replay path still runs"


# -- training --------------------------------------------------------------------------------------


def train(
    eager: Classifier,
    graphed: Classifier,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Train both models on the same batches.

    Per model: the losses, the seconds of each step and, on a GPU, the most memory a step
    allocated on top of what was resident when it started (both models, the graph pool).
    """
    models = {"eager": eager, "graphed": graphed}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    losses: dict[str, list[float]] = {name: [] for name in models}
    seconds: dict[str, list[float]] = {name: [] for name in models}
    peak = dict.fromkeys(models, 0)
    data = torch.Generator().manual_seed(args.seed + 1)
    size = args.image_size
    for _ in tqdm(range(args.steps), desc="training", unit="step", disable=None):
        images = torch.randn(args.batch, 3, size, size, generator=data).to(device, dtype)
        labels = torch.randint(0, CLASSES, (args.batch,), generator=data).to(device)
        for name, model in models.items():  # the same batch for both, one after the other
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)  # both models, graph pool
            start = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            logits, aux_loss = model(images)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            if aux_loss is not None:  # None here: the encoder has no auxiliary loss
                loss = loss + aux_loss
            loss.backward()
            optimizers[name].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                step_peak = torch.cuda.max_memory_allocated(device) - resident
                peak[name] = max(peak[name], step_peak)
            seconds[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())
            del logits, loss  # no autograd graph left alive between steps
    return {"losses": losses, "seconds": seconds, "peak": peak}


def compare_losses(
    losses: dict[str, list[float]], tolerance: float, device: torch.device, dtype: str
) -> tuple[bool, str]:
    """Whether every step's graphed loss is within ``tolerance`` (relative) of the eager one."""
    worst, worst_step = 0.0, 0
    for step, (eager, graphed) in enumerate(zip(losses["eager"], losses["graphed"], strict=True)):
        difference = abs(graphed - eager) / max(1.0, abs(eager))
        if difference > worst:
            worst, worst_step = difference, step
    eager, graphed = losses["eager"][worst_step], losses["graphed"][worst_step]
    where = f"{dtype} on {device.type}"
    if worst <= tolerance:
        return True, (
            f"losses match: {len(losses['eager'])} steps, largest relative difference {worst:.3g} "
            f"(tolerance {tolerance:g} for {where}); last loss {losses['eager'][-1]:.6f}"
        )
    return False, (
        f"losses differ at step {worst_step}: graphed {graphed:.8g}, eager {eager:.8g} "
        f"(relative difference {worst:.3g} > tolerance {tolerance:g} for {where})"
    )


# -- parity with JAX -------------------------------------------------------------------------------


def parity_report(
    encoder: VisionEncoder, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> Any:
    """The graphed encoder against the JAX reference: outputs, input grads, parameter grads."""
    import functools

    from dualgraph.models import jax_vit
    from dualgraph.parity import compare

    generator = torch.Generator().manual_seed(args.seed + 2)
    size = args.image_size
    images = torch.randn(args.batch, 3, size, size, generator=generator).to(device, dtype)
    params = jax_vit.params_from_state_dict(encoder.state_dict())
    return compare(
        encoder,
        functools.partial(jax_vit.vision_encoder, heads=args.heads),
        (images,),
        params=params,
        params_from_torch=jax_vit.params_from_state_dict,
    )


# -- summary ---------------------------------------------------------------------------------------


def print_summary(
    args: argparse.Namespace,
    device: torch.device,
    backend: str,
    why: str,
    run: dict[str, Any],
    loss_line: str,
    report: Any,
) -> None:
    # The first step of each model is left out of the medians: it includes one-time set-up.
    timed = {name: s[1:] or s for name, s in run["seconds"].items()}
    eager_ms = 1e3 * statistics.median(timed["eager"])
    graphed_ms = 1e3 * statistics.median(timed["graphed"])
    if device.type == "cuda":
        mib = {name: peak / 2**20 for name, peak in run["peak"].items()}
        pool = run["pool_bytes"] / 2**20
        memory = (
            f"a step allocates up to {mib['eager']:.1f} MiB eager, {mib['graphed']:.1f} MiB "
            f"graphed, besides the graphs' pool of {pool:.1f} MiB (held between steps)"
        )
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        memory = f"n/a on the CPU (process peak RSS {rss:.0f} MiB, both models and JAX)"
    speedup_note = ""
    if backend != "cuda":  # emulate re-runs each block and copies its buffers: no graph to win
        speedup_note = f" ({backend}: the speedup comes from real CUDA graphs, on a GPU)"
    rows = [
        ("device", f"{device.type}, {args.dtype}"),
        ("backend", f"{backend} ({why})"),
        ("model", f"{args.layers} graphed blocks, dim {args.dim}, batch {args.batch}"),
        ("steps", str(args.steps)),
        ("losses", loss_line.partition(";")[0].removeprefix("losses ")),
        ("step time eager", f"{eager_ms:.2f} ms (median)"),
        ("step time graphed", f"{graphed_ms:.2f} ms (median)"),
        ("speedup", f"{eager_ms / graphed_ms:.2f}x{speedup_note}"),
        ("peak memory", memory),
        ("parity vs JAX", str(report).splitlines()[0]),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")


if __name__ == "__main__":
    sys.exit(main())
