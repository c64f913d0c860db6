"""The tensors a graphed callable's state holds besides its inputs, each where it hangs.

A module's are its parameters and buffers (as its :class:`ModuleTensors` records them) and the
plain tensor attributes of it and its submodules; a function's (or a bound method's) are those
its code names, recorded as ``code_tensors``, and the plain tensor attributes of the modules it
names. Warmup compares some of them around its calls (``_warmup.py``: those nothing else puts
back) and the end of capture records others when they live off the graphs' device
(``_host_state.py``); each picks the kinds it watches, from one walk named one way.

>>> layer = torch.nn.Linear(2, 2)
>>> layer.cache = torch.zeros(2)
>>> [held.name for held in held_tensors(ModuleTensors.of(layer), [("Linear", layer)])]
['Linear.weight', 'Linear.bias', 'Linear.cache']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch

from ._closed_over import method_module, named_values, plain_tensor_attributes
from ._params import ModuleTensors

__all__ = ["Held", "held_tensors", "modules_named_by"]


class Held(NamedTuple):
    """One tensor of a callable's state: its name in messages, the tensor, the dict it hangs in
    (a module's ``_parameters``, ``_buffers`` or ``__dict__``) and its key there, and its kind
    (a function's closed-over tensors are recorded as buffers)."""

    name: str
    tensor: torch.Tensor
    namespace: dict[str, Any]
    key: str
    kind: Literal["parameter", "buffer", "attribute"]


def held_tensors(
    record: ModuleTensors,
    holders: Sequence[tuple[str, torch.nn.Module]],
    keep: Callable[[Held], bool] = lambda held: True,
) -> list[Held]:
    """Those of ``record``'s parameters and buffers, then of the plain tensor attributes of
    ``holders`` (``(prefix, module)``: named ``prefix.path``), that ``keep`` takes, each tensor
    once (named where it is found first), strided ones only (a sparse tensor's bits are not
    compared)."""
    found: dict[int, Held] = {}
    for name, owner, key, tensor, is_buffer in zip(
        record.names, record.owners, record.keys, record.tensors, record.is_buffer, strict=True
    ):
        held = Held(name, tensor, owner, key, "buffer" if is_buffer else "parameter")
        if id(tensor) not in found and keep(held):
            found[id(tensor)] = held
    for prefix, holder in holders:
        for name, tensor in plain_tensor_attributes(holder):
            path, _, key = name.rpartition(".")
            namespace = (holder.get_submodule(path) if path else holder).__dict__
            held = Held(f"{prefix}.{name}", tensor, namespace, key, "attribute")
            if id(tensor) not in found and keep(held):
                found[id(tensor)] = held
    return [held for held in found.values() if held.tensor.layout == torch.strided]


def modules_named_by(fn: Callable[..., Any]) -> list[tuple[str, torch.nn.Module]]:
    """The modules a function's code names (closure, globals, partial arguments) and a bound
    method's module, named as ``code_tensors`` names them."""
    owner = method_module(fn)
    found: list[tuple[str, torch.nn.Module]] = []
    if owner is not None:
        found.append((type(owner).__name__, owner))
    found += [
        (f"closed over {name}", value)
        for name, value in named_values(fn)
        if isinstance(value, torch.nn.Module)
    ]
    return found
