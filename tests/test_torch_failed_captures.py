"""A failed capture, on every entry point, leaves the module and the process as they were.

A matrix: each way of graphing (module, method, graphed together, ``slots=``, ``schedule=``,
exact and padded buckets; each ``param_grads``) against failures at each phase (the first
warmup forward, a later warmup's backward, the capture's forward, the last bucket). Each cell
checks that the error is a :class:`DualgraphError`, that ``forward``, parameters, ``.grad``
(a value the user had), buffers and the RNG are as before, that the module then runs eagerly
as its twin does, and that graphing it again works and matches eager.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch_cases import assert_trees_match, isolation

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


class Flaky(nn.Module):
    """Raises at the ``fail_at``-th forward (or its backward) since ``arm``; counts otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("seen", torch.zeros(4))
        self.calls = 0
        self.fail_at = -1
        self.in_backward = False
        self.siblings: list[Flaky] = []

    def forward(self, x: torch.Tensor, valid_length: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        self.seen.add_(x.detach().sum(0))
        h = self.drop(self.lin(x))
        if self.calls == self.fail_at:
            if not self.in_backward:
                raise RuntimeError("planted failure in forward")
            h.register_hook(_raise)
        return h

    def method(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def _raise(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("planted failure in backward")


#: name -> (the forward to fail at, counted from the first, and whether its backward fails)
FAILURES = {
    "first_warmup": (1, False),
    "warmup_backward": (2, True),
    "capture_forward": (3, False),
    "last_one": (-2, False),  # the last forward the capture runs (the last bucket's, slot's, ...)
}
ENTRIES = ["module", "method", "together", "slots", "schedule", "buckets", "pad"]
MODES = ["auto", "autograd", "in_graph"]


def _graph(entry: str, model: Flaky, param_grads: str) -> Any:
    g = torch.Generator().manual_seed(7)  # samples drawn without the global RNG
    x = torch.randn(2, 4, generator=g, requires_grad=True)
    options: dict[str, Any] = {
        "backend": "emulate",
        "param_grads": param_grads,
        "num_warmup_iters": 2,
    }
    if entry == "method":
        return dgt.make_graphed_callables(model.method, (x,), **options)
    if entry == "together":
        sibling = model.siblings[0]  # graphed with it, captured after it
        return dgt.make_graphed_callables((model, sibling), ((x,), (x,)), **options)[0]
    if entry == "slots":
        return dgt.make_graphed_callables(model, (x,), slots=2, **options)
    if entry == "schedule":
        return dgt.make_graphed_callables(model, (x,), schedule=[1, -1, 1, -1], **options)
    if entry in ("buckets", "pad"):
        buckets = [(torch.randn(rows, 4, generator=g, requires_grad=True),) for rows in (2, 3)]
        pad = {"fallback": "pad", "dynamic_dims": {"args[0]": 0, "output": 0}}
        return dgt.make_graphed_callables(
            model, buckets=buckets, **(pad if entry == "pad" else {}), **options
        )
    return dgt.make_graphed_callables(model, (x,), **options)


def _forwards_of_a_capture(entry: str, param_grads: str) -> int:
    """How many forwards a capture of ``entry`` runs (counted on one that succeeds)."""
    model = Flaky()
    model.siblings = [Flaky()]
    if entry == "method":
        model.requires_grad_(False)
    _graph(entry, model, param_grads)
    return model.calls


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("param_grads", MODES)
def test_a_failed_capture_leaves_the_module_as_it_was(
    param_grads: str, entry: str, failure: str
) -> None:
    torch.manual_seed(0)
    model = Flaky()
    model.siblings = [Flaky()]  # not a submodule: graphed with it, for "together"
    if entry == "method":  # a bound method's parameters must be frozen
        model.requires_grad_(False)
    twin = copy.deepcopy(model)
    if entry != "method":  # a .grad the user had before graphing
        for p in (*model.parameters(), *twin.parameters()):
            p.grad = torch.full_like(p, 0.5)
    forward = model.forward
    at, in_backward = FAILURES[failure]
    if at < 0:
        at = _forwards_of_a_capture(entry, param_grads) + 1 + at
    model.fail_at, model.in_backward = at, in_backward
    rng = torch.get_rng_state()
    planted = "backward" if in_backward else "forward"
    with pytest.raises(DualgraphError, match=f"RuntimeError: planted failure in {planted}"):
        _graph(entry, model, param_grads)
    assert model.calls >= at, "the planted failure did not run"
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.forward == forward and "forward" not in vars(model)
    assert_trees_match(dict(model.named_parameters()), dict(twin.named_parameters()))
    assert_trees_match([p.grad for p in model.parameters()], [p.grad for p in twin.parameters()])
    assert_trees_match(dict(model.named_buffers()), dict(twin.named_buffers()))
    # eager calls work, as the twin's
    model.fail_at = twin.fail_at = -1
    model.eval(), twin.eval()
    x = torch.randn(2, 4)
    assert_trees_match(model(x), twin(x))
    model.train(), twin.train()
    # and graphing again works
    graphed = _graph(entry, model, param_grads)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(2, 4, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        torch.manual_seed(seed + 10)
        out = graphed(x)
        torch.manual_seed(seed + 10)
        eager = (twin.method if entry == "method" else twin)(x_eager)
        out.square().sum().backward()
        eager.square().sum().backward()
        assert_trees_match(out, eager)
        assert_trees_match(x.grad, x_eager.grad)
    assert_trees_match([p.grad for p in model.parameters()], [p.grad for p in twin.parameters()])


#: What a capture watches for its extent (grad mode set on while on; attributes looked up in
#: vain) and must put back, however it ends.
_SET_GRAD_ENABLED = torch._C._set_grad_enabled
_MODULE_GETATTR = nn.Module.__getattr__


class _FailsWhileWatched(nn.Module):
    """Looks up an optional attribute, then fails inside its own enable_grad at a given call."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        scale = getattr(self, "scale", 1.0)
        with torch.enable_grad():
            if self.calls == self.fail_at:
                raise RuntimeError("planted failure")
            return self.lin(x) * scale


# the first warmup, the second warmup, capture (call 2, the no_grad forward run because it
# turns grad mode on, does not fail the capture where it raises: such a call is refused instead)
@pytest.mark.parametrize("fail_at", [1, 3, 4])
def test_a_failed_capture_puts_back_what_it_watched(fail_at: int) -> None:
    model = _FailsWhileWatched(fail_at)
    with torch.no_grad():
        with pytest.raises(DualgraphError, match="planted failure"):
            dgt.make_graphed_callables(
                model,
                (torch.randn(2, 4, requires_grad=True),),
                backend="emulate",
                num_warmup_iters=2,
            )
        assert not torch.is_grad_enabled()  # the caller's grad mode
    assert model.calls == fail_at
    assert torch._C._set_grad_enabled is _SET_GRAD_ENABLED
    assert nn.Module.__getattr__ is _MODULE_GETATTR
    model.fail_at = -1
    graphed = dgt.make_graphed_callables(
        model, (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(graphed(x), model.lin(x))


class _CheckpointedInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True))


def test_a_reentrant_checkpoint_inside_the_callable_is_a_capture_error_naming_the_way_out() -> None:
    """Its backward refuses the ``torch.autograd.grad`` a warmup and a capture run (README):
    a ``CaptureError`` saying ``use_reentrant=False``, the module left to run eagerly."""
    module = _CheckpointedInside()
    forward = module.forward
    with pytest.raises(CaptureError, match="use_reentrant=False"):
        dgt.make_graphed_callables(module, (torch.randn(2, 4, requires_grad=True),))
    assert module.forward == forward
    assert all(p.grad is None for p in module.parameters())
    x = torch.randn(2, 4, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and module.a.weight.grad is not None


def test_a_capture_failing_on_a_generator_of_ones_own_names_it_and_what_to_do() -> None:
    # torch's message (a TORCH_CHECK in CUDAGeneratorState::increase) named neither
    from dualgraph.torch._capture_failure import Progress, describe_failure

    error = RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode.")
    message = str(describe_failure(error, Progress(name="Noisy", phase="forward capture"), "cuda"))
    assert message.startswith("capturing Noisy (cuda) failed during forward capture: RuntimeError")
    assert "a torch.Generator of your own draws random numbers inside the callable" in message
    assert "lint='error' names the line" in message


def test_a_cuda_sync_failure_in_anomaly_mode_names_anomaly_modes_nan_check() -> None:
    from dualgraph.torch._capture_failure import Progress, describe_failure

    sync = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    progress = Progress(name="Block", phase="backward capture")
    plain = str(describe_failure(sync, progress, "cuda"))
    assert "a CPU sync such as .item()" in plain and "anomaly" not in plain
    with torch.autograd.set_detect_anomaly(True):
        in_anomaly_mode = str(describe_failure(sync, progress, "cuda"))
    assert "anomaly mode is on: its NaN check reads each backward node's grads" in in_anomaly_mode
    assert "check_nan=False" in in_anomaly_mode
