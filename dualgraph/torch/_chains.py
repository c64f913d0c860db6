"""Per-call comparisons of many objects as one generated chain of tests.

A replay compares, on every call, dozens of objects with what they were at capture (a module's
parameters where they hang, the parameters' hook flags, their ``.grad``). Written as passes of
``map``, ``all`` and ``tuple`` over the objects, each pass makes an iterator or two and a tuple,
which costs more than the tests themselves where the objects are few. A :class:`Chain` writes
the tests once as one expression, ``test and test and ...``, the objects bound as closure
variables (never pasted into the source: the code names them ``v0, v1, ...``), so chains of the
same shape (a model's blocks) share one compiled code.

Example::

    chain = Chain()
    for param in params:
        chain.test("{}.requires_grad is {}", param, True)
    passes = chain.compiled()  # once
    passes()  # per call: True while every test holds
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Chain"]

# Named in tests as they are called by the passes a chain stands for (unbound: a subclass's own
# ``get`` or ``data_ptr`` is not what they call).
_BOUND = {"_get": dict.get, "_data_ptr": torch.Tensor.data_ptr, "_type": type, "_len": len}


class Chain:
    """The tests of one chain and the values they name (``v0, v1, ...``, in order); the
    functions in ``_BOUND`` by their names (``_get``, ``_data_ptr``, ``_type``, ``_len``)."""

    def __init__(self) -> None:
        self.values: list[Any] = list(_BOUND.values())
        self.tests: list[str] = []

    def bind(self, value: Any) -> str:
        """The name ``value`` has in the tests."""
        self.values.append(value)
        return f"v{len(self.values) - 1}"

    def test(self, source: str, *values: Any) -> None:
        """Add the test ``source``, whose ``{}`` are ``values`` bound in order."""
        self.tests.append(source.format(*map(self.bind, values)))

    def compiled(self) -> Callable[[], bool]:
        """A function answering whether every test holds (``True`` for none), in order, up to
        the first that fails; a test's exception passes through."""
        if not self.tests:
            return _always
        return _maker(len(self.values), tuple(self.tests))(*self.values)


def _always() -> bool:
    return True


@functools.lru_cache(maxsize=256)
def _maker(count: int, tests: tuple[str, ...]) -> Callable[..., Callable[[], bool]]:
    """A function of the ``count`` values returning the chain ``tests`` over them (compiled
    once per shape: the names of the values are their positions)."""
    names = list(_BOUND)
    names += [f"v{i}" for i in range(len(names), count)]
    chain = "\n        and ".join(tests)
    source = (
        f"def make({', '.join(names)}):\n"
        "    def passes():\n"
        f"        return (\n            {chain}\n        )\n"
        "    return passes\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "<dualgraph chain>", "exec"), namespace)
    make: Callable[..., Callable[[], bool]] = namespace["make"]
    return make
