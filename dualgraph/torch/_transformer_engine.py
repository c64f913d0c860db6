"""Transformer Engine awareness during a CUDA-graph capture, only when TE is already imported.

TE modules ask ``transformer_engine.pytorch.graph.is_graph_capturing()`` to pick graph-safe paths
(its fused attention passes ``cuda_graph=True`` to cuDNN; backward FP8 amax reductions are
skipped) and keep dropout state in their own RNG tracker, whose generators a graph must register
to draw fresh values per replay. TE's own ``make_graphed_callables`` does both; so does ours.
dualgraph never imports TE itself: without it in ``sys.modules`` this is a no-op.

>>> with transformer_engine_capture() as generators:
...     pass  # capture here; register ``generators`` with every CUDA graph
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["transformer_engine_capture"]


@contextmanager
def transformer_engine_capture() -> Iterator[list[Any]]:
    """Tell TE a capture is under way; yield the TE RNG generator states graphs must register."""
    if "transformer_engine.pytorch" not in sys.modules:
        yield []
        return
    from transformer_engine.pytorch import graph as te_graph

    already = te_graph.is_graph_capturing()
    if not already:
        te_graph.set_capture_start()
    try:
        yield _rng_generator_states()
    finally:
        if not already:
            te_graph.set_capture_end()


def _rng_generator_states() -> list[Any]:
    from transformer_engine.pytorch import distributed as te_distributed

    if not te_distributed.graph_safe_rng_available():
        return []
    return list(te_distributed.get_all_rng_states().values())
