"""JAX adapter: functions compiled ahead of time under dualgraph's contract, and their VJPs.

:func:`graphed` maps the contract of ``dualgraph.torch.make_graphed_callables`` onto
:func:`jax.jit`: compiled from the samples' shapes, ``None`` leaves and constants kept in the
outputs, calls checked against the input spec, donated arguments playing the part of a CUDA
graph's static input buffers, and a VJP under the output grad mask.

Importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless already set) so that
JAX, sharing a GPU with PyTorch, does not reserve most of its memory; import it before JAX makes
its first array. :func:`disable_command_buffers` turns XLA's own CUDA graphs off for parity runs.

>>> import jax.numpy as jnp, dualgraph.jax as dgj
>>> g = dgj.graphed(lambda x: (x + 1, None), (jnp.zeros(2),))
>>> g(jnp.zeros(2))
(Array([1., 1.], dtype=float32), None)
"""

from ._env import backend_initialized, disable_command_buffers
from ._graphed import Graphed, graphed
from ._vjp import Pullback

__all__ = [
    "Graphed",
    "Pullback",
    "backend_initialized",
    "disable_command_buffers",
    "graphed",
]
