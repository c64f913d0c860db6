"""TEMPORARY stand-in for the core's ``dualgraph.CallSpec`` until branch ``core`` lands it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._spec import LeafSpec, TreeSpec, describe

__all__ = ["CallSpec", "describe_call"]


class CallSpec:
    def __init__(self, args_spec: TreeSpec, kwargs_spec: TreeSpec) -> None:
        self.args_spec = args_spec
        self.kwargs_spec = kwargs_spec
        self.array_paths = (
            *("args" + p for p in args_spec.array_paths),
            *("kwargs" + p for p in kwargs_spec.array_paths),
        )
        self.arrays: tuple[LeafSpec, ...] = (*args_spec.arrays, *kwargs_spec.arrays)
        self.grad_mask = (*args_spec.grad_mask, *kwargs_spec.grad_mask)
        self.num_args_arrays = args_spec.num_arrays
        self.num_arrays = args_spec.num_arrays + kwargs_spec.num_arrays

    def flatten(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, check: bool = False
    ) -> list[Any]:
        arrays = self.args_spec.flatten(tuple(args), check=check, root="args")
        return arrays + self.kwargs_spec.flatten(dict(kwargs), check=check, root="kwargs")

    def unflatten(self, arrays: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        n = self.num_args_arrays
        return self.args_spec.unflatten(arrays[:n]), self.kwargs_spec.unflatten(arrays[n:])

    def __repr__(self) -> str:
        return f"CallSpec(args={self.args_spec!r}, kwargs={self.kwargs_spec!r})"


def describe_call(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> CallSpec:
    return CallSpec(describe(tuple(args), root="args"), describe(dict(kwargs or {}), root="kwargs"))
