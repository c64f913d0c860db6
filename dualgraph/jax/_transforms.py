"""Calls made from inside a JAX transformation, where arrays are tracers: named for what they are.

A :class:`~dualgraph.jax.GraphedCallable` is compiled ahead of time for concrete arrays, so it
cannot run under :func:`jax.jit`, :func:`jax.vmap`, :func:`jax.grad` or any other transformation.
Left to itself such a call fails wherever the tracer first meets code that needs a value (a shape
check, ``is_deleted()``, the compiled executable); :func:`tracer_error` says what really happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import optree

from .._containers import NAMESPACE
from .._errors import DualgraphError
from ._leaves import TRACER_TYPE

__all__ = ["call_leaves", "leaves_with_paths", "tracer_error"]

# The tracer classes of the common transformations, by class name (their modules are private).
_TRANSFORMATIONS = {
    "DynamicJaxprTracer": "jax.jit (or another staging transformation: scan, cond, checkpoint...)",
    "BatchTracer": "jax.vmap",
    "JVPTracer": "jax.jvp / jax.jacfwd",
    "LinearizeTracer": "jax.grad / jax.vjp / jax.linearize",
}


def leaves_with_paths(tree: Any, root: str) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of ``tree``, paths starting at ``root`` (for error paths).

    >>> list(leaves_with_paths(({"x": 1}, None), "args"))
    [("args[0]['x']", 1), ('args[1]', None)]
    """
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        tree, none_is_leaf=True, namespace=NAMESPACE
    )
    for accessor, leaf in zip(accessors, leaves, strict=True):
        yield accessor.codify(root), leaf


def call_leaves(args: Any, kwargs: Any) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of a call's args and kwargs."""
    yield from leaves_with_paths(args, "args")
    yield from leaves_with_paths(kwargs, "kwargs")


def tracer_error(where: str, leaves: Iterable[tuple[str, Any]]) -> DualgraphError | None:
    """The error for a call whose ``(path, leaf)`` pairs hold a tracer; ``None`` if none do.

    ``where`` names the callable in the message, e.g. ``graphed(layer)``.
    """
    try:
        found = next(((path, x) for path, x in leaves if isinstance(x, TRACER_TYPE)), None)
    except Exception:  # leaves that cannot even be listed (a tree that contains itself): no tracer
        return None
    if found is None:
        return None
    path, tracer = found
    kind = type(tracer).__name__
    transformation = _TRANSFORMATIONS.get(kind, "a JAX transformation")
    return DualgraphError(
        f"{where}: {path} is a JAX tracer ({kind}, from {transformation}), not an "
        "array: this callable is compiled ahead of time for concrete arrays and cannot be "
        "called inside jax.jit, jax.vmap, jax.grad or another transformation. Call the plain "
        "function (its .fn) inside the transformation, or call this one outside it (its "
        ".vjp gives gradients)"
    )
