"""dualgraph.parity: torch vs JAX, aligned by spec path, with gradients and dtype tolerances."""

from __future__ import annotations

import ast
import collections
import os
import pathlib
import subprocess
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import dualgraph.jax as dgj
import dualgraph.parity
from dualgraph import SpecMismatchError
from dualgraph.parity import (
    DEFAULT_TOLERANCES,
    Tolerance,
    assert_parity,
    compare,
    compare_arrays,
    rounding_tolerance,
)
from dualgraph.parity._bridge import as_jax
from dualgraph.torch._ambient import kept_settings

rng = np.random.default_rng(0)


def sample(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


# The same layer, written once per framework: outputs with None, a constant and an int array.
def torch_layer(x: torch.Tensor, *, mask: torch.Tensor) -> dict[str, Any]:
    hidden = torch.tanh(x) * mask
    count = (mask > 0).sum(dtype=torch.int32)  # JAX counts in int32 with its 64-bit mode off
    return {"hidden": hidden, "aux_loss": None, "count": count, "depth": 2}


def jax_layer(x: jax.Array, *, mask: jax.Array) -> dict[str, Any]:
    hidden = jnp.tanh(x) * mask
    return {"hidden": hidden, "aux_loss": None, "count": (mask > 0).sum(), "depth": 2}


def layer_inputs() -> tuple[tuple[np.ndarray], dict[str, np.ndarray]]:
    return (sample(2, 8),), {"mask": (sample(2, 8) > 0).astype(np.float32)}


class Scaled(torch.autograd.Function):
    """``y = 2 x`` whose backward returns ``3 * grad``: same forward, different gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3


@jax.custom_vjp
def doubled_wrong_grad(x: jax.Array) -> jax.Array:
    return x * 2


doubled_wrong_grad.defvjp(lambda x: (x * 2, None), lambda _, g: (g * 3,))


# -- equal math passes -----------------------------------------------------------------------------


def test_equal_math_passes_with_outputs_and_input_grads_by_path() -> None:
    args, kwargs = layer_inputs()
    report = assert_parity(torch_layer, jax_layer, args, kwargs)
    paths = [entry.path for entry in report.entries]
    assert paths == [
        "output['count']",
        "output['hidden']",
        "grad args[0]",
        "grad kwargs['mask']",
    ]
    assert report.ok and report.worst is not None and report.worst.score <= 1


def test_torch_tensors_and_numpy_arrays_give_the_same_report() -> None:
    args, kwargs = layer_inputs()
    from_numpy = compare(torch_layer, jax_layer, args, kwargs)
    as_tensors = compare(
        torch_layer,
        jax_layer,
        (torch.from_numpy(args[0]),),
        {"mask": torch.from_numpy(kwargs["mask"])},
    )
    assert from_numpy == as_tensors


def test_a_graphed_jax_function_with_donation_leaves_torch_inputs_intact() -> None:
    x = torch.randn(2, 8)
    before = x.clone()
    program = dgj.graphed(lambda a: (a * 2, None), (jnp.zeros((2, 8)),), donate_argnums=0)
    report = assert_parity(lambda t: (t * 2, None), program, (x,))
    assert report.ok
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def test_a_transposed_torch_input_is_compared_like_a_contiguous_one() -> None:
    x = torch.randn(3, 4).t()  # reaches JAX through DLPack in the tensor's own layout
    report = assert_parity(lambda t: (t * 2).sum(0), lambda a: (a * 2).sum(0), (x,))
    assert report.ok and [entry.path for entry in report.entries] == ["output", "grad args[0]"]


def test_inputs_reach_jax_without_a_copy_on_the_same_device() -> None:
    tensor = torch.zeros(64, 64, device="cuda" if jax.devices()[0].platform == "gpu" else "cpu")
    assert as_jax(tensor).unsafe_buffer_pointer() == tensor.data_ptr()


def test_an_input_torch_negates_lazily_reaches_jax_with_its_values() -> None:
    # DLPack exported the memory of a lazily negated view (z.conj().imag) without its negation:
    # JAX saw 2 where torch saw -2, so equal functions failed, and without grads a torch_fn
    # that negates its input passed
    lazy = torch.tensor([[1 + 2j]], dtype=torch.complex64).conj().imag
    assert lazy.is_neg()
    assert compare(lambda t: t * 2, lambda a: a * 2, (lazy,)).ok
    assert not compare(lambda t: -t * 2, lambda a: a * 2, (lazy,), grads=False).ok
    np.testing.assert_array_equal(np.asarray(as_jax(lazy)), [[-2.0]])


IN_PLACE_CASES = {
    "int-array": ((np.zeros(3, np.int32),), True),
    "float-array-without-grads": ((np.ones(3, np.float32),), False),
    "torch-tensor": ((torch.ones(3),), False),
}


@pytest.mark.parametrize("args, grads", IN_PLACE_CASES.values(), ids=IN_PLACE_CASES.keys())
def test_a_torch_fn_that_updates_an_input_in_place_is_refused_naming_it(
    args: Any, grads: bool
) -> None:
    # The input reached JAX through DLPack after torch had changed it: JAX's `a + 0` saw the
    # new values, so an identity passed against torch's `t.add_(1) + 0`.
    with pytest.raises(dualgraph.DualgraphError, match=r"^args\[0\]: torch_fn updated it in place"):
        compare(lambda t: t.add_(1) + 0, lambda a: a + 0, args, grads=grads)


def test_an_input_torch_only_reads_is_not_refused() -> None:
    x = torch.ones(3)
    assert compare(lambda t: t.view(3) + 1, lambda a: a + 1, (x,)).ok


@pytest.mark.parametrize(
    "torch_fn, jax_fn, dtype",
    [
        (torch.conj, jnp.conj, np.complex64),
        (torch._neg_view, jnp.negative, np.float32),
    ],
    ids=["conjugate-bit", "negative-bit"],
)
def test_a_lazily_conjugated_or_negated_torch_output_is_compared_by_value(
    torch_fn: Any, jax_fn: Any, dtype: Any
) -> None:
    # torch's lazy conj()/neg views refuse .numpy(): a RuntimeError escaped the comparison
    x = (sample(3) + 0.5j * sample(3)).astype(dtype) if dtype == np.complex64 else sample(3)
    assert compare(torch_fn, jax_fn, (x,), grads=False).ok
    assert not compare(torch_fn, lambda a: a, (x,), grads=False).ok


def complex_sample(*shape: int) -> np.ndarray:
    return (sample(*shape) + 1j * sample(*shape)).astype(np.complex64)


COMPLEX_CASES = {
    "holomorphic": (lambda t: t * (0.3 + 0.7j), lambda a: a * (0.3 + 0.7j)),
    "complex-to-real": (lambda t: (t * t).real, lambda a: (a * a).real),
    "not-holomorphic": (lambda t: t.conj() * t.abs(), lambda a: a.conj() * jnp.abs(a)),
    "real-to-complex": (lambda t: t.real * (1 - 2j), lambda a: a.real * (1 - 2j)),
}


@pytest.mark.parametrize("torch_fn, jax_fn", COMPLEX_CASES.values(), ids=COMPLEX_CASES.keys())
def test_equal_complex_math_passes_on_its_gradients(torch_fn: Any, jax_fn: Any) -> None:
    # torch's complex gradients are the conjugates of JAX's vjp of the conjugate cotangent
    # (conjugate Wirtinger derivatives): compared as they came, every one failed.
    assert_parity(torch_fn, jax_fn, (complex_sample(3, 4),))


def test_params_of_a_complex_dtype_are_compared_as_torch_defines_their_grads() -> None:
    weight = torch.from_numpy(complex_sample(3, 4)).requires_grad_(True)
    report = assert_parity(
        lambda x: x @ weight.T,
        lambda p, x: x @ p["weight"].T,
        (complex_sample(2, 4),),
        params={"weight": jnp.asarray(weight.detach().numpy())},
        torch_params={"weight": weight},
    )
    assert [entry.path for entry in report.entries][-1] == "grad params['weight']"


class ConjugatedGrad(torch.autograd.Function):
    """``y = c x`` whose backward returns ``c * grad``, JAX's convention: wrong for torch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * (0.3 + 0.7j)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * (0.3 + 0.7j)


def test_a_torch_complex_gradient_in_jax_convention_fails() -> None:
    # It passed: both sides were compared without the conjugations.
    report = compare(ConjugatedGrad.apply, lambda a: a * (0.3 + 0.7j), (complex_sample(3),))
    assert report.entries[0].ok and report.worst_path == "grad args[0]" and not report.ok


# -- differences are found and named -------------------------------------------------------------


def test_a_perturbed_output_fails_naming_the_leaf() -> None:
    def perturbed(x: jax.Array, *, mask: jax.Array) -> dict[str, Any]:
        out = jax_layer(x, mask=mask)
        return {**out, "hidden": out["hidden"] * 1.01}

    args, kwargs = layer_inputs()
    report = compare(torch_layer, perturbed, args, kwargs, grads=False)
    assert not report.ok and report.worst_path == "output['hidden']"
    assert [entry.path for entry in report.failures] == ["output['hidden']"]
    with pytest.raises(AssertionError, match=r"torch and JAX differ at output\['hidden'\]"):
        assert_parity(torch_layer, perturbed, args, kwargs, grads=False)


def test_an_integer_output_is_compared_exactly() -> None:
    def off_by_one(x: jax.Array, *, mask: jax.Array) -> dict[str, Any]:
        return {**jax_layer(x, mask=mask), "count": (mask > 0).sum() + 1}

    args, kwargs = layer_inputs()
    loose = Tolerance(rtol=1.0, atol=1.0, max_rel_l2=1.0, min_cosine=-1.0)
    report = compare(torch_layer, off_by_one, args, kwargs, grads=False, tolerances=loose)
    assert report.worst_path == "output['count']"
    assert report.worst.tolerance is None and not report.ok


def test_a_torch_gradient_only_difference_fails_on_the_gradient() -> None:
    report = compare(Scaled.apply, lambda x: x * 2, (sample(3, 4),))
    outputs, grads = report.entries
    assert outputs.path == "output" and outputs.ok
    assert grads.path == "grad args[0]" and not grads.ok and report.worst_path == "grad args[0]"


def test_a_jax_gradient_only_difference_fails_on_the_gradient() -> None:
    report = compare(lambda t: t * 2, doubled_wrong_grad, (sample(3, 4),))
    assert report.entries[0].ok and not report.ok
    assert report.worst_path == "grad args[0]"


def test_a_cotangent_reaches_only_masked_outputs_the_same_way_on_both_sides() -> None:
    # Torch detaches its second output; the JAX side is told so by the torch spec's grad mask.
    x = torch.randn(3)
    written = dgj.graphed(lambda a: (a * 2, a * 5), (jnp.zeros(3),)).out_spec.with_grad_mask(
        [True, False]
    )
    program = dgj.graphed(lambda a: (a * 2, a * 5), (jnp.zeros(3),), out_spec=written)
    assert_parity(lambda t: (t * 2, (t * 5).detach()), program, (x,))
    unmasked = compare(lambda t: (t * 2, (t * 5).detach()), lambda a: (a * 2, a * 5), (x,))
    assert unmasked.worst_path == "grad args[0]" and not unmasked.ok


class TimesFiveWrongGrad(torch.autograd.Function):
    """``x * 5`` whose backward gives ``7 * grad``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 5

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 7


def test_a_torch_output_requiring_grad_that_the_out_spec_masks_off_is_refused_by_path() -> None:
    # The out_spec's mask left output[1] without a cotangent on both sides, so the wrong
    # backward torch has through it was never compared, and the report passed.
    written = dgj.graphed(lambda a: (a * 2, a * 5), (jnp.zeros(3),)).out_spec.with_grad_mask(
        [True, False]
    )
    program = dgj.graphed(lambda a: (a * 2, a * 5), (jnp.zeros(3),), out_spec=written)
    with pytest.raises(
        SpecMismatchError, match=r"^output\[1\]: torch_fn's output requires grad"
    ) as caught:
        compare(lambda t: (t * 2, TimesFiveWrongGrad.apply(t)), program, (torch.randn(3),))
    assert caught.value.path == "output[1]"
    assert compare(  # nothing is differentiated without grads
        lambda t: (t * 2, TimesFiveWrongGrad.apply(t)), program, (torch.randn(3),), grads=False
    ).ok


def test_a_none_where_the_other_side_has_an_array_is_reported_by_path() -> None:
    with pytest.raises(SpecMismatchError) as caught:
        compare(lambda t: (t, None), lambda a: (a, a), (sample(2, 3),))
    assert caught.value.path == "output[1]"
    assert "output[1]: expected float32[2, 3], got None" in str(caught.value)


def test_a_torch_side_that_returns_no_tensor_is_reported_by_path() -> None:
    x = (np.ones(2, np.float32),)
    with pytest.raises(dualgraph.DualgraphError, match=r"^output\[0\]: torch_fn returned"):
        compare(lambda t: (t.detach().numpy(), None), lambda a: (a, None), x)


def test_a_different_constant_is_reported_by_path() -> None:
    with pytest.raises(SpecMismatchError, match=r"output\['depth'\]: expected int 3, got int 2"):
        compare(
            torch_layer, lambda x, *, mask: {**jax_layer(x, mask=mask), "depth": 3}, *layer_inputs()
        )


def test_a_dict_in_another_key_order_is_reported_by_path() -> None:
    # It passed: leaves are aligned by key, so equal values in another order compared equal,
    # while the two output specs (and whatever iterates over the dict) differ.
    def torch_side(t: torch.Tensor) -> list[Any]:
        return [{"a": t * 2, "b": t * 3}]

    def jax_side(a: jax.Array) -> list[Any]:
        return [{"b": a * 3, "a": a * 2}]

    with pytest.raises(SpecMismatchError, match=r"^output\[0\]: .*\['a', 'b'\].*\['b', 'a'\]"):
        compare(torch_side, jax_side, (sample(2),))


def nested(*parts: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage"
        return torch.nested.nested_tensor(list(parts))


def test_a_nested_torch_output_is_refused_by_path() -> None:
    # Described as a scalar (no single shape), it matched a JAX scalar, then torch's own
    # RuntimeError ("NestedTensorImpl doesn't support sizes") leaked, naming nothing.
    with pytest.raises(SpecMismatchError, match=r"^output\[0\]: torch_fn returned a nested"):
        compare(lambda t: [nested(t * 2, t[:1])], lambda a: [a.sum()], (sample(3),))


def test_a_nested_or_meta_torch_input_is_refused_by_path() -> None:
    inputs = ({"n": nested(torch.ones(2), torch.ones(3))},)
    with pytest.raises(dualgraph.DualgraphError, match=r"^args\[0\]\['n'\] is a nested"):
        compare(lambda d: d, lambda d: d, inputs)
    with pytest.raises(dualgraph.DualgraphError, match=r"^args\[0\] is a meta tensor"):
        compare(lambda t: t, lambda a: a, (torch.ones(2, device="meta"),))


def test_meta_torch_parameters_are_refused_by_name() -> None:
    linear = torch.nn.Linear(2, 2, device="meta")
    params = {"weight": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    with pytest.raises(dualgraph.DualgraphError, match=r"parameter 'weight' is a meta tensor"):
        compare(linear, linear_jax, (sample(1, 2),), params=params)


def test_uninitialized_torch_parameters_are_refused_by_name() -> None:
    # A lazy module's parameters leaked torch's ValueError from reading them, naming none.
    lazy = torch.nn.LazyLinear(2)
    params = {"weight": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    with pytest.raises(dualgraph.DualgraphError, match=r"parameter 'weight' is uninitialized"):
        compare(lazy, linear_jax, (sample(1, 2),), params=params)


def test_a_torch_fn_writing_its_input_through_data_is_refused_by_path() -> None:
    # .data writes do not move the version counter: JAX read the clamped values through DLPack,
    # and a reference that never clamps passed.
    def clamping(x: torch.Tensor) -> torch.Tensor:
        x.data.clamp_(min=0)
        return x * 2

    x = np.array([-1.0, 2.0], np.float32)
    with pytest.raises(dualgraph.DualgraphError, match=r"^args\[0\]: torch_fn updated it in place"):
        compare(clamping, lambda a: a * 2, (x,), grads=False)


class _ClampingInForward(torch.nn.Module):
    """Writes its weight in its forward, through .data (no version bump) or in place."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([-1.0, 2.0]))
        self.through_data = through_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_data:
            self.weight.data.clamp_(min=0)
        else:
            with torch.no_grad():
                self.weight.clamp_(min=0)
        return x * self.weight


@pytest.mark.parametrize("through_data", [False, True], ids=["in_place", "through_data"])
@pytest.mark.parametrize("with_params", [True, False], ids=["params", "closed_over"])
def test_a_torch_fn_that_updates_a_parameter_in_place_is_refused_naming_it(
    through_data: bool, with_params: bool
) -> None:
    # JAX params made through DLPack (as models.jax_vit does) share the parameter's memory: the
    # JAX side ran after torch's forward, read the clamped weight, and a reference that never
    # clamps passed.
    module = _ClampingInForward(through_data)
    shared = jax.dlpack.from_dlpack(module.weight.detach())
    x = np.array([3.0, 5.0], np.float32)
    with pytest.raises(dualgraph.DualgraphError, match=r"^torch parameter 'weight': torch_fn upd"):
        if with_params:
            compare(module, lambda p, a: a * p["weight"], (x,), params={"weight": shared})
        else:
            compare(module, lambda a: a * shared, (x,), grads=False)


def test_a_torch_fn_whose_backward_updates_its_parameters_is_refused_naming_one() -> None:
    # An optimizer step in a post-accumulate-grad hook (the optimizer-in-backward pattern) moved
    # the weights and cleared their .grad, read as zero: the comparison failed as if torch's
    # gradients were zero, and a JAX reference closing over its weights passed.
    linear = torch.nn.Linear(4, 3)
    params = jax_params_of(linear)
    steps = {p: torch.optim.SGD([p], lr=0.1) for p in linear.parameters()}

    def step(p: torch.Tensor) -> None:
        steps[p].step()
        steps[p].zero_grad()

    for p in linear.parameters():
        p.register_post_accumulate_grad_hook(step)
    weight, bias = (jnp.asarray(p.detach().numpy().copy()) for p in linear.parameters())
    closed_over = lambda p, x: x @ weight.T + bias + 0.0 * p["bias"]  # noqa: E731
    with pytest.raises(dualgraph.DualgraphError, match=r"parameter 'weight': torch_fn's backward"):
        compare(linear, closed_over, (inputs_2x4(),), params=params)


def test_a_torch_fn_whose_backward_updates_its_parameters_is_refused_without_params_too() -> None:
    # Without params= no parameter grad is read, but compare's backward, of random cotangents,
    # stepped the module (an optimizer in its post-accumulate-grad hooks), silently.
    linear = torch.nn.Linear(4, 3)
    steps = {p: torch.optim.SGD([p], lr=0.1) for p in linear.parameters()}

    def step(p: torch.Tensor) -> None:
        steps[p].step()
        steps[p].zero_grad()

    for p in linear.parameters():
        p.register_post_accumulate_grad_hook(step)
    weight, bias = (jnp.asarray(p.detach().numpy().copy()) for p in linear.parameters())
    with pytest.raises(dualgraph.DualgraphError, match=r"parameter 'weight': torch_fn's backward"):
        compare(linear, lambda x: x @ weight.T + bias, (inputs_2x4(),))


def test_a_parameter_whose_hook_clears_its_grad_is_refused_naming_it() -> None:
    # A post-accumulate-grad hook that moves the gradient away (offloading) and clears .grad
    # left it read as zero: a JAX reference closing over its weights passed.
    linear = torch.nn.Linear(4, 3)
    params = jax_params_of(linear)
    moved = {}

    def offload(p: torch.Tensor) -> None:
        moved[id(p)] = p.grad
        p.grad = None

    linear.weight.register_post_accumulate_grad_hook(offload)
    weight = jnp.asarray(linear.weight.detach().numpy().copy())
    closed_over = lambda p, x: x @ weight.T + p["bias"] + 0.0 * p["weight"].sum()  # noqa: E731
    with pytest.raises(dualgraph.DualgraphError, match=r"'weight': .* without a \.grad \(a hook"):
        compare(linear, closed_over, (inputs_2x4(),), params=params)


def test_an_unused_parameter_with_a_post_accumulate_grad_hook_is_not_refused() -> None:
    linear = torch.nn.Linear(4, 3)
    linear.unused = torch.nn.Parameter(torch.ones(2))
    linear.unused.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    params = jax_params_of(linear)
    report = assert_parity(
        linear,
        lambda p, x: linear_jax(p, x) + 0.0 * p["unused"].sum(),
        (inputs_2x4(),),
        params=params,
    )
    assert "grad params['unused']" in [entry.path for entry in report.entries]


def test_a_lazy_module_whose_forward_makes_its_parameters_is_not_refused() -> None:
    torch.manual_seed(0)
    lazy = torch.nn.LazyLinear(2, bias=False)
    x = sample(1, 3)
    # The reference is traced after torch's forward, which made the weight.
    report = compare(lazy, lambda a: a @ jnp.asarray(lazy.weight.detach().numpy()).T, (x,))
    assert report.ok and [entry.path for entry in report.entries] == ["output", "grad args[0]"]


_SPARSE = [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", _SPARSE, ids=["coo", "csr"])
def test_a_sparse_input_is_watched_for_in_place_updates_by_its_values(layout: Any) -> None:
    # torch's eq takes no sparse tensor: the in-place check leaked its NotImplementedError
    # (COO) or RuntimeError (CSR) from every comparison with a sparse input.
    x = layout(torch.eye(3))
    assert compare(lambda t: t.to_dense() * 2, lambda a: a * 2, (x,), grads=False).ok

    def doubling_its_values(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t.values().mul_(2)
        return t.to_dense()

    with pytest.raises(dualgraph.DualgraphError, match=r"^args\[0\]: torch_fn updated it in"):
        compare(doubling_its_values, lambda a: a, (layout(torch.eye(3)),), grads=False)


def test_inputs_holding_nan_that_torch_fn_leaves_alone_pass() -> None:
    x = np.array([np.nan, 1.0], np.float32)
    assert_parity(lambda t: t * 2, lambda a: a * 2, (x,), allow_nan=True)


def test_a_different_dtype_is_reported_by_path() -> None:
    with pytest.raises(SpecMismatchError, match=r"output\['h'\]: expected bfloat16\[2\]"):
        compare(lambda t: {"h": t}, lambda a: {"h": a.astype(jnp.bfloat16)}, (sample(2),))


# -- tolerances ----------------------------------------------------------------------------------


def ten_percent_larger(a: jax.Array) -> jax.Array:
    return a * jnp.asarray(1.1, a.dtype)


def plus_minus_one(n: int, dtype: Any) -> np.ndarray:
    """Entries of magnitude 1 (so ``|x| == rms``), random signs."""
    return np.where(rng.standard_normal(n) > 0, 1.0, -1.0).astype(dtype)


@pytest.mark.parametrize(
    ("dtype", "passes"), [(ml_dtypes.bfloat16, False), (np.float16, False), (np.float32, False)]
)
def test_a_leaf_ten_percent_too_large_fails_in_every_dtype(dtype: Any, passes: bool) -> None:
    # bfloat16's entry-wise limits let 10% through (rtol 6e-2 + atol 0.25 x rms); its relative
    # L2 limit (3e-2) and its limit on a systematic scale (4e-3) do not.
    report = compare(lambda t: t, ten_percent_larger, (plus_minus_one(64, dtype),), grads=False)
    name = np.dtype(dtype).name
    assert report.ok is passes
    assert report.worst.tolerance == DEFAULT_TOLERANCES[name]


SYSTEMATIC_CHANGES = {
    "scaled_1_percent": lambda x: x * 1.01,
    "scaled_2_percent": lambda x: x * 1.02,
    "shrunk_1_5_percent": lambda x: x * 0.985,
    "offset_1_5_percent_of_rms": lambda x: x + 0.015 * np.sqrt(np.mean(np.abs(x) ** 2)),
    "transposed": lambda x: x.T,
    "sign_flipped": lambda x: -x,
}
LOW_AND_FULL_PRECISION = [ml_dtypes.bfloat16, np.float16, np.float32, np.float64, np.complex64]


@pytest.mark.parametrize("dtype", LOW_AND_FULL_PRECISION, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("change", list(SYSTEMATIC_CHANGES))
def test_a_systematically_changed_leaf_fails_by_the_default_tolerance(
    dtype: Any, change: str
) -> None:
    # A whole leaf scaled by 1-2% (a wrong constant, a missing rescale) hides within the
    # scatter that bfloat16's and float16's entry-wise and L2 limits allow (the old bfloat16
    # limits passed a leaf 7% too large); its fitted scale and offset do not.
    values = rng.standard_normal((16, 16))
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal((16, 16))
    expected = values.astype(dtype)
    actual = SYSTEMATIC_CHANGES[change](
        expected.astype(np.complex128 if values.dtype.kind == "c" else np.float64)
    ).astype(dtype)
    report = compare_arrays("output", actual, expected)
    assert not report.ok, report


@pytest.mark.parametrize(
    "dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize(
    "change", ["scaled_by_two_steps", "offset_by_a_third", "transposed", "sign_flipped"]
)
def test_a_changed_narrow_format_leaf_fails_by_the_default_tolerance(
    dtype: Any, change: str
) -> None:
    # A 1-2% scale is below these formats' resolution (one step is 12.5% or 25%); what they can
    # hold wrong, they fail.
    expected = rng.standard_normal((16, 16)).astype(dtype)
    wide = expected.astype(np.float64)
    step = 2 * float(ml_dtypes.finfo(dtype).eps)
    actual = {
        "scaled_by_two_steps": wide * (1 + step),
        "offset_by_a_third": wide + np.sqrt(np.mean(wide**2)) / 3,
        "transposed": wide.T,
        "sign_flipped": -wide,
    }[change].astype(dtype)
    assert not compare_arrays("output", actual, expected).ok


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("size", [8, 4096])
def test_independent_rounding_scatter_of_a_few_steps_passes(dtype: Any, size: int) -> None:
    # Each entry off by two roundings of its own, in either direction: what two computations
    # rounding after each op leave, with no scale or offset shared by the leaf.
    values = rng.standard_normal(size)
    unit = float(ml_dtypes.finfo(dtype).eps) / 2
    scattered = values * (1 + 2 * unit * rng.standard_normal(size))
    report = compare_arrays("output", scattered.astype(dtype), values.astype(dtype))
    assert report.ok, report
    assert report.bias_usage is not None and report.max_abs > 0


@pytest.mark.parametrize("tail", ["heavy", "sparse"])
def test_leaves_of_a_few_large_entries_within_their_rounding_pass(tail: str) -> None:
    # Rounding errors follow each entry's size: in a heavy-tailed or sparse leaf the fitted
    # scale rests on a few large entries and is as uncertain as their errors. Judged by the
    # residuals' pooled variance, about a third of such bfloat16 leaves failed as scaled.
    draw = np.random.default_rng(7)
    unit = 2.0**-8
    for _ in range(10):
        if tail == "heavy":
            values = draw.standard_cauchy(1024)
        else:
            values = draw.standard_normal(4096) * (draw.random(4096) < 0.02)
        scattered = values * (1 + 1.5 * unit * draw.standard_normal(values.size))
        report = compare_arrays(
            "output", scattered.astype(ml_dtypes.bfloat16), values.astype(ml_dtypes.bfloat16)
        )
        assert report.ok, report


def test_the_low_precision_defaults_follow_the_rounding_rule() -> None:
    for name in ("bfloat16", "float16"):
        limits = DEFAULT_TOLERANCES[name]
        error = float(ml_dtypes.finfo(name).eps) / 2 * 8  # u * sqrt(64)
        assert limits == rounding_tolerance(name, depth=64)
        assert (limits.max_rel_l2, limits.rtol, limits.atol) == (error, 2 * error, 8 * error)
        assert limits.max_bias == float(ml_dtypes.finfo(name).eps) / 2
    deeper = rounding_tolerance("bfloat16", depth=256)
    assert deeper.max_rel_l2 == 2 * DEFAULT_TOLERANCES["bfloat16"].max_rel_l2


@pytest.mark.parametrize("depth", [0, -1, 2.5, True])
def test_a_rounding_tolerance_of_no_whole_depth_is_refused(depth: Any) -> None:
    with pytest.raises(dualgraph.DualgraphError, match="depth must be an int >= 1"):
        rounding_tolerance("bfloat16", depth=depth)


def test_a_bfloat16_reference_scaled_by_one_and_a_half_percent_fails_compare() -> None:
    x = sample(32, 32, dtype=ml_dtypes.bfloat16)
    report = compare(
        lambda t: torch.tanh(t), lambda a: jnp.tanh(a) * jnp.bfloat16(1.015), (x,), grads=False
    )
    assert not report.ok and "systematic error" in report.worst.reason, report


def test_a_bfloat16_leaf_within_its_rounding_passes() -> None:
    # torch computes in float32 and rounds once; JAX computes in bfloat16 throughout.
    x = sample(64, 64, dtype=ml_dtypes.bfloat16)
    report = assert_parity(
        lambda t: (torch.tanh(t.float()) * 3 + t.float() ** 2).to(torch.bfloat16),
        lambda a: jnp.tanh(a) * 3 + a**2,
        (x,),
    )
    assert report.entries[0].max_abs > 0  # they do differ, by rounding


def test_bfloat16_gradients_are_compared_in_bfloat16() -> None:
    report = assert_parity(
        lambda t: torch.tanh(t) * 3,
        lambda a: jnp.tanh(a) * 3,
        (sample(8, 8, dtype=ml_dtypes.bfloat16),),
    )
    assert [entry.dtype for entry in report.entries] == ["bfloat16", "bfloat16"]


def test_float32_matmuls_summed_in_another_order_pass() -> None:
    # Only the rounding of the float32 additions differs: the torch side sums each 256-term dot
    # product in float64 and rounds once, JAX sums in float32, in halves. (Two float32 matmuls
    # alone can agree to the bit on some CPUs, which would not test the tolerance.)
    x, w = sample(32, 256), sample(256, 64)
    report = assert_parity(
        lambda t, v: (t.double() @ v.double()).float(),
        lambda a, v: a[:, :128] @ v[:128] + a[:, 128:] @ v[128:],
        (x, w),
    )
    assert 0 < report.worst.score < 0.1


def test_tolerances_can_be_overridden_for_all_or_by_dtype() -> None:
    x = (plus_minus_one(16, np.float32),)
    lenient = Tolerance(rtol=0.2, atol=0.0, max_rel_l2=0.2, min_cosine=0.99)
    assert compare(lambda t: t, ten_percent_larger, x, grads=False, tolerances=lenient).ok
    by_dtype = {"float32": lenient}
    assert compare(lambda t: t, ten_percent_larger, x, grads=False, tolerances=by_dtype).ok
    other_dtype = {"bfloat16": lenient}
    assert not compare(lambda t: t, ten_percent_larger, x, grads=False, tolerances=other_dtype).ok


def test_a_tolerance_out_of_range_is_refused() -> None:
    with pytest.raises(dualgraph.DualgraphError, match="min_cosine"):
        Tolerance(rtol=1e-3, atol=1e-3, max_rel_l2=1e-3, min_cosine=2.0)


@pytest.mark.parametrize(
    ("tolerances", "message"),
    [
        ({"float32": 1e-3}, r"tolerances\['float32'\] is a float, not a Tolerance"),
        ([1e-3], r"tolerances: expected a Tolerance or a mapping .* got list"),
        (1e-3, r"tolerances: expected a Tolerance or a mapping .* got float"),
    ],
    ids=["number-in-mapping", "list", "number"],
)
def test_tolerances_that_are_not_tolerances_are_refused(tolerances: Any, message: str) -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare_arrays("output", x, x, tolerances=tolerances)


@pytest.mark.parametrize("key", ["fp32", "float", "int32", "bool", 32], ids=str)
def test_a_tolerance_keyed_by_no_floating_dtype_name_is_refused(key: Any) -> None:
    # {"fp32": strict} was ignored: float32 leaves were judged by the default, looser limits
    # than the caller asked for, and passed
    strict = Tolerance(rtol=0.0, atol=0.0, max_rel_l2=0.0, min_cosine=1.0)
    x = (plus_minus_one(16, np.float32),)
    message = rf"tolerances: {key!r} is not the name of a floating or complex dtype"
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare(lambda t: t * (1 + 1e-6), lambda a: a, x, grads=False, tolerances={key: strict})
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare_arrays("output", x[0], x[0], tolerances={key: strict})


@pytest.mark.parametrize(
    "limit",
    [float("inf"), np.float32("inf"), 10**400],
    ids=["inf", "numpy-inf", "int-overflowing-float"],
)
@pytest.mark.parametrize("field", ["rtol", "atol", "max_rel_l2"])
def test_an_infinite_tolerance_is_refused(field: str, limit: Any) -> None:
    # an infinite limit would let any finite difference pass
    limits = {"rtol": 1e-3, "atol": 1e-3, "max_rel_l2": 1e-3, "min_cosine": 0.9, field: limit}
    with pytest.raises(dualgraph.DualgraphError, match="must be finite"):
        Tolerance(**limits)


def test_tolerance_limits_are_stored_as_floats() -> None:
    from fractions import Fraction

    t = Tolerance(rtol=Fraction(1, 10), atol=np.float32(0.5), max_rel_l2=1, min_cosine=0)
    assert [type(v) for v in (t.rtol, t.atol, t.max_rel_l2, t.min_cosine)] == [float] * 4
    assert (t.rtol, t.atol) == (0.1, 0.5)
    x = np.ones(2, np.float32)
    assert compare_arrays("output", x * 1.05, x, tolerances=t).ok


#: The floating formats of 8 bits and fewer (ml_dtypes keeps each in one byte).
NARROW_FORMATS = [
    name
    for name in DEFAULT_TOLERANCES
    if hasattr(ml_dtypes, name) and np.dtype(getattr(ml_dtypes, name)).itemsize == 1
]


def _steps_from_one(dtype: Any, steps: int) -> Any:
    """The value ``steps`` representable values above 1.0 in ``dtype``."""
    every = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    values = np.unique(every[np.isfinite(every)])
    return values[int(np.searchsorted(values, 1.0)) + steps]


@pytest.mark.parametrize("name", NARROW_FORMATS)
def test_a_narrow_format_entry_one_value_off_passes_and_two_fail(name: str) -> None:
    # One entry of sixteen: its rtol (2 eps) and atol (eps x rms) let two steps through, and
    # the whole-leaf limits barely move (float4_e2m1fn's rtol of 100% let a 6 read as 0).
    dtype = getattr(ml_dtypes, name)
    expected = np.ones(16, dtype)
    for steps, passes in ((1, True), (2, False)):
        actual = expected.copy()
        actual[3] = _steps_from_one(dtype, steps)
        leaf = compare_arrays("out", actual, expected)
        assert leaf.ok is passes and leaf.ulps == steps, leaf
    assert "2 values apart where 1 may be" in (leaf.reason or "")


def test_an_e8m0_scale_leaf_shrunk_to_its_smallest_value_fails() -> None:
    # Powers of two: below x there is x / 2 and nothing between, so |torch - jax| < |jax| and
    # a relative L2 error under 1 held for any smaller scale; every limit passed it.
    dtype = ml_dtypes.float8_e8m0fnu
    expected = np.array([1, 2, 4, 8], dtype)
    actual = np.full(4, 2.0**-127, dtype)
    leaf = compare_arrays("scales", actual, expected)
    assert not leaf.ok and leaf.mismatched == 4 and leaf.ulps == 130, leaf


class ToE8m0WrongAtOne(torch.autograd.Function):
    """``x.to(float8_e8m0fnu)`` whose backward is wrong at entry 1 (where seed 0 drew < 0)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e8m0fnu)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        wrong = grad.float().clone()
        wrong[1] = 5.0
        return wrong


def test_cotangents_of_an_e8m0_output_are_drawn_positive_so_every_grad_entry_compares() -> None:
    # e8m0 has no sign: a negative normal draw became a NaN cotangent, and its entries' grads
    # were NaN on both sides, which matched, so a wrong gradient there passed.
    x = np.linspace(0.5, 4, 6, dtype=np.float32)
    report = compare(ToE8m0WrongAtOne.apply, lambda a: a.astype(jnp.float8_e8m0fnu), (x,))
    assert report.worst_path == "grad args[0]" and not report.ok, report
    good = compare(
        lambda t: t.to(torch.float8_e8m0fnu), lambda a: a.astype(jnp.float8_e8m0fnu), (x,)
    )
    assert good.ok and [leaf.nonfinite for leaf in good.entries] == [0, 0], good


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_max_ulps_counts_representable_values_across_zero_and_in_complex_parts(
    dtype: Any,
) -> None:
    limits = Tolerance(rtol=1.0, atol=1.0, max_rel_l2=1.0, min_cosine=-1.0, max_ulps=1)
    tiny = np.array([ml_dtypes.finfo(dtype).smallest_subnormal], dtype)
    assert compare_arrays("out", -tiny, tiny, tolerances=limits).ulps == 2
    assert compare_arrays("out", -tiny * 0, tiny * 0, tolerances=limits).ulps == 0  # -0.0, 0.0
    if dtype in (np.float32, np.float64):
        z = np.array([[1 + 1j, 2 + 2j]], np.result_type(dtype, np.complex64))
        w = z.copy()
        w[0, 1] = complex(2, np.nextafter(dtype(2), dtype(3)))
        assert compare_arrays("z", w, z, tolerances=limits).ulps == 1


@pytest.mark.parametrize("name", ["float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"])
def test_max_ulps_counts_a_sub_byte_format_by_its_values_whatever_its_unused_bits(
    name: str,
) -> None:
    # A byte of float4 or float6 holds bits above the format's own; ml_dtypes reads any of
    # them as the sign, so the steps are counted from the values, not from the raw bytes.
    dtype = getattr(ml_dtypes, name)
    bits = ml_dtypes.finfo(dtype).bits
    raw = np.arange(1 << bits, dtype=np.uint8)
    negative = (raw >> (bits - 1)).astype(bool)
    high = np.where(negative, raw | np.uint8(0xFF << bits & 0xFF), raw).view(dtype)
    assert np.array_equal(high.astype(np.float64), raw.view(dtype).astype(np.float64))
    one = np.ones(1 << bits, dtype)
    low = compare_arrays("out", raw.view(dtype), one, tolerances=_ulps_only)
    assert compare_arrays("out", high, one, tolerances=_ulps_only).ulps == low.ulps > 0


_ulps_only = Tolerance(rtol=1e3, atol=1e3, max_rel_l2=1e3, min_cosine=-1.0, max_ulps=1000)


@pytest.mark.parametrize("max_ulps", [-1, 1.0, True, "1"])
def test_max_ulps_must_be_none_or_a_non_negative_int(max_ulps: Any) -> None:
    with pytest.raises(dualgraph.DualgraphError, match="max_ulps"):
        Tolerance(rtol=0.1, atol=0.1, max_rel_l2=0.1, min_cosine=0.9, max_ulps=max_ulps)


@pytest.mark.parametrize("allow_nan", ["no", 0, None])
def test_allow_nan_must_be_a_bool(allow_nan: Any) -> None:
    nan = np.full(2, np.nan, np.float32)
    with pytest.raises(dualgraph.DualgraphError, match="allow_nan must be True or False"):
        compare_arrays("output", nan, nan, allow_nan=allow_nan)


@pytest.mark.parametrize(
    "args",
    [{"x": np.ones(2, np.float32)}, "xy", np.ones(2, np.float32), torch.ones(2), None],
    ids=["dict", "str", "numpy-array", "tensor", "none"],
)
def test_args_that_are_no_tuple_or_list_of_arguments_are_refused(args: Any) -> None:
    # a dict was read as the tuple of its keys: both sides returned the key, nothing was
    # compared, and the report passed
    with pytest.raises(dualgraph.DualgraphError, match=r"^args: expected a tuple or list"):
        compare(lambda *a: a, lambda *a: a, args)


def test_kwargs_that_are_no_mapping_are_refused() -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(dualgraph.DualgraphError, match=r"^kwargs: expected a mapping"):
        compare(lambda t, **k: t, lambda a, **k: a, (x,), [("b", x)])


@pytest.mark.parametrize("grads", ["no", 0, None])
def test_grads_must_be_a_bool(grads: Any) -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(dualgraph.DualgraphError, match="grads must be True or False"):
        compare(lambda t: t * 2, lambda a: a * 2, (x,), grads=grads)


@pytest.mark.parametrize("seed", ["0", 1.5, True, -1, None])
def test_a_seed_that_is_no_non_negative_int_is_refused(seed: Any) -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(dualgraph.DualgraphError, match="seed must be a non-negative int"):
        compare(lambda t: t * 2, lambda a: a * 2, (x,), seed=seed)


@pytest.mark.parametrize("torch_fn", [3, None, "t * 2"])
def test_a_torch_fn_that_is_not_callable_is_refused(torch_fn: Any) -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(dualgraph.DualgraphError, match=r"^torch_fn: .* is not callable"):
        compare(torch_fn, lambda a: a * 2, (x,))


def test_an_input_torch_cannot_hold_is_refused_naming_its_path() -> None:
    value = np.ones(2, np.longdouble)
    if value.dtype == np.float64:
        pytest.skip("long double is float64 on this platform")
    with pytest.raises(dualgraph.DualgraphError, match=r"args\[1\]\['w'\]: .*float128"):
        compare(lambda t, d: t, lambda a, d: a, (np.ones(2, np.float32), {"w": value}))


def _tensor_of(dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # complex32 is experimental
        warnings.simplefilter("ignore", UserWarning)
        return torch.empty(2, dtype=dtype)


# dtypes torch cannot copy or compare (quantized, sub-byte, bit-packed) or numpy cannot hold
_UNCOMPARABLE = [torch.int4, torch.uint2, torch.quint8, torch.bits8, torch.complex32]


@pytest.mark.parametrize("dtype", _UNCOMPARABLE, ids=str)
def test_an_input_of_a_dtype_that_cannot_be_compared_is_refused_naming_its_path(
    dtype: torch.dtype,
) -> None:
    # torch's NotImplementedError/RuntimeError (from the copy kept to find in-place updates,
    # or torch.equal) or the bridge's error naming no leaf came out of compare.
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(dualgraph.DualgraphError, match=rf"^args\[1\] is a torch {name} tensor"):
        compare(lambda t, q: t, lambda a, q: a, (sample(2), _tensor_of(dtype)), grads=False)


def test_a_numpy_input_torch_reads_in_a_dtype_it_cannot_copy_is_refused_naming_its_path() -> None:
    packed = np.zeros(3, ml_dtypes.int4)
    with pytest.raises(dualgraph.DualgraphError, match=r"^args\[0\] is a torch int4 tensor"):
        compare(lambda q: q, lambda q: q, (packed,), grads=False)


@pytest.mark.parametrize("dtype", _UNCOMPARABLE, ids=str)
def test_compare_arrays_refuses_a_tensor_that_cannot_be_compared_naming_the_leaf(
    dtype: torch.dtype,
) -> None:
    tensor = _tensor_of(dtype)
    with pytest.raises(dualgraph.DualgraphError, match=r"^out: a torch \w+ tensor"):
        compare_arrays("out", tensor, tensor)


@pytest.mark.parametrize("limit", ["1e-3", None, True, complex(1e-3)])
def test_a_tolerance_of_non_numbers_is_refused(limit: Any) -> None:
    with pytest.raises(dualgraph.DualgraphError, match="must be real numbers"):
        Tolerance(rtol=limit, atol=1e-3, max_rel_l2=1e-3, min_cosine=0.9)


# -- the blind spots of a max(1, |reference|)-scaled atol, each caught ---------------------------


@pytest.mark.parametrize(
    ("dtype", "magnitude"),
    [(np.float32, 1e-6), (np.float32, 1e-30), (ml_dtypes.bfloat16, 1e-2), (np.float16, 1e-3)],
    ids=["float32-1e-6", "float32-1e-30", "bfloat16-1e-2", "float16-1e-3"],
)
def test_a_tiny_leaf_whose_sign_flipped_fails(dtype: Any, magnitude: float) -> None:
    y = (np.abs(sample(4, 8)) * magnitude).astype(dtype)
    report = compare(lambda t: -t, lambda a: a, (y,), grads=False)
    leaf = report.entries[0]
    assert not leaf.ok and leaf.cosine == pytest.approx(-1.0) and leaf.score > 1


def test_a_sign_flip_fails_on_the_cosine_even_under_loose_entry_limits() -> None:
    loose = Tolerance(rtol=2.0, atol=1.0, max_rel_l2=10.0, min_cosine=0.9)
    report = compare(lambda t: -t, lambda a: a, (sample(4, 8),), grads=False, tolerances=loose)
    assert report.worst.score <= 1 and report.worst.rel_l2 <= 10
    assert report.worst.reason == "cosine similarity -1 < 0.9"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64], ids=lambda d: d.__name__)
def test_equal_leaves_pass_a_tolerance_that_asks_for_exact_values(dtype: Any) -> None:
    # The cosine was Re<a, b> / (|a| |b|), which rounds either way: about a quarter of equal
    # leaves read 'cosine similarity 1 < 1' under min_cosine=1 and failed
    exact = Tolerance(rtol=0.0, atol=0.0, max_rel_l2=0.0, min_cosine=1.0)
    draws = np.random.default_rng(1)
    for size in range(1, 41):
        x = draws.standard_normal(size) + (
            1j * draws.standard_normal(size) if dtype == np.complex64 else 0
        )
        x = (x * 10.0 ** draws.integers(-20, 20)).astype(dtype)
        leaf = compare_arrays("output", x, x.copy(), tolerances=exact)
        assert leaf.ok and leaf.cosine == 1.0, (size, leaf.reason)
    changed = np.array([1.0, 2.0, 3.0], dtype)
    assert not compare_arrays("output", changed * (1 + 1e-6), changed, tolerances=exact).ok


class FlippedGradient(torch.autograd.Function):
    """``y = x * 1e-6`` whose backward returns ``-1e-6 * grad``: a gradient of the wrong sign."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1e-6

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad * 1e-6


def test_a_sign_flipped_tiny_gradient_fails() -> None:
    report = compare(FlippedGradient.apply, lambda a: a * 1e-6, (sample(3, 4),))
    output, gradient = report.entries
    assert output.ok
    assert gradient.path == "grad args[0]" and not gradient.ok
    assert gradient.cosine == pytest.approx(-1.0)


@pytest.mark.parametrize(
    ("torch_value", "jax_value", "shown"),
    [
        (np.nan, 0.5, "torch nan, JAX 0.5"),
        (np.inf, -np.inf, "torch inf, JAX -inf"),
        (np.inf, 3e38, "torch inf, JAX 3e+38"),
    ],
    ids=["nan-vs-number", "inf-vs-minus-inf", "inf-vs-large-finite"],
)
def test_a_nonfinite_entry_unmatched_on_the_other_side_is_named_in_the_reason(
    torch_value: float, jax_value: float, shown: str
) -> None:
    # The reason read '1 values over tolerance, worst at infx (max abs 0)': the leaf failed,
    # but said nothing of NaN or infinity, and its max abs of 0 read as no difference at all
    reference = plus_minus_one(8, np.float32).reshape(2, 4)
    got, expected = reference.copy(), reference.copy()
    got[1, 2], expected[1, 2] = torch_value, jax_value
    leaf = compare_arrays("output", got, expected)
    assert not leaf.ok and leaf.mismatched == 1 and leaf.unmatched_nonfinite == 1
    assert leaf.first_unmatched == f"[1, 2]: {shown}"
    assert leaf.reason == (
        "1 values over tolerance, worst at infx (max abs 0 where both are finite; 1 NaN or "
        f"infinite on one side only or of the other sign, first at [1, 2]: {shown})"
    )


def test_a_leaf_whose_reference_is_zero_says_why_a_tiny_difference_fails() -> None:
    # The reason read '4 values over tolerance, worst at infx (max abs 1e-30)': nothing said
    # that an all-zero reference leaves every limit at 0 (atol scales by the reference's rms)
    leaf = compare_arrays("grad args[0]", np.full(4, 1e-30, np.float32), np.zeros(4, np.float32))
    assert not leaf.ok and leaf.scale == 0.0
    assert leaf.reason == (
        "4 values over tolerance, worst at infx (max abs 1e-30; the reference is 0 wherever it "
        "is finite (a fill aside), so its limits are 0 and any nonzero entry fails)"
    )
    assert compare_arrays("grad args[0]", np.zeros(4, np.float32), np.zeros(4, np.float32)).ok


class _BiasDetached(torch.nn.Module):
    """A linear layer whose bias takes no gradient (added detached)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.linear.weight.T + self.linear.bias.detach()


def test_a_gradient_torch_does_not_compute_fails_saying_so() -> None:
    # The reason read '6 values over tolerance, worst at 1.6e+04x (max abs 2)' as if torch's
    # gradient differed from JAX's, where torch computed none (its output was detached)
    report = compare(lambda t: (t * 2).detach(), lambda a: a * 2, (sample(2, 3),))
    (entry,) = report.failures
    assert entry.path == "grad args[0]"
    assert entry.reason is not None and entry.reason.startswith("6 values over tolerance")
    assert entry.reason.endswith(
        "; torch gives no gradient here: no torch output that requires grad reaches it (a "
        ".detach(), torch.no_grad() or a path through integers), where JAX's is nonzero"
    )
    module = _BiasDetached()
    params = {k: jnp.asarray(v) for k, v in to_numpy_params(module).items()}
    report = compare(
        module,
        lambda p, a: a @ p["linear.weight"].T + p["linear.bias"],
        (sample(2, 4),),
        params=params,
    )
    (entry,) = report.failures
    assert entry.path == "grad params['linear.bias']" and entry.reason is not None
    assert entry.reason.endswith(
        "; torch gives no gradient to torch parameter 'linear.bias' behind it: no torch output "
        "that requires grad reaches it (a .detach(), torch.no_grad() or a path through "
        "integers), where JAX's is nonzero"
    )
    # a gradient torch computes and gets wrong says nothing of the kind
    report = compare(lambda t: t * 3, lambda a: a * 2, (sample(2, 3),))
    assert all("no gradient" not in (e.reason or "") for e in report.failures)


def test_a_leaf_nan_everywhere_on_both_sides_is_a_warning_that_fails_by_default() -> None:
    x = np.full((2, 3), np.nan, np.float32)
    report = compare(lambda t: t * 2, lambda a: a * 2, (x,), grads=False)
    leaf = report.entries[0]
    assert leaf.warning == "NaN everywhere on both sides: no value compared"
    assert not report.ok and report.warnings == (leaf,)
    assert str(report).startswith("parity FAILED: 1 of 1 leaves (worst: output: NaN everywhere")
    with pytest.raises(AssertionError, match="pass allow_nan=True to accept it"):
        assert_parity(lambda t: t * 2, lambda a: a * 2, (x,), grads=False)


def test_allow_nan_accepts_an_all_nan_leaf_and_still_reports_it() -> None:
    x = np.full((2, 3), np.nan, np.float32)
    report = assert_parity(lambda t: t * 2, lambda a: a * 2, (x,), grads=False, allow_nan=True)
    assert report.ok and report.warnings == report.entries
    assert "1 warning" in str(report).splitlines()[0]
    assert "ok, warning: NaN everywhere on both sides" in str(report)


# -- NaN and infinities --------------------------------------------------------------------------


def test_a_leaf_with_no_finite_value_is_a_warning_too() -> None:
    x = np.array([np.inf, -np.inf, np.nan], np.float32)
    leaf = compare_arrays("out", x, x)
    assert leaf.warning.startswith("no finite value on either side") and not leaf.ok
    assert compare_arrays("out", x, x, allow_nan=True).ok


def test_a_complex128_leaf_whose_magnitudes_overflow_float64_is_still_judged() -> None:
    # |1.7e308 + 1.7e308j| is inf in float64: the leaf's rms, and every limit it scales, were
    # inf, and a real part 40% off passed as OK (score 0, relative L2 0, cosine 1)
    expected = np.array([1.7e308 + 1.7e308j, 1.6e308 + 1.6e308j, 1 + 1j, 2j], np.complex128)
    wrong = expected.copy()
    wrong[0] = 1e308 + 1.7e308j
    leaf = compare_arrays("output", wrong, expected)
    assert not leaf.ok and leaf.mismatched == 1 and leaf.max_abs == pytest.approx(7e307)
    assert leaf.scale == pytest.approx(((2 * 1.7**2 + 2 * 1.6**2) / 4) ** 0.5 * 1e308)
    assert compare_arrays("output", expected, expected.copy()).ok


def test_float64_leaves_near_overflow_are_judged_at_their_scale() -> None:
    # Their RMS and L2 norm overflow float64: an entry wrong by a factor of 1e300 must still fail.
    # (Not one repeated value: a fill that dwarfs the rest would set no scale.)
    expected = np.array([1.7e308] * 3 + [1e308, 1.0])
    report = compare_arrays("grad", np.array([1.7e308] * 3 + [1e308, 1e300]), expected)
    rms = 1.7e308 * np.sqrt((3 + (1 / 1.7) ** 2) / 5)
    assert not report.ok and report.scale == pytest.approx(rms)
    assert compare_arrays("grad", expected, expected).ok
    # A difference that overflows (opposite signs) fails, with no NaN and no numpy warning.
    flipped = compare_arrays("grad", np.array([1.7e308] * 4), np.array([1.7e308] * 3 + [-1.7e308]))
    assert not flipped.ok and flipped.score == float("inf") and flipped.mismatched == 1
    assert not np.isnan([flipped.score, flipped.rel_l2, flipped.cosine]).any()


@pytest.mark.parametrize(
    "values",
    [np.array([None, 1]), np.array(["a", "b"]), np.array([1, 2], "M8[s]"), np.zeros(2, "V4")],
    ids=["object", "str", "datetime", "void"],
)
def test_leaves_of_no_numeric_dtype_fail_naming_it(values: np.ndarray) -> None:
    report = compare_arrays("output", values, values)
    assert not report.ok
    assert report.reason == f"{values.dtype.name} is not a numeric dtype: nothing to compare"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(3, dtype=torch.bfloat16, requires_grad=True),
        lambda: torch.ones(3, dtype=torch.complex64).conj(),
        lambda: torch.ones(3, requires_grad=True) * 1,
    ],
    ids=["bfloat16-requiring-grad", "conjugate-view", "non-leaf"],
)
def test_compare_arrays_reads_a_torch_tensor_as_compare_does(make: Any) -> None:
    # np.asarray of the tensor raised torch's RuntimeError/TypeError (requires grad, bfloat16,
    # a lazy conjugate); compare itself reads torch's leaves with to_numpy
    tensor = make()
    expected = dualgraph.parity._bridge.to_numpy(tensor)
    assert compare_arrays("output", tensor, expected).ok
    assert compare_arrays("output", expected, tensor).ok


def test_compare_arrays_refuses_a_meta_tensor_naming_the_leaf() -> None:
    with pytest.raises(dualgraph.DualgraphError, match="output: a meta tensor"):
        compare_arrays("output", torch.ones(2, device="meta"), np.ones(2, np.float32))


def _deleted_array() -> jax.Array:
    array = jnp.ones(2)
    array.delete()
    return array


@pytest.mark.parametrize(
    "make",
    [_deleted_array, lambda: jax.random.key(0), lambda: [[1.0], [1.0, 2.0]]],
    ids=["deleted", "prng_key", "ragged"],
)
def test_compare_arrays_refuses_what_numpy_cannot_read_naming_the_leaf(make: Any) -> None:
    # np.asarray's RuntimeError/TypeError/ValueError came out naming no leaf.
    with pytest.raises(dualgraph.DualgraphError, match=r"^output: \w+ cannot be read as a numpy"):
        compare_arrays("output", make(), np.ones(2, np.float32))


def test_compare_arrays_reads_either_byte_order_as_the_same_values() -> None:
    # '>f4' against '<f4' failed as 'float32[2] where JAX gives float32[2]', and the steps
    # between big-endian float16 values were counted on byte-swapped bits (one step read as
    # 256, and 4.0 against 5.0 as one)
    values = np.array([4.0, 5.0], np.float16)
    one_step = Tolerance(rtol=1.0, atol=1.0, max_rel_l2=1.0, min_cosine=0.0, max_ulps=1)
    swapped = values.astype(">f2")
    assert compare_arrays("out", swapped, values, tolerances=one_step).ok
    step = np.nextafter(values, np.float16(9))
    for reference in (step, step.astype(">f2")):
        apart = compare_arrays("out", swapped, reference, tolerances=one_step)
        assert apart.ok and apart.ulps == 1
    assert compare_arrays("out", np.ones(2, ">f4"), np.ones(2, "<f4")).ok


def test_a_zero_tensor_is_read_as_its_zeros() -> None:
    # torch._efficientzerotensor holds no memory of its values: .numpy() refused it (torch's
    # RuntimeError from an output or compare_arrays), and DLPack handed JAX whatever its
    # storage held for an input.
    zero = torch._efficientzerotensor(3)
    assert compare_arrays("output", zero, np.zeros(3, np.float32)).ok
    assert compare(lambda t: zero, lambda a: jnp.zeros(3), (sample(3),), grads=False).ok
    np.testing.assert_array_equal(np.asarray(as_jax(zero)), np.zeros(3, np.float32))
    assert compare(lambda t: t + 1, lambda a: a + 1, (zero,), grads=False).ok


def test_a_reference_of_zeros_is_matched_only_by_zeros() -> None:
    zeros = np.zeros(4, np.float32)
    assert compare_arrays("grad", zeros, zeros).ok
    assert not compare_arrays("grad", np.full(4, 1e-30, np.float32), zeros).ok


def masked_logits(fill: float, dtype: Any = np.float32) -> np.ndarray:
    """Causal attention logits whose masked entries hold ``fill`` (as masked_fill makes them)."""
    logits = np.random.default_rng(0).standard_normal((8, 8)) * 3
    return np.where(np.triu(np.ones((8, 8), bool), 1), fill, logits).astype(dtype)


@pytest.mark.parametrize("fill", [-1e9, float(np.finfo(np.float32).min)], ids=["1e9", "finfo"])
def test_a_fill_that_dwarfs_the_rest_sets_no_scale(fill: float) -> None:
    # The RMS of a leaf with a mask's fill is the fill's: 1e-4 of it let every other entry be
    # anything (logits 7x too large passed with max rel 7).
    reference = masked_logits(fill)
    wrong = reference.copy()
    kept = reference != fill
    wrong[kept] *= 7
    report = compare_arrays("output", wrong, reference)
    assert not report.ok and report.mismatched == 36 and report.scale < 10, report


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=str)
def test_a_masked_leaf_within_rounding_passes(dtype: Any) -> None:
    reference = masked_logits(-1e9, dtype)
    nudged = np.where(reference == -1e9, reference, np.nextafter(reference, np.inf))
    assert compare_arrays("output", nudged.astype(dtype), reference).ok


def test_nan_and_inf_at_the_same_positions_pass_and_are_counted() -> None:
    x = np.array([np.nan, 1.0, np.inf, -np.inf], np.float32)
    report = assert_parity(lambda t: t * 1, lambda a: a * 1, (x,), grads=False)
    assert report.entries[0].nonfinite == 3 and report.entries[0].warning is None


@pytest.mark.parametrize(
    "change",
    [
        lambda a: jnp.where(jnp.isnan(a), 0.0, a),  # NaN on the torch side only
        lambda a: jnp.where(a == 1.0, jnp.nan, a),  # NaN on the JAX side only
        lambda a: jnp.where(jnp.isinf(a), -a, a),  # infinities of the other sign
        lambda a: jnp.where(jnp.isinf(a), jnp.nan, a),  # NaN where torch has an infinity
    ],
    ids=["nan-vs-number", "number-vs-nan", "inf-sign", "inf-vs-nan"],
)
def test_nan_or_inf_positions_that_differ_fail(change: Any) -> None:
    x = np.array([np.nan, 1.0, np.inf, -np.inf, 2.0], np.float32)
    report = compare(lambda t: t * 1, change, (x,), grads=False)
    assert report.worst.score == float("inf") and not report.ok
    assert report.worst.mismatched >= 1


@pytest.mark.parametrize(
    ("torch_side", "jax_side"),
    [
        (complex(np.nan, 1), complex(1, np.nan)),  # NaN in the real part vs the imaginary part
        (complex(np.nan, 1), complex(np.nan, 7)),  # the same NaN part, the other part differs
        (complex(np.inf, np.nan), complex(np.nan, np.inf)),  # inf and NaN parts swapped
        (complex(np.inf, 1), complex(np.inf, -1)),  # the finite part's sign flipped
        (complex(np.inf, 1), complex(-np.inf, 1)),  # the infinite part's sign flipped
    ],
    ids=["nan-real-vs-imag", "nan-other-part", "inf-nan-swapped", "finite-part", "inf-sign"],
)
@pytest.mark.parametrize("allow_nan", [False, True])
def test_complex_entries_are_judged_part_by_part(
    torch_side: complex, jax_side: complex, allow_nan: bool
) -> None:
    # np.isnan of a complex is True for a NaN in either part: that alone hid these differences
    for dtype in (np.complex64, np.complex128):
        actual = np.array([torch_side, 2 + 3j], dtype)
        expected = np.array([jax_side, 2 + 3j], dtype)
        leaf = compare_arrays("out", actual, expected, allow_nan=allow_nan)
        assert not leaf.ok and leaf.score == float("inf") and leaf.mismatched == 1, leaf


@pytest.mark.parametrize("where", [(0, 1), (1, 2)], ids=["first_row", "past_the_first_axis"])
def test_a_half_non_finite_entry_of_a_complex_matrix_is_judged_where_it_is(
    where: tuple[int, int],
) -> None:
    # Its finite part differs: found by flat position, it was looked up along the first axis
    # (row 1 counted whole, three entries; a flat position past the rows raised IndexError).
    expected = np.ones((3, 3), np.complex64)
    actual = expected.copy()
    expected[where], actual[where] = complex(np.nan, 1), complex(np.nan, 5)
    leaf = compare_arrays("out", actual, expected)
    assert not leaf.ok and leaf.mismatched == 1 and leaf.score == float("inf"), leaf


def test_complex_entries_non_finite_alike_in_both_parts_pass_and_are_counted() -> None:
    x = np.array([complex(np.nan, 1), complex(np.inf, -2), complex(np.nan, np.inf), 2 + 3j])
    leaf = compare_arrays("out", x, x.copy())
    assert leaf.ok and leaf.nonfinite == 3 and leaf.mismatched == 0


# -- integers, bools, dtypes: exact, never coerced -------------------------------------------------


def test_int64_values_that_float64_cannot_tell_apart_fail() -> None:
    # 2**60 and 2**60 + 1 are the same float64; JAX runs in 64-bit mode for the int64 input.
    ids = np.array([2**60, 7], np.int64)
    report = compare(lambda t: t + torch.tensor([1, 0]), lambda a: a, (ids,), grads=False)
    leaf = report.entries[0]
    assert (leaf.dtype, leaf.mismatched, leaf.max_abs, leaf.ok) == ("int64", 1, 1.0, False)
    assert not jax.config.jax_enable_x64  # the mode is restored


def test_equal_int64_values_beyond_int32_pass_exactly() -> None:
    ids = np.array([2**40 + 3, -(2**62)], np.int64)
    report = assert_parity(lambda t: t * 2, lambda a: a * 2, (ids,), grads=False)
    assert report.entries[0].dtype == "int64" and report.entries[0].score == 0


def test_the_largest_int64_difference_is_exact_without_overflow() -> None:
    low, high = np.array([np.iinfo(np.int64).min]), np.array([np.iinfo(np.int64).max])
    leaf = compare_arrays("ids", low, high)
    assert leaf.max_abs == 2**64 - 1 and "18446744073709551615" in leaf.reason


def test_uint64_values_beyond_int64_compare_exactly() -> None:
    top = np.array([2**64 - 1], np.uint64)
    assert compare_arrays("ids", top, top).ok
    leaf = compare_arrays("ids", top - np.uint64(1), top)
    assert not leaf.ok and leaf.max_abs == 1


def test_bools_compare_exactly() -> None:
    x = np.array([-1.0, 0.25, 1.0], np.float32)
    assert assert_parity(lambda t: t > 0, lambda a: a > 0, (x,), grads=False).ok
    report = compare(lambda t: t > 0, lambda a: a >= 0.5, (x,), grads=False)
    assert not report.ok and report.entries[0].dtype == "bool"


def test_int32_overflow_wraps_alike_on_both_sides() -> None:
    top = np.array([np.iinfo(np.int32).max, 0], np.int32)
    report = assert_parity(lambda t: t + 1, lambda a: a + 1, (top,), grads=False)
    assert report.entries[0].dtype == "int32"


@pytest.mark.parametrize(
    ("torch_fn", "jax_fn", "message"),
    [
        (lambda t: (t > 0).to(torch.uint8), lambda a: (a > 0).astype(jnp.int8), "int8"),
        (lambda t: t > 0, lambda a: (a > 0).astype(jnp.int32), "int32"),
        (lambda t: t.to(torch.float16), lambda a: a.astype(jnp.bfloat16), "bfloat16"),
        (lambda t: t[:, None], lambda a: a, r"float32\[2, 3\], got float32\[2, 1, 3\]"),
    ],
    ids=["uint-vs-int", "bool-vs-int", "float16-vs-bfloat16", "shape"],
)
def test_outputs_of_another_dtype_or_shape_are_reported_not_coerced(
    torch_fn: Any, jax_fn: Any, message: str
) -> None:
    with pytest.raises(
        SpecMismatchError, match=rf"^the torch and JAX outputs .*output: .*{message}"
    ):
        compare(torch_fn, jax_fn, (sample(2, 3),), grads=False)


@pytest.mark.parametrize(
    ("actual", "expected", "problem"),
    [
        (np.ones(3, np.float64), np.ones(3, np.float32), "float64[3] where JAX gives float32[3]"),
        (np.ones(3, np.uint32), np.ones(3, np.int32), "uint32[3] where JAX gives int32[3]"),
        (np.ones(3, np.bool_), np.ones(3, np.int8), "bool[3] where JAX gives int8[3]"),
        (np.ones((1, 3), np.float32), np.ones(3, np.float32), "float32[1, 3] where"),
    ],
)
def test_leaves_of_another_dtype_or_shape_fail_naming_both(
    actual: np.ndarray, expected: np.ndarray, problem: str
) -> None:
    leaf = compare_arrays("grad args[0]", actual, expected)
    assert not leaf.ok and problem in leaf.reason


def test_tf32_is_off_during_the_comparison_and_restored_after() -> None:
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    seen = []

    def torch_fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(matmul.fp32_precision)
        return t @ t

    assert_parity(torch_fn, lambda a: a @ a, (sample(4, 4),))
    assert seen == ["ieee"] and matmul.fp32_precision == before


def test_onednn_bfloat16_float32_is_off_during_the_comparison_and_restored_after() -> None:
    # torch.set_float32_matmul_precision("medium") lets oneDNN compute float32 matmuls in
    # bfloat16 on CPUs that have it (about 0.2 off on a 256 x 256 product where IEEE float32 is
    # 4e-5 off): only cuBLAS and cuDNN were set to "ieee", so the torch side was not at the
    # full precision compare promises, and equal float32 math failed.
    backends = torch.backends
    knobs = [backends, backends.cuda.matmul, backends.mkldnn.matmul, backends.mkldnn.conv]
    saved = [knob.fp32_precision for knob in knobs]
    seen = []

    def torch_fn(t: torch.Tensor) -> torch.Tensor:
        mkldnn = backends.mkldnn
        seen.append((mkldnn.matmul.fp32_precision, mkldnn.conv.fp32_precision))
        return t @ t

    # kept_settings puts back the legacy setting and the newer API's knobs: a legacy "medium"
    # left behind came back later as TF32 cuBLAS matmuls, refusing other files' calls
    legacy = torch.get_float32_matmul_precision()
    put_back = kept_settings()
    try:
        torch.set_float32_matmul_precision("medium")
        before = backends.mkldnn.matmul.fp32_precision
        assert_parity(torch_fn, lambda a: a @ a, (sample(4, 4),))
        assert seen == [("ieee", "ieee")]
        assert backends.mkldnn.matmul.fp32_precision == before == "bf16"
    finally:
        put_back()
        for knob, value in zip(knobs, saved, strict=True):
            knob.fp32_precision = value
    assert torch.get_float32_matmul_precision() == legacy


def test_reduced_precision_reductions_are_left_as_the_caller_set_them() -> None:
    # A graphed torch_fn refuses calls under other settings than its capture's (torch's default,
    # on): compare turning them off failed every graphed ViT block comparison.
    matmul = torch.backends.cuda.matmul
    names = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
    before = [getattr(matmul, name) for name in names]
    seen = []

    def torch_fn(t: torch.Tensor) -> torch.Tensor:
        seen.append([getattr(matmul, name) for name in names])
        return t @ t

    assert_parity(torch_fn, lambda a: a @ a, (sample(4, 4),))
    assert seen == [before]


def bfloat16_product(a: jax.Array) -> jax.Array:
    """What ``t @ t.T`` gives under a bfloat16 autocast: rounded inputs, a bfloat16 result."""
    low = a.astype(jnp.bfloat16)
    return (low @ low.T).astype(jnp.float32)


def test_compare_inside_an_autocast_is_refused_naming_it() -> None:
    # torch_fn computes in float32 as written; under the caller's autocast it ran in bfloat16
    # and passed against a bfloat16 reference.
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(
            dualgraph.DualgraphError,
            match=r"^compare: called inside torch.autocast\('cpu', dtype=torch.bfloat16\)",
        ),
    ):
        compare(lambda t: (t @ t.T).float(), bfloat16_product, (sample(8, 8),))


class RoundingMatmuls(torch.overrides.TorchFunctionMode):
    """A numerics emulator: every matmul's result rounded to bfloat16."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.matmul, torch.Tensor.__matmul__):
            return out.bfloat16().float()
        return out


def test_compare_inside_a_torch_function_mode_is_refused_naming_it() -> None:
    with (
        RoundingMatmuls(),
        pytest.raises(dualgraph.DualgraphError, match=r"inside the torch mode .*RoundingMatmuls"),
    ):
        compare(lambda t: t @ t.T, bfloat16_product, (sample(8, 8),), grads=False)


def test_compare_under_a_default_device_context_is_accepted() -> None:
    with torch.device("cpu"):
        assert_parity(lambda t: t + torch.ones(3), lambda a: a + jnp.ones(3), (sample(3),))


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64], ids=str)
def test_a_torch_default_dtype_other_than_jaxs_is_refused_naming_it(default: torch.dtype) -> None:
    # torch.arange(3.0) in torch's default dtype: bfloat16 or float64 steps beside JAX's float32
    name = str(default).removeprefix("torch.")
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
        with pytest.raises(dualgraph.DualgraphError, match=f"torch's default dtype is {name}"):
            compare(
                lambda t: t * torch.linspace(0, 1, 3).float(),
                lambda a: a * jnp.linspace(0, 1, 3),
                (sample(3),),
            )
    finally:
        torch.set_default_dtype(saved)


def test_a_float64_default_dtype_is_accepted_where_jax_runs_in_64_bits() -> None:
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert_parity(
            lambda t: t * torch.linspace(0, 1, 3),
            lambda a: a * jnp.linspace(0, 1, 3),
            (sample(3, dtype=np.float64),),
        )
    finally:
        torch.set_default_dtype(saved)


# -- float64 ---------------------------------------------------------------------------------------


def test_float64_runs_the_jax_reference_in_64_bit_and_restores_the_mode() -> None:
    x = np.linspace(0.1, 1.0, 5)  # float64
    report = assert_parity(torch.sin, jnp.sin, (x,))
    assert [entry.dtype for entry in report.entries] == ["float64", "float64"]
    assert report.worst.max_abs < 1e-12  # a float32 reference would be about 1e-8 off
    assert not jax.config.jax_enable_x64


def test_float64_is_held_to_float64_tolerance() -> None:
    x = np.linspace(0.1, 1.0, 5)
    report = compare(lambda t: t * (1 + 1e-6), lambda a: a, (x,), grads=False)
    assert not report.ok  # within float32's tolerance, not float64's


# -- parameters ------------------------------------------------------------------------------------


def linear_jax(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ params["weight"].T + params["bias"]


def jax_params_of(module: torch.nn.Module) -> dict[str, jax.Array]:
    return {name: jnp.asarray(p.detach().numpy()) for name, p in module.named_parameters()}


def test_parameter_grads_are_aligned_by_torch_name() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    report = assert_parity(linear, linear_jax, (sample(2, 4),), params=jax_params_of(linear))
    paths = [entry.path for entry in report.entries]
    assert paths == ["output", "grad args[0]", "grad params['bias']", "grad params['weight']"]


@pytest.mark.parametrize("scale, passes", [(1.0, True), (2.0, False)])
def test_sparse_parameter_grads_are_compared_by_their_dense_values(
    scale: float, passes: bool
) -> None:
    # An nn.Embedding(sparse=True) gives a sparse .grad: torch's TypeError from .numpy() escaped
    embedding = torch.nn.Embedding(5, 3, sparse=True)
    ids = np.array([0, 2, 2], np.int32)
    report = compare(
        lambda i: embedding(i.long()),
        lambda p, i: p["weight"][i] * scale,
        (ids,),
        params=jax_params_of(embedding),
        torch_params=dict(embedding.named_parameters()),
    )
    assert report.ok is passes
    assert [entry.path for entry in report.entries] == ["output", "grad params['weight']"]


def test_a_wrong_parameter_mapping_fails_on_that_parameter() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)

    def swapped(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**grads, "weight": grads["weight"].T}

    # The JAX params are the torch ones mapped by the right mapping, so the wrong one gives
    # other values: refused before either side runs, naming the parameter.
    with pytest.raises(dualgraph.DualgraphError, match=r"^params\['weight'\]: the JAX params hold"):
        compare(
            linear,
            linear_jax,
            (sample(2, 3),),
            params=jax_params_of(linear),
            params_from_torch=swapped,
        )


def test_jax_params_from_an_older_torch_state_are_refused_naming_the_parameter() -> None:
    # Only the structure was checked: a stale params tree failed as an output difference, as
    # if the two functions differed.
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    stale = jax_params_of(linear)
    with torch.no_grad():
        linear.weight[1, 2] += 0.5  # a training step since the JAX params were made
    with pytest.raises(
        dualgraph.DualgraphError,
        match=r"^params\['weight'\]: the JAX params hold other values than the torch parameters "
        r"mapped by params_from_torch \(first at \[1, 2\]: ",
    ):
        compare(linear, linear_jax, (sample(2, 4),), params=stale)
    assert_parity(linear, linear_jax, (sample(2, 4),), params=jax_params_of(linear))


def test_a_deleted_jax_params_leaf_is_refused_naming_it() -> None:
    linear = torch.nn.Linear(4, 3)
    params = jax_params_of(linear)
    params["weight"].delete()  # e.g. donated to an earlier call
    with pytest.raises(dualgraph.DualgraphError, match=r"^params\['weight'\]: this array has been"):
        compare(linear, linear_jax, (sample(2, 4),), params=params)


def test_a_mapping_writing_into_the_arrays_it_is_given_leaves_the_torch_parameters_alone() -> None:
    # The check of params against the torch parameters mapped handed params_from_torch numpy
    # views of the live parameters: a mapping that zeroes a row in place (a padding token's
    # embedding) zeroed it in the torch module, which compare then ran, and left it so.
    linear = torch.nn.Linear(4, 3)
    kept = linear.weight.detach().clone()

    def padding_row_zeroed(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        d["weight"][0] = 0.0
        return d

    params = padding_row_zeroed({k: v.copy() for k, v in to_numpy_params(linear).items()})
    params = {k: jnp.asarray(v) for k, v in params.items()}
    compare(
        linear,
        linear_jax,
        (inputs_2x4(),),
        grads=False,
        params=params,
        params_from_torch=padding_row_zeroed,
    )
    assert torch.equal(linear.weight.detach(), kept)


def test_float64_parameters_are_mapped_in_64_bit_mode_by_a_mapping_making_jax_arrays() -> None:
    # The check of params ran params_from_torch with the mode off: a mapping making JAX arrays
    # (as models.jax_vit's does) narrowed the float64 parameters to float32 (or refused them),
    # so a float64 comparison was refused though the mapping runs in 64 bits for the grads.
    linear = torch.nn.Linear(4, 3).double()

    def as_jax_arrays(d: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {name: jnp.asarray(value) for name, value in d.items()}

    with dgj.enable_x64():
        params = as_jax_arrays(to_numpy_params(linear))
    report = assert_parity(
        linear,
        linear_jax,
        (inputs_2x4().astype(np.float64),),
        params=params,
        params_from_torch=as_jax_arrays,
    )
    assert "grad params['weight']" in [entry.path for entry in report.entries]


def test_jax_params_are_compared_with_the_torch_ones_in_the_dtype_the_mapping_gives() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)

    def in_bfloat16(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: a.astype(ml_dtypes.bfloat16) for name, a in named.items()}

    params = {name: jnp.asarray(a) for name, a in in_bfloat16(jax_params_of(linear)).items()}
    report = compare(
        linear,
        lambda p, x: linear_jax({n: a.astype(jnp.float32) for n, a in p.items()}, x),
        (sample(2, 4),),
        params=params,
        params_from_torch=in_bfloat16,
        grads=False,
    )
    assert [entry.path for entry in report.entries] == ["output"]


def test_a_mapping_that_gives_another_tree_is_reported_by_path() -> None:
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(SpecMismatchError, match=r"params\['weight'\]: expected float32\[3, 4\]"):
        compare(
            linear,
            linear_jax,
            (sample(2, 4),),
            params=jax_params_of(linear),
            params_from_torch=lambda g: {**g, "weight": g["weight"].T},
        )


@pytest.mark.parametrize("grads", [True, False])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda p: {**p, "weight": jnp.ones((3, 5))},
            r"params\['weight'\]: expected float32\[3, 5\]",
        ),
        (
            lambda p: {**p, "bias": jnp.ones(3, jnp.bfloat16)},
            r"params\['bias'\]: expected bfloat16",
        ),
        (lambda p: {**p, "bias": None}, r"params\['bias'\]: expected None"),
        (lambda p: {"weight": p["weight"]}, r"params\['bias'\]"),
        (lambda p: {**p, "scale": jnp.ones(1)}, r"params\['scale'\]: missing"),
    ],
)
def test_params_that_are_not_the_torch_ones_are_refused_by_path_before_anything_runs(
    change: Any, message: str, grads: bool
) -> None:
    linear = torch.nn.Linear(4, 3)
    linear.weight.grad = torch.full((3, 4), 7.0)
    ran: list[str] = []

    def torch_side(x: torch.Tensor) -> torch.Tensor:
        ran.append("torch")
        return linear(x)

    def jax_side(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        ran.append("jax")
        return linear_jax(params, x)

    with pytest.raises(SpecMismatchError, match=message):
        compare(
            torch_side,
            jax_side,
            (sample(2, 4),),
            params=change(jax_params_of(linear)),
            torch_params=dict(linear.named_parameters()),
            grads=grads,
        )
    assert ran == []
    assert torch.equal(linear.weight.grad, torch.full((3, 4), 7.0))
    assert linear.bias.grad is None


def test_a_params_leaf_the_jax_side_refuses_is_named_by_its_params_path() -> None:
    # The JAX side is called as jax_fn(params, x): its refusal named args[0]['weight'], a path
    # of that call, not of compare's (where args[0] is x).
    linear = torch.nn.Linear(4, 3)
    params = {**jax_params_of(linear), "weight": linear.weight.detach()}
    with pytest.raises(dualgraph.DualgraphError) as caught:
        compare(linear, linear_jax, (sample(2, 4),), params=params)
    assert "params['weight'] is a torch.Tensor" in str(caught.value)
    assert "args[0]" not in str(caught.value)


@pytest.mark.parametrize("grads", [True, False])
def test_an_input_a_graphed_reference_refuses_is_named_by_compares_path(grads: bool) -> None:
    linear = torch.nn.Linear(4, 3)
    params = jax_params_of(linear)
    reference = dgj.graphed(linear_jax, (params, jnp.zeros((2, 4))))
    with pytest.raises(SpecMismatchError) as caught:
        compare(linear, reference, (sample(5, 4),), params=params, grads=grads)
    assert caught.value.path == "args[0]"
    assert "args[0]: expected float32[2, 4], got float32[5, 4]" in str(caught.value)


@pytest.mark.parametrize("grads", [True, False])
def test_a_comparison_under_inference_mode_runs_as_outside_it(grads: bool) -> None:
    # Under the caller's torch.inference_mode() the inputs had no version counter (torch's
    # RuntimeError, naming nothing) and nothing was recorded for the gradients.
    linear = torch.nn.Linear(4, 3)
    x = sample(2, 4)
    with torch.inference_mode():
        report = compare(linear, linear_jax, (x,), params=jax_params_of(linear), grads=grads)
    expected = compare(linear, linear_jax, (x,), params=jax_params_of(linear), grads=grads)
    assert report.ok and report.entries == expected.entries


def test_an_inference_tensor_input_is_compared_as_an_ordinary_one() -> None:
    with torch.inference_mode():
        x = torch.linspace(-1, 1, 8).reshape(2, 4)
    report = compare(lambda t: torch.tanh(t), jnp.tanh, (x,))
    assert report.ok and [entry.path for entry in report.entries] == ["output", "grad args[0]"]


def test_parameters_made_under_inference_mode_are_refused_when_grads_are_compared() -> None:
    with torch.inference_mode():
        linear = torch.nn.Linear(4, 3)
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in linear.named_parameters()}
    with pytest.raises(dualgraph.DualgraphError, match=r"^torch parameter 'weight' is an infer"):
        compare(linear, linear_jax, (sample(2, 4),), params=params)
    assert compare(linear, linear_jax, (sample(2, 4),), params=params, grads=False).ok


def test_the_parameters_previous_grads_are_left_as_they_were() -> None:
    linear = torch.nn.Linear(4, 3)
    linear.weight.grad = torch.full((3, 4), 7.0)
    assert_parity(linear, linear_jax, (sample(2, 4),), params=jax_params_of(linear))
    assert linear.bias.grad is None
    torch.testing.assert_close(linear.weight.grad, torch.full((3, 4), 7.0))


def test_frozen_parameters_are_not_compared() -> None:
    linear = torch.nn.Linear(4, 3)
    linear.bias.requires_grad_(False)
    report = assert_parity(linear, linear_jax, (sample(2, 4),), params=jax_params_of(linear))
    assert "grad params['bias']" not in [entry.path for entry in report.entries]
    assert "grad params['weight']" in [entry.path for entry in report.entries]


def inputs_2x4() -> np.ndarray:
    """Inputs drawn apart from the module's generator, which later tests depend on."""
    return np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


def weight_closed_over(linear: torch.nn.Linear) -> Any:
    """A JAX linear layer that closes over its weight: no gradient reaches params['weight']."""
    weight = jnp.asarray(linear.weight.detach().numpy())
    return lambda params, x: x @ weight.T + params["bias"] * 1.0


def test_a_state_dict_as_torch_params_is_refused_naming_the_detached_parameter() -> None:
    # state_dict() gives detached tensors: each read as frozen, no parameter grad was compared,
    # and a reference that closes over its weight passed.
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(
        dualgraph.DualgraphError,
        match=r"torch_params\['weight'\] holds the memory of torch_fn's trained parameter 'weight'",
    ):
        compare(
            linear,
            weight_closed_over(linear),
            (inputs_2x4(),),
            params=jax_params_of(linear),
            torch_params=linear.state_dict(),
        )


@pytest.mark.parametrize("part", ["no_grad_view", "detached_view", "data_view"])
def test_torch_params_holding_part_of_a_trained_parameter_are_refused_naming_it(part: str) -> None:
    # Rows of a weight given as torch_params (a view under no_grad, or of its detached values):
    # torch fills the weight's .grad, never the view's, so each read as zero (or as frozen),
    # and a JAX reference closing over the weight passed.
    linear = torch.nn.Linear(4, 6)
    weight = linear.weight
    rows = {
        "no_grad_view": lambda: (weight[:3], weight[3:]),
        "detached_view": lambda: (weight.detach()[:3], weight.detach()[3:]),
        "data_view": lambda: (weight.data[:3], weight.data[3:]),
    }[part]
    with torch.no_grad():
        top, bottom = rows()
    values = weight.detach().numpy().copy()
    params = {
        "top": jnp.asarray(values[:3]),
        "bottom": jnp.asarray(values[3:]),
        "bias": jnp.asarray(linear.bias.detach().numpy()),
    }
    closed = jnp.asarray(values)
    with pytest.raises(
        dualgraph.DualgraphError,
        match=r"torch_params\['top'\] holds memory of torch_fn's trained parameter 'weight'",
    ):
        compare(
            linear,
            lambda p, x: x @ closed.T + p["bias"] + 0.0 * (p["top"].sum() + p["bottom"].sum()),
            (inputs_2x4(),),
            params=params,
            torch_params={"top": top, "bottom": bottom, "bias": linear.bias},
        )


def test_torch_params_of_detached_copies_only_are_refused_for_a_plain_function() -> None:
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(dualgraph.DualgraphError, match="no tensor requires grad"):
        compare(
            lambda x: linear(x),
            weight_closed_over(linear),
            (inputs_2x4(),),
            params=jax_params_of(linear),
            torch_params=linear.state_dict(),
        )


class _Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_computed_tensor_as_torch_params_is_refused_naming_it() -> None:
    # A parametrization's module.weight is computed on each access: torch never fills its
    # .grad, which read as zero; a reference closing over the weight (zero grad for params)
    # passed whatever torch's backward gave the parameter behind it.
    linear = torch.nn.Linear(3, 2, bias=False)
    torch.nn.utils.parametrize.register_parametrization(linear, "weight", _Doubled())
    weight = jnp.asarray(linear.weight.detach().numpy())

    def closing_over_the_weight(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ weight.T + 0 * params["weight"].sum()

    x = sample(1, 3)
    computed = {"weight": linear.weight}
    with pytest.raises(dualgraph.DualgraphError, match=r"^torch_params\['weight'\] is computed"):
        compare(
            linear, closing_over_the_weight, (x,), params={"weight": weight}, torch_params=computed
        )
    assert compare(
        linear,
        linear_jax_no_bias,
        (x,),
        params={"weight": weight},
        torch_params=computed,
        grads=False,
    ).ok


def linear_jax_no_bias(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ params["weight"].T


def test_torch_params_of_frozen_parameters_or_without_grads_are_accepted() -> None:
    linear = torch.nn.Linear(4, 3)
    args = (inputs_2x4(),)
    report = assert_parity(
        linear,
        linear_jax,
        args,
        params=jax_params_of(linear),
        torch_params=linear.state_dict(),
        grads=False,
    )
    assert [entry.path for entry in report.entries] == ["output"]
    linear.requires_grad_(False)
    report = assert_parity(
        lambda x: linear(x),
        linear_jax,
        args,
        params=jax_params_of(linear),
        torch_params=dict(linear.named_parameters()),
    )
    assert report.ok and [entry.path for entry in report.entries] == ["output", "grad args[0]"]


def test_a_trained_parameter_the_mapping_drops_is_refused_naming_it() -> None:
    # Its grad was never compared: a JAX reference closing over the bias passed.
    linear = torch.nn.Linear(4, 3)
    bias = jnp.asarray(linear.bias.detach().numpy())

    def weight_only(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"weight": d["weight"]}

    params = {"weight": jnp.asarray(linear.weight.detach().numpy())}
    with pytest.raises(dualgraph.DualgraphError, match=r"torch parameter 'bias' has a gradient"):
        compare(
            linear,
            lambda p, x: x @ p["weight"].T + bias,
            (inputs_2x4(),),
            params=params,
            params_from_torch=weight_only,
        )


class _ComplexScale(torch.nn.Module):
    """A complex parameter whose real part scales and whose imaginary part shifts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.complex(torch.linspace(0.5, 1.5, 3), torch.zeros(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w.real + self.w.imag


@pytest.mark.parametrize("kept", ["real", "imag"])
def test_a_part_of_a_trained_complex_parameter_the_mapping_drops_is_refused(kept: str) -> None:
    # The mapping kept the real part only (JAX params as S5 stores them, without Lambda_im):
    # torch's gradient of the imaginary part was never compared, and a JAX reference lacking
    # the shift (w.imag is 0 here) passed 'parity OK'
    module = _ComplexScale()

    def one_part(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w_" + kept: getattr(d["w"], kept)}

    def reference(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x * p["w_real"] if kept == "real" else x + p["w_imag"]

    params = {k: jnp.asarray(v) for k, v in one_part(to_numpy_params(module)).items()}
    dropped = "imaginary" if kept == "real" else "real"
    message = rf"torch parameter 'w' \(its {dropped} part\) has a gradient, but .* no leaf"
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare(module, reference, (sample(2, 3),), params=params, params_from_torch=one_part)


@pytest.mark.parametrize("kept", ["real", "imag"])
def test_a_part_the_mapping_drops_after_complex_arithmetic_is_refused(kept: str) -> None:
    # (-1 * w) multiplies by -1 + 0j, and NaN * 0 is NaN: a NaN in one part spread into both,
    # so the dropped part looked mapped, its gradient was never compared, and a JAX reference
    # lacking the shift passed 'parity OK'
    module = _ComplexScale()

    def negated_part(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w_" + kept: getattr(-1 * d["w"], kept)}

    def reference(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return -x * p["w_real"] if kept == "real" else x - p["w_imag"]

    params = {k: jnp.asarray(v) for k, v in negated_part(to_numpy_params(module)).items()}
    dropped = "imaginary" if kept == "real" else "real"
    message = rf"torch parameter 'w' \(its {dropped} part\) has a gradient, but .* no leaf"
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare(module, reference, (sample(2, 3),), params=params, params_from_torch=negated_part)


def test_complex_parameters_split_after_complex_arithmetic_pass() -> None:
    # The NaN of one part, spread into both by (-1 * w), counted as two uses of it: refused as
    # a tied weight
    module = _ComplexScale()

    def negated_parts(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        negated = -1 * d["w"]
        return {"w_re": negated.real, "w_im": negated.imag}

    params = {k: jnp.asarray(v) for k, v in negated_parts(to_numpy_params(module)).items()}
    report = assert_parity(
        module,
        lambda p, x: -x * p["w_re"] - p["w_im"],
        (sample(2, 3),),
        params=params,
        params_from_torch=negated_parts,
    )
    assert [e.path for e in report.entries][-2:] == ["grad params['w_im']", "grad params['w_re']"]


@pytest.mark.parametrize("how", ["offsets", "scales or combines"])
def test_a_mapping_that_changes_the_imaginary_part_of_a_complex_parameter_is_refused(
    how: str,
) -> None:
    # Probed with real values only, w.imag + 1 (or 2 * w.imag) looked constant and passed the
    # check; torch's gradient was then mapped as Im(g) + 1 (2 Im(g)) and failed as if the
    # functions differed
    module = _ComplexScale()
    offset = how == "offsets"

    def parts(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        imag = d["w"].imag
        return {"w_re": d["w"].real, "w_im": imag + 1 if offset else 2 * imag}

    def reference(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x * p["w_re"] + (p["w_im"] - 1 if offset else p["w_im"] / 2)

    params = {k: jnp.asarray(v) for k, v in parts(to_numpy_params(module)).items()}
    message = (
        rf"^params\['w_im'\]: params_from_torch {how} the trained torch parameters there "
        r"\(at \[0\]: trained parameters of 1j map to "
    )
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare(module, reference, (sample(2, 3),), params=params, params_from_torch=parts)


def test_complex_parameters_mapped_part_by_part_pass() -> None:
    module = _ComplexScale()

    def parts(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w_re": d["w"].real, "w_im": d["w"].imag}

    params = {k: jnp.asarray(v) for k, v in parts(to_numpy_params(module)).items()}
    report = assert_parity(
        module,
        lambda p, x: x * p["w_re"] + p["w_im"],
        (sample(2, 3),),
        params=params,
        params_from_torch=parts,
    )
    assert [e.path for e in report.entries][-2:] == ["grad params['w_im']", "grad params['w_re']"]
    module.w.requires_grad_(False)  # frozen: both parts left out, neither compared as zeros
    report = assert_parity(
        module,
        lambda p, x: x * p["w_re"] + p["w_im"],
        (sample(2, 3),),
        params=params,
        params_from_torch=parts,
    )
    assert report.left_out == tuple(
        f"grad params['{leaf}'] (no trained torch parameter behind it)" for leaf in ("w_im", "w_re")
    )


def test_a_parameter_torch_fn_leaves_unused_may_be_left_out_of_the_mapping() -> None:
    linear = torch.nn.Linear(4, 3)
    linear.unused = torch.nn.Parameter(torch.ones(5))

    def linear_only(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"weight": d["weight"], "bias": d["bias"]}

    params = {k: jnp.asarray(v) for k, v in linear_only(to_numpy_params(linear)).items()}
    report = assert_parity(
        linear, linear_jax, (inputs_2x4(),), params=params, params_from_torch=linear_only
    )
    assert "grad params['weight']" in [entry.path for entry in report.entries]


def test_a_trained_parameter_whose_mapping_subtracts_one_is_refused_not_left_out() -> None:
    # With a frozen parameter beside it, a 0/1 mask mapped through `w - 1` became 0: the trained
    # weight's grad was silently left out, and a JAX reference with no grad for it passed. Such
    # a mapping cannot map gradients (g - 1 is not the gradient of w - 1), so it is refused.
    linear = torch.nn.Linear(4, 3)
    linear.bias.requires_grad_(False)

    def offset(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"weight_minus_one": d["weight"] - 1, "bias": d["bias"]}

    def no_weight_grad(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        weight = jax.lax.stop_gradient(params["weight_minus_one"] + 1)
        return x @ weight.T + params["bias"]

    params = {k: jnp.asarray(v) for k, v in offset(to_numpy_params(linear)).items()}
    with pytest.raises(
        dualgraph.DualgraphError, match=r"^params\['weight_minus_one'\]: params_from_torch offsets"
    ):
        compare(linear, no_weight_grad, (sample(2, 4),), params=params, params_from_torch=offset)


# JAX params stored otherwise than torch's, and JAX functions that undo it: the same function.
STORED_OTHERWISE = {
    "offset": (lambda w: w - 1, lambda p: p + 1, "offsets"),
    "scale": (lambda w: w * 2, lambda p: p / 2, "scales or combines"),
    "exp": (lambda w: np.exp(w), lambda p: jnp.log(p), "scales or combines"),
}


@pytest.mark.parametrize("stored", list(STORED_OTHERWISE))
def test_a_mapping_gradients_cannot_go_through_is_refused_naming_the_leaf(stored: str) -> None:
    # compare maps torch's gradients with params_from_torch: for JAX holding 2 * w, w - 1 or
    # exp(w) that gave 2g, g - 1 or exp(g) where JAX's gradient is g / 2, g or g / exp(w), and
    # the same function failed at grad params['w'] as if torch and JAX differed.
    store, undo, how = STORED_OTHERWISE[stored]
    linear = torch.nn.Linear(4, 3)

    def mapping(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": store(d["weight"]), "b": d["bias"]}

    def layer(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ undo(params["w"]).T + params["b"]

    params = {k: jnp.asarray(v) for k, v in mapping(to_numpy_params(linear)).items()}
    with pytest.raises(
        dualgraph.DualgraphError, match=rf"^params\['w'\]: params_from_torch {how} the trained"
    ):
        compare(linear, layer, (sample(2, 4),), params=params, params_from_torch=mapping)


class TiedProjection(torch.nn.Module):
    """``(x @ w) @ w.T``: one weight used twice, as a tied embedding and output head are."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) @ self.w.T


class ScaledProjection(torch.nn.Module):
    """``(x @ w) * s``, ``s`` one scalar for every column."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.s = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) * self.s


# A tied weight given JAX as two leaves, and a scalar broadcast into a leaf: JAX's gradient is
# one per place, torch's the sum over the places.
REPEATED = {
    "tied-as-two-leaves": (
        TiedProjection,
        lambda d: {"w_in": d["w"], "w_out": d["w"]},
        lambda p, x: (x @ p["w_in"]) @ p["w_out"].T,
        r"'w': params_from_torch puts its 16 entries into 32 entries of the JAX params "
        r"\(params\['w_in'\] \(16\), params\['w_out'\] \(16\)\)",
    ),
    "broadcast": (
        ScaledProjection,
        lambda d: {"w": d["w"], "s": np.broadcast_to(d["s"], (4,)).copy()},
        lambda p, x: (x @ p["w"]) * p["s"],
        r"'s': params_from_torch puts its 1 entries into 4 entries of the JAX params "
        r"\(params\['s'\] \(4\)\)",
    ),
}


@pytest.mark.parametrize("repeated", list(REPEATED))
def test_a_mapping_that_puts_a_trained_entry_in_two_places_is_refused_naming_it(
    repeated: str,
) -> None:
    # Equal functions failed at grad params['w_in'] and ['w_out'] (16 values over tolerance):
    # torch's mapped gradient was the sum over both uses, JAX's one per leaf
    make, mapping, reference, message = REPEATED[repeated]
    module = make()
    params = {k: jnp.asarray(v) for k, v in mapping(to_numpy_params(module)).items()}
    with pytest.raises(dualgraph.DualgraphError, match=rf"^torch parameter {message}"):
        compare(module, reference, (sample(2, 4),), params=params, params_from_torch=mapping)


def test_torch_params_holding_a_tied_weight_under_two_names_are_refused_naming_both() -> None:
    # named_parameters(remove_duplicate=False) lists a tied weight twice: its one .grad (the sum
    # over both uses) was read for each name, and equal functions failed at grad params['w_in']
    # and ['w_out'], where JAX gives each leaf its own part
    module = TiedProjection()
    torch_params = dict(module.named_parameters(prefix="in"))
    torch_params.update(module.named_parameters(prefix="out"))

    def mapping(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w_in": d["in.w"], "w_out": d["out.w"]}

    weight = jnp.asarray(module.w.detach().numpy())
    params = {"w_in": weight, "w_out": weight}
    with pytest.raises(
        dualgraph.DualgraphError,
        match=r"^torch_params\['in.w'\] and torch_params\['out.w'\] are one trained tensor",
    ):
        compare(
            module,
            lambda p, x: (x @ p["w_in"]) @ p["w_out"].T,
            (sample(2, 4),),
            params=params,
            params_from_torch=mapping,
            torch_params=torch_params,
        )


class _ComplexPartProjection(torch.nn.Module):
    """``x @ w.real`` or ``x @ w.imag`` of a complex ``w`` (its other part unused), then by
    the same part again where ``tied`` (as a tied embedding and output head are)."""

    def __init__(self, part: str, tied: bool) -> None:
        super().__init__()
        self.part, self.tied = part, tied
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(self.w, self.part)
        return (x @ weight) @ weight.T if self.tied else x @ weight


@pytest.mark.parametrize("part", ["real", "imag"])
def test_a_part_of_a_complex_parameter_the_mapping_puts_in_two_places_is_refused_naming_it(
    part: str,
) -> None:
    # Probed as NaN + 0j, w.imag held no NaN: an imaginary part given JAX as two leaves passed
    # the check, and equal functions failed at grad params['w_in'] and ['w_out']
    module = _ComplexPartProjection(part, tied=True)

    def twice(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w_in": getattr(d["w"], part), "w_out": getattr(d["w"], part)}

    params = {k: jnp.asarray(v) for k, v in twice(to_numpy_params(module)).items()}
    named = "real" if part == "real" else "imaginary"
    message = (
        rf"^torch parameter 'w' \(its {named} part\): params_from_torch puts its 16 entries "
        r"into 32 entries of the JAX params \(params\['w_in'\] \(16\), params\['w_out'\] \(16\)\)"
    )
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare(
            module,
            lambda p, x: (x @ p["w_in"]) @ p["w_out"].T,
            (sample(2, 4),),
            params=params,
            params_from_torch=twice,
        )


@pytest.mark.parametrize("part", ["real", "imag"])
def test_a_mapping_of_the_one_part_of_a_complex_parameter_torch_fn_uses_passes(part: str) -> None:
    # Probing both parts at once, the imaginary part's NaN would stand in for the real part's
    # (or count twice where w.real and w.imag are two leaves): each part is probed alone
    module = _ComplexPartProjection(part, tied=False)

    def one_part(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": getattr(d["w"], part)}

    params = {k: jnp.asarray(v) for k, v in one_part(to_numpy_params(module)).items()}
    report = assert_parity(
        module, lambda p, x: x @ p["w"], (sample(2, 4),), params=params, params_from_torch=one_part
    )
    assert "grad params['w']" in [entry.path for entry in report.entries]


class _Scale(torch.nn.Module):
    """``x * w``, ``w`` of values that float4_e2m1fn and float6 hold exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_a_trained_parameter_mapped_into_a_leaf_of_a_dtype_without_nan_is_compared() -> None:
    # NaN cast to float4_e2m1fn (or float6) is -0: a parameter probed as NaN reached no entry of
    # the leaf, and was refused as 'maps it into no leaf of the JAX params'
    def cast(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": d["w"].astype(ml_dtypes.float4_e2m1fn)}

    module = _Scale()
    params = {k: jnp.asarray(v) for k, v in cast(to_numpy_params(module)).items()}
    report = assert_parity(
        module,
        lambda p, x: x * p["w"].astype(jnp.float32),
        (np.ones((2, 3), np.float32),),
        params=params,
        params_from_torch=cast,
    )
    assert "grad params['w']" in [entry.path for entry in report.entries]


def test_a_trained_parameter_put_in_two_leaves_of_a_dtype_without_nan_is_refused() -> None:
    # Probed as NaN, which float4_e2m1fn casts to -0, the tie was unseen
    def twice(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        weight = d["w"].astype(ml_dtypes.float4_e2m1fn)
        return {"a": weight, "b": weight.copy()}

    module = _Scale()
    params = {k: jnp.asarray(v) for k, v in twice(to_numpy_params(module)).items()}
    with pytest.raises(
        dualgraph.DualgraphError,
        match=r"^torch parameter 'w': params_from_torch puts its 3 entries into 6 entries",
    ):
        compare(
            module,
            lambda p, x: x * p["a"].astype(jnp.float32),
            (np.ones((2, 3), np.float32),),
            params=params,
            params_from_torch=twice,
        )


class LinearPlusTable(torch.nn.Module):
    """A linear layer plus a buffer's table, which the JAX params hold as a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("table", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.table


@pytest.mark.parametrize("jax_differentiates_it", [False, True], ids=["stopped", "differentiated"])
def test_a_params_leaf_the_mapping_makes_of_no_torch_parameter_is_left_out(
    jax_differentiates_it: bool,
) -> None:
    # The mapping's constant table was mapped as torch's 'gradient' of it too: equal functions
    # failed at grad params['table'] with max abs 2 (the table's [0, 1, 2] against JAX's zeros)
    module = LinearPlusTable()
    table = np.arange(3, dtype=np.float32)

    def mapping(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": d["linear.weight"], "b": d["linear.bias"], "table": table.copy()}

    def layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        extra = p["table"] if jax_differentiates_it else jax.lax.stop_gradient(p["table"])
        return x @ p["w"].T + p["b"] + extra

    params = {k: jnp.asarray(v) for k, v in mapping(to_numpy_params(module)).items()}
    report = assert_parity(module, layer, (sample(2, 4),), params=params, params_from_torch=mapping)
    paths = [entry.path for entry in report.entries]
    assert "grad params['w']" in paths and "grad params['table']" not in paths
    wrong_bias = lambda p, x: x @ p["w"].T + p["b"] * 1.01 + p["table"]  # noqa: E731
    failed = compare(module, wrong_bias, (sample(2, 4),), params=params, params_from_torch=mapping)
    assert "grad params['b']" in [entry.path for entry in failed.failures]


def test_a_trained_parameter_mapped_through_a_clip_is_not_left_out_as_a_constant() -> None:
    # max(w, 5) of small weights is 5 whether they are 0, 1 or 2, as a constant table is: found
    # constant by those values alone, the leaf was left out, and its gradient never compared
    linear = torch.nn.Linear(4, 3)

    def clipped(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": np.maximum(d["weight"], np.float32(5.0)), "b": d["bias"]}

    params = {k: jnp.asarray(v) for k, v in clipped(to_numpy_params(linear)).items()}
    report = compare(
        linear,
        lambda p, x: x @ p["w"].T + p["b"],
        (sample(2, 4),),
        params=params,
        params_from_torch=clipped,
    )
    assert "grad params['w']" in [entry.path for entry in report.entries]
    assert report.left_out == ()


def test_a_report_names_the_parameter_grads_it_left_out() -> None:
    # A params leaf left out (made of a frozen torch parameter, or of none) appeared nowhere:
    # 'parity OK: 4 leaves within tolerance' read as if every params leaf had been compared
    module = LinearPlusTable()
    module.linear.bias.requires_grad_(False)

    def mapping(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        table = np.arange(3, dtype=np.float32)
        return {"w": d["linear.weight"], "b": d["linear.bias"], "table": table}

    def layer(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ p["w"].T + p["b"] + p["table"]

    params = {k: jnp.asarray(v) for k, v in mapping(to_numpy_params(module)).items()}
    report = assert_parity(module, layer, (sample(2, 4),), params=params, params_from_torch=mapping)
    assert report.left_out == (
        "grad params['b'] (no trained torch parameter behind it)",
        "grad params['table'] (no trained torch parameter behind it)",
    )
    text = str(report)
    assert text.splitlines()[0].endswith("; 2 left out)")
    assert text.splitlines()[-1] == "left out: " + "; ".join(report.left_out)


def test_a_report_names_the_trained_parameters_torch_params_leaves_out() -> None:
    # torch_params without the bias: torch_fn's backward gave it a gradient, which was never
    # compared (a JAX reference closing over the bias passes whatever its gradient), and the
    # report said 'parity OK: 3 leaves within tolerance' as if every gradient had been
    linear, unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    module = torch.nn.ModuleDict({"linear": linear, "unused": unused})
    bias = jnp.asarray(linear.bias.detach().numpy())

    def layer(p: dict[str, jax.Array], a: jax.Array) -> jax.Array:
        return a @ p["weight"].T + jax.lax.stop_gradient(bias)

    params = {"weight": jnp.asarray(linear.weight.detach().numpy())}
    report = assert_parity(
        lambda x: module["linear"](x),
        layer,
        (inputs_2x4(),),
        params=params,
        torch_params={"weight": linear.weight},
    )
    assert report.left_out == ()  # a function: no named parameters to look through
    report = assert_parity(
        _CallsItsLinear(module),
        layer,
        (inputs_2x4(),),
        params=params,
        torch_params={"weight": linear.weight},
    )
    # the unused layer has no gradient, and a frozen bias none either: neither is named
    assert report.left_out == (
        "grad of torch parameter 'module.linear.bias' (trained, not in torch_params)",
    )
    assert str(report).splitlines()[0].endswith("; 1 left out)")
    linear.bias.requires_grad_(False)
    report = assert_parity(
        _CallsItsLinear(module),
        layer,
        (inputs_2x4(),),
        params=params,
        torch_params={"weight": linear.weight},
    )
    assert report.left_out == ()
    assert linear.weight.grad is None and linear.bias.grad is None and unused.bias.grad is None


class _CallsItsLinear(torch.nn.Module):
    """A module holding a used and an unused layer, calling the used one."""

    def __init__(self, module: torch.nn.ModuleDict) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module["linear"](x)


def test_a_tied_weight_given_jax_as_one_leaf_used_twice_passes() -> None:
    module = TiedProjection()
    params = {"w": jnp.asarray(to_numpy_params(module)["w"])}
    report = assert_parity(
        module, lambda p, x: (x @ p["w"]) @ p["w"].T, (sample(2, 4),), params=params
    )
    assert "grad params['w']" in [entry.path for entry in report.entries]


def test_a_mapping_that_negates_transposes_and_casts_maps_gradients_and_passes() -> None:
    linear = torch.nn.Linear(4, 3)

    def mapping(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": -d["weight"].T.astype(np.float32), "b": d["bias"][::-1].copy()}

    def layer(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ -params["w"] + params["b"][::-1]

    params = {k: jnp.asarray(v) for k, v in mapping(to_numpy_params(linear)).items()}
    assert_parity(linear, layer, (sample(2, 4),), params=params, params_from_torch=mapping)


def test_a_scaling_mapping_is_accepted_without_grads() -> None:
    linear = torch.nn.Linear(4, 3)

    def mapping(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"w": d["weight"] * 2, "b": d["bias"]}

    params = {k: jnp.asarray(v) for k, v in mapping(to_numpy_params(linear)).items()}
    assert_parity(
        linear,
        lambda p, x: x @ (p["w"] / 2).T + p["b"],
        (sample(2, 4),),
        params=params,
        params_from_torch=mapping,
        grads=False,
    )


def test_a_leaf_joining_a_frozen_and_a_trained_parameter_compares_the_trained_part() -> None:
    # Such a leaf was left out whole: the trained part's grads were never compared.
    linear = torch.nn.Linear(4, 3)
    linear.bias.requires_grad_(False)

    def joined(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"wb": np.concatenate([d["weight"], d["bias"][:, None]], axis=1)}

    def layer(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ params["wb"][:, :4].T + params["wb"][:, 4]

    def wrong(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ (params["wb"][:, :4].T * 1.5) + params["wb"][:, 4]

    params = {k: jnp.asarray(v) for k, v in joined(to_numpy_params(linear)).items()}
    x = sample(2, 4)
    right = assert_parity(linear, layer, (x,), params=params, params_from_torch=joined)
    assert "grad params['wb']" in [entry.path for entry in right.entries]
    report = compare(linear, wrong, (x,), params=params, params_from_torch=joined)
    assert not report.ok
    # The input grads fail too, and which leaf is worst depends on the random layer.
    assert "grad params['wb']" in [entry.path for entry in report.failures]
    assert not next(e for e in report.entries if e.path == "grad params['wb']").ok


class FrozenBasePlusDelta(torch.nn.Module):
    """A linear layer whose weight is a frozen base plus a trained delta (a fine-tuning setup)."""

    def __init__(self) -> None:
        super().__init__()
        drawn = torch.Generator().manual_seed(0)  # apart from torch's global generator
        self.base = torch.nn.Parameter(torch.randn(3, 4, generator=drawn), requires_grad=False)
        self.delta = torch.nn.Parameter(torch.randn(3, 4, generator=drawn) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.base + self.delta).T


def test_a_leaf_merging_a_frozen_and_a_trained_parameter_compares_its_gradient() -> None:
    # Every entry of base + delta reads NaN when the frozen base is mapped as NaN, so the leaf
    # was skipped as frozen whole: the trained delta's grad was never compared, and a JAX
    # reference giving the merged weight no gradient passed.
    module = FrozenBasePlusDelta()

    def merged(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"weight": d["base"] + d["delta"]}

    params = {k: jnp.asarray(v) for k, v in merged(to_numpy_params(module)).items()}
    x = inputs_2x4()

    def no_weight_grad(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return x @ jax.lax.stop_gradient(p["weight"]).T

    right = assert_parity(
        module, lambda p, x: x @ p["weight"].T, (x,), params=params, params_from_torch=merged
    )
    assert "grad params['weight']" in [entry.path for entry in right.entries]
    report = compare(module, no_weight_grad, (x,), params=params, params_from_torch=merged)
    assert [entry.path for entry in report.failures] == ["grad params['weight']"]


def to_numpy_params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy() for name, p in module.named_parameters()}


@pytest.mark.parametrize("option", ["torch_params", "params_from_torch"])
def test_a_parameter_option_without_params_is_refused_not_ignored(option: Any) -> None:
    # Without params= no parameter grad is compared: the option was dropped silently, and a JAX
    # reference closing over its parameters passed whatever torch's parameter grads were.
    linear = torch.nn.Linear(4, 3)
    weight = jnp.asarray(linear.weight.detach().numpy())
    bias = jnp.asarray(linear.bias.detach().numpy())
    given = {
        "torch_params": dict(linear.named_parameters()),
        "params_from_torch": lambda grads: grads,
    }
    with pytest.raises(dualgraph.DualgraphError, match=f"{option}= is given without params="):
        compare(linear, lambda x: x @ weight.T + bias, (sample(2, 4),), **{option: given[option]})


@pytest.mark.parametrize(
    ("torch_params", "message"),
    [
        ({"weight": 1.0}, r"torch_params\['weight'\] is a float, not a torch tensor"),
        ({"weight": np.ones((3, 4), np.float32)}, r"torch_params\['weight'\] is a numpy.ndarray"),
        ({0: torch.ones(3)}, r"torch_params: a parameter name is a str, got 0"),
        ([torch.ones(3)], r"torch_params must be a mapping of parameter names to tensors"),
    ],
)
def test_torch_params_that_are_no_named_tensors_are_refused_clearly(
    torch_params: Any, message: str
) -> None:
    # AttributeError ('float' object has no attribute 'detach') or TypeError escaped
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(dualgraph.DualgraphError, match=message):
        compare(
            linear,
            linear_jax,
            (sample(2, 4),),
            params=jax_params_of(linear),
            torch_params=torch_params,
        )


def test_a_params_from_torch_that_is_not_callable_is_refused_clearly() -> None:
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(
        dualgraph.DualgraphError, match=r"params_from_torch: 3 \(int\) is not callable"
    ):
        compare(
            linear, linear_jax, (sample(2, 4),), params=jax_params_of(linear), params_from_torch=3
        )


# -- the report ------------------------------------------------------------------------------------


def test_the_report_reads_as_a_table_with_the_verdict_first() -> None:
    args, kwargs = layer_inputs()
    text = str(compare(torch_layer, jax_layer, args, kwargs))
    header, titles, *rows, footer = text.splitlines()
    assert header.startswith("parity OK: 4 leaves within tolerance (worst: ")
    assert titles.split() == [
        "leaf", "dtype", "shape", "max", "abs", "max", "rel", "rms", "score", "rel", "l2",
        "cosine", "nan/inf",
    ]  # fmt: skip
    assert [row.split()[0] for row in rows] == [
        "output['count']",
        "output['hidden']",
        "grad",
        "grad",
    ]
    assert all(row.rstrip().endswith("ok") for row in rows)
    assert footer == (
        "tolerances: int32 exact; float32 rtol 0.0001, atol 0.0001 x rms, rel l2 <= 0.0001, "
        "cosine >= 0.99999"
    )


def test_a_failing_row_says_why() -> None:
    text = str(compare(lambda t: -t, lambda a: a, (sample(3),), grads=False))
    assert text.splitlines()[2].endswith(
        "FAIL: 3 values over tolerance, worst at "
        + text.split("worst at ")[1].split("x")[0]
        + "x (max abs "
        + text.split("(max abs ")[1].split(")")[0]
        + ")"
    )


# -- 64-bit --------------------------------------------------------------------------------------


def test_int64_outputs_are_compared_in_64_bit() -> None:
    report = assert_parity(lambda t: (t > 0).sum(), lambda a: (a > 0).sum(), (sample(3),))
    assert report.entries[0].dtype == "int64"
    assert not jax.config.jax_enable_x64


def test_a_mismatch_under_64_bit_mode_says_why_the_mode_was_on() -> None:
    ids = np.arange(3, dtype=np.int64)
    with pytest.raises(SpecMismatchError, match=r"64-bit mode because args\[0\] is int64\[3\]"):
        # jnp.ones defaults to float64 in 64-bit mode; torch's ones are float32
        compare(lambda t: torch.ones(3) * t, lambda a: jnp.ones(3) * a, (ids,), grads=False)


# -- packaging -----------------------------------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True
    )


def test_a_comparison_under_another_default_jax_device_hands_the_inputs_to_it() -> None:
    # as_jax put every input on jax.devices()[0], where the reference, compiled for the default
    # device, refused it: compare failed under jax.default_device(...) whatever the functions.
    code = (
        "import os\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
        "import jax, numpy as np, torch\n"
        "from dualgraph.parity import compare\n"
        "x = np.linspace(-1, 1, 6, dtype=np.float32)\n"
        "with jax.default_device(jax.devices()[1]):\n"
        "    for grads in (True, False):\n"
        "        print(compare(torch.tanh, jax.numpy.tanh, (x,), grads=grads).ok)\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


BLOCK_IMPORT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {name!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
try:
    import dualgraph.parity
except ImportError as error:
    print(type(error).__name__, error)
"""


@pytest.mark.parametrize("missing", ["torch", "jax"])
def test_importing_parity_without_a_framework_says_what_to_install(missing: str) -> None:
    done = run_python(BLOCK_IMPORT.format(name=missing))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ImportError dualgraph.parity needs both PyTorch and JAX")
    assert "pip install dualgraph[torch,jax]" in done.stdout


def test_parity_uses_only_the_public_names_of_the_adapters() -> None:
    package = pathlib.Path(dualgraph.parity.__file__).parent
    private = []
    for source in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] in ("jax", "torch") and node.level == 2 and len(parts) > 1:
                    private.append(f"{source.name}: from ..{node.module}")
    assert private == []


def test_bfloat16_outputs_are_rounded_as_the_jax_program_says_like_torch() -> None:
    # XLA keeps bfloat16 intermediates in float32 unless told otherwise; torch rounds each op
    x = np.array([1.1, 1.3, 1.7, 2.9], np.float32)
    report = compare(
        lambda a: ((a.to(torch.bfloat16) * 3).float(),),
        lambda a: ((a.astype(jnp.bfloat16) * 3).astype(jnp.float32),),
        (x,),
        grads=False,
    )
    assert report.ok, report


def test_bfloat16_gradients_are_rounded_as_the_jax_program_says_like_torch() -> None:
    x = np.ones(3, np.float32)
    report = compare(
        lambda a: (a.to(torch.bfloat16) * 3,), lambda a: (a.astype(jnp.bfloat16) * 3,), (x,)
    )
    assert report.ok, report


def test_a_graphed_reference_rounds_bfloat16_as_written_like_torch() -> None:
    # dgj.graphed leaves XLA's excess precision on: the product stays unrounded in float32, so
    # a torch side that rounds it as written failed, and one that skips the rounding passed.
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    reference = dgj.graphed(lambda a: (a.astype(jnp.bfloat16) * 3).astype(jnp.float32), (x,))
    as_written = compare(lambda t: (t.to(torch.bfloat16) * 3).float(), reference, (x,))
    assert as_written.ok, as_written
    skipping = compare(lambda t: t.to(torch.bfloat16).float() * 3, reference, (x,), grads=False)
    assert skipping.failures and skipping.failures[0].path == "output", skipping
    assert reference.compiler_options == {}  # the caller's callable is left as it was


@pytest.mark.parametrize("as_module", [True, False], ids=["module", "closure"])
def test_the_grads_of_parameters_not_compared_are_left_as_they_were(as_module: bool) -> None:
    # Without params= (or for parameters left out of torch_params), compare's backward added
    # the random cotangents' gradient into their .grad: a comparison between training steps
    # changed the next optimizer step.
    linear = torch.nn.Linear(4, 3)
    linear.weight.grad = torch.full((3, 4), 7.0)
    weight = jnp.asarray(linear.weight.detach().numpy())
    bias = jnp.asarray(linear.bias.detach().numpy())
    torch_fn = linear if as_module else (lambda t: linear(t))
    assert_parity(torch_fn, lambda a: a @ weight.T + bias, (inputs_2x4(),))
    torch.testing.assert_close(linear.weight.grad, torch.full((3, 4), 7.0))
    assert linear.bias.grad is None


def test_the_grads_of_parameters_left_out_of_torch_params_are_left_as_they_were() -> None:
    linear = torch.nn.Linear(4, 3)
    bias = jnp.asarray(linear.bias.detach().numpy())
    params = {"weight": jnp.asarray(linear.weight.detach().numpy())}
    assert_parity(
        linear,
        lambda p, a: a @ p["weight"].T + bias,
        (inputs_2x4(),),
        params=params,
        torch_params={"weight": linear.weight},
    )
    assert linear.weight.grad is None and linear.bias.grad is None


class _Halved(collections.namedtuple("_Halved", "x")):
    """A namedtuple whose __new__ converts what it is given (here: halves x)."""

    def __new__(cls, x: Any) -> _Halved:
        return super().__new__(cls, x / 2)


def test_copies_before_donation_refuse_a_namedtuple_that_changes_its_values_again() -> None:
    # Before: copied rebuilt it through optree's tree_map, calling the class bare: x halved a
    # second time (the donated call then ran on a quarter of the input), silently
    from dualgraph.parity._jax_side import copied

    with pytest.raises(dualgraph.DualgraphError, match=r"_Halved did not keep its items as given"):
        copied(((_Halved(jnp.ones(2)),), {}))


_CONV_WEIGHT = np.array([[[0.5, -1.0, 2.0]]], dtype=np.float32)


_TORCH_CONV_WEIGHT = torch.from_numpy(_CONV_WEIGHT)


def _torch_conv(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv1d(x, _TORCH_CONV_WEIGHT)


def _jax_conv(x: Any) -> Any:
    return jnp.correlate(x[0, 0], jnp.asarray(_CONV_WEIGHT[0, 0]), mode="valid")[None, None]


@pytest.mark.parametrize("captured", ["with TF32 convolutions", "in full precision"])
def test_a_graphed_convolution_is_compared_only_if_captured_in_full_precision(
    captured: str,
) -> None:
    # compare sets the convolutions to full precision around torch_fn; a graphed convolution
    # replays the precision of its capture (cuDNN's TF32 on by default), which it cannot follow:
    # refused saying so and what to do, where it was captured so it is compared
    import dualgraph.torch as dgt
    from dualgraph import DualgraphError

    sample = (torch.randn(1, 1, 6, requires_grad=True),)
    cudnn: Any = torch.backends.cudnn
    saved = cudnn.conv.fp32_precision
    cudnn.conv.fp32_precision = "tf32" if captured == "with TF32 convolutions" else "ieee"
    try:
        graphed = dgt.make_graphed_callables(_torch_conv, sample, backend="emulate")
    finally:
        cudnn.conv.fp32_precision = saved
    x = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(1, 1, 6)
    if captured == "in full precision":
        assert assert_parity(graphed, _jax_conv, (x,)).ok
        return
    with pytest.raises(DualgraphError) as refused:
        compare(graphed, _jax_conv, (x,))
    assert "torch.backends.cudnn.conv.fp32_precision is 'ieee', captured with 'tf32'" in str(
        refused.value
    )
    assert "torch.backends.cudnn.conv.fp32_precision = 'ieee' around make_graphed_callables" in (
        str(refused.value)
    )
