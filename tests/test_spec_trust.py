"""A spec file is data: reading one never imports, never calls an unregistered class, and any
malformed document is a DualgraphError. Named attacks, each malformed-document class, and
hypothesis-generated hostile documents."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import TREES, EncoderOutput, array

import dualgraph
from dualgraph import CallSpec, DualgraphError, TreeSpec, describe

MARKER = "dualgraph_trust_marker"


def document(rows: Any, *, version: Any = 2) -> str:
    return json.dumps({"format": "dualgraph.TreeSpec", "version": version, "tree": rows})


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module on sys.path that leaves a file behind if it is ever imported or its class built."""
    folder = tmp_path_factory.mktemp("marker")
    touched = folder / "touched"
    (folder / f"{MARKER}.py").write_text(
        textwrap.dedent(
            f"""
            import collections, pathlib
            pathlib.Path({str(touched)!r}).write_text("imported")

            class Thing:
                def __init__(self, *args, **kwargs):
                    pathlib.Path({str(touched)!r}).write_text("called")

            Pair = collections.namedtuple("Pair", "a b")
            """
        )
    )
    sys.path.insert(0, str(folder))
    try:
        yield touched
    finally:
        sys.path.remove(str(folder))
    assert MARKER not in sys.modules
    assert not touched.exists()


def test_the_marker_module_would_show_an_import(marker: Path) -> None:
    # The marker works: importing it in a child process leaves the file behind.
    script = f"import sys; sys.path.insert(0, {str(marker.parent)!r}); import {MARKER}"
    subprocess.run([sys.executable, "-c", script], check=True)
    assert marker.read_text() == "imported"
    marker.unlink()


# -- named attacks -----------------------------------------------------------------------------


def test_the_builtins_list_and_subprocess_popen_chain_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    called: list[Any] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: called.append((a, k)))
    pwned = tmp_path / "pwned"
    rows = [
        ["namedtuple", "subprocess:Popen", ["args"]],
        ["namedtuple", "builtins:list", ["items"]],
        ["dict", ["shell"]],
        ["const", "str", f"touch {pwned}"],
    ]
    with pytest.raises(DualgraphError) as caught:
        TreeSpec.from_json(document(rows))
    message = str(caught.value)
    assert message.startswith("malformed TreeSpec JSON at <root>: namedtuple 'subprocess:Popen'")
    assert "never imports a module or calls a class named in a spec" in message
    assert "dualgraph.register_namedtuple(cls)" in message
    assert called == [] and not pwned.exists()


def test_the_version_1_attack_document_is_refused() -> None:
    tree = {
        "node": "namedtuple",
        "type": "subprocess:Popen",
        "fields": ["args"],
        "children": [{"leaf": "const", "type": "str", "value": "true"}],
    }
    with pytest.raises(DualgraphError, match="TreeSpec JSON version 1 is not supported"):
        TreeSpec.from_json(json.dumps({"format": "dualgraph.TreeSpec", "version": 1, "tree": tree}))


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
@pytest.mark.parametrize("name", [f"{MARKER}:Thing", f"{MARKER}:Pair", MARKER, f"{MARKER}:"])
def test_naming_a_module_neither_imports_it_nor_calls_its_classes(
    marker: Path, kind: str, name: str
) -> None:
    with pytest.raises(DualgraphError, match=f"{kind} '{name}' is not registered in this process"):
        TreeSpec.from_json(document([[kind, name, []]]))


@pytest.mark.parametrize(
    "name",
    ["collections:OrderedDict", "builtins:object", "os:system", "builtins:dict", "trees:array"],
)
def test_importable_classes_the_program_did_not_register_are_refused(name: str) -> None:
    with pytest.raises(DualgraphError, match="is not registered in this process"):
        TreeSpec.from_json(document([["namedtuple", name, []]]))
    with pytest.raises(DualgraphError, match="is not registered in this process"):
        TreeSpec.from_json(document([["dataclass", name, []]]))


def test_a_registered_class_named_as_another_kind_is_refused() -> None:
    name = f"{EncoderOutput.__module__}:{EncoderOutput.__qualname__}"
    with pytest.raises(DualgraphError, match="in this process is not a namedtuple"):
        TreeSpec.from_json(document([["namedtuple", name, []]]))


def test_a_registered_class_with_other_fields_is_refused() -> None:
    name = f"{EncoderOutput.__module__}:{EncoderOutput.__qualname__}"
    rows = [["dataclass", name, ["hidden", "os"]], ["none"], ["none"]]
    with pytest.raises(DualgraphError, match=r"has fields \['hidden', 'pooled', 'aux_loss'\]"):
        TreeSpec.from_json(document(rows))


def test_call_spec_documents_are_held_to_the_same_rules(marker: Path) -> None:
    text = json.dumps(
        {
            "format": "dualgraph.CallSpec",
            "version": 1,
            "args": [
                ["tuple", 1],
                ["namedtuple", f"{MARKER}:Pair", ["a", "b"]],
                ["none"],
                ["none"],
            ],
            "kwargs": [["dict", []]],
        }
    )
    with pytest.raises(DualgraphError, match=r"^malformed CallSpec JSON at args\[0\]: namedtuple"):
        CallSpec.from_json(text)


def test_a_spec_read_back_binds_the_registered_class_itself() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    dualgraph.register_namedtuple(Pair)
    loaded = TreeSpec.from_json(describe(Pair(array(2), None)).to_json())
    assert type(loaded.unflatten([array(2)])) is Pair


# -- every class of malformed document ---------------------------------------------------------


@dataclasses.dataclass
class Case:
    text: Any
    message: str


MALFORMED = {
    "not-json": Case("{'format': 1}", "not a TreeSpec JSON document: "),
    "bytes-not-utf8": Case(b"\xc3\x28", "not UTF-8"),
    "not-a-str": Case(12, "a TreeSpec JSON document is a str, got int"),
    "deep-json": Case('{"tree": ' + "[" * 50_000, "not a TreeSpec JSON document: "),
    "huge-int": Case('{"version": ' + "9" * 5000 + "}", "not a TreeSpec JSON document: "),
    "repeated-key": Case(
        '{"format":"dualgraph.TreeSpec","format":"dualgraph.TreeSpec"}', "appears twice"
    ),
    "bool-version": Case(document([["none"]], version=True), "version True is not supported"),
    "float-version": Case(document([["none"]], version=2.0), "version 2.0 is not supported"),
    "tree-not-a-list": Case(document({"0": ["none"]}), "a tree is a non-empty list"),
    "empty-tree": Case(document([]), "a tree is a non-empty list"),
    "row-not-a-list": Case(document(["none"]), "a node row is a list starting with its kind"),
    "row-kind-not-a-str": Case(document([[3]]), "a node row is a list starting with its kind"),
    "unknown-kind": Case(document([["set", 1]]), "unknown node kind 'set'"),
    "bool-as-length": Case(document([["tuple", True], ["none"]]), "a tuple row is"),
    "negative-length": Case(document([["list", -1]]), "a list row is"),
    "children-missing": Case(document([["list", 2], ["none"]]), "leave room for 1"),
    "rows-left-over": Case(document([["none"], ["none"]]), "1 rows follow the end"),
    "nan-dim": Case(document([["array", "float32", [float("nan")], True]]), "bad shape [nan]"),
    "negative-dim": Case(document([["array", "float32", [-2], True]]), "bad shape [-2]"),
    "bool-dim": Case(document([["array", "float32", [True], True]]), "True is not an int"),
    "absurd-dim": Case(document([["array", "float32", [2**64], True]]), "dimensions are in"),
    "too-many-dims": Case(document([["array", "float32", [1] * 65, True]]), "at most 64"),
    "object-dtype": Case(document([["array", "O", [2], True]]), "dtype 'O' is not one"),
    "string-dtype": Case(document([["array", "S100000000000", [2], True]]), "is not one"),
    "record-dtype": Case(document([["array", "(2,3)f4,i8", [2], True]]), "is not one"),
    "int-grad": Case(document([["array", "float32", [2], 1]]), "grad is a bool"),
    "int-as-bool": Case(document([["const", "bool", 1]]), "a bool constant holds 1"),
    "bool-as-int": Case(document([["const", "int", False]]), "a int constant holds False"),
    "float-as-json-number": Case(document([["const", "float", 0.5]]), "stored as its repr"),
    "float-not-canonical": Case(document([["const", "float", "0.50"]]), "stored as its repr"),
    "infinite-json-number": Case(document([["const", "int", float("inf")]]), "holds inf"),
    "huge-int-constant": Case(document([["const", "int", 2**5000]]), "over the 2048-bit"),
    "float-key": Case(document([["dict", [1.5]], ["none"]]), "dict key 1.5 of type float"),
    "null-key": Case(document([["dict", [None]], ["none"]]), "dict key None of type NoneType"),
    "bool-key": Case(document([["dict", [True]], ["none"]]), "dict key True of type bool"),
    "repeated-key-in-row": Case(document([["dict", ["a", "a"]]] + [["none"]] * 2), "repeat"),
    "keys-not-a-list": Case(document([["dict", "ab"]]), "a dict row is"),
    "long-class-name": Case(document([["namedtuple", "m:" + "x" * 2000, []]]), "at most 1024"),
    "fields-not-a-list": Case(document([["namedtuple", "m:X", "ab"]]), "a namedtuple row is"),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_each_malformed_document_is_a_dualgraph_error_saying_what(case: Case) -> None:
    with pytest.raises(DualgraphError) as caught:
        TreeSpec.from_json(case.text)
    assert case.message in str(caught.value)
    assert type(caught.value) is DualgraphError


def test_errors_in_rows_name_the_path_of_the_row() -> None:
    rows = [["dict", ["x", "y"]], ["none"], ["list", 2], ["none"], ["array", "float32", [-1], True]]
    with pytest.raises(
        DualgraphError, match=r"^malformed TreeSpec JSON at \['y'\]\[1\]: bad shape"
    ):
        TreeSpec.from_json(document(rows))


# -- hostile documents, generated --------------------------------------------------------------

TAGS = ["none", "const", "array", "tuple", "list", "dict", "ordereddict", "namedtuple", "dataclass"]
NAMES = [f"{MARKER}:Thing", f"{MARKER}:Pair", "subprocess:Popen", "builtins:list", "os:system"]
NAMES += ["trees:Attention", "trees:EncoderOutput", "collections:OrderedDict"]
text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=8) | st.sampled_from(
    ["float32", "bfloat16", "key<fry>", "O", "int", "float", "str", "bool", "nan", "-0.0", "1e999"]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, -1, 2**63, 2**64, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
    st.sampled_from(TAGS + NAMES),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=3),
    max_leaves=10,
)


@st.composite
def rows(draw: st.DrawFn) -> list[Any]:
    tag = draw(st.sampled_from([*TAGS, "set", ""]))
    shape = draw(st.lists(st.one_of(st.integers(-2, 4), values), max_size=3))
    choices = {
        "none": [],
        "const": [draw(st.sampled_from(["int", "bool", "float", "str", "x"])), draw(values)],
        "array": [draw(text), shape, draw(values)],
        "tuple": [draw(st.integers(-1, 3) | values)],
        "list": [draw(st.integers(-1, 3) | values)],
        "dict": [draw(st.lists(st.one_of(text, st.integers(-2, 2), values), max_size=3))],
        "ordereddict": [draw(st.lists(text, max_size=3))],
        "namedtuple": [draw(st.sampled_from(NAMES) | text), draw(st.lists(text, max_size=3))],
        "dataclass": [draw(st.sampled_from(NAMES) | text), draw(st.lists(text, max_size=3))],
    }
    row = [tag, *choices.get(tag, [draw(values)])]
    if draw(st.integers(0, 9)) == 0:  # now and then, a row of the wrong length
        row = row[: draw(st.integers(0, len(row)))] + draw(st.lists(values, max_size=2))
    return row


@st.composite
def documents(draw: st.DrawFn) -> Any:
    document: Any = {
        "format": draw(st.sampled_from(["dualgraph.TreeSpec", "dualgraph.TreeSpec", "x"])),
        "version": draw(st.sampled_from([2, 2, 2, 1, True, 2.0, "2", None])),
        "tree": draw(st.lists(rows(), max_size=8) | values),
    }
    if draw(st.integers(0, 9)) == 0:
        document = draw(values)
    if draw(st.booleans()):
        return json.dumps(document)  # NaN and Infinity included, as Python writes them
    return json.dumps(document).encode()


@given(text=documents())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hostile_documents_raise_only_dualgraph_errors_and_import_nothing(
    marker: Path, text: Any
) -> None:
    modules = set(sys.modules)
    try:
        spec = TreeSpec.from_json(text)
    except DualgraphError:
        pass
    else:  # a document that reads is a working spec
        assert TreeSpec.from_json(spec.to_json()) == spec
        repr(spec)
        spec.unflatten([None] * spec.num_arrays)
    assert set(sys.modules) == modules
    assert MARKER not in sys.modules
    assert not marker.exists()


@given(st.lists(rows(), min_size=1, max_size=8), st.lists(rows(), min_size=1, max_size=4))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hostile_call_spec_documents_raise_only_dualgraph_errors(
    args: list[Any], kwargs: list[Any]
) -> None:
    text = json.dumps(
        {"format": "dualgraph.CallSpec", "version": 1, "args": args, "kwargs": kwargs}
    )
    modules = set(sys.modules)
    try:
        spec = CallSpec.from_json(text)
    except DualgraphError as error:
        assert str(error).startswith(("malformed CallSpec JSON at ", "args: ", "kwargs: "))
    else:
        assert CallSpec.from_json(spec.to_json()) == spec
    assert set(sys.modules) == modules


# -- valid documents, mutated -------------------------------------------------------------------

#: Tokens json.dumps cannot write (or writes otherwise), each put in a document's text where
#: json.dumps wrote its marker (a str of its own): nesting deeper than any parser's recursion
#: limit and one just under it, ints longer than any a spec takes, non-finite and negative-zero
#: tokens, and numbers written as floats where ints are expected.
RAW_TOKENS = {
    "\x00deep": "[" * 100_000 + "]" * 100_000,
    "\x00deep-object": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "\x00nested": "[" * 900 + "]" * 900,
    "\x00long-int": "9" * 700,
    "\x00long-negative-int": "-" + "9" * 700,
    "\x00minus-zero": "-0",
    "\x00two-as-float": "2.0",
    "\x00two-in-exponent": "2e0",
    "\x00huge-float": "1e400",
    "\x00nan": "NaN",
    "\x00minus-infinity": "-Infinity",
}
raw_tokens = st.sampled_from(sorted(RAW_TOKENS))

json_atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**400, 2**2048, -(2**2048)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([*TAGS, *NAMES, "float32", "int64", "key<fry>", "O", "-0.0", "nan", "1e999"]),
    st.sampled_from(["int", "float", "bool", "str", "args", "kwargs", "format", "version"]),
    st.text(max_size=4),
    # surrogates (lone, and a pair held as two code points), and very long strings
    st.sampled_from(
        ["\ud800", "\udfff", "a\ud83d\ude00", "\ud83d", "x" * 100_000, "\u00e9" * 5000]
    ),
    raw_tokens,
)
json_values = st.recursive(
    json_atoms,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=3) | st.sampled_from(["\ud800", "\x00deep"]), inner)
    ),
    max_leaves=6,
)


def retyped(value: Any) -> list[Any]:
    """``value`` as other JSON types that Python compares equal to it, or that look alike:
    ``true`` for ``1``, ``2.0`` for ``2``, ``"2"`` for ``2``, ``[x]`` for ``x``."""
    found: list[Any] = [[value], str(value)]
    if type(value) is bool:
        found += [int(value), float(value)]
    elif type(value) is int:
        found += [bool(value), -value, value + 2**64, "\x00two-as-float"]
        if abs(value) < 2**53:
            found.append(float(value))
    elif type(value) is list and value:
        found += [value[0], tuple(value), {"0": value[0]}]
    return found


def document_text(document: Any) -> str:
    """``document`` as JSON (NaN and Infinity as Python writes them), each marker of
    :data:`RAW_TOKENS` replaced by its token."""
    text = json.dumps(document)
    for marker, token in RAW_TOKENS.items():
        text = text.replace(json.dumps(marker), token)
    return text


def strict_json(value: Any) -> str:
    """Parsed JSON written back so that ``true``, ``1`` and ``1.0`` differ (``==`` does not)."""
    return json.dumps(value, sort_keys=True)


@st.composite
def mutated(draw: st.DrawFn, value: Any) -> Any:
    """``value`` (parsed JSON) with one random change somewhere inside it."""
    # Choices come first where hypothesis starts (and shrinks to): a small change deep inside.
    if isinstance(value, list | dict) and value and draw(st.integers(0, 5)) < 5:
        keys = list(range(len(value))) if isinstance(value, list) else list(value)
        key = draw(st.sampled_from(keys))
        copy = list(value) if isinstance(value, list) else dict(value)
        op = draw(st.sampled_from(["inside", "inside", "replace", "delete", "insert", "copy"]))
        if op == "inside":
            copy[key] = draw(mutated(value[key]))
        elif op == "replace" and draw(st.booleans()):  # another type that looks alike
            copy[key] = draw(st.sampled_from(retyped(value[key])))
        elif op == "replace":
            copy[key] = draw(json_values)
        elif op == "delete":
            del copy[key]
        elif isinstance(copy, list):  # insert a new value, or a copy of a sibling (a row)
            sibling = copy[draw(st.integers(0, len(copy) - 1))]
            copy.insert(key, draw(json_values) if op == "insert" else sibling)
        else:
            copy[draw(st.text(max_size=8))] = draw(json_values)
        return copy
    if not draw(st.booleans()):  # a value of the same JSON type: often still a valid document
        words = st.sampled_from([*TAGS, "float32", "int64", "bool", "int", "str", "a", "b"])
        same = {bool: st.booleans(), int: st.integers(-1, 4), str: words | st.text(max_size=3)}
        return draw(same.get(type(value), json_values))
    return draw(json_values)


def valid_documents() -> list[str]:
    documents = [describe(build()).to_json() for build in TREES.values()]
    documents += [
        dualgraph.describe_call((build(), 3), {"kw": build(), "flag": True}).to_json()
        for build in TREES.values()
    ]
    return documents


@given(data=st.data(), start=st.sampled_from(valid_documents()))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_documents_raise_only_dualgraph_errors_or_read_back_exactly(
    marker: Path, data: st.DataObject, start: str
) -> None:
    document = json.loads(start)
    for _ in range(data.draw(st.integers(1, 3))):
        trees = (
            [k for k in document if k in ("tree", "args", "kwargs")]
            if isinstance(document, dict)
            else []
        )
        if trees and data.draw(st.integers(0, 9)) < 9:  # mostly the rows of a tree
            key = data.draw(st.sampled_from(trees))
            document[key] = data.draw(mutated(document[key]))
        else:  # now and then anywhere, the format and version too
            document = data.draw(mutated(document))
    text = document_text(document)
    kind: Any = TreeSpec if '"dualgraph.TreeSpec"' in start else CallSpec
    modules = set(sys.modules)
    try:
        spec = kind.from_json(text)
    except DualgraphError as error:
        assert_names_where(str(error), kind.__name__)
    else:  # what reads writes back the same document, and reads back as an equal spec
        written = spec.to_json()
        assert strict_json(json.loads(written)) == strict_json(json.loads(text))
        again = kind.from_json(written)
        assert again == spec and hash(again) == hash(spec) and again.to_json() == written
        assert kind.from_json(text.encode()) == spec
    assert set(sys.modules) == modules
    assert not marker.exists()


#: What a refused document is told by: the document as a whole (its format, version, keys, or
#: text), or a tree's rows as a whole.
DOCUMENT_ERRORS = re.compile(
    r"not a \w+ JSON document|\w+ JSON version .* is not supported|malformed \w+ JSON: |"
    r"\w+ JSON of \d+ (characters|bytes)|\w+ JSON written back|"
    r"malformed \w+ JSON at (<root>|args|kwargs): a tree (is a non-empty list|has at most)"
)


def assert_names_where(message: str, kind: str) -> None:
    """A refusal says what it refused: the document as a whole, or a row by its path in the
    tree and its place in the document's rows."""
    if DOCUMENT_ERRORS.match(message):
        return
    assert message.startswith(f"malformed {kind} JSON at "), message
    assert re.search(r" \(row \d+ of the document's \"(tree|args|kwargs)\" list\)$", message), (
        message
    )


def test_documents_naming_the_marker_module_leave_it_unimported(marker: Path) -> None:
    for name in (f"{MARKER}:Thing", f"{MARKER}:Pair", MARKER):
        for kind in ("namedtuple", "dataclass"):
            with pytest.raises(DualgraphError, match="is not registered in this process"):
                TreeSpec.from_json(document([[kind, name, ["a", "b"]], ["none"], ["none"]]))
    assert MARKER not in sys.modules and not marker.exists()
