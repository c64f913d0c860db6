"""A stand-in for the parts of Transformer Engine that dualgraph uses, for tests without TE.

:class:`StandIn` installs fake ``transformer_engine`` modules into ``sys.modules``: an
``FP8GlobalStateManager`` and ``autocast`` that keep TE's global FP8 state as TE 2.20 does
(``transformer_engine/pytorch/quantization.py``: the autocast depth and "first FP8 module" mark,
read and set with ``get_autocast_state``/``set_autocast_state``, the ``_graph`` flag, the global
amax buffers that modules join once (``quantization_state.global_*_buffer``), the forward update
at the outermost autocast's exit, the weight-cast flag), recipe classes with TE's classmethods, and
:class:`FakeFP8Linear`, a TE-like layer with delayed scaling that behaves as TE's ``Linear``
does around that state: it joins the buffers in its first FP8 forward unless a graph is being
captured, records amaxes in its histories, scales with them, takes the "first module" mark (then
its backward updates the backward scales unless a graph is being captured) and caches its cast
weight across micro-batches. Its numbers are simple (rounding to a grid of the scale, not FP8),
but they change with every scale and history update, so a missed or doubled update shows.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import optree
import pytest
import torch

FP8_MAX = 8.0  # the stand-in's "largest FP8 value": scales are FP8_MAX / amax


class Recipe:
    """Stand-in for ``transformer_engine.common.recipe.Recipe`` and its classmethods."""

    amax_history_len = 4  # what the stand-in's layer reads of any recipe
    margin = 0

    @classmethod
    def delayed(cls) -> bool:
        return False

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return False

    @classmethod
    def mxfp8(cls) -> bool:
        return False

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return False

    @classmethod
    def nvfp4(cls) -> bool:
        return False

    @classmethod
    def custom(cls) -> bool:
        return False


class DelayedScaling(Recipe):
    def __init__(self, amax_history_len: int = 4, margin: int = 0) -> None:
        self.amax_history_len = amax_history_len
        self.margin = margin
        self.fp8_dpa = self.fp8_mha = False

    @classmethod
    def delayed(cls) -> bool:
        return True

    def __repr__(self) -> str:
        return f"recipe_type=DelayedScaling, margin={self.margin}, amax_history_len=" + str(
            self.amax_history_len
        )


class Float8CurrentScaling(Recipe):
    @classmethod
    def float8_current_scaling(cls) -> bool:
        return True

    def __repr__(self) -> str:
        return "recipe_type=Float8CurrentScaling"


class CustomRecipe(Recipe):
    """A custom recipe; ``delayed_quantizers``: its factory asks for delayed-scaling ones."""

    def __init__(self, delayed_quantizers: bool = False) -> None:
        self.delayed_quantizers = delayed_quantizers
        self.amax_history_len, self.margin = 4, 0

    @classmethod
    def custom(cls) -> bool:
        return True

    def __repr__(self) -> str:
        return "recipe_type=CustomRecipe"


class FutureRecipe(Recipe):
    """A recipe kind dualgraph does not know."""

    def __repr__(self) -> str:
        return "recipe_type=FutureRecipe"


@dataclass
class Scaling:
    """A module's FP8 scale and amax history for one direction (TE's recipe state)."""

    scale: torch.Tensor
    amax_history: torch.Tensor


class CurrentScaling:
    """A module's recipe state under current scaling (TE's ``Float8CurrentScalingRecipeState``):
    no scale or amax history, each tensor is scaled from its own amax."""


def _scale_of(state: Any, t: torch.Tensor) -> torch.Tensor:
    if isinstance(state, Scaling):
        return state.scale
    return FP8_MAX / t.abs().amax().clamp_min(1e-12).reshape(1)


def _record_amax(state: Any, t: torch.Tensor) -> None:
    if isinstance(state, Scaling):
        state.amax_history[0].copy_(t.abs().amax().reshape(1))


class TransformerEngineBaseModule(torch.nn.Module):
    """Stand-in for TE's module base class: FP8 metadata, saved and reset as TE does."""

    primary_weights_in_fp8 = False

    def __init__(self) -> None:
        super().__init__()
        self.fp8_meta: dict[str, Any] = {}
        # TE's public flags (module/base.py); its forward sets the first ones on every call
        self.fp8 = self.fp8_calibration = self.fp8_initialized = False
        self.tp_size, self.sequence_parallel = 1, False
        self._fp8_workspaces: dict[str, torch.Tensor] = {}  # TE's cast weights, kept per name

    def fast_setattr(self, name: str, value: Any) -> None:
        self.__dict__[name] = value

    def prepare_forward(self, manager: Any) -> None:
        """TE's ``prepare_forward``/``init_fp8_metadata``: flags from the global FP8 state."""
        self.fast_setattr("allow_different_data_and_param_types", False)
        self.fast_setattr("forwarded_at_least_once", True)
        self.fast_setattr("fp8_parameters", False)
        self.fast_setattr("fp8", manager.is_fp8_enabled())
        self.fast_setattr("fp8_calibration", manager.is_fp8_calibration())
        self.fast_setattr("fp8_initialized", self.fp8 or self.fp8_calibration)

    def get_fp8_meta_tensors(self) -> Any:
        if "scaling_fwd" not in self.fp8_meta:
            return None
        return {
            key: [self.fp8_meta[key].scale.clone(), self.fp8_meta[key].amax_history.clone()]
            for key in ("scaling_fwd", "scaling_bwd")
        }

    def adjust_amax_history_length(self, length: int) -> None:
        """As TE's: a history of another length is replaced by a new tensor (cut, or padded
        with zeros), also in the global buffers."""
        for key in ("scaling_fwd", "scaling_bwd"):
            state = self.fp8_meta.get(key)
            if not isinstance(state, Scaling) or state.amax_history.shape[0] == length:
                continue
            old = state.amax_history
            if length < old.shape[0]:
                state.amax_history = old[:length].clone()
            else:
                state.amax_history = torch.nn.functional.pad(old, (0, 0, 0, length - old.shape[0]))
            qstate = getattr(getattr(self, "te", None), "quantization_state", None)
            for tensors in {} if qstate is None else qstate.global_amax_history_buffer.values():
                tensors[:] = [state.amax_history if t is old else t for t in tensors]

    def reset_fp8_meta_tensors(self, saved: Any = None) -> None:
        for key in ("scaling_fwd", "scaling_bwd"):
            if key not in self.fp8_meta:
                continue
            state = self.fp8_meta[key]
            with torch.no_grad():
                if saved is None:
                    state.scale.fill_(1.0)
                    state.amax_history.zero_()
                else:
                    state.scale.copy_(saved[key][0])
                    state.amax_history.copy_(saved[key][1])


class StandIn:
    """The fake TE modules, their global state, and a log of what TE was asked to do."""

    def __init__(self, *, graph_safe_rng: bool = True) -> None:
        self.log: list[str] = []
        self.reset()
        self.capturing = False
        self.generator_states = ["tracker-state-a", "tracker-state-b"]
        fake = self

        class FP8GlobalStateManager:
            @classmethod
            def is_fp8_enabled(cls) -> bool:
                return fake.enabled

            @classmethod
            def is_fp8_calibration(cls) -> bool:
                return fake.calibrating

            @classmethod
            def get_fp8_recipe(cls) -> Any:
                return fake.recipe if fake.recipe is not None else DelayedScaling()

            @classmethod
            def get_fp8_group(cls) -> Any:
                return fake.group

            @classmethod
            def fp8_graph_capturing(cls) -> bool:
                return fake.graph

            @classmethod
            def is_first_fp8_module(cls) -> bool:
                first, fake.first = fake.first, False
                return first

            @classmethod
            def get_autocast_state(cls) -> tuple[Any, ...]:
                return (fake.enabled, fake.calibrating, fake.recipe, fake.group, fake.first)

            @classmethod
            def set_autocast_state(cls, state: tuple[Any, ...]) -> None:
                (fake.enabled, fake.calibrating, fake.recipe, fake.group, fake.first) = state

            @classmethod
            def add_fp8_tensors_to_global_buffer(cls, meta: dict[str, Any]) -> None:
                if not meta["recipe"].delayed() or "buffer_index" in meta:
                    return
                meta["buffer_index"] = len(fake.joined)
                fake.joined.append(meta)
                fake.log.append(f"join {meta['name']}")
                # TE's buffers hold each joined layer's history and scale, per direction
                qstate = fake.quantization_state
                for key, direction in (("scaling_fwd", "forward"), ("scaling_bwd", "backward")):
                    buffer = f"{direction}_recipe={meta['recipe']!r}"
                    state = meta[key]
                    qstate.global_amax_history_buffer.setdefault(buffer, []).append(
                        state.amax_history
                    )
                    qstate.global_scale_buffer.setdefault(buffer, []).append(state.scale)

            @classmethod
            def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
                key = "scaling_fwd" if forward else "scaling_bwd"
                fake.log.append(f"update {'forward' if forward else 'backward'}")
                for meta in fake.joined:
                    _update(meta[key], meta["recipe"])

            @classmethod
            def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
                if fake.skip is None:
                    fake.skip = torch.empty(1)
                fake.skip.fill_(skip)

            @classmethod
            def get_skip_fp8_weight_update_tensor(cls) -> torch.Tensor | None:
                return fake.skip

        class autocast:
            def __init__(
                self,
                enabled: bool = True,
                calibrating: bool = False,
                recipe: Any = None,
                amax_reduction_group: Any = None,
                _graph: bool = False,
            ) -> None:
                self.args = (enabled, calibrating, recipe, amax_reduction_group, _graph)

            def __enter__(self) -> autocast:
                enabled, calibrating, recipe, group, graph = self.args
                self.saved = (fake.enabled, fake.calibrating, fake.recipe, fake.group)
                self.saved += (fake.first, fake.graph)
                fake.log.append(f"enter enabled={enabled} calibrating={calibrating} graph={graph}")
                fake.enabled, fake.calibrating = enabled, calibrating
                fake.recipe = recipe if recipe is not None else DelayedScaling()
                fake.group, fake.graph = group, graph
                if fake.depth == 0:
                    fake.first = True
                fake.depth += 1
                return self

            def __exit__(self, *exc: Any) -> None:
                enabled, graph = self.args[0], self.args[4]
                (fake.enabled, fake.calibrating, fake.recipe, fake.group) = self.saved[:4]
                fake.first, fake.graph = self.saved[4:]
                fake.depth -= 1
                fake.log.append(f"exit enabled={enabled} graph={graph}")
                if enabled and fake.depth == 0 and not graph and torch.is_grad_enabled():
                    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)

        self.FP8GlobalStateManager = FP8GlobalStateManager
        FP8GlobalStateManager.quantization_state = self.quantization_state  # type: ignore[attr-defined]
        self.autocast = autocast
        self._build_modules()

    def reset(self) -> None:
        """TE's ``FP8GlobalStateManager.reset()``: a new global state."""
        self.enabled = self.calibrating = self.first = self.graph = False
        self.recipe: Any = None
        self.group: Any = None
        self.depth = 0
        self.joined: list[dict[str, Any]] = []
        self.skip: torch.Tensor | None = None
        # TE 2.20's FP8GlobalState, the part read from outside: the global buffers
        self.quantization_state = types.SimpleNamespace(
            global_amax_history_buffer={}, global_scale_buffer={}
        )
        manager = getattr(self, "FP8GlobalStateManager", None)
        if manager is not None:
            manager.quantization_state = self.quantization_state

    def _build_modules(self) -> None:
        quantization = types.ModuleType("transformer_engine.pytorch.quantization")
        quantization.FP8GlobalStateManager = self.FP8GlobalStateManager  # type: ignore[attr-defined]
        quantization.autocast = self.autocast  # type: ignore[attr-defined]
        quantization.get_default_fp8_recipe = DelayedScaling  # type: ignore[attr-defined]

        def has_delayed_scaling_state(meta: dict[str, Any]) -> bool:
            return bool(meta["recipe"].delayed() or meta.get("custom_delayed"))

        quantization._has_delayed_scaling_state = has_delayed_scaling_state  # type: ignore[attr-defined]
        graph = types.ModuleType("transformer_engine.pytorch.graph")
        graph.is_graph_capturing = lambda: self.capturing  # type: ignore[attr-defined]
        graph.set_capture_start = self._start  # type: ignore[attr-defined]
        graph.set_capture_end = self._end  # type: ignore[attr-defined]
        distributed = types.ModuleType("transformer_engine.pytorch.distributed")
        distributed.graph_safe_rng_available = lambda: True  # type: ignore[attr-defined]
        distributed.get_all_rng_states = lambda: {  # type: ignore[attr-defined]
            f"tracker{i}": s for i, s in enumerate(self.generator_states)
        }
        base = types.ModuleType("transformer_engine.pytorch.module.base")
        base.TransformerEngineBaseModule = TransformerEngineBaseModule  # type: ignore[attr-defined]
        module = types.ModuleType("transformer_engine.pytorch.module")
        module.base = base  # type: ignore[attr-defined]
        ops = types.ModuleType("transformer_engine.pytorch.ops")
        pytorch = types.ModuleType("transformer_engine.pytorch")
        for name, value in (
            ("graph", graph),
            ("distributed", distributed),
            ("quantization", quantization),
            ("module", module),
            ("ops", ops),
            ("autocast", self.autocast),
        ):
            setattr(pytorch, name, value)
        recipe = types.ModuleType("transformer_engine.common.recipe")
        recipe.Recipe = Recipe  # type: ignore[attr-defined]
        common = types.ModuleType("transformer_engine.common")
        common.recipe = recipe  # type: ignore[attr-defined]
        self.modules = {
            "transformer_engine": types.ModuleType("transformer_engine"),
            "transformer_engine.pytorch": pytorch,
            "transformer_engine.pytorch.graph": graph,
            "transformer_engine.pytorch.distributed": distributed,
            "transformer_engine.pytorch.quantization": quantization,
            "transformer_engine.pytorch.module": module,
            "transformer_engine.pytorch.module.base": base,
            "transformer_engine.pytorch.ops": ops,
            "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe,
        }
        self.graph_module = graph
        self.distributed = distributed

    def _start(self) -> None:
        self.capturing = True
        self.log.append("capture start")

    def _end(self) -> None:
        self.capturing = False
        self.log.append("capture end")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> StandIn:
        for name, value in self.modules.items():
            monkeypatch.setitem(sys.modules, name, value)
        return self

    @contextmanager
    def fp8(self, recipe: Any = None, **kwargs: Any) -> Iterator[None]:
        """``te.autocast(enabled=True, recipe=recipe, ...)``."""
        with self.autocast(enabled=True, recipe=recipe, **kwargs):
            yield

    def linear(self, name: str, size: int = 4, *, seed: int = 0) -> torch.nn.Module:
        return FakeFP8Linear(self, name, size, seed=seed)


def _quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(t * scale) / scale


def _update(state: Scaling, recipe: Any) -> None:
    # TE's delayed-scaling update: the scale from the largest amax in the history, the history
    # rolled and its newest entry cleared for the next step (a layer whose state TE has since
    # made a current-scaling one keeps no history to update)
    if not isinstance(state, Scaling):
        return
    with torch.no_grad():
        amax = state.amax_history.max(dim=0).values
        scale = torch.where(amax > 0, FP8_MAX / amax / 2**recipe.margin, state.scale)
        state.scale.copy_(scale)
        state.amax_history.copy_(torch.roll(state.amax_history, -1, 0))
        state.amax_history[0].zero_()


class FakeFP8Linear(TransformerEngineBaseModule):
    """A TE-like linear layer under delayed scaling (see the module docstring)."""

    def __init__(self, te: StandIn, name: str, size: int, *, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(size, size, generator=generator) / 2)
        self.te = te
        self.label = name

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        te = self.te
        manager = te.FP8GlobalStateManager
        self.prepare_forward(manager)
        if not self.fp8:
            return x @ self.weight.t()
        meta = self.fp8_meta
        recipe = manager.get_fp8_recipe()
        history = recipe.amax_history_len
        current = recipe.float8_current_scaling()
        if "scaling_fwd" not in meta or isinstance(meta["scaling_fwd"], CurrentScaling) != current:
            for key in ("scaling_fwd", "scaling_bwd"):  # TE's state for the recipe's kind
                meta[key] = (
                    CurrentScaling() if current else Scaling(x.new_ones(1), x.new_zeros(history, 1))
                )
            meta["name"] = self.label
            meta["custom_delayed"] = getattr(manager.get_fp8_recipe(), "delayed_quantizers", False)
        else:  # TE's init_fp8_metadata under another recipe: the histories take its length
            self.adjust_amax_history_length(history)
        meta["recipe"], meta["fp8_group"] = manager.get_fp8_recipe(), manager.get_fp8_group()
        skip = None
        if manager.fp8_graph_capturing():
            skip = manager.get_skip_fp8_weight_update_tensor()
        else:
            manager.add_fp8_tensors_to_global_buffer(meta)
        if skip is not None:
            is_first_microbatch = False
        first = manager.is_first_fp8_module() if torch.is_grad_enabled() else False
        weight = self._cast_weight(is_first_microbatch, skip)
        return _FakeFP8Matmul.apply(x, self.weight, weight, meta, first, te)

    def _cast_weight(self, is_first_microbatch: bool | None, skip: torch.Tensor | None) -> Any:
        with torch.no_grad():
            fresh = _quantize(self.weight, _scale_of(self.fp8_meta["scaling_fwd"], self.weight))
            if is_first_microbatch is None:
                return fresh
            cache = self._fp8_workspaces.get("weight")
            if cache is None:
                cache = self._fp8_workspaces["weight"] = fresh.clone()
            elif skip is not None:
                cache.copy_(torch.where(skip.bool(), cache, fresh))
            elif is_first_microbatch:
                cache.copy_(fresh)
            return cache


class _FakeFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        cast_weight: torch.Tensor,
        meta: dict[str, Any],
        first: bool,
        te: StandIn,
    ) -> torch.Tensor:
        forward = meta["scaling_fwd"]
        _record_amax(forward, x)
        cast_x = _quantize(x, _scale_of(forward, x))
        ctx.save_for_backward(cast_x, cast_weight.clone())
        ctx.meta, ctx.first, ctx.te = meta, first, te
        return cast_x @ cast_weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        cast_x, cast_weight = ctx.saved_tensors
        backward = ctx.meta["scaling_bwd"]
        _record_amax(backward, grad)
        cast_grad = _quantize(grad, _scale_of(backward, grad))
        grad_x = cast_grad @ cast_weight
        grad_weight = cast_grad.reshape(-1, cast_grad.shape[-1]).t() @ cast_x.reshape(
            -1, cast_x.shape[-1]
        )
        te = ctx.te
        if ctx.first and not te.graph_module.is_graph_capturing():
            te.FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return grad_x, grad_weight, None, None, None, None


class Chain(torch.nn.Module):
    """Layers in a row, each given the call's keyword arguments (``is_first_microbatch``)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, **kwargs)
        return x


class FakeFP8Weight(torch.Tensor):
    """Stand-in for TE's FP8 weights (``QuantizedTensor`` parameters): a tensor subclass whose
    ``zeros_like`` is another of its kind, as TE's is, while the ops of a forward and backward
    give plain tensors (TE's dequantize). :func:`fp8_weight_linear` makes a layer with one."""

    _KEEP = (torch.zeros_like, torch.empty_like, torch.Tensor.detach, torch.Tensor.requires_grad_)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func in cls._KEEP:
            return result
        return optree.tree_map(
            lambda t: t.as_subclass(torch.Tensor) if type(t) is cls else t, result
        )


def fp8_weight_linear(seed: int = 0) -> torch.nn.Linear:
    """A ``Linear(4, 4)`` whose weight is a :class:`FakeFP8Weight` (the same for one seed)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(4, 4)
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone().as_subclass(FakeFP8Weight))
    return layer
