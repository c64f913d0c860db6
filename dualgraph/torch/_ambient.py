"""The ambient state a replay runs in besides its inputs: autocast, and DDP's forward.

A plan records the autocast state it was captured in; each call compares it with the present
one (``_replay.py``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["autocast_state", "ddp_is_running"]


def autocast_state() -> tuple[Any, ...]:
    """``()`` outside autocast, else the autocast dtype per device type (False where off)."""
    if not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        return ()
    return (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
    )


_DDP = torch.nn.parallel.DistributedDataParallel


def ddp_is_running() -> bool:
    # DDP marks the module whose forward is running (public hook for TorchDynamo).
    return getattr(_DDP, "_active_ddp_module", None) is not None
