"""``graphed``: a JAX function compiled ahead of time under dualgraph's contract.

What happens once (in :class:`Graphed`'s constructor): the inputs are described, the function is
traced by :func:`jax.jit` on ``ShapeDtypeStruct``s of the samples' array leaves (constants and
``None`` are compiled in), its output spec is recorded while it traces, and the program is
compiled. What happens on every call (:meth:`Graphed.__call__`): the inputs are checked against
the input spec, donated inputs are checked, the executable runs on the flat array leaves, and the
output tree is rebuilt from the spec, so ``None`` leaves and constants come back where the Python
function put them (JAX itself treats ``None`` as an empty subtree and cannot return constants).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from .._dtypes import is_differentiable_dtype
from .._errors import DualgraphError, SpecMismatchError
from .._spec import LeafSpec, TreeSpec, describe
from . import _leaves as _leaves  # registers JAX's array types with the core
from ._donation import (
    check_donated_inputs,
    delete_donated,
    explain_failed_call,
    jax_donation_warnings,
    unusable_donations,
    warn_unusable,
)
from ._env import enable_x64, x64_enabled
from ._trees import struct_of
from ._vjp import Pullback, VJPProgram

__all__ = ["Graphed", "graphed"]

# 64-bit floating dtypes and what JAX would silently compute them in with its 64-bit mode off.
_NEEDS_X64 = {"float64": "float32", "complex128": "complex64"}


def graphed(
    fn: Callable[..., Any],
    sample_args: Sequence[Any],
    sample_kwargs: Mapping[str, Any] | None = None,
    *,
    donate_argnums: int | Sequence[int] = (),
    out_spec: TreeSpec | str | None = None,
) -> Graphed:
    """Compile ``fn`` ahead of time for calls shaped like ``fn(*sample_args, **sample_kwargs)``.

    The JAX counterpart of ``dualgraph.torch.make_graphed_callables``: :func:`jax.jit` compiled
    from the samples' shapes and dtypes (the samples may be arrays or ``ShapeDtypeStruct``s).

    - Array leaves of the args and kwargs are the program's inputs; constants (int, float,
      bool, str) and ``None`` are static, compiled in, and checked on every call.
    - Outputs keep their ``None`` leaves and constants at the paths the function returns them.
      :attr:`Graphed.spec` is the output spec; for the same logical output its JSON is the one
      the PyTorch side writes.
    - ``out_spec`` (a :class:`~dualgraph.TreeSpec` or its JSON, e.g. written by the PyTorch
      side) is checked against the traced output, naming the first differing path, and supplies
      the grad mask used by :meth:`Graphed.vjp`. Without it, floating outputs are masked.
    - Calls are checked against the input spec before anything runs or is donated:
      ``args[0]['mask']: expected float32[2, 8], got float32[2, 9]``.
    - ``donate_argnums``: positional args whose buffers the call consumes, as a CUDA graph's
      static inputs: every JAX array in them is deleted after each call, and outputs of the same
      shape and dtype may be written into them. A donation no output can reuse is reported once,
      here, as a :class:`~dualgraph.DualgraphWarning`; a donated buffer also passed elsewhere in
      the same call is a :class:`~dualgraph.DualgraphError`.
    - float64 inputs need JAX's 64-bit mode (``jax.enable_x64``) when compiling: dualgraph
      refuses rather than let JAX compute them in float32. A program compiled with it on turns
      it on again around its own calls.

    >>> import jax.numpy as jnp
    >>> def layer(x, *, scale):
    ...     return {"hidden": x * scale, "aux_loss": None, "n": 2}
    >>> g = graphed(layer, (jnp.ones(3),), {"scale": 2.0})
    >>> g(jnp.ones(3), scale=2.0)
    {'hidden': Array([2., 2., 2.], dtype=float32), 'aux_loss': None, 'n': 2}
    >>> g.spec
    TreeSpec({'hidden': float32[3](grad), 'aux_loss': None, 'n': 2})
    """
    return Graphed(fn, sample_args, sample_kwargs, donate_argnums=donate_argnums, out_spec=out_spec)


class Graphed:
    """A function compiled by :func:`graphed`; call it like the function, or :meth:`vjp` it.

    Attributes: ``spec`` (output spec), ``args_spec`` and ``kwargs_spec`` (input specs),
    ``donate_argnums``, :attr:`compiled` (the forward program).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        sample_args: Sequence[Any],
        sample_kwargs: Mapping[str, Any] | None = None,
        *,
        donate_argnums: int | Sequence[int] = (),
        out_spec: TreeSpec | str | None = None,
        _compile_forward: bool = True,
    ) -> None:
        # _compile_forward=False: only trace now, compile the plain forward at its first call
        # (for dualgraph.parity, which runs the VJP programs alone).
        if not callable(fn):
            raise DualgraphError(f"graphed: {fn!r} is not callable")
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__
        args = tuple(sample_args)
        kwargs = dict(sample_kwargs or {})
        self.args_spec = describe(args, root="args")
        self.kwargs_spec = describe(kwargs, root="kwargs")
        self._inputs: tuple[LeafSpec, ...] = (*self.args_spec.arrays, *self.kwargs_spec.arrays)
        self._paths = (
            *("args" + p for p in self.args_spec.array_paths),
            *("kwargs" + p for p in self.kwargs_spec.array_paths),
        )
        # The configuration the program is compiled under; the VJP, compiled later, reuses it.
        self._x64 = x64_enabled()
        self._precision = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]
        if not self._x64:
            self._refuse_float64()
        self.donate_argnums = _donate_argnums(donate_argnums, args, self.args_spec)
        self._donated = tuple(
            i
            for i, path in enumerate(self.args_spec.array_paths)
            if _top_index(path) in self.donate_argnums
        )
        self._traced_spec: TreeSpec | None = None
        self._compiled: jax.stages.Compiled | None = None
        structs = [struct_of(leaf) for leaf in self._inputs]
        with jax_donation_warnings() as jax_warned:
            jitted = jax.jit(
                self._flat, donate_argnums=self._donated, keep_unused=bool(self._donated)
            )
            self._lowered = jitted.lower(*structs)
            if _compile_forward:
                self._compiled = self._lowered.compile()
        traced = self._traced_spec
        assert traced is not None
        self.spec: TreeSpec = _output_spec(traced, out_spec, self.name)
        self._vjp_program: VJPProgram | None = None
        unusable = unusable_donations(self._inputs, self._donated, traced.arrays)
        if unusable:
            warn_unusable(self.name, unusable, self._paths, self._inputs)
        elif jax_warned:
            warn_unusable(self.name, self._donated, self._paths, self._inputs)

    @property
    def compiled(self) -> jax.stages.Compiled:
        """The compiled forward program (``jax.stages.Compiled``)."""
        if self._compiled is None:
            with jax_donation_warnings():  # reported when traced
                self._compiled = self._lowered.compile()
        return self._compiled

    # -- traced once ----------------------------------------------------------------------------

    def _flat(self, *arrays: Any) -> list[Any]:
        """The function of the flat input arrays that returns the flat output arrays."""
        n = self.args_spec.num_arrays
        args = self.args_spec.unflatten(arrays[:n])
        kwargs = self.kwargs_spec.unflatten(arrays[n:])
        outputs = self.fn(*args, **kwargs)
        spec = describe(outputs, root="output")
        if self._traced_spec is None:
            self._traced_spec = spec
        return spec.flatten(outputs)

    def _refuse_float64(self) -> None:
        for path, leaf in zip(self._paths, self._inputs, strict=True):
            if leaf.dtype in _NEEDS_X64:
                raise DualgraphError(
                    f"graphed({self.name}): {path} is {leaf}, but JAX's 64-bit mode is off, so "
                    f"JAX would compute it in {_NEEDS_X64[leaf.dtype]}. Turn it on "
                    "(jax.config.update('jax_enable_x64', True), or build inside "
                    "`with jax.enable_x64(True):`) or pass a 32-bit array"
                )

    # -- every call -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arrays = self._checked_inputs(args, kwargs)
        return self.spec.unflatten(self._run(self._compiled or self.compiled, arrays))

    def vjp(self, *args: Any, **kwargs: Any) -> tuple[Any, Pullback]:
        """``(outputs, pullback)`` for a call like ``self(*args, **kwargs)``, as :func:`jax.vjp`.

        ``pullback(cotangent)`` takes arrays at the masked output leaves (the grad mask of
        :attr:`spec`) and ``None`` elsewhere, and returns ``(args_grads, kwargs_grads)`` with a
        gradient at each floating or complex input array and ``None`` elsewhere. Parameters
        are an argument like any other: ``fn(params, x)`` gets its parameter grads in
        ``args_grads[0]``. Both programs are compiled at the first call; donation applies as for
        a plain call.

        >>> import jax.numpy as jnp
        >>> g = graphed(lambda w, x: (w * x, None), (jnp.ones(2), jnp.ones(2)))
        >>> out, pullback = g.vjp(jnp.full(2, 3.0), jnp.ones(2))
        >>> (dw, dx), _ = pullback((jnp.ones(2), None))
        >>> dx
        Array([3., 3.], dtype=float32)
        """
        arrays = self._checked_inputs(args, kwargs)
        program = self._vjp_program
        if program is None:
            with self._compile_config():
                program = self._vjp_program = VJPProgram(
                    self._flat,
                    self._inputs,
                    self.args_spec,
                    self.kwargs_spec,
                    self.spec,
                    self._donated,
                )
        outputs, residuals = self._run(program.forward, arrays)
        return self.spec.unflatten(outputs), Pullback(program, residuals, self._x64)

    @contextlib.contextmanager
    def _compile_config(self) -> Iterator[None]:
        with jax.default_matmul_precision(self._precision):
            if self._x64 and not x64_enabled():
                with enable_x64():
                    yield
            else:
                yield

    def _checked_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        arrays = self.args_spec.flatten(args, check=True, root="args")
        arrays += self.kwargs_spec.flatten(kwargs, check=True, root="kwargs")
        if self._donated:
            check_donated_inputs(arrays, self._donated, self._paths)
        return arrays

    def _run(self, executable: Callable[..., Any], arrays: list[Any]) -> Any:
        try:
            if self._x64 and not x64_enabled():
                with enable_x64():
                    result = executable(*arrays)
            else:
                result = executable(*arrays)
        except Exception as error:
            explained = explain_failed_call(error, arrays, self._paths)
            if explained is error:
                raise
            raise explained from error
        if self._donated:
            delete_donated(arrays, self._donated)
        return result

    def __repr__(self) -> str:
        return f"Graphed({self.name}, args={self.args_spec!r}, output={self.spec!r})"


def _top_index(path: str) -> int:
    """The positional argument an args leaf belongs to: ``"[1]['w']"`` -> 1."""
    return int(path[1 : path.index("]")])


def _donate_argnums(
    donate_argnums: int | Sequence[int], args: tuple[Any, ...], spec: TreeSpec
) -> tuple[int, ...]:
    numbers = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    holding_arrays = {_top_index(path) for path in spec.array_paths}
    result = []
    for number in numbers:
        if type(number) is not int or not -len(args) <= number < len(args):
            raise DualgraphError(
                f"donate_argnums: {number!r} is not the index of one of the {len(args)} "
                "positional sample args"
            )
        index = number % len(args)
        if index not in holding_arrays:
            raise DualgraphError(
                f"donate_argnums: args[{index}] holds no array (constants and None are compiled "
                "in); only arrays can be donated"
            )
        result.append(index)
    return tuple(sorted(set(result)))


def _output_spec(traced: TreeSpec, out_spec: TreeSpec | str | None, name: str) -> TreeSpec:
    """The traced output spec, checked against ``out_spec`` and given its grad mask."""
    if out_spec is None:
        return traced
    if isinstance(out_spec, str):
        out_spec = TreeSpec.from_json(out_spec)
    stand_ins = traced.unflatten([struct_of(leaf) for leaf in traced.arrays])
    try:
        out_spec.check(stand_ins, root="output")
    except SpecMismatchError as error:
        raise SpecMismatchError(
            f"graphed({name}): the function's output does not match out_spec: {error}",
            path=error.path,
        ) from None
    for path, leaf in zip(out_spec.array_paths, out_spec.arrays, strict=True):
        if leaf.grad and not is_differentiable_dtype(leaf.dtype or ""):
            raise DualgraphError(
                f"graphed({name}): out_spec masks output{path} ({leaf}) for backward, but "
                "only floating and complex outputs can take a cotangent"
            )
    return traced.with_grad_mask(out_spec.grad_mask)
