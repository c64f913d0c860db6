"""The exceptions dualgraph raises: one base class, each also a familiar builtin error."""

from __future__ import annotations

import pytest

import dualgraph
from dualgraph import (
    CaptureError,
    DualgraphError,
    DualgraphWarning,
    SpecMismatchError,
    UnsupportedLeafError,
)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (SpecMismatchError, ValueError),
        (UnsupportedLeafError, TypeError),
        (CaptureError, RuntimeError),
    ],
    ids=lambda c: c.__name__,
)
def test_every_error_is_a_dualgraph_error_and_a_builtin_error(error: type, builtin: type) -> None:
    assert issubclass(error, DualgraphError)
    assert issubclass(error, builtin)


def test_dualgraph_error_is_an_exception() -> None:
    assert issubclass(DualgraphError, Exception)


@pytest.mark.parametrize(
    "error", [SpecMismatchError, UnsupportedLeafError], ids=lambda c: c.__name__
)
def test_path_errors_carry_the_path_and_the_message(error: type) -> None:
    raised = error("args[0]: expected None, got float32[2]", path="args[0]")
    assert raised.path == "args[0]"
    assert str(raised) == "args[0]: expected None, got float32[2]"


@pytest.mark.parametrize(
    "error", [SpecMismatchError, UnsupportedLeafError], ids=lambda c: c.__name__
)
def test_path_defaults_to_the_root(error: type) -> None:
    assert error("message").path == ""


def test_errors_raised_by_describe_are_caught_as_dualgraph_errors() -> None:
    with pytest.raises(DualgraphError):
        dualgraph.describe({1, 2})


def test_dualgraph_warning_is_a_user_warning_not_an_error() -> None:
    assert issubclass(DualgraphWarning, UserWarning)
    assert not issubclass(DualgraphWarning, DualgraphError)


@pytest.mark.parametrize(
    "exported",
    [CaptureError, DualgraphError, DualgraphWarning, SpecMismatchError, UnsupportedLeafError],
    ids=lambda c: c.__name__,
)
def test_errors_and_the_warning_are_exported(exported: type) -> None:
    assert getattr(dualgraph, exported.__name__) is exported
    assert exported.__name__ in dualgraph.__all__
