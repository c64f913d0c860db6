"""dualgraph.jax.graphed refuses a bad call by path, before running or donating anything.

A matrix over the plain call and :meth:`~dualgraph.jax.GraphedCallable.vjp`, with and without
donated arguments, against bad calls (shape, dtype, rank, leaf kind, tree structure, keywords,
constants, ``None``). Each cell checks that the error is a :class:`DualgraphError` naming the
leaf path, that no array of the bad call was donated away, and that an earlier call's pullback
and the following good call equal ``jax.vjp`` of the function.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optree
import pytest

import dualgraph
import dualgraph.jax as dgj
from dualgraph import DualgraphError


class Pair(NamedTuple):
    a: Any
    b: Any


@dualgraph.register_dataclass
@dataclasses.dataclass
class Config:
    scale: Any
    note: str = "n"


@dualgraph.register_dataclass
@dataclasses.dataclass
class OtherConfig:
    scale: Any
    note: str = "n"


def layer(
    w: jax.Array,
    x: jax.Array,
    pair: Pair,
    *,
    extra: list[dict[str, Any]],
    k: Any = 1,
    tag: str = "a",
) -> dict[str, Any]:
    h = (x @ w * pair.a + pair.b) * extra[0]["m"] * extra[0]["cfg"].scale
    return {"h": h * k, "tag": tag, "none": None, "count": extra[0]["count"]}


def good(seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    r = np.random.default_rng(seed)

    def f32(*shape: int) -> jax.Array:
        return jnp.asarray(r.standard_normal(shape), jnp.float32)

    w, x, pair = f32(4, 4), f32(2, 4), Pair(f32(4), f32(4))
    extra = [{"m": f32(1, 4), "n": None, "count": 3, "cfg": Config(f32(4))}]
    return (w, x, pair), {"extra": extra, "k": 1, "tag": "a"}


Bad = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def _with(d: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**d, **change}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _x(value: Callable[[Any], Any]) -> Bad:
    return lambda a, kw: ((a[0], value(a[1]), a[2]), kw)


def _pair(**change: Callable[[Pair], Any]) -> Bad:
    return lambda a, kw: (
        (a[0], a[1], a[2]._replace(**{k: f(a[2]) for k, f in change.items()})),
        kw,
    )


def _extra(change: Callable[[list[dict[str, Any]]], Any]) -> Bad:
    return lambda a, kw: (a, {**kw, "extra": change(kw["extra"])})


def _entry(**change: Any) -> Bad:
    return _extra(lambda e: [_with(e[0], **change)])


def _cfg(change: Callable[[Config], Any]) -> Bad:
    return _extra(lambda e: [_with(e[0], cfg=change(e[0]["cfg"]))])


def _kw(**change: Any) -> Bad:
    return lambda a, kw: (a, {**kw, **change})


class Opaque:
    """An unregistered class: never a leaf of a spec."""


#: name -> (how to spoil a good call, the path the error must start with)
BAD_CALLS: dict[str, tuple[Bad, str]] = {
    "shape": (_x(lambda x: jnp.ones((2, 5))), "args[1]"),
    "rank": (_pair(b=lambda p: p.b[None]), "args[2].b"),
    "dtype": (_entry(m=jnp.ones((1, 4), jnp.bfloat16)), "kwargs['extra'][0]['m']"),
    "int_dtype": (_x(lambda x: jnp.ones((2, 4), jnp.int32)), "args[1]"),
    "numpy_float64": (_pair(b=lambda p: np.asarray(p.b, np.float64)), "args[2].b"),
    "list_for_array": (_pair(b=lambda p: p.b.tolist()), "args[2].b"),
    "opaque_for_array": (_pair(b=lambda p: Opaque()), "args[2].b"),
    "float_for_array": (_pair(b=lambda p: 1.0), "args[2].b"),
    "extra_key": (_entry(z=jnp.ones(1)), "kwargs['extra'][0]['z']"),
    "missing_key": (_extra(lambda e: [_without(e[0], "m")]), "kwargs['extra'][0]['m']"),
    "extra_leaf": (_extra(lambda e: [*e, {}]), "kwargs['extra']"),
    "tuple_for_list": (_extra(tuple), "kwargs['extra']"),
    "ordered_dict_for_dict": (
        _extra(lambda e: [collections.OrderedDict(e[0])]),
        "kwargs['extra'][0]",
    ),
    "tuple_for_namedtuple": (lambda a, kw: ((a[0], a[1], tuple(a[2])), kw), "args[2]"),
    "dict_for_dataclass": (
        _cfg(lambda c: {"scale": c.scale, "note": c.note}),
        "kwargs['extra'][0]['cfg']",
    ),
    "other_dataclass": (_cfg(lambda c: OtherConfig(c.scale, c.note)), "kwargs['extra'][0]['cfg']"),
    "dataclass_field_shape": (
        _cfg(lambda c: Config(c.scale[:3], c.note)),
        "kwargs['extra'][0]['cfg'].scale",
    ),
    "dataclass_field_const": (
        _cfg(lambda c: Config(c.scale, "m")),
        "kwargs['extra'][0]['cfg'].note",
    ),
    "missing_kwarg": (lambda a, kw: (a, _without(kw, "extra")), "kwargs['extra']"),
    "unexpected_kwarg": (_kw(unexpected=jnp.ones(2)), "kwargs['unexpected']"),
    "missing_arg": (lambda a, kw: (a[:2], kw), "args[2]"),
    "extra_arg": (lambda a, kw: ((*a, 3), kw), "args[3]"),
    "const_true_for_1": (_kw(k=True), "kwargs['k']"),
    "const_float_for_1": (_kw(k=1.0), "kwargs['k']"),
    "const_numpy_int_for_1": (_kw(k=np.int64(1)), "kwargs['k']"),
    "const_str": (_kw(tag="b"), "kwargs['tag']"),
    "const_int_in_list": (_entry(count=4), "kwargs['extra'][0]['count']"),
    "none_for_array": (_pair(b=lambda p: None), "args[2].b"),
    "array_for_none": (_entry(n=jnp.ones(1)), "kwargs['extra'][0]['n']"),
    "array_for_const": (_kw(k=jnp.ones(())), "kwargs['k']"),
    "none_for_const": (_kw(tag=None), "kwargs['tag']"),
}


def _reference(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Outputs and grads (of w, x, pair.a) of a twin graphed from the same sample, never given
    a bad call: the same program, so equal bit for bit."""
    twin = dgj.graphed(layer, good(0)[0], sample_kwargs=good(0)[1])
    out, pullback = twin.vjp(*args, **kwargs)
    return out, _grads(pullback, out)


def _copy(tree: Any) -> Any:
    return optree.tree_map(
        lambda leaf: jnp.array(leaf, copy=True) if isinstance(leaf, jax.Array) else leaf,
        tree,
        none_is_leaf=True,
        namespace="dualgraph",
    )


def _run(graphed: dgj.GraphedCallable, entry: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Outputs and grads (of w, x, pair.a), by the plain call or by the VJP."""
    if entry == "call":
        return graphed(*args, **kwargs), None
    out, pullback = graphed.vjp(*args, **kwargs)
    return out, pullback


def _grads(pullback: Any, out: Any) -> tuple[Any, ...]:
    cotangent = {"h": jnp.ones_like(out["h"]), "tag": None, "none": None, "count": None}
    (w, x, pair), _ = pullback(cotangent)
    return w, x, pair.a


def _assert_equal(actual: Any, expected: Any) -> None:
    assert optree.tree_structure(actual, none_is_leaf=True) == optree.tree_structure(
        expected, none_is_leaf=True
    )
    for a, e in zip(
        optree.tree_leaves(actual, none_is_leaf=True),
        optree.tree_leaves(expected, none_is_leaf=True),
        strict=True,
    ):
        if isinstance(e, jax.Array):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
        else:
            assert a == e and type(a) is type(e)


@pytest.mark.parametrize("bad", list(BAD_CALLS))
@pytest.mark.parametrize("donate", [(), (1,)], ids=["kept", "donated"])
@pytest.mark.parametrize("entry", ["call", "vjp"])
def test_a_bad_call_is_refused_by_path_and_donates_nothing(
    entry: str, donate: tuple[int, ...], bad: str
) -> None:
    sample_args, sample_kwargs = good(0)
    graphed = dgj.graphed(layer, sample_args, sample_kwargs=sample_kwargs, donate_argnums=donate)
    a1, kw1 = good(1)
    expected1 = _reference(*_copy((a1, kw1)))
    out1, pullback1 = _run(graphed, entry, a1, kw1)
    spoil, path = BAD_CALLS[bad]
    bad_args, bad_kwargs = spoil(*good(2))
    with pytest.raises(DualgraphError) as caught:
        _run(graphed, entry, bad_args, bad_kwargs)
    message = str(caught.value)
    assert message.startswith(f"{path}:"), message
    for leaf in optree.tree_leaves(
        (bad_args, bad_kwargs), none_is_leaf=True, namespace="dualgraph"
    ):
        if isinstance(leaf, jax.Array):
            assert not leaf.is_deleted(), "the bad call donated an array"
    _assert_equal(out1, expected1[0])
    if pullback1 is not None:
        _assert_equal(_grads(pullback1, out1), expected1[1])
    a3, kw3 = good(3)
    expected3 = _reference(*_copy((a3, kw3)))
    out3, pullback3 = _run(graphed, entry, a3, kw3)
    _assert_equal(out3, expected3[0])
    if pullback3 is not None:
        _assert_equal(_grads(pullback3, out3), expected3[1])


def test_a_nested_array_on_another_device_is_refused_by_path_and_donates_nothing() -> None:
    code = """
import jax, jax.numpy as jnp, dualgraph, dualgraph.jax as dgj
from tests.test_jax_bad_calls import good, layer, _grads
args, kwargs = good(0)
for entry in ("call", "vjp"):
    g = dgj.graphed(layer, args, sample_kwargs=kwargs, donate_argnums=(1,))
    bad_args, bad_kwargs = good(2)
    bad_kwargs["extra"][0]["m"] = jax.device_put(bad_kwargs["extra"][0]["m"], jax.devices()[1])
    try:
        (g if entry == "call" else g.vjp)(*bad_args, **bad_kwargs)
    except dualgraph.DualgraphError as error:
        print(entry, str(error).split(":")[0], bad_args[1].is_deleted())
    a, kw = good(3)
    out = g.vjp(*a, **kw)[0] if entry == "vjp" else g(*a, **kw)
    print(entry, "then", out["h"].shape, a[1].is_deleted())
"""
    path = os.pathsep.join([os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": path,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == [
        "call kwargs['extra'][0]['m'] False",
        "call then (2, 4) True",
        "vjp kwargs['extra'][0]['m'] False",
        "vjp then (2, 4) True",
    ]


def test_compiler_options_that_are_not_a_mapping_are_refused() -> None:
    with pytest.raises(DualgraphError, match="compiler_options must be a mapping"):
        dgj.GraphedCallable(lambda x: x, (jnp.ones(2),), compiler_options=["xla_foo"])  # type: ignore[arg-type]


def test_compiler_options_that_are_not_a_mapping_are_refused_by_a_twin_too() -> None:
    g = dgj.graphed(lambda x: x, (jnp.ones(2),))
    with pytest.raises(DualgraphError, match="compiler_options must be a mapping"):
        g.with_compiler_options(["xla_foo"])  # type: ignore[arg-type]
