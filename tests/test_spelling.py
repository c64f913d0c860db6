"""``CallSpelling``: a call spelled otherwise than the sample, written as the sample was."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dualgraph import SpecMismatchError
from dualgraph._spelling import CallSpelling


def f(a: Any, b: Any = 2, /, c: Any = 3, *rest: Any, d: Any = 4, **more: Any) -> None:
    """Every kind of parameter."""


def test_a_call_spelled_as_the_sample_is_not_written_again() -> None:
    spelling = CallSpelling(f, (1,), {"c": 5, "x": 6})
    assert spelling.as_captured((9,), {"c": 8, "x": 7}) is None


def test_each_kind_of_parameter_is_written_as_the_sample_spelled_it() -> None:
    spelling = CallSpelling(f, (1, 2, 3), {"d": 4, "x": 5})
    # positional-only b left to its default 2, c by keyword, x through **more
    assert spelling.as_captured((1,), {"c": 3, "d": 4, "x": 5}) == ((1, 2, 3), {"d": 4, "x": 5})
    assert spelling.moved((1,), {"c": 3, "d": 4, "x": 5}) == (
        ("args[1]", None),
        ("args[2]", "kwargs['c']"),
    )


def test_keywords_collected_by_var_kwargs_keep_the_calls_order() -> None:
    spelling = CallSpelling(f, (1,), {"c": 3, "x": 5, "y": 6})
    spelled = spelling.as_captured((1, 2), {"y": 6, "x": 5, "c": 3})
    assert spelled is not None
    assert list(spelled[1]) == ["c", "y", "x"]  # the order check then sees the call's


def test_extra_positional_arguments_where_the_sample_passed_none_are_not_written() -> None:
    spelling = CallSpelling(f, (1,), {})
    assert spelling.as_captured((1, 2, 3, 4), {}) is None  # *rest gets (4,): the spec refuses


def test_a_call_that_does_not_bind_is_not_written() -> None:
    spelling = CallSpelling(f, (1,), {})
    assert spelling.as_captured((), {"a": 1}) is None  # a is positional-only: eager raises


def test_a_default_left_out_by_the_sample_and_passed_otherwise_is_refused_by_path() -> None:
    spelling = CallSpelling(f, (1,), {})
    assert spelling.as_captured((1, 2), {"d": 4}) == ((1,), {})
    with pytest.raises(SpecMismatchError) as info:
        spelling.as_captured((1, 2.0), {})
    assert info.value.path == "args[1]"
    assert str(info.value).startswith(
        "args[1]: float 2.0, where the sample call left b to its default int 2"
    )


def _raises() -> Any:
    raise RuntimeError("no signature")


class Unreadable:
    __signature__ = property(lambda self: _raises())

    def __call__(self, x: Any) -> None:
        pass


@pytest.mark.parametrize("fn", [len, Unreadable()], ids=["builtin", "signature_raises"])
def test_nothing_is_written_where_the_signature_cannot_be_read_or_bound(fn: Any) -> None:
    spelling = CallSpelling(fn, ([1],), {"unbound": 1})
    assert spelling.as_captured(([1],), {}) is None


def test_a_default_no_spec_holds_is_compared_by_identity_and_shown_by_its_repr() -> None:
    import enum

    class Mode(enum.Enum):
        FAST = 1
        SLOW = 2

    def g(x: Any, mode: Mode = Mode.FAST) -> None:
        """A default a spec holds no constant of."""

    spelling = CallSpelling(g, (1,), {})
    assert spelling.as_captured((1,), {"mode": Mode.FAST}) == ((1,), {})
    with pytest.raises(SpecMismatchError) as info:
        spelling.as_captured((1, Mode.SLOW), {})
    assert str(info.value).startswith(
        "args[1]: <Mode.SLOW: 2> (an object of type test_spelling.test_a_default_no_spec_holds"
    )
    assert "where the sample call left mode to its default <Mode.FAST: 1> (an object" in str(
        info.value
    )


def g(x: Any, /, **more: Any) -> None:
    """A positional-only parameter and ``**more``, which a keyword of the same name goes to."""


def with_defaults(**defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator setting defaults of its own (``functools.wraps``: the wrapped function's
    signature is what ``inspect.signature`` shows, not the one Python binds a call to)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **{**defaults, **kwargs})

        return wrapper

    return decorate


@with_defaults(scale=3.0)
def rescaled(x: Any, scale: float = 2.0) -> dict[str, Any]:
    """Eager's ``rescaled(x)`` gets scale 3.0, the wrapper's default, not 2.0."""
    return {"x": x, "scale": scale}


def test_a_wrapper_is_bound_by_its_own_signature_not_the_one_it_wraps() -> None:
    # Before: the signature was read through __wrapped__, (x, scale=2.0), so rescaled(1,
    # scale=2.0) (eager: scale 2.0) was written as the sample rescaled(1) (eager: scale 3.0,
    # the program's), and rescaled(1, 2.0) too: a replay of another call, silently.
    spelling = CallSpelling(rescaled, (1,), {})
    assert rescaled(1, scale=2.0) != rescaled(1)
    assert spelling.as_captured((1,), {"scale": 2.0}) is None  # the spec's error stands
    assert spelling.as_captured((1, 2.0), {}) is None
    assert spelling.as_captured((), {"x": 1}) is None  # the wrapper takes x in its **kwargs


def test_a_keyword_named_as_a_positional_only_parameter_is_never_made_from_it() -> None:
    # Before: the sample's x=2 (which goes to **more) was taken for the parameter x, so a call
    # g(2) leaving it out was written g(2, x=2), a keyword the caller never passed, which the
    # spec of g(2, x=2) then took: a replay with more={'x': 2} where eager's more is {}
    spelling = CallSpelling(g, (2,), {"x": 2})
    assert spelling.as_captured((2,), {}) is None  # the spec's error stands: kwargs['x'] missing
    assert spelling.as_captured((1,), {"x": 2}) is None  # spelled as the sample was


P = inspect.Parameter
values = st.sampled_from([0, 1, 2.0, None, True, "v"])


@st.composite
def functions(draw: st.DrawFn) -> Callable[..., dict[str, Any]]:
    """A function of random parameters (every kind, with and without defaults) returning what
    each parameter got."""
    kinds = sorted(
        draw(
            st.lists(st.sampled_from([P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY]))
        ),
        key=int,
    )[:5]
    parameters, defaulted = [], False
    for name, kind in zip("abcde", kinds, strict=False):
        has_default = draw(st.booleans()) or (defaulted and kind is not P.KEYWORD_ONLY)
        defaulted |= has_default and kind is not P.KEYWORD_ONLY
        parameters.append(P(name, kind, default=draw(values) if has_default else P.empty))
    if draw(st.booleans()):
        positional = sum(p.kind is not P.KEYWORD_ONLY for p in parameters)
        parameters.insert(positional, P("rest", P.VAR_POSITIONAL))
    if draw(st.booleans()):
        parameters.append(P("more", P.VAR_KEYWORD))
    namespace: dict[str, Any] = {}
    exec(f"def fn{inspect.Signature(parameters)}:\n    return dict(locals())", namespace)
    function: Callable[..., dict[str, Any]] = namespace["fn"]
    return function


@st.composite
def calls_of(draw: st.DrawFn, fn: Callable[..., Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments ``fn`` takes (Python's own binding: a keyword named as a positional-only
    parameter goes to ``**more``)."""
    args = tuple(draw(st.lists(values, max_size=4)))
    names = draw(st.lists(st.sampled_from([*"abcdexy", "rest", "more"]), max_size=3, unique=True))
    kwargs = {name: draw(values) for name in names}
    try:
        fn(*args, **kwargs)
    except TypeError:
        assume(False)
    return args, kwargs


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(data=st.data(), fn=functions())
def test_a_call_written_as_the_sample_was_gives_each_parameter_what_the_call_gives_it(
    data: st.DataObject, fn: Callable[..., dict[str, Any]]
) -> None:
    sample_args, sample_kwargs = data.draw(calls_of(fn))
    args, kwargs = data.draw(calls_of(fn))
    spelling = CallSpelling(fn, sample_args, sample_kwargs)
    try:
        spelled = spelling.as_captured(args, kwargs)
    except SpecMismatchError:  # a default passed otherwise: refused, never rewritten
        return
    if spelled is not None:  # eager's call and the one the spec checks bind alike (in order)
        assert repr(fn(*spelled[0], **spelled[1])) == repr(fn(*args, **kwargs))


def test_a_refusal_of_the_call_as_the_sample_names_the_path_as_the_call_spells_it() -> None:
    spelling = CallSpelling(f, (1, 2, 3), {})
    call: tuple[tuple[Any, ...], dict[str, Any]] = ((1,), {"c": {"k": 3}})
    assert spelling.as_captured(*call) == ((1, 2, {"k": 3}), {})
    refused = SpecMismatchError("args[2]['k']: expected int 3, got int 4", path="args[2]['k']")
    renamed = spelling.named_as_called(refused, *call)
    assert renamed.path == "kwargs['c']['k']"
    assert str(renamed) == "kwargs['c']['k']: expected int 3, got int 4"
    kept = SpecMismatchError("args[0]: expected int 1, got int 2", path="args[0]")
    assert spelling.named_as_called(kept, *call) is kept  # not moved
    # b: the call leaves it to its default, which the sample passed: the call's own error
    missing = SpecMismatchError("args[1]: missing (expected int 2)", path="args[1]")
    left = SpecMismatchError("args[1]: expected int 2, got int 3", path="args[1]")
    assert spelling.named_as_called(left, *call, missing) is missing
    assert spelling.path_as_called("args[1]", *call) is None


def test_values_given_as_the_sample_spelled_the_call_are_placed_as_the_call_spells_them() -> None:
    spelling = CallSpelling(f, (1, 2, 3), {})
    call: tuple[tuple[Any, ...], dict[str, Any]] = ((1,), {"x": 5, "c": 3, "d": 4})
    assert spelling.as_captured(*call) == ((1, 2, 3), {"x": 5})
    placed = spelling.as_called(("da", "db", "dc"), {"x": "dx"}, *call)
    # b (left to its default by the call) dropped; d (left out by the sample) gets None
    assert placed == (("da",), {"x": "dx", "c": "dc", "d": None})
    assert list(placed[1]) == ["x", "c", "d"]  # the call's order


def test_a_keyword_named_as_a_positional_only_parameter_is_collected_not_moved() -> None:
    # Before: kwargs['a'] (collected by **more) was taken for the parameter a, so the call as
    # sampled was "moved" from args[0] to kwargs['a'] and an error there named args[0].
    def g(a: Any, /, **more: Any) -> None:
        """``a`` by position only; a keyword ``a`` goes to ``more``."""

    spelling = CallSpelling(g, (1,), {"a": 2})
    assert spelling.as_captured((1,), {"a": 3}) is None  # spelled as the sample
    assert spelling.moved((1,), {"a": 3}) == ()
    refused = SpecMismatchError("kwargs['a']: expected int 2, got int 3", path="kwargs['a']")
    assert spelling.named_as_called(refused, (1,), {"a": 3}) is refused


def test_a_spelling_read_after_many_others_is_still_placed_as_the_call_spells_it() -> None:
    # Before: the plan, dropped after 64 other spellings, read as "spelled as the sample": a
    # pullback taken before them gave its grads in the sample's spelling, silently.
    def g(x: Any, y: Any = 0, **more: Any) -> None:
        """``x`` and ``y`` by position or keyword; other keywords collected."""

    spelling = CallSpelling(g, (1, 2), {})
    call: tuple[tuple[Any, ...], dict[str, Any]] = ((), {"y": 2, "x": 1})
    assert spelling.as_captured(*call) == ((1, 2), {})
    for n in range(70):  # other spellings of the same parameters
        spelling.as_captured((1, 2), dict.fromkeys(f"k{i}" for i in range(n + 1)))
    assert spelling.as_called(("dx", "dy"), {}, *call) == ((), {"y": "dy", "x": "dx"})
    assert spelling.moved(*call) == (("args[0]", "kwargs['x']"), ("args[1]", "kwargs['y']"))
