"""Moving arrays between torch, numpy and JAX without changing a bit or a dtype.

The parity harness's own seam to both frameworks: it uses their public APIs only (DLPack, bit
views for the dtypes numpy lacks natively: bfloat16 and float8 through ``ml_dtypes``).

>>> import torch
>>> to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype.name
'bfloat16'
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from .._errors import DualgraphError
from .._nodes import clip_text
from .._spec import describe, map_arrays

__all__ = [
    "UNSIGNED_OF_SIZE",
    "as_jax",
    "as_torch",
    "copied",
    "default_jax_device",
    "numpy_dtype",
    "random_like",
    "to_numpy",
    "to_torch",
    "unreadable",
]

#: Unsigned integers by size in bytes: views that carry the bits of the dtypes one side lacks,
#: and that order IEEE floats by their bits (see ``_arrays``).
UNSIGNED_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_BITS = {1: torch.uint8, 2: torch.int16}


def numpy_dtype(name: str, /) -> np.dtype:
    """The numpy dtype of a neutral dtype name (``ml_dtypes`` for bfloat16, float8...).

    >>> numpy_dtype("float8_e4m3fn").name, numpy_dtype("int64").name
    ('float8_e4m3fn', 'int64')
    """
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def unreadable(tensor: torch.Tensor, /) -> str | None:
    """Why the values of a torch tensor cannot be read for a comparison, or ``None``.

    A nested tensor has no single shape (the torch adapter describes it as a scalar, so a spec
    check passes it), and a meta tensor holds no values: both would fail deep inside torch.

    >>> unreadable(torch.ones(2, device="meta"))
    'a meta tensor (it holds no values to compare)'
    """
    if tensor.is_nested:
        return "a nested tensor (it has no single shape to compare)"
    if tensor.is_meta:
        return "a meta tensor (it holds no values to compare)"
    return _unreadable_dtype(tensor.dtype)


@functools.cache
def _unreadable_dtype(dtype: torch.dtype, /) -> str | None:
    """Why tensors of ``dtype`` cannot be compared: torch cannot copy or compare them (quantized,
    bit-packed and sub-byte integer dtypes), or numpy cannot hold them as they are (complex32);
    ``None`` for the rest. Found once per dtype, on a tensor of one element."""
    try:
        sample = torch.zeros(1, dtype=dtype)
        if sample.is_quantized:
            raise TypeError("a quantized tensor")
        kept = sample.clone()
        if not (sample.is_floating_point() or sample.is_complex()):
            torch.equal(sample, kept)  # floating ones are compared by eq and isnan
        to_numpy(sample)
    except Exception as error:
        return (
            f"a torch {str(dtype).removeprefix('torch.')} tensor, which cannot be compared "
            f"({type(error).__name__}: {clip_text(error)})"
        )
    return None


def to_numpy(tensor: torch.Tensor, /) -> np.ndarray:
    """A torch tensor (strided, or sparse: its dense values) as a numpy array of the same dtype
    (on the host)."""
    tensor = _with_values(tensor.detach().cpu())  # lazy views refuse .numpy()
    if tensor.layout != torch.strided:  # a sparse grad (nn.Embedding(sparse=True)): its values
        tensor = tensor.to_dense()
    name = describe(tensor).arrays[0].dtype or ""  # the neutral name, as the torch adapter says
    if hasattr(np, name):
        return tensor.numpy()
    bits = _TORCH_BITS.get(tensor.element_size())
    if bits is None:
        raise DualgraphError(f"a torch {name} tensor has no numpy counterpart to compare in")
    return tensor.view(bits).numpy().view(numpy_dtype(name))


def to_torch(array: np.ndarray, device: torch.device, /) -> torch.Tensor:
    """A numpy array as a torch tensor of the same dtype on ``device`` (a copy)."""
    array = np.array(array, copy=True, order="C")
    name = array.dtype.name
    if hasattr(np, name):
        return torch.from_numpy(array).to(device)
    bits = UNSIGNED_OF_SIZE[array.dtype.itemsize]
    return torch.from_numpy(array.view(bits)).view(getattr(torch, name)).to(device)


def _with_values(tensor: torch.Tensor, /) -> torch.Tensor:
    """``tensor`` with its lazy bits resolved (conjugate, negative) and, for a zero tensor
    (``torch._efficientzerotensor``, which holds no memory of its values: DLPack would carry
    whatever its storage holds, and ``.numpy()`` refuses it), its zeros made (a copy)."""
    tensor = tensor.resolve_conj().resolve_neg()
    return tensor.clone() if tensor._is_zerotensor() else tensor


def as_torch(value: Any, device: torch.device, /) -> torch.Tensor:
    """An input (tensor or array) as a detached torch tensor; arrays go to ``device``. An
    inference tensor (made under ``torch.inference_mode()``), which can neither require grad
    nor count its in-place updates, is copied (outside that mode, into an ordinary tensor)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.is_inference() else value.detach()
    return to_torch(np.asarray(value), device)


def as_jax(tensor: torch.Tensor, /) -> jax.Array:
    """The tensor as a JAX array on JAX's default device, without a copy where possible."""
    # DLPack carries memory, not torch's lazy conjugate and negative bits: a negated view
    # (z.conj().imag) would reach JAX with the other sign. Resolved, it is a copy.
    tensor = _with_values(tensor.detach())
    device = default_jax_device()
    same_kind = (tensor.device.type == "cuda") == (device.platform == "gpu")
    if same_kind:
        try:
            array = jax.dlpack.from_dlpack(tensor)
        except Exception:  # e.g. a layout DLPack cannot carry: fall back to a copy
            array = None
        if array is not None:
            return array if array.devices() == {device} else jax.device_put(array, device)
    return jax.device_put(to_numpy(tensor), device)


def default_jax_device() -> jax.Device:
    """The device JAX puts new arrays on and compiles for now: the one
    ``jax.default_device(...)`` chose (a device or a platform name), else the first.

    >>> default_jax_device() == jax.devices()[0]
    True
    """
    chosen = jax.config.jax_default_device  # type: ignore[attr-defined]  # not in its stubs
    if isinstance(chosen, str):
        return jax.devices(chosen)[0]
    return chosen if chosen is not None else jax.devices()[0]


def copied(tree: Any, /) -> Any:
    """``tree`` with a fresh copy of each JAX array (for donation, which consumes its inputs),
    rebuilt as a spec rebuilds it (never by optree's bare call of a namedtuple class)."""
    return map_arrays(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def random_like(rng: np.random.Generator, dtype: str, shape: tuple[int, ...], /) -> np.ndarray:
    """Standard normal values (complex: real and imaginary parts) of ``dtype`` and ``shape``;
    their magnitudes for a format with no sign (``float8_e8m0fnu``: a negative value is NaN
    there, and a NaN cotangent leaves its entries' gradients uncompared).

    >>> bool(np.isnan(random_like(np.random.default_rng(0), "float8_e8m0fnu", (64,))).any())
    False
    """
    values = rng.standard_normal(shape)
    if dtype.startswith("complex"):
        values = values + 1j * rng.standard_normal(shape)
    target = numpy_dtype(dtype)
    if _unsigned(target):
        values = np.abs(values)
    return values.astype(target)


def _unsigned(dtype: np.dtype) -> bool:
    """Whether a floating format holds no negative value (its most negative is above zero)."""
    try:
        return float(ml_dtypes.finfo(dtype).min) > 0  # e8m0 has no 0 to compare with in itself
    except (TypeError, ValueError):  # no floating format
        return False
