"""Every entry point refuses a bad call by path, before touching anything a good call needs.

A matrix: each way of graphing (plain module, function, bound method, graphed together,
``slots=``, ``schedule=``, exact and padded buckets; emulate and eager; each ``param_grads``)
against each bad call (shape, dtype, rank, device, requires_grad, tree structure, keywords,
constants, ``None``). Each cell checks that the error is a :class:`DualgraphError` naming the
leaf path, then that an earlier call's pending backward, the following good call and its
backward, ``.grad`` and buffers all equal eager's, bit for bit.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn
from torch_cases import assert_trees_match, isolation

import dualgraph
import dualgraph.torch as dgt
from dualgraph import DualgraphError


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Any:
    yield from isolation(request)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor | None


@dualgraph.register_dataclass
@dataclasses.dataclass
class Config:
    scale: Any
    note: str = "n"


@dualgraph.register_dataclass
@dataclasses.dataclass
class OtherConfig:
    scale: Any
    note: str = "n"


def _compute(
    lin: nn.Linear | None,
    x: torch.Tensor,
    pair: Pair,
    extra: list[dict[str, Any]],
    k: Any,
    tag: str,
) -> dict[str, Any]:
    h = lin(x) if lin is not None else x * 2
    assert pair.b is not None and extra[0]["n"] is None
    h = (h * pair.a + pair.b) * extra[0]["m"] * extra[0]["cfg"].scale
    return {"h": h * k, "tag": tag, "none": None, "count": extra[0]["count"]}


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(
        self,
        x: torch.Tensor,
        pair: Pair,
        *,
        extra: list[dict[str, Any]],
        k: Any = 1,
        tag: str = "a",
        valid_length: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        self.seen.copy_(x.detach().sum(0))  # a buffer a bad call must not touch
        return _compute(self.lin, x, pair, extra, k, tag)

    def method(
        self,
        x: torch.Tensor,
        pair: Pair,
        *,
        extra: list[dict[str, Any]],
        k: Any = 1,
        tag: str = "a",
    ) -> dict[str, Any]:
        return _compute(self.lin, x, pair, extra, k, tag)


def function(
    x: torch.Tensor,
    pair: Pair,
    *,
    extra: list[dict[str, Any]],
    k: Any = 1,
    tag: str = "a",
) -> dict[str, Any]:
    return _compute(None, x, pair, extra, k, tag)


def good(seed: int, rows: int = 2) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g, requires_grad=True)
    pair = Pair(torch.randn(4, generator=g, requires_grad=True), torch.randn(4, generator=g))
    cfg = Config(torch.randn(4, generator=g, requires_grad=True))
    extra = [{"m": torch.randn(1, 4, generator=g), "n": None, "count": 3, "cfg": cfg}]
    return (x, pair), {"extra": extra, "k": 1, "tag": "a"}


Bad = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def _x(value: Any) -> Bad:
    return lambda a, kw: ((value(a[0]), a[1]), kw)


def _pair(**change: Any) -> Bad:
    return lambda a, kw: ((a[0], a[1]._replace(**{k: f(a[1]) for k, f in change.items()})), kw)


def _extra(change: Callable[[list[dict[str, Any]]], Any]) -> Bad:
    return lambda a, kw: (a, {**kw, "extra": change(kw["extra"])})


def _kw(**change: Any) -> Bad:
    return lambda a, kw: (a, {**kw, **change})


def _with(d: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**d, **change}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _cfg(change: Callable[[Config], Any]) -> Bad:
    return _extra(lambda e: [_with(e[0], cfg=change(e[0]["cfg"]))])


class Opaque:
    """An unregistered class: never a leaf of a spec."""


class Text(str):
    pass


class Subclassed(torch.Tensor):
    pass


def _nested(tensor: torch.Tensor) -> torch.Tensor:
    """A nested tensor of the strided layout: a plain ``torch.Tensor`` by its class and layout,
    with no strides to read (torch's C guard of a call's tensors aborted the process on it)."""
    with warnings.catch_warnings():  # torch's notice that nested tensors are a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([tensor.detach()])


#: name -> (how to spoil a good call, the path the error must start with)
BAD_CALLS: dict[str, tuple[Bad, str]] = {
    "shape": (_x(lambda x: torch.randn(2, 5, requires_grad=True)), "args[0]"),
    "rank": (_pair(b=lambda p: p.b[None]), "args[1].b"),
    "dtype": (_extra(lambda e: [_with(e[0], m=e[0]["m"].double())]), "kwargs['extra'][0]['m']"),
    "complex_dtype": (_x(lambda x: torch.randn(2, 4, dtype=torch.complex64)), "args[0]"),
    "device": (_x(lambda x: torch.empty(2, 4, device="meta")), "args[0]"),
    "sparse": (_pair(b=lambda p: p.b.detach().to_sparse()), "args[1].b"),
    "nested": (_pair(b=lambda p: _nested(p.b)), "args[1].b"),
    "nested_first": (_x(_nested), "args[0]"),
    "subclass": (_pair(b=lambda p: p.b.detach().as_subclass(Subclassed)), "args[1].b"),
    "numpy_for_tensor": (_pair(b=lambda p: p.b.detach().numpy()), "args[1].b"),
    "list_for_tensor": (_pair(b=lambda p: p.b.tolist()), "args[1].b"),
    "opaque_for_tensor": (_pair(b=lambda p: Opaque()), "args[1].b"),
    "requires_grad": (
        _extra(lambda e: [_with(e[0], m=e[0]["m"].requires_grad_())]),
        "kwargs['extra'][0]['m']",
    ),
    "extra_key": (_extra(lambda e: [_with(e[0], z=torch.ones(1))]), "kwargs['extra'][0]['z']"),
    "missing_key": (_extra(lambda e: [_without(e[0], "m")]), "kwargs['extra'][0]['m']"),
    "extra_leaf": (_extra(lambda e: [*e, {}]), "kwargs['extra']"),
    "tuple_for_list": (_extra(tuple), "kwargs['extra']"),
    "ordered_dict_for_dict": (
        _extra(lambda e: [collections.OrderedDict(e[0])]),
        "kwargs['extra'][0]",
    ),
    "tuple_for_namedtuple": (lambda a, kw: ((a[0], tuple(a[1])), kw), "args[1]"),
    "dict_for_dataclass": (_cfg(dataclasses.asdict), "kwargs['extra'][0]['cfg']"),
    "other_dataclass": (
        _cfg(lambda c: OtherConfig(c.scale, c.note)),
        "kwargs['extra'][0]['cfg']",
    ),
    "dataclass_field_shape": (
        _cfg(lambda c: Config(c.scale[:3], c.note)),
        "kwargs['extra'][0]['cfg'].scale",
    ),
    "dataclass_field_const": (
        _cfg(lambda c: Config(c.scale, "m")),
        "kwargs['extra'][0]['cfg'].note",
    ),
    "missing_kwarg": (lambda a, kw: (a, _without(kw, "extra")), "kwargs['extra']"),
    "unexpected_kwarg": (_kw(unexpected=torch.ones(2)), "kwargs['unexpected']"),
    "missing_arg": (lambda a, kw: (a[:1], kw), "args[1]"),
    "extra_arg": (lambda a, kw: ((*a, 3), kw), "args[2]"),
    "const_true_for_1": (_kw(k=True), "kwargs['k']"),
    "const_float_for_1": (_kw(k=1.0), "kwargs['k']"),
    "const_numpy_int_for_1": (_kw(k=np.int64(1)), "kwargs['k']"),
    "const_str": (_kw(tag="b"), "kwargs['tag']"),
    "const_str_subclass": (_kw(tag=Text("a")), "kwargs['tag']"),
    "const_int_in_list": (_extra(lambda e: [_with(e[0], count=4)]), "kwargs['extra'][0]['count']"),
    "none_for_tensor": (_pair(b=lambda p: None), "args[1].b"),
    "tensor_for_none": (
        _extra(lambda e: [_with(e[0], n=torch.ones(1))]),
        "kwargs['extra'][0]['n']",
    ),
    "tensor_for_const": (_kw(k=torch.ones(())), "kwargs['k']"),
    "none_for_const": (_kw(tag=None), "kwargs['tag']"),
}

#: name -> how to graph a Nested (or the function) from one sample: returns (graphed, eager)
ENTRIES = [
    "module",
    "function",
    "method",
    "together",
    "slots",
    "schedule",
    "buckets",
    "pad",
]
MODES = [
    ("emulate", "auto"),
    ("emulate", "autograd"),
    ("emulate", "in_graph"),
    ("eager", "auto"),
]


def _graph(entry: str, backend: str, param_grads: str) -> tuple[Any, Any, Any]:
    """``(graphed, eager twin, the module whose grads and buffers to compare or None)``."""
    torch.manual_seed(0)
    model = Nested()
    twin = copy.deepcopy(model)
    args, kwargs = good(100)
    options: dict[str, Any] = {"backend": backend, "param_grads": param_grads}
    if entry == "function":
        return (
            dgt.make_graphed_callables(function, args, sample_kwargs=kwargs, **options),
            function,
            None,
        )
    if entry == "method":  # a bound method's parameters must be frozen
        model.requires_grad_(False)
        twin.requires_grad_(False)
        graphed = dgt.make_graphed_callables(model.method, args, sample_kwargs=kwargs, **options)
        return graphed, twin.method, (model, twin)
    if entry == "together":
        first = Nested()
        graphed = dgt.make_graphed_callables(
            (first, model), (args, args), sample_kwargs=(kwargs, kwargs), **options
        )
        return graphed[1], twin, (model, twin)
    if entry in ("slots", "schedule"):
        extra = {"slots": 2} if entry == "slots" else {"schedule": [1, 1, -1, -1]}
        graphed = dgt.make_graphed_callables(model, args, sample_kwargs=kwargs, **extra, **options)
        return graphed, twin, (model, twin)
    if entry in ("buckets", "pad"):
        buckets = [good(100, rows)[0] for rows in (2, 3)]
        extra = {"fallback": "pad", "dynamic_dims": {"args[0]": 0, "output['h']": 0}}
        graphed = dgt.make_graphed_callables(
            model,
            buckets=buckets,
            sample_kwargs=kwargs,
            **(extra if entry == "pad" else {}),
            **options,
        )
        return graphed, twin, (model, twin)
    graphed = dgt.make_graphed_callables(model, args, sample_kwargs=kwargs, **options)
    return graphed, twin, (model, twin)


def _loss(out: dict[str, Any]) -> torch.Tensor:
    return out["h"].square().sum()


def _inference(tensor: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return tensor.clone()


#: Bad calls that only a backend with static buffers refuses: eager's own error is the eager
#: backend's. name -> (how to spoil a good call, the path the error must start with)
GRAPH_BAD_CALLS: dict[str, tuple[Bad, str]] = {
    # a tensor the backward reads (the mask multiplies h), made under torch.inference_mode():
    # eager raises 'Inference tensors cannot be saved for backward' (refused after the replay)
    "inference_saved": (
        _extra(lambda e: [_with(e[0], m=_inference(e[0]["m"]))]),
        "kwargs['extra'][0]['m']",
    ),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("backend", "param_grads"), MODES, ids=[f"{b}-{p}" for b, p in MODES])
def test_a_bad_call_is_refused_by_path_and_touches_nothing(
    backend: str, param_grads: str, entry: str, bad: str
) -> None:
    _refused_by_path_touching_nothing(backend, param_grads, entry, *BAD_CALLS[bad])


GRAPH_MODES = [mode for mode in MODES if mode[0] != "eager"]


@pytest.mark.parametrize("bad", list(GRAPH_BAD_CALLS))
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(
    ("backend", "param_grads"), GRAPH_MODES, ids=[f"{b}-{p}" for b, p in GRAPH_MODES]
)
def test_a_bad_call_only_a_replay_refuses_is_refused_by_path_and_touches_nothing(
    backend: str, param_grads: str, entry: str, bad: str
) -> None:
    _refused_by_path_touching_nothing(backend, param_grads, entry, *GRAPH_BAD_CALLS[bad])


@pytest.mark.parametrize("bad", list(BAD_CALLS))
@pytest.mark.parametrize(("backend", "param_grads"), MODES, ids=[f"{b}-{p}" for b, p in MODES])
def test_a_bad_call_padded_into_a_bucket_is_refused_by_its_own_path(
    backend: str, param_grads: str, bad: str
) -> None:
    # A call of 1 row (padded into the 2-row bucket) with another leaf bad: an input of other
    # dims than every bucket's was named by the first shape no bucket has, the padded x's.
    _refused_by_path_touching_nothing(backend, param_grads, "pad", *BAD_CALLS[bad], rows=1)


def _refused_by_path_touching_nothing(
    backend: str, param_grads: str, entry: str, spoil: Bad, path: str, rows: int = 2
) -> None:
    graphed, twin, modules = _graph(entry, backend, param_grads)
    # an earlier call whose backward is pending across the bad call
    a1, kw1 = good(1)
    e1, ekw1 = copy.deepcopy((a1, kw1))
    out1 = graphed(*a1, **kw1)
    eager1 = twin(*e1, **ekw1)
    out1_value = out1["h"].detach().clone()
    bad_args, bad_kwargs = spoil(*good(2, rows))
    with pytest.raises(DualgraphError) as caught:
        graphed(*bad_args, **bad_kwargs)
    message = str(caught.value)
    assert message.startswith(f"{path}:"), message
    assert torch.equal(out1["h"], out1_value), "the bad call wrote the earlier call's output"
    if modules is not None:
        for buffer, expected in zip(modules[0].buffers(), modules[1].buffers(), strict=True):
            assert torch.equal(buffer, expected), "the bad call wrote a buffer"
    a3, kw3 = good(3)
    e3, ekw3 = copy.deepcopy((a3, kw3))
    # with slots the following good call runs with the earlier one still in flight
    in_flight = entry in ("slots", "schedule")
    if in_flight:
        out3, eager3 = graphed(*a3, **kw3), twin(*e3, **ekw3)
    _loss(out1).backward()
    _loss(eager1).backward()
    assert_trees_match(out1, eager1)
    assert_trees_match([t.grad for t in (a1[0], a1[1].a)], [t.grad for t in (e1[0], e1[1].a)])
    if not in_flight:
        out3, eager3 = graphed(*a3, **kw3), twin(*e3, **ekw3)
    _loss(out3).backward()
    _loss(eager3).backward()
    assert_trees_match(out3, eager3)
    assert_trees_match([t.grad for t in (a3[0], a3[1].a)], [t.grad for t in (e3[0], e3[1].a)])
    if modules is not None:
        assert_trees_match(
            [p.grad for p in modules[0].parameters()], [p.grad for p in modules[1].parameters()]
        )
        assert_trees_match(list(modules[0].buffers()), list(modules[1].buffers()))


#: name -> a good call spelled otherwise than the sample (which passes x and pair by position,
#: k and tag by keyword): eager binds each to the same parameters
RESPELLED: dict[str, Bad] = {
    "defaults_left_out": lambda a, kw: (a, _without(_without(kw, "k"), "tag")),
    "pair_by_keyword": lambda a, kw: (a[:1], {**kw, "pair": a[1]}),
    "everything_by_keyword": lambda a, kw: ((), {**kw, "x": a[0], "pair": a[1]}),
}


def _x_and_pair(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    named = {**dict(zip(("x", "pair"), args, strict=False)), **kwargs}
    return named["x"], named["pair"]


@pytest.mark.parametrize("spelling", list(RESPELLED))
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize(("backend", "param_grads"), MODES, ids=[f"{b}-{p}" for b, p in MODES])
def test_a_call_spelled_otherwise_than_the_sample_runs_as_eager(
    backend: str, param_grads: str, entry: str, spelling: str
) -> None:
    # Refused before ("kwargs['k']: missing", "args[1]: missing") where eager runs it.
    graphed, twin, modules = _graph(entry, backend, param_grads)
    respell = RESPELLED[spelling]
    calls = []
    for seed in (1, 2):
        args, kwargs = respell(*good(seed))
        eager_args, eager_kwargs = copy.deepcopy((args, kwargs))
        out, eager = graphed(*args, **kwargs), twin(*eager_args, **eager_kwargs)
        calls.append((out, eager, _x_and_pair(args, kwargs), _x_and_pair(eager_args, eager_kwargs)))
        if entry in ("slots", "schedule") and seed == 1:
            continue  # both forwards in flight first (a schedule's step is [1, 1, -1, -1])
        for out, eager, (x, pair), (ex, epair) in calls:
            _loss(out).backward()
            _loss(eager).backward()
            assert_trees_match(out, eager)
            assert_trees_match([x.grad, pair.a.grad], [ex.grad, epair.a.grad])
        calls.clear()
    if modules is not None:
        assert_trees_match(
            [p.grad for p in modules[0].parameters()], [p.grad for p in modules[1].parameters()]
        )
        assert_trees_match(list(modules[0].buffers()), list(modules[1].buffers()))


@pytest.mark.parametrize(("backend", "param_grads"), MODES, ids=[f"{b}-{p}" for b, p in MODES])
def test_a_nested_tensor_is_refused_by_path_where_the_samples_are_checked_in_one_c_call(
    backend: str, param_grads: str
) -> None:
    # Samples with no dimension of size 1 are checked by torch's C guard, which reads a nested
    # tensor's strides in C++: the process aborted ("NestedTensorImpl doesn't support strides").
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    twin = copy.deepcopy(model)
    graphed = dgt.make_graphed_callables(
        model, (torch.randn(2, 3, requires_grad=True),), backend=backend, param_grads=param_grads
    )
    with pytest.raises(DualgraphError, match=r"^args\[0\]: .*a nested tensor"):
        graphed(_nested(torch.randn(2, 3)))
    x = torch.randn(2, 3, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    graphed(x).square().sum().backward()
    twin(x_eager).square().sum().backward()
    assert_trees_match(
        [x.grad, *[p.grad for p in model.parameters()]],
        [x_eager.grad, *[p.grad for p in twin.parameters()]],
    )
