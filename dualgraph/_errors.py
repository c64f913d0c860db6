"""The exceptions dualgraph raises."""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "DualgraphError",
    "DualgraphWarning",
    "SpecMismatchError",
    "UnsupportedLeafError",
]


class DualgraphError(Exception):
    """Base class of every error dualgraph raises on purpose.

    >>> issubclass(SpecMismatchError, DualgraphError)
    True
    """


class SpecMismatchError(DualgraphError, ValueError):
    """A tree does not match the spec it is checked against.

    The message names the first differing leaf path and what was expected vs found:

    ``args[0]['mask']: expected float32[2, 8], got float32[2, 9]``
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class UnsupportedLeafError(DualgraphError, TypeError):
    """A leaf is neither an array, a constant, nor ``None``, nor a registered container."""

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CaptureError(DualgraphError, RuntimeError):
    """Warmup or capture of a callable failed; the message names the callable and the cause."""


class DualgraphWarning(UserWarning):
    """Something works, but probably not as meant: e.g. a donated buffer no output can reuse.

    Issued once, where the problem is found (at capture or compile time, not on every call).

    >>> issubclass(DualgraphWarning, UserWarning)
    True
    """


# Errors print as ``dualgraph.SpecMismatchError``, the name users import them by.
for _public in (
    CaptureError,
    DualgraphError,
    DualgraphWarning,
    SpecMismatchError,
    UnsupportedLeafError,
):
    _public.__module__ = "dualgraph"
del _public
