"""Validation of a graphed callable's arguments against what it was captured with.

Runs on every call, before any static buffer is written: structure, ``None`` positions and
non-tensor values through the core spec's compiled flatten, then each tensor's shape, dtype,
device and ``requires_grad`` against values precomputed at capture time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import DualgraphError, SpecMismatchError
from .._spec import TreeSpec, describe
from ._leaves import dtype_name

__all__ = ["InputGuard"]


class InputGuard:
    """The capture-time description of ``(args, kwargs)``; :meth:`tensors` checks a call.

    >>> guard = InputGuard((torch.zeros(2, 3),), {"scale": 2.0})
    >>> len(guard.tensors((torch.ones(2, 3),), {"scale": 2.0}))
    1
    >>> guard.tensors((torch.ones(2, 4),), {"scale": 2.0})
    Traceback (most recent call last):
    ...
    dualgraph.SpecMismatchError: args[0]: expected float32[2, 3] on cpu, got ...
    """

    __slots__ = (
        "_expected",
        "_has_kwargs",
        "_paths",
        "args_spec",
        "kwargs_spec",
        "num_args_tensors",
    )

    def __init__(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> None:
        args = tuple(args)
        kwargs = dict(kwargs or {})
        self.args_spec: TreeSpec = describe(args, root="args")
        self.kwargs_spec: TreeSpec = describe(kwargs, root="kwargs")
        self._has_kwargs = bool(kwargs)
        tensors = self.args_spec.flatten(args) + self.kwargs_spec.flatten(kwargs)
        paths = [f"args{p}" for p in self.args_spec.array_paths]
        paths += [f"kwargs{p}" for p in self.kwargs_spec.array_paths]
        for path, leaf in zip(paths, tensors, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise DualgraphError(
                    f"{path}: array leaves of a torch callable's inputs must be torch tensors, "
                    f"got {type(leaf).__module__}.{type(leaf).__qualname__}"
                )
        self.num_args_tensors = self.args_spec.num_arrays
        self._paths = tuple(paths)
        self._expected = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """For each input tensor (args first, then kwargs): did it require grad at capture?"""
        return tuple(expected[3] for expected in self._expected)

    @property
    def paths(self) -> tuple[str, ...]:
        """The path of each input tensor, e.g. ``args[0]`` or ``kwargs['mask']``."""
        return self._paths

    def tensors(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The input tensors of a call, in capture order; raises naming the first bad leaf."""
        tensors = self.args_spec.flatten(args, root="args")
        if kwargs or self._has_kwargs:
            if type(kwargs) is not dict:
                kwargs = dict(kwargs)
            tensors += self.kwargs_spec.flatten(kwargs, root="kwargs")
        grad_enabled = torch.is_grad_enabled()
        for tensor, (shape, dtype, device, requires_grad) in zip(
            tensors, self._expected, strict=True
        ):
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.shape != shape
                or tensor.dtype != dtype
                or tensor.device != device
                or (tensor.requires_grad and not requires_grad and grad_enabled)
            ):
                raise self._explain(tensors, grad_enabled)
        return tensors

    def _explain(self, tensors: list[Any], grad_enabled: bool) -> SpecMismatchError:
        for path, tensor, (shape, dtype, device, requires_grad) in zip(
            self._paths, tensors, self._expected, strict=True
        ):
            expected = f"{dtype_name(dtype)}[{', '.join(map(str, shape))}] on {device}"
            if not isinstance(tensor, torch.Tensor):
                found = f"an object of type {type(tensor).__module__}.{type(tensor).__qualname__}"
                return SpecMismatchError(f"{path}: expected {expected}, got {found}", path=path)
            shape_found = ", ".join(map(str, tensor.shape))
            found = f"{dtype_name(tensor.dtype)}[{shape_found}] on {tensor.device}"
            if found != expected:
                return SpecMismatchError(f"{path}: expected {expected}, got {found}", path=path)
            if tensor.requires_grad and not requires_grad and grad_enabled:
                return SpecMismatchError(
                    f"{path}: requires grad, but was captured without requires_grad, so no "
                    "gradient would reach it; pass a sample that requires grad when capturing",
                    path=path,
                )
        return SpecMismatchError("the inputs do not match the captured ones")
