"""A forward or backward that sets torch's RNG state to one it did not read in the same pass and
draws from there (``torch.utils.checkpoint`` recomputing dropout; ``torch.manual_seed`` in a
forward) is refused at capture; other reads and sets of the RNG state are not."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch_cases import GRAPH_BACKENDS, assert_trees_match, device_of, isolation, tolerance

import dualgraph.torch as dgt
from dualgraph import CaptureError
from dualgraph.torch._rng_rewinds import rng_rewinds


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
    with rng_rewinds() as seen:
        torch.set_rng_state(state)
    assert not seen.draws_from_rewound_state


def _reseeding(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)  # eager: the same noise on every call
    return x + torch.rand_like(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_forward_seeding_torch_before_it_draws_is_refused_at_capture(backend: str) -> None:
    # On CUDA the capture keeps no seed (the same one is a no-op): the replays drew new noise
    # on every call where eager draws the same; lint="off" (the CUDA default is no lint).
    sample = torch.randn(3, device=device_of(backend), requires_grad=True)
    with pytest.raises(CaptureError, match=r"_reseeding's forward seeds torch's RNG"):
        dgt.make_graphed_callables(_reseeding, (sample,), backend=backend, lint="off")


def _forked(x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):  # the state read and set back within the call
        noise = torch.rand_like(x)
    return x + noise


def test_a_forward_drawing_inside_fork_rng_is_graphed_and_matches_eager() -> None:
    graphed = dgt.make_graphed_callables(
        _forked, (torch.randn(3, requires_grad=True),), backend="emulate"
    )
    x = torch.randn(3)
    torch.manual_seed(1)
    out = graphed(x)
    state = torch.get_rng_state()
    torch.manual_seed(1)
    assert torch.equal(out, _forked(x))
    assert torch.equal(torch.get_rng_state(), state)


class _RewindsInAnotherThread(torch.autograd.Function):
    """A backward that sets the RNG state its forward read and draws, in a thread of its own:
    as the autograd engine runs a CUDA device's backward functions (a checkpoint's
    recomputation) in a thread of its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.state = torch.get_rng_state()
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        def redraw() -> None:
            torch.set_rng_state(ctx.state)
            torch.rand(3)

        worker = threading.Thread(target=redraw)
        worker.start()
        worker.join()
        return grad * 2


class _RewindingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RewindsInAnotherThread.apply(self.lin(x))


def test_a_backward_rewinding_the_rng_in_an_engine_thread_is_refused_at_capture() -> None:
    # On CUDA the checkpoint's recomputation ran in the autograd engine's device thread, which
    # the backward's watch (the calling thread's only) never heard: the capture went through.
    sample = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(CaptureError, match=r"backward sets torch's RNG state back"):
        dgt.make_graphed_callables(_RewindingBlock(), (sample,), backend="emulate")


def test_the_rng_watches_begin_and_end_without_a_context_manager_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each inspected warmup enters the seven watches twice (forward and backward): a generator
    # context manager each in an ExitStack cost about as much as the watches themselves.
    from dualgraph.torch._watched_function import WatchedFunction

    entered: list[object] = []
    watching = WatchedFunction.watching

    def noting(self: Any, *args: Any, **kwargs: Any) -> Any:
        entered.append(self)
        return watching(self, *args, **kwargs)

    monkeypatch.setattr(WatchedFunction, "watching", noting)
    state = torch.get_rng_state()
    with rng_rewinds() as seen:
        torch.set_rng_state(state)
        torch.rand(2)
    assert seen.draws_from_rewound_state  # still watched
    assert entered == []
    assert torch.get_rng_state.__module__ == "torch.random"  # put back
