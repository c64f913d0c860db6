"""cuBLAS workspaces for the capture stream are made before a capture, outside every graph pool.

Without that, the first capture of a process allocates them inside its pool (32 MiB a thread on
a Hopper GPU), where they stay: the pipeline benchmark's first graphed variant once held 64 MiB
more than the same layout graphed second. The CUDA tests run in fresh processes, where the
capture stream has never run a GEMM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dualgraph.torch as dgt
from dualgraph.torch import _blas_workspaces
from dualgraph.torch._blas_workspaces import prime_capture_stream


def run_fresh(script: str, tmp_path: Path) -> list[int]:
    """Run ``script`` in a new Python process; the integers it prints."""
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    root = str(Path(dgt.__file__).parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return [int(word) for word in run.stdout.split()]


def test_without_a_gpu_there_is_nothing_to_prime(monkeypatch: pytest.MonkeyPatch) -> None:
    # no capture stream is made (it would be a CUDA stream) and no GEMM runs, on any machine
    asked: list[str] = []
    monkeypatch.setattr(_blas_workspaces, "capture_stream", lambda: asked.append("stream"))
    monkeypatch.setattr(
        _blas_workspaces._GemmsBothWays, "apply", lambda *args: asked.append("gemms")
    )
    prime_capture_stream(None)
    prime_capture_stream(torch.device("cpu"))
    prime_capture_stream(torch.device("meta"))
    assert asked == []


@pytest.mark.cuda
def test_after_priming_gemms_on_the_capture_stream_allocate_nothing_more(tmp_path: Path) -> None:
    (grown,) = run_fresh(
        """
        import torch
        from dualgraph.torch._blas_workspaces import capture_stream, prime_capture_stream

        prime_capture_stream(torch.device("cuda"))
        stream = capture_stream()
        a = torch.ones(64, 64, device="cuda", requires_grad=True)
        bias = torch.ones(64, device="cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = torch.addmm(bias, a, a) + torch.mm(a, a)  # this thread: cuBLASLt, cuBLAS
            (grad,) = torch.autograd.grad(out.sum(), a)  # autograd's device thread: cuBLAS
            del grad
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        print(torch.cuda.memory_allocated() - before - out.numel() * out.element_size())
        """,
        tmp_path,
    )
    assert grown == 0  # the intermediates and the grad came and went: no workspace stayed


@pytest.mark.cuda
def test_the_first_capture_of_a_process_keeps_no_cublas_workspace_in_its_pool(
    tmp_path: Path,
) -> None:
    allocated, kept = run_fresh(
        """
        import torch
        from torch import nn
        import dualgraph.torch as dgt

        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
        x = torch.randn(512, 256, device="cuda", requires_grad=True)
        graphed = dgt.make_graphed_callables(mlp, (x,), lint="off")
        plan = dgt.diagnostics(graphed).memory_plan
        segments = [
            s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)
        ]
        print(sum(s["allocated_size"] for s in segments), plan.kept_in_pool_bytes)
        """,
        tmp_path,
    )
    assert allocated == kept > 0  # the output and the grads, no workspace
