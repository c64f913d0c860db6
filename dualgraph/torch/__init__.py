"""PyTorch adapter: CUDA graphs of training callables whose outputs are any tree.

>>> import torch, dualgraph.torch as dgt
>>> f = dgt.make_graphed_callables(lambda x: (x * 2, None), (torch.ones(2),), backend="emulate")
>>> f(torch.ones(2))
(tensor([2., 2.]), None)
"""

from . import _leaves as _leaves  # registers torch.Tensor with the core
from ._buckets import BucketDiagnostics, BucketedCallable, BucketedDiagnostics
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._graphed import diagnostics, make_graphed_callables, owned, reset_slots
from ._modules import restore
from ._replay import GraphedCallable
from ._schedule import Schedule
from ._slots import SlottedCallable

__all__ = [
    "BucketDiagnostics",
    "BucketedCallable",
    "BucketedDiagnostics",
    "CaptureDiagnostics",
    "EagerCallable",
    "GraphedCallable",
    "Schedule",
    "SlottedCallable",
    "diagnostics",
    "make_graphed_callables",
    "owned",
    "reset_slots",
    "restore",
]
