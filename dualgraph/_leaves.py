"""Which Python objects are leaves of a tree, and how array leaves are described.

The core knows numpy arrays. Framework adapters register their array types here; when the
core meets an object from an unregistered ``torch`` or ``jax`` module it imports the matching
adapter's registration, so ``import dualgraph`` never imports a framework itself (nor does an
object whose class only names a framework the program did not import).
"""

from __future__ import annotations

import collections
import importlib
import math
import re
import struct
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dtypes import is_differentiable_dtype
from ._errors import DualgraphError

__all__ = [
    "CONSTANT_TYPES",
    "MAX_INT_BITS",
    "ArrayType",
    "array_type_of",
    "float_of_text",
    "float_text",
    "int_size",
    "numpy_dtype_name",
    "refusal_of",
    "refuse_leaf_type",
    "register_array_type",
    "same_float",
    "signature_of",
    "strict_bool",
]

#: Python scalar types kept by value in a spec. ``bool`` is listed before ``int`` on purpose.
CONSTANT_TYPES: tuple[type, ...] = (bool, int, float, str)

#: The most bits of an ``int`` constant or key, so that it prints and serializes everywhere:
#: under 640 decimal digits, the lowest limit ``sys.set_int_max_str_digits`` takes.
MAX_INT_BITS = 2048


def int_size(value: int, /) -> str:
    """An int by its size, for messages about one too long to print (see ``MAX_INT_BITS``).

    >>> int_size(2**5000)
    'an int of 5001 bits'
    """
    return f"an int of {value.bit_length()} bits"


Signature = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class ArrayType:
    """How to read an array leaf: its ``(shape, dtype name)`` and whether it carries a gradient."""

    signature: Callable[[Any], Signature]
    requires_grad: Callable[[Any], bool]


# The registries are keyed by id(cls) and hold (cls, value): a class's metaclass may define
# __eq__ and __hash__ (typing_extensions.Protocol's does), and a lookup by such a class could
# find an equal class's entry. Each entry keeps its class alive, so its id stays unique.
_REGISTERED: dict[int, tuple[type, ArrayType]] = {}
# Types a spec reads as something else than an array, whatever is registered.
_BUILTIN_KINDS: dict[int, str] = {
    **{id(cls): "a constant" for cls in CONSTANT_TYPES},
    id(type(None)): "None",
    **{id(cls): "a container" for cls in (tuple, list, dict, collections.OrderedDict)},
}
_BUILTIN_CLASSES: dict[int, tuple[type, str]] = {
    id(cls): (cls, _BUILTIN_KINDS[id(cls)])
    for cls in (*CONSTANT_TYPES, type(None), tuple, list, dict, collections.OrderedDict)
}
_RESOLVED: dict[int, ArrayType | None] = {}  # by id(cls): the hot path reads it
# Types an adapter says can never be leaves, with why (see refuse_leaf_type).
_REFUSED: dict[int, tuple[type, str]] = {}
# The ids of the classes _RESOLVED has met. A class's entries go with it (a finalizer, which
# runs before its id can be another object's): every class ever looked up (a class made per
# call, met in a message) would otherwise stay alive for good. A class that cannot be weakly
# referenced is held instead (its id then stays its own).
_WATCHED: dict[int, type | None] = {}
#: How many registrations were made: a lookup caches its answer only if none came meanwhile.
_generation = 0
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
    ``requires_grad(x)`` says whether the leaf takes part in backward. ``numpy.ndarray`` may be
    registered again (to change ``requires_grad``), but a spec reads a numpy array's own shape
    and dtype name: a signature giving anything else is refused when a tree is described.

    >>> import numpy as np
    >>> register_array_type(np.ndarray, signature=_numpy_signature, requires_grad=_numpy_grad)
    """
    if not issubclass(type(cls), type):  # by its type: isinstance reads a __class__ that may fail
        raise DualgraphError(
            f"register_array_type expects a class, got an object of type {type(cls).__qualname__}"
        )
    builtin = _BUILTIN_KINDS.get(id(cls))
    if builtin is None:
        try:
            builtin = _kind_below(cls)
        except Exception as error:  # a metaclass's __subclasscheck__ (it runs on every lookup)
            from ._nodes import clip_text

            raise DualgraphError(
                f"register_array_type: testing which classes {cls.__qualname__} is a base of "
                f"raised {type(error).__name__}: {clip_text(error)}"
            ) from None
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
    global _generation
    _REGISTERED[id(cls)] = (cls, ArrayType(signature=signature, requires_grad=requires_grad))
    _generation += 1  # before the cache is cleared: see array_type_of
    _RESOLVED.clear()


def _kind_below(cls: type) -> str | None:
    """What else than an array a spec reads ``cls`` or a class below it as (a builtin constant
    or container, a user container), for :func:`register_array_type`; ``None`` if nothing.

    describe takes a constant or a container first, check an array's place by its signature:
    a registered base of ``int`` (``numbers.Number``) or ``tuple`` (``collections.abc.Sequence``,
    ``object``) made check take ``3`` or ``(1.0, 2.0)`` at an array's place.
    """
    from ._containers import container_kind, container_subclasses  # (they import this module)
    from ._nodes import class_name

    for ident, (builtin, what) in _BUILTIN_CLASSES.items():
        if ident != id(cls) and issubclass(builtin, cls):
            return f"the base of {builtin.__qualname__}, which is {what}"
    kind = container_kind(cls)
    if kind is not None:
        return f"a {kind.tag} class, a container"
    for subclass, kind in container_subclasses(cls):  # they would be array types too
        return f"the base of {class_name(subclass)}, which is a {kind.tag} class, a container"
    return None


def refuse_leaf_type(cls: type, /, reason: str) -> None:
    """Say why ``cls`` (subclasses included) is no leaf, in place of the usual advice to register
    it: an adapter's type that no registration could make a sound leaf.

    >>> import torch, dualgraph.torch  # doctest: +SKIP
    >>> refusal_of(torch.Generator)[:44]  # doctest: +SKIP
    "A torch.Generator can't be an input or output"
    """
    _REFUSED[id(cls)] = (cls, reason)


def refusal_of(cls: type, /) -> str | None:
    """The reason :func:`refuse_leaf_type` gave for ``cls`` or a base of it, else ``None``
    (read only when a leaf is refused: never on the hot path).

    >>> refusal_of(set) is None
    True
    """
    for base in cls.__mro__:
        entry = _REFUSED.get(id(base))
        if entry is not None:
            return entry[1]
    return None


def array_type_of(cls: type, /) -> ArrayType | None:
    """The registered :class:`ArrayType` for ``cls`` (or a base of it), else ``None``.

    >>> import numpy as np
    >>> array_type_of(np.ndarray) is not None, array_type_of(set)
    (True, None)
    """
    try:
        return _RESOLVED[id(cls)]
    except KeyError:
        pass
    generation = _generation
    found = _lookup(cls)
    if found is None:
        # The class or a base of it (a user's subclass of torch.Tensor) is a framework's.
        for module in _lazy_registrations(cls):
            try:
                importlib.import_module(module)
            except ImportError:  # the adapter's own dependencies are missing: not an array
                continue
            found = _lookup(cls)
            if found is not None:
                break
    _watch(cls)  # first: an id is only a key while its class lives
    _RESOLVED[id(cls)] = found
    if generation != _generation:
        # A registration came while this lookup ran (another thread's, or one the lookup's
        # imports made) and may have cleared the cache before the answer was put there: the
        # answer may be stale, and cached it would hide the registration for good.
        _RESOLVED.pop(id(cls), None)
        return _lookup(cls)
    return found


def _watch(cls: type) -> None:
    """Forget ``cls``'s entries when it goes (see :data:`_WATCHED`)."""
    ident = id(cls)
    if ident in _WATCHED:
        return
    try:
        weakref.finalize(cls, _forget, ident).atexit = False
    except TypeError:  # no weak references to it: keep it alive
        _WATCHED[ident] = cls
    else:
        _WATCHED[ident] = None


def _forget(ident: int) -> None:
    _RESOLVED.pop(ident, None)
    _WATCHED.pop(ident, None)


_NUMPY_DTYPE_NAMES: dict[np.dtype, str] = {}


def numpy_dtype_name(dtype: np.dtype, /) -> str:
    """The name a spec reads for a numpy dtype: its ``.name``, which says nothing of the byte
    order, so a dtype of the other byte order than the machine's is named for it
    (``'big-endian float32'``), a name no spec holds: such an array never passes for one of
    the native dtype, which a framework would read as other values.

    >>> numpy_dtype_name(np.dtype("float32")), numpy_dtype_name(np.dtype("float32").newbyteorder())
    ('float32', 'big-endian float32')
    """
    name = _NUMPY_DTYPE_NAMES.get(dtype)  # numpy's dtype.name is slow: cached per dtype
    if name is None:
        name = dtype.name
        if not dtype.isnative:
            order = "big" if dtype.byteorder == ">" else "little"
            name = f"{order}-endian {name}"
        _NUMPY_DTYPE_NAMES[dtype] = name
    return name


def signature_of(leaf: Any, /) -> Signature | None:
    """``(shape, dtype name)`` of an array leaf, or ``None`` if ``leaf`` is not an array.

    >>> signature_of(np.zeros((2, 3), np.int64)), signature_of("x")
    (((2, 3), 'int64'), None)
    """
    cls = type(leaf)
    if cls is np.ndarray:
        return leaf.shape, numpy_dtype_name(leaf.dtype)
    try:
        array_type = _RESOLVED[id(cls)]
    except KeyError:
        array_type = array_type_of(cls)
    return None if array_type is None else array_type.signature(leaf)


def strict_bool(value: Any, /) -> bool | None:
    """``value`` as a bool if it is one (or a 0-d boolean array: numpy, torch, jax), else
    ``None``: nothing is coerced (``bool("False")`` is True).

    >>> strict_bool(np.bool_(False)), strict_bool("False"), strict_bool(1)
    (False, None, None)
    """
    if isinstance(value, bool):
        return value
    # Never raises: every read of the object's own attributes is guarded, so that a caller
    # refuses it as "not a bool" at its position (a mask entry, a requires_grad answer).
    try:
        dtype = getattr(value, "dtype", None)
        if dtype is None or str(dtype) not in {"bool", "torch.bool"}:
            return None
        if tuple(value.shape) != ():
            return None
        return bool(value)
    except Exception:  # an object that only looks like an array
        return None


def same_float(found: Any, expected: float, /) -> bool:
    """Whether ``found`` is a Python float with the bits of ``expected``: NaN matches a NaN of
    the same sign and payload, -0.0 not 0.0.

    >>> same_float(float("nan"), float("nan")), same_float(-0.0, 0.0), same_float(1, 1.0)
    (True, False, False)
    >>> same_float(-float("nan"), float("nan"))
    False
    """
    if type(found) is not float:
        return False
    if found == expected:
        return found != 0.0 or math.copysign(1.0, found) == math.copysign(1.0, expected)
    return found != found and expected != expected and _bits(found) == _bits(expected)


def _bits(value: float) -> int:
    bits: int = _UNPACK_BITS(_PACK_FLOAT(value))[0]
    return bits


_PACK_FLOAT = struct.Struct("<d").pack
_UNPACK_BITS = struct.Struct("<Q").unpack
_UNPACK_FLOAT = struct.Struct("<d").unpack
_PACK_BITS = struct.Struct("<Q").pack
_SIGN = 1 << 63
#: The bits of ``float("nan")`` on every platform CPython supports (IEEE 754 binary64).
_QUIET_NAN = 0x7FF8_0000_0000_0000
_NAN_TEXT = re.compile(r"nan:0x[0-9a-f]{16}")


def float_text(value: float, /) -> str:
    """A float as a spec keeps and writes it, exactly: its ``repr``, but a NaN other than
    ``float("nan")`` as ``-nan`` (its negative) or ``nan:0x`` and its 16 hex digits of bits.

    ``repr`` alone makes every NaN ``nan``; a constant must come back with its sign and payload.

    >>> float_text(0.1), float_text(-0.0), float_text(float("nan")), float_text(-float("nan"))
    ('0.1', '-0.0', 'nan', '-nan')
    """
    if value == value:
        return repr(value)
    bits = _bits(value)
    if bits == _QUIET_NAN:
        return "nan"
    if bits == _QUIET_NAN | _SIGN:
        return "-nan"
    return f"nan:0x{bits:016x}"


def float_of_text(text: str, /) -> float | None:
    """The float :func:`float_text` wrote as ``text``; ``None`` for any other text.

    >>> float_of_text("1e-310"), float_of_text("1E-310"), float_of_text("-nan")
    (1e-310, None, nan)
    """
    if len(text) > 32:
        return None
    if text.startswith(("nan", "-nan")):
        if text == "nan":
            bits = _QUIET_NAN
        elif text == "-nan":
            bits = _QUIET_NAN | _SIGN
        elif _NAN_TEXT.fullmatch(text):
            bits = int(text[6:], 16)
        else:
            return None
        value: float = _UNPACK_FLOAT(_PACK_BITS(bits))[0]
    else:
        try:
            value = float(text)
        except ValueError:
            return None
    return value if float_text(value) == text else None


def _lazy_registrations(cls: type) -> list[str]:
    """The adapter modules that register the frameworks ``cls`` or its bases come from, for
    frameworks the program imported: a class's ``__module__`` is any text it says (a stand-in
    made with ``type()``, a mock), and an object of a framework's own class exists only once the
    framework is imported, so a class merely naming ``torch`` never imports torch.

    >>> _lazy_registrations(type("Claims", (), {"__module__": "not_a_framework"}))
    []
    """
    modules = []
    for base in cls.__mro__:
        root = getattr(base, "__module__", None)
        name = root.partition(".")[0] if type(root) is str else ""
        module = _LAZY_REGISTRATIONS.get(name)
        if module is not None and module not in modules and name in sys.modules:
            modules.append(module)
    return modules


def _lookup(cls: type) -> ArrayType | None:
    if id(cls) in _BUILTIN_KINDS:  # never an array, even where an ABC registered since says so
        return None
    for base in cls.__mro__:
        entry = _REGISTERED.get(id(base))
        if entry is not None:
            return entry[1]
    # A snapshot: issubclass may run code (a metaclass's __subclasscheck__), and another
    # thread may register meanwhile.
    for registered, array_type in tuple(_REGISTERED.values()):
        if issubclass(cls, registered):  # abstract bases such as jax.Array
            return array_type
    return None


def _numpy_signature(x: np.ndarray) -> Signature:
    return x.shape, numpy_dtype_name(x.dtype)


def _numpy_grad(x: np.ndarray) -> bool:
    return is_differentiable_dtype(numpy_dtype_name(x.dtype))


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
_REGISTERED[id(np.ndarray)] = (
    np.ndarray,
    ArrayType(signature=_numpy_signature, requires_grad=_numpy_grad),
)
