"""Specs derived from other specs: shapes for ``jax.jit``'s lowering, cotangent and grad trees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from .._errors import DualgraphError
from .._spec import LeafSpec, TreeSpec, describe
from ._dtypes import dtype_of

__all__ = ["keep_arrays", "struct_of"]


def struct_of(
    leaf: LeafSpec, sharding: Any = None, *, weak_type: bool = False
) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of an array leaf of a spec (typed PRNG keys included);
    ``weak_type`` for an input that came from a Python scalar (JAX promotes those differently)."""
    dtype = dtype_of(leaf.dtype or "")
    if dtype is None:
        raise DualgraphError(f"{leaf.path or '<root>'}: JAX has no dtype {leaf.dtype}")
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding, weak_type=weak_type)


def keep_arrays(spec: TreeSpec, keep: Sequence[bool], /, *, root: str = "") -> TreeSpec:
    """``spec`` with ``None`` at its constants and at the array leaves where ``keep`` is False.

    ``keep`` has one bool per array leaf, in flatten order. The result describes the trees of
    cotangents (kept: the grad mask) and of gradients (kept: the differentiable inputs).
    ``root`` prefixes the paths of an error (a class that refuses the ``None`` it is given).

    >>> import numpy as np
    >>> spec = describe((np.zeros(2, np.float32), np.zeros(2, np.int32), 3))
    >>> keep_arrays(spec, [True, False])
    TreeSpec((float32[2](grad), None, None))
    """
    # Rebuilt by the spec, never by optree's tree_map: that calls a namedtuple class bare, whose
    # __new__ may change the None it is given where a constant was, silently.
    stand_ins = [struct_of(leaf) for leaf, k in zip(spec.arrays, keep, strict=True) if k]
    return describe(spec.with_arrays_kept(keep).unflatten(stand_ins, root=root))
