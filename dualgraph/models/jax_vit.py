"""The vision transformer of :mod:`dualgraph.models.torch_vit`, as pure JAX functions.

The parameters are a pytree of arrays made from the PyTorch model's ``state_dict`` by
:func:`params_from_state_dict`; :func:`param_path` is the name mapping (a torch parameter name
to its path in the pytree), which also aligns parameter gradients in :mod:`dualgraph.parity`.
Linear weights are stored as ``(in, out)`` (the transpose of torch's); the patch embedding keeps
torch's ``OIHW`` layout and images stay ``NCHW``.

Low-precision math follows PyTorch's: matrix products and convolutions accumulate in float32 and
round once; layer norm, softmax, GELU and the mean pool compute in float32 and round their result.
Products run at full float32 precision (``Precision.HIGHEST``, no TF32). Dropout is not modelled:
compare against a torch model with ``dropout=0`` or in ``eval()`` mode.

>>> import torch, dualgraph.models.torch_vit as tv
>>> block = tv.ViTBlock(dim=8, heads=2)
>>> params = params_from_state_dict(block.state_dict())
>>> x = jnp.ones((1, 3, 8))
>>> hidden, extra = jax.jit(vit_block, static_argnames="heads")(params, x, heads=2)
>>> hidden.shape, extra
((1, 3, 8), None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import describe
from .._errors import DualgraphError
from ..jax._donation import default_device
from ..jax._dtypes import jax_dtype

__all__ = ["param_path", "params_from_state_dict", "vision_encoder", "vit_block"]

Params = dict[str, Any]
_HIGHEST = lax.Precision.HIGHEST
_LOW_PRECISION = (jnp.bfloat16, jnp.float16)

# torch module name -> (pytree key, {torch parameter name: (pytree key, transposed)}).
_LAYER_NORM = {"weight": ("scale", False), "bias": ("bias", False)}
_LINEAR = {"weight": ("w", True), "bias": ("b", False)}
_CONV = {"weight": ("w", False), "bias": ("b", False)}
_MODULES = {
    "ln1": ("ln1", _LAYER_NORM),
    "ln2": ("ln2", _LAYER_NORM),
    "norm": ("norm", _LAYER_NORM),
    "qkv": ("qkv", _LINEAR),
    "proj": ("proj", _LINEAR),
    "fc1": ("fc1", _LINEAR),
    "fc2": ("fc2", _LINEAR),
    "patch_embed": ("patch", _CONV),
}


# -- the model ---------------------------------------------------------------------------------


def vit_block(params: Params, x: jax.Array, *, heads: int = 4) -> tuple[jax.Array, None]:
    """One pre-LN transformer block on ``x`` (batch, tokens, dim); returns ``(x, None)``.

    ``heads`` is not in the parameters' shapes: pass the torch block's (4 is the default of
    :class:`~dualgraph.models.torch_vit.VisionEncoder`).

    >>> dim = 4
    >>> zeros = lambda *s: jnp.zeros(s)
    >>> linear = lambda i, o: {"w": zeros(i, o), "b": zeros(o)}
    >>> norm = {"scale": jnp.ones(dim), "bias": zeros(dim)}
    >>> params = {"ln1": norm, "ln2": norm, "qkv": linear(dim, 3 * dim),
    ...           "proj": linear(dim, dim), "fc1": linear(dim, 8), "fc2": linear(8, dim)}
    >>> block = jax.jit(vit_block, static_argnames="heads")
    >>> block(params, jnp.ones((1, 2, dim)), heads=2)[0].sum()  # zero weights: identity
    Array(8., dtype=float32)
    """
    x = x + _linear(params["proj"], _attention(params["qkv"], _layer_norm(params["ln1"], x), heads))
    hidden = _gelu(_linear(params["fc1"], _layer_norm(params["ln2"], x)))
    return x + _linear(params["fc2"], hidden), None


def vision_encoder(params: Params, images: jax.Array, *, heads: int = 4) -> dict[str, Any]:
    """Patch embedding, positions, blocks and final norm of ``images`` (batch, C, H, W).

    Returns ``{"hidden": (batch, tokens, dim), "pooled": (batch, dim), "aux_loss": None}``.
    """
    patch = params["patch"]["w"]
    size = patch.shape[-1]
    embedded = lax.conv_general_dilated(
        images,
        patch,
        window_strides=(size, size),
        padding="VALID",
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        precision=_HIGHEST,
        preferred_element_type=_accumulator(images.dtype),
    )
    embedded = (embedded + params["patch"]["b"][None, :, None, None]).astype(images.dtype)
    batch, dim = embedded.shape[:2]
    hidden = embedded.reshape(batch, dim, -1).transpose(0, 2, 1) + params["pos"]
    for block in params["blocks"]:
        hidden, _ = vit_block(block, hidden, heads=heads)
    hidden = _layer_norm(params["norm"], hidden)
    pooled = hidden.astype(_accumulator(hidden.dtype)).mean(axis=1).astype(hidden.dtype)
    return {"hidden": hidden, "pooled": pooled, "aux_loss": None}


def _accumulator(dtype: Any) -> Any:
    return jnp.float32 if dtype in _LOW_PRECISION else dtype


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    product = jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=_accumulator(a.dtype))
    return product.astype(a.dtype)


def _linear(params: Params, x: jax.Array) -> jax.Array:
    product = jnp.matmul(
        x, params["w"], precision=_HIGHEST, preferred_element_type=_accumulator(x.dtype)
    )
    return (product + params["b"]).astype(x.dtype)


def _layer_norm(params: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    wide = x.astype(_accumulator(x.dtype))
    mean = wide.mean(axis=-1, keepdims=True)
    variance = jnp.square(wide - mean).mean(axis=-1, keepdims=True)
    normed = (wide - mean) * lax.rsqrt(variance + eps)
    return (normed * params["scale"] + params["bias"]).astype(x.dtype)


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x.astype(_accumulator(x.dtype)), approximate=False).astype(x.dtype)


def _attention(qkv: Params, x: jax.Array, heads: int) -> jax.Array:
    batch, tokens, dim = x.shape
    head_dim = dim // heads
    q, k, v = _linear(qkv, x).reshape(batch, tokens, 3, heads, head_dim).transpose(2, 0, 3, 1, 4)
    scores = _matmul(q, k.swapaxes(-2, -1)) * jnp.asarray(1.0 / np.sqrt(head_dim), x.dtype)
    weights = jax.nn.softmax(scores.astype(_accumulator(x.dtype)), axis=-1).astype(x.dtype)
    return _matmul(weights, v).transpose(0, 2, 1, 3).reshape(batch, tokens, dim)


# -- parameters from PyTorch ---------------------------------------------------------------------


def param_path(torch_name: str, /) -> tuple[str | int, ...]:
    """Where the torch parameter ``torch_name`` lives in the JAX params pytree.

    >>> param_path("blocks.1.qkv.weight"), param_path("pos_embed")
    (('blocks', 1, 'qkv', 'w'), ('pos',))
    """
    return _rule(torch_name)[0]


def params_from_state_dict(state_dict: Mapping[str, Any], /) -> Params:
    """The JAX params pytree of a torch ``ViTBlock`` or ``VisionEncoder`` state dict.

    Values may be torch tensors (read through DLPack), numpy or JAX arrays; each is copied onto
    JAX's default device in its own dtype, and Linear weights are transposed. float64 values
    need JAX's 64-bit mode.

    >>> import torch, dualgraph.models.torch_vit as tv
    >>> params = params_from_state_dict(tv.VisionEncoder(depth=2).state_dict())
    >>> sorted(params), len(params["blocks"]), params["blocks"][0]["qkv"]["w"].shape
    (['blocks', 'norm', 'patch', 'pos'], 2, (64, 192))
    """
    tree: dict[Any, Any] = {}
    for name, value in state_dict.items():
        path, transposed = _rule(name)
        array = _to_jax(name, value)
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array.T if transposed else array
    return _lists_from_int_keys(tree)


def _rule(torch_name: str) -> tuple[tuple[str | int, ...], bool]:
    if torch_name == "pos_embed":
        return ("pos",), False
    *modules, leaf = torch_name.split(".")
    if not modules or modules[-1] not in _MODULES:
        raise DualgraphError(f"{torch_name!r} is not a parameter of the dualgraph ViT models")
    key, names = _MODULES[modules[-1]]
    if leaf not in names:
        raise DualgraphError(f"{torch_name!r} is not a parameter of the dualgraph ViT models")
    name, transposed = names[leaf]
    prefix = tuple(int(m) if m.isdigit() else m for m in modules[:-1])
    return (*prefix, key, name), transposed


def _to_jax(name: str, value: Any) -> jax.Array:
    dtype = describe(value).leaves[0].dtype or ""
    computed = jax_dtype(dtype)
    if computed != dtype:
        why = f"JAX's 64-bit mode is off and would silently compute it as {computed}"
        if computed is None:
            why = "JAX has no such dtype"
        raise DualgraphError(
            f"state_dict[{name!r}] is {dtype}, but {why}; turn the mode on (jax.enable_x64) or "
            "convert the model first"
        )
    if isinstance(value, np.ndarray | jax.Array):
        array = jnp.asarray(value)
    else:  # a torch tensor: DLPack keeps bfloat16 and the device, but not torch's lazy bits
        array = jax.dlpack.from_dlpack(value.detach().resolve_conj().resolve_neg().contiguous())
    device = default_device()  # where new arrays go and programs are compiled for
    if array.devices() != {device}:
        return jax.device_put(array, device)
    return jnp.array(array, copy=True)  # never alias memory the torch optimizer updates in place


def _lists_from_int_keys(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    children = {key: _lists_from_int_keys(child) for key, child in node.items()}
    if children and all(isinstance(key, int) for key in children):
        if sorted(children) != list(range(len(children))):
            raise DualgraphError(f"missing entries in a list of parameters: {sorted(children)}")
        return [children[i] for i in range(len(children))]
    return children
