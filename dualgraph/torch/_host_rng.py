"""The host's random streams a callable may draw from: Python's ``random`` and numpy's global one.

The checking tools (``lint``, ``memory_plan``, ``verify``) put them back as they put torch's RNG
states back, and ``verify`` starts both of its sides from the same ones. numpy is looked at only
when something imported it.

>>> import random
>>> state = host_rng_state()
>>> first = random.random()
>>> set_host_rng_state(state)
>>> random.random() == first
True
"""

from __future__ import annotations

import random
import sys
from typing import Any

__all__ = ["host_rng_state", "numpy_position", "set_host_rng_state"]


def host_rng_state() -> tuple[Any, Any]:
    """Python's ``random`` state and numpy's global generator's (``None`` without numpy)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def set_host_rng_state(state: tuple[Any, Any]) -> None:
    python_state, numpy_state = state
    random.setstate(python_state)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def numpy_position() -> Any:
    """Where numpy's global generator is in its stream (``None`` without numpy): a draw moves it.

    Its key array and position, and its cached Gaussian; compared with ``==`` after ``repr``.
    """
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    name, keys, position, has_gauss, cached = numpy.random.get_state()
    return name, keys.tobytes(), position, has_gauss, cached
