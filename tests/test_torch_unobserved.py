"""unobserved: dualgraph's own ops hidden from the torch function and dispatch modes on."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from dualgraph.torch import _unobserved
from dualgraph.torch._unobserved import unobserved


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class _SeenFunctions(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_neither_mode_sees_the_ops_inside_and_both_are_back_after() -> None:
    with _Seen() as dispatch, _SeenFunctions() as functions:
        with unobserved():
            torch.ones(2).sum()
        assert dispatch.ops == [] and functions.calls == []
        torch.ones(2)
        assert dispatch.ops and functions.calls


def test_the_modes_are_back_after_an_error_inside() -> None:
    with _Seen() as dispatch:
        with pytest.raises(KeyError), unobserved():
            raise KeyError("inside")
        assert _get_current_dispatch_mode_stack() == [dispatch]
    assert torch._C._is_torch_function_enabled()


def test_with_no_dispatch_mode_on_no_mode_stack_is_taken_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's _disable_current_modes imports its mode classes on every call: about 5 us, a
    # dozen times per callable a capture warms up
    monkeypatch.setattr(_unobserved, "_disable_current_modes", lambda: pytest.fail("entered"))
    with unobserved():
        torch.ones(2).sum()
    assert torch._C._is_torch_function_enabled()
