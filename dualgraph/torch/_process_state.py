"""The process-wide state a run of the user's callable may leave changed, kept and put back: the
random streams (torch's CPU generator, every initialised CUDA device's, Python's ``random``,
numpy's global one), grad mode, autocast and torch's numerics settings
(:func:`~dualgraph.torch._ambient.kept_modes`).

Graphing runs the callable (warmups, capture, lint, the padding check) and must leave the
process as it found it if it fails, so that a seeded run goes on as it would have without the
attempt; the checking tools (``lint``, ``memory_plan``, ``verify``) run it and leave the process
as they found it whatever happens. A forward failing half-way may leave grad mode off, an
autocast it entered or a setting it meant to undo at its end; its dropout drew from the RNG.
Inference mode is not among them: it is the scope of a guard object, with no setter to put it
back through; whatever runs the callable runs it under ``outside_inference_mode()``.

>>> with kept_process_state():
...     _ = torch.rand(3)
...     _ = torch.set_grad_enabled(False)
>>> torch.is_grad_enabled()
True
>>> state = torch.get_rng_state()
>>> with kept_process_state(on_failure_only=True):  # a success keeps what the block did
...     _ = torch.rand(3)
>>> torch.equal(torch.get_rng_state(), state)
False
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._ambient import kept_modes
from ._capture_failure import repair_cuda_rng
from ._host_rng import host_rng_state, set_host_rng_state

__all__ = ["KeptProcessState", "kept_process_state"]


@dataclass(frozen=True)
class KeptProcessState:
    """What :func:`kept_process_state` read when its block began."""

    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None  # None where CUDA was not initialised
    host_rng: tuple[Any, Any]  # Python's random, numpy's global generator
    put_back_modes: Callable[[], None]  # grad mode, autocast, the numerics settings

    @classmethod
    def now(cls) -> KeptProcessState:
        return cls(
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            host_rng=host_rng_state(),
            put_back_modes=kept_modes(),
        )

    def put_back_torch_rng(self) -> None:
        """torch's CPU and CUDA generators as kept (``verify`` starts both of its sides so)."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def put_back(self, *, failed: bool = False) -> None:
        """Everything as kept. ``failed``: a failure is on its way out, which may be a failed
        capture's: the CUDA generators are repaired first (a failed capture that drew from them
        leaves them refusing every later call), and a CUDA error here is left to the next CUDA
        call rather than reported in place of that failure."""
        torch.set_rng_state(self.cpu_rng)
        set_host_rng_state(self.host_rng)
        if self.cuda_rng is not None:
            if failed:
                with contextlib.suppress(RuntimeError):
                    repair_cuda_rng()  # idempotent; a KeyboardInterrupt skipped the capture's
                    torch.cuda.set_rng_state_all(self.cuda_rng)
            else:
                torch.cuda.set_rng_state_all(self.cuda_rng)
        self.put_back_modes()


@contextlib.contextmanager
def kept_process_state(*, on_failure_only: bool = False) -> Iterator[KeptProcessState]:
    """Keep the process's RNG states, grad mode, autocast and numerics settings and put them
    back when the block ends (with ``on_failure_only``: only where it raises, any exception,
    ``KeyboardInterrupt`` too). Yields what was kept, for a block that puts torch's RNG back
    midway (:meth:`KeptProcessState.put_back_torch_rng`)."""
    kept = KeptProcessState.now()
    try:
        yield kept
    except BaseException:
        kept.put_back(failed=True)
        raise
    if not on_failure_only:
        kept.put_back()
