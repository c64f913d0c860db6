"""The ambient state a replay runs in besides its inputs: autocast, the numerics settings, and
DDP's forward.

A plan records the autocast state and the numerics settings it was captured in; each call
compares them with the present ones (``_replay.py``) before any buffer is written.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.backends.mha

__all__ = [
    "BACKWARD_ENTRIES",
    "NUMERICS_NAMES",
    "CudnnSettings",
    "autocast_state",
    "backward_numerics",
    "autograd_records",
    "cudnn_settings",
    "ddp_is_running",
    "kept_modes",
    "kept_settings",
    "numerics_difference",
    "numerics_readings",
    "numerics_state",
    "outside_autocast",
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


def _spread(setter: Callable[..., Any]) -> Callable[[Any], Any]:
    # the cuBLAS reduction getters give (allow, allow_splitk) where the setter takes both
    return lambda value: setter(*value) if isinstance(value, tuple) else setter(value)


@dataclass(frozen=True)
class _Setting:
    """One of torch's global numerics settings: read on every call where ``name`` is set (an
    entry of :func:`numerics_state`, ``name`` how a user names it), kept and put back by
    :func:`kept_settings` where it has a setter.

    ``read`` gives the per-call reading, ``kept`` (``read`` where ``None``) what is put back
    through ``write``; ``meaning`` says what a reading means where two readings can mean one
    setting (the matmul precision's ``"none"`` and ``"ieee"``).
    """

    read: Callable[[], Any]
    write: Callable[[Any], Any] | None
    name: str | None = None
    kept: Callable[[], Any] | None = None
    meaning: Callable[[Any], Any] | None = None


def _of_c(getter: str, setter: str, name: str | None = None, spread: bool = False) -> _Setting:
    """A setting of torch's ``_C`` by its getter's and setter's names; one this torch lacks
    reads as ``None`` and is not put back."""
    read, write = getattr(_C, getter, None), getattr(_C, setter, None)
    if read is None or write is None:
        return _Setting(read or _absent, None, name)
    return _Setting(read, _spread(write) if spread else write, name)


def _deterministic_mode() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), (
        torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _set_deterministic_mode(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


_precision = getattr(_C, "_get_fp32_precision_getter", None)
if _precision is not None:  # torch's newer API, which never raises (see numerics_state)

    def _matmul_setting(reading: Any) -> Any:
        # "none" defers to torch.backends.fp32_precision, itself "none" by default: full fp32
        return "ieee" if reading == "none" else reading

    _set_precision = getattr(_C, "_set_fp32_precision_setter", None)
    _MATMUL = _Setting(
        functools.partial(_precision, "cuda", "matmul"),
        functools.partial(_set_precision, "cuda", "matmul") if _set_precision else None,
        "torch.backends.cuda.matmul.fp32_precision",
        meaning=_matmul_setting,
    )
else:  # torch before 2.9: the legacy setting, put back as such below

    def _matmul_setting(reading: Any) -> Any:
        return reading

    _MATMUL = _Setting(
        getattr(_C, "_get_float32_matmul_precision", _absent),
        None,
        "torch.get_float32_matmul_precision()",
    )

# nn.MultiheadAttention's and nn.TransformerEncoder[Layer]'s forwards read this flag in Python
# to choose their fused kernels; a replay keeps the branch capture took. Not only the last bits
# differ: on the CPU, a sequence whose keys are all padded gives NaN on the fast path, zeros on
# the other (torch 2.13), and TransformerEncoder's fast path, given a padding mask, zeros at the
# padded positions where the other gives values. A plain attribute of torch.backends.mha, which
# numerics_readings reads from the module's namespace by key (no call at all); None where a
# torch lacks it.
_FASTPATH_KEY = "_is_fastpath_enabled"
_MHA_NAMESPACE: dict[str, Any] = (
    vars(torch.backends.mha) if _FASTPATH_KEY in vars(torch.backends.mha) else {_FASTPATH_KEY: None}
)
_MHA_FASTPATH = _Setting(
    functools.partial(_MHA_NAMESPACE.__getitem__, _FASTPATH_KEY),
    getattr(torch.backends.mha, "set_fastpath_enabled", None),
    "torch.backends.mha.get_fastpath_enabled()",
)

# In the order they are put back: the legacy matmul precision before the newer API's, so that
# the newer one is set only where the legacy setter did not already bring it back (setting it
# mixes the two APIs). The named ones, in this order, make numerics_state.
_SETTINGS: tuple[_Setting, ...] = (
    _Setting(torch.get_default_dtype, torch.set_default_dtype, "torch.get_default_dtype()"),
    _Setting(torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    _MATMUL,
    _of_c(
        "_get_cublas_allow_fp16_reduced_precision_reduction",
        "_set_cublas_allow_fp16_reduced_precision_reduction",
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        spread=True,
    ),
    _of_c(
        "_get_cublas_allow_bf16_reduced_precision_reduction",
        "_set_cublas_allow_bf16_reduced_precision_reduction",
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        spread=True,
    ),
    _of_c(
        "_get_cublas_allow_fp16_accumulation",
        "_set_cublas_allow_fp16_accumulation",
        "torch.backends.cuda.matmul.allow_fp16_accumulation",
    ),
    _Setting(  # per call: whether on; put back: whether on and whether it only warns
        getattr(_C, "_get_deterministic_algorithms", _absent),
        _set_deterministic_mode,
        "torch.are_deterministic_algorithms_enabled()",
        kept=_deterministic_mode,
    ),
    # Compared, put back with the mode above: with the mode on, eager raises at a
    # nondeterministic op where it only warned at capture (warn_only=True), a replay never.
    _Setting(
        getattr(_C, "_get_deterministic_algorithms_warn_only", _absent),
        None,
        "torch.is_deterministic_algorithms_warn_only_enabled()",
    ),
    # Compared, with the mode on: there eager fills what torch.empty makes (NaN, an integer's
    # largest value) where this is on, and a replay keeps capture's choice (a fill kernel
    # captured, or memory left as the pool holds it: stale values of an earlier replay).
    _of_c(
        "_get_deterministic_fill_uninitialized_memory",
        "_set_deterministic_fill_uninitialized_memory",
        "torch.utils.deterministic.fill_uninitialized_memory",
    ),
    _of_c(
        "_get_flash_sdp_enabled", "_set_sdp_use_flash", "torch.backends.cuda.flash_sdp_enabled()"
    ),
    _of_c(
        "_get_mem_efficient_sdp_enabled",
        "_set_sdp_use_mem_efficient",
        "torch.backends.cuda.mem_efficient_sdp_enabled()",
    ),
    _of_c("_get_math_sdp_enabled", "_set_sdp_use_math", "torch.backends.cuda.math_sdp_enabled()"),
    _of_c(
        "_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn", "torch.backends.cuda.cudnn_sdp_enabled()"
    ),
    _of_c("_get_fa3_sdp_enabled", "_set_sdp_use_fa3", "the fa3 attention kernel (sdpa_kernel)"),
    _of_c("_get_sdp_priority_order", "_set_sdp_priority_order", "the sdpa_kernel priority order"),
    _of_c(
        "_get_math_sdp_allow_fp16_bf16_reduction",
        "_set_math_sdp_allow_fp16_bf16_reduction",
        "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp()",
    ),
    _MHA_FASTPATH,
    _of_c("_get_cudnn_enabled", "_set_cudnn_enabled"),
    _of_c("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    _of_c("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    _of_c("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
)
_COMPARED = tuple(setting for setting in _SETTINGS if setting.name is not None)

#: How a user names each entry of :func:`numerics_state`.
NUMERICS_NAMES: tuple[str, ...] = tuple(setting.name or "" for setting in _COMPARED)


def _reading(
    default_dtype: Callable[[], Any],
    matmul: Callable[[], Any],
    fp16_reduction: Callable[[], Any],
    bf16_reduction: Callable[[], Any],
    fp16_accumulation: Callable[[], Any],
    deterministic: Callable[[], Any],
    warn_only: Callable[[], Any],
    fill_uninitialized: Callable[[], Any],
    flash: Callable[[], Any],
    mem_efficient: Callable[[], Any],
    math: Callable[[], Any],
    cudnn_sdp: Callable[[], Any],
    fa3: Callable[[], Any],
    sdp_priority: Callable[[], Any],
    math_sdp_reduction: Callable[[], Any],
    *,
    mha: dict[str, Any],
) -> Callable[[], tuple[Any, ...]]:
    # The getters as the closure's own cells: each call reads them without a global lookup and
    # calls each directly (C functions, and a partial of one: no Python frame among them). Read
    # from a tuple of them instead (a comprehension, map(operator.call)) a call costs 1.6x as
    # much (benchmarks/RESULTS.md). The getters, in this order, are _COMPARED's; the last
    # setting, the MHA fast path, is read from torch.backends.mha's namespace by key (half the
    # cost of a call of _MHA_FASTPATH.read, which kept_settings calls).
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
            warn_only(),
            fill_uninitialized(),
            flash(),
            mem_efficient(),
            math(),
            cudnn_sdp(),
            fa3(),
            sdp_priority(),
            math_sdp_reduction(),
            mha["_is_fastpath_enabled"],
        )

    return numerics_readings


assert _COMPARED[-1] is _MHA_FASTPATH  # the one _reading reads by key
numerics_readings = _reading(*(setting.read for setting in _COMPARED[:-1]), mha=_MHA_NAMESPACE)


def numerics_state() -> tuple[Any, ...]:
    """What decides the kernels a CUDA graph replays and the dtypes and precision they compute
    in, where eager decides again on every call: the default dtype, TF32, reduced-precision
    reductions and fp16 accumulation of matmuls, deterministic algorithms (and, where they are
    on, whether they only warn and whether ``torch.empty`` fills), the attention kernels
    ``scaled_dot_product_attention`` may choose (``torch.nn.attention.sdpa_kernel``), and
    whether ``nn.MultiheadAttention`` and ``nn.TransformerEncoder`` may take their fast path
    (``torch.backends.mha``).

    Read on every call of a graphed callable (through :func:`numerics_readings`);
    ``NUMERICS_NAMES`` names each entry. Where torch has it, the matmul precision is read
    through the newer fp32-precision API: the older getters raise once a program has mixed the
    two APIs, and the newer reflects settings made through either. cuDNN's settings
    (convolution TF32, ``deterministic``, ``enabled``, ``benchmark``) are left out: they are
    compared only for a callable whose capture ran a convolution or an RNN
    (:func:`cudnn_settings`), since ``dualgraph.parity`` sets convolutions to full precision
    around every call, which would refuse every callable captured outside it.
    """
    return state_of(numerics_readings())


def state_of(readings: tuple[Any, ...]) -> tuple[Any, ...]:
    """The :func:`numerics_state` that :func:`numerics_readings` ``readings`` mean."""
    # the matmul precision second (_SETTINGS' order), the one reading a meaning reads again;
    # warn_only and fill_uninitialized_memory (seventh, eighth) mean nothing with deterministic
    # algorithms (sixth) off
    deterministic = readings[5]
    return (
        readings[0],
        _matmul_setting(readings[1]),
        *readings[2:6],
        deterministic and readings[6],
        deterministic and readings[7],
        *readings[8:],
    )


def numerics_difference(
    now: tuple[Any, ...], captured: tuple[Any, ...], among: slice = slice(None)
) -> str:
    """The first setting that differs (of the entries ``among``), as ``name is X, captured
    with Y``."""
    return _first_difference(NUMERICS_NAMES[among], now[among], captured[among])


def _first_difference(names: Sequence[str], now: Sequence[Any], captured: Sequence[Any]) -> str:
    """``name is X, captured with Y`` of the first of ``names`` whose value differs.

    >>> _first_difference(("a", "b"), (1, 3), (1, 2))
    'b is 3, captured with 2'
    """
    for name, value, expected in zip(names, now, captured, strict=True):
        if value != expected:
            return f"{name} is {value!r}, captured with {expected!r}"
    return "no setting differs"


# The entries of numerics_state that choose a backward's kernels again in eager's backward: the
# matmul precision and reductions, fp16 accumulation, deterministic algorithms. Not the default
# dtype (grads take their dtypes from the forward's tensors), nor the attention kernels and
# the MHA fast path (the forward's op decides its backward: flash attention's backward is
# flash attention's, whatever sdpa_kernel says when it runs).
BACKWARD_ENTRIES = slice(1, 7)


def backward_numerics(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """The part of a :func:`numerics_state` that eager's backward reads again when it runs, in
    which a graph's backward replays the kernels chosen at capture.

    >>> state = numerics_state()
    >>> backward_numerics(state) == state[1:7]
    True
    """
    return state[BACKWARD_ENTRIES]


# cuDNN's settings, read only for a callable whose capture ran a convolution or an RNN
# (``_cudnn_ops.py``): their TF32 precision, which is not only the last bits (~1e-3 relative),
# deterministic algorithms, whether cuDNN is used at all, and benchmark mode (its autotuned
# algorithm). A graph keeps capture's kernels; eager's convolution, forward and backward,
# chooses again under them. Read through the newer fp32-precision API where torch has it (the
# legacy allow_tf32 getter raises once conv and rnn were set apart through it); there, the
# convolutions' precision is compared for a callable that convolves, the RNNs' for one that
# runs an RNN.
_Getter = tuple[Callable[[], Any], str]
_CUDNN_MODES: tuple[_Getter, ...] = (
    (getattr(_C, "_get_cudnn_deterministic", _absent), "torch.backends.cudnn.deterministic"),
    (getattr(_C, "_get_cudnn_enabled", _absent), "torch.backends.cudnn.enabled"),
    (getattr(_C, "_get_cudnn_benchmark", _absent), "torch.backends.cudnn.benchmark"),
)
if _precision is not None:
    _CONV_TF32: tuple[_Getter, ...] = (
        (
            functools.partial(_precision, "cuda", "conv"),
            "torch.backends.cudnn.conv.fp32_precision",
        ),
    )
    _RNN_TF32: tuple[_Getter, ...] = (
        (functools.partial(_precision, "cuda", "rnn"), "torch.backends.cudnn.rnn.fp32_precision"),
    )
else:  # one setting for both
    _CONV_TF32 = _RNN_TF32 = (
        (getattr(_C, "_get_cudnn_allow_tf32", _absent), "torch.backends.cudnn.allow_tf32"),
    )


@dataclass(frozen=True)
class CudnnSettings:
    """The cuDNN settings a callable's replays compare: ``read()`` gives them now (a few C
    getters, no Python frame among them), ``names`` names each.

    >>> settings = cudnn_settings(convolution=True, rnn=False)
    >>> dict(zip(settings.names, settings.read()))["torch.backends.cudnn.deterministic"]
    False
    """

    read: Callable[[], tuple[Any, ...]]
    names: tuple[str, ...]

    def difference(self, captured: tuple[Any, ...]) -> str:
        """The first setting that differs now from ``captured``, as ``name is X, captured
        with Y``."""
        return _first_difference(self.names, self.read(), captured)


def _reader(getters: Sequence[Callable[[], Any]]) -> Callable[[], tuple[Any, ...]]:
    # The getters as the closure's own cells, each called directly (as numerics_readings): a
    # comprehension over a tuple of them costs about twice as much.
    if len(getters) == 5:
        a, b, c, d, e = getters
        return lambda: (a(), b(), c(), d(), e())
    a, b, c, d = getters
    return lambda: (a(), b(), c(), d())


def cudnn_settings(*, convolution: bool, rnn: bool) -> CudnnSettings | None:
    """The cuDNN settings compared for a callable whose capture ran convolutions and/or RNNs
    (``None`` for neither: nothing read). Left out of :func:`numerics_state`:
    ``dualgraph.parity`` runs its calls with convolutions in full precision, which would refuse
    every callable captured outside it, with a convolution or without.

    >>> cudnn_settings(convolution=False, rnn=False) is None
    True
    """
    if not (convolution or rnn):
        return None
    tf32 = dict.fromkeys((*(_CONV_TF32 if convolution else ()), *(_RNN_TF32 if rnn else ())))
    getters = (*tf32, *_CUDNN_MODES)
    return CudnnSettings(
        _reader([getter for getter, _ in getters]), tuple(name for _, name in getters)
    )


_UNREADABLE = object()


def _read(getter: Callable[[], Any]) -> Any:
    try:
        return getter()
    except RuntimeError:  # the legacy matmul getters, once a program mixed the two APIs
        return _UNREADABLE


#: (getter, setter, what a reading means or None) of each setting put back, in order.
_KEPT: tuple[tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], Any] | None], ...] = (
    tuple(
        (setting.kept or setting.read, setting.write, setting.meaning)
        for setting in _SETTINGS
        if setting.write is not None
    )
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
    before = [_read(getter) for getter, _, _ in _KEPT]

    def put_back() -> None:
        for (getter, setter, meaning), was in zip(_KEPT, before, strict=True):
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


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Autocast off on every device where it is on: a backward as torch's AMP recipe runs it
    (autocast wraps the forward and the loss; the backward's ops run in the dtypes the forward
    chose), which is where eager's backward runs when ``.backward()`` is called outside it.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16), outside_autocast():
    ...     torch.is_autocast_enabled("cpu")
    False
    """
    with contextlib.ExitStack() as stack:
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


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
