"""Host-resident state: tensors a graphed callable reaches besides its inputs that do not live
on the device its graphs run on.

A CUDA graph replays the device's kernels only. What the callable does with a CPU tensor it
reads from its state (a 0-d ``self.temperature = torch.tensor(2.0)``, which ``module.cuda()``
leaves on the CPU, as a CUDA kernel's host argument; ``.item()``, ``.tolist()``) ran once, at
capture, so every replay keeps the value of then: ``self.temperature.fill_(3.0)`` afterwards
would be ignored by the replays, where eager uses it. So, on a graph device:

- a parameter of the graphed module off that device is refused at capture (its grad and every
  optimizer step would be host work, which no replay repeats);
- a buffer, plain tensor attribute or tensor a function's code names off that device that the
  callable updates in place is refused at capture (no replay would update it);
- the others are recorded (``ModuleTensors.record_host_tensors``): a call after one was changed
  (in place, ``.data = ...``, rebound) is refused, naming it, before anything runs; an equal
  value set again is not a change.

The graphs' device is the samples' (``"cuda"``: the CUDA device). On ``"emulate"`` on a CPU all
is on the CPU, so nothing is host-resident there; a test emulates a graph device by replacing
:func:`graphs_device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._capture_failure import Refused
from ._held_tensors import held_tensors, modules_named_by

if TYPE_CHECKING:
    from ._capture_state import _Capture
    from ._params import ModuleTensors

__all__ = ["graphs_device", "record_host_state", "refuse_parameters_off_device"]

#: ``(name, tensor, the dict it hangs in, its key there)``
Hung = tuple[str, torch.Tensor, dict[str, Any], str]


def graphs_device(backend: str, samples: Sequence[torch.Tensor]) -> torch.device | None:
    """The device the graphs of a callable run on: its first sample tensor's (``"cuda"``: its
    first CUDA one's); ``None`` (nothing is host-resident) where it has none."""
    if backend == "cuda":
        on_cuda = [t.device for t in samples if t.is_cuda]
        return on_cuda[0] if on_cuda else torch.device("cuda", torch.cuda.current_device())
    return samples[0].device if samples else None


def _off(tensor: torch.Tensor, device: torch.device | None) -> bool:
    """Whether ``tensor`` is host-resident for graphs on ``device`` (a meta tensor holds no
    values to read)."""
    return device is not None and tensor.device != device and tensor.device.type != "meta"


def refuse_parameters_off_device(item: _Capture, backend: str) -> None:
    """Refuse a parameter of the graphed module that is not on the graphs' device, before
    anything runs."""
    module = item.request.module
    device = graphs_device(backend, item.request.sample_tensors)
    if module is None or device is None:
        return
    root = type(module).__name__
    for name, param in module.named_parameters():
        if _off(param, device):
            raise Refused(
                f"{root}.{name}: a parameter on {param.device}, where the graphs run on {device}: "
                "a graph replays the device's kernels only, so what the callable does with it on "
                "the host ran once, at capture, and its grads and optimizer steps would not "
                f"reach the replays; move it to {device} (module.to), or make it a buffer or a "
                "Python number"
            )


def record_host_state(item: _Capture, backend: str) -> None:
    """At the end of capture: refuse host-resident tensors the callable updated in place, and
    record the others in the module's (the function's code's) ``ModuleTensors``, which each
    call checks."""
    record = item.module_tensors if item.module_tensors is not None else item.code_tensors
    device = graphs_device(backend, item.static_inputs)
    if record is None or device is None:
        return
    hung = [entry for entry in _state_of(item, record) if _off(entry[1], device)]
    if not hung:
        return
    updated = {id(record.tensors[i]) for i in record.updated}
    updated |= {id(tensor) for _, tensor in item.closure_updates.updated}
    for name, tensor, _, _ in hung:
        if id(tensor) in updated:
            raise Refused(
                f"{name}: a tensor on {tensor.device} the callable updates in place, where the "
                f"graphs run on {device}: a graph replays the device's kernels only, so no "
                f"replay would update it; move it to {device}, or update it outside the "
                "graphed callable"
            )
    record.record_host_tensors(hung, device)


def _state_of(item: _Capture, record: ModuleTensors) -> list[Hung]:
    """The buffers, plain tensor attributes and (a function's) tensors its code names, and the
    parameters of the modules a function's code names, each once, where they hang (named as
    ``record``, the callable's own, names them)."""
    module = item.request.module
    if module is None:  # all a function's code names: its modules' parameters too
        held = held_tensors(record, modules_named_by(item.request.fn))
    else:  # a module's own parameters are refused off the device before (at capture's start)
        held = held_tensors(
            record, [(type(module).__name__, module)], lambda held: held.kind != "parameter"
        )
    return [(name, tensor, namespace, key) for name, tensor, namespace, key, _ in held]
