"""Cross-check a PyTorch callable against a JAX reference, leaf by leaf, aligned by spec path.

:func:`compare` runs both on the same inputs (numpy arrays or torch tensors, handed to JAX
through DLPack without a copy where both frameworks live on the same device), checks that the
two output specs agree (``None`` positions, constants, shapes, dtypes), then compares every output
array and, with ``grads=True``, the gradients that the same seeded random cotangents give for the
floating inputs and for the parameters. :func:`assert_parity` is the pytest form.

Default tolerances, per dtype of the leaf. A leaf passes where, elementwise,
``|torch - jax| <= rtol * |jax| + atol * scale``, ``scale`` being the leaf's largest ``|jax|``
(at least 1): rounding errors of a sum follow the size of its terms, not of its result, so the
entries of a gradient that nearly cancel to zero are held to the leaf's own scale. ``rtol=`` and
``atol=`` override the table for every floating leaf.

=================================  ========  ========
dtype                              rtol      atol
=================================  ========  ========
float64, complex128                1e-7      1e-9
float32, complex64 (TF32 off)      1e-4      1e-5
float16                            5e-3      1e-3
bfloat16                           3.2e-2    3.2e-2
float8 (e4m3, e5m2)                2.5e-1    1.25e-1
integers, bool                     exact     exact
=================================  ========  ========

Measured on an H200 (torch 2.11, jax 0.11): a depth-6, width-384 ViT encoder with CUDA-graphed
blocks against :mod:`dualgraph.models.jax_vit` used at most 0.08 (float32) and 0.38 (bfloat16)
of these tolerances, outputs and all parameter gradients included.

float32 is compared at full precision: TF32 is turned off in PyTorch for the duration (and
restored), and the JAX reference is traced under ``jax.default_matmul_precision("highest")``
(a :class:`~dualgraph.jax.Graphed` passed in keeps the precision it was compiled with). float64
is never downcast: when a float64 array is involved and JAX's 64-bit mode is off, the JAX side
runs inside ``jax.enable_x64``.

>>> import numpy as np, torch, jax.numpy as jnp
>>> x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
>>> report = compare(lambda t: (torch.tanh(t), None), lambda a: (jnp.tanh(a), None), (x,))
>>> report.ok, [entry.path for entry in report.entries]
(True, ['output[0]', 'grad args[0]'])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optree
import torch

from ._containers import NAMESPACE
from ._dtypes import is_differentiable_dtype
from ._errors import DualgraphError, SpecMismatchError
from ._spec import LeafSpec, describe
from .jax import Graphed
from .jax._env import enable_x64, x64_enabled
from .jax._trees import keep_arrays
from .torch._leaves import dtype_name

__all__ = ["DEFAULT_TOLERANCES", "LeafReport", "ParityReport", "assert_parity", "compare"]

#: ``dtype name -> (rtol, atol)`` for floating leaves; other dtypes are compared exactly.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-9),
    "complex128": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "complex64": (1e-4, 1e-5),
    "float16": (5e-3, 1e-3),
    "bfloat16": (3.2e-2, 3.2e-2),
    "float8_e4m3fn": (2.5e-1, 1.25e-1),
    "float8_e4m3fnuz": (2.5e-1, 1.25e-1),
    "float8_e5m2": (2.5e-1, 1.25e-1),
    "float8_e5m2fnuz": (2.5e-1, 1.25e-1),
}

_NEEDS_X64 = ("float64", "complex128")


@dataclass(frozen=True)
class LeafReport:
    """How one array leaf compares: ``score`` is the worst ``|diff| / (rtol*|jax| + atol*scale)``.

    ``scale`` is the leaf's largest finite ``|jax|`` (at least 1). A leaf is ``ok`` when its
    score is at most 1 (exact dtypes: when nothing differs).
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    scale: float
    rtol: float
    atol: float
    score: float

    @property
    def ok(self) -> bool:
        return self.score <= 1.0


@dataclass(frozen=True)
class ParityReport:
    """Every compared leaf (outputs, then input grads, then parameter grads) and the verdict.

    ``str(report)`` is a table, worst leaf first in the header.
    """

    entries: tuple[LeafReport, ...]

    @property
    def ok(self) -> bool:
        """Whether every leaf is within its tolerance."""
        return all(entry.ok for entry in self.entries)

    @property
    def worst(self) -> LeafReport | None:
        """The leaf furthest from (or over) its tolerance; ``None`` with nothing compared."""
        return max(self.entries, key=lambda entry: entry.score, default=None)

    @property
    def worst_path(self) -> str | None:
        """The path of :attr:`worst`, e.g. ``output['hidden']`` or ``grad params['pos']``."""
        worst = self.worst
        return None if worst is None else worst.path

    @property
    def failures(self) -> tuple[LeafReport, ...]:
        """The leaves over their tolerance."""
        return tuple(entry for entry in self.entries if not entry.ok)

    def __str__(self) -> str:
        worst = self.worst
        if worst is None:
            header = "parity: nothing to compare (no array leaves)"
        elif self.ok:
            header = (
                f"parity OK: {len(self.entries)} leaves within tolerance "
                f"(worst: {worst.path} at {worst.score:.2g} of its tolerance)"
            )
        else:
            header = (
                f"parity FAILED: {len(self.failures)} of {len(self.entries)} leaves over "
                f"tolerance (worst: {worst.path} at {worst.score:.3g}x its tolerance)"
            )
        titles = (
            "leaf",
            "dtype",
            "shape",
            "max abs",
            "max rel",
            "scale",
            "rtol",
            "atol",
            "score",
            "",
        )
        rows = [
            (
                e.path,
                e.dtype,
                "[" + ", ".join(map(str, e.shape)) + "]",
                f"{e.max_abs:.3g}",
                f"{e.max_rel:.3g}",
                f"{e.scale:.3g}",
                f"{e.rtol:.2g}",
                f"{e.atol:.2g}",
                f"{e.score:.3g}",
                "ok" if e.ok else "FAIL",
            )
            for e in self.entries
        ]
        widths = [max(len(row[i]) for row in [titles, *rows]) for i in range(len(titles))]
        lines = [header]
        for row in [titles, *rows]:
            lines.append(
                "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            )
        return "\n".join(lines)


def compare(
    torch_fn: Callable[..., Any],
    jax_fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    grads: bool = True,
    params: Any = None,
    params_from_torch: Callable[[dict[str, np.ndarray]], Any] | None = None,
    torch_params: Mapping[str, torch.Tensor] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> ParityReport:
    """Run ``torch_fn(*args, **kwargs)`` and its JAX reference; compare outputs and gradients.

    - ``args``/``kwargs`` hold numpy arrays or torch tensors (and constants, ``None``). numpy
      inputs go to the device of ``torch_fn``'s parameters (the CPU when it has none).
    - ``torch_fn``: an ``nn.Module`` (graphed or not) or any callable.
    - ``jax_fn``: a function (compiled here with :func:`dualgraph.jax.graphed`) or a
      :class:`~dualgraph.jax.Graphed`. With ``params``, it is called as
      ``jax_fn(params, *args, **kwargs)``.
    - ``params``: the JAX parameter pytree. Parameter gradients are compared after mapping the
      torch ones (``torch_params``, by default ``torch_fn.named_parameters()``) through
      ``params_from_torch({name: numpy array})`` into the same pytree, e.g.
      :func:`dualgraph.models.jax_vit.params_from_state_dict`; by default ``params`` must be a
      dict keyed by the torch parameter names. Frozen torch parameters are not compared.
    - Gradients: random normal cotangents (``seed``) on the masked outputs of the JAX output
      spec (floating outputs, or the mask of a ``Graphed``'s ``out_spec``), w.r.t. every
      floating input array and the parameters. The torch side runs one backward and reads
      ``.grad`` (putting the previous ``.grad`` back), so a graphed callable that accumulates
      parameter grads inside its backward graph is measured as its users see it.

    Raises :class:`~dualgraph.SpecMismatchError` naming the path where the two outputs differ in
    structure, ``None`` positions, constants, shapes or dtypes; value differences are reported.
    """
    kwargs = dict(kwargs or {})
    args_spec, kwargs_spec = describe(tuple(args)), describe(kwargs)
    samples = [*args_spec.flatten(tuple(args)), *kwargs_spec.flatten(kwargs)]
    inputs = (*args_spec.arrays, *kwargs_spec.arrays)
    input_paths = [
        *("args" + p for p in args_spec.array_paths),
        *("kwargs" + p for p in kwargs_spec.array_paths),
    ]
    named_params = _torch_named_params(torch_fn, torch_params) if params is not None else {}
    device = _torch_device(samples, named_params.values())
    wants_grad = [grads and is_differentiable_dtype(leaf.dtype or "") for leaf in inputs]
    torch_inputs = [_as_torch(x, device) for x in samples]
    for tensor, wanted in zip(torch_inputs, wants_grad, strict=True):
        if wanted:
            tensor.requires_grad_(True)
    n_args = args_spec.num_arrays
    torch_args = args_spec.unflatten(torch_inputs[:n_args])
    torch_kwargs = kwargs_spec.unflatten(torch_inputs[n_args:])

    with _torch_full_precision(), torch.enable_grad():
        torch_out = torch_fn(*torch_args, **torch_kwargs)
    torch_out_spec = describe(torch_out)

    dtypes = {leaf.dtype for leaf in (*inputs, *torch_out_spec.arrays)}
    if params is not None:
        dtypes |= {leaf.dtype for leaf in describe(params).arrays}
    needs_x64 = not x64_enabled() and any(d in _NEEDS_X64 for d in dtypes)
    with enable_x64() if needs_x64 else contextlib.nullcontext():
        jax_inputs = [_as_jax(t) for t in torch_inputs]
        jax_args: tuple[Any, ...] = args_spec.unflatten(jax_inputs[:n_args])
        jax_kwargs = kwargs_spec.unflatten(jax_inputs[n_args:])
        if params is not None:
            jax_args = (params, *jax_args)
        program = _as_graphed(jax_fn, jax_args, jax_kwargs)
        if program.donate_argnums:  # donation would consume arrays that share torch's memory
            jax_args, jax_kwargs = _copied((jax_args, jax_kwargs))
        if grads:
            jax_out, pullback = program.vjp(*jax_args, **jax_kwargs)
        else:
            jax_out = program(*jax_args, **jax_kwargs)
        spec = program.spec
        try:
            spec.check(torch_out, root="output")
        except SpecMismatchError as error:
            hint = ""
            if "int64" in str(error) and not x64_enabled():
                hint = "; JAX's 64-bit mode is off, so it computes int64 as int32"
            raise SpecMismatchError(
                f"the torch and JAX outputs differ in structure: {error} (expected: what JAX "
                f"returns, got: what torch returns){hint}",
                path=error.path,
            ) from None

        entries = []
        torch_leaves = spec.flatten(torch_out)
        for path, leaf, t, j in zip(
            spec.array_paths, spec.arrays, torch_leaves, spec.flatten(jax_out), strict=True
        ):
            entries.append(
                _leaf_report("output" + path, leaf, _torch_to_numpy(t), np.asarray(j), rtol, atol)
            )
        if not grads:
            return ParityReport(tuple(entries))

        rng = np.random.default_rng(seed)
        masked = [
            (leaf, t)
            for leaf, t, m in zip(spec.arrays, torch_leaves, spec.grad_mask, strict=True)
            if m
        ]
        cotangents = [_random_like(rng, leaf) for leaf, _ in masked]
        trainable = {name: p for name, p in named_params.items() if p.requires_grad}
        torch_targets = [t for t, wanted in zip(torch_inputs, wants_grad, strict=True) if wanted]
        torch_grads = _torch_grads(
            [(t, ct) for (_, t), ct in zip(masked, cotangents, strict=True)],
            [*torch_targets, *trainable.values()],
        )
        cotangent_tree = pullback.cotangent_spec.unflatten([jnp.asarray(c) for c in cotangents])
        args_grads, kwargs_grads = pullback(cotangent_tree)
        if params is not None:
            param_grads, args_grads = args_grads[0], args_grads[1:]
        jax_grads: list[Any] = optree.tree_leaves(
            (args_grads, kwargs_grads),  # type: ignore[arg-type]
            namespace=NAMESPACE,
        )
        diff_inputs = [
            (path, leaf) for path, leaf, w in zip(input_paths, inputs, wants_grad, strict=True) if w
        ]
        # torch_grads holds the parameter grads after the inputs'
        for (path, leaf), t, j in zip(diff_inputs, torch_grads, jax_grads, strict=False):
            expected = np.asarray(j)
            actual = np.zeros_like(expected) if t is None else _torch_to_numpy(t)
            entries.append(_leaf_report("grad " + path, leaf, actual, expected, rtol, atol))
        if params is not None:
            torch_param_grads = dict(zip(trainable, torch_grads[len(torch_targets) :], strict=True))
            entries += _param_grad_reports(
                params, param_grads, named_params, torch_param_grads, params_from_torch, rtol, atol
            )
    return ParityReport(tuple(entries))


def assert_parity(*args: Any, **kwargs: Any) -> ParityReport:
    """:func:`compare`, failing (``AssertionError``) with the worst leaf's path and the table.

    >>> import numpy as np, torch, jax.numpy as jnp
    >>> x = np.ones((2, 2), np.float32)
    >>> try:
    ...     assert_parity(lambda t: t * 2, lambda a: a * 2.001, (x,), grads=False)
    ... except AssertionError as error:
    ...     print(str(error).splitlines()[0])
    torch and JAX differ at output: max abs 0.001 (4.54x its tolerance)
    """
    __tracebackhide__ = True
    report = compare(*args, **kwargs)
    if not report.ok:
        worst = report.worst
        assert worst is not None
        raise AssertionError(
            f"torch and JAX differ at {worst.path}: max abs {worst.max_abs:.3g} "
            f"({worst.score:.3g}x its tolerance)\n{report}"
        )
    return report


# -- comparing leaves ----------------------------------------------------------------------------


def _tolerance(dtype: str, rtol: float | None, atol: float | None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(dtype)
    if default is None:  # integers, bool: exact
        return 0.0, 0.0
    return (default[0] if rtol is None else rtol), (default[1] if atol is None else atol)


def _leaf_report(
    path: str,
    leaf: LeafSpec,
    actual: np.ndarray,
    expected: np.ndarray,
    rtol: float | None,
    atol: float | None,
) -> LeafReport:
    dtype = leaf.dtype or ""
    leaf_rtol, leaf_atol = _tolerance(dtype, rtol, atol)
    wide = np.complex128 if np.iscomplexobj(expected) else np.float64
    a = np.atleast_1d(np.asarray(actual).astype(wide))
    b = np.atleast_1d(np.asarray(expected).astype(wide))
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.abs(a - b)
        diff[a == b] = 0.0  # equal infinities
        both_nan = np.isnan(a) & np.isnan(b)
        diff[both_nan] = 0.0
        diff[np.isnan(diff)] = np.inf  # NaN on one side only
        magnitude = np.abs(b)
        finite = np.where(np.isfinite(magnitude), magnitude, 0.0)
        scale = max(1.0, float(finite.max(initial=0.0)))
        allowed = leaf_atol * scale + leaf_rtol * finite
        ratio = np.where(diff == 0, 0.0, diff / allowed)
        relative = np.where((diff == 0) | (magnitude == 0), 0.0, diff / magnitude)
    return LeafReport(
        path=path,
        dtype=dtype,
        shape=tuple(leaf.shape or ()),
        max_abs=float(diff.max(initial=0.0)),
        max_rel=float(relative.max(initial=0.0)),
        scale=scale,
        rtol=leaf_rtol,
        atol=leaf_atol,
        score=float(ratio.max(initial=0.0)),
    )


def _param_grad_reports(
    params: Any,
    jax_grads: Any,
    named_params: Mapping[str, torch.Tensor],
    torch_grads: Mapping[str, torch.Tensor | None],
    params_from_torch: Callable[[dict[str, np.ndarray]], Any] | None,
    rtol: float | None,
    atol: float | None,
) -> list[LeafReport]:
    convert = params_from_torch or dict
    params_spec = describe(params)
    as_numpy = {
        name: (
            _torch_to_numpy(torch_grads[name])  # type: ignore[arg-type]
            if torch_grads.get(name) is not None
            else np.zeros(tuple(p.shape), _numpy_dtype(dtype_name(p.dtype)))
        )
        for name, p in named_params.items()
    }
    try:
        converted = params_spec.flatten(convert(as_numpy), check=True, root="params")
    except SpecMismatchError as error:
        raise SpecMismatchError(
            f"the torch parameter grads, mapped by params_from_torch, do not match the JAX "
            f"params: {error}",
            path=error.path,
        ) from None
    compared = [True] * params_spec.num_arrays
    if len(torch_grads) < len(named_params):  # frozen parameters: find the leaves they map to
        trained = {
            name: np.full(a.shape, name in torch_grads, a.dtype) for name, a in as_numpy.items()
        }
        compared = [bool(np.all(np.asarray(m))) for m in params_spec.flatten(convert(trained))]
    differentiable = [is_differentiable_dtype(leaf.dtype or "") for leaf in params_spec.arrays]
    jax_leaves = keep_arrays(params_spec, differentiable).flatten(jax_grads)
    reports = []
    jax_iter = iter(jax_leaves)
    for path, leaf, t, used, diff in zip(
        params_spec.array_paths,
        params_spec.arrays,
        converted,
        compared,
        differentiable,
        strict=True,
    ):
        if not diff:
            continue
        expected = np.asarray(next(jax_iter))
        if used:
            reports.append(
                _leaf_report("grad params" + path, leaf, np.asarray(t), expected, rtol, atol)
            )
    return reports


# -- moving data between the frameworks ----------------------------------------------------------


def _numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def _torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    name = dtype_name(tensor.dtype)
    if hasattr(np, name):
        return tensor.numpy()
    bits = {1: torch.uint8, 2: torch.int16}[tensor.element_size()]
    return tensor.view(bits).numpy().view(_numpy_dtype(name))


def _numpy_to_torch(array: np.ndarray, device: torch.device) -> torch.Tensor:
    array = np.array(array, copy=True, order="C")
    name = array.dtype.name
    if hasattr(np, name):
        return torch.from_numpy(array).to(device)
    bits = {1: np.uint8, 2: np.int16}[array.dtype.itemsize]
    return torch.from_numpy(array.view(bits)).view(getattr(torch, name)).to(device)


def _as_torch(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return _numpy_to_torch(np.asarray(value), device)


def _as_jax(tensor: torch.Tensor) -> jax.Array:
    """The tensor as a JAX array on JAX's default device, without a copy where possible."""
    tensor = tensor.detach()
    device = jax.devices()[0]
    same_kind = (tensor.device.type == "cuda") == (device.platform == "gpu")
    if same_kind:
        try:
            array = jax.dlpack.from_dlpack(tensor)
        except Exception:  # e.g. a layout DLPack cannot carry: fall back to a copy
            array = None
        if array is not None:
            return array if array.devices() == {device} else jax.device_put(array, device)
    return jax.device_put(_torch_to_numpy(tensor), device)


def _copied(tree: Any) -> Any:
    return optree.tree_map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
        tree,
        none_is_leaf=True,
        namespace=NAMESPACE,
    )


def _random_like(rng: np.random.Generator, leaf: LeafSpec) -> np.ndarray:
    shape = tuple(leaf.shape or ())
    values = rng.standard_normal(shape)
    if (leaf.dtype or "").startswith("complex"):
        values = values + 1j * rng.standard_normal(shape)
    return values.astype(_numpy_dtype(leaf.dtype or "float32"))


# -- running each side ---------------------------------------------------------------------------


def _as_graphed(
    jax_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Graphed:
    if isinstance(jax_fn, Graphed):
        return jax_fn
    with jax.default_matmul_precision("highest"):
        return Graphed(jax_fn, args, kwargs, _compile_forward=False)


def _torch_named_params(
    torch_fn: Any, torch_params: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    if torch_params is not None:
        return dict(torch_params)
    named = getattr(torch_fn, "named_parameters", None)
    if named is None:
        raise DualgraphError(
            "compare(params=...): torch_fn has no named_parameters(); pass torch_params= "
            "(a mapping from parameter names to tensors)"
        )
    return dict(named())


def _torch_device(samples: Sequence[Any], params: Any) -> torch.device:
    for value in (*samples, *params):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _torch_grads(
    outputs: Sequence[tuple[torch.Tensor, np.ndarray]], leaves: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The ``.grad`` that one backward of the cotangents gives each leaf (inputs, parameters).

    Read from ``.grad`` rather than through ``torch.autograd.grad`` so that graphed callables
    that accumulate parameter grads inside their backward graph are measured as users see them;
    the leaves' previous ``.grad`` are put back afterwards.
    """
    live = [(t, ct) for t, ct in outputs if t.requires_grad]
    saved = [leaf.grad for leaf in leaves]
    try:
        for leaf in leaves:
            leaf.grad = None
        if live:
            with _torch_full_precision():
                torch.autograd.backward(
                    [t for t, _ in live],
                    grad_tensors=[_numpy_to_torch(ct, t.device) for t, ct in live],
                )
        return [None if leaf.grad is None else leaf.grad.detach().clone() for leaf in leaves]
    finally:
        for leaf, grad in zip(leaves, saved, strict=True):
            leaf.grad = grad


@contextlib.contextmanager
def _torch_full_precision() -> Iterator[None]:
    """TF32 off for float32 matmuls and convolutions in PyTorch; the settings are restored."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: only the new API
        knobs = [backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn]  # type: ignore[attr-defined]
        saved = [knob.fp32_precision for knob in knobs]
        try:
            for knob in knobs:
                knob.fp32_precision = "ieee"
            yield
        finally:
            for knob, value in zip(knobs, saved, strict=True):
                knob.fp32_precision = value
        return
    legacy = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    try:
        backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = legacy
        torch.set_float32_matmul_precision(precision)
