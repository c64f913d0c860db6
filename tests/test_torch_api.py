"""``dualgraph.torch.make_graphed_callables``: its options and samples, what comes back, and how
every call is checked before any static buffer is written.

Each behaviour is checked on the backends it applies to: ``emulate`` (static buffers, no graph)
and ``eager`` on the CPU, ``cuda`` (real graphs, marked ``cuda``) on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch_cases import (
    BACKENDS,
    CASES,
    CUDA,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    TinyMLP,
    assert_grads_match,
    assert_tensors_match,
    assert_trees_match,
    backward_of,
    device_of,
    fresh_copy,
    grads_of,
    isolation,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError, SpecMismatchError
from dualgraph.models.torch_vit import ViTBlock


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


# -- options and samples -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        (
            "backend",
            "xla",
            "backend must be one of ('auto', 'cuda', 'emulate', 'eager'), got 'xla'",
        ),
        (
            "param_grads",
            "fused",
            "param_grads must be one of ('auto', 'autograd', 'in_graph'), got 'fused'",
        ),
        (
            "capture_error_mode",
            "strict",
            "capture_error_mode must be one of ('global', 'thread_local', 'relaxed'), got 'strict'",
        ),
        ("num_warmup_iters", -1, "num_warmup_iters must be an int >= 0, got -1"),
        ("num_warmup_iters", 2.0, "num_warmup_iters must be an int >= 0, got 2.0"),
        ("clone_outputs", "no", "clone_outputs must be True or False, got 'no'"),
        ("allow_unused_input", None, "allow_unused_input must be True or False, got None"),
    ],
)
def test_an_unknown_option_value_is_refused_naming_the_option(
    option: str, value: Any, message: str
) -> None:
    with pytest.raises(DualgraphError) as info:
        dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),), **{option: value})
    assert str(info.value) == message


def test_auto_backend_is_emulate_for_cpu_samples() -> None:
    graphed = dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),))
    assert dgt.diagnostics(graphed).backend == "emulate"


@pytest.mark.cuda
def test_auto_backend_is_cuda_for_cuda_samples() -> None:
    module = TinyMLP().cuda()
    graphed = dgt.make_graphed_callables(module, (torch.randn(4, 8, device="cuda"),))
    assert dgt.diagnostics(graphed).backend == "cuda"


def test_cuda_backend_needs_cuda_samples() -> None:
    with pytest.raises(DualgraphError, match="backend='cuda' needs"):
        dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),), backend="cuda")


def test_sample_args_need_one_entry_per_callable() -> None:
    modules = (TinyMLP(), TinyMLP())
    with pytest.raises(DualgraphError, match=r"one tuple of args per callable \(2\)"):
        dgt.make_graphed_callables(modules, ((torch.randn(4, 8),),))
    with pytest.raises(DualgraphError, match=r"one dict \(or None\) per callable \(2\)"):
        samples = ((torch.randn(4, 8),), (torch.randn(4, 8),))
        dgt.make_graphed_callables(modules, samples, sample_kwargs=({},))


def test_sample_args_must_be_a_sequence_of_args() -> None:
    with pytest.raises(DualgraphError, match="TinyMLP: sample args must be a tuple"):
        dgt.make_graphed_callables(TinyMLP(), torch.randn(4, 8))
    with pytest.raises(DualgraphError, match="TinyMLP: sample kwargs must be a dict"):
        dgt.make_graphed_callables(TinyMLP(), (torch.randn(4, 8),), sample_kwargs=[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_args_may_be_lists(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    assert dgt.make_graphed_callables(module, [torch.randn(4, 8, device=device)], backend=backend)
    pair = dgt.make_graphed_callables(
        [torch.tanh, torch.sin],
        [[torch.randn(3, device=device)], [torch.randn(3, device=device)]],
        backend=backend,
    )
    assert isinstance(pair, tuple) and len(pair) == 2
    x = torch.randn(3, device=device)
    assert_tensors_match(pair[1](x), torch.sin(x), "sin", tolerance(backend))


def test_the_same_callable_twice_is_refused() -> None:
    module = TinyMLP()
    with pytest.raises(DualgraphError, match="the same callable appears twice"):
        dgt.make_graphed_callables((module, module), ((torch.randn(4, 8),),) * 2)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
def test_an_empty_tuple_of_callables_is_refused(backend: str) -> None:
    with pytest.raises(DualgraphError, match="at least one callable"):
        dgt.make_graphed_callables((), (), backend=backend)


def test_sample_args_for_another_number_of_callables_are_refused_with_both_counts() -> None:
    layers = (TinyMLP(), TinyMLP())
    with pytest.raises(DualgraphError, match=r"one tuple of args per callable \(2\), got 1"):
        dgt.make_graphed_callables(layers, ((torch.randn(4, 8),),))
    with pytest.raises(DualgraphError, match=r"one dict \(or None\) per callable \(2\), got 3"):
        dgt.make_graphed_callables(layers, ((torch.randn(4, 8),),) * 2, sample_kwargs=({},) * 3)
    assert not any("_dualgraph_graphed" in vars(layer) for layer in layers)


def test_sample_tensors_must_be_torch_tensors() -> None:
    with pytest.raises(DualgraphError, match=r"args\[0\]: .* must be torch tensors"):
        dgt.make_graphed_callables(lambda x: x, (np.zeros(3, np.float32),), backend="emulate")


def test_test_only_internals_are_not_exported() -> None:
    assert set(dgt.__all__) == {
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
    }
    assert not hasattr(dgt, "InputGuard")


# -- what comes back -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_comes_back_graphed_in_place(backend: str) -> None:
    module = TinyMLP().to(device_of(backend))
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device=device_of(backend)),), backend=backend
    )
    assert graphed is module and type(module) is TinyMLP
    assert dgt.diagnostics(module).backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_function_comes_back_as_a_graphed_callable(backend: str) -> None:
    graphed = dgt.make_graphed_callables(
        torch.sin, (torch.randn(3, device=device_of(backend)),), backend=backend
    )
    kind = dgt.EagerCallable if backend == "eager" else dgt.GraphedCallable
    assert isinstance(graphed, kind)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tuple_of_callables_comes_back_as_a_tuple(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    graphed = dgt.make_graphed_callables(
        (module, torch.tanh),
        ((torch.randn(4, 8, device=device),), (torch.randn(4, 8, device=device),)),
        backend=backend,
    )
    assert isinstance(graphed, tuple) and len(graphed) == 2
    assert graphed[0] is module
    x = torch.randn(4, 8, device=device)
    assert_tensors_match(graphed[1](x), torch.tanh(x), "tanh", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_repr_names_the_callable_the_backend_and_the_specs(backend: str) -> None:
    sample = torch.randn(2, 4, device=device_of(backend), requires_grad=True)

    def double(x: torch.Tensor, *, scale: float) -> tuple[torch.Tensor, None]:
        return x * scale, None

    graphed = dgt.make_graphed_callables(
        double, (sample,), sample_kwargs={"scale": 2.0}, backend=backend
    )
    assert repr(graphed) == (
        "GraphedCallable('test_repr_names_the_callable_the_backend_and_the_specs.<locals>.double', "
        f"backend='{backend}', inputs=(args=(float32[2, 4](grad),), kwargs={{'scale': 2.0}}), "
        "outputs=TreeSpec((float32[2, 4](grad), None)))"
    )


def sine(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


def test_eager_callable_repr_shows_the_output_spec_once_known() -> None:
    graphed = dgt.make_graphed_callables(sine, (torch.ones(2),), backend="eager")
    assert repr(graphed) == (
        "EagerCallable('sine', inputs=(args=(float32[2],), kwargs={}), "
        "outputs=recorded at the first call)"
    )
    graphed(torch.ones(2))
    assert repr(graphed).endswith("outputs=TreeSpec(float32[2]))")


class Drifts(nn.Module):
    """Returns ``(x.sin(), extra)``, where ``extra`` is whatever the caller last set."""

    def __init__(self) -> None:
        super().__init__()
        self.extra: Any = torch.zeros(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return x.sin(), self.extra


@pytest.mark.parametrize(
    ("later", "found"),
    [
        (3.0, "got float 3.0"),
        (torch.zeros(3), "float32[3]"),
        (torch.zeros(2, dtype=torch.int64), "int64"),
    ],
)
def test_the_eager_backend_refuses_outputs_a_graph_could_not_give(later: Any, found: str) -> None:
    """The ``"eager"`` backend stands in for a graph: an output whose leaf changes kind, shape
    or dtype after the first call (which a replay could never give) is refused naming it."""
    module = Drifts()
    graphed = dgt.make_graphed_callables(module, (torch.ones(2),), backend="eager")
    graphed(torch.ones(2))
    module.extra = later
    with pytest.raises(SpecMismatchError, match=r"output\[1\]") as info:
        graphed(torch.ones(2))
    assert found in str(info.value)


class AuxLossWhenTraining(nn.Module):
    """``(h, aux)`` where it trains (grad mode on, or the input requiring grad), else
    ``(h, None)``."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.fc(x)
        trains = torch.is_grad_enabled() if self.branch == "grad_mode" else x.requires_grad
        return h, (h.square().mean() if trains else None)


@pytest.mark.parametrize("first", ["as_captured", "otherwise"])
@pytest.mark.parametrize("branch", ["grad_mode", "requires_grad"])
def test_the_eager_backend_returns_eagers_outputs_where_a_graph_would_run_eagerly(
    branch: str, first: str
) -> None:
    # A graphed callable runs such a call eagerly and hands back eager's (h, None); the
    # "eager" backend refused it ("output[1]: expected float32[], got None"), or, first called
    # so, refused the training call's (h, aux).
    module = AuxLossWhenTraining(branch)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), backend="eager"
    )

    def call_otherwise() -> None:
        with torch.no_grad() if branch == "grad_mode" else contextlib.nullcontext():
            assert graphed(torch.randn(2, 4))[1] is None

    if first == "otherwise":
        call_otherwise()
    assert graphed(torch.randn(2, 4, requires_grad=True))[1] is not None
    call_otherwise()
    assert graphed(torch.randn(2, 4, requires_grad=True))[1] is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphing_a_graphed_module_again_is_rejected(backend: str) -> None:
    module = TinyMLP().to(device_of(backend))
    sample = (torch.randn(4, 8, device=device_of(backend)),)
    dgt.make_graphed_callables(module, sample, backend=backend)
    with pytest.raises(DualgraphError, match=r"already graphed; call dualgraph\.torch\.restore"):
        dgt.make_graphed_callables(module, sample, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_gives_the_module_its_forward_back(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    assert dgt.restore(module) is module
    assert "forward" not in module.__dict__
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(module)
    with torch.no_grad():
        assert module(torch.randn(7, 8, device=device)).shape == (7, 8)  # eager: any batch size
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    assert dgt.diagnostics(module).backend == backend


def test_restore_puts_back_a_forward_the_module_had_before() -> None:
    module = TinyMLP()
    module.forward = lambda x: x + 1  # an instance-level forward of the user's
    dgt.make_graphed_callables(module, (torch.zeros(4, 8),), backend="emulate")
    dgt.restore(module)
    assert torch.equal(module(torch.zeros(2, 8)), torch.ones(2, 8))


def test_restore_puts_back_a_getstate_the_module_had_before_and_copies_use_it() -> None:
    # graphing set its own instance-level __getstate__ (copies drop the graphs) over the user's,
    # and restore deleted it: the module copied and pickled otherwise than before graphing
    module = TinyMLP()

    def getstate() -> dict[str, Any]:
        return {**nn.Module.__getstate__(module), "tag": "mine"}

    module.__getstate__ = getstate  # type: ignore[method-assign]
    dgt.make_graphed_callables(module, (torch.zeros(4, 8),), backend="emulate")
    copied = copy.copy(module)
    assert copied.tag == "mine" and copied.__dict__["__getstate__"] is getstate
    assert "forward" not in copied.__dict__  # the copy runs eagerly, as before
    dgt.restore(module)
    assert module.__dict__["__getstate__"] is getstate


def test_restore_leaves_a_forward_installed_after_graphing() -> None:
    module = TinyMLP()
    dgt.make_graphed_callables(module, (torch.zeros(4, 8),), backend="emulate")

    def my_forward(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    module.forward = my_forward  # the user's, installed over the graphed forward
    dgt.restore(module)
    assert module.forward is my_forward
    assert torch.equal(module(torch.zeros(2, 8)), -torch.ones(2, 8))
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(module)  # no longer graphed


def test_restore_leaves_a_wrapper_of_the_graphed_forward_running_the_original() -> None:
    module, twin = TinyMLP(), TinyMLP()
    twin.load_state_dict(module.state_dict())
    dgt.make_graphed_callables(module, (torch.zeros(4, 8),), backend="emulate")
    graphed = module.forward
    module.forward = lambda x: graphed(x) * 2  # wraps the graphed forward it replaced
    wrapper = module.forward
    dgt.restore(module)
    x = torch.randn(7, 8)  # another batch size: eager again
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(module(x), twin(x) * 2)
    assert module.forward is wrapper
    dgt.make_graphed_callables(module, (torch.zeros(4, 8),), backend="emulate")  # again
    dgt.restore(module)
    assert module.forward is wrapper


def test_restore_rejects_a_module_that_is_not_graphed() -> None:
    with pytest.raises(DualgraphError, match="TinyMLP is not a graphed module"):
        dgt.restore(TinyMLP())


def test_diagnostics_reject_a_plain_callable() -> None:
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(TinyMLP())


def _graphed_tiny_mlp() -> TinyMLP:
    module = TinyMLP()
    dgt.make_graphed_callables(module, (torch.randn(4, 8, requires_grad=True),), backend="emulate")
    return module


@pytest.mark.parametrize("tool", ["diagnostics", "verify", "restore"])
def test_a_graphed_modules_forward_is_answered_for_as_the_module(tool: str) -> None:
    """``module.forward`` of a graphed module is its graphed entry point, not an unknown
    callable (which was refused quoting a partial's repr, the module's whole tree in it)."""
    module = _graphed_tiny_mlp()
    x = torch.randn(4, 8, requires_grad=True)
    if tool == "diagnostics":
        assert dgt.diagnostics(module.forward) is dgt.diagnostics(module)
    elif tool == "verify":
        assert dgt.verify(module.forward, x).ok
    else:
        assert dgt.restore(module.forward) is module
        assert "forward" not in vars(module)


@pytest.mark.parametrize("tool", ["lint", "memory_plan"])
def test_probing_a_graphed_modules_forward_runs_the_module_eagerly_not_its_replays(
    tool: str,
) -> None:
    """As probing the module does: any batch size, and no replay run (or counted)."""
    module = _graphed_tiny_mlp()
    probe = getattr(dgt, tool)
    x = torch.randn(5, 8, requires_grad=True)  # a batch size the replays refuse
    assert str(probe(module.forward, x)) == str(probe(module, x))
    assert dgt.diagnostics(module).replays == 0


def test_graphing_a_graphed_modules_forward_is_refused_naming_the_module() -> None:
    module = _graphed_tiny_mlp()
    with pytest.raises(
        DualgraphError, match=r"^TinyMLP\.forward is the forward of a graphed module; graph the "
    ):
        dgt.make_graphed_callables(module.forward, (torch.randn(4, 8),), backend="emulate")
    assert dgt.diagnostics(module).replays == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_runs_eagerly_when_its_training_mode_differs_from_capture(backend: str) -> None:
    device = device_of(backend)
    module = ViTBlock(dim=16, heads=2, dropout=0.5).to(device)
    twin = ViTBlock(dim=16, heads=2, dropout=0.5).to(device)
    twin.load_state_dict(module.state_dict())
    dgt.make_graphed_callables(module, (torch.randn(2, 5, 16, device=device),), backend=backend)
    replays = dgt.diagnostics(module).replays

    module.eval()
    twin.eval()
    x = torch.randn(2, 5, 16, device=device)
    hidden, extra = module(x)
    expected, _ = twin(x)
    assert extra is None
    assert_tensors_match(hidden.detach(), expected.detach(), "hidden", tolerance(backend))
    assert dgt.diagnostics(module).replays == replays  # the original forward ran, not a replay
    if backend != "eager":
        static = {t.data_ptr() for t in runner_of(module).static_outputs}
        assert hidden.data_ptr() not in static

    module.train()
    with torch.no_grad():
        module(x)
    assert dgt.diagnostics(module).replays == replays + 1


# -- every call is checked first -----------------------------------------------------------------


def _bad_calls(device: torch.device) -> dict[str, tuple[Any, str]]:
    """Per name: a change to valid ``(args, kwargs)`` of ``gated``, and the message it must give."""
    on = f"on {device}"

    def nested(**changes: Any) -> Any:
        return lambda args, kwargs: ((args[0], {**args[1], **changes}), kwargs)

    def kwarg(**changes: Any) -> Any:
        return lambda args, kwargs: (args, {**kwargs, **changes})

    return {
        "shape": (
            lambda args, kwargs: ((torch.randn(3, 8, device=device), args[1]), kwargs),
            f"args[0]: expected float32[2, 8] {on}, got float32[3, 8] {on}",
        ),
        "dtype": (
            lambda args, kwargs: ((args[0].double(), args[1]), kwargs),
            f"args[0]: expected float32[2, 8] {on}, got float64[2, 8] {on}",
        ),
        "nested_shape": (
            nested(mask=torch.rand(2, 9, device=device)),
            f"args[1]['mask']: expected float32[2, 8] {on}, got float32[2, 9] {on}",
        ),
        "none_for_a_tensor": (
            nested(mask=None),
            "args[1]['mask']: expected float32[2, 8], got None",
        ),
        "missing_key": (
            lambda args, kwargs: ((args[0], {"bias": args[1]["bias"]}), kwargs),
            "args[1]['mask']: missing (expected float32[2, 8])",
        ),
        "list_for_a_dict": (
            lambda args, kwargs: ((args[0], list(args[1].values())), kwargs),
            "args[1]: expected a dict with keys ['mask', 'bias'], got a list of length 2",
        ),
        "too_few_args": (
            lambda args, kwargs: ((args[0],), kwargs),
            "args[1]: missing (expected a dict with keys ['mask', 'bias']): the call has 1 "
            "positional argument, expected 2",
        ),
        "missing_kwarg": (
            lambda args, kwargs: (args, {"scale": kwargs["scale"]}),
            "kwargs['mask']: missing (expected float32[2, 8])",
        ),
        "unexpected_kwarg": (kwarg(extra=1), "kwargs['extra']: unexpected entry int 1"),
        "changed_constant_kwarg": (
            kwarg(scale=3.0),
            "kwargs['scale']: expected float 2.0, got float 3.0",
        ),
        "kwarg_shape": (
            kwarg(mask=torch.rand(2, 7, device=device)),
            f"kwargs['mask']: expected float32[2, 8] {on}, got float32[2, 7] {on}",
        ),
        "requires_grad_not_captured": (
            nested(mask=torch.rand(2, 8, device=device, requires_grad=True)),
            "args[1]['mask']: requires grad, but was captured without requires_grad, so no "
            "gradient would reach it; pass a sample that requires grad when capturing",
        ),
        "sparse_tensor": (
            nested(mask=torch.rand(2, 8, device=device).to_sparse()),
            f"args[1]['mask']: expected float32[2, 8] {on}, got a torch.sparse_coo tensor "
            "(static buffers are dense, strided tensors)",
        ),
    }


BAD_CALLS = sorted(_bad_calls(torch.device("cpu")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD_CALLS)
def test_rejected_call_names_the_path(backend: str, bad: str) -> None:
    case = CASES["gated_function"]
    device = device_of(backend)
    args, kwargs = case.draw(device)
    graphed = dgt.make_graphed_callables(case.build(), args, sample_kwargs=kwargs, backend=backend)
    change, message = _bad_calls(device)[bad]
    bad_args, bad_kwargs = change(*case.draw(device))
    with pytest.raises(SpecMismatchError) as info:
        graphed(*bad_args, **bad_kwargs)
    assert str(info.value) == message
    assert info.value.path == message.partition(":")[0]


@pytest.mark.cuda
def test_rejected_call_names_the_wrong_device() -> None:
    case = CASES["gated_function"]
    args, kwargs = case.draw(torch.device("cuda"))
    graphed = dgt.make_graphed_callables(case.build(), args, sample_kwargs=kwargs, backend=CUDA)
    with pytest.raises(SpecMismatchError) as info:
        graphed(args[0].detach().cpu(), args[1], **kwargs)
    device = args[0].device
    assert (
        str(info.value) == f"args[0]: expected float32[2, 8] on {device}, got float32[2, 8] on cpu"
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("bad", BAD_CALLS)
def test_rejected_call_leaves_static_inputs_unchanged(backend: str, bad: str) -> None:
    case = CASES["gated_function"]
    device = device_of(backend)
    args, kwargs = case.draw(device)
    graphed = dgt.make_graphed_callables(case.build(), args, sample_kwargs=kwargs, backend=backend)
    before = [t.detach().clone() for t in graphed.static_inputs]
    change, message = _bad_calls(device)[bad]
    bad_args, bad_kwargs = change(*case.draw(device))  # the valid leaves hold new values
    with pytest.raises(SpecMismatchError) as info:
        graphed(*bad_args, **bad_kwargs)
    assert str(info.value) == message
    for i, (static, saved) in enumerate(zip(graphed.static_inputs, before, strict=True)):
        assert_tensors_match(static.detach(), saved, f"static input {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_call_after_a_rejected_call_is_correct(backend: str) -> None:
    case = CASES["gated_function"]
    device = device_of(backend)
    args, kwargs = case.draw(device)
    fn = case.build()
    graphed = dgt.make_graphed_callables(fn, args, sample_kwargs=kwargs, backend=backend)
    for bad in BAD_CALLS:
        change, _ = _bad_calls(device)[bad]
        bad_args, bad_kwargs = change(*case.draw(device))
        with pytest.raises(SpecMismatchError):
            graphed(*bad_args, **bad_kwargs)
        args, kwargs = case.draw(device)
        eager_args, eager_kwargs = fresh_copy((args, kwargs))
        outputs = graphed(*args, **kwargs)
        expected = fn(*eager_args, **eager_kwargs)
        assert_trees_match(outputs, expected, tolerance(backend))
        backward_of(outputs)
        backward_of(expected)
        assert_grads_match(
            grads_of([args[0], args[1]["bias"], kwargs["mask"]]),
            grads_of([eager_args[0], eager_args[1]["bias"], eager_kwargs["mask"]]),
            ["args[0]", "args[1]['bias']", "kwargs['mask']"],
            tolerance(backend),
        )


# -- tensors that are not plain dense tensors ----------------------------------------------------


class Tagged(torch.Tensor):
    """A tensor subclass (its Python overrides would not run in a replay)."""


def _odd_tensors(device: torch.device) -> dict[str, Any]:
    """Per kind: a function making a ``float32[2, 8]``-like tensor of that kind from a dense one."""
    kinds: dict[str, Any] = {
        "sparse_coo": (lambda t: t.to_sparse(), "a torch.sparse_coo tensor"),
        "sparse_csr": (lambda t: t.to_sparse_csr(), "a torch.sparse_csr tensor"),
        "subclass": (lambda t: t.as_subclass(Tagged), f"a tensor subclass {__name__}.Tagged"),
        "nested": (
            lambda t: torch.nested.as_nested_tensor([t[0], t[1, :5]], layout=torch.jagged),
            "a tensor subclass torch.nested._internal.nested_tensor.NestedTensor",
        ),
        "meta": (lambda t: t.to("meta"), "a meta tensor (it holds no data to replay on)"),
    }
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        kinds["mkldnn"] = (lambda t: t.to_mkldnn(), "a torch._mkldnn tensor")
    return kinds


ODD_KINDS = sorted(_odd_tensors(torch.device("cpu")))


# torch's notice on first making a CSR tensor
sparse_csr_beta = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


@sparse_csr_beta
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("kind", ODD_KINDS)
def test_a_sample_that_cannot_be_a_static_buffer_is_refused_naming_its_path(
    backend: str, kind: str
) -> None:
    device = device_of(backend)
    kinds = _odd_tensors(device)
    if kind not in kinds:
        pytest.skip(f"no {kind} tensors on {device}")
    make, why = kinds[kind]
    odd = make(torch.rand(2, 8, device=device))
    with pytest.raises(SpecMismatchError) as info:
        dgt.make_graphed_callables(
            lambda x, y: x * 2, (torch.ones(2, device=device), odd), backend=backend
        )
    assert str(info.value).startswith(f"args[1]: cannot be graphed: {why}")
    assert info.value.path == "args[1]"


@sparse_csr_beta
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ODD_KINDS)
def test_a_call_with_a_tensor_that_cannot_be_copied_in_is_refused_naming_its_path(
    backend: str, kind: str
) -> None:
    device = device_of(backend)
    kinds = _odd_tensors(device)
    if kind not in kinds:
        pytest.skip(f"no {kind} tensors on {device}")
    make, why = kinds[kind]
    graphed = dgt.make_graphed_callables(
        lambda x, mask: x * mask, (torch.ones(2, 8, device=device),) * 2, backend=backend
    )
    with pytest.raises(SpecMismatchError) as info:
        graphed(torch.ones(2, 8, device=device), make(torch.rand(2, 8, device=device)))
    expected = f"args[1]: expected float32[2, 8] on {device}, got "
    assert str(info.value).startswith(expected)
    assert why in str(info.value) or kind == "meta"  # a meta tensor is on another device
    assert info.value.path == "args[1]"


def _layouts(device: torch.device) -> dict[str, torch.Tensor]:
    """The same ``float32[4, 6]`` values in tensors with other strides and memory formats."""
    base = torch.randn(6, 4, device=device)
    wide = torch.randn(4, 12, device=device)
    return {
        "transposed": base.t(),
        "every_other_column": wide[:, ::2],
        "expanded_row": torch.randn(1, 6, device=device).expand(4, 6),
        "channels_last": torch.randn(4, 6, 1, 1, device=device)
        .to(memory_format=torch.channels_last)
        .view(4, 6),
    }


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("layout", sorted(_layouts(torch.device("cpu"))))
def test_inputs_with_other_strides_are_copied_in_by_value(backend: str, layout: str) -> None:
    device = device_of(backend)
    weight = torch.randn(6, device=device)

    def scaled_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * weight + 1, (x * weight).sum(dim=1)

    graphed = dgt.make_graphed_callables(
        scaled_sum, (torch.randn(4, 6, device=device),), backend=backend
    )
    x = _layouts(device)[layout]
    assert_trees_match(graphed(x), scaled_sum(x.contiguous()), tolerance(backend))


class _PatchTokens(nn.Module):
    """ViT's patch tokens, ``h[:, 1:]``: an output starting past the start of its memory."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 33)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[:, 1:]


@pytest.mark.parametrize("clone_outputs", [False, True])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_off_the_allocators_alignment_lies_as_far_off_it_as_eagers(
    backend: str, clone_outputs: bool
) -> None:
    # The caller's ops over an output (a head, a loss) vectorize by where it starts: an output
    # handed out aligned where eager's is not rounds them otherwise.
    device = device_of(backend)
    torch.manual_seed(0)
    eager = _PatchTokens().to(device)
    head = nn.Linear(32, 5).to(device)
    graphed = dgt.make_graphed_callables(
        copy.deepcopy(eager),
        (torch.randn(4, 8, device=device, requires_grad=True),),
        backend=backend,
        clone_outputs=clone_outputs,
    )
    unit = 512 if device.type == "cuda" else 64
    for _ in range(3):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, want = graphed(x), eager(x_eager)
        assert out.data_ptr() % unit == want.data_ptr() % unit
        assert out.stride() == want.stride()
        mine, theirs = head(out), head(want)
        assert_tensors_match(mine, theirs, "head's output", tolerance(backend))
        mine.square().sum().backward()
        theirs.square().sum().backward()
        assert_tensors_match(x.grad, x_eager.grad, "x.grad", tolerance(backend))


class _BroadcastMean(nn.Module):
    """Returns its hidden state and the mean over the batch expanded back to it (stride 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h.mean(0, keepdim=True).expand(4, 8)


@pytest.mark.parametrize("clone_outputs", [False, True])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_expanded_output_keeps_eagers_strides_and_refuses_writes_as_eagers(
    backend: str, clone_outputs: bool
) -> None:
    device = device_of(backend)
    torch.manual_seed(0)
    eager = _BroadcastMean().to(device)
    graphed = dgt.make_graphed_callables(
        copy.deepcopy(eager),
        (torch.randn(4, 8, device=device, requires_grad=True),),
        backend=backend,
        clone_outputs=clone_outputs,
    )
    for _ in range(2):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        ours, theirs = graphed(x), eager(x_eager)
        assert [t.stride() for t in ours] == [t.stride() for t in theirs] == [(8, 1), (0, 1)]
        assert_trees_match(ours, theirs, tolerance(backend))
        for mean in (ours[1], theirs[1]):  # one memory location per column
            with pytest.raises(RuntimeError, match="more than one element"), torch.no_grad():
                mean.add_(1.0)
        sum(t.square().sum() for t in ours).backward()
        sum(t.square().sum() for t in theirs).backward()
        assert_tensors_match(x.grad, x_eager.grad, "x.grad", tolerance(backend))


class _ScaledBroadcast(nn.Module):
    """An expanded output that the backward reads (saved by the product with ``w``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.fc(x).mean(0, keepdim=True).expand(4, 8)
        return mean, mean * self.w


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_an_expanded_output_the_backward_reads_replays_as_eager(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    torch.manual_seed(0)
    eager = _ScaledBroadcast().to(device)
    graphed = dgt.make_graphed_callables(
        copy.deepcopy(eager),
        (torch.randn(4, 8, device=device, requires_grad=True),),
        backend=backend,
        param_grads=param_grads,
    )
    for _ in range(2):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        ours, theirs = graphed(x), eager(x_eager)
        assert_trees_match(ours, theirs, tolerance(backend))
        sum(t.square().sum() for t in ours).backward()
        sum(t.square().sum() for t in theirs).backward()
        assert_tensors_match(x.grad, x_eager.grad, "x.grad", tolerance(backend))
    for mine, theirs_param in zip(graphed.parameters(), eager.parameters(), strict=True):
        assert_tensors_match(mine.grad, theirs_param.grad, "a parameter's grad", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_conjugate_and_negative_views_are_copied_in_by_value(backend: str) -> None:
    device = device_of(backend)
    z = torch.randn(5, dtype=torch.complex64, device=device)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * 1j

    graphed = dgt.make_graphed_callables(rotate, (z,), backend=backend)
    for view in (z.conj(), torch._neg_view(z)):
        assert view.is_conj() or view.is_neg()
        expected = rotate(view.resolve_conj().resolve_neg())
        assert_tensors_match(graphed(view), expected, "rotated", tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_passed_as_an_input_is_a_plain_input(backend: str) -> None:
    device = device_of(backend)
    sample = torch.ones(3, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(lambda x: x * 2, (sample,), backend=backend)
    param = nn.Parameter(torch.ones(3, device=device))
    graphed(param).sum().backward()
    assert_tensors_match(param.grad, torch.full((3,), 2.0, device=device), "param.grad")


@pytest.mark.parametrize("pool", ["x", (0,), (0, "1"), [0, 1], (0, 1, 2), 3, (True, 1)])
def test_a_pool_that_is_no_pool_handle_is_refused_before_capture(pool: Any) -> None:
    layer = nn.Linear(4, 4)
    weight = layer.weight.detach().clone()
    with pytest.raises(DualgraphError, match=r"^pool must be None or a handle from torch\.cuda"):
        dgt.make_graphed_callables(layer, (torch.randn(2, 4),), backend="emulate", pool=pool)
    assert torch.equal(layer.weight, weight) and "forward" not in vars(layer)


@pytest.mark.parametrize("check", [dgt.lint, dgt.memory_plan])
def test_the_checking_tools_refuse_what_is_not_callable(check: Any) -> None:
    with pytest.raises(DualgraphError, match=r"^int 3 is not callable"):
        check(3, torch.randn(2, 4))


def test_importing_the_adapter_without_torch_says_what_to_install() -> None:
    # dualgraph.jax and dualgraph.parity said what to install; dualgraph.torch leaked a bare
    # ModuleNotFoundError
    code = (
        "import importlib.abc, sys\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "try:\n"
        "    import dualgraph.torch\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    path = os.pathsep.join([os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == (
        "ImportError dualgraph.torch needs PyTorch, which did not import (No module named "
        "'torch'): pip install dualgraph[torch]"
    )
