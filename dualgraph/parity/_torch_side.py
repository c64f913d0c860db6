"""The PyTorch side of a comparison: its parameters, its device, full precision, one backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import DualgraphError
from .._nodes import class_name
from ._bridge import to_torch

__all__ = [
    "full_precision",
    "named_params",
    "read_grads",
    "refuse_ambient_numerics",
    "refuse_computed_params",
    "refuse_repeated_params",
    "refuse_default_dtype",
    "refuse_detached_params",
    "torch_device",
]


def named_params(
    torch_fn: Any, torch_params: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """``torch_params``, else ``torch_fn.named_parameters()`` (for a module, graphed or not)."""
    if torch_params is None:
        named = getattr(torch_fn, "named_parameters", None)
        if named is None:
            raise DualgraphError(
                "compare(params=...): torch_fn has no named_parameters(); pass torch_params= "
                "(a mapping from parameter names to tensors)"
            )
        return dict(named())
    if not isinstance(torch_params, Mapping):
        raise DualgraphError(
            "torch_params must be a mapping of parameter names to tensors, got "
            f"{_shown_type(torch_params)}"
        )
    found = dict(torch_params)
    for name, tensor in found.items():  # read later as tensors (.detach(), .grad)
        if type(name) is not str:
            raise DualgraphError(
                f"torch_params: a parameter name is a str, got {name!r} (a {_shown_type(name)})"
            )
        if not isinstance(tensor, torch.Tensor):
            raise DualgraphError(
                f"torch_params[{name!r}] is a {_shown_type(tensor)}, not a torch tensor (a "
                "parameter whose grad torch computes)"
            )
    return found


def refuse_detached_params(torch_fn: Any, torch_params: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``torch_params`` given for a comparison of gradients whose tensors are detached
    copies of trained parameters: read as frozen, their grads would never be compared.

    ``module.state_dict()`` is such a mapping: each entry is ``param.detach()``. Found where a
    tensor that requires no grad holds the same memory as one of ``torch_fn``'s parameters
    that does; and where none of them requires grad and none is an ``nn.Parameter`` (a frozen
    parameter is one), for a ``torch_fn`` whose parameters cannot be listed.
    """
    named = getattr(torch_fn, "named_parameters", None)
    trained: list[tuple[str, torch.Tensor]] = []
    if callable(named):
        trained = [(n, p) for n, p in named() if p.requires_grad and p.numel()]
    ranges = [(n, _byte_range(p)) for n, p in trained]
    parameters = {id(p) for _, p in trained}
    for name, tensor in torch_params.items():
        if id(tensor) in parameters:
            continue
        found = _byte_range(tensor)
        shared = next((n for n, where in ranges if _overlap(found, where)), None)
        if shared is None:
            continue
        if not tensor.requires_grad and found == dict(ranges)[shared]:
            raise DualgraphError(
                f"torch_params[{name!r}] holds the memory of torch_fn's trained parameter "
                f"{shared!r} but is detached from it (state_dict() detaches): its grad "
                "would be read as frozen and never compared. Pass the parameters themselves, "
                "e.g. dict(module.named_parameters())"
            )
        raise DualgraphError(
            f"torch_params[{name!r}] holds memory of torch_fn's trained parameter {shared!r} "
            "but is not that parameter (a view or a detached part of it: w[:3] under no_grad, "
            "w.detach()[:3], w.data[:3]): torch fills the .grad of the parameter itself, so "
            "this one's gradient would read as zero, or as frozen, and the parameter's would "
            "never be compared. Pass the parameters themselves, e.g. "
            "dict(module.named_parameters()), and split them in params_from_torch"
        )
    values = torch_params.values()
    if values and not any(t.requires_grad or isinstance(t, torch.nn.Parameter) for t in values):
        raise DualgraphError(
            "torch_params: no tensor requires grad and none is an nn.Parameter, so every "
            "parameter grad would be skipped as frozen; detached copies (state_dict() detaches) "
            "are not the parameters torch_fn trains. Pass the parameters themselves, e.g. "
            "dict(module.named_parameters()) (frozen ones are nn.Parameters that require no grad)"
        )


def refuse_repeated_params(torch_params: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``torch_params`` holding one trained tensor under two names (a tied weight, as
    ``named_parameters(remove_duplicate=False)`` lists it): its one ``.grad``, the sum over
    every use, would be read for each name, where JAX gives each of its leaves its own part,
    so the gradients would differ whatever the functions."""
    first: dict[int, str] = {}
    for name, tensor in torch_params.items():
        if not tensor.requires_grad:  # frozen: no gradient is compared
            continue
        seen = first.setdefault(id(tensor), name)
        if seen != name:
            raise DualgraphError(
                f"torch_params[{seen!r}] and torch_params[{name!r}] are one trained tensor (a "
                "tied weight): its .grad is the sum over all its uses and would be read for "
                "each name, where JAX gives each leaf its own part. Pass it once (as "
                "named_parameters() does) and give the JAX function one leaf for it, used in "
                "each place"
            )


def refuse_computed_params(torch_params: Mapping[str, torch.Tensor]) -> None:
    """Refuse ``torch_params`` given for a comparison of gradients whose tensor is computed (no
    leaf: a parametrization's ``module.weight``, ``w * 1``): torch never fills its ``.grad``, so
    its gradient would read as zero whatever torch's backward gives the parameters behind it."""
    for name, tensor in torch_params.items():
        if tensor.grad_fn is not None:
            raise DualgraphError(
                f"torch_params[{name!r}] is computed from other tensors (its grad_fn is "
                f"{type(tensor.grad_fn).__name__}, e.g. a parametrization's weight), and torch "
                "fills the .grad of leaf tensors only: its gradient would read as zero. Pass the "
                "parameters it is computed from, e.g. dict(module.named_parameters()) "
                "('parametrizations.weight.original'), mapped by params_from_torch"
            )


def _byte_range(tensor: torch.Tensor) -> tuple[Any, int, int, int] | None:
    """Where a strided tensor's values live: its device, its storage's address and the bytes
    ``[start, end)`` of that storage its entries span; ``None`` for an empty or sparse one."""
    if tensor.layout != torch.strided or not tensor.numel():
        return None
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    span = 1 + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.device, tensor.untyped_storage().data_ptr(), start, start + span * size


def _overlap(a: tuple[Any, int, int, int] | None, b: tuple[Any, int, int, int] | None) -> bool:
    """Whether two byte ranges of :func:`_byte_range` share a byte."""
    if a is None or b is None or a[:2] != b[:2]:
        return False
    return a[2] < b[3] and b[2] < a[3]


def _shown_type(value: Any) -> str:
    """The type of ``value`` for a message (a builtin one by its bare name)."""
    return class_name(type(value)).removeprefix("builtins.")


#: The device types torch's autocast knows (with the private-use backend's name, at the call).
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla")


def refuse_ambient_numerics() -> None:
    """Refuse a caller's setting under which ``torch_fn`` would compute other than as written,
    while the JAX reference does not: an open ``torch.autocast`` (its ops in bfloat16 or
    float16 where the reference computes in the inputs' dtypes) and a torch function or
    dispatch mode (which may replace any op: a quantizing or rounding emulator), ``torch.device``
    (a default device for factories) excepted. compare's own settings (full precision, TF32 off)
    are set for the call instead; see :func:`full_precision`."""
    device_types = {*_AUTOCAST_DEVICE_TYPES, torch._C._get_privateuse1_backend_name()}
    for device_type in sorted(device_types):
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except RuntimeError:  # a device type this build has no autocast for
            continue
        if enabled:
            dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
            raise DualgraphError(
                f"compare: called inside torch.autocast({device_type!r}, dtype=torch.{dtype}), "
                f"under which torch_fn would run its matmuls and convolutions in {dtype} where the "
                "JAX reference computes in the inputs' dtypes: the comparison would not be of "
                "torch_fn as written. Call compare outside the autocast, or enter the autocast "
                "inside torch_fn (and cast alike in the JAX function)"
            )
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext)]
    modes += _get_current_dispatch_mode_stack()
    if modes:
        raise DualgraphError(
            f"compare: called inside the torch mode {class_name(type(modes[0]))}, which may "
            "replace any op torch_fn runs (and those of compare's own backward), where the JAX "
            "reference runs as written: the comparison would not be of torch_fn as written. Call "
            "compare outside the mode, or enter it inside torch_fn"
        )


def refuse_default_dtype(jax_in_64_bits: bool) -> None:
    """Refuse a torch default dtype other than the JAX reference's default float dtype
    (``float32``; ``float64`` in JAX's 64-bit mode), as ``torch.set_default_dtype`` sets it: the
    tensors ``torch_fn`` makes from Python numbers (``torch.tensor(0.1)``, ``torch.arange(3.)``)
    would hold other values than the arrays the reference makes from them. A float32 default
    beside the 64-bit mode is left be (compare turns the mode on for 64-bit leaves)."""
    dtype = torch.get_default_dtype()
    if dtype == torch.float32 or (dtype == torch.float64 and jax_in_64_bits):
        return
    name = str(dtype).removeprefix("torch.")
    jax_default = "float64 (its 64-bit mode is on)" if jax_in_64_bits else "float32"
    raise DualgraphError(
        f"compare: torch's default dtype is {name} (torch.set_default_dtype), where the JAX "
        f"reference's is {jax_default}: the tensors torch_fn makes from Python numbers "
        "(torch.tensor(0.1), torch.arange(3.0)) would hold other values than the reference's "
        "arrays. Call compare with torch's default dtype float32"
        + ("" if jax_in_64_bits else ", or with 64-bit leaves (the JAX side then runs in 64 bits)")
    )


def torch_device(values: Iterable[Any]) -> torch.device:
    """The device of the first tensor among ``values`` (inputs, then parameters); else the CPU."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def read_grads(
    outputs: Sequence[tuple[torch.Tensor, np.ndarray]],
    leaves: Sequence[torch.Tensor],
    others: Iterable[torch.Tensor] = (),
) -> list[torch.Tensor | None]:
    """The ``.grad`` that one backward of the cotangents gives each leaf (inputs, parameters).

    ``outputs`` pairs each masked output with its cotangent; outputs that do not require grad
    take no part. Read from ``.grad`` rather than through ``torch.autograd.grad`` so that
    graphed callables that accumulate parameter grads inside their backward graph are measured
    as users see them; the leaves' previous ``.grad`` are put back afterwards, and so are those
    of ``others`` (tensors not read, e.g. a module's parameters) and of every other leaf the
    outputs' graph reaches (the parameters a function closes over): the backward adds into
    them too, and a comparison between training steps must leave them as they were.
    """
    live = [(t, ct) for t, ct in outputs if t.requires_grad]
    touched = list({id(t): t for t in [*leaves, *others, *_leaves_reached(live)]}.values())
    saved = [leaf.grad for leaf in touched]
    try:
        for leaf in touched:
            leaf.grad = None
        if live:
            with full_precision():
                torch.autograd.backward(
                    [t for t, _ in live], grad_tensors=[to_torch(ct, t.device) for t, ct in live]
                )
        return [None if leaf.grad is None else leaf.grad.detach().clone() for leaf in leaves]
    finally:
        for leaf, grad in zip(touched, saved, strict=True):
            leaf.grad = grad


def _leaves_reached(outputs: Sequence[tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
    """The leaf tensors whose ``.grad`` a backward from ``outputs`` adds into (those of their
    graph's ``AccumulateGrad`` nodes)."""
    found: list[torch.Tensor] = []
    seen: dict[int, Any] = {}  # the nodes themselves kept: an id is unique while they live
    pending = [t.grad_fn for t, _ in outputs]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.append(variable)
        pending.extend(next_node for next_node, _ in node.next_functions)
    # An output that is itself a leaf (returned as it was given) has no grad_fn.
    found.extend(t for t, _ in outputs if t.grad_fn is None)
    return found


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """TF32 off for float32 matmuls and convolutions in PyTorch, on the GPU (cuBLAS, cuDNN) and
    on the CPU (oneDNN, which ``torch.set_float32_matmul_precision("medium")`` lets compute
    float32 matmuls in bfloat16 on CPUs that have it); the settings are restored.

    cuBLAS's reduced-precision reductions of float16 and bfloat16 matmuls are left as they
    are: a graphed ``torch_fn`` refuses a call under other settings than its capture's, and
    torch's default (on) is what its users run. A graphed callable that convolves (cuDNN's
    convolution TF32 is on by default) cannot follow the convolutions' full precision: its
    refusal is raised saying so, naming the setting (graph it with them in full precision)."""
    with _full_precision(), _cudnn_refusal_explained():
        yield


#: The settings full_precision changes that a graphed convolution compares (_ambient's names),
#: and how to set each as it does.
_CUDNN_PRECISIONS = {
    "torch.backends.cudnn.conv.fp32_precision": "torch.backends.cudnn.conv.fp32_precision = 'ieee'",
    "torch.backends.cudnn.rnn.fp32_precision": "torch.backends.cudnn.rnn.fp32_precision = 'ieee'",
    "torch.backends.cudnn.allow_tf32": "torch.backends.cudnn.allow_tf32 = False",
}


@contextlib.contextmanager
def _cudnn_refusal_explained() -> Iterator[None]:
    try:
        yield
    except DualgraphError as error:
        text = str(error)
        named = next((name for name in _CUDNN_PRECISIONS if f"with {name} is" in text), None)
        if named is None:
            raise
        raise DualgraphError(
            f"{text}\n(dualgraph.parity runs torch_fn with convolutions in full precision, "
            f"{named} set for the call, and a graphed callable that convolves replays the "
            "precision of its capture: graph it with its convolutions in full precision to "
            f"compare it, {_CUDNN_PRECISIONS[named]} around make_graphed_callables)"
        ) from error


@contextlib.contextmanager
def _full_precision() -> Iterator[None]:
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: only the new API
        cudnn: Any = backends.cudnn  # conv and rnn are missing from torch's stubs
        mkldnn: Any = backends.mkldnn
        knobs: list[Any] = [
            knob
            for knob in (
                backends.cuda.matmul,
                cudnn.conv,
                cudnn.rnn,
                getattr(mkldnn, "matmul", None),
                getattr(mkldnn, "conv", None),
                getattr(mkldnn, "rnn", None),
            )
            if hasattr(knob, "fp32_precision")
        ]
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
