"""What :func:`dualgraph.torch.diagnostics` reports about a graphed callable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # issue 19 hook: the lint report and memory plan kept with the diagnostics
    from ._lint import LintReport
    from ._memory_plan import MemoryPlan

__all__ = ["CaptureDiagnostics"]


@dataclass
class CaptureDiagnostics:
    """Sizes and times of one captured callable, and how often it ran.

    ``pool_bytes`` is the size of the CUDA memory pool that all callables captured together share
    (the same number on each of them): the allocator's segments of that pool, else the memory the
    capture left allocated; 0 off the GPU. ``replays`` counts calls that replayed (or, on the
    ``"eager"`` backend, ran) the callable; ``eager_calls`` those that ran it eagerly instead, where
    its Python branches on grad mode (``torch.is_grad_enabled()``) or on an input's
    ``requires_grad`` and the call's differed from the capture's. ``param_grads_through_autograd``
    counts the backwards that handed the parameter grads to autograd (every one with
    ``param_grads="autograd"``; with ``"auto"``, those where something needed it, e.g. a parameter
    hook or DDP) instead of adding them into ``.grad`` in a graph. ``lint`` holds the capture lint's
    findings (``None`` with ``lint="off"``, on the ``"eager"`` backend, and on ``"cuda"`` under the
    default ``lint="auto"``) and ``memory_plan`` the memory plan of the callables captured together,
    with the measured pool beside it on the GPU (``None`` where the warmup ran unwatched: on
    ``"eager"``, and on ``"cuda"`` under ``lint="auto"``). With several replay slots (``slots=`` or
    ``schedule=``), the bytes count every buffer once, ``pool_bytes`` sums the slots' own pools (or
    is the schedule's shared pool), ``capture_seconds`` the slots' captures, ``slots`` is their
    number, ``in_flight`` the slots whose backward is pending, and ``reused_buffer_bytes`` what
    slots share instead of each holding a copy (the static inputs, outputs and grads of
    micro-batches never in flight together).

    >>> CaptureDiagnostics(name="Linear", backend="emulate").replays
    0
    """

    name: str
    backend: str
    static_input_bytes: int = 0
    static_output_bytes: int = 0
    static_grad_bytes: int = 0
    pool_bytes: int = 0
    capture_seconds: float = 0.0
    has_backward_graph: bool = False
    replays: int = 0
    eager_calls: int = 0
    param_grads_through_autograd: int = 0
    # issue 19 hook: set at capture by dualgraph.torch._probe.attach_probes
    lint: LintReport | None = None
    memory_plan: MemoryPlan | None = None
    slots: int = 1
    in_flight: tuple[int, ...] = ()
    reused_buffer_bytes: int = 0
