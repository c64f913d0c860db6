"""Registers JAX's array types with the core: ``jax.Array``, tracers and ``ShapeDtypeStruct``.

A leaf's signature is its shape and dtype name (``"float32"``, ``"bfloat16"``...); it takes part
in backward when its dtype is floating or complex. Tracers are registered too, so that a spec can
describe what a function returns while :func:`jax.jit` traces it; ``ShapeDtypeStruct`` so that a
spec can be made (and a function compiled) from shapes alone.

>>> import jax.numpy as jnp, dualgraph
>>> dualgraph.describe((jnp.zeros((2, 3), jnp.bfloat16), jnp.arange(3), None))
TreeSpec((bfloat16[2, 3](grad), int32[3], None))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._dtypes import is_differentiable_dtype
from .._errors import DualgraphError
from .._leaves import register_array_type
from ._dtypes import jax_dtype

__all__ = [
    "TRACER_TYPE",
    "in_default_layouts",
    "jax_signature",
    "refuse_foreign_arrays",
    "refuse_foreign_outputs",
]


def _tracer_type() -> type:
    tracer: type | None = getattr(jax.core, "Tracer", None)
    if tracer is None:  # jax.core's public names are being thinned out
        from jax._src.core import Tracer

        tracer = Tracer
    return tracer


#: The base class of JAX tracers (what a traced function sees instead of arrays).
TRACER_TYPE: type = _tracer_type()


def jax_signature(x: Any, /) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` of a JAX array, tracer or ``ShapeDtypeStruct``.

    >>> jax_signature(jax.ShapeDtypeStruct((2, 3), "bfloat16"))
    ((2, 3), 'bfloat16')
    """
    return tuple(x.shape), x.dtype.name


def _requires_grad(x: Any) -> bool:
    return is_differentiable_dtype(x.dtype.name)


for _cls in (jax.Array, TRACER_TYPE, jax.ShapeDtypeStruct):
    register_array_type(_cls, signature=jax_signature, requires_grad=_requires_grad)


# Array classes already seen to be JAX arrays (``isinstance(x, jax.Array)`` is an ABC test).
_JAX_ARRAY_TYPES: set[type] = set()


def refuse_foreign_arrays(where: str, leaves: Iterable[tuple[str, Any]], /) -> None:
    """Raise naming the first ``(path, array)`` JAX would not take as it is.

    A spec compares shapes and dtype names only, so a torch tensor, a numpy masked array (JAX
    refuses its mask) or a numpy array in non-native byte order passes a spec check; JAX then
    fails on it with an error that names no path.

    >>> refuse_foreign_arrays("g", [("args[0]", np.ones(2, ">f4"))])
    Traceback (most recent call last):
    ...
    dualgraph.DualgraphError: g: args[0] is a numpy array in non-native byte order (>f4): ...
    """
    for path, x in leaves:
        problem = _foreign_problem(x)
        if problem is not None:
            raise DualgraphError(f"{where}: {path} is {problem}")


def refuse_foreign_outputs(where: str, leaves: Iterable[tuple[str, Any]], /) -> None:
    """Raise naming the first ``(path, array)`` a traced function returns that the compiled
    program would not return as it is: anything :func:`refuse_foreign_arrays` refuses, and a
    numpy array of a dtype JAX cannot hold or would narrow (JAX converts a numpy array returned
    from a traced function: with its 64-bit mode off, ``np.int64(2**40 + 5)`` comes back as
    ``int32`` 5).

    >>> refuse_foreign_outputs("g", [("output[0]", np.ones(2, np.float32))])
    """
    for path, x in leaves:
        if isinstance(x, TRACER_TYPE):
            continue
        problem = _foreign_problem(x)
        if problem is None and isinstance(x, np.ndarray):
            name = x.dtype.name
            computed = jax_dtype(name)
            shown = f"{name}[{', '.join(map(str, x.shape))}]"
            if computed is None:
                problem = f"a numpy array of {shown}, a dtype JAX cannot hold"
            elif computed != name:
                problem = (
                    f"a numpy array of {shown}, which JAX would silently return as {computed} "
                    "because its 64-bit mode is off: turn it on (jax.enable_x64) when "
                    f"graphing, or return {computed} values"
                )
        if problem is not None:
            raise DualgraphError(
                f"{where}: {path} is {problem} (the function returns it, the compiled program "
                "could not return it as it is)"
            )


def in_default_layouts(error: Exception, arrays: Sequence[Any], /) -> list[Any] | None:
    """``arrays`` with each JAX array copied (into JAX's default memory layout) when ``error`` is
    a compiled program refusing an input's layout, else ``None``.

    An array made by DLPack from a transposed torch tensor keeps the tensor's strides as its
    layout: :func:`jax.jit` takes it, an ahead-of-time compiled program refuses it with a
    ``ValueError`` naming ``arrays[0]``. The copies have the same values, dtype, weak type and
    device. Only a failed call takes this path, so calls pay nothing for it.
    """
    if not isinstance(error, ValueError) or "layout" not in str(error):
        return None
    return [
        jnp.array(x, copy=True)
        if isinstance(x, jax.Array) and not isinstance(x, TRACER_TYPE) and not x.is_deleted()
        else x
        for x in arrays
    ]


def _foreign_problem(x: Any) -> str | None:
    """Why JAX would not take the array ``x`` as it is, or ``None`` when it would."""
    cls = type(x)
    if cls is np.ndarray:
        if x.dtype.isnative:
            return None
        return (
            f"a numpy array in non-native byte order ({x.dtype.str}): JAX does not take "
            "it; pass x.astype(x.dtype.newbyteorder('='))"
        )
    if cls in _JAX_ARRAY_TYPES:
        return None
    if isinstance(x, jax.Array):
        _JAX_ARRAY_TYPES.add(cls)
        return None
    if isinstance(x, np.ma.MaskedArray):
        return (
            "a numpy masked array: JAX does not take its mask; pass x.filled(value) or "
            "np.asarray(x)"
        )
    if isinstance(x, np.ndarray):
        if x.dtype.isnative:
            return None
        return f"a numpy array in non-native byte order ({x.dtype.str})"
    return (
        f"a {cls.__module__}.{cls.__qualname__}, not a JAX or numpy array (same shape "
        "and dtype, but JAX cannot take it)"
    )
