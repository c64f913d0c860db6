"""Which Python objects are leaves of a tree, and how array leaves are described.

The core knows numpy arrays. Framework adapters register their array types here; when the
core meets an object from an unregistered ``torch`` or ``jax`` module it imports the matching
adapter's registration, so ``import dualgraph`` never imports a framework itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dtypes import is_differentiable_dtype

__all__ = [
    "CONSTANT_TYPES",
    "ArrayType",
    "array_type_of",
    "register_array_type",
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


register_array_type(np.ndarray, signature=_numpy_signature, requires_grad=_numpy_grad)
