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

from typing import Any

import jax

from .._dtypes import is_differentiable_dtype
from .._leaves import register_array_type

__all__ = ["TRACER_TYPE", "jax_signature"]


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
