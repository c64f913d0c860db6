"""Replay hooks: host code that runs outside the graphs, around every replay of a callable.

A graph replays kernels, not Python. Host state that eager code changes on every call (a step
counter, an MoE aux-loss tracker's count of micro-batches, a library's per-step bookkeeping such
as Transformer Engine's FP8 scale update) changes during warmup and capture only, unless
something runs it on every replay: :class:`ReplayHooks` holds up to four callables, each given
the :class:`ReplayCall` it runs for. They run on every backend (on ``"eager"``, around the eager
call), for every slot and bucket; dualgraph's own bookkeeping (Transformer Engine's) runs before
yours.

>>> import torch, dualgraph.torch as dgt
>>> micro_batches = []
>>> hooks = dgt.ReplayHooks(after_backward=lambda call: micro_batches.append(call.name))
>>> layer = dgt.make_graphed_callables(
...     torch.nn.Linear(2, 2), (torch.ones(1, 2),), replay_hooks=hooks
... )
>>> layer(torch.ones(1, 2)).sum().backward()
>>> micro_batches
['Linear']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import optree
import torch

from .._containers import NAMESPACE
from .._errors import DualgraphError
from ._ambient import autograd_records

__all__ = ["ReplayCall", "ReplayHookRunner", "ReplayHooks", "ReplayKwarg", "call_eagerly"]

_NO_KWARGS: Mapping[str, Any] = MappingProxyType({})
_HOOK_NAMES = ("before_forward", "after_forward", "before_backward", "after_backward")
_NONE: tuple[tuple[Any, ...], None] = ((), None)  # a hook name with nothing to run


@dataclass(eq=False, slots=True)
class ReplayCall:
    """One call of a graphed callable, as its replay hooks see it.

    The same object goes to the forward hooks and the backward hooks of one replay, so
    ``state`` carries what a forward hook wants its backward hook to know.

    Attributes:
        name: the graphed callable's name (its class for a module).
        index: its position among the callables graphed together (0 for one callable).
        backend: ``"cuda"``, ``"emulate"`` or ``"eager"``.
        backward_expected: grad mode is on and the outputs have a differentiable part, so the
            backward hooks run if the caller runs the backward (on ``"eager"``: grad mode is on).
        replay_kwargs: the keyword arguments that the replay takes itself and does not pass to
            the callable, e.g. ``{"is_first_microbatch": True}`` with
            ``cache_quantized_params=True``.
        outputs: in ``after_forward``, the outputs the call returns; ``None`` in the others.
        state: a dict of your own, per call.

    >>> ReplayCall("Linear", 0, "emulate", True).state
    {}
    """

    name: str
    index: int
    backend: str
    backward_expected: bool
    replay_kwargs: Mapping[str, Any] = field(default_factory=dict)
    outputs: Any = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayHooks:
    """Callables run outside the graphs around every replay (each optional, given a ReplayCall).

    - ``before_forward(call)``: after the call's inputs are checked, before the forward replay.
    - ``after_forward(call)``: after it, with ``call.outputs`` set.
    - ``before_backward(call)``, ``after_backward(call)``: around the backward replay of that
      call; ``after_backward`` once the parameter grads a graph adds are in ``.grad``
      (``param_grads="auto"`` in a plain ``.backward()``, ``"in_graph"``; grads handed to
      autograd reach ``.grad`` after it). On the ``"eager"`` backend: when the backward reaches
      the call's outputs, and at the end of that backward pass, since autograd marks no single
      end of one call's backward.

    Hooks return ``None``. An exception a hook raises propagates with a note naming the hook and
    the callable; it aborts that call (a forward hook) or that backward (a backward hook).

    >>> from collections import Counter
    >>> replays = Counter()
    >>> hooks = ReplayHooks(before_forward=lambda call: replays.update([call.name]))
    >>> hooks.before_forward is not None and hooks.after_backward is None
    True
    """

    before_forward: Callable[[ReplayCall], None] | None = None
    after_forward: Callable[[ReplayCall], None] | None = None
    before_backward: Callable[[ReplayCall], None] | None = None
    after_backward: Callable[[ReplayCall], None] | None = None

    def __post_init__(self) -> None:
        for name in _HOOK_NAMES:
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise DualgraphError(
                    f"ReplayHooks.{name} must be a callable taking a ReplayCall, or None; got "
                    f"{type(hook).__name__}"
                )


@dataclass(frozen=True)
class ReplayKwarg:
    """A keyword argument each call passes to the replay, which takes it from the call.

    ``check(value)`` says what is wrong with a value (``None``: nothing); ``missing`` explains
    the argument when a call leaves it out; ``to_eager`` passes it on to the callable on the
    ``"eager"`` backend (where the callable itself uses it).
    """

    name: str
    check: Callable[[Any], str | None]
    missing: str
    to_eager: bool = False


class ReplayHookRunner:
    """The hooks of one graphed callable: dualgraph's own first, then the user's, and the kwargs
    its replays take. Built once at capture; a replay calls it four times at most."""

    __slots__ = ("_kwargs", "_phases", "index", "name")

    def __init__(
        self,
        name: str,
        index: int,
        *,
        internal: Sequence[ReplayHooks] = (),
        user: ReplayHooks | None = None,
        kwargs: Sequence[ReplayKwarg] = (),
    ) -> None:
        self.name = name
        self.index = index
        self._kwargs = tuple(kwargs)
        # per hook name: dualgraph's callables, then the user's (or None), fixed here
        self._phases = {
            which: (
                tuple(h for h in (getattr(hooks, which) for hooks in internal) if h is not None),
                None if user is None else getattr(user, which),
            )
            for which in _HOOK_NAMES
        }

    @property
    def eager_kwargs(self) -> tuple[str, ...]:
        """The replay kwargs the ``"eager"`` backend passes on to the callable."""
        return tuple(kwarg.name for kwarg in self._kwargs if kwarg.to_eager)

    def split_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Mapping[str, Any]]:
        """``(kwargs for the callable, replay kwargs)``; a missing or bad replay kwarg raises."""
        if not self._kwargs:
            return kwargs, _NO_KWARGS
        rest = dict(kwargs)
        taken: dict[str, Any] = {}
        for kwarg in self._kwargs:
            if kwarg.name not in rest:
                raise DualgraphError(
                    f"{self.name}: kwargs['{kwarg.name}'] is missing: {kwarg.missing}"
                )
            value = rest.pop(kwarg.name)
            why = kwarg.check(value)
            if why is not None:
                raise DualgraphError(f"{self.name}: kwargs['{kwarg.name}']: {why}")
            taken[kwarg.name] = value
        return rest, taken

    def before_forward(
        self, backend: str, backward_expected: bool, replay_kwargs: Mapping[str, Any]
    ) -> ReplayCall:
        call = ReplayCall(self.name, self.index, backend, backward_expected, replay_kwargs)
        self._run("before_forward", call)
        return call

    def after_forward(self, call: ReplayCall, outputs: Any) -> None:
        if self._phases["after_forward"] == _NONE:
            return
        call.outputs = outputs
        try:
            self._run("after_forward", call)
        finally:
            call.outputs = None  # a slot is free once nothing holds its outputs

    def before_backward(self, call: ReplayCall) -> None:
        self._run("before_backward", call)

    def after_backward(self, call: ReplayCall) -> None:
        self._run("after_backward", call)

    def _run(self, which: str, call: ReplayCall) -> None:
        internal, hook = self._phases[which]
        if hook is None and not internal:
            return
        for own in internal:
            own(call)
        if hook is None:
            return
        try:
            result = hook(call)
        except Exception as error:
            note = f"raised in the {which} replay hook of {self.name}"
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(note)
                raise
            raise DualgraphError(f"{self.name}: {note}: {type(error).__name__}: {error}") from error
        if result is not None:
            raise DualgraphError(
                f"{self.name}: the {which} replay hook returned {type(result).__name__}; replay "
                "hooks return None"
            )


def call_eagerly(
    runner: ReplayHookRunner,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    check: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    run: Callable[[], Any] | None = None,
) -> Any:
    """One eager call with replay hooks: the forward hooks around it, the backward hooks on the
    autograd graph of its outputs. ``check`` validates the call's inputs; ``run`` is a context
    the call runs in (e.g. a Transformer Engine autocast)."""
    kwargs, replay_kwargs = runner.split_kwargs(kwargs)
    check(args, kwargs)
    call_kwargs = dict(kwargs)
    for name in runner.eager_kwargs:
        call_kwargs[name] = replay_kwargs[name]
    call = runner.before_forward("eager", autograd_records(), replay_kwargs)
    if run is None:
        outputs = fn(*args, **call_kwargs)
    else:
        with run():
            outputs = fn(*args, **call_kwargs)
    if call.backward_expected:
        _hook_backward(runner, call, outputs)
    runner.after_forward(call, outputs)
    return outputs


def _hook_backward(runner: ReplayHookRunner, call: ReplayCall, outputs: Any) -> None:
    """Run the backward hooks when a backward pass reaches ``outputs``, and at its end."""
    differentiable = [
        leaf
        for leaf in optree.tree_leaves(outputs, none_is_leaf=True, namespace=NAMESPACE)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None
    ]
    if not differentiable:
        return

    def reached(_grad: Any) -> None:
        runner.before_backward(call)
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: runner.after_backward(call))

    torch.autograd.graph.register_multi_grad_hook(differentiable, reached, mode="any")
