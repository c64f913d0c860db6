"""What a callable's backward leaves in its parameters' own attributes, put back after graphing.

Megatron's ``gradient_accumulation_fusion`` (Transformer Engine's ``fuse_wgrad_accumulation``)
gives each parameter a ``main_grad`` tensor (a view of one contiguous grad buffer) that the
backward adds the weight grad into itself, and a ``grad_added_to_main_grad`` flag that it sets,
so that the grad hook of Megatron's DDP does not add the dummy grad handed to autograd. Warmup
and capture run that backward; graphing runs nothing in eager, so
:func:`parameter_attributes_kept` puts back what they changed there: each tensor attribute of a
parameter by value (the warmup's grads out of ``main_grad``, its memory kept: a graph adds into
it), each other attribute as it was (the flag).

>>> import torch
>>> weight = torch.nn.Parameter(torch.ones(2))
>>> weight.main_grad, weight.grad_added_to_main_grad = torch.tensor([0.0, 3.0]), False
>>> with parameter_attributes_kept([weight]):
...     weight.main_grad.add_(1.0)  # the warmup's backward
...     weight.grad_added_to_main_grad = True
tensor([1., 4.])
>>> weight.main_grad, weight.grad_added_to_main_grad
(tensor([0., 3.]), False)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ._params import FUSED_ACCUMULATION_FLAGS, bits_view, is_plain, is_tensor_subclass, write_back

__all__ = ["FUSED_ACCUMULATION_FLAGS", "SetByCallable", "parameter_attributes_kept"]


class SetByCallable:
    """The plain values the callable's Python set on its parameters during graphing (the flag),
    found when :func:`parameter_attributes_kept` ends: a graph's replay runs no Python, so each
    replay of a CUDA graph sets them again after its backward, as eager's backward would."""

    def __init__(self) -> None:
        self._found: dict[int, list[tuple[str, Any]]] = {}
        self._written: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def note(self, param_id: int, name: str, value: Any) -> None:
        self._found.setdefault(param_id, []).append((name, value))

    def note_written(self, param_id: int, name: str, tensor: torch.Tensor) -> None:
        self._written.setdefault(param_id, []).append((name, tensor))

    def written(
        self, params: Sequence[torch.Tensor], names: Sequence[str]
    ) -> tuple[tuple[str, dict[str, Any], str, torch.Tensor, int], ...]:
        """``(path, the parameter's __dict__, name, tensor, address)`` of each tensor attribute
        of ``params`` that graphing wrote into (``main_grad``): a CUDA graph writes into that
        memory, so it must stay the attribute's."""
        return tuple(
            (f"{label}.{name}", param.__dict__, name, tensor, tensor.data_ptr())
            for label, param in zip(names, params, strict=True)
            for name, tensor in self._written.get(id(param), ())
        )

    def of(
        self, params: Sequence[torch.Tensor]
    ) -> tuple[tuple[int, dict[str, Any], str, Any], ...]:
        """``(position, the parameter's __dict__, name, value)`` for each of ``params``."""
        return tuple(
            (i, param.__dict__, name, value)
            for i, param in enumerate(params)
            for name, value in self._found.get(id(param), ())
        )


@contextmanager
def parameter_attributes_kept(params: Iterable[torch.Tensor]) -> Iterator[SetByCallable]:
    """Run the block, then give each parameter's own public attributes (in its ``__dict__``;
    not those of a tensor subclass, which are its data) the objects they held before it, and
    each tensor among them the values it held (where they changed), whether the block succeeds
    or fails."""
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    tensors: list[tuple[int, str, torch.Tensor]] = []
    seen: set[int] = set()
    kept_ids: list[int] = []
    for param in params:
        attributes = param.__dict__
        if id(param) in seen or is_tensor_subclass(param):
            continue  # a subclass's (an FP8 weight's) are its own data and caches
        seen.add(id(param))
        kept_ids.append(id(param))
        public = {name: value for name, value in attributes.items() if not name.startswith("_")}
        kept.append((attributes, public))
        for name, value in public.items():
            if (
                isinstance(value, torch.Tensor)
                and value.layout == torch.strided
                and value.device.type != "meta"
                and id(value) not in seen
            ):
                seen.add(id(value))
                tensors.append((id(param), name, value))
    # all zeros (a main_grad after zero_grad_buffer): no copy of the grad buffer; by bits, so
    # that -0.0 is kept as itself
    nonzero = _read([_bits(tensor).any() for _, _, tensor in tensors])
    values = [
        (param_id, name, tensor, tensor.detach().clone() if any_set else None)
        for (param_id, name, tensor), any_set in zip(tensors, nonzero, strict=True)
    ]
    found = SetByCallable()
    try:
        yield found
    finally:
        with torch.no_grad():
            changed = _read([_changed(tensor, saved) for _, _, tensor, saved in values])
            written = [entry for entry, moved in zip(values, changed, strict=True) if moved]
        fused = {param_id for param_id, *_ in written}  # whose main_grad the block added into
        for param_id, (attributes, before) in zip(kept_ids, kept, strict=True):
            for name, value in attributes.items():
                if (
                    not name.startswith("_")
                    and is_plain(value)
                    and (
                        name not in before
                        or before[name] is not value
                        or (name in FUSED_ACCUMULATION_FLAGS and param_id in fused)
                    )
                ):
                    found.note(param_id, name, value)
        for attributes, before in kept:
            for name in [n for n in attributes if n not in before and not n.startswith("_")]:
                del attributes[name]
            attributes.update(before)
        for param_id, name, tensor, saved in written:
            found.note_written(param_id, name, tensor)
            write_back(tensor, saved)


def _changed(tensor: torch.Tensor, saved: torch.Tensor | None) -> torch.Tensor:
    """Whether ``tensor`` no longer holds ``saved`` (all zeros where ``None``), bit for bit (by
    value, a NaN is never itself), as a 0-d bool tensor on its device, for :func:`_read` to read
    with the rest."""
    if saved is None:
        return _bits(tensor).any()
    if tensor.shape != saved.shape or tensor.dtype != saved.dtype:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return (_bits(tensor) != _bits(saved)).any()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as integers (:func:`bits_view`), or ``tensor`` where there is no such
    view (compared by value then, as before)."""
    bits = bits_view(tensor)
    return tensor if bits is None else bits


def _read(flags: Sequence[torch.Tensor]) -> list[bool]:
    """0-d bool tensors as bools, read to the host once per device rather than once each: one
    device synchronisation however many parameters hold a ``main_grad``."""
    read = [False] * len(flags)
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    for positions in by_device.values():
        values = torch.stack([flags[i] for i in positions]).tolist()
        for i, value in zip(positions, values, strict=True):
            read[i] = value
    return read
