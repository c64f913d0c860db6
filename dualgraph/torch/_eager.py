"""The ``"eager"`` backend: validate the inputs against the samples, then call the callable.

It is also what a copy of a graphed callable becomes (``copy.deepcopy``, pickling): the same
function and input checks, without static buffers to share (and without hooks). Made by
``make_graphed_callables(..., backend="eager")``, it runs the callable's replay hooks around
each call and in the context its hooks give (e.g. a Transformer Engine autocast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import DualgraphError
from .._spec import TreeSpec, describe
from ._diagnostics import CaptureDiagnostics
from ._hooks import NO_HOOKS, CallableHooks
from ._inputs import InputGuard
from ._replay_hooks import call_eagerly

__all__ = ["EagerCallable"]


class EagerCallable:
    """A callable run eagerly, its inputs checked against the samples it was made with.

    >>> import torch
    >>> double = EagerCallable("double", lambda x: x * 2, InputGuard((torch.ones(2),), None))
    >>> double(torch.ones(2))
    tensor([2., 2.])
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        guard: InputGuard,
        hooks: CallableHooks = NO_HOOKS,
    ) -> None:
        self.name = name
        self.fn = fn
        self.backend = "eager"
        self.diagnostics = CaptureDiagnostics(name=name, backend="eager")
        self._guard = guard
        self._out_spec: TreeSpec | None = None
        self._hooks = hooks

    @property
    def spec(self) -> TreeSpec:
        """The output spec, recorded at the first call."""
        if self._out_spec is None:
            raise DualgraphError(
                f"{self.name}: the eager backend records its spec at the first call"
            )
        return self._out_spec

    @property
    def checked_tensors(self) -> None:
        """What each call checks besides its inputs: nothing (an eager call reads the module as
        it is), as :attr:`GraphedCallable.checked_tensors` says for a graphed one."""
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self._hooks
        if hooks.replay is not None:
            outputs = call_eagerly(
                hooks.replay, self.fn, args, kwargs, check=self._guard.tensors, run=hooks.run_eager
            )
        elif hooks.run_eager is not None:
            self._guard.tensors(args, kwargs)
            with hooks.run_eager():
                outputs = self.fn(*args, **kwargs)
        else:
            self._guard.tensors(args, kwargs)
            outputs = self.fn(*args, **kwargs)
        if self._out_spec is None:
            self._out_spec = describe(outputs, root="output")
        else:
            self._out_spec.flatten(outputs, check=True, root="output")
        self.diagnostics.replays += 1
        return outputs

    def __repr__(self) -> str:
        outputs = "recorded at the first call" if self._out_spec is None else repr(self._out_spec)
        return f"EagerCallable({self.name!r}, inputs=({self._guard.describe()}), outputs={outputs})"
