"""Outputs that share memory in eager, handed out by a replay with the same relations.

In eager, ``return h, h`` gives one tensor twice, ``return h, h[0]`` a view of the other output
(``h[0]._base is h``), and ``return x`` or ``return x[0]`` the caller's input itself or a view
of it: an in-place change through one is seen through the other. A replay's outputs are static
buffers of their own, so :func:`find_output_aliases` records at capture, from the first warmup's
outputs, which output is another one (or an input), or a view of one, and
:meth:`OutputAliases.hand_out` rebuilds those relations on every replay from the outputs handed
out (views by ``as_strided`` with the captured size, stride and offset, under the caller's grad
mode, so autograd sees an ordinary view; one that needs grad by the view ops eager's was made
with, as their backwards hand on the grad in eager's layout: ``h.t()``'s keeps a ``.sum()``
loss's expanded grad expanded, which a BatchNorm's backward rounds otherwise than a dense one).
A callable whose outputs share no memory has no
``OutputAliases`` and pays nothing. What a replay cannot give as eager does is refused at
capture, naming the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._errors import DualgraphError
from ._address_ranges import storage_key
from ._capture_failure import Refused

__all__ = ["OutputAliases", "find_output_aliases", "is_dense"]

_ADVICE = "return a copy of one of them (.clone()) in the callable"


@dataclass(frozen=True)
class _Step:
    """Output ``output`` is made from ``source`` (an output, or an input where ``from_input``).

    ``size`` ``None``: the source itself (detached where ``detach``); else a view of it with
    this size and stride, ``offset`` elements past the source's storage offset. ``conj`` and
    ``neg``: the output's conjugate or negative bit is the other one than the source's
    (``x.conj()``: the same memory, read conjugated), so the view made flips it. ``parameter``:
    the output is this parameter itself (``return h, self.weight``), handed out as eager does;
    or, for a module tensor that needs no grad (a buffer, a frozen parameter), a view of it
    (``size``) or an alias (``detach``), so that a change through the output reaches it.
    """

    output: int
    source: int
    from_input: bool = False
    detach: bool = False
    size: tuple[int, ...] | None = None
    stride: tuple[int, ...] = ()
    offset: int = 0
    source_stride: tuple[int, ...] = ()  # from an input: the input's layout at capture
    conj: bool = False
    neg: bool = False
    parameter: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # makes the view from its source with eager's view ops (held by a meta tensor), or None
    view: Callable[[torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )


@dataclass(frozen=True)
class OutputAliases:
    """How a replay hands out outputs that are, or view, other outputs or inputs (see above)."""

    steps: tuple[_Step, ...]  # sources before the outputs made from them
    input_views: tuple[_Step, ...]  # views of inputs: the input must keep its captured layout

    @property
    def handed_out(self) -> frozenset[int]:
        """The outputs handed out as another tensor than the replay's own (an input, a
        parameter, another output or a view of one): their grads go to that tensor, so the
        backward never gets one for them, and must not differentiate them (a view's backward
        pads with ``0.0``, which turns a ``-0.0`` of the source's grad into ``0.0``)."""
        return frozenset(step.output for step in self.steps)

    def check_inputs(
        self,
        name: str,
        tensors: Sequence[torch.Tensor],
        paths: Sequence[str],
        out_paths: Sequence[str],
    ) -> None:
        """Refuse an input of another layout than at capture that an output is, or is a view of."""
        for step in self.input_views:
            tensor = tensors[step.source]
            if step.size is None:
                if tensor.is_conj() or tensor.is_neg() or not _walks_as(tensor, step.source_stride):
                    _refuse_returned_input(name, step, tensor, paths, out_paths)
                continue
            if not _walks_as(tensor, step.source_stride):
                path = paths[step.source]
                raise DualgraphError(
                    f"{name}: output{out_paths[step.output]} is a view of {path}, captured with "
                    f"strides {step.source_stride}; this call's {path} has strides "
                    f"{tensor.stride()}, of which a replay cannot make eager's view. Pass "
                    f"{_laid_out(path, tensor, step.source_stride)}, or {_ADVICE}"
                )

    def hand_out(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """The outputs with the captured relations: ``outputs`` are the replay's own."""
        result = list(outputs)
        for step in self.steps:
            held = step.parameter
            if held is not None and step.size is None and not step.detach:
                result[step.output] = held
                continue
            if held is not None:
                base = held
            else:
                base = inputs[step.source] if step.from_input else result[step.source]
            if step.detach:
                base = base.detach()
            if step.view is not None:
                base = step.view(base)
            elif step.size is not None:
                base = base.as_strided(step.size, step.stride, base.storage_offset() + step.offset)
            if step.conj:
                base = base.conj()
            if step.neg:
                base = torch._neg_view(base)
            result[step.output] = base
        return tuple(result)


def find_output_aliases(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    out_paths: Sequence[str],
    input_paths: Sequence[str],
    parameters: Sequence[torch.Tensor] = (),
    held: Sequence[torch.Tensor] = (),
) -> OutputAliases | None:
    """The relations among ``outputs`` (and with ``inputs``) a replay must keep, or ``None``.

    ``outputs``: the flat outputs of a warmup call on the static ``inputs``. ``parameters``:
    the callable's module's (or the modules its code names), each of which an output may be
    itself (eager returns the ``Parameter``, a leaf; a replay's output is a copy with a history
    of its own). ``held``: the module tensors needing no grad (buffers, frozen parameters):
    an output that is one, or shares its memory needing no grad itself (``self.mask[0]``), is
    handed out as it or a view of it, as eager's (a change through it changes the module).
    Raises :class:`Refused` naming the outputs where a replay cannot give eager's sharing.
    """
    parameter_ids = {id(p): p for p in parameters}
    held_ids = {id(t): t for t in held}
    storage_of_held: dict[int, torch.Tensor] = {}
    for tensor in held:
        if tensor.numel() and not tensor.requires_grad and tensor.layout is torch.strided:
            storage_of_held.setdefault(storage_key(tensor), tensor)
    steps: list[_Step] = []
    input_views: list[_Step] = []
    first: dict[int, int] = {}  # id of an output tensor: its first position
    storage_of_input: dict[int, int] = {}
    for i, tensor in enumerate(inputs):
        if tensor.numel():
            storage_of_input.setdefault(storage_key(tensor), i)
    groups: dict[int, list[int]] = {}  # storage: distinct output tensors' positions
    for k, tensor in enumerate(outputs):
        if id(tensor) in first:
            continue
        first[id(tensor)] = k
        position = next((i for i, t in enumerate(inputs) if t is tensor), None)
        if position is not None:
            # The input itself, maybe through an op that returns its input only where it is
            # laid out so (x.contiguous(), x.resolve_conj()): checked at each call.
            step = _Step(k, position, from_input=True, source_stride=tensor.stride())
            steps.append(step)
            input_views.append(step)
            continue
        parameter = parameter_ids.get(id(tensor), held_ids.get(id(tensor)))
        if parameter is not None:
            steps.append(_Step(k, k, parameter=parameter))
            continue
        if not tensor.numel():  # shares no element: a view only by its _base
            # (its layout at the call is not checked: a view with no element is any layout)
            empty = _empty_view(k, tensor, inputs, outputs, held_ids, out_paths)
            if empty is not None:
                steps.append(empty)
            continue
        storage = storage_key(tensor)
        owner = storage_of_held.get(storage)
        if owner is not None and not tensor.requires_grad and tensor.dtype == owner.dtype:
            steps.append(_held_view(k, tensor, owner))
            continue
        source = storage_of_input.get(storage)
        if source is not None:
            step = _input_view(k, source, tensor, inputs[source], out_paths, input_paths)
            steps.append(step)
            input_views.append(step)
            continue
        groups.setdefault(storage, []).append(k)
    for members in groups.values():
        if len(members) > 1:
            steps += _views_within(members, outputs, out_paths)
    # The views (with their nodes) made in the order eager's forward made them: the engine adds
    # the grads meeting at their base in the order of their nodes, the latest made first.
    steps.sort(key=lambda step: _made_at(outputs[step.output]))
    # An output met again is the tensor at its first position, whatever that one became.
    steps += [
        _Step(k, first[id(tensor)]) for k, tensor in enumerate(outputs) if first[id(tensor)] != k
    ]
    if not steps:
        return None
    views = {id(step): _with_view_ops(step, outputs, inputs) for step in steps}
    return OutputAliases(
        steps=tuple(views[id(s)] for s in steps),
        input_views=tuple(views[id(s)] for s in input_views),
    )


def _with_view_ops(
    step: _Step, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> _Step:
    """``step`` making its view by the ops eager's output was made with, where it is a view
    needing grad of its source itself (found on the first warmup, which records views' ops).

    Their backwards hand on the grad as eager's do (``h.t()``'s and ``h.view(-1)``'s keep an
    expanded grad expanded), where ``as_strided``'s makes it dense, which kernels such as
    BatchNorm's backward round otherwise. The ops are kept on a ``meta`` stand-in of the
    source, so no memory of the warmup stays held. Else ``step`` as it is (``as_strided``).
    """
    if step.size is None or step.parameter is not None or step.detach or step.conj or step.neg:
        return step
    tensor = outputs[step.output]
    source = inputs[step.source] if step.from_input else outputs[step.source]
    if not tensor.requires_grad or tensor._base is not source:
        return step
    stand_in = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device="meta")
    with torch.autograd._force_original_view_tracking(True):
        held: torch.Tensor | None = tensor._view_func(stand_in)  # type: ignore[attr-defined]
        view = getattr(held, "_view_func", None) if held is not None and held._is_view() else None
        if view is None:
            return step
        made = view(source.detach())
    if (
        tuple(made.shape) != step.size
        or made.stride() != step.stride
        or made.storage_offset() - source.storage_offset() != step.offset
        or made.is_conj() != source.is_conj()
        or made.is_neg() != source.is_neg()
    ):
        return step
    return replace(step, view=view)


def _empty_view(
    k: int,
    tensor: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    held: dict[int, torch.Tensor],
    out_paths: Sequence[str],
) -> _Step | None:
    """Output ``k``, with no element, as a view of what eager's is a view of (its ``_base``:
    an input, another output, a module tensor needing no grad), or ``None``: ``x[:0]`` shares
    no memory, but is ``x``'s view (``_base``, and a grad to ``x`` through its node)."""
    base = tensor._base
    if base is None:
        return None
    for i, source in enumerate(inputs):
        if source is base:
            if tensor.requires_grad != source.requires_grad or tensor.dtype != source.dtype:
                return None  # (made under no_grad: a tensor of its own, as before)
            return _view_step(k, i, tensor, source, from_input=True)
    owner = held.get(id(base))
    if owner is not None and not tensor.requires_grad and tensor.dtype == owner.dtype:
        return _held_view(k, tensor, owner)
    root = next((j for j, t in enumerate(outputs) if t is base), None)
    if root is None or tensor.dtype != base.dtype:
        return None
    if tensor.requires_grad and not base.requires_grad:
        raise Refused(
            f"output{out_paths[k]} requires grad and is a view of output{out_paths[root]}, "
            f"which does not (a detached alias), which a replay cannot hand out as eager "
            f"does; {_ADVICE}"
        )
    return _view_step(k, root, tensor, base, detach=base.requires_grad and not tensor.requires_grad)


def _view_step(
    k: int, source_index: int, tensor: torch.Tensor, source: torch.Tensor, **how: Any
) -> _Step:
    """Output ``k`` made as a view of ``source`` (at ``source_index``) laid out as ``tensor``:
    its size, stride, offset past ``source``'s and the conjugate and negative bits it flips;
    ``how``: the step's other fields (``from_input``, ``detach``, ``parameter``)."""
    if how.get("from_input"):
        how["source_stride"] = source.stride()
    return _Step(
        k,
        source_index,
        size=tuple(tensor.shape),
        stride=tensor.stride(),
        offset=int(tensor.storage_offset() - source.storage_offset()),
        conj=tensor.is_conj() != source.is_conj(),
        neg=tensor.is_neg() != source.is_neg(),
        **how,
    )


def _made_at(tensor: torch.Tensor) -> int:
    """When eager made ``tensor``'s autograd node (its sequence number); -1 for a tensor
    without one (a leaf, a detached alias), which a replay hands out without a node."""
    node = tensor.grad_fn
    return -1 if node is None else int(node._sequence_nr())


def _held_view(k: int, tensor: torch.Tensor, owner: torch.Tensor) -> _Step:
    """Output ``k``, sharing the memory of the module tensor ``owner`` (needing no grad): an
    alias of it (``.detach()``, ``.data``) or a view of it, made from it on every call."""
    conj, neg = tensor.is_conj() != owner.is_conj(), tensor.is_neg() != owner.is_neg()
    if (
        tensor._base is None
        and tensor.shape == owner.shape
        and tensor.stride() == owner.stride()
        and tensor.storage_offset() == owner.storage_offset()
        and not (conj or neg)
    ):
        return _Step(k, k, detach=True, parameter=owner)
    return _view_step(k, k, tensor, owner, parameter=owner)


def _input_view(
    k: int,
    i: int,
    tensor: torch.Tensor,
    source: torch.Tensor,
    out_paths: Sequence[str],
    input_paths: Sequence[str],
) -> _Step:
    # The static inputs are leaves of their own: a view of one has it as its base.
    if tensor._base is not source or tensor.requires_grad != source.requires_grad:
        raise Refused(
            f"output{out_paths[k]} shares memory with {input_paths[i]} without being it or a "
            f"view of it (e.g. .detach() or .data of it), which a replay cannot hand out as "
            f"eager does; {_ADVICE}"
        )
    if tensor.dtype != source.dtype:
        raise Refused(
            f"output{out_paths[k]} is a view of {input_paths[i]} as another dtype, which a "
            f"replay cannot hand out as eager does; {_ADVICE}"
        )
    return _view_step(k, i, tensor, source, from_input=True)


def _views_within(
    members: list[int],
    outputs: Sequence[torch.Tensor],
    out_paths: Sequence[str],
) -> list[_Step]:
    """Steps for distinct outputs that share one storage (none is an input's), one dtype.

    Each output whose elements another one (a root: dense, so its elements are one span of
    memory) holds is made from that root; outputs that share no element (``h[0]``, ``h[1]``)
    stay apart, as they are in eager.
    """
    # Dense ones first (only a dense one can hold another: an expanded or unfolded view counts
    # more elements than the output it views), largest first; among equals a tensor of its
    # own, requiring grad, before a view or an alias.
    order = sorted(
        members,
        key=lambda k: (
            not is_dense(outputs[k]),
            -outputs[k].numel(),
            not outputs[k].requires_grad,
            outputs[k]._base is not None,
            k,
        ),
    )
    dtypes = {outputs[k].dtype for k in members}
    if len(dtypes) > 1:
        a, b = members[0], next(k for k in members if outputs[k].dtype != outputs[members[0]].dtype)
        raise Refused(
            f"output{out_paths[a]} and output{out_paths[b]} share memory as different dtypes, "
            f"which a replay cannot hand out as eager does; {_ADVICE}"
        )
    roots: list[int] = []
    steps: list[_Step] = []
    for k in order:
        tensor = outputs[k]
        root = next((r for r in roots if _covers(outputs[r], tensor)), None)
        if root is None:
            clash = next((r for r in roots if _overlap(outputs[r], tensor)), None)
            if clash is not None:
                raise Refused(
                    f"output{out_paths[clash]} and output{out_paths[k]} share memory, but "
                    f"neither holds all of the other's (overlapping views of one tensor), "
                    f"which a replay cannot hand out as eager does; {_ADVICE}"
                )
            roots.append(k)
            continue
        base = outputs[root]
        if tensor.requires_grad and not base.requires_grad:
            raise Refused(
                f"output{out_paths[k]} requires grad and shares memory with output"
                f"{out_paths[root]}, which does not (a detached alias), which a replay cannot "
                f"hand out as eager does; {_ADVICE}"
            )
        detach = base.requires_grad and not tensor.requires_grad
        same_layout = (
            tensor.shape == base.shape
            and tensor.stride() == base.stride()
            and tensor.storage_offset() == base.storage_offset()
        )
        conj, neg = tensor.is_conj() != base.is_conj(), tensor.is_neg() != base.is_neg()
        if detach and same_layout and tensor._base is None and not (conj or neg):
            steps.append(_Step(k, root, detach=True))  # .detach() of it
        else:
            steps.append(_view_step(k, root, tensor, base, detach=detach))
    return steps


def _walks_as(tensor: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``tensor`` lays its elements out as one of its shape with ``stride`` does: the
    strides of dims of one element never matter (to where an element lies, so to any view).

    >>> _walks_as(torch.ones(4, 1).t(), (4, 1)), _walks_as(torch.ones(3, 2).t(), (3, 1))
    (True, False)
    """
    if tensor.stride() == stride or not tensor.numel():
        return True
    return all(
        n == 1 or a == b for n, a, b in zip(tensor.shape, tensor.stride(), stride, strict=True)
    )


def _refuse_returned_input(
    name: str,
    step: _Step,
    tensor: torch.Tensor,
    paths: Sequence[str],
    out_paths: Sequence[str],
) -> None:
    path = paths[step.source]
    bits = [
        bit for bit, on in (("conjugate", tensor.is_conj()), ("negative", tensor.is_neg())) if on
    ]
    now = f"strides {tensor.stride()}" + "".join(f", a {bit} bit" for bit in bits)
    laid_out = _laid_out(path, tensor, step.source_stride)
    if bits:
        laid_out += " and without that bit (.resolve_conj(), .resolve_neg())"
    raise DualgraphError(
        f"{name}: output{out_paths[step.output]} was {path} itself at capture, where the "
        f"callable saw it with strides {step.source_stride}; this call's {path} has {now}, for "
        f"which eager may return another tensor (x.contiguous() and x.resolve_conj() return x "
        f"itself only where it is laid out so), which a replay cannot tell. Pass {laid_out}, "
        f"or {_ADVICE}"
    )


def _laid_out(path: str, tensor: torch.Tensor, stride: tuple[int, ...]) -> str:
    """How to pass ``path`` laid out with ``stride``, as the callable saw it at capture: the
    sample's layout where it was dense, else a dense copy of it (not always ``.contiguous()``).

    >>> _laid_out("x", torch.ones(2, 3), (3, 1))
    'x laid out with strides (3, 1) (.contiguous()), as the callable saw it at capture'
    >>> _laid_out("x", torch.ones(2, 3), (1, 2))[:70]
    'x laid out with strides (1, 2) (x.new_empty_strided((2, 3), (1, 2)).co'
    """
    shape = tuple(tensor.shape)
    if _walks_as(tensor.new_empty(shape), stride):
        how = ".contiguous()"
    else:
        how = f"{path}.new_empty_strided({shape}, {stride}).copy_({path})"
    return f"{path} laid out with strides {stride} ({how}), as the callable saw it at capture"


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The first and one past the last element of ``tensor`` in its storage (non-empty)."""
    start = int(tensor.storage_offset())
    last = start + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, last + 1


def _covers(root: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is one of ``root``'s (``root`` dense)."""
    if not is_dense(root):
        return False
    start, end = _span(root)
    low, high = _span(tensor)
    return start <= low and high <= end


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one span of memory, each once (any dim order:
    contiguous, channels_last, a transpose).

    >>> is_dense(torch.ones(2, 3).t()), is_dense(torch.ones(2, 3)[:, :2])
    (True, False)
    """
    expected = 1
    for size, stride in sorted(
        (pair for pair in zip(tensor.shape, tensor.stride(), strict=True) if pair[0] != 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one storage) have an element in common."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    # Interleaved (h[:, 0] and h[:, 1]): mark one's elements, look for the other's.
    marks = torch.zeros(max(a1, b1), dtype=torch.bool)
    marks.as_strided(a.shape, a.stride(), a.storage_offset()).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), b.storage_offset()).any())
