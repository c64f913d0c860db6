"""dualgraph.parity: torch vs JAX, aligned by spec path, with gradients and dtype tolerances."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import dualgraph.jax as dgj
from dualgraph import SpecMismatchError
from dualgraph.parity import DEFAULT_TOLERANCES, _as_jax, assert_parity, compare

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


def test_inputs_reach_jax_without_a_copy_on_the_same_device() -> None:
    tensor = torch.zeros(64, 64, device="cuda" if jax.devices()[0].platform == "gpu" else "cpu")
    assert _as_jax(tensor).unsafe_buffer_pointer() == tensor.data_ptr()


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
    report = compare(torch_layer, off_by_one, args, kwargs, grads=False, rtol=1.0, atol=1.0)
    assert report.worst_path == "output['count']"
    assert (report.worst.rtol, report.worst.atol, report.ok) == (0.0, 0.0, False)


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
    written = dgj.graphed(lambda a: (a * 2, a * 5), (jnp.zeros(3),)).spec.with_grad_mask(
        [True, False]
    )
    program = dgj.graphed(lambda a: (a * 2, a * 5), (jnp.zeros(3),), out_spec=written)
    assert_parity(lambda t: (t * 2, (t * 5).detach()), program, (x,))
    unmasked = compare(lambda t: (t * 2, (t * 5).detach()), lambda a: (a * 2, a * 5), (x,))
    assert unmasked.worst_path == "grad args[0]" and not unmasked.ok


def test_a_none_where_the_other_side_has_an_array_is_reported_by_path() -> None:
    with pytest.raises(SpecMismatchError) as caught:
        compare(lambda t: (t, None), lambda a: (a, a), (sample(2, 3),))
    assert caught.value.path == "output[1]"
    assert "output[1]: expected float32[2, 3], got None" in str(caught.value)


def test_a_different_constant_is_reported_by_path() -> None:
    with pytest.raises(SpecMismatchError, match=r"output\['depth'\]: expected int 3, got int 2"):
        compare(
            torch_layer, lambda x, *, mask: {**jax_layer(x, mask=mask), "depth": 3}, *layer_inputs()
        )


def test_a_different_dtype_is_reported_by_path() -> None:
    with pytest.raises(SpecMismatchError, match=r"output\['h'\]: expected bfloat16\[2\]"):
        compare(lambda t: {"h": t}, lambda a: {"h": a.astype(jnp.bfloat16)}, (sample(2),))


# -- tolerances ----------------------------------------------------------------------------------


def one_percent_off(a: jax.Array) -> jax.Array:
    return a * jnp.asarray(1.01, a.dtype)


@pytest.mark.parametrize(
    ("dtype", "passes"), [(ml_dtypes.bfloat16, True), (np.float16, False), (np.float32, False)]
)
def test_tolerances_follow_the_dtype(dtype: Any, passes: bool) -> None:
    report = compare(lambda t: t, one_percent_off, (sample(4, 4, dtype=dtype),), grads=False)
    name = np.dtype(dtype).name
    assert report.ok is passes
    assert (report.worst.rtol, report.worst.atol) == DEFAULT_TOLERANCES[name]


def test_bfloat16_gradients_are_compared_in_bfloat16() -> None:
    report = assert_parity(
        lambda t: torch.tanh(t) * 3,
        lambda a: jnp.tanh(a) * 3,
        (sample(8, 8, dtype=ml_dtypes.bfloat16),),
    )
    assert [entry.dtype for entry in report.entries] == ["bfloat16", "bfloat16"]


def test_tolerances_can_be_overridden() -> None:
    x = (sample(4, 4),)
    assert compare(lambda t: t, one_percent_off, x, grads=False, rtol=0.02).ok
    assert not compare(lambda t: t, one_percent_off, x, grads=False, rtol=0.0, atol=1e-3).ok


def test_nan_matches_nan_and_nothing_else() -> None:
    x = np.array([np.nan, 1.0, np.inf], np.float32)
    assert compare(lambda t: t * 1, lambda a: a * 1, (x,), grads=False).ok
    report = compare(lambda t: t * 1, lambda a: jnp.where(jnp.isnan(a), 0.0, a), (x,), grads=False)
    assert report.worst.score == float("inf")


def test_tf32_is_off_during_the_comparison_and_restored_after() -> None:
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    seen = []

    def torch_fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(matmul.fp32_precision)
        return t @ t

    assert_parity(torch_fn, lambda a: a @ a, (sample(4, 4),))
    assert seen == ["ieee"] and matmul.fp32_precision == before


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


def test_a_wrong_parameter_mapping_fails_on_that_parameter() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)

    def swapped(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**grads, "weight": grads["weight"].T}

    report = compare(
        linear, linear_jax, (sample(2, 3),), params=jax_params_of(linear), params_from_torch=swapped
    )
    assert [entry.path for entry in report.failures] == ["grad params['weight']"]


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


# -- the report ------------------------------------------------------------------------------------


def test_the_report_reads_as_a_table_with_the_verdict_first() -> None:
    args, kwargs = layer_inputs()
    text = str(compare(torch_layer, jax_layer, args, kwargs))
    header, titles, *rows = text.splitlines()
    assert header.startswith("parity OK: 4 leaves within tolerance (worst: ")
    assert titles.split() == [
        "leaf",
        "dtype",
        "shape",
        "max",
        "abs",
        "max",
        "rel",
        "scale",
        "rtol",
        "atol",
        "score",
    ]
    assert [row.split()[0] for row in rows] == [
        "output['count']",
        "output['hidden']",
        "grad",
        "grad",
    ]
    assert all(row.rstrip().endswith("ok") for row in rows)


def test_an_int64_against_int32_mismatch_explains_the_64_bit_mode() -> None:
    with pytest.raises(SpecMismatchError, match="64-bit mode is off"):
        compare(lambda t: (t > 0).sum(), lambda a: (a > 0).sum(), (sample(3),), grads=False)
