"""``graphed``: a JAX function compiled ahead of time under dualgraph's contract.

What happens once (in :class:`GraphedCallable`'s constructor): the call is described (its
:attr:`~GraphedCallable.call_spec`), dtypes JAX would narrow are refused, the function is traced
once on ``ShapeDtypeStruct``s of the samples' array leaves (constants and ``None`` are compiled
in), its output spec is recorded while it traces, and the program is compiled from that trace,
as is the VJP later (the function's Python runs again only to judge a call weakly typed
otherwise than the samples). What happens on every call (:meth:`GraphedCallable.__call__`):
the inputs are checked against the call spec, donated inputs are checked, the executable runs on
the flat array leaves, and the output tree is rebuilt from the spec, so ``None`` leaves and
constants come back where the Python function put them (JAX itself treats ``None`` as an empty
subtree and cannot return constants).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from .._call import CallSpec, describe_call
from .._dtypes import is_differentiable_dtype
from .._errors import DualgraphError, SpecMismatchError
from .._nodes import clip
from .._orders import KeyOrders, key_order_difference
from .._spec import TreeSpec, describe
from .._spelling import CallSpelling
from . import _leaves as _leaves  # registers JAX's array types with the core
from ._donation import (
    check_donated_inputs,
    default_device,
    delete_donated,
    donated_argnums,
    donated_leaves,
    explain_failed_call,
    jax_donation_warnings,
    unusable_donations,
    warn_unusable,
)
from ._dtypes import refuse_narrowed_inputs, weak_type_error, weak_types
from ._env import config_value, x64_enabled, x64_mode
from ._leaves import (
    TRACER_TYPE,
    in_default_layouts,
    refuse_foreign_arrays,
    refuse_foreign_outputs,
)
from ._non_finite import non_finite_error
from ._settings import TraceSettings
from ._transforms import call_leaves, tracer_error
from ._trees import struct_of
from ._vjp import Pullback, VJPProgram

__all__ = ["GraphedCallable", "graphed"]


def graphed(
    fn: Callable[..., Any],
    sample_args: Sequence[Any],
    *,
    sample_kwargs: Mapping[str, Any] | None = None,
    donate_argnums: Any = (),
    out_spec: TreeSpec | str | None = None,
    lazy: bool = False,
) -> GraphedCallable:
    """Compile ``fn`` ahead of time for calls shaped like ``fn(*sample_args, **sample_kwargs)``.

    The JAX counterpart of ``dualgraph.torch.make_graphed_callables``: :func:`jax.jit` compiled
    from the samples' shapes and dtypes (the samples may be arrays or ``ShapeDtypeStruct``s).

    - Array leaves of the args and kwargs are the program's inputs; constants (int, float,
      bool, str) and ``None`` are static, compiled in, and checked on every call.
    - Outputs keep their ``None`` leaves and constants at the paths the function returns them.
      :attr:`GraphedCallable.out_spec` is the output spec; for the same logical output its JSON
      is the one the PyTorch side writes.
    - ``out_spec`` (a :class:`~dualgraph.TreeSpec` or its JSON, e.g. written by the PyTorch
      side) is checked against the traced output, naming the first differing path, and supplies
      the grad mask used by :meth:`GraphedCallable.vjp`. Without it, floating outputs are masked.
    - Calls are checked against the call spec before anything runs or is donated:
      ``args[0]['mask']: expected float32[2, 8], got float32[2, 9]``. A dict argument must
      have its keys in the sample's order (the function was traced in that order), and so must
      the keywords the function collects in its ``**kwargs``. A call spelled otherwise than the
      samples (``g(x, 2.0)`` or ``g(x, scale=2.0)`` for a sample ``g(x)``) is bound by the
      function's signature and checked as the samples were spelled; a default the samples left
      out must be passed as itself, else it is refused naming its path.
    - ``donate_argnums``: an int (``np.int64`` and other integer-likes too) or a sequence of
      them, the positional args whose buffers the call consumes, as a CUDA graph's static inputs:
      every JAX array in them is deleted after each call, and outputs of the same shape and dtype
      may be written into them. A donation no output can reuse is reported once, here, as a
      :class:`~dualgraph.DualgraphWarning`; a donated buffer also passed elsewhere in the same
      call, whole or in part (overlapping views of one allocation), is a
      :class:`~dualgraph.DualgraphError`.
    - Inputs JAX would narrow are refused, naming their path: int64, uint64, float64 and
      complex128 need JAX's 64-bit mode (``jax.enable_x64``) when compiling, rather than be
      computed in 32 bits; float128 and non-numeric arrays are refused always. A program
      compiled with the mode on turns it on again around its own calls.
    - ``lazy=True``: trace now (the output spec and tracing errors come at once) but compile
      each program at its first use, for callers that only need :meth:`GraphedCallable.vjp`.
    - It cannot be called inside ``jax.jit``/``vmap``/``grad``: a tracer among its inputs is
      an error that says so. Call ``.fn`` there instead.

    >>> import jax.numpy as jnp
    >>> def layer(x, *, scale):
    ...     return {"hidden": x * scale, "aux_loss": None, "n": 2}
    >>> g = graphed(layer, (jnp.ones(3),), sample_kwargs={"scale": 2.0})
    >>> g(jnp.ones(3), scale=2.0)
    {'hidden': Array([2., 2., 2.], dtype=float32), 'aux_loss': None, 'n': 2}
    >>> g.out_spec
    TreeSpec({'hidden': float32[3](grad), 'aux_loss': None, 'n': 2})
    """
    return GraphedCallable(
        fn,
        sample_args,
        sample_kwargs=sample_kwargs,
        donate_argnums=donate_argnums,
        out_spec=out_spec,
        lazy=lazy,
    )


class GraphedCallable:
    """A function compiled by :func:`graphed`; call it like the function, or :meth:`vjp` it.

    Attributes (named as on ``dualgraph.torch``'s graphed callables): ``name``, ``fn``,
    ``call_spec`` (the inputs: a :class:`~dualgraph.CallSpec`), ``out_spec`` (the outputs, with
    the grad mask :meth:`vjp` uses), ``donate_argnums`` and :attr:`compiled` (the forward).
    Constructed directly, it also takes ``compiler_options``: XLA options every program (the
    VJP's too) is compiled with, as ``jax.stages.Lowered.compile`` takes them;
    :meth:`with_compiler_options` makes a twin compiled with others from the same trace.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        sample_args: Sequence[Any],
        *,
        sample_kwargs: Mapping[str, Any] | None = None,
        donate_argnums: Any = (),
        out_spec: TreeSpec | str | None = None,
        lazy: bool = False,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not callable(fn):
            raise DualgraphError(f"graphed: {fn!r} is not callable")
        self.fn = fn
        self.name: str = getattr(fn, "__qualname__", None) or type(fn).__name__
        if not isinstance(sample_args, (tuple, list)):
            raise DualgraphError(
                f"graphed({self.name}): sample_args must be a tuple of the positional sample "
                f"arguments, got {type(sample_args).__name__} (for one argument x: (x,))"
            )
        if not isinstance(lazy, bool):  # "no" would be truthy
            raise DualgraphError(
                f"graphed({self.name}): lazy must be True or False, got {clip(lazy)}"
            )
        args = tuple(sample_args)
        self.call_spec: CallSpec = describe_call(args, sample_kwargs)  # refuses a non-mapping
        kwargs = dict(sample_kwargs or {})
        self._paths = self.call_spec.array_paths
        # The spec matches a dict (and the keywords) in any order; the function is traced in
        # the sample's.
        self._key_orders = KeyOrders(self.call_spec, fn) or None  # None: nothing to check
        # A call spelling its arguments otherwise than the sample (a keyword by position, a
        # default passed or left out) is the function's same call: written as the sample's
        # where the spec refuses it as it is, and its errors name paths as it spells them.
        self._spelling = CallSpelling(fn, args, kwargs)
        self._called_paths: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {}
        self._keywords = tuple(kwargs)  # a pullback gives a call's kwargs grads in its order
        # Weakly typed samples (from Python scalars) are compiled weak, as jax.jit would; every
        # call must then match them (JAX promotes the two kinds differently).
        self._weak = weak_types(self.call_spec.flatten(args, kwargs))
        self._weak_verdicts: dict[tuple[bool, ...], bool] = {}  # whether it traces the same
        # Graphed with the 64-bit mode off, called with it on: whether the function traces to
        # the same program there (None: not judged yet; the error, or False when it does).
        self._wide_verdict: DualgraphError | bool | None = None
        # The configuration the programs are compiled under; the VJP, compiled later, reuses it.
        self._x64 = x64_enabled()
        self._precision = config_value("jax_default_matmul_precision")
        self._device = default_device()  # what the programs are compiled for, the VJP's too
        # Calls under other settings that change what tracing makes are refused (jax.jit would
        # trace again); the VJP, compiled at the first .vjp call, is then traced under these.
        self._settings = TraceSettings(self.name)
        refuse_narrowed_inputs(self.name, self._paths, self.call_spec.arrays)
        self.donate_argnums = donated_argnums(donate_argnums, self.call_spec.args_spec, len(args))
        self._donated = donated_leaves(self.call_spec.args_spec, self.donate_argnums)
        if compiler_options is not None and not isinstance(compiler_options, Mapping):
            raise DualgraphError(
                f"graphed({self.name}): compiler_options must be a mapping of XLA option names "
                f"to values, got {clip(compiler_options)}"
            )
        self._compiler_options = dict(compiler_options or {})
        self._traced_spec: TreeSpec | None = None
        self._compiled: jax.stages.Compiled | None = None
        # The VJP by the inputs' weak types: the sample's, and any other a call is accepted with
        # (the same forward program, but jax.vjp gives each grad its input's own weak type).
        self._vjp_programs: dict[tuple[bool, ...], VJPProgram] = {}
        structs = [
            struct_of(leaf, weak_type=weak)
            for leaf, weak in zip(self.call_spec.arrays, self._weak, strict=True)
        ]
        with jax_donation_warnings() as jax_warned:
            # The function's Python runs once, here: every program (this forward, the VJP's,
            # compiled later) is made from this one trace, so none sees Python state (a global,
            # an attribute, a side effect) as it is at a later first call.
            with _constants_in_the_trace():
                trace = _with_constants_kept(jax.make_jaxpr(self._flat)(*structs))
            self._program = jaxpr_as_fun(trace)
            jitted = jax.jit(
                self._program, donate_argnums=self._donated, keep_unused=bool(self._donated)
            )
            self._lowered = jitted.lower(*structs)
            if not lazy:
                self._compiled = self._lowered.compile(self._compiler_options)
        traced = self._traced_spec
        assert traced is not None
        _check_returned(self.name, traced, jax.tree_util.tree_leaves(self._lowered.out_info))
        self.out_spec: TreeSpec = _output_spec(traced, out_spec, self.name)
        inputs = self.call_spec.arrays
        unusable = unusable_donations(inputs, self._donated, traced.arrays)
        if unusable:
            warn_unusable(self.name, unusable, self._paths, inputs)
        elif jax_warned:
            warn_unusable(self.name, self._donated, self._paths, inputs)

    @property
    def compiled(self) -> jax.stages.Compiled:
        """The compiled forward program (``jax.stages.Compiled``)."""
        if self._compiled is None:
            with jax_donation_warnings():  # reported when traced
                self._compiled = self._lowered.compile(self._compiler_options)
        return self._compiled

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The XLA options every program (the VJP's too) is compiled with (a copy)."""
        return dict(self._compiler_options)

    def with_compiler_options(self, options: Mapping[str, Any]) -> GraphedCallable:
        """A twin compiled, at its first use, from this one's trace with ``options`` added to its
        XLA options: the same program (the function's Python does not run again), the same
        specs, donation and settings, e.g. with ``{"xla_allow_excess_precision": False}`` to
        round every bfloat16 and float16 result as the program says.

        >>> import jax.numpy as jnp
        >>> g = graphed(lambda x: x * 3, (jnp.ones(2, jnp.bfloat16),))
        >>> g.with_compiler_options({"xla_allow_excess_precision": False}).compiler_options
        {'xla_allow_excess_precision': False}
        """
        if not isinstance(options, Mapping):
            raise DualgraphError(
                f"graphed({self.name}): compiler_options must be a mapping of XLA option names "
                f"to values, got {clip(options)}"
            )
        twin = copy.copy(self)
        twin._compiler_options = {**self._compiler_options, **options}
        twin._compiled = None
        twin._vjp_programs = {}
        twin._weak_verdicts = dict(self._weak_verdicts)
        return twin

    # -- traced once ----------------------------------------------------------------------------

    def _flat(self, *arrays: Any) -> list[Any]:
        """The function of the flat input arrays that returns the flat output arrays."""
        args, kwargs = self.call_spec.unflatten(arrays)
        outputs = self.fn(*args, **kwargs)
        spec = describe(outputs, root="output")
        returned = spec.flatten(outputs)
        paths = ["output" + path for path in spec.array_paths]
        refuse_foreign_outputs(f"graphed({self.name})", zip(paths, returned, strict=True))
        self._traced_spec = spec
        return returned

    # -- every call -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arrays, paths, _ = self._checked_inputs(args, kwargs)
        return self.out_spec.unflatten(self._run(self._compiled or self.compiled, arrays, paths))

    def vjp(self, *args: Any, **kwargs: Any) -> tuple[Any, Pullback]:
        """``(outputs, pullback)`` for a call like ``self(*args, **kwargs)``, as :func:`jax.vjp`.

        ``pullback(cotangent)`` takes arrays at the masked output leaves (the grad mask of
        :attr:`out_spec`) and ``None`` elsewhere, and returns ``(args_grads, kwargs_grads)``
        with a gradient at each floating or complex input array and ``None`` elsewhere, spelled
        as this call spells its arguments, its keywords in its order (``g.vjp(w=w, x=x)`` gets
        ``((), {'w': dw, 'x': dx})`` where the sample passed them by position).
        Parameters are an argument like any other: ``fn(params, x)`` gets its parameter grads in
        ``args_grads[0]``. Both programs are compiled at the first call; donation applies as for
        a plain call.

        >>> import jax.numpy as jnp
        >>> g = graphed(lambda w, x: (w * x, None), (jnp.ones(2), jnp.ones(2)))
        >>> out, pullback = g.vjp(jnp.full(2, 3.0, jnp.float32), jnp.ones(2))  # strong, as w
        >>> (dw, dx), _ = pullback((jnp.ones(2), None))
        >>> dx
        Array([3., 3.], dtype=float32)
        """
        arrays, paths, weak = self._checked_inputs(args, kwargs)
        program = self._vjp_programs.get(weak)
        if program is None:
            with self._compile_config():
                program = self._vjp_programs[weak] = VJPProgram(
                    self.name,
                    self._program,
                    self.call_spec,
                    self.out_spec,
                    self._donated,
                    weak,
                    self._device,
                    self._compiler_options,
                    self._compile_config,
                )
        outputs, residuals = self._run(program.forward, arrays, paths)
        as_called = None
        if paths is not self._paths:  # spelled otherwise than the sample: grads as it spells
            shape = ((None,) * len(args), dict.fromkeys(kwargs))  # holds none of the inputs
            as_called = functools.partial(_grads_as_called, self._spelling, shape)
        elif kwargs and tuple(kwargs) != self._keywords:  # the sample's, in another order
            as_called = functools.partial(_grads_in_order, tuple(kwargs))
        pullback = Pullback(program, residuals, self._x64, self._settings, as_called)
        return self.out_spec.unflatten(outputs), pullback

    @contextlib.contextmanager
    def _compile_config(self) -> Iterator[None]:
        with (
            jax.default_matmul_precision(self._precision),
            x64_mode(self._x64),
            jax.default_device(self._device),
        ):
            yield

    def _checked_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], tuple[str, ...], tuple[bool, ...]]:
        """The call's input arrays, checked, their paths as the call spells them (the
        samples' paths, ``self._paths`` itself, where the call is spelled as the sample) and
        their weak types."""
        try:
            self._settings.check()
            paths = self._paths
            try:
                arrays = self.call_spec.flatten(args, kwargs, check=True)
                spelled_args, spelled_kwargs = args, kwargs
            except SpecMismatchError as error:  # spelled otherwise than the sample call?
                spelled = self._spelling.as_captured(args, kwargs)
                if spelled is None:
                    raise
                spelled_args, spelled_kwargs = spelled
                try:
                    arrays = self.call_spec.flatten(spelled_args, spelled_kwargs, check=True)
                except SpecMismatchError as refused:
                    raise self._spelling.named_as_called(refused, args, kwargs, error) from None
                paths = self._paths_as_called(args, kwargs)
            if self._key_orders is not None:
                try:
                    self._key_orders.check(spelled_args, spelled_kwargs)
                except SpecMismatchError as refused:
                    raise self._spelling.named_as_called(refused, args, kwargs) from None
            refuse_foreign_arrays(f"graphed({self.name})", zip(paths, arrays, strict=True))
            weak = weak_types(arrays)
            if weak != self._weak:
                self._check_weak_types(weak, paths)
            if not self._x64 and x64_enabled():
                self._check_wide_mode()
            if self._donated:
                check_donated_inputs(arrays, self._donated, paths)
        except Exception as error:  # a tracer fails these checks in many ways: name the cause
            explained = tracer_error(f"graphed({self.name})", call_leaves(args, kwargs))
            if explained is None:
                raise
            raise explained from error
        return arrays, paths, weak

    def _paths_as_called(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, ...]:
        """The input arrays' paths as a call spelled otherwise than the sample spells them
        (worked out once per spelling)."""
        shape = (len(args), tuple(kwargs))
        paths = self._called_paths.get(shape)
        if paths is None:
            if len(self._called_paths) >= 64:  # spellings of one function: few kinds
                self._called_paths.clear()
            paths = self._called_paths[shape] = tuple(
                self._spelling.path_as_called(path, args, kwargs) or path for path in self._paths
            )
        return paths

    def _check_wide_mode(self) -> None:
        """Accept a call with JAX's 64-bit mode on, for a program compiled with it off, only
        where the function traces to the same program in either mode: it runs in the mode it
        was compiled in, where the function itself would make 64-bit values (``x.astype(float)``,
        ``jnp.zeros(n)``) and return other dtypes and values. Judged once."""
        if self._wide_verdict is None:
            with self._compile_config():
                narrow = self._jaxpr(self._weak)
            with self._compile_config(), x64_mode(True):
                wide = self._jaxpr(self._weak)
            self._wide_verdict = narrow != wide and DualgraphError(
                f"graphed({self.name}) was graphed with JAX's 64-bit mode off and is called "
                "with it on, where the function computes otherwise (it makes 64-bit values, "
                "e.g. x.astype(float) or jnp.zeros(n)) than the program, which runs in the mode "
                "it was compiled in. Call it with the mode off, or graph it with the mode on"
            )
        if isinstance(self._wide_verdict, DualgraphError):
            raise self._wide_verdict

    def _check_weak_types(self, weak: tuple[bool, ...], paths: Sequence[str]) -> None:
        """Accept inputs weakly typed otherwise than the samples only where the function traces
        to the same program with outputs typed the same (weakly or not: ``jax.jit`` returns a
        weak output for weak inputs, and ``bfloat16 + out`` depends on it); the verdict is kept
        per pattern."""
        same = self._weak_verdicts.get(weak)
        if same is None:
            with self._compile_config():
                same = self._weak_verdicts[weak] = self._jaxpr(self._weak) == self._jaxpr(weak)
        if not same:
            raise weak_type_error(paths, self.call_spec.arrays, self._weak, weak)

    def _jaxpr(self, weak: tuple[bool, ...]) -> tuple[str, list[bool], TreeSpec]:
        """The function's program, as text, its outputs' weak types (the text omits them) and
        its output spec, for inputs weakly typed so."""
        specs: list[TreeSpec] = []

        def flat(*arrays: Any) -> list[Any]:
            args, kwargs = self.call_spec.unflatten(arrays)
            outputs = self.fn(*args, **kwargs)
            specs.append(describe(outputs, root="output"))
            return specs[-1].flatten(outputs)

        structs = [
            struct_of(leaf, weak_type=w)
            for leaf, w in zip(self.call_spec.arrays, weak, strict=True)
        ]
        program = jax.make_jaxpr(flat)(*structs)
        return str(program), [aval.weak_type for aval in program.out_avals], specs[-1]

    def _run(
        self,
        executable: Callable[..., Any],
        arrays: list[Any],
        paths: Sequence[str],
        *,
        relaid: bool = False,
    ) -> Any:
        try:
            with x64_mode(self._x64):
                result = executable(*arrays)
        except Exception as error:
            copies = None if relaid else in_default_layouts(error, arrays)
            if copies is not None:  # an input in another memory layout, taken as jax.jit would
                result = self._run(executable, copies, paths, relaid=True)
                if self._donated:
                    delete_donated(arrays, self._donated)
                return result
            non_finite = non_finite_error(error, f"graphed({self.name})")
            if non_finite is not None:  # the program ran, and consumed what it was donated
                if self._donated:
                    delete_donated(arrays, self._donated)
                raise non_finite from error
            explained: Exception | None = tracer_error(
                f"graphed({self.name})", zip(paths, arrays, strict=True)
            )
            if explained is None:
                explained = explain_failed_call(error, arrays, paths, self._device, self._donated)
            if explained is error:
                raise
            raise explained from error
        if self._donated:
            delete_donated(arrays, self._donated)
        return result

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, call={self.call_spec!r}, out={self.out_spec!r})"


def _grads_as_called(
    spelling: CallSpelling,
    shape: tuple[tuple[None, ...], dict[str, None]],
    args_grads: Any,
    kwargs_grads: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Grads of a call spelled otherwise than the sample (``shape``: its args and kwargs with
    ``None`` for values), given as the sample spelled it, placed as the call spelled it."""
    return spelling.as_called(args_grads, kwargs_grads, *shape)


def _grads_in_order(
    order: tuple[str, ...], args_grads: Any, kwargs_grads: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """Grads of a call passing the sample's keywords in the ``order`` it passes them."""
    return args_grads, {name: kwargs_grads[name] for name in order}


def _with_constants_kept(trace: Any) -> Any:
    """``trace`` holding copies of the arrays the function closes over, where JAX's holds the
    arrays themselves: written into after graphing (a numpy array, ``weights[:] = new``, or a
    JAX array whose memory torch shares through DLPack and changes in place), their new values
    would reach the VJP, lowered at its first call, and not the forward, lowered when graphed.

    A JAX array is copied to the host, as the lowered forward holds its constants; a weakly
    typed one, or a PRNG key, on its device (a host copy would lose its weak type or key).

    >>> import numpy as np, jax.numpy as jnp
    >>> weights = np.ones(2, np.float32)
    >>> trace = _with_constants_kept(jax.make_jaxpr(lambda x: x * weights)(jnp.ones(2)))
    >>> weights[:] = 5.0
    >>> trace.consts[0].tolist()
    [1.0, 1.0]
    """
    return trace.replace(consts=[_kept_constant(c) for c in trace.consts])


def _constants_in_the_trace() -> contextlib.AbstractContextManager[Any]:
    """A context in which a trace holds the arrays the function closes over among its
    constants, where :func:`_with_constants_kept` copies them, never as literals of its
    equations (``jax_use_simplified_jaxpr_constants``, the same program either way)."""
    try:
        from jax._src import config  # the setting's own context manager; no public one
    except ImportError:
        return contextlib.nullcontext()
    setting = getattr(config, "use_simplified_jaxpr_constants", None)
    return contextlib.nullcontext() if setting is None else setting(False)


def _numpy_copy(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` of no more memory than it holds: an axis of stride 0 (a view of
    ``np.broadcast_to``) stays a broadcast of one copied entry, which JAX lowers as such, where
    a dense copy could be any size.

    >>> view = np.broadcast_to(np.arange(2.0)[:, None], (2, 10**6))
    >>> kept = _numpy_copy(view)
    >>> kept.base.shape, np.shares_memory(kept, view), (kept == view).all()
    ((2, 1), False, np.True_)
    """
    broadcast = [
        stride == 0 and size > 1 for stride, size in zip(array.strides, array.shape, strict=True)
    ]
    if not any(broadcast) or not array.size:
        return array.copy()
    one = tuple(slice(0, 1) if b else slice(None) for b in broadcast)
    return np.broadcast_to(array[one].copy(), array.shape)


def _kept_constant(const: Any) -> Any:
    """A copy of an array the function closes over that nothing else can write into."""
    if isinstance(const, np.ndarray):
        return _numpy_copy(const)
    if not isinstance(const, jax.Array) or isinstance(const, TRACER_TYPE):
        return const
    if not const.is_fully_addressable:  # other hosts hold parts of it: as JAX holds it
        return const
    if jax.dtypes.issubdtype(const.dtype, jax.dtypes.extended) or const.weak_type:
        return jnp.array(const, copy=True)
    return np.array(const, copy=True)


def _check_returned(name: str, traced: TreeSpec, returned: Sequence[Any]) -> None:
    """Refuse a traced output spec that says otherwise than the program returns (shape, dtype)."""
    for path, leaf, struct in zip(traced.array_paths, traced.arrays, returned, strict=True):
        shape, dtype = tuple(struct.shape), struct.dtype.name
        if (shape, dtype) != (leaf.shape, leaf.dtype):
            raise DualgraphError(
                f"graphed({name}): output{path} is {leaf} where the function returns it, but "
                f"the compiled program returns {dtype}[{', '.join(map(str, shape))}]"
            )


def _output_spec(traced: TreeSpec, out_spec: TreeSpec | str | None, name: str) -> TreeSpec:
    """The traced output spec, checked against ``out_spec`` and given its grad mask."""
    if out_spec is None:
        return traced
    if isinstance(out_spec, (str, bytes, bytearray, memoryview)):
        out_spec = TreeSpec.from_json(out_spec)
    elif not isinstance(out_spec, TreeSpec):
        raise DualgraphError(
            f"graphed({name}): out_spec must be a TreeSpec or its JSON (str or bytes), got "
            f"{type(out_spec).__module__}.{type(out_spec).__qualname__}"
        )
    stand_ins = traced.unflatten([struct_of(leaf) for leaf in traced.arrays])
    try:
        out_spec.check(stand_ins, root="output")
    except SpecMismatchError as error:
        hint = ""
        if not x64_enabled() and any(
            leaf.dtype in ("int64", "uint64", "float64", "complex128") for leaf in out_spec.arrays
        ):
            hint = " (JAX's 64-bit mode is off, so JAX computes 64-bit types in 32 bits)"
        raise SpecMismatchError(
            f"graphed({name}): the function's output does not match out_spec: {error}{hint}",
            path=error.path,
        ) from None
    found = key_order_difference(out_spec, traced)
    if found is not None:
        path, written, returned = found
        raise SpecMismatchError(
            f"graphed({name}): output{path} is a dict with its keys in the order "
            f"{list(returned)!r}, but out_spec has them in the order {list(written)!r} (what "
            "iterates over the dict, its .values() or a concatenation, would differ)",
            path="output" + path,
        )
    for path, leaf in zip(out_spec.array_paths, out_spec.arrays, strict=True):
        if leaf.grad and not is_differentiable_dtype(leaf.dtype or ""):
            raise DualgraphError(
                f"graphed({name}): out_spec masks output{path} ({leaf}) for backward, but "
                "only floating and complex outputs can take a cotangent"
            )
    return traced.with_grad_mask(out_spec.grad_mask)
