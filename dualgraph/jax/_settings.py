"""JAX settings a graphed program was traced under, and the refusal of calls made under others.

:func:`jax.jit` traces a function again when a setting that changes what tracing produces has
changed since (``jax_default_matmul_precision``, ``jax_numpy_rank_promotion``,
``jax_numpy_dtype_promotion``, ``jax_threefry_partitionable``, ``jax_softmax_custom_jvp``...):
JAX lists them as its *trace context*. A graphed program is compiled once, so a call made after
such a change would silently compute what the old setting gave (other random bits, another matmul
precision, a broadcast where the function now raises). :class:`TraceSettings` refuses that call,
naming the setting, before anything runs or is donated; the check is one tuple comparison.

Left out, because dualgraph handles them itself: ``jax_enable_x64`` (a program runs in the mode
it was compiled in, see :func:`~dualgraph.jax.x64_mode`) and ``jax_default_device`` (a program is
compiled for one device; an input elsewhere is refused by name). Also left out are switches that
change how JAX or XLA get to a program, not its values (profiling, metadata, internal
implementations). A call under ``jax.disable_jit()`` is refused too (an ahead-of-time program
cannot run op by op; ``.fn`` can). ``jax_default_prng_impl``, which is not in JAX's trace
context (``jax.jit`` keeps a stale key implementation too), is compared as well: eager
``jax.random.key(seed)`` follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import DualgraphError

__all__ = ["TraceSettings"]

#: Settings whose change leaves a graphed program's values and errors as eager's.
_NOT_COMPARED = frozenset(
    {
        "jax_enable_x64",  # the program turns its own mode on or off around its calls
        "jax_default_device",  # programs are compiled for one device; inputs are checked
        "jax_hlo_source_file_canonicalization_regex",
        "jax_enable_pgle",
        "jax_pgle_profiling_runs",
        "jax_xla_profile_version",
        "xla_metadata_context_manager",
        "jax_scan3",
        "jax_remat3",
        "jax_custom_vjp3",
        "jax_use_direct_linearize",
        "jax_use_simplified_jaxpr_constants",
        "jax_embedded_constants_max_bytes",
        "jax_use_shardy_partitioner",
        "jax_threefry_gpu_kernel_lowering",
        "jax_use_emit_pipeline_primitive",
        "jax_pallas_enable_debug_checks",
        "jax_pallas_use_mosaic_gpu",
        "jax_ragged_dot_use_gpu_pallas_triton_lowering",
        "pallas_tpu_interpret_mode_context_manager",
        "eager_constant_folding",
    }
)

#: Compared where JAX cannot list its trace context (older jaxlib): the settings known to change
#: a program's values or errors.
_FALLBACK_NAMES = (
    "jax_disable_jit",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_threefry_partitionable",
    "jax_random_seed_offset",
    "jax_softmax_custom_jvp",
    "jax_debug_key_reuse",
    "jax_check_static_indices",
    "jax_allow_f16_reductions",
    "jax_high_dynamic_range_gumbel",
)

#: Compared beside the trace context: what eager's ``jax.random.key(seed)`` makes.
_EXTRA_NAMES = ("jax_default_prng_impl",)


def _reader() -> tuple[tuple[str, ...], Callable[[], tuple[Any, ...]]]:
    """The names of the compared settings and a function reading their values, in that order."""
    import jax

    def read_named(names: tuple[str, ...]) -> Callable[[], tuple[Any, ...]]:
        return lambda: tuple(getattr(jax.config, name) for name in names)

    extra = read_named(_EXTRA_NAMES)
    try:
        from jax._src import config  # no public equivalent; what jax.jit keys its traces on

        context_names = tuple(config.trace_context_names())
        trace_context = config.trace_context
    except (ImportError, AttributeError, NotImplementedError):
        return (*_FALLBACK_NAMES, *_EXTRA_NAMES), read_named((*_FALLBACK_NAMES, *_EXTRA_NAMES))
    return (*context_names, *_EXTRA_NAMES), lambda: (*trace_context(), *extra())


class TraceSettings:
    """The settings where a function was graphed; :meth:`check` refuses a call under others.

    >>> import jax
    >>> settings = TraceSettings("f")
    >>> settings.check()
    >>> with jax.numpy_rank_promotion("raise"):
    ...     settings.check()
    Traceback (most recent call last):
    ...
    dualgraph.DualgraphError: graphed(f) was graphed under jax_numpy_rank_promotion='allow', but...
    """

    __slots__ = ("_accepted", "_graphed", "_name", "_names", "_read")

    def __init__(self, name: str) -> None:
        self._name = name
        self._names, self._read = _reader()
        self._graphed = self._read()
        self._accepted = self._graphed  # the last settings found equal where it matters

    def check(self, where: str = "") -> None:
        """Raise :class:`~dualgraph.DualgraphError` when a compared setting differs now."""
        now = self._read()
        if now == self._graphed or now == self._accepted:
            return
        if dict(zip(self._names, now, strict=True)).get("jax_disable_jit"):
            raise DualgraphError(
                f"graphed({self._name}){where} cannot run under jax.disable_jit(): it is a "
                "program compiled ahead of time. Call the function itself (its .fn) to run it "
                "op by op"
            )
        changed = [
            (name, then, value)
            for name, then, value in zip(self._names, self._graphed, now, strict=True)
            if name not in _NOT_COMPARED and then != value
        ]
        if not changed:
            self._accepted = now
            return
        shown = ", ".join(f"{name}={then!r}" for name, then, _ in changed)
        found = ", ".join(f"{name}={value!r}" for name, _, value in changed)
        raise DualgraphError(
            f"graphed({self._name}){where} was graphed under {shown}, but it is {found} now: "
            "the compiled program would compute what the old setting gave, where the function "
            "(and jax.jit) would compute with the new one. Call it under the setting it was "
            "graphed with, or graph it again under the new one"
        )
