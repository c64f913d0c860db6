"""A backward that sets torch's RNG state back and draws from there (``torch.utils.checkpoint``
recomputing dropout) is refused at capture; other reads and sets of the RNG state are not."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch_cases import GRAPH_BACKENDS, assert_trees_match, device_of, isolation, tolerance

import dualgraph.torch as dgt
from dualgraph import CaptureError
from dualgraph.torch._rng_rewinds import backward_rewinds


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


class Checkpointed(nn.Module):
    """A block whose linear layer and dropout are recomputed in the backward."""

    def __init__(self, p: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, device=device)
        self.drop = nn.Dropout(p)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False, preserve_rng_state=True)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_checkpoint_recomputing_dropout_in_the_backward_is_refused_at_capture(
    backend: str,
) -> None:
    # On CUDA the backward graph draws its masks from where its own replay finds the generator,
    # not from the forward's position: silently other masks than the forward's.
    device = device_of(backend)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    with pytest.raises(CaptureError, match=r"Checkpointed's backward sets torch's RNG state back"):
        dgt.make_graphed_callables(Checkpointed(0.5, device), (sample,), backend=backend)


def test_a_refused_checkpoint_leaves_the_rng_and_torch_functions_as_they_were() -> None:
    functions = (torch.get_rng_state, torch.set_rng_state, torch.cuda.set_rng_state)
    module, sample = Checkpointed(0.5), torch.randn(3, 4, requires_grad=True)
    state = torch.get_rng_state()
    with pytest.raises(CaptureError):
        dgt.make_graphed_callables(module, (sample,), backend="emulate")
    assert torch.equal(torch.get_rng_state(), state)
    assert (torch.get_rng_state, torch.set_rng_state, torch.cuda.set_rng_state) == functions


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_checkpoint_without_random_ops_is_graphed_and_matches_eager(backend: str) -> None:
    torch.manual_seed(0)
    device = device_of(backend)
    module = Checkpointed(0.0, device)
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(3, 4, device=device, requires_grad=True),), backend=backend
    )
    x = torch.randn(3, 4, device=device, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_(True)
    graphed(x).pow(2).sum().backward()
    twin(x_twin).pow(2).sum().backward()
    tol = tolerance(backend)
    assert_trees_match(x.grad, x_twin.grad, tol)
    assert_trees_match(module.lin.weight.grad, twin.lin.weight.grad, tol)


class _NoisyGrad(torch.autograd.Function):
    """A backward drawing noise under ``fork_rng``: a state read and set back within it."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            return grad * 2 + torch.rand_like(grad)


def test_a_backward_drawing_inside_fork_rng_is_not_a_rewind() -> None:
    graphed = dgt.make_graphed_callables(
        _NoisyGrad.apply, (torch.randn(3, requires_grad=True),), backend="emulate", lint="off"
    )
    x = torch.randn(3, requires_grad=True)
    graphed(x).sum().backward()
    assert x.grad is not None


def test_a_set_state_no_draw_follows_is_no_rewind() -> None:
    state = torch.get_rng_state()
    _ = torch.rand(2)
    with backward_rewinds() as seen:
        torch.set_rng_state(state)
    assert not seen.draws_from_rewound_state
