"""The torch function and dispatch modes a call runs under, as a replay must match them.

A ``TorchFunctionMode`` or ``TorchDispatchMode`` entered around an eager call sees (and may
change) every op of the callable: a ``torch.device`` context (or ``torch.set_default_device``)
places the tensors its factory calls make, a mode may rewrite or scale ops. A CUDA graph replays
the kernels captured under the modes of capture and runs through none of them. So each call
compares the modes in effect with capture's, and a call under others is refused before anything
is written: :func:`modes_now` reads them (two C calls where none is in effect, the usual case),
:func:`modes_meaning` says what a replay must match.

Modes that change no value are let be: observers, which only count or record what runs
(``FlopCounterMode``'s, torch's communication debug mode, dualgraph's own lint and memory
probe: they see none of a replay's kernels, as a profiler's counts of a graph replay show none
either), and ``allow_mutation_on_saved_tensors``' copy-on-write mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "OBSERVER_MODES",
    "dispatch_modes_now",
    "modes_meaning",
    "modes_now",
    "of_dispatch",
    "show_modes",
]

_function_depth = torch._C._len_torch_function_stack
_dispatch_depth = torch._C._len_torch_dispatch_stack
_function_at = torch._C._get_function_stack_at
_dispatch_at = torch._C._get_dispatch_stack_at
_CPU = torch.device("cpu")

#: ``module.qualname`` of the modes that change no value (see the module's docstring): the
#: observers, and ``torch.autograd.graph.allow_mutation_on_saved_tensors``' mode, which clones a
#: saved tensor before an op updates it in place (its values stay eager's either way).
OBSERVER_MODES = frozenset(
    {
        "torch.utils.flop_counter._FlopCounterMode",
        "torch.utils.flop_counter.FlopCounterMode",
        "torch.distributed.tensor.debug._comm_mode.CommDebugMode",
        "torch.autograd.graph._CloneArgBeforeMutateMode",
    }
)


def modes_now() -> tuple[Any, ...]:
    """The function modes then the dispatch modes in effect, each stack innermost last; ``()``
    where none is (the usual case: two C calls).

    >>> modes_now()
    ()
    >>> with torch.device("cpu"):
    ...     [type(mode).__name__ for mode in modes_now()]
    ['DeviceContext']
    """
    functions, dispatches = _function_depth(), _dispatch_depth()
    if not (functions or dispatches):
        return ()
    return (
        *map(_function_at, range(functions)),
        *map(_dispatch_at, range(dispatches)),
    )


def dispatch_modes_now() -> tuple[Any, ...]:
    """The dispatch modes in effect, innermost last: what a backward's kernels run through (the
    autograd engine calls no function mode, so a backward is compared on these alone).

    >>> dispatch_modes_now()
    ()
    """
    return tuple(map(_dispatch_at, range(_dispatch_depth())))


def of_dispatch(meaning: tuple[Any, ...]) -> tuple[Any, ...]:
    """The dispatch modes' entries of a :func:`modes_meaning`.

    >>> from torch.overrides import TorchFunctionMode
    >>> of_dispatch((TorchFunctionMode, ("device", torch.device("meta"))))
    ()
    """
    return tuple(
        entry
        for entry in meaning
        if isinstance(entry, type) and issubclass(entry, TorchDispatchMode)
    )


def modes_meaning(modes: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a replay must match of :func:`modes_now`'s ``modes``: each mode that is neither an
    observer nor a device context, by its class, then the default device the innermost device
    context sets where it is not the CPU (eager's own default: a ``torch.device("cpu")`` context
    changes nothing, two ``torch.device("cuda")`` contexts mean the same).

    >>> with torch.device("meta"):
    ...     modes_meaning(modes_now())
    (('device', device(type='meta')),)
    >>> with torch.device("cpu"):
    ...     modes_meaning(modes_now())
    ()
    """
    meaning: list[Any] = []
    device = _CPU
    for mode in modes:
        kind = type(mode)
        if isinstance(mode, DeviceContext):
            device = mode.device
        elif not _an_observer(kind):
            meaning.append(kind)
    if device != _CPU:
        meaning.append(("device", device))
    return tuple(meaning)


def show_modes(meaning: tuple[Any, ...]) -> str:
    """A :func:`modes_meaning` in words, for messages.

    >>> show_modes(())
    'no torch function or dispatch mode'
    >>> show_modes((("device", torch.device("meta")),))
    "torch.device('meta') as the default device"
    """
    if not meaning:
        return "no torch function or dispatch mode"
    parts = [
        f"torch.device({str(entry[1])!r}) as the default device"
        if isinstance(entry, tuple)
        else f"{entry.__module__}.{entry.__qualname__}"
        for entry in meaning
    ]
    return ", ".join(parts)


def _an_observer(kind: type) -> bool:
    home = getattr(kind, "__module__", "") or ""
    return home.startswith("dualgraph.") or f"{home}.{kind.__qualname__}" in OBSERVER_MODES
