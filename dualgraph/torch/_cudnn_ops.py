"""Whether a callable runs convolutions or RNNs, whose kernels and precision cuDNN's settings
choose.

A convolution (and an RNN) on CUDA computes in the TF32 precision, deterministic mode and
algorithm (benchmark mode) that ``torch.backends.cudnn`` says when it runs, or without cuDNN
where it is off; a graph replays what capture chose. A replay compares cuDNN's settings with
capture's only for callables found here to run such ops (``_ambient.cudnn_settings``): others
read nothing, and ``dualgraph.parity``'s full-precision convolutions refuse none of them.

Found in the inspected warmup, at no cost to the replay: by the autograd graph of its outputs
(a convolution's node, whatever calls it) and by the modules it runs (a convolution or RNN
module, which also covers a frozen one that leaves no node, and an RNN on the CPU, whose graph
holds its cells' ops).

>>> conv = torch.nn.Conv1d(1, 1, 3)
>>> cudnn_ops_run([conv(torch.ones(1, 1, 4)).grad_fn], [])
(True, False)
>>> cudnn_ops_run([(torch.ones(2, requires_grad=True) * 2).grad_fn], [torch.nn.Linear(2, 2)])
(False, False)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["cudnn_ops_run"]

# Every convolution's node is ``convolution``'s (ConvolutionBackward0) whichever backend runs
# it; cuDNN's and MIOpen's (ROCm's counterpart) own convolutions and RNNs are named so too.
_CONVOLUTION_MARKS = ("Convolution", "SlowConv")
_RNN_MARKS = ("CudnnRnn", "MiopenRnn")


def cudnn_ops_run(nodes: Iterable[Any], modules: Iterable[torch.nn.Module]) -> tuple[bool, bool]:
    """Whether the autograd ``nodes`` (those of the outputs' graph, walked once already:
    ``_reach.trace_leaves``) or ``modules`` (each with its submodules) hold a convolution, and
    an RNN: ``(convolution, rnn)``."""
    convolution = rnn = False
    for module in modules:
        for m in module.modules():
            convolution |= isinstance(m, torch.nn.modules.conv._ConvNd)
            rnn |= isinstance(m, torch.nn.RNNBase)
    for node in nodes:
        if convolution and rnn:
            break
        name = type(node).__name__
        convolution |= any(mark in name for mark in _CONVOLUTION_MARKS)
        rnn |= any(mark in name for mark in _RNN_MARKS)
    return convolution, rnn
