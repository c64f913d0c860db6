"""The container kinds a spec can hold, one class each, and the registry of user classes.

Every kind of container is one :class:`~dualgraph._nodes.Container` subclass below, listed in
:data:`CONTAINER_KINDS`; adding a kind means adding a class there. Builtin kinds match one exact
type (a subclass of ``dict`` is not a dict).

Namedtuples and dataclasses are named in JSON as ``module:QualName``. The name is only ever
looked up among classes this process registered (:func:`register_namedtuple`,
:func:`register_dataclass`) or described: nothing named in a spec is imported or called unless
the program itself handed dualgraph that very class. A name means the class most recently
registered or first described under it; a spec bound to an older class of the same name (a
class redefined in a notebook, say) still works, but cannot be written to JSON, since reading it
back would give the newer class.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import inspect
import unicodedata
import weakref
from collections.abc import Callable, Sequence
from operator import is_
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import optree

from ._errors import DualgraphError
from ._leaves import array_type_of, signature_of
from ._nodes import (
    MAX_INT_BITS,
    Bind,
    Container,
    Node,
    NodeError,
    brief_constant,
    check_int,
    check_json_text,
    class_name,
    clip,
    clip_text,
    is_instance,
)
from ._paths import Attr, Index, Key, PathEntry

__all__ = [
    "CONTAINER_KINDS",
    "NAMESPACE",
    "NamedContainer",
    "DataclassNode",
    "DictNode",
    "ListNode",
    "NamedTupleNode",
    "OrderedDictNode",
    "TupleNode",
    "brief_of",
    "container_kind",
    "container_subclasses",
    "dataclass_fields",
    "qualified_name",
    "register_dataclass",
    "register_namedtuple",
]

#: optree namespace under which dualgraph registers user dataclasses.
NAMESPACE = "dualgraph"
#: The longest ``module:QualName`` a spec may hold.
MAX_NAME_LENGTH = 1024

T = TypeVar("T", bound=type)

# name -> class, and the kind of each class the program registered or described.
_NAMED: dict[str, type] = {}
# Keyed by id(cls), holding (cls, fields): see _leaves._REGISTERED for why not by class.
_DATACLASS_FIELDS: dict[int, tuple[type, tuple[str, ...]]] = {}


def qualified_name(cls: type, /) -> str:
    """``module:QualName``, the way a spec names a user class.

    >>> import collections
    >>> qualified_name(collections.OrderedDict)
    'collections:OrderedDict'
    """
    module = cls.__module__
    if type(module) is not str:
        raise DualgraphError(
            f"{class_name(cls)}: its __module__ is {clip(module, 60)}, not a str, so a spec "
            "cannot name the class (module:QualName)"
        )
    return f"{module}:{cls.__qualname__}"


# -- the kinds ---------------------------------------------------------------------------------


class _Sequence(Container):
    """A tuple or list of a fixed length."""

    __slots__ = ()

    def __init__(self, length: int) -> None:
        super().__init__((self.tag, length), tuple(Index(i) for i in range(length)))

    @classmethod
    def describe(cls, obj: Any, intern: dict[Any, Node]) -> tuple[Node, Sequence[Any]]:
        key = (cls.tag, len(obj))
        node = intern.get(key)
        if node is None:
            node = intern[key] = cls(len(obj))
        return node, obj

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> Container:
        if len(row) != 2 or type(row[1]) is not int or row[1] < 0:
            raise NodeError(f"a {cls.tag} row is ['{cls.tag}', length], got {clip(row)}")
        _check_arity(row[1], max_arity)
        return cls(row[1])

    @classmethod
    def brief_of_object(cls, obj: Any) -> str:
        return f"a {cls.tag} of length {len(obj)}"

    def brief(self) -> str:
        return f"a {self.tag} of length {self.arity}"

    def row(self) -> list[Any]:
        return [self.tag, self.arity]

    def children_of(self, obj: Any) -> Sequence[Any] | None:
        if type(obj) is self.python_type and len(obj) == self.arity:
            return obj
        return None

    def guard(self, var: str, bind: Bind) -> str:
        return f"type({var}) is not {self.tag} or len({var}) != {self.arity}"

    def child(self, var: str, index: int, bind: Bind) -> str:
        return f"{var}[{index}]"

    def difference(self, obj: Any, children: Sequence[Node]) -> tuple[PathEntry | None, str]:
        return None, f"expected {self.brief()}, got {brief_of(obj)}"


class TupleNode(_Sequence):
    """A ``tuple``: children by position."""

    __slots__ = ()
    tag = "tuple"
    python_type = tuple

    def rebuild(self, values: list[Any]) -> Any:
        return tuple(values)

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        return "(" + "".join(f"{part}, " for part in parts) + ")"

    def show(self, parts: Sequence[str]) -> str:
        return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


class ListNode(_Sequence):
    """A ``list``: children by position."""

    __slots__ = ()
    tag = "list"
    python_type = list

    def rebuild(self, values: list[Any]) -> Any:
        return values

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        return "[" + ", ".join(parts) + "]"

    def show(self, parts: Sequence[str]) -> str:
        return f"[{', '.join(parts)}]"


def _check_arity(arity: int, max_arity: int) -> None:
    if arity > max_arity:
        raise NodeError(
            f"the row has {arity} children, but the rows after it leave room for {max_arity}"
        )


def check_key(key: Any) -> None:
    """Refuse a mapping key that is not a ``str`` or an ``int`` (``bool`` is not an int here)."""
    if type(key) is int:
        check_int(key)
    elif type(key) is not str:
        raise NodeError(
            f"dict key {clip(key)} of type {type(key).__name__} is not supported; "
            "spec dict keys are str or int"
        )


#: The most int keys of one mapping that may share a hash (below 2**61 only -1 and -2 do).
MAX_KEYS_PER_HASH = 8


def _check_int_hashes(keys: tuple[Any, ...]) -> None:
    """Refuse int keys that pile up on one hash. Python hashes an int by its value modulo
    2**61 - 1, so a document can hold any number of keys of one hash, and a set or dict of n
    of them takes time quadratic in n. Hash values are small ints, which hash to themselves:
    counting them cannot collide."""
    if len(keys) <= MAX_KEYS_PER_HASH:
        return
    counts = collections.Counter(hash(key) for key in keys if type(key) is int)
    if counts:
        value, count = counts.most_common(1)[0]
        if count > MAX_KEYS_PER_HASH:
            shared = [key for key in keys if type(key) is int and hash(key) == value][:3]
            raise NodeError(
                f"{count} int keys share one hash (e.g. {clip(shared)}); a spec takes at most "
                f"{MAX_KEYS_PER_HASH}: sets of such keys take time quadratic in their number"
            )


def _sorted_order(keys: tuple[Any, ...]) -> list[int]:
    """Child indices in optree's order: keys sorted (mixed types: by type name, then key)."""
    try:
        return sorted(range(len(keys)), key=keys.__getitem__)
    except TypeError:
        return sorted(range(len(keys)), key=lambda i: (type(keys[i]).__name__, keys[i]))


class _Mapping(Container):
    """A dict or ``OrderedDict``: children by key; rebuilt and shown in the user's key order."""

    __slots__ = ("flat_keys", "key_types", "keys", "keyset", "user_order")
    article: ClassVar[str] = "a"
    #: Whether leaves flatten in sorted key order (dict) or in the key order (OrderedDict).
    sorts_keys: ClassVar[bool]
    #: The keys in the user's order (as rebuilt and shown), and in flatten order.
    keys: tuple[str | int, ...]
    flat_keys: tuple[str | int, ...]
    keyset: frozenset[str | int]
    #: The exact types of the keys: an object's keys equal to ``keys`` must be of these too
    #: (``True == 1`` and ``1.0 == 1``, but a spec tells a bool key from an int one).
    key_types: frozenset[type]
    #: For each key in the user's order, the flatten position of its child.
    user_order: tuple[int, ...]

    def __init__(self, keys: tuple[str | int, ...]) -> None:
        order = _sorted_order(keys) if self.sorts_keys else range(len(keys))
        flat_keys = tuple(keys[i] for i in order)
        super().__init__((self.tag, keys), tuple(Key(k) for k in flat_keys))
        position = {index: flat for flat, index in enumerate(order)}
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "flat_keys", flat_keys)
        object.__setattr__(self, "keyset", frozenset(keys))
        object.__setattr__(self, "key_types", frozenset(map(type, keys)))
        object.__setattr__(self, "user_order", tuple(position[i] for i in range(len(keys))))

    @classmethod
    def make(cls, keys: tuple[str | int, ...]) -> _Mapping:
        for key in keys:
            check_key(key)
        _check_int_hashes(keys)
        if len(set(keys)) != len(keys):
            raise NodeError(f"{cls.tag} keys repeat: {clip(list(keys))}")
        return cls(keys)

    @classmethod
    def describe(cls, obj: Any, intern: dict[Any, Node]) -> tuple[Node, Sequence[Any]]:
        keys = tuple(obj)
        # Key types are part of the lookup (True == 1, but a bool key is refused), by identity:
        # a key's class may compare equal to str through its metaclass.
        key = (cls.tag, keys, tuple(map(id, map(type, keys))))
        node = intern.get(key)
        if node is None:
            node = intern[key] = cls.make(keys)
        assert isinstance(node, _Mapping)
        return node, [obj[k] for k in node.flat_keys]

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> Container:
        if len(row) != 2 or type(row[1]) is not list:
            raise NodeError(f"a {cls.tag} row is ['{cls.tag}', [keys]], got {clip(row)}")
        _check_arity(len(row[1]), max_arity)
        keys = tuple(row[1])
        for key in keys:
            if type(key) is str:  # what is read must write back (a str document can hold these)
                check_json_text(key, "the key")
        return cls.make(keys)

    @classmethod
    def brief_of_object(cls, obj: Any) -> str:
        return f"{cls.article} {cls.tag} with keys {clip(list(obj))}"

    def brief(self) -> str:
        return f"{self.article} {self.tag} with keys {clip(list(self.keys))}"

    def row(self) -> list[Any]:
        for key in self.keys:
            if type(key) is str:
                check_json_text(key, "the key")
        return [self.tag, list(self.keys)]

    def children_of(self, obj: Any) -> Sequence[Any] | None:
        if type(obj) is self.python_type and self.same_keys(obj):
            return [obj[key] for key in self.flat_keys]
        return None

    def same_keys(self, obj: Any) -> bool:
        raise NotImplementedError

    def child(self, var: str, index: int, bind: Bind) -> str:
        return f"{var}[{bind(self.flat_keys[index], 'k')}]"

    def user_pairs(self, parts: Sequence[Any]) -> list[tuple[Any, Any]]:
        """``(key, part)`` in the user's key order, from ``parts`` in flatten order."""
        return [(key, parts[i]) for key, i in zip(self.keys, self.user_order, strict=True)]

    def rebuild_source_pairs(self, parts: Sequence[str], bind: Bind) -> list[str]:
        return [f"{bind(key, 'k')}: {part}" for key, part in self.user_pairs(parts)]

    def shown_items(self, parts: Sequence[str]) -> str:
        return ", ".join(f"{key!r}: {part}" for key, part in self.user_pairs(parts))

    def difference(self, obj: Any, children: Sequence[Node]) -> tuple[PathEntry | None, str]:
        if type(obj) is not self.python_type:
            return None, f"expected {self.brief()}, got {brief_of(obj)}"
        by_key = dict(zip(self.flat_keys, children, strict=True))
        for key in self.keys:
            if key not in obj:
                return Key(key), f"missing (expected {by_key[key].brief()})"
        for key in obj:
            if key not in self.keyset:
                return Key(key), f"unexpected entry {brief_of(obj[key])}"
        for key in obj:
            if type(key) not in self.key_types:
                ours = next(k for k in self.keys if k == key)
                return Key(key), (
                    f"key of type {type(key).__name__}, expected the "
                    f"{type(ours).__name__} key {clip(ours)}"
                )
        return None, f"expected keys in the order {clip(list(self.keys))}, got {clip(list(obj))}"


class DictNode(_Mapping):
    """A ``dict``: any key order matches; leaves flatten by sorted key; rebuilt in the user's."""

    __slots__ = ()
    tag = "dict"
    python_type = dict
    sorts_keys = True

    def same_keys(self, obj: Any) -> bool:
        return obj.keys() == self.keyset and self.key_types.issuperset(map(type, obj))

    def rebuild(self, values: list[Any]) -> Any:
        return dict(self.user_pairs(values))

    def guard(self, var: str, bind: Bind) -> str:
        types = bind(self.key_types.issuperset, "k")
        keys = f"{var}.keys() != {bind(self.keyset, 'k')}"
        return f"type({var}) is not dict or {keys} or not {types}(map(type, {var}))"

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        return "{" + ", ".join(self.rebuild_source_pairs(parts, bind)) + "}"

    def show(self, parts: Sequence[str]) -> str:
        return "{" + self.shown_items(parts) + "}"


class OrderedDictNode(_Mapping):
    """An ``OrderedDict``: its key order is part of the structure (and the flatten order)."""

    __slots__ = ()
    tag = "ordereddict"
    python_type = collections.OrderedDict
    sorts_keys = False
    article = "an"

    def same_keys(self, obj: Any) -> bool:
        return tuple(obj) == self.keys and self.key_types.issuperset(map(type, obj))

    def rebuild(self, values: list[Any]) -> Any:
        return collections.OrderedDict(zip(self.keys, values, strict=True))

    def guard(self, var: str, bind: Bind) -> str:
        cls = bind(collections.OrderedDict, "T")
        types = bind(self.key_types.issuperset, "k")
        keys = f"tuple({var}) != {bind(self.keys, 'k')}"
        return f"type({var}) is not {cls} or {keys} or not {types}(map(type, {var}))"

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        items = ", ".join(
            f"({bind(key, 'k')}, {part})" for key, part in zip(self.keys, parts, strict=True)
        )
        return f"{bind(collections.OrderedDict, 'T')}([{items}])"

    def show(self, parts: Sequence[str]) -> str:
        return "OrderedDict({" + self.shown_items(parts) + "})"


class NamedContainer(Container):
    """A user class with named fields, bound by identity; JSON names it ``module:QualName``."""

    __slots__ = ("cls", "fields", "name")
    cls: type[Any]
    fields: tuple[str, ...]
    name: str
    register_with: ClassVar[str]

    def __init__(self, cls: type, fields: tuple[str, ...]) -> None:
        # By id: a metaclass may make classes compare equal; the node keeps its class alive
        super().__init__((self.tag, id(cls)), tuple(Attr(f) for f in fields))
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "fields", fields)
        try:
            name = qualified_name(cls)
        except DualgraphError as error:  # the class changed since it was registered
            raise NodeError(str(error)) from None
        object.__setattr__(self, "name", name)

    @classmethod
    def fields_of(cls, typ: type) -> tuple[str, ...] | None:
        """The fields of ``typ`` if it is a registered class of this kind, else ``None``."""
        raise NotImplementedError

    @classmethod
    def describe(cls, obj: Any, intern: dict[Any, Node]) -> tuple[Node, Sequence[Any]]:
        typ = type(obj)
        key = (NamedContainer, id(typ))  # the object keeps its class alive while describing
        node = intern.get(key)
        if node is None:
            fields = cls.fields_of(typ)
            assert fields is not None  # the caller found the kind by fields_of
            node = intern[key] = cls(typ, fields)
        assert isinstance(node, NamedContainer)
        return node, node.values_of(obj)

    def values_of(self, obj: Any) -> Sequence[Any]:
        raise NotImplementedError

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> Container:
        return cls(*cls._class_of_row(row, max_arity))

    @classmethod
    def _class_of_row(cls, row: list[Any], max_arity: int) -> tuple[type, tuple[str, ...]]:
        """The registered class a row names, and its fields (checked against the row's)."""
        if len(row) != 3 or type(row[1]) is not str or type(row[2]) is not list:
            raise NodeError(f"a {cls.tag} row is ['{cls.tag}', 'module:QualName', [fields]]")
        name, fields = row[1], row[2]
        _check_arity(len(fields), max_arity)
        if len(name) > MAX_NAME_LENGTH:
            raise NodeError(f"a class name has at most {MAX_NAME_LENGTH} characters")
        check_json_text(name, "the class name")  # what is read must write back
        found = _NAMED.get(name)
        if found is None:
            raise NodeError(
                f"{cls.tag} {name!r} is not registered in this process. dualgraph never imports "
                "a module or calls a class named in a spec: register the class first, with "
                f"dualgraph.{cls.register_with}(cls){_DESCRIBED_NOTE.get(cls.tag, '')}"
            )
        expected = cls.fields_of(found)
        if expected is None:
            raise NodeError(f"{name!r} in this process is not a {cls.tag}")
        if list(expected) != fields:
            raise NodeError(
                f"{name!r} has fields {list(expected)} in this process, "
                f"the spec says {clip(fields)}"
            )
        return found, expected

    @classmethod
    def brief_of_object(cls, obj: Any) -> str:
        return f"a {class_name(type(obj))}"

    def brief(self) -> str:
        return f"a {class_name(self.cls)}"

    def row(self) -> list[Any]:
        if len(self.name) > MAX_NAME_LENGTH:  # from_row refuses it: what is written must read
            raise NodeError(
                f"the class name {clip(self.name, 80)} has {len(self.name)} characters; a spec "
                f"read from JSON takes at most {MAX_NAME_LENGTH}"
            )
        check_json_text(self.name, "the class name")
        if _NAMED.get(self.name) is not self.cls:
            raise NodeError(
                f"{self.name!r} now names another class in this process (was the class "
                "redefined?), so a spec read back would not rebuild the class it describes; "
                f"describe a tree of the current class, or dualgraph.{self.register_with}(cls) "
                "the one you mean"
            )
        return [self.tag, self.name, list(self.fields)]

    def show(self, parts: Sequence[str]) -> str:
        fields = ", ".join(f"{f}={p}" for f, p in zip(self.fields, parts, strict=True))
        return f"{self.cls.__qualname__}({fields})"

    def guard(self, var: str, bind: Bind) -> str:
        return f"type({var}) is not {bind(self.cls, 'T')}"

    def difference(self, obj: Any, children: Sequence[Node]) -> tuple[PathEntry | None, str]:
        found = brief_of(obj)
        if type(obj) is not self.cls and class_name(type(obj)) == class_name(self.cls):
            found += " (another class of the same name)"
        return None, f"expected {self.brief()}, got {found}"


_DESCRIBED_NOTE = {"namedtuple": " (describing a tree that holds it registers it too)"}


class NamedTupleNode(NamedContainer):
    """A namedtuple class: children by position, shown by field name."""

    __slots__ = ()
    tag = "namedtuple"
    register_with = "register_namedtuple"

    @classmethod
    def claims(cls, typ: type, *, learn: bool) -> bool:
        if not _is_namedtuple_class(typ):
            return False
        if learn:  # described: a spec read back may now name it
            _refuse_array_type(typ, NodeError)
            misread = _misread_field(typ)
            if misread is not None:
                raise NodeError(misread)
            try:
                _bind_name(typ)
            except DualgraphError as error:  # describe adds the path
                raise NodeError(str(error)) from None
        return True

    @classmethod
    def fields_of(cls, typ: type) -> tuple[str, ...] | None:
        if kind_of(typ) is NamedTupleNode:  # registered or described
            return typ._fields  # type: ignore[attr-defined]
        return None

    def values_of(self, obj: Any) -> Sequence[Any]:
        return _tuple_items(obj)

    def children_of(self, obj: Any) -> Sequence[Any] | None:
        if type(obj) is self.cls and _tuple_len(obj) == self.arity:
            return _tuple_items(obj)
        return None

    def rebuild(self, values: list[Any]) -> Any:
        return rebuilt_namedtuple(self.cls, values, _items_reader(self.cls))

    def guard(self, var: str, bind: Bind) -> str:
        # tuple.__new__ can make an instance with more or fewer items than the class's fields
        length = "len" if _reads_as_tuple(self.cls) else bind(_tuple_len, "L")
        return f"type({var}) is not {bind(self.cls, 'T')} or {length}({var}) != {self.arity}"

    def child(self, var: str, index: int, bind: Bind) -> str:
        # by position: a field name is never read as an attribute
        if _reads_as_tuple(self.cls):
            return f"{var}[{index}]"
        return f"{bind(_tuple_item, 'I')}({var}, {index})"

    def difference(self, obj: Any, children: Sequence[Node]) -> tuple[PathEntry | None, str]:
        if type(obj) is self.cls and _tuple_len(obj) != self.arity:
            return None, (
                f"expected {self.brief()} of {self.arity} fields, got {brief_of(obj)} of "
                f"length {_tuple_len(obj)}"
            )
        return super().difference(obj, children)

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        rebuild, cls = bind(rebuilt_namedtuple, "R"), bind(self.cls, "T")
        items_of = _items_reader(self.cls)
        reader = "None" if items_of is None else bind(items_of, "I")
        values = "".join(f"{part}, " for part in parts)  # a tuple: the call unpacks it as is
        return f"{rebuild}({cls}, ({values}), {reader})"


class DataclassNode(NamedContainer):
    """A registered dataclass: children are its fields, read with ``getattr``.

    A dataclass that is also a dict (Hugging Face's ``ModelOutput`` subclasses ``OrderedDict``)
    is rebuilt from its fields alone, so each of its dict entries must be one of its fields,
    holding that field's value: any other entry would be lost by a rebuild, and is refused.
    Which fields have entries, in which order, is part of its node (``out.to_tuple()``,
    ``out[0]`` and ``dict(out)`` read them): a tree whose object has other entries is another
    tree, and a rebuild that makes other entries (``out.loss = x`` set after ``out`` was made
    without it, where the rebuild's ``__post_init__`` makes an entry of every field set) is
    refused.

    A dataclass that is also a list, tuple, set or deque holds items besides its fields, which a
    rebuild from its fields would lose: one holding any is refused, and so is a rebuild that
    makes some.
    """

    __slots__ = ("count_items", "entry_items", "fieldset", "held")
    tag = "dataclass"
    register_with = "register_dataclass"
    #: The field names, where the class is a dict subclass (its entries are checked), else None.
    fieldset: frozenset[str] | None
    #: The fields that have dict entries, in the entries' order (a dict subclass), else None.
    held: tuple[str, ...] | None
    #: The len() of the builtin sequence or set the class also is (list.__len__), else None.
    count_items: Callable[[Any], int] | None
    #: How the dict entries are read, in the object's own order (see :func:`_entry_items`).
    entry_items: Callable[[Any], Any]

    def __init__(
        self, cls: type, fields: tuple[str, ...], entries: tuple[str, ...] | None = None
    ) -> None:
        super().__init__(cls, fields)
        is_dict = _is_dict(cls)
        if is_dict != (entries is not None):
            raise NodeError(
                f"{class_name(cls)} is a dict: its node needs the keys of its dict entries"
                if is_dict
                else f"{class_name(cls)} is not a dict: its node holds no dict entries"
            )
        if entries is not None:
            if len(set(entries)) != len(entries) or not set(entries) <= set(fields):
                raise NodeError(
                    f"the dict entries of a {class_name(cls)} are some of its fields "
                    f"{list(fields)}, each once, got {clip(list(entries))}"
                )
            object.__setattr__(self, "key", (*self.key, entries))
        object.__setattr__(self, "fieldset", frozenset(fields) if is_dict else None)
        object.__setattr__(self, "held", entries)
        object.__setattr__(self, "count_items", _items_counter(cls))
        object.__setattr__(self, "entry_items", _entry_items(cls))

    @classmethod
    def fields_of(cls, typ: type) -> tuple[str, ...] | None:
        return dataclass_fields(typ)

    @classmethod
    def describe(cls, obj: Any, intern: dict[Any, Node]) -> tuple[Node, Sequence[Any]]:
        typ = type(obj)
        if not _is_dict(typ):
            return super().describe(obj, intern)
        fields = cls.fields_of(typ)
        assert fields is not None  # the caller found the kind by fields_of
        lost = _entries_lost(obj, frozenset(fields))
        if lost:
            raise NodeError(_lost_message(typ, lost))
        entries = tuple(key for key, _ in _entry_items(typ)(obj))
        key = (NamedContainer, id(typ), entries)
        node = intern.get(key)
        if node is None:
            node = intern[key] = cls(typ, fields, entries)
        return node, [getattr(obj, field) for field in fields]

    def values_of(self, obj: Any) -> Sequence[Any]:
        if self.count_items is not None and self.count_items(obj):
            raise NodeError(_items_message(self.cls, self.count_items(obj)))
        return [getattr(obj, field) for field in self.fields]

    def children_of(self, obj: Any) -> Sequence[Any] | None:
        if type(obj) is not self.cls:
            return None
        if self.held is not None and _entries_differ(obj, self.held, self.entry_items):
            return None
        if self.count_items is not None and self.count_items(obj):
            return None
        return [getattr(obj, field) for field in self.fields]

    def guard(self, var: str, bind: Bind) -> str:
        guard = super().guard(var, bind)
        if self.count_items is not None:
            guard += f" or {bind(self.count_items, 'n')}({var})"
        if self.held is None:
            return guard
        differ, items = bind(_entries_differ, "L"), bind(self.entry_items, "e")
        return f"{guard} or {differ}({var}, {bind(self.held, 'f')}, {items})"

    def difference(self, obj: Any, children: Sequence[Node]) -> tuple[PathEntry | None, str]:
        if type(obj) is self.cls and self.count_items is not None and self.count_items(obj):
            return None, _items_message(self.cls, self.count_items(obj))
        if type(obj) is self.cls and self.held is not None:
            assert self.fieldset is not None
            lost = _entries_lost(obj, self.fieldset)
            if lost:
                return None, _lost_message(self.cls, lost)
            found = [key for key, _ in self.entry_items(obj)]
            return None, (
                f"expected {self.brief()} with the dict entries {clip(list(self.held))}, got one "
                f"with the entries {clip(found)}"
            )
        return super().difference(obj, children)

    def row(self) -> list[Any]:
        row = super().row()
        return row if self.held is None else [*row, list(self.held)]

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> Container:
        # ['dataclass', name, fields], and for a class that is a dict its entries' keys after
        entries: tuple[str, ...] | None = None
        if len(row) == 4:
            if type(row[3]) is not list or not all(type(key) is str for key in row[3]):
                raise NodeError(
                    f"a dataclass row's dict entries are a list of field names, got {clip(row[3])}"
                )
            entries = tuple(row[3])
        found, fields = cls._class_of_row(row[:3] if len(row) == 4 else row, max_arity)
        return cls(found, fields, entries)

    def rebuild(self, values: list[Any]) -> Any:
        return rebuilt_dataclass(self.cls, self.fields, values, self.held, self.count_items)

    def child(self, var: str, index: int, bind: Bind) -> str:
        return f"_getattr({var}, {bind(self.fields[index], 'f')})"

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        maker, cls = bind(rebuilt_dataclass, "R"), bind(self.cls, "T")
        held = "" if self.held is None else f", {bind(self.held, 'e')}"
        if self.count_items is not None:
            held = f", None, {bind(self.count_items, 'n')}"
        return f"{maker}({cls}, {bind(self.fields, 'f')}, [{', '.join(parts)}]{held})"


def _is_dict(cls: type) -> bool:
    """Whether ``cls`` is a dict subclass, by its real bases (never a metaclass's check)."""
    return type.__subclasscheck__(dict, cls)


def _entries_lost(obj: dict[Any, Any], fieldset: frozenset[str]) -> list[Any]:
    """The keys of ``obj``'s dict entries that a rebuild from its fields would lose: keys that
    are no field, or whose entry is not the field's value (read through dict's own methods:
    the class may override them)."""
    return [
        key
        for key, value in dict.items(obj)
        if type(key) is not str or key not in fieldset or getattr(obj, key) is not value
    ]


def _entry_items(cls: type) -> Callable[[Any], Any]:
    """How the dict entries of ``cls``'s objects are read, in the order the object itself gives
    them (what ``out.to_tuple()``, ``list(out)`` and ``out.keys()`` of eager's see): an
    ``OrderedDict``'s own order (which ``move_to_end`` changes, where the underlying dict's
    stays that of insertion), else the dict's. Read through the builtin's own method, never the
    class's overrides (by its real bases, never a metaclass's check).

    >>> od = collections.OrderedDict(a=1, b=2)
    >>> od.move_to_end("a")
    >>> [key for key, _ in _entry_items(type(od))(od)], list(dict.keys(od))
    (['b', 'a'], ['a', 'b'])
    """
    if type.__subclasscheck__(collections.OrderedDict, cls):
        return collections.OrderedDict.items
    return dict.items


def _entries_differ(
    obj: Any, held: tuple[str, ...], items: Callable[[Any], Any] = dict.items
) -> bool:
    """Whether ``obj``'s dict entries (read by ``items``: :func:`_entry_items`) are not exactly
    the fields ``held``, in that order, each holding its field's value."""
    if dict.__len__(obj) != len(held):
        return True
    for (key, value), name in zip(items(obj), held, strict=True):
        if type(key) is not str or key != name or getattr(obj, name) is not value:
            return True
    return False


#: Builtin containers besides dict that a dataclass may also be: their items are no fields.
_ITEM_BASES: tuple[type, ...] = (list, tuple, set, frozenset, bytearray, collections.deque)


# The builtins a dataclass may also be: containers whose contents its node checks (a dict's
# entries, the others' items), object, and Generic (a builtin in some Python versions).
_CHECKED_BASES = frozenset(map(id, (object, dict, collections.OrderedDict, *_ITEM_BASES, Generic)))
# type's own readers: a metaclass may define a __mro__ or __flags__ of its own
_MRO, _FLAGS = type.__dict__["__mro__"].__get__, type.__dict__["__flags__"].__get__
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (or type())


def _value_base(cls: type) -> type | None:
    """A builtin (a class made in C, not by a class statement) ``cls`` derives from whose value
    no field holds: ``str``, ``int``, ``float``, ``bytes``, ``defaultdict``, an exception's
    ``args``. A rebuild calls the class with its fields alone, so that value would be made anew.

    >>> @dataclasses.dataclass
    ... class Tag(str):
    ...     x: Any = None
    >>> _value_base(Tag)
    <class 'str'>
    >>> _value_base(collections.OrderedDict) is None
    True
    """
    for base in _MRO(cls):
        if id(base) in _CHECKED_BASES:
            continue
        if not _FLAGS(base) & _HEAP_TYPE:
            return base
    return None


def _items_counter(cls: type) -> Callable[[Any], int] | None:
    """The builtin ``len()`` of the list, tuple, set or deque ``cls`` also is (by its real
    bases: never a metaclass's check), else ``None``."""
    for base in _ITEM_BASES:
        if type.__subclasscheck__(base, cls):
            counter: Callable[[Any], int] = getattr(base, "__len__")  # noqa: B009
            return counter
    return None


def _items_message(cls: type, count: int) -> str:
    return (
        f"a {class_name(cls)} holds {count} item{'' if count == 1 else 's'} besides its fields "
        "(it is also a builtin sequence or set): it is rebuilt from its fields alone, so they "
        "would be lost. Keep its items in a field"
    )


def _lost_message(cls: type, lost: list[Any]) -> str:
    return (
        f"a {class_name(cls)} holds the dict entries {clip(lost)}, which are not its fields (or "
        "not their values): it is rebuilt from its fields alone, so they would be lost. "
        "Keep its dict entries to its fields' values"
    )


# -- rebuilding user classes ---------------------------------------------------------------------
# A class is rebuilt by calling it with its fields' values. An ``__init__``, ``__post_init__`` or
# ``__new__`` of the user's that changes a value it is given (``self.x = self.x * 2``) would
# silently hand back another object than the one taken apart: the fields are checked to hold
# the very values given (validation, and conversions that return their argument unchanged such
# as ``np.asarray`` of an array, keep them).


def rebuilt_dataclass(
    cls: type,
    fields: tuple[str, ...],
    values: list[Any],
    held: tuple[str, ...] | None = None,
    count_items: Callable[[Any], int] | None = None,
    /,
) -> Any:
    """``cls(**{field: value})``, refused if it does not keep every value as given, if (a class
    that is a dict) its dict entries are not the fields ``held``, in that order, or if (one that
    is a list, tuple, set or deque, read by ``count_items``) it holds items, or if it changed
    the contents of a list, dict or dataclass it was given (see :func:`_contents`)."""
    before = _contents(values)
    obj: Any = cls(**dict(zip(fields, values, strict=True)))
    if type(obj) is not cls:
        raise DualgraphError(_other_class(cls, obj))
    for field, value in zip(fields, values, strict=True):
        if getattr(obj, field) is not value:
            raise DualgraphError(_changed(cls, f"field {field!r}", "__init__ or __post_init__"))
    if before is not None and _contents_changed(before, values):
        raise DualgraphError(_changed_in_place(cls, "__init__ or __post_init__"))
    if held is not None:
        entry_items = _entry_items(cls)
        if _entries_differ(obj, held, entry_items):
            found = [key for key, _ in entry_items(obj)]
            raise DualgraphError(
                f"{class_name(cls)} rebuilt from its fields holds the dict entries {clip(found)}, "
                f"where the object taken apart held {clip(list(held))} (its __init__ or "
                "__post_init__ makes them from the fields, in its own order, so they would "
                "differ from eager's, as would out.to_tuple() and out[0]). Make the object with "
                "the fields it is to hold (Output(logits=logits, loss=loss)) rather than adding "
                "one or reordering them (move_to_end) afterwards"
            )
    if count_items is not None and count_items(obj):
        raise DualgraphError(
            f"{class_name(cls)} rebuilt from its fields holds {count_items(obj)} items (its "
            "__init__ or __post_init__ makes them), where the object taken apart held none. "
            "Keep its items in a field"
        )
    return obj


def rebuilt_namedtuple(
    cls: type, values: Sequence[Any], items_of: Callable[[Any], tuple[Any, ...]] | None, /
) -> Any:
    """``cls(*values)``, refused if it does not keep every value as given. ``items_of`` reads
    the items of a class that overrides ``len()``, indexing or iteration (see
    :func:`_items_reader`); ``None`` reads them through the tuple protocol (faster).

    >>> Point = collections.namedtuple("Point", "x y")
    >>> rebuilt_namedtuple(Point, [1, None], None)
    Point(x=1, y=None)
    """
    before = _contents(values)
    obj: Any = cls(*values)
    if type(obj) is not cls:
        raise DualgraphError(_other_class(cls, obj))
    items: Any = obj if items_of is None else items_of(obj)
    if len(items) != len(values) or not all(map(is_, items, values)):
        raise DualgraphError(_changed(cls, "its items", "__new__"))
    if before is not None and _contents_changed(before, values):
        raise DualgraphError(_changed_in_place(cls, "__new__"))
    return obj


# A class called with its fields may also change, in place, a list, dict or dataclass it is
# given (self.items.append(x), self.extra.setdefault(k, v)): its fields then hold the very
# objects given, but the tree it makes is not the one taken apart (which the class changed
# once already when eager made it). What such values hold is noted before the call and compared
# after: the objects by identity, the lengths and keys by value. Tuples (and namedtuples) are
# not looked into: their items cannot change (a list inside one could: not looked for).


def _contents(values: Sequence[Any]) -> tuple[list[Any], list[Any]] | None:
    """What the lists, dicts and registered dataclasses among ``values`` hold, recursively: the
    objects met and the lengths and keys met, or ``None`` where there are none (the fast path).

    >>> _contents([1, None]) is None
    True
    >>> objects, shape = _contents([[None, 2]])
    >>> shape
    [2]
    """
    changeable = _CHANGEABLE
    for value in values:  # the common case: none (a loop is cheaper than a map for a few)
        if id(type(value)) in changeable:
            break
    else:
        return None
    found: tuple[list[Any], list[Any]] = ([], [])
    for value in values:
        if id(type(value)) in changeable:
            _note(value, found[0], found[1], 0)
    return found


#: The ids of the classes whose objects :func:`_contents` looks into: list, dict, OrderedDict
#: and each registered dataclass (kept alive for good by :data:`_DATACLASS_FIELDS`).
_CHANGEABLE: set[int] = {id(list), id(dict), id(collections.OrderedDict)}

#: How deep :func:`_note` looks (a class may make a list hold itself).
_MAX_DEPTH = 100


def _note(value: Any, objects: list[Any], shape: list[Any], depth: int) -> None:
    objects.append(value)
    if depth > _MAX_DEPTH:
        return  # not looked into further (a list made to hold itself ends here)
    typ = type(value)
    if typ is list:
        shape.append(len(value))
        for item in value:
            _note(item, objects, shape, depth + 1)
    elif typ is dict or typ is collections.OrderedDict:
        shape.append(len(value))
        for key, item in value.items():
            shape.append(key)
            _note(item, objects, shape, depth + 1)
    else:
        entry = _DATACLASS_FIELDS.get(id(typ))
        if entry is not None and entry[0] is typ:
            for field in entry[1]:
                _note(getattr(value, field), objects, shape, depth + 1)


def _contents_changed(before: tuple[list[Any], list[Any]], values: Sequence[Any]) -> bool:
    """Whether what :func:`_contents` notes of ``values`` now differs from ``before``."""
    try:
        after = _contents(values)
        return (
            after is None
            or len(before[0]) != len(after[0])
            or not all(map(is_, before[0], after[0]))
            or before[1] != after[1]
        )
    except Exception:  # a key the class put there whose __eq__ raises: changed, surely
        return True


def _changed_in_place(cls: type, method: str) -> str:
    return (
        f"{class_name(cls)} changed in place a list, dict or dataclass it was given when rebuilt "
        f"from its fields (its {method} adds, removes or replaces what it holds), so the rebuilt "
        "tree would differ from the one taken apart, which it changed once already. Make that "
        "change outside the class, or on a copy"
    )


def _items_reader(cls: type) -> Callable[[Any], tuple[Any, ...]] | None:
    """How :func:`rebuilt_namedtuple` reads the items of ``cls``'s objects: ``None`` (the
    tuple protocol) unless the class overrides it."""
    if _reads_as_tuple(cls) and getattr(cls, "__iter__", None) is _tuple_iter:
        return None
    return _tuple_items


# A namedtuple's items are read from the tuple itself, never through methods its class may
# override (a __getitem__ that also takes field names, or one that changes what it returns):
# the spec, its paths (``.field``, read by the field's own accessor) and a rebuild must agree.
_tuple_len = tuple.__len__
_tuple_item = tuple.__getitem__
_tuple_iter = tuple.__iter__
_ALL = slice(None)  # made once: Python makes a slice anew each time it meets ``[:]``


def _tuple_items(obj: tuple[Any, ...]) -> tuple[Any, ...]:
    """The items ``obj`` holds, as a plain tuple (the object itself when it is one)."""
    return _tuple_item(obj, _ALL)


def _reads_as_tuple(cls: type) -> bool:
    """Whether ``len()`` and indexing of ``cls``'s objects are tuple's own (the fast path)."""
    length, item = getattr(cls, "__len__", None), getattr(cls, "__getitem__", None)
    return length is _tuple_len and item is _tuple_item


def _other_class(cls: type, obj: Any) -> str:
    return (
        f"{class_name(cls)} called with its fields gave an object of type "
        f"{class_name(type(obj))} (its __new__ returns another class's objects), so the rebuilt "
        "tree would not be the one taken apart. Keep __new__ returning the class's own objects"
    )


def _changed(cls: type, what: str, method: str) -> str:
    return (
        f"{class_name(cls)} did not keep {what} as given when rebuilt from its fields "
        f"(its {method} changes them), so the rebuilt object would differ from the one taken "
        "apart. Make that conversion outside the class, or keep the values it is given"
    )


#: Every container kind.
CONTAINER_KINDS: tuple[type[Container], ...] = (
    TupleNode,
    ListNode,
    DictNode,
    OrderedDictNode,
    NamedTupleNode,
    DataclassNode,
)

# The kind of each class seen so far: builtins, and registered or described user classes.
# (By id(cls), holding (cls, kind): see _leaves._REGISTERED for why not by class.)
_KIND_OF: dict[int, tuple[type, type[Container]]] = {
    id(kind.python_type): (kind.python_type, kind)
    for kind in CONTAINER_KINDS
    if kind.python_type is not None
}


# The user classes describe met and learned (namedtuples), by id(cls), each held weakly: a class
# made per call goes with the last spec that holds it, and its entry with it (a finalizer, which
# runs before its id can be another object's). Registered classes stay in _KIND_OF for good.
_LEARNED: dict[int, tuple[weakref.ref[type], type[Container]]] = {}


def kind_of(typ: type, /) -> type[Container] | None:
    """The kind of a builtin container type or a user class registered or described."""
    entry = _KIND_OF.get(id(typ))
    if entry is not None:
        return entry[1]
    learned = _LEARNED.get(id(typ))
    return None if learned is None else learned[1]


def _learn(typ: type, kind: type[Container]) -> None:
    """Note the kind of a class ``describe`` met, weakly (see :data:`_LEARNED`)."""
    ident = id(typ)
    _LEARNED[ident] = (weakref.ref(typ), kind)
    weakref.finalize(typ, _LEARNED.pop, ident, None).atexit = False


def container_kind(typ: type, /, *, learn: bool = False) -> type[Container] | None:
    """The container kind (a class of :data:`CONTAINER_KINDS`) of objects of type ``typ``.

    With ``learn=True`` (what :func:`~dualgraph.describe` does) a user class that a kind claims
    on sight (a namedtuple class) is registered. Returns ``None`` if ``typ`` is no container.
    """
    kind = kind_of(typ)
    if kind is not None:
        return kind
    for kind in CONTAINER_KINDS:
        if kind.python_type is None and kind.claims(typ, learn=learn):
            if learn:
                _learn(typ, kind)
            return kind
    return None


def brief_of(obj: Any, /) -> str:
    """What ``obj`` is, for messages: ``float32[2, 3]``, ``a list of length 2``, ``None``."""
    if obj is None:
        return "None"
    typ = type(obj)
    if typ is bool or typ is int or typ is float or typ is str:
        return brief_constant(obj)
    kind = container_kind(typ)
    if kind is not None:
        return kind.brief_of_object(obj)
    try:
        signature = signature_of(obj)
        if signature is not None:
            shape, dtype = signature
            return clip_text(f"{dtype}[{', '.join(map(str, shape))}]")
    except Exception:  # the array type's own signature failed: describe the object
        pass
    if is_instance(obj, _SCALAR_LIKE) and not (
        is_instance(obj, int) and int.bit_length(obj) > MAX_INT_BITS  # (see clip)
    ):
        # A value that stands where a constant would (np.float32(0.5), an IntEnum member, a str
        # subclass): its type alone would not say which value it holds.
        return f"{clip(obj, 60)} (an object of type {class_name(typ)})"
    return f"an object of type {class_name(typ)}"


#: Objects that stand for a value a spec would hold as a constant, shown by their repr too.
_SCALAR_LIKE = (int, float, complex, str, bytes, np.generic, enum.Enum)


# -- registration --------------------------------------------------------------------------------


def _is_namedtuple_class(typ: type) -> bool:
    """A real namedtuple class: optree's test, with distinct fields that are identifiers (they
    name its children's paths)."""
    if not optree.is_namedtuple_class(typ):
        return False
    fields = typ._fields  # type: ignore[attr-defined]
    return all(f.isidentifier() for f in fields) and len(set(fields)) == len(fields)


# What a namedtuple's field names (its attribute, or ``_fields`` read by position) when its class
# leaves them as namedtuple made them; None where this Python makes them otherwise (unchecked).
_PROBED_READER = type(inspect.getattr_static(collections.namedtuple("_Probe", "a"), "a"))
_FIELD_READER = _PROBED_READER if _PROBED_READER.__name__ == "_tuplegetter" else None


def _misread_field(cls: type) -> str | None:
    """Why a spec cannot name the items of the namedtuple class ``cls`` by its ``_fields``, or
    ``None``: a spec reads and rebuilds its items by position and names item ``i`` ``.field``
    (``_fields[i]``), so ``obj.field`` must read item ``i``; a subclass that reorders
    ``_fields`` or overrides a field's attribute (a property) would have a path name a value
    other than the spec's.

    >>> _misread_field(collections.namedtuple("Point", "x y")) is None
    True
    """
    if _FIELD_READER is None:
        return None
    for index, name in enumerate(cls._fields):  # type: ignore[attr-defined]
        reader = inspect.getattr_static(cls, name, None)
        if type(reader) is not _FIELD_READER or reader.__reduce__()[1][0] != index:
            return (
                f"{qualified_name(cls)}: its field {name!r} (item {index} of _fields) is not read "
                "by namedtuple's own accessor of that item (the class overrides it, or reorders "
                f"_fields), so a spec's path .{name} would name another value than the one it "
                "holds there. Keep the fields as namedtuple makes them"
            )
    return None


def _refuse_array_type(cls: type, error: type[Exception], prefix: str = "") -> None:
    """Refuse to make ``cls`` a container if it is an array type: describe would take it for a
    container, check an array's place for an array."""
    if array_type_of(cls) is not None:
        raise error(
            f"{prefix}{qualified_name(cls)}: it is an array type "
            "(dualgraph.register_array_type, or a subclass of one); a class is an array or a "
            "container in a spec, never both"
        )


def container_subclasses(cls: type, /) -> list[tuple[type, type[Container]]]:
    """The user classes known as containers (registered or described) that subclass ``cls``."""
    # A snapshot: issubclass may run code (a metaclass's __subclasscheck__) that describes a
    # tree, and another thread may register or describe meanwhile, either adding classes.
    known = [*_KIND_OF.values(), *[(ref(), kind) for ref, kind in tuple(_LEARNED.values())]]
    return [
        (typ, kind)
        for typ, kind in known
        if typ is not None and kind.python_type is None and issubclass(typ, cls)
    ]


def _bind_name(cls: type) -> None:
    _NAMED[qualified_name(cls)] = cls


def _is_class(obj: Any) -> bool:
    """Whether ``obj`` is a class, by its type alone (``isinstance`` would read an
    ``obj.__class__`` that an object can make fail or lie)."""
    return issubclass(type(obj), type)


def _is_dataclass(cls: type) -> bool:
    """``dataclasses.is_dataclass``, false where the class's own attribute lookup fails (it
    passes on any error but AttributeError)."""
    try:
        return dataclasses.is_dataclass(cls)
    except Exception:
        return False


def register_namedtuple(cls: T, /) -> T:
    """Let specs read from JSON rebuild the namedtuple class ``cls``; usable as a decorator.

    Describing a tree that holds a namedtuple registers its class too; registering names the
    class a spec's ``module:QualName`` means when a class of that name was redefined.

    >>> from typing import NamedTuple
    >>> @register_namedtuple
    ... class Pair(NamedTuple):
    ...     first: int
    ...     second: int
    >>> import dualgraph
    >>> dualgraph.TreeSpec.from_json(dualgraph.describe(Pair(1, 2)).to_json())
    TreeSpec(Pair(first=1, second=2))
    """
    if not (_is_class(cls) and _is_namedtuple_class(cls)):
        raise DualgraphError(f"register_namedtuple expects a namedtuple class, got {clip(cls)}")
    _refuse_array_type(cls, DualgraphError, "cannot register ")
    misread = _misread_field(cls)
    if misread is not None:
        raise DualgraphError(f"cannot register {misread}")
    _bind_name(cls)
    _KIND_OF[id(cls)] = (cls, NamedTupleNode)
    return cls


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
    if not (_is_class(cls) and _is_dataclass(cls)):
        raise DualgraphError(f"register_dataclass expects a dataclass type, got {clip(cls)}")
    _refuse_array_type(cls, DualgraphError, "cannot register ")
    qualified_name(cls)  # a class a spec cannot name is refused before anything is registered
    if id(cls) not in _DATACLASS_FIELDS:
        try:
            fields = dataclasses.fields(cls)
        except Exception as error:  # a __dataclass_fields__ of the class's own making
            raise DualgraphError(
                f"cannot register {qualified_name(cls)}: reading its dataclass fields raised "
                f"{type(error).__name__}: {clip_text(error)}"
            ) from None
        no_init = [f.name for f in fields if not f.init]
        if no_init:
            raise DualgraphError(
                f"cannot register {qualified_name(cls)}: fields {no_init} have init=False, "
                "so the dataclass cannot be rebuilt from its fields"
            )
        names = tuple(f.name for f in fields)
        unnormalized = [n for n in names if unicodedata.normalize("NFKC", n) != n]
        if unnormalized:
            raise DualgraphError(
                f"cannot register {qualified_name(cls)}: Python reads the field names "
                f"{unnormalized} as {[unicodedata.normalize('NFKC', n) for n in unnormalized]} "
                "(NFKC) in __init__, so the dataclass cannot be rebuilt from its fields"
            )
        other = _value_base(cls)
        if other is not None:
            raise DualgraphError(
                f"cannot register {qualified_name(cls)}: it is also a {class_name(other)}, whose "
                "value is none of its fields: a rebuild from its fields would make that value "
                "anew (from its __new__), so it could not be checked or rebuilt as it was. Keep "
                "the value in a field of a dataclass that is no such builtin"
            )
        unfit = _init_problem(cls, names)
        if unfit:
            raise DualgraphError(
                f"cannot register {qualified_name(cls)}: its __init__ {unfit}, so the dataclass "
                "cannot be rebuilt from its fields"
            )

        # The adapters' optree walks (tree_map over outputs: dualgraph.torch.owned) take such an
        # object apart and rebuild it as a spec does, with the same refusals: a rebuild that
        # changes a field, or a dict's entries or a list's items it would lose or make.
        is_dict, count_items, entry_items = _is_dict(cls), _items_counter(cls), _entry_items(cls)
        fieldset = frozenset(names)

        def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...] | None, tuple[str, ...]]:
            held = None
            if is_dict:
                lost = _entries_lost(obj, fieldset)
                if lost:
                    raise DualgraphError(_lost_message(cls, lost))
                held = tuple(key for key, _ in entry_items(obj))
            if count_items is not None and count_items(obj):
                raise DualgraphError(_items_message(cls, count_items(obj)))
            return [getattr(obj, name) for name in names], held, names

        def unflatten(held: tuple[str, ...] | None, children: Any) -> Any:
            return rebuilt_dataclass(cls, names, list(children), held, count_items)

        try:
            optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]
        except Exception as error:  # e.g. registered there already, by optree.dataclasses
            raise DualgraphError(
                f"cannot register {qualified_name(cls)}: optree refused dualgraph's registration "
                f"of its fields in the optree namespace {NAMESPACE!r}, where the adapters "
                f"flatten trees ({type(error).__name__}: {clip_text(error)}); register the "
                "class with dualgraph.register_dataclass alone, or with optree in another "
                "namespace"
            ) from None
        _DATACLASS_FIELDS[id(cls)] = (cls, names)
        _CHANGEABLE.add(id(cls))
    _bind_name(cls)
    _KIND_OF[id(cls)] = (cls, DataclassNode)
    return cls


def _init_problem(cls: type, names: tuple[str, ...]) -> str | None:
    """Why ``cls(**{name: value for each field})`` cannot work (an ``InitVar`` without a default,
    an ``__init__`` of its own), or ``None``."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except Exception:  # no signature to read (or its __signature__ raises): the rebuild will tell
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {p.name for p in parameters if p.kind in keyword}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        accepted.update(names)
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and p.name not in names
    ]
    if required:
        return f"requires {required}, which are not fields"
    unaccepted = [name for name in names if name not in accepted]
    if unaccepted:
        return f"does not take the fields {unaccepted} by keyword"
    return None


def dataclass_fields(cls: type, /) -> tuple[str, ...] | None:
    """The child fields of a registered dataclass, or ``None`` if ``cls`` is not one."""
    entry = _DATACLASS_FIELDS.get(id(cls))
    return None if entry is None else entry[1]
