"""Per-spec Python functions for the hot path: flatten, check and unflatten.

A spec knows its whole tree when it is made, so instead of walking the tree generically on every
replay it writes straight-line code once: type and length tests for each container, direct
indexing for each leaf, and a literal that rebuilds the tree. The generated ``flatten`` and
``check`` return ``None`` on any mismatch; the caller then explains the mismatch (slow path).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ._containers import resolve_type
from ._leaves import _RESOLVED, array_type_of

__all__ = ["CompiledSpec", "compile_spec"]

Node = dict[str, Any]

_NUMPY_DTYPE_NAMES: dict[np.dtype, str] = {}


def signature_of(leaf: Any) -> tuple[tuple[int, ...], str] | None:
    """``(shape, dtype name)`` of an array leaf, or ``None`` if ``leaf`` is not an array."""
    cls = type(leaf)
    if cls is np.ndarray:  # numpy's dtype.name is slow: cache it per dtype
        dtype = leaf.dtype
        name = _NUMPY_DTYPE_NAMES.get(dtype)
        if name is None:
            name = _NUMPY_DTYPE_NAMES[dtype] = dtype.name
        return leaf.shape, name
    array_type = _RESOLVED[cls] if cls in _RESOLVED else array_type_of(cls)
    return None if array_type is None else array_type.signature(leaf)


def _numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a neutral dtype name, where numpy (or ml_dtypes) knows it."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


def _same_float(found: Any, expected: float) -> bool:
    if type(found) is not float:
        return False
    if found != found:  # NaN matches NaN
        return expected != expected
    return found == expected and math.copysign(1.0, found) == math.copysign(1.0, expected)


class CompiledSpec:
    """The generated functions of one spec (see the module docstring)."""

    __slots__ = ("check", "flatten", "source", "unflatten")

    def __init__(
        self,
        flatten: Callable[[Any], list[Any] | None],
        check: Callable[[Any], list[Any] | None],
        unflatten: Callable[[Any], Any],
        source: str,
    ) -> None:
        self.flatten = flatten
        self.check = check
        self.unflatten = unflatten
        self.source = source


def compile_spec(node: Node, array_positions: list[int]) -> CompiledSpec:
    """Generate the hot-path functions for the tree described by ``node``.

    ``array_positions[k]`` is the flatten position of the k-th array leaf met walking ``node``
    in its own (the user's) order.
    """
    writer = _Writer(array_positions)
    flatten_body = writer.structure(node, "t", full=False)
    flatten_return = writer.array_list()
    writer.reset_arrays()
    check_body = writer.structure(node, "t", full=True)
    check_return = writer.array_list()
    writer.reset_arrays()
    rebuilt = writer.rebuild(node)
    source = "\n".join(
        [
            "def flatten(t):",
            *(f"    {line}" for line in flatten_body),
            f"    return {flatten_return}",
            "def check(t):",
            *(f"    {line}" for line in check_body),
            f"    return {check_return}",
            "def unflatten(a):",
            f"    return {rebuilt}",
        ]
    )
    namespace = writer.namespace
    exec(compile(source, "<dualgraph spec>", "exec"), namespace)
    return CompiledSpec(namespace["flatten"], namespace["check"], namespace["unflatten"], source)


class _Writer:
    def __init__(self, array_positions: list[int]) -> None:
        self.namespace: dict[str, Any] = {
            "_signature": signature_of,
            "_same_float": _same_float,
            "_OrderedDict": collections.OrderedDict,
            "_ndarray": np.ndarray,
        }
        self._positions = array_positions
        self._arrays: list[tuple[int, str]] = []
        self._counter = 0

    def reset_arrays(self) -> None:
        self._arrays = []

    def array_list(self) -> str:
        ordered = sorted(self._arrays)
        return "[" + ", ".join(name for _, name in ordered) + "]"

    def bind(self, value: Any, prefix: str) -> str:
        self._counter += 1
        name = f"{prefix}{self._counter}"
        self.namespace[name] = value
        return name

    def fresh(self) -> str:
        self._counter += 1
        return f"n{self._counter}"

    def structure(self, node: Node, var: str, *, full: bool) -> list[str]:
        """Statements that test ``var`` against ``node`` and bind its array leaves."""
        fail = "return None"
        if "leaf" in node:
            kind = node["leaf"]
            if kind == "none":
                return [f"if {var} is not None: {fail}"]
            if kind == "const":
                value = node["value"]
                if node["type"] == "float":
                    name = self.bind(float(value), "c")
                    return [f"if not _same_float({var}, {name}): {fail}"]
                name = self.bind(value, "c")
                cls = self.bind({"int": int, "bool": bool, "str": str}[node["type"]], "T")
                return [f"if type({var}) is not {cls} or {var} != {name}: {fail}"]
            position = self._positions[len(self._arrays)]
            self._arrays.append((position, var))
            if not full:  # shapes and dtypes are check's job, but None is part of the structure
                return [f"if {var} is None: {fail}"]
            shape = tuple(node["shape"])
            expected = self.bind((shape, node["dtype"]), "e")
            numpy_dtype = _numpy_dtype(node["dtype"])
            if numpy_dtype is None:
                return [f"if _signature({var}) != {expected}: {fail}"]
            # numpy arrays are compared natively (no dtype name lookup); the rest by signature
            native = f"type({var}) is _ndarray and {var}.shape == {self.bind(shape, 's')}"
            native += f" and {var}.dtype == {self.bind(numpy_dtype, 'd')}"
            return [f"if not ({native}) and _signature({var}) != {expected}: {fail}"]
        kind = node["node"]
        children = node["children"]
        lines: list[str] = []
        if kind in ("tuple", "list"):
            lines.append(f"if type({var}) is not {kind} or len({var}) != {len(children)}: {fail}")
            accessors = [f"{var}[{i}]" for i in range(len(children))]
        elif kind in ("dict", "ordereddict"):
            if kind == "dict":  # a dict's key order doesn't matter, an OrderedDict's does
                keys = self.bind(frozenset(node["keys"]), "k")
                lines.append(f"if type({var}) is not dict or {var}.keys() != {keys}: {fail}")
            else:
                cls = self.bind(collections.OrderedDict, "T")
                keys = self.bind(list(node["keys"]), "k")
                lines.append(f"if type({var}) is not {cls} or list({var}) != {keys}: {fail}")
            accessors = [f"{var}[{self.bind(key, 'k')}]" for key in node["keys"]]
        else:
            cls = self.bind(resolve_type(node["type"]), "T")
            lines.append(f"if type({var}) is not {cls}: {fail}")
            accessors = [f"{var}.{field}" for field in node["fields"]]
        for accessor, child in zip(accessors, children):
            child_var = self.fresh()
            lines.append(f"{child_var} = {accessor}")
            lines.extend(self.structure(child, child_var, full=full))
        return lines

    def rebuild(self, node: Node) -> str:
        """An expression that rebuilds ``node`` from the flat array list ``a``."""
        if "leaf" in node:
            kind = node["leaf"]
            if kind == "none":
                return "None"
            if kind == "const":
                value = float(node["value"]) if node["type"] == "float" else node["value"]
                return self.bind(value, "c")
            position = self._positions[len(self._arrays)]
            self._arrays.append((position, ""))
            return f"a[{position}]"
        kind = node["node"]
        parts = [self.rebuild(child) for child in node["children"]]
        if kind == "tuple":
            return "(" + "".join(f"{p}, " for p in parts) + ")"
        if kind == "list":
            return "[" + ", ".join(parts) + "]"
        if kind == "dict":
            keys = [self.bind(key, "k") for key in node["keys"]]
            return "{" + ", ".join(f"{k}: {p}" for k, p in zip(keys, parts)) + "}"
        if kind == "ordereddict":
            keys = [self.bind(key, "k") for key in node["keys"]]
            return "_OrderedDict([" + ", ".join(f"({k}, {p})" for k, p in zip(keys, parts)) + "])"
        cls = self.bind(resolve_type(node["type"]), "T")
        if kind == "namedtuple":
            return f"{cls}(" + ", ".join(parts) + ")"
        return f"{cls}(" + ", ".join(f"{f}={p}" for f, p in zip(node["fields"], parts)) + ")"
