"""dualgraph's own saved-tensor hooks: above the caller's, and also where the caller disabled them.

A graph keeps its activations to itself, so the caller's hooks (offloading, compression, a
non-reentrant checkpoint) see none of a replay's, nor of a capture's: on CUDA a capture under
them would bake what they did into every replay.

``torch.autograd.graph.disable_saved_tensors_hooks`` refuses hooks of the code it runs; the
warmup's and the memory plan's hooks only watch what autograd saves, so eager's forward and
backward run under them as without. torch cannot disable hooks while one is pushed, so the
callable's warmup runs with them enabled (hooks it pushes itself are not refused there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.autograd.graph as _autograd_graph
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_mode_stack

from .._errors import DualgraphError

__all__ = [
    "KEEPING_ACTIVATIONS",
    "keeping_activations",
    "own_saved_tensors_hooks",
    "saved_copies_kept",
]

_disabled_message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message
_enable = torch._C._autograd._saved_tensors_hooks_enable
_disable = torch._C._autograd._saved_tensors_hooks_disable
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # Not the tensor itself: an op's saved output packed as itself holds its own node, a cycle
    # no garbage collection frees (autograd puts the grad_fn back when it unpacks).
    return tensor.detach()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


#: Saved-tensor hooks that keep a tensor as it is, above the caller's (the innermost pair serves).
KEEPING_ACTIVATIONS = saved_tensors_hooks(_detached, _same)


def keeping_activations() -> AbstractContextManager[Any]:
    """:data:`KEEPING_ACTIVATIONS` where the caller has saved-tensor hooks, else nothing."""
    return nullcontext() if _top_saved_tensors_hooks(False) is None else KEEPING_ACTIVATIONS


@contextmanager
def own_saved_tensors_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]
) -> Iterator[None]:
    """``saved_tensors_hooks(pack, unpack)``, also inside ``disable_saved_tensors_hooks``."""
    message = _disabled_message()
    if message is None:
        with saved_tensors_hooks(pack, unpack):
            yield
        return
    _enable()  # torch refuses to disable hooks again while any is pushed: enabled meanwhile
    try:
        with saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _disable(message)


def saved_copies_kept(overwritten: Sequence[torch.Tensor]) -> None:
    """Before a replay writes ``overwritten`` (static buffers the caller holds views of):
    under ``torch.autograd.graph.allow_mutation_on_saved_tensors``, clone what autograd saved of
    their memory, as that context does before an op mutates a saved tensor.

    That context saves through hooks, so autograd checks no version counter, and clones only
    for ops its dispatch mode sees; a graph writing its outputs is no op.
    """
    if not _autograd_graph._allow_mutation_on_saved_tensors_enabled or not overwritten:
        return
    context = _mutation_context()
    original = getattr(context, "original", None)
    cloned = getattr(context, "cloned", None)
    if original is None or cloned is None:
        raise DualgraphError(
            "a replay under torch.autograd.graph.allow_mutation_on_saved_tensors overwrites "
            "its outputs, and this torch keeps that context's saved tensors where dualgraph "
            "cannot clone them; replay outside that context"
        )
    storages = {_storage_key(t) for t in overwritten}
    with torch.no_grad():
        for handle, tensor in list(original.items()):
            if _storage_key(tensor) in storages:
                cloned[handle] = tensor.clone()
                del original[handle]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _mutation_context() -> Any:
    for mode in _dispatch_mode_stack():
        if isinstance(mode, _autograd_graph._CloneArgBeforeMutateMode):
            return mode.ctx
    return None
