"""What a replay's backward asks before it writes ``.grad``: aliasing, holders, the engine.

Whether a ``.grad`` is its accumulator's memory or overlaps another's, who else holds an
accumulator, and whether the autograd engine runs a parameter's ``AccumulateGrad`` node in this
backward (``_replay.py`` calls these on its slow paths).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import get_gradient_edge

from .._errors import DualgraphError

__all__ = [
    "GradProblem",
    "aliases",
    "grad_accumulator",
    "grad_problem",
    "grads_overlap",
    "held_by_a_graph",
    "holders",
    "in_place_refusal",
    "own_hooks",
    "span",
    "will_engine_execute_node",
    "will_execute_or_capture",
]

_STRIDED = torch.strided
_storage_use_count = torch._C._storage_Use_Count
will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)
_node_of = getattr(
    torch.autograd.graph, "_get_grad_fn_or_grad_acc", lambda t: get_gradient_edge(t).node
)
_no_torch_function = torch._C.DisableTorchFunctionSubclass
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def grad_accumulator(tensor: torch.Tensor) -> Any:
    """A leaf's ``AccumulateGrad`` node (made if none is alive).

    torch.autograd.graph's lookup, without the ``GradientEdge`` that ``get_gradient_edge`` wraps
    it in, and past a tensor subclass's ``__torch_function__`` (the lookup differentiates
    ``tensor.view_as(tensor)``; a subclass that hands back plain tensors, as Transformer
    Engine's FP8 weights do, would add a node of its own in between).

    >>> w = torch.ones(2, requires_grad=True)
    >>> type(grad_accumulator(w)).__name__
    'AccumulateGrad'
    """
    if type(tensor) in _PLAIN:
        return _node_of(tensor)
    with _no_torch_function():
        return _node_of(tensor)


_PROBE_KEY = "dualgraph: looked up"


def held_by_a_graph(tensor: torch.Tensor) -> bool:
    """Whether something besides ``tensor`` keeps its ``AccumulateGrad`` node alive: an
    autograd graph that reaches it (an output or loss kept from an earlier call), or DDP.

    A leaf keeps only a weak reference to its node; a node nobody holds goes when the lookup's
    reference does, and the next lookup makes a new one. So the node found first is marked, and
    the mark is still there at the second lookup only where someone else holds that node.

    >>> w = torch.ones(2, requires_grad=True)
    >>> held_by_a_graph(w)
    False
    >>> kept = (w * 2).sum()
    >>> held_by_a_graph(w)
    True
    """
    node = grad_accumulator(tensor)
    if node is None:
        return False
    node.metadata[_PROBE_KEY] = True
    del node
    again = grad_accumulator(tensor)
    return again is not None and bool(again.metadata.pop(_PROBE_KEY, False))


def own_hooks(tensor: torch.Tensor, which: str = "_backward_hooks") -> Any:
    """The hook dict ``which`` of ``tensor`` itself (``None`` if it has none), to change it.

    Read past a tensor subclass's ``__torch_function__``, which may hand back a copy of it
    (one that rebuilds the containers it returns), in which a change would be lost.

    >>> w = torch.ones(2, requires_grad=True)
    >>> handle = w.register_hook(lambda grad: grad)
    >>> own_hooks(w) is w._backward_hooks
    True
    """
    if type(tensor) in _PLAIN:
        return getattr(tensor, which, None)
    with _no_torch_function():
        return getattr(tensor, which, None)


def aliases(grad: torch.Tensor, accumulator: torch.Tensor, name: str) -> bool:
    """Whether ``grad`` (a ``.grad`` that is not ``accumulator``) is its memory, laid out alike.

    ``p.grad = p.grad.detach()`` (or ``.data``) makes such a ``.grad``: adding into the
    accumulator adds into it, as eager adds into ``.grad`` in place. Any other overlap cannot be
    replayed. A ``.grad`` that is not strided (sparse) is never its memory.
    """
    if grad.layout is not _STRIDED or grad.shape != accumulator.shape:
        return False  # another shape is grad_problem's to find (a prefix of its memory too)
    if grad.untyped_storage().data_ptr() != accumulator.untyped_storage().data_ptr():
        return False
    if grad.data_ptr() == accumulator.data_ptr() and grad.stride() == accumulator.stride():
        return True
    raise DualgraphError(
        f"{name}: .grad shares memory with the graph's grad buffer in another layout, which a "
        "replay cannot add into; set .grad to None or to a tensor of its own"
    )


def span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes a strided tensor's elements lie in: ``[start, end)``."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + (last + 1) * tensor.element_size()


def _name(of: Any) -> str:
    """``float32`` for a dtype or a tensor of that dtype."""
    return str(getattr(of, "dtype", of)).removeprefix("torch.")


class GradProblem(NamedTuple):
    """A ``.grad`` no accumulator can stand in for (see :func:`grad_problem`)."""

    name: str  # its parameter's
    #: What was found and what eager does, which autograd does as eager; ``None`` where nothing
    #: can (memory shared with another parameter's ``.grad``).
    found: str | None
    #: Its parameter, where eager's ``AccumulateGrad`` raises for it: autograd, handed its grad
    #: alone, raises the same error, having changed no other ``.grad``.
    raises_for: torch.Tensor | None = None
    #: What makes ``"in_graph"`` able to add into it (``None``: a ``.grad`` of its own).
    remedy: str | None = None


def grad_problem(
    pending: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]],
    accumulator_spans: Sequence[tuple[int, int]],
    names: dict[torch.Tensor, str],
) -> GradProblem | None:
    """A ``.grad`` of ``pending`` (each not its accumulator) that no accumulator can stand in
    for; ``None`` if there is none.

    Eager adds into a sparse ``.grad`` by replacing it with the dense sum, into a ``.grad`` of
    another dtype than the parameter's (allowed by ``param.grad_dtype``, e.g. float32 grads of
    bfloat16 weights) in that dtype, and makes a new ``.grad`` of the ``grad_dtype``; copied into
    the accumulators (of the parameter's dtype) and back, these would be rounded or refused by
    torch, so autograd must add them (what was found, expected against found). Eager's
    in-place add into a ``.grad`` it cannot write (:func:`_unwritable`) raises, or adds into
    overlapping elements one after another; the copy back of an accumulator would raise only
    after the replay changed other ``.grad`` tensors, or write each element once, so autograd
    must add into it too. Eager adds into a ``.grad`` that shares memory with another
    parameter's ``.grad`` (or accumulator) twice, which nothing reproduces (``None``).

    >>> weight = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> accumulator = torch.zeros(2, dtype=torch.bfloat16)
    >>> grad_problem([(weight, accumulator, None, None)], [span(accumulator)], {weight: "w"})
    >>> expanded = torch.zeros(1, dtype=torch.bfloat16).expand(2)
    >>> grad_problem([(weight, accumulator, expanded, None)], [span(accumulator)], {weight: "w"})
    ... # doctest: +ELLIPSIS
    GradProblem(name='w', found=".grad's elements share memory (an expanded tensor?): ...)
    """
    spans: list[tuple[int, int, str | None]] = [(*span, None) for span in accumulator_spans]
    for param, accumulator, grad, _ in pending:
        if grad is None:
            # A new .grad will be the accumulator (or a clone): of the parameter's dtype, which
            # torch refuses as the .grad of a parameter whose grad_dtype is another one.
            wanted = getattr(param, "grad_dtype", None)
            if wanted is not None and wanted != accumulator.dtype:
                return GradProblem(
                    names[param],
                    (
                        f"grad_dtype is {_name(wanted)}, the parameter {_name(param)}: eager "
                        "makes a .grad of the grad_dtype"
                    ),
                    remedy="set its grad_dtype to None (a .grad of the parameter's dtype)",
                )
            continue
        if grad.layout is not _STRIDED:
            return GradProblem(
                names[param],
                (
                    f".grad is {grad.layout} (expected torch.strided): eager replaces it by the "
                    "dense sum"
                ),
            )
        if grad.device != accumulator.device:  # .data set to memory on another device
            return GradProblem(
                names[param],
                (
                    f".grad is on {grad.device}, the parameter on {param.device}: eager's add "
                    "into it raises"
                ),
                param,
                remedy="set .grad to None or to a tensor on the parameter's device",
            )
        if grad.dtype != accumulator.dtype:
            return GradProblem(
                names[param],
                (
                    f".grad is {_name(grad)}, the parameter {_name(param)}: eager adds in the "
                    ".grad's dtype"
                ),
            )
        if grad.shape != accumulator.shape:  # .data set to a tensor of another shape
            return GradProblem(
                names[param],
                (
                    f".grad has shape {list(grad.shape)}, the parameter {list(param.shape)}: "
                    "eager's add into it raises"
                ),
                param,
                remedy="set .grad to None or to a tensor of the parameter's shape",
            )
        unwritable, raises = _unwritable(grad)
        if unwritable is not None:
            return GradProblem(names[param], unwritable, param if raises else None)
        spans.append((*span(grad), names[param]))
    spans.sort(key=operator.itemgetter(0, 1))
    end, owner = -1, None
    for start, stop, name in spans:
        if start < end and start < stop and (name is not None or owner is not None):
            return GradProblem(name or owner, None)  # type: ignore[arg-type]
        if stop > end:
            end, owner = stop, name
    return None


def grads_overlap(grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether two of ``grads`` (the parameters' ``.grad``) may share memory, which eager adds
    into once per parameter, in the order its backward reaches them (:func:`grad_problem`
    found memory shared; this tells that from a ``.grad`` that shares memory only with the
    graph's grad buffer of another parameter, which eager adds into once, as any ``.grad``).

    >>> flat = torch.zeros(4)
    >>> grads_overlap([flat[:2], flat[2:], None]), grads_overlap([flat[:3], flat[2:]])
    (False, True)
    """
    spans = sorted(span(g) for g in grads if g is not None and g.layout is _STRIDED)
    end = -1
    for start, stop in spans:
        if start < end and start < stop:
            return True
        end = max(end, stop)
    return False


def in_place_refusal(tensor: torch.Tensor) -> str | None:
    """Why torch refuses an in-place update of ``tensor`` here: ``"inference"`` (an inference
    tensor outside inference mode), ``"overlap"`` (elements that share memory for sure, e.g. an
    expanded tensor), or ``None``. One test for a mutated input and for a ``.grad``.

    >>> in_place_refusal(torch.zeros(1).expand(3)), in_place_refusal(torch.zeros(3))
    ('overlap', None)
    """
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        return "inference"
    if torch._debug_has_internal_overlap(tensor) == 1:  # 0: none, 1: for sure, 2: can't tell
        return "overlap"
    return None


def _unwritable(grad: torch.Tensor) -> tuple[str | None, bool]:
    """What stops eager's in-place add into a strided ``.grad`` from writing each element once
    (what was found, and what eager does), or ``None``; and whether eager raises."""
    refusal = in_place_refusal(grad)  # a backward never runs in inference mode
    if refusal == "inference":
        return (
            ".grad is an inference tensor: eager's in-place add into it raises outside "
            "inference mode"
        ), True
    if refusal == "overlap":
        return (
            ".grad's elements share memory (an expanded tensor?): eager's in-place add into it "
            "raises"
        ), True
    if torch._debug_has_internal_overlap(grad) == 2 and _may_overlap(grad):
        return (
            ".grad's elements overlap in memory: eager adds into each element in place, one "
            "after another"
        ), False
    return None, False


def _may_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may lie at one address: unless each dimension, by
    increasing stride, steps past all the elements of the dimensions below it."""
    extent = 1  # the elements the dimensions so far span, plus one
    for stride, size in sorted(zip(tensor.stride(), tensor.shape, strict=True)):
        if size > 1:
            if stride < extent:
                return True
            extent += (size - 1) * stride
    return False


def will_execute_or_capture(param: torch.Tensor) -> bool:
    """Whether this backward runs the ``AccumulateGrad`` node of ``param`` or captures its grad.

    The node is looked up, not kept: during a backward through a replay, whose Function has the
    parameter as an input, it exists already (the lookup makes none).
    """
    if will_engine_execute_node is None:
        return True
    if not param.requires_grad:  # frozen since the forward: autograd skips it, as eager does
        return False
    try:
        return bool(will_engine_execute_node(grad_accumulator(param)))
    except RuntimeError:  # raised for a leaf whose grad torch.autograd.grad captures
        return True


def holders(tensor: torch.Tensor, storage: int) -> tuple[int, int, int]:
    """References to ``tensor``: from Python, from C++ (another tensor's ``.grad``, a saved
    tensor, a view's base) and to its memory (``storage``, its storage's ``_cdata``: views,
    detached aliases)."""
    return (
        sys.getrefcount(tensor),
        tensor._use_count(),  # type: ignore[attr-defined]
        _storage_use_count(storage),
    )
