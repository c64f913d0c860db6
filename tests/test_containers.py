"""Registered dataclasses and how a spec names and finds container types."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, NamedTuple

import pytest
from trees import Attention, EncoderOutput, array, assert_same_tree

import dualgraph
from dualgraph import DualgraphError, TreeSpec, describe, register_dataclass
from dualgraph._containers import dataclass_fields, qualified_name, resolve_type


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


def test_frozen_dataclass_round_trips() -> None:
    @register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: Any
        tag: str = "frozen"

    tree = Frozen(array(2))
    spec = describe(tree)
    assert_same_tree(spec.unflatten(spec.flatten(tree)), tree)


@pytest.mark.parametrize("not_a_dataclass", [dict, EncoderOutput(1, 2)], ids=["class", "instance"])
def test_register_dataclass_rejects_anything_but_a_dataclass_type(not_a_dataclass: Any) -> None:
    with pytest.raises(DualgraphError, match="register_dataclass expects a dataclass type"):
        register_dataclass(not_a_dataclass)


def test_register_dataclass_rejects_fields_that_init_cannot_set() -> None:
    @dataclasses.dataclass
    class Derived:
        x: Any
        cached: Any = dataclasses.field(init=False, default=None)

    with pytest.raises(DualgraphError, match=r"fields \['cached'\] have init=False"):
        register_dataclass(Derived)
    assert dataclass_fields(Derived) is None


def test_dataclass_fields_is_none_for_an_unregistered_type() -> None:
    assert dataclass_fields(tuple) is None


def test_qualified_name_is_module_colon_qualname() -> None:
    assert qualified_name(collections.OrderedDict) == "collections:OrderedDict"
    assert qualified_name(Attention) == "trees:Attention"


class Outer:
    class Inner(NamedTuple):
        x: Any


def test_resolve_type_imports_a_named_type() -> None:
    assert resolve_type("json.decoder:JSONDecodeError") is json.JSONDecodeError


def test_resolve_type_follows_a_nested_qualname() -> None:
    assert resolve_type(f"{__name__}:Outer.Inner") is Outer.Inner


def test_resolve_type_finds_a_locally_defined_type_once_described() -> None:
    Local = collections.namedtuple("Local", "a b")
    text = describe(Local(array(2), None)).to_json()
    assert resolve_type(qualified_name(Local)) is Local
    assert type(TreeSpec.from_json(text).unflatten([array(2)])) is Local


@pytest.mark.parametrize(
    "name", ["no_such_module:Thing", "collections:NoSuchThing"], ids=["module", "attribute"]
)
def test_resolve_type_of_a_missing_name_says_to_define_it(name: str) -> None:
    with pytest.raises(DualgraphError, match=f"cannot resolve type '{name}' .*define it first"):
        resolve_type(name)


def test_resolve_type_rejects_a_name_that_is_not_a_type() -> None:
    with pytest.raises(DualgraphError, match="is not a type"):
        resolve_type("os.path:join")


def test_register_dataclass_is_exported() -> None:
    assert dualgraph.register_dataclass is register_dataclass
