"""CallSpec: the spec of a call's ``(args, kwargs)``, the inputs of a graphed callable.

Adapters describe the sample call once (:func:`describe_call`), then on every call take the
array leaves out of ``(args, kwargs)`` with :meth:`CallSpec.flatten` (which checks the
structure, and with ``check=True`` every shape and dtype) and put them back with
:meth:`CallSpec.unflatten`. Paths start at ``args`` and ``kwargs``: ``args[0]['x']``,
``kwargs['mask']``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

from ._containers import DictNode, TupleNode, brief_of
from ._errors import DualgraphError, SpecMismatchError
from ._json import read_document, write_document
from ._nodes import class_name, clip, clip_text, is_instance
from ._spec import LeafSpec, TreeSpec, count_arrays, describe, grad_flags

__all__ = ["CALL_SPEC_FORMAT", "CallSpec", "describe_call"]

CALL_SPEC_FORMAT = "dualgraph.CallSpec"
CALL_SPEC_VERSION = 1


def describe_call(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, /) -> CallSpec:
    """Describe the inputs of a call: ``args`` (a tuple or list) and ``kwargs`` (or ``None``).

    >>> import numpy as np
    >>> spec = describe_call((np.zeros(2, np.float32), {"x": None}), {"mask": np.ones(3, bool)})
    >>> spec
    CallSpec(args=(float32[2](grad), {'x': None}), kwargs={'mask': bool[3]})
    >>> spec.array_paths, spec.grad_mask
    (('args[0]', "kwargs['mask']"), (True, False))
    """
    if type(args) is not tuple:
        args, problem = _args_tuple(args, "a tuple or list of positional arguments")
        if problem is not None:
            raise DualgraphError(problem)
    kwargs, problem = _kwargs_dict(kwargs)
    if problem is not None:
        raise DualgraphError(problem)
    return CallSpec(describe(args, root="args"), describe(kwargs, root="kwargs"))


class CallSpec:
    """The spec of ``(args, kwargs)``: one :class:`TreeSpec` for each, seen as one call.

    Array leaves are numbered args first, then kwargs, each in its spec's flatten order.

    >>> import numpy as np
    >>> spec = describe_call((np.zeros(2, np.float32),), {"scale": 2.0})
    >>> arrays = spec.flatten((np.ones(2, np.float32),), {"scale": 2.0})
    >>> spec.unflatten(arrays)
    ((array([1., 1.], dtype=float32),), {'scale': 2.0})
    >>> spec.flatten((np.ones(2, np.float32),), {})
    Traceback (most recent call last):
    ...
    dualgraph.SpecMismatchError: kwargs['scale']: missing (expected float 2.0)
    """

    __slots__ = ("_arrays", "_has_kwargs", "_hash", "_num_args", "args_spec", "kwargs_spec")
    args_spec: TreeSpec
    kwargs_spec: TreeSpec

    def __init__(self, args_spec: TreeSpec, kwargs_spec: TreeSpec, /) -> None:
        """Pair the spec of ``tuple(args)`` with that of ``dict(kwargs)``; see describe_call."""
        if not is_instance(args_spec, TreeSpec) or not is_instance(kwargs_spec, TreeSpec):
            raise DualgraphError("CallSpec takes two TreeSpecs: one of args, one of kwargs")
        problem = _root_problem(args_spec, kwargs_spec)
        if problem is not None:
            raise DualgraphError(f"{problem[0]}: {problem[1]}")
        kwargs_root = kwargs_spec._nodes[0]
        assert isinstance(kwargs_root, DictNode)
        self.args_spec = args_spec
        self.kwargs_spec = kwargs_spec
        self._num_args = args_spec.num_arrays
        self._has_kwargs = bool(kwargs_root.keys)
        self._arrays: tuple[LeafSpec, ...] | None = None
        self._hash: int | None = None

    # -- what the spec says -------------------------------------------------------------------

    @property
    def arrays(self) -> tuple[LeafSpec, ...]:
        """The array leaves (args first, then kwargs); their paths start at ``args``/``kwargs``.

        A leaf's :attr:`~LeafSpec.entries` start at the root of its tree (``args`` or ``kwargs``).
        """
        if self._arrays is None:
            self._arrays = tuple(
                dataclasses.replace(leaf, path=root + leaf.path)
                for root, spec in (("args", self.args_spec), ("kwargs", self.kwargs_spec))
                for leaf in spec.arrays
            )
        return self._arrays

    @property
    def array_paths(self) -> tuple[str, ...]:
        """The path of each array leaf, e.g. ``args[0]`` or ``kwargs['mask']``."""
        return tuple(leaf.path for leaf in self.arrays)

    @property
    def grad_mask(self) -> tuple[bool, ...]:
        """One bool per array leaf (args first): does it take part in backward?"""
        return self.args_spec.grad_mask + self.kwargs_spec.grad_mask

    @property
    def num_arrays(self) -> int:
        """How many array leaves :meth:`flatten` returns."""
        return self._num_args + self.kwargs_spec.num_arrays

    @property
    def num_args_arrays(self) -> int:
        """How many of them come from ``args`` (they come first)."""
        return self._num_args

    def with_grad_mask(self, mask: Sequence[bool], /) -> CallSpec:
        """The same spec with another grad mask (one bool per array leaf, args first).

        >>> import numpy as np
        >>> spec = describe_call((np.zeros(2, np.float32),), {"b": np.zeros(1, np.float32)})
        >>> spec.with_grad_mask([False, True]).grad_mask
        (False, True)
        """
        flags = grad_flags(mask, self.array_paths, "call")
        n = self._num_args
        return CallSpec(
            self.args_spec.with_grad_mask(flags[:n]), self.kwargs_spec.with_grad_mask(flags[n:])
        )

    # -- the hot path -------------------------------------------------------------------------

    def flatten(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None, /, *, check: bool = False
    ) -> list[Any]:
        """The array leaves of a call, args first; raises :class:`SpecMismatchError` on a mismatch.

        Structure, ``None`` positions and constants are always checked, with ``check=True``
        every array's shape and dtype too. ``kwargs=None`` means no keyword arguments.

        >>> import numpy as np
        >>> spec = describe_call(({"x": np.zeros((2, 3), np.float32)},))
        >>> spec.flatten(({"x": np.zeros((2, 4), np.float32)},), None, check=True)
        Traceback (most recent call last):
        ...
        dualgraph.SpecMismatchError: args[0]['x']: expected float32[2, 3], got float32[2, 4]
        """
        if type(args) is not tuple:
            args, problem = _args_tuple(args, "a tuple of positional arguments")
            if problem is not None:
                raise SpecMismatchError(problem, path="args")
        try:
            arrays = self.args_spec.flatten(args, check=check, root="args")
        except SpecMismatchError as error:
            if error.path != "args" or len(args) == self.args_spec._nodes[0].arity:
                raise
            raise self._wrong_count(args) from None
        if type(kwargs) is not dict:
            if kwargs is None:
                if not self._has_kwargs:
                    return arrays
                kwargs = {}
            else:
                kwargs, problem = _kwargs_dict(kwargs)
                if problem is not None:
                    raise SpecMismatchError(problem, path="kwargs")
        elif not kwargs and not self._has_kwargs:
            return arrays
        arrays += self.kwargs_spec.flatten(kwargs, check=check, root="kwargs")
        return arrays

    def _wrong_count(self, args: tuple[Any, ...]) -> SpecMismatchError:
        """The error naming the first positional argument missing or extra (slow path)."""
        nodes = self.args_spec._nodes
        count = nodes[0].arity
        if len(args) > count:
            return SpecMismatchError(
                f"args[{count}]: unexpected extra positional argument {brief_of(args[count])}: "
                f"the call has {_positional(len(args))}, expected {count}",
                path=f"args[{count}]",
            )
        child = nodes[self.args_spec._get_layout().children(0)[len(args)]]
        return SpecMismatchError(
            f"args[{len(args)}]: missing (expected {child.brief()}): the call has "
            f"{_positional(len(args))}, expected {count}",
            path=f"args[{len(args)}]",
        )

    def unflatten(self, arrays: Sequence[Any], /) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` from the array leaves (args first)."""
        count_arrays(arrays, self.num_arrays)
        n = self._num_args
        try:
            args, kwargs = arrays[:n], arrays[n:]
        except Exception as error:
            raise SpecMismatchError(
                f"unflatten: could not read the arrays ({type(error).__name__}: {clip_text(error)})"
            ) from None
        return (
            self.args_spec.unflatten(args, root="args"),
            self.kwargs_spec.unflatten(kwargs, root="kwargs"),
        )

    # -- serialization, equality, display -----------------------------------------------------

    def to_json(self) -> str:
        """Serialize: sorted keys, versioned, no framework or device names.

        >>> import numpy as np
        >>> CallSpec.from_json(describe_call((np.zeros(2, np.int8),)).to_json())
        CallSpec(args=(int8[2],), kwargs={})
        """
        trees = {
            "args": self.args_spec._rows(root="args"),
            "kwargs": self.kwargs_spec._rows(root="kwargs"),
        }
        return write_document(CALL_SPEC_FORMAT, CALL_SPEC_VERSION, trees)

    @classmethod
    def from_json(cls, text: str | bytes, /) -> CallSpec:
        """Load a spec written by :meth:`to_json`; a malformed document is a DualgraphError."""
        document = read_document(text, CALL_SPEC_FORMAT, CALL_SPEC_VERSION, ("args", "kwargs"))
        specs = [
            TreeSpec._from_rows(document[part], root=part, what="CallSpec")
            for part in ("args", "kwargs")
        ]
        problem = _root_problem(*specs)
        if problem is not None:  # a root of another kind: its row is the first one
            part, message = problem
            raise DualgraphError(
                f"malformed CallSpec JSON at {part}: {message} (row 0 of the document's "
                f'"{part}" list)'
            )
        return cls(*specs)

    def __eq__(self, other: object) -> bool:
        if not is_instance(other, CallSpec):  # (an object's __class__ can raise)
            return NotImplemented
        spec = cast(CallSpec, other)
        return self.args_spec == spec.args_spec and self.kwargs_spec == spec.kwargs_spec

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self.args_spec, self.kwargs_spec))
        return self._hash

    def __repr__(self) -> str:
        args = repr(self.args_spec)[len("TreeSpec(") : -1]
        kwargs = repr(self.kwargs_spec)[len("TreeSpec(") : -1]
        return f"CallSpec(args={args}, kwargs={kwargs})"

    def __reduce__(self) -> tuple[Any, ...]:
        return CallSpec.from_json, (self.to_json(),)

    # Immutable, as its TreeSpecs: a copy is the spec itself (not a trip through JSON, which a
    # spec of a redefined class or of a str JSON cannot hold refuses, and which re-reads it all).
    def __copy__(self) -> CallSpec:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CallSpec:
        return self


def _positional(count: int) -> str:
    return f"{count} positional argument{'' if count == 1 else 's'}"


def _args_tuple(args: Any, expected: str) -> tuple[tuple[Any, ...], str | None]:
    """``(args as a tuple, None)``, or ``((), what is wrong)``: a tuple or list (a subclass's own
    iteration may fail)."""
    if not is_instance(args, (tuple, list)):
        return (), f"args: expected {expected}, got {_type_name(args)}"
    try:
        return tuple(args), None
    except Exception as error:
        return (), (
            f"args: reading the positional arguments raised {type(error).__name__}: "
            f"{clip_text(error)}"
        )


def _kwargs_dict(kwargs: Any) -> tuple[dict[str, Any], str | None]:
    """``(kwargs as a plain dict, None)``, or ``({}, what is wrong)``; ``None`` means ``{}``."""
    if kwargs is None:
        return {}, None
    if not is_instance(kwargs, Mapping):
        return {}, f"kwargs: expected a mapping of keyword arguments, got {_type_name(kwargs)}"
    try:
        result = dict(kwargs)
    except Exception as error:
        return {}, f"kwargs: reading the mapping raised {type(error).__name__}: {clip_text(error)}"
    for key in result:
        if type(key) is not str:
            return {}, f"kwargs: keyword names must be str, got {clip(key)} ({_type_name(key)})"
    return result, None


def _type_name(obj: Any) -> str:
    """The class of ``obj`` for messages, builtins by their own name (never raises: a class's
    ``__module__`` may be any object, whose ``==`` may fail)."""
    name = class_name(type(obj))
    return name.removeprefix("builtins.")


def _root_problem(args_spec: TreeSpec, kwargs_spec: TreeSpec) -> tuple[str, str] | None:
    """``(part, what is wrong)`` where the args spec's root is no tuple or the kwargs spec's no
    dict of str keys; ``None`` where both are right. The root node alone is named: a document's
    spec can be too large to show.

    >>> from dualgraph import describe
    >>> _root_problem(describe([1]), describe({}))
    ('args', 'the args spec must describe a tuple, not a list of length 1')
    """
    args_root = args_spec._nodes[0]
    if type(args_root) is not TupleNode:
        return "args", f"the args spec must describe a tuple, not {args_root.brief()}"
    kwargs_root = kwargs_spec._nodes[0]
    if not isinstance(kwargs_root, DictNode) or not all(
        type(key) is str for key in kwargs_root.keys
    ):
        return "kwargs", (
            f"the kwargs spec must describe a dict with str keys, not {kwargs_root.brief()}"
        )
    return None
