"""Every way a torch callable is graphed, for tests of a rule that must hold on each of them.

A refusal written and tested on a plain graphed module was missed elsewhere (a padded call, a
graphed function): each rule's test runs over :data:`ENTRY_POINTS` through :func:`graphed_on`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import dualgraph.torch as dgt

# A module graphed in place; with clone_outputs=True; the second of two graphed together; with
# replay slots; with a schedule; exact shape buckets; a call padded into a bucket; a function
# calling the module; the module's bound forward.
ENTRY_POINTS = [
    "plain",
    "clone_outputs",
    "together",
    "slots",
    "schedule",
    "buckets",
    "pad",
    "function",
    "method",
]
# A function or a method is graphed with the module's parameters frozen: a graph of one that
# reads parameters needing grad is refused (they would get no grad).
WITH_PARAMETERS = [e for e in ENTRY_POINTS if e not in ("function", "method")]
LENGTH = 3  # of the samples, and of every call but a padded one
PADDED_LENGTH = 4  # a padded call's: padded into the bucket of length 5


def call_length(entry: str) -> int:
    """The length along dim 1 of a call through ``entry``."""
    return PADDED_LENGTH if entry == "pad" else LENGTH


def batch(length: int = LENGTH, device: torch.device | str = "cpu") -> torch.Tensor:
    """A (2, length, 4) input that requires grad."""
    return torch.randn(2, length, 4, device=device, requires_grad=True)


def graphed_on(
    entry: str,
    module: nn.Module,
    extra: Sequence[torch.Tensor] = (),
    *,
    backend: str = "emulate",
    order: Sequence[int] = (1, -1, 1, -1),
    **options: Any,
) -> Callable[..., Any]:
    """What a caller calls once ``module`` is graphed through ``entry``.

    ``module.forward(x, *extra, valid_length=None)`` takes a (2, length, 4) ``x`` and returns
    outputs whose dim 1 is the length. ``order``: the schedule's, for ``"schedule"``.
    """
    device = next(iter(module.parameters())).device
    sample = (batch(LENGTH, device), *extra)
    options = {"backend": backend, **options}
    if entry in ("function", "method"):
        module.requires_grad_(False)
    if entry == "plain":
        return dgt.make_graphed_callables(module, sample, **options)  # type: ignore[no-any-return]
    if entry == "clone_outputs":
        return dgt.make_graphed_callables(module, sample, clone_outputs=True, **options)  # type: ignore[no-any-return]
    if entry == "together":
        before = type(module)().to(device)
        _, graphed = dgt.make_graphed_callables((before, module), (sample, sample), **options)
        return graphed  # type: ignore[no-any-return]
    if entry == "slots":
        return dgt.make_graphed_callables(module, sample, slots=2, **options)  # type: ignore[no-any-return]
    if entry == "schedule":
        return dgt.make_graphed_callables(module, sample, schedule=list(order), **options)  # type: ignore[no-any-return]
    buckets = [(batch(LENGTH, device), *extra), (batch(5, device), *extra)]
    if entry == "buckets":
        return dgt.make_graphed_callables(module, buckets=buckets, **options)  # type: ignore[no-any-return]
    if entry == "pad":
        cut = {"output": 1} if _one_output(module, sample) else {"output[0]": 1, "output[1]": 1}
        return dgt.make_graphed_callables(  # type: ignore[no-any-return]
            module, buckets=buckets, fallback="pad", dynamic_dims={"args[0]": 1, **cut}, **options
        )
    if entry == "function":
        return dgt.make_graphed_callables(lambda x, *rest: module(x, *rest), sample, **options)  # type: ignore[no-any-return]
    if entry == "method":
        return dgt.make_graphed_callables(module.forward, sample, **options)  # type: ignore[no-any-return]
    raise ValueError(entry)


def _one_output(module: nn.Module, sample: Sequence[torch.Tensor]) -> bool:
    with torch.no_grad():
        state = {k: v.clone() for k, v in module.state_dict().items()}
        out = module(*sample)
        module.load_state_dict(state)
    return isinstance(out, torch.Tensor)


class Decays(nn.Module):
    """A Linear and tanh; first halves a buffer of its own in place (as BatchNorm updates its
    statistics), then adds ``shift`` (when given) after reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("stats", torch.ones(4))

    def forward(
        self,
        x: torch.Tensor,
        shift: torch.Tensor | None = None,
        valid_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with torch.no_grad():
            self.stats.mul_(0.5)
        y = self.linear(x).tanh()
        return y if shift is None else y + shift


class HiddenAndOut(nn.Module):
    """Returns a hidden state and what it computes from it (HF's ``output_hidden_states``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, valid_length: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.first(x).tanh()
        return hidden, self.second(hidden).sigmoid()
