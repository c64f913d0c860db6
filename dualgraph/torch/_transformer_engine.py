"""Transformer Engine's entry points, only when TE is imported (dualgraph never imports it itself
unless it is given TE's arguments).

During a CUDA-graph capture, TE modules ask ``transformer_engine.pytorch.graph.
is_graph_capturing()`` to pick graph-safe paths (its fused attention passes ``cuda_graph=True``
to cuDNN; backward FP8 amax reductions are skipped) and keep dropout state in their own RNG
tracker, whose generators a graph must register to draw fresh values per replay. TE's own
``make_graphed_callables`` does both; so does :func:`transformer_engine_capture`.

:class:`TransformerEngine` gathers the entry points the FP8 support (``_te_precision.py``)
uses, looked up once per capture. The TE facts this relies on are in
``docs/transformer_engine.md``.

>>> with transformer_engine_capture() as generators:
...     pass  # capture here; register ``generators`` with every CUDA graph
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import DualgraphError

__all__ = ["TransformerEngine", "set_by_te_forward", "transformer_engine_capture"]

_PYTORCH = "transformer_engine.pytorch"

#: The public flags a TE module's forward sets on every call, before it reads them, from TE's
#: global state (``module/base.py``: ``prepare_forward``, ``init_fp8_metadata`` and
#: ``is_debug_iter``; ``DotProductAttention.init_fp8_metadata``): an eager call outside FP8 or
#: a calibration sets them otherwise, and the next call sets them back. The FP8 state they come
#: from is compared per replay on its own (``_te_precision.py``); so is the autocast state
#: ``activation_dtype`` is set from (``set_activation_dtype``), or else the input's dtype.
TE_FORWARD_FLAGS = frozenset(
    {
        "activation_dtype",
        "fp8",
        "fp8_calibration",
        "fp8_parameters",
        "fp8_initialized",
        "forwarded_at_least_once",
        "allow_different_data_and_param_types",
        "debug_last_iteration",
        "debug_enabled_in_this_iteration",
        "next_iter_when_debug_should_be_run",
    }
)


def set_by_te_forward(module: object) -> frozenset[str]:
    """The names of :data:`TE_FORWARD_FLAGS` for a TE module, none for any other (nor when the
    program has not imported TE)."""
    base = getattr(sys.modules.get(f"{_PYTORCH}.module.base"), "TransformerEngineBaseModule", None)
    if isinstance(base, type) and isinstance(module, base):
        return TE_FORWARD_FLAGS
    return frozenset()


@contextmanager
def transformer_engine_capture() -> Iterator[list[Any]]:
    """Tell TE a capture is under way; yield the TE RNG generator states graphs must register."""
    if _PYTORCH not in sys.modules:
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


@dataclass(frozen=True, eq=False)
class TransformerEngine:
    """The TE entry points dualgraph's FP8 support uses (``None`` where this TE has none).

    - ``manager``: ``FP8GlobalStateManager`` (``transformer_engine.pytorch.quantization``, or
      ``.fp8`` before TE 2.9): the global FP8 state, amax buffers and their update.
    - ``autocast(enabled, calibrating, recipe, group, graph)``: TE's autocast context
      (``quantization.autocast``; ``fp8_autocast`` where there is none) with its ``_graph`` flag.
    - ``default_recipe()``: the recipe TE uses when none is given.
    - ``recipe_base``: ``transformer_engine.common.recipe.Recipe``.
    - ``base_module``, ``basic_operation``, ``op_sequential``, ``attention``: the classes
      ``TransformerEngineBaseModule``, ``ops.BasicOperation``, ``ops.Sequential`` and
      ``DotProductAttention``.
    - ``has_delayed_scaling_state(fp8_meta)``: whether a module's FP8 metadata keeps an amax
      history (a private TE function; ``None`` where absent).
    """

    manager: Any
    autocast: Callable[[bool, bool, Any, Any, bool], AbstractContextManager[Any]]
    default_recipe: Callable[[], Any]
    recipe_base: type
    base_module: type | None
    basic_operation: type | None
    op_sequential: type | None
    attention: type | None
    has_delayed_scaling_state: Callable[[dict[str, Any]], bool] | None

    @classmethod
    def imported(cls) -> TransformerEngine | None:
        """TE's entry points if the program imported ``transformer_engine.pytorch``, else None."""
        if sys.modules.get(_PYTORCH) is None:
            return None
        return cls.load()

    @classmethod
    def load(cls) -> TransformerEngine:
        """Import TE (when asked for its features) and look its entry points up."""
        try:
            pytorch = importlib.import_module(_PYTORCH)
            recipes = importlib.import_module("transformer_engine.common.recipe")
        except ImportError as error:
            raise DualgraphError(
                "enabled=, recipe=, amax_reduction_group=, calibrating= and "
                "cache_quantized_params= are Transformer Engine's, which does not import here "
                f"({type(error).__name__}: {error}); install it with pip install dualgraph[te]"
            ) from None
        quantization = _module("quantization") or _module("fp8")
        manager = getattr(quantization, "FP8GlobalStateManager", None)
        if manager is None:
            raise DualgraphError(
                "this Transformer Engine has no FP8GlobalStateManager where dualgraph looks for "
                "it (transformer_engine.pytorch.quantization or .fp8); TE >= 2.0 is supported"
            )
        ops = _module("ops")
        return cls(
            manager=manager,
            autocast=_autocast_of(quantization),
            default_recipe=quantization.get_default_fp8_recipe,
            recipe_base=recipes.Recipe,
            base_module=getattr(_module("module.base"), "TransformerEngineBaseModule", None),
            basic_operation=getattr(ops, "BasicOperation", None),
            op_sequential=getattr(ops, "Sequential", None),
            attention=getattr(pytorch, "DotProductAttention", None),
            has_delayed_scaling_state=getattr(quantization, "_has_delayed_scaling_state", None),
        )


def _module(name: str) -> Any:
    try:
        return importlib.import_module(f"{_PYTORCH}.{name}")
    except ImportError:
        return None


def _autocast_of(
    quantization: Any,
) -> Callable[[bool, bool, Any, Any, bool], AbstractContextManager[Any]]:
    autocast = getattr(quantization, "autocast", None)
    if autocast is not None:  # TE 2.9+

        def enter(enabled: bool, calibrating: bool, recipe: Any, group: Any, graph: bool) -> Any:
            return autocast(
                enabled=enabled,
                calibrating=calibrating,
                recipe=recipe,
                amax_reduction_group=group,
                _graph=graph,
            )

        return enter
    fp8_autocast = quantization.fp8_autocast

    def enter_fp8(enabled: bool, calibrating: bool, recipe: Any, group: Any, graph: bool) -> Any:
        return fp8_autocast(
            enabled=enabled,
            calibrating=calibrating,
            fp8_recipe=recipe,
            fp8_group=group,
            _graph=graph,
        )

    return enter_fp8


def _rng_generator_states() -> list[Any]:
    from transformer_engine.pytorch import (  # type: ignore[import-not-found,unused-ignore]
        distributed as te_distributed,
    )

    if not te_distributed.graph_safe_rng_available():
        return []
    return list(te_distributed.get_all_rng_states().values())
