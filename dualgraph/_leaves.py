"""Which Python objects are leaves of a tree, and how array leaves are described.

The core knows numpy arrays. Framework adapters register their array types here; when the
core meets an object from an unregistered ``torch`` or ``jax`` module it imports the matching
adapter's registration, so ``import dualgraph`` never imports a framework itself.
"""

from __future__ import annotations

import collections
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dtypes import is_differentiable_dtype
from ._errors import DualgraphError

__all__ = [
    "CONSTANT_TYPES",
    "ArrayType",
    "array_type_of",
    "register_array_type",
    "same_float",
    "signature_of",
    "strict_bool",
]

#: Python scalar types kept by value in a spec. ``bool`` is listed before ``int`` on purpose.
CONSTANT_TYPES: tuple[type, ...] = (bool, int, float, str)

Signature = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class ArrayType:
    """How to read an array leaf: its ``(shape, dtype name)`` and whether it carries a gradient."""

    signature: Callable[[Any], Signature]
    requires_grad: Callable[[Any], bool]


_REGISTERED: dict[type, ArrayType] = {}
# Types a spec reads as something else than an array, whatever is registered.
_BUILTIN_KINDS: dict[type, str] = {
    **{cls: "a constant" for cls in CONSTANT_TYPES},
    type(None): "None",
    **{cls: "a container" for cls in (tuple, list, dict, collections.OrderedDict)},
}
_RESOLVED: dict[type, ArrayType | None] = {}
# Root module of a framework's array type -> the dualgraph module that registers it.
_LAZY_REGISTRATIONS = {
    "torch": "dualgraph.torch._leaves",
    "jax": "dualgraph.jax._leaves",
    "jaxlib": "dualgraph.jax._leaves",
}


def register_array_type(
    cls: type,
    /,
    *,
    signature: Callable[[Any], Signature],
    requires_grad: Callable[[Any], bool],
) -> None:
    """Teach the core a new array type (subclasses included).

    ``signature(x)`` returns ``(shape tuple, neutral dtype name)``, e.g. ``((2, 3), "float32")``;
    ``requires_grad(x)`` says whether the leaf takes part in backward.

    >>> import numpy as np
    >>> register_array_type(np.ndarray, signature=_numpy_signature, requires_grad=_numpy_grad)
    """
    if not isinstance(cls, type):
        raise DualgraphError(
            f"register_array_type expects a class, got an object of type {type(cls).__qualname__}"
        )
    builtin = _BUILTIN_KINDS.get(cls)
    if builtin is None:
        from ._containers import container_kind  # (it imports this module)

        # describe takes a container first, check an array's place by its signature: never both
        kind = container_kind(cls)
        if kind is not None:
            builtin = f"a {kind.tag} class, a container"
    if builtin is not None:
        raise DualgraphError(
            f"register_array_type: {cls.__qualname__} is {builtin} in a spec, never an array"
        )
    for name, function in (("signature", signature), ("requires_grad", requires_grad)):
        if not callable(function):
            raise DualgraphError(
                f"register_array_type({cls.__qualname__}): {name} must be callable, "
                f"got an object of type {type(function).__qualname__}"
            )
    _REGISTERED[cls] = ArrayType(signature=signature, requires_grad=requires_grad)
    _RESOLVED.clear()


def array_type_of(cls: type, /) -> ArrayType | None:
    """The registered :class:`ArrayType` for ``cls`` (or a base of it), else ``None``.

    >>> import numpy as np
    >>> array_type_of(np.ndarray) is not None, array_type_of(set)
    (True, None)
    """
    try:
        return _RESOLVED[cls]
    except KeyError:
        pass
    found = _lookup(cls)
    if found is None:
        module = _LAZY_REGISTRATIONS.get(cls.__module__.partition(".")[0])
        if module is not None:
            try:
                importlib.import_module(module)
            except ImportError:  # the adapter's own dependencies are missing: not an array
                pass
            else:
                found = _lookup(cls)
    _RESOLVED[cls] = found
    return found


_NUMPY_DTYPE_NAMES: dict[np.dtype, str] = {}


def signature_of(leaf: Any, /) -> Signature | None:
    """``(shape, dtype name)`` of an array leaf, or ``None`` if ``leaf`` is not an array.

    >>> signature_of(np.zeros((2, 3), np.int64)), signature_of("x")
    (((2, 3), 'int64'), None)
    """
    cls = type(leaf)
    if cls is np.ndarray:  # numpy's dtype.name is slow: cache it per dtype
        dtype = leaf.dtype
        name = _NUMPY_DTYPE_NAMES.get(dtype)
        if name is None:
            name = _NUMPY_DTYPE_NAMES[dtype] = dtype.name
        return leaf.shape, name
    array_type = _RESOLVED[cls] if cls in _RESOLVED else array_type_of(cls)
    return None if array_type is None else array_type.signature(leaf)


def strict_bool(value: Any, /) -> bool | None:
    """``value`` as a bool if it is one (or a 0-d boolean array: numpy, torch, jax), else
    ``None``: nothing is coerced (``bool("False")`` is True).

    >>> strict_bool(np.bool_(False)), strict_bool("False"), strict_bool(1)
    (False, None, None)
    """
    if isinstance(value, bool):
        return value
    dtype = getattr(value, "dtype", None)
    if dtype is None or str(dtype) not in {"bool", "torch.bool"}:
        return None
    try:
        if tuple(value.shape) != ():
            return None
        return bool(value)
    except Exception:  # an object that only looks like an array
        return None


def same_float(found: Any, expected: float, /) -> bool:
    """Whether ``found`` is a Python float equal to ``expected``: NaN matches NaN, -0.0 not 0.0.

    >>> same_float(float("nan"), float("nan")), same_float(-0.0, 0.0), same_float(1, 1.0)
    (True, False, False)
    """
    if type(found) is not float:
        return False
    if found != found:
        return expected != expected
    return found == expected and math.copysign(1.0, found) == math.copysign(1.0, expected)


def _lookup(cls: type) -> ArrayType | None:
    for base in cls.__mro__:
        if base in _REGISTERED:
            return _REGISTERED[base]
    for registered, array_type in _REGISTERED.items():
        if issubclass(cls, registered):  # abstract bases such as jax.Array
            return array_type
    return None


def _numpy_signature(x: np.ndarray) -> Signature:
    return x.shape, x.dtype.name


def _numpy_grad(x: np.ndarray) -> bool:
    return is_differentiable_dtype(x.dtype.name)


def numpy_is_native() -> bool:
    """Whether numpy arrays are described as the core does by default (so it may read them
    directly, without the registered functions)."""
    array_type = array_type_of(np.ndarray)
    return (
        array_type is not None
        and array_type.signature is _numpy_signature
        and array_type.requires_grad is _numpy_grad
    )


# Registered directly: register_array_type reads the container kinds, which import this module.
_REGISTERED[np.ndarray] = ArrayType(signature=_numpy_signature, requires_grad=_numpy_grad)
