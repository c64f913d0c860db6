"""Spec documents: parsing within bounds, the document's own checks, and row paths in errors."""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dualgraph import CallSpec, DualgraphError, TreeSpec, describe, register_namedtuple
from dualgraph import _json as json_module
from dualgraph._containers import qualified_name
from dualgraph._json import next_entries, read_document, read_tree
from dualgraph._nodes import MAX_INT_BITS
from dualgraph._paths import Index, Key

FORMAT = "dualgraph.TreeSpec"


def load(text: Any) -> TreeSpec:
    return TreeSpec.from_json(text)


def document(**fields: Any) -> str:
    return json.dumps({"format": FORMAT, "version": 2, "tree": [["none"]], **fields})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a TreeSpec JSON document: Expecting value"),
        ("{", "not a TreeSpec JSON document: "),
        ("[" * 100_000, "not a TreeSpec JSON document: "),  # deeper than the parser recurses
        ("1" * 5000, "not a TreeSpec JSON document: "),  # past int's str-conversion limit
        ('"\\ud800"', "not a TreeSpec JSON document (format must be"),
        ("null", "not a TreeSpec JSON document (format must be"),
        ("[]", "not a TreeSpec JSON document (format must be"),
        (
            '{"format": "other"}',
            "not a TreeSpec JSON document (format must be 'dualgraph.TreeSpec')",
        ),
    ],
    ids=["empty", "truncated", "deep", "huge-int", "surrogate", "null", "list", "format"],
)
def test_documents_that_are_not_specs_are_refused(text: str, message: str) -> None:
    with pytest.raises(DualgraphError, match="^" + re.escape(message)):
        load(text)


@pytest.mark.parametrize("version", [1, 3, True, 2.0, "2", None, [2], 10**100], ids=repr)
def test_only_version_2_is_read_and_bools_are_not_ints(version: Any) -> None:
    with pytest.raises(DualgraphError, match=r"TreeSpec JSON version .* is not supported"):
        load(document(version=version))


def test_a_repeated_key_is_refused() -> None:
    text = '{"format":"dualgraph.TreeSpec","version":2,"tree":[["none"]],"tree":[["none"]]}'
    with pytest.raises(DualgraphError, match="the key 'tree' appears twice"):
        load(text)


def test_a_repeated_key_inside_a_tree_is_refused_naming_its_rows_path() -> None:
    # Before: 'malformed JSON: the key 'a' appears twice in an object', naming no place
    text = document(tree=[["tuple", 2], ["none"], ["const", "str", "@"]])
    text = text.replace('"@"', '{"a":1,"a":2}')
    message = "malformed TreeSpec JSON at [1]: a str constant holds <an object naming the key 'a'"
    with pytest.raises(DualgraphError, match="^" + re.escape(message)):
        load(text)


def test_an_unknown_key_is_refused() -> None:
    with pytest.raises(DualgraphError, match="unknown key 'extra'"):
        load(document(extra=1))


def test_a_missing_tree_is_refused() -> None:
    with pytest.raises(DualgraphError, match="'tree' is missing"):
        load('{"format": "dualgraph.TreeSpec", "version": 2}')


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"], ids=["nan", "inf", "-inf"])
def test_non_standard_json_constants_are_refused_where_they_stand(constant: str) -> None:
    text = '{"format":"dualgraph.TreeSpec","version":2,"tree":[["array","float32",[%s],true]]}'
    with pytest.raises(DualgraphError, match=r"^malformed TreeSpec JSON at <root>: bad shape"):
        load(text % constant)


def test_bytes_are_read_as_utf8() -> None:
    spec = describe({"é": 1})
    assert load(spec.to_json().encode()) == spec
    assert load(bytearray(spec.to_json().encode())) == spec
    for bad in (b"\xff", b'{"\xed\xa0\x80": 1}'):  # not UTF-8; an encoded surrogate
        with pytest.raises(DualgraphError, match="not UTF-8"):
            load(bad)


def test_a_document_whose_class_cannot_be_read_is_a_dualgraph_error() -> None:
    # Before: the isinstance test for bytes leaked the object's own ValueError
    class ClassUnreadable:
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            raise ValueError("no class to read")

    with pytest.raises(DualgraphError, match="a TreeSpec JSON document is a str"):
        load(ClassUnreadable())


def test_a_memoryview_that_cannot_be_read_is_a_dualgraph_error() -> None:
    # Before: bytes() of a released memoryview leaked its ValueError from from_json
    view = memoryview(describe((None,)).to_json().encode())
    view.release()
    with pytest.raises(DualgraphError, match="could not be read from the memoryview"):
        load(view)


@pytest.mark.parametrize("text", [3, None, ["[]"], object()], ids=repr)
def test_a_document_is_a_str_or_bytes(text: Any) -> None:
    with pytest.raises(DualgraphError, match="a TreeSpec JSON document is a str"):
        load(text)


def test_documents_over_the_size_limit_are_refused_before_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(json_module, "MAX_JSON_CHARS", 10)
    with pytest.raises(DualgraphError, match="over the limit of 10"):
        load(document())


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview], ids=repr)
def test_a_bytes_document_longer_than_any_within_the_limit_is_refused_before_decoding(
    monkeypatch: pytest.MonkeyPatch, kind: Any
) -> None:
    # Before: the bytes were copied and decoded whole first (a document of gigabytes took as
    # much again), so these were refused as not UTF-8
    monkeypatch.setattr(json_module, "MAX_JSON_CHARS", 10)
    with pytest.raises(DualgraphError, match=r"of 41 bytes is over the limit of 10 characters"):
        load(kind(b"\xff" * 41))


def test_a_tree_over_the_node_limit_is_refused_before_reading_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(json_module, "MAX_NODES", 3)
    with pytest.raises(DualgraphError, match="a tree has at most 3 nodes, this one 4"):
        load(document(tree=[["tuple", 3]] + [["none"]] * 3))


def test_a_row_cannot_announce_more_children_than_rows_follow() -> None:
    with pytest.raises(DualgraphError, match="the row has 1000000000 children"):
        load(document(tree=[["tuple", 10**9], ["none"]]))


def test_unicode_keys_and_surrogates_round_trip() -> None:
    tree = {"\ud800": None, "naïve ✓": "\udfff", "\x00": 1}
    spec = describe(tree)
    assert spec.to_json().isascii()
    assert load(spec.to_json()) == spec
    assert load(spec.to_json()).unflatten([]) == tree


def test_read_tree_names_the_path_of_a_bad_row() -> None:
    rows = [["dict", ["b", "a"]], ["list", 2], ["none"], ["bad"], ["none"]]  # "a" comes first
    with pytest.raises(DualgraphError, match=r"^malformed Spec JSON at out\['a'\]\[1\]: unknown"):
        read_tree(rows, "Spec", root="out")


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (
            TreeSpec,
            document(tree=[["list", 2], ["none"], ["array", "float32", [-1], True]]),
            "at [1]: bad shape [-1]: dimensions are in [0, 2**63 - 1] "
            '(row 2 of the document\'s "tree" list)',
        ),
        (
            CallSpec,
            json.dumps(
                {
                    "format": "dualgraph.CallSpec",
                    "version": 1,
                    "args": [["tuple", 1], ["none"]],
                    "kwargs": [["dict", ["a", "b"]], ["none"], ["list", 1], ["bad"]],
                }
            ),
            "at kwargs['b'][0]: unknown node kind 'bad' (row 3 of the document's \"kwargs\" list)",
        ),
        (
            TreeSpec,
            document(tree=[["none"], ["none"], ["none"]]),
            '(row 1 of the document\'s "tree"',
        ),
    ],
    ids=["tree", "call", "rows-left-over"],
)
def test_a_malformed_row_is_named_by_its_place_in_the_documents_rows_too(
    kind: Any, text: str, message: str
) -> None:
    # Before: only the tree path ([1]), which as an index into the rows names another row (the
    # document's "tree"[1] is ["none"]), so a reader of the JSON looked at the wrong row.
    with pytest.raises(DualgraphError) as caught:
        kind.from_json(text)
    assert message in str(caught.value)


def test_next_entries_is_the_path_after_a_pre_order_prefix() -> None:
    nodes = describe(({"k": [None, None]}, None))._nodes
    assert next_entries(nodes[:0]) == ()
    assert next_entries(nodes[:1]) == (Index(0),)
    assert next_entries(nodes[:2]) == (Index(0), Key("k"))
    assert next_entries(nodes[:4]) == (Index(0), Key("k"), Index(1))
    assert next_entries(nodes[:5]) == (Index(1),)
    assert next_entries(nodes) == ()


def test_read_document_returns_the_checked_document() -> None:
    found = read_document(document(), FORMAT, 2, ("tree",))
    assert found == {"format": FORMAT, "version": 2, "tree": [["none"]]}


#: CPython hashes an int by its value modulo 2**61 - 1: these ints all hash to 0.
COLLIDING_INTS = [k * (2**61 - 1) for k in range(8000)]


def colliding_rows() -> dict[str, list[list[Any]]]:
    """Rows of int constants and of array shapes that all have one hash, and of unequal ones."""
    dims = [0, *COLLIDING_INTS[1:5]]  # shapes of 8 of these dims: one hash, 5**8 of them
    shapes = [[dims[i // 5**j % 5] for j in range(8)] for i in range(len(COLLIDING_INTS))]
    return {
        "constants": [["const", "int", n] for n in COLLIDING_INTS],
        "shapes": [["array", "int8", shape, False] for shape in shapes],
        "plain constants": [["const", "int", n] for n in range(len(COLLIDING_INTS))],
    }


def test_rows_whose_nodes_share_one_hash_read_in_linear_time() -> None:
    # Equal nodes were shared through a dict keyed by the nodes, where n keys of one hash take
    # time quadratic in n: 20,000 such rows (0.9 MB) took 9 s to read.
    # The best of three reads each, in CPU time, against a bound far above linear and far below
    # quadratic: a loaded machine (a garbage collection, another process) must not fail it.
    seconds = {}
    for name, rows in colliding_rows().items():
        document = [["list", len(rows)], *rows]
        tries = []
        for _ in range(3):
            start = time.process_time()
            read_tree(document, "TreeSpec")
            tries.append(time.process_time() - start)
        seconds[name] = min(tries)
    plain = seconds.pop("plain constants")
    for name, took in seconds.items():
        assert took < 20 * plain + 0.05, f"{name}: {took:.2f} s, plain rows {plain:.3f} s"


@pytest.fixture
def no_int_digit_limit() -> Iterator[None]:
    """Python's int/str conversion unlimited (``sys.set_int_max_str_digits(0)``)."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(before)


def test_a_long_int_is_refused_before_it_is_converted(no_int_digit_limit: None) -> None:
    # Converting n digits takes time quadratic in n: without the interpreter's limit, a 1.6 MB
    # document of one int took 106 s to refuse.
    text = document(tree=[["const", "int", 0]]).replace("0]]", "7" * 400_000 + "]]")
    start = time.perf_counter()
    with pytest.raises(
        DualgraphError, match=r"^not a TreeSpec JSON document: an int of 400000 digits"
    ):
        load(text)
    assert time.perf_counter() - start < 1.0


def test_the_longest_int_a_spec_takes_is_read(no_int_digit_limit: None) -> None:
    largest = -(2**MAX_INT_BITS - 1)
    assert load(document(tree=[["const", "int", largest]])).unflatten([]) == largest


def test_a_spec_whose_json_is_over_the_read_limit_is_refused_when_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # to_json wrote a document that from_json then refused: what one writes, the other reads
    monkeypatch.setattr(json_module, "MAX_JSON_CHARS", 200)
    spec = describe(("x" * 300, None))
    with pytest.raises(DualgraphError, match=r"over the limit of 200 .*TreeSpec\.from_json"):
        spec.to_json()


def test_a_document_whose_spec_would_be_written_over_the_limit_is_refused_when_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: raw non-ASCII text is read as one character each and written as a 6-character
    # escape, so from_json took a document within the limit whose spec to_json then refused
    monkeypatch.setattr(json_module, "MAX_JSON_CHARS", 200)
    raw = json.dumps(
        {"format": FORMAT, "version": 2, "tree": [["const", "str", "\u00e9" * 60]]},
        ensure_ascii=False,
    )
    assert len(raw) <= 200
    with pytest.raises(DualgraphError, match=r"written back .* over the limit of 200"):
        load(raw)
    assert load(raw.replace("\u00e9" * 60, "\u00e9" * 10)).to_json()  # one that fits reads


def test_a_class_name_over_the_read_limit_is_refused_when_written() -> None:
    # a namedtuple of a 1100-character name was written, and its JSON refused when read back
    cls = collections.namedtuple("P" * 1100, ["x"])  # type: ignore[misc]
    spec = describe(cls(None))
    with pytest.raises(DualgraphError, match=r"cannot write the spec at <root>: .*1024"):
        spec.to_json()


@pytest.mark.parametrize(
    "tree",
    ["\ud83d\ude00", {"x\ud83d\ude00": None}, collections.OrderedDict([("\udbff\udfff", 1)])],
    ids=["constant", "key", "ordereddict-key"],
)
def test_a_surrogate_pair_held_as_two_code_points_is_refused_when_written(tree: Any) -> None:
    # Before: JSON wrote the two code points as the escapes of one character, so the spec read
    # back held that character ('\U0001f600') and refused the very tree it was written from
    spec = describe(tree)
    with pytest.raises(DualgraphError, match=r"cannot write the spec at <root>: .*two code points"):
        spec.to_json()


#: A namedtuple class registered under a name holding a surrogate pair as two code points.
PairNamed = collections.namedtuple("PairNamed", ["x"])  # type: ignore[misc]
PairNamed.__qualname__ = "PairNamed\ud83d\ude00"
register_namedtuple(PairNamed)


@pytest.mark.parametrize(
    "rows",
    [
        [["const", "str", "\ud83d\ude00"]],
        [["dict", ["\ud83d\ude00"]], ["none"]],
        [["namedtuple", qualified_name(PairNamed), ["x"]], ["none"]],
    ],
    ids=["constant", "key", "class-name"],
)
def test_a_str_document_holding_a_raw_surrogate_pair_is_refused_when_read(
    rows: list[Any],
) -> None:
    # Before: a document given as a str may hold the two code points themselves (no escapes):
    # from_json took them, and the spec's to_json then refused to write what it had read
    text = document(tree=rows)
    raw = text.replace("\\ud83d\\ude00", "\ud83d\ude00")
    assert raw != text
    with pytest.raises(
        DualgraphError, match=r"^malformed TreeSpec JSON at <root>: .*two code points"
    ):
        load(raw)


def test_lone_surrogates_and_characters_beyond_the_bmp_are_written_and_read_back() -> None:
    spec = describe(("\ud83d", "\ude00", "\ude00\ud83d", "\U0001f600", {"\ud800": None}))
    assert load(spec.to_json()) == spec


def test_a_class_name_holding_a_surrogate_pair_is_refused_when_written() -> None:
    cls = collections.namedtuple("P", ["x"])  # type: ignore[misc]
    cls.__qualname__ = "P\ud83d\ude00"
    spec = describe(cls(None))
    with pytest.raises(DualgraphError, match=r"cannot write the spec at <root>: the class name"):
        spec.to_json()
