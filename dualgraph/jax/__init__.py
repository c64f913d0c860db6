"""JAX adapter: functions compiled ahead of time under dualgraph's contract, and their VJPs.

:func:`graphed` maps the contract of ``dualgraph.torch.make_graphed_callables`` onto
:func:`jax.jit`: compiled from the samples' shapes, ``None`` leaves and constants kept in the
outputs, calls checked against the call spec, donated arguments playing the part of a CUDA
graph's static input buffers, and a VJP under the output grad mask. It returns a
:class:`GraphedCallable` (``.name``, ``.call_spec``, ``.out_spec``, as on the PyTorch side).

Importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless already set) so that
JAX, sharing a GPU with PyTorch, does not reserve most of its memory; import it before JAX makes
its first array. :func:`disable_command_buffers` turns XLA's own CUDA graphs off for parity runs;
:func:`enable_x64` is the context dualgraph runs 64-bit programs in.

>>> import jax.numpy as jnp, dualgraph.jax as dgj
>>> g = dgj.graphed(lambda x: (x + 1, None), (jnp.zeros(2),))
>>> g(jnp.zeros(2))
(Array([1., 1.], dtype=float32), None)
"""

from importlib import import_module as _import_module

from ._env import backend_initialized, disable_command_buffers, enable_x64, x64_enabled

try:  # a clear message where JAX is missing or broken
    _import_module("jax")
except ImportError as _error:
    raise ImportError(
        f"dualgraph.jax needs JAX, which did not import ({_error}): pip install dualgraph[jax]"
    ) from _error

from ._graphed import GraphedCallable, graphed
from ._non_finite import NonFiniteError
from ._vjp import Pullback

__all__ = [
    "GraphedCallable",
    "NonFiniteError",
    "Pullback",
    "backend_initialized",
    "disable_command_buffers",
    "enable_x64",
    "graphed",
    "x64_enabled",
]
