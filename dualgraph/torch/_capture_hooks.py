"""Capture-time hooks: host code around each warmup and capture call, never around a replay.

Some work must happen around a callable's forward and backward while it is warmed up and
captured, but must not be captured and must not run at replay: FSDP's unshard before the
forward and reshard after it, say (the graph keeps the unsharded memory it captured). Transformer
Engine's ``make_graphed_callables`` takes them as ``capture_time_hooks``, and so does
:func:`dualgraph.torch.make_graphed_callables`, in the same form: one dict per callable, with
any of the keys ``"forward_pre_hooks"``, ``"forward_hooks"``, ``"backward_pre_hooks"`` and
``"backward_hooks"``, each a ``{hook_id: hook}`` dict; ``hook(module)`` (the function, for a
callable that is not a module) returns ``None``. They run outside the graph being captured.

>>> seen = []
>>> hooks = CaptureTimeHooks.parse("f", print, {"forward_pre_hooks": {0: seen.append}})
>>> with hooks.around("forward"):
...     pass
>>> seen == [print]
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import DualgraphError

__all__ = ["HOOK_KINDS", "CaptureTimeHooks"]

#: The keys of a callable's capture-time hooks, as Transformer Engine names them.
HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


@dataclass(frozen=True, eq=False)
class CaptureTimeHooks:
    """One callable's capture-time hooks, checked; :meth:`around` runs them."""

    name: str
    target: Any  # what each hook is given: the module, or the function
    hooks: Mapping[str, tuple[tuple[Any, Callable[[Any], None]], ...]]

    @classmethod
    def parse(cls, name: str, target: Any, given: Any) -> CaptureTimeHooks:
        """Check ``given`` (a dict of hook dicts, or ``None``) for the callable ``name``."""
        if given is None:
            given = {}
        if not isinstance(given, Mapping):
            raise DualgraphError(
                f"capture_time_hooks for {name} must be a dict with keys among {HOOK_KINDS}, "
                f"got {type(given).__name__}"
            )
        unknown = [key for key in given if key not in HOOK_KINDS]
        if unknown:
            raise DualgraphError(
                f"capture_time_hooks for {name}: unknown key {unknown[0]!r}; the keys are "
                f"{HOOK_KINDS}"
            )
        hooks: dict[str, tuple[tuple[Any, Callable[[Any], None]], ...]] = {}
        for kind in HOOK_KINDS:
            table = given.get(kind, {})
            if not isinstance(table, Mapping):
                raise DualgraphError(
                    f"capture_time_hooks[{kind!r}] for {name} must be a dict {{hook_id: hook}}, "
                    f"got {type(table).__name__}"
                )
            for hook_id, hook in table.items():
                if not callable(hook):
                    raise DualgraphError(
                        f"capture_time_hooks[{kind!r}][{hook_id!r}] for {name} is not callable "
                        f"({type(hook).__name__})"
                    )
            hooks[kind] = tuple(table.items())
        return cls(name, target, hooks)

    @property
    def empty(self) -> bool:
        return not any(self.hooks.values())

    @contextlib.contextmanager
    def around(self, phase: str) -> Iterator[None]:
        """Run the ``phase`` (``"forward"`` or ``"backward"``) pre hooks, the body, the hooks."""
        self._run(f"{phase}_pre_hooks")
        yield
        self._run(f"{phase}_hooks")

    def _run(self, kind: str) -> None:
        for hook_id, hook in self.hooks[kind]:
            if hook(self.target) is not None:
                raise DualgraphError(
                    f"capture_time_hooks[{kind!r}][{hook_id!r}] of {self.name} returned a value; "
                    "capture-time hooks return None"
                )
