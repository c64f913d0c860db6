"""Sizes and strides of fixed tensors, compared per call in one C call for all of them.

A replay compares the layout (sizes and strides) of the parameters, buffers and ``.grad``
accumulators its graphs read and write with the layout they had at capture: another one (a
transposed ``.data``, a ``.grad`` set to a prefix of its memory) would be read or written by
kernels captured for the old one. ``t.size()`` and ``t.stride()`` build two tuples per
tensor; TorchDynamo's C tensor guard (``TensorGuards``) compares every tensor's sizes and
strides in C++, without building any (about 3x faster for a ViT block's 12 parameters).

The guard also compares what else it reads of a tensor (class, dtype, device, requires_grad,
and its dispatch keys under the thread's autocast and inference mode): where one of those
differs it answers ``False`` though the layouts are the same, and the tuples decide; the guard
is then made again from the tensors as they are, for the calls that follow. Tensors the guard
may not compare as the tuples would (a dimension of size 0 or 1, whose stride some versions of
it ignore; a class that may override ``stride()``) are compared through the tuples only. So
:meth:`Layouts.same` answers as comparing ``size()`` and ``stride()`` of every tensor does.

Example::

    layouts = Layouts.of((weight, bias))  # at capture
    layouts.same()  # per call: False once weight.data = weight.data.t() (say)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Layouts", "exact_guard"]

_TensorGuards: Any
try:  # a C class of torch's (TorchDynamo's guards), not a public API
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without it: the tuples for every tensor
    _TensorGuards = None


def _guard_answers_as_tuples(guards: Any) -> bool:
    """Whether ``guards`` (a private class, whose behaviour another torch may change) tells a
    tensor from the same memory seen with other strides, and from one of other sizes, and
    passes the same tensor: if not, every tensor goes through the tuples."""
    try:
        base = torch.zeros(6)
        tensor = base.as_strided((2, 3), (3, 1))
        guard = guards(tensor, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        return (
            guard.check(tensor) is True
            and guard.check(base.as_strided((2, 3), (1, 2))) is False
            and guard.check(base.as_strided((3, 2), (2, 1))) is False
        )
    except Exception:  # another torch's signature or behaviour
        return False


if _TensorGuards is not None and not _guard_answers_as_tuples(_TensorGuards):
    _TensorGuards = None  # pragma: no cover - a torch whose guard compares otherwise

_stride = torch.Tensor.stride
_size = torch.Tensor.size
# Classes whose stride() and size() are the tensor's own (no __torch_function__ of their own).
_PLAIN = (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", torch.Tensor))


def _guarded(tensor: torch.Tensor, sizes: Sequence[int]) -> bool:
    return type(tensor) in _PLAIN and tensor.layout is torch.strided and min(sizes, default=2) > 1


def _guard_of(tensors: tuple[torch.Tensor, ...]) -> Any:
    """A C guard of ``tensors`` as they are now, or ``None`` (no tensor, or none to be had)."""
    if not tensors or _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # another torch's signature: the tuples, as for the others
        return None


def _guard_answers_as_input_checks(guards: Any) -> bool:
    """Whether ``guards`` also refuses what a graphed call's input checks refuse besides the
    layout (``_guard_answers_as_tuples``): another dtype, ``requires_grad`` where the tensor it
    was made from had none, another class, an inference tensor; a torch whose guard leaves one
    of them to another guard would pass them silently, so :func:`exact_guard` makes none.

    Asked outside inference mode whatever the importer's mode (``import dualgraph.torch``
    inside ``torch.inference_mode()``): there every tensor made is an inference tensor, and the
    answer would be no for the guard of any torch, leaving the process without an input guard.
    """
    try:
        with torch.inference_mode(False):
            return _answers_as_input_checks(guards)
    except Exception:  # another torch's signature or behaviour
        return False


def _answers_as_input_checks(guards: Any) -> bool:
    tensor = torch.zeros(2, 3)
    guard = guards(tensor, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    with torch.inference_mode():
        inference = torch.zeros(2, 3)
    refused = (
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 3, requires_grad=True),
        torch.zeros(2, 3).as_subclass(_Subclass),
        inference,
    )
    return guard.check(torch.ones(2, 3)) is True and not any(
        guard.check(other) for other in refused
    )


class _Subclass(torch.Tensor):
    """A class the self-test's guard must refuse (of a tensor made as a plain one)."""


def exact_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A C guard passing exactly tensors like ``tensors`` (class, dtype, device, sizes,
    strides, ``requires_grad``, dispatch keys under this thread's autocast and inference mode),
    one call for all: ``guard.check(*others)``. ``None`` where one is of a subclass, not
    strided or has a dimension of size 0 or 1 (whose stride the guard may not compare), or
    where there is no such guard.

    >>> guard = exact_guard((torch.zeros(2, 3),))
    >>> guard.check(torch.ones(2, 3)), guard.check(torch.ones(3, 2))
    (True, False)
    """
    tensors = tuple(tensors)
    if not _EXACT or not all(map(_guarded, tensors, map(_size, tensors))):
        return None
    return _guard_of(tensors)


_EXACT = _TensorGuards is not None and _guard_answers_as_input_checks(_TensorGuards)


class Layouts:
    """The sizes and strides ``tensors`` had (``sizes``, ``strides``), compared by
    :meth:`same` on each call: ``True`` exactly when every tensor's ``size()`` and
    ``stride()`` equal them."""

    __slots__ = (
        "_guard",
        "_guarded",
        "_layouts",
        "_others",
        "_others_layouts",
        "_previous_guard",
        "_tensors",
    )

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        sizes: Sequence[Sequence[int]],
        strides: Sequence[Sequence[int]],
    ) -> None:
        self._tensors = tuple(tensors)
        self._layouts = (*map(torch.Size, sizes), *map(tuple, strides))
        guarded = tuple(map(_guarded, self._tensors, sizes))
        self._guarded = tuple(t for t, g in zip(self._tensors, guarded, strict=True) if g)
        self._others = tuple(t for t, g in zip(self._tensors, guarded, strict=True) if not g)
        self._others_layouts = (
            *(torch.Size(s) for s, g in zip(sizes, guarded, strict=True) if not g),
            *(tuple(s) for s, g in zip(strides, guarded, strict=True) if not g),
        )
        # made from the tensors only where they are laid out as recorded
        self._guard = _guard_of(self._guarded) if self._laid_out_as_recorded() else None
        self._previous_guard: Any = None  # the one before: calls may alternate between two

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Layouts:
        """The layouts ``tensors`` have now."""
        return cls(tensors, tuple(map(_size, tensors)), tuple(map(_stride, tensors)))

    def same(self) -> bool:
        """Whether every tensor has the sizes and strides recorded."""
        guard = self._guard
        if (
            guard is not None
            and guard.check(*self._guarded)
            and (
                not self._others
                or (*map(_size, self._others), *map(_stride, self._others)) == self._others_layouts
            )
        ):
            return True
        if not self._laid_out_as_recorded():
            return False
        # The same layouts, and the guard answered False on something else it compares (or
        # there is none): the one before, or one of the tensors as they are now, for the calls
        # that follow (calls alternating between autocast and none, say, make none).
        previous = self._previous_guard
        if previous is None or not previous.check(*self._guarded):
            previous = _guard_of(self._guarded)
        self._guard, self._previous_guard = previous, guard
        return True

    def _laid_out_as_recorded(self) -> bool:
        tensors = self._tensors
        return (*map(_size, tensors), *map(_stride, tensors)) == self._layouts
