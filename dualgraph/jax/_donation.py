"""Buffer donation: which donated inputs an output can reuse, and the checks made before a call.

A donated input plays the part of a CUDA graph's static input buffer: the call consumes it, and
XLA may write an output of the same shape and dtype into it. dualgraph makes the contract the same
whatever XLA decides: every donated JAX array is deleted after the call, a donation no output can
reuse is reported once at compile time (:class:`~dualgraph.DualgraphWarning`, in place of JAX's
generic warning), and a donated buffer that is also passed elsewhere in the same call, whole or
in part (overlapping views of one allocation), is refused before anything is consumed.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

from .._errors import DualgraphError, DualgraphWarning
from .._nodes import clip
from .._spec import LeafSpec, TreeSpec
from ._dtypes import dtype_of
from ._leaves import TRACER_TYPE

__all__ = [
    "check_donated_inputs",
    "default_device",
    "delete_donated",
    "donated_argnums",
    "donated_leaves",
    "explain_failed_call",
    "jax_donation_warnings",
    "unusable_donations",
    "warn_unusable",
]

_JAX_DONATION_WARNING = "Some donated buffers were not usable"


def donated_argnums(donate_argnums: Any, args_spec: TreeSpec, num_args: int) -> tuple[int, ...]:
    """The positional args to donate, from an int-like or a sequence of them; sorted, unique.

    Anything :func:`operator.index` accepts is an index (``np.int64(0)`` too, not ``True``);
    negative indices count from the end, as in :func:`jax.jit`. ``None`` donates nothing.

    >>> import numpy as np
    >>> from dualgraph import describe
    >>> spec = describe((np.ones(2), np.ones(2)))
    >>> donated_argnums(np.int64(-1), spec, 2), donated_argnums([1, 0, 1], spec, 2)
    ((1,), (0, 1))
    """
    holding_arrays = {_top_index(path) for path in args_spec.array_paths}
    result = set()
    for number in _argnum_list(donate_argnums):
        if not -num_args <= number < num_args:
            raise DualgraphError(
                f"donate_argnums: {clip(number)} is not the index of one of the {num_args} "
                "positional sample args"
            )
        index = number % num_args
        if index not in holding_arrays:
            raise DualgraphError(
                f"donate_argnums: args[{index}] holds no array (constants and None are compiled "
                "in); only arrays can be donated"
            )
        result.add(index)
    return tuple(sorted(result))


def donated_leaves(args_spec: TreeSpec, argnums: Sequence[int]) -> tuple[int, ...]:
    """The positions, among the flat input arrays, of the arrays inside the donated args."""
    return tuple(i for i, path in enumerate(args_spec.array_paths) if _top_index(path) in argnums)


def _argnum_list(donate_argnums: Any) -> list[int]:
    if donate_argnums is None:
        return []
    if not isinstance(donate_argnums, (str, bytes, bool, Mapping)):
        try:
            return [operator.index(donate_argnums)]
        except TypeError:
            pass
        try:
            items = list(donate_argnums)
        except TypeError:
            pass
        else:
            return [_argnum(item) for item in items]
    raise DualgraphError(
        f"donate_argnums: expected an int or a sequence of ints, got {clip(donate_argnums)} "
        f"({type(donate_argnums).__name__})"
    )


def _argnum(item: Any) -> int:
    if not isinstance(item, (bool, str, bytes)):
        try:
            return operator.index(item)
        except TypeError:
            pass
    raise DualgraphError(
        f"donate_argnums: {clip(item)} ({type(item).__name__}) is not an integer index of a "
        "positional arg"
    )


def _top_index(path: str) -> int:
    """The positional argument an args leaf belongs to: ``"[1]['w']"`` -> 1."""
    return int(path[1 : path.index("]")])


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
    dtype = dtype_of(leaf.dtype or "")
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys
        return leaf.shape, leaf.dtype
    return leaf.shape, jax.dtypes.canonicalize_dtype(dtype)


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
    """Refuse a call, before anything is consumed, whose donated inputs cannot be donated.

    A donated buffer is refused where another input shares any of its bytes: the same array, or
    views of one allocation that overlap (DLPack of ``t[0:32]`` and ``t[16:48]``). Each buffer
    is taken as the bytes from its pointer to its ``nbytes`` later (JAX arrays are dense).
    """
    extents: list[tuple[int, int] | None] | None = None
    for i in donated:
        x = arrays[i]
        if not isinstance(x, jax.Array):
            continue  # a numpy array is copied to the device: nothing of the caller's is consumed
        if x.is_deleted():
            raise DualgraphError(
                f"{paths[i]}: this array has been deleted (it was donated to an earlier call, "
                "which consumed it); pass a fresh array"
            )
        if extents is None:
            extents = [_extent(y) for y in arrays]
        start, end = extents[i] or (0, 0)  # (0, 0) overlaps nothing
        for j, other in enumerate(extents):
            if j == i or not (
                arrays[j] is x or (other is not None and other[0] < end and start < other[1])
            ):
                continue
            shared = "the same buffer is" if other == extents[i] else "part of its buffer is"
            raise DualgraphError(
                f"{paths[i]} is donated, but {shared} also passed as {paths[j]}: the call "
                "consumes a donated buffer, so the other use would read freed or overwritten "
                "memory. Pass a copy of one of them (jnp.copy(x))."
            )


def _extent(x: Any) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` a JAX array's buffer occupies; ``None`` where unknown or empty
    (an empty array holds no bytes to share, and CUDA puts every empty one at 0)."""
    start = _buffer_pointer(x)
    if start is None:
        return None
    size = x.size
    return (start, start + size * x.dtype.itemsize) if size else None  # x.nbytes, for less


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


def explain_failed_call(
    error: Exception,
    arrays: Sequence[Any],
    paths: Sequence[str],
    device: Any,
    donated: Sequence[int] = (),
) -> Exception:
    """A clearer error for a failed call, naming the input's path: one that had been deleted, or
    one on another device than ``device``, the one the programs were compiled for; else
    ``error`` itself. A ``donated`` input was checked before the call: deleted now, the failed
    call consumed it, which explains nothing."""
    for i, (x, path) in enumerate(zip(arrays, paths, strict=True)):
        if i in donated:
            continue
        if isinstance(x, jax.Array) and not isinstance(x, TRACER_TYPE) and x.is_deleted():
            return DualgraphError(
                f"{path}: this array has been deleted (donated to an earlier call, or deleted "
                "explicitly); pass a fresh array"
            )
    if isinstance(error, ValueError) and "sharding" in str(error):
        for x, path in zip(arrays, paths, strict=True):
            if isinstance(x, jax.Array) and not isinstance(x, TRACER_TYPE):
                devices = x.devices()
                if devices != {device}:
                    where = ", ".join(sorted(map(str, devices)))
                    return DualgraphError(
                        f"{path}: an array on {where}, but graphed programs are compiled for "
                        f"JAX's default device when graphed, {device}; put the inputs there "
                        "(jax.device_put), or graph with that device as the default "
                        "(jax.default_device)"
                    )
                kind, expected = _memory_kinds(x, device)
                if kind is not None and expected is not None and kind != expected:
                    # JAX's own error names the flat index of the inputs, not the path
                    return DualgraphError(
                        f"{path}: an array in {device}'s {kind!r} memory, but graphed programs "
                        f"take their inputs in its default memory, {expected!r}; put it there "
                        "(jax.device_put(x, jax.sharding.SingleDeviceSharding(device, "
                        f"memory_kind={expected!r})))"
                    )
    return error


def _memory_kinds(x: jax.Array, device: Any) -> tuple[str | None, str | None]:
    """The memory kind ``x`` is in, and ``device``'s default one (``None`` where unknown)."""
    try:
        return x.sharding.memory_kind, device.default_memory().kind
    except Exception:  # a backend without memory kinds
        return None, None


def default_device() -> Any:
    """The device JAX compiles for when nothing says otherwise (``jax.default_device``)."""
    chosen = getattr(jax.config, "jax_default_device", None)
    if isinstance(chosen, str):
        return jax.devices(chosen)[0]
    return chosen if chosen is not None else jax.devices()[0]
