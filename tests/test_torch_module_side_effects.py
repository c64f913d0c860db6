"""SideEffects: what a forward's Python leaves on its modules, watched from call to call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dualgraph.torch import _module_side_effects
from dualgraph.torch._capture_failure import Refused
from dualgraph.torch._module_side_effects import SideEffects


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale, self.name, self.flag, self.none = 2.0, "block", True, None
        self.calls = 0
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a plain value: left alone
        self.losses.append(x.sum())
        return x * self.scale


def test_a_list_appended_to_after_the_first_call_is_refused_and_put_back() -> None:
    module = _Counting()
    watch = SideEffects([("Counting", module)])
    watch.run(lambda: module(torch.ones(1)))
    with pytest.raises(Refused, match=r"Counting\.losses"):
        watch.run(lambda: module(torch.ones(1)))
    assert module.losses == []


def test_plain_values_are_not_asked_about_on_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # a module's own numbers, strings and flags (Linear's in_features) are never watched: taken
    # by their type, not asked of _watched (an ABC check for an iterator each) on every call
    asked: list[Any] = []
    watched = _module_side_effects._watched
    monkeypatch.setattr(_module_side_effects, "_watched", lambda v: asked.append(v) or watched(v))
    module = _Counting()
    watch = SideEffects([("Counting", module)])
    watch.run(lambda: module(torch.ones(1)))
    assert asked and not any(type(v) in (int, float, str, bool, type(None)) for v in asked)
