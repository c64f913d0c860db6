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

from typing import Any

import torch

from ._transformer_engine import TransformerEngine

__all__ = ["FP8State", "fp8_state_kept"]


class FP8State:
    """What :func:`fp8_state_kept` kept; :meth:`put_back` restores it (any number of times)."""

    def __init__(self, te: TransformerEngine | None, module: torch.nn.Module | None) -> None:
        self._te = te
        self._autocast: tuple[Any, Any] | None = None  # (setter, state)
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._modules: list[tuple[Any, Any]] = []
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
        # the module's own layers, joined or not yet (None: they have no FP8 state yet)
        layer: Any  # a TE layer: its methods are TE's
        for layer in () if module is None else module.modules():
            if _is(layer, te.base_module):
                self._modules.append((layer, layer.get_fp8_meta_tensors()))
            elif _is(layer, te.basic_operation):
                self._modules.append((layer, layer._save_fp8_metas()))

    def _keep(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in self._tensors:
            self._tensors[id(tensor)] = (tensor, tensor.detach().clone())

    def put_back(self) -> None:
        """Give every kept tensor its kept values, and the autocast its kept mark."""
        te = self._te
        if te is None:
            return
        with torch.no_grad():
            for tensor, saved in self._tensors.values():
                tensor.copy_(saved)
            layer: Any
            for layer, saved in self._modules:
                if _is(layer, te.base_module):
                    layer.reset_fp8_meta_tensors(saved)  # None: as a new layer has them
                elif saved is not None:
                    layer._load_fp8_metas(saved)
        if self._autocast is not None:
            setter, state = self._autocast
            setter(state)


def fp8_state_kept(module: torch.nn.Module | None) -> FP8State:
    """The FP8 state of TE's autocast, its global buffers and ``module``'s TE layers, kept now
    (nothing when the program has not imported TE)."""
    return FP8State(TransformerEngine.imported(), module)


def _first(owner: Any, *names: str) -> Any:
    for name in names:
        found = getattr(owner, name, None)
        if callable(found):
            return found
    return None


def _is(value: Any, cls: type | None) -> bool:  # a bool: mypy keeps ``value`` as Any
    return cls is not None and isinstance(value, cls)
