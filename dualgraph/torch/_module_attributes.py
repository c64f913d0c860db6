"""The plain Python attributes of a module and its submodules, as the checking tools found them.

``lint``, ``memory_plan`` and ``verify`` run a module's forward; Python code in it may rebind
attributes (a counter ``self.calls += 1``, a cache set on first use). What a call rebinds,
adds or deletes in any submodule's ``__dict__`` is put back afterwards; parameters, buffers and
submodules live in dicts the call does not rebind, and are put back on their own. Objects
changed in place (a list appended to) are not copied, so they stay changed.

>>> import torch
>>> layer = torch.nn.Linear(2, 2)
>>> saved = module_attributes(layer)
>>> layer.calls = 3
>>> put_back(saved)
>>> hasattr(layer, "calls")
False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["module_attributes", "put_back"]

Saved = Sequence[tuple[dict[str, Any], dict[str, Any]]]


def module_attributes(*roots: torch.nn.Module | None) -> Saved:
    """Each submodule's ``__dict__`` with a shallow copy of it, once for a submodule several
    ``roots`` share (nothing for ``None``: a function that names no module)."""
    saved: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for root in roots:
        if root is not None:
            for module in root.modules():
                saved.setdefault(id(module), (module.__dict__, dict(module.__dict__)))
    return list(saved.values())


def put_back(saved: Saved) -> None:
    """Every entry as it was: the same objects under the same names, and no others."""
    for live, kept in saved:
        for name in [name for name in live if name not in kept]:
            del live[name]
        for name, value in kept.items():
            if name not in live or live[name] is not value:
                live[name] = value
