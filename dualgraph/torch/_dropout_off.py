"""Functional dropout switched off for an eager check, as dropout modules at ``p=0`` are.

The padding check (``_padding.py``) compares a call with the same call padded; random draws make
values incomparable (a padded call draws for the padded shape), so it sets dropout modules to
``p=0``. Dropout called as a function (``F.dropout(h, p, self.training)``, as ``ViTBlock``
does; ``F.dropout1d``, alpha dropout, the attention dropout of
``F.scaled_dot_product_attention(dropout_p=)`` and so of ``nn.MultiheadAttention``) has no
module to set: :class:`DropoutOff` makes each such call what it is at ``p=0``, so the check can
compare values. Dropout scales each element by its own draw and moves nothing between
positions, so what padding would leak is the same with it off.
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


class DropoutOff(TorchFunctionMode):
    """Within it, functional dropout draws nothing: each call returns what ``p=0`` returns.

    >>> x = torch.ones(4)
    >>> with DropoutOff():
    ...     torch.nn.functional.dropout(x, 0.5, training=True) is x
    True
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
            if len(args) > _SDPA_DROPOUT_AT:
                args = (*args[:_SDPA_DROPOUT_AT], 0.0, *args[_SDPA_DROPOUT_AT + 1 :])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)
