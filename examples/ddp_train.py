"""Data-parallel training with graphed blocks: DDP over a vision encoder, graphed vs eager.

Every rank builds the same classifier (a ``VisionEncoder`` whose blocks return ``(hidden, None)``,
then a linear head) twice from one seed: one copy with every block graphed by dualgraph (one
``make_graphed_callables`` call over the tuple of blocks), one eager. Both are wrapped in
``DistributedDataParallel``, train on the same batches (different on each rank) with gradient
accumulation under ``no_sync``, and after every backward and every optimizer step their grads
and parameters are compared. See docs/ddp.md for the rules this script follows.

    torchrun --nproc_per_node=2 examples/ddp_train.py        # one GPU per rank: NCCL, CUDA graphs
    python examples/ddp_train.py                             # no launcher: 2 CPU ranks over gloo

Rank 0 prints one line starting ``ddp_train: OK`` (or ``ddp_train: FAILED``, with a non-zero
exit) with the largest grad and parameter differences and the median step times.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import socket
import statistics
import sys
import time
import warnings

# NVLink multicast (NVLS) off, as on the shared GPU hosts this runs on; before NCCL starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dualgraph.torch as dgt
from dualgraph.models.torch_vit import VisionEncoder

PATCH = 8


class Classifier(torch.nn.Module):
    """The encoder's pooled features through a linear head; adds ``aux_loss`` when there is one."""

    def __init__(self, encoder: VisionEncoder, dim: int, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.encoder(images)
        return self.head(out["pooled"]), out["aux_loss"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--micro-batches", type=int, default=2, help="per step; all but the last under no_sync"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="per rank and micro-batch")
    parser.add_argument(
        "--backend",
        choices=["auto", "cuda", "emulate", "eager"],
        default="auto",
        help="dualgraph backend; auto: cuda graphs on a GPU, 'emulate' (static buffers) on a CPU",
    )
    parser.add_argument("--dist-backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument("--atol", type=float, default=0.0, help="allowed grad/param difference")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start without torchrun")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:  # started by torchrun
        leave(run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    try:
        torch.multiprocessing.spawn(_spawned_rank, args=(args,), nprocs=args.nproc)
    except torch.multiprocessing.ProcessException as error:
        print(f"ddp_train: a rank failed: {error}", file=sys.stderr)
        return 1
    return 0


def _spawned_rank(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc))
    leave(run_rank(rank, args.nproc, args))


def leave(code: int) -> None:
    """End a rank without the interpreter's teardown.

    There a finished CPU rank sometimes aborts in C++ code ("terminate called without an active
    exception", with no Python frame; about one run in 30 with torch 2.13 and gloo).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # torch's one-time note when its autograd thread first meets cuBLAS during a capture
        # (torch.cuda.make_graphed_callables prints it too); harmless.
        warnings.filterwarnings("ignore", "Attempting to run cuBLAS, but there was no current")
        # Full float32 products and a deterministic patch-embedding convolution: otherwise the
        # eager model does not even agree with itself to the last bit (cuDNN's weight grad).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist_backend = args.dist_backend
    if dist_backend == "auto":
        # NCCL needs a GPU of its own per rank; gloo also all-reduces CUDA tensors.
        enough_gpus = device.type == "cuda" and torch.cuda.device_count() >= world_size
        dist_backend = "nccl" if enough_gpus else "gloo"
    backend = args.backend
    if backend == "auto":  # on a CPU, emulate: the static-buffer path without a graph
        backend = "cuda" if device.type == "cuda" else "emulate"
    dist.init_process_group(
        dist_backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
        device_id=device if dist_backend == "nccl" else None,
    )
    try:
        return train(rank, world_size, device, dist_backend, backend, args)
    finally:
        dist.destroy_process_group()


def train(
    rank: int,
    world_size: int,
    device: torch.device,
    dist_backend: str,
    backend: str,
    args: argparse.Namespace,
) -> int:
    torch.manual_seed(0)
    encoder = VisionEncoder(
        image_size=args.image_size,
        patch_size=PATCH,
        dim=args.dim,
        depth=args.layers,
        heads=args.heads,
    )
    eager = Classifier(encoder, args.dim, classes=10).to(device)
    graphed = copy.deepcopy(eager)

    # 1. Graph the blocks first (one call: one shared memory pool), then wrap in DDP. DDP's
    #    all-reduce hooks then run eagerly after each graphed backward, outside the graphs.
    tokens = (args.image_size // PATCH) ** 2
    sample = torch.randn(args.batch, tokens, args.dim, device=device, requires_grad=True)
    blocks = tuple(graphed.encoder.blocks)
    dgt.make_graphed_callables(blocks, tuple((sample,) for _ in blocks), backend=backend)

    # 2. DDP on the stream the training loop runs on (the default one): nothing DDP does is
    #    captured, so the side-stream construction that whole-step capture needs does not apply.
    device_ids = [device.index] if device.type == "cuda" else None
    models = {
        "eager": DDP(eager, device_ids=device_ids),
        "graphed": DDP(graphed, device_ids=device_ids),
    }
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    seconds: dict[str, list[float]] = {name: [] for name in models}

    data = torch.Generator().manual_seed(1000 + rank)  # every rank its own batches
    grad_diff = param_diff = 0.0
    for _ in range(args.steps):
        batches = [
            (
                torch.randn(args.batch, 3, args.image_size, args.image_size, generator=data),
                torch.randint(0, 10, (args.batch,), generator=data),
            )
            for _ in range(args.micro_batches)
        ]
        for name, model in models.items():
            _synchronize(device)
            start = time.perf_counter()
            optimizers[name].zero_grad(set_to_none=True)
            for index, (images, labels) in enumerate(batches):
                last = index == len(batches) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    logits, aux_loss = model(images.to(device, non_blocking=True))
                    loss = torch.nn.functional.cross_entropy(logits, labels.to(device))
                    if aux_loss is not None:
                        loss = loss + aux_loss
                    loss.backward()
            _synchronize(device)
            seconds[name].append(time.perf_counter() - start)
        grad_diff = max(grad_diff, _max_difference(eager, graphed, grads=True))
        for optimizer in optimizers.values():
            optimizer.step()
        param_diff = max(param_diff, _max_difference(eager, graphed, grads=False))

    # Grads identical on every rank show the all-reduce reached the graphed blocks' parameters.
    rank_spread = _rank_spread(graphed, world_size)
    ok = grad_diff <= args.atol and param_diff <= args.atol and rank_spread == 0.0
    replays = [dgt.diagnostics(block).replays for block in blocks]
    if rank == 0:
        eager_ms = 1e3 * statistics.median(seconds["eager"][1:] or seconds["eager"])
        graphed_ms = 1e3 * statistics.median(seconds["graphed"][1:] or seconds["graphed"])
        print(
            f"ddp_train: {'OK' if ok else 'FAILED'} world={world_size} dist={dist_backend} "
            f"device={device.type} backend={backend} steps={args.steps} "
            f"micro_batches={args.micro_batches} replays/block={replays[0]} "
            f"max|grad diff|={grad_diff:.3g} max|param diff|={param_diff:.3g} "
            f"(atol {args.atol:g}) rank spread={rank_spread:.3g} "
            f"step eager={eager_ms:.2f} ms graphed={graphed_ms:.2f} ms",
            flush=True,
        )
    return 0 if ok else 1


def _max_difference(eager: torch.nn.Module, graphed: torch.nn.Module, *, grads: bool) -> float:
    differences = []
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        if grads:
            if a.grad is None or b.grad is None:
                raise RuntimeError(f"{name}: a parameter without grad after backward")
            a, b = a.grad, b.grad
        differences.append((a.detach() - b.detach()).abs().max().item())
    # numpy's max keeps a NaN, which Python's max drops after a finite value
    return float(np.max(differences, initial=0.0))


def _rank_spread(model: torch.nn.Module, world_size: int) -> float:
    """The largest difference of any grad between this rank and the others (0 after all-reduce)."""
    grads = torch.cat([p.grad.detach().flatten() for p in model.parameters() if p.grad is not None])
    gathered = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(gathered, grads)
    # numpy's max keeps a NaN, which Python's max drops after a finite value
    differences = [(g - grads).abs().max().item() for g in gathered]
    spread = torch.tensor([float(np.max(differences, initial=0.0))], device=grads.device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
