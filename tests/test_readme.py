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

A ``print(...)  # COMMENT`` whose comment begins with the character its output begins with is a
claim about that output: the comment is the output, where ``...`` stands for any text, and may
go on with ``: why`` (``# 3 3: warmup and capture count nothing``). Other comments explain. A
Python block followed by ``Its output ...:`` and a ```text block prints exactly that text when
run as a file named after the block's caption (``debugging.py``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import itertools
import linecache
import re
import sys
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


def shows(comment: str, output: str) -> bool:
    """Whether a print's ``# comment`` is its output (``...``: any text), maybe with ``: why``."""
    prefixes = [comment] + [
        comment[:at] for at in range(len(comment)) if comment.startswith(": ", at)
    ]
    for prefix in prefixes:
        pattern = ".*".join(re.escape(part) for part in prefix.split("..."))
        if re.fullmatch(pattern, output, flags=re.DOTALL):
            return True
    return False


def explains(comment: str, output: str) -> bool:
    """Whether a print's comment explains it rather than shows its output.

    Prose starts in lower case and not as the output does (``# on a CPU: ...``); a comment
    starting as output (``# 3 3``, ``# True``, ``# Linear: ...``) is a claim even where the
    output now starts otherwise (``4 4``, ``False``).

    >>> explains("on a CPU: what a GPU rejects", "capture lint of Model"), explains("3 3", "4 4")
    (True, False)
    """
    return not output or (comment[0].islower() and output[0] != comment[0])


def printed_claims(code: str) -> dict[int, str]:
    """Line number -> comment, for each line that is one ``print(...)`` with a comment."""
    claims = {}
    for number, line in enumerate(code.splitlines(), start=1):
        match = re.match(r"^\s*print\(.*\)\s+#\s(?P<comment>.*)$", line)
        if match:
            claims[number] = match.group("comment")
    return claims


def run_block(block: Block) -> dict[int, list[str]]:
    """Run a block in a fresh namespace; what each of its lines printed, by line number."""
    printed: dict[int, list[str]] = {}

    def recording_print(*values: object, sep: str | None = " ", end: str | None = "\n") -> None:
        caller = sys._getframe(1)
        text = (" " if sep is None else sep).join(str(value) for value in values)
        if caller.f_code.co_filename == block.name:
            printed.setdefault(caller.f_lineno, []).append(text)
        print(text, end="\n" if end is None else end)

    namespace = {"__name__": "__readme__", "print": recording_print}
    exec(compile(block.code, block.name, "exec"), namespace)
    return printed


@pytest.mark.parametrize("block", [_param(block) for block in PROGRAMS])
def test_readme_block_runs_and_prints_what_it_says(block: Block) -> None:
    printed = run_block(block)
    for number, comment in printed_claims(block.code).items():
        outputs = printed.get(number, [])
        assert outputs, f"{block.name}, line {number}: says {comment!r} but printed nothing"
        if explains(comment, outputs[0]):
            continue
        assert len(outputs) == 1, f"{block.name}, line {number}: printed {len(outputs)} times"
        first_line = outputs[0].splitlines()[0]
        assert shows(comment, first_line), (
            f"{block.name}, line {number} prints {first_line!r}, the README says {comment!r}"
        )


def test_readme_prints_claims_that_are_checked() -> None:
    """The claims the test above checks are there (a README rewrite could lose them all)."""
    claims = [
        c for block in PROGRAMS if not block.marker for c in printed_claims(block.code).values()
    ]
    assert len(claims) >= 10


@pytest.mark.parametrize(
    ("comment", "output", "expected"),
    [
        ("3 3: warmup and capture count nothing", "3 3", True),
        ("8 () 99328: 4 sets, not 8", "8 () 32768", False),
        ("(1, 1, -1, ...): 1F1B", "(1, 1, -1, 1, -1, -1)", True),
        ("Linear: a forward is ...", "Linear: a forward is out of order", True),
        (
            "['x']: expected float32[2], got float32[3]",
            "['x']: expected float32[2], got float32[3]",
            True,
        ),
        ("['x']: expected float32[2]: the why", "['x']: expected float32[2]", True),
        ("['x']: expected float32[2], got float32[3]", "['x']: got float32[3]", False),
        ("T((...))", "T((a, b))", True),
    ],
)
def test_shows_reads_a_comment_as_output_and_why(comment: str, output: str, expected: bool) -> None:
    assert shows(comment, output) is expected


@pytest.mark.parametrize(
    ("comment", "output", "expected"),
    [
        ("3 3: warmup and capture count nothing", "4 4", False),  # a claim, now wrong
        ("True", "False", False),
        ("Linear: a forward is ...", "TinyMLP: a forward is ...", False),
        ("on a CPU: what a capture on a GPU would reject", "capture lint of Model", True),
        ("before capture; a capture keeps one", "memory plan (bytes)", True),
        ("a table by path", "a table by path", False),  # shows() judges it
    ],
)
def test_a_comment_is_prose_only_in_lower_case_and_unlike_the_output(
    comment: str, output: str, expected: bool
) -> None:
    # any first character unlike the output's read as prose: '# 3 3' printing '4 4' passed
    assert explains(comment, output) is expected


def _output_blocks() -> list[tuple[Block, Block]]:
    """Each Python block of the README followed by ``Its output ...:`` and a ```text block."""
    blocks = read_blocks(README.read_text())
    lines = README.read_text().splitlines()
    pairs = []
    for block, following in itertools.pairwise(blocks):
        between = lines[block.line : following.line - 1]
        if (block.language, following.language) == ("python", "text") and any(
            line.startswith("Its output") for line in between
        ):
            pairs.append((block, following))
    return pairs


OUTPUT_BLOCKS = _output_blocks()


@pytest.mark.parametrize(
    ("block", "output"), OUTPUT_BLOCKS, ids=[block.name for block, _ in OUTPUT_BLOCKS]
)
def test_readme_output_block_is_what_the_program_prints(block: Block, output: Block) -> None:
    filename = f"{block.section.split(':')[0].strip().lower()}.py"
    linecache.cache[filename] = (len(block.code), None, block.code.splitlines(True), filename)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            exec(compile(block.code, filename, "exec"), {"__name__": "__readme__"})
    finally:
        linecache.cache.pop(filename, None)
    assert captured.getvalue() == output.code


def test_readme_has_an_output_block() -> None:
    assert OUTPUT_BLOCKS


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
