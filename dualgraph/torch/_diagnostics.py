"""What :func:`dualgraph.torch.diagnostics` reports about a graphed callable."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CaptureDiagnostics"]


@dataclass
class CaptureDiagnostics:
    """Sizes and times of one captured callable, and how often it ran.

    ``pool_bytes`` is the size of the CUDA memory pool that all callables captured together share
    (the same number on each of them): the allocator's segments of that pool, else the memory
    the capture left allocated; 0 off the GPU. ``replays`` counts calls that replayed (or, on
    the ``"eager"`` backend, ran) the callable. ``param_grads_through_autograd`` counts the
    backwards that handed the parameter grads to autograd (every one with
    ``param_grads="autograd"``; with ``"auto"``, those where something needed it, e.g. a
    parameter hook or DDP) instead of adding them into ``.grad`` in a graph.

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
    param_grads_through_autograd: int = 0
