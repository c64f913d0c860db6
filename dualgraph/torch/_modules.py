"""Graphed modules: the ``forward`` a module gets, how it comes back, and what copies get.

A graphed module's ``forward`` replays while the module's ``training`` mode is the one it was
captured in, and runs the original forward otherwise. The module keeps its own class; the
graphing lives in two entries of its ``__dict__``: ``forward`` and the runner's state.
``copy.deepcopy`` and pickling (``torch.save``) keep the parameters and drop the graphs: the
copy runs eagerly, with its own weights, and can be graphed on its own. ``copy.copy`` drops them
too (its forward would be the one bound to the module copied, replaying in that module's mode).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .._errors import DualgraphError
from ._buckets import BucketedCallable
from ._eager import EagerCallable
from ._params import GRAPHED_STATE, changes_taken
from ._replay import GraphedCallable
from ._slots import SlottedCallable

__all__ = [
    "eager_forward",
    "install",
    "is_graphed",
    "restore",
    "runner_of",
    "the_module_of_its_forward",
    "training_at_capture",
]

_STATE = GRAPHED_STATE

Runner = GraphedCallable | SlottedCallable | EagerCallable | BucketedCallable


class _Graphed:
    """A graphed module's state: its runner, its training mode at capture, its old forward.

    Copies of the module get a :class:`_Copied` in its place, without the runner.
    """

    __slots__ = ("getstate", "previous", "runner", "training")

    def __init__(self, runner: Runner, training: bool, previous: Any, getstate: Any) -> None:
        self.runner = runner
        self.training = training
        self.previous = previous  # an instance-level forward the module had before, or None
        self.getstate = getstate  # an instance-level __getstate__ it had before, or None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Copied:
        return _Copied(copy.deepcopy(self.previous, memo))

    def __copy__(self) -> _Copied:
        return _Copied(self.previous)

    def __reduce__(self) -> tuple[Any, ...]:
        return _Copied, (self.previous,)


class _Copied:
    """Left in a copy of a graphed module (the copy runs eagerly and drops this on first use),
    and in a restored module whose forward the user replaced after graphing (a wrapper of the
    graphed forward they installed may still call it: it runs ``previous``)."""

    __slots__ = ("previous",)

    def __init__(self, previous: Any) -> None:
        self.previous = previous


def _graphed_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A graphed module's ``forward``: replay, or the original forward in the other mode.

    Installed as ``functools.partial(_graphed_forward, module)``, which ``copy.deepcopy`` and
    pickle rebuild around the copy. In a copy it finds no runner, puts the copy's own forward
    back and runs that: copies are plain modules.
    """
    state = module.__dict__.get(_STATE)
    if type(state) is _Graphed:
        if module.training == state.training:
            return state.runner(*args, **kwargs)
        with changes_taken(module):  # numbers its Python sets are no change of the caller's
            if state.previous is not None:
                outputs = state.previous(*args, **kwargs)
            else:
                outputs = type(module).forward(module, *args, **kwargs)
        graphs = getattr(state.runner, "eager_graphs", None)  # "auto": see EagerGraphs
        if graphs is not None:  # (no grad mode read here: inside a capture it would be noted)
            graphs.track(tree_leaves(outputs))
        return outputs
    # A copy of a graphed module (from now on a plain module), or a restored one whose user's
    # forward wraps this one: run the forward from before graphing, never module.forward (which
    # may be that wrapper, calling this again).
    previous = getattr(state, "previous", None)
    _ungraph(module)
    if previous is not None:
        return previous(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def install(fn: Any, runner: Runner) -> Any:
    """Give a module ``runner`` as its forward (a module comes back); a function is ``runner``."""
    if not isinstance(fn, torch.nn.Module):
        return runner
    module = fn
    if isinstance(module.__dict__.get(_STATE), _Copied):
        _ungraph(module)
    getstate = module.__dict__.get(_GETSTATE)
    if type(getstate) is functools.partial and getstate.func is _state_of_a_copy:
        getstate = None  # ours, left by a copy made while graphed
    state = _Graphed(runner, module.training, module.__dict__.get("forward"), getstate)
    module.__dict__[_STATE] = state
    module.__dict__["forward"] = functools.partial(_graphed_forward, module)
    # copy.copy, copy.deepcopy and pickle read a module's state through the instance's
    # __getstate__: a shallow copy would otherwise share the forward bound to this module,
    # replaying its graphs in this module's training mode with its attributes, not the copy's
    module.__dict__[_GETSTATE] = functools.partial(_state_of_a_copy, module)
    return module


_GETSTATE = "__getstate__"


def _state_of_a_copy(module: torch.nn.Module) -> Any:
    """What a copy of graphed ``module`` is made from: its class's state, without the graphs (a
    :class:`_Copied` in their place, for the messages of a copy)."""
    graphed = module.__dict__.get(_STATE)
    users = graphed.getstate if type(graphed) is _Graphed else None
    state = users() if users is not None else type(module).__getstate__(module)
    if not isinstance(state, dict):
        return state
    state = {key: value for key, value in state.items() if key != _GETSTATE}
    if users is not None:  # the copy keeps the user's, as a copy of the module before graphing
        state[_GETSTATE] = users
    graphed = state.get(_STATE)
    if type(graphed) is not _Graphed:
        return state
    state[_STATE] = _Copied(graphed.previous)
    forward = state.get("forward")
    if type(forward) is functools.partial and forward.func is _graphed_forward:
        if graphed.previous is None:
            del state["forward"]
        else:
            state["forward"] = graphed.previous
    return state


def eager_forward(module: torch.nn.Module) -> Any:
    """The forward ``module`` runs without graphs (a copy of a graphed module is cleaned first)."""
    if isinstance(module.__dict__.get(_STATE), _Copied):
        _ungraph(module)
    return module.forward


def is_graphed(module: torch.nn.Module) -> bool:
    """Whether ``module`` is graphed (a copy of a graphed module is not)."""
    return type(module.__dict__.get(_STATE)) is _Graphed


def training_at_capture(module: torch.nn.Module) -> bool | None:
    """The ``training`` mode a graphed module replays in (``None``: not graphed)."""
    state = module.__dict__.get(_STATE)
    return state.training if type(state) is _Graphed else None


def restore(module: torch.nn.Module, /) -> torch.nn.Module:
    """Give a graphed module its original ``forward`` back (a copy of one is cleaned up too).

    Given the module's graphed ``forward`` (``module.forward``), restores the module.

    A forward the user installed after graphing (``module.forward = f``) stays: it is theirs.

    >>> import dualgraph.torch as dgt
    >>> layer = dgt.make_graphed_callables(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    >>> dgt.restore(layer)(torch.ones(3, 2)).shape  # eager again: any batch size
    torch.Size([3, 2])
    """
    module = the_module_of_its_forward(module)  # restore(model.forward) restores model
    if not isinstance(module, torch.nn.Module) or _STATE not in module.__dict__:
        raise DualgraphError(f"{type(module).__name__} is not a graphed module")
    _ungraph(module)
    return module


def the_module_of_its_forward(thing: Any) -> Any:
    """``module`` for the forward a graphed module was given (``module.forward``), else ``thing``.

    That forward is the module's graphed entry point: the tools asked about it (``diagnostics``,
    ``verify``, ``lint``, ...) answer for the module, whose runner it replays, rather than
    refusing it as an unknown callable or running (and counting) its replays as the callable.

    >>> import dualgraph.torch as dgt
    >>> layer = dgt.make_graphed_callables(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    >>> the_module_of_its_forward(layer.forward) is layer
    True
    """
    if type(thing) is functools.partial and thing.func is _graphed_forward and len(thing.args) == 1:
        return thing.args[0]
    return thing


def runner_of(graphed: Any) -> Runner:
    """The :class:`GraphedCallable` (:class:`SlottedCallable`, :class:`EagerCallable`,
    :class:`BucketedCallable`) behind a graphed object (a graphed module's ``forward`` too)."""
    if isinstance(graphed, GraphedCallable | SlottedCallable | EagerCallable | BucketedCallable):
        return graphed
    graphed = the_module_of_its_forward(graphed)
    state = getattr(graphed, "__dict__", {}).get(_STATE)
    if type(state) is not _Graphed:
        raise DualgraphError(_not_graphed(graphed, state))
    return state.runner


def _not_graphed(thing: Any, state: Any) -> str:
    """Why ``thing`` has no runner, named by its class (a module's repr is its whole tree) and
    pointing at what is graphed: a copy's source, a model's graphed submodules."""
    if not isinstance(thing, torch.nn.Module):
        shown = repr(thing)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        return f"{shown} was not made by dualgraph.torch.make_graphed_callables"
    name = type(thing).__name__
    if isinstance(state, _Copied):
        return (
            f"{name} is a copy of a graphed module (copy.deepcopy, pickle: copies run eagerly) "
            "and was not made by dualgraph.torch.make_graphed_callables; ask the module it was "
            "copied from, or graph the copy"
        )
    inside = [path for path, sub in thing.named_modules() if path and is_graphed(sub)]
    if not inside:
        return f"{name} (a module) was not made by dualgraph.torch.make_graphed_callables"
    listed = ", ".join(inside[:4]) + (f" and {len(inside) - 4} more" if len(inside) > 4 else "")
    return (
        f"{name} (a module) was not made by dualgraph.torch.make_graphed_callables, but "
        f"holds graphed submodules: {listed}; pass one of those "
        f"(.get_submodule({inside[0]!r}))"
    )


def _ungraph(module: torch.nn.Module) -> None:
    state = module.__dict__.pop(_STATE, None)
    getstate = module.__dict__.get(_GETSTATE)
    if type(getstate) is functools.partial and getstate.func is _state_of_a_copy:
        del module.__dict__[_GETSTATE]
        users = getattr(state, "getstate", None)
        if users is not None:  # the user's, from before graphing
            module.__dict__[_GETSTATE] = users
    previous = getattr(state, "previous", None)
    forward = module.__dict__.get("forward")
    if not (isinstance(forward, functools.partial) and forward.func is _graphed_forward):
        # The user replaced the graphed forward: theirs stays, and a wrapper of ours in it still
        # finds the forward from before graphing.
        if forward is not None and type(state) is _Graphed:
            module.__dict__[_STATE] = _Copied(previous)
        return
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = previous
