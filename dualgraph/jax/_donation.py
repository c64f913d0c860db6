"""Buffer donation: which donated inputs an output can reuse, and the checks made before a call.

A donated input plays the part of a CUDA graph's static input buffer: the call consumes it, and
XLA may write an output of the same shape and dtype into it. dualgraph makes the contract the same
whatever XLA decides: every donated JAX array is deleted after the call, a donation no output can
reuse is reported once at compile time (:class:`~dualgraph.DualgraphWarning`, in place of JAX's
generic warning), and a donated buffer that is also passed elsewhere in the same call is refused
before anything is consumed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from .._errors import DualgraphError, DualgraphWarning
from .._spec import LeafSpec

__all__ = [
    "check_donated_inputs",
    "delete_donated",
    "explain_failed_call",
    "jax_donation_warnings",
    "unusable_donations",
    "warn_unusable",
]

_JAX_DONATION_WARNING = "Some donated buffers were not usable"


def unusable_donations(
    inputs: Sequence[LeafSpec], donated: Sequence[int], outputs: Sequence[LeafSpec]
) -> list[int]:
    """The donated input positions that no output can reuse.

    Matches donated inputs to outputs of the same shape and (canonical) dtype, first come first
    served, as JAX does when it sets up input-output aliases.
    """
    free: dict[tuple[Any, ...], int] = {}
    for leaf in outputs:
        key = _alias_key(leaf)
        free[key] = free.get(key, 0) + 1
    unusable = []
    for i in donated:
        key = _alias_key(inputs[i])
        if free.get(key, 0):
            free[key] -= 1
        else:
            unusable.append(i)
    return unusable


def _alias_key(leaf: LeafSpec) -> tuple[Any, ...]:
    return leaf.shape, jax.dtypes.canonicalize_dtype(leaf.dtype)


def warn_unusable(
    name: str, unusable: Sequence[int], paths: Sequence[str], inputs: Sequence[LeafSpec]
) -> None:
    """One :class:`DualgraphWarning` naming every donated input no output can reuse."""
    shown = ", ".join(f"{paths[i]} ({inputs[i]})" for i in unusable)
    warnings.warn(
        f"dualgraph.jax.graphed({name}): donated {shown} cannot be reused by any output (no "
        "output is left with the same shape and dtype). The buffer is still consumed (deleted "
        "after each call) but saves no memory: drop it from donate_argnums, or return an array "
        "of that shape and dtype.",
        DualgraphWarning,
        stacklevel=4,
    )


@contextlib.contextmanager
def jax_donation_warnings() -> Iterator[list[str]]:
    """Collect JAX's own "Some donated buffers were not usable" warnings instead of issuing them.

    Other warnings raised inside are issued again, unchanged, when the block ends.
    """
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield seen
    for record in caught:
        if str(record.message).startswith(_JAX_DONATION_WARNING):
            seen.append(str(record.message))
        else:
            warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)


def check_donated_inputs(
    arrays: Sequence[Any], donated: Sequence[int], paths: Sequence[str]
) -> None:
    """Refuse a call, before anything is consumed, whose donated inputs cannot be donated."""
    pointers: list[int | None] | None = None
    for i in donated:
        x = arrays[i]
        if not isinstance(x, jax.Array):
            continue  # a numpy array is copied to the device: nothing of the caller's is consumed
        if x.is_deleted():
            raise DualgraphError(
                f"{paths[i]}: this array has been deleted (it was donated to an earlier call, "
                "which consumed it); pass a fresh array"
            )
        if pointers is None:
            pointers = [_buffer_pointer(y) for y in arrays]
        for j, y in enumerate(arrays):
            if j != i and (y is x or (pointers[i] is not None and pointers[j] == pointers[i])):
                raise DualgraphError(
                    f"{paths[i]} is donated, but the same buffer is also passed as {paths[j]}: "
                    "the call consumes a donated buffer, so the other use would read freed or "
                    "overwritten memory. Pass a copy of one of them (jnp.copy(x))."
                )


def _buffer_pointer(x: Any) -> int | None:
    if not isinstance(x, jax.Array) or x.is_deleted():
        return None
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # sharded over several devices: no single buffer to compare
        return None


def delete_donated(arrays: Sequence[Any], donated: Sequence[int]) -> None:
    """Delete the donated JAX arrays that XLA did not consume itself (it skips unusable ones)."""
    for i in donated:
        x = arrays[i]
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def explain_failed_call(error: Exception, arrays: Sequence[Any], paths: Sequence[str]) -> Exception:
    """A clearer error for a failed call when an input had been deleted; else ``error`` itself."""
    for x, path in zip(arrays, paths, strict=True):
        if isinstance(x, jax.Array) and x.is_deleted():
            return DualgraphError(
                f"{path}: this array has been deleted (donated to an earlier call, or deleted "
                "explicitly); pass a fresh array"
            )
    return error
