"""The example callables every torch test walks through, their sample inputs, and comparisons.

``CASES`` maps a name to a :class:`Case`: a module or function (the reference model's ViT block
and encoder among them) and a way to draw fresh random inputs for it, with the ``requires_grad``
flags a training step would give them. A test graphs ``case.make(device)``'s callable, runs its
twin (same weights, loaded with ``load_state_dict``) eagerly on copies of the same inputs, and
compares outputs and gradients with :func:`assert_trees_match`: bit for bit on a CPU, within
:data:`TOLERANCES` on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dualgraph
import dualgraph.torch as dgt
from dualgraph import CaptureError
from dualgraph.models.torch_vit import VisionEncoder, ViTBlock
from dualgraph.torch._modules import runner_of as runner_of

#: The backend that needs a GPU; test parameters for it carry the ``cuda`` marker.
CUDA = "cuda"

#: Every backend; ``eager`` has no static buffers (a plain call with input checks).
BACKENDS = ["emulate", "eager", pytest.param(CUDA, marks=pytest.mark.cuda)]
#: The backends with static buffers: outputs alias them, capture can fail, grads go through them.
GRAPH_BACKENDS = ["emulate", pytest.param(CUDA, marks=pytest.mark.cuda)]
#: ``(backend, param_grads)``: the default (``"auto"``: chosen per backward), parameter grads
#: always returned through autograd, or added into static ``.grad`` buffers inside the backward
#: graph (the eager backend has no graph to add them in).
GRAD_MODES = [
    pytest.param("emulate", "auto", id="emulate"),
    pytest.param("emulate", "autograd", id="emulate-autograd"),
    pytest.param("emulate", "in_graph", id="emulate-in_graph"),
    pytest.param("eager", "auto", id="eager"),
    pytest.param(CUDA, "auto", marks=pytest.mark.cuda, id="cuda"),
    pytest.param(CUDA, "autograd", marks=pytest.mark.cuda, id="cuda-autograd"),
    pytest.param(CUDA, "in_graph", marks=pytest.mark.cuda, id="cuda-in_graph"),
]
#: The same on the backends with graphs.
GRAPH_GRAD_MODES = [p for p in GRAD_MODES if p.values[0] != "eager"]

#: ``(atol, rtol)`` of graphed vs eager on a GPU, per dtype (TF32 off); CPU results are exact.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def device_of(backend: str) -> torch.device:
    """Where a backend's tensors live: the GPU for ``"cuda"``, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == CUDA
        else torch.device("cpu")
    )


def tolerance(backend: str, dtype: torch.dtype = torch.float32) -> tuple[float, float] | None:
    """``None`` (bit for bit) on the CPU; the dtype's tolerance on the GPU."""
    return TOLERANCES[dtype] if backend == CUDA else None


def isolation(request: pytest.FixtureRequest) -> Iterator[None]:
    """Body of each torch test file's autouse fixture: a fixed seed, and CUDA hygiene."""
    torch.manual_seed(0)
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    with cuda_hygiene():
        yield


# -- example callables ---------------------------------------------------------------------------


class TinyMLP(nn.Module):
    """Linear, GELU, Linear: a plain tensor in, a plain tensor out."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Summary(NamedTuple):
    """A namedtuple output container."""

    total: Any
    note: Any


@dualgraph.register_dataclass
@dataclasses.dataclass
class GatedOutput:
    """A registered dataclass output container."""

    hidden: Any
    attention: Any = None


class EveryLeaf(nn.Module):
    """Returns every kind of output leaf, in every kind of container.

    Differentiable tensors, ``None``, int/float/bool/str constants, integer, bool and detached
    tensors, in a tuple, a dict (keys not sorted), a list, a namedtuple and a dataclass.
    """

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, extras: dict[str, torch.Tensor], *, shift: torch.Tensor
    ) -> Any:
        h = self.proj(x) + shift
        return (
            h,
            None,
            {"scale": 0.5, "aux": h.tanh(), "mask": None, "count": 3, "name": "every", "on": True},
            [h.argmax(dim=-1), h > 0, h.detach() * 2],
            Summary(total=h.sum(dim=-1), note=None),
            GatedOutput(hidden=h * extras["gate"]),
        )


def gated(
    x: torch.Tensor, extras: dict[str, torch.Tensor], *, mask: torch.Tensor, scale: float
) -> dict[str, Any]:
    """A function of tensor args, a nested dict arg, a tensor kwarg and a constant kwarg."""
    h = (x * extras["mask"] + extras["bias"]) * scale
    return {"out": (h * mask).tanh(), "kept": mask.detach() > 0.5, "scale": scale}


def frozen(x: torch.Tensor) -> tuple[Any, ...]:
    """Nothing differentiable comes out, although ``x`` requires grad."""
    return x.argmax(dim=-1), x.detach().exp(), None


# -- the table -----------------------------------------------------------------------------------

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Case:
    """An example: ``build()`` makes the callable, ``draw(device)`` fresh ``(args, kwargs)``."""

    name: str
    build: Callable[[], Any]
    draw: Callable[[torch.device], Inputs]
    differentiable: bool = True

    def make(self, device: torch.device) -> tuple[Any, Any]:
        """The callable to graph and its eager twin (a module with the same weights)."""
        fn = self.build()
        if not isinstance(fn, nn.Module):
            return fn, fn
        fn = fn.to(device)
        twin = self.build().to(device)
        twin.load_state_dict(fn.state_dict())
        return fn, twin


def _randn(device: torch.device, *shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=device).requires_grad_(grad)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("mlp", TinyMLP, lambda d: ((_randn(d, 4, 8),), {})),
        Case(
            "vit_block",
            lambda: ViTBlock(dim=16, heads=2),
            lambda d: ((_randn(d, 2, 5, 16, grad=True),), {}),
        ),
        Case(
            "encoder",
            lambda: VisionEncoder(image_size=16, patch_size=8, dim=16, depth=2, heads=2),
            lambda d: ((_randn(d, 2, 3, 16, 16),), {}),
        ),
        Case(
            "every_leaf",
            EveryLeaf,
            lambda d: (
                (_randn(d, 3, 6, grad=True), {"gate": _randn(d, 3, 6)}),
                {"shift": _randn(d, 6, grad=True)},
            ),
        ),
        Case(
            "gated_function",
            lambda: gated,
            lambda d: (
                (
                    _randn(d, 2, 8, grad=True),
                    {"mask": torch.rand(2, 8, device=d), "bias": _randn(d, 8, grad=True)},
                ),
                {"mask": torch.rand(2, 8, device=d).requires_grad_(), "scale": 2.0},
            ),
        ),
        Case(
            "frozen_function",
            lambda: frozen,
            lambda d: ((_randn(d, 3, 5, grad=True),), {}),
            differentiable=False,
        ),
    )
}


# -- running and comparing -----------------------------------------------------------------------


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree``, in optree's order."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True, namespace="dualgraph")
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def fresh_copy(tree: Any) -> Any:
    """``tree`` with each tensor replaced by a new leaf holding its values and ``requires_grad``."""
    return optree.tree_map(
        lambda leaf: (
            leaf.detach().clone().requires_grad_(leaf.requires_grad)
            if isinstance(leaf, torch.Tensor)
            else leaf
        ),
        tree,
        none_is_leaf=True,
        namespace="dualgraph",
    )


def loss_of(outputs: Any) -> torch.Tensor:
    """A scalar that every differentiable output leaf contributes to, each in its own way."""
    terms = [
        (t.float().square() * (k + 1)).mean()
        for k, t in enumerate(tensors_of(outputs))
        if t.requires_grad
    ]
    return torch.stack(terms).sum()


def backward_of(outputs: Any) -> None:
    """Backward of :func:`loss_of`; nothing of the autograd graph outlives the call."""
    loss_of(outputs).backward()


def grads_of(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The ``.grad`` of each tensor (cloned: a later backward can't change what is returned)."""
    return [None if t.grad is None else t.grad.detach().clone() for t in tensors]


def assert_tensors_match(
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    where: str,
    tolerance: tuple[float, float] | None = None,
) -> None:
    """Bit for bit (``tolerance=None``) or within ``(atol, rtol)``; ``None`` matches ``None``."""
    # a tolerance passed where the name goes would silently make the comparison bit for bit
    assert isinstance(where, str), f"where must name the tensors, got {where!r}"
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{where}: {actual!r} vs {expected!r}"
        return
    assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
    assert actual.device == expected.device, f"{where}: {actual.device} != {expected.device}"
    if tolerance is None:
        if not torch.equal(actual, expected):
            difference = (actual.double() - expected.double()).abs().max().item()
            raise AssertionError(f"{where}: not bit-identical (max abs difference {difference})")
        return
    atol, rtol = tolerance
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}"
    )


def assert_trees_match(
    actual: Any, expected: Any, tolerance: tuple[float, float] | None = None, path: str = ""
) -> None:
    """Same containers (types, dict key order), same ``None`` and constants, matching tensors.

    Tensors also need the same ``requires_grad`` as their eager counterparts.
    """
    where = path or "<root>"
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.requires_grad == expected.requires_grad, f"{where}: requires_grad differs"
        assert_tensors_match(actual.detach(), expected.detach(), where, tolerance)
    elif expected is None or isinstance(expected, (bool, int, float, str)):
        assert repr(actual) == repr(expected), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_trees_match(actual[key], expected[key], tolerance, f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            name = field.name
            assert_trees_match(
                getattr(actual, name), getattr(expected, name), tolerance, f"{path}.{name}"
            )
    else:
        assert isinstance(expected, (tuple, list)), f"{where}: unexpected {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_trees_match(a, e, tolerance, f"{path}[{i}]")


def assert_grads_match(
    actual: list[torch.Tensor | None],
    expected: list[torch.Tensor | None],
    names: list[str],
    tolerance: tuple[float, float] | None = None,
) -> None:
    """Grads of the same tensors (parameters or inputs) from two runs, compared one by one."""
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected, strict=True):
        assert_tensors_match(a, e, f"grad of {name}", tolerance)


def parameter_names(fn: Any) -> list[str]:
    return [name for name, _ in fn.named_parameters()] if isinstance(fn, nn.Module) else []


def parameters_of(fn: Any) -> list[torch.Tensor]:
    return list(fn.parameters()) if isinstance(fn, nn.Module) else []


@contextlib.contextmanager
def cuda_hygiene() -> Iterator[None]:
    """Around a CUDA test: TF32 off, and no autograd graph of an earlier test alive at a capture.

    A graph alive across a capture makes torch warn that the AccumulateGrad stream does not match
    (docs/cuda_graphs.md), which ``filterwarnings = error`` turns into a failure.
    """
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch versions warn about the TF32 flags' API itself
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        gc.collect()


def isclose_fraction(fraction: float, expected: float, spread: float = 0.1) -> bool:
    """Whether a measured fraction (of dropped elements, say) is near what was expected."""
    return math.isclose(fraction, expected, abs_tol=spread)


def capture_error(fn: Any, args: tuple[Any, ...], **options: Any) -> str:
    """The message of the CaptureError that graphing ``fn`` raises; nothing of it is kept alive."""
    try:
        dgt.make_graphed_callables(fn, args, **options)
    except CaptureError as error:
        return str(error)
    raise AssertionError(f"graphing {fn!r} raised no CaptureError")
