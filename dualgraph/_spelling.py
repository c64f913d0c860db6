"""How a call spells its arguments: by position, by keyword, or left to their defaults.

A call spec describes the sample call as it was written: ``f(x, scale=2.0)`` holds
``kwargs['scale']``, ``f(x, 2.0)`` holds ``args[1]`` and ``f(x)`` neither. Python binds all
three to the same parameters, so a later call spelled otherwise than the sample (a keyword
passed by position, a default passed explicitly, or left out where the sample passed it) is, to
eager, the same call. :class:`CallSpelling` writes such a call as the sample was written, from
the function's signature, so that the spec checks what each parameter gets:

* a parameter the sample passed gets the call's value, or its default where the call leaves
  it out (eager's value), which the spec then compares;
* a parameter the sample left to its default must get its default (or be left out): the call's
  value is compared with the default strictly (its type and value, as a spec compares
  constants; a tensor by identity), and anything else is refused naming the path the call
  passes it at, as a compiled program holds the default.

Only a call the spec refused is written again (the error path), and the way of writing each
spelling is worked out once.

>>> def f(x, scale=2.0, mask=None):
...     return x
>>> spelling = CallSpelling(f, ("x",), {"scale": 2.0})
>>> spelling.as_captured(("x", 3.0), {"mask": None})
(('x',), {'scale': 3.0})
>>> spelling.as_captured(("x",), {"mask": 0.5})
Traceback (most recent call last):
...
dualgraph.SpecMismatchError: kwargs['mask']: float 0.5, where the sample call left mask to its ...
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._containers import brief_of
from ._errors import SpecMismatchError
from ._nodes import clip
from ._paths import Index, Key, format_path
from ._signatures import signature_of
from ._spec import describe

__all__ = ["CallSpelling", "binding_signature"]

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def binding_signature(fn: Callable[..., Any], /) -> inspect.Signature:
    """The signature Python binds a call of ``fn`` by: ``fn``'s own, never one it wraps.

    ``inspect.signature`` follows ``__wrapped__`` (``functools.wraps``) to the wrapped
    function's, but a call binds to the wrapper, whose own defaults and ``**kwargs`` decide
    what the wrapped function gets. A ``__signature__`` the callable declares is kept
    (``jax.jit`` declares the function's, ``functools.partial`` gets its own).

    >>> import functools
    >>> def f(x, scale=2.0):
    ...     return x * scale
    >>> binding_signature(functools.wraps(f)(lambda *args, **kwargs: f(*args, scale=3.0)))
    <Signature (*args, **kwargs)>
    """
    return signature_of(fn)


class _Slot:
    """Where a call gives a value: ``args[key]`` or ``kwargs[key]`` (a probe bound in its place),
    or a parameter's default (``key`` is then the default itself)."""

    __slots__ = ("key", "kind")

    ARG, KWARG, DEFAULT = range(3)

    def __init__(self, kind: int, key: Any) -> None:
        self.kind = kind
        self.key = key

    def read(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if self.kind == _Slot.ARG:
            return args[self.key]
        if self.kind == _Slot.KWARG:
            return kwargs[self.key]
        return self.key

    @property
    def path(self) -> str | None:
        """Where the call gives the value (``None``: left to its default)."""
        if self.kind == _Slot.DEFAULT:
            return None
        return _path(self.kind == _Slot.ARG, self.key)


def _path(positional: bool, key: Any) -> str:
    return format_path((Index(key),), "args") if positional else format_path((Key(key),), "kwargs")


#: How to write one spelling of a call as the sample's: where each positional argument and each
#: keyword comes from, and the parameters the sample left to their defaults that the call passes
#: (where the call gives them, their name, the default).
_Plan = tuple[tuple[_Slot, ...], tuple[tuple[str, _Slot], ...], tuple[tuple[_Slot, str, Any], ...]]


class CallSpelling:
    """The way a sample call spelled its arguments for ``fn``'s signature; :meth:`as_captured`
    writes another call of ``fn`` so (see the module docstring).

    Where the signature cannot be read or the sample does not bind to it, nothing is written
    again (:meth:`as_captured` gives ``None``).
    """

    __slots__ = ("_keywords", "_left_out", "_plans", "_positional", "_signature", "_var")

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]):
        self._signature: inspect.Signature | None = None
        self._plans: dict[tuple[int, tuple[str, ...]], _Plan | None] = {}
        try:
            signature = binding_signature(fn)  # read once for the callables of one graphing
            signature.bind(*args, **kwargs)
        except Exception:  # no signature to read (a builtin), or one the sample does not fit
            return
        parameters = signature.parameters
        #: the parameters the sample passed by position, in order (then its ``*args``)
        self._positional = len(args)
        #: the named parameters the sample passed by keyword, in its order (a keyword named as
        #: a positional-only parameter goes to the ``**kwargs``, not to that parameter)
        self._keywords = tuple(
            name for name in kwargs if name in parameters and parameters[name].kind in _KEYWORD
        )
        given = set(self._keywords)
        named = [p for p in parameters.values() if p.kind not in _VAR]
        positional = [p for p in named if p.kind in _POSITIONAL]
        given.update(p.name for p in positional[: self._positional])
        #: the named parameters the sample left to their defaults
        self._left_out = tuple(p.name for p in named if p.name not in given)
        self._var = {p.kind: p.name for p in parameters.values() if p.kind in _VAR}
        self._signature = signature

    def as_captured(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """``(args, kwargs)`` written as the sample call was, or ``None`` where the call is
        spelled so already or binds to no parameters (it cannot be written otherwise).

        Raises :class:`~dualgraph.SpecMismatchError` naming the path of a value the call passes
        for a parameter the sample left to its default, other than that default.
        """
        if self._signature is None:
            return None
        shape = (len(args), tuple(kwargs))
        try:
            plan = self._plans[shape]
        except KeyError:
            if len(self._plans) >= 64:  # spellings of one callable: few kinds
                self._plans.clear()
            plan = self._plans[shape] = self._plan(*shape)
        if plan is None:
            return None
        positional, keywords, left_out = plan
        for slot, name, default in left_out:
            value = slot.read(args, kwargs)
            if not _same_default(value, default):
                path = slot.path or ""
                raise SpecMismatchError(
                    f"{path}: {_shown(value)}, where the sample call left {name} to its "
                    f"default {_shown(default)}: a replay runs with the sample's value; leave "
                    f"{name} out (or pass its default), or graph with {name} in the sample call",
                    path=path,
                )
        return (
            tuple(slot.read(args, kwargs) for slot in positional),
            {name: slot.read(args, kwargs) for name, slot in keywords},
        )

    def moved(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[str, str | None], ...]:
        """For each argument :meth:`as_captured` moves for this call: its path as the sample
        spelled it, and as the call does (``None``: the call leaves it to its default).

        >>> def f(x, scale=2.0):
        ...     return x
        >>> spelling = CallSpelling(f, ("x",), {"scale": 3.0})
        >>> _ = spelling.as_captured((), {"x": "x"})
        >>> spelling.moved((), {"x": "x"})
        (('args[0]', "kwargs['x']"), ("kwargs['scale']", None))
        """
        plan = self._plan_of(len(args), tuple(kwargs))
        if plan is None:
            return ()
        positional, keywords, _ = plan
        placed = [*((_path(True, i), s) for i, s in enumerate(positional))]
        placed.extend((_path(False, name), s) for name, s in keywords)
        return tuple((path, slot.path) for path, slot in placed if slot.path != path)

    def path_as_called(
        self, path: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> str | None:
        """``path``, of this call written as the sample was (:meth:`as_captured`), as the call
        spells it: ``kwargs['x'][0]`` for ``args[0][0]`` where the call passes ``x`` by keyword;
        ``None`` where the call leaves that argument to its parameter's default; ``path`` itself
        where the call does not move it.

        >>> def f(x, scale=2.0):
        ...     return x
        >>> spelling = CallSpelling(f, ((1, 2),), {"scale": 3.0})
        >>> _ = spelling.as_captured((), {"x": (1, 2), "scale": 3.0})
        >>> spelling.path_as_called("args[0][1]", (), {"x": (1, 2), "scale": 3.0})
        "kwargs['x'][1]"
        """
        for captured, called in self.moved(args, kwargs):
            if path == captured:
                return called
            if path.startswith((f"{captured}[", f"{captured}.")):
                return None if called is None else called + path[len(captured) :]
        return path

    def named_as_called(
        self,
        refused: SpecMismatchError,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        missing: SpecMismatchError | None = None,
    ) -> SpecMismatchError:
        """``refused``, an error of ``(args, kwargs)`` written as the sample call was, naming its
        path as the call spells it (``kwargs['x']`` where the sample passed ``args[0]``:
        :meth:`path_as_called`); ``missing`` (the call's own error) where that argument is one
        the call leaves to a default of its parameter, which the sample passed otherwise.

        >>> def f(x, scale=2.0):
        ...     return x
        >>> spelling = CallSpelling(f, (1,), {"scale": 3.0})
        >>> _ = spelling.as_captured((), {"x": 1.5, "scale": 3.0})
        >>> refused = SpecMismatchError("args[0]: expected int 1, got float 1.5", path="args[0]")
        >>> spelling.named_as_called(refused, (), {"x": 1.5, "scale": 3.0})
        SpecMismatchError("kwargs['x']: expected int 1, got float 1.5")
        """
        found = refused.path
        if not found:
            return refused
        called = self.path_as_called(found, args, kwargs)
        if called == found:
            return refused
        if called is None:
            return missing or refused
        text = str(refused)
        if not text.startswith(found):
            return refused
        return SpecMismatchError(called + text[len(found) :], path=called)

    def as_called(
        self,
        spelled_args: Sequence[Any],
        spelled_kwargs: Mapping[str, Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Values given for each argument of this call written as the sample was (its
        gradients, say), placed where the call ``(args, kwargs)`` passes them: the reverse of
        :meth:`as_captured`. An argument the call passes for a parameter the sample left to its
        default (passed as that default) gets ``None``; one the sample passed that the call
        leaves to its default is dropped.

        >>> def f(x, scale=2.0, mask=None):
        ...     return x
        >>> spelling = CallSpelling(f, ("x",), {"scale": 3.0})
        >>> _ = spelling.as_captured((), {"scale": 3.0, "x": "x", "mask": None})
        >>> spelling.as_called(("dx",), {"scale": None}, (), {"scale": 3.0, "x": "x", "mask": None})
        ((), {'scale': None, 'x': 'dx', 'mask': None})
        """
        plan = self._plan_of(len(args), tuple(kwargs))
        if plan is None:  # spelled as the sample
            return tuple(spelled_args), dict(spelled_kwargs)
        positional, keywords, _ = plan
        placed_args: list[Any] = [None] * len(args)
        placed_kwargs: dict[str, Any] = dict.fromkeys(kwargs)
        placed = [*zip(positional, spelled_args, strict=True)]
        placed.extend((slot, spelled_kwargs[name]) for name, slot in keywords)
        for slot, value in placed:
            if slot.kind == _Slot.ARG:
                placed_args[slot.key] = value
            elif slot.kind == _Slot.KWARG:
                placed_kwargs[slot.key] = value
        return tuple(placed_args), placed_kwargs

    def _plan_of(self, count: int, keys: tuple[str, ...]) -> _Plan | None:
        """The plan :meth:`as_captured` made for this spelling, worked out again where it has
        been dropped since (more spellings came between it and a later reader: a pullback)."""
        shape = (count, keys)
        if shape in self._plans:
            return self._plans[shape]
        return None if self._signature is None else self._plan(count, keys)

    def _plan(self, count: int, keys: tuple[str, ...]) -> _Plan | None:
        """How to write a call of ``count`` positional arguments and the keywords ``keys``."""
        signature = self._signature
        assert signature is not None
        try:
            bound = signature.bind(
                *(_Slot(_Slot.ARG, i) for i in range(count)),
                **{key: _Slot(_Slot.KWARG, key) for key in keys},
            )
        except TypeError:  # eager's call would raise: the spec's error stands
            return None
        arguments = bound.arguments
        parameters = signature.parameters

        def slot_of(name: str) -> _Slot:
            found = arguments.get(name)
            if found is None:  # left out by the call: eager's value is the default
                return _Slot(_Slot.DEFAULT, parameters[name].default)
            assert isinstance(found, _Slot)
            return found

        named = [p.name for p in parameters.values() if p.kind in _POSITIONAL]
        extra = arguments.get(self._var.get(inspect.Parameter.VAR_POSITIONAL, ""), ())
        if self._positional <= len(named):
            if extra:  # positional arguments past the sample's where it passed none
                return None
            positional = tuple(map(slot_of, named[: self._positional]))
        else:
            positional = (*map(slot_of, named), *extra)
        keywords = [(name, slot_of(name)) for name in self._keywords]
        # the keywords the function's **kwargs collects, in the call's order (which it sees)
        collected = arguments.get(self._var.get(inspect.Parameter.VAR_KEYWORD, ""), {})
        keywords.extend(collected.items())
        left_out = tuple(
            (arguments[name], name, parameters[name].default)
            for name in self._left_out
            if name in arguments
        )
        unchanged = (
            len(positional) == count
            and all(s.kind == _Slot.ARG and s.key == i for i, s in enumerate(positional))
            and [name for name, _ in keywords] == list(keys)
            and all(s.kind == _Slot.KWARG for _, s in keywords)
            and not left_out
        )
        return None if unchanged else (positional, tuple(keywords), left_out)


def _shown(value: Any) -> str:
    """``value`` for a message: as a spec shows it, with its ``repr`` where a spec holds no such
    value (``torch.float64 (an object of type torch.dtype)``)."""
    brief = brief_of(value)
    return f"{clip(value, 60)} ({brief})" if brief.startswith("an object of type") else brief


def _same_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default`` as a spec tells constants apart: the same object, or
    the same tree of constants (type and value: ``1`` is not ``True`` nor ``1.0``, ``-0.0`` is
    not ``0.0``); arrays only as the same objects."""
    if value is default:
        return True
    try:
        found, expected = describe(value), describe(default)
    except Exception:  # no constant a spec holds (an enum, a dtype): by identity only
        return False
    return found.num_arrays == 0 and found == expected
