"""Graphed = eager where a demanding user looks, or a clear error: never a silent difference.

The rules that come with graphs (README), one behaviour per test, each on ``emulate`` and on
``cuda``:

- grads handed out never alias a buffer a later replay overwrites (``torch.autograd.grad``,
  tensor hooks, ``retain_grad``, kwargs, inputs used twice, views, parameters);
- inputs the callable updates in place are updated for the caller, as in eager;
- parameters frozen, unfrozen, replaced or moved after capture are refused by name;
- copies (``copy.deepcopy``, pickling) of graphed modules and functions run eagerly;
- one graphed callable refuses concurrent calls from two threads;
- ``param_grads="in_graph"`` and ``"auto"`` keep eager's ``.grad`` contract
  (``zero_grad(set_to_none=True)`` gives a new tensor); ``"in_graph"`` refuses what it cannot do
  (``torch.autograd.grad``, hooks), ``"auto"`` sends the grads through autograd for those;
- outputs the backward reads may not be changed in place (eager would raise too).
"""

from __future__ import annotations

import copy
import enum
import functools
import io
import math
import pickle
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import entry_points
import numpy as np
import pytest
import torch
from entry_points import ENTRY_POINTS, WITH_PARAMETERS, Decays, batch, call_length, graphed_on
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torch_cases import (
    CUDA,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    TinyMLP,
    assert_grads_match,
    assert_tensors_match,
    assert_trees_match,
    backward_of,
    device_of,
    grads_of,
    isolation,
    loss_of,
    parameter_names,
    parameters_of,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.models.torch_vit import VisionEncoder
from dualgraph.torch._replay_function import SecondBackwardError


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


# -- grads handed out are the caller's own -------------------------------------------------------


def scaled_tanh(x: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
    return (x * w).tanh()


def _grab_autograd_grad(loss: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss(), x)[0]


def _grab_hook(loss: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    x.register_hook(seen.append)
    loss().backward()
    return seen[0]


def _grab_retained(loss: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    x.retain_grad()
    loss().backward()
    assert x.grad is not None
    return x.grad


def _grab_backward_inputs(loss: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    loss().backward(inputs=[x])
    assert x.grad is not None
    return x.grad


def _grab_node_prehook(loss: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    # on x's own node: its AccumulateGrad for a leaf (which sees the grad coming in), its
    # grad_fn otherwise
    seen: list[torch.Tensor] = []
    node = torch.autograd.graph.get_gradient_edge(x).node
    node.register_prehook(lambda grads: seen.append(grads[0]))  # type: ignore[func-returns-value]
    loss().backward()
    return seen[0]


def _grab_node_hook(loss: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    node = torch.autograd.graph.get_gradient_edge(x).node
    node.register_hook(lambda grads_in, grads_out: seen.append(grads_out[0]))  # type: ignore[func-returns-value]
    loss().backward()
    return seen[0]


GRABS = {
    "autograd_grad": _grab_autograd_grad,
    "hook": _grab_hook,
    "retain_grad": _grab_retained,
    "backward_inputs": _grab_backward_inputs,
    "node_prehook": _grab_node_prehook,
    "node_hook": _grab_node_hook,
}

#: How the input reaches the callable: ``(make the tensor the grad is taken of, call)``.
INPUT_KINDS = ["leaf", "non_leaf", "view", "kwarg", "used_twice"]


def _call(kind: str, graphed: Any, device: torch.device) -> tuple[torch.Tensor, Any, Any]:
    """``(tensor whose grad is taken, graphed loss, eager loss)`` for one fresh draw."""
    base = torch.randn(3, 4, device=device, requires_grad=True)
    w = torch.randn(3, 4, device=device, requires_grad=True)
    if kind == "leaf":
        x = base
        arg, kwarg = (lambda: x), (lambda: w)
    elif kind == "non_leaf":
        x = base * 1
        arg, kwarg = (lambda: x), (lambda: w)
    elif kind == "view":
        wide = torch.randn(3, 8, device=device, requires_grad=True)
        x = wide
        arg, kwarg = (lambda: wide[:, 2:6]), (lambda: w)
    elif kind == "kwarg":
        x = w
        arg, kwarg = (lambda: base), (lambda: w)
    else:  # the same tensor as both inputs
        x = base
        arg, kwarg = (lambda: x), (lambda: x)

    def graphed_loss() -> torch.Tensor:
        return graphed(arg(), w=kwarg()).square().sum()

    def eager_loss() -> torch.Tensor:
        return scaled_tanh(arg(), w=kwarg()).square().sum()

    return x, graphed_loss, eager_loss


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("grab", sorted(GRABS))
def test_input_grads_are_never_overwritten_by_a_later_replay(
    backend: str, kind: str, grab: str
) -> None:
    device = device_of(backend)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        scaled_tanh, (sample,), sample_kwargs={"w": sample.clone()}, backend=backend
    )
    take = GRABS[grab]
    kept = []
    for _ in range(3):
        x, graphed_loss, eager_loss = _call(kind, graphed, device)
        grad = take(graphed_loss, x)
        expected = torch.autograd.grad(eager_loss(), x)[0]
        assert_tensors_match(grad, expected, f"grad of {kind}", tolerance(backend))
        kept.append((grad, expected))
    for i, (grad, expected) in enumerate(kept):  # later replays left earlier grads alone
        assert_tensors_match(grad, expected, f"grad {i} of {kind}", tolerance(backend))


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
@pytest.mark.parametrize("grab", ["node_prehook", "node_hook"])
@pytest.mark.parametrize("grad", ["no .grad", "a .grad to add into"])
def test_a_hook_on_a_leaf_inputs_accumulate_grad_node_keeps_a_grad_of_its_own(
    backend: str, param_grads: str, grab: str, grad: str
) -> None:
    # a module (a plain .backward() hands the grads on as they are where nothing sees them)
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (sample,), backend=backend, param_grads=param_grads)
    kept = []
    for _ in range(3):
        x = torch.randn(2, 4, device=device, requires_grad=True)
        if grad != "no .grad":
            x.grad = torch.ones_like(x)
        seen = GRABS[grab](lambda x=x: loss_of(layer(x)), x)
        kept.append((seen, torch.autograd.grad(loss_of(twin(x)), x)[0]))
    for i, (seen, expected) in enumerate(kept):  # later replays left earlier grads alone
        assert_tensors_match(seen, expected, f"grad {i}", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("grab", ["autograd_grad", "hook"])
def test_parameter_grads_are_never_overwritten_by_a_later_replay(backend: str, grab: str) -> None:
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, device=device),), backend=backend)
    kept = []
    for _ in range(3):
        x = torch.randn(2, 4, device=device)
        grad = GRABS[grab](lambda x=x: layer(x).square().sum(), layer.weight)
        expected = torch.autograd.grad(twin(x).square().sum(), twin.weight)[0]
        kept.append((grad, expected))
    for i, (grad, expected) in enumerate(kept):
        assert_tensors_match(grad, expected, f"weight grad {i}", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_hook_registered_before_capture_runs_once_per_replay(backend: str) -> None:
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    calls = []
    for module in (layer, twin):
        module.weight.register_hook(lambda grad, m=module: calls.append(m) or grad * 2)
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, device=device),), backend=backend)
    calls.clear()
    for _ in range(2):
        x = torch.randn(2, 4, device=device)
        backward_of(layer(x))
        backward_of(twin(x))
    assert calls.count(layer) == calls.count(twin) == 2
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        parameter_names(layer),
        tolerance(backend),
    )


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_grads_flow_through_a_stack_of_graphed_blocks_like_eager(
    backend: str, param_grads: str
) -> None:
    """Each block's input grad goes straight to the block before it (no copy there)."""
    device = device_of(backend)
    blocks = [TinyMLP().to(device) for _ in range(3)]
    twins = [TinyMLP().to(device) for _ in range(3)]
    for block, twin in zip(blocks, twins, strict=True):
        twin.load_state_dict(block.state_dict())
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in blocks)
    dgt.make_graphed_callables(tuple(blocks), samples, backend=backend, param_grads=param_grads)
    for _ in range(3):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        h, h_eager = x, x_eager
        for block, twin in zip(blocks, twins, strict=True):
            h, h_eager = block(h), twin(h_eager)
        backward_of(h)
        backward_of(h_eager)
        assert_tensors_match(x.grad, x_eager.grad, "x.grad", tolerance(backend))
    for block, twin in zip(blocks, twins, strict=True):
        assert_grads_match(
            grads_of(parameters_of(block)),
            grads_of(parameters_of(twin)),
            parameter_names(block),
            tolerance(backend),
        )


@pytest.mark.parametrize("hook", ["prehook", "posthook"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_node_hook_on_the_block_before_keeps_a_grad_no_later_replay_overwrites(
    backend: str, param_grads: str, hook: str
) -> None:
    # The block before is a replay too, so the grad goes to it without a copy: a hook on its
    # node (register_prehook, or register_hook, which also sees the incoming grads) could keep
    # the next block's static input grad buffer, which the next backward overwrites.
    device = device_of(backend)
    blocks = [TinyMLP().to(device) for _ in range(2)]
    twins = [TinyMLP().to(device) for _ in range(2)]
    for block, twin in zip(blocks, twins, strict=True):
        twin.load_state_dict(block.state_dict())
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in blocks)
    dgt.make_graphed_callables(tuple(blocks), samples, backend=backend, param_grads=param_grads)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(3):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        seen: list[torch.Tensor] = []
        for first, second in ((blocks[0], blocks[1]), (twins[0], twins[1])):
            h = first(x)
            if hook == "prehook":
                h.grad_fn.register_prehook(lambda grads, seen=seen: seen.append(grads[0]))
            else:
                h.grad_fn.register_hook(lambda _, grads, seen=seen: seen.append(grads[0]))
            backward_of(second(h))
        kept.append((seen[0], seen[1]))
    for i, (grad, expected) in enumerate(kept):  # later replays left earlier grads alone
        assert_tensors_match(grad, expected, f"grad {i} seen by the hook", tolerance(backend))


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_post_hook_on_the_replays_own_node_keeps_grads_no_later_replay_overwrites(
    entry: str, param_grads: str
) -> None:
    # ``out.grad_fn.register_hook(fn)`` sees the grads the replay hands on (a leaf input's, and
    # under "autograd" the parameters'), which went out as static buffers in a plain backward.
    graphed = graphed_on(entry, Decays(), param_grads=param_grads)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(grads: tuple[torch.Tensor | None, ...], _: Any) -> None:
        kept.extend((grad, grad.clone()) for grad in grads if grad is not None)

    for _ in range(2):
        out = graphed(batch(call_length(entry)))
        out.grad_fn.register_hook(keep)
        out.sum().backward()
    assert kept
    for i, (grad, snapshot) in enumerate(kept):  # the later replay left earlier grads alone
        assert_tensors_match(grad, snapshot, f"grad {i} seen by the hook", None)


# -- an output the callable also uses inside ---------------------------------------------------


class HiddenAndOut(nn.Module):
    """Returns a hidden state and what it computes from it (HF's ``output_hidden_states``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.first(x).tanh()
        return hidden, hidden.t(), self.second(hidden).sigmoid()


def _watch_hook(tensor: torch.Tensor) -> None:
    tensor.register_hook(lambda grad: grad * 2)


def _watch_retained(tensor: torch.Tensor) -> None:
    tensor.retain_grad()


@pytest.mark.parametrize("watch", [_watch_hook, _watch_retained], ids=["hook", "retain_grad"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_grad_watched_at_an_output_used_inside_is_refused_not_partial(
    backend: str, param_grads: str, watch: Callable[[torch.Tensor], None]
) -> None:
    # Eager's grad at ``hidden`` includes what flows back from the output computed from it; a
    # replay's only what the loss sends to ``hidden`` itself: a hook or retain_grad there saw a
    # partial grad (and a hook's change missed the rest), silently.
    device = device_of(backend)
    module = HiddenAndOut().to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, param_grads=param_grads)
    outputs = module(torch.randn(2, 4, device=device, requires_grad=True))
    watch(outputs[0])
    with pytest.raises(DualgraphError, match=re.escape("output[0]") + ".*used inside"):
        sum(t.sum() for t in outputs).backward()


class ViewsUsedInside(nn.Module):
    """Returns a view of its input and a view of a hidden state, and what it computes from
    each: a replay hands both views out made anew (from the caller's input, from the hidden
    state handed out), not the tensors the other outputs were computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        row, hidden = x[0], self.fc(x)
        first = hidden[0]
        return row, row.exp(), hidden, first, self.fc(first).tanh()


@pytest.mark.parametrize("output", [0, 3], ids=["view_of_an_input", "view_of_an_output"])
@pytest.mark.parametrize("watch", [_watch_hook, _watch_retained], ids=["hook", "retain_grad"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_grad_watched_at_a_view_handed_out_that_other_outputs_use_is_refused_not_partial(
    backend: str, param_grads: str, watch: Callable[[torch.Tensor], None], output: int
) -> None:
    # The hook or retain_grad went on the view a replay makes after it (of the caller's x, or
    # of the hidden state handed out): it saw only what the loss sends to it directly, where
    # eager's includes what flows back from row.exp() (or fc(first)), silently.
    device = device_of(backend)
    module = ViewsUsedInside().to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, param_grads=param_grads)
    outputs = module(torch.randn(2, 4, device=device, requires_grad=True))
    watch(outputs[output])
    with pytest.raises(DualgraphError, match=re.escape(f"output[{output}]") + ".*used inside"):
        sum(t.sum() for t in outputs).backward()


@pytest.mark.parametrize("output", [1, 2])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_grad_watched_at_an_output_nothing_inside_uses_is_eagers(
    backend: str, param_grads: str, output: int
) -> None:
    # output[1] is a view of output[0] (handed out from it), output[2] the last one
    device = device_of(backend)
    module, twin = HiddenAndOut().to(device), HiddenAndOut().to(device)
    twin.load_state_dict(module.state_dict())
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, param_grads=param_grads)
    for _ in range(2):
        x = torch.randn(2, 4, device=device, requires_grad=True)
        outputs, expected = module(x), twin(x)
        for tensors in (outputs, expected):
            tensors[output].retain_grad()
            sum(t.sum() for t in tensors).backward()
        where = f"output[{output}].grad"
        assert_tensors_match(outputs[output].grad, expected[output].grad, where, tolerance(backend))


@pytest.mark.parametrize("change", ["optimizer_step", "in_place_add"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_parameter_the_backward_reads_changed_in_place_before_it_is_refused(
    backend: str, param_grads: str, change: str
) -> None:
    # Eager's backward raises (the weight it saved was modified by an inplace operation); a
    # backward graph reads the weight's memory as it is then: grads of the new weight, silently.
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (sample,), backend=backend, param_grads=param_grads)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    backward_of(layer(torch.randn(2, 4, device=device, requires_grad=True)))
    loss = layer(torch.randn(2, 4, device=device, requires_grad=True)).tanh().sum()
    if change == "optimizer_step":
        optimizer.step()
    else:
        with torch.no_grad():
            layer.weight.add_(1.0)
    kept = [p.grad.clone() for p in layer.parameters()]
    with pytest.raises(DualgraphError, match=r"Linear\.weight.*modified in place"):
        loss.backward()
    for grad, param in zip(kept, layer.parameters(), strict=True):  # nothing was added
        assert_tensors_match(param.grad, grad, "grad after the refusal", None)


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_parameter_the_backward_does_not_read_may_change_before_it(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(2, 4, device=device, requires_grad=True)
    losses = [module(x).square().sum() for module in (layer, twin)]
    with torch.no_grad():
        for module in (layer, twin):
            module.bias.add_(1.0)  # the bias is in no op's backward
    for loss in losses:
        loss.backward()
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        parameter_names(layer),
        tolerance(backend),
    )


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_an_expanded_incoming_grad_gives_eagers_grads_through_batchnorm(
    backend: str, param_grads: str, slots: int
) -> None:
    # BatchNorm's backward rounds differently for an expanded grad (what .sum() hands on) and a
    # dense one; eager differentiates with the grad as it comes, and so must the replay (on a
    # GPU the captured kernels read the static buffer: there the dtype's tolerance applies)
    device = device_of(backend)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32)).to(device)
    twin = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32)).to(device)
    twin.load_state_dict(model.state_dict())
    sample = torch.randn(64, 16, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        model, (sample,), backend=backend, param_grads=param_grads, slots=slots
    )
    for _ in range(3):  # the grads accumulate over the steps
        x = torch.randn(64, 16, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        graphed(x).sum().backward()
        twin(x_eager).sum().backward()
        assert_tensors_match(x.grad, x_eager.grad, "x.grad", tolerance(backend))
    assert_grads_match(
        grads_of(parameters_of(model)),
        grads_of(parameters_of(twin)),
        parameter_names(model),
        tolerance(backend),
    )


# -- inputs the callable updates in place --------------------------------------------------------


def track(x: torch.Tensor, stats: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Updates a running mean and a call count in place, like a cache or running statistic."""
    stats.mul_(0.9).add_(x.detach().mean(dim=0), alpha=0.1)
    count.add_(1)
    return x * 2 + stats


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_inputs_the_callable_updates_in_place_are_updated_for_the_caller(backend: str) -> None:
    device = device_of(backend)
    stats, count = torch.zeros(4, device=device), torch.zeros((), device=device, dtype=torch.long)
    graphed = dgt.make_graphed_callables(
        track, (torch.randn(3, 4, device=device), stats.clone(), count.clone()), backend=backend
    )
    assert graphed.plan.mutated_inputs == (1, 2)
    eager_stats, eager_count = stats.clone(), count.clone()
    for _ in range(3):
        x = torch.randn(3, 4, device=device)
        out = graphed(x, stats, count)
        expected = track(x, eager_stats, eager_count)
        assert_tensors_match(out, expected, "output", tolerance(backend))
        assert_tensors_match(stats, eager_stats, "stats", tolerance(backend))
        assert_tensors_match(count, eager_count, "count")
    with torch.no_grad():
        graphed(torch.randn(3, 4, device=device), stats, count)
    assert int(count) == 4


def _update_through_data(cache: torch.Tensor, x: torch.Tensor) -> None:
    cache.data.mul_(2).add_(x.detach()[0])


def _assign_through_data(cache: torch.Tensor, x: torch.Tensor) -> None:
    cache.data[1:] = x.detach()[1, 1:]


def _scale_through_its_storage(cache: torch.Tensor, x: torch.Tensor) -> None:
    alias = cache.new_empty(0).set_(cache.untyped_storage(), 0, cache.shape)
    alias.mul_(3)


def _update_as_batch_norm(cache: torch.Tensor, x: torch.Tensor) -> None:
    # running statistics passed in: the kernel writes the mean without a version bump
    nn.functional.batch_norm(x.detach(), cache, torch.ones_like(cache), training=True)


_UPDATES_NO_VERSION_SEES = {
    "data": _update_through_data,
    "data_setitem": _assign_through_data,
    "storage": _scale_through_its_storage,
    "batch_norm": _update_as_batch_norm,
}


def _cached(change: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[..., torch.Tensor]:
    def cached(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        change(cache, x)
        return x * 2

    return cached


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("update", sorted(_UPDATES_NO_VERSION_SEES))
def test_an_input_updated_where_its_version_does_not_move_is_updated_for_the_caller(
    backend: str, update: str
) -> None:
    # cache.data.mul_(2), or F.batch_norm's running mean passed in, moves no version counter of
    # cache's: the update was not found at capture, so the caller's cache kept its values
    device = device_of(backend)
    cached = _cached(_UPDATES_NO_VERSION_SEES[update])
    graphed = dgt.make_graphed_callables(
        cached, (torch.randn(2, 4, device=device), torch.randn(4, device=device)), backend=backend
    )
    assert graphed.plan.mutated_inputs == (1,)
    cache, eager_cache = torch.ones(4, device=device), torch.ones(4, device=device)
    for _ in range(3):
        x = torch.randn(2, 4, device=device)
        graphed(x, cache)
        cached(x, eager_cache)
        assert_tensors_match(cache, eager_cache, "cache", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("update", sorted(_UPDATES_NO_VERSION_SEES))
def test_an_input_updated_where_its_version_does_not_move_keeps_its_version_as_in_eager(
    backend: str, update: str
) -> None:
    # eager's update moves no version: an eager op that saved the caller's tensor still
    # differentiates afterwards, where a copy back that moved it would raise at backward
    device = device_of(backend)
    cached = _cached(_UPDATES_NO_VERSION_SEES[update])
    graphed = dgt.make_graphed_callables(
        cached, (torch.randn(2, 4, device=device), torch.randn(4, device=device)), backend=backend
    )
    cache, eager_cache = torch.ones(4, device=device), torch.ones(4, device=device)
    x = torch.randn(2, 4, device=device)
    graphed(x, cache)
    cached(x, eager_cache)
    assert cache._version == eager_cache._version == 0


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_holding_nan_that_nothing_updates_is_not_taken_as_updated(backend: str) -> None:
    device = device_of(backend)
    sample = torch.tensor([float("nan"), 1.0, -0.0], device=device)
    graphed = dgt.make_graphed_callables(lambda x: x * 2, (sample,), backend=backend)
    assert graphed.plan.mutated_inputs == ()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_place_updates_reach_the_caller_through_a_view(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        track,
        (
            torch.randn(3, 4, device=device),
            torch.zeros(4, device=device),
            torch.zeros((), device=device),
        ),
        backend=backend,
    )
    state = torch.zeros(2, 4, device=device)
    count = torch.zeros((), device=device)
    x = torch.ones(3, 4, device=device)
    graphed(x, state[1], count)
    assert_tensors_match(
        state[1], torch.full((4,), 0.1, device=device), "state[1]", tolerance(backend)
    )
    assert_tensors_match(state[0], torch.zeros(4, device=device), "state[0]")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_updated_input_that_shares_memory_with_another_input_is_refused(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        track,
        (
            torch.randn(3, 4, device=device),
            torch.zeros(4, device=device),
            torch.zeros((), device=device),
        ),
        backend=backend,
    )
    x = torch.randn(3, 4, device=device)
    before = x.clone()
    with pytest.raises(DualgraphError) as info:
        graphed(x, x[0], torch.zeros((), device=device))  # eager would see stats through x
    assert str(info.value) == (
        "track: args[1] and args[0] share memory, and the callable updates args[1] in place: "
        "eager would see the update through args[0], a replay would not; pass tensors that do "
        "not share memory"
    )
    assert torch.equal(x, before)


def test_an_updated_input_overlapping_another_through_another_storage_is_refused() -> None:
    # from_numpy of overlapping numpy views makes two storages over the same bytes: compared by
    # storage, they shared nothing, and the replay updated its copy where eager's x saw it.
    graphed = dgt.make_graphed_callables(
        track, (torch.randn(3, 4), torch.zeros(4), torch.zeros(())), backend="emulate"
    )
    earlier = graphed(torch.randn(3, 4), torch.zeros(4), torch.zeros(()))
    earlier_value = earlier.clone()
    memory = np.random.default_rng(0).standard_normal(12).astype(np.float32)
    x, stats = torch.from_numpy(memory).view(3, 4), torch.from_numpy(memory[4:8])
    assert x.untyped_storage().data_ptr() != stats.untyped_storage().data_ptr()
    before = x.clone()
    with pytest.raises(DualgraphError, match=r"^track: args\[1\] and args\[0\] share memory"):
        graphed(x, stats, torch.zeros(()))
    assert torch.equal(x, before)
    assert torch.equal(earlier, earlier_value), "the refused call wrote a static buffer"
    x, stats = torch.randn(3, 4), torch.randn(4)
    x_eager, stats_eager = x.clone(), stats.clone()
    out = graphed(x, stats, torch.zeros(()))
    assert torch.equal(out, track(x_eager, stats_eager, torch.zeros(())))
    assert torch.equal(stats, stats_eager)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_an_updated_input_the_update_cannot_be_written_into_is_refused_before_the_replay(
    backend: str, kind: str
) -> None:
    # Eager's in-place update raises on such a tensor; the replay refuses it before any static
    # buffer is written (else it raised after the replay, with the buffers overwritten).
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        track,
        (
            torch.randn(3, 4, device=device),
            torch.zeros(4, device=device),
            torch.zeros((), device=device),
        ),
        backend=backend,
    )
    stats = torch.zeros(1, device=device).expand(4)
    count = torch.zeros((), device=device)
    if kind == "inference":
        with torch.inference_mode():
            stats, count = torch.zeros(4, device=device), torch.zeros((), device=device)
    static = [t.clone() for t in graphed.static_inputs]
    with pytest.raises(
        DualgraphError, match=r"^track: args\[1\]: the callable updates it in place"
    ):
        graphed(torch.randn(3, 4, device=device), stats, count)
    assert all(map(torch.equal, graphed.static_inputs, static))
    assert graphed.generation == 0


def update_both(x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Updates both its inputs in place."""
    stats.mul_(0.5)
    x.add_(1.0)
    return x * 2 + stats


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("which", ["stats", "x"])
def test_an_updated_input_that_is_an_earlier_output_of_the_same_callable_is_refused(
    backend: str, which: str
) -> None:
    # An earlier call's output is a view of the static output this replay writes: the copy back
    # of the update wrote into the new output (silently wrong values), where eager's output is a
    # tensor of its own.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        update_both,
        (torch.randn(3, 4, device=device), torch.ones(4, device=device)),
        backend=backend,
    )
    out = graphed(torch.randn(3, 4, device=device), torch.ones(4, device=device))
    before = out.clone()
    x, stats = torch.randn(3, 4, device=device), torch.ones(4, device=device)
    if which == "stats":
        stats = out[0]
    else:
        x = out
    path = "args[1]" if which == "stats" else "args[0]"
    with pytest.raises(DualgraphError) as info:
        graphed(x, stats)
    assert str(info.value) == (
        f"update_both: {path} shares memory with output of an earlier call (a static buffer "
        f"this replay overwrites), and the callable updates {path} in place: the replay "
        "would write the update into this call's output; pass a copy (clone(), or graph "
        "with clone_outputs=True)"
    )
    assert torch.equal(out, before)
    assert graphed.generation == 1


def test_an_updated_input_overlapping_an_earlier_output_through_another_storage_is_refused() -> (
    None
):
    # from_numpy of the earlier output's memory is another storage over it: compared by storage,
    # the copy back of the update wrote into this call's output.
    graphed = dgt.make_graphed_callables(
        update_both, (torch.randn(3, 4), torch.ones(4)), backend="emulate"
    )
    out = graphed(torch.randn(3, 4), torch.ones(4))
    before = out.clone()
    stats = torch.from_numpy(out.detach().numpy()[1])
    assert stats.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    with pytest.raises(DualgraphError, match=r"^update_both: args\[1\] shares memory with output"):
        graphed(torch.randn(3, 4), stats)
    assert torch.equal(out, before)
    assert graphed.generation == 1


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_updated_input_that_is_an_earlier_cloned_output_updates_like_eager(
    backend: str,
) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        track,
        (
            torch.randn(3, 4, device=device),
            torch.zeros(4, device=device),
            torch.zeros((), device=device),
        ),
        backend=backend,
        clone_outputs=True,
    )
    results = []
    for fn in (graphed, track):
        torch.manual_seed(0)
        count = torch.zeros((), device=device)
        out = fn(torch.randn(3, 4, device=device), torch.zeros(4, device=device), count)
        results.append((fn(torch.randn(3, 4, device=device), out[0], count), out))
    (got, got_first), (expected, expected_first) = results
    assert_tensors_match(got, expected, "output", tolerance(backend))
    assert_tensors_match(got_first, expected_first, "earlier output", tolerance(backend))


class ScalesByItsBuffer(nn.Module):
    """Updates an input in place, and reads a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        stats.mul_(0.5)
        return self.fc(x) * self.scale


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("which", ["scale", "fc.weight"])
def test_an_updated_input_that_shares_memory_with_a_module_tensor_is_refused(
    backend: str, which: str
) -> None:
    # Eager's forward reads the update through the module's own tensor, a replay would not.
    device = device_of(backend)
    module = ScalesByItsBuffer().to(device)
    dgt.make_graphed_callables(
        module, (torch.randn(3, 4, device=device), torch.ones(4, device=device)), backend=backend
    )
    tensor = module.get_buffer(which) if which == "scale" else module.get_parameter(which)
    shared = tensor.detach()[0] if which == "fc.weight" else tensor
    before = tensor.detach().clone()
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(3, 4, device=device), shared)
    assert str(info.value) == (
        f"ScalesByItsBuffer: args[1] shares memory with ScalesByItsBuffer.{which}, and the "
        "callable updates args[1] in place: eager would see the update through "
        f"ScalesByItsBuffer.{which}, a replay would not; pass a tensor of its own (clone())"
    )
    assert torch.equal(tensor, before)
    assert runner_of(module).generation == 0


def test_an_updated_input_overlapping_a_module_tensor_through_another_storage_is_refused() -> None:
    # from_numpy of a view of the buffer is another storage over its memory: compared by storage,
    # eager saw the update through the buffer, a replay did not (silently another output).
    module = ScalesByItsBuffer()
    dgt.make_graphed_callables(module, (torch.randn(3, 4), torch.ones(4)), backend="emulate")
    weight = module.fc.weight
    shared = torch.from_numpy(weight.detach().numpy().reshape(-1)[1:5])
    assert shared.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    before = weight.detach().clone()
    with pytest.raises(
        DualgraphError, match=r"^ScalesByItsBuffer: args\[1\] shares memory with .*fc\.weight, and"
    ):
        module(torch.randn(3, 4), shared)
    assert torch.equal(weight, before)
    assert runner_of(module).generation == 0


class NormsThenAdds(nn.Module):
    """Updates its BatchNorm statistics in place, then reads an input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + stats


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("view", [False, True])
def test_an_input_sharing_memory_with_a_buffer_the_callable_updates_is_refused(
    backend: str, view: bool
) -> None:
    # Eager reads the input after BatchNorm updated its statistics in place; a replay read the
    # copy made before (silently another output).
    device = device_of(backend)
    module, twin = NormsThenAdds().to(device), NormsThenAdds().to(device)
    dgt.make_graphed_callables(
        module, (torch.randn(3, 4, device=device), torch.ones(4, device=device)), backend=backend
    )
    stats = module.norm.running_mean
    shared = stats[:] if view else stats
    x = torch.randn(3, 4, device=device)
    before = stats.clone()
    with pytest.raises(DualgraphError) as info:
        module(x, shared)
    message = str(info.value)
    assert message.startswith(
        "NormsThenAdds: args[1] shares memory with NormsThenAdds.norm.running_mean, which the "
        "callable updates in place"
    )
    assert "clone()" in message
    assert torch.equal(stats, before)
    assert runner_of(module).generation == 0
    # a copy replays, as eager runs it
    got = module(x, stats.clone())
    expected = twin(x, twin.norm.running_mean.clone())
    assert_tensors_match(got, expected, "output", tolerance(backend))
    assert_tensors_match(module.norm.running_mean, twin.norm.running_mean, "stats", None)


def test_an_input_overlapping_an_updated_buffer_through_another_storage_is_refused() -> None:
    # frombuffer over the statistics' memory is another storage: compared by storage, the replay
    # read the copy made before BatchNorm's update, where eager read it after.
    memory = np.zeros(8, dtype=np.float32)
    module = NormsThenAdds()
    module.norm.running_mean = torch.from_numpy(memory[:4])
    dgt.make_graphed_callables(module, (torch.randn(3, 4), torch.ones(4)), backend="emulate")
    stats = module.norm.running_mean
    shared = torch.frombuffer(memory[1:5], dtype=torch.float32)
    assert shared.untyped_storage().data_ptr() != stats.untyped_storage().data_ptr()
    before = stats.clone()
    with pytest.raises(
        DualgraphError,
        match=r"^NormsThenAdds: args\[1\] shares memory with NormsThenAdds\.norm\.running_mean,",
    ):
        module(torch.randn(3, 4), shared)
    assert torch.equal(stats, before)
    assert runner_of(module).generation == 0


class _FillsWithItsBuffer(nn.Module):
    """Reads a buffer of NaN (the fill of what the mask drops) and updates nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fill", torch.full((4,), math.nan))
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x * self.scale, self.fill)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_buffer_holding_nan_that_the_callable_only_reads_is_not_taken_as_updated(
    backend: str,
) -> None:
    # The buffers were compared with what they held before warmup by value, by which a NaN is
    # never itself: one only read was taken as updated in place, and an input sharing its
    # memory was refused ("which the callable updates in place") where eager runs it.
    device = device_of(backend)
    module, twin = _FillsWithItsBuffer().to(device), _FillsWithItsBuffer().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, device=device),), backend=backend)
    got = module(module.fill)
    torch.testing.assert_close(got, twin(twin.fill), rtol=0, atol=0, equal_nan=True)
    assert module.fill.isnan().all()


def test_a_closed_over_tensor_holding_nan_only_read_is_not_taken_as_updated() -> None:
    # As a module's buffer: a function's closed-over tensors were compared by value too.
    fill = torch.full((4,), math.nan)

    def fills(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x * 2, fill)

    graphed = dgt.make_graphed_callables(
        fills, (torch.randn(4, requires_grad=True),), backend="emulate"
    )
    torch.testing.assert_close(graphed(fill), fills(fill), rtol=0, atol=0, equal_nan=True)


# -- parameters and buffers after capture --------------------------------------------------------


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_parameter_unfrozen_after_capture_is_refused_naming_it(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    module.fc1.weight.requires_grad_(False)
    dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device=device),), backend=backend, param_grads=param_grads
    )
    module.fc1.weight.requires_grad_(True)
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(4, 8, device=device))
    assert str(info.value) == (
        "TinyMLP.fc1.weight: requires_grad was False at capture and is True now; the captured "
        "backward computes grads for the parameters that required grad at capture, so restore "
        "the module (dualgraph.torch.restore) and graph it again"
    )
    with torch.no_grad():  # no grad is computed: the flag does not matter
        module(torch.randn(4, 8, device=device))


@pytest.mark.parametrize("frozen", ["fc1.weight", "fc2.bias"])  # the first parameter, the last
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_parameter_frozen_after_capture_is_refused_naming_it(
    backend: str, param_grads: str, frozen: str
) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device=device),), backend=backend, param_grads=param_grads
    )
    module.get_parameter(frozen).requires_grad_(False)
    with pytest.raises(DualgraphError, match=rf"^TinyMLP\.{frozen}: requires_grad was True"):
        backward_of(module(torch.randn(4, 8, device=device)))
    assert all(p.grad is None for p in module.parameters())


class _TwoHeads(nn.Module):
    """An output of the input and the first layer, and one of the second layer's alone."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second.weight * 2 + self.second.bias


@pytest.mark.parametrize("frozen", ["every parameter", "second"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_outputs_only_parameters_frozen_after_capture_reach_need_no_grad_as_in_eager(
    backend: str, param_grads: str, frozen: str
) -> None:
    device = device_of(backend)
    module, twin = _TwoHeads().to(device), _TwoHeads().to(device)
    twin.load_state_dict(module.state_dict())
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, param_grads=param_grads)
    for m in (module, twin):
        (m if frozen == "every parameter" else m.second).requires_grad_(False)
    for _ in range(2):
        x = torch.randn(4, 8, device=device)
        assert_trees_match(module(x), twin(x), tolerance(backend))
    # an input that needs grad makes the output it reaches need grad again
    x = torch.randn(4, 8, device=device, requires_grad=True)
    assert_trees_match(module(x), twin(x), tolerance(backend))


@pytest.mark.parametrize("frozen", ["fc1.weight", "fc2.bias"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_parameter_frozen_between_forward_and_backward_keeps_its_grad_as_in_eager(
    backend: str, param_grads: str, frozen: str
) -> None:
    # eager's AccumulateGrad skips a parameter that no longer requires grad; the others get theirs
    device = device_of(backend)
    module, twin = TinyMLP().to(device), TinyMLP().to(device)
    twin.load_state_dict(module.state_dict())
    dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device=device),), backend=backend, param_grads=param_grads
    )
    x = torch.randn(4, 8, device=device)
    backward_of(module(x))  # .grad holds something: it must not change for the frozen one
    backward_of(twin(x))
    x = torch.randn(4, 8, device=device)
    outputs, expected = module(x), twin(x)
    for m in (module, twin):
        m.get_parameter(frozen).requires_grad_(False)
    if param_grads == "in_graph":  # the backward graph would add into it: refused
        with pytest.raises(DualgraphError, match=rf"^TinyMLP\.{frozen}: requires_grad was True"):
            backward_of(outputs)
        return
    backward_of(outputs)
    backward_of(expected)
    _assert_same_grads(module, twin, backend)
    if param_grads == "auto":  # autograd skips the frozen parameter, as in eager
        assert _through_autograd(module) == 1


class _DropNormBlock(nn.Module):
    """Dropout and BatchNorm, whose forwards read Python numbers: ``p``, ``momentum``, ``eps``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.scale = 2.0  # the block's own number

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.fc(x))) * self.scale


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("drop.p", 0.0),  # a dropout schedule
        ("norm.momentum", None),  # swa_utils.update_bn: a cumulative average
        ("norm.eps", 1e-3),
        ("scale", 3.0),
    ],
)
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_python_number_a_submodule_reads_changed_after_capture_is_refused_naming_it(
    backend: str, path: str, value: Any
) -> None:
    """A replay runs what the forward computed from it at capture: the change would be lost."""
    device = device_of(backend)
    block = _DropNormBlock().to(device)
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    block(torch.randn(4, 8, device=device)).sum().backward()
    owner_path, _, name = path.rpartition(".")
    owner = block.get_submodule(owner_path)
    then = getattr(owner, name)
    statistics = block.norm.running_mean.clone()
    setattr(owner, name, value)
    with pytest.raises(DualgraphError, match=rf"^_DropNormBlock\.{path}: was {then!r} at capture"):
        block(torch.randn(4, 8, device=device))
    assert torch.equal(block.norm.running_mean, statistics)  # refused before anything ran
    setattr(owner, name, then * 1.0)  # an equal value (another float object): fine
    block(torch.randn(4, 8, device=device)).sum().backward()


class _Activation(enum.Enum):
    GELU = "gelu"
    TANH = "tanh"


class _CastBlock(nn.Module):
    """A forward branching on an ``Enum`` member and casting to a dtype, both its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = _Activation.GELU
        self.out_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.nn.functional.gelu(h) if self.act is _Activation.GELU else h.tanh()
        return h.to(self.out_dtype)


@pytest.mark.parametrize(
    ("name", "value"), [("act", _Activation.TANH), ("out_dtype", torch.float64)]
)
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_enum_or_dtype_attribute_changed_after_capture_is_refused_naming_it(
    backend: str, name: str, value: Any
) -> None:
    # Eager takes the other branch (tanh) or casts to float64; a graph replays the branch and
    # the cast of capture (on CUDA silently; "emulate" followed the Enum, and refused the dtype
    # as 'output: expected float32[4, 8], got float64[4, 8]', naming no attribute).
    device = device_of(backend)
    block = _CastBlock().to(device)
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    then = getattr(block, name)
    setattr(block, name, value)
    with pytest.raises(DualgraphError) as info:
        block(torch.randn(4, 8, device=device))
    assert str(info.value).startswith(f"_CastBlock.{name}: was {then!r} at capture and is")
    setattr(block, name, then)  # as at capture: replays again
    x = torch.randn(4, 8, device=device)
    expected = _CastBlock.forward(block, x).detach()
    assert_tensors_match(block(x).detach(), expected, "output", tolerance(backend))


class _SignedBlock(nn.Module):
    """A forward whose host Python reads a float's sign (``copysign``), and a NaN fill value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.sign = 0.0
        self.fill = float("nan")
        self.shape = (2, -0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * math.copysign(1.0, self.sign) * math.copysign(1.0, self.shape[1])
        return y.nan_to_num(nan=self.fill)  # a NaN fill: NaNs are kept


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(("name", "value"), [("sign", -0.0), ("shape", (2, 0.0))])
def test_a_float_attribute_set_to_zero_of_the_other_sign_is_refused(
    backend: str, name: str, value: Any
) -> None:
    # -0.0 == 0.0, so it read as unchanged; the graphs keep the sign the forward read at capture.
    device = device_of(backend)
    block = _SignedBlock().to(device)
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    setattr(block, name, value)
    with pytest.raises(DualgraphError, match=rf"^_SignedBlock\.{name}: was .* at capture and is"):
        block(torch.randn(4, 8, device=device))


class _GainOnItsWeights(nn.Module):
    """Reads plain values hung on its weight and a buffer (as quantization libraries hang a
    scale on a weight), and sets a flag on its bias on every call (Megatron's kind). Made on
    its device: ``.to("cuda")`` makes new tensors, without the values."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, device=device)
        self.fc.weight.gain = 2.0  # type: ignore[attr-defined]
        self.register_buffer("shift", torch.ones(8, device=device))
        self.shift.sign = -1.0  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc.bias.seen = True  # type: ignore[union-attr]
        return self.fc(x) * self.fc.weight.gain + self.shift * self.shift.sign  # type: ignore[operator]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("tensor", "name", "value"), [("fc.weight", "gain", 3.0), ("shift", "sign", 1.0)]
)
def test_a_plain_value_on_a_parameter_or_buffer_changed_after_capture_is_refused_naming_it(
    backend: str, tensor: str, name: str, value: float
) -> None:
    # The graphs hold what the forward computed from the value of capture: on CUDA a replay
    # scaled by 2.0 after weight.gain = 3.0, silently (emulate re-ran the Python and hid it).
    device = device_of(backend)
    block = _GainOnItsWeights(device)
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    held = block.get_parameter(tensor) if "." in tensor else block.get_buffer(tensor)
    then = getattr(held, name)
    setattr(held, name, value)
    with pytest.raises(
        DualgraphError,
        match=rf"^_GainOnItsWeights\.{re.escape(tensor)}\.{name}: was {then!r} at capture and is "
        rf"{value!r} now",
    ):
        block(torch.randn(4, 8, device=device))
    setattr(held, name, then)  # as at capture: replays again, the forward's own flag aside
    x = torch.randn(4, 8, device=device)
    expected = _GainOnItsWeights.forward(block, x).detach()
    assert_tensors_match(block(x).detach(), expected, "output", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_the_fused_accumulation_flag_a_backward_sets_on_a_parameter_is_no_value_compared(
    backend: str,
) -> None:
    # Graphed after an eager step (Megatron's order), the flag is True; zero_grad_buffer sets
    # it False at the next step's start, and each backward True again: no value the forward read.
    device = device_of(backend)
    block = _GainOnItsWeights(device)
    block.fc.weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    block.fc.weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    block(torch.randn(4, 8, device=device))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_nan_attribute_set_to_another_nan_is_no_change(backend: str) -> None:
    # nan != nan, so another NaN object (a config loaded again) read as a change and was refused.
    device = device_of(backend)
    block = _SignedBlock().to(device)
    twin = copy.deepcopy(block)
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    block.fill = float("nan")
    twin.fill = float("nan")
    x = torch.randn(4, 8, device=device)
    block(x).sum().backward()
    twin(x).sum().backward()
    assert torch.equal(block(x), twin(x))
    for graphed, eager in zip(block.parameters(), twin.parameters(), strict=True):
        assert torch.equal(graphed.grad, eager.grad)


class _FrozenScaled(nn.Module):
    """A frozen encoder whose forward reads a number of its own, and a method that does too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)
        self.scale = 2.0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # the forward's own: no change of the caller's
        return self.fc(x) * self.scale

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).tanh()


def _graphed_function_of(encoder: _FrozenScaled, how: str) -> Callable[..., torch.Tensor]:
    if how == "method":
        return encoder.encode

    def step(x: torch.Tensor) -> torch.Tensor:
        return encoder(x).tanh()

    return step


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("how", "name"), [("closure", "closed over encoder.scale"), ("method", "_FrozenScaled.scale")]
)
def test_a_number_of_a_module_a_graphed_function_names_changed_after_capture_is_refused(
    backend: str, how: str, name: str
) -> None:
    # Only a graphed module's own numbers were compared: the graphs of a function closing over
    # an encoder (or a method of it) kept scale 2.0 where eager used 3.0.
    device = device_of(backend)
    encoder = _FrozenScaled().to(device)
    graphed = dgt.make_graphed_callables(
        _graphed_function_of(encoder, how),
        (torch.randn(4, 8, device=device, requires_grad=True),),
        backend=backend,
    )
    for _ in range(2):  # its own counter moves on every call (emulate's replays run it)
        graphed(torch.randn(4, 8, device=device, requires_grad=True)).sum().backward()
    encoder.scale = 2.0 * 1.0  # an equal value: fine
    graphed(torch.randn(4, 8, device=device, requires_grad=True)).sum().backward()
    encoder.scale = 3.0
    with pytest.raises(DualgraphError, match=rf": {re.escape(name)}: was 2\.0 at capture and is"):
        graphed(torch.randn(4, 8, device=device, requires_grad=True))


class _CountingBlock(_DropNormBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1  # Python a replay never runs
        return super().forward(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_numbers_the_forward_sets_in_an_eager_call_in_the_other_mode_are_no_change(
    backend: str,
) -> None:
    """An evaluation (eager, in the other mode) runs the forward's Python: what it sets is not
    the caller's change; a change the caller made before it stays refused."""
    device = device_of(backend)
    block = _CountingBlock().to(device)
    dgt.make_graphed_callables(block, (torch.randn(4, 8, device=device),), backend=backend)
    block.eval()
    block(torch.randn(4, 8, device=device))  # calls += 1, eagerly
    block.train()
    block(torch.randn(4, 8, device=device)).sum().backward()
    block.drop.p = 0.5
    block.eval()
    block(torch.randn(4, 8, device=device))
    block.train()
    with pytest.raises(DualgraphError, match=r"^_CountingBlock\.drop\.p: was 0\.25 at capture"):
        block(torch.randn(4, 8, device=device))


def _replace_weight(module: TinyMLP) -> None:
    module.fc1.weight = nn.Parameter(module.fc1.weight.detach().clone())


def _reassign_data(module: TinyMLP) -> None:
    module.fc1.weight.data = module.fc1.weight.data.clone()


def _relaid_out(module: TinyMLP) -> None:
    # The same memory read with other strides: a captured kernel would keep the old ones.
    weight = module.fc1.weight.data
    module.fc1.weight.data = weight.as_strided(weight.shape, (1, weight.shape[0]))


def _to_double(module: TinyMLP) -> None:
    module.double()


def _delete_bias(module: TinyMLP) -> None:
    del module.fc1.bias
    module.fc1.bias = None


def _replace_buffer(module: TinyMLP) -> None:
    module.scale = torch.full((8,), 3.0, device=module.scale.device)


def _replace_submodule(module: TinyMLP) -> None:
    # New tensors the graphs never read; the captured fc1 keeps its own, untouched.
    module.fc1 = nn.Linear(8, 16).to(module.fc2.weight.device)


def _delete_submodule(module: TinyMLP) -> None:
    del module.fc2


def _load_state_dict_assigning(module: TinyMLP) -> None:
    state = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    module.load_state_dict(state, assign=True)


def _share_memory(module: TinyMLP) -> None:
    if module.fc1.weight.is_cuda:
        pytest.skip("share_memory() leaves CUDA tensors where they are")
    module.share_memory()  # moves each CPU tensor's storage into shared memory


class ScaledMLP(TinyMLP):
    """TinyMLP with a buffer its forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


CHANGES = {
    "replaced": (_replace_weight, "ScaledMLP.fc1.weight: the parameter was replaced after capture"),
    "data_assigned": (_reassign_data, "ScaledMLP.fc1.weight: the parameter's memory changed"),
    "relaid_out": (_relaid_out, "ScaledMLP.fc1.weight: the parameter's layout changed"),
    "moved_by_to": (_to_double, "ScaledMLP.scale: the buffer was replaced after capture (by"),
    "deleted": (_delete_bias, "ScaledMLP.fc1.bias: the parameter was replaced after capture"),
    "buffer_replaced": (_replace_buffer, "ScaledMLP.scale: the buffer was replaced after capture"),
    "submodule_replaced": (_replace_submodule, "ScaledMLP.fc1: the submodule was replaced or"),
    "submodule_deleted": (_delete_submodule, "ScaledMLP.fc2: the submodule was replaced or"),
    "load_state_dict_assign": (
        _load_state_dict_assigning,
        "ScaledMLP.scale: the buffer was replaced after capture (by assignment, "
        "load_state_dict(assign=True),",
    ),
    "share_memory": (
        _share_memory,
        "ScaledMLP.scale: the buffer's memory changed after capture (.to(), .half(), "
        "share_memory(),",
    ),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_parameter_or_buffer_replaced_after_capture_is_refused_naming_it(
    backend: str, change: str
) -> None:
    device = device_of(backend)
    module = ScaledMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    make_change, message = CHANGES[change]
    make_change(module)
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(4, 8, device=device))  # as captured: the module is what changed
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_functional_call_with_other_parameters_is_refused_naming_it(backend: str) -> None:
    # torch.func.functional_call swaps the module's parameters for one call: the graphs would
    # read the captured ones. Refused, with the same parameters it replays.
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    same = torch.func.functional_call(module, dict(module.named_parameters()), (x,))
    assert torch.equal(same, module(x))
    others = {name: p.detach() * 2 for name, p in module.named_parameters()}
    with pytest.raises(DualgraphError, match=r"^TinyMLP\.fc1\.weight: .*functional_call"):
        torch.func.functional_call(module, others, (x,))


class OptionalNorm(nn.Module):
    """A Linear, and a norm registered as ``None`` that the forward runs once it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_module("norm", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y if self.norm is None else self.norm(y)


#: How a parameter, buffer or submodule that was ``None`` at capture gets set:
#: ``(build, change, message)``.
SET_AFTER_CAPTURE = {
    "bias": (
        lambda: nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh()),
        lambda module: setattr(module[0], "bias", nn.Parameter(torch.ones(8))),
        "Sequential.0.bias: the parameter was None at capture",
    ),
    "running_mean": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, track_running_stats=False)),
        lambda module: module[1].register_buffer("running_mean", torch.zeros(8)),
        "Sequential.1.running_mean: the buffer was None at capture",
    ),
    "submodule": (
        lambda: OptionalNorm(),
        lambda module: setattr(module, "norm", nn.LayerNorm(8)),
        "OptionalNorm.norm: the submodule was None at capture",
    ),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("entry", sorted(SET_AFTER_CAPTURE))
def test_a_parameter_or_buffer_none_at_capture_and_set_after_is_refused_naming_it(
    backend: str, entry: str
) -> None:
    # Eager would use the new tensor (add the bias, update the statistics); the graphs never
    # read it, so a replay would silently leave it out.
    device = device_of(backend)
    build, make_change, message = SET_AFTER_CAPTURE[entry]
    module = build().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    make_change(module)
    module.to(device)
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(4, 8, device=device))
    assert str(info.value).startswith(message)


class GrowingStack(nn.Module):
    """Layers in a ModuleList, scales in a ParameterList, and an optional buffer: each one
    added after capture is one eager's forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8)])
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(8))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        for scale in self.scales:
            x = x * scale
        shift = self._buffers.get("shift")
        return x if shift is None else x + shift


#: How a member is added after capture, and the start of the refusal naming it.
ADDED_AFTER_CAPTURE = {
    "submodule": (
        lambda module: module.layers.append(nn.Linear(8, 8)),
        "GrowingStack.layers.1: a submodule added after capture",
    ),
    "parameter": (
        lambda module: module.scales.append(nn.Parameter(torch.full((8,), 2.0))),
        "GrowingStack.scales.1: a parameter added after capture",
    ),
    "buffer": (
        lambda module: module.register_buffer("shift", torch.ones(8)),
        "GrowingStack.shift: a buffer added after capture",
    ),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("member", sorted(ADDED_AFTER_CAPTURE))
def test_a_member_added_after_capture_is_refused_naming_it(backend: str, member: str) -> None:
    # Eager runs the appended layer and multiplies by the appended scale; the graphs never read
    # them (on emulate the new parameter got no grad, on CUDA the output left them out too).
    device = device_of(backend)
    module = GrowingStack().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    add, message = ADDED_AFTER_CAPTURE[member]
    add(module)
    module.to(device)
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(4, 8, device=device))
    assert str(info.value).startswith(message)


class DropNormNet(nn.Module):
    """Linear, dropout, BatchNorm: two submodules whose training mode changes what runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.drop(self.fc(x)))


def _dropout_to_eval(module: DropNormNet) -> None:
    module.drop.eval()  # captured in training mode: the graphs hold a dropout


def _all_to_train(module: DropNormNet) -> None:
    module.train()  # captured with a frozen BatchNorm (norm.eval()): the graphs hold its eval


#: How a submodule's mode comes to differ from capture: ``(capture-time modes, change, message)``.
MODE_CHANGES = {
    "dropout_to_eval": (None, _dropout_to_eval, "DropNormNet.drop: training was True at capture"),
    "frozen_norm_to_train": ("norm", _all_to_train, "DropNormNet.norm: training was False at"),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("change", sorted(MODE_CHANGES))
def test_a_submodule_put_in_another_training_mode_after_capture_is_refused_naming_it(
    backend: str, change: str
) -> None:
    # The module keeps its own mode (which would make it run eagerly), so the replay would run
    # the submodule's captured mode: its dropout, or its BatchNorm's batch statistics.
    device = device_of(backend)
    evaluated, make_change, message = MODE_CHANGES[change]
    module, twin = DropNormNet().to(device), DropNormNet().to(device)
    twin.load_state_dict(module.state_dict())
    for net in (module, twin):
        if evaluated is not None:
            net.get_submodule(evaluated).eval()
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    static = [t.clone() for t in runner_of(module).static_inputs]
    make_change(module)
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(4, 8, device=device))
    assert str(info.value).startswith(message)
    assert all(map(torch.equal, runner_of(module).static_inputs, static))  # refused before
    # The mode the module was captured in again: replays train like eager.
    module.train()
    if evaluated is not None:
        module.get_submodule(evaluated).eval()
    for seed in range(2):
        x = torch.randn(4, 8, device=device)
        torch.manual_seed(seed)
        out = module(x)
        torch.manual_seed(seed)
        expected = twin(x)
        backward_of(out)
        backward_of(expected)
        if backend == "emulate":  # on CUDA, a graph's dropout mask is not eager's for a seed
            assert_tensors_match(out.detach(), expected.detach(), "output")
            assert_grads_match(
                grads_of(parameters_of(module)),
                grads_of(parameters_of(twin)),
                parameter_names(module),
            )
    assert dgt.diagnostics(module).replays == 2


def _doubles_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 2


def _doubles_input(module: nn.Module, args: Any) -> tuple[torch.Tensor, ...]:
    return (args[0] * 2,)


def _records(*args: Any) -> None:
    return None


#: A hook put on a submodule inside the graphed module: ``(register it, the kind named)``.
SUBMODULE_HOOKS: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "forward": (lambda m: m.register_forward_hook(_doubles_output), "forward hook"),
    "forward_pre": (lambda m: m.register_forward_pre_hook(_doubles_input), "forward pre-hook"),
    "full_backward": (lambda m: m.register_full_backward_hook(_records), "backward hook"),
    "backward_pre": (lambda m: m.register_full_backward_pre_hook(_records), "backward pre-hook"),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("when", ["registered", "removed"])
@pytest.mark.parametrize("hook", sorted(SUBMODULE_HOOKS))
def test_a_submodule_hook_registered_or_removed_after_capture_is_refused_naming_it(
    backend: str, when: str, hook: str
) -> None:
    # A graph replays what the submodules' hooks did at capture: one registered since would
    # never run (eager runs it: a doubled output, an activation recorder that records nothing),
    # one removed would still act. ("emulate" re-runs the callable, hooks and all, and so hid it.)
    device = device_of(backend)
    torch.manual_seed(0)
    module = TinyMLP().to(device)
    twin = copy.deepcopy(module)
    register, kind = SUBMODULE_HOOKS[hook]
    handles = [register(m.fc2) for m in (module, twin)] if when == "removed" else []
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    static = [t.clone() for t in runner_of(module).static_inputs]
    if when == "removed":
        handles[0].remove()
    else:
        handles = [register(module.fc2)]
    with pytest.raises(DualgraphError) as info:
        module(torch.randn(4, 8, device=device))
    assert str(info.value).startswith(f"TinyMLP.fc2: {kind} {when} after capture")
    assert all(map(torch.equal, runner_of(module).static_inputs, static))  # refused before
    # The hooks of capture time again: replays train like eager.
    if when == "removed":
        handles[0] = register(module.fc2)
    else:
        handles[0].remove()
    x = torch.randn(4, 8, device=device)
    out, expected = module(x), twin(x)
    backward_of(out)
    backward_of(expected)
    assert_tensors_match(out.detach(), expected.detach(), "output", tolerance(backend))
    assert_grads_match(
        grads_of(parameters_of(module)),
        grads_of(parameters_of(twin)),
        parameter_names(module),
        tolerance(backend),
    )


#: How a refusal names each kind of global hook.
GLOBAL_HOOK_KIND_WORDS = {
    "forward": "forward hook",
    "forward_pre": "forward pre-hook",
    "full_backward": "backward hook",
    "backward_pre": "backward pre-hook",
}
#: A global hook (torch.nn.modules.module's, run in every module's call): what registers it.
GLOBAL_HOOK_REGISTERS: dict[str, tuple[str, Any]] = {
    "forward": ("register_module_forward_hook", _doubles_output),
    "forward_pre": ("register_module_forward_pre_hook", _doubles_input),
    "full_backward": ("register_module_full_backward_hook", _records),
    "backward_pre": ("register_module_full_backward_pre_hook", _records),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("when", ["registered", "removed"])
@pytest.mark.parametrize("hook", sorted(GLOBAL_HOOK_REGISTERS))
def test_a_global_module_hook_registered_or_removed_after_capture_is_refused(
    backend: str, when: str, hook: str
) -> None:
    # Every submodule's call runs the global hooks as its own: a graph replays what they did at
    # capture (a doubling hook registered since never ran inside it on CUDA), and only the
    # submodules' own hook dicts were watched.
    device = device_of(backend)
    module = TinyMLP().to(device)
    register_name, hook_fn = GLOBAL_HOOK_REGISTERS[hook]
    register = getattr(nn.modules.module, register_name)

    def call() -> None:
        module(torch.randn(4, 8, device=device, requires_grad=True))

    handle = register(hook_fn) if when == "removed" else None
    try:
        dgt.make_graphed_callables(
            module, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
        )
        if handle is not None:
            handle.remove()
            handle = None
        else:
            handle = register(hook_fn)
        with pytest.raises(DualgraphError) as info:
            call()
        assert str(info.value).startswith(
            f"TinyMLP: a global {GLOBAL_HOOK_KIND_WORDS[hook]} "
            f"(torch.nn.modules.module.{register_name}: {hook_fn.__qualname__}) {when} "
            "after capture"
        )
        # The global hooks of capture time again: the module replays.
        if handle is not None:
            handle.remove()
            handle = None
        else:
            handle = register(hook_fn)
        call()
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_torchs_flop_counter_around_a_replay_is_no_global_hook_change(backend: str) -> None:
    # FlopCounterMode registers torch's ModuleTracker global hooks while it counts: they only
    # record which module runs, so the replay's results are eager's and the call goes on.
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    with FlopCounterMode(display=False):
        module(torch.randn(4, 8, device=device))
    assert dgt.diagnostics(module).replays == 1


def _triples_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 3


def _triples_input(module: nn.Module, args: Any) -> tuple[torch.Tensor, ...]:
    return (args[0] * 3,)


def _records_too(*args: Any) -> None:
    return None


#: Another hook of each kind, to swap in under the first one's handle.
OTHER_HOOKS = {
    "forward": ("_forward_hooks", _triples_output),
    "forward_pre": ("_forward_pre_hooks", _triples_input),
    "full_backward": ("_backward_hooks", _records_too),
    "backward_pre": ("_backward_pre_hooks", _records_too),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("hook", sorted(SUBMODULE_HOOKS))
def test_a_submodule_hook_replaced_under_its_handle_after_capture_is_refused_naming_it(
    backend: str, hook: str
) -> None:
    # As many hooks as at capture, under the same handle ids, but one is another function
    # (``module._forward_hooks[handle.id] = other``): eager runs the new one, a graph the old.
    device = device_of(backend)
    module = TinyMLP().to(device)
    register, kind = SUBMODULE_HOOKS[hook]
    handle = register(module.fc2)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    attribute, other = OTHER_HOOKS[hook]
    hooks = getattr(module.fc2, attribute)
    original = hooks[handle.id]
    hooks[handle.id] = other
    with pytest.raises(DualgraphError, match=f"^TinyMLP.fc2: {kind} replaced after capture"):
        module(torch.randn(4, 8, device=device))
    hooks[handle.id] = original
    module(torch.randn(4, 8, device=device))  # the hooks of capture time again


def _forward_replaced(module: TinyMLP) -> Callable[[], None]:
    module.fc2.forward = lambda x: x * 2  # what accelerate's hooks do: an instance-level forward
    return lambda: module.fc2.__dict__.pop("forward")


class _DoubledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _class_swapped(module: TinyMLP) -> Callable[[], None]:
    module.fc2.__class__ = _DoubledLinear  # what torch's parametrize does to a module
    return lambda: setattr(module.fc2, "__class__", nn.Linear)


#: How a submodule comes to run another forward than at capture: ``(change, message)``; the
#: change returns what puts it back.
FORWARD_CHANGES = {
    "forward_replaced": (_forward_replaced, r"^TinyMLP\.fc2: its forward was replaced after"),
    "class_swapped": (
        _class_swapped,
        r"^TinyMLP\.fc2: its class was Linear at capture and is _DoubledLinear",
    ),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("change", sorted(FORWARD_CHANGES))
def test_a_submodule_given_another_forward_after_capture_is_refused_naming_it(
    backend: str, change: str
) -> None:
    # Eager runs the new forward; a graph replays the kernels of the one it captured.
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    make_change, message = FORWARD_CHANGES[change]
    put_back = make_change(module)
    with pytest.raises(DualgraphError, match=message):
        module(torch.randn(4, 8, device=device))
    put_back()
    module(torch.randn(4, 8, device=device))  # the forward of capture time again


class _Halved(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parametrization_registered_after_capture_is_refused_as_one(backend: str) -> None:
    # It swaps the submodule's class and moves its weight out of _parameters: the refusal names
    # the parametrization (it blamed an assignment or .to() of the weight).
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    torch.nn.utils.parametrize.register_parametrization(module.fc2, "weight", _Halved())
    with pytest.raises(DualgraphError, match=r"^TinyMLP\.fc2: its class was Linear at capture "):
        module(torch.randn(4, 8, device=device))


class _ScaledWeight(nn.Module):
    """A weight of its own, used by the forward itself (not by a submodule)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _ScaledWeightTripled(_ScaledWeight):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 3


def _parametrize_own_weight(module: nn.Module) -> None:
    torch.nn.utils.parametrize.register_parametrization(module, "weight", _Halved())


def _swap_class(module: nn.Module) -> None:
    module.__class__ = _ScaledWeightTripled


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("change", "now"),
    [(_parametrize_own_weight, "Parametrized_ScaledWeight"), (_swap_class, "_ScaledWeightTripled")],
    ids=["parametrization", "__class__ set"],
)
def test_the_graphed_modules_own_class_changed_after_capture_is_refused_naming_it(
    backend: str, change: Callable[[nn.Module], None], now: str
) -> None:
    # Eager runs the new class's forward (a parametrization's weight, a subclass's forward);
    # the graphed module's forward replayed the one of capture (x * 1 for x * 3), silently.
    device = device_of(backend)
    module = _ScaledWeight().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    change(module)
    with pytest.raises(
        DualgraphError,
        match=rf"^_ScaledWeight: its class was _ScaledWeight at capture and is {now} now",
    ):
        module(torch.randn(4, 8, device=device))


def _classes_with_a_helper() -> tuple[type[nn.Module], type[nn.Module]]:
    """A root class calling a submodule whose forward calls a helper through ``self``: classes
    of their own for each test, which patches them."""

    class Activated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def _act(self, h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._act(self.fc(x))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Activated()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    return Outer, Activated


def _tripled(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * 3


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("patched", "key", "name"),
    [
        ("inner", "forward", "Activated.forward"),
        ("inner", "_act", "Activated._act"),
        ("root", "forward", "Outer.forward"),
    ],
    ids=["a submodule's forward", "a helper it calls through self", "the graphed module's forward"],
)
def test_code_of_a_class_the_forward_runs_patched_after_capture_is_refused_naming_it(
    backend: str, patched: str, key: str, name: str
) -> None:
    # Eager looks up a class's forward and the methods it calls through self on every call
    # (attention patches replace them on the class); the replays ran the code of capture.
    device = device_of(backend)
    outer, inner = _classes_with_a_helper()
    module = outer().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    owner = outer if patched == "root" else inner
    original = vars(owner)[key]
    setattr(owner, key, _tripled)
    with pytest.raises(
        DualgraphError, match=rf"^{name} \(code its forward runs\): was .*{key} at "
    ):
        module(torch.randn(4, 8, device=device))
    setattr(owner, key, original)  # put back: it replays again
    module(torch.randn(4, 8, device=device))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_method_set_on_an_instance_over_its_classs_code_is_refused_naming_it(
    backend: str,
) -> None:
    # self._act(h) then finds the instance's function first: eager runs it, the replays ran
    # the class's code of capture. Deleted again, it replays.
    device = device_of(backend)
    outer, _ = _classes_with_a_helper()
    module = outer().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    module.inner._act = functools.partial(_tripled, module.inner)
    with pytest.raises(
        DualgraphError, match=r"^Outer\.inner\._act: set on the instance after capture"
    ):
        module(torch.randn(4, 8, device=device))
    del module.inner._act
    module(torch.randn(4, 8, device=device))


def _doubles_last(module: nn.Module, *args: Any) -> torch.Tensor:
    return args[-1] * 2  # the output, with or without the kwargs before it


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_submodule_hook_registered_again_with_other_flags_is_refused(backend: str) -> None:
    # The same function, but called with the forward's kwargs now: torch calls it another way.
    device = device_of(backend)
    module = TinyMLP().to(device)
    handle = module.fc2.register_forward_hook(_doubles_last)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    handle.remove()
    handle = module.fc2.register_forward_hook(_doubles_last, with_kwargs=True)
    with pytest.raises(DualgraphError, match=r"^TinyMLP\.fc2: forward hook replaced after capture"):
        module(torch.randn(4, 8, device=device))
    handle.remove()
    module.fc2.register_forward_hook(_doubles_last)  # as at capture, under a new handle: fine
    module(torch.randn(4, 8, device=device))


def _doubles_a_linears_output(module: nn.Module, args: Any, output: Any) -> Any:
    return output * 2 if isinstance(module, nn.Linear) else None


def _doubles_a_linears_input(module: nn.Module, args: Any) -> Any:
    return (args[0] * 2,) if isinstance(module, nn.Linear) else None


_MODULE_HOOKS = torch.nn.modules.module
#: A global module hook (torch runs it on every module's call): ``(register it, the kind)``.
GLOBAL_HOOKS: dict[str, tuple[Callable[[], Any], str]] = {
    "forward": (
        lambda: _MODULE_HOOKS.register_module_forward_hook(_doubles_a_linears_output),
        "forward hook",
    ),
    "forward_pre": (
        lambda: _MODULE_HOOKS.register_module_forward_pre_hook(_doubles_a_linears_input),
        "forward pre-hook",
    ),
    "full_backward": (
        lambda: _MODULE_HOOKS.register_module_full_backward_hook(_records),
        "backward hook",
    ),
    "backward_pre": (
        lambda: _MODULE_HOOKS.register_module_full_backward_pre_hook(_records),
        "backward pre-hook",
    ),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("when", ["registered", "removed"])
@pytest.mark.parametrize("hook", sorted(GLOBAL_HOOKS))
def test_a_global_module_hook_registered_or_removed_after_capture_is_refused_naming_it(
    backend: str, when: str, hook: str
) -> None:
    # Torch runs a global module hook on every module's call, the submodules' inside the graphs
    # too: a graph replays what the global hooks did to them at capture, so one registered since
    # would never run on them (eager's fc1 and fc2 outputs doubled), one removed would still
    # act. ("emulate" re-runs the callable, hooks and all, and so hid it.)
    device = device_of(backend)
    module = TinyMLP().to(device)
    twin = copy.deepcopy(module)
    register, kind = GLOBAL_HOOKS[hook]

    def batch() -> torch.Tensor:  # requiring grad: a full backward hook warns on the root else
        return torch.randn(4, 8, device=device, requires_grad=True)

    handles = [register()] if when == "removed" else []
    try:
        dgt.make_graphed_callables(module, (batch(),), backend=backend)
        static = [t.clone() for t in runner_of(module).static_inputs]
        if when == "removed":
            handles.pop().remove()
        else:
            handles.append(register())
        with pytest.raises(DualgraphError) as info:
            module(batch())
        assert str(info.value).startswith(
            f"TinyMLP: a global {kind} (torch.nn.modules.module.register_module_"
        )
        hook_name = "_records" if "backward" in hook else "_doubles_a_linears_"
        assert f": {hook_name}" in str(info.value)  # the hook, by name
        assert f") {when} after capture" in str(info.value)
        assert all(map(torch.equal, runner_of(module).static_inputs, static))  # refused before
        # The global hooks of capture time again: replays train like eager.
        if when == "removed":
            handles.append(register())
        else:
            handles.pop().remove()
        x = batch()
        out, expected = module(x), twin(x)
        backward_of(out)
        backward_of(expected)
    finally:
        for handle in handles:
            handle.remove()
    assert_tensors_match(out.detach(), expected.detach(), "output", tolerance(backend))
    assert_grads_match(
        grads_of(parameters_of(module)),
        grads_of(parameters_of(twin)),
        parameter_names(module),
        tolerance(backend),
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_global_module_hook_runs_around_the_replay_of_a_module_without_submodules(
    backend: str,
) -> None:
    # It acts on the graphed module's own call only, which runs around the replay: as in eager.
    device = device_of(backend)
    layer = nn.Linear(8, 8).to(device)
    dgt.make_graphed_callables(layer, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    plain = layer(x).detach().clone()
    handle = GLOBAL_HOOKS["forward"][0]()
    try:
        doubled = layer(x).detach().clone()
    finally:
        handle.remove()
    assert_tensors_match(doubled, plain * 2, "output", tolerance(backend))


class FrozenEncoder(nn.Module):
    """A frozen encoder graphed through a method or a function (not as a module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.requires_grad_(False)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)).tanh()


def _graph_through_code(how: str, backend: str) -> tuple[FrozenEncoder, Any]:
    """A frozen encoder and a graphed callable whose code names it: ``encoder.encode``, or a
    function closing over ``encoder``, or over its weight."""
    device = device_of(backend)
    encoder = FrozenEncoder().to(device)
    weight = encoder.fc.weight
    callables = {
        "method": encoder.encode,
        "closure": lambda x: encoder.encode(x) * 2,
        "tensor": lambda x: x @ weight,
    }
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    return encoder, dgt.make_graphed_callables(callables[how], (sample,), backend=backend)


def _assert_encodes_as(
    out: torch.Tensor, encoder: FrozenEncoder, x: torch.Tensor, backend: str, *, scale: float = 1
) -> None:
    """``out`` is ``scale * encoder.encode(x)`` with some dropout mask: an element dropout kept
    is ``tanh(2 fc(x))`` (p = 0.5), one it dropped is 0 (whatever the mask drawn, on any GPU)."""
    kept = out != 0
    assert kept.any() and not kept.all(), "dropout kept all or nothing: no check"
    expected = (encoder.fc(x) * 2).tanh() * scale
    assert_tensors_match(out[kept], expected[kept], "kept outputs", tolerance(backend))


def _move_weight(encoder: FrozenEncoder) -> None:
    encoder.fc.weight.data = torch.randn_like(encoder.fc.weight)  # new memory, same tensor


#: What a graphed method or function's code names may undergo after capture:
#: ``(change, the callables it matters to, the start of the error)``.
CODE_CHANGES: dict[str, tuple[Callable[[FrozenEncoder], Any], tuple[str, ...], str]] = {
    "weight_moved": (_move_weight, ("method", "closure", "tensor"), ".*weight: the"),
    "eval": (lambda encoder: encoder.eval(), ("method", "closure"), ".*: training was True"),
    "half": (lambda encoder: encoder.half(), ("method", "closure"), ".*fc.weight: the"),
    "submodule_hook": (
        lambda encoder: encoder.fc.register_forward_hook(lambda m, i, o: o * 2),
        ("method", "closure"),
        ".*fc: forward hook registered",
    ),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("change", "how"),
    [(change, how) for change, (_, hows, _) in CODE_CHANGES.items() for how in hows],
)
def test_what_a_graphed_method_or_function_names_changed_after_capture_is_refused_naming_it(
    backend: str, change: str, how: str
) -> None:
    # Its graphs read the module's (or tensor's) memory and replay its modes and hooks as at
    # capture; eager would run the changed module. A graphed module refuses the same changes.
    encoder, graphed = _graph_through_code(how, backend)
    make_change, _, message = CODE_CHANGES[change]
    make_change(encoder)
    with pytest.raises(DualgraphError, match=message) as info:
        graphed(torch.randn(4, 8, device=device_of(backend), requires_grad=True))
    assert str(info.value).startswith(f"{graphed.name}: ")  # which callable refused


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["method", "closure", "tensor"])
def test_what_a_graphed_method_or_function_names_may_be_updated_in_place(
    backend: str, how: str
) -> None:
    encoder, graphed = _graph_through_code(how, backend)
    twin = copy.deepcopy(encoder)
    with torch.no_grad():
        encoder.fc.weight.mul_(0.5)  # an EMA step, load_state_dict: in place
        twin.fc.weight.mul_(0.5)
    encoder.eval()
    twin.eval()
    encoder.train()
    twin.train()
    x = torch.randn(4, 8, device=device_of(backend))
    if how == "tensor":
        assert_tensors_match(graphed(x), x @ twin.fc.weight, "output", tolerance(backend))
    else:  # the replay reads the halved weight
        _assert_encodes_as(graphed(x), twin, x, backend, scale=2 if how == "closure" else 1)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["method", "closure", "tensor"])
def test_a_weight_a_graphed_method_or_function_names_changed_before_its_backward_is_refused(
    backend: str, how: str
) -> None:
    # The frozen weight is saved for the input's grad: eager's backward raises after an EMA
    # step between the forward and the backward, a graph would read the new weight.
    encoder, graphed = _graph_through_code(how, backend)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    loss = graphed(x).sum()
    with torch.no_grad():
        encoder.fc.weight.mul_(0.5)
    with pytest.raises(DualgraphError, match=r"weight was modified in place"):
        loss.backward()
    assert x.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_hook_on_the_module_of_a_graphed_method_is_not_a_change(backend: str) -> None:
    # Calling encoder.encode runs no hook of encoder's own (only encoder(...) would).
    encoder, graphed = _graph_through_code("method", backend)
    ran: list[str] = []

    def doubles(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        ran.append("hook")
        return output * 2

    encoder.register_forward_hook(doubles)
    x = torch.randn(4, 8, device=device_of(backend))
    out = graphed(x)
    assert ran == []  # neither refused nor run around the replay
    _assert_encodes_as(out, encoder, x, backend)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_hooks_on_the_graphed_module_itself_may_come_and_go(backend: str) -> None:
    # They run around the replay, through the module's __call__, as in eager.
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    plain = module(x).detach().clone()
    handle = module.register_forward_hook(_doubles_output)
    assert_tensors_match(module(x).detach(), plain * 2, "output", tolerance(backend))
    handle.remove()
    assert_tensors_match(module(x).detach(), plain, "output", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_parameters_updated_in_place_are_seen_by_the_next_replay(backend: str) -> None:
    device = device_of(backend)
    module, other = TinyMLP().to(device), TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    module.load_state_dict(other.state_dict())  # copies in place
    x = torch.randn(4, 8, device=device)
    assert_tensors_match(module(x).detach(), other(x).detach(), "output", tolerance(backend))


# -- copies --------------------------------------------------------------------------------------


def _train_step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    backward_of(out)
    return out.detach().clone()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_deepcopy_of_a_graphed_module_is_an_eager_copy_with_its_own_weights(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    replays = dgt.diagnostics(module).replays
    twin = copy.deepcopy(module)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)  # the copy's weights, not the original's
    reference = TinyMLP().to(device)
    reference.load_state_dict(twin.state_dict())
    x = torch.randn(5, 8, device=device)  # another batch size: only an eager module takes it
    assert_tensors_match(
        _train_step(twin, x), _train_step(reference, x), "copy", tolerance(backend)
    )
    assert all(p.grad is None for p in module.parameters())  # the original saw nothing
    assert dgt.diagnostics(module).replays == replays
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(twin)
    assert "forward" not in twin.__dict__  # the copy dropped what was left of the graphing
    assert dgt.diagnostics(module).backend == backend  # the original still replays
    module(torch.randn(4, 8, device=device))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_copy_of_a_graphed_module_can_be_graphed_on_its_own(backend: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    twin = copy.deepcopy(module)
    dgt.make_graphed_callables(twin, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    assert_tensors_match(twin(x).detach(), module(x).detach(), "output", tolerance(backend))
    assert dgt.restore(twin) is twin and "forward" not in twin.__dict__


class _ScaledDropout(nn.Module):
    """Reads its own mode and a plain attribute in its forward, with no submodule to tell."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x @ self.weight, 0.5, self.training) * self.scale


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_shallow_copy_of_a_graphed_module_runs_eagerly_in_its_own_mode(backend: str) -> None:
    """copy.copy shares the weights, as torch's does; its forward was the one bound to the
    original, replaying in the original's training mode with its scale: silently dropout in
    eval, and the copy's scale ignored."""
    device = device_of(backend)
    module = _ScaledDropout().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    shallow = copy.copy(module)
    assert shallow.weight is module.weight
    x = torch.randn(4, 8, device=device)
    shallow.eval()
    with torch.no_grad():
        assert_tensors_match(shallow(x), x @ module.weight, "eval", tolerance(backend))
    shallow.train()
    shallow.scale = 3.0
    torch.manual_seed(1)
    out = shallow(x)
    torch.manual_seed(1)
    assert_tensors_match(out, _ScaledDropout.forward(shallow, x), "scaled", tolerance(backend))
    assert dgt.diagnostics(module).replays == 0  # the original replayed for none of them
    module(x)
    assert dgt.diagnostics(module).replays == 1  # and still replays


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_deepcopy_of_a_model_with_graphed_blocks_evaluates_like_it(backend: str) -> None:
    """The EMA / eval-snapshot pattern: copy the model whose blocks are graphed."""
    device = device_of(backend)
    encoder = VisionEncoder(image_size=16, patch_size=8, dim=16, depth=2, heads=2).to(device)
    samples = tuple(
        (torch.randn(2, 4, 16, device=device, requires_grad=True),) for _ in encoder.blocks
    )
    dgt.make_graphed_callables(tuple(encoder.blocks), samples, backend=backend)
    snapshot = copy.deepcopy(encoder)
    images = torch.randn(2, 3, 16, 16, device=device)
    with torch.no_grad():
        expected = encoder(images)["hidden"].clone()
        assert_tensors_match(snapshot(images)["hidden"], expected, "hidden", tolerance(backend))
        for p in snapshot.parameters():
            p.add_(0.5)
        assert not torch.allclose(snapshot(images)["hidden"], expected)
        assert_tensors_match(encoder(images)["hidden"], expected, "original", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickled_graphed_module_loads_as_an_eager_module(backend: str, how: str) -> None:
    device = device_of(backend)
    module = TinyMLP().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(module))
    else:
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        assert_tensors_match(loaded(x), TinyMLP.forward(module, x), "output", tolerance(backend))
    with pytest.raises(DualgraphError, match="was not made by"):
        dgt.diagnostics(loaded)
    assert "forward" not in loaded.__dict__


def double_it(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_of_a_graphed_function_is_an_eager_callable(backend: str, how: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        double_it, (torch.ones(3, device=device),), backend=backend
    )
    copied = {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda g: pickle.loads(pickle.dumps(g)),
    }[how](graphed)
    assert isinstance(copied, dgt.EagerCallable)
    x = torch.randn(3, device=device)
    out = copied(x)
    assert out.data_ptr() not in {t.data_ptr() for t in graphed.static_outputs}
    assert_tensors_match(out, x * 2, "output")
    with pytest.raises(DualgraphError, match=r"args\[0\]: expected float32\[3\]"):
        copied(torch.ones(4, device=device))  # still checked against the samples


# -- threads -------------------------------------------------------------------------------------


def _hold_a_call(graphed: Any, x: torch.Tensor) -> tuple[threading.Thread, threading.Event]:
    """Start ``graphed(x)`` in another thread; return once that call is inside its replay."""
    entered, release = threading.Event(), threading.Event()
    replay = graphed._replay_forward

    def held_replay(grad_enabled: bool) -> None:
        entered.set()
        assert release.wait(30)
        replay(grad_enabled)

    graphed._replay_forward = held_replay
    thread = threading.Thread(target=graphed, args=(x,))
    thread.start()
    assert entered.wait(30)
    graphed._replay_forward = replay  # later calls replay as usual
    return thread, release


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_call_while_another_thread_is_inside_the_same_callable_is_refused(backend: str) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        double_it, (torch.ones(3, device=device),), backend=backend
    )
    thread, release = _hold_a_call(graphed, torch.ones(3, device=device))
    try:
        with pytest.raises(DualgraphError) as info:
            graphed(torch.full((3,), 5.0, device=device))
    finally:
        release.set()
        thread.join(30)
    assert str(info.value).startswith(
        "double_it: called while another thread is running it; a graphed callable has one set "
        "of static buffers"
    )
    assert_tensors_match(graphed.static_inputs[0], torch.ones(3, device=device), "static input")
    x = torch.randn(3, device=device)
    assert_tensors_match(graphed(x), x * 2, "a later call")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_backward_while_another_thread_is_inside_the_forward_is_refused(backend: str) -> None:
    device = device_of(backend)
    sample = torch.ones(3, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(double_it, (sample,), backend=backend)
    x = torch.randn(3, device=device, requires_grad=True)
    out = graphed(x)
    thread, release = _hold_a_call(graphed, torch.ones(3, device=device))
    try:
        with pytest.raises(DualgraphError, match="called while another thread is running it"):
            out.sum().backward()
    finally:
        release.set()
        thread.join(30)
    assert x.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_separate_graphed_callables_work_in_separate_threads(backend: str) -> None:
    device = device_of(backend)
    # Captured separately: callables captured together share a memory pool and must replay in
    # their capture order, which two threads do not keep.
    graphed = [
        dgt.make_graphed_callables(fn, (torch.ones(64, device=device),), backend=backend)
        for fn in (double_it, torch.neg)
    ]
    wrong: list[str] = []

    def hammer(fn: Any, expect: Callable[[torch.Tensor], torch.Tensor], label: str) -> None:
        for _ in range(300):
            x = torch.randn(64, device=device)
            if not torch.equal(fn(x), expect(x)):
                wrong.append(label)

    threads = [
        threading.Thread(target=hammer, args=(graphed[0], double_it, "double")),
        threading.Thread(target=hammer, args=(graphed[1], torch.neg, "neg")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert wrong == []


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_one_graphed_callable_hammered_from_two_threads_never_returns_a_wrong_result(
    backend: str,
) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        double_it, (torch.ones(64, device=device),), backend=backend, clone_outputs=True
    )
    results = {"right": 0, "refused": 0, "wrong": 0}
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(500):
            x = torch.randn(64, device=device)
            try:
                out = graphed(x)
            except DualgraphError:
                outcome = "refused"
            else:
                outcome = "right" if torch.equal(out, x * 2) else "wrong"
            with lock:
                results[outcome] += 1

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results["wrong"] == 0 and results["right"] + results["refused"] == 1000


# -- param_grads="in_graph" and "auto": the .grad contract ---------------------------------------

#: The modes whose backward adds parameter grads into ``.grad`` itself.
IN_GRAPH_MODES = ["in_graph", "auto"]


def _in_graph_pair(backend: str, param_grads: str = "in_graph") -> tuple[nn.Linear, nn.Linear]:
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    dgt.make_graphed_callables(
        layer, (torch.randn(2, 4, device=device),), backend=backend, param_grads=param_grads
    )
    return layer, twin


def _both(layer: nn.Module, twin: nn.Module, backend: str) -> None:
    x = torch.randn(2, 4, device=device_of(backend))
    backward_of(layer(x))
    backward_of(twin(x))
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        ["weight", "bias"],
        tolerance(backend),
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", IN_GRAPH_MODES)
def test_in_graph_grads_accumulate_in_place_like_eager(backend: str, param_grads: str) -> None:
    layer, twin = _in_graph_pair(backend, param_grads)
    _both(layer, twin, backend)
    grad = layer.weight.grad
    _both(layer, twin, backend)
    assert layer.weight.grad is grad  # eager adds into the same .grad tensor
    layer.zero_grad(set_to_none=False)
    twin.zero_grad(set_to_none=False)
    _both(layer, twin, backend)
    assert layer.weight.grad is grad


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", IN_GRAPH_MODES)
@pytest.mark.parametrize("held", ["tensor", "view"])
def test_in_graph_grads_after_zero_grad_set_to_none_are_new_tensors(
    backend: str, param_grads: str, held: str
) -> None:
    layer, twin = _in_graph_pair(backend, param_grads)
    _both(layer, twin, backend)
    old = layer.weight.grad if held == "tensor" else layer.weight.grad[0]
    old_values = old.clone()
    layer.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    _both(layer, twin, backend)
    assert layer.weight.grad is not old
    assert_tensors_match(old, old_values, "the .grad the user held")
    _both(layer, twin, backend)  # accumulates into the new tensor
    assert_tensors_match(old, old_values, "the .grad the user held")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", IN_GRAPH_MODES)
def test_in_graph_grads_reuse_their_buffer_when_nobody_holds_the_old_grad(
    backend: str, param_grads: str
) -> None:
    layer, twin = _in_graph_pair(backend, param_grads)
    _both(layer, twin, backend)
    pointer = layer.weight.grad.data_ptr()
    layer.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    _both(layer, twin, backend)
    assert layer.weight.grad.data_ptr() == pointer  # no copy: the graph's buffer, free again


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", IN_GRAPH_MODES)
def test_in_graph_grads_add_into_a_grad_tensor_the_user_set(backend: str, param_grads: str) -> None:
    layer, twin = _in_graph_pair(backend, param_grads)
    mine = torch.ones_like(layer.weight)
    layer.weight.grad = mine
    twin.weight.grad = torch.ones_like(twin.weight)
    _both(layer, twin, backend)
    assert layer.weight.grad is mine  # eager adds into the user's tensor
    _both(layer, twin, backend)
    assert layer.weight.grad is mine


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", IN_GRAPH_MODES)
@pytest.mark.parametrize("alias", ["detach", "data"])
def test_in_graph_grads_add_into_a_grad_that_aliases_their_buffer(
    backend: str, param_grads: str, alias: str
) -> None:
    layer, twin = _in_graph_pair(backend, param_grads)
    _both(layer, twin, backend)
    for module in (layer, twin):
        for param in module.parameters():
            param.grad = param.grad.detach() if alias == "detach" else param.grad.data
    mine = layer.weight.grad
    _both(layer, twin, backend)
    _both(layer, twin, backend)
    assert layer.weight.grad is mine  # eager adds into it in place


def _lay_out_otherwise(layer: nn.Linear, how: str) -> None:
    if how == "assigned":
        layer.weight.grad = layer.weight.grad.t()
    else:  # the same .grad object, read with other strides from now on
        layer.weight.grad.t_()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["assigned", "in_place"])
def test_in_graph_grads_refuse_a_grad_in_their_buffer_laid_out_otherwise(
    backend: str, how: str
) -> None:
    device = device_of(backend)
    layer = nn.Linear(3, 3).to(device)  # square: a transposed view is a valid .grad
    x = torch.randn(2, 3, device=device)
    dgt.make_graphed_callables(layer, (x,), backend=backend, param_grads="in_graph")
    backward_of(layer(x))
    _lay_out_otherwise(layer, how)
    values = [p.grad.clone() for p in layer.parameters()]
    with pytest.raises(DualgraphError, match=r"Linear\.weight: \.grad shares memory"):
        backward_of(layer(x))
    assert_grads_match(grads_of(list(layer.parameters())), values, ["weight", "bias"])


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["assigned", "in_place"])
def test_auto_adds_into_a_grad_in_its_buffer_laid_out_otherwise_as_eager(
    backend: str, how: str
) -> None:
    # Refused under "auto" too, where eager adds into the transposed .grad in place: "auto"
    # hands such a backward's grads to autograd, whose add into it is eager's.
    device = device_of(backend)
    layer, twin = nn.Linear(3, 3).to(device), nn.Linear(3, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    dgt.make_graphed_callables(layer, (torch.randn(2, 3, device=device),), backend=backend)
    inputs = [torch.randn(2, 3, device=device) for _ in range(4)]
    for module in (layer, twin):
        backward_of(module(inputs[0]))
        _lay_out_otherwise(module, how)
        module.kept = module.weight.grad  # type: ignore[assignment]
    for x in inputs[1:]:
        for module in (layer, twin):
            backward_of(module(x))
        assert_grads_match(
            grads_of(parameters_of(layer)),
            grads_of(parameters_of(twin)),
            ["weight", "bias"],
            tolerance(backend),
        )
    assert layer.weight.grad is layer.kept and twin.weight.grad is twin.kept
    assert layer.weight.grad.stride() == twin.weight.grad.stride() == (1, 3)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_refuses_a_grad_shared_by_two_parameters_beside_one_laid_out_otherwise(
    backend: str,
) -> None:
    # Handing the grads to autograd for the transposed .grad would let it add the two shared
    # ones in its own order: still refused, before anything changed.
    device = device_of(backend)
    model = nn.Sequential(*(nn.Linear(3, 3, bias=False) for _ in range(3))).to(device)
    x = torch.randn(2, 3, device=device)
    dgt.make_graphed_callables(model, (x,), backend=backend)
    backward_of(model(x))
    model[0].weight.grad.t_()
    model[1].weight.grad = model[2].weight.grad = torch.zeros(3, 3, device=device)
    values = grads_of(parameters_of(model))
    with pytest.raises(DualgraphError, match=r"^Sequential: Sequential\.0\.weight: \.grad shares"):
        backward_of(model(x))
    assert_grads_match(grads_of(parameters_of(model)), values, ["0", "1", "2"])


class _TwoSquares(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3, bias=False)
        self.second = nn.Linear(3, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _hand_grads_over(module: _TwoSquares, how: str) -> None:
    """Give ``second`` the ``.grad`` tensor ``first`` had (after a backward that made it)."""
    first, second = module.first.weight, module.second.weight
    if how == "moved":  # first gets a new one at the next backward
        second.grad, first.grad = first.grad, None
    else:
        first.grad, second.grad = second.grad, first.grad


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["moved", "swapped"])
def test_auto_adds_into_a_grad_another_parameter_had_as_eager(backend: str, how: str) -> None:
    # A .grad that is the tensor another parameter's backward made (its graph grad buffer,
    # handed out as its .grad) was refused as memory shared between two .grad tensors, though
    # eager adds into it once, as into any .grad: "auto" now hands such a backward's grads to
    # autograd (each grad buffer put back after), "in_graph" says what it found.
    device = device_of(backend)
    graphed, twin = _TwoSquares().to(device), _TwoSquares().to(device)
    twin.load_state_dict(graphed.state_dict())
    dgt.make_graphed_callables(graphed, (torch.randn(2, 3, device=device),), backend=backend)
    inputs = [torch.randn(2, 3, device=device) for _ in range(4)]
    kept = []
    for module in (graphed, twin):
        backward_of(module(inputs[0]))
        _hand_grads_over(module, how)
        kept.append(module.second.weight.grad)
    for x in inputs[1:]:
        for module in (graphed, twin):
            backward_of(module(x))
        assert_grads_match(
            grads_of(parameters_of(graphed)),
            grads_of(parameters_of(twin)),
            ["first", "second"],
            tolerance(backend),
        )
    assert graphed.second.weight.grad is kept[0] and twin.second.weight.grad is kept[1]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", ["moved", "swapped"])
def test_in_graph_refuses_a_grad_another_parameter_had_naming_it(backend: str, how: str) -> None:
    device = device_of(backend)
    graphed = _TwoSquares().to(device)
    x = torch.randn(2, 3, device=device)
    dgt.make_graphed_callables(graphed, (x,), backend=backend, param_grads="in_graph")
    backward_of(graphed(x))
    _hand_grads_over(graphed, how)
    values = grads_of(parameters_of(graphed))
    with pytest.raises(
        DualgraphError,
        match=r"^_TwoSquares: _TwoSquares\.(first|second)\.weight: \.grad shares memory with the "
        r"graph's "
        r"grad buffer of another parameter .* set \.grad to a clone of it, or capture with "
        r"param_grads='auto'",
    ):
        backward_of(graphed(x))
    assert_grads_match(grads_of(parameters_of(graphed)), values, ["first", "second"])


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_grads_refuse_torch_autograd_grad(backend: str) -> None:
    device = device_of(backend)
    layer = nn.Linear(4, 3).to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(layer, (sample,), backend=backend, param_grads="in_graph")
    x = torch.randn(2, 4, device=device, requires_grad=True)
    with pytest.raises(DualgraphError, match="this backward leaves the parameters out"):
        torch.autograd.grad(layer(x).sum(), x)
    assert layer.weight.grad is None and layer.bias.grad is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_grads_cannot_refuse_a_backward_that_asks_for_parameters_only(
    backend: str,
) -> None:
    # README: the parameters are no inputs of the replay's node, so such a backward never runs
    # it (nothing of dualgraph runs to refuse it): torch's own error, None with allow_unused,
    # and backward(inputs=params) leaves .grad be. Pinned: a DualgraphError here would be better.
    layer, _ = _in_graph_pair(backend)
    loss = loss_of(layer(torch.randn(2, 4, device=device_of(backend))))
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph") as info:
        torch.autograd.grad(loss, [layer.weight], retain_graph=True)
    assert not isinstance(info.value, DualgraphError)
    assert torch.autograd.grad(loss, [layer.weight], allow_unused=True, retain_graph=True) == (
        None,
    )
    loss.backward(inputs=[layer.weight, layer.bias])
    assert layer.weight.grad is None and layer.bias.grad is None
    backward_of(layer(torch.randn(2, 4, device=device_of(backend))))  # a plain one still works
    assert layer.weight.grad is not None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("hook", ["tensor_hook", "post_accumulate_grad_hook"])
def test_in_graph_grads_refuse_parameter_hooks_registered_after_capture(
    backend: str, hook: str
) -> None:
    layer, _ = _in_graph_pair(backend)
    if hook == "tensor_hook":
        layer.bias.register_hook(lambda grad: grad * 2)
    else:
        layer.bias.register_post_accumulate_grad_hook(lambda param: None)
    with pytest.raises(DualgraphError) as info:
        backward_of(layer(torch.randn(2, 4, device=device_of(backend))))
    assert str(info.value).startswith("Linear: Linear.bias has a grad hook")
    assert layer.bias.grad is None


def _accumulate_grad_node(param: torch.Tensor) -> Any:
    """A parameter's ``AccumulateGrad`` node, found as Megatron-LM's DDP finds it."""
    return param.expand_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("hook", ["prehook", "hook"])
def test_in_graph_grads_refuse_hooks_on_a_parameters_accumulate_grad_node(
    backend: str, hook: str
) -> None:
    # The parameters are no inputs of the replay's node: their AccumulateGrad nodes never run.
    layer, _ = _in_graph_pair(backend)
    backward_of(layer(torch.randn(2, 4, device=device_of(backend))))
    grads = grads_of(parameters_of(layer))
    node = _accumulate_grad_node(layer.bias)  # held, as Megatron-LM holds it
    if hook == "prehook":
        handle = node.register_prehook(lambda grads: None)
    else:
        handle = node.register_hook(lambda grads_in, grads_out: None)
    with pytest.raises(DualgraphError) as info:
        backward_of(layer(torch.randn(2, 4, device=device_of(backend))))
    assert str(info.value).startswith("Linear: Linear.bias's AccumulateGrad node has a hook")
    assert_grads_match(grads_of(parameters_of(layer)), grads, ["weight", "bias"], None)
    handle.remove()  # a node kept without hooks is no reason to refuse, and neither is none
    backward_of(layer(torch.randn(2, 4, device=device_of(backend))))
    del node
    backward_of(layer(torch.randn(2, 4, device=device_of(backend))))


# -- param_grads="auto": the path each backward takes -------------------------------------------


def _auto_pair(backend: str) -> tuple[TinyMLP, TinyMLP]:
    """A ``TinyMLP`` graphed with the default ``param_grads="auto"``, and its eager twin."""
    device = device_of(backend)
    mlp, twin = TinyMLP().to(device), TinyMLP().to(device)
    twin.load_state_dict(mlp.state_dict())
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend)
    assert runner_of(mlp).plan.params.mode == "auto"
    return mlp, twin


def _through_autograd(module: nn.Module) -> int:
    return dgt.diagnostics(module).param_grads_through_autograd


def _grads_in_graph_buffers(module: nn.Module) -> bool:
    accumulators = runner_of(module).plan.params.accumulators
    return all(p.grad is a for p, a in zip(module.parameters(), accumulators, strict=True))


def _assert_same_grads(mlp: nn.Module, twin: nn.Module, backend: str) -> None:
    assert_grads_match(
        grads_of(parameters_of(mlp)),
        grads_of(parameters_of(twin)),
        parameter_names(mlp),
        tolerance(backend),
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_adds_the_grads_of_a_plain_backward_into_grad_without_autograd(
    backend: str,
) -> None:
    mlp, twin = _auto_pair(backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (mlp, twin)]
    for step in range(4):
        for _ in range(2):  # grads accumulate over two replays
            x = torch.randn(4, 8, device=device_of(backend))
            backward_of(mlp(x))
            backward_of(twin(x))
            _assert_same_grads(mlp, twin, backend)
        assert _grads_in_graph_buffers(mlp)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=step % 2 == 0)
        assert_grads_match(
            [p.detach() for p in mlp.parameters()],
            [p.detach() for p in twin.parameters()],
            parameter_names(mlp),
            tolerance(backend),
        )
    assert _through_autograd(mlp) == 0


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("wrt", ["parameters", "parameters_and_input", "allow_unused"])
def test_auto_gives_torch_autograd_grad_the_parameter_grads(backend: str, wrt: str) -> None:
    mlp, twin = _auto_pair(backend)
    stray = torch.zeros(3, device=device_of(backend), requires_grad=True)  # used by neither
    kept = []
    for _ in range(2):
        x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
        results = []
        for module in (mlp, twin):
            x_here = x.detach().clone().requires_grad_()
            targets = list(module.parameters())
            if wrt == "parameters_and_input":
                targets.append(x_here)
            if wrt == "allow_unused":
                targets.append(stray)
            results.append(
                torch.autograd.grad(
                    loss_of(module(x_here)), targets, allow_unused=wrt == "allow_unused"
                )
            )
        graphed, eager = results
        names = [f"grad {i}" for i in range(len(eager))]
        assert_grads_match(list(graphed), list(eager), names, tolerance(backend))
        kept.append((graphed, [g if g is None else g.clone() for g in graphed]))
    for graphed, values in kept:  # never a buffer that a later replay overwrote
        assert_grads_match(list(graphed), values, [f"kept grad {i}" for i in range(len(values))])
    assert all(p.grad is None for p in mlp.parameters())  # torch.autograd.grad leaves .grad be
    assert _through_autograd(mlp) == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_backward_with_inputs_accumulates_only_those(backend: str) -> None:
    mlp, twin = _auto_pair(backend)
    for _ in range(2):
        x = torch.randn(4, 8, device=device_of(backend))
        loss_of(mlp(x)).backward(inputs=[mlp.fc1.weight, mlp.fc2.bias])
        loss_of(twin(x)).backward(inputs=[twin.fc1.weight, twin.fc2.bias])
        _assert_same_grads(mlp, twin, backend)
    assert mlp.fc1.bias.grad is None and mlp.fc2.weight.grad is None
    backward_of(mlp(x))  # a plain backward after them: in-graph again, same .grad tensors
    backward_of(twin(x))
    _assert_same_grads(mlp, twin, backend)
    assert _through_autograd(mlp) == 2


def _double(grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("hook", ["tensor_hook", "post_accumulate_grad_hook", "multi_grad_hook"])
def test_auto_runs_parameter_hooks_registered_after_capture(backend: str, hook: str) -> None:
    mlp, twin = _auto_pair(backend)
    x = torch.randn(4, 8, device=device_of(backend))
    backward_of(mlp(x))  # in graph: .grad is the graph's buffer when the hook comes
    backward_of(twin(x))
    grads = [p.grad for p in mlp.parameters()]
    calls: dict[str, list[torch.Tensor]] = {"graphed": [], "eager": []}
    handles = []
    for module, seen in ((mlp, calls["graphed"]), (twin, calls["eager"])):
        if hook == "tensor_hook":
            handles.append(module.fc1.bias.register_hook(_double))
        elif hook == "post_accumulate_grad_hook":
            handles.append(
                module.fc2.weight.register_post_accumulate_grad_hook(
                    lambda param, seen=seen: seen.append(param.grad.clone())
                )
            )
        else:
            handles.append(
                torch.autograd.graph.register_multi_grad_hook(
                    (module.fc1.weight, module.fc2.bias),
                    lambda grads, seen=seen: seen.extend(g.clone() for g in grads),
                )
            )
    for _ in range(2):
        x = torch.randn(4, 8, device=device_of(backend))
        backward_of(mlp(x))
        backward_of(twin(x))
        _assert_same_grads(mlp, twin, backend)
    assert _through_autograd(mlp) == 2
    # autograd added into the same .grad tensors, as in eager (the graph's accumulators, which
    # those backwards borrowed and gave back)
    assert all(p.grad is grad for p, grad in zip(mlp.parameters(), grads, strict=True))
    assert len(calls["graphed"]) == len(calls["eager"])  # once per replay, as in eager
    names = [f"hook call {i}" for i in range(len(calls["eager"]))]
    assert_grads_match(calls["graphed"], calls["eager"], names, tolerance(backend))
    for handle in handles:
        handle.remove()
    backward_of(mlp(x))  # no hook left: in graph again
    backward_of(twin(x))
    _assert_same_grads(mlp, twin, backend)
    assert _through_autograd(mlp) == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_hands_hooks_on_a_parameters_accumulate_grad_node_the_grads(backend: str) -> None:
    # Megatron-LM's DDP: a pre-hook on the node reads (and may change) the grad coming in,
    # and the node's post hook runs after it is added.
    mlp, twin = _auto_pair(backend)
    backward_of(mlp(torch.randn(4, 8, device=device_of(backend))))  # in graph before the hooks
    calls: dict[str, list[torch.Tensor]] = {"graphed": [], "eager": []}
    nodes, handles = [], []
    for module, seen in ((mlp, calls["graphed"]), (twin, calls["eager"])):
        node = _accumulate_grad_node(module.fc1.weight)
        handles.append(
            node.register_prehook(lambda grads, seen=seen: (seen.append(grads[0].clone()), None)[1])
        )
        handles.append(
            node.register_hook(lambda grads_in, grads_out, seen=seen: seen.append(grads_out[0] * 1))
        )
        nodes.append(node)
    twin.load_state_dict(mlp.state_dict())
    for module in (mlp, twin):
        module.zero_grad()
    for _ in range(2):
        x = torch.randn(4, 8, device=device_of(backend))
        backward_of(mlp(x))
        backward_of(twin(x))
        _assert_same_grads(mlp, twin, backend)
    assert len(calls["graphed"]) == len(calls["eager"]) == 4
    names = [f"hook call {i}" for i in range(4)]
    assert_grads_match(calls["graphed"], calls["eager"], names, tolerance(backend))
    assert _through_autograd(mlp) == 2
    for handle in handles:
        handle.remove()
    backward_of(mlp(torch.randn(4, 8, device=device_of(backend))))  # kept, unhooked: in graph
    assert _through_autograd(mlp) == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_steps_an_optimizer_applied_in_backward_after_capture(backend: str) -> None:
    with warnings.catch_warnings():  # the package imports scripted optimizers (deprecated)
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import _apply_optimizer_in_backward

    mlp, twin = _auto_pair(backend)
    for module in (mlp, twin):
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    for _ in range(2):
        x = torch.randn(4, 8, device=device_of(backend))
        backward_of(mlp(x))
        backward_of(twin(x))
        for name, param, eager in zip(
            parameter_names(mlp), mlp.parameters(), twin.parameters(), strict=True
        ):
            assert_tensors_match(param.detach(), eager.detach(), name, tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_checks_parameter_grads_for_nan_in_anomaly_mode(backend: str) -> None:
    mlp, twin = _auto_pair(backend)
    with torch.autograd.set_detect_anomaly(True):
        x = torch.randn(4, 8, device=device_of(backend))
        backward_of(mlp(x))
        backward_of(twin(x))
        _assert_same_grads(mlp, twin, backend)
        assert _through_autograd(mlp) == 1  # anomaly mode checks what autograd hands on
        nan = torch.full((4, 8), float("nan"), device=device_of(backend))
        for module in (twin, mlp):
            with warnings.catch_warnings():  # anomaly mode warns with the forward's traceback
                warnings.simplefilter("ignore")
                with pytest.raises(RuntimeError, match="returned nan values"):
                    backward_of(module(nan))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_refuses_a_backward_in_anomaly_mode_before_touching_grad(backend: str) -> None:
    # Eager's anomaly mode raises at the first backward node that returns NaN, before any .grad
    # is added to; "in_graph" adds the parameter grads into .grad inside the graph, where
    # nothing can check them (on CUDA a NaN went into .grad silently).
    device = device_of(backend)
    mlp, twin = TinyMLP().to(device), TinyMLP().to(device)
    twin.load_state_dict(mlp.state_dict())
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend, param_grads="in_graph")
    x = torch.randn(4, 8, device=device)
    backward_of(mlp(x))
    backward_of(twin(x))
    kept = [p.grad.clone() for p in mlp.parameters()]
    out = mlp(x)
    with torch.autograd.set_detect_anomaly(True), pytest.raises(DualgraphError, match="anomaly"):
        backward_of(out)
    assert all(torch.equal(p.grad, k) for p, k in zip(mlp.parameters(), kept, strict=True))
    backward_of(mlp(x))  # out of anomaly mode, as before
    backward_of(twin(x))
    _assert_same_grads(mlp, twin, backend)


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")  # eager's too
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_under_create_graph_hands_the_grads_to_autograd_as_eager_does(backend: str) -> None:
    mlp, twin = _auto_pair(backend)
    first = {}
    for step in range(2):
        x = torch.randn(4, 8, device=device_of(backend))
        for name, module in (("graphed", mlp), ("eager", twin)):
            loss_of(module(x)).backward(create_graph=True)
            if step == 0:
                first[name] = module.fc1.weight.grad
        _assert_same_grads(mlp, twin, backend)
        for ours, theirs in zip(mlp.parameters(), twin.parameters(), strict=True):
            # eager: .grad is a graph of its own under create_graph, summed out of place
            assert ours.grad.requires_grad == theirs.grad.requires_grad
    assert (mlp.fc1.weight.grad is first["graphed"]) == (twin.fc1.weight.grad is first["eager"])
    assert _through_autograd(mlp) == 2


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_refuses_create_graph_before_touching_grad(backend: str) -> None:
    layer, _ = _in_graph_pair(backend)
    with pytest.raises(DualgraphError, match=r"Linear: .*create_graph=True"):
        loss_of(layer(torch.randn(2, 4, device=device_of(backend)))).backward(create_graph=True)
    assert layer.weight.grad is None and layer.bias.grad is None


def _square_pair(backend: str, param_grads: str) -> tuple[nn.Sequential, nn.Sequential]:
    """Two bias-free square layers (their grads have one shape), graphed, and an eager twin."""
    device = device_of(backend)
    net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    net = net.to(device)
    twin = copy.deepcopy(net)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(net, (sample,), backend=backend, param_grads=param_grads)
    return net, twin


def _share_one_grad(module: nn.Module) -> None:
    shared = torch.ones_like(module[0].weight)
    module[0].weight.grad = shared  # eager adds both layers' grads into it, one after the other
    module[2].weight.grad = shared


def _sparse_grad(module: nn.Module) -> None:
    module[0].weight.grad = torch.ones_like(module[0].weight).to_sparse()  # eager: dense after


def _grad_in_another_grad(module: nn.Module) -> None:
    module[2].weight.grad = module[0].weight.grad  # the same tensor, which accumulates twice


def _wider_grad(module: nn.Module) -> None:
    # eager adds float32 grads into it in float64; copied into a float32 buffer, it would round
    weight = module[0].weight
    weight.grad_dtype = None  # any dtype
    weight.grad = weight.grad.double()


SHARED_GRADS = {"shared": _share_one_grad, "another_parameters_grad": _grad_in_another_grad}

#: ``param.grad_dtype`` (a ``.grad`` of another dtype than its parameter's) is newer than torch 2.8.
needs_grad_dtype = pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="needs param.grad_dtype (torch >= 2.9)"
)


def _square_step(net: nn.Module, twin: nn.Module, backend: str) -> None:
    x = torch.randn(2, 4, device=device_of(backend))
    for module in (net, twin):
        loss_of(module(x)).backward()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_adds_into_a_sparse_grad_through_autograd_as_eager_does(backend: str) -> None:
    net, twin = _square_pair(backend, "auto")
    _square_step(net, twin, backend)
    for module in (net, twin):
        _sparse_grad(module)
    for _ in range(2):
        _square_step(net, twin, backend)
        for ours, theirs in zip(net.parameters(), twin.parameters(), strict=True):
            assert ours.grad.layout == theirs.grad.layout == torch.strided
            assert_tensors_match(ours.grad, theirs.grad, "grad", tolerance(backend))
    assert _through_autograd(net) == 1  # then .grad is dense again: in graph


@needs_grad_dtype
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("when", ["grad_set_after_a_step", "grad_dtype_set_before"])
def test_auto_adds_into_a_grad_of_another_dtype_through_autograd_as_eager_does(
    backend: str, when: str
) -> None:
    # e.g. float32 grads of low-precision weights: eager adds in the .grad's dtype, and makes a
    # new .grad of the grad_dtype; a float32 accumulator would round them, or torch refuse it.
    net, twin = _square_pair(backend, "auto")
    if when == "grad_dtype_set_before":
        for module in (net, twin):
            module[0].weight.grad_dtype = torch.float64
    _square_step(net, twin, backend)
    if when == "grad_set_after_a_step":
        for module in (net, twin):
            _wider_grad(module)
    for _ in range(2):
        _square_step(net, twin, backend)
        for ours, theirs in zip(net.parameters(), twin.parameters(), strict=True):
            assert ours.grad.dtype == theirs.grad.dtype
            assert_tensors_match(ours.grad, theirs.grad, "grad", tolerance(backend))
    assert net[0].weight.grad.dtype == torch.float64
    assert _through_autograd(net) == 3 - (when == "grad_set_after_a_step")


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    ("param_grads", "kind"),
    [("in_graph", "sparse"), pytest.param("in_graph", "another_dtype", marks=needs_grad_dtype)]
    + [(mode, kind) for mode in IN_GRAPH_MODES for kind in SHARED_GRADS],
)
def test_a_grad_the_graphs_cannot_add_into_as_eager_is_refused_naming_it(
    backend: str, param_grads: str, kind: str
) -> None:
    net, _ = _square_pair(backend, param_grads)
    loss_of(net(torch.randn(2, 4, device=device_of(backend)))).backward()
    changes = {"sparse": _sparse_grad, "another_dtype": _wider_grad, **SHARED_GRADS}
    changes[kind](net)
    before = [p.grad.to_dense().clone() for p in net.parameters()]
    with pytest.raises(
        DualgraphError, match=r"Sequential: Sequential\.[02]\.weight: \.grad "
    ) as info:
        loss_of(net(torch.randn(2, 4, device=device_of(backend)))).backward()
    found = {  # what the message says it found, against what it expected
        "sparse": ".grad is torch.sparse_coo (expected torch.strided)",
        "another_dtype": ".grad is float64, the parameter float32",
    }
    if kind in found:
        assert found[kind] in str(info.value)
    for param, values in zip(net.parameters(), before, strict=True):
        assert_tensors_match(param.grad.to_dense(), values, "a .grad the refused backward kept")


@needs_grad_dtype
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_in_graph_refuses_a_grad_dtype_saying_to_clear_it_not_the_grad(backend: str) -> None:
    """Setting ``.grad`` to ``None`` does not help there (eager still makes a ``.grad`` of the
    grad_dtype): the refusal says what does."""
    net, _ = _square_pair(backend, "in_graph")
    net[0].weight.grad_dtype = torch.float64
    refused = r"Sequential\.0\.weight: grad_dtype is float64"
    with pytest.raises(DualgraphError, match=refused) as info:
        loss_of(net(torch.randn(2, 4, device=device_of(backend)))).backward()
    message = str(info.value)
    assert "set its grad_dtype to None" in message and "set .grad to None" not in message
    assert all(p.grad is None for p in net.parameters())
    net[0].weight.grad_dtype = None
    loss_of(net(torch.randn(2, 4, device=device_of(backend)))).backward()
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("param_grads", IN_GRAPH_MODES)
def test_in_graph_grads_add_into_views_of_one_flat_grad_buffer(
    backend: str, param_grads: str
) -> None:
    net, twin = _square_pair(backend, param_grads)
    for module in (net, twin):  # one flat buffer, a view per parameter (Megatron, Apex)
        flat = torch.zeros(32, device=device_of(backend))
        module[0].weight.grad = flat[:16].view(4, 4)
        module[2].weight.grad = flat[16:].view(4, 4)
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)
    assert net[0].weight.grad._base is net[2].weight.grad._base
    assert _through_autograd(net) == 0


#: Ways to move a ``.grad`` into other memory while it stays the same tensor object, as
#: DeepSpeed's contiguous gradients do (``param.grad.data = bucket.narrow(...).view_as(...)``).
REPOINTS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "data": lambda grad, place: setattr(grad, "data", place),
    "set_": lambda grad, place: grad.set_(place),
}


def _repoint_grads_into_one_flat_buffer(module: nn.Module, how: str) -> torch.Tensor:
    params = list(module.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    start = 0
    for param in params:
        place = flat[start : start + param.numel()].view_as(param)
        place.copy_(param.grad)
        REPOINTS[how](param.grad, place)
        start += param.numel()
    return flat


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
@pytest.mark.parametrize("how", REPOINTS)
def test_a_grad_moved_into_other_memory_keeping_its_identity_is_added_into_like_eager(
    backend: str, param_grads: str, how: str
) -> None:
    _moved_grads_step_like_eager(backend, param_grads, how, hooked=False)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("how", REPOINTS)
def test_a_grad_moved_into_other_memory_is_added_into_like_eager_through_autograd(
    backend: str, how: str
) -> None:
    _moved_grads_step_like_eager(backend, "auto", how, hooked=True)


def _moved_grads_step_like_eager(backend: str, param_grads: str, how: str, hooked: bool) -> None:
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    kept = [p.grad for p in net.parameters()]
    flats = [_repoint_grads_into_one_flat_buffer(module, how) for module in (net, twin)]
    if hooked:  # "auto" hands the grads to autograd, from copies of what the graph added
        for module in (net, twin):
            for param in module.parameters():
                param.register_hook(lambda grad: grad * 2)
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)
    assert_tensors_match(flats[0], flats[1], "the flat buffer the .grad tensors live in")
    assert all(p.grad is grad for p, grad in zip(net.parameters(), kept, strict=True))


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_grad_moved_into_other_memory_is_not_handed_out_again_after_zero_grad(
    backend: str, param_grads: str
) -> None:
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    flat = _repoint_grads_into_one_flat_buffer(net, "data")
    _repoint_grads_into_one_flat_buffer(twin, "data")
    values = flat.clone()
    for module in (net, twin):
        module.zero_grad(set_to_none=True)
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)
    assert_tensors_match(flat, values, "the flat buffer the old .grad tensors live in")


def _inference_grad(param: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones_like(param)


#: A ``.grad`` eager's in-place add raises for (``AccumulateGrad``), made for a parameter.
UNWRITABLE_GRADS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "expanded": lambda param: torch.ones(1, 1, device=param.device).expand_as(param),
    "inference": _inference_grad,
}
#: The error eager raises for each.
UNWRITABLE_ERRORS = {
    "expanded": "more than one element of the written-to tensor refers to a single memory",
    "inference": "Inplace update to inference tensor outside InferenceMode",
}
#: ``(backend, param_grads)``: every mode, on the backends with graphs and on ``eager``.
EVERY_MODE = [
    pytest.param("eager", "auto", id="eager"),
    *[pytest.param(*p.values, marks=p.marks, id=p.id) for p in GRAPH_GRAD_MODES],
]


@pytest.mark.parametrize(("backend", "param_grads"), EVERY_MODE)
@pytest.mark.parametrize("kind", UNWRITABLE_GRADS)
def test_a_grad_eager_cannot_add_into_raises_before_any_other_grad_changed(
    backend: str, param_grads: str, kind: str
) -> None:
    # Eager's backward reaches the last layer first, and its AccumulateGrad raises there. The
    # graph added into every other .grad and then raised copying into that one, leaving the
    # grads half updated and its accumulators as the replay left them.
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    for module in (net, twin):
        module[2].weight.grad = UNWRITABLE_GRADS[kind](module[2].weight)
    grads = [p.grad for p in net.parameters()]
    before = grads_of(list(net.parameters()))
    x = torch.randn(2, 4, device=device_of(backend))
    with pytest.raises(RuntimeError, match=UNWRITABLE_ERRORS[kind]):
        loss_of(twin(x)).backward()
    expected = DualgraphError if param_grads == "in_graph" else RuntimeError
    with pytest.raises(expected) as info:
        loss_of(net(x)).backward()
    if param_grads == "in_graph":  # refused, naming it, before anything changed
        assert str(info.value).startswith("Sequential: Sequential.2.weight: .grad")
        assert_grads_match(grads_of(list(net.parameters())), before, ["0.weight", "2.weight"])
    else:  # eager's error, from autograd adding the grad as eager does
        assert UNWRITABLE_ERRORS[kind] in str(info.value)
        assert_tensors_match(net[2].weight.grad, twin[2].weight.grad, "2.weight", None)
        if param_grads == "auto":  # autograd got that grad alone: nothing else changed, as eager
            _assert_same_grads(net, twin, backend)
        # ("autograd" hands every grad on at once, and which AccumulateGrad runs first is the
        # engine's choice: the other .grad may have been added to, unlike eager's)
    assert all(p.grad is grad for p, grad in zip(net.parameters(), grads, strict=True))
    for module in (net, twin):  # the next steps, into a new .grad, match eager's
        module.zero_grad(set_to_none=True)
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)


#: Ways to give a ``.grad`` another shape than its parameter's, keeping its identity (which
#: assigning ``.grad`` itself refuses): a prefix of its own memory keeps its address and strides.
RESHAPED_GRADS: dict[str, Callable[[torch.Tensor], None]] = {
    "prefix": lambda grad: setattr(grad, "data", grad.data[:2]),
    "elsewhere": lambda grad: setattr(grad, "data", torch.zeros_like(grad.data[:2])),
}


@pytest.mark.parametrize(("backend", "param_grads"), EVERY_MODE)
@pytest.mark.parametrize("kind", RESHAPED_GRADS)
def test_a_grad_of_another_shape_raises_before_any_grad_changed(
    backend: str, param_grads: str, kind: str
) -> None:
    # The prefix kept the accumulator's address and strides, so the graph added the whole
    # grad into memory the .grad only partly shows, where eager's AccumulateGrad raises.
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    for module in (net, twin):
        RESHAPED_GRADS[kind](module[2].weight.grad)
    grads = [p.grad for p in net.parameters()]
    before = grads_of(list(net.parameters()))
    x = torch.randn(2, 4, device=device_of(backend))
    eager_error = "must match the size of tensor"
    with pytest.raises(RuntimeError, match=eager_error):
        loss_of(twin(x)).backward()
    expected = DualgraphError if param_grads == "in_graph" else RuntimeError
    with pytest.raises(expected) as info:
        loss_of(net(x)).backward()
    if param_grads == "in_graph":  # refused, naming it, before anything changed
        assert str(info.value).startswith("Sequential: Sequential.2.weight: .grad has shape")
    else:  # eager's error, from autograd adding the grad as eager does
        assert eager_error in str(info.value)
    if param_grads != "autograd":  # (which AccumulateGrad runs first is the engine's choice)
        assert_grads_match(grads_of(list(net.parameters())), before, ["0.weight", "2.weight"])
    assert all(p.grad is grad for p, grad in zip(net.parameters(), grads, strict=True))
    for module in (net, twin):  # the next steps, into a new .grad, match eager's
        module.zero_grad(set_to_none=True)
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)


@pytest.mark.cuda
@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_a_grad_moved_to_another_device_gets_what_eager_does_before_any_grad_changed(
    param_grads: str,
) -> None:
    # .grad.data moved to the host (an offload): the graph's copy back into it crossed devices
    # silently where eager's add into it raises (grad_problem's CPU test stands in off a GPU)
    net, twin = _square_pair(CUDA, param_grads)
    _square_step(net, twin, CUDA)
    for module in (net, twin):
        module[2].weight.grad.data = module[2].weight.grad.data.cpu()
    grads = [p.grad for p in net.parameters()]
    before = grads_of(list(net.parameters()))
    x = torch.randn(2, 4, device=device_of(CUDA))
    try:
        loss_of(twin(x)).backward()
        eager_error = None
    except RuntimeError as error:
        eager_error = str(error)
    if param_grads == "in_graph":  # refused, naming it, before anything changed
        moved = r"^Sequential: Sequential\.2\.weight: \.grad is on cpu"
        with pytest.raises(DualgraphError, match=moved):
            loss_of(net(x)).backward()
        assert_grads_match(grads_of(list(net.parameters())), before, ["0.weight", "2.weight"])
    elif eager_error is not None:  # eager's error, from autograd adding that grad alone
        with pytest.raises(RuntimeError) as info:
            loss_of(net(x)).backward()
        assert str(info.value) == eager_error
        if param_grads == "auto":
            assert_grads_match(grads_of(list(net.parameters())), before, ["0.weight", "2.weight"])
    else:
        loss_of(net(x)).backward()
        _assert_same_grads(net, twin, CUDA)
    assert all(p.grad is grad for p, grad in zip(net.parameters(), grads, strict=True))


@pytest.mark.parametrize(("backend", "param_grads"), EVERY_MODE)
@pytest.mark.parametrize("kind", UNWRITABLE_GRADS)
def test_a_grad_eager_cannot_add_into_leaves_a_grad_the_user_kept_as_it_was(
    backend: str, param_grads: str, kind: str
) -> None:
    # a .grad kept after zero_grad(set_to_none=True) shares the graph's accumulator: the graph
    # wrote into it, and the error left it changed
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    kept = net[2].weight.grad
    values = kept.clone()
    for module in (net, twin):
        module.zero_grad(set_to_none=True)
        module[0].weight.grad = UNWRITABLE_GRADS[kind](module[0].weight)
    # in_graph refuses naming the parameter; the other modes raise eager's error from autograd
    if param_grads == "in_graph":
        expected, message = DualgraphError, r"^Sequential: Sequential\.0\.weight: \.grad"
    else:
        expected, message = RuntimeError, UNWRITABLE_ERRORS[kind]
    with pytest.raises(expected, match=message):
        loss_of(net(torch.randn(2, 4, device=device_of(backend)))).backward()
    assert_tensors_match(kept, values, "the .grad the user kept")


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize(("backend", "param_grads"), EVERY_MODE)
def test_a_grad_whose_elements_overlap_is_added_into_as_eager_or_refused(
    backend: str, param_grads: str
) -> None:
    # torch can't tell that these strides overlap, and eager adds into each element in place,
    # one after another; a copy back would write each memory location once
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    for module in (net, twin):
        flat = torch.ones(8, device=device_of(backend))
        module[2].weight.grad = flat.as_strided((4, 4), (1, 1))
    before = grads_of(list(net.parameters()))
    if param_grads == "in_graph":
        with pytest.raises(DualgraphError, match=r"2\.weight: \.grad's elements overlap"):
            loss_of(net(torch.randn(2, 4, device=device_of(backend)))).backward()
        assert_grads_match(grads_of(list(net.parameters())), before, ["0.weight", "2.weight"])
        return
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)


def _grad_requiring_grad(param: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(param).requires_grad_()


def _view_of_a_tensor_requiring_grad(param: torch.Tensor) -> torch.Tensor:
    base = torch.ones(2 * param.numel(), device=param.device, requires_grad=True)
    return base[param.numel() :].view_as(param)


@pytest.mark.parametrize(("backend", "param_grads"), EVERY_MODE)
@pytest.mark.parametrize("make", [_grad_requiring_grad, _view_of_a_tensor_requiring_grad])
def test_a_grad_that_requires_grad_is_added_into_in_place_as_eager_does(
    backend: str, param_grads: str, make: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    net, twin = _square_pair(backend, param_grads)
    _square_step(net, twin, backend)
    for module in (net, twin):
        module[2].weight.grad = make(module[2].weight)
    mine = net[2].weight.grad
    for _ in range(2):
        _square_step(net, twin, backend)
        _assert_same_grads(net, twin, backend)
        assert net[2].weight.grad is mine
        assert net[2].weight.grad.requires_grad and twin[2].weight.grad.requires_grad
        assert type(mine.grad_fn) is type(twin[2].weight.grad.grad_fn)


class _TiedBlock(nn.Module):
    """A block whose first layer may be another block's (tied weights)."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.shared, self.own = shared, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.tanh(self.own(self.shared(x))), None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_auto_sends_the_grads_of_weights_tied_across_callables_through_autograd(
    backend: str,
) -> None:
    device = device_of(backend)

    def stack() -> nn.ModuleList:
        torch.manual_seed(1)
        tied = nn.Linear(8, 8)
        return nn.ModuleList([_TiedBlock(tied), _TiedBlock(tied), _TiedBlock(nn.Linear(8, 8))])

    graphed, eager = stack().to(device), stack().to(device)
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in range(3))
    dgt.make_graphed_callables(tuple(graphed), samples, backend=backend)
    for _ in range(3):  # eager sums the tied weight's two grads before adding them to .grad
        x = torch.randn(4, 8, device=device)
        for model in (graphed, eager):
            hidden = x.detach().requires_grad_()
            for block in model:
                hidden = block(hidden)[0]
            loss_of(hidden).backward()
        _assert_same_grads(graphed, eager, backend)
    through_autograd = [_through_autograd(block) for block in graphed]
    assert through_autograd == [3, 3, 0]  # only the blocks that share a weight


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_second_order_grad_through_a_replay_raises(backend: str) -> None:
    mlp, _ = _auto_pair(backend)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    (grad,) = torch.autograd.grad(loss_of(mlp(x)), x, create_graph=True)
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        grad.sum().backward()  # a replay is differentiable once: never a silent zero


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "in_graph"]
)
def test_a_second_order_grad_through_a_replay_names_the_callable_and_what_to_do(
    backend: str, param_grads: str
) -> None:
    # torch's words alone ('a function that was marked with @once_differentiable') named
    # neither the graphed callable nor a way out
    mlp = TinyMLP().to(device_of(backend))
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    (grad,) = torch.autograd.grad(mlp(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^TinyMLP: trying to differentiate twice.*restore"):
        grad.square().sum().backward()


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "in_graph"]
)
def test_a_gradient_penalty_through_a_replay_raises_even_when_no_incoming_grad_needs_grad(
    backend: str, param_grads: str
) -> None:
    # y.sum()'s grad (ones) needs no grad: once_differentiable then handed back plain grads,
    # so a penalty on them silently added nothing where eager differentiates it.
    mlp = TinyMLP().to(device_of(backend))
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    y = mlp(x)
    (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert grad.requires_grad  # as eager's: it depends on the weights
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        (y.square().sum() + grad.square().sum()).backward()


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "in_graph"]
)
def test_a_backward_through_the_outputs_after_a_create_graph_backward_is_a_second_derivative(
    backend: str, param_grads: str
) -> None:
    # On the H100 (run AD) a penalty's backward reached the replay's node before the node
    # refusing its grads' backward, and raised the plain "second backward through the same
    # replay" DualgraphError (no RuntimeError, no word of the penalty); the same happens on
    # any device when a backward goes through the outputs alone after a create_graph=True one.
    mlp = TinyMLP().to(device_of(backend))
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    y = mlp(x)
    torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(SecondBackwardError, match="trying to differentiate twice through a "):
        y.square().sum().backward()


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "in_graph"]
)
@pytest.mark.parametrize("towards", ["input", "parameters"])
def test_a_second_derivative_through_a_replay_raises_when_asked_for_inputs_or_parameters(
    backend: str, param_grads: str, towards: str
) -> None:
    # autograd.grad(..., inputs) runs only the nodes on a path to what it asks for: the node
    # refusing a second backward hung off leaves of its own, so it was never run, and a
    # Hessian (allow_unused=True, as torch.autograd.functional's) came back silently zero.
    mlp = TinyMLP().to(device_of(backend))
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    (grad,) = torch.autograd.grad(mlp(x).sum(), x, create_graph=True)
    wanted = [x] if towards == "input" else list(mlp.parameters())
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        torch.autograd.grad(grad.square().sum(), wanted, allow_unused=True)


def test_a_hessian_through_a_replay_raises_instead_of_coming_back_zero() -> None:
    mlp = TinyMLP()
    sample = torch.randn(4, 8, requires_grad=True)
    graphed = dgt.make_graphed_callables(mlp, (sample,), backend="emulate")
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        torch.autograd.functional.hessian(lambda x: graphed(x).sum(), torch.randn(4, 8))


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAPH_GRAD_MODES if p.values[1] != "in_graph"]
)
def test_a_derivative_through_a_replay_towards_its_incoming_grad_raises(
    backend: str, param_grads: str
) -> None:
    # The double-backward trick (torch.autograd.functional.jvp): differentiate the grads with
    # respect to the grad_outputs handed in; the engine ran no node of the replay's on the way
    # to them, and jvp came back silently zero.
    mlp = TinyMLP().to(device_of(backend))
    sample = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    dgt.make_graphed_callables(mlp, (sample,), backend=backend, param_grads=param_grads)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    y = mlp(x)
    incoming = torch.ones_like(y, requires_grad=True)
    (grad,) = torch.autograd.grad(y, x, incoming, create_graph=True)
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        torch.autograd.grad(grad.square().sum(), incoming, allow_unused=True)


def test_a_jvp_through_a_replay_raises_instead_of_coming_back_zero() -> None:
    mlp = TinyMLP()
    sample = torch.randn(4, 8, requires_grad=True)
    graphed = dgt.make_graphed_callables(mlp, (sample,), backend="emulate")
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        torch.autograd.functional.jvp(graphed, torch.randn(4, 8), torch.randn(4, 8))


@pytest.mark.parametrize("slots", [None, 1])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_an_output_saved_under_allow_mutation_on_saved_tensors_keeps_its_values(
    backend: str, param_grads: str, slots: int | None
) -> None:
    # Under this context autograd saves through hooks (no version check) and clones a saved
    # tensor only when an op mutates it; a replay writing its static outputs is no op, so the
    # next replay silently changed what an eager op had saved of the last call's output.
    device = device_of(backend)
    mlp = TinyMLP().to(device)
    eager = copy.deepcopy(mlp)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    dgt.make_graphed_callables(
        mlp, (sample,), backend=backend, param_grads=param_grads, slots=slots
    )
    first, second = (torch.randn(4, 8, device=device, requires_grad=True) for _ in range(2))
    grads = []
    for fn in (mlp, eager):
        weight = torch.ones(4, 8, device=device, requires_grad=True)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            product = (weight * fn(first)).sum()  # saves the output
            fn(second)
            grads.append(torch.autograd.grad(product, weight)[0])
    assert_tensors_match(grads[0], grads[1], "grad of the weight", tolerance(backend))


# -- outputs changed in place --------------------------------------------------------------------


def exp_of(x: torch.Tensor) -> torch.Tensor:
    return x.exp()  # its backward reads its output


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_the_backward_reads_may_not_be_changed_in_place(backend: str) -> None:
    device = device_of(backend)
    sample = torch.randn(3, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(exp_of, (sample,), backend=backend)
    assert graphed.plan.saved_outputs == (0,)
    x = torch.randn(3, device=device, requires_grad=True)
    out = graphed(x)
    out.mul_(2)
    with pytest.raises(DualgraphError) as info:
        out.sum().backward()
    assert str(info.value).startswith(
        "exp_of: output was modified in place after the replay, but the backward reads it"
    )
    eager = exp_of(x.detach().clone().requires_grad_())
    eager.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager.sum().backward()  # eager refuses it too


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_the_backward_does_not_read_may_be_changed_in_place(backend: str) -> None:
    device = device_of(backend)
    layer, twin = nn.Linear(4, 3).to(device), nn.Linear(4, 3).to(device)
    twin.load_state_dict(layer.state_dict())
    dgt.make_graphed_callables(layer, (torch.randn(2, 4, device=device),), backend=backend)
    assert runner_of(layer).plan.saved_outputs == ()
    x = torch.randn(2, 4, device=device)
    out, expected = layer(x), twin(x)
    out.add_(1)
    expected.add_(1)
    backward_of(out)
    backward_of(expected)
    assert_grads_match(
        grads_of(parameters_of(layer)),
        grads_of(parameters_of(twin)),
        parameter_names(layer),
        tolerance(backend),
    )


class ShiftsAndDropsAProduct(nn.Module):
    """Returns ``x + w`` after multiplying it by ``w`` into a result it drops: only that
    product's node (which no output reaches) saved the output."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.w
        _ = y * self.w
        return y


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_output_only_a_dropped_result_saved_may_be_changed_in_place_as_in_eager(
    param_grads: str,
) -> None:
    # The warmup took every saved tensor for one the backward reads: "output was modified in
    # place after the replay, but the backward reads it" where eager's backward reads none.
    module = ShiftsAndDropsAProduct()
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(
        module, (batch(),), backend="emulate", param_grads=param_grads
    )
    assert runner_of(module).plan.saved_outputs == ()
    for _ in range(2):
        x = batch()
        eager_x = x.detach().clone().requires_grad_()
        out, expected = graphed(x), twin(eager_x)
        out.mul_(2.0)
        expected.mul_(2.0)
        (out * 3.0).sum().backward()
        (expected * 3.0).sum().backward()
        assert_tensors_match(x.grad, eager_x.grad, "x.grad")
        assert_grads_match(
            grads_of(parameters_of(module)), grads_of(parameters_of(twin)), parameter_names(module)
        )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_cloned_outputs_may_be_changed_in_place(backend: str) -> None:
    device = device_of(backend)
    sample = torch.randn(3, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(exp_of, (sample,), backend=backend, clone_outputs=True)
    x = torch.randn(3, device=device, requires_grad=True)
    out = graphed(x)
    out.mul_(2)  # a clone of its own: the static output the backward reads is untouched
    out.sum().backward()
    assert_tensors_match(x.grad, 2 * x.detach().exp(), "x.grad", tolerance(backend))


# -- each rule on every entry point (entry_points.py) -------------------------------------------


@pytest.mark.parametrize("entry", WITH_PARAMETERS)
def test_in_graph_refuses_a_backward_in_anomaly_mode_on_every_entry_point(entry: str) -> None:
    module = Decays()
    graphed = graphed_on(entry, module, param_grads="in_graph")
    backward_of(graphed(batch(call_length(entry))))
    kept = [p.grad.clone() for p in module.parameters()]
    out = graphed(batch(call_length(entry)))
    with torch.autograd.set_detect_anomaly(True), pytest.raises(DualgraphError, match="anomaly"):
        backward_of(out)
    assert all(torch.equal(p.grad, k) for p, k in zip(module.parameters(), kept, strict=True))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_input_sharing_memory_with_a_buffer_the_callable_updates_is_refused_on_every_entry_point(
    entry: str,
) -> None:
    # A graphed function or method has no module of its own: the buffer its code names (a
    # closure over the module, the method's module) was not looked at, and the replay read the
    # copy made before the update, silently.
    module = Decays()
    graphed = graphed_on(entry, module, (torch.zeros(4),))
    stats = module.stats
    before = stats.clone()
    with pytest.raises(DualgraphError, match=r"args\[1\] shares memory with .*stats, which the"):
        graphed(batch(call_length(entry)), stats)
    assert torch.equal(stats, before)


@pytest.mark.parametrize("param_grads", ["auto", "in_graph", "autograd"])
@pytest.mark.parametrize("entry", WITH_PARAMETERS)
def test_a_weight_changed_in_place_before_the_backward_is_refused_on_every_entry_point(
    entry: str, param_grads: str
) -> None:
    module = Decays()
    graphed = graphed_on(entry, module, param_grads=param_grads)
    backward_of(graphed(batch(call_length(entry))))
    loss = graphed(batch(call_length(entry))).sum()
    with torch.no_grad():
        module.linear.weight.add_(1.0)
    kept = [p.grad.clone() for p in module.parameters()]
    with pytest.raises(DualgraphError, match=r"linear\.weight.*modified in place"):
        loss.backward()
    assert all(torch.equal(p.grad, k) for p, k in zip(module.parameters(), kept, strict=True))


class DropsALayersResult(nn.Module):
    """Runs its layer once more on its output and drops that result (a fuzz find): no output
    reaches the second call's node, so no backward reads what it saved (the weight; the first
    call saves only its input, for the weight's grad, where the input needs none)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mid = self.inp(x)
        self.inp(mid)
        return mid


class ReadsItsWeightOnlyInADroppedResult(nn.Module):
    """The weight reaches the output without being saved (added), and is saved only by a
    product whose result is dropped (for the input's grad): the backward reads no weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ = x * self.weight  # saves the weight, result dropped
        return x.tanh() + self.weight


def _step_between_call_and_backward(
    module: nn.Module, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> list[torch.Tensor]:
    """The grads of ``x`` and the parameters of a call whose weights change (an optimizer
    step) after the forward, before the backward."""
    module.zero_grad(set_to_none=True)
    loss = call(x).sum()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)
    loss.backward()
    grads = [x.grad, *(p.grad for p in module.parameters())]
    return [g.clone() if g is not None else torch.zeros(0) for g in grads]


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize(
    ("make", "input_grad"),
    [(DropsALayersResult, False), (ReadsItsWeightOnlyInADroppedResult, True)],
    ids=["layer", "product"],
)
def test_a_weight_only_a_dropped_result_saved_may_change_before_the_backward_as_in_eager(
    make: Callable[[], nn.Module], input_grad: bool, param_grads: str
) -> None:
    # Eager's backward never reaches the dropped result's node, so the weight it saved may
    # change before the backward; the warmup took every saved tensor for one the backward
    # reads and the graphed backward was refused ("inp.weight was modified in place").
    torch.manual_seed(0)
    eager = make()
    module = copy.deepcopy(eager)
    graphed = dgt.make_graphed_callables(
        module, (batch().requires_grad_(input_grad),), backend="emulate", param_grads=param_grads
    )
    for _ in range(2):
        x = batch().detach()
        expected = _step_between_call_and_backward(
            eager, eager, x.clone().requires_grad_(input_grad)
        )
        got = _step_between_call_and_backward(module, graphed, x.requires_grad_(input_grad))
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


class SavesItsWeightAlsoInADroppedResult(DropsALayersResult):
    """As :class:`DropsALayersResult`, with the returned result's node saving the weight too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mid = self.inp(x).tanh()
        self.inp(mid)
        return mid @ self.inp.weight


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_a_weight_a_reached_node_saved_is_refused_also_when_a_dropped_result_saved_it(
    param_grads: str,
) -> None:
    module = SavesItsWeightAlsoInADroppedResult()
    graphed = dgt.make_graphed_callables(
        module, (batch().detach(),), backend="emulate", param_grads=param_grads
    )
    eager = copy.deepcopy(module)
    eager_loss = eager(batch().detach()).sum()
    with torch.no_grad():
        eager.inp.weight.add_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager_loss.backward()
    loss = graphed(batch().detach()).sum()
    with torch.no_grad():
        module.inp.weight.add_(0.5)
    with pytest.raises(DualgraphError, match=r"inp\.weight was modified in place"):
        loss.backward()
    assert module.inp.weight.grad is None


@pytest.mark.parametrize("entry", ["function", "method"])
def test_a_frozen_weight_a_graphed_function_reads_changed_before_the_backward_is_refused(
    entry: str,
) -> None:
    # A function's or method's weights are no parameters of a graphed module (they are frozen),
    # yet its backward reads them for the input grads: eager raises; on CUDA the graph read the
    # new values, silently, and the emulated backward leaked torch's RuntimeError.
    module = Decays()
    graphed = graphed_on(entry, module)
    x = batch()
    loss = graphed(x).sum()
    with torch.no_grad():
        module.linear.weight.add_(1.0)
    with pytest.raises(DualgraphError, match=r"linear\.weight was modified in place"):
        loss.backward()
    assert x.grad is None


class ScalesByAnAttribute(nn.Module):
    """Multiplies by a plain tensor attribute (no parameter, no buffer), as some caches are."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = torch.randn(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


@pytest.mark.parametrize("entry", ["plain", "method"])
def test_a_plain_tensor_attribute_changed_before_the_backward_is_refused(entry: str) -> None:
    # The backward reads it (for the grads through the product): eager raises, a graph would
    # read the new values (the emulated backward leaked torch's RuntimeError).
    module = ScalesByAnAttribute()
    if entry == "method":
        module.requires_grad_(False)
        graphed = dgt.make_graphed_callables(module.forward, (batch(),), backend="emulate")
    else:
        graphed = dgt.make_graphed_callables(module, (batch(),), backend="emulate")
    x = batch()
    loss = graphed(x).sum()
    module.scale.mul_(2.0)
    with pytest.raises(DualgraphError, match=r"ScalesByAnAttribute\.scale was modified in place"):
        loss.backward()
    assert x.grad is None


def test_a_tensor_a_graphed_function_closes_over_changed_before_the_backward_is_refused() -> None:
    weight = torch.randn(4, 4)
    graphed = dgt.make_graphed_callables(
        lambda x: (x @ weight).tanh(), (batch(),), backend="emulate"
    )
    x = batch()
    loss = graphed(x).sum()
    weight.mul_(2.0)
    with pytest.raises(DualgraphError, match="closed over weight was modified in place"):
        loss.backward()
    assert x.grad is None
    weight.div_(2.0)  # a tensor the backward does not read may change: the bias here
    bias = torch.zeros(4)
    graphed = dgt.make_graphed_callables(lambda x: x.tanh() + bias, (batch(),), backend="emulate")
    loss = graphed(x).sum()
    bias.add_(1.0)
    loss.backward()
    assert x.grad is not None


@pytest.mark.parametrize("watch", [_watch_hook, _watch_retained], ids=["hook", "retain_grad"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_grad_watched_at_an_output_used_inside_is_refused_on_every_entry_point(
    entry: str, watch: Callable[[torch.Tensor], None]
) -> None:
    # A padded call hands out outputs cut back from the replay's: the refusal looked at the
    # replay's own output only, and a hook on the cut one saw a partial grad, silently.
    graphed = graphed_on(entry, entry_points.HiddenAndOut())
    hidden, out = graphed(batch(call_length(entry)))
    watch(hidden)
    with pytest.raises(DualgraphError, match=re.escape("output[0]") + ".*used inside"):
        (hidden.sum() + out.sum()).backward()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_node_hook_on_the_block_before_keeps_its_grad_on_every_entry_point(entry: str) -> None:
    seen: dict[str, list[torch.Tensor]] = {"graphed": [], "eager": []}
    module = Decays()
    twin = copy.deepcopy(module)
    before, before_twin = Decays(), Decays()
    before_twin.load_state_dict(before.state_dict())
    graphed = graphed_on(entry, module)
    dgt.make_graphed_callables(before, (batch(call_length(entry)),), backend="emulate")
    for _ in range(3):
        x = batch(call_length(entry))
        for key, first, second in (("graphed", before, graphed), ("eager", before_twin, twin)):
            h = first(x)
            h.grad_fn.register_prehook(lambda grads, key=key: seen[key].append(grads[0]))
            backward_of(second(h))
    for i, (grad, expected) in enumerate(zip(seen["graphed"], seen["eager"], strict=True)):
        assert_tensors_match(grad, expected, f"grad {i} seen by the hook", tolerance("emulate"))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_second_derivative_through_a_replay_raises_on_every_entry_point(entry: str) -> None:
    graphed = graphed_on(entry, Decays())
    x = batch(call_length(entry))
    (grad,) = torch.autograd.grad(graphed(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        torch.autograd.grad(grad.square().sum(), x, allow_unused=True)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_output_saved_under_allow_mutation_on_saved_tensors_is_kept_on_every_entry_point(
    entry: str,
) -> None:
    module = Decays()
    twin = copy.deepcopy(module)
    graphed = graphed_on(entry, module, order=(1, 1, -1, -1))
    first, second = batch(call_length(entry)), batch(call_length(entry))
    grads = []
    for fn in (graphed, twin):
        weight = torch.ones_like(first, requires_grad=True)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            kept = fn(first)
            product = (weight * kept).sum() + kept.sum()  # saves the output
            later = fn(second)
            grads.append(torch.autograd.grad(product, weight, retain_graph=True)[0])
            if entry in ("slots", "schedule"):  # both replays in flight: backwards in order
                product.backward()
            backward_of(later)
    assert_tensors_match(grads[0], grads[1], "grad of the weight", tolerance("emulate"))


class _Shifted(nn.Module):
    """A forward adding a plain tensor attribute (not a buffer: ``module.to`` leaves it)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, device=device)
        self.offset = torch.ones(8, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a tensor the forward itself rebinds on every call, self.last = y.detach(), is
        # refused at capture: test_a_forward_leaving_state_on_its_module_on_every_call_...)
        return self.fc(x) + self.offset


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_tensor_attribute_rebound_after_capture_is_refused_naming_it(backend: str) -> None:
    # The graphs read the memory of the tensor of capture: on CUDA a replay kept adding the
    # old offset where eager added the new one (emulate re-ran the Python and followed eager).
    device = device_of(backend)
    module = _Shifted(device)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
    )
    for _ in range(2):
        graphed(torch.randn(4, 8, device=device, requires_grad=True)).sum().backward()
    module.offset = module.offset  # the same tensor: fine
    graphed(torch.randn(4, 8, device=device)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.offset = torch.full((8,), 2.0, device=device)
    with pytest.raises(
        DualgraphError,
        match=r"^_Shifted\.offset: a tensor attribute rebound to another object after capture "
        r"\(at capture a float32 tensor \[8\] on .* at 0x[0-9a-f]+, now a float32 tensor \[8\] on ",
    ):
        graphed(torch.randn(4, 8, device=device, requires_grad=True)).sum().backward()
    assert all(map(torch.equal, (p.grad for p in module.parameters()), grads))


class Tempered(nn.Module):
    """Reads optional public attributes its user may set: a temperature and a cache it fills
    itself on first use (``inner`` reads its own optional shift)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = Shifted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale_cache"):  # lazily set: the captured state
            self.scale_cache = 0.5
        return self.inner(self.fc(x)) * self.scale_cache / getattr(self, "temperature", 1.0)


class Shifted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.__dict__.get("shift", 0.0)


def _graphed_tempered(backend: str) -> tuple[Tempered, torch.device]:
    device = device_of(backend)
    module = Tempered().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    return module, device


def _set_temperature(module: Tempered) -> None:
    module.temperature = 2.0


def _set_inner_shift(module: Tempered) -> None:
    module.inner.shift = 1.0


def _delete_cache(module: Tempered) -> None:
    del module.scale_cache  # eager's forward sets it again (to what it computes now)


#: An attribute added or deleted after capture: ``(change, the message's start)``.
ATTRIBUTE_CHANGES = {
    "added_on_root": (_set_temperature, "Tempered.temperature: an attribute added after capture"),
    "added_on_submodule": (_set_inner_shift, "Tempered.inner.shift: an attribute added after"),
    "deleted": (_delete_cache, "Tempered.scale_cache: an attribute deleted after capture"),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("change", sorted(ATTRIBUTE_CHANGES))
def test_a_public_attribute_added_or_deleted_after_capture_is_refused_naming_it(
    backend: str, change: str
) -> None:
    # On CUDA the graphs keep the capture's branch (temperature 1.0, no shift); eager uses it.
    module, device = _graphed_tempered(backend)
    x = torch.randn(4, 8, device=device)
    module(x)
    alter, message = ATTRIBUTE_CHANGES[change]
    alter(module)
    with pytest.raises(DualgraphError) as info:
        module(x)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_attribute_the_forward_sets_lazily_is_no_change(backend: str) -> None:
    module, device = _graphed_tempered(backend)
    assert module.scale_cache == 0.5  # set in warmup, kept: part of what was captured
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        expected = (module.inner(module.fc(x)) * 0.5).clone()
    for _ in range(3):
        assert torch.equal(module(x).detach(), expected)


class LazyInEval(nn.Module):
    """Sets an attribute on its first eval-mode call only (an eager call of a graphed module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and not hasattr(self, "eval_calls"):
            self.eval_calls = 1
        return self.fc(x)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_attribute_the_forward_adds_in_an_eager_call_is_its_own(backend: str) -> None:
    device = device_of(backend)
    module = LazyInEval().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    module.eval()
    module(x)  # eager: the forward's own addition
    module.train()
    assert module.eval_calls == 1
    assert module(x).shape == (4, 8)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_private_or_object_attribute_set_after_capture_is_not_refused(backend: str) -> None:
    # Private names are torch's and hooks' (and not compared, as the plain values are not);
    # objects (a logger, a config) and tensors (a graphed module's hook keeping its output)
    # are not compared either.
    module, device = _graphed_tempered(backend)
    x = torch.randn(4, 8, device=device)
    module._temperature = 2.0
    module.inner._shift = 1.0
    module.logger = object()
    module.last_output = torch.zeros(4, 8, device=device)
    handle = module.inner.register_forward_hook(lambda *_: None)
    handle.remove()
    for _ in range(2):
        assert module(x).shape == (4, 8)


class Masked(nn.Module):
    """Reads optional attributes its user may set to tensors: a mask (getattr) on itself and
    an extra shift (hasattr) on ``inner``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = OptionalShift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(self.fc(x))
        mask = getattr(self, "mask", None)
        return y if mask is None else y * mask


class OptionalShift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.extra if hasattr(self, "extra") else x


def _set_mask(module: Masked) -> None:
    module.mask = torch.tensor([0.0, 1.0] * 4, device=module.fc.weight.device)


def _set_inner_extra(module: Masked) -> None:
    module.inner.extra = torch.ones(8, device=module.fc.weight.device)


#: A tensor set after capture where the forward looked for one: ``(change, its path's end)``.
LOOKED_UP_CHANGES = {
    "mask_on_root": (_set_mask, r"mask"),
    "extra_on_submodule": (_set_inner_extra, r"inner\.extra"),
}


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("change", sorted(LOOKED_UP_CHANGES))
@pytest.mark.parametrize("graphed_as", ["module", "function"])
def test_a_tensor_set_after_capture_where_the_forward_looked_for_one_is_refused(
    backend: str, change: str, graphed_as: str
) -> None:
    # On CUDA the graphs keep the capture's branch (no mask, no shift) where eager uses the
    # tensor; an added tensor was taken as a hook's kept output, not compared. A name the forward
    # looked up in vain at capture (getattr with a default, hasattr) is one it reads.
    device = device_of(backend)
    module = Masked().to(device)
    twin = copy.deepcopy(module)
    if graphed_as == "function":  # closed over: frozen
        module.requires_grad_(False)
        twin.requires_grad_(False)
        graphed = dgt.make_graphed_callables(
            lambda x: module(x),
            (torch.randn(4, 8, device=device, requires_grad=True),),
            backend=backend,
        )
        owner = r"<lambda>: closed over module\."
    else:
        graphed = dgt.make_graphed_callables(
            module, (torch.randn(4, 8, device=device, requires_grad=True),), backend=backend
        )
        owner = r"^Masked\."
    for _ in range(2):  # as eager before the change: values, grads, accumulated
        x = torch.randn(4, 8, device=device, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        out, expected = graphed(x), twin(xe)
        assert_tensors_match(out, expected, "output", tolerance(backend))
        out.sum().backward()
        expected.sum().backward()
        assert_tensors_match(x.grad, xe.grad, "input grad", tolerance(backend))
        assert_grads_match(
            [p.grad for p in module.parameters()],
            [p.grad for p in twin.parameters()],
            [name for name, _ in module.named_parameters()],
            tolerance(backend),
        )
    kept = out.detach().clone()
    alter, path = LOOKED_UP_CHANGES[change]
    alter(module)
    with pytest.raises(
        DualgraphError,
        match=owner + path + r": a float32 tensor \[8\] on \S+ at 0x[0-9a-f]+ added after capture "
        r"under a name the forward looked up and did not find at capture",
    ):
        graphed(torch.randn(4, 8, device=device, requires_grad=True))
    assert torch.equal(out.detach(), kept)  # refused before the replay wrote its outputs


def test_a_capture_watches_lookups_on_its_modules_classes_and_leaves_nn_module_alone() -> None:
    # Setting nn.Module.__getattr__ makes the interpreter update each of torch's ~350 module
    # classes (0.4 ms each way on a CPU, per capture); the classes of the modules recorded have
    # it set instead, and deleted again. A lookup in vain is still found (the refusal above).
    getattr_during_capture: list[Any] = []

    class Watching(Masked):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            getattr_during_capture.append(vars(nn.Module)["__getattr__"])
            return super().forward(x)

    module = Watching()
    original = vars(nn.Module)["__getattr__"]
    dgt.make_graphed_callables(module, (torch.randn(4, 8, requires_grad=True),))
    assert getattr_during_capture and all(f is original for f in getattr_during_capture)
    assert "__getattr__" not in vars(Watching) and "__getattr__" not in vars(nn.Linear)
    _set_mask(module)
    with pytest.raises(DualgraphError, match=r"^Watching\.mask: a float32 tensor \[8\]"):
        module(torch.randn(4, 8))


class DefaultingToNone(nn.Module):
    """A ``__getattr__`` of its own that catches nn.Module's miss: a missing name reads None."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y if self.mask is None else y * self.mask


def test_a_tensor_set_where_a_modules_own_getattr_read_none_at_capture_is_refused() -> None:
    # Its __getattr__ finds no miss (it returns None): nn.Module's is watched for such a
    # class, which sees the miss it catches, as for every class before.
    module = DefaultingToNone()
    dgt.make_graphed_callables(module, (torch.randn(4, 8, requires_grad=True),))
    module.mask = torch.ones(8)
    with pytest.raises(DualgraphError, match=r"^DefaultingToNone\.mask: a float32 tensor"):
        module(torch.randn(4, 8))


class PrivateCache(nn.Module):
    """Fills a private tensor cache on first use, after hasattr missed it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_cache"):
            self._cache = torch.full((8,), 0.5, device=x.device)
        return self.fc(x) * self._cache


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_name_looked_up_in_vain_then_set_by_the_forward_itself_is_no_change(
    backend: str,
) -> None:
    device = device_of(backend)
    module = PrivateCache().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    module.logger = object()  # an object added: the names are looked at, _cache stays its own
    for _ in range(2):
        assert module(torch.randn(4, 8, device=device)).shape == (4, 8)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_attribute_added_to_a_closed_over_module_after_capture_is_refused(backend: str) -> None:
    device = device_of(backend)
    tempered = Tempered().to(device).requires_grad_(False)  # closed over: frozen

    def step(x: torch.Tensor) -> torch.Tensor:
        return tempered(x) * 2

    graphed = dgt.make_graphed_callables(step, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    graphed(x)
    tempered.inner.shift = 1.0
    with pytest.raises(DualgraphError, match=r"closed over tempered\.inner\.shift: an attribute"):
        graphed(x)


#: A global a graphed function reads (the test rebinds it, and puts it back).
TEMPERATURE = 2.0


def _tempered_by_the_global(x: torch.Tensor) -> torch.Tensor:
    return (x / TEMPERATURE).tanh()


def _tempered(x: torch.Tensor, *, temperature: float) -> torch.Tensor:
    return (x / temperature).tanh()


def _graph_reading_a_plain_value(where: str, backend: str) -> tuple[Any, Callable[[float], None]]:
    """A graphed function dividing by a temperature of 2.0 that its code reads from ``where``
    (its closure, a global, a ``functools.partial``'s keyword), and what sets it."""
    sample = (torch.randn(4, 8, device=device_of(backend), requires_grad=True),)
    if where == "global":

        def set_global(value: float) -> None:
            global TEMPERATURE
            TEMPERATURE = value

        return dgt.make_graphed_callables(_tempered_by_the_global, sample, backend=backend), (
            set_global
        )
    if where == "partial":
        partial = functools.partial(_tempered, temperature=2.0)
        graphed = dgt.make_graphed_callables(partial, sample, backend=backend)
        return graphed, functools.partial(partial.keywords.__setitem__, "temperature")
    temperature = 2.0

    def tempered(x: torch.Tensor) -> torch.Tensor:
        return (x / temperature).tanh()

    def set_cell(value: float) -> None:
        nonlocal temperature
        temperature = value

    return dgt.make_graphed_callables(tempered, sample, backend=backend), set_cell


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("where", ["closure", "global", "partial"])
def test_a_plain_value_a_graphed_function_reads_changed_after_capture_is_refused_naming_it(
    backend: str, where: str
) -> None:
    # A temperature schedule: eager divides by the new value, a graph by the one of capture
    # (on CUDA silently; "emulate" re-ran the Python and followed eager, hiding it).
    graphed, set_temperature = _graph_reading_a_plain_value(where, backend)
    x = torch.randn(4, 8, device=device_of(backend), requires_grad=True)
    static = [t.clone() for t in runner_of(graphed).static_inputs]
    try:
        set_temperature(3.0)
        with pytest.raises(DualgraphError) as info:
            graphed(x)
        name = "partial argument temperature" if where == "partial" else "closed over "
        assert str(info.value).startswith(f"{graphed.name}: {name}")
        assert "was 2.0 at capture and is 3.0 now" in str(info.value)
        assert all(map(torch.equal, runner_of(graphed).static_inputs, static))  # refused before
        set_temperature(float("2.0"))  # an equal value set again: no change
        assert_tensors_match(
            graphed(x).detach(), (x / 2.0).tanh().detach(), "output", tolerance(backend)
        )
    finally:
        set_temperature(2.0)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("what", ["weight", "layer"])
def test_a_tensor_or_module_a_graphed_function_names_rebound_after_capture_is_refused(
    backend: str, what: str
) -> None:
    # Eager reads the name again (the new weight, the new layer); the graphs read the memory
    # of the tensor and the module of capture. ("emulate" re-ran the Python and followed eager.)
    device = device_of(backend)
    weight = torch.randn(8, 8, device=device)
    layer = nn.Linear(8, 8).to(device).requires_grad_(False)

    def step(x: torch.Tensor) -> torch.Tensor:
        return layer(x @ weight)

    sample = (torch.randn(4, 8, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(step, sample, backend=backend)
    if what == "weight":
        weight = torch.randn(8, 8, device=device)
    else:
        layer = nn.Linear(8, 8).to(device).requires_grad_(False)
    with pytest.raises(DualgraphError) as info:
        graphed(torch.randn(4, 8, device=device, requires_grad=True))
    assert str(info.value).startswith(f"{graphed.name}: closed over {what}: rebound after capture")


class _TemperedByTheGlobal(nn.Module):
    """A Linear divided by the global ``TEMPERATURE``, in a submodule's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / TEMPERATURE


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_global_a_graphed_modules_forward_reads_changed_after_capture_is_refused(
    backend: str,
) -> None:
    # As for a graphed function: eager's forward reads the global again, a graph holds what
    # the forward computed from it at capture.
    global TEMPERATURE
    device = device_of(backend)
    module = nn.Sequential(_TemperedByTheGlobal(), nn.Tanh()).to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    try:
        TEMPERATURE = 3.0
        with pytest.raises(DualgraphError) as info:
            module(torch.randn(4, 8, device=device))
    finally:
        TEMPERATURE = 2.0
    assert str(info.value).startswith(
        "_TemperedByTheGlobal.forward's global TEMPERATURE: was 2.0 at capture and is 3.0 now"
    )


def test_a_forwards_code_is_disassembled_once_for_every_block_running_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The globals a forward reads are found by disassembling its code: the same for each block
    # of a model (and each capture), so done once per code object; what they hold is read anew.
    import dis

    from dualgraph.torch import _closed_over

    class Scaled(nn.Module):  # a class of its own: no earlier test disassembled its code
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * TEMPERATURE

    disassembled: list[Any] = []
    get_instructions = dis.get_instructions

    def counted(code: Any, *args: Any, **kwargs: Any) -> Any:
        disassembled.append(code)
        return get_instructions(code, *args, **kwargs)

    monkeypatch.setattr(dis, "get_instructions", counted)
    found = [_closed_over.forward_values(Scaled())[0] for _ in range(3)]
    assert disassembled.count(Scaled.forward.__code__) == 1
    assert [[(name, value) for name, _, _, value in each] for each in found] == [
        [("Scaled.forward's global TEMPERATURE", 2.0)]
    ] * 3


@pytest.mark.parametrize("blocks", [1, 4])
def test_a_capture_reads_the_class_of_its_blocks_once_whatever_their_number(
    monkeypatch: pytest.MonkeyPatch, blocks: int
) -> None:
    # What a forward runs of its class and the class attributes it reads are the same for
    # every block of one class, and nothing runs during a capture's setup that could change
    # them: read once for all blocks (each block's forward was followed twice, 12 blocks of a
    # ViT ~6 ms of a capture on a CPU); each block's value still compared after capture.
    import inspect

    from dualgraph.torch import _closed_over

    class Scaled(nn.Module):  # a class of its own: no earlier capture read it
        scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    looked_up: list[str] = []
    getattr_static = inspect.getattr_static

    def counted(owner: Any, name: str, *default: Any) -> Any:
        if owner is Scaled:
            looked_up.append(name)
        return getattr_static(owner, name, *default)

    monkeypatch.setattr(_closed_over.inspect, "getattr_static", counted)
    made = tuple(Scaled() for _ in range(blocks))
    samples = tuple((torch.randn(2, requires_grad=True),) for _ in range(blocks))
    graphed = dgt.make_graphed_callables(made, samples, backend="emulate")
    assert looked_up.count("scale") == 2  # methods_run's and class_values', once each
    monkeypatch.setattr(Scaled, "scale", 3.0)
    with pytest.raises(DualgraphError, match=r"Scaled.scale \(a class attribute\): was 2.0"):
        graphed[-1](torch.randn(2, requires_grad=True))


class _ScaledByTheClass(nn.Module):
    """A Linear times ``scale``, a value of the class (every block's at once), not its own."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class _ScaledBySubclass(_ScaledByTheClass):
    """Reads its base class's ``scale`` until one is set on it."""


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("where", ["on the class", "on a subclass"])
def test_a_class_attribute_a_graphed_modules_forward_reads_changed_after_capture_is_refused(
    backend: str, where: str
) -> None:
    # Eager's forward reads self.scale again on every call, from the class where the instance
    # has none of its own; a graph holds what the forward computed from it at capture (on CUDA
    # the replays went on multiplying by 2.0, silently).
    device = device_of(backend)
    module = nn.Sequential(_ScaledBySubclass(), nn.Tanh()).to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    owner = _ScaledByTheClass if where == "on the class" else _ScaledBySubclass
    try:
        owner.scale = 3.0
        with pytest.raises(DualgraphError) as info:
            module(torch.randn(4, 8, device=device))
    finally:
        _ScaledByTheClass.scale = 2.0
        if "scale" in vars(_ScaledBySubclass):
            del _ScaledBySubclass.scale
    assert str(info.value).startswith(
        "_ScaledBySubclass.scale (a class attribute): was 2.0 at capture and is 3.0 now"
    )


class _EncodesAtTheClassScale(nn.Module):
    """``encode`` (graphed as a method) reads ``scale`` from the class; ``forward``, which the
    method never calls, reads ``unused`` from it."""

    scale = 2.0
    unused = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.unused


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_class_attribute_a_graphed_method_reads_changed_after_capture_is_refused(
    backend: str,
) -> None:
    device = device_of(backend)
    module = _EncodesAtTheClassScale().to(device)
    sample = (torch.randn(4, 8, device=device, requires_grad=True),)
    graphed = dgt.make_graphed_callables(module.encode, sample, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    try:
        _EncodesAtTheClassScale.unused = 3.0  # read by the forward only: no change
        graphed(x)
        _EncodesAtTheClassScale.scale = 3.0
        with pytest.raises(DualgraphError) as info:
            graphed(x)
    finally:
        _EncodesAtTheClassScale.scale, _EncodesAtTheClassScale.unused = 2.0, 1.0
    assert str(info.value).startswith(
        f"{graphed.name}: _EncodesAtTheClassScale.scale (a class attribute): was 2.0 at "
        "capture and is 3.0 now"
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_class_attribute_set_again_to_an_equal_value_is_no_change(backend: str) -> None:
    device = device_of(backend)
    module = _ScaledByTheClass().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    x = torch.randn(4, 8, device=device)
    try:
        _ScaledByTheClass.scale = float("2.0")  # another float object, the same value
        assert_tensors_match(module(x), module.fc(x) * 2.0, "output", tolerance(backend))
    finally:
        _ScaledByTheClass.scale = 2.0


class _TemperedInAHelper(nn.Module):
    """Its forward calls a method of its own class that reads the global ``TEMPERATURE`` and
    the class's ``scale``."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tempered(x).tanh()

    def _tempered(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / TEMPERATURE * self.scale


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("what", ["global", "class attribute"])
def test_a_value_a_helper_method_of_the_forward_reads_changed_after_capture_is_refused(
    backend: str, what: str
) -> None:
    # The forward's own code reads neither: the helper it calls through self does, and a graph
    # holds what it computed at capture.
    global TEMPERATURE
    device = device_of(backend)
    module = _TemperedInAHelper().to(device)
    dgt.make_graphed_callables(module, (torch.randn(4, 8, device=device),), backend=backend)
    try:
        if what == "global":
            TEMPERATURE = 3.0
        else:
            _TemperedInAHelper.scale = 3.0
        with pytest.raises(DualgraphError) as info:
            module(torch.randn(4, 8, device=device))
    finally:
        TEMPERATURE, _TemperedInAHelper.scale = 2.0, 2.0
    expected = (
        "_TemperedInAHelper._tempered's global TEMPERATURE"
        if what == "global"
        else "_TemperedInAHelper.scale (a class attribute)"
    )
    assert str(info.value).startswith(f"{expected}: was 2.0 at capture and is 3.0 now")


class _FrozenTempered(nn.Module):
    """Divides by the global ``TEMPERATURE`` in its forward and in a helper of ``encode``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / TEMPERATURE

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._tempered(x).tanh()

    def _tempered(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / TEMPERATURE


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("graphed", ["a function calling the module", "a method"])
def test_a_global_the_code_a_graphed_function_runs_reads_changed_after_capture_is_refused(
    backend: str, graphed: str
) -> None:
    # Not the function's own code: the forward of the module it calls, or the helper the
    # method calls through self (a graph holds what they computed at capture).
    global TEMPERATURE
    device = device_of(backend)
    module = _FrozenTempered().to(device)
    if graphed == "a method":
        fn, expected = module.encode, "_FrozenTempered._tempered's global TEMPERATURE"
    else:
        fn, expected = (lambda x: module(x) * 2), "_FrozenTempered.forward's global TEMPERATURE"
    sample = (torch.randn(4, 8, device=device, requires_grad=True),)
    callable_ = dgt.make_graphed_callables(fn, sample, backend=backend)
    try:
        TEMPERATURE = 3.0
        with pytest.raises(DualgraphError) as info:
            callable_(torch.randn(4, 8, device=device, requires_grad=True))
    finally:
        TEMPERATURE = 2.0
    assert str(info.value).startswith(
        f"{callable_.name}: {expected}: was 2.0 at capture and is 3.0 now"
    )


class _ScaledThroughAHelper(nn.Module):
    """Reads the class's ``scale`` in a classmethod its forward calls and in a property its
    ``encode`` reads: neither's code is the forward's or the method's own."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self._scale_of_the_class()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.factor).tanh()

    @classmethod
    def _scale_of_the_class(cls) -> float:
        return cls.scale

    @property
    def factor(self) -> float:
        return self.scale


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize(
    "graphed",
    [
        "the module (a classmethod)",
        "a function calling the module (a classmethod)",
        "a method (a property)",
    ],
)
def test_a_class_attribute_a_classmethod_or_property_reads_changed_after_capture_is_refused(
    backend: str, graphed: str
) -> None:
    # methods_run followed functions and staticmethods only: a class attribute read in a
    # classmethod or a property's getter was never compared (on CUDA the replays went on
    # multiplying by 2.0, silently).
    device = device_of(backend)
    module = _ScaledThroughAHelper().to(device)
    fn: Any = {
        "the module (a classmethod)": module,
        "a function calling the module (a classmethod)": lambda x: module(x) * 2,
        "a method (a property)": module.encode,
    }[graphed]
    sample = (torch.randn(4, 8, device=device, requires_grad=True),)
    callable_ = dgt.make_graphed_callables(fn, sample, backend=backend)
    try:
        _ScaledThroughAHelper.scale = 3.0
        with pytest.raises(DualgraphError) as info:
            callable_(torch.randn(4, 8, device=device, requires_grad=True))
    finally:
        _ScaledThroughAHelper.scale = 2.0
    assert "_ScaledThroughAHelper.scale (a class attribute): was 2.0 at capture and is 3.0 now" in (
        str(info.value)
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_value_a_graphed_function_sets_itself_is_no_change(backend: str) -> None:
    # A counter it keeps in its closure (nonlocal) is its own, as a module's own counter is:
    # "emulate" re-runs the Python, which moves it on every call, a graph never does.
    calls = 0

    def counted(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return x * 2

    sample = (torch.randn(4, device=device_of(backend), requires_grad=True),)
    graphed = dgt.make_graphed_callables(counted, sample, backend=backend)
    x = torch.randn(4, device=device_of(backend))
    for _ in range(3):
        assert_tensors_match(graphed(x), x * 2, "output", tolerance(backend))


class ScalesByAnInput(nn.Module):
    """A Linear and tanh, times ``scale`` plus ``shift`` (inputs): the backward reads ``scale``
    (for the grads through the product) and ``x`` (for the weight's grad, where it needs one),
    never ``shift``, which is only added."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        shift: torch.Tensor,
        valid_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.linear(x).tanh() * scale + shift


def _scaled_call(entry: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call's ``x`` (a leaf requiring grad), ``scale`` and ``shift`` (neither requires grad)."""
    return batch(call_length(entry)), torch.rand(4) + 0.5, torch.randn(4)


def _changed_in_place(how: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Change a saved input of a call in place after it, as ``how`` says; the caller's tensor
    passed for it is returned (``x_derived``: ``h = x * 1``, passed instead of ``x``)."""
    with torch.no_grad():
        if how == "scale":
            scale.add_(1.0)
        elif how == "view_of_scale":
            scale[:2].mul_(2.0)
        elif how == "leaf_x":  # a leaf requiring grad, changed where autograd allows it
            x.add_(1.0)
    return x


SAVED_CHANGES = ["scale", "view_of_scale", "leaf_x", "derived_x"]


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("how", SAVED_CHANGES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_input_the_backward_reads_changed_in_place_before_it_is_refused_on_every_entry_point(
    entry: str, how: str, param_grads: str
) -> None:
    # Eager's backward raises (an input it saved was modified by an inplace operation); a
    # replay's backward read the static copy made at the call, silently grads of the old values.
    if entry in ("function", "method") and how.endswith("_x"):
        pytest.skip("the weights are frozen: the backward does not read x (see the next test)")
    module = ScalesByAnInput()
    twin = copy.deepcopy(module)
    graphed = graphed_on(entry, module, (torch.ones(4), torch.zeros(4)), param_grads=param_grads)
    twin.requires_grad_(entry not in ("function", "method"))  # as graphed_on leaves the module
    path = "args[0]" if how.endswith("_x") else "args[1]"
    backward_of(graphed(*_scaled_call(entry)))  # each .grad a tensor, to see it left alone
    kept = grads_of(parameters_of(module))
    x, scale, shift = _scaled_call(entry)
    h = x * 1 if how == "derived_x" else x
    loss = graphed(h, scale, shift).sum()
    eager_x = x.detach().clone().requires_grad_()
    eager_h = eager_x * 1 if how == "derived_x" else eager_x
    eager_scale = scale.clone()
    eager_loss = twin(eager_h, eager_scale, shift).sum()
    if how == "derived_x":
        with torch.no_grad():
            h.add_(1.0)
            eager_h.add_(1.0)
    else:
        _changed_in_place(how, x, scale)
        _changed_in_place(how, eager_x, eager_scale)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager_loss.backward()  # eager refuses it
    with pytest.raises(DualgraphError, match=re.escape(f"{path} was modified in place after")):
        loss.backward()
    assert x.grad is None
    assert_grads_match(grads_of(parameters_of(module)), kept, parameter_names(module))
    if entry in ("slots", "schedule"):
        dgt.reset_slots(graphed)  # the refused replay stays in flight: a step abandoned
    # the next call, left alone, trains as eager
    for tensor in (*module.parameters(), *twin.parameters()):
        tensor.grad = None
    x, scale, shift = _scaled_call(entry)
    eager_x = x.detach().clone().requires_grad_()
    backward_of(graphed(x, scale, shift))
    backward_of(twin(eager_x, scale, shift))
    exact = tolerance("emulate") if entry != "pad" else (1e-6, 1e-5)  # pad: up to rounding
    assert_tensors_match(x.grad, eager_x.grad, "x.grad", exact)
    assert_grads_match(
        grads_of(parameters_of(module)),
        grads_of(parameters_of(twin)),
        parameter_names(module),
        exact,
    )


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_input_the_backward_does_not_read_may_be_changed_in_place_as_in_eager(
    entry: str, param_grads: str
) -> None:
    # ``shift`` is only added: eager saves it nowhere, and its backward runs. With the weights
    # frozen (a function, a method), neither is ``x`` saved. No refusal, and eager's grads.
    module = ScalesByAnInput()
    twin = copy.deepcopy(module)
    graphed = graphed_on(entry, module, (torch.ones(4), torch.zeros(4)), param_grads=param_grads)
    twin.requires_grad_(entry not in ("function", "method"))
    x, scale, shift = _scaled_call(entry)
    eager_x, eager_shift = x.detach().clone().requires_grad_(), shift.clone()
    h, eager_h = x * 1, eager_x * 1
    loss, eager_loss = graphed(h, scale, shift).sum(), twin(eager_h, scale, eager_shift).sum()
    with torch.no_grad():
        for tensor in (shift, eager_shift):
            tensor.add_(1.0)
        if entry in ("function", "method"):
            h.mul_(2.0)
            eager_h.mul_(2.0)
    loss.backward()
    eager_loss.backward()
    exact = tolerance("emulate") if entry != "pad" else (1e-6, 1e-5)  # pad: up to rounding
    assert_tensors_match(x.grad, eager_x.grad, "x.grad", exact)
    assert_grads_match(
        grads_of(parameters_of(module)),
        grads_of(parameters_of(twin)),
        parameter_names(module),
        exact,
    )


def test_an_input_the_backward_reads_changed_after_a_padded_call_names_the_callers_input() -> None:
    # The replay of a padded call reads a padded copy: the caller's tensor is what eager saved.
    module = ScalesByAnInput()
    graphed = graphed_on("pad", module, (torch.ones(4), torch.zeros(4)))
    x, scale, shift = _scaled_call("pad")
    loss = graphed(x, scale, shift).sum()
    with torch.no_grad():
        x.mul_(2.0)
    with pytest.raises(DualgraphError, match=re.escape("args[0] was modified in place after")):
        loss.backward()


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_input_of_an_earlier_slot_changed_before_one_backward_through_both_adds_nothing(
    param_grads: str,
) -> None:
    # The engine runs the later slot's backward first: it must refuse before that one adds.
    module = ScalesByAnInput()
    graphed = graphed_on("slots", module, (torch.ones(4), torch.zeros(4)), param_grads=param_grads)
    backward_of(graphed(*_scaled_call("slots")))
    kept = grads_of(parameters_of(module))
    first, second = _scaled_call("slots"), _scaled_call("slots")
    loss = graphed(*first).sum() + graphed(*second).sum()
    with torch.no_grad():
        first[1].add_(1.0)
    with pytest.raises(DualgraphError, match=re.escape("args[1] was modified in place after")):
        loss.backward()
    assert first[0].grad is None and second[0].grad is None
    assert_grads_match(grads_of(parameters_of(module)), kept, parameter_names(module))


class ScalesOnlyADroppedResult(nn.Module):
    """Multiplies by ``scale`` (an input) in a result it drops, and only adds it to the one it
    returns: the dropped product saved ``scale``, no backward reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        _ = h * scale
        return h.tanh() + scale


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_input_only_a_dropped_result_saved_may_change_before_the_backward_as_in_eager(
    param_grads: str,
) -> None:
    # The warmup took every saved tensor for one the backward reads: "args[1] was modified in
    # place after the call" where eager's backward never reaches the product's node.
    module = ScalesOnlyADroppedResult()
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(
        module, (batch(), torch.ones(4)), backend="emulate", param_grads=param_grads
    )
    for _ in range(2):
        x, scale = batch(), torch.rand(4)
        eager_x, eager_scale = x.detach().clone().requires_grad_(), scale.clone()
        loss, eager_loss = graphed(x, scale).sum(), twin(eager_x, eager_scale).sum()
        scale.add_(1.0)
        eager_scale.add_(1.0)
        loss.backward()
        eager_loss.backward()
        assert_tensors_match(x.grad, eager_x.grad, "x.grad")
        assert_grads_match(
            grads_of(parameters_of(module)), grads_of(parameters_of(twin)), parameter_names(module)
        )


class HalvesThenScales(nn.Module):
    """Halves ``scale`` (an input) in place, then multiplies by it: the backward reads it as
    updated, which is no change after the call (the replay copies the update back)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scale.mul_(0.5)
        return self.linear(x).tanh() * scale


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_input_the_callable_updates_before_the_backward_reads_it_trains_as_eager(
    param_grads: str,
) -> None:
    module = HalvesThenScales()
    twin = copy.deepcopy(module)
    graphed = dgt.make_graphed_callables(
        module, (batch(), torch.ones(4)), backend="emulate", param_grads=param_grads
    )
    x, scale = batch(), torch.rand(4) + 0.5
    eager_x, eager_scale = x.detach().clone().requires_grad_(), scale.clone()
    backward_of(graphed(x, scale))
    backward_of(twin(eager_x, eager_scale))
    assert torch.equal(scale, eager_scale)
    assert_tensors_match(x.grad, eager_x.grad, "x.grad")
    assert_grads_match(
        grads_of(parameters_of(module)), grads_of(parameters_of(twin)), parameter_names(module)
    )
    loss = graphed(x, scale).sum()
    scale.add_(1.0)  # a change of the caller's after the call is refused, as ever
    with pytest.raises(DualgraphError, match=re.escape("args[1] was modified in place after")):
        loss.backward()


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_a_weight_changed_between_two_slots_before_one_backward_through_both_adds_nothing(
    param_grads: str,
) -> None:
    # The later slot's replay saw the changed weight, the earlier one's backward reads it: the
    # engine runs the later one first, which must refuse before its graph adds into .grad.
    module = ScalesByAnInput()
    graphed = graphed_on("slots", module, (torch.ones(4), torch.zeros(4)), param_grads=param_grads)
    backward_of(graphed(*_scaled_call("slots")))
    kept = grads_of(parameters_of(module))
    first = graphed(*_scaled_call("slots")).sum()
    with torch.no_grad():
        module.linear.weight.add_(1.0)
    second = graphed(*_scaled_call("slots")).sum()
    with pytest.raises(DualgraphError, match=r"linear\.weight was modified in place"):
        (first + second).backward()
    assert_grads_match(grads_of(parameters_of(module)), kept, parameter_names(module))


@pytest.mark.parametrize("param_grads", ["auto", "autograd", "in_graph"])
def test_an_inference_tensor_the_backward_would_read_is_refused_as_eager_refuses_it(
    param_grads: str,
) -> None:
    # Eager raises 'Inference tensors cannot be saved for backward' at the call; a replay took
    # it (its static copy is a normal tensor), and no change of it after the call could be seen.
    module = ScalesByAnInput()
    twin = copy.deepcopy(module)
    graphed = graphed_on("plain", module, (torch.ones(4), torch.zeros(4)), param_grads=param_grads)
    x, scale, shift = _scaled_call("plain")
    with torch.inference_mode():
        scale = scale.clone()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        twin(x, scale, shift)
    with pytest.raises(DualgraphError, match=re.escape("args[1]: an inference tensor")):
        graphed(x, scale, shift)
    with torch.no_grad():  # no backward follows: eager takes it, and so does a replay
        assert_tensors_match(graphed(x, scale, shift), twin(x, scale, shift), "output")
    backward_of(graphed(x, scale.clone(), shift))  # and the next call trains
    assert x.grad is not None


# -- a parameter whose grad is sparse (nn.Embedding(sparse=True)) ------------------------------


class SparseLookup(nn.Module):
    """Scales ``x`` by rows of an embedding whose grad is sparse (a recommender's table)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(7, 4, sparse=True)

    def forward(self, x: torch.Tensor, valid_length: torch.Tensor | None = None) -> torch.Tensor:
        return x * self.table(torch.arange(x.shape[1], device=x.device) % 3)


@pytest.mark.parametrize("param_grads", ["auto", "autograd"])
@pytest.mark.parametrize("entry", WITH_PARAMETERS)
def test_a_sparse_parameter_grad_stays_sparse_as_eager_on_every_entry_point(
    entry: str, param_grads: str
) -> None:
    # "auto" added a sparse embedding's grads into a dense accumulator: .grad came back dense
    # (eager's is sparse), and optimizers that take sparse grads (SparseAdam) refused it;
    # "autograd" with buckets copied the sparse grad into a dense shared buffer (RuntimeError);
    # the padding check of a padded call compared sparse grads with torch's dense ops.
    module = SparseLookup()
    twin = copy.deepcopy(module)
    graphed = graphed_on(entry, module, param_grads=param_grads)
    for step in range(2):
        for _ in range(2):  # grad accumulation
            x = batch(call_length(entry))
            backward_of(graphed(x.detach().clone().requires_grad_()))
            backward_of(twin(x))
        grad, expected = module.table.weight.grad, twin.table.weight.grad
        assert grad.layout is expected.layout is torch.sparse_coo
        assert torch.equal(grad.to_dense(), expected.to_dense())
        module.zero_grad(set_to_none=step == 0)
        twin.zero_grad(set_to_none=step == 0)


def test_in_graph_refuses_a_sparse_parameter_grad_naming_it() -> None:
    module = SparseLookup()
    with pytest.raises(DualgraphError, match=r"SparseLookup.table.weight: its backward gives a "):
        dgt.make_graphed_callables(module, (batch(),), backend="emulate", param_grads="in_graph")
    backward_of(module(batch()))  # the module is usable eagerly
    assert module.table.weight.grad.layout is torch.sparse_coo


def _product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y


def test_an_input_saved_only_for_a_grad_this_call_needs_not_may_be_changed_as_in_eager() -> None:
    # Captured with both factors requiring grad, ``x * y`` saves both; a call with ``x`` without
    # grad saves only ``x`` (for y's grad), so eager's backward runs after ``y`` changes in place.
    graphed = dgt.make_graphed_callables(
        _product, (torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True))
    )
    x = torch.arange(4.0)
    leaf = torch.full((4,), 2.0, requires_grad=True)
    y, eager_y = leaf * 1, leaf * 1
    out, eager_out = graphed(x, y), _product(x, eager_y)
    with torch.no_grad():
        y.add_(1.0)
        eager_y.add_(1.0)
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    (eager_grad,) = torch.autograd.grad(eager_out.sum(), leaf)
    assert torch.equal(grad, eager_grad)
    # the capture's pattern (both need grad) is still checked: eager raises there
    x = torch.ones(4, requires_grad=True)
    y = leaf * 1
    out = graphed(x, y)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(DualgraphError, match=r"args\[1\] was modified in place"):
        out.sum().backward()


class _BranchesOnGradMode(nn.Module):
    """Scales by 2 with grad on, by 3 without (as a fast path taken only without grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if torch.is_grad_enabled() else 3.0)


class _BranchesOnRequiresGrad(nn.Module):
    """Scales by 2 where its input requires grad, by 3 where not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if x.requires_grad else 3.0)


class _ReadsNoFlags(nn.Module):
    """Reads neither grad mode nor a flag (its own no_grad block saves grad mode to put it back)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shift = x.mean()
        return self.fc(x) + shift


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_callable_branching_on_grad_mode_runs_eagerly_under_no_grad(backend: str) -> None:
    # On CUDA a replay would run the branch taken with grad on at capture (scale 2).
    device = device_of(backend)
    module = _BranchesOnGradMode().to(device)
    twin = copy.deepcopy(module)
    dgt.make_graphed_callables(module, (torch.randn(2, 4, device=device),), backend=backend)
    x = torch.randn(2, 4, device=device)
    replays = dgt.diagnostics(module).replays
    with torch.no_grad():
        out = module(x)
        expected = twin(x)
    assert_tensors_match(out, expected, "output", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1
    assert dgt.diagnostics(module).replays == replays
    assert_tensors_match(module(x), twin(x), "output", tolerance(backend))  # grad on: replayed
    assert dgt.diagnostics(module).replays == replays + 1


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_callable_branching_on_an_inputs_requires_grad_runs_eagerly_where_it_differs(
    backend: str,
) -> None:
    device = device_of(backend)
    module = _BranchesOnRequiresGrad().to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend)
    x = torch.randn(2, 4, device=device)  # requires no grad: eager scales by 3
    assert_tensors_match(module(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1
    x.requires_grad_(True)  # as the sample: replayed
    assert_tensors_match(module(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1


class _BranchesOnHistory(nn.Module):
    """Scales by 2 where its input is a leaf (``x.is_leaf``, or ``x.grad_fn is None``), by 3
    where it was computed under grad (a previous layer's output)."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.flag = flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leaf = x.is_leaf if self.flag == "is_leaf" else x.grad_fn is None
        return self.fc(x) * (2.0 if leaf else 3.0)


@pytest.mark.parametrize("flag", ["is_leaf", "grad_fn"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_callable_branching_on_whether_an_input_is_a_leaf_runs_eagerly_where_it_is_not(
    backend: str, param_grads: str, flag: str
) -> None:
    # The replay's inputs are leaves, as at capture: a replay would take the leaf's branch for
    # a caller's tensor computed under grad, which eager scales by 3.
    device = device_of(backend)
    module = _BranchesOnHistory(flag).to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, param_grads=param_grads)
    leaf = torch.randn(2, 4, device=device, requires_grad=True)
    twin_leaf = leaf.detach().clone().requires_grad_()
    out, expected = module(leaf * 1.5), twin(twin_leaf * 1.5)
    assert_tensors_match(out, expected, "output", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1
    out.sum().backward()
    expected.sum().backward()
    assert_tensors_match(leaf.grad, twin_leaf.grad, "leaf.grad", tolerance(backend))
    for p, q in zip(module.parameters(), twin.parameters(), strict=True):
        assert_tensors_match(p.grad, q.grad, "parameter grad", tolerance(backend))
    x = torch.randn(2, 4, device=device, requires_grad=True)  # a leaf, as the sample: replayed
    assert_tensors_match(module(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1


class _TurnsRequiresGradOn(nn.Module):
    """Turns its input's requires_grad on (a saliency map's pattern: ``x.grad`` after the
    backward), through the method or the attribute."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "requires_grad_":
            x.requires_grad_()
        else:
            x.requires_grad = True
        return self.fc(x).tanh()


@pytest.mark.parametrize("how", ["requires_grad_", "attribute"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_call_without_grad_of_a_callable_turning_it_on_runs_eagerly(
    backend: str, param_grads: str, how: str
) -> None:
    # Eager's call turns the caller's tensor's requires_grad on, so the output depends on it
    # and it gets a grad. The replay took no edge to a tensor that did not require grad: its
    # output was left without history through x, x.grad stayed None and x.requires_grad False.
    device = device_of(backend)
    module = _TurnsRequiresGradOn(how).to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend, param_grads=param_grads)
    x, x_twin = torch.randn(2, 4, device=device), torch.randn(2, 4, device=device)
    x_twin.copy_(x)
    module(x).sum().backward()
    twin(x_twin).sum().backward()
    assert x.requires_grad and x.grad is not None
    assert_tensors_match(x.grad, x_twin.grad, "args[0].grad", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 1
    x = torch.randn(2, 4, device=device, requires_grad=True)  # as the sample: replayed
    module(x).sum().backward()
    assert dgt.diagnostics(module).eager_calls == 1 and x.grad is not None


class _WideBranchesOnRequiresGrad(nn.Module):
    """Scales by 2 where its input requires grad, by 3 where not; wide enough that the order in
    which a weight's grads are added shows in the last bits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (2.0 if x.requires_grad else 3.0)


@pytest.mark.parametrize("layout", ["plain", "slots", "buckets"])
def test_auto_sums_a_replays_grads_with_those_of_a_call_run_eagerly_in_one_backward_as_eager(
    layout: str,
) -> None:
    # A call whose input's requires_grad differs from the sample's runs eagerly; one backward
    # through it and a replay gives the weight grads of both uses. "auto" added the replay's
    # share into .grad in its graph and autograd the eager one's after it, where eager sums both
    # first (last bits apart); it now hands the replay's to autograd while such a graph lives.
    torch.manual_seed(0)
    module = _WideBranchesOnRequiresGrad()
    twin = copy.deepcopy(module)
    options: dict[str, Any] = {"backend": "emulate", "param_grads": "auto"}
    if layout == "buckets":
        options["buckets"] = [(torch.randn(n, 16, requires_grad=True),) for n in (8, 4)]
    else:
        options["sample_args"] = (torch.randn(8, 16, requires_grad=True),)
        if layout == "slots":
            options["slots"] = 2
    dgt.make_graphed_callables(module, **options)
    replayed, eager = torch.randn(8, 16) * 100, torch.randn(8, 16)
    for side in (module, twin):
        side.fc.weight.grad = torch.randn(16, 16, generator=torch.Generator().manual_seed(5)) * 1e3
        (side(replayed.clone().requires_grad_()).sum() + side(eager.clone()).sum()).backward()
    assert dgt.diagnostics(module).eager_calls == 1
    assert torch.equal(module.fc.weight.grad, twin.fc.weight.grad)
    assert torch.equal(module.fc.bias.grad, twin.fc.bias.grad)


@pytest.mark.parametrize("layout", ["plain", "slots", "buckets"])
def test_auto_sums_a_replays_grads_with_those_of_the_modules_forward_in_the_other_mode_as_eager(
    layout: str,
) -> None:
    # A graphed module in the other training mode runs its forward eagerly; one backward
    # through such a call and a replay gives the weight grads of both uses. "auto" added the
    # replay's share into .grad in its graph and autograd the eager one's after it, where eager
    # sums both first (last bits apart); it now hands the replay's to autograd meanwhile.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.0))
    twin = copy.deepcopy(module)
    options: dict[str, Any] = {"backend": "emulate", "param_grads": "auto"}
    if layout == "buckets":
        options["buckets"] = [(torch.randn(n, 16, requires_grad=True),) for n in (8, 4)]
    else:
        options["sample_args"] = (torch.randn(8, 16, requires_grad=True),)
        if layout == "slots":
            options["slots"] = 2
    dgt.make_graphed_callables(module, **options)
    replayed, evaluated = torch.randn(8, 16) * 100, torch.randn(8, 16, requires_grad=True)
    for side in (module, twin):
        side[0].weight.grad = torch.randn(16, 16, generator=torch.Generator().manual_seed(5)) * 1e3
        trained = side(replayed.clone().requires_grad_()).sum()
        side.eval()
        (trained + side(evaluated).sum()).backward()
        side.train()
    assert dgt.diagnostics(module).param_grads_through_autograd == 1
    assert torch.equal(module[0].weight.grad, twin[0].weight.grad)
    assert torch.equal(module[0].bias.grad, twin[0].bias.grad)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_callable_reading_no_grad_mode_replays_under_no_grad(backend: str) -> None:
    device = device_of(backend)
    module = _ReadsNoFlags().to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(module, (sample,), backend=backend)
    replays = dgt.diagnostics(module).replays
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        assert_tensors_match(module(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(module).replays == replays + 1
    assert dgt.diagnostics(module).eager_calls == 0


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_submodules_full_backward_hook_is_no_read_of_grad_mode(backend: str) -> None:
    # torch's hook machinery reads grad mode only to record the hook's identity node: under
    # no_grad the forward's values are the same, so the call replays (no silent eager call)
    device = device_of(backend)
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(device)
    module[0].register_full_backward_hook(lambda *_: None)
    twin = copy.deepcopy(module)
    dgt.make_graphed_callables(module, (torch.randn(2, 4, device=device),), backend=backend)
    replays = dgt.diagnostics(module).replays
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        assert_tensors_match(module(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(module).eager_calls == 0
    assert dgt.diagnostics(module).replays == replays + 1


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_transformer_layer_in_eval_runs_eagerly_under_no_grad_as_its_fast_path(
    backend: str,
) -> None:
    # eager takes torch's fast path (another kernel) under no_grad in eval; a replay would not
    device = device_of(backend)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).to(device).eval()
    twin = copy.deepcopy(layer)
    dgt.make_graphed_callables(layer, (torch.randn(2, 3, 8, device=device),), backend=backend)
    x = torch.randn(2, 3, 8, device=device)
    with torch.no_grad():
        assert_tensors_match(layer(x), twin(x), "output", tolerance(backend))
    assert dgt.diagnostics(layer).eager_calls == 1
