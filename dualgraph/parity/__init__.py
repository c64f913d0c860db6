"""Cross-check a PyTorch callable against a JAX reference, leaf by leaf, aligned by spec path.

:func:`compare` runs both on the same inputs (numpy arrays or torch tensors, handed to JAX
through DLPack without a copy where both frameworks live on the same device), checks that the
two output specs agree (``None`` positions, constants, shapes, dtypes), then compares every output
array and, with ``grads=True``, the gradients that the same seeded random cotangents give for the
floating inputs and for the parameters. :func:`assert_parity` is the pytest form;
:func:`compare_arrays` judges one pair of arrays.

The tolerance model (:data:`DEFAULT_TOLERANCES`, per dtype): integers and bools compare exactly
in their own dtype; a floating leaf passes when every entry has
``|torch - jax| <= rtol * |jax| + atol * rms`` (``rms``: the root mean square of the reference
leaf, its typical scale), the leaf's relative L2 error is at most ``max_rel_l2``, its cosine
similarity with the reference at least ``min_cosine``, and NaN and infinities sit at the same
positions on both sides; the formats of 8 bits and fewer also hold every entry within one
representable value of the reference's (``max_ulps=1``), and bfloat16 and float16 hold the
leaf's fitted scale error and offset to ``max_bias`` beyond its scatter (a leaf scaled by 1% fails
there, hidden from the other limits by its rounding). Their limits follow one rule from the
dtype's epsilon and a reduction depth (:func:`rounding_tolerance`). A leaf with no finite value (NaN
everywhere) is a warning, and fails unless ``allow_nan=True``. Nothing is coerced: dtypes and
shapes must agree, and 64-bit leaves are compared in 64 bits (the JAX side runs in its 64-bit
mode for them).

float32 is compared at full precision: TF32 (and oneDNN's bfloat16, on the CPU) is off in PyTorch
for the duration (and restored), and the JAX reference is traced and run under
``jax.default_matmul_precision("highest")`` (a :class:`~dualgraph.jax.GraphedCallable` passed in
runs under the caller's settings, which must be those it was graphed with: it refuses others).
bfloat16 and float16 results are rounded after each op, as in PyTorch: a plain JAX function is
compiled with XLA's excess precision off, and so is a :class:`~dualgraph.jax.GraphedCallable`
compiled otherwise (``dualgraph.jax.graphed`` leaves it on), again from its own trace.

>>> import numpy as np, torch, jax.numpy as jnp
>>> x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
>>> report = compare(lambda t: (torch.tanh(t), None), lambda a: (jnp.tanh(a), None), (x,))
>>> report.ok, [entry.path for entry in report.entries]
(True, ['output[0]', 'grad args[0]'])
"""

from importlib import import_module as _import_module

try:  # a clear message where a framework is missing or broken
    for _name in ("torch", "jax", "ml_dtypes"):
        _import_module(_name)
except ImportError as _error:
    raise ImportError(
        f"dualgraph.parity needs both PyTorch and JAX, and one did not import ({_error}): "
        "pip install dualgraph[torch,jax]"
    ) from _error

from ._arrays import compare_arrays
from ._compare import assert_parity, compare
from ._report import LeafReport, ParityReport
from ._tolerances import DEFAULT_DEPTH, DEFAULT_TOLERANCES, Tolerance, rounding_tolerance

__all__ = [
    "DEFAULT_DEPTH",
    "DEFAULT_TOLERANCES",
    "LeafReport",
    "ParityReport",
    "Tolerance",
    "assert_parity",
    "compare",
    "compare_arrays",
    "rounding_tolerance",
]
