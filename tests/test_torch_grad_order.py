"""The order in which a replay's backward reaches the parameters: eager's, where hooks watch it.

Eager's backward runs each parameter's hooks as it reaches that parameter (the last layer's
first); a replay hands every parameter grad out at once. These tests compare the graphed
callable (``backend="emulate"``) with its eager deep copy: the hooks' order, what a hook reads
of other parameters' ``.grad``, and the grads themselves, bit for bit, over several replays.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch_cases import isolation

import dualgraph.torch as dgt
from dualgraph.torch._grad_order import reaching_order

#: the modes whose parameter grads reach the parameters' hooks ("in_graph" refuses hooks)
HOOKED_MODES = ["auto", "autograd"]


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def _layers() -> nn.Module:
    # a LayerNorm hands its weight's and bias's grads out together, as a replay does all
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3))


def _inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(2, 4, generator=generator) for _ in range(count)]


def _eager_and_graphed(mode: str) -> tuple[nn.Module, nn.Module]:
    eager = _layers()
    graphed = copy.deepcopy(eager)
    sample = torch.randn(2, 4, requires_grad=True)
    dgt.make_graphed_callables(graphed, (sample,), backend="emulate", param_grads=mode)
    return eager, graphed


def _bits(tensor: torch.Tensor | None) -> Any:
    return None if tensor is None else tensor.detach().view(torch.int32).tolist()


def _run(module: nn.Module, hook: Callable[[nn.Module, list[Any]], None]) -> list[Any]:
    log: list[Any] = []
    hook(module, log)
    for x in _inputs(3):
        module(x).square().sum().backward()
    return [*log, *(_bits(p.grad) for p in module.parameters())]


def _reading_the_others(module: nn.Module, log: list[Any]) -> None:
    # what each parameter's hook sees of every .grad when it runs
    params = list(module.parameters())
    for i, param in enumerate(params):

        def seen(_: torch.Tensor, i: int = i) -> None:
            log.append((i, [_bits(p.grad) for p in params]))

        param.register_post_accumulate_grad_hook(seen)


def _norm_summed_in_hooks(module: nn.Module, log: list[Any]) -> None:
    # a clipping norm summed as the grads arrive: float addition is not associative
    total = [torch.zeros(())]

    def add(param: torch.Tensor) -> None:
        assert param.grad is not None
        total[0] = total[0] + param.grad.square().sum()
        log.append(_bits(total[0].reshape(1)))

    for param in module.parameters():
        param.register_post_accumulate_grad_hook(add)


def _tensor_hooks_in_order(module: nn.Module, log: list[Any]) -> None:
    for i, param in enumerate(module.parameters()):
        param.register_hook(lambda grad, i=i: log.append(i))


def _hooks_on_kept_nodes(module: nn.Module, log: list[Any]) -> None:
    # Megatron-LM's DDP: a hook on each parameter's AccumulateGrad node, the node kept
    params = list(module.parameters())
    kept = log  # the nodes live as long as the log: popped off below, before comparing
    for i, param in enumerate(params):
        node = param.expand_as(param).grad_fn.next_functions[0][0]

        def seen(*_: Any, i: int = i) -> None:
            log.append((i, [_bits(p.grad) for p in params]))

        node.register_hook(seen)
        kept.append(node)


@pytest.mark.parametrize("mode", HOOKED_MODES)
@pytest.mark.parametrize(
    "hook",
    [_reading_the_others, _norm_summed_in_hooks, _tensor_hooks_in_order, _hooks_on_kept_nodes],
    ids=[
        "post_accumulate_reading_other_grads",
        "norm_summed_in_hooks",
        "tensor_hooks",
        "hooks_on_kept_nodes",
    ],
)
def test_parameter_hooks_run_in_eagers_order_and_see_eagers_grads(
    mode: str, hook: Callable[[nn.Module, list[Any]], None]
) -> None:
    eager, graphed = _eager_and_graphed(mode)
    ours, theirs = _run(graphed, hook), _run(eager, hook)
    nodes = (torch.autograd.graph.Node,)
    assert [e for e in ours if not isinstance(e, nodes)] == [
        e for e in theirs if not isinstance(e, nodes)
    ]


@pytest.mark.parametrize("mode", HOOKED_MODES)
def test_with_hooks_autograd_grad_and_backward_inputs_keep_eagers_grads(mode: str) -> None:
    # the edges through views in eager's order: torch.autograd.grad returns the grads and
    # leaves .grad alone, backward(inputs=...) adds only into those asked for
    def program(module: nn.Module) -> list[Any]:
        log: list[Any] = []
        _tensor_hooks_in_order(module, log)
        first, second, third = _inputs(3)
        x = first.requires_grad_()
        grads = torch.autograd.grad(module(x).square().sum(), [x, module[0].weight])
        module(second).square().sum().backward(inputs=[module[3].weight, module[1].bias])
        module(third).square().sum().backward()
        return [*log, *map(_bits, grads), *(_bits(p.grad) for p in module.parameters())]

    eager, graphed = _eager_and_graphed(mode)
    assert program(graphed) == program(eager)


def test_under_auto_a_hook_put_on_after_calls_runs_in_eagers_order_from_the_next_call() -> None:
    # "auto" looks for hooks at its first forward and then at each backward (README): the
    # call after the one whose backward first saw the hook runs it in eager's order
    def program(module: nn.Module) -> list[Any]:
        first, second, *rest = _inputs(5)
        module(first).square().sum().backward()  # no hook yet
        log: list[Any] = []
        _reading_the_others(module, log)
        module(second).square().sum().backward()  # the engine's order, eager's grads
        grads = [_bits(p.grad) for p in module.parameters()]
        del log[:]
        for x in rest:
            module(x).square().sum().backward()
        return [grads, *log, *(_bits(p.grad) for p in module.parameters())]

    eager, graphed = _eager_and_graphed("auto")
    assert program(graphed) == program(eager)


@pytest.mark.parametrize("mode", HOOKED_MODES)
@pytest.mark.parametrize(
    "options", [{"slots": 2}, {"schedule": [1, 1, -1, -1]}], ids=["slots", "schedule"]
)
def test_every_slots_replay_runs_parameter_hooks_in_eagers_order(
    mode: str, options: dict[str, Any]
) -> None:
    # Only the first slot's warmup is inspected; the others took over what it found but the
    # order, so the second slot's backward ran the hooks in the engine's heap order
    eager = _layers()
    graphed = copy.deepcopy(eager)
    sample = torch.randn(2, 4, requires_grad=True)
    dgt.make_graphed_callables(graphed, (sample,), backend="emulate", param_grads=mode, **options)

    def program(module: nn.Module) -> list[Any]:
        log: list[Any] = []
        _reading_the_others(module, log)
        inputs = _inputs(4)
        for step in (inputs[:2], inputs[2:]):  # two in flight: each slot replays
            losses = [module(x).square().sum() for x in step]
            for loss in losses:
                loss.backward()
        return [*log, *(_bits(p.grad) for p in module.parameters())]

    assert program(graphed) == program(eager)


def test_reaching_order_notes_eagers_order_and_leaves_no_hook_dict() -> None:
    module = _layers()
    params = list(module.parameters())
    with reaching_order(params) as order:
        module(torch.randn(2, 4)).sum().backward()
    assert order == [5, 4, 2, 3, 1, 0]  # the last Linear's bias first, its weight through a t()
    assert all(p._backward_hooks is None for p in params)
