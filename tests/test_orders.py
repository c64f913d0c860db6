"""KeyOrders: the key order of a call's dicts, which a spec lets vary and a program cannot."""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, NamedTuple

import pytest
from trees import EncoderOutput, array

from dualgraph import SpecMismatchError, describe, describe_call
from dualgraph._orders import KeyOrders, key_order_difference


class Counted(NamedTuple):
    index: Any  # a field named like a tuple method: read by position, never as an attribute
    count: Any


def swapped(d: dict[Any, Any]) -> dict[Any, Any]:
    return dict(reversed(d.items()))


def nested(d: dict[Any, Any]) -> tuple[Any, ...]:
    """``d`` deep inside a call's args: a list, a namedtuple field, a dataclass field, a dict."""
    return ([None, Counted(index=EncoderOutput(hidden=None, pooled={"in": d}), count=1)],)


def test_a_dict_in_another_order_is_refused_naming_its_path_through_every_container() -> None:
    d = {"b": array(2), "a": array(2)}
    orders = KeyOrders(describe_call(nested(d)))
    orders.check(nested(d), {})
    with pytest.raises(SpecMismatchError) as caught:
        orders.check(nested(swapped(d)), {})
    path = "args[0][1].index.pooled['in']"
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: a dict with its keys in the order ['a', 'b']")


class Reversing(collections.namedtuple("Reversing", "first second")):
    """A namedtuple whose indexing reads its items from the other end."""

    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        return tuple.__getitem__(self, -1 - index)


def test_a_namedtuple_on_the_way_is_read_by_its_items_not_its_own_indexing() -> None:
    # Before: the walk read Reversing(d, None)[0] through the class's __getitem__ (None), and
    # the check ended in a TypeError instead of reading the dict
    d = {"b": array(2), "a": array(2)}
    orders = KeyOrders(describe_call((Reversing(d, None),)))
    orders.check((Reversing(d, None),), {})
    with pytest.raises(SpecMismatchError) as caught:
        orders.check((Reversing(swapped(d), None),), {})
    assert caught.value.path == "args[0].first"


def test_the_keyword_arguments_themselves_bind_by_name() -> None:
    kwargs = {"b": array(2), "a": array(2), "inner": {"y": 1, "x": array(1)}}
    orders = KeyOrders(describe_call((), kwargs))
    orders.check((), swapped(kwargs))  # any order of the keywords
    with pytest.raises(SpecMismatchError, match=r"^kwargs\['inner'\]: a dict with its keys"):
        orders.check((), {**kwargs, "inner": swapped(kwargs["inner"])})


def test_a_call_without_dicts_of_two_keys_has_nothing_to_check() -> None:
    ordered = collections.OrderedDict(b=array(1), a=array(1))  # its order is its structure
    assert not KeyOrders(describe_call(({"a": array(1)}, ordered, [1, 2]), {"k": 1, "j": 2}))
    assert KeyOrders(describe_call(({"a": array(1), "b": None},)))


def collecting(x: Any, /, *, scale: float, **parts: Any) -> None:
    """Collects every keyword but ``scale`` in ``parts`` (``x`` too, given by keyword)."""


def test_keywords_a_function_collects_in_its_var_kwargs_keep_their_order() -> None:
    kwargs = {"b": array(1), "scale": 1.0, "x": 2, "a": None}
    orders = KeyOrders(describe_call((array(1),), kwargs), collecting)
    orders.check((), {"scale": 1.0, "b": 0, "x": 0, "a": 0})  # scale binds by name
    with pytest.raises(SpecMismatchError, match=r"^kwargs: the keywords \['x', 'b', 'a'\] go to"):
        orders.check((), {"x": 0, "b": 0, "a": 0, "scale": 1.0})


def test_keywords_a_wrapper_collects_in_its_var_kwargs_keep_their_order() -> None:
    # Before: the signature was read through __wrapped__ (functools.wraps), where a and b are
    # named parameters, so the wrapper's **kwargs, which sees the call's order, went unchecked.
    def named(x: Any, a: Any, b: Any) -> None:
        """Takes a and b by name."""

    @functools.wraps(named)
    def summing(*args: Any, **kwargs: Any) -> Any:
        return named(*args, **kwargs), list(kwargs)  # the keywords in the call's order

    orders = KeyOrders(describe_call((array(1),), {"a": array(1), "b": array(1)}), summing)
    orders.check((0,), {"a": 0, "b": 0})
    with pytest.raises(SpecMismatchError, match=r"^kwargs: the keywords \['b', 'a'\] go to"):
        orders.check((0,), {"b": 0, "a": 0})


class _UnreadableSignature:
    """A callable whose ``__signature__`` raises (inspect.signature passes the error on)."""

    @property
    def __signature__(self) -> Any:
        raise RuntimeError("no signature")

    def __call__(self, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize(
    "fn",
    [lambda **kw: None, max, _UnreadableSignature()],
    ids=["one-collected", "no-signature", "signature-raises"],
)
def test_nothing_is_checked_where_order_cannot_matter_or_cannot_be_known(fn: Any) -> None:
    unknown = fn is max or isinstance(fn, _UnreadableSignature)
    assert not KeyOrders(describe_call((), {"b": 1, "a": 2} if unknown else {"a": 1}), fn)


@pytest.mark.parametrize("kwargs", [{}, {"mask": 1}], ids=["no-keyword", "one-keyword"])
def test_the_signature_is_not_read_where_fewer_than_two_keywords_are_given(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any]
) -> None:
    # Fewer than two keywords have no order a **kwargs could see; reading the signature cost
    # every graphed callable's capture ~0.1 ms. Two are still read (the test above).
    import inspect

    from dualgraph import _orders

    read: list[Any] = []
    signature = inspect.signature

    def counted(fn: Any, *args: Any, **options: Any) -> inspect.Signature:
        read.append(fn)
        return signature(fn, *args, **options)

    monkeypatch.setattr(_orders.inspect, "signature", counted)
    assert not KeyOrders(describe_call((array(1),), kwargs), collecting)
    assert read == []
    assert KeyOrders(describe_call((), {"b": 1, "a": 2}), collecting)
    assert read == [collecting]


def test_difference_gives_the_path_and_both_orders_for_each_adapter_to_word() -> None:
    kwargs = {"b": array(1), "scale": 1.0, "a": {"y": 1, "x": 2}}
    orders = KeyOrders(describe_call((), kwargs), collecting)
    assert orders.difference((), kwargs) is None
    assert orders.difference((), {**kwargs, "a": {"x": 2, "y": 1}}) == (
        "kwargs['a']",
        ("x", "y"),
        ("y", "x"),
    )
    assert orders.difference((), {"a": kwargs["a"], "b": 0, "scale": 1.0}) == (
        "kwargs",
        ("a", "b"),
        ("b", "a"),
    )


def test_dicts_down_a_deep_spine_are_checked_in_time_linear_in_its_depth() -> None:
    # Each dict kept its own steps from the root and its path: building took time and memory
    # quadratic in the depth (4,000 levels: 34 s, 527 MB), and so did every call's check.
    def spine(depth: int, last: tuple[str, str]) -> dict[str, Any]:
        tree: dict[str, Any] = dict.fromkeys(last, 1)
        for _ in range(depth):
            tree = {"a": tree, "b": 1}
        return tree

    def took(depth: int) -> float:
        start = time.process_time()  # CPU time: other processes on the machine do not count
        orders = KeyOrders(describe_call((spine(depth, ("x", "y")),)))
        orders.check((spine(depth, ("x", "y")),), {})
        with pytest.raises(SpecMismatchError, match=rf"^args\[0\](\['a'\]){{{depth}}}: a dict"):
            orders.check((spine(depth, ("y", "x")),), {})
        return time.process_time() - start

    # the best of three each: a garbage collection falling in one try does not fail it
    seconds = [min(took(depth) for _ in range(3)) for depth in (500, 4000)]
    assert seconds[1] < 8 * 4 * seconds[0] + 0.1, seconds  # 8x the depth: at most 4x linear


def test_key_order_difference_names_the_first_dict_in_another_order() -> None:
    expected = describe({"x": [{"a": 1, "b": 2}], "y": {"c": 1, "d": 2}})
    found = describe({"y": {"d": 2, "c": 1}, "x": [{"b": 2, "a": 1}]})
    assert key_order_difference(expected, found) == ("", ("x", "y"), ("y", "x"))
    inner = describe({"x": [{"b": 2, "a": 1}], "y": {"c": 1, "d": 2}})
    assert key_order_difference(expected, inner) == ("['x'][0]", ("a", "b"), ("b", "a"))
    assert key_order_difference(expected, expected) is None


@pytest.mark.parametrize("where", ["dict", "collected"])
def test_an_order_refused_shows_the_keys_clipped_not_all_of_them(where: str) -> None:
    # Before: both orders were written out whole: a dict of 20,000 keys in another order made
    # a message of 400,000 characters
    keys = [f"key{i}" for i in range(20_000)]
    reordered = dict.fromkeys(reversed(keys), 0)
    if where == "dict":
        orders = KeyOrders(describe_call((dict.fromkeys(keys, 0),)))
        call: tuple[Any, Any] = ((reordered,), {})
        start = "args[0]: a dict with its keys in the order ['key19999', 'key19998', "
    else:
        orders = KeyOrders(describe_call((), dict.fromkeys(keys, 0)), lambda **kw: None)
        call = ((), reordered)
        start = "kwargs: the keywords ['key19999', 'key19998', "
    with pytest.raises(SpecMismatchError) as caught:
        orders.check(*call)
    assert str(caught.value).startswith(start) and len(str(caught.value)) < 1200
