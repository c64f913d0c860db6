"""Which dtypes JAX computes exactly as given, and the refusal of those it would narrow.

With its 64-bit mode off, JAX silently computes ``int64`` as ``int32``, ``uint64`` as ``uint32``,
``float64`` as ``float32`` and ``complex128`` as ``complex64`` (``1099511627784`` comes back as
``8``); some numpy dtypes (``float128``, strings, objects, dates) it cannot hold at all.
:func:`refuse_narrowed_inputs` turns both into an error naming the input's path, before anything
is compiled.

>>> jax_dtype("bfloat16"), jax_dtype("float128")
('bfloat16', None)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._dtypes import is_dtype_name
from .._errors import DualgraphError, SpecMismatchError
from .._spec import LeafSpec
from ._env import x64_enabled

__all__ = [
    "dtype_of",
    "jax_dtype",
    "refuse_narrowed_inputs",
    "weak_type_error",
    "weak_types",
]

#: JAX's own PRNG implementations, whose typed keys (``key<fry>``...) a spec can name.
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


@functools.cache
def _key_dtypes() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for impl in _KEY_IMPLS:
        try:
            dtype = jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl)).dtype
        except Exception:  # an implementation this JAX does not have
            continue
        found[dtype.name] = dtype
    return found


def dtype_of(name: str, /) -> Any:
    """The dtype object JAX uses for the spec dtype name ``name`` (numpy's, or a typed PRNG
    key's), or ``None`` when JAX has none. Names are looked up, never parsed into new dtypes.

    >>> dtype_of("float32"), dtype_of("key<fry>"), dtype_of("qint8")
    (dtype('float32'), key<fry>, None)
    """
    key = _key_dtypes().get(name)
    if key is not None:
        return key
    if not is_dtype_name(name):
        return None
    try:
        return jnp.dtype(name)
    except TypeError:
        return None


def jax_dtype(name: str, /) -> str | None:
    """The dtype JAX computes an array of dtype ``name`` in, under the current 64-bit mode.

    ``None`` when JAX has no such dtype. With the 64-bit mode off, ``jax_dtype("int64")`` is
    ``"int32"``; a typed PRNG key stays itself.
    """
    if name in _key_dtypes():
        return name
    return _jax_dtype(name, x64_enabled())


@functools.cache
def _jax_dtype(name: str, x64: bool) -> str | None:
    del x64  # part of the cache key: the answer depends on the mode
    dtype = dtype_of(name)
    if dtype is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX's "will be truncated" warning: we answer instead
        try:
            # As an input is traced (a ShapeDtypeStruct; arrays are canonicalized alike): by the
            # 64-bit mode alone. An explicit dtype (jnp.zeros(n, dtype)) follows
            # jax_explicit_x64_dtypes too, which keeps float64 with the mode off ('allow') where
            # an input is still narrowed to float32.
            made = jax.eval_shape(lambda x: x, jax.ShapeDtypeStruct((0,), dtype))
            jax.eval_shape(lambda: jnp.zeros((0,), made.dtype))  # refuses what JAX cannot hold
        except TypeError:  # "JAX only supports number, bool, and string dtypes"
            return None
    return str(made.dtype.name)


def refuse_narrowed_inputs(name: str, paths: Sequence[str], leaves: Sequence[LeafSpec]) -> None:
    """Raise naming the first input whose dtype JAX would narrow or cannot hold."""
    for path, leaf in zip(paths, leaves, strict=True):
        dtype = leaf.dtype or ""
        computed = jax_dtype(dtype)
        if computed is None:
            raise DualgraphError(
                f"graphed({name}): {path} is {leaf}, a dtype JAX cannot compute in; convert it "
                "(e.g. to float32 or int32) before the call"
            )
        if computed != dtype:
            why = "JAX's 64-bit mode is off, so " if not x64_enabled() else ""
            raise DualgraphError(
                f"graphed({name}): {path} is {leaf}, but {why}JAX would silently compute it "
                f"as {computed}. Turn the 64-bit mode on (jax.config.update('jax_enable_x64', "
                f"True), or build inside `with jax.enable_x64(True):`) or pass {computed} values"
            )


def weak_types(arrays: Sequence[Any], /) -> tuple[bool, ...]:
    """For each array, whether JAX types it weakly (made from a Python scalar, as
    ``jnp.asarray(2.0)``): ``bfloat16 + weak float32`` is bfloat16, ``+ float32`` is float32.
    numpy arrays are never weak.

    >>> weak_types([jnp.asarray(2.0), jnp.float32(2.0)])
    (True, False)
    """
    return tuple(bool(getattr(x, "weak_type", False)) for x in arrays)


def weak_type_error(
    paths: Sequence[str], leaves: Sequence[LeafSpec], expected: Sequence[bool], got: Sequence[bool]
) -> SpecMismatchError:
    """The error naming the first input weakly typed where its sample was not, or the reverse."""
    i = next(i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g)
    want, have = ("weakly", "strongly") if expected[i] else ("strongly", "weakly")
    fix = (
        "pass a weakly typed value (e.g. jnp.asarray of a Python scalar) or compile from a "
        "strongly typed sample"
        if expected[i]
        else f"pass jnp.asarray(x, {leaves[i].dtype}) or compile from a weakly typed sample"
    )
    return SpecMismatchError(
        f"{paths[i]}: expected a {want} typed {leaves[i]}, got a {have} typed one (weak types come "
        "from Python scalars, and JAX promotes them differently: here the function computes "
        "otherwise, or returns outputs typed otherwise, than the program compiled for the "
        f"sample): {fix}",
        path=paths[i],
    )
