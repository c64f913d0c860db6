"""``InputGuard``: every call's arguments are checked against the samples before any copy.

The guard describes the sample call with the core's :class:`dualgraph.CallSpec`, returns the
input tensors in capture order (positional args, then kwargs by sorted key) and otherwise raises
:class:`dualgraph.SpecMismatchError` naming the first bad leaf's path.
"""

from __future__ import annotations

import copy
import types
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_cases import (
    BACKENDS,
    GRAPH_BACKENDS,
    assert_tensors_match,
    device_of,
    runner_of,
    tolerance,
)

import dualgraph.torch as dgt
from dualgraph import DualgraphError, SpecMismatchError, UnsupportedLeafError, describe_call
from dualgraph.torch._inputs import InputGuard, input_off_device, unsupported_tensor


class Batch(NamedTuple):
    pixels: Any
    labels: Any


def _samples() -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``f(x, {"mask", "bias"}, Batch(pixels, labels), 3, *, scale=2.0, mask=m, note=None)``."""
    args = (
        torch.randn(2, 8, requires_grad=True),
        {"mask": torch.rand(2, 8), "bias": torch.randn(8, requires_grad=True)},
        Batch(pixels=torch.randn(2, 3, 4, 4), labels=torch.arange(2)),
        3,
    )
    kwargs = {"scale": 2.0, "mask": torch.rand(2, 8, requires_grad=True), "note": None}
    return args, kwargs


def _guard() -> InputGuard:
    return InputGuard(*_samples())


def _message(guard: InputGuard, args: Any, kwargs: Any) -> str:
    with pytest.raises(SpecMismatchError) as info:
        guard.tensors(args, kwargs)
    assert info.value.path == str(info.value).partition(":")[0]
    return str(info.value)


def test_paths_name_every_input_tensor_args_first_then_kwargs_by_key() -> None:
    assert _guard().paths == (
        "args[0]",
        "args[1]['bias']",
        "args[1]['mask']",
        "args[2].pixels",
        "args[2].labels",
        "kwargs['mask']",
    )


def test_tensors_come_back_in_the_order_of_the_paths() -> None:
    args, kwargs = _samples()
    tensors = _guard().tensors(args, kwargs)
    expected = [args[0], args[1]["bias"], args[1]["mask"], *args[2], kwargs["mask"]]
    assert len(tensors) == len(expected)
    assert all(t is e for t, e in zip(tensors, expected, strict=True))


def test_requires_grad_and_the_number_of_args_tensors_are_recorded() -> None:
    guard = _guard()
    assert guard.requires_grad == (True, True, False, False, False, True)
    assert guard.num_args_tensors == 5


def test_kwargs_order_and_mapping_type_do_not_matter() -> None:
    guard = _guard()
    args, kwargs = _samples()
    reordered = dict(reversed(list(kwargs.items())))
    assert guard.tensors(args, reordered)[-1] is kwargs["mask"]
    assert guard.tensors(args, types.MappingProxyType(kwargs))[-1] is kwargs["mask"]


def test_a_dict_with_its_keys_in_another_order_is_refused_naming_it() -> None:
    # The callable sees a dict's key order (d.values(), a sum over it); a replay re-runs the
    # captured order, so a call must keep it. The kwargs themselves bind by name.
    guard = _guard()
    args, kwargs = _samples()
    swapped = (args[0], dict(reversed(list(args[1].items()))), *args[2:])
    assert _message(guard, swapped, kwargs) == (
        "args[1]: a dict with its keys in the order ['bias', 'mask'], captured in the order "
        "['mask', 'bias']; a replay runs the callable as captured, so whatever follows the key "
        "order (d.values(), a sum over the dict) would not follow this call's; pass the keys "
        "in the captured order"
    )
    nested = InputGuard(
        ([{"a": torch.ones(1), "b": {"c": torch.ones(2), "d": None}}],),
        {"e": {"f": torch.ones(3), "g": 1}},
    )
    same = ([{"a": torch.ones(1), "b": {"c": torch.ones(2), "d": None}}],)
    assert len(nested.tensors(same, {"e": {"f": torch.ones(3), "g": 1}})) == 3
    inner = ([{"a": torch.ones(1), "b": {"d": None, "c": torch.ones(2)}}],)
    message = _message(nested, inner, {"e": {"f": torch.ones(3), "g": 1}})
    assert message.startswith("args[0][0]['b']: a dict with its keys in the order ['d', 'c']")
    message = _message(nested, same, {"e": {"g": 1, "f": torch.ones(3)}})
    assert message.startswith("kwargs['e']: a dict with its keys in the order ['g', 'f']")
    fields = InputGuard((Batch(pixels={"a": torch.ones(1), "b": 2}, labels=None),), None)
    message = _message(fields, (Batch(pixels={"b": 2, "a": torch.ones(1)}, labels=None),), {})
    assert message.startswith("args[0].pixels: a dict with its keys in the order ['b', 'a']")


def test_a_replay_never_follows_another_key_order_than_eager() -> None:
    def concat(parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts.values())) * 2

    parts = {"a": torch.randn(3, requires_grad=True), "b": torch.randn(2, requires_grad=True)}
    graphed = dgt.make_graphed_callables(concat, (parts,), backend="emulate")
    again = {"a": torch.randn(3), "b": torch.randn(2)}
    assert torch.equal(graphed(again), concat(again))
    with pytest.raises(SpecMismatchError, match=r"^args\[0\]: a dict with its keys in the order"):
        graphed({"b": again["b"], "a": again["a"]})  # eager: another result


def joined(x: torch.Tensor, *, scale: float = 1.0, **parts: torch.Tensor) -> torch.Tensor:
    """Follows the order of the keywords ``parts`` collects (``scale`` binds by name)."""
    return torch.cat([x, *parts.values()]) * scale


class Joined(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, **parts: torch.Tensor) -> Any:
        return joined(x, scale=scale, **parts) * self.weight


def _parts(device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(2, device=device, requires_grad=True),
        "a": torch.randn(3, device=device, requires_grad=True),
        "b": torch.randn(1, device=device, requires_grad=True),
    }


@pytest.mark.parametrize("kind", ["function", "module"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_keywords_collected_by_var_kwargs_in_another_order_are_refused(
    backend: str, kind: str
) -> None:
    # forward(x, **parts) sees the keywords in the call's order, a replay the sample's:
    # torch.cat(parts.values()) gave [x, a, b] where eager gave [x, b, a], silently.
    device = device_of(backend)
    fn = joined if kind == "function" else Joined().to(device)
    eager = fn if kind == "function" else copy.deepcopy(fn)
    sample = _parts(device)
    graphed = dgt.make_graphed_callables(
        fn,
        (sample["x"],),
        sample_kwargs={"a": sample["a"], "scale": 2.0, "b": sample["b"]},
        backend=backend,
    )
    static = [t.clone() for t in runner_of(graphed).static_inputs] if backend != "eager" else []
    call = _parts(device)
    with pytest.raises(SpecMismatchError) as info:
        graphed(call["x"], b=call["b"], a=call["a"], scale=2.0)
    assert info.value.path == "kwargs"
    assert str(info.value).startswith(
        "kwargs: the keywords ['b', 'a'] go to the callable's **kwargs in this order, captured "
        "in the order ['a', 'b']; a replay runs the callable as captured"
    )
    if backend != "eager":  # refused before any static buffer was written
        after = runner_of(graphed).static_inputs
        assert all(torch.equal(t, s) for t, s in zip(after, static, strict=True))
    twin = {k: v.detach().clone().requires_grad_() for k, v in call.items()}
    out = graphed(call["x"], scale=2.0, a=call["a"], b=call["b"])  # scale binds by name
    want = eager(twin["x"], scale=2.0, a=twin["a"], b=twin["b"])
    assert_tensors_match(out, want, "output", tolerance(backend))
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for key in call:
        assert_tensors_match(call[key].grad, twin[key].grad, f"grad {key}", tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_named_keywords_still_bind_in_any_order(backend: str) -> None:
    def named(x: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, a, b]) * 2

    sample = _parts(device_of(backend))
    graphed = dgt.make_graphed_callables(
        named, (sample["x"],), sample_kwargs={"a": sample["a"], "b": sample["b"]}, backend=backend
    )
    call = _parts(device_of(backend))
    out = graphed(call["x"], b=call["b"], a=call["a"])
    want = named(call["x"], a=call["a"], b=call["b"])
    assert_tensors_match(out, want, "output", tolerance(backend))


def test_a_guard_without_kwargs_accepts_an_empty_call_and_refuses_any_kwarg() -> None:
    x = torch.randn(3)
    guard = InputGuard((x,), None)
    assert guard.tensors((x,), {}) == [x]
    assert _message(guard, (x,), {"extra": x}) == "kwargs['extra']: unexpected entry float32[3]"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ((), "args[0]: missing (expected float32[2, 8]): the call has 0 positional arguments"),
        ((0,), "args[1]: missing (expected float32[8]): the call has 1 positional argument"),
        ((0, 1, 2.0), "args[2]: unexpected extra positional argument float 2.0: the call has 3"),
    ],
    ids=["none", "one_missing", "one_extra"],
)
@pytest.mark.parametrize("checked", [False, True], ids=["tensors", "checked_tensors"])
def test_a_positional_argument_missing_or_extra_in_a_call_without_kwargs_is_named_by_its_path(
    call: tuple[Any, ...], message: str, checked: bool
) -> None:
    # The usual call (positional args only) was refused as 'args: expected a tuple of length
    # 2, got a tuple of length 1', naming no argument, where a call with kwargs named it.
    samples = (torch.randn(2, 8), torch.randn(8))
    guard = InputGuard(samples, None)
    args = tuple(samples[i] if isinstance(i, int) else i for i in call)
    with pytest.raises(SpecMismatchError) as info:
        if checked:
            guard.checked_tensors(args, {}, True)
        else:
            guard.tensors(args, {})
    assert str(info.value).startswith(message)
    assert info.value.path == str(info.value).partition(":")[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a, k: ((torch.randn(3, 8, requires_grad=True), *a[1:]), k),
            "args[0]: expected float32[2, 8] on cpu, got float32[3, 8] on cpu",
        ),
        (
            lambda a, k: ((a[0].detach().half(), *a[1:]), k),
            "args[0]: expected float32[2, 8] on cpu, got float16[2, 8] on cpu",
        ),
        (
            lambda a, k: ((a[0], {**a[1], "mask": torch.rand(8, 2)}, *a[2:]), k),
            "args[1]['mask']: expected float32[2, 8] on cpu, got float32[8, 2] on cpu",
        ),
        (
            lambda a, k: ((*a[:2], a[2]._replace(labels=torch.arange(2.0)), a[3]), k),
            "args[2].labels: expected int64[2] on cpu, got float32[2] on cpu",
        ),
        (
            lambda a, k: ((*a[:2], tuple(a[2]), a[3]), k),
            f"args[2]: expected a {Batch.__module__}.Batch, got a tuple of length 2",
        ),
        (
            lambda a, k: ((*a[:3], 4), k),
            "args[3]: expected int 3, got int 4",
        ),
        (
            lambda a, k: ((*a[:3], 3.0), k),
            "args[3]: expected int 3, got float 3.0",
        ),
        (
            lambda a, k: ((a[0].detach().numpy(), *a[1:]), k),
            "args[0]: expected float32[2, 8] on cpu, got an object of type numpy.ndarray",
        ),
        (
            lambda a, k: ((7, *a[1:]), k),
            "args[0]: expected float32[2, 8] on cpu, got an object of type builtins.int",
        ),
        (
            lambda a, k: ((None, *a[1:]), k),
            "args[0]: expected float32[2, 8], got None",
        ),
        (
            lambda a, k: (a[:3], k),
            "args[3]: missing (expected int 3): the call has 3 positional arguments, expected 4",
        ),
        (
            lambda a, k: (a, {**k, "note": "hi"}),
            "kwargs['note']: expected None, got str 'hi'",
        ),
        (
            lambda a, k: (a, {**k, "mask": None}),
            "kwargs['mask']: expected float32[2, 8], got None",
        ),
        (
            lambda a, k: (a, {key: v for key, v in k.items() if key != "scale"}),
            "kwargs['scale']: missing (expected float 2.0)",
        ),
        (
            lambda a, k: (a, {**k, "scale": 2}),
            "kwargs['scale']: expected float 2.0, got int 2",
        ),
        (
            lambda a, k: (a, {**k, "extra": 1}),
            "kwargs['extra']: unexpected entry int 1",
        ),
    ],
    ids=[
        "shape",
        "dtype",
        "nested_shape",
        "namedtuple_field_dtype",
        "tuple_for_a_namedtuple",
        "changed_constant",
        "float_for_an_int",
        "numpy_for_a_tensor",
        "int_for_a_tensor",
        "none_for_a_tensor",
        "missing_arg",
        "value_for_a_none",
        "none_for_a_tensor_kwarg",
        "missing_kwarg",
        "int_for_a_float_kwarg",
        "unexpected_kwarg",
    ],
)
def test_a_mismatch_names_its_path(change: Any, message: str) -> None:
    assert _message(_guard(), *change(*_samples())) == message


def test_a_tensor_that_requires_grad_where_the_sample_did_not_is_refused_under_grad() -> None:
    guard = _guard()
    args, kwargs = _samples()
    args = (args[0], {**args[1], "mask": torch.rand(2, 8, requires_grad=True)}, *args[2:])
    assert _message(guard, args, kwargs) == (
        "args[1]['mask']: requires grad, but was captured without requires_grad, so no gradient "
        "would reach it; pass a sample that requires grad when capturing"
    )
    with torch.no_grad():
        assert len(guard.tensors(args, kwargs)) == 6  # no grad would flow anyway


def test_a_tensor_without_grad_where_the_sample_required_it_is_accepted() -> None:
    args, kwargs = _samples()
    args = (args[0].detach(), *args[1:])
    assert len(_guard().tensors(args, kwargs)) == 6


def test_the_error_is_a_value_error_and_a_dualgraph_error() -> None:
    args, kwargs = _samples()
    with pytest.raises(ValueError, match=r"^args\[3\]"):
        _guard().tensors((*args[:3], 5), kwargs)
    assert issubclass(SpecMismatchError, DualgraphError)


def test_array_samples_must_be_torch_tensors() -> None:
    with pytest.raises(DualgraphError) as info:
        InputGuard((torch.zeros(2), {"w": np.zeros(2, np.float32)}), None)
    assert str(info.value) == (
        "args[1]['w']: array leaves of a torch callable's inputs must be torch tensors, "
        "got numpy.ndarray"
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "path"),
    [((torch.zeros(2), object()), None, "args[1]"), ((), {"cache": {1, 2}}, "kwargs['cache']")],
    ids=["arg", "kwarg"],
)
def test_an_unsupported_sample_leaf_is_named_by_its_path(args: Any, kwargs: Any, path: str) -> None:
    with pytest.raises(UnsupportedLeafError) as info:
        InputGuard(args, kwargs)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: unsupported leaf of type builtins.")


def test_the_guard_describes_the_call_with_the_core_call_spec() -> None:
    args, kwargs = _samples()
    guard = _guard()
    assert guard.spec == describe_call(args, kwargs)
    assert guard.paths == guard.spec.array_paths
    assert guard.describe() == repr(guard.spec)[len("CallSpec(") : -1]


def test_sample_args_may_be_a_list() -> None:
    args, kwargs = _samples()
    guard = InputGuard(list(args), kwargs)
    assert guard.spec == _guard().spec
    assert len(guard.tensors(args, kwargs)) == 6


def test_unflatten_puts_tensors_back_at_their_paths() -> None:
    args, kwargs = _samples()
    guard = _guard()
    new_args, new_kwargs = guard.unflatten(guard.tensors(args, kwargs))
    assert new_args[1]["bias"] is args[1]["bias"] and new_kwargs["mask"] is kwargs["mask"]
    assert new_args[3] == 3 and new_kwargs["note"] is None


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: torch.zeros(2, 2).to_sparse(), "a torch.sparse_coo tensor"),
        (lambda: torch.zeros(2, device="meta"), "a meta tensor"),
        (lambda: torch.nn.Parameter(torch.zeros(2)), None),
        (lambda: torch.zeros(4).t(), None),
        (lambda: torch.zeros(2, dtype=torch.complex64).conj(), None),
    ],
    ids=["sparse", "meta", "parameter", "view", "conjugate"],
)
def test_unsupported_tensor_says_why_a_tensor_cannot_be_a_static_buffer(
    make: Any, why: str | None
) -> None:
    found = unsupported_tensor(make())
    if why is None:
        assert found is None
    else:
        assert found is not None and found.startswith(why)


# -- memory layout: eager's kernels and outputs follow an input's, a replay keeps the capture's --


def _conv(x: torch.Tensor, *, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x, weight, padding=1).relu()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("captured", ["contiguous", "channels_last"])
def test_an_input_in_another_memory_format_than_its_sample_is_refused_naming_it(
    backend: str, captured: str
) -> None:
    device = device_of(backend)
    weight = torch.randn(4, 3, 3, 3, device=device)
    other = torch.contiguous_format if captured == "channels_last" else torch.channels_last
    sample = torch.randn(2, 3, 8, 8, device=device)
    if captured == "channels_last":
        sample = sample.to(memory_format=torch.channels_last)
    fn = dgt.make_graphed_callables(lambda x: _conv(x, weight=weight), (sample,), backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device).to(memory_format=other)
    eager = _conv(x, weight=weight)
    assert eager.is_contiguous(memory_format=other)  # a convolution's output follows its input
    static = runner_of(fn).static_inputs[0].clone()
    with pytest.raises(SpecMismatchError, match=r"^args\[0\]: laid out ") as info:
        fn(x)
    assert f"captured {captured}" in str(info.value) and info.value.path == "args[0]"
    assert torch.equal(runner_of(fn).static_inputs[0], static)  # nothing was copied in
    as_captured = x.contiguous(
        memory_format=getattr(torch, f"{captured}_format", torch.channels_last)
    )
    assert_tensors_match(fn(as_captured), eager, "output", tolerance(backend))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("strides", ["sliced", "transposed"])
def test_an_input_with_other_strides_in_its_samples_memory_format_is_accepted(
    backend: str, strides: str
) -> None:
    # a slice of a larger tensor (split, narrow), or a transposed one (a ViT's patch embedding)
    device = device_of(backend)
    fn = dgt.make_graphed_callables(
        _sin_twice, (torch.randn(2, 4, 8, device=device),), backend=backend
    )
    for _ in range(2):
        if strides == "sliced":
            x = torch.randn(2, 4, 16, device=device)[..., ::2]
        else:
            x = torch.randn(2, 8, 4, device=device).transpose(1, 2)
        graphed = fn(x)
        assert_tensors_match(graphed, _sin_twice(x), "output", tolerance(backend))
        assert graphed.stride() == (32, 8, 1)  # the capture's (eager's follows a transposed x)


def _sin_twice(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sin()


def test_input_off_device_names_the_first_tensor_elsewhere() -> None:
    args = (torch.zeros(2), {"scale": torch.tensor(2.0)})
    assert input_off_device(args, {"n": 3}, torch.device("cpu")) is None
    found = input_off_device(args, {"n": torch.ones(1)}, torch.device("meta"))
    assert found == ("args[0]", torch.device("cpu"))


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * scale  # a 0-d CPU scale is a CUDA kernel's host argument


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["sample_args", "buckets"])
def test_a_cpu_tensor_input_of_a_cuda_graph_is_refused_naming_it(how: str) -> None:
    # Captured, every replay multiplied by the capture's scale (2.0), whatever the call passed.
    module = _Scaled().cuda()
    x = torch.randn(2, 4, device="cuda")
    scale = {"scale": torch.tensor(2.0)}
    with pytest.raises(SpecMismatchError) as info:
        if how == "buckets":
            dgt.make_graphed_callables(module, buckets=[(x,), (x[:1],)], sample_kwargs=scale)
        else:
            dgt.make_graphed_callables(module, (x,), sample_kwargs=scale)
    assert info.value.path == "kwargs['scale']"
    assert "a tensor on cpu, where the graphs run on cuda:0" in str(info.value)
    assert type(module).forward is _Scaled.forward and "forward" not in vars(module)


def _checked_message(guard: InputGuard, args: Any, kwargs: Any) -> str:
    with pytest.raises(SpecMismatchError) as info:
        guard.checked_tensors(args, kwargs, torch.is_grad_enabled())
    return str(info.value)


def test_checked_tensors_refuse_under_grad_a_tensor_passed_without_grad_mode() -> None:
    # A call's tensors that passed become the guard of the next calls: one requiring grad
    # where its sample did not, passed under no grad, must not pass under grad after it.
    guard = _guard()
    args, kwargs = _samples()
    args = (args[0], {**args[1], "mask": torch.rand(2, 8, requires_grad=True)}, *args[2:])
    with torch.no_grad():
        for _ in range(2):
            assert len(guard.checked_tensors(args, kwargs, False)) == 6
    assert _checked_message(guard, args, kwargs) == _message(guard, args, kwargs)
    assert _checked_message(guard, args, kwargs).startswith("args[1]['mask']: requires grad")


def test_checked_tensors_refuse_after_calls_passed_under_and_outside_autocast() -> None:
    guard = _guard()
    args, kwargs = _samples()
    for _ in range(2):
        with torch.autocast("cpu"):  # the guard reads the autocast dispatch keys
            assert len(guard.checked_tensors(args, kwargs, True)) == 6
        assert len(guard.checked_tensors(args, kwargs, True)) == 6
    wrong = (args[0].double(), *args[1:])
    assert _checked_message(guard, wrong, kwargs) == _message(guard, wrong, kwargs)
    with torch.autocast("cpu"):
        assert _checked_message(guard, wrong, kwargs).startswith("args[0]: expected float32")


def test_checked_tensors_refuse_another_memory_format_after_calls_passed() -> None:
    guard = InputGuard((torch.randn(2, 3, 4, 4),), {})
    for _ in range(2):
        assert len(guard.checked_tensors((torch.randn(2, 3, 4, 4),), {}, True)) == 1
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    with pytest.raises(SpecMismatchError, match=r"^args\[0\]: laid out channels_last"):
        guard.checked_tensors((x,), {}, True)
    sliced = torch.randn(2, 3, 4, 8)[..., ::2]  # other strides, the same format: accepted
    assert guard.checked_tensors((sliced,), {}, True)[0] is sliced


def test_a_copied_guard_checks_its_tensors_one_by_one() -> None:
    guard = copy.deepcopy(_guard())  # the C guard is left out of copies and pickles
    args, kwargs = _samples()
    assert len(guard.checked_tensors(args, kwargs, True)) == 6
    wrong = (args[0][:1], *args[1:])
    assert _checked_message(guard, wrong, kwargs).startswith("args[0]: expected float32[2, 8]")


class _Marked(torch.Tensor):
    """A subclass: refused by the one-by-one checks (not a Tensor or Parameter)."""


def _variant(sample: torch.Tensor, how: str) -> torch.Tensor:
    """A call's tensor made from ``sample`` in one way a guard might confuse with it."""
    fresh = torch.randn_like(sample) if sample.is_floating_point() else sample.clone()
    fresh = fresh.as_strided(sample.shape, sample.stride()) if sample.dim() else fresh
    if how == "requires_grad":
        return fresh.detach().requires_grad_(not sample.requires_grad)
    if how == "double":
        return fresh.to(torch.complex128 if fresh.is_complex() else torch.float64)
    if how == "transposed":
        return fresh.detach().t().contiguous().t() if fresh.dim() == 2 else fresh.detach()
    if how == "channels_last" and fresh.dim() == 4:
        return fresh.detach().contiguous(memory_format=torch.channels_last)
    if how == "size_one":
        return fresh.detach()[:1]
    if how == "expanded":
        return fresh.detach()[:1].expand(sample.shape)
    if how == "neg_view":
        return torch._neg_view(fresh.detach())
    if how == "inference":
        with torch.inference_mode():
            return fresh.detach().clone()
    if how == "parameter":
        return torch.nn.Parameter(fresh.detach(), requires_grad=sample.requires_grad)
    if how == "subclass":
        return fresh.detach().as_subclass(_Marked)
    if how == "sparse":
        return fresh.detach().to_sparse()
    if how == "view":
        return fresh.detach().view(sample.shape)
    if how == "conj":
        return fresh.detach().conj()
    return fresh.detach().requires_grad_(sample.requires_grad)


_VARIANTS = [
    "same",
    "requires_grad",
    "double",
    "transposed",
    "channels_last",
    "size_one",
    "expanded",
    "neg_view",
    "inference",
    "parameter",
    "subclass",
    "sparse",
    "view",
    "conj",
]


def _accepts(guard: InputGuard, args: tuple[Any, ...], grad: bool) -> bool:
    try:
        guard.checked_tensors(args, {}, grad)
    except DualgraphError:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(
        st.sampled_from([(2, 3), (3, 2), (2, 3, 4), (2, 3, 4, 4)]), min_size=1, max_size=3
    ),
    needs=st.lists(st.booleans(), min_size=3, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.complex64]),
    calls=st.lists(
        st.tuples(
            st.lists(st.sampled_from(_VARIANTS), min_size=3, max_size=3),
            st.sampled_from(["grad", "no_grad", "inference_mode", "autocast"]),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_checked_tensors_accept_exactly_what_the_one_by_one_checks_accept(
    shapes: list[tuple[int, ...]],
    needs: list[bool],
    dtype: torch.dtype,
    calls: list[tuple[list[str], str]],
) -> None:
    # A guard made from one call's tensors decides the next calls: it may refuse more (the
    # one-by-one checks then decide), never accept what they refuse, whatever came before.
    samples = tuple(
        torch.randn(shape, dtype=dtype, requires_grad=need)
        for shape, need in zip(shapes, needs, strict=False)
    )
    guard = InputGuard(samples, {})
    for hows, mode in calls:
        args = tuple(_variant(s, how) for s, how in zip(samples, hows, strict=False))
        context = {
            "grad": torch.enable_grad(),
            "no_grad": torch.no_grad(),
            "inference_mode": torch.inference_mode(),
            "autocast": torch.autocast("cpu"),
        }[mode]
        with context:
            grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            one_by_one = copy.copy(guard)  # a copy drops the C guards
            assert one_by_one._guards is None
            expected = _accepts(one_by_one, args, grad)
            assert _accepts(guard, args, grad) == expected, (hows, mode)


def shifted(
    x: torch.Tensor, shift: Any = 0.0, mask: torch.Tensor | None = None, pair: Any = (1, 2)
) -> torch.Tensor:
    """Branches on the values of its defaults, as a replay cannot."""
    h = (x + shift) * pair[0] if not isinstance(shift, torch.Tensor) else x * 3
    return h * mask if mask is not None else h.sin()


NAN = float("nan")


@pytest.mark.parametrize(
    ("call", "path", "value"),
    [
        ({"shift": 1.0}, "kwargs['shift']", "float 1.0"),
        ({"shift": 0}, "kwargs['shift']", "int 0"),
        ({"shift": False}, "kwargs['shift']", "bool False"),
        ({"shift": -0.0}, "kwargs['shift']", "float -0.0"),
        (
            {"shift": np.float64(0.0)},
            "kwargs['shift']",
            "np.float64(0.0) (an object of type numpy.float64)",
        ),
        ({"shift": torch.tensor(0.0)}, "kwargs['shift']", "float32[]"),
        ({"mask": torch.ones(3)}, "kwargs['mask']", "float32[3]"),
        ({"pair": [1, 2]}, "kwargs['pair']", "a list of length 2"),
        ({"pair": (1, 2.0)}, "kwargs['pair']", "a tuple of length 2"),
    ],
    ids=["float", "int", "bool", "negative_zero", "numpy", "tensor", "mask", "list", "item"],
)
@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_default_the_sample_left_out_passed_otherwise_is_refused_naming_its_path(
    backend: str, positional: bool, call: dict[str, Any], path: str, value: str
) -> None:
    # A replay runs with the default the sample call had; eager with the value passed.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        shifted, (torch.randn(3, device=device, requires_grad=True),), backend=backend
    )
    static = [t.clone() for t in runner_of(graphed).static_inputs] if backend != "eager" else []
    x = torch.randn(3, device=device, requires_grad=True)
    name, given = next(iter(call.items()))
    if positional:  # the same parameter by position
        order = ["shift", "mask", "pair"]
        args = (x, *[shifted.__defaults__[i] for i in range(order.index(name))], given)  # type: ignore[index]
        call, path = {}, f"args[{len(args) - 1}]"
    else:
        args = (x,)
    with pytest.raises(SpecMismatchError) as info:
        graphed(*args, **call)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: {value}")
    assert f"where the sample call left {name} to its default" in str(info.value)
    if backend != "eager":  # refused before any static buffer was written
        after = runner_of(graphed).static_inputs
        assert all(torch.equal(t, s) for t, s in zip(after, static, strict=True))
    twin = x.detach().clone().requires_grad_()
    out, want = graphed(x), shifted(twin)
    assert_tensors_match(out, want, "output", tolerance(backend))
    out.sum().backward()
    want.sum().backward()
    assert_tensors_match(x.grad, twin.grad, "grad", tolerance(backend))


@pytest.mark.parametrize(
    "call",
    [
        {"shift": 0.0},
        {"shift": -0.0 + 0.0},
        {"mask": None},
        {"pair": (1, 2)},
        {"shift": 0.0, "mask": None, "pair": (1, 2)},
    ],
    ids=["float", "computed_float", "none", "tuple", "all"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_default_the_sample_left_out_passed_as_itself_runs_as_eager(
    backend: str, call: dict[str, Any]
) -> None:
    # Refused before as "kwargs['shift']: unexpected entry float 0.0", where eager runs it.
    device = device_of(backend)
    graphed = dgt.make_graphed_callables(
        shifted, (torch.randn(3, device=device, requires_grad=True),), backend=backend
    )
    for _ in range(2):
        x = torch.randn(3, device=device, requires_grad=True)
        twin = x.detach().clone().requires_grad_()
        out, want = graphed(x, **call), shifted(twin, **call)
        assert_tensors_match(out, want, "output", tolerance(backend))
        out.sum().backward()
        want.sum().backward()
        assert_tensors_match(x.grad, twin.grad, "grad", tolerance(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_argument_the_sample_passed_and_a_call_leaves_to_another_default_is_missing(
    backend: str,
) -> None:
    device = device_of(backend)
    sample = torch.randn(3, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(
        shifted, (sample,), sample_kwargs={"shift": 2.0}, backend=backend
    )
    with pytest.raises(SpecMismatchError) as info:
        graphed(torch.randn(3, device=device))  # eager: shift=0.0
    assert str(info.value) == "kwargs['shift']: missing (expected float 2.0)"
    nan = dgt.make_graphed_callables(shifted, (sample, NAN), backend=backend)
    x = torch.randn(3, device=device)
    assert torch.isnan(nan(x, shift=float("nan"))).all()  # the same NaN, another object
    with pytest.raises(SpecMismatchError) as info:  # another NaN: compared as a spec compares
        nan(x, shift=-NAN)
    assert str(info.value) == "kwargs['shift']: expected float nan, got float -nan"
    assert info.value.path == "kwargs['shift']"  # as the call spells it (the sample: args[1])
    with pytest.raises(SpecMismatchError) as info:
        nan(x=torch.randn(4, device=device), shift=NAN)
    expected = f"expected float32[3] on {device}, got float32[4] on {device}"
    assert str(info.value) == f"kwargs['x']: {expected}"


def test_a_transposed_call_of_a_transposed_sample_replays_as_eager() -> None:
    # What README advises for eager's bits where calls are laid out otherwise than a dense
    # sample (a contiguous sample's buffer makes the Linear multiply another layout than
    # eager's, which can round otherwise): a sample laid out like the calls replays on their
    # strides.
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    twin = copy.deepcopy(layer)
    sample = torch.randn(3, 4).t().requires_grad_()
    dgt.make_graphed_callables(layer, (sample,), backend="emulate")
    for _ in range(2):
        x = torch.randn(3, 4).t().requires_grad_()
        y = x.detach().clone().requires_grad_()  # clone keeps the strides of a dense tensor
        out, want = layer(x), twin(y)
        out.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(out, want)
        for mine, theirs in [(x, y), *zip(layer.parameters(), twin.parameters(), strict=True)]:
            assert mine.grad is not None and theirs.grad is not None
            assert torch.equal(mine.grad, theirs.grad)
            assert mine.grad.stride() == theirs.grad.stride()
    assert dgt.diagnostics(layer).replays == 2


def test_a_call_sliced_out_of_a_bigger_tensor_as_its_sample_replays_as_eager() -> None:
    # A slice past the start of its storage (big[1:], one of several chunks) lies at an address
    # the allocator never hands out: kernels vectorize by alignment, so on the CPU a Linear of
    # it rounds otherwise than of an aligned copy. The static buffer lies as far past the
    # allocator's alignment as its sample, so calls sliced as the sample replay eager's bits.
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    twin = copy.deepcopy(layer)

    def sliced() -> torch.Tensor:
        return torch.randn(33)[1:].view(4, 8).requires_grad_()

    dgt.make_graphed_callables(layer, (sliced(),), backend="emulate")
    for _ in range(3):
        x = sliced()
        y = torch.randn(33)[1:].view(4, 8)
        y.copy_(x.detach())
        y.requires_grad_()
        out, want = layer(x), twin(y)
        out.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(out, want)
        for mine, theirs in [(x, y), *zip(layer.parameters(), twin.parameters(), strict=True)]:
            assert mine.grad is not None and theirs.grad is not None
            assert torch.equal(mine.grad, theirs.grad)
    assert dgt.diagnostics(layer).replays == 3


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_static_input_lies_as_far_past_the_allocators_alignment_as_its_sample(
    backend: str,
) -> None:
    device = device_of(backend)
    sample = torch.randn(4 * 8 + 3, device=device)[3:].view(4, 8)
    graphed = dgt.make_graphed_callables(lambda x: x * 2, (sample,), backend=backend)
    (static,) = runner_of(graphed).static_inputs
    unit = 512 if device.type == "cuda" else 64
    assert static.data_ptr() % unit == sample.data_ptr() % unit
    assert static._base is None and static.stride() == sample.stride()
