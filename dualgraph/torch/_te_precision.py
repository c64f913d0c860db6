"""Transformer Engine precision per graphed callable, and the FP8 bookkeeping of every replay.

Eager TE training runs each micro-batch's forwards inside ``te.autocast``. Under delayed scaling
(``DelayedScaling``) the FP8 scales come from an amax history: each TE module, in its first FP8
forward, adds its amax and scale tensors to TE's global buffers; the exit of the outermost
autocast reduces the forward amaxes (over its ``amax_reduction_group``), rolls the histories and
updates the scales; the backward of the first FP8 module of the autocast region does the same
for the backward amaxes. A replay runs kernels, not that Python. So, as TE's own
``make_graphed_callables`` does:

- **Capture.** Each callable's warmup and capture calls (and ``"emulate"`` replays) run inside
  ``te.autocast(enabled, calibrating, recipe, amax_reduction_group, _graph=True)``: the
  callable's own arguments, or those of the autocast ``make_graphed_callables`` was called in.
  There TE modules join no buffer and reduce nothing, and the replay takes the autocast's
  "first FP8 module" mark first, so no module's backward reduces either. Under delayed scaling
  the modules' scales and amax histories are saved before warmup and put back after capture:
  graphing changes no FP8 state.
- **Every replay in FP8** (a :class:`~dualgraph.torch.ReplayHooks` of dualgraph's own): before
  the forward, the flag the captured weight casts read is set from ``is_first_microbatch``
  (weight caching); once the forward has replayed (a call refused before it keeps no books, as
  an eager call that never ran), the modules that ran in the captured forward join the global
  buffers (once; TE ignores a second time) and the replay takes the region's "first FP8
  module" mark (TE's ``is_first_fp8_module``); after the backward, the replay that took the
  mark reduces and updates the backward scales. The forward scales are updated, as in eager, when
  the caller's ``te.autocast`` exits; so a callable captured in FP8 replays inside a
  ``te.autocast`` of the same recipe and group, and a replay elsewhere is refused (a graph
  replays the precision it was captured in).

>>> Precision.off().active
False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CaptureError, DualgraphError
from ._replay_hooks import ReplayCall, ReplayHooks, ReplayKwarg
from ._te_state import (
    STATE_KEYS,
    has_histories,
    layer_state,
    note_layers_run,
    put_back_layer_state,
)
from ._transformer_engine import TransformerEngine

__all__ = ["FIRST_MICROBATCH", "Precision", "PrecisionArgs", "TECallable", "te_callables"]

#: The replay kwarg of weight caching, named as Transformer Engine names it.
FIRST_MICROBATCH = "is_first_microbatch"
_TOOK_FIRST = "dualgraph.te_first_fp8_module"  # ReplayCall.state key: this replay took the mark
# Recipes that keep no host-side state between steps, so that a replay needs no bookkeeping for
# them beyond what every FP8 replay does; TE's recipe classmethods that recognise them.
_STATELESS_KINDS = ("float8_current_scaling", "mxfp8", "float8_block_scaling", "nvfp4")


@dataclass(frozen=True)
class PrecisionArgs:
    """The TE arguments of :func:`~dualgraph.torch.make_graphed_callables`, as given."""

    enabled: Any = None
    recipe: Any = None
    amax_reduction_group: Any = None
    calibrating: Any = None
    cache_quantized_params: bool = False

    @property
    def per_callable(self) -> bool:
        """Whether the precision was given (else it is the ambient autocast's)."""
        return any(
            value is not None
            for value in (self.enabled, self.recipe, self.amax_reduction_group, self.calibrating)
        )

    @property
    def given(self) -> bool:
        return self.per_callable or self.cache_quantized_params


@dataclass(frozen=True)
class Precision:
    """How one callable is captured: ``te.autocast``'s arguments, and whether they are the ambient
    autocast's (then every replay must run in that same autocast)."""

    enabled: bool
    calibrating: bool
    recipe: Any  # None when neither enabled nor calibrating
    group: Any
    follows_ambient: bool

    @classmethod
    def off(cls) -> Precision:
        """No FP8: outside any ``te.autocast``, or in one that is off."""
        return _OFF

    @property
    def active(self) -> bool:
        """Whether TE quantizes (``enabled``) or records amaxes (``calibrating``) under it."""
        return self.enabled or self.calibrating

    def describe(self) -> str:
        """How a user would write it: ``te.autocast(enabled=True, recipe=...)``."""
        if not self.active:
            return "no FP8 te.autocast"
        parts = [f"enabled={self.enabled}"]
        if self.calibrating:
            parts.append("calibrating=True")
        parts.append(f"recipe={self.recipe!r}")
        if self.group is not None:
            parts.append(f"amax_reduction_group={self.group!r}")
        return f"te.autocast({', '.join(parts)})"


_OFF = Precision(False, False, None, None, True)


def ambient_precision(te: TransformerEngine) -> Precision:
    """The precision of the ``te.autocast`` the caller is in now."""
    manager = te.manager
    enabled = bool(manager.is_fp8_enabled())
    calibrating = bool(manager.is_fp8_calibration())
    if not (enabled or calibrating):
        return Precision.off()
    return Precision(enabled, calibrating, manager.get_fp8_recipe(), manager.get_fp8_group(), True)


def _same_recipe(a: Any, b: Any) -> bool:
    # TE keys its autocast regions by the recipe's repr; two recipes with the same type and
    # repr quantize and update alike.
    return a is b or (type(a) is type(b) and repr(a) == repr(b))


def te_callables(
    args: PrecisionArgs,
    names: Sequence[str],
    targets: Sequence[Any],
    *,
    graphed: bool,
) -> list[TECallable] | None:
    """One :class:`TECallable` per callable, or ``None`` when TE plays no part.

    TE plays a part when the program imported it or passed TE's arguments (then dualgraph
    imports it, or says why it cannot). The arguments are checked and broadcast here; recipes
    no replay can follow are refused (``CaptureError``) when ``graphed``.
    """
    te = TransformerEngine.load() if args.given else TransformerEngine.imported()
    if te is None:
        return None
    count = len(names)
    if args.per_callable:
        enabled = _each("enabled", args.enabled, count, _is_bool, "a bool", default=False)
        calibrating = _each(
            "calibrating", args.calibrating, count, _is_bool, "a bool", default=False
        )
        recipes = _each(
            "recipe",
            args.recipe,
            count,
            lambda value: value is None or isinstance(value, te.recipe_base),
            "a transformer_engine.common.recipe.Recipe (or None: TE's default)",
            default=None,
        )
        groups = _each(
            "amax_reduction_group",
            args.amax_reduction_group,
            count,
            _is_group,
            "a torch.distributed ProcessGroup (or None)",
            default=None,
        )
        precisions = [
            _given_precision(te, *values)
            for values in zip(enabled, calibrating, recipes, groups, strict=True)
        ]
    else:
        precisions = [ambient_precision(te)] * count
    if not isinstance(args.cache_quantized_params, bool):
        kind = type(args.cache_quantized_params).__name__
        raise DualgraphError(f"cache_quantized_params must be a bool, got {kind}")
    callables = [
        TECallable(te, name, index, target, precision, args.cache_quantized_params)
        for index, (name, target, precision) in enumerate(
            zip(names, targets, precisions, strict=True)
        )
    ]
    if graphed:
        for item in callables:
            item.refuse_what_replays_cannot_follow()
    return callables


def _given_precision(
    te: TransformerEngine, enabled: bool, calibrating: bool, recipe: Any, group: Any
) -> Precision:
    if not (enabled or calibrating):
        return Precision(False, False, None, group, follows_ambient=False)
    if recipe is None:
        recipe = te.default_recipe()
    return Precision(enabled, calibrating, recipe, group, follows_ambient=False)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_group(value: Any) -> bool:
    if value is None:
        return True
    distributed = torch.distributed
    return distributed.is_available() and isinstance(value, distributed.ProcessGroup)


def _each(
    option: str,
    value: Any,
    count: int,
    valid: Callable[[Any], bool],
    expected: str,
    *,
    default: Any,
) -> list[Any]:
    """``value`` for each of ``count`` callables: one value for all, or a tuple with one each."""
    if value is None:
        return [default] * count
    values = list(value) if isinstance(value, tuple | list) else [value] * count
    if len(values) != count:
        raise DualgraphError(
            f"{option} is one value for every callable or a tuple with one per callable "
            f"({count}), got {len(values)}"
        )
    for i, item in enumerate(values):
        if not valid(item):
            where = f"{option}[{i}]" if isinstance(value, tuple | list) else option
            raise DualgraphError(f"{where} must be {expected}, got {type(item).__name__}")
    return [default if item is None else item for item in values]


class TECallable:
    """One callable's TE precision: the contexts it runs in, and what each replay does.

    Built before capture; :func:`capturing` brackets the capture of all of them; what the
    capture shows (the TE modules its forward ran, the weight-cast flag) is kept for the replays.
    """

    def __init__(
        self,
        te: TransformerEngine,
        name: str,
        index: int,
        target: Any,
        precision: Precision,
        cache_quantized_params: bool,
    ) -> None:
        self.te = te
        self.name = name
        self.index = index
        self.target = target  # the module, or the function
        self.precision = precision
        self.cache_quantized_params = cache_quantized_params
        self._kind = _recipe_kind(precision.recipe) if precision.active else None
        self._thread: int | None = None  # the thread whose forward is being captured
        self._seen: dict[int, torch.nn.Module] = {}  # TE modules the captured forwards ran
        self._checked_custom = False
        # delayed scaling: the layers whose FP8 state capture keeps (by id), and the state of
        # those first known when they ran (not the module's own), put back after capture
        self._kept: set[int] = set()
        self._saved_late: list[tuple[Any, Any]] = []
        # set by capturing(): what the replays touch
        self._modules: tuple[Any, ...] = ()  # TE modules whose FP8 metadata joins the buffers
        self._attention: tuple[Any, ...] = ()  # DotProductAttention: only with FP8 attention
        self._ops: tuple[Any, ...] = ()  # basic ops of TE's operation fuser
        self._skip: torch.Tensor | None = None  # the weight-cast flag the graphs read
        # delayed scaling: each joined layer's metadata, key, recipe state, scale and history,
        # as the graphs read them (TE gives a layer new ones when it runs under another recipe)
        self._states: tuple[tuple[Any, str, Any, Any, Any], ...] = ()

    # -- what the capture and the hooks ask -------------------------------------------------

    @property
    def runs_in_autocast(self) -> bool:
        """Whether its Python runs inside a TE autocast of dualgraph's during capture."""
        return (
            not self.precision.follows_ambient
            or self.precision.active
            or self.cache_quantized_params
        )

    def run(self) -> AbstractContextManager[Any]:
        """The context of a warmup, capture or ``"emulate"`` replay call."""
        return self._in_autocast(graph=True)

    def run_eager(self) -> AbstractContextManager[Any]:
        """The context of a call on the ``"eager"`` backend (given arguments only).

        A callable captured with ``enabled=True`` runs in the caller's autocast, which its
        replay check requires to be the same: one more autocast inside it would give each
        callable TE's "first FP8 module" mark (an autocast's exit restores it), where graphed
        callables, as TE's own, take it once per caller's autocast. One captured with
        ``enabled=False`` runs inside ``te.autocast(enabled=False, ...)``, as it was captured.
        """
        if self.precision.enabled:
            return contextlib.nullcontext()
        return self._in_autocast(graph=False)

    def replay_hooks(self) -> ReplayHooks:
        return ReplayHooks(
            before_forward=self._before_forward,
            after_forward=self._after_forward,
            after_backward=self._after_backward,
        )

    def replay_kwargs(self) -> tuple[ReplayKwarg, ...]:
        if not self.cache_quantized_params:
            return ()
        return (
            ReplayKwarg(
                FIRST_MICROBATCH,
                check=_first_microbatch_problem,
                missing=(
                    "captured with cache_quantized_params=True, every call passes "
                    "is_first_microbatch=True on the first micro-batch of a step (the cached "
                    "FP8 weights are cast again) or False on the others (they are reused)"
                ),
                to_eager=True,
            ),
        )

    @contextlib.contextmanager
    def around(self, phase: str) -> Iterator[None]:
        """Capture-time observer: note the TE modules each warmup and capture forward runs."""
        if phase != "forward" or not self.precision.active:
            yield
            return
        self._thread = threading.get_ident()
        handle = torch.nn.modules.module.register_module_forward_hook(self._saw)
        # delayed scaling: the state of a layer the module does not own is kept at its first run
        early = (
            torch.nn.modules.module.register_module_forward_pre_hook(self._save_before_first_run)
            if self._kind == "delayed" and isinstance(self.target, torch.nn.Module)
            else None
        )
        try:
            top = self.target
            if isinstance(top, torch.nn.Module):
                self._saw(top, (), None)  # called through its forward: no hook fires for it
            yield
        finally:
            handle.remove()
            if early is not None:
                early.remove()
        if not self._checked_custom and self._kind == "custom":
            self._checked_custom = True
            self._refuse_custom_delayed_scaling()

    def refuse_what_replays_cannot_follow(self) -> None:
        """Raise :class:`CaptureError` for a recipe whose state replays would not keep."""
        precision = self.precision
        if not precision.active:
            return
        if self._kind is None:
            raise CaptureError(
                f"capturing {self.name} under Transformer Engine's recipe {precision.recipe!r} "
                "is not supported: dualgraph knows what a replay must do for DelayedScaling, "
                "Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling "
                f"and CustomRecipe, and a {type(precision.recipe).__name__} may keep state "
                "between steps that replays would not update"
            )
        if self._kind == "delayed" and not isinstance(self.target, torch.nn.Module):
            raise CaptureError(
                f"capturing {self.name} under Transformer Engine's recipe {precision.recipe!r} "
                "is supported for modules only: dualgraph saves the FP8 scales and amax "
                "histories of the module's TE layers before warmup and puts them back after "
                "capture, and a function's layers are not known before it runs; graph the "
                "module, or use a recipe that scales from the current tensors"
            )

    # -- capture ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _in_autocast(self, *, graph: bool) -> Iterator[None]:
        if not self.runs_in_autocast or (not graph and self.precision.follows_ambient):
            yield
            return
        p = self.precision
        with self.te.autocast(p.enabled, p.calibrating, p.recipe, p.group, graph):
            if graph:
                # Taken here, so that no TE module of a warmup or capture call (nor of an
                # "emulate" replay, whose replay hook took it already) reduces the backward
                # amaxes; the autocast's exit gives the caller's mark back.
                self.te.manager.is_first_fp8_module()
            yield

    def _saw(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        # Every TE layer the forward runs, its module's or not (a layer held in a plain list,
        # or closed over, joins TE's buffers in eager too); none run by another thread.
        if threading.get_ident() != self._thread:
            return
        te = self.te
        if te.op_sequential is not None and isinstance(module, te.op_sequential):
            found = [m for m in module.modules() if _isinstance(m, te.basic_operation)]
        elif _isinstance(module, te.base_module) or _isinstance(module, te.basic_operation):
            found = [module]
        else:
            return
        for item in found:
            self._seen.setdefault(id(item), item)

    def _refuse_custom_delayed_scaling(self) -> None:
        check = self.te.has_delayed_scaling_state
        for meta in self._fp8_metas():
            if check is None or ("recipe" in meta and check(meta)):
                raise DualgraphError(
                    f"Transformer Engine's recipe {self.precision.recipe!r} asks for "
                    "delayed-scaling quantizers, whose amax histories dualgraph does not yet "
                    "update on replay for a CustomRecipe; use DelayedScaling itself, or "
                    "quantizers that scale from the current tensors"
                )

    def _fp8_metas(self) -> Iterator[dict[str, Any]]:
        for module in self._seen.values():
            if _isinstance(module, self.te.base_module):
                meta = getattr(module, "fp8_meta", None)
                if isinstance(meta, dict):
                    yield meta
            else:
                metas = getattr(module, "_fp8_metas", None) or {}
                for meta in metas.values():
                    if isinstance(meta, dict):
                        yield meta

    def _save_fp8_state(self) -> list[tuple[Any, Any]]:
        """The scales and amax histories of the module's TE layers (delayed scaling only)."""
        if self._kind != "delayed" or not isinstance(self.target, torch.nn.Module):
            return []
        saved: list[tuple[Any, Any]] = []
        with self.run():  # TE calls below then join no global buffer
            for module in self.target.modules():
                self._save_layer_state(module, saved)
        return saved

    def _save_layer_state(self, module: Any, saved: list[tuple[Any, Any]]) -> None:
        """Append a TE layer's (or op's) state to ``saved``, once (anything else: nothing)."""
        te, recipe = self.te, self.precision.recipe
        if id(module) in self._kept:
            return
        if _isinstance(module, te.base_module):
            self._kept.add(id(module))
            # The histories take the recipe's length now, as TE gives them at the first
            # forward under it (new tensors): so what is kept fits them when put back.
            if getattr(module, "primary_weights_in_fp8", False) or _other_length(
                module, recipe.amax_history_len
            ):
                module.adjust_amax_history_length(recipe.amax_history_len)
            saved.append((module, layer_state(te, module)))
        elif _isinstance(module, te.basic_operation):
            self._kept.add(id(module))
            module.reset_recipe_state(recipe=recipe)  # so that there is state to save
            saved.append((module, layer_state(te, module)))

    def _save_before_first_run(self, module: torch.nn.Module, inputs: Any) -> None:
        # A TE layer the module does not own (held in a plain list, closed over) is first known
        # when its forward runs: its state is kept then, before that forward records amaxes.
        if threading.get_ident() != self._thread:
            return
        te = self.te
        if te.op_sequential is not None and isinstance(module, te.op_sequential):
            layers: list[Any] = [m for m in module.modules() if _isinstance(m, te.basic_operation)]
        else:
            layers = [module]
        for layer in layers:
            self._save_layer_state(layer, self._saved_late)

    def _restore_fp8_state(self, saved: Sequence[tuple[Any, Any]]) -> None:
        late, self._saved_late = self._saved_late, []
        for module, state in [*saved, *late]:
            put_back_layer_state(self.te, module, state)

    def _learned(self) -> None:
        """Keep what the capture showed, for the replays."""
        te = self.te
        modules, attention, ops = [], [], []
        for module in self._seen.values():
            if _isinstance(module, te.attention):
                attention.append(module)
            elif _isinstance(module, te.base_module):
                modules.append(module)
            else:
                ops.append(module)
        self._modules, self._attention, self._ops = tuple(modules), tuple(attention), tuple(ops)
        note_layers_run(self._seen.values())  # verify keeps their FP8 state (_te_state.py)
        self._skip = te.manager.get_skip_fp8_weight_update_tensor()
        if self._kind == "delayed" and self.precision.enabled:
            states = []
            for meta in self._joined_metas(self.precision.recipe):
                for key in STATE_KEYS:
                    state: Any = meta.get(key)
                    if has_histories(state):
                        states.append((meta, key, state, state.scale, state.amax_history))
            self._states = tuple(states)

    def _joined_metas(self, recipe: Any) -> Iterator[dict[str, Any]]:
        """The FP8 metadata each replay joins to TE's global buffers under ``recipe`` (as
        :meth:`_after_forward` joins them, inline there)."""
        for module in self._modules:
            yield module.fp8_meta
        if self._attention and (
            getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False)
        ):
            for module in self._attention:
                yield module.fp8_meta
        for op in self._ops:
            metas = op._fp8_metas
            if not metas:
                continue
            for mode in ("forward", "backward"):
                meta = metas.get(mode)
                if meta is not None and op.num_quantizers(mode):
                    yield meta

    # -- every replay -------------------------------------------------------------------------

    def _before_forward(self, call: ReplayCall) -> None:
        now = ambient_precision(self.te)
        if now is not _OFF or self.precision is not _OFF:
            self._check_ambient(now)
        if not self.precision.enabled or call.backend == "eager":
            return  # eager calls keep TE's books themselves; high precision keeps none
        for meta, key, state, scale, history in self._states:  # the tensors the graphs read
            if (
                meta.get(key) is not state
                or state.scale is not scale
                or state.amax_history is not history
            ):
                self._refuse_replaced_state(meta, key)
        skip = self._skip
        if skip is not None:
            cached = self.cache_quantized_params and not call.replay_kwargs[FIRST_MICROBATCH]
            skip.fill_(cached)  # the captured weight casts skip their update when it is 1

    def _refuse_replaced_state(self, meta: dict[str, Any], key: str) -> None:
        layer = self._layer_named(meta)
        raise DualgraphError(
            f"{self.name}: the FP8 scales and amax histories of its Transformer Engine layer "
            f"{layer} ({key}) are other tensors than at capture: TE gives a layer new ones "
            "when it runs eagerly under a recipe of another kind or amax history length (an "
            "evaluation in another te.autocast, e.g. TE's default recipe), and the graphs read "
            "and update the ones of capture, which TE no longer updates. Graph it again "
            "(dualgraph.torch.restore, then make_graphed_callables), and run such calls under "
            f"the captured recipe {self.precision.recipe!r}"
        )

    def _layer_named(self, meta: dict[str, Any]) -> str:
        """The path of the TE layer (or op) holding ``meta`` in the graphed module, or its
        class where the module does not own it."""
        owners = [*self._modules, *self._attention, *self._ops]
        owner = next(
            (
                module
                for module in owners
                if getattr(module, "fp8_meta", None) is meta
                or meta in (getattr(module, "_fp8_metas", None) or {}).values()
            ),
            None,
        )
        if owner is None:
            return "?"
        if isinstance(self.target, torch.nn.Module):
            for path, module in self.target.named_modules():
                if module is owner:
                    return f"{type(self.target).__name__}.{path}" if path else type(owner).__name__
        return type(owner).__name__

    def _after_forward(self, call: ReplayCall) -> None:
        # Once the forward has replayed, as eager's forward keeps these books: a call refused
        # before it (a user's before_forward hook raising) took no mark and joined nothing.
        if not self.precision.enabled or call.backend == "eager":
            return
        manager = self.te.manager
        recipe, group = manager.get_fp8_recipe(), manager.get_fp8_group()
        # the metadata _joined_metas lists, inline: a generator costs every FP8 replay ~0.2 us
        for module in self._modules:
            _join(manager, module.fp8_meta, recipe, group)
        if self._attention and (
            getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False)
        ):
            for module in self._attention:
                _join(manager, module.fp8_meta, recipe, group)
        for op in self._ops:
            metas = op._fp8_metas
            if not metas:
                continue
            for mode in ("forward", "backward"):
                meta = metas.get(mode)
                if meta is not None and op.num_quantizers(mode):
                    _join(manager, meta, recipe, group)
        if call.backward_expected:
            call.state[_TOOK_FIRST] = manager.is_first_fp8_module()

    def _after_backward(self, call: ReplayCall) -> None:
        if call.state.get(_TOOK_FIRST):
            self.te.manager.reduce_and_update_fp8_tensors(forward=False)

    def _check_ambient(self, now: Precision) -> None:
        captured = self.precision
        if captured.follows_ambient:
            same = now.enabled == captured.enabled and now.calibrating == captured.calibrating
            if same and captured.active:
                same = _same_recipe(now.recipe, captured.recipe) and now.group is captured.group
            if not same:
                raise DualgraphError(
                    f"{self.name}: called under {now.describe()} but captured under "
                    f"{captured.describe()}; a graph replays the precision it was captured in"
                )
        elif captured.enabled and not (
            now.enabled
            and _same_recipe(now.recipe, captured.recipe)
            and now.group is captured.group
        ):
            raise DualgraphError(
                f"{self.name}: captured with enabled=True, so it replays inside "
                f"{captured.describe()} (as its eager forward would run, and whose exit updates "
                f"the FP8 scales), but it was called under {now.describe()}"
            )


@contextlib.contextmanager
def capturing(callables: Sequence[TECallable] | None) -> Iterator[None]:
    """Around the whole capture: the weight-cast flag exists, FP8 state is saved and restored."""
    if not callables:
        yield
        return
    if any(item.cache_quantized_params for item in callables):
        # The flag TE's weight casts read while a graph is captured: 0 updates the cached FP8
        # weights, 1 reuses them. Every replay sets it before the graph reads it.
        callables[0].te.manager.set_skip_fp8_weight_update_tensor(False)
    saved: list[tuple[TECallable, list[tuple[Any, Any]]]] = []
    try:
        for item in callables:
            try:
                saved.append((item, item._save_fp8_state()))
            except Exception as error:
                raise CaptureError(
                    f"capturing {item.name} failed while saving the FP8 scales of its "
                    f"Transformer Engine layers: {type(error).__name__}: {error}"
                ) from error
        yield
    finally:
        for item, state in reversed(saved):
            try:
                item._restore_fp8_state(state)
            except Exception as error:
                raise CaptureError(
                    f"capturing {item.name}: putting back the FP8 scales and amax histories of "
                    f"its Transformer Engine layers failed: {type(error).__name__}: {error}"
                ) from error
    for item in callables:
        item._learned()


def _join(manager: Any, meta: dict[str, Any], recipe: Any, group: Any) -> None:
    # As TE's own graphed callables do before a replay: the module's metadata names the
    # autocast it runs in, and joins that autocast's global amax buffers (once).
    meta["fp8_group"] = group
    meta["recipe"] = recipe
    manager.add_fp8_tensors_to_global_buffer(meta)


def _recipe_kind(recipe: Any) -> str | None:
    """``"delayed"``, ``"custom"``, a stateless kind, or ``None`` for a recipe not known here."""
    cls = type(recipe)
    for kind in ("delayed", *_STATELESS_KINDS, "custom"):
        test = getattr(cls, kind, None)
        if callable(test) and test():
            return kind
    return None


def _other_length(module: Any, length: int) -> bool:
    """Whether a TE layer has delayed-scaling amax histories of another length than ``length``."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict):
        return False
    for key in ("scaling_fwd", "scaling_bwd"):
        history = getattr(meta.get(key), "amax_history", None)
        if isinstance(history, torch.Tensor) and history.shape[0] != length:
            return True
    return False


def _isinstance(value: Any, cls: type | None) -> bool:
    return cls is not None and isinstance(value, cls)


def _first_microbatch_problem(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    return f"expected a bool (True on the first micro-batch of a step), got {type(value).__name__}"
