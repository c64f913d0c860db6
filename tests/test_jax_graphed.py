"""dualgraph.jax.graphed: jax.jit under dualgraph's contract (outputs, checks, donation, VJP)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import operator
import os
import subprocess
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optree
import pytest
import torch
from trees import TREES, assert_same_tree

import dualgraph
import dualgraph.jax as dgj
from dualgraph import DualgraphError, DualgraphWarning, SpecMismatchError, describe


def x64() -> Any:
    """A context with JAX's 64-bit mode on, so that int64 and float64 leaves stay 64-bit."""
    return jax.enable_x64(True)


def identity_of(tree: Any) -> tuple[Any, list[np.ndarray]]:
    """A function of the array leaves of ``tree`` that returns ``tree`` rebuilt from them."""
    spec = describe(tree)
    return (lambda *arrays: spec.unflatten(list(arrays))), spec.flatten(tree)


def to_numpy(tree: Any) -> Any:
    """``tree`` with its JAX arrays as numpy arrays."""
    return optree.tree_map(
        lambda leaf: np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf,
        tree,
        none_is_leaf=True,
        namespace="dualgraph",
    )


def to_torch(tree: Any) -> Any:
    """``tree`` with torch tensors (floating ones requiring grad, as a module's outputs do)."""

    def convert(leaf: Any) -> Any:
        if not isinstance(leaf, np.ndarray):
            return leaf
        tensor = torch.from_dlpack(jnp.asarray(leaf)).clone()
        return tensor.requires_grad_(dualgraph.is_differentiable_dtype(leaf.dtype.name))

    return optree.tree_map(convert, tree, none_is_leaf=True, namespace="dualgraph")


def encoder_layer(x: jax.Array, *, scale: float = 2.0) -> dict[str, Any]:
    hidden = x * scale
    return {"hidden": hidden, "pooled": hidden.mean(0), "aux_loss": None, "depth": 2}


# -- outputs: None leaves and constants ---------------------------------------------------------


@pytest.mark.parametrize("name", TREES)
def test_none_leaves_and_constants_come_back_at_their_paths(name: str) -> None:
    tree = TREES[name]()
    fn, arrays = identity_of(tree)
    with x64():
        out = dgj.graphed(fn, arrays)(*arrays)
    assert_same_tree(to_numpy(out), tree)


@pytest.mark.parametrize("name", TREES)
def test_spec_json_is_the_numpy_description_of_the_same_tree(name: str) -> None:
    tree = TREES[name]()
    fn, arrays = identity_of(tree)
    with x64():
        spec = dgj.graphed(fn, arrays).out_spec
    assert spec.to_json() == describe(tree).to_json()


@pytest.mark.parametrize("name", ["vit_layer", "encoder_dict", "nested_namedtuple", "deep"])
def test_spec_json_is_the_torch_description_of_the_same_tree(name: str) -> None:
    tree = TREES[name]()
    fn, arrays = identity_of(tree)
    assert dgj.graphed(fn, arrays).out_spec.to_json() == describe(to_torch(tree)).to_json()


def test_kwargs_constants_are_static_and_outputs_keep_the_users_order() -> None:
    g = dgj.graphed(encoder_layer, (jnp.ones((2, 3)),), sample_kwargs={"scale": 3.0})
    out = g(jnp.ones((2, 3)), scale=3.0)
    assert list(out) == ["hidden", "pooled", "aux_loss", "depth"]
    assert out["aux_loss"] is None and out["depth"] == 2
    np.testing.assert_array_equal(out["pooled"], np.full(3, 3.0, np.float32))


def concatenated(d: dict[str, jax.Array], *, extra: Any = None) -> jax.Array:
    return jnp.concatenate([*d.values(), *(extra or {}).values()])


@pytest.mark.parametrize("where", ["args", "kwargs"])
def test_a_dict_input_with_its_keys_in_another_order_is_refused_naming_its_path(
    where: str,
) -> None:
    # The core matches a dict whatever its key order, but the program was traced with the
    # sample's order: concatenating d.values() gave [a, b] where the plain function gave [b, a].
    a, b = jnp.zeros(2), jnp.ones(2)
    if where == "args":
        g = dgj.graphed(concatenated, ({"a": a, "b": b},))
        call: Any = lambda d: g(d)  # noqa: E731
        path = r"args\[0\]"
    else:
        g = dgj.graphed(concatenated, ({},), sample_kwargs={"extra": {"a": a, "b": b}})
        call = lambda d: g({}, extra=d)  # noqa: E731
        path = r"kwargs\['extra'\]"
    np.testing.assert_array_equal(call({"a": a, "b": b}), [0, 0, 1, 1])
    with pytest.raises(SpecMismatchError, match=rf"^{path}: a dict with its keys in the order"):
        call({"b": b, "a": a})
    with pytest.raises(SpecMismatchError, match=rf"^{path}: a dict with its keys in the order"):
        g.vjp(
            *([{"b": b, "a": a}] if where == "args" else [{}]),
            **({} if where == "args" else {"extra": {"b": b, "a": a}}),
        )


def test_keywords_collected_by_var_kwargs_in_another_order_are_refused() -> None:
    # fn(x, **parts) sees the keywords in the call's order; the program was traced in the
    # sample's: concatenating parts.values() gave [a, b] where the plain function gave [b, a].
    def joined(x: jax.Array, *, scale: float = 1.0, **parts: jax.Array) -> jax.Array:
        return jnp.concatenate([x, *parts.values()]) * scale

    x, a, b = jnp.zeros(1), jnp.ones(1), jnp.full(1, 2.0)
    g = dgj.graphed(joined, (x,), sample_kwargs={"a": a, "scale": 1.0, "b": b})
    np.testing.assert_array_equal(g(x, scale=1.0, a=a, b=b), joined(x, a=a, b=b))  # scale named
    with pytest.raises(SpecMismatchError, match=r"^kwargs: the keywords \['b', 'a'\] go to"):
        g(x, b=b, a=a, scale=1.0)
    plain = dgj.graphed(
        lambda x, *, a, b: jnp.concatenate([x, a, b]), (x,), sample_kwargs={"a": a, "b": b}
    )
    np.testing.assert_array_equal(plain(x, b=b, a=a), [0, 1, 2])  # named keywords: any order


def test_shape_dtype_structs_and_numpy_arrays_serve_as_samples_and_inputs() -> None:
    g = dgj.graphed(encoder_layer, (jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),))
    out = g(np.ones((2, 3), jnp.bfloat16))
    assert out["hidden"].dtype == jnp.bfloat16
    assert g.out_spec.arrays[0].dtype == "bfloat16"


def test_an_unsupported_output_leaf_names_its_output_path() -> None:
    with pytest.raises(dualgraph.UnsupportedLeafError, match=r"output\['bad'\]") as caught:
        dgj.graphed(lambda x: {"x": x, "bad": object()}, (jnp.ones(2),))
    assert caught.value.path == "output['bad']"


# -- out_spec ------------------------------------------------------------------------------------


def test_out_spec_from_torch_json_supplies_the_grad_mask() -> None:
    torch_out = (torch.ones(2, 3, requires_grad=True), None, torch.ones(2, 3))  # last: detached
    written = describe(torch_out).to_json()
    g = dgj.graphed(lambda x: (x * 2, None, x + 1), (jnp.ones((2, 3)),), out_spec=written)
    assert g.out_spec.grad_mask == (True, False)
    assert g.out_spec.to_json() == written


def test_out_spec_mismatch_names_the_output_path() -> None:
    expected = describe({"hidden": np.zeros((2, 5), np.float32), "aux_loss": None})
    with pytest.raises(SpecMismatchError) as caught:
        dgj.graphed(
            lambda x: {"hidden": x, "aux_loss": None}, (jnp.ones((2, 4)),), out_spec=expected
        )
    assert caught.value.path == "output['hidden']"
    assert "output['hidden']: expected float32[2, 5], got float32[2, 4]" in str(caught.value)


def test_out_spec_with_a_none_where_the_function_returns_an_array_is_refused() -> None:
    expected = describe((np.zeros(2, np.float32), None))
    with pytest.raises(SpecMismatchError, match=r"output\[1\]: expected None, got float32\[2\]"):
        dgj.graphed(lambda x: (x, x), (jnp.ones(2),), out_spec=expected)


def test_out_spec_masking_an_integer_output_is_refused() -> None:
    expected = describe((np.zeros(2, np.int32),)).with_grad_mask([True])
    with pytest.raises(DualgraphError, match=r"output\[0\]"):
        dgj.graphed(lambda x: (x.astype(jnp.int32),), (jnp.ones(2),), out_spec=expected)


# -- validation of calls -------------------------------------------------------------------------


def masked_mean(batch: dict[str, jax.Array], w: jax.Array, *, mask: jax.Array) -> jax.Array:
    return ((batch["x"] @ w) * mask).mean()


def sample_batch(columns: int = 8) -> dict[str, jax.Array]:
    return {"x": jnp.ones((2, 4)), "mask": jnp.ones((2, columns))}


def test_a_wrong_shape_in_args_is_named_by_its_path() -> None:
    g = dgj.graphed(
        masked_mean, (sample_batch(), jnp.ones((4, 8))), sample_kwargs={"mask": jnp.ones((2, 8))}
    )
    with pytest.raises(SpecMismatchError) as caught:
        g(sample_batch(9), jnp.ones((4, 8)), mask=jnp.ones((2, 8)))
    assert str(caught.value) == "args[0]['mask']: expected float32[2, 8], got float32[2, 9]"


def test_a_wrong_kwarg_is_named_by_its_path() -> None:
    g = dgj.graphed(
        masked_mean, (sample_batch(), jnp.ones((4, 8))), sample_kwargs={"mask": jnp.ones((2, 8))}
    )
    with pytest.raises(SpecMismatchError) as caught:
        g(sample_batch(), jnp.ones((4, 8)), mask=jnp.ones((2, 8), jnp.bfloat16))
    assert str(caught.value) == "kwargs['mask']: expected float32[2, 8], got bfloat16[2, 8]"


def test_a_changed_static_constant_is_refused() -> None:
    g = dgj.graphed(encoder_layer, (jnp.ones((2, 3)),), sample_kwargs={"scale": 3.0})
    with pytest.raises(SpecMismatchError, match=r"kwargs\['scale'\]"):
        g(jnp.ones((2, 3)), scale=4.0)


def test_a_rejected_call_donates_nothing_and_the_next_call_works() -> None:
    g = dgj.graphed(
        lambda state, x, *, mask: (state + x * mask, None),
        (jnp.ones((2, 8)), jnp.ones((2, 8))),
        sample_kwargs={"mask": jnp.ones((2, 8))},
        donate_argnums=0,
    )
    state = jnp.ones((2, 8))
    with pytest.raises(SpecMismatchError, match=r"kwargs\['mask'\]"):
        g(state, jnp.ones((2, 8)), mask=jnp.ones((2, 9)))
    assert not state.is_deleted()
    new_state, nothing = g(state, jnp.ones((2, 8)), mask=jnp.ones((2, 8)))
    assert nothing is None and state.is_deleted()
    np.testing.assert_array_equal(new_state, np.full((2, 8), 2.0, np.float32))


# -- donation ------------------------------------------------------------------------------------


def accumulate(state: dict[str, jax.Array], grads: dict[str, jax.Array]) -> dict[str, Any]:
    return {name: state[name] + grads[name] for name in state} | {"step": None}


def params_like() -> dict[str, jax.Array]:
    return {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}


def test_donated_inputs_are_deleted_after_the_call_and_others_are_not() -> None:
    g = dgj.graphed(accumulate, (params_like(), params_like()), donate_argnums=0)
    state, grads = params_like(), params_like()
    out = g(state, grads)
    assert state["w"].is_deleted() and state["b"].is_deleted()
    assert not grads["w"].is_deleted()
    assert out["step"] is None
    np.testing.assert_array_equal(out["w"], np.full((3, 4), 2.0, np.float32))


def test_reusing_a_donated_array_is_refused_naming_its_path() -> None:
    g = dgj.graphed(accumulate, (params_like(), params_like()), donate_argnums=0)
    state = params_like()
    g(state, params_like())
    with pytest.raises(DualgraphError, match=r"args\[0\]\['b'\]: this array has been deleted"):
        g(state, params_like())


def test_a_donation_no_output_can_reuse_is_warned_once_in_dualgraph_words() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = dgj.graphed(
            lambda w, x: (x @ w).sum(), (jnp.ones((3, 4)), jnp.ones((2, 3))), donate_argnums=0
        )
        w = jnp.ones((3, 4))
        g(w, jnp.ones((2, 3)))
        g(jnp.ones((3, 4)), jnp.ones((2, 3)))
    assert [r.category for r in caught] == [DualgraphWarning]
    message = str(caught[0].message)
    assert "donated args[0] (float32[3, 4]) cannot be reused by any output" in message
    assert "Some donated buffers" not in message
    assert w.is_deleted()  # consumed all the same: the contract does not depend on XLA's choice


def test_a_donation_that_an_output_reuses_is_not_warned() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dgj.graphed(accumulate, (params_like(), params_like()), donate_argnums=0)
    assert caught == []


def test_the_same_buffer_twice_with_one_donated_is_refused() -> None:
    g = dgj.graphed(lambda s, x: s + x, (jnp.ones(3), jnp.ones(3)), donate_argnums=0)
    shared = jnp.ones(3)
    with pytest.raises(
        DualgraphError, match=r"args\[0\] is donated, but .* also passed as args\[1\]"
    ):
        g(shared, shared)
    assert not shared.is_deleted()


def test_the_same_buffer_under_two_array_objects_is_refused() -> None:
    g = dgj.graphed(lambda s, x: s + x, (jnp.ones(3), jnp.ones(3)), donate_argnums=0)
    tensor = torch.ones(3)
    with pytest.raises(DualgraphError, match=r"args\[0\] is donated"):
        g(jax.dlpack.from_dlpack(tensor), jax.dlpack.from_dlpack(tensor))


def shared_views(tensor: torch.Tensor, first: slice, second: slice) -> tuple[jax.Array, jax.Array]:
    """Two JAX arrays over views of one torch allocation (DLPack shares, copying nothing)."""
    a, b = jax.dlpack.from_dlpack(tensor[first]), jax.dlpack.from_dlpack(tensor[second])
    start = tensor.data_ptr()
    offsets = (a.unsafe_buffer_pointer() - start, b.unsafe_buffer_pointer() - start)
    assert offsets == (first.start * 4, second.start * 4)  # the views, not copies
    return a, b


@pytest.mark.parametrize("donated", [0, 1])
def test_a_donated_buffer_partly_overlapping_another_input_is_refused(donated: int) -> None:
    # Only the same start address was caught: views at an offset into one allocation share
    # bytes, and the donated one's reuse for an output would overwrite what the other reads.
    g = dgj.graphed(
        lambda s, x: (s * 2, x * 3), (jnp.ones(32), jnp.ones(32)), donate_argnums=donated
    )
    a, b = shared_views(torch.arange(64.0), slice(0, 32), slice(16, 48))
    other = 1 - donated
    with pytest.raises(
        DualgraphError,
        match=rf"args\[{donated}\] is donated, but part of its buffer is also passed as "
        rf"args\[{other}\]",
    ):
        g(a, b)
    assert not a.is_deleted() and not b.is_deleted()


def test_adjacent_views_of_one_allocation_may_be_donated() -> None:
    # The views are of a CPU torch tensor, so the function is graphed for JAX's CPU device: with
    # a GPU as JAX's default, it was compiled for the GPU and the CPU views were refused.
    with jax.default_device(jax.devices("cpu")[0]):
        g = dgj.graphed(lambda s, x: (s * 2, x * 3), (jnp.ones(32), jnp.ones(32)), donate_argnums=0)
    a, b = shared_views(torch.arange(64.0), slice(0, 32), slice(32, 64))
    doubled, tripled = g(a, b)
    assert np.array_equal(doubled, np.arange(32.0) * 2)
    assert np.array_equal(tripled, np.arange(32.0, 64.0) * 3)


def test_two_empty_arrays_at_one_address_with_one_donated_are_not_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A CUDA allocation of zero bytes has address 0, so every empty array on a GPU shares one
    # "buffer pointer": two distinct empty inputs with one donated were refused as one buffer
    # passed twice (emulated here: the CPU gives each empty array an address of its own).
    from dualgraph.jax import _donation

    pointer = _donation._buffer_pointer
    monkeypatch.setattr(_donation, "_buffer_pointer", lambda x: 0 if x.size == 0 else pointer(x))
    g = dgj.graphed(lambda s, x: (s + 1, x * 2), (jnp.ones((0, 3)), jnp.ones(0)), donate_argnums=0)
    out, doubled = g(jnp.zeros((0, 3)), jnp.zeros(0))
    assert out.shape == (0, 3) and doubled.shape == (0,)


@pytest.mark.parametrize(("argnums", "bad"), [(2, 2), (-3, -3), ((0, 5), 5)])
def test_donate_argnums_out_of_range_is_refused(argnums: Any, bad: int) -> None:
    # the option's name alone matched any refusal of donate_argnums: name the index refused
    refused = rf"^donate_argnums: {bad} is not the index of one of the 2 positional sample args"
    with pytest.raises(DualgraphError, match=refused):
        dgj.graphed(lambda s, x: s + x, (jnp.ones(3), jnp.ones(3)), donate_argnums=argnums)


class Index:
    """An integer-like that is not an int: anything with ``__index__``."""

    def __index__(self) -> int:
        return 1


@pytest.mark.parametrize(
    "argnums",
    [np.int64(0), np.int32(-2), Index(), [np.int64(1), 0], np.array([0, 1]), range(2), (0, 0)],
    ids=["np.int64", "np.int32-negative", "__index__", "list", "np.array", "range", "repeated"],
)
def test_donate_argnums_accepts_integer_likes_and_sequences_of_them(argnums: Any) -> None:
    g = dgj.graphed(lambda s, x: (s + x, s - x), (jnp.ones(3), jnp.ones(3)), donate_argnums=argnums)
    expected = {operator.index(n) % 2 for n in np.atleast_1d(np.asarray(argnums, dtype=object))}
    assert g.donate_argnums == tuple(sorted(expected))
    state, x = jnp.ones(3), jnp.ones(3)
    g(state, x)
    assert [state.is_deleted(), x.is_deleted()] == [0 in expected, 1 in expected]


def test_donate_argnums_none_donates_nothing() -> None:
    assert dgj.graphed(lambda s: s * 2, (jnp.ones(3),), donate_argnums=None).donate_argnums == ()


@pytest.mark.parametrize(
    ("argnums", "message"),
    [
        (0.0, r"0\.0 \(float\)"),
        ("0", r"'0' \(str\)"),
        (True, r"True \(bool\)"),
        ([0, 1.5], r"1\.5 \(float\) is not an integer index"),
        ([[0]], r"\[0\] \(list\) is not an integer index"),
        (object(), "expected an int or a sequence of ints"),
        ({0: "state"}, "expected an int or a sequence of ints"),
        ([np.bool_(True)], r"True_ \(bool\) is not an integer index"),
    ],
    ids=["float", "str", "bool", "float-in-list", "nested", "object", "dict", "np.bool_"],
)
def test_donate_argnums_that_are_not_indices_are_refused_clearly(
    argnums: Any, message: str
) -> None:
    with pytest.raises(DualgraphError, match=rf"^donate_argnums: .*{message}"):
        dgj.graphed(lambda s, x: s + x, (jnp.ones(3), jnp.ones(3)), donate_argnums=argnums)


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    "argnums",
    [10**5000, [0, -(10**5000)], Unprintable(), [Unprintable()]],
    ids=["huge-int", "huge-int-in-list", "unprintable", "unprintable-in-list"],
)
def test_donate_argnums_that_cannot_print_are_still_refused_clearly(argnums: Any) -> None:
    with pytest.raises(DualgraphError, match=r"^donate_argnums: "):
        dgj.graphed(lambda s, x: s + x, (jnp.ones(3), jnp.ones(3)), donate_argnums=argnums)


def test_donating_a_constant_argument_is_refused() -> None:
    with pytest.raises(DualgraphError, match=r"args\[1\] holds no array"):
        dgj.graphed(lambda s, n: s * n, (jnp.ones(3), 2), donate_argnums=1)


# -- VJP -----------------------------------------------------------------------------------------


def layer(params: dict[str, jax.Array], x: jax.Array, ids: jax.Array, n: int) -> Any:
    hidden = jnp.tanh(x @ params["w"] + params["b"]) * n
    return {"hidden": hidden, "aux": None, "ids": ids + 1, "summary": hidden.sum(0)}


def layer_inputs() -> tuple[Any, ...]:
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (3, 4)), "b": jnp.linspace(-1, 1, 4)}
    return params, jnp.linspace(-2, 2, 6).reshape(2, 3), jnp.arange(2), 3


def test_vjp_gives_jax_vjp_gradients_for_float_inputs_and_none_elsewhere() -> None:
    inputs = layer_inputs()
    g = dgj.graphed(layer, inputs)
    out, pullback = g.vjp(*inputs)
    cotangent = {"hidden": jnp.ones((2, 4)), "aux": None, "ids": None, "summary": jnp.ones(4)}
    (params_grads, x_grad, ids_grad, n_grad), kwargs_grads = pullback(cotangent)

    def reference(params: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = layer(params, x, inputs[2], 3)
        return out["hidden"], out["summary"]

    @jax.jit
    def reference_grads(params: Any, x: jax.Array) -> Any:
        return jax.vjp(reference, params, x)[1]((jnp.ones((2, 4)), jnp.ones(4)))

    expected_params, expected_x = reference_grads(inputs[0], inputs[1])
    np.testing.assert_allclose(params_grads["w"], expected_params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x_grad, expected_x, rtol=1e-5, atol=1e-6)
    assert ids_grad is None and n_grad is None and kwargs_grads == {}
    assert out["aux"] is None and out["ids"].tolist() == [1, 2]


def test_vjp_gives_an_unmasked_output_no_cotangent() -> None:
    written = describe((np.zeros(3, np.float32), np.zeros(3, np.float32))).with_grad_mask(
        [True, False]
    )
    g = dgj.graphed(lambda x: (x * 2.0, x * 5.0), (jnp.ones(3),), out_spec=written)
    _, pullback = g.vjp(jnp.ones(3))
    assert pullback.cotangent_spec == describe((np.zeros(3, np.float32), None))
    (x_grad,), _ = pullback((jnp.ones(3), None))
    np.testing.assert_array_equal(x_grad, np.full(3, 2.0, np.float32))
    with pytest.raises(SpecMismatchError, match=r"cotangent\[1\]: expected None, got float32\[3\]"):
        pullback((jnp.ones(3), jnp.ones(3)))


def test_vjp_consumes_donated_inputs_and_its_pullback_can_run_twice() -> None:
    g = dgj.graphed(lambda s, x: (s * x, None), (jnp.ones(3), jnp.ones(3)), donate_argnums=0)
    state = jnp.full(3, 2.0, jnp.float32)
    _, pullback = g.vjp(state, jnp.full(3, 5.0, jnp.float32))
    assert state.is_deleted()
    first = pullback((jnp.ones(3), None))
    second = pullback((jnp.ones(3), None))
    np.testing.assert_array_equal(first[0][0], np.full(3, 5.0, np.float32))
    np.testing.assert_array_equal(second[0][1], np.full(3, 2.0, np.float32))


def test_vjp_checks_its_inputs_like_a_call() -> None:
    g = dgj.graphed(encoder_layer, (jnp.ones((2, 3)),))
    with pytest.raises(SpecMismatchError, match=r"args\[0\]: expected float32\[2, 3\]"):
        g.vjp(jnp.ones((2, 4)))


# -- 64-bit --------------------------------------------------------------------------------------


NARROWED = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}


@pytest.mark.parametrize("dtype", NARROWED)
def test_a_dtype_jax_would_narrow_is_refused_naming_its_path(dtype: str) -> None:
    batch = {"ids": np.zeros(3, dtype), "x": np.zeros(3, np.float32)}
    with pytest.raises(DualgraphError) as caught:
        dgj.graphed(lambda x, *, batch: x, (jnp.ones(2),), sample_kwargs={"batch": batch})
    message = str(caught.value)
    assert f"kwargs['batch']['ids'] is {dtype}[3]" in message
    assert f"JAX's 64-bit mode is off, so JAX would silently compute it as {NARROWED[dtype]}" in (
        message
    )


@pytest.mark.parametrize(
    "array",
    [np.zeros(2, np.longdouble), np.array(["a", "b"]), np.array(["2020-01-01"], "datetime64[D]")],
    ids=["longdouble", "str", "datetime64"],
)
def test_a_dtype_jax_cannot_hold_is_refused_naming_its_path(array: np.ndarray) -> None:
    if array.dtype == np.float64:
        pytest.skip("long double is float64 on this platform")
    # The core refuses dtypes no spec holds (str, datetime); JAX refuses the rest it can't hold.
    cannot_hold = r"a dtype JAX cannot compute in|is not one a spec accepts"
    with pytest.raises(DualgraphError, match=rf"args\[1\]:? .*({cannot_hold})"):
        dgj.graphed(lambda x, y: x, (jnp.ones(2), array))


@pytest.mark.parametrize(
    "dtype",
    ["float32", "bfloat16", "float16", "float8_e4m3fn", "int32", "int16", "uint8", "bool"],
)
def test_a_dtype_jax_keeps_passes_through_unchanged(dtype: str) -> None:
    x = jnp.zeros(3, dtype)
    out = dgj.graphed(lambda a: a, (x,))(x)
    assert out.dtype == x.dtype


def test_int64_under_64_bit_mode_stays_exact() -> None:
    with x64():
        g = dgj.graphed(lambda ids: ids + 1, (np.zeros(2, np.int64),))
    out = g(np.array([1099511627783, 2**62], np.int64))  # outside the mode: turned on again
    assert out.dtype == np.int64 and out.tolist() == [1099511627784, 2**62 + 1]


def test_float64_without_x64_is_refused_clearly() -> None:
    with pytest.raises(DualgraphError, match=r"args\[0\] is float64\[2\].*64-bit mode is off"):
        dgj.graphed(lambda x: x * 2, (np.ones(2, np.float64),))


@pytest.mark.parametrize("explicit", ["allow", "error"])
def test_float64_without_x64_is_refused_whatever_explicit_x64_dtypes_says(explicit: str) -> None:
    # jax_explicit_x64_dtypes='allow' keeps jnp.zeros(n, float64) 64-bit with the mode off, but
    # an input is still traced, and a numpy one converted, as float32: (1 + 2**-40) - 1 is 0.
    sample = np.full(2, 1 + 2.0**-40)
    before = jax.config.jax_explicit_x64_dtypes  # type: ignore[attr-defined]
    jax.config.update("jax_explicit_x64_dtypes", explicit)
    try:
        with pytest.raises(DualgraphError, match=r"args\[0\] is float64\[2\].*64-bit mode is off"):
            dgj.graphed(lambda x: x - 1, (sample,))
    finally:
        jax.config.update("jax_explicit_x64_dtypes", before)
    with pytest.raises(DualgraphError, match=r"args\[0\] is float64\[2\].*64-bit mode is off"):
        dgj.graphed(lambda x: x - 1, (sample,))  # and with JAX's default setting after it


def test_a_program_compiled_with_x64_keeps_float64_outside_the_context() -> None:
    with x64():
        g = dgj.graphed(lambda x: (x * 2, None), (np.ones(2, np.float64),))
    out, _ = g(np.full(2, 1 / 3))
    _, pullback = g.vjp(np.ones(2))
    (grad,), _ = pullback((np.ones(2), None))
    assert out.dtype == np.float64 and grad.dtype == np.float64
    assert float(out[0]) == 2 / 3


def test_an_int64_out_spec_against_32_bit_jax_names_the_64_bit_mode() -> None:
    written = describe((np.zeros(3, np.int64),))
    with pytest.raises(SpecMismatchError, match=r"output\[0\]: expected int64\[3\].*64-bit mode"):
        dgj.graphed(lambda x: ((x > 0).astype(int),), (jnp.ones(3),), out_spec=written)


@pytest.mark.parametrize(
    "value",
    [
        np.array([2**40 + 5], np.int64),
        np.array([2**63 - 1], np.uint64),
        np.array([1e300], np.float64),
        np.array([1 / 3 + 1j], np.complex128),
    ],
    ids=["int64", "uint64", "float64", "complex128"],
)
def test_a_64_bit_numpy_output_jax_would_narrow_is_refused_naming_its_path(
    value: np.ndarray,
) -> None:
    # A numpy array the function returns is converted by JAX: in 32 bits, 2**40 + 5 became 5
    # while out_spec said int64.
    x = jnp.ones(2, jnp.float32)
    narrowed = r"output\[1\]\['ids'\] is a numpy array of .*64-bit mode is off"
    with pytest.raises(DualgraphError, match=narrowed):
        dgj.graphed(lambda x: (x, {"ids": value}), (x,))
    with x64():
        g = dgj.graphed(lambda x: (x, {"ids": value}), (x,))
    out = g(x)[1]["ids"]
    assert out.dtype == value.dtype and out.tolist() == value.tolist()


@pytest.mark.parametrize(
    "value",
    [np.ones(2, np.longdouble), torch.ones(2)],
    ids=["longdouble", "torch-tensor"],
)
def test_an_output_jax_cannot_return_as_is_is_refused_naming_its_path(value: Any) -> None:
    if isinstance(value, np.ndarray) and value.dtype == np.float64:
        pytest.skip("long double is float64 on this platform")
    with pytest.raises(DualgraphError, match=r"^graphed\(\S*<lambda>\): output\[1\] "):
        dgj.graphed(lambda x: (x, value), (jnp.ones(2),))


def test_a_numpy_output_jax_keeps_comes_back_with_its_values() -> None:
    value = np.arange(3, dtype=np.int16)
    g = dgj.graphed(lambda x: (x, value), (jnp.ones(2),))
    assert g.out_spec == describe((np.ones(2, np.float32), value))
    assert g(jnp.ones(2))[1].tolist() == [0, 1, 2]


def test_an_output_spec_that_says_otherwise_than_the_program_is_refused() -> None:
    from dualgraph.jax._graphed import _check_returned

    traced = describe((None, {"ids": np.zeros(2, np.int64)}))
    returned = [jax.ShapeDtypeStruct((2,), jnp.int32)]
    with pytest.raises(DualgraphError, match=r"output\[1\]\['ids'\] is int64\[2\] .* int32\[2\]"):
        _check_returned("f", traced, returned)
    _check_returned("f", traced, [jax.ShapeDtypeStruct((2,), np.int64)])


def test_enable_x64_is_one_context_that_nests_and_restores() -> None:
    assert not dgj.x64_enabled()
    with dgj.enable_x64():
        with dgj.enable_x64():  # already on: a no-op
            assert dgj.x64_enabled()
        assert dgj.x64_enabled()
        with dgj.enable_x64(False):  # asks for nothing: leaves the mode as it is
            assert dgj.x64_enabled()
    assert not dgj.x64_enabled()


# -- inside JAX transformations ------------------------------------------------------------------


def double(x: jax.Array, *, scale: float = 2.0) -> tuple[jax.Array, None]:
    return x * scale, None


TRANSFORMATIONS = {
    "jit": (lambda f: jax.jit(f), jnp.ones(3), "DynamicJaxprTracer, from jax.jit"),
    "vmap": (lambda f: jax.vmap(f), jnp.ones((2, 3)), "BatchTracer, from jax.vmap"),
    "grad": (lambda f: jax.grad(lambda x: f(x).sum()), jnp.ones(3), "Tracer, from jax.grad"),
    "jacfwd": (lambda f: jax.jacfwd(f), jnp.ones(3), "JVPTracer, from jax.jvp"),
    "scan": (
        lambda f: lambda xs: jax.lax.scan(lambda c, x: (c, f(x)), 0.0, xs)[1],
        jnp.ones((2, 3)),
        "DynamicJaxprTracer, from jax.jit (or another staging transformation",
    ),
}


@pytest.mark.parametrize("donate", [(), 0], ids=["plain", "donated"])
@pytest.mark.parametrize("name", TRANSFORMATIONS)
def test_a_call_inside_a_transformation_names_the_real_cause(name: str, donate: Any) -> None:
    transform, x, kind = TRANSFORMATIONS[name]
    g = dgj.graphed(double, (jnp.ones(3),), donate_argnums=donate)
    with pytest.raises(DualgraphError) as caught:
        transform(lambda a: g(a)[0])(x)
    message = str(caught.value)
    assert message.startswith("graphed(double): args[0] is a JAX tracer (") and kind in message
    assert "cannot be called inside jax.jit, jax.vmap, jax.grad" in message
    assert "ConcretizationTypeError" not in message and "Concretization" not in repr(caught.value)


def test_a_call_or_cotangent_that_contains_itself_is_a_mismatch_naming_its_path() -> None:
    g = dgj.graphed(lambda x, opt: (x * 2, None), (jnp.ones(3), None))
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(SpecMismatchError, match=r"^args\[1\]: expected None, got a list"):
        g(jnp.ones(3), cycle)
    _, pullback = g.vjp(jnp.ones(3), None)
    with pytest.raises(SpecMismatchError, match=r"^cotangent\[1\]: expected None, got a list"):
        pullback((jnp.ones(3), cycle))


def test_a_tracer_among_the_kwargs_is_named_by_its_path() -> None:
    g = dgj.graphed(double, (jnp.ones(3),), sample_kwargs={"scale": 2.0})
    x = jnp.ones(3)  # concrete: only the scale is traced
    with pytest.raises(DualgraphError, match=r"^graphed\(double\): kwargs\['scale'\] is a JAX"):
        jax.jit(lambda s: g(x, scale=s)[0])(2.0)


def test_vjp_inside_a_transformation_names_the_real_cause() -> None:
    g = dgj.graphed(double, (jnp.ones(3),))
    with pytest.raises(DualgraphError, match=r"args\[0\] is a JAX tracer"):
        jax.jit(lambda a: g.vjp(a)[0][0])(jnp.ones(3))


def test_a_pullback_inside_a_transformation_names_the_real_cause() -> None:
    _, pullback = dgj.graphed(double, (jnp.ones(3),)).vjp(jnp.ones(3))
    with pytest.raises(DualgraphError) as caught:
        jax.jit(lambda ct: pullback((ct, None))[0][0])(jnp.ones(3))
    assert str(caught.value).startswith(
        "the pullback of graphed(double): cotangent[0] is a JAX tracer"
    )


def test_the_plain_function_still_works_inside_a_transformation() -> None:
    g = dgj.graphed(double, (jnp.ones(3),))
    out = jax.jit(lambda a: g.fn(a)[0])(jnp.ones(3))
    np.testing.assert_array_equal(out, np.full(3, 2.0, np.float32))


def test_a_failing_call_outside_transformations_keeps_its_own_error() -> None:
    g = dgj.graphed(lambda s, x: s + x, (jnp.ones(3), jnp.ones(3)), donate_argnums=0)
    state = jnp.ones(3)
    g(state, jnp.ones(3))
    with pytest.raises(DualgraphError, match=r"args\[0\]: this array has been deleted"):
        g(state, jnp.ones(3))


# -- how it reads: the same names as the PyTorch adapter -------------------------------------------


def test_a_graphed_callable_reads_like_the_torch_one() -> None:
    g = dgj.graphed(encoder_layer, (jnp.ones((2, 3)),), sample_kwargs={"scale": 3.0})
    assert isinstance(g, dgj.GraphedCallable)
    assert g.name == "encoder_layer"
    assert g.call_spec == dualgraph.describe_call((jnp.ones((2, 3)),), {"scale": 3.0})
    assert g.call_spec.array_paths == ("args[0]",)
    assert g.out_spec == describe({"hidden": jnp.ones((2, 3)), "pooled": jnp.ones(3),
                                   "aux_loss": None, "depth": 2})  # fmt: skip
    assert repr(g).startswith("GraphedCallable(encoder_layer, call=CallSpec(args=(float32[2, 3]")


def test_sample_args_that_are_not_a_tuple_are_refused() -> None:
    with pytest.raises(DualgraphError, match=r"sample_args must be a tuple .* got ArrayImpl"):
        dgj.graphed(double, jnp.ones(3))


def test_sample_kwargs_are_keyword_only() -> None:
    # Python's own refusal of a third positional argument, not any TypeError (a typo raises one)
    with pytest.raises(TypeError, match=r"graphed\(\) takes 2 positional arguments but 3 were"):
        dgj.graphed(encoder_layer, (jnp.ones((2, 3)),), {"scale": 3.0})  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", ["ab", [("scale", 3.0)], 0, jnp.ones(2)], ids=str)
def test_sample_kwargs_that_are_no_mapping_are_refused(kwargs: Any) -> None:
    # "ab" was a ValueError from dict(); a list of pairs and 0 were taken as kwargs
    with pytest.raises(DualgraphError, match=r"^kwargs: expected a mapping of keyword arguments"):
        dgj.graphed(encoder_layer, (jnp.ones((2, 3)),), sample_kwargs=kwargs)


@pytest.mark.parametrize("lazy", ["no", 0, None])
def test_lazy_must_be_a_bool(lazy: Any) -> None:
    with pytest.raises(DualgraphError, match="lazy must be True or False"):
        dgj.graphed(double, (jnp.ones(3),), lazy=lazy)


def test_lazy_compiles_each_program_at_its_first_use() -> None:
    g = dgj.graphed(double, (jnp.ones(3),), lazy=True)
    assert g.out_spec == describe((jnp.ones(3), None))  # traced at once
    assert g._compiled is None
    out, _ = g(jnp.ones(3))
    assert g._compiled is not None and out.tolist() == [2.0, 2.0, 2.0]


def precise(x: jax.Array) -> jax.Array:
    """A float32 function whose values depend on JAX's 64-bit mode (``float`` is its widest)."""
    return jnp.sin(x.astype(float) * 12345.678).astype(jnp.float32)


def test_a_vjp_compiled_later_uses_the_64_bit_mode_of_the_first_program() -> None:
    # Compiled with the mode off, the VJP was compiled (and the function traced again) with the
    # mode its first call found: on, its outputs and grads were those of the float64
    # computation, other values than the plain call's. Such a call is now refused (the function
    # computes otherwise with the mode on), and compiles nothing.
    x = jnp.asarray(np.linspace(0.1, 2, 4, dtype=np.float32))
    g = dgj.graphed(precise, (x,))
    with x64(), pytest.raises(DualgraphError, match="64-bit mode off"):
        g.vjp(x)
    out, pullback = g.vjp(x)
    (grad,), _ = pullback(jnp.ones(4, jnp.float32))
    np.testing.assert_array_equal(out, g(x))
    np.testing.assert_array_equal(out, precise(x))
    np.testing.assert_array_equal(grad, jax.grad(lambda v: precise(v).sum())(x))


def test_a_call_in_64_bit_mode_where_the_function_computes_otherwise_is_refused() -> None:
    # The program ran in the mode it was compiled in (off): float32 values where the function
    # itself, with the mode on, computes in float64 (and returns float64 from jnp.zeros).
    x = jnp.asarray(np.linspace(0.1, 2, 4, dtype=np.float32))
    g = dgj.graphed(lambda a: (precise(a), jnp.zeros(2)), (x,))
    with x64():
        assert precise(x).tolist() != g.compiled(x)[0].tolist()
        with pytest.raises(DualgraphError, match=r"64-bit mode off and is called with it on"):
            g(x)
        with pytest.raises(DualgraphError, match=r"64-bit mode off and is called with it on"):
            g.vjp(x)
    np.testing.assert_array_equal(g(x)[0], precise(x))


# -- the environment -----------------------------------------------------------------------------


def run_python(code: str, **env: str) -> str:
    path = os.pathsep.join([os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path, **env}
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_turns_preallocation_off_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    importlib.reload(dualgraph.jax._env)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    importlib.reload(dualgraph.jax._env)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_disable_command_buffers_before_the_backend_starts_sets_xla_flags() -> None:
    code = (
        "import os, dualgraph.jax as dgj; dgj.disable_command_buffers(); "
        "import jax.numpy as jnp; print(float(jnp.ones(2).sum()), os.environ['XLA_FLAGS'])"
    )
    assert run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=1") == (
        "2.0 --xla_force_host_platform_device_count=1 --xla_gpu_enable_command_buffer="
    )


def test_importing_the_adapter_without_jax_says_what_to_install() -> None:
    code = (
        "import importlib.abc, sys\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('jax', 'jaxlib'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "try:\n"
        "    import dualgraph.jax\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
        "import dualgraph, numpy\n"  # the core still works without JAX
        "print(dualgraph.describe(numpy.zeros(2, numpy.float32)))\n"
    )
    first, second = run_python(code).splitlines()
    assert first == (
        "ImportError dualgraph.jax needs JAX, which did not import (No module named 'jax'): "
        "pip install dualgraph[jax]"
    )
    assert second == "TreeSpec(float32[2](grad))"


def test_disable_command_buffers_after_the_backend_started_is_an_error() -> None:
    jnp.ones(1).block_until_ready()
    if "--xla_gpu_enable_command_buffer=" in os.environ.get("XLA_FLAGS", "").split():
        pytest.skip("this process was started with command buffers off")
    with pytest.raises(DualgraphError, match="too late"):
        dgj.disable_command_buffers()


# -- adversarial: key dtypes, out_spec types, foreign arrays ---------------------------------------


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys_go_in_and_come_out_as_with_jax_jit(impl: str) -> None:
    def sample(key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array, None]:
        new, sub = jax.random.split(key)
        return x + jax.random.normal(sub, x.shape), new, None

    key, x = jax.random.key(3, impl=impl), jnp.ones(4)
    g = dgj.graphed(sample, (key, x), donate_argnums=0)
    expected = jax.jit(sample)(key, x)
    out = g(jax.random.key(3, impl=impl), x)
    assert np.array_equal(out[0], expected[0]) and out[2] is None
    assert out[1].dtype == expected[1].dtype
    assert np.array_equal(jax.random.key_data(out[1]), jax.random.key_data(expected[1]))
    assert g.out_spec.grad_mask == (True, False)
    (_, dx), _ = g.vjp(jax.random.key(3, impl=impl), x)[1]((jnp.ones(4), None, None))
    assert np.array_equal(dx, jnp.ones(4))


def test_a_key_output_checked_against_an_out_spec_from_json() -> None:
    def fn(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return x * 2, jax.random.key(0)

    written = dgj.graphed(fn, (jnp.ones(2),)).out_spec.to_json()
    g = dgj.graphed(fn, (jnp.ones(2),), out_spec=written)
    assert str(g.out_spec.arrays[1]) == "key<fry>[]"


def test_out_spec_as_json_bytes_is_read_like_json_text() -> None:
    written = describe((np.zeros(2, np.float32), None)).with_grad_mask([False]).to_json()
    g = dgj.graphed(lambda x: (x + 1, None), (jnp.ones(2),), out_spec=written.encode())
    assert g.out_spec.grad_mask == (False,)


@pytest.mark.parametrize("out_spec", [5, ["tuple", 2], object()], ids=repr)
def test_an_out_spec_that_is_no_spec_nor_json_is_refused(out_spec: Any) -> None:
    with pytest.raises(DualgraphError, match="out_spec must be a TreeSpec or its JSON"):
        dgj.graphed(lambda x: (x + 1, None), (jnp.ones(2),), out_spec=out_spec)


FOREIGN_ARRAYS = {
    "torch-tensor": lambda: torch.ones(2),
    "masked-array": lambda: np.ma.array(np.ones(2, np.float32), mask=[True, False]),
}


@pytest.mark.parametrize("make", FOREIGN_ARRAYS.values(), ids=FOREIGN_ARRAYS.keys())
@pytest.mark.parametrize("where", ["args", "kwargs", "cotangent"])
def test_an_array_jax_cannot_take_as_is_is_refused_naming_its_path(make: Any, where: str) -> None:
    # each has the sample's shape and dtype name, so the spec alone accepts it
    g = dgj.graphed(lambda x, *, y: (x * y, None), (jnp.ones(2),), sample_kwargs={"y": jnp.ones(2)})
    foreign = make()
    x = jnp.ones(2)
    if where == "cotangent":
        _, pullback = g.vjp(x, y=x)
        with pytest.raises(
            DualgraphError, match=r"^the pullback of graphed\(\S*<lambda>\): cotangent\[0\] is a "
        ):
            pullback((foreign, None))
        return
    args, kwargs = ((foreign,), {"y": x}) if where == "args" else ((x,), {"y": foreign})
    path = r"args\[0\]" if where == "args" else r"kwargs\['y'\]"
    with pytest.raises(DualgraphError, match=rf"^graphed\(\S*<lambda>\): {path} is a "):
        g(*args, **kwargs)
    with pytest.raises(DualgraphError, match=rf"^graphed\(\S*<lambda>\): {path} is a "):
        g.vjp(*args, **kwargs)
    assert not x.is_deleted()
    assert np.array_equal(g(x, y=x)[0], jnp.ones(2))


@pytest.mark.parametrize(
    "second",
    [
        lambda a: (None, a * 3),  # None and the array swapped
        lambda a: (a * 3, 1),  # a constant where None was
        lambda a: (a[:1], None),  # another shape
    ],
    ids=["swapped", "constant", "shape"],
)
def test_the_vjp_uses_the_trace_made_when_graphed_not_a_new_one(second: Any) -> None:
    # The VJP traced the function again: a function whose second trace differs was refused
    traces: list[int] = []

    def impure(a: jax.Array) -> Any:
        traces.append(1)
        return (a * 2, None) if len(traces) == 1 else second(a)

    g = dgj.graphed(impure, (jnp.ones(2),))
    out, pullback = g.vjp(jnp.ones(2))
    assert out[0].tolist() == [2.0, 2.0] and out[1] is None
    assert pullback((jnp.ones(2), None))[0][0].tolist() == [2.0, 2.0]
    assert len(traces) == 1


def test_python_state_changed_after_graphing_reaches_neither_the_call_nor_the_vjp() -> None:
    # The VJP, traced at its first call, read the new value: g(x) gave 2x, g.vjp(x) 3x
    class Config:
        scale = 2.0

    g = dgj.graphed(lambda x: x * Config.scale, (jnp.ones(2),))
    Config.scale = 3.0
    out, pullback = g.vjp(jnp.ones(2))
    (grad,), _ = pullback(jnp.ones(2))
    assert out.tolist() == g(jnp.ones(2)).tolist() == [2.0, 2.0]
    assert grad.tolist() == [2.0, 2.0]


@pytest.fixture(params=[False, True], ids=["consts", "literals"])
def jaxpr_constants(request: pytest.FixtureRequest) -> Any:
    """JAX's two ways of holding what a function closes over in its trace: the trace's
    constants, or literals in its equations (``jax_use_simplified_jaxpr_constants``)."""
    from jax._src import config as jax_config  # the setting's own context manager

    with jax_config.use_simplified_jaxpr_constants(request.param):
        yield request.param


@pytest.mark.parametrize("lazy", [False, True], ids=["compiled", "lazy"])
def test_a_numpy_array_closed_over_and_written_after_graphing_reaches_neither(
    lazy: bool, jaxpr_constants: bool
) -> None:
    # JAX's trace holds a view of a numpy array the function closes over: the forward was
    # lowered from its values when graphed, the VJP from those at its first call, so after
    # weights[:] = 5 g(x) gave x and g.vjp(x) 5x (its grad 5 too), silently (after the copy
    # kept in the trace's constants, still so where JAX holds them as literals)
    weights = np.ones(3, np.float32)
    g = dgj.graphed(lambda x: x * weights, (jnp.ones(3),), lazy=lazy)
    weights[:] = 5.0
    out, pullback = g.vjp(jnp.ones(3))
    (grad,), _ = pullback(jnp.ones(3))
    assert out.tolist() == g(jnp.ones(3)).tolist() == [1.0] * 3
    assert grad.tolist() == [1.0] * 3
    weights[:] = 7.0
    twin = g.with_compiler_options({"xla_allow_excess_precision": False})
    assert twin.vjp(jnp.ones(3))[0].tolist() == [1.0] * 3


def test_a_broadcast_numpy_array_closed_over_is_kept_without_its_broadcast_made_dense() -> None:
    # The trace's copy of a closed-over numpy array (np.broadcast_to's view of one value,
    # 256 MiB as a dense array) was made dense: graphing allocated all of it and lowered it as
    # a dense constant (1 GiB took 5 s and 1 GiB of memory, where jax.jit lowers a broadcast
    # of the one value in 0.06 s)
    import tracemalloc

    ones = np.broadcast_to(np.float32(1.0), (8192, 8192))
    struct = jax.ShapeDtypeStruct(ones.shape, jnp.float32)
    tracemalloc.start()
    try:
        g = dgj.graphed(lambda x: (x * ones).sum(), (struct,), lazy=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20
    small = np.broadcast_to(np.arange(3, dtype=np.float32)[:, None], (3, 2))
    h = dgj.graphed(lambda x: x * small, (jnp.ones((3, 2)),))
    np.testing.assert_array_equal(h(jnp.ones((3, 2))), small)
    del g


def _shared_with_torch(kind: str) -> tuple[jax.Array, torch.Tensor]:
    """A JAX array and a torch tensor of the same memory (DLPack, either way round)."""
    if kind == "from_torch":
        tensor = torch.ones(3)
        return jax.dlpack.from_dlpack(tensor), tensor
    array = jnp.full(3, 1.0) if kind == "weak_to_torch" else jnp.ones(3, jnp.float32)
    return array, torch.from_dlpack(array)


@pytest.mark.parametrize("lazy", [False, True], ids=["compiled", "lazy"])
@pytest.mark.parametrize("kind", ["from_torch", "to_torch", "weak_to_torch"])
def test_a_jax_array_closed_over_and_written_through_dlpack_reaches_neither(
    kind: str, lazy: bool, jaxpr_constants: bool
) -> None:
    # JAX's trace held the array itself, whose memory torch shares: the forward was lowered from
    # its values when graphed, the VJP from those at its first call, so after torch's mul_(5)
    # g(x) gave 3 and g.vjp(x) 15 (its grad 5), silently
    weights, tensor = _shared_with_torch(kind)
    if tensor.data_ptr() != weights.unsafe_buffer_pointer():
        pytest.skip("DLPack copied here: nothing is shared")
    g = dgj.graphed(lambda x: (x * weights).sum(), (jnp.ones(3),), lazy=lazy)
    tensor.mul_(5.0)
    assert (weights == 5.0).all()  # the function itself (and jax.jit) now computes with 5s
    out, pullback = g.vjp(jnp.ones(3))
    (grad,), _ = pullback(jnp.float32(1.0))
    assert float(out) == float(g(jnp.ones(3))) == 3.0
    assert grad.tolist() == [1.0] * 3
    tensor.mul_(7.0)
    twin = g.with_compiler_options({"xla_allow_excess_precision": False})
    assert float(twin.vjp(jnp.ones(3))[0]) == 3.0


# -- weakly typed inputs (from Python scalars): JAX promotes them differently ---------------------


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    return x + y


def test_a_weakly_typed_sample_is_compiled_as_jax_jit_would() -> None:
    # bfloat16 + a weakly typed float32 scalar is bfloat16 in eager JAX and under jax.jit
    x, weak = jnp.ones(2, jnp.bfloat16), jnp.asarray(2.0)
    assert weak.weak_type
    g = dgj.graphed(add, (x, weak))
    expected = jax.jit(add)(x, weak)
    assert expected.dtype == jnp.bfloat16
    for _ in range(2):
        got = g(x, jnp.asarray(3.0))
        assert got.dtype == jnp.bfloat16 and got.tolist() == [4.0, 4.0]
    assert str(g.out_spec) == "TreeSpec(bfloat16[2](grad))"
    out, pullback = g.vjp(x, weak)
    assert out.dtype == jnp.bfloat16
    (dx, dweak), _ = pullback(jnp.ones(2, jnp.bfloat16))
    assert dx.dtype == jnp.bfloat16 and dweak.dtype == jnp.float32 and float(dweak) == 2.0


@pytest.mark.parametrize("sample_weak", [True, False], ids=["weak-sample", "strong-sample"])
def test_a_call_whose_weak_typing_differs_from_the_sample_is_refused(sample_weak: bool) -> None:
    def make(value: float) -> jax.Array:
        return jnp.asarray(value) if sample_weak else jnp.float32(value)

    def other(value: float) -> jax.Array:
        return jnp.float32(value) if sample_weak else jnp.asarray(value)

    x = jnp.ones(2, jnp.bfloat16)
    g = dgj.graphed(lambda a, *, y: a + y, (x,), sample_kwargs={"y": make(2.0)})
    want, got = ("weakly", "strongly") if sample_weak else ("strongly", "weakly")
    message = rf"kwargs\['y'\]: expected a {want} typed float32\[\], got a {got} typed one"
    with pytest.raises(SpecMismatchError, match=message):
        g(x, y=other(2.0))
    with pytest.raises(SpecMismatchError, match=message):
        g.vjp(x, y=other(2.0))
    assert g(x, y=make(2.0)).dtype == jax.jit(lambda a, y: a + y)(x, make(2.0)).dtype


def test_a_weakly_typed_donated_input_is_refused_before_it_is_consumed() -> None:
    g = dgj.graphed(add, (jnp.ones(()), jnp.ones(())), donate_argnums=0)
    weak = jnp.asarray(1.0)
    with pytest.raises(SpecMismatchError, match=r"args\[0\]: expected a strongly typed"):
        g(weak, jnp.ones(()))
    assert not weak.is_deleted()


def test_numpy_inputs_are_strongly_typed() -> None:
    g = dgj.graphed(add, (np.ones(2, np.float32), np.ones((), np.float32)))
    assert g(np.ones(2, np.float32), np.ones((), np.float32)).tolist() == [2.0, 2.0]
    assert g(jnp.ones(2), jnp.float32(1.0)).tolist() == [2.0, 2.0]


def test_weak_typing_that_changes_nothing_is_accepted() -> None:
    # `s > 0` is the same program for a weak and a strong s, and the outputs' typing is the
    # same: no reason to refuse
    g = dgj.graphed(lambda s, x: (jnp.where(s > 0, x, -x), None), (jnp.ones(3), jnp.ones(3)))
    s, x = jnp.full(3, -2.0), jnp.full(3, 5.0, jnp.float32)  # jnp.full of a float is weak
    out, _ = g(s, x)
    assert s.weak_type and out.tolist() == [-5.0] * 3
    assert not out.weak_type and not jax.jit(g.fn)(s, x)[0].weak_type
    assert g(jnp.ones(3), jnp.asarray(2.0) * jnp.ones(3))[0].tolist() == [2.0] * 3


@pytest.mark.parametrize("sample_weak", [True, False], ids=["weak-sample", "strong-sample"])
def test_a_vjp_weakly_typed_otherwise_than_the_sample_types_its_grads_as_jax_jit(
    sample_weak: bool,
) -> None:
    # `s > 0` is the same program for a weak and a strong s, so the call is accepted; but
    # jax.vjp gives s's (zero) grad s's own weak type: the VJP compiled for the sample's
    # typing gave it the sample's, and `bfloat16 + ds` was float32 where eager's is bfloat16
    # (or the reverse)
    def flip(s: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.where(s > 0, x, -x)

    weak, strong = jnp.full(3, 2.0), jnp.ones(3, jnp.float32)
    sample, other = (weak, strong) if sample_weak else (strong, weak)
    x, ones = jnp.full(3, 5.0, jnp.float32), jnp.ones(3, jnp.float32)
    g = dgj.graphed(flip, (sample, x))
    for s in (other, sample, other):
        out, pullback = g.vjp(s, x)
        (ds, dx), _ = pullback(ones)
        eager = jax.vjp(flip, s, x)[1](ones)
        jitted = jax.jit(lambda s, x, ct: jax.vjp(flip, s, x)[1](ct))(s, x, ones)
        assert ds.weak_type == eager[0].weak_type == jitted[0].weak_type == s.weak_type
        bf = jnp.ones(3, jnp.bfloat16)
        assert (bf + ds).dtype == (bf + eager[0]).dtype
        assert out.tolist() == [5.0] * 3 and dx.tolist() == [1.0] * 3 and ds.tolist() == [0] * 3


@pytest.mark.parametrize("sample_weak", [True, False], ids=["weak-sample", "strong-sample"])
def test_a_call_that_changes_only_the_outputs_weak_types_is_refused(sample_weak: bool) -> None:
    # `s * 2` is the same program for a weak and a strong s, but jax.jit returns a weak output
    # for a weak s: the graphed output kept the sample's typing, and `bfloat16 + out` was
    # float32 where jax.jit's gave bfloat16 (or the reverse)
    weak, strong = jnp.asarray(3.0), jnp.float32(3.0)
    sample, other = (weak, strong) if sample_weak else (strong, weak)
    g = dgj.graphed(lambda s: s * 2, (sample,))
    with pytest.raises(SpecMismatchError, match=r"^args\[0\]: expected a \w+ typed float32\[\]"):
        g(other)
    assert g(sample).weak_type == jax.jit(g.fn)(sample).weak_type == sample_weak


@pytest.mark.parametrize("cotangent_weak", [True, False], ids=["weak-cotangent", "strong"])
def test_a_pullbacks_grads_are_typed_weakly_as_jax_jits_for_its_cotangents(
    cotangent_weak: bool,
) -> None:
    # jax.vjp (eager or under jax.jit) of a weak s (a learnable scalar made as
    # jnp.asarray(1.0)) gives a weak grad for a weak cotangent (jnp.ones_like of the weak
    # output): the pullback, compiled for strong cotangents only, gave it strong, and
    # `bfloat16 + grad` was float32 where eager's is bfloat16
    def scaled(s: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return s * 2, x * 3

    s, x = jnp.asarray(3.0), jnp.ones(2, jnp.bfloat16)
    g = dgj.graphed(scaled, (s, x))
    (doubled, out), pullback = g.vjp(s, x)
    ones = jnp.ones_like(doubled) if cotangent_weak else jnp.float32(1.0)
    assert ones.weak_type == cotangent_weak
    cotangent = (ones, jnp.ones_like(out))
    eager = jax.vjp(scaled, s, x)[1](cotangent)
    jitted = jax.jit(lambda s, x, ct: jax.vjp(scaled, s, x)[1](ct))(s, x, cotangent)
    for _ in range(2):
        (ds, dx), _ = pullback(cotangent)
        assert ds.weak_type == eager[0].weak_type == jitted[0].weak_type == cotangent_weak
        assert (x + ds).dtype == (x + eager[0]).dtype
        assert float(ds) == float(eager[0]) == 2.0 and dx.tolist() == eager[1].tolist()


def test_an_input_on_another_device_is_refused_naming_its_path() -> None:
    code = (
        "import jax, jax.numpy as jnp, dualgraph.jax as dgj\n"
        "from dualgraph import DualgraphError\n"
        "g = dgj.graphed(lambda x, y: x * y, (jnp.ones(2), jnp.ones(2)))\n"
        "other = jax.device_put(jnp.ones(2), jax.devices()[1])\n"
        "kept = jnp.ones(2)\n"
        "try:\n"
        "    g(kept, other)\n"
        "except DualgraphError as error:\n"
        "    print(error)\n"
        "print(float(g(kept, jnp.ones(2)).sum()))\n"  # the callable still works
    )
    out = run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    first, second = out.splitlines()
    assert first.startswith("args[1]: an array on cpu:1, but graphed programs are compiled for ")
    assert second == "2.0"


def test_a_function_graphed_for_another_device_keeps_it_for_its_vjp_and_errors() -> None:
    # The VJP was compiled for the default device of its first call: the committed input on
    # cpu:1 was refused there (an uncommitted one went to cpu:0), and an input on cpu:0 given to
    # the plain program leaked JAX's ValueError, the check naming the default device of the call
    code = (
        "import jax, jax.numpy as jnp, dualgraph.jax as dgj\n"
        "from dualgraph import DualgraphError\n"
        "d = jax.devices()\n"
        "x = jax.device_put(jnp.ones(2), d[1])\n"
        "with jax.default_device(d[1]):\n"
        "    g = dgj.graphed(lambda x: x * 2, (x,))\n"
        "out, pullback = g.vjp(x)\n"
        "(grad,), _ = pullback(jax.device_put(jnp.ones(2), d[1]))\n"
        "print(out.devices() == g(x).devices() == grad.devices() == {d[1]})\n"
        "try:\n"
        "    g(jax.device_put(jnp.ones(2), d[0]))\n"
        "except DualgraphError as error:\n"
        "    print(error)\n"
    )
    out = run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    first, second = out.splitlines()
    assert first == "True"
    assert second.startswith("args[0]: an array on cpu:0, but graphed programs are compiled for ")
    assert "when graphed, cpu:1" in second


def test_a_cotangent_on_another_device_is_refused_naming_its_path() -> None:
    # the pullback's program refused it with JAX's ValueError, which named no path
    code = (
        "import jax, jax.numpy as jnp, dualgraph.jax as dgj\n"
        "from dualgraph import DualgraphError\n"
        "g = dgj.graphed(lambda x: {'y': x * 2}, (jnp.ones(2),))\n"
        "_, pullback = g.vjp(jnp.ones(2))\n"
        "try:\n"
        "    pullback({'y': jax.device_put(jnp.ones(2), jax.devices()[1])})\n"
        "except DualgraphError as error:\n"
        "    print(error)\n"
        "print(float(pullback({'y': jnp.ones(2)})[0][0].sum()))\n"  # the pullback still works
    )
    out = run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    first, second = out.splitlines()
    assert first.startswith("cotangent['y']: an array on cpu:1, but graphed programs are ")
    assert second == "4.0"


def test_a_deleted_cotangent_is_refused_naming_its_path() -> None:
    # JAX's RuntimeError ("Array has been deleted") named no path
    g = dgj.graphed(lambda x: {"y": x * 2}, (jnp.ones(2),))
    _, pullback = g.vjp(jnp.ones(2))
    cotangent = jnp.ones(2)
    cotangent.delete()
    with pytest.raises(DualgraphError, match=r"^cotangent\['y'\]: this array has been deleted"):
        pullback({"y": cotangent})
    assert pullback({"y": jnp.ones(2)})[0][0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("how", ["donated", "deleted", "weak_deleted", "key_deleted"])
def test_a_vjp_after_a_closed_over_array_was_deleted_runs_on_the_values_kept_when_graphed(
    how: str,
) -> None:
    # The VJP, traced at its first call, read the deleted array: JAX's RuntimeError escaped
    # (later refused by name); the trace now keeps its own copy, as the compiled forward does
    closed_over = jnp.full(3, 1.0) if how == "weak_deleted" else jnp.ones(3)
    key = jax.random.key(0)

    def fn(x: jax.Array) -> jax.Array:
        return x + (jax.random.normal(key, (3,)) if how == "key_deleted" else closed_over)

    g = dgj.graphed(fn, (jnp.ones(3),), donate_argnums=0)
    want = g(jnp.ones(3)).tolist()
    if how == "donated":
        g(closed_over)
    else:
        (key if how == "key_deleted" else closed_over).delete()
    out, pullback = g.vjp(jnp.ones(3))
    assert out.tolist() == g(jnp.ones(3)).tolist() == want
    assert pullback(jnp.ones(3))[0][0].tolist() == [1.0, 1.0, 1.0]


def transposed_array() -> jax.Array:
    """A JAX array in another memory layout than a compiled program's (from DLPack of a
    transposed torch tensor), which jax.jit takes as it is; on JAX's default device (a GPU's
    array from a CPU tensor would be refused as on another device)."""
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    return jax.dlpack.from_dlpack(torch.arange(12.0, device=device).reshape(3, 4).t())


@pytest.mark.parametrize("donate", [(), 0], ids=["kept", "donated"])
def test_an_input_in_another_memory_layout_is_taken_as_jax_jit_takes_it(donate: Any) -> None:
    g = dgj.graphed(lambda x: (x * 2, None), (jnp.ones((4, 3)),), donate_argnums=donate)
    x = transposed_array()
    expected = np.asarray(x) * 2
    out, _ = g(x)
    np.testing.assert_array_equal(out, expected)
    assert x.is_deleted() == bool(donate == 0)
    y = transposed_array()
    (out, _), pullback = g.vjp(y)
    np.testing.assert_array_equal(out, expected)
    (grad,), _ = pullback((transposed_array(), None))
    np.testing.assert_array_equal(grad, np.asarray(transposed_array()) * 2)
    assert y.is_deleted() == bool(donate == 0)


# -- JAX settings changed after graphing ---------------------------------------------------------


@pytest.fixture
def jax_setting() -> Any:
    """``set(name, value)``: a JAX setting changed for the test, put back afterwards."""
    saved: dict[str, Any] = {}

    def set_setting(name: str, value: Any) -> None:
        saved.setdefault(name, getattr(jax.config, name))
        jax.config.update(name, value)

    yield set_setting
    for name, value in saved.items():
        jax.config.update(name, value)


def uniform_from_seed(seed: jax.Array) -> jax.Array:
    return jax.random.uniform(jax.random.key(seed), (3,))


def test_a_call_after_threefry_partitionable_changed_is_refused_naming_it(jax_setting: Any) -> None:
    # The program kept the old random bits where the function (and jax.jit) gave new ones.
    seed = jnp.asarray(1, jnp.uint32)
    g = dgj.graphed(uniform_from_seed, (seed,))
    before = jax.config.jax_threefry_partitionable
    jax_setting("jax_threefry_partitionable", not before)
    assert not np.array_equal(uniform_from_seed(seed), g.compiled(seed)[0])
    with pytest.raises(DualgraphError, match=rf"jax_threefry_partitionable={before!r}.*now"):
        g(seed)
    jax_setting("jax_threefry_partitionable", before)
    np.testing.assert_array_equal(g(seed), uniform_from_seed(seed))


def test_a_call_after_the_default_prng_impl_changed_is_refused_naming_it(jax_setting: Any) -> None:
    seed = jnp.asarray(1, jnp.uint32)
    g = dgj.graphed(uniform_from_seed, (seed,))
    jax_setting("jax_default_prng_impl", "rbg")
    with pytest.raises(DualgraphError, match=r"jax_default_prng_impl='threefry2x32'.*'rbg'"):
        g(seed)


def test_a_call_after_rank_promotion_was_set_to_raise_is_refused(jax_setting: Any) -> None:
    # Eager raises on the implicit broadcast; the program broadcast anyway.
    g = dgj.graphed(operator.add, (jnp.ones((3, 1)), jnp.ones(3)))
    jax_setting("jax_numpy_rank_promotion", "raise")
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
        g.fn(jnp.ones((3, 1)), jnp.ones(3))
    with pytest.raises(DualgraphError, match=r"jax_numpy_rank_promotion='allow'.*'raise' now"):
        g(jnp.ones((3, 1)), jnp.ones(3))


def test_a_call_under_another_matmul_precision_is_refused_before_donating() -> None:
    x = jnp.ones((4, 4))
    g = dgj.graphed(lambda a: a @ a, (x,), donate_argnums=0)
    refused = pytest.raises(DualgraphError, match=r"jax_default_matmul_precision=None")
    with jax.default_matmul_precision("bfloat16"), refused:
        g(x)
    assert not x.is_deleted()
    np.testing.assert_array_equal(g(x), np.full((4, 4), 4.0, np.float32))


def test_a_pullback_called_under_another_setting_is_refused() -> None:
    x = jnp.ones((4, 4))
    g = dgj.graphed(lambda a: a @ a, (x,))
    _, pullback = g.vjp(x)
    refused = pytest.raises(DualgraphError, match=r"\(its pullback\) was graphed under")
    with jax.default_matmul_precision("float32"), refused:
        pullback(jnp.ones((4, 4)))
    (grad,), _ = pullback(jnp.ones((4, 4)))
    np.testing.assert_array_equal(grad, np.full((4, 4), 8.0, np.float32))


def test_the_64_bit_mode_does_not_refuse_a_call_the_program_keeps_its_own() -> None:
    x = jnp.ones(2)
    g = dgj.graphed(lambda a: a * 2, (x,))
    with x64():
        np.testing.assert_array_equal(g(x), np.full(2, 2.0, np.float32))


def test_a_call_under_disable_jit_is_refused_naming_fn() -> None:
    # JAX's ahead-of-time executable raised its own ValueError, naming no path.
    x = jnp.ones(2)
    g = dgj.graphed(lambda a: a * 2, (x,), donate_argnums=0)
    _, pullback = g.vjp(jnp.ones(2))
    with jax.disable_jit():
        with pytest.raises(DualgraphError, match=r"under jax.disable_jit\(\).*\.fn"):
            g(x)
        with pytest.raises(DualgraphError, match=r"under jax.disable_jit\(\)"):
            g.vjp(x)
        with pytest.raises(DualgraphError, match=r"under jax.disable_jit\(\)"):
            pullback(jnp.ones(2))
    assert not x.is_deleted()


# -- jax_debug_nans / jax_debug_infs -------------------------------------------------------------


def test_a_nan_output_under_debug_nans_is_a_floating_point_error_as_eager(jax_setting: Any) -> None:
    # The compiled program's check leaked JAX's private InternalFloatingPointError.
    g = dgj.graphed(jnp.log, (jnp.ones(3),))
    jax_setting("jax_debug_nans", True)
    with pytest.raises(FloatingPointError):
        g.fn(-jnp.ones(3))
    with pytest.raises(dgj.NonFiniteError, match=r"graphed\(\S*log\): .* a NaN .*\.fn"):
        g(-jnp.ones(3))
    with pytest.raises(dgj.NonFiniteError):
        g.vjp(-jnp.ones(3))
    assert issubclass(dgj.NonFiniteError, DualgraphError)


def test_a_nan_grad_under_debug_nans_is_a_floating_point_error_naming_the_pullback(
    jax_setting: Any,
) -> None:
    g = dgj.graphed(jnp.sqrt, (jnp.ones(3),))
    _, pullback = g.vjp(jnp.zeros(3))  # sqrt(0) is finite, its grad is not
    jax_setting("jax_debug_infs", True)
    with pytest.raises(dgj.NonFiniteError, match=r"^the pullback of graphed\(\S*sqrt\): .*an inf"):
        pullback(jnp.ones(3))


def test_a_donated_input_the_failing_call_consumed_is_not_blamed(jax_setting: Any) -> None:
    # The error said the input had been "donated to an earlier call": this call consumed it.
    x = -jnp.ones(3)
    g = dgj.graphed(lambda a: (jnp.log(a), a * 2), (x,), donate_argnums=0)
    jax_setting("jax_debug_nans", True)
    with pytest.raises(dgj.NonFiniteError) as raised:
        g(x)
    assert "earlier call" not in str(raised.value)
    assert x.is_deleted()  # consumed, as by every call that ran


@dualgraph.register_dataclass
@dataclasses.dataclass
class DoubledOutput:
    x: Any

    def __post_init__(self) -> None:
        self.x = self.x * 2


def test_an_output_class_that_changes_its_fields_is_refused_not_changed_twice() -> None:
    # The rebuilt output ran __post_init__ a second time: [4, 4] where the function gave [2, 2].
    g = dgj.graphed(DoubledOutput, (jnp.ones(2),))
    with pytest.raises(DualgraphError, match=r"DoubledOutput did not keep field 'x'"):
        g(jnp.ones(2))


def test_an_out_spec_with_a_dict_in_another_key_order_is_refused_naming_it() -> None:
    # It was accepted (a spec matches a dict in any order), and out_spec came back in the
    # function's order, another spec (and JSON) than the one written.
    written = describe([{"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}])
    with pytest.raises(
        SpecMismatchError, match=r"output\[0\] is a dict .*\['b', 'a'\].*\['a', 'b'\]"
    ):
        dgj.graphed(lambda x: [{"b": x, "a": x * 2}], (jnp.ones(2),), out_spec=written.to_json())


def test_a_twin_with_other_compiler_options_runs_the_same_trace_rounded_as_asked() -> None:
    traced = []

    def fn(a: jax.Array) -> jax.Array:
        traced.append(1)
        return (a.astype(jnp.bfloat16) * 3).astype(jnp.float32)

    x = jnp.asarray(np.random.default_rng(0).standard_normal(64), jnp.float32)
    g = dgj.graphed(fn, (x,), donate_argnums=0)
    twin = g.with_compiler_options({"xla_allow_excess_precision": False})
    out = twin(jnp.copy(x))
    (vjp_out, _) = twin.vjp(jnp.copy(x))
    assert len(traced) == 1  # traced once, when graphed
    rounded = (np.asarray(x).astype(ml_dtypes.bfloat16) * 3).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out), rounded)
    np.testing.assert_array_equal(np.asarray(vjp_out), rounded)
    assert twin.compiler_options == {"xla_allow_excess_precision": False}
    assert g.compiler_options == {} and twin.out_spec == g.out_spec
    assert twin.donate_argnums == (0,)
    if jax.default_backend() == "cpu":  # XLA's CPU keeps the excess (GPU run Y rounded both)
        assert not np.array_equal(np.asarray(g(jnp.copy(x))), rounded)  # what the option changes


NON_NATIVE = np.dtype("float32").newbyteorder()  # the other byte order than this machine's


def test_an_output_of_the_other_byte_order_is_refused_by_its_spec_naming_its_path() -> None:
    # the core names such a dtype apart (it refuses to describe it), before the adapter's check
    with pytest.raises(DualgraphError, match=r"^output\[1\]: a \w+-endian float32 array"):
        dgj.graphed(lambda x: (x, np.ones(2, NON_NATIVE)), (jnp.ones(2),))


@pytest.mark.parametrize("where", ["args", "kwargs", "cotangent"])
def test_an_input_of_the_other_byte_order_fails_the_spec_check_naming_its_path(where: str) -> None:
    g = dgj.graphed(lambda x, *, y: (x * y, None), (jnp.ones(2),), sample_kwargs={"y": jnp.ones(2)})
    odd = np.ones(2, NON_NATIVE)
    x = jnp.ones(2)
    expected = r": expected float32\[2\], got \w+-endian float32\[2\]$"
    if where == "cotangent":
        _, pullback = g.vjp(x, y=x)
        with pytest.raises(SpecMismatchError, match=r"^cotangent\[0\]" + expected):
            pullback((odd, None))
        return
    args, kwargs = ((odd,), {"y": x}) if where == "args" else ((x,), {"y": odd})
    path = r"args\[0\]" if where == "args" else r"kwargs\['y'\]"
    with pytest.raises(SpecMismatchError, match="^" + path + expected):
        g(*args, **kwargs)
    with pytest.raises(SpecMismatchError, match="^" + path + expected):
        g.vjp(*args, **kwargs)
    assert not x.is_deleted()
    assert np.array_equal(g(x, y=x)[0], jnp.ones(2))


class _ScaleDefaulted(collections.namedtuple("_ScaleDefaulted", "h scale")):
    """A namedtuple whose __new__ makes a scale of 1.0 where it is given None."""

    def __new__(cls, h: Any, scale: Any = None) -> _ScaleDefaulted:
        return super().__new__(cls, h, 1.0 if scale is None else scale)


def test_a_cotangent_spec_is_rebuilt_by_the_spec_refusing_a_class_that_changes_its_none() -> None:
    # Before: keep_arrays put None at the constant through optree's tree_map, which called the
    # class bare: its __new__ made 1.0 there, and the cotangent spec held the constant 1.0
    # where the output held 2.0, silently
    from dualgraph.jax._trees import keep_arrays

    spec = describe((_ScaleDefaulted(np.zeros(2, np.float32), 2.0),))
    with pytest.raises(
        DualgraphError,
        match=r"^unflatten: \[0\]: rebuilding a \S*_ScaleDefaulted raised DualgraphError: .* did "
        r"not keep its items as given",
    ):
        keep_arrays(spec, [True])


def scaled(x: jax.Array, scale: float = 2.0, shift: jax.Array | None = None) -> jax.Array:
    """A function with defaults, to call spelled otherwise than its sample."""
    return x * scale if shift is None else x * scale + shift


#: name -> (sample args, sample kwargs, a call of x spelled otherwise: eager binds it alike)
RESPELLINGS: dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]] = {
    "default_by_position": ((), {}, lambda x: ((x, 2.0), {})),
    "default_by_keyword": ((), {}, lambda x: ((x,), {"scale": 2.0})),
    "keyword_by_position": ((), {"scale": 3.0}, lambda x: ((x, 3.0), {})),
    "position_by_keyword": ((3.0,), {}, lambda x: ((x,), {"scale": 3.0})),
    "everything_by_keyword": ((3.0,), {}, lambda x: ((), {"scale": 3.0, "x": x})),
    "default_left_out": ((2.0,), {}, lambda x: ((x,), {})),
    "none_default_passed": ((), {}, lambda x: ((x,), {"shift": None})),
}


@pytest.mark.parametrize("name", list(RESPELLINGS))
def test_a_call_spelled_otherwise_than_the_sample_runs_as_the_function(name: str) -> None:
    # Before: g(x, 2.0) for a sample g(x) was refused ("args[1]: unexpected extra positional
    # argument"), as was any other spelling the function binds alike.
    sample_args, sample_kwargs, respell = RESPELLINGS[name]
    g = dgj.graphed(scaled, (jnp.ones(3), *sample_args), sample_kwargs=sample_kwargs)
    for seed in (1, 2):
        x = jnp.arange(3.0) + seed
        args, kwargs = respell(x)
        np.testing.assert_array_equal(g(*args, **kwargs), scaled(*args, **kwargs))
        out, pullback = g.vjp(*args, **kwargs)
        rest = functools.partial(scaled_of_x, args[1:], _without_x(kwargs))
        want, want_pullback = jax.vjp(rest, x)
        np.testing.assert_array_equal(out, want)
        args_grads, kwargs_grads = pullback(jnp.full(3, 0.5))
        (dx,) = want_pullback(jnp.full(3, 0.5))
        found = kwargs_grads["x"] if "x" in kwargs else args_grads[0]
        np.testing.assert_array_equal(found, dx)


def scaled_of_x(rest: tuple[Any, ...], kwargs: dict[str, Any], x: jax.Array) -> jax.Array:
    return scaled(x, *rest, **kwargs)


def _without_x(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "x"}


def _scale_three(fn: Any) -> Any:
    """A decorator giving ``scale`` a default of its own (as configuration decorators do);
    ``functools.wraps`` makes ``inspect.signature`` show the wrapped function's."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{"scale": 3.0, **kwargs})

    return wrapper


def test_a_wrapped_function_spelled_otherwise_is_bound_as_the_wrapper_binds_it() -> None:
    # Before: g(x, scale=2.0) for a sample g(x) was written g(x) by the wrapped function's
    # signature (its default is 2.0) and ran the program of scale 3.0: [3, 3, 3] where the
    # function gives [2, 2, 2], silently. The wrapper collects scale in its **kwargs.
    wrapped = _scale_three(scaled)
    g = dgj.graphed(wrapped, (jnp.ones(3),), donate_argnums=0)
    x = jnp.ones(3)
    for args, kwargs in (((x,), {"scale": 2.0}), ((x, 2.0), {})):
        with pytest.raises(SpecMismatchError, match=r"^(kwargs\['scale'\]|args\[1\]): unexpected"):
            g(*args, **kwargs)
        assert not x.is_deleted()
    np.testing.assert_array_equal(g(x), wrapped(jnp.ones(3)))


def test_a_respelled_vjp_gives_grads_as_the_call_spells_its_arguments() -> None:
    def product(w: jax.Array, x: jax.Array, scale: float = 1.0) -> jax.Array:
        return (w * x).sum() * scale

    w, x = jnp.arange(3.0), jnp.full(3, 2.0)
    g = dgj.graphed(product, (w, x))
    _, pullback = g.vjp(x=x, w=w, scale=1.0)
    args_grads, kwargs_grads = pullback(jnp.float32(1.0))
    assert args_grads == ()
    assert list(kwargs_grads) == ["x", "w", "scale"]  # the call's order
    np.testing.assert_array_equal(kwargs_grads["x"], w)
    np.testing.assert_array_equal(kwargs_grads["w"], x)
    assert kwargs_grads["scale"] is None
    _, pullback = g.vjp(w, x=x)
    (dw,), kwargs_grads = pullback(jnp.float32(1.0))
    np.testing.assert_array_equal(dw, x)
    np.testing.assert_array_equal(kwargs_grads["x"], w)


@pytest.mark.parametrize(
    ("call", "path", "shown"),
    [
        (lambda x: ((x, 3.0), {}), "args[1]", "float 3.0"),
        (lambda x: ((x,), {"scale": 2}), "kwargs['scale']", "int 2"),
        (lambda x: ((x,), {"shift": jnp.ones(3)}), "kwargs['shift']", "float32[3]"),
    ],
    ids=["other_value_by_position", "int_for_float_by_keyword", "array_for_none"],
)
def test_a_default_the_sample_left_out_passed_otherwise_is_refused_naming_its_path(
    call: Any, path: str, shown: str
) -> None:
    # The program holds the default; the function would compute with the value passed.
    g = dgj.graphed(scaled, (jnp.ones(3),), donate_argnums=0)
    x = jnp.ones(3)
    args, kwargs = call(x)
    for run in (g, g.vjp):
        with pytest.raises(SpecMismatchError) as info:
            run(*args, **kwargs)
        assert info.value.path == path
        assert str(info.value).startswith(f"{path}: {shown}")
        assert "where the sample call left" in str(info.value)
        assert not x.is_deleted()  # refused before anything was donated
    np.testing.assert_array_equal(g(x), scaled(jnp.ones(3)))


def test_an_argument_the_sample_passed_and_a_call_leaves_to_another_default_is_missing() -> None:
    g = dgj.graphed(scaled, (jnp.ones(3),), sample_kwargs={"scale": 3.0})
    with pytest.raises(SpecMismatchError) as info:
        g(jnp.ones(3))  # the function: scale=2.0
    assert str(info.value) == "kwargs['scale']: missing (expected float 3.0)"


def test_a_respelled_calls_errors_name_paths_as_the_call_spells_them() -> None:
    def pair(w: jax.Array, x: jax.Array) -> jax.Array:
        return w * x

    g = dgj.graphed(pair, (jnp.ones(3), jnp.ones(3)), donate_argnums=0)
    with pytest.raises(SpecMismatchError, match=r"^kwargs\['x'\]: expected float32\[3\], got"):
        g(jnp.ones(3), x=jnp.ones(4))
    with pytest.raises(SpecMismatchError, match=r"^kwargs\['w'\]: expected float32\[3\], got"):
        g(x=jnp.ones(3), w=jnp.ones(2))
    shared = jnp.ones(3)
    with pytest.raises(DualgraphError, match=r"^kwargs\['w'\] is donated, .* as kwargs\['x'\]"):
        g(w=shared, x=shared)
    assert not shared.is_deleted()
    weak = dgj.graphed(pair, (jnp.ones(3, jnp.bfloat16), jnp.float32(2.0)))
    with pytest.raises(SpecMismatchError, match=r"^kwargs\['x'\]: expected a strongly typed"):
        weak(jnp.ones(3, jnp.bfloat16), x=jnp.asarray(2.0))  # bfloat16 out, where float32
    w = jnp.ones(3)
    g(w=w, x=jnp.ones(3))
    with pytest.raises(DualgraphError, match=r"^kwargs\['w'\]: this array has been deleted"):
        g(w=w, x=jnp.ones(3))


def _in_memory(x: jax.Array, kind: str) -> jax.Array:
    device = jax.devices()[0]
    if kind not in [m.kind for m in device.addressable_memories()]:
        pytest.skip(f"no {kind} memory on {device}")
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
@pytest.mark.parametrize("where", ["call", "vjp", "cotangent"])
def test_an_input_in_another_memory_kind_is_refused_naming_its_path(kind: str, where: str) -> None:
    # Before: JAX's ValueError leaked, naming the flat index ("Argument args[1]", or
    # "arrays[1]", "cotangents[1]"): another input than the path where it is passed.
    def fn(x: jax.Array, *, m: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return x * 2, x + m["a"]

    g = dgj.graphed(fn, (jnp.ones(3),), sample_kwargs={"m": {"a": jnp.ones(3)}}, donate_argnums=0)
    x, other = jnp.ones(3), _in_memory(jnp.ones(3), kind)
    if where == "cotangent":
        _, pullback = g.vjp(x, m={"a": jnp.ones(3)})
        path = r"cotangent\[1\]"
        with pytest.raises(DualgraphError, match=rf"^{path}: an array in .*'{kind}' memory"):
            pullback((jnp.ones(3), other))
        return
    with pytest.raises(DualgraphError, match=rf"^kwargs\['m'\]\['a'\]: an array in .*'{kind}'"):
        (g if where == "call" else g.vjp)(x, m={"a": other})
    assert not x.is_deleted()
    np.testing.assert_array_equal(g(x, m={"a": jnp.ones(3)})[1], jnp.full(3, 2.0))


@dataclasses.dataclass
class _Counted:
    """A registered dataclass whose __post_init__ refuses a count that is not a positive int."""

    w: Any
    count: Any

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count <= 0:
            raise ValueError("count must be a positive int")


dualgraph.register_dataclass(_Counted)


@pytest.mark.parametrize(
    ("where", "path"),
    [("args", r"args\[1\]"), ("kwargs", r"kwargs\['c'\]"), ("output", r"output\[1\]")],
)
def test_a_class_refusing_the_none_of_its_grad_tree_is_named_by_its_path(
    where: str, path: str
) -> None:
    # Before: "unflatten: [0]: rebuilding a _Counted raised ValueError ...": a path of no tree
    # the caller passed (args[1], kwargs['c'] or the output's [1] all read as [0]).
    def fn(x: jax.Array, c: _Counted | None = None, **kwargs: _Counted) -> Any:
        counted = c if c is not None else kwargs["c"]
        return x * 2, (counted if where == "output" else None)

    x, counted = jnp.ones(2), _Counted(jnp.ones(2), 3)
    args, kwargs = ((x, counted), {}) if where != "kwargs" else ((x,), {"c": counted})
    g = dgj.graphed(fn, args, sample_kwargs=kwargs, donate_argnums=0)
    np.testing.assert_array_equal(g(jnp.ones(2), *args[1:], **kwargs)[0], jnp.full(2, 2.0))
    fresh = jnp.ones(2)
    what = "cotangents" if where == "output" else "gradients"
    with pytest.raises(
        DualgraphError,
        match=rf"^graphed\(.*\): the tree of {what} of {where} holds None at its constants .*: "
        rf"unflatten: {path}: rebuilding a \S*_Counted raised ValueError: count must be",
    ):
        g.vjp(fresh, *args[1:], **kwargs)
    assert not fresh.is_deleted()  # refused before anything was donated


def test_a_keyword_named_as_a_positional_only_parameter_is_named_as_passed() -> None:
    # Before: "args[0]: expected float32[2], got float32[3]", the other argument.
    def fn(a: jax.Array, /, **more: jax.Array) -> jax.Array:
        return a + more["a"]

    g = dgj.graphed(fn, (jnp.ones(2),), sample_kwargs={"a": jnp.ones(2)})
    with pytest.raises(SpecMismatchError) as info:
        g(jnp.ones(2), a=jnp.ones(3))
    assert str(info.value) == "kwargs['a']: expected float32[2], got float32[3]"
    assert info.value.path == "kwargs['a']"


def test_a_vjp_with_keywords_in_another_order_gives_kwargs_grads_in_the_calls_order() -> None:
    # Before: ({'b': db, 'a': da}) for a call passing a=, b=: the sample's order, so zipping
    # the call's kwargs with the grads paired a with db.
    def fn(x: jax.Array, *, a: jax.Array, b: jax.Array) -> jax.Array:
        return (x * a + 2 * b).sum()

    x, a, b = jnp.ones(2), jnp.arange(2.0), jnp.arange(2.0) + 3
    g = dgj.graphed(fn, (x,), sample_kwargs={"b": b, "a": a})
    kwargs = {"a": a, "b": b}
    _, pullback = g.vjp(x, **kwargs)
    _, kwargs_grads = pullback(jnp.float32(1.0))
    assert list(kwargs_grads) == ["a", "b"]
    (want,) = jax.vjp(lambda kw: fn(x, **kw), kwargs)[1](jnp.float32(1.0))
    for (name, grad), expected in zip(kwargs_grads.items(), [x, jnp.full(2, 2.0)], strict=True):
        np.testing.assert_array_equal(grad, want[name])
        np.testing.assert_array_equal(grad, expected)
