"""Transformer Engine's FP8 state outside a module's parameters and buffers, kept and put back.

A call of a TE layer under delayed scaling, eager or replayed, changes state that is neither a
parameter nor a buffer: it takes the "first FP8 module" mark of the caller's ``te.autocast``
(the first FP8 call of the region), writes the newest amax into its amax histories, and the
backward of the call that took the mark rolls the backward histories and updates the backward
scales of every layer in TE's global amax buffers. :func:`fp8_state_kept` keeps that state so
that ``verify`` can run its two sides from the same state and leave it as it found it.

>>> fp8_state_kept(None).put_back()  # without TE: nothing to keep
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ._params import set_versions, write_back
from ._transformer_engine import TransformerEngine

__all__ = [
    "STATE_KEYS",
    "FP8State",
    "LayerState",
    "fp8_state_kept",
    "has_histories",
    "layer_state",
    "note_layers_run",
    "put_back_layer_state",
    "state_tensors",
]

#: Every TE layer (or op) a capture saw a callable's forward run, its module's or not (a layer
#: held in a plain list, closed over): :class:`FP8State` keeps theirs too, since one the module
#: does not own is in TE's global buffers only once a replay joined it.
_LAYERS_RUN: weakref.WeakSet[Any] = weakref.WeakSet()
_LAYERS_RUN_LOCK = threading.Lock()  # captures in several threads note them


def note_layers_run(layers: Any) -> None:
    """Note TE layers a capture saw its forwards run (held weakly)."""
    with _LAYERS_RUN_LOCK:
        _LAYERS_RUN.update(layers)


def _layers_run() -> list[Any]:
    with _LAYERS_RUN_LOCK:
        return list(_LAYERS_RUN)


class FP8State:
    """What :func:`fp8_state_kept` kept; :meth:`put_back` restores it (any number of times)."""

    def __init__(
        self, te: TransformerEngine | None, modules: Sequence[torch.nn.Module | None]
    ) -> None:
        self._te = te
        self._autocast: tuple[Any, Any] | None = None  # (setter, state)
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._modules: list[tuple[Any, LayerState]] = []
        self._seen: set[int] = set()  # the layers kept, by id
        self._versions: dict[int, tuple[torch.Tensor, int]] = {}  # each kept tensor's, by id
        if te is None:
            return
        manager = te.manager
        getter = _first(manager, "get_autocast_state", "get_fp8_autocast_state")  # TE 2.9+, older
        setter = _first(manager, "set_autocast_state", "set_fp8_autocast_state")
        if getter is not None and setter is not None:
            self._autocast = (setter, getter())
        # every layer that joined the global buffers: a backward update rolls them all
        qstate = getattr(manager, "quantization_state", manager)
        for name in ("global_amax_history_buffer", "global_scale_buffer"):
            buffers = getattr(qstate, name, None)
            if isinstance(buffers, dict):
                for tensors in buffers.values():
                    for tensor in tensors:
                        self._keep(tensor)
        # the module's own layers, joined or not yet, and those a capture saw run
        owned = [layer for module in modules if module is not None for layer in module.modules()]
        for layer in [*owned, *_layers_run()]:
            self._keep_layer(layer)

    def _keep_layer(self, layer: Any) -> None:
        te = self._te
        if te is None or id(layer) in self._seen:
            return
        self._seen.add(id(layer))
        if _is(layer, te.base_module) or _is(layer, te.basic_operation):
            self._modules.append((layer, layer_state(te, layer)))

    @contextmanager
    def keeping_layers_run(self) -> Iterator[None]:
        """Also keep, before its first forward in the block (in this thread), the state of any
        TE layer the block runs that was not kept yet (one held in a plain list, closed over)."""
        if self._te is None:
            yield
            return
        thread = threading.get_ident()

        def keep(module: torch.nn.Module, inputs: Any) -> None:
            if threading.get_ident() == thread:
                self._keep_layer(module)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(keep)
        try:
            yield
        finally:
            handle.remove()

    def _keep(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in self._tensors:
            self._tensors[id(tensor)] = (tensor, tensor.detach().clone())
            self._versions.setdefault(id(tensor), (tensor, tensor._version))

    def put_back(self) -> None:
        """Give every kept tensor its kept values and version, and the autocast its kept mark.

        Through ``.data``, the versions then set back as kept (the put-back rule of graphing,
        :func:`~dualgraph.torch._params.write_back`): a backward pending from before (one that
        saved a scale) still runs, as it would had nothing been kept and put back."""
        te = self._te
        if te is None:
            return
        for tensor, saved in self._tensors.values():
            write_back(tensor, saved)
        for layer, state in self._modules:
            put_back_layer_state(te, layer, state)
        set_versions(self._versions.values())
        if self._autocast is not None:
            setter, state = self._autocast
            setter(state)


def fp8_state_kept(*modules: torch.nn.Module | None) -> FP8State:
    """The FP8 state of TE's autocast, its global buffers, the TE layers of ``modules`` and
    those a capture saw run (:func:`note_layers_run`), kept now (nothing when the program has
    not imported TE)."""
    return FP8State(TransformerEngine.imported(), modules)


@dataclass(frozen=True)
class LayerState:
    """A TE layer's FP8 state as :func:`layer_state` kept it: TE's own copy of its scales and
    amax histories (``None`` where it kept none) and the versions its state tensors had."""

    saved: Any
    versions: tuple[tuple[torch.Tensor, int], ...]


def layer_state(te: TransformerEngine, layer: Any) -> LayerState:
    """A TE layer's (or op's) scales and amax histories, copied, with their version counters;
    ``saved`` is ``None`` where it keeps none: no FP8 state yet, or a recipe's state without them
    (current and block scaling: TE's getters would raise)."""
    versions = tuple((t, t._version) for t in state_tensors(te, layer) if not t.is_inference())
    if _is(layer, te.base_module):
        if not _keeps_histories(layer.fp8_meta.get(key) for key in STATE_KEYS):
            return LayerState(None, versions)
        return LayerState(layer.get_fp8_meta_tensors(), versions)
    metas = getattr(layer, "_fp8_metas", None)
    if not isinstance(metas, dict) or not all(
        _keeps_histories(meta.get(key) for key in STATE_KEYS)
        for meta in metas.values()
        if meta is not None
    ):
        return LayerState(None, versions)
    return LayerState(layer._save_fp8_metas(), versions)


def put_back_layer_state(te: TransformerEngine, layer: Any, state: LayerState) -> None:
    """Give a layer the state :func:`layer_state` kept, its tensors' versions as they were then
    (TE's own put-back writes with ``copy_``, which moves them: a backward pending from before
    that saved a scale would fail). ``saved=None`` gives a layer with scales and histories now
    the ones and zeros of a new one (TE makes that state at the first forward under a
    delayed-scaling recipe); a layer without them keeps what it has."""
    saved = state.saved
    if _is(layer, te.base_module):
        if _keeps_histories(layer.fp8_meta.get(key) for key in STATE_KEYS):
            layer.reset_fp8_meta_tensors(saved)
    elif saved is not None:
        layer._load_fp8_metas(saved)
    set_versions(state.versions)


#: The attributes of a TE recipe state that hold its tensors (``scale_inv`` in older TE).
_STATE_TENSORS = ("scale", "amax_history", "scale_inv")


def state_tensors(te: TransformerEngine, layer: Any) -> list[torch.Tensor]:
    """The tensors of a TE layer's (or op's) recipe states, forward and backward (none for
    anything else, or before its first FP8 forward)."""
    if _is(layer, te.base_module):
        metas: list[Any] = [getattr(layer, "fp8_meta", None)]
    elif _is(layer, te.basic_operation):
        found = getattr(layer, "_fp8_metas", None)
        metas = list(found.values()) if isinstance(found, dict) else []
    else:
        return []
    tensors: list[torch.Tensor] = []
    for meta in metas:
        if not isinstance(meta, dict):
            continue
        for key in STATE_KEYS:
            state = meta.get(key)
            for name in _STATE_TENSORS:
                tensor = getattr(state, name, None)
                if isinstance(tensor, torch.Tensor):
                    tensors.append(tensor)
    return tensors


#: The keys of a TE layer's FP8 metadata that hold its recipe state, forward and backward.
STATE_KEYS = ("scaling_fwd", "scaling_bwd")


def has_histories(state: Any) -> bool:
    """Whether a recipe state keeps a scale and an amax history (delayed scaling's).

    >>> has_histories(None)
    False
    """
    return isinstance(getattr(state, "scale", None), torch.Tensor) and isinstance(
        getattr(state, "amax_history", None), torch.Tensor
    )


def _keeps_histories(states: Any) -> bool:
    present = [state for state in states if state is not None]
    return bool(present) and all(map(has_histories, present))


def _first(owner: Any, *names: str) -> Any:
    for name in names:
        found = getattr(owner, name, None)
        if callable(found):
            return found
    return None


def _is(value: Any, cls: type | None) -> bool:  # a bool: mypy keeps ``value`` as Any
    return cls is not None and isinstance(value, cls)
