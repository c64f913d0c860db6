"""Capture's watches of torch functions, shared by threads: put back however they end."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from torch import nn

from dualgraph.torch import _missed_attributes
from dualgraph.torch._branch_reads import branch_reads
from dualgraph.torch._grad_mode_set import turns_grad_mode_on
from dualgraph.torch._missed_attributes import attributes_missed
from dualgraph.torch._watched_function import WatchedFunction

_MODULE_GETATTR = nn.Module.__getattr__

_WATCHES: dict[str, tuple[Callable[[], AbstractContextManager[Any]], Callable[[], Any]]] = {
    "getattr": (attributes_missed, lambda: nn.Module.__getattr__),
    "set_grad_enabled": (turns_grad_mode_on, lambda: torch._C._set_grad_enabled),
    "is_grad_enabled": (lambda: branch_reads(()), lambda: torch.is_grad_enabled),
    # inherited from torch._C.TensorBase: torch.Tensor holds none of its own, before or after
    "requires_grad": (lambda: branch_reads(()), lambda: vars(torch.Tensor).get("requires_grad")),
}


def _in_thread(body: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=body)
    thread.start()
    return thread


@pytest.mark.parametrize("watch", sorted(_WATCHES))
def test_watches_of_two_threads_ending_out_of_order_put_the_function_back(watch: str) -> None:
    # Two captures in two threads: the first to begin ends first.
    watched, current = _WATCHES[watch]
    found = current()
    first_began, second_began = threading.Event(), threading.Event()

    def first() -> None:
        with watched():
            first_began.set()
            assert second_began.wait(10)

    thread = _in_thread(first)
    assert first_began.wait(10)
    with watched():
        second_began.set()
        thread.join(10)
    assert current() is found


def test_a_watch_notes_the_lookups_of_its_own_thread_only() -> None:
    layer = nn.Linear(2, 2)

    def elsewhere() -> None:
        getattr(layer, "elsewhere", None)

    with attributes_missed() as missed:
        _in_thread(elsewhere).join(10)
        getattr(layer, "here", None)
    assert missed == {id(layer.__dict__): {"here"}}


def test_a_nested_watch_notes_in_the_outer_one_too() -> None:
    layer = nn.Linear(2, 2)
    with attributes_missed() as outer:
        with attributes_missed() as inner:
            getattr(layer, "inside", None)
        getattr(layer, "after", None)
    assert inner == {id(layer.__dict__): {"inside"}}
    assert outer == {id(layer.__dict__): {"inside", "after"}}


@pytest.mark.parametrize("outer_classes", [None, [nn.Linear]], ids=["every_class", "linear"])
@pytest.mark.parametrize("inner_classes", [None, [nn.Linear]], ids=["every_class", "linear"])
def test_a_nested_watch_of_classes_or_of_every_class_notes_in_the_outer_one_too(
    outer_classes: list[type] | None, inner_classes: list[type] | None
) -> None:
    # A class's watch calls nn.Module's __getattr__ as it is at the call: an outer or inner
    # watch of nn.Module hears the lookup too.
    layer = nn.Linear(2, 2)
    with attributes_missed(outer_classes) as outer:
        with attributes_missed(inner_classes) as inner:
            getattr(layer, "inside", None)
        getattr(layer, "after", None)
    assert inner == {id(layer.__dict__): {"inside"}}
    assert outer == {id(layer.__dict__): {"inside", "after"}}
    assert nn.Module.__getattr__ is _MODULE_GETATTR and "__getattr__" not in vars(nn.Linear)
    assert not _missed_attributes._CLASS_WATCHES


def test_a_watch_of_classes_notes_their_modules_only_and_puts_back_no_class_attribute() -> None:
    layer, relu = nn.Linear(2, 2), nn.ReLU()
    with attributes_missed([nn.Linear]) as missed:
        assert nn.Module.__getattr__ is _MODULE_GETATTR  # torch's subclasses left alone
        getattr(layer, "mask", None)
        getattr(relu, "mask", None)
    assert missed == {id(layer.__dict__): {"mask"}}
    assert "__getattr__" not in vars(nn.Linear)


def test_a_class_with_a_getattr_of_its_own_has_nn_modules_watched() -> None:
    # Its own __getattr__ may catch nn.Module's miss (and return a default), which a watch on
    # the class would not see.
    class Defaulting(nn.Module):
        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return None

    module = Defaulting()
    with attributes_missed([Defaulting]) as missed:
        assert module.mask is None
    assert missed == {id(module.__dict__): {"mask"}}
    assert nn.Module.__getattr__ is _MODULE_GETATTR and "__getattr__" in vars(Defaulting)


def test_watches_ended_out_of_order_in_one_thread_each_stop_noting() -> None:
    # begin/end (several watches entered at once): an end takes its own watcher, by identity,
    # wherever it is in the thread's list (two empty dicts are equal, and not the same).
    layer = nn.Linear(2, 2)
    watch = _missed_attributes._GETATTR
    first: dict[int, set[str]] = {}
    second: dict[int, set[str]] = {}
    watch.begin(first)
    watch.begin(second)
    watch.end(first)
    getattr(layer, "after_the_first_ended", None)
    watch.end(second)
    getattr(layer, "after_both_ended", None)
    assert first == {}
    assert second == {id(layer.__dict__): {"after_the_first_ended"}}
    assert nn.Module.__getattr__ is _MODULE_GETATTR


def test_a_watch_of_every_thread_hears_another_threads_call_and_a_plain_one_does_not() -> None:
    # The autograd engine runs a CUDA device's backward functions in a thread of its own: a
    # watch of a warmup backward must hear that thread's calls too.
    def noting(found: Any, watchers: Callable[[], list[list[Any]]]) -> Any:
        def noted(x: Any) -> Any:
            for seen in watchers():
                seen.append(x)
            return found(x)

        return noted

    box = types.SimpleNamespace(double=lambda x: 2 * x)
    original = box.double
    watched: WatchedFunction[list[Any]] = WatchedFunction(box, "double", noting)
    everywhere: list[Any] = []
    here: list[Any] = []
    with watched.watching(everywhere, every_thread=True), watched.watching(here):
        worker = threading.Thread(target=box.double, args=(5,))
        worker.start()
        worker.join()
        box.double(7)
    assert everywhere == [5, 7]
    assert here == [7]
    assert box.double is original


def _noting(found: Any, watchers: Callable[[], list[list[int]]]) -> Any:
    def noted(x: int) -> int:
        for seen in watchers():
            seen.append(x)
        return found(x)  # type: ignore[no-any-return]

    return noted


def test_a_watch_of_its_own_thread_ends_taking_the_lock_once() -> None:
    # Every warmup forward begins and ends a dozen watches: the end of one begun for this thread
    # only takes the lock for the count alone (none of every thread's watchers is its own).
    box = types.SimpleNamespace(double=lambda x: 2 * x)
    watch: WatchedFunction[list[int]] = WatchedFunction(box, "double", _noting)

    class CountingLock:
        def __init__(self) -> None:
            self.taken = 0
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            self.taken += 1
            self._lock.acquire()

        def __exit__(self, *_: object) -> None:
            self._lock.release()

    lock = CountingLock()
    object.__setattr__(watch, "_lock", lock)  # a slot
    held: list[int] = []
    watch.begin(held)  # the function replaced, and stays so
    seen: list[int] = []
    watch.begin(seen)
    lock.taken = 0
    watch.end(seen)
    assert lock.taken == 1
    assert box.double(3) == 6 and seen == [] and held == [3]
    watch.end(held)
    assert box.double(3) == 6 and held == [3]
