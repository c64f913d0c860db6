"""The Python attributes a caller's input tensors carry (``x.scale = 2.0``), which the callable's
Python may read (``getattr(x, "scale", 1.0)``): a replay runs no Python, so a capture reads the
samples' and every call is held to them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch_cases import BACKENDS, device_of

import dualgraph.torch as dgt
from dualgraph import SpecMismatchError


class ScaledByItsInput(nn.Module):
    """Scales by a value its caller hangs on the input tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * getattr(x, "scale", 1.0)


def _carrying(tensor: torch.Tensor, **attributes: object) -> torch.Tensor:
    tensor.__dict__.update(attributes)
    return tensor


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_attribute_the_sample_carries_is_read_as_eager_reads_the_calls(backend: str) -> None:
    # The capture's Python read the static buffer, which carried none: every replay scaled by
    # 1.0 where eager scales by the 2.0 the call's tensor carries, silently (emulate too).
    device = device_of(backend)
    module = ScaledByItsInput().to(device)
    twin = copy.deepcopy(module)
    sample = _carrying(torch.randn(2, 4, device=device, requires_grad=True), scale=2.0)
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend)
    x = _carrying(torch.randn(2, 4, device=device), scale=2.0)
    assert torch.equal(graphed(x), twin(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("sample_carries", "call_carries", "words"),
    [
        ({"scale": 2.0}, {"scale": 3.0}, "carries the attribute scale = 3.0, where its sample "),
        ({}, {"scale": 3.0}, "carries the attribute scale = 3.0, which its sample did not"),
        ({"scale": 2.0}, {}, "carries no attribute scale, where its sample carried 2.0"),
        ({"scale": 0.0}, {"scale": -0.0}, "carries the attribute scale = -0.0, where its "),
    ],
    ids=["other_value", "added", "missing", "negative_zero"],
)
def test_a_call_whose_tensor_carries_other_attributes_is_refused_naming_its_path(
    backend: str, sample_carries: dict[str, float], call_carries: dict[str, float], words: str
) -> None:
    device = device_of(backend)
    module = ScaledByItsInput().to(device)
    sample = _carrying(torch.randn(2, 4, device=device, requires_grad=True), **sample_carries)
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend)
    x = _carrying(torch.randn(2, 4, device=device), **call_carries)
    with pytest.raises(SpecMismatchError, match=r"^args\[0\]: ") as refused:
        graphed(x)
    assert words in str(refused.value), refused.value
    assert refused.value.path == "args[0]"
    same = _carrying(torch.randn(2, 4, device=device), **sample_carries)
    graphed(same)  # a call carrying the sample's still runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_private_attributes_of_a_calls_tensor_are_not_compared(backend: str) -> None:
    # libraries' bookkeeping (Transformer Engine's fuser marks its inputs _do_not_clear)
    device = device_of(backend)
    module = ScaledByItsInput().to(device)
    twin = copy.deepcopy(module)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend)
    x = _carrying(torch.randn(2, 4, device=device), _do_not_clear=True)
    assert torch.equal(graphed(x), twin(x))


class TagsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.seen = True
        return self.fc(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_attribute_the_callable_sets_on_its_input_does_not_refuse_that_tensors_next_call(
    backend: str,
) -> None:
    device = device_of(backend)
    module = TagsItsInput().to(device)
    sample = torch.randn(2, 4, device=device, requires_grad=True)
    graphed = dgt.make_graphed_callables(module, (sample,), backend=backend)
    x = torch.randn(2, 4, device=device)
    first = graphed(x)
    assert x.seen is True
    assert torch.equal(graphed(x), first)
