"""A pipeline-parallel training step simulated on one device, for graphed and eager stages alike.

The model is ``stages * chunks`` pieces (:class:`Piece`, a residual MLP returning a dict with a
``None`` leaf and a constant); stage ``s`` holds pieces ``s``, ``s + stages``, ... (its chunks).
:func:`device_order` interleaves the stages' schedules into one order a single device can run,
each pass after those it depends on, as the stages would run them in parallel;
:class:`Pipeline` runs a step in that order as pipeline-parallel training does: a stage's forward
takes the previous piece's output as a fresh leaf that requires grad, its backward is
``torch.autograd.backward(output, grad)`` with the grad the next piece's input received, and the
last piece's backward is that of its loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dualgraph.torch as dgt

DIM = 8
BATCH = 4


class Piece(nn.Module):
    """``x + fc2(tanh(fc1(x))) * scale`` (dropout optional), as a dict with ``None`` and an int."""

    def __init__(self, index: int, dim: int = DIM, dropout: float = 0.0) -> None:
        super().__init__()
        self.index = index
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, Any]:
        h = self.fc2(torch.tanh(self.fc1(x)))
        if self.dropout:
            h = F.dropout(h, self.dropout, self.training)
        return {"hidden": x + h * scale, "aux": None, "piece": self.index}


@dataclass(frozen=True)
class Pass:
    """One pass of the device order: stage, chunk (from 0), micro-batch, and which direction."""

    stage: int
    chunk: int
    microbatch: int
    backward: bool


def device_order(schedules: Sequence[dgt.Schedule]) -> list[Pass]:
    """The stages' passes in rounds (one pass per stage per round, where it can run).

    A forward of piece ``v`` waits for the forward of piece ``v - 1`` of the same micro-batch; a
    backward for the backward of piece ``v + 1`` (the last piece: for its own forward).
    """
    stages = len(schedules)
    chunks = schedules[0].chunks
    pieces = stages * chunks
    position = [0] * stages
    forwards = [[0] * chunks for _ in range(stages)]
    backwards = [[0] * chunks for _ in range(stages)]
    done: set[tuple[int, int, bool]] = set()  # (piece, micro-batch, backward)
    order: list[Pass] = []
    while any(position[s] < len(schedules[s].order) for s in range(stages)):
        ran = False
        for s in range(stages):
            if position[s] == len(schedules[s].order):
                continue
            c = schedules[s].order[position[s]]
            chunk = abs(c) - 1
            piece = chunk * stages + s
            if c > 0:
                microbatch = forwards[s][chunk]
                ready = piece == 0 or (piece - 1, microbatch, False) in done
            else:
                microbatch = backwards[s][chunk]
                after = (piece, microbatch, False) if piece == pieces - 1 else None
                ready = (piece + 1, microbatch, True) in done or (
                    after is not None and after in done
                )
            if not ready:
                continue
            order.append(Pass(s, chunk, microbatch, c < 0))
            done.add((piece, microbatch, c < 0))
            (backwards if c < 0 else forwards)[s][chunk] += 1
            position[s] += 1
            ran = True
        if not ran:
            raise AssertionError(f"the schedules deadlock at positions {position}")
    return order


class Pipeline:
    """Runs training steps of ``pieces`` (callables, graphed or not) in a device order."""

    def __init__(
        self,
        pieces: Sequence[Callable[..., Any]],
        order: Sequence[Pass],
        stages: int,
        data: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        forward_under: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        ),
    ) -> None:
        self.pieces = list(pieces)
        self.order = list(order)
        self.stages = stages
        self.data = data  # per micro-batch: (input, target, scale)
        # what each forward pass and its loss run under (an autocast: torch's AMP recipe, as
        # Megatron's forward step; the backward passes run outside it)
        self.forward_under = forward_under

    def step(self) -> list[float]:
        """One step: every pass in order; returns the micro-batches' losses."""
        last = len(self.pieces) - 1
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], Any] = {}
        losses: dict[int, torch.Tensor] = {}
        sent: dict[tuple[int, int], torch.Tensor] = {}  # activations and grads "on the wire"
        for scheduled in self.order:
            piece = scheduled.chunk * self.stages + scheduled.stage
            key = (piece, scheduled.microbatch)
            x, target, scale = self.data[scheduled.microbatch]
            if not scheduled.backward:
                if piece == 0:
                    received = x
                else:
                    received = sent.pop((piece - 1, scheduled.microbatch)).requires_grad_()
                inputs[key] = received
                with self.forward_under():
                    out = self.pieces[piece](received, scale=scale)
                    if piece == last:
                        losses[scheduled.microbatch] = F.mse_loss(out["hidden"], target) / len(
                            self.data
                        )
                assert out["aux"] is None and out["piece"] == piece
                outputs[key] = out
                if piece != last:
                    sent[key] = out["hidden"].detach()
                continue
            out = outputs.pop(key)
            if piece == last:
                losses[scheduled.microbatch].backward()
            else:
                grad = sent.pop(key)  # what the next piece's input received
                torch.autograd.backward(out["hidden"], grad)
            received = inputs.pop(key)
            if piece > 0:
                assert received.grad is not None
                sent[(piece - 1, scheduled.microbatch)] = received.grad
            del out
        assert not outputs and not inputs and not sent
        return [losses[i].item() for i in sorted(losses)]


def make_pieces(
    pieces: int, device: torch.device, dropout: float = 0.0
) -> tuple[list[Piece], list[Piece]]:
    """The pieces to graph, and an eager twin of each with the same weights."""
    graphed = [Piece(i, dropout=dropout).to(device) for i in range(pieces)]
    return graphed, [copy.deepcopy(piece) for piece in graphed]


def make_data(
    microbatches: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(input, target, scale)`` per micro-batch."""
    return [
        (
            torch.randn(BATCH, DIM, device=device),
            torch.randn(BATCH, DIM, device=device),
            torch.rand(DIM, device=device) + 0.5,
        )
        for _ in range(microbatches)
    ]


def samples(piece: int, device: torch.device) -> tuple[tuple[torch.Tensor], dict[str, Any]]:
    """Sample args and kwargs of a piece: the first takes data, the others a leaf with grad."""
    x = torch.randn(BATCH, DIM, device=device, requires_grad=piece > 0)
    return (x,), {"scale": torch.rand(DIM, device=device)}
