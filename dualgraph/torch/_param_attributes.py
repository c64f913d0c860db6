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
>>> weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(2), False
>>> with parameter_attributes_kept([weight]):
...     weight.main_grad.add_(1.0)  # the warmup's backward
...     weight.grad_added_to_main_grad = True
tensor([1., 1.])
>>> weight.main_grad, weight.grad_added_to_main_grad
(tensor([0., 0.]), False)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._params import is_tensor_subclass

__all__ = ["parameter_attributes_kept"]


@contextmanager
def parameter_attributes_kept(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Run the block, then give each parameter's own public attributes (in its ``__dict__``;
    not those of a tensor subclass, which are its data) the objects they held before it, and
    each tensor among them the values it held (where they changed), whether the block succeeds
    or fails."""
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []
    values: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for param in params:
        attributes = param.__dict__
        if id(param) in seen or not attributes or is_tensor_subclass(param):
            continue  # usually none; a subclass's (an FP8 weight's) are its own data and caches
        seen.add(id(param))
        public = {name: value for name, value in attributes.items() if not name.startswith("_")}
        kept.append((attributes, public))
        for value in public.values():
            if (
                isinstance(value, torch.Tensor)
                and value.layout == torch.strided
                and value.device.type != "meta"
                and id(value) not in seen
            ):
                seen.add(id(value))
                values.append((value, value.detach().clone()))
    try:
        yield
    finally:
        for attributes, before in kept:
            for name in [n for n in attributes if n not in before and not n.startswith("_")]:
                del attributes[name]
            attributes.update(before)
        with torch.no_grad():
            for tensor, saved in values:
                if not tensor.is_inference() and not torch.equal(tensor, saved):
                    tensor.copy_(saved)
