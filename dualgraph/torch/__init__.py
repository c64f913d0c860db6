"""PyTorch adapter: CUDA graphs of training callables whose outputs are any tree.

>>> import torch, dualgraph.torch as dgt
>>> f = dgt.make_graphed_callables(lambda x: (x * 2, None), (torch.ones(2),), backend="emulate")
>>> f(torch.ones(2))
(tensor([2., 2.]), None)
"""

from importlib import import_module as _import_module

try:  # a clear message where PyTorch is missing or broken
    _import_module("torch")
except ImportError as _error:
    raise ImportError(
        f"dualgraph.torch needs PyTorch, which did not import ({_error}): "
        "pip install dualgraph[torch]"
    ) from _error

from . import _leaves as _leaves  # registers torch.Tensor with the core
from ._buckets import BucketDiagnostics, BucketedCallable, BucketedDiagnostics
from ._diagnostics import CaptureDiagnostics
from ._eager import EagerCallable
from ._graphed import diagnostics, make_graphed_callables, owned, reset_slots
from ._lint import CaptureLintError, LintFinding, LintReport, lint
from ._memory_plan import CallableMemory, MemoryPlan, memory_plan
from ._modules import restore
from ._replay import GraphedCallable
from ._replay_hooks import ReplayCall, ReplayHooks
from ._schedule import Schedule
from ._slots import SlottedCallable
from ._verify import LeafCheck, VerifyReport, verify

__all__ = [
    "BucketDiagnostics",
    "BucketedCallable",
    "BucketedDiagnostics",
    "CallableMemory",
    "CaptureDiagnostics",
    "CaptureLintError",
    "EagerCallable",
    "GraphedCallable",
    "LeafCheck",
    "LintFinding",
    "LintReport",
    "MemoryPlan",
    "ReplayCall",
    "ReplayHooks",
    "VerifyReport",
    "Schedule",
    "SlottedCallable",
    "diagnostics",
    "lint",
    "make_graphed_callables",
    "memory_plan",
    "owned",
    "reset_slots",
    "restore",
    "verify",
]
