"""``ObjectGuard``: identities, classes and dict sizes of fixed objects in one C call, never
passing what the Python tests it stands for would refuse; and ``ModuleTensors.check`` with it."""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict
from typing import Any

import pytest
import torch

import dualgraph.torch as dgt
from dualgraph import DualgraphError
from dualgraph.torch._modules import runner_of
from dualgraph.torch._object_guards import ObjectGuard
from dualgraph.torch._params import ModuleTensors


class _Thing:
    pass


def _guarded() -> tuple[dict[str, Any], _Thing, Any]:
    thing = _Thing()
    thing.flag = True
    entries: dict[str, Any] = {"thing": thing}
    guard = ObjectGuard()
    guard.holds(entries, "thing", thing)
    guard.holds(entries, "absent", ObjectGuard.ABSENT)
    guard.size(entries, 1)
    guard.is_a(thing, _Thing)
    guard.attribute(thing, "flag", True)
    check = guard.made()
    if check is None:
        pytest.skip("no guard manager in this torch")
    return entries, thing, check


def test_an_object_guard_passes_the_objects_as_they_are() -> None:
    _, _, check = _guarded()
    assert check() is True


@pytest.mark.parametrize(
    "change",
    [
        lambda entries, thing: entries.__setitem__("thing", _Thing()),
        lambda entries, thing: entries.pop("thing"),
        lambda entries, thing: entries.__setitem__("absent", None),
        lambda entries, thing: entries.__setitem__("more", thing),
        lambda entries, thing: setattr(thing, "flag", 1),  # equal, not the same object
        lambda entries, thing: delattr(thing, "flag"),
        lambda entries, thing: setattr(thing, "__class__", type("Other", (), {})),
    ],
    ids=["replaced", "removed", "added_where_absent", "more_keys", "equal_flag", "no_flag", "cls"],
)
def test_an_object_guard_fails_each_change(change: Any) -> None:
    entries, thing, check = _guarded()
    change(entries, thing)
    assert check() is False


def test_no_object_guard_over_a_dict_subclass() -> None:
    class Entries(dict):  # type: ignore[type-arg]
        pass

    guard = ObjectGuard()
    guard.size(Entries(), 0)
    assert guard.made() is None
    plain = ObjectGuard()
    plain.size(OrderedDict(), 0)
    assert plain.made() is not None or ObjectGuard().made() is None


class _Scaled(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.scale = 2.0


def _recorded(layer: torch.nn.Module) -> ModuleTensors:
    tensors = ModuleTensors.of(layer)
    tensors.record_attributes()
    return tensors


def test_a_value_set_back_after_the_callable_changed_it_is_refused() -> None:
    # The callable's own change is taken as the record (an emulated replay's Python); the C
    # check made before from the old value must not pass that old value set back after.
    layer = _Scaled()
    tensors = _recorded(layer)
    before = layer.scale
    for _ in range(2):
        tensors.check(grad_enabled=True)  # the first passing call makes the C check
    with tensors.own_changes_taken():
        layer.scale = 3.0
    layer.scale = before
    with pytest.raises(DualgraphError, match=r"scale"):
        tensors.check(grad_enabled=True)


def test_a_module_check_refuses_after_calls_that_passed() -> None:
    layer = _Scaled()
    tensors = _recorded(layer)
    for _ in range(3):
        tensors.check(grad_enabled=True)
    layer.training = 1  # equal to True: no change, as before
    for _ in range(3):
        tensors.check(grad_enabled=True)
    layer.bias = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(DualgraphError, match=r"_Scaled\.bias"):
        tensors.check(grad_enabled=True)


def test_a_module_check_keeps_to_python_where_a_record_changes_on_every_call() -> None:
    layer = _Scaled()
    tensors = _recorded(layer)
    for step in range(20):
        with tensors.own_changes_taken():
            layer.scale = float(step)  # a counter the callable's Python sets
        tensors.check(grad_enabled=True)
    assert tensors._object_check[0] is None  # made 8 times, then no more
    layer.scale = -1.0
    with pytest.raises(DualgraphError, match=r"scale"):
        tensors.check(grad_enabled=True)


def test_a_graphed_module_whose_calls_made_the_c_check_is_freed_once_dropped() -> None:
    # the C guard compares by id and holds no reference the garbage collector cannot see
    def graphed() -> tuple[weakref.ref[torch.nn.Module], weakref.ref[torch.Tensor]]:
        module = torch.nn.Sequential(_Scaled(), torch.nn.ReLU())
        model = dgt.make_graphed_callables(
            module, (torch.randn(2, 2, requires_grad=True),), backend="emulate"
        )
        for _ in range(3):
            model(torch.randn(2, 2, requires_grad=True)).sum().backward()
        checked = runner_of(model).checked_tensors
        assert checked is not None and checked._object_check[1] >= 1  # made, and used
        return weakref.ref(module), weakref.ref(module[0].weight)

    refs = [graphed() for _ in range(2)]
    gc.collect()
    assert all(module() is None and weight() is None for module, weight in refs)
