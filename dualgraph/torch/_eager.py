"""The ``"eager"`` backend: validate the inputs against the samples, then call the callable.

Like a graph, it holds a call made as capture's are (grad mode on, each input requiring grad as
its sample) to the outputs' structure, shapes and dtypes of the first such call; a call made
otherwise, which a graphed callable whose Python reads those runs eagerly, returns eager's
outputs as they are.

It is also what a copy of a graphed callable becomes (``copy.deepcopy``, pickling): the same
function and input checks, without static buffers to share (and without hooks). Made by
``make_graphed_callables(..., backend="eager")``, it runs the callable's replay hooks around
each call and in the context its hooks give (e.g. a Transformer Engine autocast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import DualgraphError
from .._spec import TreeSpec, describe
from ._carried_attributes import public_attributes, set_by_call
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
        # whether _out_spec is that of a call made as capture's are (see _check_outputs)
        self._spec_as_captured = False
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
    def returned_input_paths(self) -> None:
        """Not known: an eager call returns whatever the callable returns, its inputs too (as
        :attr:`GraphedCallable.returned_input_paths` says for a graphed one)."""
        return None

    @property
    def checked_tensors(self) -> None:
        """What each call checks besides its inputs: nothing (an eager call reads the module as
        it is), as :attr:`GraphedCallable.checked_tensors` says for a graphed one."""
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self._hooks
        tensors: list[torch.Tensor] = []

        carried = self._guard.carried

        def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            found = self._guard.tensors(args, kwargs)
            if carried.differ(found):  # as a replay refuses it (_carried_attributes)
                raise carried.refusal(found)
            tensors.extend(found)
            before.extend(map(public_attributes, found))

        before: list[dict[str, Any]] = []

        if hooks.replay is not None:
            outputs = call_eagerly(
                hooks.replay, self.fn, args, kwargs, check=check, run=hooks.run_eager
            )
        elif hooks.run_eager is not None:
            check(args, kwargs)
            with hooks.run_eager():
                outputs = self.fn(*args, **kwargs)
        else:
            check(args, kwargs)
            outputs = self.fn(*args, **kwargs)
        for i, (tensor, then) in enumerate(zip(tensors, before, strict=True)):
            carried.ignore(i, set_by_call(tensor, then))  # set again on each call's input
        self._check_outputs(outputs, tensors)
        self.diagnostics.replays += 1
        return outputs

    def _check_outputs(self, outputs: Any, tensors: list[torch.Tensor]) -> None:
        """Refuse outputs a replay could not give: another structure, shape or dtype than the
        first call's, where this call is made as capture's are (grad mode on, the inputs'
        ``requires_grad`` their samples'). A call made otherwise is one a graphed callable
        reading grad mode or ``requires_grad`` runs eagerly, handing back eager's outputs of
        whatever structure (``(h, None)`` where training returns an auxiliary loss): so here."""
        as_captured = (
            torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and tuple(t.requires_grad for t in tensors) == self._guard.requires_grad
        )
        if self._out_spec is None or (as_captured and not self._spec_as_captured):
            self._out_spec = describe(outputs, root="output")
            self._spec_as_captured = as_captured
        elif as_captured:
            self._out_spec.flatten(outputs, check=True, root="output")

    def __repr__(self) -> str:
        outputs = "recorded at the first call" if self._out_spec is None else repr(self._out_spec)
        return f"EagerCallable({self.name!r}, inputs=({self._guard.describe()}), outputs={outputs})"
