"""``fallback="pad"``: which dims a call is padded along, and the checks that make it safe.

A padded call gets ``valid_length=`` and its outputs are cut back along the declared output
dims; :func:`padding_of` reads ``dynamic_dims``, and the checks refuse what padding would
change: a callable without ``valid_length``, statistics over positions, outputs that cannot be
cut back, and outputs or grads that differ when a call is padded (compared eagerly at capture,
for every bucket a call can be padded into).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .._errors import DualgraphError, SpecMismatchError
from .._spec import TreeSpec, describe
from ._address_ranges import storage_key
from ._ambient import kept_modes, outside_autocast
from ._closed_over import modules_named_by, named_by
from ._dropout_off import DropoutOff
from ._inputs import InputGuard
from ._leaf_difference import difference_but_shapes
from ._param_attributes import parameter_attributes_kept
from ._params import bytes_of, same_bytes, write_back
from ._process_state import kept_process_state

if TYPE_CHECKING:
    from ._bucket_capture import BucketRequest

__all__ = [
    "VALID_LENGTH",
    "Padding",
    "check_padded_call",
    "check_padded_plans",
    "check_padding_can_be_correct",
    "check_padding_is_masked",
    "cut_back",
    "output_cuts",
    "padding_of",
    "undeclared_length_dims",
    "valid_length_position",
]

#: The keyword argument through which ``fallback="pad"`` tells the callable how many positions
#: along the dynamic dims are real (a 0-d int64 tensor); the rest are zero padding.
VALID_LENGTH = "valid_length"
_VALID_LENGTH_PATH = f"kwargs['{VALID_LENGTH}']"

#: Modules whose statistics run across positions, so that padding would change them.
_POSITION_STATISTICS: tuple[type, ...] = (
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.GroupNorm,
)


@dataclass(frozen=True)
class Padding:
    """``fallback="pad"``: which input dims share the dynamic length, which output dims follow.

    ``inputs`` and ``outputs`` hold ``(array index, dim)``; output indices are resolved against
    each bucket's output spec, from ``output_paths``.
    """

    inputs: tuple[tuple[int, int], ...]
    input_paths: tuple[str, ...]
    output_paths: tuple[tuple[str, int], ...]  # (path after "output", dim as declared)
    ranks: tuple[int, ...]  # how many dims each padded input has in every bucket

    def length_of(self, shapes: Sequence[Sequence[int]]) -> int:
        """A call's length along the dynamic dims; raises where a padded input has another
        number of dims than the buckets' (it has no such dim to pad, or another one) or where
        two dynamic dims disagree."""
        for (index, dim), path, rank in zip(self.inputs, self.input_paths, self.ranks, strict=True):
            shape = shapes[index]
            if len(shape) != rank:
                raise SpecMismatchError(
                    f"{path}: got shape {list(shape)} ({len(shape)} dims); fallback='pad' pads "
                    f"dim {dim} of a {rank}-dim tensor there, as every bucket has it",
                    path=path,
                )
        (first, first_dim), *rest = self.inputs
        length = shapes[first][first_dim]
        for (index, dim), path in zip(rest, self.input_paths[1:], strict=True):
            other = shapes[index][dim]
            if other != length:
                raise SpecMismatchError(
                    f"{path}: length {other} along dim {dim}, but {self.input_paths[0]} has "
                    f"length {length} along dim {first_dim}; the dims in dynamic_dims share one "
                    "length",
                    path=path,
                )
        return int(length)

    def fixed_shapes(self, shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """The shapes with each dynamic dim replaced by -1: what a padded bucket must match."""
        fixed = [tuple(shape) for shape in shapes]
        for index, dim in self.inputs:
            shape = list(fixed[index])
            shape[dim] = -1
            fixed[index] = tuple(shape)
        return tuple(fixed)

    def groups(self, shapes: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
        """The buckets (indices into ``shapes``, each a bucket's input shapes) grouped by their
        :meth:`fixed_shapes`: a call can be padded from one into another of its group only."""
        groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for i, key in enumerate(shapes):
            groups.setdefault(self.fixed_shapes(key), []).append(i)
        return list(groups.values())


def output_cuts(padding: Padding, spec: TreeSpec) -> tuple[tuple[int, int], ...]:
    """``(output array index, dim)`` for each output dim declared in ``dynamic_dims``."""
    cuts = []
    for path, dim in padding.output_paths:
        if path not in spec.array_paths:
            raise DualgraphError(
                f"dynamic_dims: output{path} is not a tensor of the outputs (they are "
                f"{', '.join('output' + p for p in spec.array_paths) or 'none'})"
            )
        index = spec.array_paths.index(path)
        ndim = len(spec.arrays[index].shape or ())
        if not -ndim <= dim < ndim:
            raise DualgraphError(
                f"dynamic_dims: output{path} has {ndim} dims, so it has no dim {dim}"
            )
        cuts.append((index, dim % ndim))
    return tuple(cuts)


def cut_back(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``tensor`` cut to its first ``length`` positions along ``dim``, laid out as eager's.

    Eager's output for the unpadded call is dense; a plain ``narrow`` of the padded one is not
    (its other dims keep the padded length's strides), so ``.view`` would fail on it and code
    that reads strides would see another tensor. The cut is made dense with its dims in the
    padded output's memory order (a transposed output stays transposed); a cut that is dense
    already (along the outermost dim) stays a view.
    """
    cut = tensor.narrow(dim, 0, length)
    strides = tensor.stride()
    order = sorted(range(tensor.dim()), key=lambda d: -strides[d])  # outermost first; stable
    dense = cut.permute(order).contiguous()  # itself where it is dense in that order already
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return dense.permute(inverse)


def padding_of(
    request: BucketRequest, guard: InputGuard, shapes: Sequence[tuple[torch.Size, ...]]
) -> tuple[Padding | None, list[int | None]]:
    """The padding layout of ``fallback="pad"`` (checked), and each bucket's length."""
    dims = request.dynamic_dims
    if request.fallback != "pad":
        if dims is not None:
            raise DualgraphError("dynamic_dims= goes with fallback='pad' (the dims it pads)")
        return None, [None] * len(shapes)
    if not isinstance(dims, Mapping) or not dims:
        raise DualgraphError(
            "fallback='pad' needs dynamic_dims=: the input dims it may pad, and the output dims "
            "to cut back, by path, e.g. {'args[0]': 1, 'output[0]': 1}"
        )
    position = valid_length_position(request.fn)
    for i, (args, kwargs) in enumerate(request.samples):
        if VALID_LENGTH in kwargs:
            raise DualgraphError(
                f"sample kwargs hold '{VALID_LENGTH}', which fallback='pad' passes itself"
            )
        if position is not None and len(args) > position:
            # Every replay passes it by keyword: the call would give it twice (a TypeError
            # at warmup that named no sample).
            raise DualgraphError(
                f"buckets[{i}]: args[{position}] is {request.name}'s '{VALID_LENGTH}' "
                f"parameter, which fallback='pad' passes itself (by keyword); leave it out of "
                "the sample, passing the arguments after it by keyword"
            )
    inputs: list[tuple[int, int]] = []
    input_paths: list[str] = []
    ranks: list[int] = []
    outputs: list[tuple[str, int]] = []
    for path, dim in dims.items():
        if not isinstance(path, str) or type(dim) is not int:
            raise DualgraphError(
                f"dynamic_dims maps a path (str) to a dim (int), got {path!r}: {dim!r}"
            )
        if path.startswith("output"):
            outputs.append((path[len("output") :], dim))
            continue
        if path not in guard.paths:
            raise DualgraphError(
                f"dynamic_dims: {path} is not an input tensor (they are "
                f"{', '.join(guard.paths)}; outputs are named output...)"
            )
        index = guard.paths.index(path)
        ndims = {len(key[index]) for key in shapes}
        ndim = ndims.pop()
        if ndims:
            raise DualgraphError(f"dynamic_dims: {path} has a different number of dims per bucket")
        if not -ndim <= dim < ndim:
            raise DualgraphError(f"dynamic_dims: {path} has {ndim} dims, so it has no dim {dim}")
        inputs.append((index, dim % ndim))
        input_paths.append(path)
        ranks.append(ndim)
    if not inputs:
        raise DualgraphError("dynamic_dims names no input dim for fallback='pad' to pad")
    padding = Padding(tuple(inputs), tuple(input_paths), tuple(outputs), tuple(ranks))
    lengths: list[int | None] = []
    for i, key in enumerate(shapes):
        try:
            length = padding.length_of(key)
        except SpecMismatchError as error:
            raise DualgraphError(f"buckets[{i}]: {error}") from None
        if length < 1:
            raise DualgraphError(f"buckets[{i}]: length 0 along the dynamic dims")
        lengths.append(length)
    return padding, lengths


def undeclared_length_dims(
    padding: Padding,
    paths: Sequence[str],
    lengths: Sequence[int | None],
    shapes: Sequence[tuple[torch.Size, ...]],
) -> tuple[tuple[str, int], ...]:
    """``(path, dim)`` of each input left out of ``dynamic_dims`` whose ``dim`` holds every
    bucket's length, where the buckets have several lengths: most likely a mask or a position
    table that follows the length but was not declared, so that padding cuts or pads the
    declared inputs and leaves it as it was.

    >>> padding = Padding(((0, 1),), ("args[0]",), (), (3,))
    >>> shapes = [(torch.Size([2, n, 8]), torch.Size([2, n])) for n in (4, 6)]
    >>> undeclared_length_dims(padding, ("args[0]", "args[1]"), [4, 6], shapes)
    (('args[1]', 1),)
    """
    if len(set(lengths)) < 2:  # one length: any dim of that size would look the same
        return ()
    declared = {index for index, _ in padding.inputs}
    found = []
    for index, path in enumerate(paths):
        if index in declared:
            continue
        ranks = {len(key[index]) for key in shapes}
        if len(ranks) != 1:
            continue
        for dim in range(ranks.pop()):
            if all(key[index][dim] == length for key, length in zip(shapes, lengths, strict=True)):
                found.append((path, dim))
                break
    return tuple(found)


def check_padding_can_be_correct(request: BucketRequest) -> None:
    """Refuse ``fallback="pad"`` where padding would change results the callable cannot fix."""
    if not _accepts_valid_length(request.fn):
        raise DualgraphError(
            f"fallback='pad': {request.name} takes no '{VALID_LENGTH}' argument, so it could not "
            "tell padding from data (attention would attend to it, means would count it); give "
            f"it a '{VALID_LENGTH}=None' keyword argument and mask with it"
        )
    if request.module is not None:
        for path, module in request.module.named_modules():
            if isinstance(module, _POSITION_STATISTICS):
                where = f"{request.name}.{path}" if path else request.name
                raise DualgraphError(
                    f"fallback='pad': {where} is a {type(module).__name__}, whose statistics "
                    "run over positions, so padded positions would change them; use "
                    "fallback='eager' or 'error', or buckets without padding"
                )


def _roots_of(request: BucketRequest) -> list[torch.nn.Module]:
    """The modules a call of ``request`` runs: the graphed module, or those a graphed
    function's or method's code names and a method's module (as a capture finds them)."""
    if request.module is not None:
        return [request.module]
    return modules_named_by(request.fn)


def check_padded_plans(
    request: BucketRequest,
    padding: Padding,
    plans: Sequence[Any],
    lengths: Sequence[int | None],
    shapes: Sequence[tuple[torch.Size, ...]],
) -> None:
    """Refuse what pad cannot cut back or copy back, now that the outputs are known."""
    cuts_per_bucket = []
    for i, (plan, length) in enumerate(zip(plans, lengths, strict=True)):
        # by path: a plan's inputs hold valid_length too, among the keywords in sorted order,
        # so its positions are not the bucket guard's
        for index in plan.mutated_inputs:
            _refuse_updated_input(
                request.name, padding, plan.inputs.paths[index], "found by its capture"
            )
        cuts = output_cuts(padding, plan.outputs)
        for index, dim in cuts:
            size = plan.outputs.arrays[index].shape[dim]
            if size != length:
                path = plan.outputs.array_paths[index]
                raise DualgraphError(
                    f"dynamic_dims: output{path} dim {dim} has size {size} in buckets[{i}], "
                    f"whose length is {length}; only dims of the bucket's length can be cut back"
                )
        cuts_per_bucket.append(set(cuts))
    for members in padding.groups(shapes):
        first = plans[members[0]].outputs
        for index, leaf in enumerate(first.arrays):
            for dim in range(len(leaf.shape or ())):
                sizes = {plans[i].outputs.arrays[index].shape[dim] for i in members}
                if len(sizes) > 1 and (index, dim) not in cuts_per_bucket[members[0]]:
                    declared = dict(padding.output_paths).get(leaf.path)
                    fix = (
                        f"add 'output{leaf.path}': {dim}"
                        if declared is None
                        else f"dynamic_dims cuts one dim per output (dim {declared} there), so "
                        "use fallback='eager' or 'error' for a callable that returns it"
                    )
                    raise DualgraphError(
                        f"fallback='pad': output{leaf.path} dim {dim} changes with the length "
                        f"({', '.join(map(str, sorted(sizes)))} across buckets) but is not in "
                        f"dynamic_dims, so a padded call could not be cut back; {fix}"
                    )


def _refuse_updated_input(name: str, padding: Padding, path: str, found: str) -> None:
    """Refuse a callable that updates a padded input or ``valid_length`` (found at ``path``) in
    place: a padded call hands it a padded copy, so the caller's tensor would not see the
    update; ``valid_length`` is one tensor per length that every later call of that length
    gets, which would then tell it another length."""
    if path == _VALID_LENGTH_PATH:
        raise DualgraphError(
            f"fallback='pad': {name} updates {path} in place, but every later call "
            f"of that length is handed the same tensor, which would then tell it another length "
            f"({found}); compute a new one ({VALID_LENGTH} - 1, not {VALID_LENGTH} -= 1)"
        )
    if path in padding.input_paths:
        raise DualgraphError(
            f"fallback='pad': {name} updates {path} in place, but a padded call "
            f"passes it a padded copy, so the caller's tensor would not see the update ({found})"
        )


def check_padding_is_masked(
    request: BucketRequest,
    padding: Padding,
    guards: Sequence[InputGuard],
    lengths: Sequence[int | None],
    shapes: Sequence[tuple[torch.Size, ...]],
) -> None:
    """Refuse a callable whose outputs change when a call is padded (it ignores padding).

    Every bucket is its own capture of the callable's Python, which may take another path per
    length (``x.shape`` read in Python), so each bucket a call can be padded into is checked: a
    short call runs eagerly as it is and padded to the bucket's length with ``valid_length``;
    the outputs, cut back, must agree up to rounding. Per group of buckets that pad into one
    another, the largest is checked first with the smallest bucket's sample, then each bucket
    with the shortest call padded into it (one position longer than the bucket below, or half
    the smallest bucket's length). A module runs in eval mode (dropout off, functional dropout
    too); of a callable that still draws random numbers (its reference differs under two seeds)
    only the padded call's structure and shapes, cut back, and the call told and untold (one
    seed) can be compared.
    """
    for members in padding.groups(shapes):
        sizes = {i: int(lengths[i] or 0) for i in members}
        ordered = sorted(members, key=sizes.__getitem__)
        checks = []  # (the bucket whose sample is cut, the call's length, the bucket padded to)
        if len(ordered) > 1:
            checks.append((ordered[0], sizes[ordered[0]], ordered[-1]))
        below = 0
        for i in ordered:
            length = below + 1 if below else sizes[i] // 2
            if 1 <= length < sizes[i]:  # else no call is padded into bucket i
                checks.append((i, length, i))
            below = sizes[i]
        for sample, length, bucket in checks:
            originals = guards[sample].tensors(*request.samples[sample])
            tensors = [t.detach().clone() for t in originals]
            for index, dim in padding.inputs:
                tensors[index] = tensors[index].narrow(dim, 0, length)
            wants_grad = [t.requires_grad for t in originals]
            _compare_padded(
                request, padding, guards[sample], tensors, wants_grad, length, sizes[bucket]
            )


def check_padded_call(
    request: BucketRequest,
    padding: Padding,
    guard: InputGuard,
    tensors: Sequence[torch.Tensor],
    length: int,
    full: int,
) -> None:
    """Refuse, as the capture's check would, a call of ``tensors`` (of ``length`` along the
    dynamic dims) whose outputs, buffers or grads change when it is padded to ``full`` (a
    bucket's length; the call's own: only told ``valid_length``). The capture checks a few
    lengths per bucket; :func:`dualgraph.torch.verify` checks the length of the call it runs.
    Leaves the module, the ``.grad`` and the random streams as it found them."""
    _compare_padded(
        request,
        padding,
        guard,
        [t.detach().clone() for t in tensors],
        [t.requires_grad for t in tensors],
        length,
        full,
    )


def _compare_padded(
    request: BucketRequest,
    padding: Padding,
    guard: InputGuard,
    tensors: list[torch.Tensor],
    wants_grad: Sequence[bool],
    length: int,
    full: int,
) -> None:
    """Refuse ``request`` if a call of ``tensors`` and the same call padded to ``full`` differ:
    in their outputs, cut back, in the buffers the call updates, or in the grads one upstream
    grad gives the call's inputs and the module's parameters.

    Compared in eval mode (dropout off), and, for a module captured in training mode, in the
    modes it was captured in too (its replays run in those): a module may mix positions only
    while training (batch statistics of its own, a running mean it updates). A graphed function
    or method is judged so by the modules its code names and its method's module. Dropout
    draws nothing there (``p`` is 0 for the check: of modules, and of functional dropout through
    :class:`DropoutOff`); of a callable that still draws random numbers only the structure and
    shapes of its padded call are judged in that mode.
    """
    module = request.module
    roots = _roots_of(request)
    # each module once (a function may name a module and one of its submodules)
    modes = list({id(m): (m, m.training) for root in roots for m in root.modules()}.values())
    # a graphed function's or method's: what its code names, as a capture and verify find them
    named_buffers = [
        (name, tensor)
        for name, tensor in (module.named_buffers() if module is not None else named_by(request.fn))
        if not tensor.requires_grad and _writable(tensor)
    ]
    # every call of every variant starts from these, and they are put back at the end
    saved = [b.detach().clone() for _, b in named_buffers]
    dropouts = [
        (m, m.p)
        for m, training in modes
        if training and isinstance(m, torch.nn.modules.dropout._DropoutNd)
    ]
    training = any(training for _, training in modes)
    found: tuple[str, str, str] | None = None
    params = list(module.parameters()) if module is not None else []
    check = _PaddedCheck(
        request,
        padding,
        guard,
        wants_grad,
        length,
        full,
        named_buffers,
        saved,
        untold=not _requires_valid_length(request.fn),
    )
    try:
        # Eager would not have run the callable: every random stream it drew from (torch's,
        # Python's, numpy's) and every mode it left are put back, success or not. Its backward
        # may add into the parameters' main_grad and set their flags (fused weight-grad
        # accumulation): put back as a capture does.
        with (
            kept_process_state(),
            torch.no_grad(),
            parameter_attributes_kept(params),
            DropoutOff(),  # functional dropout as dropout modules: at p=0
        ):
            for in_training in (False, True) if training else (False,):
                if in_training:
                    for m, was_training in modes:
                        m.training = was_training
                    for m, _ in dropouts:
                        m.p = 0.0
                else:
                    for root in roots:
                        root.eval()
                mode = " in training mode, as captured" if in_training else ""
                for inputs, shifted in _input_variants(padding, tensors):
                    found = _padded_difference(check, inputs, mode + shifted, sample=not shifted)
                    if found is not None:
                        break
                if found is not None:
                    break
    finally:
        for m, training in modes:
            m.training = training
        for m, p in dropouts:
            m.p = p
        for (_, buffer), value in zip(named_buffers, saved, strict=True):
            write_back(buffer, value)
    if found is None:
        return
    difference, kind, mode = found
    if kind == "untold":
        raise DualgraphError(
            f"fallback='pad': {request.name}: {difference} between a call of length {length} "
            f"told {VALID_LENGTH}={length} (every replay is told one, padded or not) and the "
            f"same call without {VALID_LENGTH} (as eager calls it){mode}: told the call's "
            "full length, it must do what it does untold (a mask off by one?); or use "
            "fallback='eager' or 'error'"
        )
    padded = (
        f"fallback='pad': {request.name}: {difference} when a call of length {length} is "
        f"padded to {full} (with {VALID_LENGTH}={length}){mode}"
    )
    if kind == "shape":
        # also for a callable that draws random numbers, whose values cannot be compared
        raise DualgraphError(
            f"{padded}: a padded call's outputs, cut back, must be the call's tree and shapes; "
            "name every output dim that follows the length in dynamic_dims (e.g. "
            "'output[1]': 1), or use fallback='eager' or 'error'"
        )
    where = f"{padded}: padded positions reach"
    if kind == "grads":
        raise DualgraphError(
            f"{where} the grads of the call's own (an op whose backward is inf or NaN at the "
            "zero padding, such as sqrt, log, a division or pow, gives NaN even times the zero "
            "grad of a padded output). Keep padded positions out of such ops (torch.where "
            "before them, an eps), or use fallback='eager' or 'error'"
        )
    raise DualgraphError(
        f"{where} what it returns or updates for the call's own. It must keep them out of "
        f"whatever mixes positions (mask attention, count only the first {VALID_LENGTH} "
        "positions in a mean, a sum or a statistic it keeps, mask a softmax over positions); "
        "or use fallback='eager' or 'error'"
    )


def _writable(tensor: torch.Tensor) -> bool:
    """Whether no two elements of ``tensor`` share memory (an expanded constant does): only
    such a tensor can be updated in place, by the call or by the check putting it back.

    >>> _writable(torch.zeros(2, 3)), _writable(torch.zeros(1).expand(4))
    (True, False)
    """
    sizes_and_strides = zip(tensor.shape, tensor.stride(), strict=True)
    return all(stride or size <= 1 for size, stride in sizes_and_strides)


@dataclass(frozen=True)
class _PaddedCheck:
    """What every comparison of a call with the same call padded shares (one per sample
    length): the callable, its padding and input guard, which inputs want grads, the call's
    length and the bucket's, the module's buffers with their values before the check, from
    which each call starts, and whether the callable may be called without ``valid_length``
    (``untold``: not where its signature requires one)."""

    request: BucketRequest
    padding: Padding
    guard: InputGuard
    wants_grad: Sequence[bool]
    length: int
    full: int
    named_buffers: Sequence[tuple[str, torch.Tensor]]
    saved: Sequence[torch.Tensor]
    untold: bool


def _padded_difference(
    check: _PaddedCheck, tensors: list[torch.Tensor], mode: str, sample: bool = True
) -> tuple[str, str, str] | None:
    """How the padded call of ``tensors`` differs, in the modules' current modes:
    ``(difference, kind, mode)`` (kind: ``"shape"``: the outputs' structure or shapes,
    ``"padded"``: their values or the buffers', ``"grads"``, or
    ``"untold"``: the call told its full length differs from it called without
    ``valid_length``, as eager calls it), or None. Each call starts from the buffers as
    ``check.saved`` (their values before the check). ``sample``: the sample's own values; else
    shifted ones (:func:`_input_variants`), whose outputs alone are compared, and only where
    the call's own are finite (a log of the shifted values is no fault of the padding; nor is
    an error the call raises on them)."""
    padded = _padded(check.padding, tensors, check.length, check.full)
    device = tensors[check.padding.inputs[0][0]].device
    valid = torch.full((), check.length, dtype=torch.int64, device=device)

    def run(
        inputs: list[torch.Tensor],
        seed: int,
        given: list[torch.Tensor] | None = None,
        told: bool = True,
    ) -> Any:
        """The call of ``inputs`` (copies, into ``given``), told ``valid_length`` or not."""
        for (_, buffer), value in zip(check.named_buffers, check.saved, strict=True):
            write_back(buffer, value)  # every call starts from the same values; no version moves
        clones = [t.clone() for t in inputs]
        if given is not None:
            given.extend(clones)
        args, kwargs = check.guard.unflatten(clones)
        torch.manual_seed(seed)
        if told:
            kwargs = {**kwargs, VALID_LENGTH: valid}
        return check.request.hooks.call(check.request.fn, args, kwargs)

    def updated() -> list[torch.Tensor]:
        return [b.detach().clone() for _, b in check.named_buffers]

    given: list[torch.Tensor] = []
    if sample:
        reference = run(tensors, 0, given)
        # what a capture finds for the graphed backends (check_padded_plans), on every backend
        _refuse_updates_of_the_call(
            check.request.name,
            check.padding,
            check.guard.paths,
            tensors,
            given,
            valid,
            check.length,
        )
    else:
        # values it may not take (probabilities shifted out of [0, 1]): where it raises, it
        # cannot be judged on them, as where its outputs are not finite
        reference = _guarded(lambda: run(tensors, 0, given))
        if reference is _REFUSED:
            return None
    expected_buffers = updated()
    if not sample and not _all_finite(reference):
        return None
    _refuse_lost_views(check.request.name, check.padding, check.guard.paths, reference, given)
    if sample and check.untold:
        # told or untold, an unpadded call of one seed draws the same numbers: compared also
        # for a callable that draws random numbers
        untold = _untold_difference(
            check, run, tensors, reference, given, expected_buffers, updated
        )
        if untold is not None:
            return untold, "untold", mode
    redrawn = run(tensors, 1)
    # it draws random numbers: a padded call draws for the padded shape, so values cannot be
    # compared, but the outputs' structure and shapes can, where two seeds agree on them
    draws = _difference(reference, redrawn, ()) is not None
    if draws and (not sample or _shape_difference(reference, redrawn, (), 0) is not None):
        return None
    given_padded: list[torch.Tensor] = []
    found = run(padded, 0, given_padded)
    cuts = output_cuts(check.padding, describe(found))
    shapes = _shape_difference(reference, found, cuts, check.length)
    if shapes is not None:
        return shapes, "shape", mode
    if draws:
        return None
    difference = _difference(reference, found, cuts, check.length)
    if difference is None:
        difference = _buffer_difference(check.named_buffers, expected_buffers, updated())
    if difference is None:
        difference = _updated_input_difference(check, given, given_padded)
    if difference is not None:
        return difference, "padded", mode
    if not sample:
        return None
    module = check.request.module
    params = [] if module is None else list(module.named_parameters())
    with torch.enable_grad():
        outputs, grads = _grads_both_ways(
            run,
            check.padding,
            tensors,
            check.wants_grad,
            params,
            check.full,
            updated,
            check.named_buffers,
        )
    if outputs is not None:
        return outputs, "padded", mode + ", with grad enabled (as replays run)"
    if grads is None:
        return None
    names = [n for n, wants in zip(check.guard.paths, check.wants_grad, strict=True) if wants]
    names += [f"parameter {name}" for name, p in params if p.requires_grad]
    difference = _grad_difference(names, *grads)
    return None if difference is None else (difference, "grads", mode)


def _updated_input_difference(
    check: _PaddedCheck, expected: Sequence[torch.Tensor], found: Sequence[torch.Tensor]
) -> str | None:
    """How the inputs a padded call was given (``found``, copies) differ after it from those
    of the call as it is (``expected``): an input it updates in place (a running total passed
    in), which a replay copies back into the caller's tensor. Padded inputs are left out: an
    update of one is refused before (:func:`_refuse_updates_of_the_call`)."""
    padded = {index for index, _ in check.padding.inputs}
    for index, (path, before, after) in enumerate(
        zip(check.guard.paths, expected, found, strict=True)
    ):
        if index not in padded:
            gap = _tensor_difference(before.detach(), after.detach())
            if gap is not None:
                return f"{path} (updated by the call) {gap}"
    return None


def _untold_difference(
    check: _PaddedCheck,
    run: Callable[..., Any],
    tensors: list[torch.Tensor],
    told: Any,
    told_inputs: Sequence[torch.Tensor],
    told_buffers: Sequence[torch.Tensor],
    updated: Callable[[], list[torch.Tensor]],
) -> str | None:
    """How the call of ``tensors`` without ``valid_length`` (as eager calls the callable)
    differs from ``told``, its outputs with ``valid_length`` of their full length (as every
    replay calls it, padded or not), in outputs, updated buffers or inputs it updates in place
    (``told_inputs``: the told call's copies, after it); None where they agree or where it
    cannot be called without (a required ``valid_length``: nothing to compare)."""
    untold_inputs: list[torch.Tensor] = []
    untold = _guarded(lambda: run(tensors, 0, untold_inputs, told=False))
    if untold is _REFUSED:
        return None
    difference = _difference(untold, told, ())
    if difference is None:
        names = [name for name, _ in check.named_buffers]
        for name, before, after in zip(names, updated(), told_buffers, strict=True):
            gap = _tensor_difference(before, after)
            if gap is not None:
                return f"buffer {name} (updated by the call) {gap}"
        for path, before, after in zip(check.guard.paths, untold_inputs, told_inputs, strict=True):
            gap = _tensor_difference(before.detach(), after.detach())
            if gap is not None:
                return f"{path} (updated by the call) {gap}"
    return difference


#: What :func:`_guarded` returns for a call the callable raised on.
_REFUSED: Any = object()


def _guarded(call: Callable[[], Any]) -> Any:
    """``call()`` (a run of the callable in the padding check), or :data:`_REFUSED` where the
    callable raises (a call or values it does not take: nothing to judge there), with the modes
    it left put back for the next run; dualgraph's own refusals (a graphed callable inside) go
    through.

    >>> _guarded(lambda: 1 / 0) is _REFUSED, _guarded(lambda: 2)
    (True, 2)
    """
    put_back_modes = kept_modes()
    try:
        return call()
    except DualgraphError:
        raise
    except Exception:
        put_back_modes()
        return _REFUSED


def _refuse_updates_of_the_call(
    name: str,
    padding: Padding,
    paths: Sequence[str],
    tensors: Sequence[torch.Tensor],
    given: Sequence[torch.Tensor],
    valid: torch.Tensor,
    length: int,
) -> None:
    """Refuse a call that updated a padded input or ``valid_length`` (made holding ``length``)
    in place: ``given`` are the fresh copies of ``tensors`` it was passed; a version moved or a
    value changed (an update through ``.data`` moves none)."""
    held = int(valid.item())
    if valid._version or held != length:
        found = f"it held {length}, then {held}" + (" (version moved)" if valid._version else "")
        _refuse_updated_input(name, padding, _VALID_LENGTH_PATH, found)
    for index, _ in padding.inputs:
        copy, original = given[index], tensors[index]
        if copy._version:
            _refuse_updated_input(name, padding, paths[index], "its version moved")
        if not same_bytes(bytes_of(copy), bytes_of(original)):  # through .data: no version
            _refuse_updated_input(name, padding, paths[index], "its values changed")


def _input_variants(
    padding: Padding, tensors: list[torch.Tensor]
) -> list[tuple[list[torch.Tensor], str]]:
    """The call's inputs; where a padded input is all zeros, the same with it given nonzero
    values (:func:`_nonzero_like`): the floats first, then the token ids and masks too; then
    the same with its
    floating padded inputs shifted below zero and above it: where zero is the largest or the
    smallest value, a max, min or sort over positions that forgets the mask picks a padded
    zero, which the sample's mixed signs may hide (a max over 16 random positions is almost
    never below zero, a max of log probabilities always is). Only inputs whose values take
    both signs are shifted: values on one side of zero may be a domain (probabilities,
    indices, lengths, a float keep-mask of ones and zeros), which a shift would leave
    (binary_cross_entropy or an index op out of range is a device-side assert on CUDA, which
    leaves the process unusable), and for them a padded zero already wins a max or a min on
    the sample's own values."""
    variants = [(tensors, "")]
    # Samples of zeros (a common way to give a capture its shapes: float hidden states, int64
    # token ids, a bool mask) are what padding adds, so a call padded with them equals the call
    # whatever the callable does with the padding: such inputs get nonzero values too.
    # The floats first on their own: ones given to a mask of False whose True means padding
    # (key_padding_mask) would mask every position, and the call's NaN could not be judged.
    zeros = [index for index, _ in padding.inputs if not tensors[index].any()]
    generator = torch.Generator().manual_seed(0)
    filled = list(tensors)
    for kind, label in (
        (_is_floating, " (with its all-zero padded inputs given values in (0, 1))"),
        (_fillable_discrete, " (with its all-zero padded inputs given nonzero values)"),
    ):
        chosen = [index for index in zeros if kind(tensors[index])]
        if chosen:
            filled = list(filled)
            for index in chosen:
                filled[index] = _nonzero_like(tensors[index], generator)
            variants.append((filled, label))
    floating = [
        index
        for index, _ in padding.inputs
        if tensors[index].dtype.is_floating_point and _both_signs(tensors[index])
    ]
    if not floating:
        return variants
    for sign, where in ((-1.0, "below"), (1.0, "above")):
        shifted = list(tensors)
        for index in floating:
            tensor = tensors[index]
            offset = tensor.abs().max() + 1
            shifted[index] = tensor + sign * offset
        variants.append((shifted, f" (with its padded inputs shifted {where} zero)"))
    return variants


def _is_floating(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _fillable_discrete(tensor: torch.Tensor) -> bool:
    """Bools (a mask), and integers (token ids) on the CPU only: an integer may index a table
    of one row (RoBERTa's token types, all zeros), where 1 is out of range; on the CPU that
    raises, and the check cannot judge those values, but on CUDA it is a device-side assert,
    which leaves the process unusable.

    >>> _fillable_discrete(torch.zeros(2, dtype=torch.bool)), _fillable_discrete(torch.zeros(2))
    (True, False)
    >>> ids = torch.zeros(2, dtype=torch.int64)
    >>> _fillable_discrete(ids), _fillable_discrete(ids.to("meta"))
    (True, False)
    """
    if tensor.dtype == torch.bool:
        return True
    return not _is_floating(tensor) and tensor.device.type == "cpu"


def _nonzero_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Values of ``tensor``'s shape and dtype that are not the zero padding, inside most domains:
    floats in (0, 1) (probabilities, keep-masks), ``True``, and for integers ones (an index any
    table of two rows takes, a token that is not the padding's ``0``).

    >>> generator = torch.Generator().manual_seed(0)
    >>> _nonzero_like(torch.zeros(3, dtype=torch.int64), generator).tolist()
    [1, 1, 1]
    >>> bool(((_nonzero_like(torch.zeros(3), generator) - 0.5).abs() < 0.5).all())
    True
    """
    if _is_floating(tensor):
        values = torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype)
        return values.to(tensor.device) * 0.98 + 0.01
    return torch.ones_like(tensor)


def _both_signs(tensor: torch.Tensor) -> bool:
    """Whether some values are below zero and some above (hidden states, not a domain).

    >>> _both_signs(torch.tensor([1.0, -0.5])), _both_signs(torch.tensor([1.0, 0.0, 0.5]))
    (True, False)
    """
    return bool((tensor < 0).any()) and bool((tensor > 0).any())


def _all_finite(outputs: Any) -> bool:
    spec = describe(outputs)
    return all(
        bool(t.isfinite().all())
        for t in spec.flatten(outputs)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    )


def _refuse_lost_views(
    name: str,
    padding: Padding,
    input_paths: Sequence[str],
    outputs: Any,
    inputs: Sequence[torch.Tensor],
) -> None:
    """Refuse outputs that share elements in eager where a padded call cannot keep them shared.

    A padded call cuts back the declared outputs (a copy) and hands the callable a padded copy
    of the padded inputs, so a view of a cut output, a cut output that views another output,
    and a view of a padded input would come back unlinked: an in-place change through one would
    not be seen through the other, as it is in eager. Outputs that are one tensor returned
    twice, a padded input returned itself, views among outputs that are not cut, and outputs
    that share a storage but no element (``h.chunk(2)``) stay as eager's.
    """
    spec = describe(outputs)
    flat = spec.flatten(outputs)
    paths = spec.array_paths
    cut = {index for index, _ in output_cuts(padding, spec)}
    padded = {index for index, _ in padding.inputs}
    earlier: dict[int, list[int]] = {}  # storage: the outputs (by position) found in it
    seen: set[int] = set()
    for k, tensor in enumerate(flat):
        if not isinstance(tensor, torch.Tensor) or id(tensor) in seen or not tensor.numel():
            continue
        seen.add(id(tensor))
        if any(tensor is inputs[i] for i in padded):
            continue  # the caller's own tensor is handed back
        storage = storage_key(tensor)
        for i, given in enumerate(inputs):
            if (i in padded or k in cut) and _shares_elements(tensor, given, storage):
                raise DualgraphError(
                    f"fallback='pad': {name}: output{paths[k]} is a view of {input_paths[i]} "
                    "(they share memory), which a padded call cannot keep: it pads a copy of "
                    f"{input_paths[i]} or cuts the output back into a copy, so an in-place change "
                    "through one would not be seen through the other as in eager. Return a copy "
                    "(.clone()), or use fallback='eager' or 'error'"
                )
        others = earlier.setdefault(storage, [])
        for other in others:
            if (k in cut or other in cut) and _shares_elements(tensor, flat[other], storage):
                raise DualgraphError(
                    f"fallback='pad': {name}: output{paths[k]} is a view of output{paths[other]} "
                    "(they share memory), which a padded call cannot keep: it cuts the declared "
                    "outputs back into copies, so an in-place change through one would not be "
                    "seen through the other as in eager. Return a copy (.clone()) of one of "
                    "them, or use fallback='eager' or 'error'"
                )
        others.append(k)


def _shares_elements(a: torch.Tensor, b: torch.Tensor, storage_of_a: int) -> bool:
    """Whether ``a`` and ``b`` hold a byte in common (runs at capture, on the samples)."""
    if not b.numel() or storage_key(b) != storage_of_a:
        return False
    if a.element_size() != b.element_size():
        return True  # as different dtypes: counted as shared
    return bool(torch.isin(_addresses(a), _addresses(b)).any())


def _addresses(tensor: torch.Tensor) -> torch.Tensor:
    """The storage offset of each element of ``tensor``, flat (int64, on the CPU)."""
    offsets = torch.full((), int(tensor.storage_offset()), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = offsets[..., None] + torch.arange(size, dtype=torch.int64) * stride
    return offsets.reshape(-1)


def _padded(
    padding: Padding, tensors: Sequence[torch.Tensor], length: int, full: int
) -> list[torch.Tensor]:
    """``tensors`` with each dynamic dim padded with zeros from ``length`` to ``full``."""
    padded = list(tensors)
    for index, dim in padding.inputs:
        tensor = tensors[index]
        padded[index] = F.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (0, full - length))
    return padded


def _grads_both_ways(
    run: Callable[[list[torch.Tensor], int], Any],
    padding: Padding,
    tensors: Sequence[torch.Tensor],
    wants_grad: Sequence[bool],
    params: Sequence[tuple[str, torch.nn.Parameter]],
    full: int,
    updated: Callable[[], list[torch.Tensor]] | None = None,
    buffers: Sequence[tuple[str, torch.Tensor]] = (),
) -> tuple[str | None, tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]] | None]:
    """A call and the same call padded, run under grad mode, as replays run: how the padded
    call's outputs, cut back, or the ``buffers`` it updates (their values read by ``updated``)
    differ (or None), and the grads of the inputs that want one and of the trainable
    parameters for each under one upstream grad (None when there are none).

    Outputs and buffers are compared here too: a callable may compute otherwise under grad mode
    than in the no-grad runs the forward check made (``torch.is_grad_enabled()`` read in
    Python; a running statistic kept only in a training step's forward). The
    cuts are found in these runs' own outputs: it may also return another structure under grad
    mode (an auxiliary loss). ``torch.autograd.grad`` leaves every ``.grad`` alone.
    """
    trainable = [p for _, p in params if p.requires_grad]
    runs = []
    for pad in (False, True):
        leaves = [
            t.detach().requires_grad_(wants) for t, wants in zip(tensors, wants_grad, strict=True)
        ]
        length = leaves[padding.inputs[0][0]].shape[padding.inputs[0][1]]
        outputs = run(_padded(padding, leaves, length, full) if pad else leaves, 0)
        spec = describe(outputs)
        cuts = output_cuts(padding, spec) if pad else ()
        after = updated() if updated is not None else []
        runs.append((leaves, outputs, _cut_arrays(spec, outputs, cuts, length), after))
    (_, expected, _, expected_buffers), (_, found, _, found_buffers) = runs
    difference = _difference(expected, found, output_cuts(padding, describe(found)), length)
    if difference is None and buffers:
        difference = _buffer_difference(buffers, expected_buffers, found_buffers)
    upstream: list[torch.Tensor] | None = None
    results = []
    for leaves, _, flat, _ in runs:
        carrying = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        targets = [leaf for leaf in leaves if leaf.requires_grad] + trainable
        if not carrying or not targets:
            return difference, None
        if upstream is None:
            upstream = [torch.randn_like(t) for t in carrying]
        if len(upstream) != len(carrying):
            return difference, None  # another set of outputs carries grad: judged above
        try:
            with outside_autocast():  # as a replay's backward runs (_capture_cuda)
                results.append(torch.autograd.grad(carrying, targets, upstream, allow_unused=True))
        except RuntimeError:
            return difference, None  # no backward to compare (warmup would have said why)
    return difference, (results[0], results[1])


def _buffer_difference(
    buffers: Sequence[tuple[str, torch.Tensor]],
    expected: Sequence[torch.Tensor],
    found: Sequence[torch.Tensor],
) -> str | None:
    """How the values ``found`` of ``buffers`` after a padded call differ from ``expected``."""
    for (name, _), before, after in zip(buffers, expected, found, strict=True):
        gap = _tensor_difference(before, after)
        if gap is not None:
            return f"buffer {name} (updated by the call) {gap}"
    return None


def _grad_difference(
    names: Sequence[str],
    expected: Sequence[torch.Tensor | None],
    found: Sequence[torch.Tensor | None],
) -> str | None:
    """How the grads ``found`` differ from ``expected`` (``None``: zero), or None."""
    for name, a, b in zip(names, expected, found, strict=True):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a  # type: ignore[arg-type]
        b = torch.zeros_like(a) if b is None else b
        difference = _tensor_difference(a, b)
        if difference is not None:
            return f"the grad of {name} {difference}"
    return None


def _shape_difference(
    expected: Any, found: Any, cuts: Sequence[tuple[int, int]], length: int
) -> str | None:
    """How ``found`` (its ``cuts`` narrowed to ``length``) differs from ``expected`` in
    structure or shapes, or None: what random draws leave comparable.

    >>> _shape_difference((torch.ones(2, 5),), (torch.ones(2, 8),), ((0, 1),), 5) is None
    True
    >>> _shape_difference((torch.ones(2, 5),), (torch.ones(2, 8),), (), 5)
    'output[0] has shape [2, 8] instead of [2, 5]'
    """
    spec, other = describe(expected), describe(found)
    difference = difference_but_shapes(spec, other)
    if difference is not None:
        path, want, got = difference
        return f"output{path} is {got}, not {want},"
    arrays = _cut_arrays(other, found, cuts, length)
    for leaf, a, b in zip(spec.arrays, spec.flatten(expected), arrays, strict=True):
        if a.shape != b.shape:
            return f"output{leaf.path} has shape {list(b.shape)} instead of {list(a.shape)}"
    return None


def _cut_arrays(
    spec: TreeSpec, outputs: Any, cuts: Sequence[tuple[int, int]], length: int
) -> list[Any]:
    """The arrays of ``outputs`` (described by ``spec``), ``cuts`` narrowed to ``length``."""
    arrays = spec.flatten(outputs)
    for index, dim in cuts:
        arrays[index] = arrays[index].narrow(dim, 0, length)
    return arrays


def _difference(
    expected: Any, found: Any, cuts: Sequence[tuple[int, int]], length: int = 0
) -> str | None:
    """How ``found`` (its ``cuts`` narrowed to ``length``) differs from ``expected``, or None."""
    difference = _shape_difference(expected, found, cuts, length)
    if difference is not None:
        return difference
    spec = describe(expected)
    arrays = _cut_arrays(describe(found), found, cuts, length)
    for leaf, a, b in zip(spec.arrays, spec.flatten(expected), arrays, strict=True):
        gap = _tensor_difference(a, b)
        if gap is not None:
            return f"output{leaf.path} {gap}"
    return None


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """``differs (by up to ...)`` where ``b`` is not ``a`` up to rounding, else None."""
    if a.layout != torch.strided or b.layout != torch.strided:  # a sparse embedding's grad
        a, b = a.to_dense(), b.to_dense()  # by its values: padding adds entries of zeros
    if a.dtype.is_floating_point or a.dtype.is_complex:
        # 32-bit on a GPU: TF32 convolutions (torch's default) round differently per shape
        rtol = (1e-2 if a.is_cuda else 1e-3) if a.element_size() >= 4 else 3e-2
        scale = a.abs().max().item() if a.numel() else 0.0
        gap = (a - b).abs().max().item() if a.numel() else 0.0
        if not gap <= rtol * scale + 1e-6:  # also refuses NaN
            return f"differs (by up to {gap:.3g}, of values up to {scale:.3g})"
    elif not torch.equal(a, b):
        if a.shape != b.shape:
            return f"has shape {list(b.shape)} instead of {list(a.shape)}"
        at = tuple((a != b).nonzero()[0].tolist())
        # the first element apart, as expected (the call as it is) and as found (padded)
        return f"differs (at {list(at)}: {b[at].item()} instead of {a[at].item()})"
    return None


def _requires_valid_length(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s signature says it cannot be called without ``valid_length`` (False where
    it cannot tell). A module is read through its ``forward``, where nothing that runs before
    it could pass one (its class's call is ``Module``'s, and no forward pre-hook is set).

    >>> _requires_valid_length(lambda x, valid_length: x)
    True
    >>> _requires_valid_length(lambda x, valid_length=None: x), _requires_valid_length(print)
    (False, False)
    """
    if isinstance(fn, torch.nn.Module):
        if (
            type(fn).__call__ is not torch.nn.Module.__call__
            or fn._forward_pre_hooks
            or torch.nn.modules.module._global_forward_pre_hooks
        ):
            return False
        fn = fn.forward
    try:
        parameter = inspect.signature(fn).parameters.get(VALID_LENGTH)
    except (TypeError, ValueError):  # no signature to read
        return False
    return (
        parameter is not None
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and parameter.default is parameter.empty
    )


def valid_length_position(fn: Callable[..., Any]) -> int | None:
    """Where ``valid_length`` stands among ``fn``'s positional parameters (a module's
    ``forward``'s), ``None`` where it is keyword-only, absent or the signature unreadable.

    >>> valid_length_position(lambda x, valid_length=None, scale=1.0: x)
    1
    >>> valid_length_position(lambda x, *, valid_length=None: x) is None
    True
    """
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, parameter in enumerate(positional):
        if parameter.name == VALID_LENGTH and parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
            return index
    return None


def _accepts_valid_length(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: warmup will tell
        return True
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == VALID_LENGTH and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in parameters
    )
