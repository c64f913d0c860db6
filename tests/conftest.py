"""Shared pytest setup: tests marked ``cuda`` skip cleanly where no CUDA device is usable.

Skips are summarised one line per reason (``-r`` in pyproject.toml leaves out ``s``, which would
print one line per skipped test): failures, errors and xfails are still reported one by one.
"""

from __future__ import annotations

import collections
import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_items:
        item.add_marker(skip)


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a test was skipped, without pytest's ``Skipped: `` prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per skip reason, most frequent first, unless ``-rs`` already listed each skip."""
    if set(terminalreporter.config.option.reportchars) & set("saA"):  # listed one by one
        return
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if getattr(report, "longrepr", None) is not None and not hasattr(report, "wasxfail")
    ]
    if not skipped:
        return
    reasons = collections.Counter(skip_reason(report) for report in skipped)
    terminalreporter.section("skipped, by reason", sep="-")
    for reason, count in reasons.most_common():
        terminalreporter.line(f"{count:4d} {reason}")
