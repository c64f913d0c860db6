"""What a callable reaches besides its inputs and its module, and putting it back after warmup.

A graphed module's buffers are put back after warmup and capture (``_params.py``), so that the
replays alone update them, as eager steps do. A bound method's module and the tensors a function
closes over are reached the same way; :func:`left_as_found` puts those back too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._probe import module_of

__all__ = ["closed_over_tensors", "left_as_found"]


def closed_over_tensors(fn: Callable[..., Any]) -> list[tuple[str, torch.Tensor]]:
    """``("closed over NAME", tensor)`` for what a graphed function may change besides its
    inputs: the tensors, and the buffers of the modules, that its own code names from its
    closure or its module's globals (and a ``functools.partial``'s arguments), once each.

    What it reaches otherwise (through an object's attribute, or in the functions it calls)
    is not found.
    """
    found: dict[int, tuple[str, torch.Tensor]] = {}
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
    for name, value in named:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), (f"closed over {name}", value))
        elif isinstance(value, torch.nn.Module):
            for buffer_name, buffer in value.named_buffers():
                found.setdefault(id(buffer), (f"closed over {name}.{buffer_name}", buffer))
    return list(found.values())


@contextlib.contextmanager
def left_as_found(fn: Callable[..., Any]) -> Iterator[None]:
    """Put back, by value, what warmup and capture of ``fn`` (not itself a module) change in
    place besides its inputs: its module's buffers for a bound method, and the tensors and
    module buffers it closes over (:func:`closed_over_tensors`), those that need no grad.

    Whether it succeeds or fails, graphing then runs nothing, as in eager.
    """
    module = None if isinstance(fn, torch.nn.Module) else module_of(fn)
    reached = [tensor for _, tensor in closed_over_tensors(fn)]
    if module is not None:
        reached += list(module.buffers())
    kept = {
        id(t): (t, t.detach().clone())
        for t in reached
        if not t.requires_grad and not t.is_inference() and t.layout is torch.strided
    }
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, saved in kept.values():
                tensor.copy_(saved)
