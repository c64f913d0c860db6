"""The VJP of a graphed function under its output grad mask: two compiled programs.

The forward program returns the outputs and the residuals of :func:`jax.vjp` (the arrays the
backward needs), so donated inputs can be consumed by the forward; the backward program maps the
residuals and the cotangents of the masked outputs to the gradients of the differentiable
(floating or complex) inputs. Both are compiled once, at the first :meth:`GraphedCallable.vjp`
(again for inputs weakly typed otherwise, where a call is accepted so); the backward again for
cotangents weakly typed otherwise (``jnp.ones_like`` of a weak output), whose grads ``jax.vjp``
types otherwise (``bfloat16 + grad`` depends on it), at their first use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax

from .._call import CallSpec
from .._dtypes import is_differentiable_dtype
from .._errors import DualgraphError
from .._spec import TreeSpec
from ._donation import explain_failed_call, jax_donation_warnings
from ._dtypes import weak_types as weak_types_of
from ._env import x64_mode
from ._leaves import in_default_layouts, refuse_foreign_arrays
from ._non_finite import non_finite_error
from ._settings import TraceSettings
from ._transforms import leaves_with_paths, tracer_error
from ._trees import keep_arrays, struct_of

__all__ = ["Pullback", "VJPProgram"]

#: args and kwargs grads spelled as the sample call -> as the call spelled its arguments
AsCalled = Callable[[Any, Any], tuple[tuple[Any, ...], dict[str, Any]]]


class VJPProgram:
    """The compiled forward-with-residuals and backward of one graphed function."""

    def __init__(
        self,
        name: str,
        flat_fn: Callable[..., list[Any]],
        call_spec: CallSpec,
        out_spec: TreeSpec,
        donated: Sequence[int],
        weak_types: Sequence[bool],
        device: Any,
        compiler_options: dict[str, Any],
        compile_config: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        self.name = name
        self.device = device  # compiled for it (the caller's context makes it JAX's default)
        inputs = call_spec.arrays
        differentiable = [is_differentiable_dtype(leaf.dtype or "") for leaf in inputs]
        diff_inputs = [i for i, d in enumerate(differentiable) if d]
        masked_outputs = [j for j, m in enumerate(out_spec.grad_mask) if m]
        n_args = call_spec.num_args_arrays
        self.cotangent_spec = _kept(name, out_spec, out_spec.grad_mask, "output", "cotangent")
        self.cotangent_paths = ["cotangent" + p for p in self.cotangent_spec.array_paths]
        self.args_grad_spec = _kept(name, call_spec.args_spec, differentiable[:n_args], "args")
        self.kwargs_grad_spec = _kept(
            name, call_spec.kwargs_spec, differentiable[n_args:], "kwargs"
        )
        self.num_args_grads = sum(differentiable[:n_args])
        pullback_tree: list[Any] = []

        def forward(*arrays: Any) -> tuple[list[Any], list[Any]]:
            def masked(*diff: Any) -> tuple[list[Any], list[Any]]:
                full = list(arrays)
                for i, x in zip(diff_inputs, diff, strict=True):
                    full[i] = x
                outputs = flat_fn(*full)
                return [outputs[j] for j in masked_outputs], outputs

            primals = [arrays[i] for i in diff_inputs]
            _, pullback, outputs = jax.vjp(masked, *primals, has_aux=True)
            residuals, tree = jax.tree_util.tree_flatten(pullback)
            pullback_tree[:] = [tree]
            return outputs, residuals

        def backward(residuals: list[Any], cotangents: list[Any]) -> list[Any]:
            pullback = jax.tree_util.tree_unflatten(pullback_tree[0], residuals)
            return list(pullback(list(cotangents)))

        structs = [struct_of(x, weak_type=w) for x, w in zip(inputs, weak_types, strict=True)]
        with jax_donation_warnings():  # reported once already, by the plain forward's compile
            jitted = jax.jit(forward, donate_argnums=tuple(donated), keep_unused=bool(donated))
            lowered = jitted.lower(*structs)
            self.forward = lowered.compile(compiler_options)
        self._backward = backward
        self._residual_structs = lowered.out_info[1]
        self._compiler_options = compiler_options
        self._compile_config = compile_config  # the graphing's precision, 64-bit mode, device
        #: the backward by the cotangents' weak types (a weak cotangent, e.g. jnp.ones_like of
        #: a weak output, gives jax.vjp's grads weak types of their own)
        self.backwards: dict[tuple[bool, ...], Any] = {}
        self.backward_for((False,) * len(self.cotangent_spec.arrays))

    def backward_for(self, weak: tuple[bool, ...]) -> Any:
        """The backward compiled for cotangents weakly typed as ``weak`` says (once each)."""
        found = self.backwards.get(weak)
        if found is None:
            structs = [
                struct_of(leaf, weak_type=w)
                for leaf, w in zip(self.cotangent_spec.arrays, weak, strict=True)
            ]
            with self._compile_config():
                lowered = jax.jit(self._backward).lower(self._residual_structs, structs)
                found = self.backwards[weak] = lowered.compile(self._compiler_options)
        return found


def _kept(
    name: str, spec: TreeSpec, keep: Sequence[bool], root: str, what: str = "gradient"
) -> TreeSpec:
    """The spec of the tree of ``what`` values for ``spec`` (:func:`keep_arrays`), refused
    naming the path and saying why where a class of the tree refuses the ``None`` it holds."""
    try:
        return keep_arrays(spec, keep, root=root)
    except DualgraphError as error:
        raise DualgraphError(
            f"graphed({name}): the tree of {what}s of {root} holds None at its constants and at "
            f"the arrays that take no {what}, but a class in it refuses None there: {error}. "
            "Let the class take None there, or pass that constant outside it"
        ) from error


class Pullback:
    """The backward of one :meth:`GraphedCallable.vjp` call: cotangents in, input gradients out.

    Call it with a tree shaped like the output whose masked leaves (the output spec's grad mask)
    are arrays of the output's shape and dtype and whose other leaves are ``None``, constants
    included; :attr:`cotangent_spec` describes it. It returns ``(args_grads, kwargs_grads)``:
    trees shaped like the call's args and kwargs with a gradient at every floating or complex
    array and ``None`` elsewhere. It can be called more than once.
    """

    __slots__ = ("_as_called", "_program", "_residuals", "_settings", "_x64")

    def __init__(
        self,
        program: VJPProgram,
        residuals: list[Any],
        x64: bool,
        settings: TraceSettings,
        as_called: AsCalled | None = None,
    ) -> None:
        self._program = program
        #: writes the grads, spelled as the sample call, as the call spelled its arguments
        self._as_called = as_called
        self._residuals = residuals
        self._x64 = x64
        self._settings = settings  # where the function was graphed; the backward too

    @property
    def cotangent_spec(self) -> TreeSpec:
        """The spec of the cotangent tree: the masked output arrays, ``None`` elsewhere."""
        return self._program.cotangent_spec

    def __call__(self, cotangent: Any, /) -> tuple[tuple[Any, ...], dict[str, Any]]:
        program = self._program
        try:
            self._settings.check(" (its pullback)")
            cotangents = program.cotangent_spec.flatten(cotangent, check=True, root="cotangent")
            refuse_foreign_arrays(
                f"the pullback of graphed({program.name})",
                zip(program.cotangent_paths, cotangents, strict=True),
            )
            weak = weak_types_of(cotangents)
            backward = program.backwards.get(weak) or program.backward_for(weak)
            with x64_mode(self._x64):
                try:
                    grads = backward(self._residuals, cotangents)
                except Exception as error:
                    non_finite = non_finite_error(error, f"the pullback of graphed({program.name})")
                    if non_finite is not None:
                        raise non_finite from error
                    copies = in_default_layouts(error, cotangents)
                    if copies is None:  # a deleted cotangent, or one on another device
                        clearer = explain_failed_call(
                            error, cotangents, program.cotangent_paths, program.device
                        )
                        if clearer is error:
                            raise
                        raise clearer from error
                    grads = program.backward_for(weak_types_of(copies))(self._residuals, copies)
        except Exception as error:  # a tracer fails these in many ways: name the cause
            explained = tracer_error(
                f"the pullback of graphed({program.name})",
                leaves_with_paths(cotangent, "cotangent"),
            )
            if explained is None:
                raise
            raise explained from error
        n = program.num_args_grads
        args_grads = program.args_grad_spec.unflatten(grads[:n])
        kwargs_grads = program.kwargs_grad_spec.unflatten(grads[n:])
        if self._as_called is not None:
            return self._as_called(args_grads, kwargs_grads)
        return args_grads, kwargs_grads
