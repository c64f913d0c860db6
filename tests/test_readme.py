"""Every ```python block of README.md runs as written: in order, each in a fresh namespace.

A block may be preceded (on the line before its fence) by one marker, an HTML comment that
GitHub does not render and that says why the block is not simply run:

- ``<!-- signature: MODULE.NAME -->``: a program with one call of that function passing every
  keyword-only option at its default; the defaults are checked against ``inspect.signature``;
- ``<!-- not-run: REASON -->``: an illustration, not a program (skipped with REASON, so that
  pytest's summary lists it);
- ``<!-- needs-cuda -->``: run only where a CUDA device is (the ``cuda`` mark);
- ``<!-- needs-te -->``: run only where a CUDA device is and Transformer Engine is installed;
- ``<!-- known-broken: REASON -->``: run, and expected to fail until the fix named in REASON
  lands (a strict xfail: once the block runs, the test fails until the marker is removed).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*(?P<kind>[a-z-]+)(?::\s*(?P<reason>.*?))?\s*-->$")
KINDS_WITH_REASON = {"not-run", "known-broken", "signature"}
KINDS = {*KINDS_WITH_REASON, "needs-cuda", "needs-te"}
_HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it starts, its section, its language, code and marker."""

    line: int  # of the opening fence, 1-based
    section: str
    language: str
    code: str
    marker: str = ""
    reason: str = ""

    @property
    def name(self) -> str:
        return f"README.md:{self.line} ({self.section})"


def read_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with the marker on the line before it."""
    blocks, section, lines = [], "", text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        opening = FENCE.match(line)
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        marker = MARKER.match(lines[index - 1].strip()) if index else None
        blocks.append(
            Block(
                line=index + 1,
                section=section,
                language=opening.group(1),
                code="\n".join(lines[index + 1 : end]) + "\n",
                marker=marker.group("kind") if marker else "",
                reason=(marker.group("reason") or "") if marker else "",
            )
        )
        index = end + 1
    return blocks


BLOCKS = [block for block in read_blocks(README.read_text()) if block.language == "python"]


def _param(block: Block) -> object:
    marks: list[pytest.MarkDecorator] = []
    if block.marker == "not-run":
        marks.append(pytest.mark.skip(reason=f"README block not run: {block.reason}"))
    if block.marker in ("needs-cuda", "needs-te"):
        marks.append(pytest.mark.cuda)
    if block.marker == "needs-te" and not _HAS_TE:
        marks.append(pytest.mark.skip(reason="needs transformer-engine (the [te] extra)"))
    if block.marker == "known-broken":
        reason = f"{block.reason}; once this block runs, remove its known-broken marker"
        marks.append(pytest.mark.xfail(strict=True, reason=reason))
    return pytest.param(block, id=block.name, marks=marks)


PROGRAMS = BLOCKS  # a signature block runs too


@pytest.mark.parametrize("block", [_param(block) for block in PROGRAMS])
def test_readme_block_runs_as_written(block: Block) -> None:
    exec(compile(block.code, block.name, "exec"), {"__name__": "__readme__"})


SIGNATURES = [block for block in BLOCKS if block.marker == "signature"]


@pytest.mark.parametrize("block", SIGNATURES, ids=[block.name for block in SIGNATURES])
def test_readme_signature_matches_the_code(block: Block) -> None:
    """The block calls the function once with every keyword-only option at its default."""
    module_name, _, name = block.reason.rpartition(".")
    function = getattr(importlib.import_module(module_name), name)
    calls = [
        node
        for node in ast.walk(ast.parse(block.code))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name)
    ]
    assert len(calls) == 1, f"{block.name}: expected one call of {name}, found {len(calls)}"
    documented = {keyword.arg: ast.literal_eval(keyword.value) for keyword in calls[0].keywords}
    parameters = inspect.signature(function).parameters.values()
    positional = [p for p in parameters if p.kind is not p.KEYWORD_ONLY]
    actual = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}
    assert len(calls[0].args) == len(positional), f"{block.name}: positional arguments differ"
    assert documented == actual, f"{block.name} documents {block.reason} differently"


def test_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 3
    assert any(block.section == "Quickstart" and not block.marker for block in BLOCKS)


def test_every_marker_is_known_and_says_why() -> None:
    lines = README.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        marker = MARKER.match(line.strip())
        if marker is None:
            continue
        kind, reason = marker.group("kind"), marker.group("reason")
        where = f"README.md:{number}: {line.strip()}"
        assert kind in KINDS, f"{where}: unknown marker, expected one of {sorted(KINDS)}"
        if kind in KINDS_WITH_REASON:
            assert reason, f"{where}: say why"
        following = lines[number] if number < len(lines) else ""
        assert following.startswith("```python"), f"{where}: must come right before a ```python"


def test_quickstart_example_is_the_readme_quickstart() -> None:
    quickstart = next(block for block in BLOCKS if block.section == "Quickstart")
    example = (ROOT / "examples" / "quickstart.py").read_text()
    assert quickstart.code in example, "examples/quickstart.py and the README Quickstart differ"


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        ("```python\nx = 1\n```\n", [("python", "x = 1\n", "", "")]),
        (
            "<!-- not-run: a signature -->\n```python\nf(*, a)\n```\n",
            [("python", "f(*, a)\n", "not-run", "a signature")],
        ),
        (
            "<!-- needs-cuda -->\n```python\ny\n```\n```bash\nmake\n```\n",
            [("python", "y\n", "needs-cuda", ""), ("bash", "make\n", "", "")],
        ),
        ("text\n```python\n```\n", [("python", "\n", "", "")]),
    ],
)
def test_blocks_are_read_with_their_markers(
    markdown: str, expected: list[tuple[str, str, str, str]]
) -> None:
    blocks = read_blocks(markdown)
    assert [(b.language, b.code, b.marker, b.reason) for b in blocks] == expected
