"""Validation of a graphed callable's arguments against the samples it was captured with.

Runs on every call, before any static buffer is written: structure, ``None`` positions and
constants through the core's call spec, then each tensor against what was recorded from its
sample: a plain dense tensor (no subclass, sparse, nested or quantized tensor) of the same
shape, dtype and device, and no ``requires_grad`` where the sample had none. A graphed call
also checks that each tensor is laid out in memory as its sample was
(:meth:`InputGuard.check_layouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch
from torch._prims_common import suggest_memory_format as _suggest_memory_format

from .._call import CallSpec, describe_call
from .._errors import DualgraphError, SpecMismatchError
from .._orders import KeyOrders
from .._spelling import CallSpelling
from ._ambient import autograd_records
from ._carried_attributes import CarriedAttributes
from ._layout_checks import exact_guard
from ._leaves import dtype_name

__all__ = [
    "InputGuard",
    "input_off_device",
    "own_parameter_at",
    "own_parameter_passed",
    "same_tensor_twice",
    "unsupported_tensor",
]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided
_stride = torch.Tensor.stride
_is_nested = attrgetter("is_nested")


def _needs_grad_unexpected(tensor: torch.Tensor, expected: bool) -> bool:
    return tensor.requires_grad and not expected


def _describe_format(memory_format: torch.memory_format) -> str:
    return str(memory_format).removeprefix("torch.")


def unsupported_tensor(tensor: torch.Tensor, /) -> str | None:
    """Why ``tensor`` cannot be copied into a static buffer and replayed, or ``None``.

    >>> unsupported_tensor(torch.zeros(2, 2).to_sparse())
    'a torch.sparse_coo tensor (static buffers are dense, strided tensors)'
    >>> unsupported_tensor(torch.zeros(2)) is None
    True
    """
    cls = type(tensor)
    if cls is not _Tensor and cls is not _Parameter:
        return (
            f"a tensor subclass {cls.__module__}.{cls.__qualname__} (a replay runs the captured "
            "kernels, not the subclass's Python code)"
        )
    if tensor.is_nested:
        return "a nested tensor (static buffers are dense, strided tensors)"
    if tensor.layout is not _STRIDED:
        return f"a {tensor.layout} tensor (static buffers are dense, strided tensors)"
    if tensor.is_quantized:
        return "a quantized tensor (static buffers are dense, strided tensors)"
    if tensor.is_meta:
        return "a meta tensor (it holds no data to replay on)"
    return None


def same_tensor_twice(
    paths: Sequence[str], tensors: Sequence[torch.Tensor]
) -> tuple[str, str] | None:
    """The paths of the first tensor passed at two inputs (the earlier first), or ``None``.

    >>> x = torch.zeros(2)
    >>> same_tensor_twice(["args[0]", "args[1]", "args[2]"], [x, torch.zeros(2), x])
    ('args[0]', 'args[2]')
    """
    first: dict[int, str] = {}
    for path, tensor in zip(paths, tensors, strict=True):
        earlier = first.setdefault(id(tensor), path)
        if earlier != path:
            return earlier, path
    return None


def own_parameter_at(
    tensors: Sequence[torch.Tensor], positions: Iterable[int], params: Container[int]
) -> int | None:
    """The first of ``positions`` whose input is one of the parameters (``params``: their ids)
    requiring grad, or a view of one (its ``_base``) that carries grad back to it (a
    ``grad_fn``: one made under ``no_grad`` has none, and sends none); ``None``: none is.
    Identities first, no storage read (a replay's check on each call).

    >>> weight = torch.nn.Parameter(torch.ones(2, 2))
    >>> inputs = [torch.ones(2), weight.t()]
    >>> own_parameter_at(inputs, [0, 1], {id(weight)}), own_parameter_at(inputs, [0], {id(weight)})
    (1, None)
    """
    for i in positions:
        tensor = tensors[i]
        if id(tensor) in params:
            if tensor.requires_grad:
                return i
        elif id(tensor._base) in params and tensor.grad_fn is not None:
            return i
    return None


def own_parameter_passed(
    paths: Sequence[str],
    tensors: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    names: Sequence[str],
) -> tuple[str, str] | None:
    """The path of the first input that is one of ``params``, or views one, as
    :func:`own_parameter_at` tells, and that parameter's name; ``None``: none is.

    >>> weight = torch.nn.Parameter(torch.ones(2, 2))
    >>> own_parameter_passed(["args[0]", "args[1]"], [torch.ones(2), weight.t()], [weight], ["w"])
    ('args[1]', 'w')
    """
    named = {id(param): name for param, name in zip(params, names, strict=True)}
    i = own_parameter_at(tensors, range(len(paths)), named)
    if i is None:
        return None
    tensor = tensors[i]
    return paths[i], named[id(tensor)] if id(tensor) in named else named[id(tensor._base)]


def input_off_device(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None, device: torch.device
) -> tuple[str, torch.device] | None:
    """The path and device of the first tensor of a call that is not on ``device``, or ``None``.

    >>> input_off_device((torch.zeros(2),), {"scale": torch.tensor(2.0)}, torch.device("meta"))
    ('args[0]', device(type='cpu'))
    """
    spec = describe_call(args, kwargs)
    for path, leaf in zip(spec.array_paths, spec.flatten(args, kwargs), strict=True):
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            return path, leaf.device
    return None


class InputGuard:
    """The capture-time description of ``(args, kwargs)``; :meth:`tensors` checks a call.

    Built on the core's :class:`dualgraph.CallSpec` (structure, ``None`` leaves, constants,
    paths); what a tensor leaf must be is checked here. Given the callable ``fn`` (a module's
    forward), the keywords its ``**kwargs`` collects must keep their order, as dicts do.

    >>> guard = InputGuard((torch.zeros(2, 3),), {"scale": 2.0})
    >>> len(guard.tensors((torch.ones(2, 3),), {"scale": 2.0}))
    1
    >>> guard.tensors((torch.ones(2, 4),), {"scale": 2.0})
    Traceback (most recent call last):
    ...
    dualgraph.SpecMismatchError: args[0]: expected float32[2, 3] on cpu, got ...
    """

    __slots__ = (
        "_expected",
        "_flatten_args",
        "_guards",
        "_has_kwargs",
        "_key_orders",
        "_layouts",
        "_layouts_seen",
        "_spelling",
        "carried",
        "paths",
        "requires_grad",
        "spec",
        "strides",
    )

    def __init__(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        fn: Callable[..., Any] | None = None,
    ) -> None:
        #: The core's description of the call: structure, constants, array paths.
        self.spec: CallSpec = describe_call(args, kwargs)
        tensors = self.spec.flatten(args, kwargs)
        paths = self.spec.array_paths
        for path, leaf in zip(paths, tensors, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise DualgraphError(
                    f"{path}: array leaves of a torch callable's inputs must be torch tensors, "
                    f"got {type(leaf).__module__}.{type(leaf).__qualname__}"
                )
            why = unsupported_tensor(leaf)
            if why is not None:
                raise SpecMismatchError(f"{path}: cannot be graphed: {why}", path=path)
        #: The path of each input tensor, e.g. ``args[0]`` or ``kwargs['mask']``.
        self.paths: tuple[str, ...] = paths
        #: The public Python attributes each sample tensor carried (``x.scale = 2.0``), which
        #: the static inputs carry too and a call's tensors are held to.
        self.carried = CarriedAttributes(paths, tensors)
        #: For each input tensor (args first, then kwargs): did its sample require grad?
        self.requires_grad: tuple[bool, ...] = tuple(t.requires_grad for t in tensors)
        self._expected = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)
        #: The strides of each sample: a call's tensors with others are checked for their layout.
        self.strides: tuple[tuple[int, ...], ...] = tuple(t.stride() for t in tensors)
        self._layouts = tuple(map(_suggest_memory_format, tensors))
        # (position, strides) found laid out as the sample (a slice of a larger tensor, say)
        self._layouts_seen: dict[tuple[int, tuple[int, ...]], None] = {}
        self._has_kwargs = self.spec.kwargs_spec.num_arrays > 0 or bool(kwargs)
        self._flatten_args = self.spec.args_spec.flatten
        # The core matches a dict (and the keywords) whatever its key order; the callable's
        # Python sees the order of its dicts, and of the keywords its **kwargs collects.
        self._key_orders = KeyOrders(self.spec, fn) or None  # None: nothing to check
        # A call spelling its arguments otherwise than the sample (a keyword by position, a
        # default passed or left out) is eager's same call: written as the sample's, on the
        # error path only.
        self._spelling = CallSpelling(fn, args, kwargs or {}) if fn is not None else None
        # A call's tensors as the samples, in one C call (checked_tensors): the guard of the
        # samples, then also of a call's tensors that passed (under autocast, whose dispatch
        # keys the guard reads); the latest two. None: a sample it cannot guard.
        guard = exact_guard(tensors)
        self._guards: tuple[Any, Any] | None = None if guard is None else (guard, guard)

    @property
    def num_args_tensors(self) -> int:
        """How many input tensors come from ``args`` (they come first)."""
        return self.spec.num_args_arrays

    def tensors(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], grad_enabled: bool | None = None
    ) -> list[torch.Tensor]:
        """The input tensors of a call, in capture order; raises naming the first bad leaf.

        ``grad_enabled`` is the grad mode of the call (read from torch when not given).
        """
        try:
            if kwargs or self._has_kwargs:
                tensors = self.spec.flatten(args, kwargs)
            else:  # the usual call: positional args only (``args`` is the call's own tuple)
                try:
                    tensors = self._flatten_args(args, root="args")
                except SpecMismatchError as error:
                    raise self._positional_mismatch(args, error) from None
        except SpecMismatchError as error:  # spelled otherwise than the sample call?
            _, spelled_args, spelled_kwargs = self.flattened_as_captured(args, kwargs, error)
            try:
                return self.tensors(spelled_args, spelled_kwargs, grad_enabled)
            except SpecMismatchError as refused:
                raise self.named_as_called(refused, args, kwargs) from None
        if grad_enabled is None:
            grad_enabled = autograd_records()
        try:
            for tensor, (shape, dtype, device, requires_grad) in zip(
                tensors, self._expected, strict=True
            ):
                cls = type(tensor)
                if (
                    (cls is not _Tensor and cls is not _Parameter)
                    or tensor.layout is not _STRIDED
                    or tensor.shape != shape
                    or tensor.dtype is not dtype
                    or tensor.device != device
                    or (tensor.requires_grad and not requires_grad and grad_enabled)
                ):
                    raise self._explain(tensors, grad_enabled)
        except SpecMismatchError:
            raise
        except Exception:  # e.g. a nested tensor has no shape to compare
            raise self._explain(tensors, grad_enabled) from None
        if self._key_orders is not None:
            self.check_key_orders(args, kwargs)
        return tensors

    def checked_tensors(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], grad_enabled: bool
    ) -> list[torch.Tensor]:
        """:meth:`tensors`, then :meth:`check_layouts` where some strides differ from the
        samples': a graphed call's checks of its tensors. Where a guard made from tensors that
        passed them (the samples, or a call's) passes this call's, of the same class, dtype,
        device, sizes, strides and ``requires_grad``, those are not compared one by one."""
        guards = self._guards
        if guards is not None:
            try:
                if kwargs or self._has_kwargs:
                    tensors = self.spec.flatten(args, kwargs)
                else:
                    tensors = self._flatten_args(args, root="args")
            except SpecMismatchError:  # (the error path) checked one by one, and worded
                return self._checked_one_by_one(args, kwargs, grad_enabled)
            if any(map(_is_nested, tensors)):
                # a nested tensor of the strided layout (a plain Tensor by class and layout)
                # has no strides: torch's guard reads them in C++, where the error it throws
                # aborts the process. Refused one by one, by path.
                return self._checked_one_by_one(args, kwargs, grad_enabled)
            latest, previous = guards
            if latest.check(*tensors) or (previous.check(*tensors) and self._swap_guards()):
                if self._key_orders is not None:
                    self.check_key_orders(args, kwargs)
                return tensors
        return self._checked_one_by_one(args, kwargs, grad_enabled)

    def _checked_one_by_one(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], grad_enabled: bool
    ) -> list[torch.Tensor]:
        guards = self._guards
        tensors = self.tensors(args, kwargs, grad_enabled)
        if tuple(map(_stride, tensors)) != self.strides:
            try:
                self.check_layouts(tensors)
            except SpecMismatchError as refused:
                raise self.named_as_called(refused, args, kwargs) from None
        elif guards is not None and not any(
            map(_needs_grad_unexpected, tensors, self.requires_grad)
        ):
            # passed as the samples would (a guard made under no grad from a tensor requiring
            # grad where its sample did not would pass it under grad mode, which refuses it)
            guard = exact_guard(tensors)
            if guard is not None:
                self._guards = (guard, guards[0])
        return tensors

    def __getstate__(self) -> dict[str, Any]:
        # a C guard is neither copied nor pickled: a copy checks its tensors one by one
        state = {slot: getattr(self, slot) for slot in self.__slots__ if hasattr(self, slot)}
        state["_guards"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            object.__setattr__(self, slot, value)

    def as_captured(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], error: SpecMismatchError
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of a call the spec refused with ``error``, written as the sample
        call was (a keyword passed by position, a default passed or left out: eager binds them
        alike, see :class:`~dualgraph._spelling.CallSpelling`); raises ``error`` where the call
        cannot be written otherwise, and names a default passed with another value."""
        spelled = None if self._spelling is None else self._spelling.as_captured(args, kwargs)
        if spelled is None:
            raise error
        return spelled

    def flattened_as_captured(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], error: SpecMismatchError
    ) -> tuple[list[Any], tuple[Any, ...], dict[str, Any]]:
        """The tensors, args and kwargs of a call the spec refused with ``error``, written as
        the sample call was (:meth:`as_captured`); a refusal of that call names each path as
        this call spells it (:meth:`named_as_called`)."""
        spelled_args, spelled_kwargs = self.as_captured(args, kwargs, error)
        try:
            tensors = self.spec.flatten(spelled_args, spelled_kwargs)
        except SpecMismatchError as refused:
            raise self.named_as_called(refused, args, kwargs, error) from None
        return tensors, spelled_args, spelled_kwargs

    def named_as_called(
        self,
        refused: SpecMismatchError,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        missing: SpecMismatchError | None = None,
    ) -> SpecMismatchError:
        """``refused``, an error of ``(args, kwargs)`` written as the sample call was, naming
        its path as the call spells it (``kwargs['x']`` where the sample passed ``args[0]``);
        ``missing`` (the call's own error) where that argument is one the call leaves to a
        default of its parameter, which the sample passed otherwise."""
        if self._spelling is None:
            return refused
        return self._spelling.named_as_called(refused, args, kwargs, missing)

    def _positional_mismatch(
        self, args: tuple[Any, ...], error: SpecMismatchError
    ) -> SpecMismatchError:
        """The error of a call of positional args only that the args' spec refused, as the
        call spec words it: a positional argument missing or extra is named by its path
        (``args[1]: missing (expected float32[3, 4])``), where the args' spec says only
        ``args: expected a tuple of length 2``."""
        try:
            self.spec.flatten(args, None)
        except SpecMismatchError as worded:
            return worded
        return error

    def _swap_guards(self) -> bool:
        latest, previous = self._guards  # type: ignore[misc]
        self._guards = (previous, latest)
        return True

    def check_layouts(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse a tensor in another memory format than its sample (channels_last where the
        sample was contiguous, or the reverse; a call passes its tensors here where some
        strides differ from the samples').

        Eager's convolutions (and what follows them) pick their kernels, and so their rounding
        and their outputs' memory format, by their input's; a replay runs the kernels of capture
        and hands back outputs laid out as then. Other strides in the same format (a slice of a
        larger tensor, a transposed one) are copied into the static buffer and accepted: the
        outputs then have the capture's strides, where an elementwise op's in eager would follow
        the input's order in memory.
        """
        seen = self._layouts_seen
        for i, (tensor, strides) in enumerate(zip(tensors, self.strides, strict=True)):
            now = tensor.stride()
            if now == strides or (i, now) in seen:
                continue
            memory_format = _suggest_memory_format(tensor)
            expected = self._layouts[i]
            if memory_format is not expected:
                path = self.paths[i]
                captured = _describe_format(expected)
                raise SpecMismatchError(
                    f"{path}: laid out {_describe_format(memory_format)} (strides {now}), captured "
                    f"{captured} (strides {strides}): eager's kernels and its outputs' memory "
                    "format follow an input's, a replay keeps the capture's; pass it as captured "
                    f"(.contiguous(memory_format=torch.{captured})), or graph with a sample laid "
                    "out like it",
                    path=path,
                )
            if len(seen) < 256:  # strides of calls with fixed shapes: few kinds
                seen[(i, now)] = None

    def check_key_orders(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse a dict whose keys, or keywords the callable collects in its ``**kwargs``,
        come in another order than at capture (the structure matched, so every step of the
        way is there)."""
        found = self.key_order_difference(args, kwargs)
        if found is None:
            return
        path, difference = found
        if path == "kwargs":
            follows = "their order (kwargs.values(), a concatenation)"
            advice = "pass them in the captured order"
        else:
            follows = "the key order (d.values(), a sum over the dict)"
            advice = "pass the keys in the captured order"
        raise SpecMismatchError(
            f"{path}: {difference}; a replay runs the callable as captured, so whatever "
            f"follows {follows} would not follow this call's; {advice}",
            path=path,
        )

    def key_order_difference(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[str, str] | None:
        """The path of the first dict (or ``kwargs``, for the keywords the callable collects in
        its ``**kwargs``) whose keys come in another order than at capture, and how (``None``:
        none); the call's structure matched."""
        found = self._key_orders.difference(args, kwargs) if self._key_orders else None
        if found is None:
            return None
        path, keys, expected = found
        if path == "kwargs":
            return path, (
                f"the keywords {list(keys)!r} go to the callable's **kwargs in this order, "
                f"captured in the order {list(expected)!r}"
            )
        return path, (
            f"a dict with its keys in the order {list(keys)!r}, captured in the order "
            f"{list(expected)!r}"
        )

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with ``tensors`` (in capture order) at the tensor leaves."""
        return self.spec.unflatten(tensors)

    def describe(self) -> str:
        """The captured inputs, e.g. ``args=(float32[2, 4](grad),), kwargs={}``."""
        return repr(self.spec)[len("CallSpec(") : -1]

    def _explain(self, tensors: list[Any], grad_enabled: bool) -> SpecMismatchError:
        return self.first_mismatch(tensors, grad_enabled) or SpecMismatchError(
            "the inputs do not match the captured ones"
        )

    def first_mismatch(
        self, tensors: Sequence[Any], grad_enabled: bool, *, shapes: bool = True
    ) -> SpecMismatchError | None:
        """The error naming the first input tensor that differs from capture, or ``None``.

        ``shapes=False`` compares everything but the shapes (the shape buckets' dispatch does).
        """
        for path, tensor, (shape, dtype, device, requires_grad) in zip(
            self.paths, tensors, self._expected, strict=True
        ):
            if shapes:
                expected = f"{dtype_name(dtype)}[{', '.join(map(str, shape))}] on {device}"
            else:
                expected = f"a {dtype_name(dtype)} tensor on {device}"
            if not isinstance(tensor, torch.Tensor):
                found = f"an object of type {type(tensor).__module__}.{type(tensor).__qualname__}"
                return SpecMismatchError(f"{path}: expected {expected}, got {found}", path=path)
            why = unsupported_tensor(tensor)
            if why is not None:
                return SpecMismatchError(f"{path}: expected {expected}, got {why}", path=path)
            if shapes:
                shape_found = ", ".join(map(str, tensor.shape))
                found = f"{dtype_name(tensor.dtype)}[{shape_found}] on {tensor.device}"
            else:
                found = f"a {dtype_name(tensor.dtype)} tensor on {tensor.device}"
            if found != expected:
                return SpecMismatchError(f"{path}: expected {expected}, got {found}", path=path)
            if tensor.requires_grad and not requires_grad and grad_enabled:
                return SpecMismatchError(
                    f"{path}: requires grad, but was captured without requires_grad, so no "
                    "gradient would reach it; pass a sample that requires grad when capturing",
                    path=path,
                )
        return None
