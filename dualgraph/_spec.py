"""TreeSpec: a framework-neutral description of a tree of arrays, constants and ``None``.

A spec records the containers of a tree, where its ``None`` leaves and constants are, each array
leaf's shape and neutral dtype name, and the grad mask (which array leaves take part in backward).
Everything that can be is precomputed when the spec is made, so :meth:`TreeSpec.flatten`,
:meth:`TreeSpec.unflatten` and :meth:`TreeSpec.check` stay cheap enough to run on every replay.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree

from ._compile import compile_spec
from ._containers import NAMESPACE, dataclass_fields, qualified_name, resolve_type
from ._errors import DualgraphError, SpecMismatchError, UnsupportedLeafError
from ._leaves import CONSTANT_TYPES, array_type_of
from ._paths import EntryKind, join_path, show_path

__all__ = ["SPEC_FORMAT", "SPEC_VERSION", "LeafSpec", "TreeSpec", "describe"]

SPEC_FORMAT = "dualgraph.TreeSpec"
SPEC_VERSION = 1

Constant = bool | int | float | str
Node = dict[str, Any]

_CONSTANT_TYPE_NAMES: dict[type, str] = {t: t.__name__ for t in CONSTANT_TYPES}
_CONSTANT_TYPES_BY_NAME: dict[str, type] = {n: t for t, n in _CONSTANT_TYPE_NAMES.items()}
_MAPPING_NODES = ("dict", "ordereddict")
_FIELD_NODES = ("namedtuple", "dataclass")


@dataclass(frozen=True)
class LeafSpec:
    """One leaf of a spec: an array (shape, dtype, grad), a constant (value) or ``None``.

    >>> import numpy as np
    >>> describe((np.zeros((2, 3), np.float32), None)).leaves[0]
    LeafSpec(kind='array', path='[0]', shape=(2, 3), dtype='float32', grad=True, value=None)
    """

    kind: str
    path: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    grad: bool = False
    value: Constant | None = None

    def __str__(self) -> str:
        return _show_leaf(_leaf_node(self))


def describe(tree: Any, /, *, root: str = "") -> TreeSpec:
    """Describe ``tree``: its containers, ``None`` leaves, constants and array leaves.

    ``root`` prefixes the paths in error messages (e.g. ``"args"``); the spec's own
    :attr:`~TreeSpec.paths` always start at the tree's root.

    >>> import numpy as np
    >>> spec = describe({"hidden": np.ones((2, 4), np.float32), "aux_loss": None, "n": 3})
    >>> spec
    TreeSpec({'hidden': float32[2, 4](grad), 'aux_loss': None, 'n': 3})
    >>> spec.paths
    ("['aux_loss']", "['hidden']", "['n']")
    """
    return TreeSpec(_node_of(tree, root, strict=True))


class TreeSpec:
    """The description of a tree; see :func:`describe` and :meth:`from_json`.

    Leaves are ordered as optree flattens the tree (dict keys sorted); dicts keep the user's
    key order when unflattened. A dict with the same keys in another order passes :meth:`check`.

    >>> import numpy as np
    >>> spec = describe((np.zeros(3, np.float32), None))
    >>> out = spec.unflatten(spec.flatten((np.ones(3, np.float32), None)))
    >>> out[1] is None, spec.grad_mask
    (True, (True,))
    """

    __slots__ = (
        "_array_index",
        "_array_positions",
        "_compiled",
        "_hash",
        "_json",
        "_leaves",
        "_node",
        "_treedef",
    )

    def __init__(self, node: Node, /) -> None:
        """Build a spec from its JSON node; users call :func:`describe` or :meth:`from_json`."""
        slots: list[_Slot] = []
        skeleton = _skeleton_of(node, "", slots)
        ordered, treedef = optree.tree_flatten(skeleton, none_is_leaf=True, namespace=NAMESPACE)
        leaves = tuple(slot.leaf for slot in ordered)
        array_rank = {id(s): k for k, s in enumerate(s for s in ordered if s.leaf.kind == "array")}
        positions = [array_rank[id(s)] for s in slots if s.leaf.kind == "array"]
        self._node = node
        self._treedef = treedef
        self._leaves = leaves
        self._array_index = tuple(i for i, leaf in enumerate(leaves) if leaf.kind == "array")
        self._array_positions = positions
        self._compiled = compile_spec(node, positions)
        self._json: str | None = None
        self._hash: int | None = None

    # -- what the spec says -------------------------------------------------------------------

    @property
    def leaves(self) -> tuple[LeafSpec, ...]:
        """Every leaf (arrays, constants and ``None``) in flatten order."""
        return self._leaves

    @property
    def paths(self) -> tuple[str, ...]:
        """A readable path for every leaf, e.g. ``[1]['aux_loss']``; the root is ``''``."""
        return tuple(leaf.path for leaf in self._leaves)

    @property
    def arrays(self) -> tuple[LeafSpec, ...]:
        """The array leaves, in the order :meth:`flatten` returns them."""
        return tuple(self._leaves[i] for i in self._array_index)

    @property
    def array_paths(self) -> tuple[str, ...]:
        """The path of each array leaf, aligned with :meth:`flatten` and :attr:`grad_mask`."""
        return tuple(self._leaves[i].path for i in self._array_index)

    @property
    def num_arrays(self) -> int:
        """How many array leaves :meth:`flatten` returns."""
        return len(self._array_index)

    @property
    def grad_mask(self) -> tuple[bool, ...]:
        """One bool per array leaf: does it take part in backward?"""
        return tuple(self._leaves[i].grad for i in self._array_index)

    def with_grad_mask(self, mask: Sequence[bool], /) -> TreeSpec:
        """The same spec with another grad mask (one bool per array leaf).

        >>> import numpy as np
        >>> describe((np.zeros(2, np.float32),)).with_grad_mask([False]).grad_mask
        (False,)
        """
        mask = [bool(m) for m in mask]
        if len(mask) != self.num_arrays:
            raise DualgraphError(
                f"grad mask has {len(mask)} entries, the spec has {self.num_arrays} array leaves"
            )
        # The mask is in flatten order (dict keys sorted); the node lists keys in the user's order.
        flags = iter([mask[position] for position in self._array_positions])
        return TreeSpec(_map_array_nodes(self._node, lambda leaf: {**leaf, "grad": next(flags)}))

    # -- the hot path -------------------------------------------------------------------------

    def flatten(self, tree: Any, /, *, check: bool = False, root: str = "") -> list[Any]:
        """The array leaves of ``tree`` in spec order.

        Structure, ``None`` positions and constants are always checked; with ``check=True``
        every array's shape and dtype too (as :meth:`check` does, in the same pass). A mismatch
        raises :class:`SpecMismatchError`; ``root`` prefixes the paths in its message.

        >>> import numpy as np
        >>> spec = describe({"x": np.zeros(2, np.float32), "aux": None})
        >>> spec.flatten({"x": np.ones(2, np.float32), "aux": None})
        [array([1., 1.], dtype=float32)]
        """
        arrays = (self._compiled.check if check else self._compiled.flatten)(tree)
        if arrays is None:
            raise self.mismatch(tree, root=root)
        return arrays

    def unflatten(self, arrays: Sequence[Any], /) -> Any:
        """Rebuild the tree from its array leaves; ``None`` and constants are restored."""
        if len(arrays) != len(self._array_index):
            raise SpecMismatchError(
                f"unflatten: expected {len(self._array_index)} arrays, got {len(arrays)}"
            )
        return self._compiled.unflatten(arrays)

    def check(self, tree: Any, /, *, root: str = "") -> None:
        """Raise :class:`SpecMismatchError` naming the first leaf where ``tree`` differs.

        Structure, leaf kind, shape, dtype and constant values are compared; the grad flag is
        not (it is a property of how a tree is used). ``root`` prefixes the paths in messages.

        >>> import numpy as np
        >>> spec = describe({"mask": np.zeros((2, 8), np.float32)})
        >>> try:
        ...     spec.check({"mask": np.zeros((2, 9), np.float32)}, root="kwargs")
        ... except SpecMismatchError as error:
        ...     print(error)
        kwargs['mask']: expected float32[2, 8], got float32[2, 9]
        """
        if self._compiled.check(tree) is None:
            raise self.mismatch(tree, root=root)

    def mismatch(self, tree: Any, /, *, root: str = "") -> SpecMismatchError:
        """The error explaining how ``tree`` differs from this spec (slow path, for messages)."""
        found = _node_of(tree, "", strict=False)
        difference = _first_difference(self._node, found, "")
        if difference is None:
            return SpecMismatchError(
                f"{show_path(root)}: the tree does not match the spec {self!r}", path=root
            )
        path, message = difference
        path = root + path
        return SpecMismatchError(f"{show_path(path)}: {message}", path=path)

    # -- serialization, equality, display -----------------------------------------------------

    def to_json(self) -> str:
        """Serialize: sorted keys, no framework or device names, stable across processes.

        >>> import numpy as np
        >>> describe((np.zeros(2, np.int64), None)).to_json()[:60]
        '{"format":"dualgraph.TreeSpec","tree":{"children":[{"dtype":'
        """
        if self._json is None:
            document = {"format": SPEC_FORMAT, "version": SPEC_VERSION, "tree": self._node}
            self._json = json.dumps(
                document, sort_keys=True, separators=(",", ":"), allow_nan=False
            )
        return self._json

    @classmethod
    def from_json(cls, text: str, /) -> TreeSpec:
        """Load a spec written by :meth:`to_json` (in any process, by any framework)."""
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise DualgraphError(f"not a TreeSpec JSON document: {error}") from None
        if not isinstance(document, dict) or document.get("format") != SPEC_FORMAT:
            raise DualgraphError(f"not a TreeSpec JSON document (format must be {SPEC_FORMAT!r})")
        if document.get("version") != SPEC_VERSION:
            raise DualgraphError(
                f"TreeSpec JSON version {document.get('version')!r} is not supported "
                f"(this dualgraph reads version {SPEC_VERSION})"
            )
        node = document.get("tree")
        _validate_node(node, "")
        return cls(node)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeSpec):
            return NotImplemented
        return self._node == other._node

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.to_json())
        return self._hash

    def __repr__(self) -> str:
        return f"TreeSpec({_show_node(self._node)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return TreeSpec.from_json, (self.to_json(),)


# -- building the node of a tree ----------------------------------------------------------------


def _node_of(obj: Any, path: str, *, strict: bool) -> Node:
    """The JSON node describing ``obj``; with ``strict=False`` unknown leaves are described too."""
    if obj is None:
        return {"leaf": "none"}
    cls = type(obj)
    if cls in _CONSTANT_TYPE_NAMES:
        value = repr(obj) if cls is float else obj
        return {"leaf": "const", "type": _CONSTANT_TYPE_NAMES[cls], "value": value}
    array_type = array_type_of(cls)
    if array_type is not None:
        shape, dtype = array_type.signature(obj)
        grad = bool(array_type.requires_grad(obj))
        return {"leaf": "array", "shape": list(shape), "dtype": dtype, "grad": grad}
    if cls is tuple or cls is list:
        children = [
            _node_of(c, join_path(path, i, "index"), strict=strict) for i, c in enumerate(obj)
        ]
        return {"node": cls.__name__, "children": children}
    if cls is dict or cls is collections.OrderedDict:
        keys = list(obj)
        for key in keys:
            if type(key) not in (str, int):
                if not strict:
                    return _object_node(obj)
                raise UnsupportedLeafError(
                    f"{show_path(path)}: dict key {key!r} of type {type(key).__name__} is not "
                    "supported; spec dict keys are str or int",
                    path=path,
                )
        children = [_node_of(obj[k], join_path(path, k, "key"), strict=strict) for k in keys]
        kind = "dict" if cls is dict else "ordereddict"
        return {"node": kind, "keys": keys, "children": children}
    if optree.is_namedtuple_class(cls):
        fields = list(cls._fields)
        children = [
            _node_of(c, join_path(path, f, "attr"), strict=strict) for f, c in zip(fields, obj)
        ]
        return {
            "node": "namedtuple",
            "type": qualified_name(cls),
            "fields": fields,
            "children": children,
        }
    fields_of_dataclass = dataclass_fields(cls)
    if fields_of_dataclass is not None:
        fields = list(fields_of_dataclass)
        children = [
            _node_of(getattr(obj, f), join_path(path, f, "attr"), strict=strict) for f in fields
        ]
        return {
            "node": "dataclass",
            "type": qualified_name(cls),
            "fields": fields,
            "children": children,
        }
    if not strict:
        return _object_node(obj)
    raise UnsupportedLeafError(
        f"{show_path(path)}: unsupported leaf of type {cls.__module__}.{cls.__qualname__}. "
        "A spec holds arrays (numpy, torch, jax), None, int/float/bool/str constants, and "
        "tuple/list/dict/OrderedDict/namedtuple containers. Register a dataclass with "
        "dualgraph.register_dataclass(cls) or another array type with "
        "dualgraph.register_array_type(cls, signature=..., requires_grad=...).",
        path=path,
    )


def _object_node(obj: Any) -> Node:
    return {"leaf": "object", "type": qualified_name(type(obj))}


def _map_array_nodes(node: Node, change: Any) -> Node:
    if "leaf" in node:
        return change(node) if node["leaf"] == "array" else node
    return {**node, "children": [_map_array_nodes(c, change) for c in node["children"]]}


# -- from a node to the optree structure and leaf specs -----------------------------------------


class _Slot:
    """A stand-in leaf in the skeleton tree from which the optree structure is taken."""

    __slots__ = ("leaf",)

    def __init__(self, leaf: LeafSpec) -> None:
        self.leaf = leaf


def _skeleton_of(node: Node, path: str, slots: list[_Slot]) -> Any:
    if "leaf" in node:
        slot = _Slot(_leaf_spec(node, path))
        slots.append(slot)
        return slot
    kind = node["node"]
    children = node["children"]
    if kind in ("tuple", "list"):
        items = [
            _skeleton_of(c, join_path(path, i, "index"), slots) for i, c in enumerate(children)
        ]
        return tuple(items) if kind == "tuple" else items
    if kind in _MAPPING_NODES:
        pairs = [
            (k, _skeleton_of(c, join_path(path, k, "key"), slots))
            for k, c in zip(node["keys"], children)
        ]
        return dict(pairs) if kind == "dict" else collections.OrderedDict(pairs)
    cls = resolve_type(node["type"])
    values = [
        _skeleton_of(c, join_path(path, f, "attr"), slots) for f, c in zip(node["fields"], children)
    ]
    if kind == "namedtuple":
        return cls(*values)
    if dataclass_fields(cls) is None:
        raise DualgraphError(
            f"{show_path(path)}: {node['type']} is not a registered dataclass; "
            "call dualgraph.register_dataclass on it before loading the spec"
        )
    return cls(**dict(zip(node["fields"], values)))


def _leaf_spec(node: Node, path: str) -> LeafSpec:
    kind = node["leaf"]
    if kind == "array":
        return LeafSpec("array", path, tuple(node["shape"]), node["dtype"], node["grad"])
    if kind == "const":
        cls = _CONSTANT_TYPES_BY_NAME[node["type"]]
        value = float(node["value"]) if cls is float else node["value"]
        return LeafSpec("const", path, value=value)
    return LeafSpec("none", path)


def _leaf_node(leaf: LeafSpec) -> Node:
    if leaf.kind == "array":
        return {
            "leaf": "array",
            "shape": list(leaf.shape or ()),
            "dtype": leaf.dtype,
            "grad": leaf.grad,
        }
    if leaf.kind == "const":
        value = leaf.value
        shown = repr(value) if type(value) is float else value
        return {"leaf": "const", "type": type(value).__name__, "value": shown}
    return {"leaf": "none"}


# -- explaining differences ----------------------------------------------------------------------


def _first_difference(expected: Node, found: Node, path: str) -> tuple[str, str] | None:
    """``(path, message)`` of the first place where ``found`` differs from ``expected``."""
    if "leaf" in expected or "leaf" in found:
        if _leaf_identity(expected) != _leaf_identity(found):
            return path, f"expected {_show_brief(expected)}, got {_show_brief(found)}"
        return None
    kind = expected["node"]
    if kind != found["node"] or expected.get("type") != found.get("type"):
        return path, f"expected {_show_brief(expected)}, got {_show_brief(found)}"
    if kind in _MAPPING_NODES:
        expected_children = dict(zip(expected["keys"], expected["children"]))
        found_children = dict(zip(found["keys"], found["children"]))
        for key in expected["keys"]:
            if key not in found_children:
                missing = _show_brief(expected_children[key])
                return join_path(path, key, "key"), f"missing (expected {missing})"
        for key in found["keys"]:
            if key not in expected_children:
                extra = _show_brief(found_children[key])
                return join_path(path, key, "key"), f"unexpected entry {extra}"
        if kind == "ordereddict" and expected["keys"] != found["keys"]:
            return path, f"expected keys in the order {expected['keys']}, got {found['keys']}"
        for key in _sorted_keys(expected["keys"]):
            difference = _first_difference(
                expected_children[key], found_children[key], join_path(path, key, "key")
            )
            if difference is not None:
                return difference
        return None
    if kind in _FIELD_NODES:
        if expected["fields"] != found["fields"]:
            return path, f"expected fields {expected['fields']}, got {found['fields']}"
        entries: list[tuple[Any, EntryKind]] = [(f, "attr") for f in expected["fields"]]
    else:
        if len(expected["children"]) != len(found["children"]):
            return path, f"expected {_show_brief(expected)}, got {_show_brief(found)}"
        entries = [(i, "index") for i in range(len(expected["children"]))]
    for (entry, entry_kind), e, f in zip(entries, expected["children"], found["children"]):
        difference = _first_difference(e, f, join_path(path, entry, entry_kind))
        if difference is not None:
            return difference
    return None


def _sorted_keys(keys: list[Any]) -> list[Any]:
    try:
        return sorted(keys)
    except TypeError:
        return list(keys)


def _leaf_identity(node: Node) -> tuple[Any, ...]:
    kind = node.get("leaf")
    if kind == "array":
        return ("array", tuple(node["shape"]), node["dtype"])
    if kind == "const":
        value = node["value"]
        if node["type"] == "float":  # by repr: NaN equals NaN, 0.0 differs from -0.0
            return ("const", "float", repr(float(value)))
        return ("const", node["type"], value)
    if kind == "object":
        return ("object", node["type"])
    if kind == "none":
        return ("none",)
    return ("node", node["node"])


def _show_brief(node: Node) -> str:
    """A short description of a node for error messages."""
    kind = node.get("leaf")
    if kind == "array":
        return _show_leaf(node)
    if kind == "const":
        return f"{node['type']} {_show_leaf(node)}"
    if kind == "none":
        return "None"
    if kind == "object":
        return f"an object of type {node['type'].replace(':', '.')}"
    container = node["node"]
    if container in _MAPPING_NODES:
        article = "an" if container == "ordereddict" else "a"
        return f"{article} {container} with keys {node['keys']}"
    if container in _FIELD_NODES:
        return f"a {node['type'].replace(':', '.')}"
    return f"a {container} of length {len(node['children'])}"


def _show_leaf(node: Node) -> str:
    kind = node["leaf"]
    if kind == "array":
        shape = ", ".join(str(d) for d in node["shape"])
        return f"{node['dtype']}[{shape}]"
    if kind == "const":
        return str(node["value"]) if node["type"] == "float" else repr(node["value"])
    if kind == "none":
        return "None"
    return f"<{node['type'].replace(':', '.')}>"


def _show_node(node: Node) -> str:
    """The tree as it would print, with leaves described: ``(float32[2, 3](grad), None)``."""
    if "leaf" in node:
        shown = _show_leaf(node)
        return f"{shown}(grad)" if node["leaf"] == "array" and node["grad"] else shown
    kind = node["node"]
    parts = [_show_node(c) for c in node["children"]]
    if kind == "tuple":
        return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"
    if kind == "list":
        return f"[{', '.join(parts)}]"
    if kind in _MAPPING_NODES:
        body = ", ".join(f"{k!r}: {p}" for k, p in zip(node["keys"], parts))
        return "{" + body + "}" if kind == "dict" else f"OrderedDict({{{body}}})"
    name = node["type"].rpartition(":")[2]
    body = ", ".join(f"{f}={p}" for f, p in zip(node["fields"], parts))
    return f"{name}({body})"


# -- validating JSON input -----------------------------------------------------------------------


def _validate_node(node: Any, path: str) -> None:
    def fail(what: str) -> None:
        raise DualgraphError(f"malformed TreeSpec JSON at {show_path(path)}: {what}")

    if not isinstance(node, dict):
        fail(f"expected an object, got {node!r}")
    if "leaf" in node:
        kind = node["leaf"]
        if kind == "array":
            shape, dtype = node.get("shape"), node.get("dtype")
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                fail(f"bad shape {shape!r}")
            if not isinstance(dtype, str) or not isinstance(node.get("grad"), bool):
                fail("an array leaf needs a dtype string and a grad bool")
        elif kind == "const":
            cls = _CONSTANT_TYPES_BY_NAME.get(node.get("type", ""))
            value = node.get("value")
            stored = str if cls is float else cls
            if cls is None or type(value) is not stored:
                fail(f"bad constant {node!r}")
            if cls is float:
                try:
                    float(value)
                except ValueError:
                    fail(f"bad float constant {value!r}")
        elif kind != "none":
            fail(f"unknown leaf kind {kind!r}")
        return
    kind = node.get("node")
    children = node.get("children")
    if kind not in ("tuple", "list", *_MAPPING_NODES, *_FIELD_NODES) or not isinstance(
        children, list
    ):
        fail(f"unknown or incomplete node {kind!r}")
    labels = node.get("keys") if kind in _MAPPING_NODES else node.get("fields")
    if kind in (*_MAPPING_NODES, *_FIELD_NODES) and (
        not isinstance(labels, list) or len(labels) != len(children)
    ):
        fail(f"{kind} needs one key or field per child")
    if kind in _MAPPING_NODES and any(type(key) not in (str, int) for key in labels):
        fail(f"{kind} keys must be str or int, got {labels!r}")
    if kind in _FIELD_NODES and not all(isinstance(f, str) and f.isidentifier() for f in labels):
        fail(f"{kind} fields must be identifiers, got {labels!r}")
    if kind in _FIELD_NODES and not isinstance(node.get("type"), str):
        fail(f"{kind} needs a type name")
    for i, child in enumerate(children):
        label = labels[i] if labels is not None else i
        entry_kind: EntryKind = "key" if kind in _MAPPING_NODES else "attr" if labels else "index"
        _validate_node(child, join_path(path, label, entry_kind))
