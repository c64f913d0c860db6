"""Registers ``torch.Tensor`` with the core: shape, neutral dtype name, ``requires_grad``; and
says why a ``torch.Generator`` is no leaf."""

from __future__ import annotations

import torch

from .._leaves import refuse_leaf_type, register_array_type

__all__ = ["dtype_name", "tensor_signature"]

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype, /) -> str:
    """The framework-neutral name of a torch dtype.

    >>> dtype_name(torch.half), dtype_name(torch.bfloat16), dtype_name(torch.long)
    ('float16', 'bfloat16', 'int64')
    """
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def tensor_signature(tensor: torch.Tensor, /) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` of a tensor, as the core describes arrays.

    A nested tensor has no single shape; it is described as a scalar, so that a spec can still
    be made and the adapter can refuse it by its path.
    """
    if tensor.is_nested:
        return (), dtype_name(tensor.dtype)
    return tuple(tensor.shape), dtype_name(tensor.dtype)


def _requires_grad(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad


register_array_type(torch.Tensor, signature=tensor_signature, requires_grad=_requires_grad)

# A generator would otherwise be refused with the advice to register it, which no registration
# could make sound: a replay draws only from the generators its capture registered.
refuse_leaf_type(
    torch.Generator,
    reason=(
        "A torch.Generator can't be an input or output of a graphed call: a CUDA graph capture "
        "registers only each device's default CUDA generator, so a replay would not draw from "
        "or move this one. Let dropout and other random ops draw from the default generator "
        "(seed it with torch.manual_seed), or run the callable eagerly."
    ),
)
