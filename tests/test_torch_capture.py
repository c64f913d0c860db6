"""Captures that fail or are refused: the error names the callable, the phase and the cause,
and the module and the process are left usable (no capture open, the caller's stream current,
the CUDA RNG working, buffers and hooks as they were).

Refused on purpose, because a replay would differ from eager without a word: outputs that
depend on tensors requiring grad that are neither inputs nor parameters, outputs whose structure
changes from call to call, outputs no static buffer can hold, parameters the callable updates in
place, inputs updated during backward, lazy modules, and parameter hooks under in-graph grads.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import importlib
import itertools
import queue
import random
import threading
import traceback
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from entry_points import ENTRY_POINTS, Decays, graphed_on
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch_cases import (
    CUDA,
    GRAPH_BACKENDS,
    TinyMLP,
    assert_grads_match,
    assert_tensors_match,
    assert_trees_match,
    backward_of,
    capture_error,
    device_of,
    grads_of,
    isclose_fraction,
    isolation,
    parameter_names,
    parameters_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError, DualgraphWarning
from dualgraph.torch._param_attributes import parameter_attributes_kept


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def step_grads(fn: Any, args: tuple[Any, ...]) -> list[Any]:
    """Forward, backward of ``loss_of``, and the parameters' grads; no graph outlives the call."""
    backward_of(fn(*args))
    grads = grads_of(parameters_of(fn))
    fn.zero_grad(set_to_none=True)
    return grads


# -- failed capture ------------------------------------------------------------------------------


class Exploding(nn.Module):
    """Raises from its forward from the ``fail_at``-th call on (``None``: never)."""

    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # some GPU work first, so that a capture is not empty
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ValueError("exploded on purpose")
        return h


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("phase", ["warmup", "capture"])
def test_failed_capture_names_the_callable_and_the_cause(backend: str, phase: str) -> None:
    warmup = 3
    module = Exploding(fail_at=1 if phase == "warmup" else warmup + 1).to(device_of(backend))
    sample = (torch.randn(2, 8, device=device_of(backend)),)
    message = capture_error(module, sample, backend=backend, num_warmup_iters=warmup)
    during = "forward capture" if phase == "capture" and backend == CUDA else phase
    assert message == (
        f"capturing Exploding ({backend}) failed during {during}: ValueError: exploded on purpose"
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_failed_capture_leaves_the_module_usable_and_graphable(backend: str) -> None:
    device = device_of(backend)
    module = Exploding(fail_at=2).to(device)
    twin = Exploding(fail_at=None).to(device)
    twin.load_state_dict(module.state_dict())
    capture_error(module, (torch.randn(2, 8, device=device),), backend=backend)
    gc.collect()
    assert "forward" not in module.__dict__  # not graphed

    module.fail_at = None
    x = torch.randn(2, 8, device=device)
    assert_grads_match(
        step_grads(module, (x,)),
        step_grads(twin, (x,)),
        parameter_names(module),
        tolerance(backend),
    )

    dgt.make_graphed_callables(module, (torch.randn(2, 8, device=device),), backend=backend)
    for _ in range(2):
        x = torch.randn(2, 8, device=device)
        assert_tensors_match(module(x).detach(), twin(x).detach(), "output", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("phase", ["warmup", "capture"])
def test_a_failed_capture_of_the_second_callable_leaves_the_first_as_it_was(
    backend: str, phase: str
) -> None:
    # The first is warmed up (and on CUDA its forward graph captured) before the second fails:
    # its buffers, parameters and .grad tensors are as they were, and it is not graphed.
    device = device_of(backend)
    first = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(device)
    for p in first.parameters():
        p.grad = torch.full_like(p, 7.0)
    state = {name: t.clone() for name, t in first.state_dict().items()}
    grads = [p.grad for p in first.parameters()]
    second = Exploding(fail_at=1 if phase == "warmup" else 4).to(device)
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in range(2))
    message = capture_error((first, second), samples, backend=backend, num_warmup_iters=3)
    assert message.startswith(f"capturing Exploding ({backend}) failed during")
    assert "forward" not in vars(first) and "forward" not in vars(second)
    for name, tensor in first.state_dict().items():
        assert_tensors_match(tensor, state[name], name)
    for p, grad in zip(first.parameters(), grads, strict=True):
        assert p.grad is grad and bool((grad == 7.0).all())
    second.fail_at = None
    dgt.make_graphed_callables((first, second), samples, backend=backend)  # graphs on retry


class SyncsAfterDropout(nn.Module):
    """Draws a dropout mask, then reads a value back to the CPU: fine eagerly, not in a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc(x), 0.25, self.training)
        if self.sync and h.sum().item() > 1e30:  # never true; .item() is the point
            h = h * 0
        return h


class CudaMallocWorker:
    """Another thread that calls cudaMalloc when asked, and says what came of it.

    :meth:`malloc_now`, called from inside a captured forward, asks for more than all the free
    memory the caching allocator holds (so the allocation must call cudaMalloc) and waits until
    that call has returned: the other thread's cudaMalloc lands inside the capture every time.
    """

    def __init__(self) -> None:
        self.requests: queue.Queue[int | None] = queue.Queue()
        self.results: queue.Queue[str] = queue.Queue()
        self.outcomes: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while (nbytes := self.requests.get()) is not None:
            reserved = torch.cuda.memory_reserved()
            try:
                block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            except Exception as error:  # refused during a global-mode capture: the point
                self.results.put(f"refused: {type(error).__name__}")
                continue
            grew = torch.cuda.memory_reserved() > reserved
            del block
            self.results.put("cudaMalloc" if grew else "served from the cache")

    def malloc_now(self) -> str:
        free_in_cache = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        self.requests.put(free_in_cache + (64 << 20))
        outcome = self.results.get(timeout=60)
        self.outcomes.append(outcome)
        return outcome

    def __enter__(self) -> CudaMallocWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.requests.put(None)
        self.thread.join(60)


class MallocsInAnotherThread(TinyMLP):
    """A TinyMLP whose forward, while it is being captured, has another thread call cudaMalloc."""

    def __init__(self, worker: CudaMallocWorker) -> None:
        super().__init__()
        self.worker = worker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            self.worker.malloc_now()
        return super().forward(x)


@pytest.mark.cuda
def test_capture_error_mode_decides_whether_another_threads_cuda_malloc_breaks_capture() -> None:
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    with CudaMallocWorker() as worker:
        module = MallocsInAnotherThread(worker).cuda()
        eager = TinyMLP().cuda()
        eager.load_state_dict(module.state_dict())
        sample = torch.randn(4, 8, device="cuda", requires_grad=True)
        message = capture_error(module, (sample,), backend=CUDA)  # the default, "global"
        assert message.startswith("capturing MallocsInAnotherThread (cuda) failed during ")
        assert "forward" not in module.__dict__  # the failed capture left the module as it was
        # the other thread's cudaMalloc came once, inside the forward capture: refused (or let
        # through, the capture invalidated all the same), never served from the cache
        (refused,) = worker.outcomes
        assert refused != "served from the cache"
        dgt.make_graphed_callables(
            module, (sample,), backend=CUDA, capture_error_mode="thread_local"
        )
        assert worker.outcomes[1:] == ["cudaMalloc"]  # allowed, and the capture went through
    for _ in range(3):  # fresh inputs; parameter grads accumulate over the replays
        x = torch.randn(4, 8, device="cuda", requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, out_eager = module(x), eager(x_eager)
        torch.testing.assert_close(out, out_eager)
        out.square().sum().backward()
        out_eager.square().sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    torch.testing.assert_close(grads_of(parameters_of(module)), grads_of(parameters_of(eager)))
    assert len(worker.outcomes) == 2  # replays run no Python: the other thread was not asked


@pytest.mark.cuda
def test_cpu_sync_in_capture_fails_cleanly_and_cuda_keeps_working() -> None:
    module = SyncsAfterDropout().cuda()
    stream = torch.cuda.current_stream()
    # lint="off": the capture lint would refuse the .item() before the capture; this is about
    # what a real failed capture leaves behind
    message = capture_error(module, (torch.ones(16, 32, device="cuda"),), backend=CUDA, lint="off")
    gc.collect()
    assert message.startswith("capturing SyncsAfterDropout (cuda) failed during forward capture: ")
    assert "forward" not in module.__dict__
    assert torch.cuda.current_stream() == stream  # not torch's capture stream

    # The capture drew from the CUDA generator before it failed: the generator must still work.
    assert torch.randn(1000, device="cuda").std().item() > 0.5
    kept = F.dropout(torch.ones(1000, device="cuda"), 0.5).ne(0).float().mean().item()
    assert isclose_fraction(kept, 0.5)
    step_grads(module, (torch.randn(16, 32, device="cuda"),))  # eager, .item() included
    torch.cuda.synchronize()

    module.sync = False
    sample = torch.ones(16, 32, device="cuda", requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=CUDA)
    masks = []
    for _ in range(2):
        x = torch.ones(16, 32, device="cuda", requires_grad=True)
        out = module(x)
        out.sum().backward()
        kept = out.detach() != 0
        assert isclose_fraction(kept.float().mean().item(), 0.75)
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.cuda
def test_cuda_capture_holds_automatic_garbage_collection_and_gives_it_back() -> None:
    # The collector may destroy an unreachable graph during another capture (docs/cuda_graphs.md).
    seen: list[bool] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return x * 2

    assert gc.isenabled()
    sample = torch.ones(4, device="cuda", requires_grad=True)
    graphed = dgt.make_graphed_callables(double, (sample,), backend=CUDA, num_warmup_iters=1)
    assert seen == [False, False]  # one warmup, one capture
    assert gc.isenabled()
    torch.testing.assert_close(
        graphed(torch.full((4,), 3.0, device="cuda")), torch.full((4,), 6.0, device="cuda")
    )

    def fails(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    assert "boom" in capture_error(fails, (sample,), backend=CUDA)
    assert gc.isenabled()


# -- refused on purpose --------------------------------------------------------------------------


def _scale_first(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    return x * 2


class HalfUsed(nn.Module):
    """A module with a parameter its forward never touches."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_unused_input_is_a_capture_error_without_allow_unused_input(backend: str) -> None:
    device = device_of(backend)
    x, y = (torch.randn(3, device=device, requires_grad=True) for _ in range(2))
    message = capture_error(_scale_first, (x, y), backend=backend)
    assert message.startswith(f"capturing _scale_first ({backend}) failed during warmup: ")
    assert "args[1] requires grad, but no output depends on it" in message  # names it
    assert "allow_unused_input=True" in message
    message = capture_error(
        HalfUsed().to(device), (torch.randn(2, 4, device=device),), backend=backend
    )
    assert "HalfUsed.unused.weight requires grad, but no output depends on it" in message


def test_the_unused_grad_check_compares_no_grad_with_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `None in grads` asked Tensor.__eq__(None) of every warmup grad, whose TypeError costs
    # about 18 us a tensor: 9 ms of a 12-block capture. The check is by identity.
    compared: list[Any] = []
    equal = torch.Tensor.__eq__

    def noting(self: torch.Tensor, other: Any) -> Any:
        compared.append(other)
        return equal(self, other)

    monkeypatch.setattr(torch.Tensor, "__eq__", noting)
    dgt.make_graphed_callables(nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),))
    assert [other for other in compared if other is None] == []
    message = capture_error(HalfUsed(), (torch.randn(2, 4),), backend="emulate")
    assert "HalfUsed.unused.weight requires grad, but no output depends on it" in message


def test_warmup_compares_the_bytes_of_a_modules_tensors_eight_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Around warmup each parameter's bytes were compared as uint8 (torch.equal: about 1.6 ns a
    # byte on a CPU, against under 0.25 as int64); the same bits, compared as wider integers.
    compared: list[torch.dtype] = []
    equal = torch.equal

    def noting(a: torch.Tensor, b: torch.Tensor) -> bool:
        compared.append(a.dtype)
        return equal(a, b)

    monkeypatch.setattr(torch, "equal", noting)
    dgt.make_graphed_callables(nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),))
    assert compared and set(compared) == {torch.int64}


def test_recording_a_modules_tensors_walks_its_submodules_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ModuleTensors.of walked the module tree three times (tensors, submodules, hooks), and
    # named each submodule once per kind of hook: ~0.14 ms a ViT block on a CPU, now ~0.11.
    from dualgraph.torch._params import ModuleTensors

    walks: list[nn.Module] = []
    named_modules = nn.Module.named_modules

    def noting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        walks.append(self)
        return named_modules(self, *args, **kwargs)

    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    module[0].register_forward_hook(lambda *args: None)
    monkeypatch.setattr(nn.Module, "named_modules", noting)
    record = ModuleTensors.of(module)
    assert sum(walked is module for walked in walks) == 1  # (its submodules: the recursion)
    assert record.names == (
        "Sequential.0.weight",
        "Sequential.0.bias",
        "Sequential.2.weight",
        "Sequential.2.bias",
    )
    assert [name for name in record.hook_names if name.startswith("Sequential.0")] == [
        "Sequential.0: forward pre-hook",
        "Sequential.0: forward hook",
        "Sequential.0: backward pre-hook",
        "Sequential.0: backward hook",
    ]
    assert [len(hooks[0]) for hooks in record.hooks_at_capture[:4]] == [0, 1, 0, 0]


def test_warmup_copies_a_modules_large_tensors_once_and_compares_them_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Around warmup each parameter's bytes were copied before and again after, to compare the
    # two copies; a large tensor's own memory, in element order, is compared with the one copy.
    from dualgraph.torch import _kept_bytes, _warmup

    copied: list[torch.Tensor] = []
    flattened: list[torch.Tensor] = []
    bytes_of, flatten = _kept_bytes.bytes_of, _kept_bytes._flatten_dense_tensors

    def noting(tensor: torch.Tensor) -> torch.Tensor:
        copied.append(tensor)
        return bytes_of(tensor)

    def noting_flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        flattened.extend(tensors)
        return flatten(tensors)

    monkeypatch.setattr(_kept_bytes, "bytes_of", noting)
    monkeypatch.setattr(_kept_bytes, "_flatten_dense_tensors", noting_flat)
    inputs: list[torch.Tensor] = []
    warmup_bytes_of = _warmup.bytes_of
    monkeypatch.setattr(_warmup, "bytes_of", lambda t: inputs.append(t) or warmup_bytes_of(t))
    module = nn.Linear(128, 128)  # a weight of _kept_bytes.BATCHED_BELOW bytes or more
    assert module.weight.numel() * 4 >= _kept_bytes.BATCHED_BELOW
    dgt.make_graphed_callables(module, (torch.randn(2, 128, requires_grad=True),))
    assert sum(t is module.weight for t in copied) == 1
    assert not any(t is module.weight for t in flattened)
    assert len(inputs) == 1  # and the inspected warmup's input, once


def test_warmup_copies_a_modules_small_tensors_once_together_and_compares_them_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy and a comparison each (a dozen small ops, on CUDA a synchronizing torch.equal) per
    # bias and norm weight was most of the warmup's host time for a layer: one flat copy of
    # them before, one flat copy to compare with after.
    from dualgraph.torch import _kept_bytes

    flattened: list[list[torch.Tensor]] = []
    flatten = _kept_bytes._flatten_dense_tensors

    def noting_flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        flattened.append(list(tensors))
        return flatten(tensors)

    monkeypatch.setattr(_kept_bytes, "_flatten_dense_tensors", noting_flat)
    monkeypatch.setattr(_kept_bytes, "bytes_of", lambda t: pytest.fail("copied on its own"))
    module = TinyMLP()
    params = list(module.parameters())
    dgt.make_graphed_callables(module, (torch.randn(2, 8, requires_grad=True),))
    assert [[id(t) for t in batch] for batch in flattened] == [[id(p) for p in params]] * 2


def test_the_inspected_warmup_finds_a_modules_plain_tensor_attributes_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both the outputs sharing a module tensor's memory and the tensors the backward reads
    # look among its plain tensor attributes, as the inspected call left them: one walk.
    from dualgraph.torch import _warmup

    walks: list[nn.Module] = []
    attributes = _warmup.plain_tensor_attributes

    def noting(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        walks.append(module)
        return attributes(module)

    monkeypatch.setattr(_warmup, "plain_tensor_attributes", noting)
    module = nn.Linear(4, 4)
    module.scale = torch.full((4,), 2.0)
    dgt.make_graphed_callables(module, (torch.randn(2, 4, requires_grad=True),))
    assert walks == [module]


class ExpandedBias(nn.Module):
    """A linear layer plus a bias held expanded (stride 0), as a buffer or a plain attribute."""

    def __init__(self, how: str, device: torch.device) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8, device=device)
        # Made on its device: `.to()` neither moves a plain attribute nor keeps a stride of 0.
        shift = torch.full((1,), 0.5, device=device).expand(8)
        if how == "buffer":
            self.register_buffer("shift", shift)
        else:
            self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.shift


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["buffer", "attribute"])
def test_a_module_reading_an_expanded_tensor_is_graphed_as_eager(backend: str, how: str) -> None:
    # Putting the module's tensors back after warmup wrote into the expanded one, which torch
    # refuses ('more than one element of the written-to tensor refers to a single memory
    # location'): the capture failed.
    device = device_of(backend)
    module, twin = ExpandedBias(how, device), ExpandedBias(how, device)
    twin.linear.load_state_dict(module.linear.state_dict())
    dgt.make_graphed_callables(
        module, (torch.randn(2, 8, device=device, requires_grad=True),), backend=backend
    )
    assert module.shift.stride() == (0,) and module.shift._version == 0
    for _ in range(2):
        x = torch.randn(2, 8, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, expected = module(x), twin(x_eager)
        assert_tensors_match(out, expected, "output", tolerance(backend))
        out.sum().backward()
        expected.sum().backward()
        assert_tensors_match(x.grad, x_eager.grad, "input grad", tolerance(backend))
    assert_grads_match(
        grads_of(parameters_of(module)),
        grads_of(parameters_of(twin)),
        parameter_names(module),
        tolerance(backend),
    )


def _autocast(backend: str, **options: Any) -> torch.autocast:
    return torch.autocast(device_of(backend).type, dtype=torch.bfloat16, **options)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_autocast_capture_needs_the_cache_disabled(backend: str) -> None:
    module = TinyMLP().to(device_of(backend))
    with _autocast(backend), pytest.raises(CaptureError, match=r"cache_enabled=False"):
        dgt.make_graphed_callables(
            module, (torch.randn(4, 8, device=device_of(backend)),), backend=backend
        )
    assert "forward" not in module.__dict__


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_non_tensor_array_output_is_refused_naming_its_path(backend: str) -> None:
    def returns_numpy(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        return x * 2, np.zeros(2, np.float32)

    message = capture_error(
        returns_numpy, (torch.ones(2, device=device_of(backend)),), backend=backend
    )
    assert "output[1]: expected a torch tensor, got numpy.ndarray" in message


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_no_static_buffer_can_hold_is_refused_naming_its_path(backend: str) -> None:
    def returns_sparse(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"dense": x * 2, "sparse": (x * 3).to_sparse()}

    message = capture_error(
        returns_sparse, (torch.ones(2, 2, device=device_of(backend)),), backend=backend
    )
    assert message.endswith(
        "output['sparse']: a graph cannot return a torch.sparse_coo tensor "
        "(static buffers are dense, strided tensors)"
    )


@pytest.mark.parametrize("backend", [*GRAPH_BACKENDS, "eager"])
def test_an_output_leaf_of_an_unsupported_type_is_refused_naming_its_output_path(
    backend: str,
) -> None:
    # The path was '[1]' (no root): an argument or an output, the message did not say.
    def returns_its_shape(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
        return x * 2, x.shape

    with pytest.raises(DualgraphError, match=r"output\[1\]: unsupported leaf of type torch.Size"):
        graphed = dgt.make_graphed_callables(
            returns_its_shape, (torch.ones(2, device=device_of(backend)),), backend=backend
        )
        graphed(torch.ones(2, device=device_of(backend)))  # eager: described at the first call


class UsesAnotherModulesWeight(nn.Module):
    """Reads a parameter it does not own (a weight shared from elsewhere, held as a plain attr)."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.__dict__["shared"] = shared  # not a submodule: its parameters are not ours

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.shared(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_that_depend_on_a_foreign_tensor_requiring_grad_are_refused(backend: str) -> None:
    """A replay would give a closure's or another module's parameters no gradient."""
    device = device_of(backend)
    shared = nn.Linear(4, 4).to(device)
    module = UsesAnotherModulesWeight(shared).to(device)
    message = capture_error(module, (torch.randn(2, 4, device=device),), backend=backend)
    assert message == (
        f"capturing UsesAnotherModulesWeight ({backend}) failed during warmup: the outputs "
        "depend on 2 tensor(s) that require grad but are neither inputs nor parameters of the "
        "module (float32[4, 4], float32[4]; output reads the float32[4, 4] one), e.g. a "
        "closure over another module's weights; a "
        "replay would give them no gradient. Pass them as inputs, or graph the module that "
        "holds them"
    )
    weight = torch.randn(4, device=device, requires_grad=True)
    message = capture_error(lambda x: x * weight, (torch.randn(4, device=device),), backend=backend)
    assert "neither inputs nor arguments (float32[4]; output reads the float32[4] one)" in message
    assert shared.weight.grad is None and weight.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_foreign_tensor_requiring_grad_is_refused_naming_an_output_that_reads_it(
    backend: str,
) -> None:
    # The refusal named the tensor's shape only: which of a dict's outputs read it, it did not say.
    device = device_of(backend)
    weight = torch.randn(4, device=device, requires_grad=True)
    message = capture_error(
        lambda x: {"plain": x * 2, "scaled": x * weight},
        (torch.randn(4, device=device, requires_grad=True),),
        backend=backend,
    )
    assert "(float32[4]; output['scaled'] reads the float32[4] one)" in message


def _derivative_of_its_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x.requires_grad_(True)  # a physics-informed loss's pattern: du/dx inside the forward
    u = x.sin().sum()
    (du,) = torch.autograd.grad(u, x, create_graph=True)
    return u, du


class AddsInPlace(nn.Module):
    """``x += offset``: fine in eager for an input that is no leaf (a previous layer's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.offset
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_requiring_grad_updated_in_place_is_refused_saying_so(backend: str) -> None:
    # The sample is no leaf, so torch's 'a leaf Variable that requires grad is being used in
    # an in-place operation' named neither the input nor what to do.
    device = device_of(backend)
    module = AddsInPlace().to(device)
    base = torch.randn(2, 4, device=device, requires_grad=True)
    module(base * 1).sum().backward()  # runs in eager
    message = capture_error(module, (base * 1,), backend=backend)
    assert "an input requiring grad (args[0]: x += y" in message
    assert "Compute it out of place (x = x + y)" in message


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_without_grad_updated_in_place_with_a_value_requiring_grad_is_refused(
    backend: str,
) -> None:
    # Graphed: the static input kept the warmup's `x += offset` history, so offset.grad was a
    # multiple of eager's (six times after three emulated calls); on CUDA the capture's backward
    # ran through the warmup stream's AccumulateGrad node, and failed with torch's warning.
    device = device_of(backend)
    module = AddsInPlace().to(device)
    message = capture_error(module, (torch.randn(2, 4, device=device),), backend=backend)
    assert message.startswith(
        f"capturing AddsInPlace ({backend}) failed during warmup: args[0]: an input that needs "
        "no grad, which the callable updates in place with a value that requires grad (after "
        "the call it has an autograd history, AddBackward0: "
    )
    assert all(p.grad is None for p in module.parameters())
    module(torch.randn(2, 4, device=device)).sum().backward()  # eager, on the caller's stream
    assert all(p.grad is not None for p in module.parameters())


def _marks_its_input(x: torch.Tensor) -> torch.Tensor:
    x.requires_grad_(True)  # for the caller's later use; no output depends on it
    return x.detach().sin()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    "fn", [_derivative_of_its_input, _marks_its_input], ids=["depends", "marks"]
)
def test_an_input_the_callable_makes_require_grad_is_refused_naming_it(
    backend: str, fn: Any
) -> None:
    # Was refused as 'neither inputs nor arguments (float32[4])', which it is: the input; and
    # where no output depends on it (marks), graphed, every call leaving the caller's tensor
    # without requires_grad, which eager's turns on.
    device = device_of(backend)
    message = capture_error(fn, (torch.randn(4, device=device),), backend=backend)
    assert "args[0]: its sample does not require grad, but the callable made it" in message
    assert "Pass a sample args[0] that requires grad" in message
    sample = torch.randn(4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(fn, (sample,), backend=backend)
    x = torch.randn(4, device=device, requires_grad=True)
    assert_trees_match(graphed(x), fn(x.detach().clone().requires_grad_()), tolerance(backend))


class HooksItsInput(nn.Module):
    """Puts a grad hook on its input, as code scaling the grad sent back to the layer before."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "grad":
            x.register_hook(lambda grad: grad * 2)
        else:
            x.register_post_accumulate_grad_hook(lambda leaf: None)
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("kind", ["grad", "post_accumulate"])
def test_a_hook_the_callable_puts_on_its_input_is_refused_naming_it(
    backend: str, kind: str
) -> None:
    # Graphed: each warmup's and each emulated replay's hook stayed on the static input, so the
    # input's grad was 16 times eager's at the first call and doubled again on every call; the
    # caller's tensor got no hook.
    device = device_of(backend)
    module = HooksItsInput(kind).to(device)
    message = capture_error(
        module, (torch.randn(2, 4, device=device, requires_grad=True),), backend=backend
    )
    assert message.startswith(
        f"capturing HooksItsInput ({backend}) failed during warmup: args[0]: the callable "
        "registers a "
    )
    assert "Register the hook on the tensor you pass, outside the callable" in message


class RetainsGrad(nn.Module):
    """Calls ``retain_grad()`` on its input, or on a tensor of its own, as attribution code does."""

    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.on_input = on_input
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_input:
            x.retain_grad()
        h = self.fc(x)
        if not self.on_input:
            h.retain_grad()  # a tensor of its own, not returned: eager's .grad nobody reads
        return h.tanh()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_the_callable_retains_the_grad_of_is_refused_naming_it(backend: str) -> None:
    # Graphed, the static input (a leaf: retain_grad does nothing there) took the call, and the
    # caller's tensor, a previous layer's output, kept .grad None where eager's holds its grad.
    device = device_of(backend)
    module = RetainsGrad(on_input=True).to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True) * 2
    message = capture_error(module, (sample,), backend=backend)
    assert message.startswith(
        f"capturing RetainsGrad ({backend}) failed during warmup: args[0]: the callable calls "
        "retain_grad() on this input: eager calls it on the caller's tensor"
    )
    assert "Call retain_grad() on the tensor you pass, outside the callable" in message
    x = torch.randn(2, 4, device=device, requires_grad=True) * 2
    module(x).sum().backward()  # the module is left usable, eager
    assert x.grad is not None
    assert torch.Tensor.retain_grad is torch._C.TensorBase.retain_grad  # put back


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_tensor_of_its_own_the_callable_retains_the_grad_of_is_graphed(backend: str) -> None:
    device = device_of(backend)
    module = RetainsGrad(on_input=False).to(device)
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 4, device=device, requires_grad=True),), backend=backend
    )
    x = torch.randn(2, 4, device=device, requires_grad=True)
    twin_x = x.detach().clone().requires_grad_()
    graphed(x).sum().backward()
    twin(twin_x).sum().backward()
    assert_tensors_match(x.grad, twin_x.grad, "grad", tolerance(backend))


class ReshapesItsMaskInPlace(nn.Module):
    """Reshapes its mask argument in place (``mask.unsqueeze_(-1)``), as older code does."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.op == "squeeze_":
            mask.squeeze_(-1)
        else:
            mask.unsqueeze_(-1)
        return self.fc(x) * mask.reshape(x.shape)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("op", ["squeeze_", "unsqueeze_"])
def test_an_input_the_callable_reshapes_in_place_is_refused_naming_it(
    backend: str, op: str
) -> None:
    # Graphed, each warmup call reshaped the static input again, and every call then failed
    # copying the caller's mask into it with torch's broadcast error ('output with shape ...
    # doesn't match the broadcast shape ...'), naming neither the input nor the op.
    device = device_of(backend)
    mask = (
        torch.ones(2, 4, 1, device=device) if op == "squeeze_" else torch.ones(2, 4, device=device)
    )
    sample = (torch.randn(2, 4, device=device, requires_grad=True), mask)
    message = capture_error(ReshapesItsMaskInPlace(op).to(device), sample, backend=backend)
    assert message.startswith(
        f"capturing ReshapesItsMaskInPlace ({backend}) failed during warmup: args[1]: the "
        "callable changes this input's sizes, strides, dtype or memory in place"
    )
    assert "Use the op that returns a new tensor" in message
    assert mask.shape == sample[1].shape and mask.dim() == (3 if op == "squeeze_" else 2)


class RetainsItsOutputsGrad(nn.Module):
    """Keeps the grad of what it returns (``h.retain_grad()``), as an attribution method may."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        h.retain_grad()
        return x.sin(), h


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_the_callable_retains_the_grad_of_is_refused_naming_it(backend: str) -> None:
    # Graphed, the output handed out had .grad None after the backward (and torch warned about
    # reading a non-leaf's .grad), where eager's held the grad.
    device = device_of(backend)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    message = capture_error(RetainsItsOutputsGrad().to(device), sample, backend=backend)
    assert message.startswith(
        f"capturing RetainsItsOutputsGrad ({backend}) failed during warmup: output[1]: the "
        "callable calls retain_grad() on it"
    )
    assert "Call retain_grad() on the output the call returns" in message


class TagsItsOutput(nn.Module):
    """Sets an attribute on the tensor it returns (``y.tag = "logits"``, or what
    Transformer Engine's fuser sets, ``y._do_not_clear = True``), or a list (``tag="list"``)."""

    def __init__(self, tag: Any = "logits") -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.tag = tag

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        y.tag = [1] if self.tag == "list" else self.tag  # type: ignore[attr-defined]
        y._do_not_clear = True  # type: ignore[attr-defined]
        return x.sin(), y


@pytest.mark.parametrize("tag", [("logits", 2), torch.float16], ids=["tuple", "dtype"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_plain_attributes_a_callable_sets_on_its_output_come_with_every_replays(
    backend: str, tag: Any
) -> None:
    # Graphed, the output handed out had no .tag (a replay's tensor of its own), silently,
    # where eager's output is the tensor the callable tagged; then such outputs were refused,
    # which refused Transformer Engine's fused ops (te.ops), whose fuser marks its outputs
    # _do_not_clear (found on the H100, run AC): plain values are set on every call's output.
    device = device_of(backend)
    module = TagsItsOutput(tag).to(device)  # a dtype is as immutable as a tuple of plain values
    twin = copy.deepcopy(module)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4, device=device)
        _, y = graphed(x.clone().requires_grad_())
        _, expected = twin(x.clone().requires_grad_())
        assert vars(y) == vars(expected) == {"tag": tag, "_do_not_clear": True}
        assert torch.equal(y, expected)
        del y.tag  # the next call's output has its own
    assert dgt.diagnostics(graphed).replays == 3


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_the_callable_sets_an_object_on_is_refused_naming_it(backend: str) -> None:
    # A list (or a tensor) set on an output would be one object shared by every replay's
    # output, which eager makes anew per call: refused by path and name.
    device = device_of(backend)
    module = TagsItsOutput("list").to(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    message = capture_error(module, sample, backend=backend)
    assert message.startswith(
        f"capturing TagsItsOutput ({backend}) failed during warmup: output[1]: the callable "
        "sets the attribute 'tag' on it to a list"
    ), message
    assert module(sample[0])[1].tag == [1]  # left usable, eager


class MarksItsInput(nn.Module):
    """Sets an attribute on the tensor it is given, as Transformer Engine's fuser marks its
    inputs ``_do_not_clear``."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x._do_not_clear = self.value
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_plain_attributes_a_callable_sets_on_its_input_are_set_on_every_calls_input(
    backend: str,
) -> None:
    # The warmup set them on a static input; the caller's tensor never got them (on CUDA no
    # Python runs on a replay; emulate ran it on the static buffer), where eager sets them on it.
    device = device_of(backend)
    module = MarksItsInput(True).to(device)
    twin = copy.deepcopy(module)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4, device=device)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, expected = graphed(mine), twin(theirs)
        assert vars(mine) == vars(theirs) == {"_do_not_clear": True}
        assert torch.equal(y, expected)
    assert dgt.diagnostics(graphed).replays == 3


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_the_callable_sets_an_object_on_is_refused_naming_it(backend: str) -> None:
    # One list on the static buffer, where eager sets a new one on each caller's tensor.
    device = device_of(backend)
    module = MarksItsInput([1]).to(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    message = capture_error(module, sample, backend=backend)
    assert message.startswith(
        f"capturing MarksItsInput ({backend}) failed during warmup: args[0]: the callable "
        "sets the attribute '_do_not_clear' on this input to a list"
    ), message
    x = torch.randn(2, 4, device=device)
    module(x)  # left usable, eager
    assert x._do_not_clear == [1]


class ChangesItsBatch(nn.Module):
    """Changes the dict it is given: pops the labels, replaces or adds an entry."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change
        self.fc = nn.Linear(4, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.change == "pop":
            return self.fc(batch["x"]) * batch.pop("labels")
        if self.change == "replace":
            batch["x"] = batch["x"] * 2
        else:
            batch["hidden"] = self.fc(batch["x"])
        return self.fc(batch["x"]) * batch["labels"]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("change", "path", "found"),
    [
        ("pop", "args[0]['labels']", "missing (expected float32[2, 4])"),
        ("replace", "args[0]['x']", "another value was put in its place"),
        ("add", "args[0]['hidden']", "unexpected entry float32[2, 4]"),
    ],
)
def test_a_callable_changing_its_input_containers_is_refused_naming_the_entry(
    backend: str, change: str, path: str, found: str
) -> None:
    # Eager changes the caller's dict (a fresh one each call). The static dict kept the change:
    # pop failed graphing with the callable's own "KeyError: 'labels'", replace with torch's
    # 'Trying to backward through the graph a second time', and add was graphed, the key missing
    # from the caller's dict after each call.
    device = device_of(backend)
    batch = {
        "x": torch.randn(2, 4, device=device, requires_grad=True),
        "labels": torch.randn(2, 4, device=device),
    }
    message = capture_error(ChangesItsBatch(change).to(device), (batch,), backend=backend)
    assert message.startswith(
        f"capturing ChangesItsBatch ({backend}) failed during warmup: {path}: the callable "
        f"changes the containers of its inputs in place (after the call: {found}): "
    )
    assert "Copy the container in the callable before changing it" in message
    assert sorted(batch) == ["labels", "x"]


class DetachesItsTarget(nn.Module):
    """Turns off its target's requires_grad in place, as a stop-gradient written with detach_."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.how == "detach_":
            target.detach_()
        else:
            target.requires_grad_(False)
        return (self.fc(x) - target).square().mean()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["detach_", "requires_grad_"])
def test_an_input_the_callable_turns_requires_grad_off_on_is_refused_naming_it(
    backend: str, how: str
) -> None:
    # Was refused with torch's 'One of the differentiated Tensors does not require grad'.
    device = device_of(backend)
    sample = (
        torch.randn(2, 4, device=device, requires_grad=True),
        torch.randn(2, 4, device=device, requires_grad=True),
    )
    message = capture_error(DetachesItsTarget(how).to(device), sample, backend=backend)
    assert message.startswith(
        f"capturing DetachesItsTarget ({backend}) failed during warmup: args[1]: the callable "
        "turns requires_grad off on this input"
    )
    assert "(x = x.detach())" in message
    assert sample[1].requires_grad


class _ContextNamedVariable(torch.autograd.Function):
    """Doubles; its context holds a tensor requiring grad under AccumulateGrad's attribute name."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.variable = torch.ones(2, device=x.device, requires_grad=True)  # not in the graph
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _DoublesThroughAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ContextNamedVariable.apply(self.fc(x))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_custom_function_whose_context_holds_a_variable_is_not_a_foreign_leaf(
    backend: str,
) -> None:
    """Only AccumulateGrad nodes are leaves: a context attribute named ``variable`` is not one."""
    device = device_of(backend)
    layer = _DoublesThroughAFunction().to(device)
    twin = copy.deepcopy(layer)
    graphed = dgt.make_graphed_callables(
        layer, (torch.randn(3, 2, device=device, requires_grad=True),), backend=backend
    )
    x = torch.randn(3, 2, device=device, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_(True)
    out, expected = graphed(x), twin(x_eager)
    assert_trees_match(out, expected, tolerance(backend))
    out.sum().backward()
    expected.sum().backward()
    assert_grads_match(
        grads_of([x, *layer.parameters()]),
        grads_of([x_eager, *twin.parameters()]),
        ["x", "fc.weight", "fc.bias"],
        tolerance(backend),
    )


class ChangesItsOutputs(nn.Module):
    """Returns ``(h, None)`` on its first call and ``(h, h)`` afterwards (e.g. a cache filled)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls += 1
        h = self.fc(x)
        return h, (None if self.calls == 1 else h * 2)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_whose_structure_changes_between_calls_are_refused(backend: str) -> None:
    device = device_of(backend)
    message = capture_error(
        ChangesItsOutputs().to(device), (torch.randn(2, 4, device=device),), backend=backend
    )
    assert message == (
        f"capturing ChangesItsOutputs ({backend}) failed during warmup: the outputs differ from "
        "one call to the next (TreeSpec((float32[2, 4](grad), None)), then "
        "TreeSpec((float32[2, 4](grad), float32[2, 4](grad)))); a graph replays one call's "
        "structure"
    )


class ClampsItsWeight(nn.Module):
    """Updates a parameter in place in its forward (what warmup cannot undo for parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.1, 0.1)
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("lint", ["error", "warn", "off"])
def test_a_parameter_the_callable_updates_in_place_is_refused(backend: str, lint: str) -> None:
    device = device_of(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DualgraphWarning)  # lint="warn" warns first
        message = capture_error(
            ClampsItsWeight().to(device),
            (torch.randn(2, 4, device=device),),
            backend=backend,
            lint=lint,
        )
    if lint != "error":  # the adapter's own check, after warmup
        assert "ClampsItsWeight.fc.weight: the callable updates this parameter in place" in message
    if lint != "off":  # the lint's finding, with the line that does it
        assert "parameter updated in place: aten.clamp_ on fc.weight at test_torch_capture.py:" in (
            message
        )


class CountsByReassigning(nn.Module):
    """Replaces a buffer (``self.steps = self.steps + 1``) or a submodule in its forward."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.what == "buffer":
            self.steps = self.steps + 1  # eager counts; a replay would read the captured tensor
        elif self.what == "parameter":
            self.fc.bias = nn.Parameter(self.fc.bias.detach() * 0.5)
        elif self.what == "submodule":
            self.fc = nn.Linear(4, 4).to(x.device)
        return self.fc(x) * self.steps


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("what", "name"),
    [
        ("buffer", "CountsByReassigning.steps"),
        ("parameter", "CountsByReassigning.fc.bias"),
        ("submodule", "CountsByReassigning.fc"),
    ],
)
def test_a_callable_that_replaces_a_module_tensor_is_refused_at_capture(
    backend: str, what: str, name: str
) -> None:
    device = device_of(backend)
    module = CountsByReassigning(what).to(device)
    before = dict(module.named_parameters()), dict(module.named_buffers()), module.fc
    message = capture_error(
        module, (torch.randn(2, 4, device=device),), backend=backend, lint="off"
    )
    assert f"{name}: the callable replaces" in message
    # the module holds the tensors and submodules it held before, and still works
    assert dict(module.named_parameters()) == before[0]
    assert dict(module.named_buffers()) == before[1] and module.fc is before[2]
    assert float(module.steps) == 0.0
    module.what = "nothing"
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 4, device=device),), backend=backend
    )
    assert graphed(torch.randn(2, 4, device=device)).shape == (2, 4)


def _scales_input_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _ScaleInBackward.apply(x)


class _ScaleInBackward(torch.autograd.Function):
    """Identity whose backward also halves a saved input in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x.detach().mul_(0.5)
        return grad


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_updated_in_place_during_backward_is_refused(backend: str) -> None:
    sample = torch.randn(3, device=device_of(backend), requires_grad=True)
    message = capture_error(_scales_input_in_backward, (sample,), backend=backend)
    assert message.startswith(
        f"capturing _scales_input_in_backward ({backend}) failed during warmup: args[0] is updated "
        "in place during backward; dualgraph hands in-place updates back to the caller after the "
        "forward only"
    )
    if backend != "emulate":
        return  # lint="auto" lints on emulate only; cuda's warmup runs unobserved
    # the capture lint's finding follows, with the line in the backward that does it
    assert (
        "error: input updated in place during backward: aten.mul_ on args[0] at "
        "test_torch_capture.py:"
    ) in message


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_lazy_module_is_refused_until_it_ran_once(backend: str) -> None:
    device = device_of(backend)
    module = nn.LazyLinear(4).to(device)
    message = capture_error(module, (torch.randn(2, 3, device=device),), backend=backend)
    assert "weight is not initialized yet (a lazy module); run the module once" in message
    module(torch.randn(2, 3, device=device))
    dgt.make_graphed_callables(module, (torch.randn(2, 3, device=device),), backend=backend)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_parameter_hooks_are_refused_with_in_graph_param_grads(backend: str) -> None:
    device = device_of(backend)
    layer = nn.Linear(4, 4).to(device)
    layer.weight.register_hook(lambda grad: grad * 2)
    message = capture_error(
        layer, (torch.randn(2, 4, device=device),), backend=backend, param_grads="in_graph"
    )
    assert message == (
        f"capturing Linear ({backend}) failed during setup: Linear.weight has a grad hook, which "
        "param_grads='in_graph' would never run (the backward graph adds the grad into .grad "
        "itself); capture with param_grads='autograd' to use parameter hooks"
    )


class NormedThenExploding(nn.Module):
    """BatchNorm (whose statistics warmup updates), then a failure on the third call."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("exploded on purpose")
        return self.norm(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_capture_leaves_buffers_and_hooks_as_they_were(backend: str) -> None:
    device = device_of(backend)
    module = NormedThenExploding().to(device)
    seen: list[torch.Tensor] = []
    module.norm.weight.register_hook(lambda grad: seen.append(grad) or grad)
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    capture_error(module, (torch.randn(8, 4, device=device),), backend=backend)
    for name, b in module.named_buffers():
        assert_tensors_match(b, buffers[name], name)
    module.calls = -100
    module(torch.randn(8, 4, device=device)).sum().backward()
    assert len(seen) == 1  # the hook is still there, and ran once


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("exploded on purpose in backward")


class DropsThenExplodes(nn.Module):
    """Dropout (which draws from the RNG), then a failure from the ``fail_at``-th call on, in
    its forward (a ``KeyboardInterrupt`` with ``interrupt``) or in the backward of that call."""

    def __init__(self, fail_at: int, in_backward: bool = False, interrupt: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.fail_at = fail_at
        self.interrupt = interrupt
        self.in_backward = in_backward
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        self.calls += 1
        if self.fail_at and self.calls >= self.fail_at:
            if self.interrupt:
                raise KeyboardInterrupt
            if not self.in_backward:
                raise ValueError("exploded on purpose")
            h = _FailsInBackward.apply(h)
        return h


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("how", "fail_at", "in_backward"),
    [
        ("plain", 1, False),  # the first warmup call
        ("plain", 3, False),  # the last warmup call
        ("plain", 4, False),  # the capture call
        ("plain", 2, True),  # a warmup backward
        ("buckets", 6, False),  # the second bucket, after the first was captured
        ("slots", 5, False),  # the second slot's capture
    ],
)
def test_a_failed_capture_leaves_the_rng_as_it_found_it(
    backend: str, how: str, fail_at: int, in_backward: bool
) -> None:
    device = device_of(backend)
    module = DropsThenExplodes(fail_at, in_backward).to(device)
    sample = (torch.randn(2, 8, device=device, requires_grad=True),)
    options: dict[str, Any] = {"backend": backend, "num_warmup_iters": 3}
    if how == "buckets":
        options["buckets"] = [sample, (torch.randn(3, 8, device=device, requires_grad=True),)]
        sample = None  # type: ignore[assignment]
    elif how == "slots":
        options["slots"] = 2
    before = _rng_states(device)
    with pytest.raises(CaptureError, match="exploded on purpose"):
        dgt.make_graphed_callables(module, sample, **options)
    assert module.calls >= 1  # the dropout drew a mask before the failure
    for after, was in zip(_rng_states(device), before, strict=True):
        assert torch.equal(after, was)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_interrupted_capture_leaves_the_rng_and_the_module_as_it_found_them(
    backend: str,
) -> None:
    device = device_of(backend)
    module = DropsThenExplodes(fail_at=2, interrupt=True).to(device)
    sample = (torch.randn(2, 8, device=device, requires_grad=True),)
    before = _rng_states(device)
    with pytest.raises(KeyboardInterrupt):  # as raised, not wrapped
        dgt.make_graphed_callables(module, sample, backend=backend)
    for after, was in zip(_rng_states(device), before, strict=True):
        assert torch.equal(after, was)
    assert "forward" not in module.__dict__  # not graphed
    module.fail_at = 0
    module.drop.p = 0.0  # deterministic, to compare with eager
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 8, device=device),), backend=backend
    )
    for _ in range(2):
        x = torch.randn(2, 8, device=device)
        assert_tensors_match(
            graphed(x).detach(), module.fc(x).detach(), "output", tolerance(backend)
        )


class LeavesAmbientStateThenExplodes(nn.Module):
    """Turns grad mode off and enters an autocast it never leaves, then fails (second call)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        if self.calls == 2:
            torch.set_grad_enabled(False)
            torch.autocast(x.device.type, dtype=torch.float16).__enter__()
            raise ValueError("exploded on purpose")
        return h


def _ambient_state(device_type: str) -> tuple[Any, ...]:
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_capture_leaves_grad_mode_and_autocast_as_it_found_them(backend: str) -> None:
    device = device_of(backend)
    module = LeavesAmbientStateThenExplodes().to(device)
    before = _ambient_state(device.type)
    try:
        message = capture_error(module, (torch.randn(2, 8, device=device),), backend=backend)
        assert message.endswith("ValueError: exploded on purpose")
        assert _ambient_state(device.type) == before
    finally:
        torch.set_grad_enabled(True)
        torch.set_autocast_enabled(device.type, False)
    module.calls = 10  # never fails again
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 8, device=device, requires_grad=True),), backend=backend
    )
    x = torch.randn(2, 8, device=device, requires_grad=True)
    assert graphed(x).dtype == torch.float32  # captured outside autocast
    assert_tensors_match(graphed(x).detach(), module.fc(x).detach(), "output", tolerance(backend))


class LeavesSettingsThenExplodes(nn.Module):
    """Draws from the host RNG (which the lint refuses, after all warmup calls ran) or changes
    torch's numerics settings it meant to undo at its end, then fails (``fail_at``-th call)."""

    def __init__(self, change: str, fail_at: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.change = change
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        if self.change == "host_rng":
            random.random()
            np.random.rand()
        elif self.calls == self.fail_at:
            if self.change == "default_dtype":
                torch.set_default_dtype(torch.float64)
            elif self.change == "deterministic":
                torch.use_deterministic_algorithms(True, warn_only=True)
            elif self.change == "matmul_precision":
                torch.set_float32_matmul_precision("medium")
            elif self.change == "cudnn":
                torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
        if self.calls == self.fail_at:
            raise ValueError("exploded on purpose")
        return h


def _settings_and_host_rng() -> tuple[Any, ...]:
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
        random.getstate(),
        np.random.get_state()[1].tobytes(),
        np.random.get_state()[2],
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("fail_at", [1, 3])
@pytest.mark.parametrize(
    "change", ["host_rng", "default_dtype", "deterministic", "matmul_precision", "cudnn"]
)
def test_a_failed_capture_leaves_host_rng_and_numerics_settings_as_it_found_them(
    backend: str, fail_at: int, change: str
) -> None:
    device = device_of(backend)
    module = LeavesSettingsThenExplodes(change, fail_at if change != "host_rng" else 0)
    module.to(device)
    before = _settings_and_host_rng()
    try:
        with pytest.raises(CaptureError):  # the lint's, for the host draws
            dgt.make_graphed_callables(
                module, (torch.randn(2, 8, device=device),), backend=backend, lint="error"
            )
        assert module.calls >= fail_at
        assert _settings_and_host_rng() == before
    finally:
        torch.set_default_dtype(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])
        torch.set_float32_matmul_precision(before[3])
        torch.backends.cudnn.benchmark = before[4]


class Tag:
    """An object that can be weakly referenced."""


class FailsHalfWay(nn.Module):
    """Fails in its second call, after building part of a graph; keeps weak references to it."""

    def __init__(self, error: type[BaseException] = ValueError) -> None:
        super().__init__()
        self.error = error
        self.fc = nn.Linear(8, 8)
        self.calls = 0
        self.left: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x).relu()
        if self.calls == 2:
            # the weight's AccumulateGrad, as the graph reaches it: relu <- addmm <- t <- weight
            ((addmm, _),) = h.grad_fn.next_functions
            node = next(n for n, _ in addmm.next_functions if n is not None and n.next_functions)
            node = node.next_functions[0][0]
            tag = Tag()  # lives as long as the node (nodes cannot be weakly referenced)
            node.metadata["tag"] = tag
            self.left = [weakref.ref(h), weakref.ref(tag)]
            raise self.error("failed half-way")
        return h


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_capture_frees_the_graph_its_forward_left_at_once(
    backend: str, error: type[BaseException]
) -> None:
    """While the caller still holds the error, no frame of the failed attempt keeps its tensors
    or the parameters' AccumulateGrad nodes (on CUDA made on the capture's side stream, which
    later backwards and captures would otherwise be tied to); an interrupt passes as it is."""
    device = device_of(backend)
    module = FailsHalfWay(error).to(device)
    x = torch.randn(2, 8, device=device)
    # torch imports torch._dynamo at the first op under a TorchFunctionMode (the capture lint's),
    # and that import leaves a reference cycle through the frames on the stack (torch.fx.wrap)
    # which only a collection frees: imported here, before the frames hold anything
    importlib.import_module("torch._dynamo")
    gc.disable()  # only reference counts may free them
    try:
        expected = CaptureError if error is ValueError else error
        with pytest.raises(expected, match="failed half-way") as caught:
            dgt.make_graphed_callables(module, (x,), backend=backend)
        assert len(module.left) == 2
        assert [ref() for ref in module.left] == [None, None]
        # the traceback still shows where it failed, only without the locals
        raised = caught.value.__cause__ if error is ValueError else caught.value
        assert raised is not None
        shown = "".join(traceback.format_tb(raised.__traceback__))
        assert 'raise self.error("failed half-way")' in shown
    finally:
        gc.enable()
    module.calls = 10  # never fails again; graphing it now works, the error still held
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's AccumulateGrad stream-mismatch warning too
        graphed = dgt.make_graphed_callables(
            module, (torch.randn(2, 8, device=device, requires_grad=True),), backend=backend
        )
        y = torch.randn(2, 8, device=device, requires_grad=True)
        graphed(y).sum().backward()
    del caught
    assert_tensors_match(
        graphed(x).detach(), module.fc(x).relu().detach(), "out", tolerance(backend)
    )


def _raises_keeping(kept: Any) -> None:
    """Raises, with ``kept`` among its locals (what a post-mortem debugger would read)."""
    raise KeyError("the caller's own error")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_capture_failing_in_an_except_block_leaves_the_handled_error_alone(backend: str) -> None:
    """Graphing inside the caller's ``except`` block: the failure's chain reaches the caller's
    error, whose frames (locals) belong to the caller, and which is no cause of the failure."""
    device = device_of(backend)
    try:
        _raises_keeping(kept="the caller's local")
    except KeyError as handled:
        with pytest.raises(CaptureError) as caught:
            dgt.make_graphed_callables(
                Exploding(fail_at=2).to(device),
                (torch.randn(2, 8, device=device),),
                backend=backend,
            )
        assert str(caught.value).endswith("failed during warmup: ValueError: exploded on purpose")
        assert isinstance(caught.value.__cause__, ValueError)
        frames = [frame for frame, _ in traceback.walk_tb(handled.__traceback__)]
        assert frames[-1].f_locals == {"kept": "the caller's local"}
        assert caught.value.__cause__.__context__ is handled  # the chain itself is kept


class ThrowsIntoItsSchedule(nn.Module):
    """Keeps a generator it resumes on each call and throws its failures into (which records
    them and goes on); fails in its second call after that."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0
        self.schedule = self._steps()
        next(self.schedule)

    def _steps(self) -> Any:
        failures = 0
        while True:
            try:
                yield failures
            except ValueError:
                failures += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            try:
                raise ValueError("exploded on purpose")
            except ValueError as error:
                self.schedule.throw(error)  # its frame joins the error's traceback, suspended
                raise
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_capture_leaves_a_suspended_generator_in_its_traceback_running(
    backend: str,
) -> None:
    device = device_of(backend)
    module = ThrowsIntoItsSchedule().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a generator closed under it would warn (unraisable)
        message = capture_error(module, (torch.randn(2, 8, device=device),), backend=backend)
    assert message.endswith("ValueError: exploded on purpose")
    assert next(module.schedule) == 1  # not closed: it recorded the failure and goes on


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_capture_failing_inside_a_generator_based_context_manager_keeps_its_state(
    backend: str,
) -> None:
    """Graphing in a ``@contextmanager`` (whose generator is running, and here handles an
    error): the failure is a CaptureError with the original cause, and the generator, its
    locals and the error it handles are left as they were."""
    device = device_of(backend)
    seen: list[Any] = []

    @contextlib.contextmanager
    def graphed_or_eager(module: nn.Module) -> Any:
        mode = "graphed"
        try:
            _raises_keeping(kept=mode)
        except KeyError as handled:
            try:
                module = dgt.make_graphed_callables(
                    module, (torch.randn(2, 8, device=device),), backend=backend
                )
            except CaptureError as error:
                mode = "eager"
                seen.append(error)
            frames = [frame for frame, _ in traceback.walk_tb(handled.__traceback__)]
            seen.append(frames[-1].f_locals)
        yield module, mode

    with graphed_or_eager(Exploding(fail_at=2).to(device)) as (module, mode):
        assert mode == "eager" and "forward" not in module.__dict__
    error, kept_locals = seen
    assert isinstance(error.__cause__, ValueError)
    assert str(error).endswith("ValueError: exploded on purpose")
    assert kept_locals == {"kept": "graphed"}


def _graph_again_while_the_error_is_held(module: nn.Module, backend: str, match: str) -> Any:
    """Graph ``module`` (which fails), then again while the first error is still held and no
    garbage collection runs: what the failed attempt made must be gone by then."""
    device = device_of(backend)
    sample = (torch.randn(2, 8, device=device, requires_grad=True),)
    importlib.import_module("torch._dynamo")  # see the test above
    gc.disable()
    try:
        with pytest.raises(CaptureError, match=match) as caught:
            dgt.make_graphed_callables(module, sample, backend=backend)
        graphed = dgt.make_graphed_callables(module, sample, backend=backend)
        del caught
    finally:
        gc.enable()
    return graphed


def _fails_on_call(at: int) -> Any:
    calls: list[None] = []

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        calls.append(None)
        if len(calls) == at:
            raise ValueError("failed in a hook")

    return hook


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("at", [1, 2], ids=["first warmup (linted)", "second warmup"])
def test_a_capture_failing_in_a_submodule_hook_frees_its_graph_while_the_error_is_held(
    backend: str, at: int
) -> None:
    """torch runs a module's hooks through a closure over its inputs and output; the cleared
    frame of that closure still holds it, and its cells held the half-built graph (and in the
    first warmup, a snapshot of the frame's locals that the capture lint's walk took)."""
    device = device_of(backend)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    twin = copy.deepcopy(module)
    module[2].register_forward_hook(_fails_on_call(at))
    graphed = _graph_again_while_the_error_is_held(module, backend, "failed in a hook")
    x = torch.randn(2, 8, device=device)
    assert_tensors_match(graphed(x).detach(), twin(x).detach(), "output", tolerance(backend))


class KeepsWeakReferencesToItsInputs(nn.Module):
    """Fails in its second call; keeps weak references to what each call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.given: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.given.append(weakref.ref(x))
        if len(self.given) == 2:
            raise ValueError("failed")
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_capture_frees_its_static_inputs_while_the_error_is_held(backend: str) -> None:
    """The capture lint keeps the static inputs it watches; the frame that raises the error
    (which its traceback keeps) held the lint."""
    device = device_of(backend)
    module = KeepsWeakReferencesToItsInputs().to(device)
    sample = (torch.randn(2, 8, device=device, requires_grad=True),)
    importlib.import_module("torch._dynamo")  # see test_a_failed_capture_frees_the_graph_...
    gc.disable()  # only reference counts may free them
    try:
        # every capture error says "failed": the planted cause is what names this one
        with pytest.raises(
            CaptureError, match=r"failed during warmup: ValueError: failed$"
        ) as caught:
            dgt.make_graphed_callables(module, sample, backend=backend, lint="warn")
        assert [ref() for ref in module.given] == [None, None]
        del caught
    finally:
        gc.enable()


class RegistersAHookThenFails(nn.Module):
    """Its second call registers a hook on its layer, closing over a local, then fails."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            scale = 3.0
            self.fc.register_forward_hook(lambda module, args, out: out * scale)
            raise ValueError("failed after registering a hook")
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_failed_capture_keeps_the_cells_of_a_closure_it_left_registered(backend: str) -> None:
    """The failed frame's variables that a closure still held elsewhere closes over stay."""
    device = device_of(backend)
    module = RegistersAHookThenFails().to(device)
    capture_error(module, (torch.randn(2, 8, device=device),), backend=backend)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        expected = F.linear(x, module.fc.weight, module.fc.bias) * 3
        assert_tensors_match(module.fc(x), expected, "output", tolerance(backend))


class FailsInAGenerator(nn.Module):
    """Its second call iterates a generator that yields the layer's output, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def _steps(self, x: torch.Tensor) -> Any:
        h = self.fc(x)
        yield h
        raise ValueError("failed in a generator")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            return sum(self._steps(x))  # type: ignore[return-value]
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_capture_failing_in_a_generator_frees_its_graph_while_the_error_is_held(
    backend: str,
) -> None:
    """A finished generator's frame keeps its locals as any finished frame does (only a
    suspended one is left alone)."""
    module = FailsInAGenerator().to(device_of(backend))
    graphed = _graph_again_while_the_error_is_held(module, backend, "failed in a generator")
    x = torch.randn(2, 8, device=device_of(backend))
    assert_tensors_match(graphed(x).detach(), module.fc(x).detach(), "out", tolerance(backend))


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_module_keeping_a_graph_in_a_tensor_attribute_is_refused_naming_the_attribute(
    backend: str, norm: str
) -> None:
    """torch's deprecated weight_norm and spectral_norm keep ``weight`` as a plain attribute
    with its autograd graph: there is no ``loss`` to delete, so the refusal names the attribute
    and the parametrizations that replace those functions."""
    device = device_of(backend)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
        getattr(torch.nn.utils, norm)(module[0])
    module(torch.randn(4, 8, device=device))  # an eager call, its output dropped
    message = capture_error(module, (torch.randn(4, 8, device=device),), backend=backend)
    assert "Sequential.0.weight is a tensor attribute that keeps an autograd graph" in message
    assert "torch.nn.utils.parametrizations" in message


@pytest.mark.parametrize("allow_unused_input", [False, True])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_read_through_the_graphed_modules_own_pre_hook_is_refused_naming_the_hook(
    backend: str, allow_unused_input: bool
) -> None:
    """A graphed module's own forward pre-hooks run around each call, outside the graphs:
    torch's deprecated spectral_norm, on the graphed module itself, computes ``weight`` from
    ``weight_orig`` there, so the graph never reaches ``weight_orig``, which eager gives a
    grad. The refusal names the pre-hook and says so, instead of offering allow_unused_input
    "as in eager" (which then left weight_orig without its grad), and allow_unused_input=True
    does not let it through."""
    device = device_of(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # spectral_norm's deprecation
        module = torch.nn.utils.spectral_norm(nn.Linear(8, 8).to(device))
    message = capture_error(
        module,
        (torch.randn(4, 8, device=device),),
        backend=backend,
        allow_unused_input=allow_unused_input,
    )
    assert "Linear.weight_orig requires grad" in message
    assert "forward pre-hooks (SpectralNorm) run outside the graphs" in message
    assert "as in eager" not in message


@pytest.mark.parametrize("kept", ["output", "loss after backward"])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_graphing_while_an_eager_graph_of_the_module_is_alive_is_refused_until_it_goes(
    backend: str, kept: str
) -> None:
    """An eager output or loss kept across graphing keeps the parameters' AccumulateGrad nodes
    alive, made on the caller's stream, which a CUDA capture's backward would wait on from inside
    the graph (torch warns, then the capture fails): refused by name before anything runs, on
    a CPU too; once the graph is gone, graphing works and trains as eager."""
    device = device_of(backend)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    twin = copy.deepcopy(module)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    alive = module(x)
    if kept == "loss after backward":
        alive = alive.sum()
        alive.backward()  # frees the saved tensors, not the graph's nodes
        twin(x.detach().requires_grad_()).sum().backward()
    sample = (torch.randn(4, 8, device=device, requires_grad=True),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing runs: not even torch's stream-mismatch warning
        message = capture_error(module, sample, backend=backend)
    assert "Sequential.0.weight's AccumulateGrad node is held by an autograd graph" in message
    assert "del loss" in message
    del alive
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    for _ in range(2):
        y = torch.randn(4, 8, device=device)
        a, b = y.clone().requires_grad_(), y.clone().requires_grad_()
        graphed(a).square().sum().backward()
        twin(b).square().sum().backward()
        assert_tensors_match(a.grad, b.grad, "x.grad", tolerance(backend))
        for (name, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
            assert_tensors_match(p.grad, q.grad, name, tolerance(backend))


class _Cyclic:
    """Refers to itself: only a garbage collection frees it (and what it holds)."""

    def __init__(self, held: Any) -> None:
        self.held = held
        self.me = self


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_eager_graph_only_a_reference_cycle_keeps_is_collected_not_refused(
    backend: str,
) -> None:
    """An eager loss that is garbage but not yet collected (kept by a reference cycle) holds the
    AccumulateGrad nodes like a live one; graphing collects it instead of refusing."""
    device = device_of(backend)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(device)
    twin = copy.deepcopy(module)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    gc.disable()  # only the capture's own collection may free it
    try:
        left = weakref.ref(_Cyclic(module(x).sum()))
        assert left() is not None
        sample = (torch.randn(4, 8, device=device, requires_grad=True),)
        graphed = dgt.make_graphed_callables(module, sample, backend=backend)
        assert left() is None
    finally:
        gc.enable()
    y = torch.randn(4, 8, device=device)
    graphed(y).square().sum().backward()
    twin(y).square().sum().backward()
    for (name, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, q.grad, name, tolerance(backend))


class DropsAnActivation(nn.Module):
    """Computes a sigmoid it never uses: autograd saves a sigmoid's output for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        torch.sigmoid(h)  # dropped at once, as eager drops it
        return h * 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_activation_the_forward_drops_leaves_no_graph_behind_the_warmup(backend: str) -> None:
    """The first warmup call notes what autograd saves; a pack hook that hands autograd the
    tensor itself ties an op's saved output to its own node, a cycle no collection frees (the
    warmup's backward never reaches a dropped result). The parameters' AccumulateGrad nodes
    stayed alive (on CUDA made on the warmup's side stream): graphing the module again was
    refused."""
    device = device_of(backend)
    module = DropsAnActivation().to(device)
    twin = copy.deepcopy(module)
    sample = (torch.randn(2, 8, device=device, requires_grad=True),)
    dgt.make_graphed_callables(module, sample, backend=backend)
    dgt.restore(module)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    x = torch.randn(2, 8, device=device)
    graphed(x).square().sum().backward()
    twin(x).square().sum().backward()
    for (name, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, q.grad, name, tolerance(backend))


class Foreign(nn.Module):
    """Closes over a tensor that requires grad but is neither an input nor a parameter (refused);
    with ``foreign=None`` it is a plain layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.foreign: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))  # tanh saves its output
        return h if self.foreign is None else h * self.foreign


def _fails_once(error: BaseException) -> Any:
    calls: list[None] = []

    def hook(module: nn.Module) -> None:
        calls.append(None)
        if len(calls) == 1:
            raise error

    return hook


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    "failure", ["refused foreign leaf", "capture-time forward hook", "interrupt in that hook"]
)
def test_a_capture_failing_between_the_first_forward_and_its_backward_can_be_retried(
    backend: str, failure: str
) -> None:
    """The first warmup forward's graph, never differentiated, goes with the failure: graphing
    the module again works (it was refused: the parameters' AccumulateGrad nodes stayed held)
    and trains as eager."""
    device = device_of(backend)
    module = Foreign().to(device)
    twin = copy.deepcopy(module)
    sample = (torch.randn(2, 8, device=device, requires_grad=True),)
    options: dict[str, Any] = {"backend": backend}
    if failure == "refused foreign leaf":
        module.foreign = torch.ones(8, device=device, requires_grad=True)
    else:
        error = (
            ValueError("failed") if failure == "capture-time forward hook" else KeyboardInterrupt()
        )
        options["capture_time_hooks"] = {"forward_hooks": {0: _fails_once(error)}}
    with pytest.raises(KeyboardInterrupt if failure == "interrupt in that hook" else CaptureError):
        dgt.make_graphed_callables(module, sample, **options)
    module.foreign = None
    graphed = dgt.make_graphed_callables(module, sample, **options)
    x = torch.randn(2, 8, device=device)
    graphed(x).square().sum().backward()
    twin(x).square().sum().backward()
    for (name, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, q.grad, name, tolerance(backend))


def test_pool_sizes_come_from_one_allocator_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pool's segments on the device, summed; a handle that is no pair id counts 0."""
    from dualgraph.torch import _capture_cuda

    segments = [
        {"segment_pool_id": (0, 1), "device": 0, "total_size": 2 << 20},
        {"segment_pool_id": (0, 1), "device": 0, "total_size": 1 << 20},
        {"segment_pool_id": (0, 1), "device": 1, "total_size": 8 << 20},  # another device
        {"segment_pool_id": (0, 2), "device": 0, "total_size": 4 << 20},
        {"segment_pool_id": (0, 0), "device": 0, "total_size": 16 << 20},  # no graph pool
    ]
    calls: list[None] = []
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: calls.append(None) or segments)
    sizes = _capture_cuda._pool_bytes([(0, 1), object(), (0, 2), (0, 3)], torch.device("cuda", 0))
    assert sizes == [3 << 20, 0, 4 << 20, 0] and len(calls) == 1
    assert _capture_cuda._pool_bytes([object()], torch.device("cuda", 0)) == [0]
    assert len(calls) == 1  # no handle to look for: no snapshot


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_capture_where_saved_tensor_hooks_are_disabled_works_as_eager_does(
    backend: str,
) -> None:
    # dualgraph's own hooks (the warmup's) pushed where the caller disabled saved-tensor hooks
    # failed the capture with torch's message, where the eager forward and backward run.
    device = device_of(backend)
    mlp = TinyMLP().to(device)
    eager = copy.deepcopy(mlp)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off here"):
        dgt.make_graphed_callables(mlp, (sample,), backend=backend)
        assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() == (
            "hooks are off here"
        )
        for _ in range(2):
            x = torch.randn(4, 8, device=device)
            assert_grads_match(
                step_grads(mlp, (x,)),
                step_grads(eager, (x,)),
                parameter_names(mlp),
                tolerance(backend),
            )
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


def test_a_memory_plan_where_saved_tensor_hooks_are_disabled_works() -> None:
    sample = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off here"):
        plan = dgt.memory_plan(TinyMLP(), sample)
    assert plan.callables[0].saved_activation_bytes > 0
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_capture_keeps_its_activations_from_the_callers_saved_tensor_hooks(
    backend: str,
) -> None:
    # Replays keep their activations from the caller's hooks (offloading, compression) as a
    # graph does; the capture ran the callable under them, so on CUDA the graph would replay
    # what they did at capture (a lossy pack baked into every backward, pinned-memory copies).
    device = device_of(backend)
    mlp = TinyMLP().to(device)
    eager = copy.deepcopy(mlp)
    packed: list[torch.Tensor] = []

    def lossy(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor.to(torch.bfloat16)

    sample = torch.randn(4, 8, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lossy, lambda t: t.float()):
        dgt.make_graphed_callables(mlp, (sample,), backend=backend)
    assert packed == []
    x = torch.randn(4, 8, device=device)
    assert_grads_match(
        step_grads(mlp, (x,)), step_grads(eager, (x,)), parameter_names(mlp), tolerance(backend)
    )


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_capture_keeps_its_activations_from_the_callers_saved_tensor_hooks_on_every_entry_point(
    entry: str,
) -> None:
    # The padding check at capture (a padded and an unpadded eager call, and their grads) ran
    # under the caller's hooks: 18 packs for one Linear.
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        graphed_on(entry, Decays())
    assert packed == []


# -- what a callable reaches besides its module ---------------------------------------------------


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).requires_grad_(False)  # a bound method's: frozen
        self.register_buffer("seen", torch.zeros(4))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().sum(0))
        return self.lin(x) * x


@pytest.mark.parametrize("fails", [False, True], ids=["captured", "failed"])
def test_graphing_a_method_leaves_its_modules_buffers_as_they_were(fails: bool) -> None:
    module = _Counting()
    if fails:
        module.lin.register_forward_hook(lambda *_: module.seen.sum().item())  # lint: refused
    x = torch.ones(2, 4, requires_grad=True)
    try:
        graphed = dgt.make_graphed_callables(module.encode, (x,), backend="emulate")
    except CaptureError:
        assert fails
    else:
        assert not fails
        graphed(x).sum().backward()
        assert torch.equal(module.seen, torch.full((4,), 2.0))  # the one replay's update
        return
    assert torch.equal(module.seen, torch.zeros(4))


def test_graphing_a_function_leaves_the_tensors_it_closes_over_as_they_were() -> None:
    stats = torch.zeros(2)

    def step(x: torch.Tensor) -> torch.Tensor:
        stats.add_(x.detach())
        return x * 2

    graphed = dgt.make_graphed_callables(
        step, (torch.ones(2, requires_grad=True),), backend="emulate"
    )
    assert torch.equal(stats, torch.zeros(2))
    graphed(torch.ones(2, requires_grad=True)).sum().backward()
    assert torch.equal(stats, torch.ones(2))  # as one eager call


def test_graphing_a_function_leaves_a_tensor_it_only_reads_untouched() -> None:
    # Only what warmup changed is copied back: a copy bumps the version, which would break an
    # eager backward of the caller's that saved the tensor.
    scale = torch.full((2,), 3.0)
    version = scale._version

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    graphed = dgt.make_graphed_callables(
        step, (torch.ones(2, requires_grad=True),), backend="emulate"
    )
    assert scale._version == version
    graphed(torch.ones(2, requires_grad=True)).sum().backward()
    assert torch.equal(scale, torch.full((2,), 3.0))


class MovesItsTensorElsewhere(nn.Module):
    """Sets a module tensor's ``.data`` to a tensor of another size in its forward."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.scale = torch.ones(4)  # a plain tensor attribute
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moved = self.w if self.where == "parameter" else self.scale
        moved.data = torch.zeros(8, device=x.device)
        return x * self.w[:4] * self.scale[:4]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("where", "name"),
    [("parameter", "MovesItsTensorElsewhere.w"), ("attribute", "MovesItsTensorElsewhere.scale")],
)
def test_a_module_tensor_moved_to_memory_of_another_size_is_refused_and_put_back(
    backend: str, where: str, name: str
) -> None:
    # The put-back copied 4 kept elements into the 8 of the new memory: a RuntimeError naming
    # no path, and the module left holding the new tensor.
    device = device_of(backend)
    module = MovesItsTensorElsewhere(where).to(device)
    module.scale = module.scale.to(device)
    message = capture_error(
        module, (torch.randn(2, 4, device=device),), backend=backend, lint="off"
    )
    assert f"{name}: the callable " in message
    assert "RuntimeError" not in message
    for tensor in (module.w, module.scale):  # as before graphing
        assert torch.equal(tensor.detach().cpu(), torch.ones(4))


class HalvesItsWeightQuietly(nn.Module):
    """Changes a module tensor where no version counter moves (``.data``), as a kernel could."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)
        self.scale = torch.ones(4)  # a plain tensor attribute
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "parameter":
            self.w.data.mul_(0.5)
        elif self.where == "frozen parameter":
            self.frozen.data.copy_(self.frozen.data * 0.5)
        else:
            self.scale.data.mul_(0.5)
        return x * self.w * self.frozen * self.scale


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("parameter", "HalvesItsWeightQuietly.w"),
        ("frozen parameter", "HalvesItsWeightQuietly.frozen"),
        ("attribute", "HalvesItsWeightQuietly.scale"),
    ],
)
def test_a_module_tensor_changed_without_a_version_bump_is_refused_and_put_back(
    backend: str, where: str, name: str
) -> None:
    # lint="off" (the CUDA default): warmup and capture each halved the weight, which a
    # graphed module then held at 0.0625 where eager's would still be 1.0.
    device = device_of(backend)
    module = HalvesItsWeightQuietly(where).to(device)
    module.scale = module.scale.to(device)
    message = capture_error(
        module, (torch.randn(2, 4, device=device, requires_grad=True),), backend=backend, lint="off"
    )
    assert f"{name}: the callable updates this" in message
    assert "without a version bump (.data, a kernel of its own) (element [0] was 1.0 and is 0." in (
        message
    )
    for tensor in (module.w, module.frozen, module.scale):  # as before graphing
        assert torch.equal(tensor.detach().cpu(), torch.ones(4))
    assert module.w._version == 0  # nothing eager would see moved


class HalvesItsWeightOnItsSecondCall(nn.Module):
    """Changes its weight through ``.data`` on its second call only (a step counter of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            self.w.data.mul_(0.5)
        return x * self.w


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_changed_quietly_by_a_later_warmup_call_is_refused_and_put_back(
    backend: str,
) -> None:
    # Only the first warmup call was compared: the second halved the weight unseen, and the
    # graphed module went on with 0.5 where eager's (never called) held 1.0.
    device = device_of(backend)
    module = HalvesItsWeightOnItsSecondCall().to(device)
    message = capture_error(
        module, (torch.randn(2, 4, device=device, requires_grad=True),), backend=backend, lint="off"
    )
    assert "HalvesItsWeightOnItsSecondCall.w: the callable updates this" in message
    assert torch.equal(module.w.detach().cpu(), torch.ones(4))
    assert module.w._version == 0


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_a_failed_capture_of_a_method_changed_quietly_is_put_back(
    backend: str,
) -> None:
    # Refused for another reason (a method's parameters get no grad from a replay), after the
    # first warmup call halved the weight through .data.
    device = device_of(backend)
    module = HalvesItsWeightQuietly("parameter").to(device)
    module.scale = module.scale.to(device)  # a plain attribute: module.to leaves it
    message = capture_error(
        module.forward, (torch.randn(4, device=device),), backend=backend, lint="off"
    )
    assert "neither inputs nor arguments" in message
    assert torch.equal(module.w.detach().cpu(), torch.ones(4))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("graphed", "where", "name"),
    [
        ("function", "frozen parameter", "closed over halves.frozen"),
        ("function", "attribute", "closed over halves.scale"),
        ("method", "attribute", "HalvesItsWeightQuietly.scale"),
    ],
)
def test_a_tensor_a_functions_code_reaches_changed_quietly_is_named_as_the_code_names_it(
    backend: str, graphed: str, where: str, name: str
) -> None:
    # Pins the names warmup's comparison gives a function's tensors (as each call's check
    # names them) and that it puts them back.
    device = device_of(backend)
    halves = HalvesItsWeightQuietly(where).to(device)
    halves.w.requires_grad_(False)  # a replay gives a function's parameters no grad
    halves.scale = halves.scale.to(device)

    def call(x: torch.Tensor) -> torch.Tensor:
        return halves(x)

    message = capture_error(
        call if graphed == "function" else halves.forward,
        (torch.randn(2, 4, device=device, requires_grad=True),),
        backend=backend,
        lint="off",
    )
    assert f"{name}: the callable updates this" in message
    for tensor in (halves.frozen, halves.scale):  # as before graphing
        assert torch.equal(tensor.detach().cpu(), torch.ones(4))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("graphed", ["module", "function"])
def test_a_backward_pending_on_the_buffers_graphing_puts_back_still_runs(
    backend: str, graphed: str
) -> None:
    # BatchNorm's kernel updates its statistics without a version bump; putting them back with
    # copy_ moved their versions, so the backward of an eval-mode call made before graphing
    # (which saved them) failed as "modified by an inplace operation", where eager (graphing
    # runs nothing) runs it.
    device = device_of(backend)
    norm = nn.BatchNorm1d(4, affine=False).to(device).eval()
    x = torch.randn(8, 4, device=device, requires_grad=True)
    (expected,) = torch.autograd.grad(norm(x).square().sum(), x)
    pending = norm(x).square().sum()
    norm.train()
    versions = (norm.running_mean._version, norm.running_var._version)

    def call(t: torch.Tensor) -> torch.Tensor:
        return norm(t)

    sample = torch.randn(8, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(norm if graphed == "module" else call, (sample,), backend=backend)
    assert (norm.running_mean._version, norm.running_var._version) == versions
    pending.backward()
    assert x.grad is not None and torch.equal(x.grad, expected)


class _FusedWgradMatmul(torch.autograd.Function):
    """Megatron's gradient_accumulation_fusion (TE's fuse_wgrad_accumulation): the backward adds
    the weight grad into ``weight.main_grad`` itself, sets ``grad_added_to_main_grad`` and hands
    autograd a dummy grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.weight = weight
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        weight.main_grad.add_(grad.t() @ x)
        weight.grad_added_to_main_grad = True
        return grad @ weight, torch.ones_like(weight)  # a dummy (TE's may be uninitialized)


class _FusedWgradLinear(nn.Module):
    def __init__(self, seed: int, device: torch.device) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(4, 4, generator=generator).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedWgradMatmul.apply(x, self.weight)


def _with_grad_buffer(model: nn.Module) -> torch.Tensor:
    """Megatron's DDP: every parameter's main_grad a view of one contiguous buffer, and a grad
    hook that adds a grad into it unless the backward did (grad_added_to_main_grad)."""
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    offset = 0
    for param in params:
        param.main_grad = buffer[offset : offset + param.numel()].view_as(param)  # type: ignore[attr-defined]
        param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        offset += param.numel()

        def hook(param: torch.Tensor) -> None:
            if param.grad is not None and not param.grad_added_to_main_grad:  # type: ignore[attr-defined]
                param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
            param.grad = None

        param.register_post_accumulate_grad_hook(hook)
    return buffer


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_megatron_fused_grad_accumulation_into_main_grad_equals_eager(backend: str) -> None:
    # The warmup's backward added its grads into main_grad and set grad_added_to_main_grad:
    # a model graphed at the start of a step (after zero_grad_buffer) began with them. On CUDA
    # a replay runs no Python: the flag is set again by each backward replay, else the grad
    # hook adds the dummy grad into main_grad.
    device = device_of(backend)
    results = []
    for graphed in (True, False):
        model = nn.Sequential(_FusedWgradLinear(1, device), _FusedWgradLinear(2, device))
        buffer = _with_grad_buffer(model)
        run: Any = model
        if graphed:
            sample = (torch.ones(2, 4, device=device, requires_grad=True),)
            run = dgt.make_graphed_callables(model, sample, backend=backend)
            assert not buffer.any()
            assert [p.grad_added_to_main_grad for p in model.parameters()] == [False, False]  # type: ignore[attr-defined]
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):  # steps: zero_grad_buffer clears the buffer and the flags
            buffer.zero_()
            for param in model.parameters():
                param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            for _ in range(2):  # micro-batches accumulate into main_grad
                x = torch.randn(2, 4, generator=generator).to(device).requires_grad_()
                run(x).sum().backward()
            results.append(buffer.clone())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])


def test_graphing_notes_the_flags_a_backward_sets_on_its_parameters() -> None:
    # What CUDA replays set again (emulate's replays run the backward's Python themselves).
    layer = _FusedWgradLinear(1, torch.device("cpu"))
    _with_grad_buffer(layer)
    layer.weight.shared = True  # type: ignore[attr-defined]  # set before: no flag of the backward
    with parameter_attributes_kept([layer.weight]) as found:
        x = torch.ones(2, 4, requires_grad=True)
        layer(x).sum().backward()
        layer.weight.note = "set by the call"  # type: ignore[attr-defined]
    assert [entry[2:] for entry in found.of([layer.weight])] == [
        ("grad_added_to_main_grad", True),
        ("note", "set by the call"),
    ]
    assert found.of([layer.weight])[0][1] is layer.weight.__dict__
    written = found.written([layer.weight], ["Layer.weight"])  # main_grad: checked on CUDA
    assert [(entry[0], entry[3]) for entry in written] == [
        ("Layer.weight.main_grad", layer.weight.main_grad)  # type: ignore[attr-defined]
    ]
    assert not hasattr(layer.weight, "note") and not layer.weight.main_grad.any()  # type: ignore[attr-defined]


def test_main_grads_are_compared_without_a_host_read_each() -> None:
    # Each host read of a CUDA tensor waits for the device: one per main_grad at entry (is it
    # zero?) and one at exit (did the block write it?) made capture wait 2 x parameters times.
    # The checks are read together; on the CPU no read goes through torch's dispatch at all.
    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.equal):
                self.found.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    params = [nn.Parameter(torch.ones(3)) for _ in range(3)]
    for i, param in enumerate(params):
        param.main_grad = torch.full((3,), float(i))  # type: ignore[attr-defined]
    with HostReads() as reads, parameter_attributes_kept(params):
        params[0].main_grad.add_(1.0)  # type: ignore[attr-defined]
        params[2].main_grad.add_(1.0)  # type: ignore[attr-defined]
    assert reads.found == []
    assert [p.main_grad.tolist() for p in params] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]  # type: ignore[attr-defined]


def test_graphing_notes_the_fused_flag_a_backward_sets_when_it_held_that_value_already() -> None:
    # Graphed after an eager step, before zero_grad_buffer (Megatron's order: the graphs are
    # made before the next step's train_step): the flag is True already and the backward sets
    # True again. A CUDA replay must still set it, else Megatron's hook, after the next
    # zero_grad_buffer, adds the dummy grad into main_grad.
    layer = _FusedWgradLinear(1, torch.device("cpu"))
    _with_grad_buffer(layer)
    layer(torch.ones(2, 4)).sum().backward()  # the eager step: main_grad filled, flag True
    assert layer.weight.grad_added_to_main_grad  # type: ignore[attr-defined]
    with parameter_attributes_kept([layer.weight]) as found:
        layer(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert [entry[2:] for entry in found.of([layer.weight])] == [("grad_added_to_main_grad", True)]


def test_a_main_grad_holding_nan_the_block_leaves_alone_is_not_taken_as_written() -> None:
    # Compared by value (tensor != saved), a NaN is never itself: a main_grad holding NaN (left
    # from an earlier step, or torch.empty's) was taken as written by the backward, its memory
    # then held to the attribute on CUDA and its parameter's fused flag noted as set.
    weight = nn.Parameter(torch.ones(3))
    weight.main_grad = torch.tensor([float("nan"), 1.0, 0.0])  # type: ignore[attr-defined]
    weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    with parameter_attributes_kept([weight]) as found:
        pass
    assert found.written([weight], ["weight"]) == ()
    assert found.of([weight]) == ()


def test_a_main_grad_of_negative_zeros_is_put_back_as_it_was() -> None:
    # A main_grad whose values are all zero was kept as "zeros" (tensor.any() is False for
    # -0.0), so the put-back of what the block added wrote +0.0 where it held -0.0.
    weight = nn.Parameter(torch.ones(2))
    weight.main_grad = torch.tensor([-0.0, -0.0])  # type: ignore[attr-defined]
    with parameter_attributes_kept([weight]):
        weight.main_grad.data.add_(1.0)  # type: ignore[attr-defined]
    assert weight.main_grad.signbit().all()  # type: ignore[attr-defined]


def test_putting_back_a_main_grad_moves_no_version_counter() -> None:
    # A fused kernel adds into main_grad without a version bump; the put-back's copy_ moved it
    # (as graphing runs nothing in eager, none should), where a module's buffers' did not.
    weight = nn.Parameter(torch.ones(2))
    weight.main_grad = torch.tensor([0.0, 3.0])  # type: ignore[attr-defined]
    version = weight.main_grad._version  # type: ignore[attr-defined]
    with parameter_attributes_kept([weight]):
        weight.main_grad.data.add_(1.0)  # type: ignore[attr-defined]
    assert torch.equal(weight.main_grad, torch.tensor([0.0, 3.0]))  # type: ignore[attr-defined]
    assert weight.main_grad._version == version  # type: ignore[attr-defined]


def test_a_main_grad_held_as_an_inference_tensor_is_put_back_too() -> None:
    # Its put-back was skipped (copy_ refuses an inference tensor outside inference mode), so
    # what a fused kernel (which no inference check sees) added there stayed; .data takes it.
    weight = nn.Parameter(torch.ones(2))
    with torch.inference_mode():
        weight.main_grad = torch.tensor([0.0, 3.0])  # type: ignore[attr-defined]
    with parameter_attributes_kept([weight]):
        weight.main_grad.data.add_(1.0)  # type: ignore[attr-defined]
    assert torch.equal(weight.main_grad, torch.tensor([0.0, 3.0]))  # type: ignore[attr-defined]


@pytest.mark.cuda
def test_fused_grad_accumulation_graphed_after_an_eager_step_equals_eager_on_cuda() -> None:
    # The flag is True when graphing (the eager step set it): CUDA replays must set it too.
    results = []
    for graphed in (True, False):
        model = nn.Sequential(_FusedWgradLinear(1, torch.device(CUDA)))
        buffer = _with_grad_buffer(model)
        model(torch.ones(2, 4, device=CUDA)).sum().backward()  # an eager step
        run: Any = model
        if graphed:
            sample = (torch.ones(2, 4, device=CUDA, requires_grad=True),)
            run = dgt.make_graphed_callables(model, sample, backend="cuda")
        buffer.zero_()
        for param in model.parameters():
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        run(torch.full((2, 4), 2.0, device=CUDA, requires_grad=True)).sum().backward()
        results.append(buffer.clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.cuda
def test_a_main_grad_rebound_after_capture_is_refused_on_cuda() -> None:
    # The captured backward adds into the main_grad memory of capture; eager's into the new.
    model = nn.Sequential(_FusedWgradLinear(1, torch.device(CUDA)))
    _with_grad_buffer(model)
    sample = (torch.ones(2, 4, device=CUDA, requires_grad=True),)
    run = dgt.make_graphed_callables(model, sample, backend="cuda")
    run(sample[0]).sum().backward()
    model[0].weight.main_grad = torch.zeros_like(model[0].weight)  # type: ignore[attr-defined]
    refused = (
        r"0\.weight\.main_grad was rebound or moved since capture "
        r"\(at 0x[0-9a-f]+ then, now another tensor, at 0x"
    )
    with pytest.raises(DualgraphError, match=refused):
        run(sample[0])


class LeavesStateOnItself(nn.Module):
    """Leaves something of each call on itself (or, ``cached_once``, fills a cache on its
    first call and reads it after)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(4, 4)
        self.inner = nn.Module()
        self.inner.aux_losses = []
        self.cache: dict[str, torch.Tensor] = {}
        self.stats: collections.defaultdict[str, list[torch.Tensor]] = collections.defaultdict(list)
        self.queues = ([], [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.how == "shapes_rebound":  # a plain value: left alone
            self.shapes = (x.shape, h.shape)
        elif self.how == "nested_appended":
            self.stats["aux"].append(h.square().mean())
        elif self.how == "in_a_tuple_appended":
            self.queues[1].append(h)
        elif self.how == "tuple_rebound":
            self.last = (h, h.softmax(-1))
        elif self.how == "appended_in_backward":  # a hook its backward runs, logging grads
            if h.requires_grad:
                h.register_hook(lambda grad: self.inner.aux_losses.append(grad.norm()))
        elif self.how == "appended":
            self.inner.aux_losses.append(h.square().mean())
        elif self.how == "entry_set":
            self.cache["h"] = h
        elif self.how == "rebound":
            self.last_attn = h.softmax(-1)
        elif "scale" not in self.cache:  # cached_once
            self.cache["scale"] = torch.full((4,), 2.0, device=x.device)
        return h * self.cache.get("scale", 1.0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("how", "path", "words"),
    [
        ("appended", "LeavesStateOnItself.inner.aux_losses", "changes this list in place"),
        ("entry_set", "LeavesStateOnItself.cache", "changes this dict in place"),
        ("rebound", "LeavesStateOnItself.last_attn", "sets this attribute to a new Tensor"),
        ("nested_appended", "LeavesStateOnItself.stats['aux']", "changes this list in place"),
        ("in_a_tuple_appended", "LeavesStateOnItself.queues[1]", "changes this list in place"),
        ("tuple_rebound", "LeavesStateOnItself.last", "sets this attribute to a new tuple"),
        (
            "appended_in_backward",
            "LeavesStateOnItself.inner.aux_losses",
            "changes this list in place",
        ),
    ],
)
def test_a_forward_leaving_state_on_its_module_on_every_call_is_refused_naming_it(
    backend: str, how: str, path: str, words: str
) -> None:
    # Eager appends a loss (sets an entry, a new tensor) on every call; a CUDA replay runs no
    # Python, so the list stopped growing (the attribute kept the tensor of capture), silently
    # (emulate re-ran the Python, so CPU tests saw eager's behaviour).
    device = device_of(backend)
    module = LeavesStateOnItself(how).to(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    message = capture_error(module, sample, backend=backend)
    assert message.startswith(
        f"capturing LeavesStateOnItself ({backend}) failed during warmup: {path}: the "
        f"callable's Python {words} on every call"
    ), message
    # put back as before the capture, and left usable
    assert module.inner.aux_losses == [] and module.cache == {}
    assert module.stats == {} and module.queues == ([], [])
    assert not hasattr(module, "last_attn") and not hasattr(module, "last")
    module(sample[0])
    assert len(module.inner.aux_losses) == (how == "appended")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_tuple_of_sizes_a_forward_sets_on_every_call_is_a_plain_value(backend: str) -> None:
    device = device_of(backend)
    module = LeavesStateOnItself("shapes_rebound").to(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    assert graphed(torch.randn(2, 4, device=device)).shape == (2, 4)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_cache_a_forward_fills_on_its_first_call_and_reads_after_is_graphed(
    backend: str,
) -> None:
    device = device_of(backend)
    module = LeavesStateOnItself("cached_once").to(device)
    twin = copy.deepcopy(module)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    x = torch.randn(2, 4, device=device)
    assert torch.equal(graphed(x), twin(x))
    assert list(module.cache) == ["scale"]


AUX_LOSSES: list[torch.Tensor] = []


class RouterAppendingToAGlobal(nn.Module):
    """A mixture of experts' router collecting its load-balancing loss in a global list."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        AUX_LOSSES.append(h.softmax(-1).mean())
        return h


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("where", ["function", "module", "comprehension"])
def test_a_global_list_the_code_names_appended_to_on_every_call_is_refused_naming_it(
    backend: str, where: str
) -> None:
    # On CUDA a replay runs no Python: the load-balancing losses stopped being collected.
    device = device_of(backend)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    AUX_LOSSES.clear()
    if where == "module":
        fn: Any = nn.Sequential(RouterAppendingToAGlobal()).to(device)
        named = "RouterAppendingToAGlobal.forward's global AUX_LOSSES"
    elif where == "comprehension":  # named in nested code only
        frozen = nn.Linear(4, 4).to(device).requires_grad_(False)

        def fn(x: torch.Tensor) -> torch.Tensor:
            h = frozen(x)
            [AUX_LOSSES.append(part.square().mean()) for part in (h, h * 2)]
            return h

        named = "global AUX_LOSSES"
    else:
        layer = nn.Linear(4, 4).to(device).requires_grad_(False)  # a function's: frozen

        def fn(x: torch.Tensor) -> torch.Tensor:
            h = layer(x)
            AUX_LOSSES.append(h.square().mean())
            return h

        named = "global AUX_LOSSES"
    message = capture_error(fn, sample, backend=backend)
    assert (
        f"failed during warmup: {named}: the callable's Python changes this list in place on "
        in (message)
    ), message
    assert AUX_LOSSES == []  # put back as before the capture


AUX_BY_LAYER: dict[str, list[torch.Tensor]] = {"router": []}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_list_inside_a_global_dict_appended_to_on_every_call_is_refused_naming_it(
    backend: str,
) -> None:
    device = device_of(backend)
    layer = nn.Linear(4, 4).to(device).requires_grad_(False)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = layer(x)
        AUX_BY_LAYER["router"].append(h.square().mean())
        return h

    message = capture_error(fn, (torch.randn(2, 4, device=device),), backend=backend)
    assert (
        "failed during warmup: global AUX_BY_LAYER['router']: the callable's Python changes "
        "this list in place on every call"
    ) in message, message
    assert AUX_BY_LAYER == {"router": []}  # put back as before the capture


SCALES = iter([0.5 * k for k in range(1, 10_000)])


class _Warmup:
    """A learning-rate-like schedule written as a Python iterator."""

    def __init__(self) -> None:
        self.step = 0

    def __iter__(self) -> _Warmup:
        return self

    def __next__(self) -> float:
        self.step += 1
        return min(1.0, self.step / 100)


def _schedule(how: str) -> Any:
    """A fresh schedule of scales of the kind ``how`` names."""
    if how == "generator":
        return (0.5 * k for k in range(1, 100))
    if how == "count":
        return itertools.count(1)
    if how == "cycle":
        return itertools.cycle([0.5, 1.0, 2.0])
    if how == "map":
        return map(float, range(1, 100))
    if how == "python":
        return _Warmup()
    return iter(torch.utils.data.DataLoader([0.5 * k for k in range(1, 100)], batch_size=None))


class TakesTheNextScale(nn.Module):
    """Scales by the next item of an iterator it holds (or a global one), not an input."""

    def __init__(self, how: str, advanced: bool = True) -> None:
        super().__init__()
        self.how, self.advanced = how, advanced
        self.fc = nn.Linear(4, 4)
        self.schedule = _schedule(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.advanced:
            return self.fc(x)
        scale = next(SCALES) if self.how == "global" else next(self.schedule)
        return self.fc(x) * scale


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("how", "path", "kind"),
    [
        ("generator", "TakesTheNextScale.schedule", "generator"),
        ("global", "TakesTheNextScale.forward's global SCALES", "list_iterator"),
        ("count", "TakesTheNextScale.schedule", "count"),
        ("cycle", "TakesTheNextScale.schedule", "cycle"),
        ("map", "TakesTheNextScale.schedule", "map"),
        ("python", "TakesTheNextScale.schedule", "_Warmup"),
        ("data_loader", "TakesTheNextScale.schedule", "_SingleProcessDataLoaderIter"),
    ],
)
def test_an_iterator_a_forward_advances_on_every_call_is_refused_naming_it(
    backend: str, how: str, path: str, kind: str
) -> None:
    # On CUDA every replay kept the scale the capture took, silently; eager takes the next.
    device = device_of(backend)
    module = TakesTheNextScale(how).to(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    message = capture_error(module, sample, backend=backend)
    assert message.startswith(
        f"capturing TakesTheNextScale ({backend}) failed during warmup: {path}: the callable's "
        f"Python advances this {kind} on every call"
    ), message
    module(sample[0])  # left usable, eager


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["generator", "count", "cycle", "map", "python", "data_loader"])
def test_an_iterator_a_module_holds_and_its_forward_does_not_advance_is_graphed(
    backend: str, how: str
) -> None:
    device = device_of(backend)
    module = TakesTheNextScale(how, advanced=False).to(device)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    x = torch.randn(2, 4, device=device)
    assert torch.equal(graphed(x), module.fc(x))


class WalksItsBlocks(nn.Module):
    """Binds a fresh iterator over its blocks on every call, as a helper would."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.walk = iter(self.blocks)
        return next(self.walk)(next(self.walk)(x))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_iterator_a_forward_binds_afresh_on_every_call_is_graphed(backend: str) -> None:
    # Each call's iterator stands where the capture's does: nothing a replay would lose.
    device = device_of(backend)
    module = WalksItsBlocks().to(device)
    twin = copy.deepcopy(module)
    sample = (torch.randn(2, 4, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module, sample, backend=backend)
    x = torch.randn(2, 4, device=device)
    assert torch.equal(graphed(x), twin(x))


losses: list[torch.Tensor] = []  # a global named like the attribute below


class AppendsToItsOwnLosses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.losses.append(h.mean())
        return h


def test_an_attribute_named_like_a_global_is_no_global_of_the_code() -> None:
    # the refusal names the module's own list, never the unrelated global `losses`
    message = capture_error(
        AppendsToItsOwnLosses(), (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    assert "AppendsToItsOwnLosses.losses" in message and "global losses" not in message, message
    assert losses == []
