"""Tensors a graphed function may update besides its inputs, and the ones it does update;
the modules and tensors its code names, which each call checks as a module's own.

A module's own parameters and buffers are recorded by :class:`ModuleTensors`. A function, or a
bound method, has none of its own, yet its code may name some: a closure over a BatchNorm, a
global tensor, the module of a method. Those its warmup and capture updated in place are what an
input sharing memory with one would, in eager, be read after (``GraphedCallable``); they are
put back after capture, as a module's buffers are. ``dgt.verify`` compares them too.

Its graphs read those modules' and tensors' memory, and replay their modules' training modes
and hooks, as they were at capture; :func:`code_tensors` records them so that each call refuses
a change (a weight moved by ``.data = ...`` or ``.half()``, ``encoder.eval()``), as a graphed
module's own ``ModuleTensors`` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._params import ModuleTensors, write_back

__all__ = [
    "ClosureUpdates",
    "closed_over_tensors",
    "code_tensors",
    "method_module",
    "modules_named_by",
    "named_by",
    "named_values",
    "plain_tensor_attributes",
]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass may have no memory of its own to read


def closed_over_tensors(
    fn: Callable[..., Any], *, parameters: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """``("closed over NAME", tensor)`` for what a graphed function may change besides its
    inputs: the tensors, and the buffers of the modules, that its own code names from its
    closure or its module's globals (and a ``functools.partial``'s arguments), once each.
    ``parameters``: the modules' parameters and plain tensor attributes too (what its backward
    may read besides buffers: frozen weights, a cache).

    What it reaches otherwise (through an object's attribute, or in the functions it calls)
    is not found.
    """
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, value in named_values(fn):
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), (f"closed over {name}", value))
        elif isinstance(value, torch.nn.Module):
            for tensor_name, tensor in _tensors_of(value, parameters):
                found.setdefault(id(tensor), (f"closed over {name}.{tensor_name}", tensor))
    return list(found.values())


def code_tensors(fn: Callable[..., Any]) -> ModuleTensors | None:
    """The modules and tensors ``fn``'s code names (as :func:`closed_over_tensors` finds them)
    and a bound method's module, recorded as a module's own are; ``None`` where there are none.

    Named as the code names them (``closed over encoder.fc.weight``; a method's module by its
    class, ``FrozenEncoder.fc.weight``). A method's module is not called by the method, so its
    own hooks and ``forward`` are not watched; its submodules', which it calls, are.
    """
    holder = torch.nn.Module()  # hangs them together; never called
    seen: set[int] = set()
    uncalled: tuple[torch.nn.Module, ...] = ()
    owner = method_module(fn)
    if owner is not None:
        holder._modules[type(owner).__name__] = owner
        seen.add(id(owner))
        uncalled = (owner,)
    for name, value in named_values(fn):
        if id(value) in seen:
            continue
        if isinstance(value, torch.nn.Module):
            holder._modules[f"closed over {name}"] = value
            seen.add(id(value))
        elif type(value) in _PLAIN and value.layout == torch.strided:
            holder._buffers[f"closed over {name}"] = value
            seen.add(id(value))
    if not holder._modules and not holder._buffers:
        return None
    return ModuleTensors.of(holder, root="", uncalled=uncalled)


def named_values(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """What ``fn``'s own code names: its closure's cells, its globals it uses, and a
    ``functools.partial``'s arguments, as ``(name, value)``."""
    named: list[tuple[str, Any]] = []
    while isinstance(fn, functools.partial):
        named += [(f"partial argument {i}", a) for i, a in enumerate(fn.args)]
        named += [(f"partial argument {k}", a) for k, a in fn.keywords.items()]
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = getattr(fn, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars, cells, strict=False):
            with contextlib.suppress(ValueError):  # a cell not filled yet
                named.append((name, cell.cell_contents))
        globals_ = getattr(fn, "__globals__", {})
        named += [(n, globals_[n]) for n in code.co_names if n in globals_]
    return named


def named_by(fn: Callable[..., Any], *, parameters: bool = False) -> list[tuple[str, torch.Tensor]]:
    """What :func:`closed_over_tensors` finds, and the buffers (``parameters``: and the
    parameters) of a bound method's module."""
    found = closed_over_tensors(fn, parameters=parameters)
    owner = method_module(fn)
    if owner is not None:
        seen = {id(tensor) for _, tensor in found}
        root = type(owner).__name__
        found += [
            (f"{root}.{name}", tensor)
            for name, tensor in _tensors_of(owner, parameters)
            if id(tensor) not in seen
        ]
    return found


def modules_named_by(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules ``fn``'s own code names (as :func:`closed_over_tensors` finds them), a bound
    method's module, and a module wrapped in ``functools.partial``, once each: what a call of
    ``fn`` may run, and so change, besides a module ``fn`` is.

    >>> layer = torch.nn.Linear(2, 2)
    >>> [type(m).__name__ for m in modules_named_by(lambda x: layer(x) * 2)]
    ['Linear']
    """
    found: dict[int, torch.nn.Module] = {}
    for _, value in named_values(fn):
        if isinstance(value, torch.nn.Module):
            found.setdefault(id(value), value)
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    owner = inner if isinstance(inner, torch.nn.Module) else method_module(fn)
    if owner is not None:
        found.setdefault(id(owner), owner)
    return list(found.values())


def method_module(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module whose bound method ``fn`` is (through ``functools.partial``), or ``None``.

    >>> layer = torch.nn.Linear(2, 2)
    >>> method_module(functools.partial(layer.forward)) is layer, method_module(len)
    (True, None)
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _tensors_of(module: torch.nn.Module, parameters: bool) -> list[tuple[str, torch.Tensor]]:
    tensors = list(module.named_buffers())
    if not parameters:
        return tensors
    return [*module.named_parameters(), *tensors, *plain_tensor_attributes(module)]


def plain_tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of the tensors held as plain attributes (neither parameters nor
    buffers: ``self.scale = torch.ones(4)``, a cache) by ``module`` and its submodules.

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.cache = torch.zeros(2)
    >>> [name for name, _ in plain_tensor_attributes(layer)]
    ['cache']
    """
    found = []
    for prefix, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found.append((f"{prefix}.{name}" if prefix else name, value))
    return found


class ClosureUpdates:
    """The tensors a function (not a module) names that its warmup and capture updated in place.

    Shared by the replay slots of one callable; empty for a module (``ModuleTensors.updated``).
    """

    def __init__(self) -> None:
        self.updated: tuple[tuple[str, torch.Tensor], ...] = ()

    @contextlib.contextmanager
    def watching(self, fn: Callable[..., Any]) -> Iterator[None]:
        """Record what ``fn`` names, run the block, keep the tensors it changed, and put them
        back by value, whether the block succeeds or fails: graphing runs nothing in eager, so
        only the replays may update them (as a module's buffers, ``ModuleTensors.left_as_found``).
        """
        before = [
            (name, tensor, tensor._version, tensor.detach().clone())
            for name, tensor in named_by(fn)
            # a parameter is refused elsewhere if updated; a sparse tensor has no torch.equal
            if not tensor.requires_grad and tensor.layout == torch.strided
        ]
        try:
            yield
        finally:
            # By value as well: BatchNorm's kernel writes its statistics without a version bump.
            changed = [
                (name, tensor, kept)
                for name, tensor, version, kept in before
                if tensor._version != version or not torch.equal(tensor, kept)
            ]
            self.updated = tuple((name, tensor) for name, tensor, _ in changed)
            for _, tensor, kept in changed:  # only those: the others hold their values
                write_back(tensor, kept)
