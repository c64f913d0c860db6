"""Train a vision encoder eagerly and with its blocks graphed by torch, TE and dualgraph; vs JAX.

The encoder (``dualgraph.models.torch_vit.VisionEncoder``) has blocks that return
``(hidden, None)``: an output ``torch.cuda.make_graphed_callables`` cannot capture. From one
seed, this script builds the encoder with a classification head once per variant:

- ``eager``: no graphs, the reference;
- ``torch.cuda``: ``torch.cuda.make_graphed_callables`` on every block, through a wrapper that
  returns the hidden tensor alone and one that puts the ``None`` back (what users write today);
  GPU only;
- ``te``: Transformer Engine's ``make_graphed_callables`` on every block as it is; GPU only, and
  only where ``transformer_engine`` imports (otherwise a line says why it was skipped);
- ``dualgraph``: ``dualgraph.torch.make_graphed_callables`` on every block as it is;
- ``dualgraph in_graph``: the same with ``param_grads="in_graph"``.

It trains every variant with AdamW on the same batches, in interleaved rounds, and prints
per variant the step time (forward + backward + optimizer step, median over rounds), the
capture time, the memory (a step's peak allocation and the graphs' pool) and whether its losses
match eager's; then it cross-checks the dualgraph encoder's forward and backward against the JAX
reference (``dualgraph.models.jax_vit``) with ``dualgraph.parity``, and saves a bar chart of the
step times (``--plot``). Exit code 1 if a loss or the parity check is off.

    python examples/vision_encoder.py               # GPU: ViT-S/16 in bf16; CPU: a small encoder
    python examples/vision_encoder.py --device cpu --steps 3 --plot step_time.png
    python examples/vision_encoder.py --batch 2     # GPU only: host-bound, where graphs pay most

The GPU default is ViT-S/16-sized (12 blocks, dim 384, 6 heads, 224 px images in 16 px patches:
196 tokens, as ViT-S/16 less its class token), bfloat16, batch 32. The same sizes on a CPU take
tens of seconds a step: the CPU default is 2 blocks of dim 64 in float32. There the dualgraph
backend is ``emulate``: the static input, output and grad buffers of a CUDA graph, the blocks
re-run on them instead of a replay, so the path real graphs take (and its aliasing rules) runs
without a GPU; speedups come from real graphs only.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import itertools
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import VisionEncoder

CLASSES = 10
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLOT = ROOT / "benchmarks" / "results" / "vision_encoder_step_time.png"

#: The defaults of the flags that depend on the device: ViT-S/16 on a GPU, a small encoder on a CPU.
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {
        "layers": 12,
        "dim": 384,
        "heads": 6,
        "image_size": 224,
        "patch": 16,
        "batch": 32,
        "dtype": "bfloat16",
        "steps": 100,
        "warmup": 3,
        "plot": DEFAULT_PLOT,
    },
    "cpu": {
        "layers": 2,
        "dim": 64,
        "heads": 4,
        "image_size": 32,
        "patch": 8,
        "batch": 8,
        "dtype": "float32",
        "steps": 10,
        "warmup": 1,
        "plot": None,
    },
}

#: How far a graphed loss may be from the eager one, relative to the loss, by (device, dtype).
#: On the CPU the emulate backend runs eager's kernels on the same values: bit for bit, in every
#: dtype. On a GPU graphed and eager agree exactly in practice; these bound what a different
#: kernel choice could change (float32 with TF32 off).
LOSS_TOLERANCE = {
    ("cpu", "float32"): 0.0,
    ("cuda", "float32"): 1e-5,
    ("cpu", "bfloat16"): 0.0,
    ("cuda", "bfloat16"): 2e-2,
}

#: Above this many multiply-adds per block pass (batch * tokens * dim**2), a CPU run is slow.
CPU_SLOW_WORK = 10**9


# -- flags -----------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def seed(text: str) -> int:
    """An argparse type: a seed for ``torch.manual_seed``, 0 to 2**32 - 1."""
    value = _integer(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**32 - 1, got {text!r}")
    return value


def png_path(text: str) -> Path:
    """An argparse type: where to save the plot, a path ending in ``.png``."""
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"must be a path ending in .png, got {text!r}")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a file")
    folder = path.absolute().parent  # made when the chart is saved, if it is not there
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot make a folder for {text!r}: {folder} is a file")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is read-only")
    return path


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    def by_device(flag: str, what: str) -> str:
        gpu, cpu = (str(DEFAULTS[device][flag]) for device in ("cuda", "cpu"))
        return f"{what} (default: {gpu} on a GPU, {cpu} on the CPU)"

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="The GPU-sized defaults take tens of seconds a step on a CPU: there, keep the "
        "CPU defaults or pass small sizes.",
    )
    has_cuda = torch.cuda.is_available()
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if has_cuda else "cpu",
        help="where to train (default: cuda where a GPU is available, else cpu; here: %(default)s)",
    )
    parser.add_argument("--layers", type=positive_int, help=by_device("layers", "encoder blocks"))
    parser.add_argument("--dim", type=positive_int, help=by_device("dim", "model width"))
    parser.add_argument(
        "--heads", type=positive_int, help=by_device("heads", "attention heads; divide --dim")
    )
    parser.add_argument(
        "--image-size", type=positive_int, help=by_device("image_size", "image side in pixels")
    )
    parser.add_argument(
        "--patch", type=positive_int, help=by_device("patch", "patch side; divides --image-size")
    )
    parser.add_argument("--batch", type=positive_int, help=by_device("batch", "images per step"))
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help=by_device("dtype", "parameter dtype")
    )
    parser.add_argument(
        "--steps", type=positive_int, help=by_device("steps", "timed training steps per variant")
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        help=by_device("warmup", "untimed training steps per variant, first"),
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        help="interleaved rounds the timed steps are split into; the step time is the median "
        "over rounds (default: 5, or --steps when fewer)",
    )
    parser.add_argument(
        "--parity-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of the parity check against JAX; in bfloat16, rounding through many blocks "
        "can exceed its per-leaf tolerance on some grads (12 blocks did on a CPU) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "cuda", "emulate", "eager"],
        default="auto",
        help="dualgraph's backend; auto: real CUDA graphs on a GPU, 'emulate' (static buffers, "
        "no graph) on a CPU (default: %(default)s)",
    )
    plot = parser.add_mutually_exclusive_group()
    plot.add_argument(
        "--plot",
        type=png_path,
        metavar="PATH",
        help="save a bar chart of the step times here (default on a GPU: "
        f"{DEFAULT_PLOT.relative_to(ROOT)}; on the CPU: none)",
    )
    plot.add_argument("--no-plot", action="store_true", help="save no chart")
    parser.add_argument("--seed", type=seed, default=0, help="model and data seed (default: 0)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, with the device's defaults filled in; a bad flag exits with code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if args.device == "cuda" and not has_cuda:
        parser.error("--device cuda: no CUDA device is available")
    if args.backend == "cuda" and args.device != "cuda":
        if has_cuda:
            parser.error("--backend cuda needs --device cuda")
        parser.error("--backend cuda: no CUDA device is available (use emulate or eager)")
    plot_asked = args.plot is not None
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.no_plot:
        args.plot = None
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.image_size % args.patch:
        parser.error(
            f"--image-size ({args.image_size}) must be a multiple of --patch ({args.patch})"
        )
    if args.rounds is None:
        args.rounds = min(5, args.steps)
    elif args.rounds > args.steps:
        parser.error(f"--rounds ({args.rounds}) must be at most --steps ({args.steps})")
    if plot_asked and not installed("matplotlib"):
        parser.error("--plot needs matplotlib: pip install 'dualgraph[examples]'")
    return args


# -- the model and its variants --------------------------------------------------------------------


class Classifier(torch.nn.Module):
    """The encoder's pooled features through a linear head; the encoder's ``aux_loss`` kept."""

    def __init__(self, encoder: VisionEncoder, dim: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(dim, CLASSES)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.encoder(images)
        return self.head(out["pooled"]), out["aux_loss"]


class HiddenOnly(torch.nn.Module):
    """A block returning ``hidden`` alone: what ``torch.cuda.make_graphed_callables`` can take."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


class WithNone(torch.nn.Module):
    """A graphed ``HiddenOnly`` back in the encoder, which expects ``(hidden, None)``."""

    def __init__(self, graphed: torch.nn.Module) -> None:
        super().__init__()
        self.graphed = graphed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.graphed(x), None


@dataclass
class Variant:
    """One way of running the encoder, and what its training measured."""

    name: str
    about: str
    model: Classifier | None = None
    skipped: str = ""  # why the variant did not run
    optimizer: torch.optim.Optimizer | None = None
    capture_seconds: float | None = None
    pool_bytes: int | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)  # ms per step, one value a round
    step_peak_bytes: int | None = None

    @property
    def step_ms(self) -> float:
        return statistics.median(self.round_ms)


def make_classifier(args: argparse.Namespace, dtype: torch.dtype) -> Classifier:
    """The encoder with its head, from ``--seed``, on ``--device``."""
    torch.manual_seed(args.seed)
    encoder = VisionEncoder(
        image_size=args.image_size,
        patch_size=args.patch,
        dim=args.dim,
        depth=args.layers,
        heads=args.heads,
    )
    return Classifier(encoder, args.dim).to(args.device, dtype)


def block_samples(args: argparse.Namespace, dtype: torch.dtype) -> tuple[tuple[torch.Tensor], ...]:
    """One sample per block: the hidden state it sees, requiring grad like the real one."""
    shape = (args.batch, (args.image_size // args.patch) ** 2, args.dim)
    return tuple(
        (torch.randn(shape, device=args.device, dtype=dtype, requires_grad=True),)
        for _ in range(args.layers)
    )


def build_variants(args: argparse.Namespace, backend: str) -> list[Variant]:
    """Every variant's model, graphed as it says, from one seed; peers skipped with the reason."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base = make_classifier(args, dtype)

    def samples() -> tuple[tuple[torch.Tensor], ...]:
        return block_samples(args, dtype)

    def graph_with_torch(model: Classifier) -> None:
        wrappers = tuple(HiddenOnly(block) for block in model.encoder.blocks)
        graphed = torch.cuda.make_graphed_callables(wrappers, samples())
        for index, module in enumerate(graphed):
            model.encoder.blocks[index] = WithNone(module)

    def graph_with_te(model: Classifier) -> None:
        te = transformer_engine()
        blocks = tuple(model.encoder.blocks)
        graphed = te.make_graphed_callables(blocks, samples())
        for block, replayed in zip(blocks, graphed, strict=True):
            if replayed is not block:  # TE graphs a module in place and hands it back
                raise RuntimeError(f"TE returned {type(replayed).__name__}, not the module")

    def graph_with_dualgraph(param_grads: str) -> Callable[[Classifier], None]:
        def graph(model: Classifier) -> None:
            blocks = tuple(model.encoder.blocks)
            dgt.make_graphed_callables(blocks, samples(), backend=backend, param_grads=param_grads)

        return graph

    on_gpu = device.type == "cuda"
    te_missing = transformer_engine_missing() if on_gpu else "needs a CUDA device"
    plans: list[tuple[str, str, Callable[[Classifier], None] | None, str]] = [
        ("eager", "no graphs", None, ""),
        (
            "torch.cuda",
            "torch.cuda.make_graphed_callables per block, via a hidden-only wrapper",
            graph_with_torch,
            "" if on_gpu else "needs a CUDA device",
        ),
        ("te", "Transformer Engine's make_graphed_callables per block", graph_with_te, te_missing),
        (
            "dualgraph",
            f"dualgraph.torch.make_graphed_callables per block, backend {backend}",
            graph_with_dualgraph("auto"),
            "",
        ),
        (
            "dualgraph in_graph",
            'the same with param_grads="in_graph"',
            graph_with_dualgraph("in_graph"),
            "",
        ),
    ]
    variants = []
    for name, about, graph, skipped in plans:
        variant = Variant(name, about, skipped=skipped)
        variants.append(variant)
        if skipped:
            continue
        model = base if graph is None else copy.deepcopy(base)  # copied before any training
        if graph is not None:
            try:
                variant.capture_seconds, variant.pool_bytes = timed_capture(graph, model, device)
            except Exception as error:
                if name.startswith("dualgraph"):
                    raise
                variant.skipped = f"capture failed: {type(error).__name__}: {error}"
                continue
        if name.startswith("dualgraph") and on_gpu:  # one pool for all blocks, sized by dualgraph
            variant.pool_bytes = dgt.diagnostics(model.encoder.blocks[0]).pool_bytes
        variant.model = model
        # Fused AdamW on the GPU: one kernel launch a step, as fast training loops use it.
        variant.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=on_gpu or None)
    return variants


def timed_capture(
    graph: Callable[[Classifier], None], model: Classifier, device: torch.device
) -> tuple[float, int | None]:
    """Seconds ``graph(model)`` took, and the bytes of the memory pools it made (GPU only)."""
    synchronize(device)
    pools = pool_bytes(device)
    start = time.perf_counter()
    graph(model)
    synchronize(device)
    seconds = time.perf_counter() - start
    after = pool_bytes(device)
    if pools is None or after is None:
        return seconds, None
    return seconds, sum(size for pool, size in after.items() if pool not in pools)


def pool_bytes(device: torch.device) -> dict[tuple[int, ...], int] | None:
    """Bytes the CUDA caching allocator holds in each private pool; None off the GPU."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    sizes: dict[tuple[int, ...], int] = {}
    for segment in torch.cuda.memory_snapshot():
        if "segment_pool_id" not in segment:  # a torch too old to say
            return None
        pool = tuple(segment["segment_pool_id"])
        if segment.get("device", index) == index and pool != (0, 0):  # (0, 0): the default pool
            sizes[pool] = sizes.get(pool, 0) + segment["total_size"]
    return sizes


@functools.cache
def transformer_engine() -> Any:
    """``transformer_engine.pytorch`` (its import-time notices about JAX and TorchScript hidden)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected a Jax installation", RuntimeWarning)
        warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated")
        import transformer_engine.pytorch as te
    return te


def transformer_engine_missing() -> str:
    """Why Transformer Engine cannot be used here, or "" when it imports."""
    try:
        transformer_engine()
    except Exception as error:  # ImportError, or TE failing to load its CUDA libraries
        return f"transformer_engine does not import ({type(error).__name__}: {error})"
    return ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- training --------------------------------------------------------------------------------------


def train(variants: list[Variant], args: argparse.Namespace) -> None:
    """Train every variant on the same batches: warm-up steps, then interleaved timed rounds.

    Each round draws its batches, then runs them through each variant in turn (the order
    rotates from round to round), timing the variant's steps of the round together.
    """
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    running = [variant for variant in variants if variant.model is not None]
    data = torch.Generator().manual_seed(args.seed + 1)

    def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = args.image_size
        return [
            (
                torch.randn(args.batch, 3, size, size, generator=data).to(device, dtype),
                torch.randint(0, CLASSES, (args.batch,), generator=data).to(device),
            )
            for _ in range(count)
        ]

    warmup = batches(args.warmup)
    for variant in running:
        for images, labels in warmup:
            variant.losses.append(train_step(variant, images, labels))
    round_sizes = [len(part) for part in split(range(args.steps), args.rounds)]
    progress = tqdm(total=args.steps * len(running), desc="training", unit="step", disable=None)
    for index, size in enumerate(round_sizes):
        round_batches = batches(size)
        shift = index % len(running)
        for variant in running[shift:] + running[:shift]:
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)  # every model, the graph pools
            start = time.perf_counter()
            for images, labels in round_batches:
                variant.losses.append(train_step(variant, images, labels))
            synchronize(device)
            variant.round_ms.append(1e3 * (time.perf_counter() - start) / size)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - resident
                variant.step_peak_bytes = max(variant.step_peak_bytes or 0, peak)
            progress.update(size)
    progress.close()


def train_step(variant: Variant, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Forward, backward and an AdamW step; the loss, detached (read after the timing)."""
    assert variant.model is not None and variant.optimizer is not None
    variant.optimizer.zero_grad(set_to_none=True)
    logits, aux_loss = variant.model(images)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels)
    if aux_loss is not None:  # None here: the encoder has no auxiliary loss
        loss = loss + aux_loss
    loss.backward()
    variant.optimizer.step()
    return loss.detach()  # no autograd graph left alive between steps


def split(items: Sequence[int], parts: int) -> list[Sequence[int]]:
    """``items`` in ``parts`` consecutive runs whose lengths differ by at most one."""
    size, extra = divmod(len(items), parts)
    bounds = [index * size + min(index, extra) for index in range(parts + 1)]
    return [items[start:end] for start, end in itertools.pairwise(bounds)]


def compare_losses(
    eager: Sequence[float], graphed: Sequence[float], tolerance: float, where: str
) -> tuple[bool, str]:
    """Whether every step's graphed loss is within ``tolerance`` (relative) of the eager one."""
    if len(eager) != len(graphed):
        return False, f"{len(graphed)} losses against eager's {len(eager)}"
    differences = [
        abs(loss - reference) / max(1.0, abs(reference))
        for reference, loss in zip(eager, graphed, strict=True)
    ]
    # numpy's max keeps a NaN, which Python's max drops after a finite value (argmax: its step)
    worst = float(np.max(differences, initial=0.0))
    worst_step = int(np.argmax(differences)) if differences else 0
    if worst <= tolerance:  # False for a NaN
        return True, (
            f"losses match eager: {len(eager)} steps, largest relative difference {worst:.3g} "
            f"(tolerance {tolerance:g} for {where})"
        )
    return False, (
        f"losses differ at step {worst_step}: graphed {graphed[worst_step]:.8g}, eager "
        f"{eager[worst_step]:.8g} (relative difference {worst:.3g} > tolerance {tolerance:g} "
        f"for {where})"
    )


# -- parity with JAX -------------------------------------------------------------------------------


def parity_report(graphed: Classifier, args: argparse.Namespace, backend: str) -> Any:
    """The dualgraph encoder against the JAX reference: outputs, input grads, parameter grads.

    In ``--parity-dtype``: ``graphed``'s own encoder when that is the training dtype, else a
    fresh encoder in that dtype with its blocks graphed the same way.
    """
    dtype = getattr(torch, args.parity_dtype)
    encoder = graphed.encoder
    if args.parity_dtype != args.dtype:  # captured before JAX starts, so no JAX thread is busy
        encoder = make_classifier(args, dtype).encoder
        blocks = tuple(encoder.blocks)
        dgt.make_graphed_callables(blocks, block_samples(args, dtype), backend=backend)

    from dualgraph.models import jax_vit
    from dualgraph.parity import compare

    generator = torch.Generator().manual_seed(args.seed + 2)
    size = args.image_size
    images = torch.randn(args.batch, 3, size, size, generator=generator).to(args.device, dtype)
    params = jax_vit.params_from_state_dict(encoder.state_dict())
    return compare(
        encoder,
        functools.partial(jax_vit.vision_encoder, heads=args.heads),
        (images,),
        params=params,
        params_from_torch=jax_vit.params_from_state_dict,
    )


# -- report ----------------------------------------------------------------------------------------


def mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f}"


def summary_table(variants: list[Variant], verdicts: dict[str, str]) -> list[str]:
    """One line a variant: step time, speedup over eager, capture time, memory, losses."""
    eager_ms = variants[0].step_ms
    titles = ("variant", "ms/step", "x eager", "capture s", "step peak MiB", "pool MiB", "losses")
    rows: list[tuple[str, ...]] = [titles]
    for variant in variants:
        if variant.skipped:
            rows.append((variant.name, f"skipped: {variant.skipped}"))
            continue
        capture = "-" if variant.capture_seconds is None else f"{variant.capture_seconds:.2f}"
        rows.append(
            (
                variant.name,
                f"{variant.step_ms:.2f}",
                f"{eager_ms / variant.step_ms:.2f}",
                capture,
                mib(variant.step_peak_bytes),
                mib(variant.pool_bytes) if variant.capture_seconds is not None else "-",
                verdicts.get(variant.name, "reference"),
            )
        )
    full = [row for row in rows if len(row) == len(titles)]
    widths = [max(len(row[column]) for row in full) for column in range(len(titles))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        if len(row) == len(titles):
            pairs = zip(row[1:-1], widths[1:-1], strict=True)
            cells += [cell.rjust(width) for cell, width in pairs]
        lines.append("  ".join([*cells, row[-1]]))
    return lines


def save_plot(path: Path, variants: list[Variant], title: str) -> None:
    """A bar chart of the step time of every variant that ran, as a PNG (matplotlib's Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ran = [variant for variant in variants if not variant.skipped]
    eager_ms = ran[0].step_ms
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colors = {"eager": "#8c8c8c", "torch.cuda": "#e07b39", "te": "#59a14f"}
    bars = axes.bar(
        [variant.name for variant in ran],
        [variant.step_ms for variant in ran],
        color=[colors.get(variant.name, "#4e79a7") for variant in ran],
    )
    axes.bar_label(
        bars,
        labels=[f"{v.step_ms:.2f} ms\n{eager_ms / v.step_ms:.2f}x eager" for v in ran],
        fontsize=9,
    )
    axes.set_ylabel("ms per training step (median over rounds)")
    axes.set_ylim(0, 1.25 * max(variant.step_ms for variant in ran))
    axes.set_title(title, fontsize=10)
    skipped = [f"{v.name} skipped: {v.skipped}" for v in variants if v.skipped]
    if skipped:
        axes.set_xlabel("\n".join(line[:110] for line in skipped), fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)


# -- main ------------------------------------------------------------------------------------------


def choose_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """The dualgraph backend to use, and why."""
    if requested != "auto":
        return requested, "--backend"
    if device.type == "cuda":
        return "cuda", "real CUDA graphs"
    return "emulate", "no GPU: static buffers without a graph, so the replay path still runs"


def configure(device: torch.device) -> None:
    """JAX beside torch, and torch's numerics made reproducible (eager agrees with itself)."""
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
        # eager model agrees with itself (and so with the graphed ones) to the last bit.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except torch.cuda.OutOfMemoryError as error:
        print(
            f"vision_encoder: out of GPU memory, try a smaller --batch ({error})", file=sys.stderr
        )
        return 1


def run(args: argparse.Namespace) -> int:
    """Build, graph and train every variant, check parity, report; 1 if something is off."""
    device = torch.device(args.device)
    backend, why = choose_backend(args.backend, device)
    configure(device)
    tokens = (args.image_size // args.patch) ** 2
    where = f"{args.dtype} on {device.type}"
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    model_line = (
        f"{args.layers} blocks, dim {args.dim}, {args.heads} heads, {tokens} tokens "
        f"({args.image_size} px, {args.patch} px patches), batch {args.batch}, {where}"
    )
    print(f"vision encoder: {model_line}; dualgraph backend {backend} ({why})")
    if device.type == "cpu" and args.batch * tokens * args.dim**2 > CPU_SLOW_WORK:
        print("note: a GPU-sized encoder on the CPU: expect tens of seconds a step")

    variants = build_variants(args, backend)
    train(variants, args)

    print(f"\nvariants (a step: forward, backward, AdamW; warm-up steps: {args.warmup})")
    for variant in variants:
        print(f"  {variant.name}: {variant.about}")
    tolerance = LOSS_TOLERANCE[(device.type, args.dtype)]
    numerics = f"{args.dtype} on {device.type}"
    eager_losses = torch.stack(variants[0].losses).tolist()
    verdicts, failures = {}, []
    for variant in variants[1:]:
        if variant.skipped:
            continue
        ok, message = compare_losses(
            eager_losses, torch.stack(variant.losses).tolist(), tolerance, numerics
        )
        print(f"{variant.name}: {message}")
        verdicts[variant.name] = "match" if ok else "DIFFER"
        if not ok:
            failures.append(f"{variant.name}: {message}")

    dualgraph = next(variant for variant in variants if variant.name == "dualgraph")
    assert dualgraph.model is not None
    if not installed("jax"):
        parity = "skipped: JAX is not installed (pip install 'dualgraph[jax]')"
    else:
        report = parity_report(dualgraph.model, args, backend)
        print(report)
        how = "" if args.parity_dtype == args.dtype else " copy, its blocks graphed the same way"
        parity = f"{args.parity_dtype}{how}: {str(report).splitlines()[0]}"
        if not report.ok:
            failures.append(f"parity with JAX: {report.worst_path}")

    print(
        f"\nsummary: {model_line}\nstep time: median of {args.rounds} interleaved rounds, "
        f"{args.steps} timed steps per variant"
    )
    for line in summary_table(variants, verdicts):
        print(f"  {line}")
    if device.type == "cuda":
        print(
            "  memory: step peak = the most a step allocates on top of what is resident; "
            "pool = the memory pool a variant's graphs hold between steps"
        )
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(f"  memory: n/a on the CPU (process peak RSS {rss:.0f} MiB, every variant and JAX)")
    if backend != "cuda":  # emulate re-runs each block and copies its buffers: no graph to win
        print(f"  speedups come from real CUDA graphs (on a GPU); here dualgraph runs {backend}")
    print(f"  parity vs JAX (dualgraph), {parity}")

    if args.plot is not None:
        title = (
            f"{model_line}\nforward + backward + AdamW step, median of {args.rounds} rounds; "
            f"dualgraph backend {backend}"
        )
        if not installed("matplotlib"):
            print("plot: skipped, matplotlib is not installed (pip install 'dualgraph[examples]')")
        else:
            save_plot(args.plot, variants, title)
            print(f"plot: {args.plot}")

    if failures:
        for failure in failures:
            print(f"vision_encoder: FAILED: {failure}", file=sys.stderr)
        return 1
    print("vision_encoder: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
