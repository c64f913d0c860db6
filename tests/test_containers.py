"""Container kinds, registered user classes, and how a spec names and finds them by identity."""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import weakref
from typing import Any, NamedTuple

import numpy as np
import optree
import optree.dataclasses
import pytest
from trees import Attention, EncoderOutput, array, assert_same_tree

import dualgraph
from dualgraph import (
    DualgraphError,
    SpecMismatchError,
    TreeSpec,
    UnsupportedLeafError,
    describe,
    register_dataclass,
    register_namedtuple,
)
from dualgraph._containers import (
    CONTAINER_KINDS,
    NAMESPACE,
    container_kind,
    dataclass_fields,
    qualified_name,
)
from dualgraph._nodes import ConstLeaf, NodeError


def rows_of(spec: TreeSpec) -> list[Any]:
    return json.loads(spec.to_json())["tree"]


def from_rows(rows: list[Any]) -> TreeSpec:
    return TreeSpec.from_json(
        json.dumps({"format": "dualgraph.TreeSpec", "version": 2, "tree": rows})
    )


# -- kinds -----------------------------------------------------------------------------------------


def test_each_kind_has_its_own_json_tag() -> None:
    tags = [kind.tag for kind in CONTAINER_KINDS]
    assert tags == ["tuple", "list", "dict", "ordereddict", "namedtuple", "dataclass"]


@pytest.mark.parametrize(
    ("cls", "tag"),
    [(tuple, "tuple"), (list, "list"), (dict, "dict"), (collections.OrderedDict, "ordereddict")],
)
def test_builtin_containers_have_a_kind_by_exact_type(cls: type, tag: str) -> None:
    kind = container_kind(cls)
    assert kind is not None and kind.tag == tag


@pytest.mark.parametrize("cls", [collections.defaultdict, set, frozenset, str, bytes])
def test_subclasses_and_other_types_are_no_container(cls: type) -> None:
    assert container_kind(cls) is None


def test_nodes_are_frozen() -> None:
    node = describe(((),))._nodes[0]
    with pytest.raises(AttributeError, match="frozen"):
        node.arity = 3  # type: ignore[misc]


# -- dataclasses -----------------------------------------------------------------------------------


def test_register_dataclass_returns_the_class_so_it_works_as_a_decorator() -> None:
    @dataclasses.dataclass
    class Output:
        x: Any

    assert register_dataclass(Output) is Output


def test_registered_dataclass_fields_are_children_in_field_order() -> None:
    @register_dataclass
    @dataclasses.dataclass
    class Output:
        logits: Any
        loss: Any = None

    assert dataclass_fields(Output) == ("logits", "loss")
    assert describe(Output(array(2))).paths == (".logits", ".loss")


def test_registering_twice_is_harmless() -> None:
    assert register_dataclass(EncoderOutput) is EncoderOutput
    assert dataclass_fields(EncoderOutput) == ("hidden", "pooled", "aux_loss")


def test_frozen_and_keyword_only_dataclasses_round_trip() -> None:
    @register_dataclass
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Frozen:
        x: Any
        tag: str = "frozen"

    tree = Frozen(x=array(2))
    spec = TreeSpec.from_json(describe(tree).to_json())
    assert_same_tree(spec.unflatten(spec.flatten(tree)), tree)


def test_a_dataclass_optree_holds_in_dualgraphs_namespace_is_refused_cleanly() -> None:
    # Before: optree's ValueError ('already registered in namespace') leaked from
    # register_dataclass for a class made with optree.dataclasses.dataclass(namespace=...)
    @optree.dataclasses.dataclass(namespace=NAMESPACE)
    class Output:
        x: Any

    with pytest.raises(DualgraphError, match="optree refused dualgraph's registration"):
        register_dataclass(Output)
    assert dataclass_fields(Output) is None  # nothing half-registered
    with pytest.raises(UnsupportedLeafError):
        describe(Output(array(2)))


@pytest.mark.parametrize("not_a_dataclass", [dict, EncoderOutput(1, 2)], ids=["class", "instance"])
def test_register_dataclass_rejects_anything_but_a_dataclass_type(not_a_dataclass: Any) -> None:
    with pytest.raises(DualgraphError, match="register_dataclass expects a dataclass type"):
        register_dataclass(not_a_dataclass)


def test_register_dataclass_rejects_an_init_that_its_fields_cannot_call() -> None:
    @dataclasses.dataclass
    class WithInitVar:
        x: Any
        scale: dataclasses.InitVar[float]

        def __post_init__(self, scale: float) -> None:
            self.x = self.x

    @dataclasses.dataclass(init=False)
    class OwnInit:
        x: Any

        def __init__(self, value: Any) -> None:
            self.x = value

    for cls, missing in ((WithInitVar, "'scale'"), (OwnInit, "'value'")):
        with pytest.raises(DualgraphError, match=rf"__init__ .*{missing}.* cannot be rebuilt"):
            register_dataclass(cls)
        assert dataclass_fields(cls) is None


def test_register_dataclass_accepts_an_init_var_with_a_default() -> None:
    @register_dataclass
    @dataclasses.dataclass
    class WithDefault:
        x: Any
        scale: dataclasses.InitVar[float] = 1.0

    x = array(2)
    tree = WithDefault(x)
    assert_same_tree(describe(tree).unflatten([x]), tree)


def test_register_dataclass_rejects_fields_that_init_cannot_set() -> None:
    @dataclasses.dataclass
    class Derived:
        x: Any
        cached: Any = dataclasses.field(init=False, default=None)

    with pytest.raises(DualgraphError, match=r"fields \['cached'\] have init=False"):
        register_dataclass(Derived)
    assert dataclass_fields(Derived) is None


def test_register_dataclass_rejects_field_names_python_normalises() -> None:
    # A field named with the ligature "\ufb01" would be "fi" to the generated __init__ (NFKC).
    # Python 3.11 cannot even make such a dataclass, so rename a field after the fact.
    @dataclasses.dataclass
    class Ligature:
        field: Any

    Ligature.__dataclass_fields__["field"].name = "\ufb01eld"
    with pytest.raises(
        DualgraphError, match=r"reads the field names \['\ufb01eld'\] as \['field'\]"
    ):
        register_dataclass(Ligature)


def test_dataclass_fields_is_none_for_an_unregistered_type() -> None:
    assert dataclass_fields(tuple) is None


# -- namedtuples -----------------------------------------------------------------------------------


def test_register_namedtuple_returns_the_class_and_lets_json_name_it() -> None:
    class Registered(NamedTuple):
        x: Any

    assert register_namedtuple(Registered) is Registered
    rows = [["namedtuple", qualified_name(Registered), ["x"]], ["none"]]
    assert from_rows(rows).unflatten([]) == Registered(None)


@pytest.mark.parametrize(
    "not_a_namedtuple", [tuple, EncoderOutput, Attention(1, 2)], ids=["tuple", "dataclass", "inst"]
)
def test_register_namedtuple_rejects_anything_but_a_namedtuple_class(not_a_namedtuple: Any) -> None:
    with pytest.raises(DualgraphError, match="register_namedtuple expects a namedtuple class"):
        register_namedtuple(not_a_namedtuple)


def test_a_tuple_subclass_posing_as_a_namedtuple_is_not_one() -> None:
    class Impostor(tuple):
        _fields = ("a\nimport os",)

        def _make(self) -> None: ...

        def _asdict(self) -> None: ...

    assert container_kind(Impostor, learn=True) is None
    with pytest.raises(dualgraph.UnsupportedLeafError, match="unsupported leaf"):
        describe(Impostor((1,)))


def test_a_namedtuple_class_whose_fields_repeat_is_not_one() -> None:
    # Two children had one path (.a twice), and the key-order check of a call read the
    # first child for both, missing a reordered dict in the second
    Repeated = collections.namedtuple("Repeated", "a b")  # type: ignore[name-match]
    Repeated._fields = ("a", "a")  # type: ignore[misc]
    assert container_kind(Repeated, learn=True) is None
    with pytest.raises(dualgraph.UnsupportedLeafError, match=r"^\[0\]: unsupported leaf"):
        describe((Repeated(1, 2),))
    with pytest.raises(DualgraphError, match="register_namedtuple expects a namedtuple class"):
        register_namedtuple(Repeated)


def test_namedtuple_fields_are_read_by_position_so_nfkc_names_work() -> None:
    # namedtuple keeps the field name as given; Python source would read "\ufb01" as "fi".
    Ligature = collections.namedtuple("Ligature", ["\ufb01eld", "other"])
    tree = Ligature(array(2), None)
    spec = describe(tree)
    assert spec.paths == (".\ufb01eld", ".other")
    loaded = TreeSpec.from_json(spec.to_json())
    rebuilt = loaded.unflatten(loaded.flatten(tree, check=True))
    assert type(rebuilt) is Ligature and rebuilt[0] is tree[0]


def test_a_spec_naming_the_nfkc_form_of_a_field_is_refused() -> None:
    Ligature = collections.namedtuple("Ligature", ["\ufb01eld"])
    rows = rows_of(describe(Ligature(None)))
    rows[0][2] = ["field"]
    with pytest.raises(DualgraphError, match=r"has fields \['\ufb01eld'\] in this process"):
        from_rows(rows)


# -- names and identity ----------------------------------------------------------------------------


def test_qualified_name_is_module_colon_qualname() -> None:
    assert qualified_name(collections.OrderedDict) == "collections:OrderedDict"
    assert qualified_name(Attention) == "trees:Attention"


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_namedtuple_instance_of_another_length_is_a_mismatch(length: int, size: int) -> None:
    # tuple.__new__ makes an instance with more or fewer items than the class has fields; the
    # generated flatten read the first two and silently dropped the third
    Pair = collections.namedtuple("Pair", "x y")
    spec = describe([Pair(array(1), array(2)), *[None] * size])
    odd = tuple.__new__(Pair, [array(1), array(2), array(3)][:length])
    for check in (False, True):
        with pytest.raises(
            SpecMismatchError,
            match=rf"^\[0\]: expected .*Pair of 2 fields, got .*Pair of length {length}$",
        ):
            spec.flatten([odd, *[None] * size], check=check)


OddPair = collections.namedtuple("OddPair", "a b")
ODD_PAIRS = {
    "short": lambda: [{"x": tuple.__new__(OddPair, (1,))}],
    "long": lambda: [{"x": tuple.__new__(OddPair, (1, 2, 3))}],
    # read as [OddPair(a=1, b=OddPair(a=2, b=3)), 4]: a valid pre-order of another tree
    "short-then-long": lambda: [tuple.__new__(OddPair, (1,)), tuple.__new__(OddPair, (2, 3, 4))],
}


@pytest.mark.parametrize("make", ODD_PAIRS.values(), ids=ODD_PAIRS.keys())
def test_describing_a_namedtuple_instance_of_another_length_is_refused_naming_its_path(
    make: Any,
) -> None:
    # describe took the node's arity from the class and the children from the instance
    with pytest.raises(
        DualgraphError, match=r"^\[0\]\S*: a \S*Pair of length \d, but its class has 2 fields"
    ):
        describe(make())


class Swapped(collections.namedtuple("Swapped", "first second")):
    """A namedtuple whose indexing, length and iteration say something else than its items."""

    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        return tuple.__getitem__(self, 1 - index) if type(index) is int else getattr(self, index)

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Any:
        return iter(reversed(tuple(tuple.__getitem__(self, slice(None)))))


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_namedtuple_is_read_by_its_items_not_by_methods_its_class_overrides(size: int) -> None:
    # Before: describe, flatten and check read Swapped by its own __getitem__ and len() (the spec
    # said first=None for first=array, or refused the tree as "of length 1"), so
    # unflatten(flatten(x)) was another tree than x
    tree = [Swapped(array(2), None), *[None] * size]
    spec = describe(tree)
    assert spec.paths[:2] == ("[0].first", "[0].second")
    assert spec.leaves[0].kind == "array" and spec.leaves[1].kind == "none"
    for check in (False, True):
        arrays = spec.flatten(tree, check=check)
        assert arrays == [tree[0].first]
        rebuilt = spec.unflatten(arrays)[0]
        assert type(rebuilt) is Swapped
        assert rebuilt.first is tree[0].first and rebuilt.second is None
    with pytest.raises(SpecMismatchError, match=r"^\[0\]\.second: expected None, got"):
        spec.check([Swapped(array(2), array(2)), *[None] * size])


class IteratesOtherwise(collections.namedtuple("IteratesOtherwise", "first second")):
    """A namedtuple whose iteration yields something else than its items (only that)."""

    __slots__ = ()

    def __iter__(self) -> Any:
        return iter(("x", "y"))


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_unflatten_checks_a_rebuilt_namedtuple_by_its_items_not_its_iteration(size: int) -> None:
    # Before: the rebuild's check that __new__ kept every value iterated the new object, so
    # unflatten refused a faithful rebuild as "__new__ changed its items"
    tree = [IteratesOtherwise(array(2), None), *[None] * size]
    spec = describe(tree)
    rebuilt = spec.unflatten(spec.flatten(tree))[0]
    assert type(rebuilt) is IteratesOtherwise
    assert tuple.__getitem__(rebuilt, 0) is tree[0].first and rebuilt.second is None


def test_a_locally_defined_namedtuple_resolves_once_described() -> None:
    Local = collections.namedtuple("Local", "a b")
    text = describe(Local(array(2), None)).to_json()
    assert type(TreeSpec.from_json(text).unflatten([array(2)])) is Local


def test_a_redefined_class_works_for_the_tree_it_was_described_from() -> None:
    def define() -> type:
        class Output(NamedTuple):
            hidden: Any
            aux: Any

        return Output

    Old, New = define(), define()
    assert qualified_name(Old) == qualified_name(New) and Old is not New
    old_tree, new_tree = Old(array(2), None), New(array(2), None)
    old_spec, new_spec = describe(old_tree), describe(new_tree)
    assert old_spec != new_spec
    assert type(old_spec.unflatten(old_spec.flatten(old_tree))) is Old
    assert type(new_spec.unflatten(new_spec.flatten(new_tree))) is New
    with pytest.raises(dualgraph.SpecMismatchError, match="another class of the same name"):
        old_spec.check(new_tree)


def test_a_name_means_the_newest_class_and_an_older_spec_cannot_be_written() -> None:
    def define() -> type:
        class Output(NamedTuple):
            hidden: Any

        return Output

    Old = define()
    old_spec = describe(Old(None))
    text = old_spec.to_json()  # written while Old is what the name means
    New = define()
    new_spec = describe(New(None))
    assert type(TreeSpec.from_json(text).unflatten([])) is New
    assert TreeSpec.from_json(new_spec.to_json()) == new_spec
    fresh_old_spec = describe(Old(array(2)))
    with pytest.raises(DualgraphError, match=r"now names another class in this process"):
        fresh_old_spec.to_json()


def test_a_spec_written_before_its_class_was_redefined_cannot_be_written_again() -> None:
    def define() -> type:
        class Output(NamedTuple):
            hidden: Any

        return Output

    Old = define()
    old_spec = describe(Old(array(2)))
    old_spec.to_json()  # fine while Old is what the name means
    New = define()
    describe(New(array(2)))
    with pytest.raises(DualgraphError, match=r"now names another class in this process"):
        old_spec.to_json()  # the JSON written before would now be read back as New


def test_registering_picks_the_class_a_name_means() -> None:
    def define() -> type:
        class Output(NamedTuple):
            hidden: Any

        return Output

    Old = define()
    describe(Old(None))
    New = define()
    describe(New(None))
    register_namedtuple(Old)
    assert (
        type(from_rows([["namedtuple", qualified_name(Old), ["hidden"]], ["none"]]).unflatten([]))
        is Old
    )


def test_a_namedtuple_class_describe_met_goes_with_its_last_spec() -> None:
    # Before: every namedtuple class describe met stayed alive for good in the kind registry (a
    # class made per call piled up); the name keeps only the newest class of that name alive
    def define() -> type:
        class Made(NamedTuple):
            hidden: Any

        return Made

    def described() -> tuple[weakref.ref[type], TreeSpec]:
        made = define()
        return weakref.ref(made), describe(made(array(2)))

    first, spec = described()
    newest, newest_spec = described()  # the name now means the newer class
    assert first() is not None  # its spec holds it, and it still rebuilds
    assert type(spec.unflatten([array(2)])) is first()
    del spec
    gc.collect()
    assert first() is None
    assert TreeSpec.from_json(newest_spec.to_json()) == newest_spec  # the newest reads back
    assert container_kind(newest()) is not None  # type: ignore[arg-type]


def test_a_name_registered_as_another_kind_is_refused() -> None:
    rows = [["namedtuple", qualified_name(EncoderOutput), ["hidden", "pooled", "aux_loss"]]]
    rows += [["none"]] * 3
    with pytest.raises(
        DualgraphError, match=r"'trees:EncoderOutput' in this process is not a namedtuple"
    ):
        from_rows(rows)


def test_register_functions_are_exported() -> None:
    assert dualgraph.register_dataclass is register_dataclass
    assert dualgraph.register_namedtuple is register_namedtuple


#: 2**61 - 1: CPython hashes an int by its value modulo this, so its multiples all hash to 0.
HASH_MODULUS = 2**61 - 1


@pytest.mark.parametrize("kind", [dict, collections.OrderedDict])
def test_int_keys_that_share_one_hash_are_refused_before_a_set_of_them_is_built(kind: type) -> None:
    # A set of n such keys takes time quadratic in n: a 3.5 MB document of 100,000 keys took
    # minutes to read.
    keys = [k * HASH_MODULUS for k in range(9)]
    assert len({hash(key) for key in keys}) == 1
    with pytest.raises(UnsupportedLeafError, match=r"^\['x'\]: .*9 int keys share one hash"):
        describe({"x": kind((key, None) for key in keys)})
    tag = "dict" if kind is dict else "ordereddict"
    document = {"format": "dualgraph.TreeSpec", "version": 2}
    document["tree"] = [["list", 1], [tag, keys]] + [["none"]] * 9
    with pytest.raises(DualgraphError, match=r"^malformed TreeSpec JSON at \[0\]: .*one hash"):
        dualgraph.TreeSpec.from_json(json.dumps(document))


def test_int_keys_whose_hashes_collide_as_python_makes_them_still_work() -> None:
    tree = {-1: array(2), -2: None, HASH_MODULUS: 1, 0: 2}  # hash(-1) == hash(-2) == -2
    spec = describe(tree)
    assert_same_tree(spec.unflatten(spec.flatten(tree)), tree)
    assert dualgraph.TreeSpec.from_json(spec.to_json()) == spec


# -- rebuilding a class that changes the values it is given ------------------------------------


@pytest.fixture(params=["generated", "walker"])
def rebuild_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Rebuild through generated code, or through the walker that runs trees over the limit."""
    if request.param == "walker":
        from dualgraph import _compile

        monkeypatch.setattr(_compile, "COMPILE_LIMIT", 0)
    return str(request.param)


@register_dataclass
@dataclasses.dataclass
class Doubled:
    x: Any

    def __post_init__(self) -> None:
        self.x = self.x * 2


class DoubledPair(collections.namedtuple("DoubledPair", "a b")):
    __slots__ = ()

    def __new__(cls, a: Any, b: Any) -> DoubledPair:
        return super().__new__(cls, a * 2, b)


def test_a_dataclass_whose_post_init_changes_a_field_is_refused_not_changed_twice(
    rebuild_path: str,
) -> None:
    # unflatten(flatten(obj)) ran __post_init__ again: x came back 4 where obj held 2.
    tree = (Doubled(array(1)),)
    spec = describe(tree)
    with pytest.raises(DualgraphError, match=r"\[0\]: rebuilding .*Doubled.* field 'x'"):
        spec.unflatten(spec.flatten(tree))


def test_a_namedtuple_whose_new_changes_an_item_is_refused_not_changed_twice(
    rebuild_path: str,
) -> None:
    tree = DoubledPair(array(1), 3)
    spec = describe(tree)
    with pytest.raises(DualgraphError, match=r"rebuilding .*DoubledPair.*__new__"):
        spec.unflatten(spec.flatten(tree))


class TupleOnRebuild(collections.namedtuple("TupleOnRebuild", "a b")):
    """A namedtuple whose ``__new__`` gives a plain tuple (its objects are made otherwise)."""

    __slots__ = ()

    def __new__(cls, a: Any, b: Any) -> TupleOnRebuild:
        return (a, b)  # type: ignore[return-value]


def test_a_namedtuple_whose_new_gives_another_class_is_refused_not_rebuilt_as_it(
    rebuild_path: str,
) -> None:
    # Before: unflatten handed out the plain tuple (its items were the very values given)
    tree = tuple.__new__(TupleOnRebuild, (array(1), 3))
    spec = describe(tree)
    with pytest.raises(
        DualgraphError,
        match=r"<root>: rebuilding .*TupleOnRebuild.* gave an object of type builtins\.tuple",
    ):
        spec.unflatten(spec.flatten(tree))


@register_dataclass
@dataclasses.dataclass
class Rec:
    """A dataclass whose ``__new__`` gives a subclass's objects."""

    x: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> Rec:
        return object.__new__(Sub if cls is Rec else cls)


@dataclasses.dataclass
class Sub(Rec):
    pass


def test_a_dataclass_whose_new_gives_a_subclass_is_refused_not_rebuilt_as_it(
    rebuild_path: str,
) -> None:
    # Before: unflatten handed out an object of the subclass, fields as given
    tree = object.__new__(Rec)
    tree.x = array(1)
    spec = describe((tree,))
    with pytest.raises(
        DualgraphError, match=r"\[0\]: rebuilding .*Rec raised .* gave an object of type .*Sub"
    ):
        spec.unflatten(spec.flatten((tree,)))


def test_a_post_init_that_keeps_its_values_as_given_still_rebuilds(rebuild_path: str) -> None:
    @register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: Any
        n: int = 2

        def __post_init__(self) -> None:
            object.__setattr__(self, "x", np.asarray(self.x))  # an array already: itself
            if self.n < 0:
                raise ValueError("n")

    tree = Checked(array(1), 5)
    spec = describe(tree)
    assert_same_tree(spec.unflatten(spec.flatten(tree)), tree)


# -- classes are told apart by identity ------------------------------------------------------------


class _AllEqual(type):
    """A metaclass whose classes all compare equal (and hash alike): dict lookups by class
    would take one for another."""

    def __eq__(cls, other: object) -> bool:
        return isinstance(other, _AllEqual)

    def __hash__(cls) -> int:
        return 0


def test_a_dataclass_whose_class_compares_by_value_is_still_told_apart() -> None:
    # Before: registering one class of an _AllEqual metaclass made every other one a
    # "registered" dataclass, rebuilt as the first class
    @register_dataclass
    @dataclasses.dataclass
    class First(metaclass=_AllEqual):
        x: Any

    @dataclasses.dataclass
    class Second(metaclass=_AllEqual):
        x: Any

    tree = First(array(2))
    spec = TreeSpec.from_json(describe(tree).to_json())
    assert type(spec.unflatten(spec.flatten(tree))) is First
    with pytest.raises(UnsupportedLeafError, match=r"Second"):
        describe(Second(array(2)))


def test_specs_of_classes_that_compare_by_value_are_not_equal_nor_share_a_program() -> None:
    @register_dataclass
    @dataclasses.dataclass
    class Left(metaclass=_AllEqual):
        x: Any

    @register_dataclass
    @dataclasses.dataclass
    class Right(metaclass=_AllEqual):
        x: Any

    left, right = describe(Left(array(2))), describe(Right(array(2)))
    assert left != right
    assert type(right.unflatten([array(2)])) is Right
    assert type(describe([Left(1), Right(2)]).unflatten([])[1]) is Right


def test_a_namedtuple_whose_class_compares_by_value_is_told_apart() -> None:
    Pair = collections.namedtuple("Pair", "a b")  # type: ignore[name-match]

    class OddPair(Pair, metaclass=_AllEqual):  # type: ignore[misc]
        pass

    class OtherPair(Pair, metaclass=_AllEqual):  # type: ignore[misc]
        pass

    spec = describe((OddPair(1, array(2)), OtherPair(3, array(2))))
    rebuilt = spec.unflatten([array(2), array(2)])
    assert (type(rebuilt[0]), type(rebuilt[1])) == (OddPair, OtherPair)


def _equal_to(builtin: type) -> type:
    """A class that equals ``builtin`` through its metaclass (and hashes as it does), whose
    objects equal anything and hash as the str ``'key'``."""

    class EqualToBuiltin(type):
        def __eq__(cls, other: object) -> bool:
            return other is builtin or type.__eq__(cls, other)

        def __hash__(cls) -> int:
            return hash(builtin)

    class Lookalike(metaclass=EqualToBuiltin):
        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash("key")

    return Lookalike


def test_an_object_whose_class_equals_int_is_no_constant() -> None:
    # Before: describe took it for an int constant (a spec holding an arbitrary object, whose
    # check passed any other such object and whose to_json leaked TypeError)
    like_int = _equal_to(int)()
    with pytest.raises(UnsupportedLeafError, match=r"\[0\]: unsupported leaf of type .*Lookalike"):
        describe((like_int,))
    with pytest.raises(NodeError, match="a constant is a bool, int, float or str"):
        ConstLeaf(like_int)


def test_a_key_whose_class_equals_str_is_refused_after_an_equal_str_key() -> None:
    # Before: the second dict was looked up among the nodes already made by its keys and their
    # types compared by ==, so it took the first dict's node: a str key it does not have
    key = _equal_to(str)()
    with pytest.raises(UnsupportedLeafError, match=r"\[1\]: dict key .* of type Lookalike"):
        describe([{"key": None}, {key: None}])


def test_a_dataclass_whose_signature_cannot_be_read_registers_and_rebuilds() -> None:
    # Before: register_dataclass leaked the RuntimeError its metaclass's __signature__ raised
    class Unreadable(type):
        pass

    @dataclasses.dataclass
    class Plain(metaclass=Unreadable):
        x: Any

    def unreadable(cls: type) -> Any:
        raise RuntimeError("no signature")

    Unreadable.__signature__ = property(unreadable)  # type: ignore[attr-defined]
    register_dataclass(Plain)
    assert describe(Plain(1)).unflatten([]) == Plain(1)


# -- a class's __module__ can be any object --------------------------------------------------------


class _Unprintable:
    """A ``__module__`` whose str, repr and format raise."""

    def __str__(self) -> str:
        raise RuntimeError("unprintable")

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        raise RuntimeError("unprintable")


def test_a_namedtuple_whose_module_is_not_a_str_is_refused_naming_the_path() -> None:
    Odd = collections.namedtuple("Odd", "a b")  # type: ignore[name-match]
    Odd.__module__ = _Unprintable()  # type: ignore[assignment]
    with pytest.raises(DualgraphError, match=r"^\[1\]: .*Odd.*__module__"):
        describe((1, Odd(1, 2)))
    with pytest.raises(DualgraphError, match=r"Odd.*__module__"):
        register_namedtuple(Odd)


def test_a_dataclass_whose_module_is_not_a_str_is_refused() -> None:
    @dataclasses.dataclass
    class Odd:
        x: Any

    Odd.__module__ = _Unprintable()  # type: ignore[assignment]
    with pytest.raises(DualgraphError, match=r"Odd.*__module__"):
        register_dataclass(Odd)


def test_messages_about_a_class_whose_module_is_not_a_str_still_name_it() -> None:
    class Thing:
        pass

    Thing.__module__ = _Unprintable()  # type: ignore[assignment]
    with pytest.raises(UnsupportedLeafError, match=r"^\[0\]: unsupported leaf of type .*Thing"):
        describe((Thing(),))
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected int 1, got .*Thing"):
        describe((1,)).check((Thing(),))


def test_a_registered_class_whose_module_changes_to_no_str_is_still_explained() -> None:
    @register_dataclass
    @dataclasses.dataclass
    class Later:
        x: Any

    spec = describe(Later(1))

    class Other:
        pass

    Later.__module__ = _Unprintable()  # type: ignore[assignment]
    Other.__module__ = _Unprintable()  # type: ignore[assignment]
    with pytest.raises(SpecMismatchError, match=r"^<root>: expected a .*Later, got .*Other"):
        spec.check(Other())


def test_a_dataclass_implementing_a_typing_extensions_protocol_registers() -> None:
    # typing_extensions.Protocol's metaclass defines __eq__ and __hash__ (its classes still
    # compare by identity): such classes are common and must not be refused
    typing_extensions = pytest.importorskip("typing_extensions")

    class HasHidden(typing_extensions.Protocol):
        hidden: Any

    @register_dataclass
    @dataclasses.dataclass
    class Out(HasHidden):
        hidden: Any

    tree = Out(array(2))
    spec = TreeSpec.from_json(describe(tree).to_json())
    assert_same_tree(spec.unflatten(spec.flatten(tree)), tree)


def test_a_registered_class_whose_module_becomes_no_str_is_refused_naming_the_path() -> None:
    @register_dataclass
    @dataclasses.dataclass
    class Renamed:
        x: Any

    Renamed.__module__ = _Unprintable()  # type: ignore[assignment]
    with pytest.raises(DualgraphError, match=r"^\[0\]\['k'\]: .*Renamed.*__module__"):
        describe(({"k": Renamed(1)},))


# -- hostile classes handed to the registrations -------------------------------------------------


class _ClassFails(Exception):
    pass


class _ClassRaises:
    """An object whose ``__class__`` (which isinstance reads) raises."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise _ClassFails("no class")


@pytest.mark.parametrize(
    "register",
    [
        dualgraph.register_namedtuple,
        dualgraph.register_dataclass,
        lambda cls: dualgraph.register_array_type(cls, signature=len, requires_grad=bool),
    ],
    ids=["namedtuple", "dataclass", "array_type"],
)
def test_registering_an_object_whose_class_cannot_be_read_is_a_dualgraph_error(
    register: Any,
) -> None:
    # Before: isinstance(cls, type) read its __class__, whose error leaked
    with pytest.raises(dualgraph.DualgraphError, match=r"expects a (namedtuple |dataclass )?"):
        register(_ClassRaises())


def test_a_dataclass_whose_fields_cannot_be_read_is_refused_naming_the_error() -> None:
    # Before: dataclasses.fields' AttributeError leaked from register_dataclass
    @dataclasses.dataclass
    class Broken:
        x: Any = None

    Broken.__dataclass_fields__ = 5  # type: ignore[assignment]
    with pytest.raises(
        dualgraph.DualgraphError,
        match=r"cannot register .*Broken: reading its dataclass fields raised AttributeError",
    ):
        dualgraph.register_dataclass(Broken)


def test_a_class_whose_dataclass_test_raises_is_no_dataclass() -> None:
    # Before: dataclasses.is_dataclass passed on the metaclass property's error
    class Failing(type):
        @property
        def __dataclass_fields__(cls) -> Any:
            raise _ClassFails("no fields")

    class Record(metaclass=Failing):
        pass

    with pytest.raises(dualgraph.DualgraphError, match=r"expects a dataclass type, got"):
        dualgraph.register_dataclass(Record)


@dualgraph.register_dataclass
@dataclasses.dataclass
class DictOutput(collections.OrderedDict):  # type: ignore[type-arg]
    """Like Hugging Face's ModelOutput: a dataclass that is also a dict of its set fields."""

    logits: Any = None
    loss: Any = None

    def __post_init__(self) -> None:
        for name in ("logits", "loss"):
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)


def test_a_dict_dataclass_whose_entries_are_its_fields_is_rebuilt_with_them() -> None:
    out = DictOutput(logits=array(2))
    spec = describe({"out": out})
    rebuilt = spec.unflatten(spec.flatten({"out": out}, check=True))["out"]
    assert type(rebuilt) is DictOutput and dict(rebuilt) == {"logits": out.logits}
    assert rebuilt.logits is out.logits and rebuilt.loss is None


def _with_entry(kind: str) -> DictOutput:
    out = DictOutput(logits=array(2))
    if kind == "extra":
        dict.__setitem__(out, "extra", array(1))  # not a field: a rebuild drops it
    else:
        dict.__setitem__(out, "logits", array(2))  # not the field's value: a rebuild drops it
    return out


@pytest.mark.parametrize("kind", ["extra", "other-value"])
def test_describing_a_dict_dataclass_with_an_entry_a_rebuild_loses_is_refused(kind: str) -> None:
    # Before: described by its fields alone; unflatten gave it back without the entry
    key = "extra" if kind == "extra" else "logits"
    with pytest.raises(
        DualgraphError, match=rf"^\['out'\]: a \S*DictOutput holds the dict entries \['{key}'\]"
    ):
        describe({"out": _with_entry(kind)})


@pytest.mark.parametrize("kind", ["extra", "other-value"])
@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_dict_dataclass_with_an_entry_a_rebuild_loses_is_a_mismatch(kind: str, size: int) -> None:
    # Before: check and flatten passed it, and unflatten lost the entry
    spec = describe([DictOutput(logits=array(2)), *[None] * size])
    key = "extra" if kind == "extra" else "logits"
    odd = [_with_entry(kind), *[None] * size]
    for check in (False, True):
        with pytest.raises(
            SpecMismatchError, match=rf"^\[0\]: a \S*DictOutput holds the dict entries \['{key}'\]"
        ):
            spec.flatten(odd, check=check)


class Tagged(collections.namedtuple("Tagged", "x y")):  # a subclass: it has a __dict__
    """A namedtuple subclass whose __new__ sets an attribute besides its fields."""

    def __new__(cls, x: Any, y: Any) -> Tagged:
        obj = super().__new__(cls, x, y)
        obj.made_by_new = True
        return obj


def test_a_namedtuple_subclass_attribute_made_by_new_is_made_again_on_rebuild() -> None:
    # Decided: a namedtuple's tree is its fields (as optree and JAX take it); attributes outside
    # them are not refused, since __new__ may make them, and then a rebuild makes them again
    tree = Tagged(array(2), None)
    spec = describe(tree)
    rebuilt = spec.unflatten(spec.flatten(tree, check=True))
    assert type(rebuilt) is Tagged and rebuilt.made_by_new is True


def _loss_set_afterwards() -> DictOutput:
    """A DictOutput made without loss, given one as an attribute: no dict entry for it."""
    out = DictOutput(logits=array(2))
    out.loss = 3
    return out


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_dict_dataclass_whose_rebuild_makes_other_entries_is_refused_by_unflatten(
    size: int,
) -> None:
    # Before: unflatten handed it out with an entry 'loss' the object taken apart did not hold
    # (to_tuple() and out[1] then differed from eager's)
    tree = [_loss_set_afterwards(), *[None] * size]
    spec = describe(tree)
    arrays = spec.flatten(tree, check=True)
    with pytest.raises(
        DualgraphError,
        match=r"^unflatten: \[0\]: rebuilding a \S*DictOutput raised DualgraphError: \S*DictOutput "
        r"rebuilt from its fields holds the dict entries \['logits', 'loss'\], where the object "
        r"taken apart held \['logits'\]",
    ):
        spec.unflatten(arrays)


@pytest.mark.parametrize("direction", ["entry-described", "attribute-described"])
@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_dict_dataclass_with_other_entries_than_described_is_a_mismatch(
    direction: str, size: int
) -> None:
    # Before: check passed (its fields held the same values), and the rebuild's entries were
    # the described object's, not the call's
    with_entry = DictOutput(logits=array(2), loss=3)
    without = _loss_set_afterwards()
    described, found = (with_entry, without)
    if direction == "attribute-described":
        described, found = found, described
    spec = describe([described, *[None] * size])
    entries = {id(with_entry): r"\['logits', 'loss'\]", id(without): r"\['logits'\]"}
    message = (
        rf"^\[0\]: expected a \S*DictOutput with the dict entries {entries[id(described)]}, got "
        rf"one with the entries {entries[id(found)]}$"
    )
    for check in (False, True):
        with pytest.raises(SpecMismatchError, match=message):
            spec.flatten([found, *[None] * size], check=check)


def test_specs_of_a_dict_dataclass_with_other_entries_are_unequal_and_read_back() -> None:
    # Before: equal, with one JSON
    with_entry = describe(DictOutput(logits=array(2), loss=3))
    without = describe(_loss_set_afterwards())
    assert with_entry != without
    assert with_entry.to_json() != without.to_json()
    for spec in (with_entry, without):
        read = TreeSpec.from_json(spec.to_json())
        assert read == spec and read.to_json() == spec.to_json()


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (None, "its node needs the keys of its dict entries"),
        (["other"], r"are some of its fields \['logits', 'loss'\], each once, got \['other'\]"),
        (["loss", "loss"], r"each once, got \['loss', 'loss'\]"),
        ([1], r"dict entries are a list of field names, got \[1\]"),
    ],
    ids=["missing", "not-a-field", "repeated", "not-a-str"],
)
def test_a_dict_dataclass_row_must_name_its_entries_among_its_fields(
    entries: list[Any] | None, message: str
) -> None:
    row = ["dataclass", qualified_name(DictOutput), ["logits", "loss"]]
    rows = [[*row, entries] if entries is not None else row, ["none"], ["none"]]
    text = json.dumps({"format": "dualgraph.TreeSpec", "version": 2, "tree": rows})
    with pytest.raises(DualgraphError, match=rf"^malformed TreeSpec JSON at <root>: .*{message}"):
        TreeSpec.from_json(text)


@register_dataclass
@dataclasses.dataclass
class ListOutput(list):  # type: ignore[type-arg]
    """A dataclass that is also a list: its items are no fields."""

    logits: Any = None
    extra: Any = None

    def __post_init__(self) -> None:
        if self.extra is not None:  # items made from a field: a rebuild makes them again
            self.append(self.extra)


@register_dataclass
@dataclasses.dataclass(eq=False)
class SetOutput(set):  # type: ignore[type-arg]
    """A dataclass that is also a set: its items are no fields."""

    logits: Any = None


def _with_an_item(kind: str) -> Any:
    out = ListOutput(logits=array(2)) if kind == "list" else SetOutput(logits=array(2))
    (out.append if kind == "list" else out.add)(5)
    return out


@pytest.mark.parametrize("kind", ["list", "set"])
def test_describing_a_dataclass_that_is_also_a_list_or_set_holding_items_is_refused(
    kind: str,
) -> None:
    # Before: described by its fields alone; unflatten gave it back without its items
    with pytest.raises(
        DualgraphError,
        match=r"^\['out'\]: a \S*(List|Set)Output holds 1 item besides its fields .* be lost",
    ):
        describe({"out": _with_an_item(kind)})


@pytest.mark.parametrize("kind", ["list", "set"])
@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_dataclass_that_is_also_a_list_or_set_holding_items_is_a_mismatch(
    kind: str, size: int
) -> None:
    # Before: check and flatten passed it, and unflatten lost its items
    empty = ListOutput(logits=array(2)) if kind == "list" else SetOutput(logits=array(2))
    spec = describe([empty, *[None] * size])
    for check in (False, True):
        with pytest.raises(
            SpecMismatchError, match=r"^\[0\]: a \S*(List|Set)Output holds 1 item besides"
        ):
            spec.flatten([_with_an_item(kind), *[None] * size], check=check)


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_dataclass_that_is_also_a_list_whose_rebuild_makes_items_is_refused(size: int) -> None:
    # Before: made without extra, given it as an attribute afterwards, it was rebuilt holding
    # an item its __post_init__ makes
    out = ListOutput(logits=array(2))
    out.extra = 3
    tree = [out, *[None] * size]
    spec = describe(tree)
    with pytest.raises(
        DualgraphError, match=r"^unflatten: \[0\]: .*ListOutput rebuilt from its fields holds 1 "
    ):
        spec.unflatten(spec.flatten(tree, check=True))


def test_a_dataclass_that_is_also_a_list_holding_no_items_is_rebuilt_as_it() -> None:
    tree = (ListOutput(logits=array(2)),)
    spec = describe(tree)
    rebuilt = spec.unflatten(spec.flatten(tree, check=True))[0]
    assert type(rebuilt) is ListOutput and list(rebuilt) == [] and rebuilt.logits is tree[0].logits


def test_a_row_of_a_dataclass_that_is_no_dict_holds_no_dict_entries() -> None:
    row = ["dataclass", qualified_name(EncoderOutput), ["hidden", "pooled", "aux_loss"], []]
    rows = [row, ["none"], ["none"], ["none"]]
    text = json.dumps({"format": "dualgraph.TreeSpec", "version": 2, "tree": rows})
    with pytest.raises(
        DualgraphError, match=r"^malformed .* at <root>: \S*EncoderOutput is not a dict: its node "
    ):
        TreeSpec.from_json(text)


def test_a_dict_dataclass_given_an_entry_out_of_field_order_is_refused_by_unflatten() -> None:
    # Before: rebuilt with its entries in field order (loss first), so out[0] and to_tuple()
    # differed from eager's; the refusal says to make the object with its fields
    out = LossFirstOutput(logits=array(2))
    out["loss"] = 3  # an entry after logits', as Hugging Face's __setitem__ makes it
    out.loss = 3
    spec = describe((out,))
    with pytest.raises(
        DualgraphError,
        match=r"holds the dict entries \['loss', 'logits'\], where the object taken apart held "
        r"\['logits', 'loss'\] .* Make the object with the fields it is to hold",
    ):
        spec.unflatten(spec.flatten((out,), check=True))


@register_dataclass
@dataclasses.dataclass
class LossFirstOutput(collections.OrderedDict):  # type: ignore[type-arg]
    """Hugging Face's CausalLMOutput's field order: loss first."""

    loss: Any = None
    logits: Any = None

    def __post_init__(self) -> None:
        for name in ("loss", "logits"):
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)


def _same(x: Any) -> Any:
    return x


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Doubled(array(1)), r"Doubled did not keep field 'x' as given"),
        (lambda: _with_an_item("list"), r"ListOutput holds 1 item besides its fields"),
        (_loss_set_afterwards, r"DictOutput rebuilt from its fields holds the dict entries"),
    ],
    ids=["post-init-changes-a-field", "list-items", "dict-entries-gained"],
)
def test_an_optree_walk_rebuilds_a_registered_dataclass_as_a_spec_does(
    make: Any, message: str
) -> None:
    # Before: optree's unflatten in dualgraph's namespace (the adapters' tree_map, as in
    # dualgraph.torch.owned) called the class bare: x doubled again, the items lost, the
    # entry 'loss' made, all silently
    with pytest.raises(DualgraphError, match=message):
        optree.tree_map(_same, make(), none_is_leaf=True, namespace=NAMESPACE)


def test_an_optree_walk_keeps_a_dict_dataclass_as_it_was() -> None:
    out = DictOutput(logits=array(2), loss=3)
    rebuilt = optree.tree_map(_same, out, none_is_leaf=True, namespace=NAMESPACE)
    assert type(rebuilt) is DictOutput and list(rebuilt.items()) == list(out.items())


def _moved_to_end() -> DictOutput:
    """A DictOutput whose entries an OrderedDict's move_to_end reordered: ['loss', 'logits']
    to the object (and to_tuple()), ['logits', 'loss'] to the dict beneath."""
    out = DictOutput(logits=array(2), loss=3)
    out.move_to_end("logits")
    return out


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_an_ordereddict_dataclass_reordered_by_move_to_end_is_a_mismatch(size: int) -> None:
    # Before: its entries were read in the dict's insertion order, not the object's, so a call
    # whose object was reordered passed check against one that was not
    spec = describe([DictOutput(logits=array(2), loss=3), *[None] * size])
    message = (
        r"^\[0\]: expected a \S*DictOutput with the dict entries \['logits', 'loss'\], got one "
        r"with the entries \['loss', 'logits'\]$"
    )
    for check in (False, True):
        with pytest.raises(SpecMismatchError, match=message):
            spec.flatten([_moved_to_end(), *[None] * size], check=check)


@pytest.mark.parametrize("walk", ["spec", "optree"])
def test_an_ordereddict_dataclass_reordered_by_move_to_end_is_refused_by_its_rebuild(
    walk: str,
) -> None:
    # Before: described as ['logits', 'loss'] and rebuilt so, silently, where the object (its
    # to_tuple(), out[0]) gave ['loss', 'logits']
    out = _moved_to_end()
    match = r"holds the dict entries \['logits', 'loss'\], where the object taken apart held "
    match += r"\['loss', 'logits'\]"
    with pytest.raises(DualgraphError, match=match):
        if walk == "spec":
            spec = describe((out,))
            assert spec.to_json() != describe((DictOutput(logits=array(2), loss=3),)).to_json()
            spec.unflatten(spec.flatten((out,), check=True))
        else:
            optree.tree_map(_same, out, none_is_leaf=True, namespace=NAMESPACE)


@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_an_ordereddict_reordered_by_move_to_end_is_read_and_rebuilt_in_its_own_order(
    size: int,
) -> None:
    # Guard: an OrderedDict's order is the object's (move_to_end's), in check and rebuild
    moved = collections.OrderedDict(a=array(1), b=array(2))
    moved.move_to_end("a")
    spec = describe([moved, *[None] * size])
    rebuilt = spec.unflatten(spec.flatten([moved, *[None] * size], check=True))[0]
    assert list(rebuilt) == ["b", "a"] and rebuilt["a"] is moved["a"]
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected keys in the order \['b', 'a'\]"):
        spec.check([collections.OrderedDict(a=array(1), b=array(2)), *[None] * size])


def _dataclass_also(base: type) -> type:
    """A dataclass that is also ``base``, whose builtin value its __new__ makes: the value is
    none of its fields."""

    def __new__(cls: type, x: Any = None, value: Any = None) -> Any:
        return base.__new__(cls) if value is None else base.__new__(cls, value)

    namespace = {"__annotations__": {"x": Any}, "x": None, "__new__": __new__}
    return dataclasses.dataclass(type(f"Also{base.__name__.title()}", (base,), namespace))


@pytest.mark.parametrize(
    "base",
    [str, int, float, bytes, complex, collections.defaultdict, Exception],
    ids=lambda base: base.__name__,
)
def test_registering_a_dataclass_that_is_also_a_builtin_value_is_refused(base: type) -> None:
    # Before: registered; its builtin value (a str's text, an int's number) was neither checked
    # nor rebuilt: a call of another value passed check, and unflatten made __new__'s default
    cls = _dataclass_also(base)
    with pytest.raises(
        DualgraphError,
        match=rf"^cannot register \S*Also\w+: it is also a \S*{base.__name__}, whose value is none "
        r"of its fields",
    ):
        register_dataclass(cls)
    assert container_kind(cls) is None  # nothing registered: describe refuses it as a leaf


@register_dataclass
@dataclasses.dataclass
class _Inner:
    x: Any = None


@register_dataclass
@dataclasses.dataclass
class _ChangesInPlace:
    """A dataclass whose __post_init__ changes what its fields hold, in place."""

    how: str
    held: Any = None

    def __post_init__(self) -> None:
        if self.how == "list-append":
            self.held.append(None)
        elif self.how == "dict-count":
            self.held["count"] = self.held.get("count", 0) + 1
        elif self.how == "nested-dataclass-field":
            self.held.x = None


def _held(how: str) -> Any:
    if how == "nested-dataclass-field":
        return _Inner()
    return [array(2)] if how == "list-append" else {"x": array(2)}


@pytest.mark.parametrize("how", ["list-append", "dict-count", "nested-dataclass-field"])
@pytest.mark.parametrize("size", [1, 2000], ids=["generated", "walked"])
def test_a_rebuild_that_changes_a_given_container_in_place_is_refused(how: str, size: int) -> None:
    # Before: its fields held the very objects given, so the rebuild passed, with the list one
    # item longer (or the dict one entry more, the inner field None) than the object taken apart
    made = _ChangesInPlace(how, _held(how))
    if how == "nested-dataclass-field":
        made.held.x = array(2)  # set again after its __post_init__ made it None
    tree = [made, *[None] * size]
    spec = describe(tree)
    with pytest.raises(
        DualgraphError,
        match=r"^unflatten: \[0\]: rebuilding a \S*_ChangesInPlace raised DualgraphError: \S* "
        r"changed in place a list, dict or dataclass it was given",
    ):
        spec.unflatten(spec.flatten(tree, check=True))


class _AppendsOnMaking(collections.namedtuple("_AppendsOnMaking", "items")):
    """A namedtuple whose __new__ appends to the list it is given."""

    def __new__(cls, items: Any) -> _AppendsOnMaking:
        items.append(None)
        return super().__new__(cls, items)


@pytest.mark.parametrize("where", ["root", "inside-a-dataclass"])
def test_a_namedtuple_whose_new_changes_a_given_list_in_place_is_refused(where: str) -> None:
    # Before: rebuilt with one None more in items than the object taken apart
    tree = _AppendsOnMaking([array(2)])
    with pytest.raises(DualgraphError, match=r"_AppendsOnMaking changed in place a list"):
        if where == "root":
            spec = describe(tree)
            spec.unflatten(spec.flatten(tree))
        else:
            made = _ChangesInPlace("none", [tree])
            spec = describe(made)
            spec.unflatten(spec.flatten(made))


class _FieldsReordered(collections.namedtuple("_FieldsReordered", "x y")):
    _fields = ("y", "x")


class _FieldOverridden(collections.namedtuple("_FieldOverridden", "x y")):
    @property
    def x(self) -> Any:  # type: ignore[override]
        return "another value"


@pytest.mark.parametrize(
    ("cls", "field"),
    [(_FieldsReordered, "y"), (_FieldOverridden, "x")],
    ids=["reordered", "property"],
)
def test_a_namedtuple_whose_fields_name_other_items_is_refused(cls: type, field: str) -> None:
    # Before: described, its item 0 named .y (.x read by a property), where obj.y is item 1
    # (obj.x 'another value'): a path in a spec's messages named another value than it held
    message = rf"\S*{cls.__name__}: its field '{field}' \(item 0 of _fields\) is not read by "
    with pytest.raises(DualgraphError, match=rf"^\[0\]: {message}"):
        describe((cls(array(2), 1),))
    with pytest.raises(DualgraphError, match=rf"^cannot register {message}"):
        register_namedtuple(cls)
