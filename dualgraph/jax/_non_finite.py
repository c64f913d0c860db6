"""The error a graphed call raises where JAX's ``jax_debug_nans`` (``jax_debug_infs``) finds a
NaN (an inf) in what the program returns.

Eager JAX, and :func:`jax.jit`, raise :class:`FloatingPointError` then. A compiled program's
check raises JAX's private ``InternalFloatingPointError`` instead, which names no output and
which :func:`jax.jit` alone turns into the public error (by running the function again op by
op). :func:`non_finite_error` turns it into a :class:`NonFiniteError`, a ``FloatingPointError``
that says where to look.
"""

from __future__ import annotations

from .._errors import DualgraphError

__all__ = ["NonFiniteError", "non_finite_error"]


class NonFiniteError(DualgraphError, FloatingPointError):
    """A graphed program returned a NaN (or an inf) while ``jax_debug_nans`` (``jax_debug_infs``)
    is on; eager JAX raises :class:`FloatingPointError` there, and so does this."""


NonFiniteError.__module__ = "dualgraph.jax"  # printed as users import it


def non_finite_error(error: BaseException, where: str, /) -> NonFiniteError | None:
    """The :class:`NonFiniteError` for JAX's internal NaN/inf check failing in ``where``, or
    ``None`` when ``error`` is something else."""
    if type(error).__name__ != "InternalFloatingPointError":  # private to JAX, found by name
        return None
    kind = getattr(error, "ty", "nan")
    found, flag = ("an inf", "jax_debug_infs") if kind == "inf" else ("a NaN", "jax_debug_nans")
    return NonFiniteError(
        f"{where}: the compiled program returned {found} while {flag} is on (eager JAX would "
        "raise FloatingPointError at the operation that made it). Call the function itself "
        "(its .fn) under the same setting to find that operation"
    )
