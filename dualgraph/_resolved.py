"""A torch tensor's values as they read, for whatever takes its memory rather than its view:
DLPack, ``.numpy()``, a byte copy.

torch keeps a conjugate or a negation as a lazy bit on a view (``z.conj()``, ``z.conj().imag``):
the memory holds the values before it. DLPack hands JAX that memory (the other sign, or refuses a
conjugate), ``.numpy()`` refuses such a view, and a byte copy would copy the values of before.
The torch adapter (its bitwise comparisons), the parity bridge and the JAX ViT's loader all read
through :func:`resolved`. It lives in the core, which imports no torch, because the parity
harness uses only the adapters' public names and the JAX model imports no torch: it only calls
the tensor's own methods.

>>> import torch
>>> view = torch.tensor([1 + 2j]).conj().imag  # a negated view of the memory holding 2.0
>>> view.is_neg(), resolved(view).is_neg(), resolved(view)
(True, False, tensor([-2.]))
"""

from __future__ import annotations

from typing import Protocol, TypeVar

__all__ = ["resolved"]


class _LazyBits(Protocol):
    """What :func:`resolved` calls: a ``torch.Tensor``'s methods."""

    def detach(self: _Tensor) -> _Tensor: ...
    def resolve_conj(self: _Tensor) -> _Tensor: ...
    def resolve_neg(self: _Tensor) -> _Tensor: ...


_Tensor = TypeVar("_Tensor", bound=_LazyBits)


def resolved(tensor: _Tensor) -> _Tensor:
    """``tensor`` (a ``torch.Tensor``) detached, its lazy conjugate and negative bits applied to
    its values: a copy where it had one, else ``tensor`` itself, detached."""
    return tensor.detach().resolve_conj().resolve_neg()
