"""The node model: frozen leaf nodes that validate what they are made of and compare by value."""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dualgraph import SpecMismatchError, TreeSpec, describe
from dualgraph._nodes import (
    MAX_DIM,
    MAX_INT_BITS,
    MAX_NDIM,
    NONE,
    ArrayLeaf,
    ConstLeaf,
    NodeError,
    NoneLeaf,
    check_shape,
    clip,
    clip_text,
)


def test_leaf_nodes_are_frozen() -> None:
    for node in (NONE, ConstLeaf(1), ArrayLeaf((2,), "float32", True)):
        with pytest.raises(AttributeError, match="frozen"):
            node.key = ()  # type: ignore[misc]
        with pytest.raises(AttributeError, match="frozen"):
            del node.key


def test_equal_nodes_compare_and_hash_equal() -> None:
    assert ArrayLeaf((2, 3), "float32", True) == ArrayLeaf([2, 3], "float32", True)
    assert hash(ConstLeaf(-0.0)) == hash(ConstLeaf(-0.0))
    assert ConstLeaf(math.nan) == ConstLeaf(math.nan)
    assert NoneLeaf() == NONE


@pytest.mark.parametrize(
    ("first", "second"),
    [(True, 1), (1, 1.0), (0.0, -0.0), ("1", 1), (False, 0)],
    ids=["bool-int", "int-float", "zero-signs", "str-int", "false-zero"],
)
def test_constants_of_another_type_or_sign_differ(first: Any, second: Any) -> None:
    assert ConstLeaf(first) != ConstLeaf(second)


def test_array_nodes_differ_by_shape_dtype_and_grad() -> None:
    node = ArrayLeaf((2,), "float32", True)
    assert node != ArrayLeaf((3,), "float32", True)
    assert node != ArrayLeaf((2,), "float16", True)
    assert node != ArrayLeaf((2,), "float32", False)
    assert node.with_grad(False) == ArrayLeaf((2,), "float32", False)
    assert node.with_grad(True) is node


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((-1,), "dimensions are in"),
        ((MAX_DIM + 1,), "dimensions are in"),
        ((True, 2), "True is not an int"),
        ((2.0,), "2.0 is not an int"),
        (("2",), "'2' is not an int"),
        ((2,) * (MAX_NDIM + 1), f"at most {MAX_NDIM} dimensions"),
        ("22", "a shape is a sequence of ints"),
        (None, "a shape is a sequence of ints"),
    ],
    ids=["negative", "huge", "bool", "float", "str", "too-many", "string", "none"],
)
def test_absurd_shapes_are_refused(shape: Any, message: str) -> None:
    with pytest.raises(NodeError, match=message):
        check_shape(shape)


def test_shapes_accept_index_types_such_as_numpy_ints() -> None:
    assert check_shape((np.int64(2), 0, MAX_DIM)) == (2, 0, MAX_DIM)
    assert all(type(d) is int for d in check_shape([np.int32(3)]))


class _IndexOf:
    """A dimension whose ``__index__`` gives ``value``, whatever its type."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __index__(self) -> Any:
        return self.value


class _Int(int):
    pass


def test_a_dimension_whose_index_is_an_int_subclass_is_kept_as_an_exact_int() -> None:
    # Before: the int subclass itself was the shape's dimension (printed by its own repr)
    shape = check_shape((_IndexOf(_Int(3)), _Int(2)))
    assert shape == (3, 2) and [type(d) for d in shape] == [int, int]


@pytest.mark.parametrize("value", [True, 2.0, "2"], ids=repr)
def test_a_dimension_whose_index_is_no_int_is_refused(value: Any) -> None:
    # Before: an __index__ giving True made the shape [True, 2]: the spec printed
    # float32[True, 2] and its JSON ([true, 2]) was refused by from_json
    with pytest.raises(NodeError, match=r"bad shape .* as its __index__, not an int"):
        check_shape((_IndexOf(value), 2))


@pytest.mark.parametrize("dtype", ["O", "object", "S100000000000", "<f4", "f4", "float32,int8", 3])
def test_dtypes_outside_the_vocabulary_are_refused(dtype: Any) -> None:
    with pytest.raises(NodeError, match="is not one a spec accepts"):
        ArrayLeaf((2,), dtype, True)


def test_grad_must_be_a_bool() -> None:
    with pytest.raises(NodeError, match="grad is a bool, got 1"):
        ArrayLeaf((2,), "float32", 1)  # type: ignore[arg-type]


@pytest.fixture
def lowest_int_digits() -> Iterator[None]:
    """Python's int/str conversion limited to 640 digits, the lowest a program may set."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    yield
    sys.set_int_max_str_digits(before)


def test_every_int_a_spec_takes_prints_and_reads_back_under_any_int_digit_limit(
    lowest_int_digits: None,
) -> None:
    # The limit was 4096 bits (1234 digits): a spec written in one process could not be read,
    # shown or explained in another that lowered the limit (repr raised ValueError).
    largest = 2**MAX_INT_BITS - 1
    spec = describe((largest, -largest, {largest: None}))
    assert TreeSpec.from_json(spec.to_json()) == spec
    assert str(largest) in repr(spec)
    assert str(spec.leaves[0]) == str(largest)
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected int 3231\d+\.\.\., got int 1$"):
        spec.check((1, -largest, {largest: None}))


def test_an_int_too_long_to_print_is_shown_by_its_size(lowest_int_digits: None) -> None:
    with pytest.raises(
        SpecMismatchError, match=r"^\[0\]: expected int 1, got an int of 2326 bits$"
    ):
        describe((1,)).check((10**700,))


@pytest.fixture
def no_int_digit_limit() -> Iterator[None]:
    """Python's int/str conversion unlimited (``sys.set_int_max_str_digits(0)``)."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(before)


def test_an_int_over_the_spec_limit_is_shown_by_its_size_without_converting_it(
    no_int_digit_limit: None,
) -> None:
    # Before: with the interpreter's limit lifted, messages converted the whole int to text,
    # in time quadratic in its digits (an int of 30 million bits: minutes for one message)
    big = 1 << 10_000
    with pytest.raises(
        SpecMismatchError, match=r"^\[0\]: expected int 1, got an int of 10001 bits$"
    ):
        describe((1,)).check((big,))
    with pytest.raises(SpecMismatchError, match=r"^\[<an int of 10001 bits>\]: unexpected entry"):
        describe({1: None}).check({1: None, big: None})
    assert clip([1, big, "x"]) == "[1, <an int of 10001 bits>, 'x']"
    assert clip((big,)) == "(<an int of 10001 bits>,)"
    assert clip(list(range(100)), 20) == "[0, 1, 2, 3, 4, 5..."


def test_int_constants_are_bounded() -> None:
    assert ConstLeaf(2**MAX_INT_BITS - 1).value == 2**MAX_INT_BITS - 1
    with pytest.raises(NodeError, match=f"over the {MAX_INT_BITS}-bit limit"):
        ConstLeaf(2**MAX_INT_BITS)


@pytest.mark.parametrize("value", [None, b"x", 1j, [1], np.float32(1)], ids=repr)
def test_only_python_scalars_are_constants(value: Any) -> None:
    with pytest.raises(NodeError, match="a constant is a bool, int, float or str"):
        ConstLeaf(value)


@pytest.mark.parametrize(
    "node",
    [NONE, ConstLeaf(True), ConstLeaf(-0.0), ConstLeaf(math.inf), ConstLeaf("x"), ConstLeaf(2**70)],
    ids=repr,
)
def test_leaf_rows_round_trip(node: Any) -> None:
    assert type(node).from_row(node.row(), 0) == node


def test_array_rows_round_trip() -> None:
    node = ArrayLeaf((2, 0), "bfloat16", False)
    assert node.row() == ["array", "bfloat16", [2, 0], False]
    assert ArrayLeaf.from_row(node.row(), 0) == node


@pytest.mark.parametrize(
    "row",
    [
        ["none", 1],
        ["const", "int"],
        ["const", "int", True],
        ["const", "bool", 1],
        ["const", "float", 1.5],
        ["const", "float", "1.50"],
        ["const", "float", " 1.5"],
        ["const", "float", "1_0.0"],
        ["const", "float", "NaN"],
        ["const", "float", "+nan"],
        ["const", "float", "-NaN"],
        ["const", "float", "nan:0x7ff8000000000000"],  # float("nan") is written "nan"
        ["const", "float", "nan:0x7ff0000000000000"],  # the bits of inf, not a NaN
        ["const", "float", "nan:0xFFF0000000000002"],  # upper-case hex
        ["const", "float", "nan:0x7ff80000000000001"],
        ["const", "float", "nan:7ff8000000000001"],
        ["const", "complex", "1j"],
        ["const", ["int"], 1],
        ["array", "float32", [2], True, "extra"],
        ["array", "float32", 2, True],
    ],
    ids=repr,
)
def test_malformed_leaf_rows_are_node_errors(row: list[Any]) -> None:
    cls = {"none": NoneLeaf, "const": ConstLeaf, "array": ArrayLeaf}[row[0]]
    with pytest.raises(NodeError):
        cls.from_row(row, 0)


def test_float_constants_are_stored_by_their_exact_repr() -> None:
    for value in (0.1, -0.0, 1e-310, math.nan, -math.inf, 1.7976931348623157e308):
        row = ConstLeaf(value).row()
        assert row[2] == repr(value)
        assert repr(ConstLeaf.from_row(row, 0).value) == repr(value)


@pytest.mark.parametrize(
    ("bits", "text"),
    [
        (0x7FF8_0000_0000_0000, "nan"),
        (0xFFF8_0000_0000_0000, "-nan"),
        (0x7FF8_0000_0000_0001, "nan:0x7ff8000000000001"),
        (0xFFF0_0000_0000_0002, "nan:0xfff0000000000002"),
    ],
    ids=["nan", "negative", "payload", "signalling"],
)
def test_nan_constants_are_stored_with_their_sign_and_payload(bits: int, text: str) -> None:
    value = struct.unpack("<d", bits.to_bytes(8, "little"))[0]
    row = ConstLeaf(value).row()
    assert row == ["const", "float", text]
    read = ConstLeaf.from_row(row, 0).value
    assert struct.pack("<d", read) == bits.to_bytes(8, "little")


def test_clip_never_raises_and_bounds_messages() -> None:
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError

        def __str__(self) -> str:
            raise RuntimeError

    assert clip(Unprintable()) == "<Unprintable>"
    assert clip_text(Unprintable()) == "<Unprintable>"
    assert clip("x" * 1000).endswith("...") and len(clip("x" * 1000)) == 120
    assert clip(10**5000) == "<an int of 16610 bits>"


def pairs_of_one_tuple_hash(count: int) -> list[tuple[int, int]]:
    """``count`` pairs of ints under 2**60 (each hashing to itself) whose tuples all hash as
    ``(1, 1)`` does: CPython mixes a tuple's item hashes with fixed primes and rotations
    (xxHash), so for almost any first item a second can be solved for."""
    mod = 2**64
    prime_1, prime_2, prime_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rotate_left(x: int) -> int:
        return ((x << 31) | (x >> 33)) % mod

    def rotate_right(x: int) -> int:
        return ((x >> 31) | (x << 33)) % mod

    target = hash((1, 1)) % mod
    # the state after both items, before the length is added and the last item mixed in
    last = rotate_right((target - (2 ^ prime_5 ^ 3527539)) * pow(prime_1, -1, mod) % mod)
    pairs = []
    first = 2
    while len(pairs) < count:
        state = rotate_left((prime_5 + first * prime_2) % mod) * prime_1 % mod
        second = (last - state) * pow(prime_2, -1, mod) % mod
        if second < 2**60:
            pairs.append((first, second))
        first += 1
    return pairs


@pytest.mark.skipif(sys.hash_info.width != 64, reason="the tuple hash solved for is 64-bit")
@pytest.mark.parametrize("kind", ["shape", "keys"])
def test_specs_of_documents_whose_int_tuples_share_a_hash_hash_apart(kind: str) -> None:
    # Before: ints under 2**60 hashed as themselves, so a node's hash was a fixed mix of what
    # the document wrote, and shapes (or a dict's keys) solved to share one tuple hash made
    # specs of one hash: a set of them, or the specs' shared programs, took quadratic time
    pairs = pairs_of_one_tuple_hash(20)
    assert len({hash(pair) for pair in pairs}) == 1  # what the documents are made of
    rows = {
        "shape": [[["array", "float32", list(pair), False]] for pair in pairs],
        "keys": [[["dict", list(pair)], ["none"], ["none"]] for pair in pairs],
    }[kind]
    specs = [TreeSpec._from_rows(tree) for tree in rows]
    assert len({hash(spec) for spec in specs}) == len(specs)
    assert len({hash(spec.leaves) for spec in specs}) == len(specs)


class Text(str):
    def __repr__(self) -> str:
        return f"Text({str.__repr__(self)})"


@pytest.mark.parametrize(
    ("expected", "found", "shown"),
    [
        (("a",), ("x" * 100_000,), "[0]: expected str 'a', got str 'xxxxx"),
        (("x" * 100_000,), ("b",), "[0]: expected str 'xxxxx"),
        ((None,), (b"z" * 100_000,), "[0]: expected None, got b'zzzzz"),
        ((None,), (Text("t" * 100_000),), "[0]: expected None, got 'ttttt"),
        ((None,), ({"k" * 100_000: 1},), "[0]: expected None, got a dict with keys ['kkkkk"),
    ],
    ids=["found", "expected", "bytes", "str-subclass", "key"],
)
def test_a_message_shows_a_long_text_by_its_start_reading_no_more_of_it(
    expected: Any, found: Any, shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: a mismatch took the repr of the whole text and then cut it to 120 characters: a
    # 200 MB str constant or input took 1-1.7 s (and its copies in memory) to refuse
    import builtins

    from dualgraph import _nodes

    lengths: list[int] = []

    def measured_repr(value: Any) -> str:
        lengths.append(len(value) if isinstance(value, str | bytes) else 0)
        return builtins.repr(value)

    monkeypatch.setattr(_nodes, "repr", measured_repr, raising=False)
    with pytest.raises(SpecMismatchError) as caught:
        describe(expected).check(found)
    assert str(caught.value).startswith(shown) and len(str(caught.value)) < 300
    assert max(lengths) <= 120
