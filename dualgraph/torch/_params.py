"""The parameters and buffers of a graphed module: as the graphs read them, checked per call.

A graph reads each parameter and buffer at the address it had at capture, its backward computes
grads for the parameters that required grad then, and it replays the training mode each
submodule had then. :class:`ModuleTensors` records that and :meth:`ModuleTensors.check` refuses
a call, naming the tensor or submodule, when the module no longer matches: a parameter or buffer
replaced (``module.weight = nn.Parameter(...)``), moved or re-allocated (``.to()``, ``.half()``,
``param.data = ...``) or read with other strides (``param.data = view``), one that was ``None``
at capture given a tensor (a bias the graphs never add), a parameter, buffer or submodule added
(``layers.append(...)``: the graphs never read it), a public attribute added to a module's
``__dict__`` or deleted from it (``module.temperature = 2.0`` where the forward reads
``getattr(self, "temperature", 1.0)``), a parameter frozen or unfrozen, a submodule replaced
(``module.fc = nn.Linear(...)``, whose tensors the graphs never read), or a submodule put in
another training mode than the module itself (``module.dropout.eval()``: the graphs would replay
the captured dropout; a whole module in another mode runs eagerly, see ``_modules.py``), or a
submodule given or relieved of a forward or backward hook, or one swapped for another function
(the graphs replay the hooks a submodule had at capture: one registered since would never run,
one removed would still act; so for torch's global module hooks, which run on the submodules'
calls too), or a submodule given another forward (an instance-level
``forward``, as accelerate's hooks set, or another class): the graphs replay the kernels of the
forward they captured; or a global the forwards' own code reads (a flag, a temperature) set to
another value since. A submodule graphed itself after its parent keeps running inside the
parent's replay as captured, so dualgraph's own ``forward`` is not a change.

At capture, :meth:`ModuleTensors.left_as_found` undoes what warmup does to buffers (BatchNorm's
running statistics are updated on every warmup call, as if those calls had been steps), and
:func:`suspended_tensor_hooks` keeps parameter hooks out of the captured backward, so that they
run once per replay, through autograd, as in eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import DualgraphError
from ._grad_checks import own_hooks
from ._layout_checks import Layouts
from ._module_check import fast_check
from ._transformer_engine import set_by_te_forward

__all__ = [
    "FUSED_ACCUMULATION_FLAGS",
    "GRAPHED_STATE",
    "ModuleTensors",
    "bits_view",
    "bytes_now",
    "bytes_of",
    "same_bits",
    "same_bytes",
    "first_difference",
    "grad_buffer_like",
    "is_plain",
    "is_tensor_subclass",
    "own_changes_taken_of",
    "requires_grad_changed",
    "suspended_tensor_hooks",
    "set_versions",
    "write_back",
]

_getitem = operator.getitem
_get = dict.get
_is_not = operator.is_not
_NONES = itertools.repeat(None)
_FORWARD = itertools.repeat("forward")
_NO_ROOT = type(None)  # the class of a record without a root (root None)
#: Where ``_modules.py`` keeps a graphed module's state in its ``__dict__``.
GRAPHED_STATE = "_dualgraph_graphed"
_is = operator.is_
_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_shape = operator.attrgetter("shape")
_requires_grad = operator.attrgetter("requires_grad")
_training = operator.attrgetter("training")
_version = operator.attrgetter("_version")
_cell_contents = operator.attrgetter("cell_contents")
# A module's hook dicts, by the kind of hook each holds, with the dicts of flags (keyed by the
# same handle ids) that change how a hook of that kind is called.
_HOOK_KINDS = {
    "_forward_pre_hooks": ("forward pre-hook", ("_forward_pre_hooks_with_kwargs",)),
    "_forward_hooks": (
        "forward hook",
        ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    ),
    "_backward_pre_hooks": ("backward pre-hook", ()),
    "_backward_hooks": ("backward hook", ()),
}
#: The hooks ``torch.nn.modules.module.register_module_*_hook`` puts on every module, by the
#: function that registers them, with their flag dicts: each submodule's call runs them, so the
#: graphs replay what they did at capture, as for a submodule's own.
_GLOBAL_HOOK_KINDS = {
    "_global_forward_pre_hooks": ("forward pre-hook", "register_module_forward_pre_hook", ()),
    "_global_forward_hooks": (
        "forward hook",
        "register_module_forward_hook",
        ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called"),
    ),
    "_global_backward_pre_hooks": (
        "backward pre-hook",
        "register_module_full_backward_pre_hook",
        (),
    ),
    "_global_backward_hooks": ("backward hook", "register_module_full_backward_hook", ()),
}
#: What a hook dict holds, as the module calls it: its hooks in order, and each flag per hook.
Hooks = tuple[tuple[Any, ...], tuple[tuple[bool, ...], ...]]


def _hooks_held(hooks: dict[Any, Any], flags: tuple[dict[Any, Any], ...]) -> Hooks:
    if not hooks:  # most hook dicts of most modules (four a module): nothing to iterate
        return (), ((),) * len(flags)
    return tuple(hooks.values()), tuple(tuple(key in flag for key in hooks) for flag in flags)


def _same_hooks(now: Hooks, then: Hooks) -> bool:
    """The same hook functions (by identity: another function under the same handle id acts
    differently), in the same order, with the same flags."""
    return len(now[0]) == len(then[0]) and all(map(_is, now[0], then[0])) and now[1] == then[1]


def _hook_change(now: Hooks, then: Hooks) -> str:
    """What became of a hook dict's hooks since capture (``now`` unlike ``then``), for a message.

    >>> _hook_change(((print, len), ((),)), ((print,), ((),)))
    'registered'
    """
    count, was = len(now[0]), len(then[0])
    return "registered" if count > was else "removed" if count < was else "replaced"


def _acting_global_hooks(hooks: dict[Any, Any], flags: tuple[dict[Any, Any], ...]) -> Hooks:
    """:func:`_hooks_held` of a global hook dict, less the hooks of torch's and dualgraph's own
    observers (``torch.utils.module_tracker``'s, which ``FlopCounterMode`` registers while it
    counts; dualgraph's Transformer Engine observer during a capture): they only record which
    module runs, so a replay's results are eager's with them or without."""
    kept = [key for key, hook in hooks.items() if not _an_observer(hook)]
    return (
        tuple(hooks[key] for key in kept),
        tuple(tuple(key in flag for key in kept) for flag in flags),
    )


def _an_observer(hook: Any) -> bool:
    home = getattr(hook, "__module__", None)
    return isinstance(home, str) and home.startswith(("torch.", "dualgraph."))


@dataclass(frozen=True, eq=False)
class ModuleTensors:
    """Every parameter and buffer of a module, where it lives, and what the graphs captured.

    One entry per ``(submodule, name)``, so a tensor shared by two submodules (tied weights) is
    checked in both places.

    >>> layer = torch.nn.Linear(2, 2)
    >>> tensors = ModuleTensors.of(layer)
    >>> tensors.names
    ('Linear.weight', 'Linear.bias')
    >>> tensors.check(grad_enabled=True)  # nothing changed
    >>> layer.bias = torch.nn.Parameter(torch.zeros(2))
    >>> tensors.check(grad_enabled=True)
    Traceback (most recent call last):
    ...
    dualgraph.DualgraphError: Linear.bias: the parameter was replaced after capture ...
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    >>> tensors = ModuleTensors.of(net)
    >>> net[1].eval()  # doctest: +ELLIPSIS
    Dropout(...)
    >>> tensors.check(grad_enabled=True)
    Traceback (most recent call last):
    ...
    dualgraph.DualgraphError: Sequential.1: training was True at capture and is False now; ...
    """

    names: tuple[str, ...]
    owners: tuple[dict[str, Any], ...]  # the submodule's _parameters or _buffers dict
    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    data_ptrs: tuple[int, ...]
    requires_grad: tuple[bool, ...]
    is_buffer: tuple[bool, ...]
    # The layout the captured kernels read the memory with (same address, other strides: a
    # transposed ``.data``, ``as_strided_``).
    strides: tuple[tuple[int, ...], ...] = ()
    shapes: tuple[torch.Size, ...] = ()
    # The entries that were None at capture (a Linear without bias, BatchNorm's statistics
    # when it tracks none, a submodule registered as None): the graphs never read them, so a
    # tensor or module set there since is refused. Each one's kind names it in the message.
    absent_names: tuple[str, ...] = ()
    absent_owners: tuple[dict[str, Any], ...] = ()
    absent_keys: tuple[str, ...] = ()
    absent_kinds: tuple[str, ...] = ()
    # The tensors whose requires_grad each call checks: those frozen at capture (usually none).
    # A trainable parameter frozen since is found by the backward replay, which looks at the
    # trainable parameters anyway (as its Function's inputs, or for their hooks).
    watched: tuple[torch.Tensor, ...] = ()
    watched_requires_grad: tuple[bool, ...] = ()
    # Every submodule below the root, where it hangs (its parent's _modules dict and key), and
    # its training mode at capture (the root's own mode decides between replay and eager).
    module_names: tuple[str, ...] = ()
    module_owners: tuple[dict[str, Any], ...] = ()
    module_keys: tuple[str, ...] = ()
    modules: tuple[torch.nn.Module, ...] = ()
    training: tuple[bool, ...] = ()
    # Each submodule's __dict__, the instance-level forward it held at capture (usually None)
    # and its class: what its forward is.
    module_dicts: tuple[dict[str, Any], ...] = ()
    forwards: tuple[Any, ...] = ()
    classes: tuple[type, ...] = ()
    # Every submodule's forward and backward hook dicts (the root's run around the replay, so
    # they are not among them), their flag dicts, and the hooks each held at capture.
    hook_names: tuple[str, ...] = ()
    hook_dicts: tuple[dict[Any, Any], ...] = ()
    hook_flags: tuple[tuple[dict[Any, Any], ...], ...] = ()
    hooks_at_capture: tuple[Hooks, ...] = ()
    # Per call: the dicts empty at capture must be empty still (one any()); the few that held
    # hooks are compared hook by hook.
    unhooked_dicts: tuple[dict[Any, Any], ...] = ()
    hooked: tuple[int, ...] = ()  # indices into hook_dicts
    # torch.nn.modules.module's global hook dicts (every submodule's call runs them; none where
    # no submodule is called), with their flag dicts and the acting hooks each held at capture.
    global_hook_names: tuple[str, ...] = ()
    global_hook_dicts: tuple[dict[Any, Any], ...] = ()
    global_hook_flags: tuple[tuple[dict[Any, Any], ...], ...] = ()
    global_hooks_at_capture: tuple[Hooks, ...] = ()
    # The buffers the callable updates in place (BatchNorm's statistics), found by warmup and
    # capture (left_as_found): an input sharing memory with one is read, in eager, after the
    # update, where a replay reads the copy made before it.
    updated: tuple[int, ...] = ()  # indices into tensors
    # What check compares on every call, fused (built once, in __post_init__): the dicts and
    # keys looked up by index and by get, what they must hold (by identity), and the values
    # (submodules' classes and modes, tensors' addresses, strides and shapes, watched tensors'
    # requires_grad) read now must equal.
    _indexed: tuple[tuple[dict[str, Any], ...], tuple[str, ...]] = field(
        init=False, repr=False, default=((), ())
    )
    _got: tuple[tuple[dict[str, Any], ...], tuple[str, ...]] = field(
        init=False, repr=False, default=((), ())
    )
    _identical: tuple[Any, ...] = field(init=False, repr=False, default=())
    _values: tuple[Any, ...] = field(init=False, repr=False, default=())
    _layouts: Layouts = field(init=False, repr=False, default=None)  # type: ignore[assignment]
    # The same comparisons as one chain of tests (_module_check.py), made at the first check
    # after the record last changed (_set), as the record's fields are complete only then.
    _passes: Callable[[], bool] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        # Each fused comparison implies the one of _check_all it stands for: identity for
        # objects (tensors, submodules, forwards, None for the absent entries), equality for
        # values as _check_all compares them (classes and modes, which a tuple compares by
        # identity first, layouts, flags). A call that passes them passes _check_all: the usual
        # call, in one pass over the objects and one over the values. Anything else (dualgraph's
        # own forward on a submodule graphed after its parent, a watched tensor's requires_grad
        # changed outside grad mode, which only grad mode refuses) goes to _check_all, which
        # decides as before.
        fill = object.__setattr__
        fill(
            self, "_indexed", ((*self.owners, *self.module_owners), (*self.keys, *self.module_keys))
        )
        fill(
            self,
            "_got",
            (
                (*self.module_dicts, *self.absent_owners),
                (*("forward",) * len(self.module_dicts), *self.absent_keys),
            ),
        )
        fill(
            self,
            "_identical",
            (*self.tensors, *self.modules, *self.forwards, *(None,) * len(self.absent_keys)),
        )
        fill(
            self,
            "_values",
            (
                *self.classes,
                *self.training,
                *self.data_ptrs,
                *self.watched_requires_grad,
            ),
        )
        # and the tensors' sizes and strides, in one C call (_layout_checks.py)
        fill(self, "_layouts", Layouts(self.tensors, self.shapes, self.strides))

    # The plain Python numbers, strings and flags of each submodule (dropout's p, BatchNorm's
    # momentum and eps, a block's own scale) as capture left them: the graphs hold what the
    # forward computed from them then. Found at the end of capture (left_as_found), so that
    # what the forward itself changes (a counter) is taken as it ends.
    root: Any = None  # the module itself, and what names start with
    root_name: str = ""
    # The root's class at capture: a graphed module's forward replays the forward of that class,
    # where eager runs the new one's (``__class__`` set, a parametrization of its own tensor).
    root_class: type = _NO_ROOT
    # The same values at setup, before warmup: one dict per module (root first).
    attributes_at_setup: tuple[dict[str, Any], ...] = ()
    #: the public plain values hung on each parameter and buffer (``weight.gain``) at setup
    tensor_attributes_at_setup: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    attribute_names: tuple[str, ...] = ()
    attribute_dicts: tuple[dict[str, Any], ...] = ()
    attribute_keys: tuple[str, ...] = ()
    attribute_values: list[Any] = dataclasses.field(default_factory=list)
    # Host-resident tensors (``_host_state.py``: off the graphs' device, usually none), found at
    # the end of capture: what the graphs hold is what the host read from them then. Where each
    # hangs, the tensor, and its version, address, layout and bytes then.
    host_names: tuple[str, ...] = ()
    host_dicts: tuple[dict[str, Any], ...] = ()
    host_keys: tuple[str, ...] = ()
    host_tensors: tuple[torch.Tensor, ...] = ()
    host_versions: list[int] = dataclasses.field(default_factory=list)
    host_ptrs: tuple[int, ...] = ()
    host_layouts: tuple[tuple[torch.Size, tuple[int, ...]], ...] = ()
    host_bytes: tuple[torch.Tensor, ...] = ()
    host_device: Any = None  # the graphs' device, for the message
    # Every module's _parameters, _buffers and _modules (root first), their owner's name, and
    # the keys each held at the end of capture (record_attributes): a key added since (a layer
    # appended to a ModuleList, a parameter or buffer registered) is one the graphs never read.
    # The recorded keys are all still there with their tensors (the checks above), so an equal
    # count per dict means no key was added.
    member_names: tuple[str, ...] = ()
    member_kinds: tuple[str, ...] = ()
    member_dicts: tuple[dict[str, Any], ...] = ()
    member_keys: tuple[frozenset[str], ...] = ()
    member_counts: tuple[int, ...] = ()
    # Every module's __dict__ (root first, a method's module too: its code reads them), its
    # name, the public attributes it held at the end of capture (what the forward added in
    # warmup and capture is the captured state) and those an addition of is no change
    # (dualgraph's own forward, TE's flags). Per call: one len per dict, fused with the
    # members' (counted_*); only where a count differs are the names compared.
    namespace_names: tuple[str, ...] = ()
    namespaces: tuple[dict[str, Any], ...] = ()
    namespace_keys: list[frozenset[str]] = dataclasses.field(default_factory=list)
    namespace_exempt: tuple[frozenset[str], ...] = ()
    counted_dicts: tuple[dict[str, Any], ...] = ()
    counted_lens: list[int] = dataclasses.field(default_factory=list)
    # Per module __dict__ (by id), the names the callable looked up and did not find during
    # warmup and capture (getattr(self, "mask", None), hasattr: _missed_attributes.py): one
    # added since, of any kind (a tensor too), is what eager's forward would read.
    looked_up_absent: dict[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    # What the code itself reads (note_code_values: a graphed function's globals, partial
    # keywords and closure cells; the globals a module's forwards load) that the graphs hold as
    # of capture: plain values, tensors, modules, at setup, before warmup. record_attributes
    # keeps those capture left as they were: the globals and keywords after the modules'
    # attributes (from code_from on), the cells below, compared per call as attributes are.
    code_globals: tuple[tuple[str, dict[str, Any], str, Any], ...] = ()
    code_cells: tuple[tuple[str, Any, Any], ...] = ()
    code_from: int = 0
    cell_names: tuple[str, ...] = ()
    cells: tuple[Any, ...] = ()
    cell_values: list[Any] = dataclasses.field(default_factory=list)
    # What the forwards read from their modules' classes (_closed_over.class_values: a
    # ``scale = 1.0`` of the class body, set on the class since), at setup; record_attributes
    # keeps those capture left as they were, compared per call by getattr on the class (a value
    # set on a subclass since shadows the base class's).
    code_classes: tuple[tuple[str, type, str, Any], ...] = ()
    class_names: tuple[str, ...] = ()
    class_owners: tuple[type, ...] = ()
    class_keys: tuple[str, ...] = ()
    class_values: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def of(
        cls,
        module: torch.nn.Module,
        *,
        root: str | None = None,
        uncalled: tuple[torch.nn.Module, ...] = (),
    ) -> ModuleTensors:
        """Record the parameters and buffers of ``module`` as they are now.

        ``root``: what names start with (its class name unless given; ``""``: nothing).
        ``uncalled``: submodules the callable never calls, only runs code of (the module of a
        graphed method): their own hooks and instance-level ``forward`` are not watched.
        """
        root = type(module).__name__ if root is None else root
        entries: list[tuple[str, dict[str, Any], str, torch.Tensor, bool]] = []
        absent: list[tuple[str, dict[str, Any], str, str]] = []
        walked = list(module.named_modules())  # one walk for all three passes below
        for prefix, submodule in walked:
            for is_buffer, owner in ((False, submodule._parameters), (True, submodule._buffers)):
                for key, tensor in owner.items():
                    name = _joined(root, prefix, key)
                    if tensor is not None:
                        entries.append((name, owner, key, tensor, is_buffer))
                    else:
                        absent.append((name, owner, key, "buffer" if is_buffer else "parameter"))
        tensors = tuple(entry[3] for entry in entries)
        watched = tuple(dict.fromkeys(t for t in tensors if not t.requires_grad))
        hung: list[tuple[str, dict[str, Any], str, torch.nn.Module]] = []
        for prefix, parent in walked:
            for key, child in parent._modules.items():
                name = _joined(root, prefix, key)
                if child is not None:
                    hung.append((name, parent._modules, key, child))
                else:
                    absent.append((name, parent._modules, key, "submodule"))
        modules = tuple(entry[3] for entry in hung)
        hooked: list[tuple[str, str, dict[Any, Any], tuple[dict[Any, Any], ...]]] = []
        for prefix, submodule in walked:
            if not prefix or any(submodule is other for other in uncalled):
                continue
            name = _joined(root, prefix)  # once for its four kinds of hooks
            for attribute, (kind, flags) in _HOOK_KINDS.items():
                held = tuple([getattr(submodule, flag, {}) for flag in flags])
                hooked.append((name, kind, getattr(submodule, attribute), held))
        table = vars(torch.nn.modules.module)
        global_hooks = [
            (
                f"{root or 'the modules it calls'}: a global {kind} "
                f"(torch.nn.modules.module.{register}",
                table[attribute],
                tuple(table[flag] for flag in flags),
            )
            for attribute, (kind, register, flags) in _GLOBAL_HOOK_KINDS.items()
            # submodules are called, and each call runs the global hooks too
            if hooked
            and isinstance(table.get(attribute), dict)
            and all(isinstance(table.get(flag), dict) for flag in flags)
        ]
        # An uncalled module's forward is never read: an empty namespace of its own stands in.
        namespaces = tuple(
            {} if any(child is other for other in uncalled) else child.__dict__ for child in modules
        )
        hook_dicts = tuple(entry[2] for entry in hooked)
        hook_flags = tuple(entry[3] for entry in hooked)
        return cls(
            names=tuple(entry[0] for entry in entries),
            owners=tuple(entry[1] for entry in entries),
            keys=tuple(entry[2] for entry in entries),
            tensors=tensors,
            data_ptrs=tuple(map(_data_ptr, tensors)),
            requires_grad=tuple(map(_requires_grad, tensors)),
            is_buffer=tuple(entry[4] for entry in entries),
            strides=tuple(map(_stride, tensors)),
            shapes=tuple(map(_shape, tensors)),
            absent_names=tuple(entry[0] for entry in absent),
            absent_owners=tuple(entry[1] for entry in absent),
            absent_keys=tuple(entry[2] for entry in absent),
            absent_kinds=tuple(entry[3] for entry in absent),
            watched=watched,
            watched_requires_grad=tuple(map(_requires_grad, watched)),
            module_names=tuple(entry[0] for entry in hung),
            module_owners=tuple(entry[1] for entry in hung),
            module_keys=tuple(entry[2] for entry in hung),
            modules=modules,
            training=tuple(map(_training, modules)),
            module_dicts=namespaces,
            forwards=tuple(namespace.get("forward") for namespace in namespaces),
            classes=tuple(map(type, modules)),
            hook_names=tuple(f"{name}: {kind}" if kind else name for name, kind, _, _ in hooked),
            hook_dicts=hook_dicts,
            hook_flags=hook_flags,
            hooks_at_capture=tuple(map(_hooks_held, hook_dicts, hook_flags)),
            unhooked_dicts=tuple(hooks for hooks in hook_dicts if not hooks),
            hooked=tuple(i for i, hooks in enumerate(hook_dicts) if hooks),
            global_hook_names=tuple(entry[0] for entry in global_hooks),
            global_hook_dicts=tuple(entry[1] for entry in global_hooks),
            global_hook_flags=tuple(entry[2] for entry in global_hooks),
            global_hooks_at_capture=tuple(
                _acting_global_hooks(hooks, flags) for _, hooks, flags in global_hooks
            ),
            root=module,
            root_name=root,
            root_class=type(module),
            attributes_at_setup=tuple(
                {
                    key: value
                    for key, value in vars(m).items()
                    # most of a module's own keys are private: not watched, no call to ask
                    if key[:1] != "_" and _watched(key, value)
                }
                for m in (module, *modules)
            ),
            tensor_attributes_at_setup={
                id(tensor): dict(vars(tensor))
                for m in (module, *modules)
                for tensor in _held_by(m)
                if vars(tensor)  # most hold none: no dict made
            },
        )

    def _set(self, name: str, value: Any) -> None:
        """Set a field after construction (the record is frozen to its users); the chain of
        tests is made again at the next check."""
        object.__setattr__(self, name, value)
        object.__setattr__(self, "_passes", None)

    def check(self, *, grad_enabled: bool) -> None:
        """Raise :class:`DualgraphError` naming the first tensor the graphs would misread.

        ``requires_grad`` only matters under grad mode: without it no grad is computed anyway.
        """
        passes = self._passes
        if passes is None:
            passes = fast_check(self, _ABSENT)
            object.__setattr__(self, "_passes", passes)
        try:
            # each comparison of _check_all implied by one test (__post_init__), in one chain
            if passes():
                return
        except (KeyError, ValueError):  # ValueError: a closure's cell emptied (del name)
            raise self._explain(grad_enabled) from None
        self._check_all(grad_enabled)

    def _check_all(self, grad_enabled: bool) -> None:
        """:meth:`check`, each comparison on its own (where the fused one found a difference)."""
        try:
            current = tuple(map(_getitem, self.owners, self.keys))
            hung = tuple(map(_getitem, self.module_owners, self.module_keys))
        except KeyError:
            raise self._explain(grad_enabled) from None
        if (
            type(self.root) is not self.root_class
            or not all(map(_is, current, self.tensors))
            or not all(map(_is, hung, self.modules))
            or tuple(map(_training, self.modules)) != self.training
            or tuple(map(type, self.modules)) != self.classes
            or (
                not all(map(_is, map(_get, self.module_dicts, _FORWARD), self.forwards))
                and self._forward_replaced() is not None
            )
            or any(self.unhooked_dicts)  # usually all of them: none then, none now
            or (self.hooked and not self._same_hooks_where_hooked())
            or not self._same_global_hooks()
            or tuple(map(_data_ptr, self.tensors)) != self.data_ptrs
            or tuple(map(_stride, self.tensors)) != self.strides
            or tuple(map(_shape, self.tensors)) != self.shapes
            or (
                self.absent_keys
                and any(map(_is_not, map(_get, self.absent_owners, self.absent_keys), _NONES))
            )
            or (
                grad_enabled
                and tuple(map(_requires_grad, self.watched)) != self.watched_requires_grad
            )
            or (self.attribute_keys and self._attribute_changed() is not None)
            or (self.cells and self._cell_changed() is not None)
            or (self.class_keys and self._class_value_changed() is not None)
            or (self.host_tensors and self._host_changed() is not None)
            or (
                (counts := list(map(len, self.counted_dicts))) != self.counted_lens
                and (
                    tuple(map(len, self.member_dicts)) != self.member_counts
                    or self._namespace_changed(counts) is not None
                )
            )
        ):
            raise self._explain(grad_enabled)

    def record_host_tensors(
        self,
        hung: Sequence[tuple[str, torch.Tensor, dict[str, Any], str]],
        device: torch.device,
    ) -> None:
        """Note the host-resident tensors ``(name, tensor, dict, key)`` as they are now (the end
        of capture): each call refuses one changed since (``_host_state.py``)."""
        tensors = tuple(entry[1] for entry in hung)
        self._set("host_names", tuple(entry[0] for entry in hung))
        self._set("host_dicts", tuple(entry[2] for entry in hung))
        self._set("host_keys", tuple(entry[3] for entry in hung))
        self._set("host_tensors", tensors)
        self._set("host_ptrs", tuple(map(_data_ptr, tensors)))
        self._set("host_layouts", tuple((t.shape, t.stride()) for t in tensors))
        self._set("host_bytes", tuple(map(bytes_of, tensors)))
        self._set("host_device", device)
        self.host_versions[:] = map(_version, tensors)

    def _host_unchanged(self) -> bool:
        """Whether every host-resident tensor hangs where it did, at its address, with the
        version of capture (one pass each: usually there are none)."""
        tensors = self.host_tensors
        return (
            all(map(_is, map(_get, self.host_dicts, self.host_keys), tensors))
            and list(map(_version, tensors)) == self.host_versions
            and tuple(map(_data_ptr, tensors)) == self.host_ptrs
        )

    def _host_changed(self) -> int | None:
        """The index of the first host-resident tensor changed since capture (``None``).

        One written with its own values again (a version bump, the same bytes and layout) is no
        change: its new version is taken, so that the next call passes in one pass again.
        """
        if self._host_unchanged():
            return None
        for i, (namespace, key, tensor) in enumerate(
            zip(self.host_dicts, self.host_keys, self.host_tensors, strict=True)
        ):
            if namespace.get(key) is not tensor or tensor.data_ptr() != self.host_ptrs[i]:
                return i
            if tensor._version == self.host_versions[i]:
                continue
            if (tensor.shape, tensor.stride()) != self.host_layouts[i] or not same_bytes(
                bytes_of(tensor), self.host_bytes[i]
            ):
                return i
            self.host_versions[i] = tensor._version
        return None

    def _attribute_changed(self) -> int | None:
        """The index of the first attribute whose value is not the one of capture (``None``)."""
        now = list(map(_get, self.attribute_dicts, self.attribute_keys, _ABSENTS))
        return _first_changed(now, self.attribute_values)

    def _cell_changed(self) -> int | None:
        """The index of the first closure cell whose value is not the one of capture
        (``None``)."""
        return _first_changed(list(map(_contents_or_absent, self.cells)), self.cell_values)

    def _class_value_changed(self) -> int | None:
        """The index of the first class attribute whose value is not the one of capture
        (``None``)."""
        now = list(map(getattr, self.class_owners, self.class_keys, _ABSENTS))
        return _first_changed(now, self.class_values)

    @contextlib.contextmanager
    def own_changes_taken(self) -> Iterator[None]:
        """Run the callable's Python (an eager call, an emulated replay) taking the values it
        sets (a counter) as the recorded ones; what the caller had changed before stays."""
        keys, cells = self.attribute_keys, self.cells
        if not keys and not cells:
            with self._own_keys_taken():
                yield
            return
        dicts = self.attribute_dicts
        before = list(map(_get, dicts, keys, _ABSENTS))
        cells_before = list(map(_contents_or_absent, cells))
        try:
            with self._own_keys_taken():
                yield
        finally:
            _take_own(list(map(_get, dicts, keys, _ABSENTS)), before, self.attribute_values)
            _take_own(list(map(_contents_or_absent, cells)), cells_before, self.cell_values)

    @contextlib.contextmanager
    def _own_keys_taken(self) -> Iterator[None]:
        """Take the public attributes the callable's Python adds or deletes (a cache set on
        its first eval call) as those of capture, in each ``__dict__`` whose count was capture's
        before it ran (where the caller had added one already, that stays refused)."""
        namespaces = self.namespaces
        counts = list(map(len, self.counted_dicts))  # the members', then the namespaces'
        if counts != self.counted_lens:
            self._namespace_changed(counts)  # takes what is no change (dualgraph's own forward)
        start = len(self.member_dicts)
        before = counts[start:]
        try:
            yield
        finally:
            after = list(map(len, namespaces))
            if after != before:
                lens = self.counted_lens
                looked_up = self.looked_up_absent
                for i, namespace in enumerate(namespaces):
                    if after[i] != before[i] and before[i] == lens[start + i]:
                        self.namespace_keys[i] = _public_keys(namespace, self.namespace_exempt[i])
                        lens[start + i] = after[i]
                        if id(namespace) in looked_up:  # now set by the forward itself
                            looked_up[id(namespace)] = looked_up[id(namespace)].difference(
                                namespace
                            )

    def _namespace_changed(self, counts: Sequence[int]) -> tuple[int, str, str] | None:
        """The first public attribute added to or deleted from a module's ``__dict__`` since
        capture, as ``(namespace index, attribute, how)`` (``None``), ``how`` one of ``"added"``,
        ``"looked up"`` (added, and the forward looked it up in vain at capture) and
        ``"deleted"``.

        An addition is one of a plain value (:func:`is_plain`: what a forward computes with on
        the host), or of anything under a name the forward looked up and did not find at
        capture. Only the dicts whose count differs are looked at; where none of theirs is (a
        private attribute, an object, a tensor a hook of the graphed module keeps, as its hooks
        run around each replay, dualgraph's own ``forward``), the new count is taken, so that
        the next call passes in one pass again. ``counts``: the ``len`` of each of
        ``counted_dicts``, as the caller read them to find a count changed.
        """
        start = len(self.member_dicts)
        lens = self.counted_lens
        for i, namespace in enumerate(self.namespaces):
            count = counts[start + i]
            if count == lens[start + i]:
                continue
            keys, exempt = self.namespace_keys[i], self.namespace_exempt[i]
            looked_up = self.looked_up_absent.get(id(namespace), _NO_NAMES)
            for key, value in namespace.items():
                if key in keys or key in exempt:
                    continue
                if _added_plain(key, value):
                    return i, key, "added"
                if key in looked_up:
                    return i, key, "looked up"
            for key in keys:
                if key not in namespace:
                    return i, key, "deleted"
            self.namespace_keys[i] = keys | {
                key for key in namespace if key not in exempt and _added_plain(key, namespace[key])
            }
            lens[start + i] = count
        return None

    def note_code_values(
        self,
        globals_: Sequence[tuple[str, dict[str, Any], str, Any]],
        cells: Sequence[tuple[str, Any, Any]],
    ) -> None:
        """Note, at setup, a graphed function's own plain values (``_closed_over.code_values``):
        where they live and their values now; :meth:`record_attributes` keeps those that
        capture left as they were."""
        self._set("code_globals", tuple(globals_))
        self._set("code_cells", tuple(cells))

    def note_class_values(self, found: Sequence[tuple[str, type, str, Any]]) -> None:
        """Note, at setup, the values the forwards read from their classes
        (``_closed_over.class_values``); :meth:`record_attributes` keeps those that capture
        left as they were."""
        self._set("code_classes", tuple(found))

    def note_looked_up(self, missed: dict[int, set[str]]) -> None:
        """Keep, per module, the names the callable looked up and did not find during warmup
        and capture (``_missed_attributes.py``) that are still absent (not set lazily since)."""
        for module in (self.root, *self.modules):
            if module is None:
                continue
            namespace = module.__dict__
            names = missed.get(id(namespace))
            if names:
                self.looked_up_absent[id(namespace)] = frozenset(names.difference(namespace))

    def record_attributes(self) -> None:
        """Note every submodule's public plain Python values as they are now (the end of
        capture), but those warmup and capture changed: the forward's own (a counter), which
        its Python, run again eagerly, may change again."""
        before = self.attributes_at_setup
        found = [
            (_joined(name, key), module.__dict__, key, value)
            for name, module, then in zip(
                (self.root_name, *self.module_names),
                (self.root, *self.modules),
                before or itertools.repeat({}),
                strict=False,
            )
            if module is not None
            # TE's forward sets these before reading them: asked once a module
            for te_flags in (set_by_te_forward(module),)
            for key, value in module.__dict__.items()
            if _watched(key, value)
            and (not before or then.get(key, _ABSENT) is value)
            and key not in te_flags
        ]
        found += self._code_shadowed()
        found += self._tensor_attributes()
        self._set("code_from", len(found))
        found += [  # a function's own: those its warmup and capture did not rebind
            (name, namespace, key, then)
            for name, namespace, key, then in self.code_globals
            if namespace.get(key, _ABSENT) is then
        ]
        cells = [
            (name, cell, then)
            for name, cell, then in self.code_cells
            if _contents_or_absent(cell) is then
        ]
        classes = [  # those warmup and capture did not set (the forward's own)
            (name, owner, key, then)
            for name, owner, key, then in self.code_classes
            if getattr(owner, key, _ABSENT) is then
        ]
        self._set("class_names", tuple(entry[0] for entry in classes))
        self._set("class_owners", tuple(entry[1] for entry in classes))
        self._set("class_keys", tuple(entry[2] for entry in classes))
        self.class_values[:] = [entry[3] for entry in classes]
        self._set("cell_names", tuple(entry[0] for entry in cells))
        self._set("cells", tuple(entry[1] for entry in cells))
        self.cell_values[:] = [entry[2] for entry in cells]
        self._set("attribute_names", tuple(entry[0] for entry in found))
        self._set("attribute_dicts", tuple(entry[1] for entry in found))
        self._set("attribute_keys", tuple(entry[2] for entry in found))
        self.attribute_values[:] = [entry[3] for entry in found]
        members = [
            (name, kind, getattr(module, attribute))
            for name, module in zip(
                (self.root_name, *self.module_names), (self.root, *self.modules), strict=True
            )
            if module is not None
            for attribute, kind in _MEMBER_KINDS.items()
        ]
        self._set("member_names", tuple(entry[0] for entry in members))
        self._set("member_kinds", tuple(entry[1] for entry in members))
        self._set("member_dicts", tuple(entry[2] for entry in members))
        self._set("member_keys", tuple(frozenset(entry[2]) for entry in members))
        self._set("member_counts", tuple(len(entry[2]) for entry in members))
        named = [
            (name, module.__dict__, set_by_te_forward(module) | _NOT_ADDED)
            for name, module in zip(
                (self.root_name, *self.module_names), (self.root, *self.modules), strict=True
            )
            if module is not None
        ]
        namespaces = tuple(entry[1] for entry in named)
        self._set("namespace_names", tuple(entry[0] for entry in named))
        self._set("namespaces", namespaces)
        self._set("namespace_exempt", tuple(entry[2] for entry in named))
        self.namespace_keys[:] = [_public_keys(namespace, exempt) for _, namespace, exempt in named]
        counted = (*self.member_dicts, *namespaces)
        self._set("counted_dicts", counted)
        self.counted_lens[:] = map(len, counted)
        if self.root is not None and (found or namespaces):
            _RECORDED.setdefault(self.root, []).append(weakref.ref(self))

    def _code_shadowed(self) -> list[tuple[str, dict[str, Any], str, Any]]:
        """Where an instance would shadow the code its forward runs of its class (a method it
        calls through ``self``, ``block._act = f``: eager runs ``f``), as :meth:`record_attributes`
        notes them: absent from the instance's ``__dict__`` at capture (its ``forward`` is
        compared apart)."""
        code = {
            (owner, key)
            for _, owner, key, then in self.code_classes
            if key != "forward" and not is_plain(then)
        }
        if not code:
            return []
        return [
            (_joined(name, key), module.__dict__, key, _ABSENT)
            for name, module in zip(
                (self.root_name, *self.module_names), (self.root, *self.modules), strict=True
            )
            if module is not None
            for owner, key in code
            if owner is type(module) and key not in module.__dict__
        ]

    def _tensor_attributes(self) -> list[tuple[str, dict[str, Any], str, Any]]:
        """The public plain values hung on each parameter and buffer (``weight.gain = 2.0``,
        which a forward may read), as :meth:`record_attributes` notes them: those warmup and
        capture did not set (a flag the forward sets on every call is its own)."""
        found: list[tuple[str, dict[str, Any], str, Any]] = []
        seen: set[int] = set()
        setup = self.tensor_attributes_at_setup
        for name, module in zip(
            (self.root_name, *self.module_names), (self.root, *self.modules), strict=True
        ):
            if module is None:
                continue
            for key, tensor in (*module._parameters.items(), *module._buffers.items()):
                if tensor is None or id(tensor) in seen or id(tensor) not in setup:
                    continue
                seen.add(id(tensor))
                then = setup[id(tensor)]
                found += [
                    (_joined(name, key, attribute), vars(tensor), attribute, value)
                    for attribute, value in vars(tensor).items()
                    if not attribute.startswith("_")
                    and attribute not in FUSED_ACCUMULATION_FLAGS
                    and is_plain(value)
                    and then.get(attribute, _ABSENT) is value
                ]
        return found

    def _forward_replaced(self) -> str | None:
        """The name of the first submodule whose instance-level forward is not the one of
        capture, nor dualgraph's own around it (a submodule graphed after its parent)."""
        for name, namespace, forward in zip(
            self.module_names, self.module_dicts, self.forwards, strict=True
        ):
            now = namespace.get("forward")
            if now is forward:
                continue
            state = namespace.get(GRAPHED_STATE)
            if state is None or getattr(state, "previous", None) is not forward:
                return name
        return None

    def _same_hooks_where_hooked(self) -> bool:
        for i in self.hooked:
            if not _same_hooks(
                _hooks_held(self.hook_dicts[i], self.hook_flags[i]), self.hooks_at_capture[i]
            ):
                return False
        return True

    def _same_global_hooks(self) -> bool:
        return all(
            map(
                _same_hooks,
                map(_acting_global_hooks, self.global_hook_dicts, self.global_hook_flags),
                self.global_hooks_at_capture,
            )
        )

    def _hooks_now(self) -> Iterator[Hooks]:
        return map(_hooks_held, self.hook_dicts, self.hook_flags)

    def _explain(self, grad_enabled: bool) -> DualgraphError:
        again = "restore the module (dualgraph.torch.restore) and graph it again"
        if type(self.root) is not self.root_class:  # before its tensors, as for a submodule
            return DualgraphError(
                f"{self.root_name or 'the modules it calls'}: its class was "
                f"{self.root_class.__name__} at capture "
                f"and is {type(self.root).__name__} now (a parametrization registered, "
                f"__class__ set?), but the graphs replay the forward they captured; {again}"
            )
        for name, owner, key, submodule, training in zip(
            self.module_names,
            self.module_owners,
            self.module_keys,
            self.modules,
            self.training,
            strict=True,
        ):
            if owner.get(key) is not submodule:
                return DualgraphError(
                    f"{name}: the submodule was replaced or removed after capture, but the "
                    f"graphs read the captured one's tensors; load the new weights into the "
                    f"captured submodule in place (load_state_dict), or {again}"
                )
            if submodule.training != training:
                return DualgraphError(
                    f"{name}: training was {training} at capture and is {not training} now; "
                    "the graphs replay the mode each submodule was captured in (dropout, "
                    "BatchNorm's batch statistics). Put its mode back, or change the mode of "
                    f"the whole graphed module (which then runs eagerly), or {again}"
                )
        for name, now, then in zip(
            self.hook_names, self._hooks_now(), self.hooks_at_capture, strict=True
        ):
            if not _same_hooks(now, then):
                change = _hook_change(now, then)
                return DualgraphError(
                    f"{name} {change} after capture, but the graphs replay what the submodules' "
                    "hooks did at capture (a hook registered or swapped in since would never "
                    "run, one removed would still act); register hooks on submodules before "
                    "graphing (they run at capture only, as the rest of the callable's Python), "
                    "put them on the graphed module itself (they run around each replay), or "
                    f"{again}"
                )
        for name, hooks, flags, then in zip(
            self.global_hook_names,
            self.global_hook_dicts,
            self.global_hook_flags,
            self.global_hooks_at_capture,
            strict=True,
        ):
            now = _acting_global_hooks(hooks, flags)
            if not _same_hooks(now, then):
                change = _hook_change(now, then)
                return DualgraphError(
                    f"{name}: {_hook_named(now[0], then[0])}) {change} after capture: eager "
                    "runs the global hooks in every "
                    "submodule's call, but the graphs replay what they did at capture (one "
                    "registered since would never run inside the graphed module, one removed "
                    f"would still act); register global hooks before graphing and keep them, or "
                    f"{again}"
                )
        # Before the tensors: a parametrization also moves the tensor it wraps away.
        for name, module, cls in zip(self.module_names, self.modules, self.classes, strict=True):
            if type(module) is not cls:
                return DualgraphError(
                    f"{name}: its class was {cls.__name__} at capture and is "
                    f"{type(module).__name__} now (a parametrization registered?), but the "
                    f"graphs replay the forward they captured; {again}"
                )
        for name, owner, key, tensor, ptr, stride, shape, grad, is_buffer in zip(
            self.names,
            self.owners,
            self.keys,
            self.tensors,
            self.data_ptrs,
            self.strides,
            self.shapes,
            self.requires_grad,
            self.is_buffer,
            strict=True,
        ):
            kind = "buffer" if is_buffer else "parameter"
            current = owner.get(key)
            if current is not tensor:
                return DualgraphError(
                    f"{name}: the {kind} was replaced after capture (by assignment, "
                    "load_state_dict(assign=True), .to(), .half(), ..., or for one call, as "
                    "torch.func.functional_call does), but the graphs read the captured tensor; "
                    "update it in place (copy_, load_state_dict without assign=True), or "
                    f"{again}"
                )
            if tensor.data_ptr() != ptr:
                return DualgraphError(
                    f"{name}: the {kind}'s memory changed after capture (.to(), .half(), "
                    "share_memory(), assigning .data?), but the graphs read the captured "
                    f"memory; {again}"
                )
            if tensor.stride() != stride or tensor.shape != shape:
                return DualgraphError(
                    f"{name}: the {kind}'s layout changed after capture (shape {tuple(shape)} "
                    f"strides {stride} then, {tuple(tensor.shape)} {tensor.stride()} now: "
                    f"assigning .data, as_strided_?), but the graphs read the memory as "
                    f"captured; copy the new values in place (copy_), or {again}"
                )
            if grad_enabled and tensor.requires_grad != grad:
                return requires_grad_changed(name, grad)
        replaced = self._forward_replaced()
        if replaced is not None:
            return DualgraphError(
                f"{replaced}: its forward was replaced after capture (module.forward = ...), "
                f"but the graphs replay the forward they captured; set it before graphing, or "
                f"{again}"
            )
        for name, owner, key, kind in zip(
            self.absent_names, self.absent_owners, self.absent_keys, self.absent_kinds, strict=True
        ):
            if owner.get(key) is not None:
                what = "a module" if kind == "submodule" else "a tensor"
                return DualgraphError(
                    f"{name}: the {kind} was None at capture and is {what} now, which eager "
                    f"would use but the graphs never read; {again}"
                )
        host = self._host_changed() if self.host_tensors else None
        if host is not None:
            name, tensor = self.host_names[host], self.host_tensors[host]
            bound = self.host_dicts[host].get(self.host_keys[host])
            how = "was rebound" if bound is not tensor else "was changed (in place, .data = ...)"
            if type(bound) is torch.Tensor:  # what a replay would ignore
                how += f" ({first_difference(bound, self.host_bytes[host])})"
            device = self.host_device
            return DualgraphError(
                f"{name}: a tensor on {tensor.device} (where the graphs run on {device}) that "
                f"{how} after capture; the graphs hold what the host read from it at capture (a "
                f"scalar a {device.type} kernel takes, .item(), .tolist()), so every replay "
                f"would keep the old value where eager uses the new one. Keep it on {device} "
                "(a buffer moves with module.to), or make it a Python number, or set it back, "
                f"or {again}"
            )
        for name, kind, members, keys in zip(
            self.member_names, self.member_kinds, self.member_dicts, self.member_keys, strict=True
        ):
            added = [key for key in members if key not in keys]
            if added:
                return DualgraphError(
                    f"{_joined(name, added[0])}: a {kind} added after capture (registered, set "
                    "as an attribute, appended to a ModuleList or ParameterList), which eager "
                    f"would use but the graphs never read; add it before graphing, or {again}"
                )
        counts = list(map(len, self.counted_dicts))
        if counts != self.counted_lens:
            attribute = self._namespace_changed(counts)
            if attribute is not None:
                index, attribute_name, change = attribute
                module_name = self.namespace_names[index]
                if change == "looked up":
                    value = self.namespaces[index].get(attribute_name)
                    how = (
                        f"{_summary(value)} added after capture under a name the forward "
                        "looked up and did not find at capture (getattr(self, name, default), "
                        "hasattr), so eager's forward would use it where the graphs replay what "
                        f"it computed without it; set it before graphing, delete it, or {again}"
                    )
                elif change == "added":
                    how = (
                        "an attribute added after capture, which eager's forward may read "
                        "(getattr(self, name, default), hasattr) but the graphs replay what it "
                        "computed without it; set it before graphing, delete it, make it "
                        f"private (_{attribute_name}: not compared), or {again}"
                    )
                else:
                    how = (
                        "an attribute deleted after capture, which eager's forward may read "
                        "(hasattr, or set again as a cache) but the graphs replay what it "
                        f"computed with it; set it back, or {again}"
                    )
                return DualgraphError(f"{_joined(module_name, attribute_name)}: {how}")
        changed = self._attribute_changed() if self.attribute_keys else None
        if changed is not None and changed >= self.code_from:  # a function's own value
            then = self.attribute_values[changed]
            now = self.attribute_dicts[changed].get(self.attribute_keys[changed], _ABSENT)
            return _code_value_changed(self.attribute_names[changed], then, now)
        cell = self._cell_changed() if self.cells else None
        if cell is not None:
            now = _contents_or_absent(self.cells[cell])
            return _code_value_changed(self.cell_names[cell], self.cell_values[cell], now)
        read = self._class_value_changed() if self.class_keys else None
        if read is not None:
            class_value: Any = getattr(self.class_owners[read], self.class_keys[read], _ABSENT)
            then = self.class_values[read]
            if not is_plain(then):  # a method or forward of the class (_closed_over.class_values)
                shown = "deleted" if class_value is _ABSENT else _code_named(class_value)
                return DualgraphError(
                    f"{self.class_names[read]}: was {_code_named(then)} at capture and is "
                    f"{shown} now; the graphs replay what the code of capture did, so eager's "
                    "new code would never run. Put it back, patch the class before graphing, "
                    f"or {again}"
                )
            shown = "deleted" if class_value is _ABSENT else f"{class_value!r}"
            return DualgraphError(
                f"{self.class_names[read]}: was {self.class_values[read]!r} at capture and is "
                f"{shown} now; the graphs replay what the code computed from it at capture, so "
                "eager's new value would be lost. Set it back, set it before graphing, or "
                f"{again}"
            )
        if changed is not None:
            name, then = self.attribute_names[changed], self.attribute_values[changed]
            now = self.attribute_dicts[changed].get(self.attribute_keys[changed], _ABSENT)
            if then is _ABSENT:  # set over a method of its class (_code_shadowed)
                return DualgraphError(
                    f"{name}: set on the instance after capture ({_code_named(now)}), over the "
                    "method of its class the forward calls through self; the graphs replay "
                    "what the class's code did at capture, so eager's new code would never "
                    f"run. Delete it, set it before graphing, or {again}"
                )
            if type(then) is torch.Tensor:
                how = "deleted" if now is _ABSENT else "rebound to another object"
                found = "deleted" if now is _ABSENT else _summary(now)
                return DualgraphError(
                    f"{name}: a tensor attribute {how} after capture (at capture "
                    f"{_summary(then)}, now {found}); the graphs read the "
                    "memory of the tensor of capture, so the change would be lost. Set it "
                    f"back, change its values in place (copy_), make it a buffer, or {again}"
                )
            shown = "deleted" if now is _ABSENT else f"{now!r}"
            return DualgraphError(
                f"{name}: was {then!r} at capture and is {shown} now; the graphs replay what "
                "the forward computed from it at capture (a dropout probability, BatchNorm's "
                "momentum or eps), so the change would be lost. Set it back, set it before "
                f"graphing, or {again}"
            )
        return DualgraphError("the module's parameters changed since capture")

    @contextlib.contextmanager
    def left_as_found(self) -> Iterator[None]:
        """Put back the buffers warmup and capture update; refuse parameters they update.

        In eager, graphing runs nothing: the buffers (BatchNorm's running statistics, its batch
        count) must be as they were, so that the replays alone update them, as eager steps do.
        A submodule, parameter or buffer the callable replaces (``self.steps = self.steps + 1``)
        is hung back and refused, naming it: a replay would read the captured one every time.
        """
        buffers = [
            (tensor, tensor.detach().clone())
            for tensor, is_buffer in zip(self.tensors, self.is_buffer, strict=True)
            if is_buffer
        ]
        versions = [tensor._version for tensor in self.tensors]
        try:
            yield
        except BaseException as error:
            replaced = self._put_back_replaced()
            _copy_back(buffers)
            if replaced is not None and isinstance(error, Exception):
                raise replaced from error  # the replacement is what broke the capture
            raise
        replaced = self._put_back_replaced()
        # By bits as well: BatchNorm's kernel writes its statistics without a version bump
        # (by value, a buffer holding NaN would be taken as updated).
        saved_of = {id(tensor): saved for tensor, saved in buffers}
        updated = tuple(
            i
            for i, (tensor, version, is_buffer) in enumerate(
                zip(self.tensors, versions, self.is_buffer, strict=True)
            )
            if is_buffer
            and (tensor._version != version or not same_bits(tensor, saved_of[id(tensor)]))
        )
        self._set("updated", updated)  # found only now; read by the plan
        _copy_back(buffers)
        if replaced is not None:
            raise replaced
        self.record_attributes()
        for name, tensor, version, is_buffer in zip(
            self.names, self.tensors, versions, self.is_buffer, strict=True
        ):
            if not is_buffer and tensor._version != version:
                raise DualgraphError(
                    f"{name}: the callable updates this parameter in place, so warmup and "
                    "capture changed it already (dualgraph undoes that only for buffers); "
                    "register it as a buffer, or update it outside the graphed callable"
                )

    def _put_back_replaced(self) -> DualgraphError | None:
        """Hang every submodule, parameter and buffer the callable replaced back where it was;
        the error naming the first one (``None`` where none was replaced)."""
        error: DualgraphError | None = None
        advice = (
            "a replay would read the captured one on every call, and eager's changes would be "
            "lost. Update it in place (self.x += 1, copy_), or keep it out of the graphed callable"
        )
        for name, owner, key, module in zip(
            self.module_names, self.module_owners, self.module_keys, self.modules, strict=True
        ):
            if owner.get(key) is not module:
                owner[key] = module
                error = error or DualgraphError(
                    f"{name}: the callable replaces this submodule (self.{key} = ...); {advice}"
                )
        for name, owner, key, tensor, ptr, is_buffer in zip(
            self.names,
            self.owners,
            self.keys,
            self.tensors,
            self.data_ptrs,
            self.is_buffer,
            strict=True,
        ):
            kind = "buffer" if is_buffer else "parameter"
            if owner.get(key) is not tensor:
                owner[key] = tensor
                error = error or DualgraphError(
                    f"{name}: the callable replaces this {kind} (self.{key} = ...) instead of "
                    f"updating it in place; {advice}"
                )
            elif tensor.data_ptr() != ptr:
                error = error or DualgraphError(
                    f"{name}: the callable moves this {kind} to other memory (.data = ...); "
                    f"{advice}"
                )
        return error


def _code_value_changed(name: str, then: Any, now: Any) -> DualgraphError:
    shown = "deleted" if now is _ABSENT else f"{now!r}"
    if not is_plain(then):  # a tensor, a module
        shown = "deleted" if now is _ABSENT else _summary(now)
        return DualgraphError(
            f"{name}: rebound after capture (now {shown}, not the "
            f"{_summary(then).removeprefix('a ')} of capture); the graphs "
            "read the one of capture (its memory, a module's weights), so eager's new one "
            "would be ignored. Set it back, update the one of capture in place (copy_, "
            "load_state_dict), pass it to the callable as an argument, or graph the callable "
            "again"
        )
    return DualgraphError(
        f"{name}: was {then!r} at capture and is {shown} now; the graphs replay what the code "
        "computed from it at capture (a temperature, a flag it branches on), so eager's new "
        "value would be lost. Set it back, pass it to the callable as a tensor argument "
        "(copied in on every call), or graph the callable again"
    )


#: A module's dicts of members, and what each holds (for the message of one added).
_MEMBER_KINDS = {"_parameters": "parameter", "_buffers": "buffer", "_modules": "submodule"}
#: Public ``__dict__`` entries whose addition is no change: dualgraph's own ``forward`` (a
#: replaced one is refused on its own), the mode (checked on its own).
_NOT_ADDED = frozenset({"forward", "training"})
_ABSENT = object()  # an attribute deleted since capture
_NO_NAMES: frozenset[str] = frozenset()
_ABSENTS = itertools.repeat(_ABSENT)
_SCALARS = (int, float, bool, str, type(None))
# Immutable values besides them, compared by equality (an Enum member, by identity): what a
# forward casts to (self.out_dtype), puts tensors on, or branches on (self.act is Act.GELU).
_VALUES = (complex, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _hook_named(now: Sequence[Any], then: Sequence[Any]) -> str:
    """The first hook in only one of ``now`` and ``then``, by name, for a message (who
    registers a global hook is often not the user: torch's ``ModuleTracker``, under
    ``FlopCounterMode``, registers one of each forward kind).

    >>> _hook_named([print, len], [print])
    'len'
    """
    for hook in (*now, *then):
        if not any(hook is other for other in now) or not any(hook is other for other in then):
            return getattr(hook, "__qualname__", None) or repr(hook)
    return "a hook under another flag"


def _contents_or_absent(cell: Any) -> Any:
    """A closure cell's value, ``_ABSENT`` for an emptied one (``del name``)."""
    try:
        return cell.cell_contents
    except ValueError:
        return _ABSENT


def _take_own(now: list[Any], before: list[Any], recorded: list[Any]) -> None:
    """Take as recorded each value the callable's Python set (``now`` differs from ``before``)
    where the one before was the recorded one: a change of its own, not the caller's."""
    if all(map(_is, now, before)):
        return
    for i, value in enumerate(now):
        if value is not before[i] and before[i] is recorded[i]:
            recorded[i] = value


def _watched(key: str, value: Any) -> bool:
    """Whether an attribute is one a replay's check compares: public (not torch's own
    ``_is_full_backward_hook``...), not ``training`` (checked on its own), plain, or a plain
    tensor (the graphs read the memory of the one of capture; compared by identity)."""
    return (
        not key.startswith("_")
        and key != "training"
        and (is_plain(value) or type(value) is torch.Tensor)
    )


def _added_plain(key: str, value: Any) -> bool:
    """Whether an attribute added to a module's ``__dict__`` since capture is refused."""
    return not key.startswith("_") and is_plain(value)


#: The flags a fused weight-grad accumulation's backward sets on each parameter whose
#: ``main_grad`` it adds into, whatever they held (TE's and Megatron's): noted for such a
#: parameter even when they held that value already, as when graphing follows an eager step
#: (Megatron's ``zero_grad_buffer`` resets it only at the next step's start); a backward's
#: own, never compared as a value the forward read.
FUSED_ACCUMULATION_FLAGS = frozenset({"grad_added_to_main_grad"})


def _held_by(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` holds itself."""
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _public_keys(namespace: dict[str, Any], exempt: frozenset[str]) -> frozenset[str]:
    """The attributes of a module's ``__dict__`` whose deletion is refused."""
    return frozenset(key for key in namespace if not key.startswith("_") and key not in exempt)


def _same_plain(a: Any, b: Any) -> bool:
    """Whether two plain values (see :func:`is_plain`) would compute the same: of one type and
    equal, a float by its bits as the kernels see it (``-0.0`` is not ``0.0``: ``copysign``,
    a division; any NaN is a NaN), a tuple item by item; anything else (a tensor, a module),
    only itself: the graphs read the memory of the one of capture.

    >>> _same_plain(float("nan"), float("nan")), _same_plain(-0.0, 0.0), _same_plain(1, True)
    (True, False, False)
    >>> _same_plain((2, -0.0), (2, 0.0)), _same_plain((2, 0.5), (2, 0.5))
    (False, True)
    """
    if type(a) is not type(b):
        return False
    if type(a) is float:
        if a != a:  # NaN: equal to any NaN, as the kernels use it
            return b != b
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if type(a) is tuple:
        return len(a) == len(b) and all(map(_same_plain, a, b))
    if type(a) in _SCALARS or type(a) in _VALUES:
        return bool(a == b)
    return a is b  # an Enum member, a tensor, a module


def _code_named(code: Any) -> str:
    """A function (a property, a staticmethod's function) by its qualified name.

    >>> _code_named(torch.nn.Linear.forward)
    'Linear.forward'
    """
    function = getattr(code, "fget", code)
    return getattr(function, "__qualname__", None) or repr(code)


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a number, string, flag or ``None``, an immutable value such as a
    ``torch.dtype``, a ``torch.device`` or an ``Enum`` member (or a tuple of them, as
    LayerNorm's ``normalized_shape``): what a forward may compute with or branch on on the host.

    >>> is_plain((8, 1e-5)), is_plain(torch.float16), is_plain([8]), is_plain(torch.ones(1))
    (True, True, False, False)
    """
    if type(value) is tuple:
        return all(map(_is_plain_item, value))
    return _is_plain_item(value)


def _is_plain_item(value: Any) -> bool:
    return type(value) in _SCALARS or type(value) in _VALUES or isinstance(value, enum.Enum)


#: The records of each graphed module's attributes (one per capture: buckets, slots).
_RECORDED: weakref.WeakKeyDictionary[torch.nn.Module, list[weakref.ref[ModuleTensors]]] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def changes_taken(module: torch.nn.Module) -> Iterator[None]:
    """Run an eager call of a graphed ``module`` (in the other training mode) taking the values
    its own Python sets (a counter) as the recorded ones: they are no change of the caller's.
    What the caller had changed before stays refused."""
    records = [record for ref in _RECORDED.get(module, ()) if (record := ref()) is not None]
    with own_changes_taken_of(records):
        yield


@contextlib.contextmanager
def own_changes_taken_of(records: Iterable[ModuleTensors]) -> Iterator[None]:
    """:meth:`ModuleTensors.own_changes_taken` of each of ``records`` around an eager call."""
    with contextlib.ExitStack() as stack:
        for record in records:
            stack.enter_context(record.own_changes_taken())
        yield


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s bytes in element order (``torch.equal`` of two is bitwise: a NaN
    equals itself, ``-0.0`` is not ``0.0``).

    >>> a, b = torch.tensor([float("nan"), 0.0]), torch.tensor([float("nan"), -0.0])
    >>> torch.equal(bytes_of(a), bytes_of(a.clone())), torch.equal(bytes_of(a), bytes_of(b))
    (True, False)
    """
    # detached first, so nothing after records history: no no_grad() block (3 us a call)
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1).clone().view(torch.uint8)


def _first_changed(now: list[Any], values: list[Any]) -> int | None:
    """The index of the first of ``now`` that is not its ``values`` entry of capture, or None.

    By identity first (one pass); a value set to an equal one since (another float object) is
    taken as the new object in ``values``, so that the next call passes by identity again.

    >>> kept = [1.5, "a"]
    >>> _first_changed([float("1.5"), "a"], kept), _first_changed([1.5, "b"], kept)
    (None, 1)
    """
    if all(map(_is, now, values)):
        return None
    for i, value in enumerate(now):
        if value is values[i]:
            continue
        if not _same_plain(value, values[i]):
            return i
        values[i] = value
    return None


def bytes_now(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes in element order, as :func:`bytes_of` gives them, to compare with a
    kept copy at once: a view of its memory where its elements lie there in order (no copy:
    a capture compares every parameter of its callables this way), else a copy.

    >>> t = torch.tensor([1.0, -0.0])
    >>> bytes_now(t).data_ptr() == t.data_ptr(), same_bytes(bytes_now(t), bytes_of(t))
    (True, True)
    >>> bytes_now(t.flip(0)).data_ptr() == t.data_ptr()  # elements not in order: a copy
    False
    """
    view = tensor.detach()
    if (
        view.layout == torch.strided
        and view.is_contiguous()
        and not view.is_conj()
        and not view.is_neg()
        and not view.is_quantized
    ):
        return view.reshape(-1).view(torch.uint8)
    return bytes_of(tensor)


#: Wider integers of a size, to compare bytes with: ``torch.equal`` of ``uint8`` on a CPU takes
#: about 1.6 ns a byte, of ``int64`` under 0.25.
_WIDER = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def same_bytes(kept: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether two :func:`bytes_of` results hold the same bytes (``torch.equal`` of them,
    compared as wider integers where their sizes allow: the same answer, sooner).

    >>> same_bytes(bytes_of(torch.tensor([1.0, -0.0])), bytes_of(torch.tensor([1.0, 0.0])))
    False
    >>> same_bytes(bytes_of(torch.arange(3.0)), bytes_of(torch.arange(3.0)))
    True
    """
    size = kept.numel()
    if size != now.numel():
        return False
    for width, dtype in _WIDER:
        if size % width == 0 and kept.storage_offset() % width == now.storage_offset() % width == 0:
            return torch.equal(kept.view(dtype), now.view(dtype))
    return torch.equal(kept, now)


#: The integers of each element size, as which a tensor's elements compare bit for bit.
_INTS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s elements as integers of their size (complex ones as two), a view with no
    copy: equal where the bits are (a NaN is itself, ``-0.0`` is not ``0.0``), nonzero where
    they are; ``None`` where no such view exists (sparse, quantized) or may not (a tensor
    subclass, FP8 or DTensor, whose own ops may not take a view as another dtype).

    >>> bits_view(torch.tensor([-0.0, 1.0])).tolist()
    [-2147483648, 1065353216]
    """
    if is_tensor_subclass(tensor):
        return None
    view = tensor.detach().resolve_conj().resolve_neg()
    if view.is_complex():
        view = torch.view_as_real(view)
    ints = _INTS_OF_SIZE.get(view.element_size())
    if ints is None or view.layout != torch.strided or view.is_quantized:
        return None
    return view.view(ints)


def same_bits(tensor: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether ``tensor`` holds what ``kept`` (a copy of it) holds, bit for bit, with no copy:
    ``torch.equal`` compares values, by which a NaN is never itself and ``-0.0`` is ``0.0``.

    >>> nan = torch.tensor([float("nan"), 1.0])
    >>> same_bits(nan, nan.clone()), torch.equal(nan, nan.clone())
    (True, False)
    >>> same_bits(torch.tensor([-0.0]), torch.tensor([0.0]))
    False
    """
    if tensor.shape != kept.shape or tensor.dtype != kept.dtype:
        return False
    a, b = bits_view(tensor), bits_view(kept)
    if a is None or b is None:
        return torch.equal(tensor, kept)  # by value, as before: no integer view of these
    return torch.equal(a, b)


def first_difference(tensor: torch.Tensor, kept: torch.Tensor) -> str:
    """Where ``tensor`` differs from ``kept`` (its :func:`bytes_of` of before), for a message:
    its layout, or its first element whose bits changed, as it was and as it is.

    >>> first_difference(torch.tensor([[1.0, 2.0]]), bytes_of(torch.tensor([[1.0, 3.0]])))
    'element [0, 1] was 3.0 and is 2.0'
    """
    size = tensor.element_size()
    now = bytes_of(tensor)
    if now.numel() != kept.numel() or tensor.numel() == 0:
        return f"it held {kept.numel()} bytes and holds {now.numel()}"
    with torch.no_grad():
        differs = (now.view(-1, size) != kept.view(-1, size)).any(dim=1).nonzero()
    if not len(differs):
        return "its values are the same"
    flat = int(differs[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), tensor.shape)]
    then, found = kept.view(tensor.dtype)[flat].item(), now.view(tensor.dtype)[flat].item()
    if not index:
        return f"it was {then!r} and is {found!r}"
    return f"element {index} was {then!r} and is {found!r}"


def _summary(value: Any) -> str:
    """A value as a message shows it: a tensor by its dtype, shape, device and address.

    >>> _summary(torch.zeros(2, 3, dtype=torch.float16))
    'a float16 tensor [2, 3] on cpu at 0x...'
    >>> _summary(1.5)
    'a float'
    """
    if isinstance(value, torch.Tensor):
        return (
            f"a {str(value.dtype).removeprefix('torch.')} tensor {list(value.shape)} on "
            f"{value.device} at {value.data_ptr():#x}"
        )
    return f"a {type(value).__name__}"


def _joined(*parts: str) -> str:
    return ".".join(filter(None, parts))


def _copy_back(buffers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for tensor, saved in buffers:
        write_back(tensor, saved)


#: torch's own setter of version counters (as functionalization uses it); ``None`` where this
#: torch lacks it (the versions then stay moved).
_set_version_counters = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def set_versions(versions: Iterable[tuple[torch.Tensor, int]]) -> None:
    """Set each tensor's version counter to the version given (an inference tensor has none:
    left out), where a put-back had to move it (:func:`write_back` moves none).

    >>> t = torch.zeros(2)
    >>> t += 1
    >>> set_versions([(t, 0)])
    >>> t._version
    0
    """
    pairs = [(t, v) for t, v in versions if not t.is_inference()]
    if pairs and _set_version_counters is not None:
        _set_version_counters(tuple(t for t, _ in pairs), tuple(v for _, v in pairs))


def write_back(tensor: torch.Tensor, kept: torch.Tensor | None) -> None:
    """Put ``kept`` (``None``: zeros) back into ``tensor``'s memory through ``.data``, so that
    its version counter does not move: the one rule of every put-back of graphing.

    Graphing runs nothing in eager, so undoing what warmup and capture did must not look like
    an update: a caller's pending backward that saved the tensor (BatchNorm's statistics in eval
    mode) would fail on a moved version. No check reads a put-back as a change or misses one:
    those around warmup and capture (``left_as_found``, ``ClosureUpdates.watching``,
    ``module_tensors_kept``, ``parameter_attributes_kept``) compare versions and values (bits) with
    what they noted before, and do so before they put back; those after (host state, each
    call's) note them after every put-back. An inference tensor is put back too (``copy_``
    would refuse it outside inference mode; its ``.data`` takes the copy).

    An expanded tensor (``torch.zeros(1).expand(8)``, a buffer registered so) repeats its
    elements along its stride-0 dims, which torch refuses to write into: it is written through
    one position of each such dim, each memory location once.

    >>> count = torch.zeros(2)
    >>> count += 1
    >>> write_back(count, torch.zeros(2))
    >>> count, count._version
    (tensor([0., 0.]), 1)
    >>> base = torch.zeros(1)
    >>> write_back(base.expand(3), torch.ones(3))
    >>> base
    tensor([1.])
    """
    with torch.no_grad():
        target = tensor.data
        if 0 in target.stride():
            # each repeated dim once, in both: what kept holds there is what was repeated
            for dim, (size, stride) in enumerate(zip(target.shape, target.stride(), strict=True)):
                if stride == 0 and size > 1:
                    target = target.narrow(dim, 0, 1)
                    kept = None if kept is None else kept.narrow(dim, 0, 1)
        if kept is None:
            target.zero_()
        else:
            target.copy_(kept)


def is_tensor_subclass(param: torch.Tensor) -> bool:
    """Whether ``param`` is a tensor subclass (not a plain tensor or ``nn.Parameter``).

    Such a parameter (Transformer Engine's FP8 weights, a ``QuantizedTensor``) may hold its
    values in another form than its grads: ``torch.zeros_like`` of it is another FP8 tensor,
    which no ``.grad`` may be, and adding into which would quantize the grads.

    >>> is_tensor_subclass(torch.nn.Parameter(torch.ones(2))), is_tensor_subclass(torch.ones(2))
    (False, False)
    """
    return type(param) not in (torch.Tensor, torch.nn.Parameter)


def grad_buffer_like(param: torch.Tensor) -> torch.Tensor:
    """A zeroed plain tensor that holds a grad of ``param``: its shape, dtype, device and, for a
    plain parameter, its strides (autograd hands a parameter grads of its own dtype).

    >>> grad_buffer_like(torch.nn.Parameter(torch.ones(2, 3))).shape
    torch.Size([2, 3])
    """
    if is_tensor_subclass(param):
        return torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    return torch.zeros_like(param)


def requires_grad_changed(name: str, at_capture: bool) -> DualgraphError:
    """The error for a parameter frozen or unfrozen after capture."""
    return DualgraphError(
        f"{name}: requires_grad was {at_capture} at capture and is {not at_capture} now; the "
        "captured backward computes grads for the parameters that required grad at capture, so "
        "restore the module (dualgraph.torch.restore) and graph it again"
    )


@contextlib.contextmanager
def suspended_tensor_hooks(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Keep the parameters' tensor hooks out of warmup and the captured backward.

    A hook inside the captured backward would run again when the replay hands the grad to
    autograd: twice per replay. A leaf's hooks live in its ``_backward_hooks`` dict, which
    autograd reads when it runs them; emptying it for the capture and refilling it keeps the
    user's handles valid.
    """
    suspended: list[tuple[dict[Any, Any], dict[Any, Any]]] = []
    for param in params:
        hooks = own_hooks(param)
        if hooks:
            suspended.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in suspended:
            hooks.update(saved)
