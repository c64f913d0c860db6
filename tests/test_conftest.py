"""tests/conftest.py: skips summarised one line per reason; failures and xfails still listed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

SAMPLE_TESTS = """
import pytest

@pytest.mark.parametrize("n", range(3))
def test_needs_a_gpu(n):
    pytest.skip("needs a GPU here")

@pytest.mark.skip(reason="not today")
def test_later():
    pass

@pytest.mark.xfail(reason="known bug")
def test_known_bug():
    assert False

def test_broken():
    assert 1 == 2
"""


def run_pytest(folder: Path, *options: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, str(folder)],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr  # test_broken fails
    return result.stdout


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    return tmp_path


def test_skips_are_counted_by_reason_and_the_rest_listed(sample: Path) -> None:
    output = run_pytest(sample, "-rfExX")
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "skipped, by reason" in line)
    assert lines[start + 1 : start + 3] == ["   3 needs a GPU here", "   1 not today"]
    assert "SKIPPED [" not in output
    assert any(line.startswith("FAILED test_sample.py::test_broken") for line in lines)
    assert any(line.startswith("XFAIL test_sample.py::test_known_bug") for line in lines)
    assert "1 failed, 4 skipped, 1 xfailed" in output


def test_with_rs_each_skip_is_listed_and_not_summarised(sample: Path) -> None:
    output = run_pytest(sample, "-ra")
    assert "skipped, by reason" not in output
    assert re.search(r"^SKIPPED \[3\] test_sample.py:\d+: needs a GPU here$", output, re.M)
