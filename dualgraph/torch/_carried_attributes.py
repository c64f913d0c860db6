"""The Python attributes a caller's input tensors carry, which the callable's Python may read.

A caller may hang a value on a tensor it passes (``x.scale = 2.0``, a data pipeline's tag) and
the forward read it (``getattr(x, "scale", 1.0)``). Eager reads the call's own; a capture's
Python read the static input buffer's, and on CUDA no Python runs on a replay, so whatever the
forward computed from it stays the capture's. So the static inputs carry their samples'
attributes while the callable's Python runs (warmup and capture), and a call whose tensor
carries other public attributes (other names, or other values: plain values compared as the
kernels use them, other objects by identity) is refused naming the path, before any buffer is
written. ``_private`` names are libraries' bookkeeping (Transformer Engine's fuser marks its
inputs ``_do_not_clear``) and are not compared, nor are names the callable sets on that input
itself (set again on each call's input).

>>> import torch
>>> sample = torch.zeros(2)
>>> sample.scale = 2.0
>>> carried = CarriedAttributes(["args[0]"], [sample])
>>> call = torch.ones(2)
>>> call.scale = 3.0
>>> carried.differ([call])
True
>>> print(carried.refusal([call]))
args[0]: carries the attribute scale = 3.0, where its sample carried 2.0: ...
>>> call.scale = 2.0
>>> carried.differ([call])
False
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch

from .._errors import SpecMismatchError
from ._params import _same_plain

__all__ = ["CarriedAttributes", "dict_of", "public_attributes", "set_by_call", "set_since"]

#: a tensor's ``__dict__``: falsy where it carries no attribute
dict_of = attrgetter("__dict__")


def public_attributes(tensor: torch.Tensor, ignored: Collection[str] = ()) -> dict[str, Any]:
    """The attributes ``tensor`` carries under public names, ``ignored`` ones aside.

    >>> x = torch.ones(1)
    >>> x.scale, x._do_not_clear = 2.0, True
    >>> public_attributes(x)
    {'scale': 2.0}
    """
    return {
        name: value
        for name, value in vars(tensor).items()
        if not name.startswith("_") and name not in ignored
    }


def set_by_call(tensor: torch.Tensor, before: dict[str, Any]) -> list[str]:
    """The public names a call set on ``tensor`` (new, or rebound since ``before``).

    >>> x = torch.ones(1)
    >>> before = public_attributes(x)
    >>> x.seen = True
    >>> set_by_call(x, before)
    ['seen']
    """
    return list(set_since(public_attributes(tensor), before))


def set_since(attributes: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``attributes`` new since ``before``, or bound to another object (by identity:
    ``x.seen = True`` again is no change, a new list of equal items is one).

    >>> set_since({"seen": True, "tag": "a", "step": 2}, {"seen": True, "step": 1})
    {'tag': 'a', 'step': 2}
    """
    return {
        name: value
        for name, value in attributes.items()
        if name not in before or before[name] is not value
    }


class CarriedAttributes:
    """The public attributes each sample tensor carried (by input position): given to the
    static inputs (:meth:`give`), and compared on each call (:meth:`differ`)."""

    __slots__ = ("_compared", "_expected", "_ignored", "_paths", "any_expected")

    def __init__(self, paths: Sequence[str], samples: Sequence[torch.Tensor]) -> None:
        self._paths = tuple(paths)
        self._expected = tuple(public_attributes(t) for t in samples)
        self._ignored: tuple[frozenset[str], ...] = tuple(frozenset() for _ in samples)
        #: what each call's tensor must carry: the expected attributes, ignored ones aside
        self._compared = self._expected
        #: whether some sample carried a public attribute (else a call's tensors carry none)
        self.any_expected = any(self._expected)

    def give(self, static_inputs: Sequence[torch.Tensor]) -> None:
        """Hang each sample's public attributes on its static input."""
        for tensor, attributes in zip(static_inputs, self._expected, strict=True):
            tensor.__dict__.update(attributes)

    def ignore(self, position: int, names: Collection[str]) -> None:
        """Leave ``names`` of the input at ``position`` uncompared: the callable sets them."""
        if not names:
            return
        ignored = list(self._ignored)
        ignored[position] |= frozenset(names)
        self._ignored = tuple(ignored)
        self._compared = tuple(
            {k: v for k, v in expected.items() if k not in skip}
            for expected, skip in zip(self._expected, self._ignored, strict=True)
        )

    def differ(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a call's tensors carry other public attributes than the samples did (per
        call: one ``__dict__`` test a tensor where no sample carried any, and none does)."""
        if not self.any_expected and not any(map(dict_of, tensors)):
            return False
        return self._difference(tensors) is not None

    def refusal(self, tensors: Sequence[torch.Tensor]) -> SpecMismatchError:
        """The refusal of a call whose tensors :meth:`differ`, naming the first path."""
        found = self._difference(tensors)
        assert found is not None
        position, name, now, then = found
        path = self._paths[position]
        if now is _ABSENT:
            what = f"carries no attribute {name}, where its sample carried {_shown(then)}"
        elif then is _ABSENT:
            what = f"carries the attribute {name} = {_shown(now)}, which its sample did not"
        else:
            what = (
                f"carries the attribute {name} = {_shown(now)}, where its sample carried "
                f"{_shown(then)}"
            )
        return SpecMismatchError(
            f"{path}: {what}: the callable's Python ran at capture on a buffer carrying the "
            "sample's, and a replay runs no Python, so what it read of them "
            f"(getattr(x, {name!r})) would stay the sample's. Pass such a value as an argument, "
            "or graph with a sample carrying the same",
            path=path,
        )

    def _difference(self, tensors: Sequence[torch.Tensor]) -> tuple[int, str, Any, Any] | None:
        for position, (tensor, then, ignored) in enumerate(
            zip(tensors, self._compared, self._ignored, strict=True)
        ):
            if not then and not tensor.__dict__:  # nothing expected, nothing carried
                continue
            now = public_attributes(tensor, ignored)
            for name in (*then, *(k for k in now if k not in then)):
                a, b = now.get(name, _ABSENT), then.get(name, _ABSENT)
                if a is not b and (a is _ABSENT or b is _ABSENT or not _same_plain(a, b)):
                    return position, name, a, b
        return None


_ABSENT: Any = object()


def _shown(value: Any) -> str:
    """A value as a refusal shows it: a plain one as written, another by its type."""
    if type(value) in (bool, int, float, str, type(None)):
        return repr(value)
    return f"a {type(value).__name__}"
