"""Transformer Engine awareness, only when TE is already imported (dualgraph never imports it).

During a CUDA-graph capture, TE modules ask ``transformer_engine.pytorch.graph.
is_graph_capturing()`` to pick graph-safe paths (its fused attention passes ``cuda_graph=True``
to cuDNN; backward FP8 amax reductions are skipped) and keep dropout state in their own RNG
tracker, whose generators a graph must register to draw fresh values per replay. TE's own
``make_graphed_callables`` does both; so does :func:`transformer_engine_capture`.

TE's FP8 autocast (``te.autocast``) is ambient state a graph bakes in, like ``torch.autocast``:
:func:`fp8_state` reads it, so that replays can be refused outside the state they were captured
in. Under the delayed-scaling recipe, FP8 scales come from an amax history that TE updates when
an autocast region exits, for the modules whose forward ran in it; a replay runs no TE Python,
so the scales would go stale. :func:`refuse_delayed_scaling` refuses that capture. The TE facts
this relies on are in ``docs/transformer_engine.md``.

>>> with transformer_engine_capture() as generators:
...     pass  # capture here; register ``generators`` with every CUDA graph
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import CaptureError

__all__ = ["fp8_state", "refuse_delayed_scaling", "transformer_engine_capture"]


@contextmanager
def transformer_engine_capture() -> Iterator[list[Any]]:
    """Tell TE a capture is under way; yield the TE RNG generator states graphs must register."""
    if "transformer_engine.pytorch" not in sys.modules:
        yield []
        return
    from transformer_engine.pytorch import (  # type: ignore[import-not-found,unused-ignore]
        graph as te_graph,
    )

    already = te_graph.is_graph_capturing()
    if not already:
        te_graph.set_capture_start()
    try:
        yield _rng_generator_states()
    finally:
        if not already:
            te_graph.set_capture_end()


def fp8_state() -> tuple[Any, ...] | None:
    """``None`` without TE; else ``(enabled, recipe type name)`` of TE's FP8 autocast now."""
    manager = _fp8_manager()
    if manager is None:
        return None
    if not manager.is_fp8_enabled():
        return (False, None)
    return (True, type(manager.get_fp8_recipe()).__name__)


def refuse_delayed_scaling(name: str) -> None:
    """Raise :class:`CaptureError` when TE's FP8 autocast is on with a delayed-scaling recipe."""
    manager = _fp8_manager()
    if manager is None or not manager.is_fp8_enabled():
        return
    recipe = manager.get_fp8_recipe()
    delayed = getattr(recipe, "delayed", None)
    if type(recipe).__name__ == "DelayedScaling" or (callable(delayed) and delayed()):
        raise CaptureError(
            f"capturing {name} under Transformer Engine's FP8 recipe {recipe!r} is not supported: "
            "with delayed scaling, TE updates the amax history and scales when an autocast "
            "region exits, for the modules whose forward ran in it, and a graph replay runs no "
            "TE code, so its FP8 scales would go stale. Capture under a recipe that scales from "
            "the current tensors (e.g. Float8CurrentScaling, MXFP8BlockScaling), or use TE's "
            "own make_graphed_callables for delayed scaling"
        )


def _fp8_manager() -> Any:
    # TE 2.x keeps FP8GlobalStateManager in ``quantization``; earlier releases in ``fp8``.
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        module = sys.modules.get(name)
        manager = getattr(module, "FP8GlobalStateManager", None)
        if manager is not None:
            return manager
    return None


def _rng_generator_states() -> list[Any]:
    from transformer_engine.pytorch import (  # type: ignore[import-not-found,unused-ignore]
        distributed as te_distributed,
    )

    if not te_distributed.graph_safe_rng_available():
        return []
    return list(te_distributed.get_all_rng_states().values())
