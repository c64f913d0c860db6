"""Graphed blocks inside ``DistributedDataParallel``: the all-reduced grads equal eager DDP's.

Every test starts two ranks (separate processes, ``gloo`` on the CPU, ``nccl`` on two GPUs). Each
rank builds the same model twice from one seed: one copy eager, one whose blocks (which return
``(hidden, None)``) are graphed by dualgraph, both wrapped in DDP. Both copies see the same
batches, which differ between ranks, and after every backward their ``.grad`` must be identical,
and after every optimizer step their parameters. Exactly, not within a tolerance: the graphed and
the eager copy run the same kernels on the same values in the same order, and a two-rank
all-reduce is one addition, which gives the same bits on both ranks. (The ``cuda`` test keeps
that claim with TF32 off.) Identical grads on both ranks show that the all-reduce happened.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dualgraph.torch as dgt

WORLD_SIZE = 2
TIMEOUT_SECONDS = 60.0  # for all ranks together; a hung collective gives up after half of it
BATCH, TOKENS, DIM, DEPTH = 4, 3, 16, 2


class Block(torch.nn.Module):
    """A pre-norm residual MLP block that returns ``(hidden, None)``, like a vision layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hidden + self.fc2(torch.tanh(self.fc1(self.norm(hidden)))), None


class Net(torch.nn.Module):
    def __init__(self, dim: int = DIM, depth: int = DEPTH, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = torch.nn.Linear(dim, 1)
        # Reentrant activation checkpointing: each block runs again during the backward, outside
        # DDP's forward, and its backward is a backward of its own.
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            if self.checkpointed:
                hidden, aux = checkpoint(block, hidden, use_reentrant=True)
            else:
                hidden, aux = block(hidden)
            assert aux is None
        return self.head(hidden).squeeze(-1)


# -- what each rank runs --------------------------------------------------------------------------


def train_side_by_side(
    rank: int,
    *,
    backend: str,
    steps: int,
    micro_batches: int,
    device: torch.device,
    ddp_options: dict[str, Any] | None = None,
    checkpointed: bool = False,
) -> None:
    """Train an eager and a graphed copy under DDP on this rank's batches; compare every step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    eager = Net(checkpointed=checkpointed).to(device)
    graphed = copy.deepcopy(eager)
    sample = torch.randn(BATCH, TOKENS, DIM, device=device, requires_grad=True)
    # Graph first, then wrap in DDP: the all-reduce stays outside the graphs (docs/ddp.md).
    dgt.make_graphed_callables(
        tuple(graphed.blocks), tuple((sample,) for _ in graphed.blocks), backend=backend
    )
    device_ids = [device.index] if device.type == "cuda" else None
    models = {
        "eager": DDP(eager, device_ids=device_ids, **(ddp_options or {})),
        "graphed": DDP(graphed, device_ids=device_ids, **(ddp_options or {})),
    }
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}

    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(steps):
        batches = [
            (
                torch.randn(BATCH, TOKENS, 8, generator=data),
                torch.randn(BATCH, TOKENS, generator=data),
            )
            for _ in range(micro_batches)
        ]
        for name, model in models.items():
            optimizers[name].zero_grad(set_to_none=True)
            for index, (x, target) in enumerate(batches):
                last = index == micro_batches - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = torch.nn.functional.mse_loss(model(x.to(device)), target.to(device))
                    loss.backward()
        _assert_same(eager, graphed, "grad", f"step {step}")
        _assert_same_on_all_ranks(graphed, f"step {step}")
        for optimizer in optimizers.values():
            optimizer.step()
        _assert_same(eager, graphed, "param", f"step {step}")

    replays = [dgt.diagnostics(block).replays for block in graphed.blocks]
    runs = 2 if checkpointed else 1  # without grad, then again in the backward
    assert replays == [runs * steps * micro_batches] * DEPTH, replays
    # param_grads="auto" sends the grads through DDP's hooks; a block run again in the backward
    # (checkpointed) adds them into .grad itself, before DDP's hooks read .grad.
    if backend != "eager" and not checkpointed:
        through_autograd = [
            dgt.diagnostics(block).param_grads_through_autograd for block in graphed.blocks
        ]
        assert through_autograd == replays, through_autograd
    assert {dgt.diagnostics(block).backend for block in graphed.blocks} == {backend}


def _assert_same(eager: Net, graphed: Net, what: str, when: str) -> None:
    for (name, p_eager), p_graphed in zip(
        eager.named_parameters(), graphed.parameters(), strict=True
    ):
        a, b = (p_eager.grad, p_graphed.grad) if what == "grad" else (p_eager, p_graphed)
        assert a is not None and b is not None, f"{when}: {name} has no grad"
        if not torch.equal(a, b):
            difference = (a - b).abs().max().item()
            raise AssertionError(f"{when}: {what} of {name} differs by up to {difference:.3g}")


def _assert_same_on_all_ranks(model: Net, when: str) -> None:
    import torch.distributed as dist

    for name, param in model.named_parameters():
        assert param.grad is not None
        gathered = [torch.empty_like(param.grad) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, param.grad)
        if not all(torch.equal(g, gathered[0]) for g in gathered):
            raise AssertionError(f"{when}: grad of {name} differs between ranks (no all-reduce?)")


# -- launching ranks ------------------------------------------------------------------------------


def _rank_main(
    rank: int,
    device_type: str,
    dist_backend: str,
    store: str,
    errors: str,
    env: dict[str, str],
    job: Callable[..., None],
    kwargs: dict[str, Any],
) -> None:
    """One rank: join the group, run ``job``, write a traceback to ``errors`` if it fails."""
    os.environ.update(env)
    warnings.simplefilter("error")  # as pytest's filterwarnings: a warning in a rank fails too
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        device = torch.device("cpu")
        if device_type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = False  # exact comparisons need full fp32
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cudnn.deterministic = True
            # torch's own one-time note when the autograd thread first meets cuBLAS; harmless.
            warnings.filterwarnings("ignore", "Attempting to run cuBLAS, but there was no current")
        dist.init_process_group(
            dist_backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS / 2),
        )
        try:
            job(rank, device=device, **kwargs)
        finally:
            dist.destroy_process_group()
        code = 0
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        code = 1
    # Skip the interpreter's teardown: there a finished rank sometimes aborts in C++ code
    # ("terminate called without an active exception", no Python frame; about 1 run in 30).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(
    tmp_path: Path,
    job: Callable[..., None],
    *,
    device_type: str = "cpu",
    dist_backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> None:
    """Run ``job(rank, device=..., **kwargs)`` on every rank; fail with the ranks' tracebacks."""
    context = multiprocessing.get_context("spawn")
    errors = tmp_path / "errors"
    errors.mkdir()
    args = (
        device_type,
        dist_backend,
        str(tmp_path / "store"),
        str(errors),
        dict(env or {}),
        job,
        kwargs,
    )
    ranks = [context.Process(target=_rank_main, args=(rank, *args)) for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + TIMEOUT_SECONDS
    try:
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
    reports = [f"--- {path.stem} ---\n{path.read_text()}" for path in sorted(errors.iterdir())]
    if hung:
        reports.append(f"ranks {hung} still running after {TIMEOUT_SECONDS:.0f} s: killed")
    codes = [process.exitcode for process in ranks]
    if reports or any(codes):
        pytest.fail(f"exit codes {codes}\n" + "\n".join(reports), pytrace=False)


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "emulate"])
def test_graphed_blocks_under_ddp_give_eager_ddp_grads_and_params(
    tmp_path: Path, backend: str
) -> None:
    run_ranks(tmp_path, train_side_by_side, backend=backend, steps=3, micro_batches=1)


@pytest.mark.parametrize("backend", ["eager", "emulate"])
def test_grad_accumulation_with_no_sync_matches_eager_ddp(tmp_path: Path, backend: str) -> None:
    run_ranks(tmp_path, train_side_by_side, backend=backend, steps=2, micro_batches=3)


@pytest.mark.parametrize(
    ("ddp_options", "micro_batches"),
    # eager DDP's static graph fails an internal assert under no_sync (torch 2.13)
    [
        ({"gradient_as_bucket_view": True}, 2),
        ({"static_graph": True}, 1),
        ({"find_unused_parameters": True}, 2),
        ({"bucket_cap_mb": 1e-4, "gradient_as_bucket_view": True}, 2),  # a bucket a parameter
    ],
    ids=["gradient_as_bucket_view", "static_graph", "find_unused_parameters", "small_buckets"],
)
def test_ddp_options_match_eager_ddp(
    tmp_path: Path, ddp_options: dict[str, Any], micro_batches: int
) -> None:
    """With ``gradient_as_bucket_view`` every ``.grad`` is a view into DDP's flat bucket."""
    run_ranks(
        tmp_path,
        train_side_by_side,
        backend="emulate",
        steps=2,
        micro_batches=micro_batches,
        ddp_options=ddp_options,
    )


def test_reentrant_checkpointed_blocks_under_ddp_match_eager_ddp(tmp_path: Path) -> None:
    """Recomputed in the backward, outside DDP's forward, a replay adds the parameter grads into
    ``.grad`` itself; DDP's hooks on the parameters' grad accumulators still run after it and
    all-reduce what is in ``.grad`` (with its buckets as ``.grad`` too)."""
    run_ranks(
        tmp_path,
        train_side_by_side,
        backend="emulate",
        steps=2,
        micro_batches=2,
        ddp_options={"gradient_as_bucket_view": True},
        checkpointed=True,
    )


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason="needs 2 CUDA devices")
def test_cuda_graphed_blocks_under_nccl_ddp_match_eager_ddp(tmp_path: Path) -> None:
    run_ranks(
        tmp_path,
        train_side_by_side,
        device_type="cuda",
        dist_backend="nccl",
        env={"NCCL_NVLS_ENABLE": "0"},
        backend="cuda",
        steps=3,
        micro_batches=2,
    )


def test_in_graph_param_grads_are_refused_under_ddp(tmp_path: Path) -> None:
    """DDP all-reduces through parameter hooks, which in-graph accumulation bypasses."""
    from dualgraph import DualgraphError

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = Net()
        sample = torch.randn(BATCH, TOKENS, DIM, requires_grad=True)
        samples = tuple((sample,) for _ in net.blocks)
        dgt.make_graphed_callables(
            tuple(net.blocks), samples, backend="emulate", param_grads="in_graph"
        )
        model = torch.nn.parallel.DistributedDataParallel(net)
        with pytest.raises(DualgraphError, match="param_grads='autograd' to train under DDP"):
            model(torch.randn(BATCH, TOKENS, 8))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_in_graph_param_grads_evaluate_under_ddp_without_grad_as_eager(
    tmp_path: Path, no_grad: Callable[[], Any]
) -> None:
    """A forward that records no grad hands DDP nothing to all-reduce: an evaluation loop under
    DDP works with ``"in_graph"`` blocks, giving eager's outputs."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = Net()
        eager = copy.deepcopy(net)
        sample = torch.randn(BATCH, TOKENS, DIM, requires_grad=True)
        samples = tuple((sample,) for _ in net.blocks)
        dgt.make_graphed_callables(
            tuple(net.blocks), samples, backend="emulate", param_grads="in_graph"
        )
        model = torch.nn.parallel.DistributedDataParallel(net)
        x = torch.randn(BATCH, TOKENS, 8)
        with no_grad():
            got = model(x)
            want = eager(x)
        assert torch.equal(got, want)
        assert not got.requires_grad
        assert [dgt.diagnostics(block).replays for block in net.blocks] == [1] * DEPTH
    finally:
        torch.distributed.destroy_process_group()


def test_in_graph_param_grads_recomputed_by_a_checkpoint_under_ddp_are_refused(
    tmp_path: Path,
) -> None:
    """Reentrant checkpointing runs a block without grad inside DDP's forward and again, with
    grad, in the backward, where DDP's forward is over: that replay is refused too, before any
    ``.grad`` of the block is written (DDP would never all-reduce it)."""
    from dualgraph import DualgraphError

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = Net(checkpointed=True)
        sample = torch.randn(BATCH, TOKENS, DIM, requires_grad=True)
        samples = tuple((sample,) for _ in net.blocks)
        dgt.make_graphed_callables(
            tuple(net.blocks), samples, backend="emulate", param_grads="in_graph"
        )
        model = torch.nn.parallel.DistributedDataParallel(net)
        loss = model(torch.randn(BATCH, TOKENS, 8)).sum()
        with pytest.raises(DualgraphError, match="param_grads='autograd' to train under DDP"):
            loss.backward()
        assert all(p.grad is None for p in net.blocks.parameters())
    finally:
        torch.distributed.destroy_process_group()
