"""TreeSpec: a framework-neutral description of a tree of arrays, constants and ``None``.

A spec records the containers of a tree, where its ``None`` leaves and constants are, each array
leaf's shape and neutral dtype name, and the grad mask (which array leaves take part in backward).
It holds the tree's nodes (``_nodes.py``, ``_containers.py``) in pre-order, and everything is
done with loops over them, so any depth of tree works. What can be is precomputed when the spec
is made (``_compile.py``), so :meth:`TreeSpec.flatten`, :meth:`TreeSpec.unflatten` and
:meth:`TreeSpec.check` stay cheap enough to run on every replay.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ._compile import compile_program
from ._containers import NamedContainer, brief_of, container_kind
from ._dtypes import is_differentiable_dtype
from ._errors import DualgraphError, SpecMismatchError, UnsupportedLeafError
from ._json import next_entries, read_document, read_tree, write_document
from ._leaves import (
    CONSTANT_TYPES,
    array_type_of,
    float_text,
    numpy_dtype_name,
    numpy_is_native,
    refusal_of,
    strict_bool,
)
from ._nodes import (
    MAX_NODES,
    NONE,
    ArrayLeaf,
    ConstLeaf,
    Container,
    Leaf,
    Node,
    NodeError,
    class_name,
    clip,
    clip_text,
    hash_part,
    is_instance,
    show_constant,
)
from ._paths import PathEntry, format_path, show_path

__all__ = ["SPEC_FORMAT", "SPEC_VERSION", "LeafSpec", "TreeSpec", "describe", "map_arrays"]

SPEC_FORMAT = "dualgraph.TreeSpec"
SPEC_VERSION = 2
#: The most characters the leaf paths of :attr:`TreeSpec.leaves` (or ``arrays``) may hold: a
#: tree with leaves at every level of a deep spine has paths quadratic in its size.
MAX_PATH_CHARS = 2**26

Constant = bool | int | float | str


@dataclass(frozen=True, eq=False)
class LeafSpec:
    """One leaf of a spec: an array (shape, dtype, grad), a constant (value) or ``None``.

    ``path`` is the leaf's accessor expression; ``entries`` the same path as typed entries
    (:class:`~dualgraph.Index`, :class:`~dualgraph.Key`, :class:`~dualgraph.Attr`). Leaves
    compare as a spec's nodes do: a constant with its type (``True`` is not ``1``), a float by
    its exact text (``-0.0`` is not ``0.0``, NaN equals NaN, ``-nan`` is not ``nan``).

    >>> import numpy as np
    >>> leaf = describe((np.zeros((2, 3), np.float32), None)).leaves[0]
    >>> leaf
    LeafSpec(kind='array', path='[0]', shape=(2, 3), dtype='float32', grad=True, value=None)
    >>> leaf.entries
    (Index(index=0),)
    """

    kind: str
    path: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    grad: bool = False
    value: Constant | None = None
    entries: tuple[PathEntry, ...] = field(default=(), repr=False, compare=False)

    def __eq__(self, other: object) -> bool:
        if not is_instance(other, LeafSpec):  # (an object's __class__ can raise)
            return NotImplemented
        return self._identity() == cast(LeafSpec, other)._identity()

    def __hash__(self) -> int:
        return hash(hash_part(self._identity()))

    def _identity(self) -> tuple[Any, ...]:
        value: Any = self.value
        if value is not None:
            value = (type(value).__name__, float_text(value) if type(value) is float else value)
        return (self.kind, self.path, self.shape, self.dtype, self.grad, value)

    def __str__(self) -> str:
        if self.kind == "array":
            return f"{self.dtype}[{', '.join(map(str, self.shape or ()))}]"
        return "None" if self.kind == "none" else show_constant(self.value)  # type: ignore[arg-type]


def describe(tree: Any, /, *, root: str = "") -> TreeSpec:
    """Describe ``tree``: its containers, ``None`` leaves, constants and array leaves.

    ``root`` prefixes the paths in error messages (e.g. ``"args"``); the spec's own
    :attr:`~TreeSpec.paths` always start at the tree's root. Describing a tree with a namedtuple
    registers its class (see :func:`~dualgraph.register_namedtuple`).

    >>> import numpy as np
    >>> spec = describe({"hidden": np.ones((2, 4), np.float32), "aux_loss": None, "n": 3})
    >>> spec
    TreeSpec({'hidden': float32[2, 4](grad), 'aux_loss': None, 'n': 3})
    >>> spec.paths
    ("['aux_loss']", "['hidden']", "['n']")
    """
    return TreeSpec(_describe_nodes(tree, _checked_root(root)))


def map_arrays(fn: Callable[[Any], Any], tree: Any, /, *, root: str = "") -> Any:
    """``tree`` with each array leaf ``x`` replaced by ``fn(x)``, taken apart and rebuilt as a
    spec does: a class whose ``__new__`` or ``__post_init__`` changes the values it is given is
    refused naming the path, never converted a second time, and an ``OrderedDict`` keeps its
    own order. What an adapter hands back rebuilt (``dualgraph.torch.owned``'s clones) goes
    through here, not through optree's ``tree_map``, which calls a namedtuple class bare and
    rebuilds an ``OrderedDict`` in the insertion order beneath (``move_to_end`` undone).
    ``root`` prefixes the paths in error messages; a tree :func:`describe` refuses is refused.

    >>> import collections, numpy as np
    >>> moved = collections.OrderedDict(a=np.ones(1), b=None)
    >>> moved.move_to_end("a")
    >>> map_arrays(lambda x: x * 2, moved)
    OrderedDict([('b', None), ('a', array([2.]))])
    """
    root = _checked_root(root)
    spec = TreeSpec(_describe_nodes(tree, root), _walk=True)  # used once: no code generated
    return spec.unflatten([fn(x) for x in spec.flatten(tree, root=root)], root=root)


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
        "_arrays",
        "_hash",
        "_json",
        "_layout",
        "_leaves",
        "_named",
        "_nodes",
        "_num_arrays",
        "_program",
    )

    def __init__(
        self, nodes: Sequence[Node], /, *, _like: TreeSpec | None = None, _walk: bool = False
    ) -> None:
        """A spec of ``nodes`` in pre-order; users call :func:`describe` or :meth:`from_json`.
        ``_walk``: walk the nodes in a loop rather than generate code (a spec used once)."""
        try:  # (one past the limit at most: an iterator may be endless)
            read: tuple[Node, ...] = (
                nodes if type(nodes) is tuple else tuple(itertools.islice(nodes, MAX_NODES + 1))
            )
        except Exception:
            raise DualgraphError(
                "a TreeSpec is made of the nodes of one tree, in pre-order; got "
                f"{brief_of(nodes)} (make one with dualgraph.describe or TreeSpec.from_json)"
            ) from None
        if len(read) > MAX_NODES:
            raise DualgraphError(f"a TreeSpec has at most {MAX_NODES} nodes, got more")
        self._nodes = nodes = read
        if _like is None:
            _check_preorder(nodes)
            self._layout: _Layout | None = None
            paths = lambda: _node_paths(self._get_layout())  # noqa: E731
            self._program = compile_program(nodes, paths, walk=_walk)
        else:  # the same tree with other grad flags: what is derived from it is the same
            self._layout = _like._layout
            self._program = _like._program
        self._num_arrays = sum(node.op == ArrayLeaf.op for node in nodes)
        self._leaves: tuple[LeafSpec, ...] | None = None
        self._arrays: tuple[LeafSpec, ...] | None = None
        self._json: str | None = None
        self._named: list[int] = []  # the nodes of user classes, named in the JSON by name
        self._hash: int | None = None

    # -- what the spec says -------------------------------------------------------------------

    @property
    def leaves(self) -> tuple[LeafSpec, ...]:
        """Every leaf (arrays, constants and ``None``) in flatten order."""
        if self._leaves is None:
            nodes = self._nodes
            self._leaves = self._leaf_specs(
                [i for i, n in enumerate(nodes) if n.arity == 0 and isinstance(n, Leaf)]
            )
        return self._leaves

    @property
    def paths(self) -> tuple[str, ...]:
        """A readable path for every leaf, e.g. ``[1]['aux_loss']``; the root is ``''``."""
        return tuple(leaf.path for leaf in self.leaves)

    @property
    def arrays(self) -> tuple[LeafSpec, ...]:
        """The array leaves, in the order :meth:`flatten` returns them."""
        if self._arrays is None:
            self._arrays = self._leaf_specs(self._array_indices())
        return self._arrays

    @property
    def array_paths(self) -> tuple[str, ...]:
        """The path of each array leaf, aligned with :meth:`flatten` and :attr:`grad_mask`."""
        return tuple(leaf.path for leaf in self.arrays)

    @property
    def num_arrays(self) -> int:
        """How many array leaves :meth:`flatten` returns."""
        return self._num_arrays

    @property
    def grad_mask(self) -> tuple[bool, ...]:
        """One bool per array leaf: does it take part in backward?"""
        return tuple(node.grad for node in self._nodes if isinstance(node, ArrayLeaf))

    @property
    def source(self) -> str | None:
        """The Python source generated for this spec's hot path (``None`` for a tree too
        large to generate code for, which a loop over its nodes runs instead).

        >>> import numpy as np
        >>> print(describe((np.zeros(2, np.float32), None)).source.splitlines()[1])
            if type(t) is not tuple or len(t) != 2: return None  # <root>
        """
        return self._program.source

    def with_grad_mask(self, mask: Sequence[bool], /) -> TreeSpec:
        """The same spec with another grad mask (one bool per array leaf).

        >>> import numpy as np
        >>> describe((np.zeros(2, np.float32),)).with_grad_mask([False]).grad_mask
        (False,)
        """
        flags = grad_flags(mask, self.array_paths, "spec")
        nodes = list(self._nodes)
        for index, flag in zip(self._array_indices(), flags, strict=True):
            nodes[index] = nodes[index].with_grad(flag)  # type: ignore[attr-defined]
        return TreeSpec(nodes, _like=self)

    def with_arrays_kept(self, keep: Sequence[bool], /) -> TreeSpec:
        """The same tree with ``None`` at its constants and at the array leaves where ``keep``
        (one bool per array leaf) is False: its :meth:`unflatten` takes the kept arrays alone,
        rebuilding each class as a spec does (a class that changes a ``None`` it is given there
        is refused naming the path, not changed silently).

        >>> import numpy as np
        >>> describe((np.zeros(2, np.float32), np.zeros(2, np.int32), 3)).with_arrays_kept(
        ...     [True, False]
        ... )
        TreeSpec((float32[2](grad), None, None))
        """
        nodes: list[Node] = [NONE if isinstance(node, ConstLeaf) else node for node in self._nodes]
        flags = grad_flags(keep, self.array_paths, "spec")
        for index, kept in zip(self._array_indices(), flags, strict=True):
            if not kept:
                nodes[index] = NONE
        return TreeSpec(nodes)

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
        try:
            arrays = (self._program.check if check else self._program.flatten)(tree)
        except Exception:  # an object's own code failed while it was read: explain below
            arrays = None
        if arrays is None:
            raise self._mismatch(tree, root, shapes=check)
        return arrays

    def unflatten(self, arrays: Sequence[Any], /, *, root: str = "") -> Any:
        """Rebuild the tree from its array leaves; ``None`` and constants are restored.
        ``root`` prefixes the paths in error messages (a container that cannot be rebuilt)."""
        cls = type(arrays)  # a list or tuple of the right length: the common case
        if (cls is not list and cls is not tuple) or len(arrays) != self._num_arrays:
            count_arrays(arrays, self._num_arrays)
        try:
            return self._program.unflatten(arrays)
        except Exception as error:
            raise self._rebuild_error(arrays, error, _checked_root(root)) from error

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
        try:
            matches = self._program.check(tree) is not None
        except Exception:  # an object's own code failed while it was read: explain below
            matches = False
        if not matches:
            raise self.mismatch(tree, root=root)

    def mismatch(self, tree: Any, /, *, root: str = "") -> SpecMismatchError:
        """The error explaining how ``tree`` differs from this spec (slow path, for messages)."""
        return self._mismatch(tree, root, shapes=True)

    def _mismatch(self, tree: Any, root: str, *, shapes: bool) -> SpecMismatchError:
        """:meth:`mismatch`, comparing array shapes and dtypes only if ``shapes`` (a flatten
        without check takes any array at an array's place: its error names what it refused)."""
        root = _checked_root(root)
        try:
            difference = _first_difference(self._nodes, self._get_layout(), tree, shapes)
        except Exception as error:  # pragma: no cover - every read above is guarded
            difference = (0, None, f"the tree could not be read: {clip_text(error)}")
        if difference is None:
            return SpecMismatchError(
                f"{show_path(root)}: the tree does not match the spec {clip(self, 300)}",
                path=root,
            )
        index, entry, message = difference
        entries = self._get_layout().entries(index)
        path = format_path(entries if entry is None else (*entries, entry), root)
        return SpecMismatchError(f"{show_path(path)}: {message}", path=path)

    # -- serialization, equality, display -----------------------------------------------------

    def to_json(self) -> str:
        """Serialize: sorted keys, no framework or device names, stable across processes.

        >>> import numpy as np
        >>> describe((np.zeros(2, np.int64), None)).to_json()
        '{"format":"dualgraph.TreeSpec","tree":[["tuple",2],["array","int64",[2],false],["none"]],"version":2}'
        """
        if self._json is None:
            self._json = write_document(SPEC_FORMAT, SPEC_VERSION, {"tree": self._rows()})
            self._named = [i for i, n in enumerate(self._nodes) if isinstance(n, NamedContainer)]
        elif self._named:  # a class named in the JSON may have been redefined since it was written
            self._rows(self._named)
        return self._json

    def _rows(self, indices: Sequence[int] | None = None, root: str = "") -> list[list[Any]]:
        """The JSON rows of the tree's nodes (of ``indices``), in pre-order (what
        :meth:`to_json` writes); ``root`` starts the paths in its errors."""
        rows = []
        nodes = self._nodes
        for index in range(len(nodes)) if indices is None else indices:
            node = nodes[index]
            try:
                rows.append(node.row())
            except NodeError as error:
                path = show_path(format_path(self._get_layout().entries(index), root))
                raise DualgraphError(f"cannot write the spec at {path}: {error}") from None
        return rows

    @classmethod
    def from_json(cls, text: str | bytes, /) -> TreeSpec:
        """Load a spec written by :meth:`to_json` (in any process, by any framework).

        Reading never imports a module or calls a class the program did not register or
        describe itself; anything malformed is a :class:`DualgraphError` naming where.
        """
        document = read_document(text, SPEC_FORMAT, SPEC_VERSION, ("tree",))
        return cls(read_tree(document["tree"], "TreeSpec"))

    @classmethod
    def _from_rows(cls, rows: Any, /, *, root: str = "", what: str = "TreeSpec") -> TreeSpec:
        """A spec of JSON rows (see :meth:`rows`); errors name paths after ``root``."""
        return cls(read_tree(rows, what, root))

    def __eq__(self, other: object) -> bool:
        if not is_instance(other, TreeSpec):  # (an object's __class__ can raise)
            return NotImplemented
        return self._nodes == cast(TreeSpec, other)._nodes

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._nodes)
        return self._hash

    def __repr__(self) -> str:
        return f"TreeSpec({_shown(self._nodes, self._get_layout())})"

    def __reduce__(self) -> tuple[Any, ...]:
        return TreeSpec.from_json, (self.to_json(),)

    def __copy__(self) -> TreeSpec:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TreeSpec:
        return self  # immutable

    # -- helpers ------------------------------------------------------------------------------

    def _get_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout(self._nodes)
        return self._layout

    def _array_indices(self) -> list[int]:
        return [i for i, node in enumerate(self._nodes) if isinstance(node, ArrayLeaf)]

    def _leaf_specs(self, indices: list[int]) -> tuple[LeafSpec, ...]:
        """The leaves at node ``indices``, once their paths are known to fit the size limit."""
        layout = self._get_layout()
        chars = [0] * len(self._nodes)  # each node's path length, from its parent's
        for index in range(1, len(chars)):
            chars[index] = chars[layout.parent[index]] + len(str(layout.entry[index]))
        total = sum(chars[i] for i in indices)
        if total > MAX_PATH_CHARS:
            raise DualgraphError(
                f"the leaf paths of this spec would hold {total} characters, over the limit of "
                f"{MAX_PATH_CHARS} (leaves at many levels of a deep tree: each path repeats "
                "its parents'); flatten, unflatten and check work without them"
            )
        return tuple(self._leaf_spec(i) for i in indices)

    def _leaf_spec(self, index: int) -> LeafSpec:
        node = self._nodes[index]
        entries = self._get_layout().entries(index)
        path = format_path(entries)
        if isinstance(node, ArrayLeaf):
            return LeafSpec("array", path, node.shape, node.dtype, node.grad, entries=entries)
        if isinstance(node, ConstLeaf):
            return LeafSpec("const", path, value=node.value, entries=entries)
        return LeafSpec("none", path, entries=entries)

    def _rebuild_error(
        self, arrays: Sequence[Any], error: Exception, root: str = ""
    ) -> DualgraphError:
        """Which container could not be rebuilt from ``arrays``, and why (slow path)."""
        nodes = self._nodes
        count = self._num_arrays
        values: list[Any] = []
        try:
            for index in range(len(nodes) - 1, -1, -1):
                node = nodes[index]
                if isinstance(node, ArrayLeaf):
                    count -= 1
                    values.append(arrays[count])
                elif isinstance(node, Leaf):
                    values.append(node.value if isinstance(node, ConstLeaf) else None)
                else:
                    assert isinstance(node, Container)
                    parts = values[len(values) - node.arity :][::-1]
                    del values[len(values) - node.arity :]
                    try:
                        values.append(node.rebuild(parts))
                    except Exception as failure:
                        path = show_path(format_path(self._get_layout().entries(index), root))
                        # dualgraph's own refusals say what to do at their end: not clipped
                        # as a user's error is (their parts are clipped themselves)
                        limit = 2000 if isinstance(failure, DualgraphError) else 120
                        return DualgraphError(
                            f"unflatten: {path}: rebuilding {node.brief()} raised "
                            f"{type(failure).__name__}: {clip_text(failure, limit)}"
                        )
        except Exception as failure:
            error = failure
        return SpecMismatchError(
            f"unflatten: could not read the arrays ({type(error).__name__}: {clip_text(error)})"
        )


def count_arrays(arrays: Any, expected: int) -> None:
    """Refuse ``arrays`` unless it is a sequence of ``expected`` items, for unflatten. A str,
    bytes, mapping or set has a length but is no sequence of arrays (a str would be rebuilt
    as its characters, a dict by its values)."""
    cls = type(arrays)
    if cls is not list and cls is not tuple:
        if is_instance(arrays, str | bytes | bytearray | Mapping | AbstractSet):
            count = None
        else:
            try:
                count = len(arrays)
            except Exception:
                count = None
        if count is None:
            raise SpecMismatchError(
                f"unflatten: expected a sequence of {expected} arrays, got {brief_of(arrays)}"
            )
    else:
        count = len(arrays)
    if count != expected:
        raise SpecMismatchError(f"unflatten: expected {expected} arrays, got {count}")


def _checked_root(root: object) -> str:
    """``root``, a prefix of paths in messages, must be a str (checked off the hot path)."""
    if type(root) is not str:
        raise DualgraphError(f"root must be a str (a path prefix), got {brief_of(root)}")
    return root


def _check_preorder(nodes: tuple[Node, ...]) -> None:
    """Refuse nodes that are not exactly one tree in pre-order."""
    expected = 1
    try:
        for node in nodes:
            if not expected or not isinstance(node, Node):
                break
            expected += node.arity - 1
        else:
            if not expected:
                return
    except Exception:  # isinstance of an object whose __class__ raises
        pass
    raise DualgraphError("a TreeSpec is made of the nodes of one tree, in pre-order")


# -- the layout of a tree's nodes -----------------------------------------------------------------


class _Layout:
    """Each node's parent and entry, and where its subtree ends: for paths and messages."""

    __slots__ = ("ends", "entry", "nodes", "parent")

    def __init__(self, nodes: tuple[Node, ...]) -> None:
        count = len(nodes)
        parent = [-1] * count
        entry: list[PathEntry | None] = [None] * count
        open_containers: list[list[int]] = []  # [node index, children so far]
        for index, node in enumerate(nodes):
            if open_containers:
                waiting = open_containers[-1]
                parent[index] = waiting[0]
                entry[index] = nodes[waiting[0]].entries[waiting[1]]  # type: ignore[attr-defined]
                waiting[1] += 1
                if waiting[1] == nodes[waiting[0]].arity:
                    open_containers.pop()
            if node.arity:
                open_containers.append([index, 0])
        ends = list(range(1, count + 1))
        for index in range(count - 1, -1, -1):
            end = index + 1
            for _ in range(nodes[index].arity):
                end = ends[end]
            ends[index] = end
        self.nodes = nodes
        self.parent = parent
        self.entry = entry
        self.ends = ends

    def children(self, index: int) -> list[int]:
        """The node indices of a container's children."""
        starts = []
        start = index + 1
        for _ in range(self.nodes[index].arity):
            starts.append(start)
            start = self.ends[start]
        return starts

    def entries(self, index: int) -> tuple[PathEntry, ...]:
        """The path of a node, as typed entries."""
        found = []
        while index > 0:
            found.append(self.entry[index])
            index = self.parent[index]
        return tuple(reversed(found))  # type: ignore[arg-type]


#: Stands for a child's text in what a container's ``show`` returns: ``\x00`` cannot be in a
#: key's or constant's repr (repr escapes it), so each one found is a child.
_CHILD = re.compile("\x00([0-9]+)\x00")


def _shown(nodes: tuple[Node, ...], layout: _Layout) -> str:
    """The tree as it prints in a spec's repr, e.g. ``{'x': float32[2](grad), 'n': 3}``.

    Written once from the root down, each node's own text in place (a container shows its
    children through placeholders): pasting each child's whole text into its parent's would
    copy a deep tree's text once per level, in time quadratic in its depth.
    """
    pieces: list[str] = []
    stack: list[int | str] = [0]  # node indices to show, and text written as it is
    while stack:
        item = stack.pop()
        if type(item) is str:
            pieces.append(item)
            continue
        node = nodes[item]  # type: ignore[index]
        if not node.arity:
            pieces.append(node.show(()))
            continue
        children = layout.children(item)  # type: ignore[arg-type]
        text = node.show([f"\x00{j}\x00" for j in range(node.arity)])
        split = _CHILD.split(text)  # text, child, text, child, ..., text
        found = sorted(int(j) for j in split[1::2])
        if found != list(range(node.arity)):  # a class's own name holds a \x00: show it whole
            return _shown_by_parts(nodes)
        for index in range(len(split) - 1, -1, -1):
            stack.append(children[int(split[index])] if index % 2 else split[index])
    return "".join(pieces)


def _shown_by_parts(nodes: tuple[Node, ...]) -> str:
    """What :func:`_shown` writes, each container's text made of its children's."""
    parts: list[str] = []
    for node in reversed(nodes):
        arity = node.arity
        children = parts[len(parts) - arity :][::-1]
        del parts[len(parts) - arity :]
        parts.append(node.show(children))
    return parts[0]


def _node_paths(layout: _Layout) -> list[str]:
    """Every node's path (for generated code's comments), each built from its parent's."""
    paths: list[str] = []
    for index, parent in enumerate(layout.parent):
        path = "" if parent < 0 else paths[parent] + str(layout.entry[index])
        paths.append(path if len(path) <= 400 else "..." + path[-397:])  # comments show the end
    return paths


# -- describing a tree ----------------------------------------------------------------------------

_UNSUPPORTED = (
    "A spec holds arrays (numpy, torch, jax), None, int/float/bool/str constants, and "
    "tuple/list/dict/OrderedDict/namedtuple containers. Register a dataclass with "
    "dualgraph.register_dataclass(cls) or another array type with "
    "dualgraph.register_array_type(cls, signature=..., requires_grad=...)."
)


class _Exit:
    """Marks, on describe's stack, the end of a container's subtree."""

    __slots__ = ("ident",)

    def __init__(self, ident: int) -> None:
        self.ident = ident


def _describe_nodes(tree: Any, root: str) -> list[Node]:
    """The nodes of ``tree`` in pre-order (a loop: no recursion, whatever the depth)."""
    nodes: list[Node] = []
    intern: dict[Any, Node] = {}
    inside: set[int] = set()  # the containers on the path to the current object
    stack: list[Any] = [tree]
    # By identity: a class whose metaclass defines __eq__ and __hash__ can equal int or str.
    constants = frozenset(map(id, CONSTANT_TYPES))
    pop, push, append = stack.pop, stack.append, nodes.append
    obj: Any = None
    native_numpy = numpy_is_native()

    def fail(message: str, error: type[DualgraphError] = UnsupportedLeafError) -> DualgraphError:
        # The object that failed is the next node's: its path is the next one in pre-order.
        path = format_path(next_entries(nodes), root)
        if error is UnsupportedLeafError:
            return UnsupportedLeafError(f"{show_path(path)}: {message}", path=path)
        return error(f"{show_path(path)}: {message}")

    try:
        while stack:
            obj = pop()
            cls = type(obj)
            if cls is _Exit:
                inside.discard(obj.ident)
                continue
            if obj is None:
                append(NONE)
                continue
            if cls is np.ndarray and native_numpy:  # the common leaf, read without a lookup
                key = (obj.shape, obj.dtype)
                leaf = intern.get(key)
                if leaf is None:
                    if not obj.dtype.isnative:
                        raise fail(_byte_order(obj.dtype), DualgraphError)
                    name = numpy_dtype_name(obj.dtype)
                    leaf = intern[key] = ArrayLeaf(obj.shape, name, is_differentiable_dtype(name))
                append(leaf)
                continue
            if id(cls) in constants:
                key = (cls, float_text(obj) if cls is float else obj)
                leaf = intern.get(key)
                if leaf is None:
                    leaf = intern[key] = ConstLeaf(obj)
                append(leaf)
                continue
            kind = container_kind(cls, learn=True)
            if kind is None:
                array_type = array_type_of(cls)
                if array_type is None:
                    # An adapter's reason, where it gave one, says more than how to register.
                    reason = refusal_of(cls)
                    raise fail(
                        f"unsupported leaf of type {class_name(cls)}. " + (reason or _UNSUPPORTED)
                    )
                shape, dtype = array_type.signature(obj)
                if not isinstance(shape, tuple):  # check compares signatures as they come
                    raise fail(
                        f"the signature registered for {class_name(cls)} "
                        f"gave a shape of type {type(shape).__qualname__}, not a tuple",
                        DualgraphError,
                    )
                answer = array_type.requires_grad(obj)
                grad = strict_bool(answer)
                if grad is None:
                    raise fail(
                        f"the requires_grad registered for {class_name(cls)} "
                        f"answered {clip(answer)}, not a bool",
                        DualgraphError,
                    )
                leaf = ArrayLeaf(shape, dtype, grad)
                if cls is np.ndarray and leaf.signature != (obj.shape, numpy_dtype_name(obj.dtype)):
                    # check and the generated code read a numpy array's own shape and dtype
                    raise fail(
                        f"the signature registered for numpy.ndarray gave {leaf.brief()} for a "
                        f"{obj.dtype.name}{list(obj.shape)} array; a spec reads numpy arrays by "
                        "their own shape and dtype (a registration may change requires_grad)",
                        DualgraphError,
                    )
                append(intern.setdefault(leaf.key, leaf))
                continue
            if id(obj) in inside:
                raise fail("the tree contains itself (a reference cycle)", DualgraphError)
            # A list, tuple or dict over the limit is refused before its node is made: the node
            # holds a path entry per child (a list of 20 million Nones took 19 s and 1.7 GB).
            if kind.python_type is not None and len(nodes) + len(stack) + len(obj) >= MAX_NODES:
                raise fail(_over_the_limit(len(obj)), DualgraphError)
            node, children = kind.describe(obj, intern)
            if len(children) != node.arity:  # a namedtuple made by tuple.__new__
                raise fail(
                    f"{brief_of(obj)} of length {len(children)}, but its class has "
                    f"{node.arity} fields (its children would be read as another tree's)",
                    DualgraphError,
                )
            if len(nodes) + len(stack) + node.arity >= MAX_NODES:
                raise fail(_over_the_limit(node.arity), DualgraphError)
            append(node)
            inside.add(id(obj))
            push(_Exit(id(obj)))
            push.__self__.extend(reversed(children))  # type: ignore[attr-defined]
    except DualgraphError:
        raise
    except NodeError as error:
        raise fail(str(error)) from None
    except Exception as error:  # the object's own code failed while it was read
        raise fail(
            f"reading {brief_of(obj)} raised {type(error).__name__}: {clip_text(error)}",
            DualgraphError,
        ) from error
    return nodes


def _over_the_limit(children: int) -> str:
    return (
        f"the tree has more than {MAX_NODES} nodes, a spec's limit (a container of {children} "
        "children)"
    )


def _byte_order(dtype: np.dtype) -> str:
    """Why an array of a dtype of the other byte order than the machine's is refused."""
    return (
        f"a {numpy_dtype_name(dtype)} array (numpy dtype {dtype.str!r}): a spec names dtypes "
        f"in the machine's byte order only (its bytes are not those of a {dtype.name} array "
        "of the same values); convert it first, e.g. x.astype(x.dtype.newbyteorder('='))"
    )


# -- explaining a mismatch ------------------------------------------------------------------------


def _first_difference(
    nodes: tuple[Node, ...], layout: _Layout, tree: Any, shapes: bool = True
) -> tuple[int, PathEntry | None, str] | None:
    """``(node index, entry, message)`` of the first place where ``tree`` differs (the entry
    names a child of that node, for a missing or unexpected key); arrays by their shapes and
    dtypes too if ``shapes``."""
    stack = [tree]
    for index, node in enumerate(nodes):
        obj = stack.pop()
        if isinstance(node, Leaf):
            if not (node.matches(obj) if shapes else node.fits(obj)):
                return index, None, f"expected {node.brief()}, got {brief_of(obj)}"
            continue
        assert isinstance(node, Container)
        try:
            children = node.children_of(obj)
        except Exception as error:
            message = f"reading {brief_of(obj)} raised {type(error).__name__}: {clip_text(error)}"
            return index, None, message
        if children is None:
            child_nodes = [nodes[start] for start in layout.children(index)]
            try:  # it reads the object again: a key's own __eq__, a field's getter may raise
                entry, message = node.difference(obj, child_nodes)
            except Exception as error:
                message = (
                    f"reading {brief_of(obj)} raised {type(error).__name__}: {clip_text(error)}"
                )
                return index, None, message
            return index, entry, message
        stack.extend(reversed(children))
    return None


def structure_difference(
    expected: TreeSpec, found: TreeSpec, *, dtypes: bool = True
) -> tuple[str, Node | None, Node | None] | None:
    """Where two specs first differ in more than array shapes, as ``(path, expected node,
    found node)`` (``None``: nothing there); None where they differ in shapes only.

    Nodes compare as a spec's do (container types and keys, ``None``, constants with their
    type, a float by its exact text), arrays by their dtype if ``dtypes``; shapes and the
    grad flag are left out. A child missing from a tuple, list or dict is named by its path.

    >>> structure_difference(describe([1, None]), describe((1, None)))
    ('', <ListNode a list of length 2>, <TupleNode a tuple of length 2>)
    >>> structure_difference(describe({"a": 1}), describe({"a": 1, "b": 2}))
    ("['b']", None, <ConstLeaf int 2>)
    >>> structure_difference(describe((np.zeros(2),)), describe((np.zeros(5),))) is None
    True
    """
    nodes, others = expected._nodes, found._nodes
    # Pre-order with arities: equal prefixes are equal subtrees, so the walks stay in step and
    # the first node that differs is the first difference (neither list ends before it).
    for index, (a, b) in enumerate(zip(nodes, others, strict=False)):
        if a == b or (
            isinstance(a, ArrayLeaf)
            and isinstance(b, ArrayLeaf)
            and (not dtypes or a.dtype == b.dtype)
        ):
            continue
        entries = expected._get_layout().entries(index)
        missing = _missing_child(expected, found, index, a, b)
        if missing is not None:
            entry, a_child, b_child = missing
            return format_path((*entries, entry)), a_child, b_child
        return format_path(entries), a, b
    return None


def _missing_child(
    expected: TreeSpec, found: TreeSpec, index: int, a: Node, b: Node
) -> tuple[PathEntry, Node | None, Node | None] | None:
    """A child one of two tuples, lists or dicts of one kind has and the other lacks."""
    if (
        type(a) is not type(b)
        or not isinstance(a, Container)
        or not isinstance(b, Container)
        or isinstance(a, NamedContainer)  # (of two classes: the class is the difference)
    ):
        return None
    k = _first_lacking(a.entries, b.entries)
    if k is not None:
        return a.entries[k], expected._nodes[expected._get_layout().children(index)[k]], None
    k = _first_lacking(b.entries, a.entries)
    if k is not None:
        return b.entries[k], None, found._nodes[found._get_layout().children(index)[k]]
    return None  # the same keys in another order, or of other types (True is not 1)


def _first_lacking(entries: Sequence[PathEntry], others: Sequence[PathEntry]) -> int | None:
    """The position of the first of ``entries`` that ``others`` lack; ``None``: they have all.

    >>> from dualgraph import Key
    >>> _first_lacking([Key("a"), Key("b")], [Key("a")]), _first_lacking([Key("a")], [Key("a")])
    (1, None)
    """
    among = set(others)
    return next((k for k, entry in enumerate(entries) if entry not in among), None)


def grad_flags(mask: object, paths: Sequence[str], owner: str) -> list[bool]:
    """The entries of a grad mask, one bool per array leaf (see :func:`_grad_flag`), as a list.

    ``paths`` are the array leaves' paths, one per entry, for the error messages; ``owner``
    names what has them (``"spec"``, ``"call"``). A mask whose length is not one per leaf is
    refused before its entries are read (a wrong numpy mask of 10**7 entries took 27 s), and
    any mask is read one entry past the leaves at most: an iterator may be endless (such as
    ``itertools.repeat(False)``), and a length may lie.

    >>> grad_flags((True, False), ("[0]", "[1]"), "spec")
    [True, False]
    """
    # A set has no order and a mapping's entries are its keys: neither is a mask.
    try:
        refused = isinstance(mask, str | bytes | AbstractSet | Mapping) or not isinstance(
            mask, Iterable
        )
        sized = isinstance(mask, Sized)
    except Exception:  # an object whose own __class__ fails
        refused, sized = True, False
    if refused:
        raise DualgraphError(f"a grad mask is a sequence of bools, got {class_name(type(mask))}")
    expected = len(paths)
    if sized:
        try:
            count: int | None = len(mask)  # type: ignore[arg-type]
        except Exception:  # its own __len__ failed: read it as an iterator
            count = None
        if count is not None and count != expected:
            raise DualgraphError(
                f"grad mask has {count} entries, the {owner} has {expected} array leaves"
            )
    try:
        entries = itertools.islice(mask, expected + 1)  # type: ignore[call-overload]
        flags = [_grad_flag(i, flag, paths) for i, flag in enumerate(entries)]
    except DualgraphError:
        raise
    except Exception as error:
        raise DualgraphError(
            f"a grad mask is a sequence of bools: reading it raised {type(error).__name__}: "
            f"{clip_text(error)}"
        ) from None
    if len(flags) > expected:
        raise DualgraphError(
            f"grad mask has more than {expected} entries, for {expected} array leaves"
        )
    if len(flags) < expected:
        raise DualgraphError(
            f"grad mask has {len(flags)} entries, the {owner} has {expected} array leaves"
        )
    return flags


def _grad_flag(index: int, flag: object, paths: Sequence[str]) -> bool:
    """A grad-mask entry: a bool, or a 0-d boolean array (numpy, torch, jax); nothing coerced."""
    found = strict_bool(flag)
    if found is not None:
        return found
    leaf = f" (the array at {paths[index] or '<root>'})" if index < len(paths) else ""
    raise DualgraphError(
        f"grad mask[{index}]{leaf}: expected a bool, got {class_name(type(flag))} "
        "(a grad mask is not coerced: 'False' would mean True)"
    )
