"""Functional dropout switched off for an eager check, as dropout modules at ``p=0`` are.

The padding check (``_padding.py``) compares a call with the same call padded; random draws make
values incomparable (a padded call draws for the padded shape), so it sets dropout modules to
``p=0``. Dropout called as a function (``F.dropout(h, p, self.training)``, as ``ViTBlock``
does; ``F.dropout1d``, alpha dropout, the attention dropout of
``F.scaled_dot_product_attention(dropout_p=)`` and so of ``nn.MultiheadAttention``) has no
module to set: :class:`DropoutOff` makes each such call what it is at ``p=0``, and a randomized
leaky ReLU (``F.rrelu``, ``nn.RReLU``) what it is out of training (its mean slope), so the check
can compare values. Both act on each element by its own draw and move nothing between
positions, so what padding would leak is the same with them off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["DropoutOff"]

#: Dropout functions whose first argument is the input, returned as ``p=0`` returns it.
_DROPOUTS = frozenset(
    {
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
        torch.dropout,
        torch.dropout_,
        torch.feature_dropout,
        torch.feature_dropout_,
        torch.alpha_dropout,
        torch.alpha_dropout_,
        torch.feature_alpha_dropout,
        torch.feature_alpha_dropout_,
    }
)

#: Where ``F.scaled_dot_product_attention`` takes ``dropout_p`` by position.
_SDPA_DROPOUT_AT = 4

#: Randomized leaky ReLUs, and where they take ``training`` by position.
_RRELUS = frozenset({F.rrelu, F.rrelu_})
_RRELU_TRAINING_AT = 3


class DropoutOff(TorchFunctionMode):
    """Within it, functional dropout draws nothing: each call returns what ``p=0`` returns.

    >>> x = torch.ones(4)
    >>> with DropoutOff():
    ...     torch.nn.functional.dropout(x, 0.5, training=True) is x
    True
    >>> with DropoutOff():
    ...     torch.nn.functional.rrelu(-x, 0.25, 0.75, training=True)
    tensor([-0.5000, -0.5000, -0.5000, -0.5000])
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]  # as at p=0: the input itself
        if func is F.scaled_dot_product_attention:
            args, kwargs = _with(args, kwargs, _SDPA_DROPOUT_AT, "dropout_p", 0.0)
        elif func in _RRELUS:
            args, kwargs = _with(args, kwargs, _RRELU_TRAINING_AT, "training", False)
        return func(*args, **kwargs)


def _with(
    args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the one at ``position`` (or keyword ``name``) set to ``value``.

    >>> _with((1, 2, 3), {}, 1, "b", 0)
    ((1, 0, 3), {})
    >>> _with((1,), {}, 1, "b", 0)
    ((1,), {'b': 0})
    """
    if len(args) > position:
        return (*args[:position], value, *args[position + 1 :]), kwargs
    return args, {**kwargs, name: value}
