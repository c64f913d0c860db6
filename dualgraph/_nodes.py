"""The node model of a spec: frozen, typed nodes, one class per leaf kind and container kind.

A spec holds its tree's nodes in pre-order (each container followed by its children's
subtrees), a flat tuple that every operation walks with a loop, so no depth of tree makes
anything recurse. A node knows only itself: a leaf its value or array signature, a container its
kind and its children's labels. Each node class says, for its kind, how to test an object (also
as generated source), how to take it apart and rebuild it, how to show it and how to write and
read its JSON row. The leaves live here; the containers in ``_containers.py``.

Nodes compare by value (a class by identity) and are immutable, so one node object serves every
equal place of a tree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

from ._dtypes import is_dtype_name, numpy_dtype
from ._leaves import MAX_INT_BITS, float_of_text, float_text, int_size, same_float, signature_of
from ._paths import PathEntry

__all__ = [
    "MAX_DIM",
    "MAX_INT_BITS",
    "MAX_NDIM",
    "MAX_NODES",
    "NONE",
    "ArrayLeaf",
    "Bind",
    "ConstLeaf",
    "Container",
    "Leaf",
    "Node",
    "NodeError",
    "NoneLeaf",
    "brief_constant",
    "check_int",
    "check_json_text",
    "class_name",
    "clip",
    "clip_text",
    "hash_part",
    "is_instance",
    "show_constant",
]

#: The most nodes (leaves and containers) a spec may have.
MAX_NODES = 2**20
#: The most dimensions an array leaf may have (numpy's own limit).
MAX_NDIM = 64
#: The largest size of one dimension.
MAX_DIM = 2**63 - 1

#: Binds a value into generated code's namespace and returns the name it has there.
Bind = Callable[[Any, str], str]


class NodeError(Exception):
    """A node cannot be made from what was given; the caller adds the path and re-raises."""


def hash_part(part: Any) -> Any:
    """``part`` (a node's key or a part of it) as hashed: every int by its text, whose hash
    (randomized per process, as every str's) no document can make collide.

    An int hashes by its value modulo 2**61 - 1, and a tuple by a fixed mix of its items'
    hashes: a document could hold any number of ints of one hash, or of tuples of small ints
    of one hash (shapes, a dict's keys, solved for from the mix), and a table of its specs
    would take time quadratic in their number.

    >>> hash_part(("array", (2, 2**61 - 1), "int8", False))
    ('array', ('0x2', '0x1fffffffffffffff'), 'int8', False)
    """
    cls = type(part)
    if cls is int:
        return hex(part)
    if cls is tuple:
        return tuple(map(hash_part, part))
    return part


class Node:
    """One node of a spec. Frozen; compares by :attr:`key`, hashes by :func:`hash_part` of it
    (a dict or set of specs read from documents is not a table keyed by what their ints hash
    to)."""

    __slots__ = ("_hash", "key")

    #: The node's name in JSON rows, e.g. ``"tuple"`` or ``"array"``.
    tag: ClassVar[str]
    #: What the generic walker does with the node: 0 container, 1 None, 2 constant, 3 array.
    op: ClassVar[int]
    #: How many children follow the node in pre-order.
    arity: int
    key: tuple[Any, ...]
    _hash: int  # set by the first __hash__

    def __init__(self, key: tuple[Any, ...]) -> None:
        object.__setattr__(self, "key", key)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is type(self) and self.key == other.key)

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:  # the first time: made when asked (most nodes never are)
            found = hash(hash_part(self.key))
            object.__setattr__(self, "_hash", found)
            return found

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.brief()}>"

    def brief(self) -> str:
        """What the node is, for messages: ``float32[2, 3]``, ``a tuple of length 2``."""
        raise NotImplementedError

    def show(self, parts: Sequence[str]) -> str:
        """The node as it prints in a spec's repr, given its children's ``parts``."""
        raise NotImplementedError

    def row(self) -> list[Any]:
        """The node's JSON row (children are the rows that follow it)."""
        raise NotImplementedError

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> Node:
        """The node of a JSON row with at most ``max_arity`` children; else a :class:`NodeError`."""
        raise NotImplementedError


class Leaf(Node):
    """A leaf: ``None``, a constant or an array."""

    __slots__ = ()
    arity = 0
    #: The kind a :class:`~dualgraph.LeafSpec` reports: ``"none"``, ``"const"`` or ``"array"``.
    kind: ClassVar[str]

    def fits(self, obj: Any) -> bool:
        """Whether ``obj`` may stand here in a flatten without checks (structure only)."""
        return self.matches(obj)

    def matches(self, obj: Any) -> bool:
        """Whether ``obj`` matches the leaf fully (arrays: shape and dtype too)."""
        raise NotImplementedError

    def guard(self, var: str, bind: Bind, *, full: bool) -> str:
        """Source of a condition that is true when ``var`` does not match (see :meth:`fits`)."""
        raise NotImplementedError


class NoneLeaf(Leaf):
    """``None``: part of the structure."""

    __slots__ = ()
    tag = kind = "none"
    op = 1

    def __init__(self) -> None:
        super().__init__(("none",))

    def brief(self) -> str:
        return "None"

    def show(self, parts: Sequence[str]) -> str:
        return "None"

    def row(self) -> list[Any]:
        return ["none"]

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> NoneLeaf:
        if len(row) != 1:
            raise NodeError(f"a none row is ['none'], got {clip(row)}")
        return NONE

    def matches(self, obj: Any) -> bool:
        return obj is None

    def guard(self, var: str, bind: Bind, *, full: bool) -> str:
        return f"{var} is not None"


#: The one ``None`` leaf.
NONE = NoneLeaf()


def show_constant(value: bool | int | float | str) -> str:
    """A constant as a spec shows it: floats as a spec writes them (``nan``, ``-nan``, ``-0.0``;
    see :func:`~dualgraph._leaves.float_text`), others by ``repr``."""
    return float_text(value) if type(value) is float else repr(value)


def brief_constant(value: bool | int | float | str) -> str:
    """A constant for messages: ``int 3``, ``float -nan``, ``str 'x'`` (never raises)."""
    if type(value) is int and value.bit_length() > MAX_INT_BITS:  # (see clip)
        return int_size(value)
    if type(value) is str:  # (clip reprs a long text's start alone)
        return f"str {clip(value)}"
    try:
        shown = show_constant(value)
    except ValueError:  # an int over this interpreter's int/str conversion limit
        return int_size(value)  # type: ignore[arg-type]
    return f"{type(value).__name__} {clip_text(shown)}"


def check_int(value: int) -> None:
    """Refuse an ``int`` too large to print or serialize in every interpreter."""
    if value.bit_length() > MAX_INT_BITS:
        raise NodeError(f"{int_size(value)} is over the {MAX_INT_BITS}-bit limit")


#: A high surrogate followed by a low one: two code points a Python str can hold, which JSON
#: writes as the escapes of one character (``"\\ud83d\\ude00"``) and reads back as it.
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def check_json_text(text: str, what: str) -> None:
    """Refuse to write ``text`` (``what`` it is) to JSON if it would not read back as itself:
    a surrogate pair held as two code points comes back as the one character it encodes."""
    if not text.isascii():
        found = _SURROGATE_PAIR.search(text)
        if found is not None:
            raise NodeError(
                f"{what} {clip(text)} holds the surrogates {ascii(found.group())[1:-1]} as two "
                "code points, which JSON writes as the escapes of one character and reads back "
                f"as {found.group().encode('utf-16', 'surrogatepass').decode('utf-16')!a}"
            )


_CONSTANT_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


class ConstLeaf(Leaf):
    """A ``bool``, ``int``, ``float`` or ``str`` kept by value (floats by their exact text)."""

    __slots__ = ("value",)
    tag = kind = "const"
    op = 2
    value: bool | int | float | str

    def __init__(self, value: bool | int | float | str) -> None:
        cls = type(value)
        if not (cls is bool or cls is int or cls is float or cls is str):  # (== can lie)
            raise NodeError(f"a constant is a bool, int, float or str, not {cls.__name__}")
        if cls is int:
            check_int(value)  # type: ignore[arg-type]
        # By its exact text, a float key tells -0.0 from 0.0 and one NaN from another, and
        # makes a NaN equal to itself.
        canonical = float_text(value) if cls is float else value  # type: ignore[arg-type]
        super().__init__(("const", cls.__name__, canonical))
        object.__setattr__(self, "value", value)

    def brief(self) -> str:
        return brief_constant(self.value)

    def show(self, parts: Sequence[str]) -> str:
        return show_constant(self.value)

    def row(self) -> list[Any]:
        value = self.value
        if type(value) is str:
            check_json_text(value, "the str constant")
        return ["const", type(value).__name__, float_text(value) if type(value) is float else value]

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> ConstLeaf:
        if len(row) != 3 or type(row[1]) is not str or row[1] not in _CONSTANT_TYPES:
            raise NodeError(f"a const row is ['const', bool|int|float|str, value], got {clip(row)}")
        type_name: str = row[1]
        value: Any = row[2]
        if type_name == "float":  # stored as text: strict JSON has no NaN or infinities
            number = float_of_text(value) if type(value) is str else None
            if number is None:
                raise NodeError(
                    f"a float constant is stored as its repr (a NaN other than float('nan') as "
                    f"'-nan' or 'nan:0x' and its 16 hex digits of bits), got {clip(value)}"
                )
            return cls(number)
        if type(value) is not _CONSTANT_TYPES[type_name]:
            raise NodeError(f"a {type_name} constant holds {clip(value)}")
        if type(value) is str:  # what is read must write back (a str document can hold these)
            check_json_text(value, "the str constant")
        return cls(cast("bool | int | float | str", value))

    def matches(self, obj: Any) -> bool:
        value = self.value
        if type(value) is float:
            return same_float(obj, value)
        return type(obj) is type(value) and obj == value

    def guard(self, var: str, bind: Bind, *, full: bool) -> str:
        value = self.value
        if type(value) is float:
            return f"not _same_float({var}, {bind(value, 'c')})"
        return f"type({var}) is not {bind(type(value), 'T')} or {var} != {bind(value, 'c')}"


class ArrayLeaf(Leaf):
    """An array: its shape, neutral dtype name and whether it takes part in backward."""

    __slots__ = ("dtype", "grad", "shape", "signature")
    tag = kind = "array"
    op = 3
    shape: tuple[int, ...]
    dtype: str
    grad: bool
    signature: tuple[tuple[int, ...], str]

    def __init__(self, shape: Sequence[int], dtype: str, grad: bool) -> None:
        shape = check_shape(shape)
        if not is_dtype_name(dtype):
            raise NodeError(
                f"dtype {clip(dtype)} is not one a spec accepts (numeric, bool or JAX key "
                "dtypes; see dualgraph.DTYPE_NAMES)"
            )
        if type(grad) is not bool:
            raise NodeError(f"grad is a bool, got {clip(grad)}")
        super().__init__(("array", shape, dtype, grad))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "grad", grad)
        object.__setattr__(self, "signature", (shape, dtype))

    def brief(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def show(self, parts: Sequence[str]) -> str:
        return f"{self.brief()}(grad)" if self.grad else self.brief()

    def row(self) -> list[Any]:
        return ["array", self.dtype, list(self.shape), self.grad]

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> ArrayLeaf:
        if len(row) != 4 or type(row[2]) is not list:
            raise NodeError(f"an array row is ['array', dtype, [dims], grad], got {clip(row)}")
        return cls(row[2], row[1], row[3])

    def with_grad(self, grad: bool) -> ArrayLeaf:
        return self if grad is self.grad else ArrayLeaf(self.shape, self.dtype, grad)

    def fits(self, obj: Any) -> bool:
        return obj is not None

    def matches(self, obj: Any) -> bool:
        try:
            found = signature_of(obj)
        except Exception:  # an array type's own signature failed: not a match
            return False
        return found is not None and found == self.signature

    def guard(self, var: str, bind: Bind, *, full: bool) -> str:
        if not full:  # shapes and dtypes are check's job, but None is part of the structure
            return f"{var} is None"
        expected = bind(self.signature, "e")
        dtype = numpy_dtype(self.dtype)
        if dtype is None:
            return f"_signature({var}) != {expected}"
        # numpy arrays compare natively (no dtype name lookup); other arrays by signature
        native = f"type({var}) is _ndarray and {var}.shape == {bind(self.shape, 's')}"
        native += f" and {var}.dtype == {bind(dtype, 'd')}"
        return f"not ({native}) and _signature({var}) != {expected}"


def check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, each in ``[0, MAX_DIM]``, at most ``MAX_NDIM`` of them."""
    if not isinstance(shape, (tuple, list)):
        raise NodeError(f"a shape is a sequence of ints, got {clip(shape)}")
    if len(shape) > MAX_NDIM:
        raise NodeError(f"a shape has at most {MAX_NDIM} dimensions, got {len(shape)}")
    dims = []
    for dim in shape:
        if type(dim) is not int:
            if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
                raise NodeError(f"bad shape {clip(shape)}: {clip(dim)} is not an int")
            found = dim.__index__()
            # Kept only as an exact int: a bool (or an int subclass) would print, compare and
            # write as itself, and a spec written with [true] in a shape does not read back.
            if type(found) is not int:
                if isinstance(found, bool) or not isinstance(found, int):
                    raise NodeError(
                        f"bad shape {clip(shape)}: {clip(dim)} gave {clip(found)} as its "
                        "__index__, not an int"
                    )
                found = int.__index__(found)
            dim = found
        if not 0 <= dim <= MAX_DIM:
            raise NodeError(f"bad shape {clip(shape)}: dimensions are in [0, 2**63 - 1]")
        dims.append(dim)
    return tuple(dims)


class Container(Node):
    """A container kind; see ``_containers.py`` for one class per kind.

    A container's children are in *flatten order*: the order their leaves flatten in, which
    is the user's order except for a dict's keys, sorted as optree sorts them.
    """

    __slots__ = ("arity", "entries")
    op = 0
    #: The exact Python type of a builtin kind (``None`` for user classes).
    python_type: ClassVar[Any] = None
    #: The path entry of each child, in flatten order.
    entries: tuple[PathEntry, ...]

    def __init__(self, key: tuple[Any, ...], entries: tuple[PathEntry, ...]) -> None:
        super().__init__(key)
        object.__setattr__(self, "arity", len(entries))
        object.__setattr__(self, "entries", entries)

    @classmethod
    def describe(cls, obj: Any, intern: dict[Any, Node]) -> tuple[Node, Sequence[Any]]:
        """The node of ``obj`` (shared through ``intern``) and ``obj``'s children."""
        raise NotImplementedError

    @classmethod
    def from_row(cls, row: list[Any], max_arity: int) -> Container:
        """The node of a JSON row with at most ``max_arity`` children; else a :class:`NodeError`."""
        raise NotImplementedError

    @classmethod
    def brief_of_object(cls, obj: Any) -> str:
        """What ``obj``, an object of this kind, is, for messages."""
        raise NotImplementedError

    @classmethod
    def claims(cls, typ: type, *, learn: bool) -> bool:
        """Whether this kind takes objects of the user class ``typ`` it has not seen yet
        (``learn``: ``describe`` met one). Builtin kinds match their ``python_type`` instead."""
        return False

    def children_of(self, obj: Any) -> Sequence[Any] | None:
        """The children of ``obj`` in flatten order, or ``None`` if ``obj`` does not match."""
        raise NotImplementedError

    def rebuild(self, values: list[Any]) -> Any:
        """An object of this kind with ``values`` (in flatten order) as its children."""
        raise NotImplementedError

    def guard(self, var: str, bind: Bind) -> str:
        """Source of a condition that is true when ``var`` is not an object of this node."""
        raise NotImplementedError

    def child(self, var: str, index: int, bind: Bind) -> str:
        """Source of an expression for the ``index``-th child of ``var`` (flatten order)."""
        raise NotImplementedError

    def rebuild_source(self, parts: Sequence[str], bind: Bind) -> str:
        """Source of an expression rebuilding this node from its children's (flatten order)."""
        raise NotImplementedError

    def difference(self, obj: Any, children: Sequence[Node]) -> tuple[PathEntry | None, str]:
        """How ``obj``, which :meth:`children_of` refused, differs: (child entry or None, text)."""
        raise NotImplementedError


def clip(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages (never raises).

    A list or tuple is shown item by item up to the limit, a long str or bytes by its start
    (its whole repr would copy it: a 200 MB text took 1.5 s), and an int over ``MAX_INT_BITS``
    by its size: converting an int of n digits to text takes time quadratic in n where a
    program lifted the interpreter's limit (``sys.set_int_max_str_digits(0)``).

    >>> clip([1, 2**5000, "x"])
    "[1, <an int of 5001 bits>, 'x']"
    """
    try:
        text = _short_repr(value, limit)
    except Exception:  # a repr that fails, or an int too long to print
        text = f"<{type(value).__name__}>"
    return clip_text(text, limit)


def _short_repr(value: Any, limit: int) -> str:
    """``repr(value)``, or enough of it to show ``limit`` characters (see :func:`clip`)."""
    cls = type(value)
    if cls is int and value.bit_length() > MAX_INT_BITS:
        return f"<{int_size(value)}>"
    text: Any
    for text in (str, bytes):  # a long one by its start: its whole repr would copy it all
        if isinstance(value, text) and text.__len__(value) > limit:
            return repr(text.__getitem__(value, slice(0, max(limit, 0))))  # (clip_text cuts it)
    if cls is not list and cls is not tuple:
        return repr(value)
    parts: list[str] = []
    size = 0
    for item in value:
        if size > limit:
            parts.append("...")
            break
        part = _short_repr(item, limit - size)
        parts.append(part)
        size += len(part) + 2
    if cls is list:
        return "[" + ", ".join(parts) + "]"
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def clip_text(value: Any, limit: int = 120) -> str:
    """``str(value)`` cut to ``limit`` characters, for messages (never raises)."""
    try:
        text = value if type(value) is str else str(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_instance(obj: Any, types: Any) -> bool:
    """``isinstance(obj, types)``, false where the test itself raises: it reads ``obj.__class__``,
    which an object can make fail, and an abstract base may run code of its own."""
    try:
        return isinstance(obj, types)
    except Exception:
        return False


def class_name(cls: Any) -> str:
    """``module.QualName`` of a class, for messages (never raises: a class's ``__module__`` can
    be set to any object)."""
    parts = []
    for attribute in ("__module__", "__qualname__"):
        try:
            value = getattr(cls, attribute, None)
        except Exception:
            value = None
        parts.append(value if type(value) is str else clip(value, 60))
    return ".".join(parts)
