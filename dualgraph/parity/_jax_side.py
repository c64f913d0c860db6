"""The JAX side of a comparison: the reference compiled with dualgraph's adapter, run once."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import torch

from .._errors import DualgraphError, SpecMismatchError, UnsupportedLeafError
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
    says (:data:`AS_WRITTEN`), and a :class:`~dualgraph.jax.GraphedCallable` compiled otherwise
    is compiled again so from its own trace; run it inside :func:`reference_settings`. Inputs shared
    with torch through DLPack are copied first if the program donates them.
    """
    args, kwargs = unflatten([as_jax(t) for t in tensors])
    if params is None:
        return _run(jax_fn, args, kwargs, grads)
    try:
        return _run(jax_fn, (params, *args), kwargs, grads)
    except (DualgraphError, SpecMismatchError, UnsupportedLeafError) as error:
        raise _in_compare_terms(error) from error


def _run(
    jax_fn: Callable[..., Any] | GraphedCallable,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads: bool,
) -> JaxRun:
    if isinstance(jax_fn, GraphedCallable):
        program = jax_fn
        options = program.compiler_options
        if any(options.get(name) != value for name, value in AS_WRITTEN.items()):
            # Its own trace, compiled again as written: graphed() leaves XLA's excess precision
            # on, and a torch side skipping a bfloat16 rounding would match it, not the program.
            program = program.with_compiler_options(AS_WRITTEN)
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


# A path of the JAX call's positional args, as the adapter's errors name them.
_ARGS_PATH = re.compile(r"(?<![\w\]'\"])args\[(\d+)\]")


def _in_compare_terms(error: DualgraphError) -> DualgraphError:
    """The JAX side's refusal of ``jax_fn(params, *args, **kwargs)`` with its paths as
    :func:`compare`'s: its ``args[0]`` is ``params``, its ``args[i + 1]`` compare's ``args[i]``
    (``args[0]['w']`` named the params leaf ``params['w']``, and an input one position off).
    Other errors (no path of the call in them, or a subclass with more to it) come back as
    they are."""
    if type(error) not in (DualgraphError, SpecMismatchError, UnsupportedLeafError):
        return error
    text = str(error)
    if _ARGS_PATH.search(text) is None:
        return error

    def ours(found: re.Match[str]) -> str:
        index = int(found.group(1))
        return "params" if index == 0 else f"args[{index - 1}]"

    message = (
        "the JAX side, called as jax_fn(params, *args, **kwargs), refused the call (paths are "
        f"compare's; counts of positional arguments include params): {_ARGS_PATH.sub(ours, text)}"
    )
    if isinstance(error, (SpecMismatchError, UnsupportedLeafError)):
        return type(error)(message, path=_ARGS_PATH.sub(ours, error.path))
    return DualgraphError(message)


def reference_settings(jax_fn: Callable[..., Any] | GraphedCallable) -> Any:
    """The context the JAX side is compiled and run in, pullback included: TF32-free
    ``"highest"`` matmul precision for a plain function; for a
    :class:`~dualgraph.jax.GraphedCallable`, the caller's, which must be those it was graphed
    with (it refuses others)."""
    if isinstance(jax_fn, GraphedCallable):
        return contextlib.nullcontext()
    return jax.default_matmul_precision("highest")
