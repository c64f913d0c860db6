"""Outputs that share memory in eager (one tensor twice, a view of another output, an input
itself or a view of one) come back from a replay with the same relations, compared with eager:
identity, ``_base``, ``requires_grad``, an in-place change through one seen through the other,
and the grads of a loss using both. What a replay cannot give as eager does is refused at capture.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch_cases import (
    GRAD_MODES,
    GRAPH_BACKENDS,
    GRAPH_GRAD_MODES,
    assert_grads_match,
    assert_trees_match,
    capture_error,
    device_of,
    isolation,
    loss_of,
    parameter_names,
    parameters_of,
    tensors_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


def _outputs(kind: str, x: torch.Tensor, h: torch.Tensor) -> Any:
    if kind == "twice":
        return h, h
    if kind == "index":
        return h, h[0]
    if kind == "view":
        return h, h.view(-1)
    if kind == "transpose":
        return h, h.t()
    if kind == "view_first":
        return h.view(2, -1), h
    if kind == "hidden_states":  # HF's output_hidden_states: the last hidden state twice
        return {"last": h, "all": (h * 2, h)}
    if kind == "expand":  # a view counting more elements than the output it views
        return h[:1].expand(5, -1), h
    if kind == "unfold":
        return h.unfold(0, 2, 1), h
    if kind == "input":
        return x, h
    if kind == "input_view":
        return x[1], h
    if kind == "empty_input_view":  # no element, still a view of x in eager
        return x[:0], h
    if kind == "empty_view":
        return h, h[3:]
    raise AssertionError(kind)


KINDS = [
    "twice",
    "index",
    "view",
    "transpose",
    "view_first",
    "hidden_states",
    "expand",
    "unfold",
    "input",
    "input_view",
    "empty_input_view",
    "empty_view",
]


class Aliasing(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        return _outputs(self.kind, x, self.fc(x))


def _relations(outputs: Any, x: torch.Tensor) -> list[tuple[Any, ...]]:
    """What eager's aliasing looks like: identity, bases, flags, among outputs and with ``x``."""
    flat = tensors_of(outputs)
    found: list[tuple[Any, ...]] = []
    for a, t in enumerate(flat):
        found.append((a, t.requires_grad, t._is_view(), t is x, t._base is x))
        for b, u in enumerate(flat):
            found.append((a, b, t is u, t._base is u, _shares(t, u)))
    return found


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _pair(kind: str, backend: str, param_grads: str) -> tuple[nn.Module, Any]:
    device = device_of(backend)
    eager = Aliasing(kind).to(device)
    module = copy.deepcopy(eager)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    options = {} if backend == "eager" else {"param_grads": param_grads}
    return eager, dgt.make_graphed_callables(module, (sample,), backend=backend, **options)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_aliased_outputs_keep_eager_relations_in_place_changes_and_grads(
    kind: str, backend: str, param_grads: str
) -> None:
    eager, graphed = _pair(kind, backend, param_grads)
    tol = tolerance(backend)
    for _ in range(3):
        x = torch.randn(3, 4, device=device_of(backend), requires_grad=True)
        x_eager = x.detach().clone().requires_grad_(True)
        ours, theirs = graphed(x), eager(x_eager)
        assert _relations(ours, x) == _relations(theirs, x_eager)
        # An in-place change through the last output: eager sees it through its aliases.
        with torch.no_grad():
            tensors_of(ours)[-1].add_(1.0)
            tensors_of(theirs)[-1].add_(1.0)
        assert_trees_match(ours, theirs, tol)
        assert_trees_match(x.detach(), x_eager.detach(), tol)
        loss_of(ours).backward()  # every output, both aliases among them
        loss_of(theirs).backward()
        assert_grads_match([x.grad], [x_eager.grad], ["x"], tol)
    assert_grads_match(
        [p.grad for p in parameters_of(graphed)],
        [p.grad for p in parameters_of(eager)],
        parameter_names(eager),
        tol,
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_aliased_outputs_keep_relations_without_grad_and_with_clone_outputs(
    kind: str, backend: str
) -> None:
    device = device_of(backend)
    eager = Aliasing(kind).to(device)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        copy.deepcopy(eager), (sample,), backend=backend, clone_outputs=True
    )
    x = torch.randn(3, 4, device=device)
    with torch.no_grad():
        ours, theirs = graphed(x), eager(x)
    assert _relations(ours, x) == _relations(theirs, x)
    with torch.no_grad():
        tensors_of(ours)[-1].mul_(3.0)
        tensors_of(theirs)[-1].mul_(3.0)
    assert_trees_match(ours, theirs, tolerance(backend))


class _NormedView(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.bn(x)
        view = {"transpose": h.t(), "flat": h.view(-1), "input": x.t()}[self.kind]
        return view, h


@pytest.mark.parametrize("kind", ["transpose", "flat", "input"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_a_view_output_hands_on_its_grad_in_eager_layout(
    kind: str, backend: str, param_grads: str
) -> None:
    # Found by the fuzzer: a loss of the view alone (h.t().sum()) sends h an expanded grad
    # through eager's TBackward0, a dense one through the replay's as_strided view; BatchNorm's
    # backward rounds them otherwise (bn.weight.grad and x.grad 6.6e-8 off where the true
    # value is 0). A replay makes the view by eager's own ops (its node is eager's, an input's
    # view's too).
    device = device_of(backend)
    torch.manual_seed(0)
    eager = _NormedView(kind).to(device)
    graphed = copy.deepcopy(eager)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(graphed, (sample,), backend=backend, param_grads=param_grads)
    for _ in range(2):
        x = torch.randn(3, 4, device=device)
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours, theirs = graphed(xg), eager(xe)
        assert type(ours[0].grad_fn).__name__ == type(theirs[0].grad_fn).__name__
        (ours[0].sum() * 1.5).backward()
        (theirs[0].sum() * 1.5).backward()
        assert torch.equal(xg.grad, xe.grad)
        for ours_p, theirs_p in zip(graphed.parameters(), eager.parameters(), strict=True):
            assert (ours_p.grad is None) == (theirs_p.grad is None)
            assert ours_p.grad is None or torch.equal(ours_p.grad, theirs_p.grad)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_outputs_without_shared_memory_record_no_aliases(backend: str) -> None:
    device = device_of(backend)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        lambda x: (x.exp(), x.sin(), x.cos().unbind(0)), (sample,), backend=backend
    )
    assert graphed.plan.output_aliases is None


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_views_of_one_hidden_tensor_that_share_no_element_stay_apart(backend: str) -> None:
    # h[:, 0] and h[:, 1] interleave in memory but share no element: as in eager, a change
    # of one leaves the other alone.
    device = device_of(backend)
    sample = torch.randn(3, 4, device=device, requires_grad=True)

    def columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        return h[:, 0], h[:, 1]

    graphed = dgt.make_graphed_callables(columns, (sample,), backend=backend)
    x = torch.randn(3, 4, device=device, requires_grad=True)
    first, second = graphed(x)
    with torch.no_grad():
        first.add_(1.0)
    assert torch.equal(second, x.detach()[:, 1] * 2)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_overlapping_views_of_a_hidden_tensor_are_refused_at_capture(backend: str) -> None:
    sample = torch.randn(3, 4, device=device_of(backend), requires_grad=True)

    def overlapping(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        return h[:2], h[1:]

    message = capture_error(overlapping, (sample,), backend=backend)
    assert "output[0] and output[1] share memory" in message and ".clone()" in message


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_detached_alias_of_an_input_is_refused_at_capture(backend: str) -> None:
    sample = torch.randn(3, 4, device=device_of(backend), requires_grad=True)
    message = capture_error(lambda x: (x * 2, x.detach()), (sample,), backend=backend)
    assert "output[1] shares memory with args[0]" in message and ".clone()" in message


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_detached_alias_of_an_output_is_handed_out_detached(backend: str) -> None:
    sample = torch.randn(3, 4, device=device_of(backend), requires_grad=True)

    def with_detached(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        return h, h.detach()

    graphed = dgt.make_graphed_callables(with_detached, (sample,), backend=backend)
    x = torch.randn(3, 4, device=device_of(backend), requires_grad=True)
    ours, theirs = graphed(x), with_detached(x)
    assert _relations(ours, x) == _relations(theirs, x)
    with torch.no_grad():
        ours[1].add_(1.0)
    assert torch.equal(ours[0], x.detach() * 2 + 1)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_view_of_an_input_laid_out_otherwise_is_refused_before_any_buffer(
    backend: str,
) -> None:
    device = device_of(backend)
    sample = torch.randn(3, 4, device=device)
    graphed = dgt.make_graphed_callables(lambda x: (x[1], x * 2), (sample,), backend=backend)
    before = [t.clone() for t in graphed.static_inputs]
    transposed = torch.randn(4, 3, device=device).t()
    with pytest.raises(DualgraphError, match=r"output\[0\] is a view of args\[0\].*strides"):
        graphed(transposed)
    assert all(map(torch.equal, graphed.static_inputs, before))
    first, _ = graphed(transposed.contiguous())
    assert first._base is not None and torch.equal(first, transposed[1])


@pytest.mark.parametrize(
    ("returns", "refusal"),
    [
        (lambda x: (x[1], x * 2), r"output\[0\] is a view of args\[0\]"),
        (lambda x: (x, x * 2), r"output\[0\] was args\[0\] itself at capture"),
    ],
    ids=["view", "itself"],
)
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_refused_layout_of_a_returned_input_advises_the_layout_the_callable_saw(
    backend: str, returns: Any, refusal: str
) -> None:
    # The sample was transposed, so the callable saw strides (1, 3): a contiguous call was
    # refused advising to pass it "laid out like the sample (.contiguous())", as it was.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        returns, (torch.randn(4, 3, device=device).t(),), backend=backend
    )
    x = torch.randn(3, 4, device=device)
    with pytest.raises(DualgraphError, match=refusal) as info:
        graphed(x)
    advice = str(info.value).partition(" Pass ")[2]
    assert advice.startswith("args[0] laid out with strides (1, 3) (args[0].new_empty_strided(")
    assert ".contiguous()" not in advice
    laid_out = x.new_empty_strided((3, 4), (1, 3)).copy_(x)
    assert_trees_match(graphed(laid_out), returns(laid_out), tolerance(backend))


#: An op that returns its input itself where it is laid out so, and a call laid out otherwise.
RETURNS_ITS_INPUT_WHERE_LAID_OUT_SO = {
    "contiguous": (torch.Tensor.contiguous, lambda x: x.t().contiguous().t()),
    "resolve_conj": (torch.Tensor.resolve_conj, torch.Tensor.conj),
}


@pytest.mark.parametrize("op", sorted(RETURNS_ITS_INPUT_WHERE_LAID_OUT_SO))
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_returned_itself_laid_out_otherwise_is_refused_before_any_buffer(
    op: str, backend: str
) -> None:
    # x.contiguous() returned x itself at capture; on a transposed x eager returns a copy,
    # where the replay handed out the caller's x: other strides (.view failed), and an
    # in-place change of the output changed the caller's input.
    returns_itself, other_layout = RETURNS_ITS_INPUT_WHERE_LAID_OUT_SO[op]

    def normalized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return returns_itself(x), x * 2

    device = device_of(backend)
    sample = torch.randn(3, 4, dtype=torch.cfloat, device=device)
    graphed = dgt.make_graphed_callables(normalized, (sample,), backend=backend)
    before = [t.clone() for t in graphed.static_inputs]
    x = other_layout(torch.randn(3, 4, dtype=torch.cfloat, device=device))
    with pytest.raises(DualgraphError, match=r"output\[0\] was args\[0\] itself at capture"):
        graphed(x)
    assert all(map(torch.equal, graphed.static_inputs, before))
    laid_out_so = returns_itself(x)
    assert graphed(laid_out_so)[0] is laid_out_so  # as eager: the input itself


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_input_returned_itself_may_differ_in_strides_of_dims_of_one_element(
    backend: str,
) -> None:
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        lambda x: (x.contiguous(), x * 2), (torch.randn(1, 4, device=device),), backend=backend
    )
    x = torch.randn(4, 4, device=device)[1:2]  # strides (4, 1) where the sample's are (4, 1)...
    y = torch.randn(4, 1, device=device).t()  # ...and (1, 1) here: both contiguous
    assert graphed(x)[0] is x and graphed(y)[0] is y


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_view_of_an_input_may_differ_in_strides_of_dims_of_one_element(backend: str) -> None:
    # A (1, 4) input with strides (1, 1) (a transposed column) is contiguous: it was refused as
    # laid out otherwise, and the advice, .contiguous(), returned it as it was.
    device = device_of(backend)

    def rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x[0], x.squeeze(0), x * 2

    graphed = dgt.make_graphed_callables(rows, (torch.randn(1, 4, device=device),), backend=backend)
    x = torch.randn(4, 1, device=device).t()
    assert x.is_contiguous() and x.stride() == (1, 1)
    ours, theirs = graphed(x), rows(x)
    assert_trees_match(ours, theirs)
    before = x.clone()
    with torch.no_grad():
        ours[0].add_(1.0)  # a view of the caller's x, as eager's
    assert torch.equal(x, before + 1.0)


def _step_keeping_its_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of a loop (``h, previous, first = step(h)``): its input returned, and viewed."""
    return torch.tanh(x) * 2, x, x[0]


@pytest.mark.parametrize("clone_outputs", [False, True])
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_earlier_output_passed_as_an_input_an_output_is_is_refused_before_any_buffer(
    backend: str, clone_outputs: bool
) -> None:
    # h is the static buffer of output[0], which the next replay overwrites: the caller's h
    # handed back as output[1] (and viewed as output[2]) held the new tanh(h) * 2, where
    # eager's holds h's values.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        _step_keeping_its_input,
        (torch.randn(3, 4, device=device),),
        backend=backend,
        clone_outputs=clone_outputs,
    )
    x = torch.randn(3, 4, device=device)
    h, _, _ = graphed(x)
    expected = _step_keeping_its_input(h.clone())
    if clone_outputs:  # h is the caller's own
        assert_trees_match(graphed(h), expected, tolerance(backend))
        return
    before = [t.clone() for t in graphed.static_inputs]
    with pytest.raises(
        DualgraphError, match=r"args\[0\] shares memory with output\[0\] of an earlier call"
    ):
        graphed(h)
    assert all(map(torch.equal, graphed.static_inputs, before))
    assert_trees_match(graphed(h.clone()), expected, tolerance(backend))


class ReturnsItsWeight(nn.Module):
    """``(fc(x), fc.weight.t())``: an output that views a parameter (a tied head's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), self.fc.weight.t()


def _loss(outputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (outputs[0] @ outputs[1]).square().sum()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_viewing_a_parameter_is_a_copy_whose_replays_leave_the_parameter_alone(
    backend: str,
) -> None:
    """The replay hands out a copy (as the README says), not the weight's memory: a replay
    writes its outputs, and moving the weight's version would refuse other backwards."""
    device = device_of(backend)
    module = ReturnsItsWeight().to(device)
    graphed = dgt.make_graphed_callables(
        module, (torch.randn(3, 4, device=device, requires_grad=True),), backend=backend
    )
    version = module.fc.weight._version
    _, weight = graphed(torch.randn(3, 4, device=device, requires_grad=True))
    assert torch.equal(weight, module.fc.weight.detach().t())
    assert not _shares(weight, module.fc.weight)
    assert module.fc.weight._version == version


@pytest.mark.parametrize(("backend", "param_grads"), GRAPH_GRAD_MODES)
def test_slots_of_a_callable_returning_its_weight_backward_in_any_order_as_eager(
    backend: str, param_grads: str
) -> None:
    device = device_of(backend)
    eager = ReturnsItsWeight().to(device)
    module = copy.deepcopy(eager)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        module, (sample,), backend=backend, slots=2, param_grads=param_grads
    )
    inputs = [torch.randn(3, 4, device=device, requires_grad=True) for _ in range(2)]
    ours = [graphed(x) for x in inputs]
    theirs = [eager(x.detach().clone().requires_grad_(True)) for x in inputs]
    for k in (1, 0):  # the first slot's backward after the second slot's forward
        _loss(ours[k]).backward()
        _loss(theirs[k]).backward()
    assert_grads_match(
        [p.grad for p in module.parameters()],
        [p.grad for p in eager.parameters()],
        parameter_names(eager),
        tolerance(backend),
    )


class _ReturnsEveryOtherWeightColumn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), self.fc.weight[:, ::2]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_viewing_a_parameter_keeps_eagers_non_dense_layout(backend: str) -> None:
    # Such an output is copied into a buffer of the graph's own (on CUDA outside the pool): the
    # buffer is laid out as eager's view (strides (6, 2)), not made contiguous
    device = device_of(backend)
    module = _ReturnsEveryOtherWeightColumn().to(device)
    with torch.no_grad():
        eager = module(torch.randn(3, 6, device=device))[1]
    dgt.make_graphed_callables(
        module, (torch.randn(3, 6, device=device, requires_grad=True),), backend=backend
    )
    out = module(torch.randn(3, 6, device=device, requires_grad=True))[1]
    assert out.stride() == eager.stride() == (6, 2)
    assert torch.equal(out.detach(), eager)


def _conjugated_views(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # y is not used inside: its grad then comes from the views alone, as eager sums it
    h = x * 2
    return h, h.conj(), h.conj()[0], torch._neg_view(h), y.conj(), y[1].conj()


@pytest.mark.parametrize("inputs_conjugated", [False, True])
@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_a_conjugate_or_negative_view_of_an_input_or_output_keeps_its_bit(
    inputs_conjugated: bool, backend: str, param_grads: str
) -> None:
    # y.conj() is y's memory read conjugated: a view made with as_strided alone lost the bit
    # and handed out y's values unconjugated, silently (values, and the grads through them).
    device = device_of(backend)
    samples = [torch.randn(3, 4, dtype=torch.cfloat, device=device, requires_grad=True)] * 2
    options = {} if backend == "eager" else {"param_grads": param_grads}
    graphed = dgt.make_graphed_callables(_conjugated_views, samples, backend=backend, **options)
    for _ in range(2):
        leaves = [torch.randn(3, 4, dtype=torch.cfloat, device=device, requires_grad=True)]
        leaves.append(torch.randn(3, 4, dtype=torch.cfloat, device=device, requires_grad=True))
        leaves_eager = [t.detach().clone().requires_grad_(True) for t in leaves]
        if inputs_conjugated:
            ours, theirs = (
                graphed(*[t.conj() for t in leaves]),
                _conjugated_views(*[t.conj() for t in leaves_eager]),
            )
        else:
            ours, theirs = graphed(*leaves), _conjugated_views(*leaves_eager)
        assert [(t.is_conj(), t.is_neg()) for t in ours] == [
            (t.is_conj(), t.is_neg()) for t in theirs
        ]
        assert_trees_match(ours, theirs, tolerance(backend))
        sum(t.abs().sum() * k for k, t in enumerate(ours, 1)).backward()
        sum(t.abs().sum() * k for k, t in enumerate(theirs, 1)).backward()
        grads = [t.grad for t in leaves]
        assert_grads_match(grads, [t.grad for t in leaves_eager], ["x", "y"], tolerance(backend))


class _ReturnsItsParameters(nn.Module):
    """``(fc(x), fc.weight, frozen)``: outputs that are parameters themselves (eager's leaves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fc(x) + self.frozen, self.fc.weight, self.frozen, self.fc.weight


@pytest.mark.parametrize(
    ("backend", "param_grads"), [p for p in GRAD_MODES if p.values[1] != "in_graph"]
)
def test_an_output_that_is_a_parameter_is_handed_out_as_that_parameter(
    backend: str, param_grads: str
) -> None:
    # A replay handed out a copy with the replay's history (not a leaf, a grad_fn, another
    # tensor), where eager returns the Parameter itself; its grads reach .grad as eager's, bit
    # for bit ("auto" takes autograd for them: eager sums both shares before adding to .grad).
    device = device_of(backend)
    eager = _ReturnsItsParameters().to(device)
    module = copy.deepcopy(eager)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    options = {} if backend == "eager" else {"param_grads": param_grads}
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend, **options)
    tol = tolerance(backend)
    for _ in range(3):
        x = torch.randn(3, 4, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_(True)
        ours, theirs = graphed(x), eager(x_eager)
        assert ours[1] is ours[3] is module.fc.weight and theirs[1] is eager.fc.weight
        assert ours[2] is module.frozen and theirs[2] is eager.frozen
        assert [(t.is_leaf, t.grad_fn, t.requires_grad) for t in ours[1:]] == [
            (t.is_leaf, t.grad_fn, t.requires_grad) for t in theirs[1:]
        ]
        _loss(ours[:2]).backward()
        _loss(theirs[:2]).backward()
        assert_grads_match([x.grad], [x_eager.grad], ["x"], tol)
    assert_grads_match(
        [p.grad for p in module.parameters()],
        [p.grad for p in eager.parameters()],
        parameter_names(eager),
        tol,
    )


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_that_is_a_parameter_requiring_grad_is_refused_under_in_graph(
    backend: str,
) -> None:
    device = device_of(backend)
    message = capture_error(
        _ReturnsItsParameters().to(device),
        (torch.randn(3, 4, device=device, requires_grad=True),),
        backend=backend,
        param_grads="in_graph",
    )
    assert "output[1] is the parameter _ReturnsItsParameters.fc.weight itself" in message
    assert "param_grads='auto' or 'autograd'" in message


class _ReturnsItsBuffers(nn.Module):
    """``(fc(x), count, mask, mask[1:], mask.detach(), frozen.t())``: a buffer it updates, a
    buffer, a view and an alias of it, a view of a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.register_buffer("count", torch.zeros(4))
        self.register_buffer("mask", torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.count.add_(1)
        h = self.fc(x) * self.mask
        return h, self.count, self.mask, self.mask[1:], self.mask.detach(), self.frozen.t()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_an_output_that_is_or_views_a_buffer_is_handed_out_as_that_memory(backend: str) -> None:
    # A replay handed out copies of a buffer returned (and of views of it): the caller's change
    # through them (in place, as eager's changes the module) was lost, silently: the next call
    # computed with the old mask, and the outputs were other objects than the module's.
    device = device_of(backend)
    eager = _ReturnsItsBuffers().to(device)
    module = copy.deepcopy(eager)
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend)
    for step in range(3):
        x = torch.randn(3, 4, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_(True)
        ours, theirs = graphed(x), eager(x_eager)
        assert ours[1] is module.count and ours[2] is module.mask
        assert ours[3]._base is module.mask and ours[5]._base is module.frozen
        assert ours[4]._base is None and ours[4].data_ptr() == module.mask.data_ptr()
        assert [(t.shape, t.stride(), t.is_leaf, t.requires_grad) for t in ours] == [
            (t.shape, t.stride(), t.is_leaf, t.requires_grad) for t in theirs
        ]
        assert_trees_match(ours, theirs, tolerance(backend))
        for outputs in (ours, theirs):  # then the caller changes them in place, as eager lets
            outputs[0].sum().backward()
            outputs[3].mul_(2.0)
            outputs[4][0] += step
            outputs[5][0, 0] = 5.0
        assert_grads_match([x.grad], [x_eager.grad], ["x"], tolerance(backend))
    assert_trees_match(dict(module.named_buffers()), dict(eager.named_buffers()))
    assert torch.equal(module.frozen, eager.frozen)


class _HandsOutOnlyViews(nn.Module):
    """``(x[0], fc.weight, x)``: every output is handed out as another tensor; fc.bias unused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x[0], self.fc.weight, x


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_parameter_no_output_depends_on_is_refused_where_every_output_is_handed_out(
    backend: str,
) -> None:
    # Outputs handed out as another tensor are left out of the captured backward; the unused
    # check must still see that no output reaches fc.bias (x and fc.weight are reached).
    device = device_of(backend)
    sample = (torch.randn(3, 4, device=device, requires_grad=True),)
    message = capture_error(_HandsOutOnlyViews().to(device), sample, backend=backend)
    assert "_HandsOutOnlyViews.fc.bias requires grad, but no output depends on it" in message


class _HandsBackItsInputAndARow(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[0], x


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_callable_whose_every_output_is_handed_out_as_another_tensor_is_graphed(
    backend: str,
) -> None:
    # No output is left for the backward graph (each takes its grad at the caller's x): the
    # capture has no backward to record, and each call hands out the caller's x and its row.
    device = device_of(backend)
    graphed = _HandsBackItsInputAndARow()
    sample = torch.randn(3, 4, device=device, requires_grad=True)
    dgt.make_graphed_callables(graphed, (sample,), backend=backend)
    for _ in range(2):
        x = torch.randn(3, 4, device=device, requires_grad=True)
        row, same = graphed(x)
        assert same is x and row._base is x and torch.equal(row, x[0])
        (row.sum() * 2 + (same * 3).sum()).backward()
        expected = torch.full((3, 4), 3.0, device=device)
        expected[0] += 2
        assert x.grad is not None and torch.equal(x.grad, expected)


class _Views(nn.Module):
    """Returns the hidden state and two views of it (or of its input), made in ``order``."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.fc(x)
        if self.order == "returned":
            return h, h[0], h.view(-1)
        if self.order == "flat_first":
            flat = h.view(-1)
            return h, h[0], flat
        flat = x.view(-1)  # views of the input, made in another order than returned
        return h, x[0], flat


@pytest.mark.parametrize("order", ["returned", "flat_first", "input_flat_first"])
@pytest.mark.parametrize(("backend", "param_grads"), GRAD_MODES)
def test_the_grads_of_several_views_reach_their_base_in_eagers_order(
    order: str, backend: str, param_grads: str
) -> None:
    # The engine adds the grads that meet at a tensor in the order of their nodes, the latest
    # made first: a replay makes the views of its outputs (and inputs) in the order eager's
    # forward made them, so the sum rounds as eager's.
    device = device_of(backend)
    torch.manual_seed(0)
    eager = _Views(order).to(device)
    module = copy.deepcopy(eager)
    sample = torch.randn(4, 8, device=device, requires_grad=True)
    options = {} if backend == "eager" else {"param_grads": param_grads}
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend, **options)
    tol = tolerance(backend)
    for _ in range(3):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_(True)
        for outputs in (graphed(x), eager(x_eager)):
            sum(t.square().mean() for t in outputs).backward()
        assert_grads_match([x.grad], [x_eager.grad], ["x"], tol)
    assert_grads_match(
        [p.grad for p in parameters_of(graphed)],
        [p.grad for p in parameters_of(eager)],
        parameter_names(eager),
        tol,
    )
