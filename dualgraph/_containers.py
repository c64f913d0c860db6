"""Container types a spec can hold, and registration of user dataclasses."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, TypeVar

import optree

from ._errors import DualgraphError

__all__ = ["NAMESPACE", "dataclass_fields", "qualified_name", "register_dataclass", "resolve_type"]

#: optree namespace under which dualgraph registers user containers.
NAMESPACE = "dualgraph"

_DATACLASS_FIELDS: dict[type, tuple[str, ...]] = {}
# Types met by describe(), so specs of locally defined namedtuples and dataclasses resolve.
_SEEN_TYPES: dict[str, type] = {}

T = TypeVar("T", bound=type)


def register_dataclass(cls: T, /) -> T:
    """Register a dataclass as a container whose fields are children; usable as a decorator.

    >>> import dataclasses
    >>> @register_dataclass
    ... @dataclasses.dataclass
    ... class EncoderOut:
    ...     hidden: Any
    ...     aux_loss: Any = None
    >>> import dualgraph
    >>> dualgraph.describe(EncoderOut(1.0)).paths
    ('.hidden', '.aux_loss')
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise DualgraphError(f"register_dataclass expects a dataclass type, got {cls!r}")
    if cls in _DATACLASS_FIELDS:
        return cls
    fields = dataclasses.fields(cls)
    no_init = [f.name for f in fields if not f.init]
    if no_init:
        raise DualgraphError(
            f"cannot register {qualified_name(cls)}: fields {no_init} have init=False, "
            "so the dataclass cannot be rebuilt from its fields"
        )
    names = tuple(f.name for f in fields)

    def flatten(obj: Any) -> tuple[list[Any], None, tuple[str, ...]]:
        return [getattr(obj, name) for name in names], None, names

    def unflatten(_: None, children: Any) -> Any:
        return cls(**dict(zip(names, children, strict=True)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
    _DATACLASS_FIELDS[cls] = names
    return cls


def dataclass_fields(cls: type, /) -> tuple[str, ...] | None:
    """The child fields of a registered dataclass, or ``None`` if ``cls`` is not one."""
    return _DATACLASS_FIELDS.get(cls)


def qualified_name(cls: type, /) -> str:
    """``module:QualName``, the way a spec names a user type (remembered for :func:`resolve_type`).

    >>> import collections
    >>> qualified_name(collections.OrderedDict)
    'collections:OrderedDict'
    """
    name = f"{cls.__module__}:{cls.__qualname__}"
    _SEEN_TYPES.setdefault(name, cls)
    return name


def resolve_type(name: str, /) -> type:
    """Import the type a spec names as ``module:QualName``.

    >>> resolve_type("collections:OrderedDict").__name__
    'OrderedDict'
    """
    if name in _SEEN_TYPES:
        return _SEEN_TYPES[name]
    module_name, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as error:
        raise DualgraphError(
            f"cannot resolve type {name!r} named in a spec: {error}; import or define it first"
        ) from None
    if not isinstance(obj, type):
        raise DualgraphError(f"{name!r} named in a spec is not a type")
    return obj
