"""The JAX side of a comparison: the reference compiled with dualgraph's adapter, run once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import torch

from ..jax import GraphedCallable, Pullback
from ._bridge import as_jax, copied

__all__ = ["AS_WRITTEN", "JaxRun", "reference_settings", "run_jax"]

# XLA computes bfloat16 and float16 intermediates in float32 and skips their rounding unless
# told otherwise; PyTorch rounds each op's result, so the reference must too (a plain function).
AS_WRITTEN = {"xla_allow_excess_precision": False}


@dataclass(frozen=True)
class JaxRun:
    """What the reference returned, and its pullback (``None`` without gradients)."""

    program: GraphedCallable
    outputs: Any
    pullback: Pullback | None


def run_jax(
    jax_fn: Callable[..., Any] | GraphedCallable,
    unflatten: Callable[[Sequence[Any]], tuple[tuple[Any, ...], dict[str, Any]]],
    tensors: Sequence[torch.Tensor],
    params: Any,
    *,
    grads: bool,
) -> JaxRun:
    """Run ``jax_fn`` on the same inputs as torch (``params`` first, when given).

    A plain function is compiled here, every low-precision intermediate rounded as the program
    says (:data:`AS_WRITTEN`); run it inside :func:`reference_settings`. Inputs shared
    with torch through DLPack are copied first if the program donates them.
    """
    args, kwargs = unflatten([as_jax(t) for t in tensors])
    if params is not None:
        args = (params, *args)
    if isinstance(jax_fn, GraphedCallable):
        program = jax_fn
    else:
        program = GraphedCallable(
            jax_fn, args, sample_kwargs=kwargs, lazy=True, compiler_options=AS_WRITTEN
        )
    if program.donate_argnums:  # donation would consume arrays that share torch's memory
        args, kwargs = copied((args, kwargs))
    if grads:
        outputs, pullback = program.vjp(*args, **kwargs)
        return JaxRun(program, outputs, pullback)
    return JaxRun(program, program(*args, **kwargs), None)


def reference_settings(jax_fn: Callable[..., Any] | GraphedCallable) -> Any:
    """The context the JAX side is compiled and run in, pullback included: TF32-free
    ``"highest"`` matmul precision for a plain function; for a
    :class:`~dualgraph.jax.GraphedCallable`, the caller's, which must be those it was graphed
    with (it refuses others)."""
    if isinstance(jax_fn, GraphedCallable):
        return contextlib.nullcontext()
    return jax.default_matmul_precision("highest")
