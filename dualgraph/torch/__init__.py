"""PyTorch adapter: CUDA graphs of training callables whose outputs are any tree.

>>> import torch, dualgraph.torch as dgt
>>> f = dgt.make_graphed_callables(lambda x: (x * 2, None), (torch.ones(2),), backend="emulate")
>>> f(torch.ones(2))
(tensor([2., 2.]), None)
"""

from . import _leaves as _leaves  # registers torch.Tensor with the core
from ._graphed import EagerCallable, diagnostics, make_graphed_callables, owned, restore
from ._inputs import InputGuard
from ._lint import CaptureLintError, LintFinding, LintReport, lint
from ._memory_plan import CallableMemory, MemoryPlan, memory_plan
from ._replay import CaptureDiagnostics, GraphedCallable
from ._verify import LeafCheck, VerifyReport, verify

__all__ = [
    "CallableMemory",
    "CaptureDiagnostics",
    "CaptureLintError",
    "EagerCallable",
    "GraphedCallable",
    "InputGuard",
    "LeafCheck",
    "LintFinding",
    "LintReport",
    "MemoryPlan",
    "VerifyReport",
    "diagnostics",
    "lint",
    "make_graphed_callables",
    "memory_plan",
    "owned",
    "restore",
    "verify",
]
