"""dualgraph: CUDA graphs for modules whose outputs hold None, constants and frozen tensors.

The core (this package) describes trees without importing any framework; the adapters live in
``dualgraph.torch`` and ``dualgraph.jax`` and the cross-check in ``dualgraph.parity``.

>>> import numpy as np, dualgraph
>>> dualgraph.describe((np.zeros((2, 3), np.float32), None))
TreeSpec((float32[2, 3](grad), None))
"""

from ._call import CallSpec, describe_call
from ._containers import register_dataclass, register_namedtuple
from ._dtypes import DIFFERENTIABLE_DTYPES, DTYPE_NAMES, is_differentiable_dtype
from ._errors import (
    CaptureError,
    DualgraphError,
    DualgraphWarning,
    SpecMismatchError,
    UnsupportedLeafError,
)
from ._leaves import register_array_type
from ._paths import Attr, Index, Key, PathEntry
from ._spec import LeafSpec, TreeSpec, describe

__version__ = "0.1.0"

__all__ = [
    "DIFFERENTIABLE_DTYPES",
    "DTYPE_NAMES",
    "Attr",
    "CallSpec",
    "CaptureError",
    "DualgraphError",
    "DualgraphWarning",
    "Index",
    "Key",
    "LeafSpec",
    "PathEntry",
    "SpecMismatchError",
    "TreeSpec",
    "UnsupportedLeafError",
    "__version__",
    "describe",
    "describe_call",
    "is_differentiable_dtype",
    "register_array_type",
    "register_dataclass",
    "register_namedtuple",
]
