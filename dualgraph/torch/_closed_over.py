"""Tensors a graphed function may update besides its inputs, and the ones it does update;
the modules and tensors its code names, which each call checks as a module's own.

A module's own parameters and buffers are recorded by :class:`ModuleTensors`. A function, or a
bound method, has none of its own, yet its code may name some: a closure over a BatchNorm, a
global tensor, the module of a method. Those its warmup and capture updated in place are what an
input sharing memory with one would, in eager, be read after (``GraphedCallable``); they are
put back after capture, as a module's buffers are. ``dgt.verify`` compares them too.

Its graphs read those modules' and tensors' memory, and replay their modules' training modes
and hooks, as they were at capture, and what the code computed from the plain values it reads
(a temperature in its closure, a global flag); :func:`code_tensors` records them so that each
call refuses a change (a weight moved by ``.data = ...`` or ``.half()``, ``encoder.eval()``,
``temperature = 3.0``), as a graphed module's own ``ModuleTensors`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dis
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._params import ModuleTensors, is_plain, same_bits, write_back

__all__ = [
    "ClosureUpdates",
    "class_values",
    "closed_over_tensors",
    "code_tensors",
    "code_values",
    "classes_read_once",
    "forward_values",
    "method_module",
    "methods_run",
    "modules_named_by",
    "named_by",
    "named_values",
    "plain_tensor_attributes",
]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass may have no memory of its own to read


def closed_over_tensors(
    fn: Callable[..., Any], *, parameters: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """``("closed over NAME", tensor)`` for what a graphed function may change besides its
    inputs: the tensors, and the buffers of the modules, that its own code names from its
    closure or its module's globals (and a ``functools.partial``'s arguments), once each.
    ``parameters``: the modules' parameters and plain tensor attributes too (what its backward
    may read besides buffers: frozen weights, a cache).

    What it reaches otherwise (through an object's attribute, or in the functions it calls)
    is not found.
    """
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, value in named_values(fn):
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), (f"closed over {name}", value))
        elif isinstance(value, torch.nn.Module):
            for tensor_name, tensor in _tensors_of(value, parameters):
                found.setdefault(id(tensor), (f"closed over {name}.{tensor_name}", tensor))
    return list(found.values())


def code_tensors(fn: Callable[..., Any]) -> ModuleTensors | None:
    """The modules and tensors ``fn``'s code names (as :func:`closed_over_tensors` finds them)
    and a bound method's module, recorded as a module's own are, with the plain values its code
    reads (:func:`code_values`); ``None`` where there are none.

    Named as the code names them (``closed over encoder.fc.weight``; a method's module by its
    class, ``FrozenEncoder.fc.weight``). A method's module is not called by the method, so its
    own hooks and ``forward`` are not watched; its submodules', which it calls, are.
    """
    holder = torch.nn.Module()  # hangs them together; never called
    seen: set[int] = set()
    uncalled: tuple[torch.nn.Module, ...] = ()
    owner = method_module(fn)
    if owner is not None:
        holder._modules[type(owner).__name__] = owner
        seen.add(id(owner))
        uncalled = (owner,)
    for name, value in named_values(fn):
        if id(value) in seen:
            continue
        if isinstance(value, torch.nn.Module):
            holder._modules[f"closed over {name}"] = value
            seen.add(id(value))
        elif type(value) in _PLAIN and value.layout == torch.strided:
            holder._buffers[f"closed over {name}"] = value
            seen.add(id(value))
    globals_, cells = code_values(fn)
    # and what the code it runs of those modules reads: a method's helpers it calls through
    # self, the forwards of its module's submodules, and those of the modules it names
    for module in holder._modules.values():
        if module is None:
            continue
        if module is owner:
            for function in methods_run(type(owner), fn)[1:]:  # [0]: the method itself
                found = code_values(function, owner=f"{type(owner).__name__}.{function.__name__}")
                globals_ += found[0]
                cells += found[1]
            for child in owner.children():
                found = forward_values(child)
                globals_ += found[0]
                cells += found[1]
        else:
            found = forward_values(module)
            globals_ += found[0]
            cells += found[1]
    once: dict[Any, Any] = {}  # each global and cell once, named where the code met it first
    for read in globals_:
        once.setdefault((id(read[1]), read[2]), read)
    globals_, once = list(once.values()), {}
    for cell in cells:
        once.setdefault(id(cell[1]), cell)
    cells = list(once.values())
    if not holder._modules and not holder._buffers and not globals_ and not cells:
        return None
    record = ModuleTensors.of(holder, root="", uncalled=uncalled)
    record.note_code_values(globals_, cells)
    # what the method's code and the named modules' forwards read from their classes
    classes: dict[tuple[int, str], tuple[str, type, str, Any]] = {}
    for module in holder._modules.values():
        if module is None:
            continue
        for entry in class_values(module, method=fn if module is owner else None):
            classes.setdefault((id(entry[1]), entry[2]), entry)
    record.note_class_values(list(classes.values()))
    return record


CodeValues = tuple[list[tuple[str, dict[str, Any], str, Any]], list[tuple[str, Any, Any]]]


def forward_values(module: torch.nn.Module) -> CodeValues:
    """:func:`code_values` of the ``forward`` of ``module``'s class and of each submodule's
    class, once each, named by the class: ``Tempered.forward's global TEMPERATURE``.

    >>> [name for name, *_ in forward_values(torch.nn.Linear(2, 2))[0]]  # torch's read none
    []
    """
    globals_: list[tuple[str, dict[str, Any], str, Any]] = []
    cells: list[tuple[str, Any, Any]] = []
    seen: set[int] = set()
    classes: set[type] = set()
    for submodule in module.modules():
        cls = type(submodule)
        if cls in classes:  # its code read once
            continue
        classes.add(cls)
        for function, found in _read_once("forward", cls, None, _forwards_read):
            if id(function) in seen:
                continue
            seen.add(id(function))
            globals_ += found[0]
            cells += found[1]
    return globals_, cells


def _forwards_read(cls: type, _: None) -> list[tuple[types.FunctionType, CodeValues]]:
    """Each function the ``forward`` of ``cls`` runs of its class, with its :func:`code_values`."""
    return [
        (function, code_values(function, owner=f"{cls.__name__}.{function.__name__}"))
        for function in methods_run(cls, getattr(cls, "forward", None))
    ]


#: What :func:`methods_run`, :func:`class_values` and :func:`forward_values` read of a class,
#: kept while :func:`classes_read_once` is open (a capture's setup, before any call): ``None``
#: outside, where each reads anew.
_CLASSES_READ: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "dualgraph_classes_read", default=None
)


@contextlib.contextmanager
def classes_read_once() -> Iterator[None]:
    """Within: what the functions above read of each class (its methods a forward runs, their
    globals and the class attributes they read) is read once, for every module of that class.

    For a capture's setup, where nothing runs in between that could change a class: the twelve
    blocks of a ViT read ``ViTBlock``'s (and ``Linear``'s, ``LayerNorm``'s) once, not twelve
    times each (``inspect.getattr_static`` for every attribute name the code loads).

    >>> with classes_read_once():
    ...     same = methods_run(torch.nn.Linear, torch.nn.Linear.forward)
    ...     same is methods_run(torch.nn.Linear, torch.nn.Linear.forward)
    True
    """
    token = _CLASSES_READ.set({})
    try:
        yield
    finally:
        _CLASSES_READ.reset(token)


def _read_once(what: str, cls: type, entry: Any, read: Callable[[type, Any], Any]) -> Any:
    """``read(cls, entry)``, kept for ``what`` while :func:`classes_read_once` is open (by the
    entry's id, which needs no hash; the entry kept alive with what was read, so that no other
    object takes its id meanwhile)."""
    kept = _CLASSES_READ.get()
    if kept is None:
        return read(cls, entry)
    key = (what, cls, id(entry))
    found = kept.get(key)
    if found is None:
        found = kept[key] = (entry, read(cls, entry))
    return found[1]


#: At most this many functions of a class are followed from one entry (a forward, a method).
_METHODS_FOLLOWED = 64
#: torch.nn.Module's own methods (x.float() names Module.float; .to, .apply, .state_dict): what
#: they read is the module machinery's, not the forward's computation. Not followed.
_MODULE_API = frozenset(map(id, vars(torch.nn.Module).values()))


def methods_run(cls: type, entry: Any) -> list[types.FunctionType]:
    """``entry`` (a function, or a method of ``cls``) and the functions of ``cls`` its code
    calls through ``self`` (``self._attend(x)``, a staticmethod or classmethod too) or reads
    through a property's getter (``self.factor``), and theirs: the code a forward runs of its
    own class, whose globals and class attributes it reads as its own.

    >>> class Block(torch.nn.Module):
    ...     def forward(self, x):
    ...         return self._scaled(x)
    ...     def _scaled(self, x):
    ...         return x * 2
    >>> [f.__name__ for f in methods_run(Block, Block.forward)]
    ['forward', '_scaled']
    """
    return _read_once("methods", cls, entry, _methods_run)


def _methods_run(cls: type, entry: Any) -> list[types.FunctionType]:
    found: dict[int, types.FunctionType] = {}
    pending = [entry]
    while pending and len(found) < _METHODS_FOLLOWED:
        function = pending.pop()
        while isinstance(function, functools.partial):
            function = function.func
        function = getattr(function, "__func__", function)  # a bound or static method
        if not isinstance(function, types.FunctionType) or id(function) in found:
            continue
        found[id(function)] = function
        for key in dict.fromkeys(_attributes_loaded(function.__code__)):
            value = inspect.getattr_static(cls, key, None)
            if id(value) in _MODULE_API:
                continue
            if isinstance(value, types.FunctionType | staticmethod | classmethod):
                pending.append(value)
            elif isinstance(value, property) and value.fget is not None:
                pending.append(value.fget)  # ``self.factor``: its getter runs on every read
    return list(found.values())


def class_values(
    module: torch.nn.Module, *, method: Callable[..., Any] | None = None
) -> list[tuple[str, type, str, Any]]:
    """``(name, class, key, value)`` of the plain Python values (numbers, strings, flags,
    ``None``, tuples of them) that the ``forward`` of ``module`` and of each submodule reads
    from its class, not from the instance (``self.scale`` where ``scale = 1.0`` is set in the
    class body, or on the class since): a graph holds what the forward computed from them, where
    eager reads ``getattr`` again on every call (``Block.scale = 2.0`` for every block at once).
    Once per class and name, named ``Block.scale (a class attribute)``; ``_private`` names are
    left out, as a module's own are. And the code it runs of its class, each function as
    ``getattr(cls, key)`` gives it (the ``forward``, methods and property getters it calls
    through ``self``, private ones too: patched on the class, ``Block.forward = patched``, eager
    runs the new code), named ``Block.forward (code its forward runs)``. ``method``: a graphed
    method of ``module``, whose code is read for ``module`` instead of its ``forward`` (which
    the method does not call).

    >>> class Scaled(torch.nn.Linear):
    ...     scale = 2.0
    ...     def forward(self, x):
    ...         return super().forward(x) * self.scale
    >>> [name for name, _, _, value in class_values(Scaled(2, 2))]
    ['Scaled.scale (a class attribute)', 'Scaled.forward (code its forward runs)']
    """
    found: dict[tuple[int, str], tuple[str, type, str, Any]] = {}
    read: dict[tuple[type, Any], tuple[tuple[str, Any], ...]] = {}  # per class and entry, once
    for submodule in module.modules():
        cls = type(submodule)
        entry = method if submodule is module and method is not None else cls.forward
        names = read.get((cls, entry))
        if names is None:
            names = read[cls, entry] = _read_once("class values", cls, entry, _class_values_read)
        own = (submodule.__dict__, submodule._parameters, submodule._buffers, submodule._modules)
        for key, value in names:
            if (id(cls), key) not in found and not any(key in d for d in own):
                # (an instance's own value is compared as an attribute)
                kind = "a class attribute" if is_plain(value) else "code its forward runs"
                found[id(cls), key] = (f"{cls.__name__}.{key} ({kind})", cls, key, value)
    return list(found.values())


def _class_values_read(cls: type, entry: Any) -> tuple[tuple[str, Any], ...]:
    """``(key, value)`` of the plain values of ``cls`` that the code ``entry`` runs loads, and
    of the code it runs of ``cls`` (its ``forward``, the methods and property getters it
    reaches through ``self``, private ones too), each as ``getattr(cls, key)`` gives it: a
    graph replays that code, where eager looks it up again on every call (``Block.forward =
    patched``, as attention patches do)."""
    functions = methods_run(cls, entry)
    loaded = dict.fromkeys(
        name for function in functions for name in _attributes_loaded(function.__code__)
    )
    plain: list[tuple[str, Any]] = []
    code: list[tuple[str, Any]] = []
    if entry is getattr(cls, "forward", None) and id(entry) not in _MODULE_API:
        code.append(("forward", entry))
    for key in loaded:
        static = inspect.getattr_static(cls, key, _NOT_THERE)  # once a key
        if is_plain(static):
            if not key.startswith("_"):  # private: not compared, as a module's own are not
                plain.append((key, static))
        # a classmethod is bound anew on every read: not compared
        elif key != "forward" and id(static) not in _MODULE_API and _is_code(static):
            code.append((key, getattr(cls, key)))
    return (*plain, *code)


def _is_code(value: Any) -> bool:
    """Whether ``value``, read statically off a class, is code a call through ``self`` runs."""
    return isinstance(value, types.FunctionType | staticmethod | property)


def _attributes_loaded(code: types.CodeType) -> tuple[str, ...]:
    """The attribute names ``code`` loads (``self.scale``, ``x.shape``), nested code's too, once
    each (cached with the globals: :func:`_names_loaded`)."""
    return _names_loaded(code)[1]


def code_values(fn: Callable[..., Any], *, owner: str = "") -> CodeValues:
    """What ``fn``'s own code reads that a graph holds as of capture, where it lives:
    ``(name, dict, key, value)`` of the globals it loads (its nested comprehensions' and
    lambdas' too) and of a ``functools.partial``'s keywords, and ``(name, cell, value)`` of its
    closure's cells, named ``closed over NAME`` (``owner``: ``OWNER's global NAME``, ``OWNER's
    closed over NAME``). Those holding plain Python values (numbers, strings, flags, ``None``,
    tuples of them: a graph holds what the code computed from them, ``x / temperature``),
    tensors and modules (a graph reads the memory of those of capture), where eager reads
    each name again on every call.

    >>> scale = 2.0
    >>> globals_, cells = code_values(lambda x: x * scale)  # a global here, in a doctest
    >>> [(name, value) for name, _, _, value in globals_], cells
    ([('closed over scale', 2.0)], [])
    """
    globals_: list[tuple[str, dict[str, Any], str, Any]] = []
    while isinstance(fn, functools.partial):
        globals_ += [
            (f"partial argument {key}", fn.keywords, key, value)
            for key, value in fn.keywords.items()
            if _held(value)
        ]
        fn = fn.func
    cells: list[tuple[str, Any, Any]] = []
    whose = f"{owner}'s " if owner else ""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return globals_, cells
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False):
        with contextlib.suppress(ValueError):  # a cell not filled yet
            if _held(cell.cell_contents):
                cells.append((f"{whose}closed over {name}", cell, cell.cell_contents))
    namespace = getattr(fn, "__globals__", None)
    if isinstance(namespace, dict):
        globals_ += [
            (f"{whose}global {name}" if owner else f"closed over {name}", namespace, name, value)
            for name in _globals_loaded(code)
            if (value := namespace.get(name, _NOT_THERE)) is not _NOT_THERE and _held(value)
        ]
    return globals_, cells


_NOT_THERE = object()


def _held(value: Any) -> bool:
    """Whether a graph holds ``value`` as of capture: a plain value, a tensor or a module
    (objects such as lists and configs are not compared, as a module's are not)."""
    return is_plain(value) or type(value) in _PLAIN or isinstance(value, torch.nn.Module)


def _globals_loaded(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` loads as globals (an attribute's name is no global read), once each.

    >>> _globals_loaded((lambda x: abs(x) + [len(y) for y in x][0]).__code__)
    ('abs', 'len')
    """
    return _names_loaded(code)[0]


@functools.lru_cache(maxsize=4096)
def _names_loaded(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The global names ``code`` loads, and the attribute names it and its nested code
    (comprehensions, lambdas) load, once each, from one disassembly.

    Cached by code object: a code object never changes, and disassembling one costs far more
    than the lookup: each block of a model runs the same ``forward`` code, and a capture asks
    for every submodule class's (a ViT block's three, 0.18 ms uncached on a CPU).

    >>> _names_loaded((lambda x: x.shape[0] + abs(x)).__code__)
    (('abs',), ('shape',))
    """
    globals_: dict[str, None] = {}
    attributes: dict[str, None] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globals_[instruction.argval] = None
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            attributes[instruction.argval] = None
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # a comprehension, a nested lambda
            nested_globals, nested_attributes = _names_loaded(constant)
            globals_.update(dict.fromkeys(nested_globals))
            attributes.update(dict.fromkeys(nested_attributes))
    return tuple(globals_), tuple(attributes)


def named_values(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """What ``fn``'s own code names: its closure's cells, its globals it uses, and a
    ``functools.partial``'s arguments, as ``(name, value)``."""
    named: list[tuple[str, Any]] = []
    while isinstance(fn, functools.partial):
        named += [(f"partial argument {i}", a) for i, a in enumerate(fn.args)]
        named += [(f"partial argument {k}", a) for k, a in fn.keywords.items()]
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = getattr(fn, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars, cells, strict=False):
            with contextlib.suppress(ValueError):  # a cell not filled yet
                named.append((name, cell.cell_contents))
        globals_ = getattr(fn, "__globals__", {})
        named += [(n, globals_[n]) for n in code.co_names if n in globals_]
    return named


def named_by(fn: Callable[..., Any], *, parameters: bool = False) -> list[tuple[str, torch.Tensor]]:
    """What :func:`closed_over_tensors` finds, and the buffers (``parameters``: and the
    parameters) of a bound method's module."""
    found = closed_over_tensors(fn, parameters=parameters)
    owner = method_module(fn)
    if owner is not None:
        seen = {id(tensor) for _, tensor in found}
        root = type(owner).__name__
        found += [
            (f"{root}.{name}", tensor)
            for name, tensor in _tensors_of(owner, parameters)
            if id(tensor) not in seen
        ]
    return found


def modules_named_by(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules ``fn``'s own code names (as :func:`closed_over_tensors` finds them), a bound
    method's module, and a module wrapped in ``functools.partial``, once each: what a call of
    ``fn`` may run, and so change, besides a module ``fn`` is.

    >>> layer = torch.nn.Linear(2, 2)
    >>> [type(m).__name__ for m in modules_named_by(lambda x: layer(x) * 2)]
    ['Linear']
    """
    found: dict[int, torch.nn.Module] = {}
    for _, value in named_values(fn):
        if isinstance(value, torch.nn.Module):
            found.setdefault(id(value), value)
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    owner = inner if isinstance(inner, torch.nn.Module) else method_module(fn)
    if owner is not None:
        found.setdefault(id(owner), owner)
    return list(found.values())


def method_module(fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module whose bound method ``fn`` is (through ``functools.partial``), or ``None``.

    >>> layer = torch.nn.Linear(2, 2)
    >>> method_module(functools.partial(layer.forward)) is layer, method_module(len)
    (True, None)
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _tensors_of(module: torch.nn.Module, parameters: bool) -> list[tuple[str, torch.Tensor]]:
    tensors = list(module.named_buffers())
    if not parameters:
        return tensors
    return [*module.named_parameters(), *tensors, *plain_tensor_attributes(module)]


def plain_tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of the tensors held as plain attributes (neither parameters nor
    buffers: ``self.scale = torch.ones(4)``, a cache) by ``module`` and its submodules.

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.cache = torch.zeros(2)
    >>> [name for name, _ in plain_tensor_attributes(layer)]
    ['cache']
    """
    found = []
    for prefix, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found.append((f"{prefix}.{name}" if prefix else name, value))
    return found


class ClosureUpdates:
    """The tensors a function (not a module) names that its warmup and capture updated in place.

    Shared by the replay slots of one callable; empty for a module (``ModuleTensors.updated``).
    """

    def __init__(self) -> None:
        self.updated: tuple[tuple[str, torch.Tensor], ...] = ()

    @contextlib.contextmanager
    def watching(self, fn: Callable[..., Any]) -> Iterator[None]:
        """Record what ``fn`` names, run the block, keep the tensors it changed, and put them
        back by value, whether the block succeeds or fails: graphing runs nothing in eager, so
        only the replays may update them (as a module's buffers, ``ModuleTensors.left_as_found``).
        """
        before = [
            (name, tensor, tensor._version, tensor.detach().clone())
            for name, tensor in named_by(fn)
            # a parameter is refused elsewhere if updated; a sparse tensor has no torch.equal
            if not tensor.requires_grad and tensor.layout == torch.strided
        ]
        try:
            yield
        finally:
            # By bits as well: BatchNorm's kernel writes its statistics without a version bump
            # (by value, a tensor holding NaN would be taken as updated).
            changed = [
                (name, tensor, kept)
                for name, tensor, version, kept in before
                if tensor._version != version or not same_bits(tensor, kept)
            ]
            self.updated = tuple((name, tensor) for name, tensor, _ in changed)
            for _, tensor, kept in changed:  # only those: the others hold their values
                write_back(tensor, kept)
