"""The ambient state a replay runs in besides its inputs: autocast, the numerics settings, and
DDP's forward.

A plan records the autocast state and the numerics settings it was captured in; each call
compares them with the present ones (``_replay.py``) before any buffer is written.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "NUMERICS_NAMES",
    "autocast_state",
    "autograd_records",
    "ddp_is_running",
    "kept_modes",
    "kept_settings",
    "numerics_difference",
    "numerics_readings",
    "numerics_state",
    "outside_inference_mode",
    "state_of",
]


def autocast_state() -> tuple[Any, ...]:
    """``()`` outside autocast, else the autocast dtype per device type (False where off)."""
    if not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        return ()
    return (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
    )


def show_autocast(state: tuple[Any, ...]) -> str:
    """An :func:`autocast_state` in words, for messages: ``under torch.autocast('cpu', ...)``."""
    if not state:
        return "outside torch.autocast"
    parts = [
        f"torch.autocast({device!r}, dtype={dtype})"
        for device, dtype in zip(("cuda", "cpu"), state, strict=True)
        if dtype is not False
    ]
    return "under " + " and ".join(parts)


_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled


def autograd_records() -> bool:
    """Whether ops record history now: grad mode on, outside inference mode (which records
    nothing even under ``torch.enable_grad()``, its outputs having no history)."""
    return _is_grad_enabled() and not _is_inference_mode_enabled()


_C = torch._C


def _absent() -> None:  # a setting this torch does not have
    return None


def _reader(name: str) -> Callable[[], Any]:
    return getattr(_C, name, _absent)


_precision = getattr(_C, "_get_fp32_precision_getter", None)
_default_dtype = torch.get_default_dtype
_fp16_reduction = _reader("_get_cublas_allow_fp16_reduced_precision_reduction")
_bf16_reduction = _reader("_get_cublas_allow_bf16_reduced_precision_reduction")
_fp16_accumulation = _reader("_get_cublas_allow_fp16_accumulation")
_math_sdp_reduction = _reader("_get_math_sdp_allow_fp16_bf16_reduction")
_deterministic = _reader("_get_deterministic_algorithms")
_flash = _reader("_get_flash_sdp_enabled")
_mem_efficient = _reader("_get_mem_efficient_sdp_enabled")
_math = _reader("_get_math_sdp_enabled")
_cudnn_sdp = _reader("_get_cudnn_sdp_enabled")
_fa3 = _reader("_get_fa3_sdp_enabled")
_sdp_priority = _reader("_get_sdp_priority_order")
if _precision is not None:  # torch's newer API, which never raises (see numerics_state)
    _matmul_reading: Callable[[], Any] = functools.partial(_precision, "cuda", "matmul")

    def _matmul_setting(reading: Any) -> Any:
        # "none" defers to torch.backends.fp32_precision, itself "none" by default: full fp32
        return "ieee" if reading == "none" else reading

    _MATMUL_NAME = "torch.backends.cuda.matmul.fp32_precision"
else:  # torch before 2.9
    _matmul_reading = _reader("_get_float32_matmul_precision")

    def _matmul_setting(reading: Any) -> Any:
        return reading

    _MATMUL_NAME = "torch.get_float32_matmul_precision()"


def _reading(
    default_dtype: Callable[[], Any],
    matmul: Callable[[], Any],
    fp16_reduction: Callable[[], Any],
    bf16_reduction: Callable[[], Any],
    fp16_accumulation: Callable[[], Any],
    deterministic: Callable[[], Any],
    flash: Callable[[], Any],
    mem_efficient: Callable[[], Any],
    math: Callable[[], Any],
    cudnn_sdp: Callable[[], Any],
    fa3: Callable[[], Any],
    sdp_priority: Callable[[], Any],
    math_sdp_reduction: Callable[[], Any],
) -> Callable[[], tuple[Any, ...]]:
    # The getters as the closure's own cells: each call reads them without a global lookup and
    # calls each directly (C functions, and a partial of one: no Python frame among them).
    def numerics_readings() -> tuple[Any, ...]:
        """The getters' results behind :func:`numerics_state`, as read (the matmul precision's
        ``"none"`` not yet read as ``"ieee"``): equal readings are equal states, so a replay
        that found these once to mean the captured state compares them alone."""
        return (
            default_dtype(),
            matmul(),
            fp16_reduction(),
            bf16_reduction(),
            fp16_accumulation(),
            deterministic(),
            flash(),
            mem_efficient(),
            math(),
            cudnn_sdp(),
            fa3(),
            sdp_priority(),
            math_sdp_reduction(),
        )

    return numerics_readings


numerics_readings = _reading(
    _default_dtype,
    _matmul_reading,
    _fp16_reduction,
    _bf16_reduction,
    _fp16_accumulation,
    _deterministic,
    _flash,
    _mem_efficient,
    _math,
    _cudnn_sdp,
    _fa3,
    _sdp_priority,
    _math_sdp_reduction,
)


def numerics_state() -> tuple[Any, ...]:
    """What decides the kernels a CUDA graph replays and the dtypes and precision they compute
    in, where eager decides again on every call: the default dtype, TF32, reduced-precision
    reductions and fp16 accumulation of matmuls, deterministic algorithms, and the attention
    kernels ``scaled_dot_product_attention`` may choose (``torch.nn.attention.sdpa_kernel``).

    Read on every call of a graphed callable (through :func:`numerics_readings`);
    ``NUMERICS_NAMES`` names each entry. Where torch has it, the matmul precision is read
    through the newer fp32-precision API: the older getters raise once a program has mixed the
    two APIs, and the newer reflects settings made through either. cuDNN's settings
    (convolution TF32, ``deterministic``, ``enabled``) are left out: ``dualgraph.parity`` sets
    convolutions to full precision around every call, which would refuse every callable
    captured outside it, with a convolution or without.
    """
    return state_of(numerics_readings())


def state_of(readings: tuple[Any, ...]) -> tuple[Any, ...]:
    """The :func:`numerics_state` that :func:`numerics_readings` ``readings`` mean."""
    return (readings[0], _matmul_setting(readings[1]), *readings[2:])


#: How a user names each entry of :func:`numerics_state`.
NUMERICS_NAMES: tuple[str, ...] = (
    "torch.get_default_dtype()",
    _MATMUL_NAME,
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_fp16_accumulation",
    "torch.are_deterministic_algorithms_enabled()",
    "torch.backends.cuda.flash_sdp_enabled()",
    "torch.backends.cuda.mem_efficient_sdp_enabled()",
    "torch.backends.cuda.math_sdp_enabled()",
    "torch.backends.cuda.cudnn_sdp_enabled()",
    "the fa3 attention kernel (sdpa_kernel)",
    "the sdpa_kernel priority order",
    "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp()",
)


def numerics_difference(now: tuple[Any, ...], captured: tuple[Any, ...]) -> str:
    """The first setting that differs, as ``name is X, captured with Y``."""
    for name, value, expected in zip(NUMERICS_NAMES, now, captured, strict=True):
        if value != expected:
            return f"{name} is {value!r}, captured with {expected!r}"
    return "no setting differs"


_UNREADABLE = object()


def _read(getter: Callable[[], Any]) -> Any:
    try:
        return getter()
    except RuntimeError:  # the legacy matmul getters, once a program mixed the two APIs
        return _UNREADABLE


def _spread(setter: Callable[..., Any]) -> Callable[[Any], Any]:
    # the cuBLAS reduction getters give (allow, allow_splitk) where the setter takes both
    return lambda value: setter(*value) if isinstance(value, tuple) else setter(value)


def _setting(getter: str, setter: str, spread: bool = False) -> list[tuple[Any, ...]]:
    read, write = getattr(_C, getter, None), getattr(_C, setter, None)
    if read is None or write is None:  # a setting this torch does not have
        return []
    return [(setter, read, _spread(write) if spread else write, None)]


def _deterministic_mode() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _set_deterministic_mode(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


# (name, getter, setter, what a reading means or None), in the order they are put back: the
# legacy matmul precision before the newer API's, so that the newer one is set only where the
# legacy setter did not already bring it back (setting it mixes the two APIs).
_SETTINGS: tuple[tuple[Any, ...], ...] = (
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype, None),
    ("deterministic", _deterministic_mode, _set_deterministic_mode, None),
    *_setting(
        "_get_deterministic_fill_uninitialized_memory",
        "_set_deterministic_fill_uninitialized_memory",
    ),
    ("legacy matmul", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, None),
    *(
        [
            (
                "matmul",
                _matmul_reading,
                functools.partial(_C._set_fp32_precision_setter, "cuda", "matmul"),
                _matmul_setting,
            )
        ]
        if _precision is not None and hasattr(_C, "_set_fp32_precision_setter")
        else []
    ),
    *_setting(
        "_get_cublas_allow_fp16_reduced_precision_reduction",
        "_set_cublas_allow_fp16_reduced_precision_reduction",
        spread=True,
    ),
    *_setting(
        "_get_cublas_allow_bf16_reduced_precision_reduction",
        "_set_cublas_allow_bf16_reduced_precision_reduction",
        spread=True,
    ),
    *_setting("_get_cublas_allow_fp16_accumulation", "_set_cublas_allow_fp16_accumulation"),
    *_setting("_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    *_setting("_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    *_setting("_get_math_sdp_enabled", "_set_sdp_use_math"),
    *_setting("_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    *_setting("_get_fa3_sdp_enabled", "_set_sdp_use_fa3"),
    *_setting("_get_sdp_priority_order", "_set_sdp_priority_order"),
    *_setting("_get_math_sdp_allow_fp16_bf16_reduction", "_set_math_sdp_allow_fp16_bf16_reduction"),
    *_setting("_get_cudnn_enabled", "_set_cudnn_enabled"),
    *_setting("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    *_setting("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    *_setting("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
)


def kept_settings() -> Callable[[], None]:
    """Read torch's global numerics settings now (those of :func:`numerics_state`, cuDNN's,
    the legacy matmul precision); the function returned sets back each one that changed since.

    For a failed graphing: a forward that failed half-way may leave a setting it changed (a
    ``torch.set_default_dtype`` it meant to undo at its end), as it leaves grad mode.

    >>> put_back = kept_settings()
    >>> torch.set_default_dtype(torch.float64)
    >>> put_back()
    >>> torch.get_default_dtype()
    torch.float32
    """
    before = [_read(getter) for _, getter, _, _ in _SETTINGS]

    def put_back() -> None:
        for (_, getter, setter, meaning), was in zip(_SETTINGS, before, strict=True):
            if was is _UNREADABLE:
                continue
            now = _read(getter)
            if now is _UNREADABLE or now == was:
                continue
            if meaning is not None and meaning(now) == meaning(was):
                continue
            with contextlib.suppress(RuntimeError, TypeError, ValueError):  # not the failure's
                setter(was)

    return put_back


_AUTOCAST_DEVICES = ("cpu", "cuda")


def kept_modes() -> Callable[[], None]:
    """Read grad mode, the autocast state and the settings of :func:`kept_settings` now; the
    function returned sets them back as they were.

    For whatever runs the user's callable and must leave the process as it found it (a failed
    graphing, the checking tools): a forward failing half-way may leave grad mode off, an
    autocast it entered, or a setting it meant to undo at its end.

    >>> put_back = kept_modes()
    >>> _ = torch.set_grad_enabled(False)
    >>> put_back()
    >>> torch.is_grad_enabled()
    True
    """
    grad_enabled = torch.is_grad_enabled()
    autocast = [
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    ]
    autocast_cache = torch.is_autocast_cache_enabled()
    put_back_settings = kept_settings()

    def put_back() -> None:
        torch.set_grad_enabled(grad_enabled)
        for device, enabled, dtype in autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(autocast_cache)
        put_back_settings()

    return put_back


def outside_inference_mode() -> contextlib.AbstractContextManager[Any]:
    """Outside ``torch.inference_mode()`` for a graphing (and the tools that run what a capture
    runs): warmup and capture record the autograd graphs a backward graph is made from, which
    inference mode never records (its tensors keep no version counter either); a replay under
    it records nothing, as eager."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


_DDP = torch.nn.parallel.DistributedDataParallel


def ddp_is_running() -> bool:
    # DDP marks the module whose forward is running (public hook for TorchDynamo).
    return getattr(_DDP, "_active_ddp_module", None) is not None
