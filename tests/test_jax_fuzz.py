"""Differential fuzzing: a graphed function, its outputs and its VJP against the function run
eagerly and :func:`jax.vjp`, over random input trees and random output trees (bounded, seeded)."""

from __future__ import annotations

import collections
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualgraph.jax as dgj

Pair = collections.namedtuple("Pair", "a b")
DTYPES = [np.float32, np.int32, np.bool_, jnp.bfloat16, np.float16, np.complex64, "weak"]
SHAPES = [(), (0,), (3,), (2, 2), (0, 3)]
OUTPUTS = ["none", "const", "leaf", "op", "same", "sum"]
fuzzed = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def _is_none(x: Any) -> bool:
    return x is None


def _array(r: random.Random) -> jax.Array:
    dtype, shape = r.choice(DTYPES), r.choice(SHAPES)
    if dtype == "weak":  # from a Python scalar: float32 or int32, weakly typed
        return jnp.full(shape, r.choice([r.uniform(-2, 2), r.randrange(-3, 4)]))
    values = np.random.default_rng(r.randrange(1 << 30)).uniform(-2, 2, size=shape)
    return jnp.asarray(values.astype(dtype))


def _fresh(tree: Any) -> Any:
    """``tree`` with new values in its arrays (of the same dtype and weak type), as a later call
    passes them: nothing of the sample's values may be compiled in."""

    def fresh(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.dtype == jnp.bool_:
            return ~x
        return x * 2 - 1 if x.weak_type else jnp.asarray(x * 2 - 1, x.dtype)

    return _map(fresh, tree)


def _map(fn: Any, tree: Any) -> Any:
    """``fn`` of each leaf, every container (a dict's key order too) kept as it is."""
    if isinstance(tree, Pair):
        return Pair(_map(fn, tree.a), _map(fn, tree.b))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


def _tree(r: random.Random, depth: int = 0) -> Any:
    kind = r.randrange(9 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return r.choice([1, 2.5, "s", True, -0.0])
    if kind <= 4:
        return _array(r)
    if kind == 5:
        return tuple(_tree(r, depth + 1) for _ in range(r.randrange(3)))
    if kind == 6:
        return {f"k{i}": _tree(r, depth + 1) for i in r.sample(range(5), r.randrange(3))}
    if kind == 7:
        return [_tree(r, depth + 1) for _ in range(r.randrange(3))]
    return Pair(_tree(r, depth + 1), _tree(r, depth + 1))


def _arrays(tree: Any) -> list[Any]:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def _function(r: random.Random, n_arrays: int) -> Any:
    recipe = [(r.choice(OUTPUTS), r.randrange(max(n_arrays, 1))) for _ in range(r.randrange(5))]
    as_tuple = r.random() < 0.5

    def fn(*args: Any, **kwargs: Any) -> Any:
        xs = _arrays((args, kwargs))
        out: list[Any] = []
        for kind, i in recipe:
            if kind == "none" or not xs:
                out.append(None)
            elif kind == "const":
                out.append(3)
            elif kind == "leaf":  # an input passed through
                out.append(xs[i])
            elif kind == "op":
                out.append(~xs[i] if xs[i].dtype == jnp.bool_ else xs[i] * 2 + 1)
            elif kind == "same":  # the same array twice
                y = xs[i] if xs[i].dtype == jnp.bool_ else xs[i] + 0
                out.append({"a": y, "b": y})
            else:
                out.append(jnp.sum(xs[i].real.astype(jnp.float32)) * 1.5)
        return tuple(out) if as_tuple else out

    return fn


def _assert_same(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got, is_leaf=_is_none) == jax.tree_util.tree_structure(
        want, is_leaf=_is_none
    )
    for x, y in zip(
        jax.tree_util.tree_leaves(got, is_leaf=_is_none),
        jax.tree_util.tree_leaves(want, is_leaf=_is_none),
        strict=True,
    ):
        assert type(x) is type(y), (x, y)
        if isinstance(y, jax.Array):
            assert (x.dtype, x.shape, x.weak_type) == (y.dtype, y.shape, y.weak_type), (x, y)
            bits = (
                np.asarray(x).reshape(-1).view(np.uint8),
                np.asarray(y).reshape(-1).view(np.uint8),
            )
            assert np.array_equal(*bits), (x, y)
        else:
            assert x == y or (x != x and y != y), (x, y)


@fuzzed
@given(st.randoms(use_true_random=False))
def test_graphed_outputs_and_vjp_equal_eager_and_jax_vjp(r: random.Random) -> None:
    args = tuple(_tree(r) for _ in range(r.randrange(1, 4)))
    if r.random() < 0.3:
        args = (*args, r.choice([1.5, 2]))  # a Python scalar: a constant
    kwargs = {f"kw{i}": _tree(r) for i in r.sample(range(4), r.randrange(3))}
    fn = _function(r, len(_arrays((args, kwargs))))
    g = dgj.graphed(fn, args, sample_kwargs=kwargs)
    if r.random() < 0.5:  # a later call, with other values
        args, kwargs = _fresh(args), _fresh(kwargs)
    want = fn(*args, **kwargs)
    _assert_same(g(*args, **kwargs), want)
    outputs, pullback = g.vjp(*args, **kwargs)
    _assert_same(outputs, want)

    mask = iter(g.out_spec.grad_mask)

    def cotangent_of(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return None
        return jnp.ones(x.shape, x.dtype) if next(mask) else None

    cotangent = jax.tree_util.tree_map(cotangent_of, want, is_leaf=_is_none)
    args_grads, kwargs_grads = pullback(cotangent)

    flat, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_none)
    diff = [
        i
        for i, x in enumerate(flat)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    cotangents = [
        c for c in jax.tree_util.tree_leaves(cotangent, is_leaf=_is_none) if c is not None
    ]

    def masked(*xs: Any) -> list[Any]:
        full = list(flat)
        for i, x in zip(diff, xs, strict=True):
            full[i] = x
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        out = fn(*call_args, **call_kwargs)
        pairs = zip(
            jax.tree_util.tree_leaves(out, is_leaf=_is_none),
            jax.tree_util.tree_leaves(cotangent, is_leaf=_is_none),
            strict=True,
        )
        return [x for x, c in pairs if c is not None]

    _, reference = jax.vjp(masked, *[flat[i] for i in diff])
    expected = iter(reference(cotangents))
    grads = jax.tree_util.tree_leaves((args_grads, kwargs_grads), is_leaf=_is_none)
    assert len(grads) == len(flat)
    for i, grad in enumerate(grads):
        if i in diff:
            _assert_same(grad, next(expected))
        else:  # integer, bool inputs and constants get None
            assert grad is None, (i, grad)


def _spelled(
    a: Any, b: Any = None, /, c: Any = 1.0, *rest: Any, d: Any = None, e: Any = 2.0, **more: Any
) -> Any:
    """Every kind of parameter, each used, so that each reaches the outputs and the grads."""
    out = a * c * e
    if b is not None:
        out = out + b
    for r in rest:
        out = out + r
    if d is not None:
        out = out * d
    for i, v in enumerate(more.values()):
        out = out - v * (i + 1)  # the collected keywords' order matters
    return {"out": out, "none": None}


def _spelling_pair(r: random.Random) -> tuple[tuple[Any, ...], dict[str, Any], Any, Any]:
    """A sample call of :func:`_spelled` and a call of it spelled otherwise, binding alike."""
    n = iter(range(1, 100))

    def arr() -> jax.Array:
        return jnp.arange(3.0, dtype=jnp.float32) + next(n)

    use_b, c_mode = r.random() < 0.5, r.choice(["pos", "kw", "left"])
    if c_mode == "pos" and not use_b:
        c_mode = "kw"
    on = {name: r.random() < 0.5 for name in "dez"}
    args: list[Any] = [arr()] + ([arr()] if use_b else [])
    kwargs: dict[str, Any] = {}
    if c_mode == "pos":
        args.append(arr())
    elif c_mode == "kw":
        kwargs["c"] = arr()
    kwargs.update({name: arr() for name in "de" if on[name]})
    named = list(kwargs.items())
    r.shuffle(named)
    kwargs = dict(named)
    if on["z"]:
        kwargs["z"], kwargs["y"] = arr(), arr()
    call_args: list[Any] = [arr()] + ([arr()] if use_b else [])
    call_kwargs: dict[str, Any] = {}
    if c_mode != "left" and use_b and r.random() < 0.5:
        call_args.append(arr())
    elif c_mode != "left":
        call_kwargs["c"] = arr()
    elif r.random() < 0.5:
        call_kwargs["c"] = 1.0  # the default passed as itself
    for name, default in (("d", None), ("e", 2.0)):
        if on[name]:
            call_kwargs[name] = arr()
        elif r.random() < 0.5:
            call_kwargs[name] = default
    named = list(call_kwargs.items())
    r.shuffle(named)
    call_kwargs = dict(named)
    if on["z"]:
        call_kwargs["z"], call_kwargs["y"] = arr(), arr()
    return tuple(args), kwargs, tuple(call_args), call_kwargs


@fuzzed
@given(st.integers(0, 2**32 - 1))
def test_a_call_spelled_otherwise_runs_and_differentiates_as_the_function(seed: int) -> None:
    sample_args, sample_kwargs, args, kwargs = _spelling_pair(random.Random(seed))
    g = dgj.graphed(_spelled, sample_args, sample_kwargs=sample_kwargs)
    out = g(*args, **kwargs)
    want = _spelled(*args, **kwargs)
    assert out["none"] is None
    np.testing.assert_array_equal(out["out"], want["out"])
    _, pullback = g.vjp(*args, **kwargs)
    args_grads, kwargs_grads = pullback({"out": jnp.ones(3), "none": None})
    names = list(kwargs)  # a dict through jax.vjp comes back with its keys sorted: a list

    def by_position(a: Any, values: list[Any]) -> Any:
        return _spelled(*a, **dict(zip(names, values, strict=True)))["out"]

    _, want_pullback = jax.vjp(by_position, args, list(kwargs.values()))
    want_args, want_values = want_pullback(jnp.ones(3))
    want_kwargs = dict(zip(names, want_values, strict=True))
    assert len(args_grads) == len(args)
    for got, expected in zip(args_grads, want_args, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert list(kwargs_grads) == list(kwargs)  # as the call spells them, in its order
    for name, value in kwargs.items():
        if isinstance(value, jax.Array):
            np.testing.assert_array_equal(kwargs_grads[name], want_kwargs[name])
        else:
            assert kwargs_grads[name] is None
