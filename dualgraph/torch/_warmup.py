"""Warmup, shared by both backends: eager forwards and backwards on the static buffers.

The first warmup call of each callable is also inspected, because a graph replays kernels and
not Python, and some eager behaviour has to be carried over or refused up front:

- inputs the callable updates in place (their version counters move, or, on that first call,
  their bits change: an update through ``.data``, F.batch_norm's running statistics): each
  replay copies the update back into the caller's tensor (where eager moved no version counter,
  without moving one); an update during backward is refused;
- outputs the backward reads (saved for backward): changing them in place is refused at backward;
  so are the parameters and buffers it reads (a module's, or those a function's code names);
- outputs that are, or view, another output or an input: each replay hands them out so
  (``_output_aliases.py``);
- tensors that require grad but are neither inputs nor parameters (a closure over another
  module's weights): refused, since a replay would give them no gradient;
- the output structure must stay the same from call to call.

Around all warmup calls (``module_tensors_kept``), a module's parameters and plain tensor
attributes (a function's: those its code names) are compared by bits: one any call changed is
refused and put back.

That first call also runs under the capture lint and the memory probe (``_probe.py``): the lint's
errors refuse the capture before anything is captured (``lint="error"``), and the findings and
the memory plan end up in each plan's diagnostics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._errors import DualgraphError, SpecMismatchError
from ._ambient import outside_autocast
from ._branch_reads import branch_reads
from ._capture_failure import Refused
from ._carried_attributes import set_since
from ._closed_over import named_by, plain_tensor_attributes
from ._cudnn_ops import cudnn_ops_run
from ._grad_mode_set import turns_grad_mode_on
from ._grad_order import reaching_order
from ._held_tensors import Held, held_tensors, modules_named_by
from ._kept_bytes import KeptBytes
from ._layouts import Layout, layout_of
from ._leaves import dtype_name
from ._output_aliases import OutputAliases, find_output_aliases
from ._params import (
    bytes_now,
    bytes_of,
    first_difference,
    is_plain,
    is_tensor_subclass,
    same_bytes,
    write_back,
)
from ._probe import WarmupProbe
from ._reach import trace_leaves, used_inside
from ._rng_rewinds import rng_rewinds
from ._saved_hooks import own_saved_tensors_hooks
from ._unobserved import unobserved as _unobserved
from ._watched_function import WatchedFunction

if TYPE_CHECKING:
    from ._capture_state import _Capture
    from ._params import ModuleTensors

__all__ = ["module_tensors_kept", "warmup", "watches_held"]


def warmup(item: _Capture, allow_unused: bool, *, inspect: bool) -> tuple[torch.Tensor | None, ...]:
    """One eager forward and backward on the static buffers; the first one is inspected."""
    return _warmup(item, allow_unused, inspect=inspect)


@contextlib.contextmanager
def watches_held() -> Iterator[None]:
    """Around several warmup calls: the watches of grad mode and tensor flag reads that each
    warmup forward enters (:func:`branch_reads`) stay installed in between.

    Each forward then adds its watcher to a list instead of replacing ``torch.Tensor``'s flags
    and putting them back: a change to a class also drops the interpreter's caches of lookups
    on it and its subclasses, which the next forward pays again. What is read between the
    warmup calls is noted by no warmup (the held watcher's notes are dropped).
    """
    with branch_reads(()):
        yield


@contextlib.contextmanager
def module_tensors_kept(item: _Capture) -> Iterator[None]:
    """Around all warmup calls: refuse a module tensor any of them changed, and put it back.

    A module tensor the call changes (a parameter through ``.data``, a kernel of its own that
    moves no version counter, a plain tensor attribute) would be changed again by the capture,
    and a replay would go on changing it; a forward may do so on some calls only (its own call
    counter). Compared by bits around every warmup call (buffers are compared by value over the
    whole capture and put back, ModuleTensors.left_as_found): a transient copy of this
    callable's parameters.
    """
    with _unobserved():
        # its .data too (no copy): a `.data = other` is put back by setting it again
        kept = [(name, t, t._version, t.data) for name, t in _writable_tensors(item)]
        # their bytes in one copy per device and dtype, compared at once
        kept_bytes = KeptBytes([t for _, t, _, _ in kept])
    try:
        yield
    finally:
        with _unobserved():
            # laid out anew (.data = other) or other bytes; the version read before putting back
            changed = [
                (name, t, t._version == version, kept_bytes.of(i), data)
                for i, (name, t, version, data) in ((i, kept[i]) for i in kept_bytes.changed())
            ]
            shown = _shown(changed[0][1], changed[0][3], changed[0][4]) if changed else ""
            del kept, kept_bytes
            _put_back(changed)
    if changed:
        name, t, quietly, _, _ = changed[0]
        kind = "parameter" if isinstance(t, torch.nn.Parameter) else "tensor"
        how = " without a version bump (.data, a kernel of its own)" if quietly else ""
        raise Refused(
            f"{name}: the callable updates this {kind} in place{how} ({shown}), so warmup and "
            "capture would change it as well, and a replay would go on changing it (dualgraph "
            "puts back only buffers); it is put back as it was. Register it as a buffer, or "
            "update it outside the graphed callable"
        )


def _writable_tensors(item: _Capture) -> list[tuple[str, torch.Tensor]]:
    """The tensors besides its inputs and buffers that the callable could change in place: a
    module's parameters (frozen too) and plain tensor attributes, or those a function's code
    names that ``ClosureUpdates`` does not put back (what requires grad: its parameters)."""
    module = item.request.module
    if module is not None:
        record, holders = item.module_tensors, [(type(module).__name__, module)]
    else:
        record, holders = item.code_tensors, modules_named_by(item.request.fn)
    if record is None:
        return []

    def writable(held: Held) -> bool:
        # put back otherwise: a module's buffers by left_as_found, a function's (and the
        # tensors its code names) by ClosureUpdates where they require no grad
        put_back = held.kind == "buffer" and (module is not None or not held.tensor.requires_grad)
        # a meta tensor holds no bits; a subclass's bits are not its values (an FP8 weight)
        return (
            not put_back
            and held.tensor.device.type != "meta"
            and not is_tensor_subclass(held.tensor)
        )

    return [(held.name, held.tensor) for held in held_tensors(record, holders, writable)]


def _moved(tensor: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``tensor`` no longer holds the memory and layout of ``data`` (``.data = ...``)."""
    return (
        tensor.data_ptr() != data.data_ptr()
        or tensor.dtype != data.dtype
        or tensor.shape != data.shape
        or tensor.stride() != data.stride()
    )


def _shown(tensor: torch.Tensor, copy: torch.Tensor, data: torch.Tensor) -> str:
    """What changed in ``tensor``, for the message: its memory, or its first changed element."""
    if _moved(tensor, data):
        return (
            f".data set from a {data.dtype} tensor {list(data.shape)} at {data.data_ptr():#x} to "
            f"a {tensor.dtype} tensor {list(tensor.shape)} at {tensor.data_ptr():#x}"
        )
    return first_difference(tensor, copy)


def _put_back(
    changed: Sequence[tuple[str, torch.Tensor, bool, torch.Tensor, torch.Tensor]],
) -> None:
    """Give the tensors the call changed their memory back and write the kept bits into it
    (:func:`write_back`: moving no version counter, as nothing ran for eager)."""
    for _, tensor, _, copy, data in changed:
        if _moved(tensor, data):
            tensor.data = data
        write_back(tensor, copy.view(tensor.dtype).view(tensor.shape))


_LEAF_UPDATED = "a leaf Variable that requires grad is being used in an in-place operation"


def _run(item: _Capture) -> Any:
    """One call of the callable on the static inputs; an input requiring grad updated in place
    is refused saying so (torch's words blame a leaf, which the caller's tensor may not be)."""
    try:
        return item.run()
    except RuntimeError as error:
        if _LEAF_UPDATED not in str(error):
            raise
        paths = [
            p
            for p, t in zip(item.request.inputs.paths, item.static_inputs, strict=True)
            if t.requires_grad
        ]
        if not paths:
            raise
        raise Refused(
            f"the callable updates in place a tensor that requires grad ({_LEAF_UPDATED}); "
            f"where that is an input requiring grad ({', '.join(paths)}: x += y, x.mul_(2)), "
            "eager's call gives the caller's tensor a new autograd history, which a replay, "
            "whose inputs are leaves of its own, cannot. Compute it out of place "
            "(x = x + y)"
        ) from error


def _refuse_inputs_given_a_history(item: _Capture) -> None:
    """Refuse an input whose sample needs no grad that the call updated in place with a value
    requiring grad (``x += self.offset``, ``cache[:, i] = k``).

    Eager's call gives the caller's tensor that autograd history. The static input kept it
    instead: the capture's forward (and each emulated replay) added to it, so the backward ran
    through the warmup's update too (``offset.grad`` twice eager's, or more), and on CUDA through
    ``AccumulateGrad`` nodes made on the warmup's stream, which failed the capture.

    >>> x = torch.zeros(2)
    >>> x += torch.ones(2, requires_grad=True)
    >>> type(x.grad_fn).__name__
    'AddBackward0'
    """
    paths = item.request.inputs.paths
    for i, t in enumerate(item.static_inputs):
        if i not in item.grad_input_indices and t.grad_fn is not None:
            raise Refused(
                f"{paths[i]}: an input that needs no grad, which the callable updates in place "
                f"with a value that requires grad (after the call it has an autograd history, "
                f"{type(t.grad_fn).__name__}: x += w, cache[:, i] = k): eager's call gives the "
                "caller's tensor that history, which a replay, whose inputs are buffers of its "
                "own, cannot (its backward would run through the earlier calls' updates too). "
                "Compute it out of place (x = x + w, torch.cat), or update it under "
                "torch.no_grad() where it needs no grad"
            )


def _refuse_changed_containers(item: _Capture) -> None:
    """Refuse a callable that changes the containers of its inputs in place
    (``labels = batch.pop("labels")``, ``batch["x"] = batch["x"] * 2``, a list's ``append``).

    Eager changes the caller's dict, list or object, and gets a fresh one on each call. The
    static containers kept the change instead, so the next warmup call failed with the
    callable's own error (``KeyError: 'labels'``) or torch's ('Trying to backward through the
    graph a second time'), or a key the callable added was missing from the caller's dict.

    >>> batch = {"x": torch.zeros(2), "labels": torch.zeros(2)}
    >>> _ = batch.pop("labels")
    >>> sorted(batch)
    ['x']
    """
    inputs = item.request.inputs
    try:
        leaves = inputs.spec.flatten(item.static_args, item.static_kwargs)
    except SpecMismatchError as error:
        path = error.path or "the inputs"
        found = str(error).removeprefix(f"{path}: ")
    else:
        changed = next(
            (
                i
                for i, (a, b) in enumerate(zip(leaves, item.static_inputs, strict=True))
                if a is not b
            ),
            None,
        )
        if changed is None:
            return
        path, found = inputs.paths[changed], "another value was put in its place"
    raise Refused(
        f"{path}: the callable changes the containers of its inputs in place (after the call: "
        f"{found}): eager changes the caller's dict, list or object, a replay runs no Python and "
        "leaves them as they were. Copy the container in the callable before changing it "
        "(batch = dict(batch)), and return what it adds as an output"
    )


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What an in-place op on a tensor's metadata changes: dtype, sizes, strides, memory."""
    return tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.data_ptr()


def _refuse_inputs_relaid(item: _Capture, layouts: Sequence[tuple[Any, ...]]) -> None:
    """Refuse an input whose sizes, strides, dtype or memory the callable changed in place
    (``mask.squeeze_(1)``, ``x.t_()``, ``x.resize_(...)``, ``x.data = ...``).

    Eager changes the caller's tensor. It changed the static input instead, so every call's
    copy into it failed with torch's broadcast error (``squeeze_``), or the next warmup saw
    another input and failed as 'the outputs differ from one call to the next'
    (``unsqueeze_``), naming neither the input nor the op.

    >>> mask = torch.ones(2, 1, 3)
    >>> before = _layout(mask)
    >>> _ = mask.squeeze_(1)
    >>> _layout(mask) == before
    False
    """
    paths = item.request.inputs.paths
    for i, (t, layout) in enumerate(zip(item.static_inputs, layouts, strict=True)):
        if _layout(t) != layout:
            dtype, shape, stride, _ = layout
            raise Refused(
                f"{paths[i]}: the callable changes this input's sizes, strides, dtype or memory "
                f"in place (x.squeeze_(), x.unsqueeze_(), x.t_(), x.resize_(), x.data = ...: "
                f"{dtype_name(dtype)}{list(shape)} with strides {stride} before the call, "
                f"{dtype_name(t.dtype)}{list(t.shape)} with strides {t.stride()} after): eager "
                "changes the caller's tensor, a replay's input is a buffer of its own, laid out "
                "once. Use the op that returns a new tensor (mask = mask.squeeze(1))"
            )


def _refuse_outputs_retaining_grad(flat: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    """Refuse an output the callable called ``retain_grad()`` on.

    Eager's output is that tensor, whose ``.grad`` the backward fills. A replay hands out a
    tensor of its own, whose ``.grad`` stayed ``None`` (with torch's warning about reading a
    non-leaf's ``.grad``).

    >>> h = torch.ones(2, requires_grad=True) * 2
    >>> h.retain_grad()
    >>> h.retains_grad
    True
    """
    for path, tensor in zip(paths, flat, strict=True):
        if tensor.retains_grad:
            raise Refused(
                f"output{path}: the callable calls retain_grad() on it: eager returns that "
                "tensor, whose .grad its backward fills, a replay hands out a tensor of its own, "
                "whose .grad would stay None. Call retain_grad() on the output the call returns"
            )


def _output_attributes(
    flat: Sequence[torch.Tensor], paths: Sequence[str], aliases: OutputAliases | None
) -> tuple[tuple[int, dict[str, Any]], ...]:
    """The Python attributes the callable set on the tensors it returns (``y.tag = "logits"``;
    Transformer Engine's fuser marks its outputs ``_do_not_clear``), by output position.

    Eager's output is that tensor, attributes included; a replay hands out a tensor of its own
    (or a view it makes), and on CUDA no Python runs to set them: the replay sets them again on
    each call's output. Only plain values can be (None, bools, numbers, strings, bytes, tuples
    of them): another object (a tensor, a list the caller may change) would be shared by every
    call's output, so it is refused, naming the output and the attribute. A parameter or buffer
    returned is handed out as itself, and keeps its own.

    >>> y = torch.ones(2) * 2
    >>> y.tag = "logits"
    >>> _output_attributes([y], ["[0]"], None)
    ((0, {'tag': 'logits'}),)
    """
    itself = frozenset(
        ()
        if aliases is None
        else (
            s.output
            for s in aliases.steps
            if s.parameter is not None and s.size is None and not s.detach
        )
    )
    found: list[tuple[int, dict[str, Any]]] = []
    for k, (path, tensor) in enumerate(zip(paths, flat, strict=True)):
        attributes = vars(tensor) if k not in itself else {}
        if not attributes:
            continue
        for name, value in attributes.items():
            if not is_plain(value):
                raise Refused(
                    f"output{path}: the callable sets the attribute {name!r} on it to a "
                    f"{type(value).__qualname__}, which eager's output carries; a replay hands out "
                    f"a tensor of its own, and can set only {_PLAIN_WORDS} on it again: this one "
                    "would be one object shared by every call's output. Return it beside the "
                    "tensor as an output, "
                    "or set it on the output after the call"
                )
        found.append((k, dict(attributes)))
    return tuple(found)


def _input_attributes(
    static_inputs: Sequence[torch.Tensor], before: Sequence[dict[str, Any]], paths: Sequence[str]
) -> tuple[tuple[int, dict[str, Any]], ...]:
    """The Python attributes the callable set on its input tensors during a call
    (``x.seen = True``; Transformer Engine's fuser marks its inputs ``_do_not_clear``), by
    input position: those new or rebound since ``before`` (each input's ``vars`` then).

    Eager sets them on the caller's tensor on every call; the warmup set them on a static
    input, and on CUDA no Python runs on a replay: the replay sets them again on each call's
    input tensor. Only plain values can be (see :func:`_output_attributes`); another object
    (a list, a tensor) is refused, naming the input and the attribute.

    >>> x = torch.ones(2)
    >>> before = [dict(vars(x))]
    >>> x._do_not_clear = True
    >>> _input_attributes([x], before, ["args[0]"])
    ((0, {'_do_not_clear': True}),)
    """
    found: list[tuple[int, dict[str, Any]]] = []
    for i, (path, tensor, old) in enumerate(zip(paths, static_inputs, before, strict=True)):
        attributes = set_since(vars(tensor), old)  # private names too (_do_not_clear)
        if not attributes:
            continue
        for name, value in attributes.items():
            if not is_plain(value):
                raise Refused(
                    f"{path}: the callable sets the attribute {name!r} on this input to a "
                    f"{type(value).__qualname__}: eager sets it on the caller's tensor, a "
                    "replay's input is a buffer of its own, and on CUDA no Python runs to set it "
                    f"again; only {_PLAIN_WORDS} are set again on each call's input. Return it "
                    "as an output, or set it "
                    "on the tensor you pass, outside the callable"
                )
        found.append((i, attributes))
    return tuple(found)


#: what :func:`is_plain` takes, in the words of a refusal
_PLAIN_WORDS = (
    "plain values (None, bools, numbers, strings, bytes, dtypes, devices, enum members, "
    "tuples of them)"
)


def _refuse_inputs_made_to_need_no_grad(item: _Capture) -> None:
    """Refuse an input requiring grad that the callable turned off (``y.requires_grad_(False)``,
    ``y.detach_()``): eager turns off the caller's tensor's, which then gets no grad; the
    static input's was turned off instead, and the warmup's backward failed with torch's 'One
    of the differentiated Tensors does not require grad', naming no input.

    >>> y = torch.zeros(2, requires_grad=True)
    >>> y.detach_().requires_grad
    False
    """
    paths = item.request.inputs.paths
    for i in item.grad_input_indices:
        if not item.static_inputs[i].requires_grad:
            raise Refused(
                f"{paths[i]}: the callable turns requires_grad off on this input "
                "(x.requires_grad_(False), x.detach_()): eager turns off the caller's tensor's, "
                "a replay's input is a buffer of its own. Detach it out of place in the callable "
                "(x = x.detach()), or pass a tensor that does not require grad"
            )


def _refuse_inputs_made_to_need_grad(item: _Capture) -> None:
    """Refuse an input whose sample needs no grad that the callable turned requires_grad on
    for (``x.requires_grad_()``, as a force field taking ``-dE/dx`` does): eager turns the
    caller's tensor's on (its outputs then depend on it, and it gets grads), a replay's input
    is a buffer of its own. With a sample requiring grad, a call whose tensor does not runs
    eagerly (:mod:`._branch_reads` counts the change as a read of the flag).

    >>> x = torch.zeros(2)
    >>> x.requires_grad_().requires_grad
    True
    """
    needed = item.request.inputs.requires_grad
    for path, tensor, sample in zip(
        item.request.inputs.paths, item.static_inputs, needed, strict=True
    ):
        if tensor.requires_grad and tensor.grad_fn is None and not sample:  # a history aside
            raise Refused(
                f"{path}: its sample does not require grad, but the callable made it require "
                "grad (x.requires_grad_()): eager's call turns the caller's tensor's on (its "
                "outputs then depend on it, and it gets grads), a replay's input is a buffer of "
                f"its own. Pass a sample {path} that requires grad (a call whose tensor does not "
                "then runs eagerly, as eager's turns it on)"
            )


def _refuse_inputs_given_hooks(item: _Capture) -> None:
    """Refuse an input the callable put a grad hook on (``x.register_hook(lambda g: g * 2)``,
    ``x.register_post_accumulate_grad_hook``).

    Eager puts it on the caller's tensor. It went on the static input instead: each warmup's
    (and each emulated replay's) hook stayed there and acted on every later backward, so the
    grad was doubled once more on every call (on CUDA, a factor fixed at capture), and the
    caller's tensor got none.

    >>> x = torch.zeros(2, requires_grad=True)
    >>> handle = x.register_hook(lambda grad: grad * 2)
    >>> len(x._backward_hooks)
    1
    """
    paths = item.request.inputs.paths
    for i, t in enumerate(item.static_inputs):
        if t._backward_hooks:
            kind = "a grad hook (x.register_hook)"
        elif t._post_accumulate_grad_hooks:
            kind = "a post-accumulate-grad hook (x.register_post_accumulate_grad_hook)"
        else:
            continue
        raise Refused(
            f"{paths[i]}: the callable registers {kind} on this input: eager puts it on the "
            "caller's tensor, a replay's input is a buffer of its own, where each call's hook "
            "would stay and act on the grads of every later call (and the caller's tensor would "
            "get none). Register the hook on the tensor you pass, outside the callable"
        )


def _noting_retained(
    found: Callable[[torch.Tensor], None], watchers: Callable[[], list[list[torch.Tensor]]]
) -> Callable[[torch.Tensor], None]:
    def retain_grad(tensor: torch.Tensor) -> None:
        for seen in watchers():
            seen.append(tensor)
        return found(tensor)

    return retain_grad


#: ``Tensor.retain_grad`` watched during the inspected warmup forward: a static input is a leaf,
#: where it is a no-op, so the input's own state cannot tell that the callable called it.
_RETAIN_GRAD = WatchedFunction(torch.Tensor, "retain_grad", _noting_retained)


def _refuse_inputs_retaining_grad(item: _Capture, retained: Sequence[torch.Tensor]) -> None:
    """Refuse an input the callable called ``retain_grad()`` on.

    Eager calls it on the caller's tensor, whose ``.grad`` the backward then fills where it is
    no leaf (a previous layer's output); a replay's input is a buffer of its own (a leaf, where
    it does nothing), so the caller's ``.grad`` stayed ``None``.
    """
    if not retained:
        return
    called = {id(t) for t in retained}
    paths = item.request.inputs.paths
    for i, t in enumerate(item.static_inputs):
        if id(t) in called:
            raise Refused(
                f"{paths[i]}: the callable calls retain_grad() on this input: eager calls it on "
                "the caller's tensor, whose .grad its backward fills where that tensor is no "
                "leaf, a replay's input is a buffer of its own, so the caller's .grad would stay "
                "None. Call retain_grad() on the tensor you pass, outside the callable"
            )


def _warmup(
    item: _Capture, allow_unused: bool, *, inspect: bool
) -> tuple[torch.Tensor | None, ...]:
    before = [t._version for t in item.static_inputs]
    layouts = list(map(_layout, item.static_inputs))
    # An update the version counters miss (``cache.data.mul_(2)``, a tensor ``set_`` on the
    # input's storage) still changes the bits: compared once, on the inspected call.
    bits = []
    # the inputs' Python attributes, to find those the callable sets (x._do_not_clear = True)
    attributes_before = [dict(vars(t)) for t in item.static_inputs] if inspect else []
    if inspect:
        with _unobserved():
            bits = [bytes_of(t) for t in item.static_inputs]
    # the storages of the tensors the forward saved that the backward reads (unpacks)
    saved: list[int] = []
    # Every warmup forward is watched for reads of grad mode and of the inputs' requires_grad:
    # under the lint's function mode (the inspected one), torch's fast-path checks stop at
    # has_torch_function before reading grad mode.
    with torch.enable_grad(), item.request.hooks.around("forward"):
        if inspect:
            with (
                own_saved_tensors_hooks(*_keeper(saved, item.probe)),
                turns_grad_mode_on() as grad_mode,
                branch_reads(item.static_inputs) as reads,
                rng_rewinds() as forward_rewound,
                _RETAIN_GRAD.watching([]) as retained,
                # views record their own ops, so that a replay makes its view outputs with
                # eager's ops (see _output_aliases)
                torch.autograd._force_original_view_tracking(True),
            ):
                outputs = _run(item)
            _refuse_inputs_retaining_grad(item, retained)
            del retained
            item.input_attributes = _input_attributes(
                item.static_inputs, attributes_before, item.request.inputs.paths
            )
            if forward_rewound.draws_from_rewound_state:
                _refuse_rewound_draws(item, "forward")
        else:
            with branch_reads(item.static_inputs) as reads:
                outputs = _run(item)
    item.reads_grad_mode |= reads.grad_mode
    item.reads_requires_grad = tuple(sorted({*item.reads_requires_grad, *reads.requires_grad}))
    item.reads_history = tuple(sorted({*item.reads_history, *reads.history}))
    item.turns_requires_grad_on = tuple(sorted({*item.turns_requires_grad_on, *reads.turned_on}))
    _refuse_changed_containers(item)
    _refuse_inputs_relaid(item, layouts)
    _refuse_inputs_made_to_need_no_grad(item)
    _refuse_inputs_made_to_need_grad(item)
    _refuse_inputs_given_a_history(item)
    _refuse_inputs_given_hooks(item)
    after_forward = [t._version for t in item.static_inputs]
    if bits:
        with _unobserved():
            for i, (copy, t) in enumerate(zip(bits, item.static_inputs, strict=True)):
                if t._version == before[i] and not same_bytes(copy, bytes_now(t)):
                    item.mutated.add(i)
                    item.mutated_quietly.add(i)  # copied back as quietly: eager moves no version
    del bits
    flat = item.record_outputs(outputs)
    differentiable = [flat[i] for i in item.diff_outputs]
    diff_inputs = item.diff_inputs()
    if inspect:
        assert item.out_spec is not None
        _refuse_outputs_retaining_grad(flat, item.out_spec.array_paths)
        record = item.module_tensors if item.module_tensors is not None else item.code_tensors
        item.output_aliases = find_output_aliases(
            flat,
            item.static_inputs,
            item.out_spec.array_paths,
            item.request.inputs.paths,
            ()
            if record is None
            else [
                t for t, buffer in zip(record.tensors, record.is_buffer, strict=True) if not buffer
            ],
            () if record is None else record.tensors,
        )
        item.take_returned_parameters(item.out_spec.array_paths)
        item.output_attributes = _output_attributes(
            flat, item.out_spec.array_paths, item.output_aliases
        )
        module = item.request.module
        # a module's plain tensor attributes as this call left them, found once for both uses
        attributes = plain_tensor_attributes(module) if module is not None else []
        item.outside_outputs = _outputs_sharing(flat, _tensors_named_by(item, attributes))
        # What else the backward reads that a replay could find changed: a function's or
        # method's weights (as a module's), a module's plain tensor attributes.
        closure_tensors = (
            named_by(item.request.fn, parameters=True)
            if module is None
            else [(f"{type(module).__name__}.{name}", tensor) for name, tensor in attributes]
        )
        aliases = item.output_aliases
        made_from_outputs = frozenset(
            () if aliases is None else (s.output for s in aliases.steps if not s.from_input)
        )
        item.used_inside = used_inside(flat, item.diff_outputs, made_from_outputs)
        walked: list[Any] = []
        reach, foreign = trace_leaves(differentiable, diff_inputs, walked)  # one walk
        # a convolution's node, or a convolution or RNN module run: cuDNN's settings choose
        # its kernels, compared on each call of such a callable only
        item.cudnn_ops = cudnn_ops_run(
            walked,
            [module] if module is not None else [m for _, m in modules_named_by(item.request.fn)],
        )
        if foreign:
            _refuse_foreign_leaves(item, foreign, differentiable)
        item.reach = reach
    del outputs
    grads: tuple[torch.Tensor | None, ...] = ()
    if differentiable and diff_inputs:
        # As the captured backward: the outputs handed out as another tensor (an input, a view
        # of one or of another output) take their grads there, never through the replay.
        backward = [differentiable[k] for k in item.backward_outputs]
        grads = (None,) * len(diff_inputs)
        # every thread's: the autograd engine runs a CUDA device's backward functions (a
        # checkpoint's recomputation) in a thread of its own
        rewinds = rng_rewinds(every_thread=True) if inspect else contextlib.nullcontext()
        # where eager's backward reaches the parameters, for the order of their hooks
        ordering: contextlib.AbstractContextManager[list[int]] = (
            reaching_order(item.params)
            if inspect and item.options.param_grads != "in_graph"
            else contextlib.nullcontext([])
        )
        # outside autocast, as the capture's backward and the replays' (_capture_cuda)
        with (
            item.request.hooks.around("backward"),
            rewinds as rewound,
            ordering as order,
            outside_autocast(),
        ):
            if backward:
                grads = tuple(
                    torch.autograd.grad(
                        backward,
                        diff_inputs,
                        grad_outputs=[torch.ones_like(t) for t in backward],
                        allow_unused=True,  # an unused one is refused below, naming it
                    )
                )
        item.after_backward()  # what a hook of a later call's backward left on its modules
        if rewound is not None and rewound.draws_from_rewound_state:
            _refuse_rewound_draws(item, "backward")
        if order:
            item.grad_order = tuple(dict.fromkeys(order))  # each once: the first reach
        # allow_unused_input lets an unused input or parameter be, as eager leaves it; not a
        # parameter the graphed module's own pre-hooks compute from (eager's grad goes through
        # them, outside the graphs): refused either way (_refuse_unused)
        module = item.request.module
        first = (
            0
            if not allow_unused
            else len(item.grad_input_indices)
            if module is not None and module._forward_pre_hooks
            else len(grads)
        )
        if first < len(grads):
            # by identity: `None in grads` compares None with each grad through Tensor.__eq__,
            # whose TypeError costs about 18 us a tensor
            unused = next(
                (
                    k
                    for k, grad in enumerate(grads)
                    if k >= first
                    and grad is None
                    and not _reached_by_handed_out(item, differentiable, k)
                ),
                None,
            )
            if unused is not None:
                _refuse_unused(item, unused)
        if inspect:
            item.take_grad_layouts(grads)
        if inspect and item.fuses_accumulation:  # the graph adds them into .grad, then frees them
            item.probe.memory.release(grads[len(item.grad_input_indices) :])
    if inspect:
        # What the backward read (only it: a node no output reaches saves tensors no backward
        # reads, eager lets them change before its backward)
        item.saved_outputs = _saved_outputs(flat, saved)
        item.saved_inputs = _saved_outputs(item.static_inputs, saved)  # by storage, as outputs
        item.saved_module_tensors = _saved_module_tensors(
            item.module_tensors if item.module_tensors is not None else item.code_tensors, saved
        )
        item.saved_closure_tensors = _saved_among(closure_tensors, saved)
    del saved
    paths = item.request.inputs.paths
    for i, (v0, v1, t) in enumerate(zip(before, after_forward, item.static_inputs, strict=True)):
        if t._version != v1:
            raise Refused(
                f"{paths[i]} is updated in place during backward; dualgraph hands in-place "
                "updates back to the caller after the forward only"
            )
        if v1 != v0:
            item.mutated.add(i)
    if inspect and grad_mode.on_while_on:
        item.records_under_no_grad = _recording_under_no_grad(item)
    return grads


def _refuse_rewound_draws(item: _Capture, where: str) -> None:
    if where == "backward":
        what = (
            "sets torch's RNG state back to one read before it and draws random numbers from "
            "there (torch.utils.checkpoint with preserve_rng_state=True recomputing dropout or "
            "another random op): eager draws the forward's numbers again, but the forward and "
            "the backward are two graphs, each drawing from where its replay finds the "
            "generator, so the backward graph would draw other numbers (dropout masks) than the "
            "forward graph and the grads would silently be wrong. Keep random ops out of the "
            "checkpointed part, or do not checkpoint inside the graphed callable (a graph keeps "
            "its activations in its pool)"
        )
    else:
        what = (
            "seeds torch's RNG (torch.manual_seed) or sets a state it did not read in the call, "
            "and draws random numbers from there: eager draws the same numbers on every call, "
            "but a graph draws from where each replay finds the generator (a capture keeps no "
            "seed), so every replay would draw other ones. Seed outside the graphed callable, "
            "or make numbers meant to be the same on every call once, outside it (a buffer)"
        )
    raise Refused(f"{item.name}'s {where} {what}")


def _reached_by_handed_out(item: _Capture, differentiable: Sequence[torch.Tensor], k: int) -> bool:
    """Whether an output handed out as another tensor reaches the ``k``-th of
    :meth:`_Capture.diff_inputs` (``return x[0]``: ``x`` takes that view's grad), which the
    backward's grads (of the other outputs) leave ``None``. Only where one is ``None``."""
    leaf = item.diff_inputs()[k]
    taken = set(item.backward_outputs)
    return any(_reaches(output, leaf) for j, output in enumerate(differentiable) if j not in taken)


def _reaches(output: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether ``output``'s autograd graph reaches ``leaf`` (only where a capture is refused).

    >>> w = torch.ones(2, requires_grad=True)
    >>> _reaches(w * 2, w), _reaches(torch.ones(2, requires_grad=True) * 2, w)
    (True, False)
    """
    if output is leaf:
        return True
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is leaf:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _recording_under_no_grad(item: _Capture) -> tuple[int, ...]:
    """The outputs a call under ``torch.no_grad()`` gives history (the callable turns grad
    mode on itself): one more forward, unobserved (module tensors are put back after warmup).

    A forward that raises under ``no_grad`` (``torch.autograd.grad`` inside its own
    ``enable_grad`` of what was computed before it, which then records nothing) is still graphed:
    eager's call raises there too, so every output is named and such a call refused."""
    assert item.out_spec is not None
    try:
        with _unobserved(), torch.no_grad(), item.request.hooks.around("forward"):
            outputs = item.run()
    except Exception:
        return tuple(range(item.out_spec.num_arrays))
    try:
        flat = item.out_spec.flatten(outputs, check=True)
    except DualgraphError:  # another tree under no_grad (a branch on grad mode): refuse all
        return item.diff_outputs
    return tuple(i for i, t in enumerate(flat) if t.requires_grad)


def _keeper(
    read: list[int], probe: WarmupProbe
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """Saved-tensor hooks whose unpack notes in ``read`` the storage of each saved tensor the
    backward reads, not the tensor: autograd keeps the hooks (and so ``read``) until the
    backward is over, and would keep the tensors too.

    Noted at unpack, not at pack: a node no output reaches (``self.inp(mid)``, its result
    dropped) saves tensors too, which no backward reads: eager lets them change in place before
    its backward (an optimizer step), so must a replay. Eager's own check of a saved tensor's
    version is made at unpack as well.

    The pack hands autograd the tensor detached: an op's saved output packed as itself holds its
    own node, a cycle no garbage collection frees, which only a backward through that node
    breaks. A result the forward drops, or a failure before the backward, would leave that graph
    (and the parameters' ``AccumulateGrad`` nodes) alive for good. Autograd puts the grad_fn
    back when it unpacks.

    >>> class NoProbe:
    ...     def note_saved(self, tensors): ...
    >>> read = []
    >>> pack, unpack = _keeper(read, NoProbe())
    >>> w = torch.ones(2, requires_grad=True)
    >>> with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
    ...     kept, dropped = (w * w).sum(), w.exp()
    >>> del dropped
    >>> read == [], kept.backward(), read == [_storage(w)] * 2
    (True, None, True)
    """

    def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        probe.note_saved((tensor,))  # issue 19 hook: the probe's own pack hook is outside this one
        return tensor.detach(), _storage(tensor)

    def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        tensor, storage = packed
        read.append(storage)
        return tensor

    return pack, unpack


def _storage(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr()) if tensor.numel() else 0
    except Exception:  # a tensor without a plain storage (e.g. a TE FP8 tensor)
        return 0


def _saved_outputs(flat: Sequence[torch.Tensor], saved: Sequence[int]) -> tuple[int, ...]:
    storages = set(saved) - {0}
    return tuple(i for i, t in enumerate(flat) if _storage(t) in storages)


def _tensors_named_by(
    item: _Capture, attributes: Sequence[tuple[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """The tensors alive before any call that the callable reads besides its inputs: a module's
    parameters, buffers and plain tensor ``attributes`` (:func:`plain_tensor_attributes`), or
    what a function's code names (a method's module's included)."""
    module = item.request.module
    if module is not None:
        # item.params are among the module's parameters (those requiring grad)
        return [*module.parameters(), *module.buffers(), *(tensor for _, tensor in attributes)]
    return [tensor for _, tensor in named_by(item.request.fn, parameters=True)]


def _outputs_sharing(
    flat: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]
) -> tuple[tuple[int, Layout], ...]:
    """The outputs that share memory with ``tensors`` (a parameter returned, a view of a
    buffer), each with its layout: memory no graph allocates, which a replay hands out as a
    copy (a CUDA graph copies it into a buffer of its own, ``_capture_cuda.py``).

    >>> weight = torch.ones(2, 3)
    >>> [i for i, _ in _outputs_sharing([weight.sum(0), weight.t(), weight], [weight])]
    [1, 2]
    """
    storages = {_storage(t) for t in tensors} - {0}
    if not storages:
        return ()
    return tuple((i, layout_of(t)) for i, t in enumerate(flat) if _storage(t) in storages)


def _saved_module_tensors(
    module_tensors: ModuleTensors | None, saved: Sequence[int]
) -> tuple[int, ...]:
    """The parameters and buffers (positions among ``module_tensors``) the backward reads."""
    if module_tensors is None:
        return ()
    storages = set(saved) - {0}
    return tuple(i for i, t in enumerate(module_tensors.tensors) if _storage(t) in storages)


def _saved_among(
    named: Sequence[tuple[str, torch.Tensor]], saved: Sequence[int]
) -> tuple[tuple[str, torch.Tensor], ...]:
    """Those of ``named`` (a function's: what its code names) the backward reads."""
    storages = set(saved) - {0}
    return tuple((name, t) for name, t in named if _storage(t) in storages)


def _refuse_unused(item: _Capture, k: int) -> None:
    """Refuse the ``k``-th of :meth:`_Capture.diff_inputs`, which no output depends on."""
    n = len(item.grad_input_indices)
    if k < n:
        name = item.request.inputs.paths[item.grad_input_indices[k]]
        advice = "pass a sample that does not require grad there, or allow_unused_input=True"
    else:
        name = item.param_names[k - n]
        module = item.request.module
        if module is not None and module._forward_pre_hooks:
            # A graphed module's own hooks run around each call, outside the graphs: a pre-hook
            # that computes what the forward reads (torch's deprecated spectral_norm sets
            # `weight` from `weight_orig`) leaves the parameter out of the graph, where eager
            # gives it a grad, so allow_unused_input would not give eager's result.
            raise Refused(
                f"{name} requires grad, but no output of the graphed forward depends on it: "
                f"{type(module).__name__}'s forward pre-hooks "
                f"({_hook_names(module._forward_pre_hooks.values())}) run outside the graphs, "
                "around each call, so what they compute from it is not part of the graph (eager "
                "gives it a grad through them); graph a module that calls this one (its hooks "
                "then run inside), or use torch.nn.utils.parametrizations in place of "
                "torch's deprecated weight_norm and spectral_norm"
            )
        advice = "freeze it (requires_grad_(False)), or pass allow_unused_input=True"
    raise Refused(
        f"{name} requires grad, but no output depends on it, so it would get no grad; {advice} "
        "(it then gets none, as in eager)"
    )


def _hook_names(hooks: Iterable[Any]) -> str:
    """``hooks`` named for a message: ``SpectralNorm``, ``my_hook``."""
    return ", ".join(
        getattr(hook, "__qualname__", None) or type(hook).__qualname__ for hook in hooks
    )


def _refuse_foreign_leaves(
    item: _Capture, foreign: Sequence[torch.Tensor], differentiable: Sequence[torch.Tensor]
) -> None:
    """Refuse outputs that depend on leaves requiring grad besides the inputs and parameters
    (an input made to require grad is refused before: :func:`_refuse_inputs_made_to_need_grad`).
    """
    shapes = ", ".join(sorted({f"{dtype_name(t.dtype)}{list(t.shape)}" for t in foreign}))
    owner = "parameters of the module" if item.request.module is not None else "arguments"
    assert item.out_spec is not None
    paths = [item.out_spec.array_paths[i] for i in item.diff_outputs]
    first = next(
        (path for path, t in zip(paths, differentiable, strict=True) if _reaches(t, foreign[0])),
        None,
    )
    leaf = foreign[0]
    where = "" if first is None else f"; output{first} reads the {dtype_name(leaf.dtype)}"
    where += "" if first is None else f"{list(leaf.shape)} one"
    raise Refused(
        f"the outputs depend on {len(foreign)} tensor(s) that require grad but are neither "
        f"inputs nor {owner} ({shapes}{where}), e.g. a closure over another module's weights; a "
        "replay would give them no gradient. Pass them as inputs, or graph the module that "
        "holds them"
    )
