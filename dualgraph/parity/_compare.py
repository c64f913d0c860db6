"""``compare`` in five steps: prepare inputs, run torch, run JAX, compare outputs, compare grads."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optree
import torch

from .._call import CallSpec, describe_call
from .._containers import NAMESPACE
from .._dtypes import is_differentiable_dtype
from .._errors import DualgraphError, SpecMismatchError
from .._nodes import clip, clip_text
from .._orders import key_order_difference
from .._spec import LeafSpec, TreeSpec, describe
from ..jax import GraphedCallable, enable_x64, x64_enabled
from ._arrays import compare_arrays, first_difference
from ._bridge import as_torch, random_like, to_numpy, unreadable
from ._jax_side import JaxRun, reference_settings, run_jax
from ._probes import PROBE_VALUES, probed_parts, reached_entries, unit_name
from ._report import LeafReport, ParityReport
from ._tolerances import Tolerance, check_tolerances
from ._torch_side import (
    full_precision,
    named_params,
    read_grads,
    refuse_ambient_numerics,
    refuse_computed_params,
    refuse_default_dtype,
    refuse_detached_params,
    refuse_repeated_params,
    torch_device,
)

__all__ = ["assert_parity", "compare"]

#: dtypes that JAX narrows to 32 bits unless its 64-bit mode is on.
_WIDE_DTYPES = frozenset({"int64", "uint64", "float64", "complex128"})

Judge = Callable[[str, np.ndarray, np.ndarray], LeafReport]


def compare(
    torch_fn: Callable[..., Any],
    jax_fn: Callable[..., Any] | GraphedCallable,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    grads: bool = True,
    params: Any = None,
    params_from_torch: Callable[[dict[str, np.ndarray]], Any] | None = None,
    torch_params: Mapping[str, torch.Tensor] | None = None,
    tolerances: Tolerance | Mapping[str, Tolerance] | None = None,
    allow_nan: bool = False,
    seed: int = 0,
) -> ParityReport:
    """Run ``torch_fn(*args, **kwargs)`` and its JAX reference; compare outputs and gradients.

    - ``args``/``kwargs`` hold numpy arrays or torch tensors (and constants, ``None``). numpy
      inputs go to the device of ``torch_fn``'s parameters (the CPU when it has none).
    - ``torch_fn``: an ``nn.Module`` (graphed or not) or any callable.
    - ``jax_fn``: a function (compiled here with :func:`dualgraph.jax.graphed`) or a
      :class:`~dualgraph.jax.GraphedCallable`. With ``params``, it is called as
      ``jax_fn(params, *args, **kwargs)``.
    - ``params``: the JAX parameter pytree. Parameter gradients are compared after mapping the
      torch ones (``torch_params``, by default ``torch_fn.named_parameters()``) through
      ``params_from_torch({name: numpy array})`` into the same pytree, e.g.
      :func:`dualgraph.models.jax_vit.params_from_state_dict`; by default ``params`` must be a
      dict keyed by the torch parameter names (``torch_params`` and ``params_from_torch`` are
      refused without ``params``: no parameter grad would be compared; so are ``torch_params``
      of detached copies, such as ``module.state_dict()``, or of views of a trained parameter
      (its rows, ``w[:3]``), when gradients are compared: read as frozen or zero, none would
      be; so are computed ones, such as a parametrization's
      ``module.weight``, whose ``.grad`` torch never fills; and a trained parameter with a
      gradient that the mapping puts in no leaf; and ``params`` whose values are not the torch
      ones mapped, exactly, in the dtypes the mapping gives: a tree made from an older torch
      state). Frozen torch parameters are not compared: a JAX params leaf made of them (or of
      no torch parameter: a constant table the mapping builds, a buffer's values) is left
      out, and a leaf that mixes them with trained ones is compared at the trained ones'
      entries, those made of both (``base + delta``) included (found by mapping NaN through
      ``params_from_torch``). The report names what it leaves out (``left_out``), and the
      trained parameters of ``torch_fn`` given a gradient that ``torch_params`` omits.
      The gradients are mapped by ``params_from_torch`` too, which gives JAX's only where each
      entry is one trained torch entry or its negative (transposes, reshapes, splits,
      concatenations, casts; plus frozen entries): with gradients compared, a mapping that
      scales, offsets, sums or otherwise transforms a trained parameter (``2 * w``, ``w - 1``,
      ``exp(w)``) is refused naming the leaf, and so is one that puts a trained entry in two
      places (a tied weight given JAX as two leaves: torch's gradient is the sum over its
      uses, JAX's one per leaf), as are ``torch_params`` holding it under two names.
    - Gradients: random normal cotangents (``seed``) on the masked outputs of the JAX output
      spec (floating outputs, or the mask of a ``GraphedCallable``'s ``out_spec``, which must
      mask every torch output that requires grad: a ``SpecMismatchError`` names the first it
      leaves out), w.r.t. every floating input array and the parameters; complex ones as
      torch defines them. The torch side runs one backward and reads ``.grad`` (putting the
      previous ``.grad`` back, for the parameters not compared too: ``torch_fn``'s own and
      those its outputs' graph reaches), so a graphed callable that accumulates parameter
      grads inside its backward graph is measured as its users see them.
    - ``tolerances``: one :class:`Tolerance` for every floating leaf, or a mapping by dtype
      name over :data:`DEFAULT_TOLERANCES`. ``allow_nan=True`` accepts leaves that have no finite
      value on either side, e.g. NaN everywhere (still reported as a warning).
    - 64-bit: when an input, a parameter or a torch output is int64, uint64, float64 or
      complex128 and JAX's 64-bit mode is off, the JAX side runs inside
      :func:`dualgraph.jax.enable_x64`, so nothing is narrowed.

    Raises :class:`~dualgraph.SpecMismatchError` naming the path where the two outputs differ in
    structure, ``None`` positions, constants, shapes, dtypes or dict key orders; value
    differences are reported.
    A ``torch_fn`` that updates an input or a parameter in place is refused, naming it (JAX
    reads the inputs, and DLPack-made params, after torch has run, and has no in-place update to
    compare with); so is one whose backward updates a parameter whose gradient is compared (an
    optimizer step in a post-accumulate-grad hook, which also clears the ``.grad`` read). The
    torch side runs with gradients recorded, under the caller's
    ``torch.no_grad()`` or ``torch.inference_mode()`` too.

    Numerics are the comparison's own, not the caller's: TF32 and oneDNN's bfloat16 are off
    for the torch side (and restored; a graphed callable that convolves, captured with cuDNN's
    TF32 convolutions, cannot follow and is refused saying so); a call inside
    ``torch.autocast``, a torch function or dispatch mode (``torch.device`` excepted), or with a
    torch default dtype other than JAX's default float dtype (float32, or float64 in its 64-bit
    mode) is refused naming it, as ``torch_fn`` would not compute as written.
    ``torch.use_deterministic_algorithms`` and cuBLAS's reduced-precision reductions are left
    as they are (kernels, not precisions; and torch's default, which a graphed torch_fn
    captured).
    """
    _check_options(torch_fn, grads, seed)
    check_tolerances(tolerances)
    refuse_ambient_numerics()
    judge = functools.partial(compare_arrays, tolerances=tolerances, allow_nan=allow_nan)
    # Under the caller's torch.inference_mode() nothing would be recorded for the gradients, and
    # its tensors have no version counter to find in-place updates by: it is left for the call.
    with torch.inference_mode(False):
        both_params = _params_of(torch_fn, params, params_from_torch, torch_params, grads)
        inputs = _prepare_inputs(args, kwargs, grads, both_params)
        named = _named_params(torch_fn, both_params)
        if grads:
            _refuse_inference_params(named)
        kept = _KeptParams(_watched(named))
        torch_out = _run_torch(torch_fn, inputs, kept)
        wide = _first_wide_leaf(inputs.call_spec, params, torch_out)
        refuse_default_dtype(jax_in_64_bits=wide is not None or x64_enabled())
        with enable_x64(wide is not None), reference_settings(jax_fn):
            run = run_jax(jax_fn, inputs.call_spec.unflatten, inputs.tensors, params, grads=grads)
            spec = _agreed_output_spec(run.program.out_spec, torch_out, wide)
            entries = _compare_outputs(spec, torch_out, run.outputs, judge)
            left_out: list[str] = []
            if grads:
                _refuse_unmasked_torch_grads(spec, torch_out)
                others = _own_parameters(torch_fn)
                entries += _compare_grads(
                    spec, torch_out, run, inputs, kept, judge, seed, others, left_out
                )
    return ParityReport(tuple(entries), left_out=tuple(left_out))


def assert_parity(*args: Any, **kwargs: Any) -> ParityReport:
    """:func:`compare`, failing (``AssertionError``) with the worst leaf's path and the table.

    >>> import numpy as np, torch, jax.numpy as jnp
    >>> x = np.ones((2, 2), np.float32)
    >>> try:
    ...     assert_parity(lambda t: t * 2, lambda a: a * 2.001, (x,), grads=False)
    ... except AssertionError as error:
    ...     print(str(error).splitlines()[0])
    torch and JAX differ at output: 4 values over tolerance, worst at 2.5x (max abs 0.001)
    """
    __tracebackhide__ = True
    report = compare(*args, **kwargs)
    if not report.ok:
        worst = report.worst
        assert worst is not None
        raise AssertionError(f"torch and JAX differ at {worst.path}: {worst.reason}\n{report}")
    return report


# -- 1. prepare the inputs -----------------------------------------------------------------------


def _check_options(torch_fn: Any, grads: Any, seed: Any) -> None:
    """Refuse options that would be coerced (``grads="no"`` is truthy) or fail deep inside."""
    if not callable(torch_fn):
        raise DualgraphError(
            f"torch_fn: {clip(torch_fn)} ({type(torch_fn).__name__}) is not callable"
        )
    if not isinstance(grads, bool):
        raise DualgraphError(f"grads must be True or False, got {clip(grads)}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise DualgraphError(f"seed must be a non-negative int, got {clip(seed)}")


@dataclass(frozen=True)
class _Params:
    """The parameters on both sides: JAX's tree, torch's named tensors, the map between them."""

    jax: Any
    torch: dict[str, torch.Tensor]
    from_torch: Callable[[dict[str, np.ndarray]], Any]


def _params_of(
    torch_fn: Any,
    params: Any,
    params_from_torch: Callable[[dict[str, np.ndarray]], Any] | None,
    torch_params: Mapping[str, torch.Tensor] | None,
    grads: bool,
) -> _Params | None:
    if params is None:
        # Without params no parameter grad is compared: an option given for them would be
        # ignored, and a reference closing over its parameters would pass whatever their grads.
        for option, value in (
            ("torch_params", torch_params),
            ("params_from_torch", params_from_torch),
        ):
            if value is not None:
                raise DualgraphError(
                    f"compare: {option}= is given without params=, so no parameter gradient "
                    "would be compared; pass the JAX parameter tree as params= (the JAX function "
                    "is then called as jax_fn(params, *args, **kwargs))"
                )
        return None
    if params_from_torch is not None and not callable(params_from_torch):
        raise DualgraphError(
            f"params_from_torch: {clip(params_from_torch)} ({type(params_from_torch).__name__}) "
            "is not callable"
        )
    both = _Params(params, named_params(torch_fn, torch_params), params_from_torch or dict)
    for name, tensor in both.torch.items():
        problem = unreadable(tensor) if isinstance(tensor, torch.Tensor) else None
        if problem is not None:
            raise DualgraphError(f"torch parameter {name!r} is {problem}")
        if torch.nn.parameter.is_lazy(tensor):  # params must hold its values, which it has not
            raise DualgraphError(
                f"torch parameter {name!r} is uninitialized (a lazy module's, made by its first "
                "forward), so params cannot hold its values: run torch_fn once on a sample "
                "before comparing, and make params from the parameters it made"
            )
    if torch_params is not None and grads:  # without grads, no .grad is read
        refuse_detached_params(torch_fn, both.torch)
        refuse_computed_params(both.torch)
        refuse_repeated_params(both.torch)
    _check_params_match(both, grads)
    return both


def _check_params_match(params: _Params, grads: bool) -> None:
    """Refuse JAX params that are not the torch ones mapped, naming the path, before either
    side runs: a wrong shape would fail deep inside the JAX function, and other values (a tree
    made from an older torch state) would show as differing outputs and gradients."""
    # Copies: to_numpy shares a CPU tensor's memory, and a mapping may write into what it is
    # given (a padding row zeroed in place), which would change the torch module compared.
    arrays = {name: to_numpy(p).copy() for name, p in params.torch.items()}
    # In the 64-bit mode for 64-bit parameters, as the mapping runs for their gradients: one
    # that makes JAX arrays (jnp.asarray, models.jax_vit's) would narrow them, or refuse them.
    wide = any(a.dtype.name in _WIDE_DTYPES for a in arrays.values())
    with enable_x64(wide):
        mapped = params.from_torch(arrays)
    spec = describe(params.jax)
    try:
        spec.check(mapped, root="params")
    except SpecMismatchError as error:
        raise SpecMismatchError(
            "the JAX params do not match the torch parameters mapped by params_from_torch "
            f"(expected: the JAX params, got: the mapped torch ones): {error}",
            path=error.path,
        ) from None
    pairs = zip(spec.array_paths, spec.flatten(params.jax), spec.flatten(mapped), strict=True)
    for path, jax_leaf, torch_leaf in pairs:
        if isinstance(jax_leaf, jax.Array) and jax_leaf.is_deleted():
            raise DualgraphError(
                f"params{path}: this array has been deleted (donated to an earlier call, or "
                "deleted explicitly); pass a fresh array"
            )
        found = first_difference(_host(jax_leaf), _host(torch_leaf))
        if found is not None:
            index, jax_value, torch_value = found
            where = f"first at [{', '.join(map(str, index))}]: " if index else ""
            raise DualgraphError(
                f"params{path}: the JAX params hold other values than the torch parameters "
                f"mapped by params_from_torch ({where}JAX {jax_value}, torch {torch_value}), "
                "e.g. a JAX params tree made from an older torch state: the "
                "outputs would differ for that, not for the functions. Make params from the "
                "torch parameters as they are now"
            )
    if grads:  # the mapping maps the gradients too
        with enable_x64(wide):
            _refuse_unmappable_grads(params, spec, arrays)


def _refuse_unmappable_grads(
    params: _Params, spec: TreeSpec, arrays: Mapping[str, np.ndarray]
) -> None:
    """Refuse a ``params_from_torch`` through which torch's gradients are not JAX's.

    compare maps torch's parameter gradients with the mapping that maps their values, which
    gives JAX's gradient only where each entry of a params leaf is one trained torch entry
    (or its negative, or that plus frozen entries): a transpose, reshape, split,
    concatenation or cast. A scale (JAX holding ``2 * w`` has the gradient ``g / 2``, not
    ``2 * g``), an offset (``w - 1``: the gradient is ``g``, not ``g - 1``), a sum of trained
    entries or a non-linear map (``exp(w)``) would fail as if the functions differed. Found
    by mapping the trained parameters as 0, 1 and 2 (the frozen ones as they are), and every
    parameter as 0; complex trained parameters again as 0, 1j and 2j (a mapping's ``.imag``
    of a real probe is constant: ``w.imag + 1`` would pass).
    """
    trained = {n for n, p in params.torch.items() if p.requires_grad and _floating(arrays[n])}
    if not trained:
        return
    probes: list[complex] = [1]
    if any(arrays[name].dtype.kind == "c" for name in trained):
        probes.append(1j)
    for probe in probes:
        _refuse_unmappable_by(params, spec, arrays, trained, probe)
    _refuse_repeated_entries(params, spec, arrays, trained)


def _refuse_unmappable_by(
    params: _Params,
    spec: TreeSpec,
    arrays: Mapping[str, np.ndarray],
    trained: set[str],
    probe: complex,
) -> None:
    """:func:`_refuse_unmappable_grads` with the trained parameters probed as 0, ``probe`` and
    ``2 * probe`` (a real parameter as 0, 1 and 2 whatever ``probe``)."""

    def mapped(value: float, frozen_too: bool = False) -> list[np.ndarray]:
        given = {
            name: np.full_like(a, value * probe if a.dtype.kind == "c" else value)
            if name in trained or frozen_too
            else a.copy()
            for name, a in arrays.items()
        }
        return [np.asarray(x) for x in spec.flatten(params.from_torch(given))]

    shown, double_shown = ("1", "2") if probe == 1 else ("1j", "2j")
    leaves = zip(spec.array_paths, mapped(0), mapped(1), mapped(2), mapped(0, True), strict=True)
    for path, zero, one, two, origin in leaves:
        if not _floating(zero):
            continue
        # Within the leaf dtype's rounding: a frozen base plus a trained delta is rounded.
        eps = float(ml_dtypes.finfo(zero.dtype).eps)
        wide = np.complex128 if zero.dtype.kind == "c" else np.float64
        zero, one, two, origin = (x.astype(wide) for x in (zero, one, two, origin))
        with np.errstate(invalid="ignore", over="ignore"):
            unit, double = one - zero, two - zero
            reached = (unit != 0) | (double != 0) | np.isnan(unit) | np.isnan(double)
            slack = 4 * eps * (2 + np.abs(zero))
            linear = (np.abs(np.abs(unit) - 1) <= slack) & (np.abs(double - 2 * unit) <= slack)
            scaled = reached & ~linear
            offset = reached & ~scaled & np.isfinite(origin) & (np.abs(origin) > slack)
        for found, how in ((scaled, "scales or combines"), (offset, "offsets")):
            if found.any():
                index = tuple(int(i) for i in np.argwhere(found)[0])
                where = f"[{', '.join(map(str, index))}]" if index else ""
                raise DualgraphError(
                    f"params{path}: params_from_torch {how} the trained torch parameters there "
                    f"(at {where or 'the entry'}: trained parameters of {shown} map to "
                    f"{one[index]!s}, of {double_shown} to {two[index]!s}, "
                    "all parameters of 0 to "
                    f"{origin[index]!s}), and compare maps torch's gradients the same way, "
                    "which gives JAX's only where each entry is one trained torch entry (or "
                    "its negative): a transpose, reshape, split, concatenation or cast. JAX "
                    "params holding 2 * w, w - 1 or exp(w) have other gradients than 2 * g, "
                    "g - 1 or exp(g). Give the JAX function the parameters as torch holds "
                    "them, and scale or offset them inside it"
                )


def _refuse_repeated_entries(
    params: _Params, spec: TreeSpec, arrays: Mapping[str, np.ndarray], trained: set[str]
) -> None:
    """Refuse a ``params_from_torch`` that puts a trained torch entry into more than one
    entry of the JAX params (a tied weight given JAX as two leaves, a scalar broadcast into a
    leaf): torch's gradient of the entry is the sum over its uses, JAX's is one per place, so
    the two would fail as if the functions differed. Found by counting the entries the trained
    parameters reach (:func:`~dualgraph.parity._probes.reached_entries`, the others as 0), a
    complex one part by part: the real parts (real parameters whole), then the imaginary ones;
    each parameter is counted alone only when more come out than went in."""

    def leaves_of(given: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(x) for x in spec.flatten(params.from_torch(given))]

    base = {name: np.zeros_like(a) for name, a in arrays.items()}
    reference = leaves_of(base)

    def reached(units: list[tuple[str, str | None]]) -> list[tuple[str, int]]:
        masks = reached_entries(leaves_of, base, reference, units)
        counts = [
            (path, int(np.count_nonzero(mask)))
            for path, mask in zip(spec.array_paths, masks, strict=True)
            if mask is not None
        ]
        return [(path, count) for path, count in counts if count]

    for probe in ("real", "imaginary"):
        # the units this probe marks: a real parameter's entries are its real parts
        units = [
            (name, part)
            for name in sorted(trained)
            for part in probed_parts(arrays[name])
            if (part or "real") == probe
        ]
        if not units:
            continue
        if sum(n for _, n in reached(units)) <= sum(arrays[name].size for name, _ in units):
            continue
        for name, part in units:
            places_reached = reached([(name, part)])
            count = sum(n for _, n in places_reached)
            if count > arrays[name].size:
                places = ", ".join(f"params{path} ({n})" for path, n in places_reached)
                raise DualgraphError(
                    f"torch parameter {unit_name(name, part)}: params_from_torch puts its "
                    f"{arrays[name].size} entries into {count} entries of the JAX params "
                    f"({clip_text(places)}): an entry used in two places (a tied weight given "
                    "JAX as two leaves, a value broadcast) has one gradient in torch, the sum "
                    "over its uses, and one per place in JAX, so they would differ whatever "
                    "the functions. Give the JAX function one leaf for it and use that leaf "
                    "in each place"
                )


def _host(leaf: Any) -> np.ndarray:
    """A params leaf (a JAX or numpy array, or a torch tensor a mapping returned) as numpy; a
    typed PRNG key as its key data."""
    if isinstance(leaf, torch.Tensor):
        return to_numpy(leaf)
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


@dataclass(frozen=True)
class _Inputs:
    """The call as torch sees it: flat tensors (requiring grad where compared), parameters."""

    call_spec: CallSpec
    tensors: list[torch.Tensor]
    wants_grad: list[bool]
    params: _Params | None


def _prepare_inputs(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None, grads: bool, params: _Params | None
) -> _Inputs:
    call_spec = describe_call(args, kwargs)  # args a tuple or list, kwargs a mapping or None
    samples = call_spec.flatten(tuple(args), dict(kwargs or {}))
    device = torch_device([*samples, *(params.torch.values() if params else ())])
    wants_grad = [grads and is_differentiable_dtype(leaf.dtype or "") for leaf in call_spec.arrays]
    tensors = []
    for path, leaf, x in zip(call_spec.array_paths, call_spec.arrays, samples, strict=True):
        problem = unreadable(x) if isinstance(x, torch.Tensor) else None
        if problem is not None:
            raise DualgraphError(f"{path} is {problem}")
        try:
            tensors.append(as_torch(x, device))
        except Exception as error:  # a dtype torch has no tensor of, e.g. numpy's long double
            raise DualgraphError(
                f"{path}: {leaf} cannot be handed to torch ({type(error).__name__}: "
                f"{clip_text(error)})"
            ) from error
    for path, tensor, wanted in zip(call_spec.array_paths, tensors, wants_grad, strict=True):
        problem = unreadable(tensor)  # a numpy array torch reads in a dtype it cannot copy
        if problem is not None:
            raise DualgraphError(f"{path} is {problem}")
        tensor.requires_grad_(wanted)
    return _Inputs(call_spec, tensors, wants_grad, params)


# -- 2. run torch ----------------------------------------------------------------------------------


def _named_params(torch_fn: Any, params: _Params | None) -> dict[str, torch.Tensor]:
    """The torch parameters of the comparison: those compared (``params``), else a module's own
    (a JAX reference may close over them)."""
    if params is not None:
        return params.torch
    if isinstance(torch_fn, torch.nn.Module):
        return dict(torch_fn.named_parameters())
    return {}


def _own_parameters(torch_fn: Any) -> dict[str, torch.Tensor]:
    """A module's (or graphed callable's) parameters by name, less a lazy module's
    uninitialized ones: a graphed backward may add into their ``.grad`` inside its graph, where
    no autograd node of the outputs' graph leads to them."""
    named = getattr(torch_fn, "named_parameters", None)
    if not callable(named):
        return {}
    return {n: p for n, p in named() if not torch.nn.parameter.is_lazy(p)}


def _refuse_inference_params(named: Mapping[str, torch.Tensor]) -> None:
    """Refuse parameters made under ``torch.inference_mode()`` when gradients are compared:
    torch cannot differentiate through them (its error, from inside torch_fn, names none)."""
    for name, p in named.items():
        if not torch.nn.parameter.is_lazy(p) and p.is_inference():
            raise DualgraphError(
                f"torch parameter {name!r} is an inference tensor (made under "
                "torch.inference_mode()), which torch cannot differentiate through, so no "
                "gradient can be compared: make the module outside inference mode, or compare "
                "with grads=False"
            )


def _watched(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters ``torch_fn`` must leave as they are, less those holding no values yet (a
    lazy module's, which its first forward makes) or none at all (meta), and inference tensors
    (made under ``torch.inference_mode()``: torch refuses to update them outside it)."""
    return {
        name: p
        for name, p in named.items()
        if not torch.nn.parameter.is_lazy(p) and unreadable(p) is None and not p.is_inference()
    }


class _KeptParams:
    """The parameters ``torch_fn`` must leave as they are, by version and value (writes through
    ``.data`` move no version counter), kept before it runs; :meth:`refuse_updated` names one it
    changed, in its forward or its backward."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._kept = [(name, p, p._version, p.detach().clone()) for name, p in params.items()]

    def refuse_updated(self, *, in_backward: bool = False) -> None:
        for name, p, version, kept in self._kept:
            if p._version == version and _same_values(p.detach(), kept):
                continue
            if in_backward:
                raise DualgraphError(
                    f"torch parameter {name!r}: torch_fn's backward updated it in place (e.g. an "
                    "optimizer step in a post-accumulate-grad hook, which also clears its "
                    ".grad): compare's backward, of random cotangents, changed it, and its "
                    "gradient, read after the backward, would not be the one the backward "
                    "computed. Compare a torch_fn whose backward leaves its parameters as they "
                    "are"
                )
            raise DualgraphError(
                f"torch parameter {name!r}: torch_fn updated it in place (e.g. "
                "nn.Embedding(max_norm=...) renormalizes its rows in its forward); the JAX "
                "reference has no update to compare with, and reads either the values from "
                "before or, sharing their memory (DLPack), the updated ones. Compare a torch_fn "
                "that leaves its parameters as they are"
            )


def _run_torch(torch_fn: Callable[..., Any], inputs: _Inputs, params: _KeptParams) -> Any:
    """``torch_fn`` on the inputs; an update of an input or a kept parameter is refused.

    Parameters are kept too: JAX params made through DLPack (``jax.dlpack.from_dlpack(
    p.detach())``, no copy) share their memory, so an update in the forward
    (``nn.Embedding(max_norm=...)`` renormalizes its rows in place) would reach a JAX reference
    that never makes it, and both would match.
    """
    args, kwargs = inputs.call_spec.unflatten(inputs.tensors)
    versions = [t._version for t in inputs.tensors]
    # Writes through .data or a numpy view do not move the version counter: values are kept too.
    before = [t.detach().clone() for t in inputs.tensors]
    with full_precision(), torch.enable_grad():
        out = torch_fn(*args, **kwargs)
    params.refuse_updated()
    # JAX reads the same memory afterwards (DLPack): it would see torch's new values, and a
    # reference that ignores the update would match. JAX functions cannot update in place, so
    # there is nothing to compare the update with.
    paths = inputs.call_spec.array_paths
    for path, t, version, kept in zip(paths, inputs.tensors, versions, before, strict=True):
        if t._version != version or not _same_values(t.detach(), kept):
            raise DualgraphError(
                f"{path}: torch_fn updated it in place; the JAX reference cannot, and would be "
                "handed the updated values. Compare a torch_fn that updates a copy "
                "(x = x.clone()) and returns what the JAX function returns"
            )
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal entry by entry, NaN matching NaN (a sparse tensor by its dense values)."""
    if a.layout != torch.strided:  # torch's eq and equal take no sparse CSR, eq no sparse COO
        a, b = a.to_dense(), b.to_dense()
    if a.is_floating_point() or a.is_complex():
        return bool((a.eq(b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


# -- 3. run JAX (in 64-bit mode when a 64-bit leaf is involved) ------------------------------------


def _first_wide_leaf(call_spec: CallSpec, params: Any, torch_out: Any) -> str | None:
    """``"<path> is <leaf>"`` for the first 64-bit leaf JAX would narrow; ``None`` if none is."""
    if x64_enabled():
        return None
    for path, leaf in _leaves_to_check(call_spec, params, torch_out):
        if leaf.dtype in _WIDE_DTYPES:
            return f"{path} is {leaf}"
    return None


def _leaves_to_check(
    call_spec: CallSpec, params: Any, torch_out: Any
) -> Iterator[tuple[str, LeafSpec]]:
    yield from zip(call_spec.array_paths, call_spec.arrays, strict=True)
    for root, tree in (("params", params), ("output", torch_out)):
        spec = describe(tree, root=root)
        yield from zip((root + p for p in spec.array_paths), spec.arrays, strict=True)


# -- 4. compare outputs ----------------------------------------------------------------------------


def _agreed_output_spec(jax_spec: TreeSpec, torch_out: Any, wide: str | None) -> TreeSpec:
    """JAX's output spec, once torch's output is known to match it (else the path that differs)."""
    try:
        jax_spec.check(torch_out, root="output")
    except SpecMismatchError as error:
        hint = f"; the JAX side ran in 64-bit mode because {wide}" if wide else ""
        raise SpecMismatchError(
            f"the torch and JAX outputs differ in structure: {error} (expected: what JAX "
            f"returns, got: what torch returns){hint}",
            path=error.path,
        ) from None
    found = key_order_difference(jax_spec, describe(torch_out))
    if found is not None:
        path, expected, got = found
        raise SpecMismatchError(
            f"output{path}: torch_fn returns a dict with its keys in the order {list(got)!r}, "
            f"the JAX function in the order {list(expected)!r} (what iterates over the dict, "
            "its .values() or a concatenation, would differ)",
            path="output" + path,
        )
    for path, leaf in zip(jax_spec.array_paths, jax_spec.flatten(torch_out), strict=True):
        if not isinstance(leaf, torch.Tensor):
            kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
            raise SpecMismatchError(
                f"output{path}: torch_fn returned a {kind}, not a torch tensor",
                path="output" + path,
            )
        problem = unreadable(leaf)
        if problem is not None:
            raise SpecMismatchError(
                f"output{path}: torch_fn returned {problem}", path="output" + path
            )
    return jax_spec


def _compare_outputs(
    spec: TreeSpec, torch_out: Any, jax_out: Any, judge: Judge
) -> list[LeafReport]:
    pairs = zip(spec.array_paths, spec.flatten(torch_out), spec.flatten(jax_out), strict=True)
    return [judge("output" + path, to_numpy(t), np.asarray(j)) for path, t, j in pairs]


# -- 5. compare gradients --------------------------------------------------------------------------


def _refuse_unmasked_torch_grads(spec: TreeSpec, torch_out: Any) -> None:
    """Refuse a torch output that requires grad where the JAX grad mask leaves it out.

    No cotangent would reach it on either side, so the gradients through it, which torch
    computes, would never be compared. Only an explicit ``out_spec`` masks a floating output
    off (without one, JAX masks every floating output). The other way round is accepted: a
    masked output torch does not differentiate (``.detach()``) takes its cotangent on the JAX
    side only, and passes where the JAX function stops its gradient too.
    """
    leaves = zip(spec.array_paths, spec.grad_mask, spec.flatten(torch_out), strict=True)
    for path, masked, tensor in leaves:
        if tensor.requires_grad and not masked:
            raise SpecMismatchError(
                f"output{path}: torch_fn's output requires grad, but the JAX side's grad mask "
                "(its GraphedCallable's out_spec) leaves it out, so the gradients through it "
                "would never be compared. Graph the JAX function with an out_spec that masks "
                "it (the torch side's out_spec does), or detach it in torch_fn",
                path="output" + path,
            )


def _compare_grads(
    spec: TreeSpec,
    torch_out: Any,
    run: JaxRun,
    inputs: _Inputs,
    kept: _KeptParams,
    judge: Judge,
    seed: int,
    others: Mapping[str, torch.Tensor],
    left_out: list[str],
) -> list[LeafReport]:
    """The same seeded cotangents through both backwards; input grads, then parameter grads.
    The ``.grad`` of ``others`` (``torch_fn``'s parameters by name) is left as it was; the
    floating params leaves not compared are added to ``left_out``, saying why, and so are
    the trained ``others`` given a gradient that ``torch_params`` leaves out."""
    assert run.pullback is not None
    rng = np.random.default_rng(seed)
    masked = [
        (leaf, t)
        for leaf, t, m in zip(spec.arrays, spec.flatten(torch_out), spec.grad_mask, strict=True)
        if m
    ]
    cotangents = [random_like(rng, leaf.dtype or "", leaf.shape or ()) for leaf, _ in masked]

    params = inputs.params
    trainable = {n: p for n, p in params.torch.items() if p.requires_grad} if params else {}
    targets = [t for t, wanted in zip(inputs.tensors, inputs.wants_grad, strict=True) if wanted]
    # torch_fn's trained parameters that torch_params leaves out: their gradients go uncompared
    # (a JAX reference closing over them passes whatever they are), so the report names those
    # the backward gives one.
    compared = {id(t) for t in trainable.values()}
    uncompared = (
        {n: p for n, p in others.items() if p.requires_grad and id(p) not in compared}
        if params is not None
        else {}
    )
    with _accumulations(trainable) as accumulated:
        torch_grads = read_grads(
            [(t, ct) for (_, t), ct in zip(masked, cotangents, strict=True)],
            [*targets, *trainable.values(), *uncompared.values()],
            others.values(),
        )
    uncompared_grads = torch_grads[len(targets) + len(trainable) :]
    torch_grads = torch_grads[: len(targets) + len(trainable)]
    # The backward must leave the parameters be: their grads are read after it, and, compared
    # or not, a comparison must not step them (an optimizer in a post-accumulate-grad hook).
    kept.refuse_updated(in_backward=True)
    if params is not None:
        _refuse_cleared_grads(trainable, torch_grads[len(targets) :], accumulated)
    # torch's gradients are JAX's conjugated, given the conjugate cotangent (see _in_torch_terms)
    cotangent_tree = run.pullback.cotangent_spec.unflatten(
        [jnp.asarray(np.conj(c) if np.iscomplexobj(c) else c) for c in cotangents]
    )
    args_grads, kwargs_grads = run.pullback(cotangent_tree)
    if params is not None:
        param_grads, args_grads = args_grads[0], args_grads[1:]

    paths = [p for p, w in zip(inputs.call_spec.array_paths, inputs.wants_grad, strict=True) if w]
    jax_grads: list[Any] = optree.tree_leaves(
        (args_grads, kwargs_grads),  # type: ignore[arg-type]  # optree's PyTree type is narrow
        namespace=NAMESPACE,
    )
    entries = [
        _noted_if_failing(
            judge("grad " + path, _grad_as_numpy(t, j), _in_torch_terms(j)),
            None if t is not None else _NO_TORCH_GRAD.format(where="here"),
        )
        for path, t, j in zip(paths, torch_grads[: len(targets)], jax_grads, strict=True)
    ]
    if params is not None:
        torch_param_grads = dict(zip(trainable, torch_grads[len(targets) :], strict=True))
        entries += _param_grad_reports(params, param_grads, torch_param_grads, judge, left_out)
    left_out += [
        f"grad of torch parameter {name!r} (trained, not in torch_params)"
        for name, grad in zip(uncompared, uncompared_grads, strict=True)
        if grad is not None
    ]
    return entries


@contextlib.contextmanager
def _accumulations(params: Mapping[str, torch.Tensor]) -> Iterator[set[str]]:
    """The names of the parameters with post-accumulate-grad hooks (which may take ``.grad``
    away) whose ``.grad`` the backward run inside accumulated into, found by a hook of compare's
    own registered after theirs. Parameters without such hooks get none: a graphed callable
    whose backward adds into ``.grad`` itself refuses parameters with hooks."""
    accumulated: set[str] = set()
    handles = []
    try:
        for name, p in params.items():
            if p.is_leaf and getattr(p, "_post_accumulate_grad_hooks", None):
                record = functools.partial(lambda name, _: accumulated.add(name), name)
                handles.append(p.register_post_accumulate_grad_hook(record))
        yield accumulated
    finally:
        for handle in handles:
            handle.remove()


def _refuse_cleared_grads(
    trainable: Mapping[str, torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    accumulated: set[str],
) -> None:
    """Refuse a parameter whose gradient the backward accumulated and a hook then took away
    (a post-accumulate-grad hook that moves or offloads it and clears ``.grad``): read as zero,
    it would not be the one the backward computed."""
    for name, grad in zip(trainable, grads, strict=True):
        if grad is None and name in accumulated:
            raise DualgraphError(
                f"torch parameter {name!r}: torch_fn's backward computed its gradient, but left "
                "it without a .grad (a hook cleared it, a post-accumulate-grad hook moving or "
                "offloading the gradient): it would be read as zero. Compare a torch_fn whose "
                "hooks leave .grad in place"
            )


#: The note of a failing gradient torch left without a ``.grad`` (read as zeros).
_NO_TORCH_GRAD = (
    "torch gives no gradient {where}: no torch output that requires grad reaches it (a "
    ".detach(), torch.no_grad() or a path through integers), where JAX's is nonzero"
)


def _noted_if_failing(entry: LeafReport, note: str | None) -> LeafReport:
    """``entry`` with ``note`` added to its reason where it fails (failure path only)."""
    return entry if note is None or entry.ok else dataclasses.replace(entry, note=note)


def _in_torch_terms(grad: Any) -> np.ndarray:
    """A JAX gradient as torch defines it: for a complex leaf, its conjugate.

    For the cotangent ``v``, torch's backward gives ``conj(vjp(conj(v)))`` of JAX's (torch
    differentiates by the conjugate Wirtinger derivative, JAX takes the plain one), so the JAX
    side is handed ``conj(v)`` and its complex gradients are conjugated; real leaves are the
    same under both conventions.
    """
    grad = np.asarray(grad)
    return np.conj(grad) if np.iscomplexobj(grad) else grad


def _grad_as_numpy(grad: torch.Tensor | None, like: Any) -> np.ndarray:
    """A torch grad as numpy; an input torch left without a grad (unused) has a zero one."""
    return np.zeros_like(np.asarray(like)) if grad is None else to_numpy(grad)


def _param_grad_reports(
    params: _Params,
    jax_grads: Any,
    torch_grads: Mapping[str, torch.Tensor | None],
    judge: Judge,
    left_out: list[str],
) -> list[LeafReport]:
    """Torch's parameter grads mapped into the JAX params tree, compared leaf by leaf; a
    floating leaf made of frozen torch parameters only, or of none, is added to ``left_out``."""
    convert, named = params.from_torch, params.torch
    params_spec = describe(params.jax)
    as_numpy = {
        name: to_numpy(_grad_or_zeros(torch_grads.get(name), p)) for name, p in named.items()
    }
    try:
        converted = params_spec.flatten(convert(as_numpy), check=True, root="params")
    except SpecMismatchError as error:
        raise SpecMismatchError(
            "the torch parameter grads, mapped by params_from_torch, do not match the JAX "
            f"params: {error}",
            path=error.path,
        ) from None
    dropped = _unmapped_trained_param(params_spec, as_numpy, torch_grads, convert)
    if dropped is not None:
        raise DualgraphError(
            f"torch parameter {dropped} has a gradient, but params_from_torch maps it into no "
            "leaf of the JAX params, so its gradient would not be compared (a JAX reference that "
            "lacks the parameter, or closes over it, would pass whatever it is). Map it into "
            "params, or freeze it (requires_grad_(False)) to leave it out"
        )
    frozen = _frozen_positions(params_spec, as_numpy, torch_grads, convert)
    jax_leaves = iter(optree.tree_leaves(jax_grads, namespace=NAMESPACE))
    reports = []
    for path, leaf, torch_grad, from_frozen in zip(
        params_spec.array_paths, params_spec.arrays, converted, frozen, strict=True
    ):
        if not is_differentiable_dtype(leaf.dtype or ""):
            continue  # JAX gives no grad for it; nor does torch
        expected = _in_torch_terms(next(jax_leaves))
        actual = np.asarray(torch_grad)
        if from_frozen is not None:
            if from_frozen.all():  # made of frozen parameters only, or of none
                left_out.append(f"grad params{path} (no trained torch parameter behind it)")
                continue
            # torch has no grad there, JAX does: neither side's value there is compared
            actual, expected = actual.copy(), expected.copy()
            actual[from_frozen] = 0
            expected[from_frozen] = 0
        reports.append(judge("grad params" + path, actual, expected))
    without = [n for n, g in torch_grads.items() if g is None and _floating(as_numpy[n])]
    if without and not all(entry.ok for entry in reports):
        reached = _reached_by(params_spec, as_numpy, without, convert)
        reports = [
            _noted_if_failing(
                entry,
                _NO_TORCH_GRAD.format(
                    where="to torch parameter "
                    + ", ".join(map(repr, reached[entry.path.removeprefix("grad params")]))
                    + " behind it"
                )
                if reached.get(entry.path.removeprefix("grad params"))
                else None,
            )
            for entry in reports
        ]
    return reports


def _reached_by(
    params_spec: TreeSpec,
    as_numpy: Mapping[str, np.ndarray],
    names: Sequence[str],
    convert: Callable[[dict[str, np.ndarray]], Any],
) -> dict[str, list[str]]:
    """For each params leaf path, the torch parameters among ``names`` whose entries reach it
    through ``params_from_torch`` (each mapped as NaN, the others as ones)."""
    ones = {name: np.ones_like(a) for name, a in as_numpy.items()}
    found: dict[str, list[str]] = {}
    for name in names:
        given = {**ones, name: _nan_filled(ones[name])}
        leaves = params_spec.flatten(convert(given))
        for path, leaf in zip(params_spec.array_paths, leaves, strict=True):
            array = np.asarray(leaf)
            if _floating(array) and np.isnan(array).any():
                found.setdefault(path, []).append(name)
    return found


def _floating(array: np.ndarray) -> bool:
    return is_differentiable_dtype(array.dtype.name)  # bfloat16 and float8 too (kind "V")


def _grad_or_zeros(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param, requires_grad=False) if grad is None else grad


def _unmapped_trained_param(
    params_spec: TreeSpec,
    as_numpy: Mapping[str, np.ndarray],
    torch_grads: Mapping[str, Any],
    convert: Callable[[dict[str, np.ndarray]], Any],
) -> str | None:
    """The first trained torch parameter with a nonzero gradient whose entries reach no leaf of
    the JAX params through ``params_from_torch``
    (:func:`~dualgraph.parity._probes.reached_entries`), as ``"'w'"``, or
    ``"'w' (its imaginary part)"`` for a part of a complex one with a nonzero gradient there
    (a mapping keeping ``w.real`` only); ``None`` if none.

    The real parts (real parameters whole), then the imaginary ones, are probed together, and
    their count of entries reached settles the usual case; only when fewer come out than went
    in (a parameter or a part dropped, entries summed together, a clip) is each part probed
    alone. A parameter without a gradient (unused by ``torch_fn``) may be left out.
    """
    # (name, part): part None for a real parameter, else "real" or "imaginary"
    candidates = [
        (name, part)
        for name, grad in torch_grads.items()
        if grad is not None and _floating(as_numpy[name])
        for part in probed_parts(as_numpy[name])
        if np.any(_part_of(as_numpy[name], part) != 0)
    ]
    if not candidates:
        return None
    base = {name: np.ones_like(a) for name, a in as_numpy.items()}
    base.update((name, np.zeros_like(base[name])) for name, _ in candidates)

    def leaves_of(given: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(x) for x in params_spec.flatten(convert(given))]

    reference = leaves_of(base)

    def count(units: list[tuple[str, str | None]], values: tuple[float, ...]) -> int:
        masks = reached_entries(leaves_of, base, reference, units, values)
        return sum(int(np.count_nonzero(mask)) for mask in masks if mask is not None)

    for probe in ("real", "imaginary"):
        units = [(name, part) for name, part in candidates if (part or "real") == probe]
        if units and count(units, PROBE_VALUES[:1]) < sum(as_numpy[n].size for n, _ in units):
            break
    else:
        return None
    for name, part in candidates:
        if count([(name, part)], PROBE_VALUES) == 0:
            return unit_name(name, part)
    return None


def _part_of(a: np.ndarray, part: str | None) -> np.ndarray:
    """``part`` of ``a`` (:func:`~dualgraph.parity._probes.probed_parts`): ``a.real``,
    ``a.imag``, or ``a`` itself."""
    return a if part is None else a.real if part == "real" else a.imag


def _filled(a: np.ndarray, value: float) -> np.ndarray:
    """``a`` filled with ``value``, a complex one in both parts (so that a mapping's ``.imag``
    of it moves with ``value`` too)."""
    return np.full_like(a, complex(value, value) if a.dtype.kind == "c" else value)


def _nan_filled(a: np.ndarray) -> np.ndarray:
    """``a`` filled with NaN, a complex one in both parts (``np.full_like(a, np.nan)`` leaves
    its imaginary part 0, which ``.imag`` maps to no NaN at all)."""
    return np.full_like(a, complex(np.nan, np.nan) if a.dtype.kind == "c" else np.nan)


def _frozen_positions(
    params_spec: TreeSpec,
    as_numpy: Mapping[str, np.ndarray],
    torch_grads: Mapping[str, Any],
    convert: Callable[[dict[str, np.ndarray]], Any],
) -> list[np.ndarray | None]:
    """For each params leaf, where its entries come from frozen torch parameters only, or from
    none (a constant the mapping makes) (``None``: nowhere).

    Ones are mapped through ``params_from_torch`` with the frozen parameters' entries NaN, and
    again with the trained ones' NaN: the entries NaN in the first and not in the second (nor
    when every entry is one) come from frozen parameters alone, whatever arithmetic the mapping
    does (``w - 1`` turns a 0/1 mask into another one; a concatenation mixes frozen and trained
    entries in one leaf). An entry made of both (``base + delta``, a frozen base and a trained
    delta merged into one leaf) carries the trained one's gradient, and is compared.
    """
    ones = {name: np.ones_like(a) for name, a in as_numpy.items()}

    def marking(frozen: bool) -> list[Any]:
        """The leaves of the mapped ones with the frozen (else the trained) parameters NaN."""
        marked = {
            name: _nan_filled(a) if _floating(a) and (name in torch_grads) != frozen else a
            for name, a in ones.items()
        }
        return params_spec.flatten(convert(marked))

    def every_parameter_as(value: float) -> list[Any]:
        """The leaves of the mapping of every floating parameter as ``value`` (others as 1)."""
        given = {n: _filled(a, value) if _floating(a) else a for n, a in ones.items()}
        return params_spec.flatten(convert(given))

    # Entries the mapping makes of no torch parameter (a constant table it builds, a buffer's
    # values): they stay put whatever the parameters are, and torch has no gradient there, so
    # the mapping's constant would be compared with JAX's gradient as if it were torch's.
    # Both ways: a clip (max(w, 5)) is constant at 0, 1 and 2 too, but carries NaN through.
    made_of_none = [
        None
        if not _floating(np.asarray(zero))
        else (np.asarray(zero) == np.asarray(one))
        & (np.asarray(zero) == np.asarray(two))
        & ~np.isnan(np.asarray(nan))
        for zero, one, two, nan in zip(
            every_parameter_as(0),
            every_parameter_as(1),
            every_parameter_as(2),
            every_parameter_as(np.nan),
            strict=True,
        )
    ]
    if len(torch_grads) == len(as_numpy):  # nothing frozen
        return [None if m is None or not m.any() else m for m in made_of_none]
    result: list[np.ndarray | None] = []
    for plain, by_frozen, by_trained, constant in zip(
        params_spec.flatten(convert(ones)),
        marking(True),
        marking(False),
        made_of_none,
        strict=True,
    ):
        plain, by_frozen, by_trained = (np.asarray(x) for x in (plain, by_frozen, by_trained))
        if not _floating(by_frozen) or constant is None:
            result.append(None)
            continue
        frozen = (np.isnan(by_frozen) & ~np.isnan(by_trained) & ~np.isnan(plain)) | constant
        result.append(frozen if frozen.any() else None)
    return result
