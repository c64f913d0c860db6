"""How JAX is set up to share a GPU with PyTorch; runs before JAX initialises its backend.

Importing :mod:`dualgraph.jax` sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the variable
is already set: by default JAX reserves most of the GPU's memory when its backend starts, which
leaves PyTorch (and its CUDA graph pools) out of memory. The variable is read once, when JAX's
backend initialises (the first array or computation), so import ``dualgraph.jax`` before that.

XLA runs parts of a GPU program as command buffers (CUDA graphs) of its own. For a parity run that
should compare plain kernels, turn them off before the backend starts with
:func:`disable_command_buffers` (it adds ``--xla_gpu_enable_command_buffer=`` to ``XLA_FLAGS``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from .._errors import DualgraphError

__all__ = [
    "COMMAND_BUFFER_FLAG",
    "backend_initialized",
    "config_value",
    "disable_command_buffers",
    "enable_x64",
    "x64_enabled",
    "x64_mode",
]

#: The XLA flag that, with an empty value, turns off every kind of XLA GPU command buffer.
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer="

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def backend_initialized() -> bool:
    """Whether JAX has started its backends (after that, XLA's environment is fixed).

    >>> isinstance(backend_initialized(), bool)
    True
    """
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public equivalent; present from jax 0.4 to 0.11

    return bool(xla_bridge.backends_are_initialized())


def disable_command_buffers() -> None:
    """Turn off XLA's GPU command buffers (CUDA graphs) for this process.

    Call it before JAX's backend starts (before the first array is made); afterwards it cannot
    take effect and raises :class:`~dualgraph.DualgraphError`, unless the flag is already set.

    Use it first thing in a parity script or a ``conftest.py``::

        import dualgraph.jax
        dualgraph.jax.disable_command_buffers()  # XLA_FLAGS += --xla_gpu_enable_command_buffer=
    """
    flags = os.environ.get("XLA_FLAGS", "").split()
    if COMMAND_BUFFER_FLAG in flags:
        return
    if backend_initialized():
        raise DualgraphError(
            "disable_command_buffers() came too late: JAX's backend is already initialised and "
            "has read XLA_FLAGS. Call it right after `import dualgraph.jax`, before any JAX "
            f"array is made, or start the process with XLA_FLAGS={COMMAND_BUFFER_FLAG}"
        )
    flags = [f for f in flags if not f.startswith("--xla_gpu_enable_command_buffer=")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, COMMAND_BUFFER_FLAG])


def config_value(name: str, /) -> Any:
    """The current value of a JAX configuration option, e.g. ``"jax_enable_x64"``."""
    import jax

    return getattr(jax.config, name)  # options are dynamic attributes, unknown to type checkers


def x64_enabled() -> bool:
    """Whether JAX's 64-bit types are on (``jax_enable_x64``) where this is called."""
    return bool(config_value("jax_enable_x64"))


def enable_x64(enabled: bool = True, /) -> contextlib.AbstractContextManager[Any]:
    """A context in which JAX's 64-bit types are on; a no-op when they already are or ``enabled``
    is False.

    The one place dualgraph turns 64-bit mode on: a program compiled with it on runs inside it,
    and :mod:`dualgraph.parity` runs a JAX reference inside it when a 64-bit array is involved.

    >>> with enable_x64():
    ...     x64_enabled()
    True
    """
    if not enabled or x64_enabled():
        return contextlib.nullcontext()
    import jax

    scoped = getattr(jax, "enable_x64", None)
    if scoped is not None:
        return scoped(True)
    from jax.experimental import (  # type: ignore[attr-defined,unused-ignore]  # JAX < 0.7
        enable_x64 as experimental,
    )

    return experimental()


def x64_mode(enabled: bool, /) -> contextlib.AbstractContextManager[Any]:
    """A context in which JAX's 64-bit mode is exactly ``enabled`` (on, or off); a no-op when it
    already is.

    A graphed program runs, and its later programs (the VJP) are traced, in the mode it was
    compiled in: traced with the mode on, a function compiled with it off computes what
    ``float`` or ``jnp.zeros(n)`` make in 64 bits, other values than the program it pairs with.

    >>> with enable_x64():
    ...     with x64_mode(False):
    ...         x64_enabled()
    False
    """
    if x64_enabled() == enabled:
        return contextlib.nullcontext()
    if enabled:
        return enable_x64()
    import jax

    scoped = getattr(jax, "enable_x64", None)
    if scoped is not None:
        return scoped(False)
    from jax.experimental import (  # type: ignore[attr-defined,unused-ignore]  # JAX < 0.7
        disable_x64,
    )

    return disable_x64()
