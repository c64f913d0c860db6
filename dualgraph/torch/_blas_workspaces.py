"""cuBLAS workspaces for the capture stream, made before any capture so that no pool keeps one.

torch gives cuBLAS (and cuBLASLt) a workspace per thread's handle and stream, allocated from the
caching allocator the first time that thread runs a GEMM on that stream, and kept for the rest of
the process. ``torch.cuda.graph`` captures on one stream for the whole process; the forward of a
capture runs its GEMMs on the capturing thread, the backward on autograd's device thread. So the
first capture of a process would allocate those workspaces inside its graphs' pool (32 MiB each
on a Hopper GPU), where they stay: the first callable graphed in a process would hold them all
its life, the next ones not. :func:`prime_capture_stream` runs a tiny forward and backward on
the capture stream first, outside any capture, so that the workspaces come from the ordinary
pool, once per process (and again if someone clears them).

>>> prime_capture_stream(None)  # no GPU: nothing to do
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capture_stream", "prime_capture_stream"]


def capture_stream() -> torch.cuda.Stream:
    """The stream ``torch.cuda.graph`` captures on when given none (made on first use)."""
    stream = torch.cuda.graph.default_capture_stream
    if stream is None:  # torch makes it when its first graph context is made
        stream = torch.cuda.graph(torch.cuda.CUDAGraph()).capture_stream
    assert stream is not None
    return stream


def prime_capture_stream(device: torch.device | None) -> None:
    """Make the cuBLAS and cuBLASLt workspaces of the capture stream outside any graph pool.

    For the calling thread and for autograd's device thread (which runs captured backwards).
    A no-op without CUDA.
    """
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return
    stream = capture_stream()
    with torch.cuda.device(stream.device):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.enable_grad():
            # float32 addmm with a bias takes cuBLASLt's path, mm cuBLAS's
            a = torch.ones(16, 16, device=stream.device, requires_grad=True)
            bias = torch.ones(16, device=stream.device, requires_grad=True)
            out = _GemmsBothWays.apply(a, bias)
            torch.autograd.grad(out.sum(), (a, bias))
        torch.cuda.current_stream().wait_stream(stream)
        stream.synchronize()


class _GemmsBothWays(torch.autograd.Function):
    """GEMMs through cuBLAS and cuBLASLt in the forward (this thread) and in the backward
    (autograd's device thread)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, bias)
        return torch.addmm(bias, a, a) + torch.mm(a, a)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, bias = ctx.saved_tensors
        grad_a = torch.addmm(bias, grad, a) + torch.mm(grad, a)
        return grad_a, grad.sum(0)
