"""Validation of a graphed callable's arguments against the samples it was captured with.

Runs on every call, before any static buffer is written: structure, ``None`` positions and
constants through the core's call spec, then each tensor against what was recorded from its
sample: a plain dense tensor (no subclass, sparse, nested or quantized tensor) of the same
shape, dtype and device, and no ``requires_grad`` where the sample had none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._call import CallSpec, describe_call
from .._errors import DualgraphError, SpecMismatchError
from ._leaves import dtype_name

__all__ = ["InputGuard", "unsupported_tensor"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided


def unsupported_tensor(tensor: torch.Tensor, /) -> str | None:
    """Why ``tensor`` cannot be copied into a static buffer and replayed, or ``None``.

    >>> unsupported_tensor(torch.zeros(2, 2).to_sparse())
    'a torch.sparse_coo tensor (static buffers are dense, strided tensors)'
    >>> unsupported_tensor(torch.zeros(2)) is None
    True
    """
    cls = type(tensor)
    if cls is not _Tensor and cls is not _Parameter:
        return (
            f"a tensor subclass {cls.__module__}.{cls.__qualname__} (a replay runs the captured "
            "kernels, not the subclass's Python code)"
        )
    if tensor.is_nested:
        return "a nested tensor (static buffers are dense, strided tensors)"
    if tensor.layout is not _STRIDED:
        return f"a {tensor.layout} tensor (static buffers are dense, strided tensors)"
    if tensor.is_quantized:
        return "a quantized tensor (static buffers are dense, strided tensors)"
    if tensor.is_meta:
        return "a meta tensor (it holds no data to replay on)"
    return None


_Steps = tuple[tuple[bool, Any], ...]  # from (args, kwargs): (is an attribute, key or index)


def _dict_orders(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> tuple[tuple[str, _Steps, tuple[Any, ...]], ...]:
    """Every plain dict of two keys or more in a call (the kwargs themselves bind by name): its
    path, the steps that reach it and its keys in order. The call was described already, so
    the tree is finite and holds only containers the core knows.

    >>> _dict_orders(([{"b": 1, "a": 2}],), {"m": {"x": 0, "y": 1}})[0][0::2]
    ('args[0][0]', ('b', 'a'))
    """
    found = []
    stack: list[tuple[Any, str, _Steps]] = [
        (value, f"kwargs[{key!r}]", ((False, 1), (False, key)))
        for key, value in reversed(list((kwargs or {}).items()))
    ]
    stack += [
        (value, f"args[{i}]", ((False, 0), (False, i)))
        for i, value in reversed(list(enumerate(args)))
    ]
    while stack:
        node, path, steps = stack.pop()
        children: list[tuple[Any, str, tuple[bool, Any]]] = []
        if isinstance(node, dict):
            if type(node) is dict and len(node) > 1:
                found.append((path, steps, tuple(node)))
            children = [(v, f"{path}[{k!r}]", (False, k)) for k, v in node.items()]
        elif isinstance(node, tuple) and hasattr(type(node), "_fields"):  # a namedtuple
            fields: tuple[str, ...] = getattr(type(node), "_fields")  # noqa: B009
            children = [(getattr(node, f), f"{path}.{f}", (True, f)) for f in fields]
        elif isinstance(node, tuple | list):
            children = [(v, f"{path}[{i}]", (False, i)) for i, v in enumerate(node)]
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            names = [field.name for field in dataclasses.fields(node)]
            children = [(getattr(node, f), f"{path}.{f}", (True, f)) for f in names]
        stack += [(child, p, (*steps, step)) for child, p, step in reversed(children)]
    return tuple(found)


class InputGuard:
    """The capture-time description of ``(args, kwargs)``; :meth:`tensors` checks a call.

    Built on the core's :class:`dualgraph.CallSpec` (structure, ``None`` leaves, constants,
    paths); what a tensor leaf must be is checked here.

    >>> guard = InputGuard((torch.zeros(2, 3),), {"scale": 2.0})
    >>> len(guard.tensors((torch.ones(2, 3),), {"scale": 2.0}))
    1
    >>> guard.tensors((torch.ones(2, 4),), {"scale": 2.0})
    Traceback (most recent call last):
    ...
    dualgraph.SpecMismatchError: args[0]: expected float32[2, 3] on cpu, got ...
    """

    __slots__ = (
        "_dict_orders",
        "_expected",
        "_flatten_args",
        "_has_kwargs",
        "paths",
        "requires_grad",
        "spec",
    )

    def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> None:
        #: The core's description of the call: structure, constants, array paths.
        self.spec: CallSpec = describe_call(args, kwargs)
        tensors = self.spec.flatten(args, kwargs)
        paths = self.spec.array_paths
        for path, leaf in zip(paths, tensors, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise DualgraphError(
                    f"{path}: array leaves of a torch callable's inputs must be torch tensors, "
                    f"got {type(leaf).__module__}.{type(leaf).__qualname__}"
                )
            why = unsupported_tensor(leaf)
            if why is not None:
                raise SpecMismatchError(f"{path}: cannot be graphed: {why}", path=path)
        #: The path of each input tensor, e.g. ``args[0]`` or ``kwargs['mask']``.
        self.paths: tuple[str, ...] = paths
        #: For each input tensor (args first, then kwargs): did its sample require grad?
        self.requires_grad: tuple[bool, ...] = tuple(t.requires_grad for t in tensors)
        self._expected = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)
        self._has_kwargs = self.spec.kwargs_spec.num_arrays > 0 or bool(kwargs)
        self._flatten_args = self.spec.args_spec.flatten
        # The core matches a dict whatever its key order; the callable's Python sees that order.
        self._dict_orders = _dict_orders(args, kwargs)

    @property
    def num_args_tensors(self) -> int:
        """How many input tensors come from ``args`` (they come first)."""
        return self.spec.num_args_arrays

    def tensors(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], grad_enabled: bool | None = None
    ) -> list[torch.Tensor]:
        """The input tensors of a call, in capture order; raises naming the first bad leaf.

        ``grad_enabled`` is the grad mode of the call (read from torch when not given).
        """
        if kwargs or self._has_kwargs:
            tensors = self.spec.flatten(args, kwargs)
        else:  # the usual call: positional args only (``args`` is the call's own tuple)
            tensors = self._flatten_args(args, root="args")
        if grad_enabled is None:
            grad_enabled = torch.is_grad_enabled()
        try:
            for tensor, (shape, dtype, device, requires_grad) in zip(
                tensors, self._expected, strict=True
            ):
                cls = type(tensor)
                if (
                    (cls is not _Tensor and cls is not _Parameter)
                    or tensor.layout is not _STRIDED
                    or tensor.shape != shape
                    or tensor.dtype is not dtype
                    or tensor.device != device
                    or (tensor.requires_grad and not requires_grad and grad_enabled)
                ):
                    raise self._explain(tensors, grad_enabled)
        except SpecMismatchError:
            raise
        except Exception:  # e.g. a nested tensor has no shape to compare
            raise self._explain(tensors, grad_enabled) from None
        if self._dict_orders:
            self.check_dict_orders(args, kwargs)
        return tensors

    def check_dict_orders(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse a dict whose keys come in another order than at capture (the structure
        matched, so every step of the way is there)."""
        found = self.dict_order_difference(args, kwargs)
        if found is not None:
            path, difference = found
            raise SpecMismatchError(
                f"{path}: {difference}; a replay runs the callable as captured, so whatever "
                "follows the key order (d.values(), a sum over the dict) would not follow this "
                "call's; pass the keys in the captured order",
                path=path,
            )

    def dict_order_difference(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """The path of the first dict whose keys come in another order than at capture, and
        how (``None``: none); the call's structure matched."""
        for path, steps, keys in self._dict_orders:
            node: Any = (args, kwargs)
            for is_attr, step in steps:
                node = getattr(node, step) if is_attr else node[step]
            if tuple(node) != keys:
                return path, (
                    f"a dict with its keys in the order {list(node)!r}, captured in the order "
                    f"{list(keys)!r}"
                )
        return None

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with ``tensors`` (in capture order) at the tensor leaves."""
        return self.spec.unflatten(tensors)

    def describe(self) -> str:
        """The captured inputs, e.g. ``args=(float32[2, 4](grad),), kwargs={}``."""
        return repr(self.spec)[len("CallSpec(") : -1]

    def _explain(self, tensors: list[Any], grad_enabled: bool) -> SpecMismatchError:
        return self.first_mismatch(tensors, grad_enabled) or SpecMismatchError(
            "the inputs do not match the captured ones"
        )

    def first_mismatch(
        self, tensors: Sequence[Any], grad_enabled: bool, *, shapes: bool = True
    ) -> SpecMismatchError | None:
        """The error naming the first input tensor that differs from capture, or ``None``.

        ``shapes=False`` compares everything but the shapes (the shape buckets' dispatch does).
        """
        for path, tensor, (shape, dtype, device, requires_grad) in zip(
            self.paths, tensors, self._expected, strict=True
        ):
            if shapes:
                expected = f"{dtype_name(dtype)}[{', '.join(map(str, shape))}] on {device}"
            else:
                expected = f"a {dtype_name(dtype)} tensor on {device}"
            if not isinstance(tensor, torch.Tensor):
                found = f"an object of type {type(tensor).__module__}.{type(tensor).__qualname__}"
                return SpecMismatchError(f"{path}: expected {expected}, got {found}", path=path)
            why = unsupported_tensor(tensor)
            if why is not None:
                return SpecMismatchError(f"{path}: expected {expected}, got {why}", path=path)
            if shapes:
                shape_found = ", ".join(map(str, tensor.shape))
                found = f"{dtype_name(tensor.dtype)}[{shape_found}] on {tensor.device}"
            else:
                found = f"a {dtype_name(tensor.dtype)} tensor on {tensor.device}"
            if found != expected:
                return SpecMismatchError(f"{path}: expected {expected}, got {found}", path=path)
            if tensor.requires_grad and not requires_grad and grad_enabled:
                return SpecMismatchError(
                    f"{path}: requires grad, but was captured without requires_grad, so no "
                    "gradient would reach it; pass a sample that requires grad when capturing",
                    path=path,
                )
        return None
