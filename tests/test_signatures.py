"""signature_of: a function's signature read once per graphing call, and anew where it changed."""

from __future__ import annotations

import functools
import inspect

import pytest

from dualgraph._signatures import signature_of, signatures_read_once


class Block:
    def forward(self, x, scale=2.0):  # type: ignore[no-untyped-def]
        return x


def test_the_bound_methods_of_one_function_share_one_read_signature() -> None:
    with signatures_read_once():
        first, second = signature_of(Block().forward), signature_of(Block().forward)
    assert first is second
    assert str(first) == "(x, scale=2.0)"


def test_a_function_and_a_method_bound_to_it_are_read_apart() -> None:
    with signatures_read_once():
        method, function = signature_of(Block().forward), signature_of(Block.forward)
    assert str(method) == "(x, scale=2.0)"
    assert str(function) == "(self, x, scale=2.0)"


def test_outside_every_call_reads_anew() -> None:
    assert signature_of(Block().forward) is not signature_of(Block().forward)


def test_defaults_replaced_meanwhile_are_read_again() -> None:
    def f(x, scale=2.0):  # type: ignore[no-untyped-def]
        return x

    with signatures_read_once():
        before = signature_of(f)
        f.__defaults__ = (3.0,)
        after = signature_of(f)
    assert str(before) == "(x, scale=2.0)"
    assert str(after) == "(x, scale=3.0)"


def test_a_decorated_function_is_read_as_a_call_binds_to_it_each_time() -> None:
    # a call binds to the wrapper's own signature, whose **kwargs see the call's keywords
    def f(x, scale=2.0):  # type: ignore[no-untyped-def]
        return x

    @functools.wraps(f)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        return f(*args, **kwargs)

    with signatures_read_once():
        first, second = signature_of(wrapper), signature_of(wrapper)
    assert first is not second
    assert first == inspect.signature(wrapper, follow_wrapped=False)
    assert str(first) == "(*args, **kwargs)"


def test_graphing_blocks_of_one_class_reads_their_forward_signature_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    import dualgraph.torch as dgt
    from dualgraph.models.torch_vit import ViTBlock

    read: list[object] = []
    signature = inspect.signature

    def noting(fn, **kwargs):  # type: ignore[no-untyped-def]
        read.append(getattr(fn, "__func__", fn))
        return signature(fn, **kwargs)

    monkeypatch.setattr(inspect, "signature", noting)
    blocks = tuple(ViTBlock(8, 2) for _ in range(3))
    samples = tuple((torch.randn(2, 3, 8, requires_grad=True),) for _ in blocks)
    dgt.make_graphed_callables(blocks, samples, backend="emulate")
    assert read.count(ViTBlock.forward) == 1
