"""What ``python -m build`` makes: an sdist whose tests can run, a wheel of the package alone."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Folders the sdist carries whole (MANIFEST.in), for the tests that run or read them.
CARRIED = ("tests", "examples", "benchmarks", "docs")
TOP_FILES = {"LICENSE", "MANIFEST.in", "Makefile", "README.md", "pyproject.toml"}
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "build",
    "dist",
    ".*_cache",
    ".hypothesis",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The sources (copied, so that the build leaves the checkout as it was), sdist and wheel."""
    source = tmp_path_factory.mktemp("source") / "dualgraph"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return source, sdist, wheel


def sdist_files(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as archive:
        names = [member.name for member in archive.getmembers() if member.isfile()]
    return {name.partition("/")[2] for name in names}


def test_sdist_ships_the_tests_with_their_helpers_and_what_they_run(
    built: tuple[Path, Path, Path],
) -> None:
    source, sdist, _ = built
    files = sdist_files(sdist)
    for helper in ("conftest.py", "trees.py", "torch_cases.py"):
        assert f"tests/{helper}" in files
    expected = {
        path.relative_to(source).as_posix()
        for folder in (*CARRIED, "dualgraph")
        for path in (source / folder).rglob("*")
        if path.is_file()
    }
    missing = (expected | TOP_FILES) - files
    assert not missing, f"the sdist lacks {sorted(missing)}"
    generated = {"PKG-INFO", "setup.cfg"}
    unexpected = {f for f in files - expected - TOP_FILES - generated if ".egg-info/" not in f}
    assert not unexpected, f"the sdist carries {sorted(unexpected)}"


def test_wheel_holds_the_package_and_the_license_only(built: tuple[Path, Path, Path]) -> None:
    _, _, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"dualgraph"}
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "dualgraph/py.typed" in names


def test_metadata_names_license_and_authors(built: tuple[Path, Path, Path]) -> None:
    _, sdist, _ = built
    with tarfile.open(sdist) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("-0.1.0/PKG-INFO")]
        extracted = archive.extractfile(member)
        assert extracted is not None
        metadata = email.parser.Parser().parsestr(extracted.read().decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert metadata["Author"] == "dualgraph developers"
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
