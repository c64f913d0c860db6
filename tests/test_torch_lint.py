"""The capture lint: each kind of finding with its source line, the module path, the automatic
lint during capture (on ``emulate`` here, ``cuda`` where marked), and what it leaves alone.

``FINDINGS`` is the table every finding test walks: a callable, its sample inputs, and the kind,
op and source line (the line holding the case's ``# lint:`` marker) the lint must report.
"""

from __future__ import annotations

import datetime
import functools
import gc
import importlib
import io
import logging
import math
import os
import random
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dualgraph.torch as dgt
from dualgraph import CaptureError, DualgraphError, DualgraphWarning
from dualgraph.models.torch_vit import VisionEncoder
from dualgraph.torch import _lint

SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The line number of the one line of this file that ends with ``# lint: <marker>``."""
    found = [i for i, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"# lint: {marker}")]
    assert len(found) == 1, f"marker {marker!r} found {len(found)} times"
    return found[0]


# -- callables that each hold one thing a graph cannot ------------------------------------------


def item_sync(x: torch.Tensor) -> torch.Tensor:
    return x / x.abs().max().item()  # lint: item


def cpu_copy(x: torch.Tensor) -> torch.Tensor:
    total = x.sum().cpu()  # lint: cpu
    return x * 2 + total.to(x.device)


def to_cpu(x: torch.Tensor) -> torch.Tensor:
    y = x.to("cpu")  # lint: to-cpu
    return x + y.to(x.device)


def tolist_sync(x: torch.Tensor) -> torch.Tensor:
    values = x.detach().tolist()  # lint: tolist
    return x * len(values)


def numpy_sync(x: torch.Tensor) -> torch.Tensor:
    array = x.detach().numpy()  # lint: numpy
    return x * float(array.size)


def int_sync(x: torch.Tensor) -> torch.Tensor:
    n = int(x.sum() > 0)  # lint: int
    return x * n


def nonzero_shape(x: torch.Tensor) -> torch.Tensor:
    where = torch.nonzero(x > 0)  # lint: nonzero
    return x * where.shape[0]


def mask_index(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0].sum() * x  # lint: mask-index


def masked_select_shape(x: torch.Tensor) -> torch.Tensor:
    return x.masked_select(x > 0).sum() * x  # lint: masked-select


def unique_shape(x: torch.Tensor) -> torch.Tensor:
    return x * torch.unique(x.detach()).numel()  # lint: unique


def repeat_interleave_shape(x: torch.Tensor) -> torch.Tensor:
    repeats = torch.ones_like(x, dtype=torch.long)
    return x.repeat_interleave(repeats) * 2  # lint: repeat-interleave


def mask_assign(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[x < 0] = 0  # lint: mask-assign
    return y


def equal_sync(x: torch.Tensor) -> torch.Tensor:
    same = torch.equal(x, x.detach())  # lint: equal
    return x * same


def allclose_sync(x: torch.Tensor) -> torch.Tensor:
    close = x.allclose(x.detach())  # lint: allclose
    return x * close


def print_tensor(x: torch.Tensor) -> torch.Tensor:
    print(x, file=io.StringIO())  # lint: print
    return x * 2


def format_tensor(x: torch.Tensor) -> torch.Tensor:
    text = f"{x.sum():.3f}"  # lint: format
    return x * len(text)


def _spd(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(-1) * x + 4 * torch.eye(x.shape[-1], device=x.device)


def cholesky_sync(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cholesky(_spd(x)).sum(0)  # lint: cholesky


def cholesky_ex_checked(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cholesky_ex(_spd(x), check_errors=True).L.sum(0)  # lint: check-errors


def eigh_sync(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvalsh(_spd(x))  # lint: eigh


def svd_sync(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(_spd(x))  # lint: svd


def normal_with_tensor_std(x: torch.Tensor) -> torch.Tensor:
    return x + torch.normal(torch.zeros_like(x), x.detach().abs())  # lint: normal-std


def branch_on_tensor(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # lint: if
        return x * 2
    return x * 3


def arange_on_host(x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[-1])  # lint: arange
    return x + positions.to(x.device)


def zeros_on_cpu(x: torch.Tensor) -> torch.Tensor:
    pad = torch.zeros(x.shape, device="cpu")  # lint: zeros-cpu
    return x + pad.to(x.device)


def host_data(x: torch.Tensor) -> torch.Tensor:
    weights = torch.tensor([0.5, 2.0, 1.0, 1.0], device=x.device)  # lint: host-data
    return x * weights


def copy_to_device(x: torch.Tensor) -> torch.Tensor:
    ones = torch.ones(4).to(x.device)  # lint: host-to-device
    return x * ones


def own_generator(x: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator(device=x.device).manual_seed(0)
    return x * torch.rand(x.shape, generator=generator, device=x.device)  # lint: generator


def updates_input(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache.add_(1)  # lint: input
    return x * 2


class HalvesInputInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x.detach().mul_(0.5)  # lint: backward-input
        return grad * 2


def updates_input_in_backward(x: torch.Tensor) -> torch.Tensor:
    return HalvesInputInBackward.apply(x)


class UpdatesParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(1.0)  # lint: parameter
        return x * self.scale


class SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2 * grad.abs().max().item()  # lint: backward


def custom_backward(x: torch.Tensor) -> torch.Tensor:
    return SyncInBackward.apply(x)


def python_random(x: torch.Tensor) -> torch.Tensor:
    return x * random.random()  # lint: python-random


def python_random_uniform(x: torch.Tensor) -> torch.Tensor:
    return x * random.uniform(0.5, 2.0)  # lint: python-uniform


def decays_with_the_clock(x: torch.Tensor) -> torch.Tensor:
    # eager reads the clock on each call; every replay reused the time read at capture, silently
    return x * math.exp(-time.monotonic() % 1.0)  # lint: host-clock


def warms_up_by_the_date(x: torch.Tensor) -> torch.Tensor:
    # datetime's clock reads are compiled: no time.time() call for the profile to see
    started = datetime.datetime.now()  # lint: datetime-clock
    return x * min(1.0, started.microsecond / 1e6 + 0.5)


def salted_by_the_os(x: torch.Tensor) -> torch.Tensor:
    # the operating system's random bytes (os.urandom, what uuid4 and secrets draw from)
    return x * (1 + os.urandom(1)[0] % 2)  # lint: os-random


def tagged_with_a_uuid(x: torch.Tensor) -> torch.Tensor:
    return x * (1 + uuid.uuid4().int % 2)  # lint: uuid-random


def reseeds_the_host(x: torch.Tensor) -> torch.Tensor:
    # eager restarts Python's random stream on every call, a replay never: what the program
    # draws after the call (an augmentation, a shuffle) differs from eager's
    random.seed(0)  # lint: python-seed
    return x * 2


def reseeds(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)  # lint: manual-seed
    return F.dropout(x, 0.5)


@dataclass(frozen=True)
class Finding:
    """A callable (or a module class, made fresh for each test) and what the lint must find."""

    fn: Callable[..., Any]
    kind: str
    op: str
    marker: str
    phase: str = "forward"
    extra_inputs: int = 0


FINDINGS = {
    "item": Finding(item_sync, _lint.HOST_SYNC, "Tensor.item", "item"),
    "cpu": Finding(cpu_copy, _lint.HOST_SYNC, "Tensor.cpu", "cpu"),
    "to-cpu": Finding(to_cpu, _lint.HOST_SYNC, "Tensor.to", "to-cpu"),
    "tolist": Finding(tolist_sync, _lint.HOST_SYNC, "Tensor.tolist", "tolist"),
    "numpy": Finding(numpy_sync, _lint.HOST_SYNC, "Tensor.numpy", "numpy"),
    "int": Finding(int_sync, _lint.HOST_SYNC, "int(tensor)", "int"),
    "nonzero": Finding(nonzero_shape, _lint.DATA_DEPENDENT_SHAPE, "aten.nonzero", "nonzero"),
    "mask-index": Finding(
        mask_index, _lint.DATA_DEPENDENT_SHAPE, "aten.index with a boolean mask", "mask-index"
    ),
    "masked-select": Finding(
        masked_select_shape, _lint.DATA_DEPENDENT_SHAPE, "aten.masked_select", "masked-select"
    ),
    "unique": Finding(unique_shape, _lint.DATA_DEPENDENT_SHAPE, "aten._unique2", "unique"),
    "repeat-interleave": Finding(
        repeat_interleave_shape,
        _lint.DATA_DEPENDENT_SHAPE,
        "aten.repeat_interleave",
        "repeat-interleave",
    ),
    "mask-assign": Finding(
        mask_assign,
        _lint.DATA_DEPENDENT_SHAPE,
        "aten.index_put_ with a boolean mask",
        "mask-assign",
    ),
    "equal": Finding(equal_sync, _lint.HOST_SYNC, "torch.equal", "equal"),
    "allclose": Finding(allclose_sync, _lint.HOST_SYNC, "Tensor.allclose", "allclose"),
    "print": Finding(print_tensor, _lint.HOST_SYNC, "print(tensor)", "print"),
    "format": Finding(format_tensor, _lint.HOST_SYNC, "f'{tensor}'", "format"),
    "if": Finding(branch_on_tensor, _lint.TENSOR_CONTROL_FLOW, "bool(tensor)", "if"),
    # kernels that read values on the host themselves, below the dispatch mode
    "cholesky": Finding(cholesky_sync, _lint.HOST_SYNC, "aten._linalg_check_errors", "cholesky"),
    "check-errors": Finding(
        cholesky_ex_checked,
        _lint.HOST_SYNC,
        "aten.linalg_cholesky_ex(check_errors=...)",
        "check-errors",
    ),
    "eigh": Finding(eigh_sync, _lint.HOST_SYNC, "aten._linalg_eigh", "eigh"),
    "svd": Finding(svd_sync, _lint.HOST_SYNC, "aten._linalg_svd", "svd"),
    "normal-std": Finding(
        normal_with_tensor_std, _lint.HOST_SYNC, "aten.normal(std=...)", "normal-std"
    ),
    "arange": Finding(arange_on_host, _lint.HOST_TENSOR, "torch.arange (no device=)", "arange"),
    "zeros-cpu": Finding(
        zeros_on_cpu, _lint.HOST_TENSOR, "torch.zeros (device='cpu')", "zeros-cpu"
    ),
    "host-data": Finding(host_data, _lint.CROSS_DEVICE_COPY, "torch.tensor", "host-data"),
    "host-to-device": Finding(
        copy_to_device, _lint.CROSS_DEVICE_COPY, "Tensor.to", "host-to-device"
    ),
    "generator": Finding(
        own_generator, _lint.UNREGISTERED_GENERATOR, "aten.rand(generator=...)", "generator"
    ),
    "input": Finding(
        updates_input, _lint.INPUT_MUTATION, "aten.add_ on args[1]", "input", extra_inputs=1
    ),
    "backward-input": Finding(
        updates_input_in_backward,
        _lint.BACKWARD_INPUT_MUTATION,
        "aten.mul_ on args[0]",
        "backward-input",
        phase="backward",
    ),
    "parameter": Finding(
        UpdatesParameter, _lint.PARAMETER_MUTATION, "aten.mul_ on scale", "parameter"
    ),
    # Python code of a backward is seen by the dispatch mode only: the op is torch's
    "backward": Finding(
        custom_backward, _lint.HOST_SYNC, "aten._local_scalar_dense", "backward", phase="backward"
    ),
    # Python calls no torch mode sees: random numbers and clocks of the host, reseeding torch
    "python-random": Finding(python_random, _lint.HOST_RANDOM, "Random.random", "python-random"),
    "python-uniform": Finding(
        python_random_uniform, _lint.HOST_RANDOM, "Random.uniform", "python-uniform"
    ),
    "os-random": Finding(salted_by_the_os, _lint.HOST_RANDOM, "os.urandom", "os-random"),
    "uuid-random": Finding(tagged_with_a_uuid, _lint.HOST_RANDOM, "os.urandom", "uuid-random"),
    "python-seed": Finding(reseeds_the_host, _lint.HOST_RANDOM, "random.seed", "python-seed"),
    "manual-seed": Finding(reseeds, _lint.RNG_RESEEDED, "torch.manual_seed", "manual-seed"),
    "host-clock": Finding(decays_with_the_clock, _lint.HOST_CLOCK, "time.monotonic", "host-clock"),
    "datetime-clock": Finding(
        warms_up_by_the_date, _lint.HOST_CLOCK, "datetime.datetime.now", "datetime-clock"
    ),
}


def callable_of(case: Finding, device: str = "cpu") -> Callable[..., Any]:
    """The case's callable; a module class is instantiated on ``device``."""
    if isinstance(case.fn, type) and issubclass(case.fn, nn.Module):
        return case.fn().to(device)
    return case.fn


def inputs_for(case: Finding, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    x = torch.tensor([1.0, -2.0, 3.0, 0.5], device=device, requires_grad=True)
    return (x, *(torch.zeros(4, device=device) for _ in range(case.extra_inputs)))


def the_finding(report: dgt.LintReport, case: Finding) -> dgt.LintFinding:
    matching = [f for f in report.findings if f.kind == case.kind and f.op == case.op]
    assert matching, f"no {case.kind} finding for {case.op}:\n{report}"
    return matching[0]


# -- each finding, with its source line ----------------------------------------------------------


@pytest.mark.parametrize("name", FINDINGS)
def test_lint_reports_the_op_and_the_users_source_line(name: str) -> None:
    case = FINDINGS[name]
    report = dgt.lint(callable_of(case), *inputs_for(case))
    finding = the_finding(report, case)
    assert finding.file == __file__
    assert finding.line == line_of(case.marker)
    assert finding.code == SOURCE[finding.line - 1].strip()
    assert finding.phase == case.phase
    assert finding.severity == _lint.KINDS[case.kind]
    assert report.ok == (finding.severity == "warning")


@pytest.mark.parametrize("name", FINDINGS)
def test_the_lint_during_an_emulated_capture_reports_what_a_real_capture_rejects(
    name: str,
) -> None:
    case = FINDINGS[name]
    fn = callable_of(case)
    if _lint.KINDS[case.kind] == "warning":  # never blocks; the adapter may refuse on its own
        try:
            graphed = dgt.make_graphed_callables(fn, inputs_for(case), backend="emulate")
        except dgt.CaptureLintError as refused:  # then its error carries the findings
            report = refused.report
        else:
            report = dgt.diagnostics(graphed).lint
        assert report is not None and report.ok
        assert the_finding(report, case).line == line_of(case.marker)
        return
    with pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(fn, inputs_for(case), backend="emulate")
    assert isinstance(caught.value, CaptureError)
    message = str(caught.value)
    name = type(fn).__name__ if isinstance(fn, nn.Module) else fn.__qualname__
    assert message.startswith(f"capturing {name} (emulate) failed during warmup: ")
    assert f"test_torch_lint.py:{line_of(case.marker)}" in message
    assert the_finding(caught.value.report, case).line == line_of(case.marker)


def test_a_random_generator_of_the_callables_own_is_seeded_without_a_finding() -> None:
    # Random(3) seeds an instance of its own (no draw from it here): the process's stream is
    # untouched, as in eager
    def makes_a_generator(x: torch.Tensor) -> torch.Tensor:
        random.Random(3)
        return x * 2

    assert dgt.lint(makes_a_generator, torch.ones(2, requires_grad=True)).findings == ()


def test_a_backward_op_of_torch_is_placed_at_the_forward_line_that_made_it() -> None:
    # x[mask]'s backward scatters through the mask: a sync in torch's own backward code.
    report = dgt.lint(mask_index, *inputs_for(FINDINGS["mask-index"]))
    backward = [f for f in report.findings if f.phase == "backward"]
    assert [f.op for f in backward] == ["aten.index_put with a boolean mask"]
    assert backward[0].line == line_of("mask-index")


def test_the_same_op_at_the_same_line_is_one_finding_with_a_count() -> None:
    def syncs_in_a_loop(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = x * x.sum().item()  # lint: loop
        return x

    report = dgt.lint(syncs_in_a_loop, torch.ones(2, requires_grad=True))
    assert [(f.op, f.line, f.count) for f in report.findings] == [
        ("Tensor.item", line_of("loop"), 3)
    ]
    assert "(3x)" in str(report)


def test_an_input_passed_as_a_kwarg_is_named_by_its_path() -> None:
    def updates(x: torch.Tensor, *, state: dict[str, torch.Tensor]) -> torch.Tensor:
        state["count"].add_(1)  # lint: kwarg
        return x * 2

    report = dgt.lint(updates, torch.ones(2), state={"count": torch.zeros(())})
    assert [(f.op, f.line) for f in report.findings] == [
        ("aten.add_ on kwargs['state']['count']", line_of("kwarg"))
    ]


def test_a_write_no_op_declared_is_caught_by_the_version_counter() -> None:
    def hidden_write(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        with torch.utils._python_dispatch._disable_current_modes():  # out of the lint's sight
            cache.add_(1)
        return x * 2

    (finding,) = dgt.lint(hidden_write, torch.ones(2), torch.zeros(2)).findings
    assert (finding.kind, finding.op, finding.line) == (
        _lint.INPUT_MUTATION,
        "an in-place write to args[1]",
        None,
    )
    assert "version counter" in finding.detail


# -- the module path ------------------------------------------------------------------------------


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * (h.max() > 0).item()  # lint: inner


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Identity(), nn.Sequential(nn.Identity(), Inner())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.zeros(3).sum() + x  # lint: outer


def test_findings_name_the_module_path_and_the_callable() -> None:
    model = Outer()
    report = dgt.lint(model, torch.randn(2, 4))
    found = {(f.module, f.line, f.callable) for f in report.findings}
    assert found == {("blocks.1.1", line_of("inner"), "Outer"), ("", line_of("outer"), "Outer")}
    assert "in blocks.1.1" in str(report)


class EmptyBag(nn.ModuleDict):
    """A container module with no children (so ``bool(self)`` is False) and a forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()  # lint: empty-bag


def test_an_empty_container_module_is_named_by_its_path() -> None:
    model = nn.Sequential(nn.Identity(), EmptyBag())
    (finding,) = dgt.lint(model, torch.ones(2)).findings
    assert (finding.module, finding.line) == ("1", line_of("empty-bag"))


def test_a_graphed_submodule_is_linted_under_its_own_name() -> None:
    model = Outer()
    inner = model.blocks[1][1]
    with pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(inner, (torch.randn(2, 4),), backend="emulate")
    (finding,) = caught.value.report.findings
    assert (finding.callable, finding.module, finding.line) == ("Inner", "", line_of("inner"))
    assert "forward" not in inner.__dict__


# -- what is not a finding ------------------------------------------------------------------------


class CleanModule(nn.Module):
    """Everything here stays on the inputs' device and keeps its shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, int]:
        h = self.norm(self.fc(x))
        h = torch.where(h > 0, h, 0.1 * h) + torch.zeros(4, device=x.device)
        h = h.masked_fill(h < -3, 0) + torch.zeros_like(h) + x.new_ones(4)
        h = h * torch.tensor(0.5) + torch.randn(h.shape, device=self.fc.weight.device)
        h = F.dropout(h, 0.1, self.training).to(x.dtype) + self.offset
        repeats = torch.full((4,), 2, device=x.device)
        wide = h.repeat_interleave(repeats, dim=1, output_size=8)
        return wide, None, 3


def test_code_that_stays_on_the_device_has_no_findings() -> None:
    report = dgt.lint(CleanModule(), torch.randn(3, 4, requires_grad=True))
    assert report.findings == ()
    assert str(report) == "capture lint of CleanModule: nothing found"


def without_host_reads(x: torch.Tensor) -> torch.Tensor:
    factor = torch.linalg.cholesky_ex(_spd(x)).L.sum(0)  # check_errors=False: no read
    inverse = torch.linalg.inv_ex(_spd(x)).inverse.sum(0)
    return x * factor + inverse + torch.normal(torch.zeros_like(x), 0.5)  # a float std


def test_the_variants_of_syncing_ops_that_read_nothing_on_the_host_have_no_findings() -> None:
    report = dgt.lint(without_host_reads, torch.randn(4, requires_grad=True))
    assert report.findings == ()


def test_the_reference_encoder_has_no_findings() -> None:
    encoder = VisionEncoder(image_size=16, patch_size=8, dim=32, depth=2, heads=2, dropout=0.1)
    report = dgt.lint(encoder, torch.randn(2, 3, 16, 16))
    assert report.findings == ()


def test_host_only_work_on_a_tensor_made_on_the_host_is_not_reported_twice() -> None:
    def table_on_host(x: torch.Tensor) -> torch.Tensor:
        table = torch.arange(4.0)  # lint: host-table
        scale = table.max().item()  # a host tensor's value: no device sync
        return x * scale

    report = dgt.lint(table_on_host, torch.ones(4))
    assert [(f.kind, f.line) for f in report.findings] == [
        (_lint.HOST_TENSOR, line_of("host-table"))
    ]


def test_buffers_updated_in_place_are_not_findings() -> None:
    norm = nn.BatchNorm1d(4)  # updates running_mean, running_var, num_batches_tracked
    assert dgt.lint(norm, torch.randn(3, 4)).findings == ()


def draws_from_a_default_generator(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return x * torch.rand(x.shape, generator=generator, device=x.device)


@pytest.mark.parametrize(
    "generator",
    [torch.default_generator, torch.random.default_generator, torch._C.default_generator],
    ids=["torch.default_generator", "torch.random.default_generator", "torch._C"],
)
def test_the_default_generator_by_any_name_is_registered(generator: torch.Generator) -> None:
    # On a CPU it stands for the GPU's, which a capture registers itself. Each reaches the
    # dispatch mode as a new Python object: the lint compares the generators behind them.
    report = dgt.lint(lambda x: draws_from_a_default_generator(x, generator), torch.ones(4))
    assert report.findings == ()


def test_a_generator_the_capture_registers_is_not_a_finding_and_another_one_is() -> None:
    registered, unregistered = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    x = torch.ones(4)  # made outside the lint: an input, on the GPU under a real capture
    lint = _lint.CaptureLint("draws", generators=[registered])
    with lint:
        draws_from_a_default_generator(x, registered)
        x.normal_(generator=registered)
    assert lint.report().findings == ()
    with lint:
        x.normal_(generator=unregistered)  # lint: unregistered
    (finding,) = lint.report().findings
    assert (finding.kind, finding.op, finding.line) == (
        _lint.UNREGISTERED_GENERATOR,
        "aten.normal_(generator=...)",
        line_of("unregistered"),
    )


def test_meta_tensors_are_on_no_device_and_not_findings() -> None:
    def shapes_only(x: torch.Tensor) -> torch.Tensor:
        layout = torch.empty_like(x, device="meta")
        blank = torch.zeros(3, 4, device="meta") + x.to("meta").sum()
        return x * (layout.shape[0] + blank.shape[1])

    assert dgt.lint(shapes_only, torch.ones(4, requires_grad=True)).findings == ()


def test_ops_of_dualgraphs_own_code_around_the_callable_are_not_findings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A capture's warmup runs its own bookkeeping (output layouts, grad buffers) while the lint
    # watches; only what the callable runs is the user's. A stand-in for dualgraph's code:
    helper = tmp_path / "warmup.py"
    helper.write_text(
        "import torch\n"
        "def warmup(fn, x):\n"
        "    out = fn(x)\n"
        "    torch.arange(4), torch.zeros(2, device='cpu'), torch.tensor([1.0, 2.0])\n"
        "    torch.empty_like(out, device='meta')\n"
        "    return out\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(helper.read_text(), str(helper), "exec"), namespace)
    monkeypatch.setattr(_lint, "_ADAPTER_DIR", str(tmp_path) + os.sep)
    lint = _lint.CaptureLint("arange_on_host", fn=arange_on_host)
    with lint:
        namespace["warmup"](arange_on_host, torch.ones(4))
    findings = lint.report().findings
    assert [(f.op, f.line) for f in findings] == [("torch.arange (no device=)", line_of("arange"))]


def test_a_capture_keeping_its_results_outside_the_pool_lints_clean() -> None:
    # Shape buckets capture with results_outside_pool: the warmup notes each output's layout
    # (a meta tensor made by dualgraph, not by the callable), which the lint once reported.
    from dualgraph.torch._capture import CaptureOptions, CaptureRequest, capture
    from dualgraph.torch._inputs import InputGuard

    block = CleanModule()
    sample = (torch.randn(3, 4, requires_grad=True),)
    guard = InputGuard(sample, None)
    request = CaptureRequest(
        "CleanModule", block.forward, block, guard, tuple(guard.tensors(sample, {}))
    )
    options = CaptureOptions(
        backend="emulate",
        num_warmup_iters=1,
        allow_unused_input=False,
        pool=None,
        capture_error_mode="global",
        clone_outputs=False,
        param_grads="autograd",
        results_outside_pool=True,
        lint="error",
    )
    (plan,) = capture([request], options)
    assert plan.diagnostics.lint is not None and plan.diagnostics.lint.findings == ()


# -- the lint leaves everything as it was -------------------------------------------------------


def numpy_random(x: torch.Tensor) -> torch.Tensor:
    return x * float(np.random.rand())


def test_a_draw_from_numpys_global_generator_is_found_by_its_state_without_a_line() -> None:
    # numpy's random functions are compiled: no profile event, so no line; its state moves
    report = dgt.lint(numpy_random, torch.ones(4, requires_grad=True))
    (finding,) = report.findings
    assert (finding.kind, finding.op) == (_lint.HOST_RANDOM, "numpy.random's global generator")
    assert finding.line is None and not report.ok


def test_one_call_of_the_random_module_is_one_finding() -> None:
    # random.uniform calls Random.random inside random.py: that call is not the user's
    report = dgt.lint(python_random_uniform, torch.ones(4, requires_grad=True))
    assert [(f.op, f.count) for f in report.findings] == [("Random.uniform", 1)]


def test_a_profiler_already_running_is_left_alone() -> None:
    seen: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        seen.append(event)

    sys.setprofile(profiler)
    try:
        report = dgt.lint(python_random, torch.ones(4, requires_grad=True))
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert seen and report.ok  # not looked for while another profiler runs (documented)


def test_random_drawn_by_code_around_the_callable_is_not_a_finding() -> None:
    report = dgt.lint(nn.Linear(4, 4), torch.ones(2, 4))
    assert report.findings == () and random.random() >= 0


def test_torch_manual_seed_wrapped_by_torch_dynamo_is_found_at_the_users_line() -> None:
    importlib.import_module("torch._dynamo")  # it wraps torch.manual_seed in a function of its own
    finding = the_finding(dgt.lint(reseeds, torch.ones(4)), FINDINGS["manual-seed"])
    assert finding.line == line_of("manual-seed")


def test_torch_compile_keeping_the_rng_states_around_a_compilation_is_not_a_finding() -> None:
    # dynamo reads and restores random's and torch's RNG states while it compiles
    torch._dynamo.reset()
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.GELU()), backend="aot_eager")
    report = dgt.lint(compiled, torch.randn(3, 4, requires_grad=True))
    assert report.findings == (), str(report)


@pytest.mark.cuda
def test_on_cuda_torch_cuda_synchronize_is_a_host_sync() -> None:
    def synchronizes(x: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()  # lint: synchronize
        return x * 2

    report = dgt.lint(synchronizes, torch.ones(4, device="cuda", requires_grad=True))
    (finding,) = report.findings
    assert (finding.kind, finding.op) == (_lint.HOST_SYNC, "torch.cuda.synchronize")
    assert finding.line == line_of("synchronize")


def test_lint_leaves_the_python_and_numpy_random_streams_as_they_were() -> None:
    def draws(x: torch.Tensor) -> torch.Tensor:
        return x * random.random() * float(np.random.rand())

    python_state, numpy_state = random.getstate(), np.random.get_state()
    dgt.lint(draws, torch.ones(4))
    assert random.getstate() == python_state
    after = np.random.get_state()
    assert after[2] == numpy_state[2] and np.array_equal(after[1], numpy_state[1])


def test_lint_leaves_inputs_buffers_grads_and_the_rng_as_they_were() -> None:
    class Stateful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.norm = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            cache.add_(1)
            return F.dropout(self.norm(self.fc(x)), 0.5)

    model = Stateful()
    x, cache = torch.randn(3, 4, requires_grad=True), torch.zeros(4)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    report = dgt.lint(model, x, cache)
    assert [f.kind for f in report.findings] == [_lint.INPUT_MUTATION]
    assert torch.equal(cache, torch.zeros(4)) and x.grad is None
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("wrap", ["closure", "partial", "graphed"])
def test_lint_leaves_the_buffers_of_modules_a_function_names_as_they_were(wrap: str) -> None:
    # A function (not a module) closing over a BatchNorm: the lint's call updated its running
    # statistics and counter, which only the lint's own root module's buffers were kept from.
    norm = nn.BatchNorm1d(4, affine=False)  # no parameters: a graphed function may close over it
    x = torch.randn(3, 4, requires_grad=True)
    fn: Callable[..., Any] = {
        "closure": lambda: lambda x: norm(x) * 2,
        "partial": lambda: functools.partial(norm),
        "graphed": lambda: dgt.make_graphed_callables(lambda x: norm(x) * 2, (x,)),
    }[wrap]()
    buffers = {name: b.clone() for name, b in norm.named_buffers()}
    dgt.lint(fn, x)
    assert all(torch.equal(b, buffers[name]) for name, b in norm.named_buffers())


class HalvesItsWeight(nn.Module):
    """Updates a parameter and a plain tensor attribute in place (the lint warns of the first;
    a capture refuses both)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
            self.seen.add_(x.sum(0))
        return self.fc(x)


@pytest.mark.parametrize("tool", ["lint", "memory_plan"])
def test_the_tools_put_back_a_parameter_the_callable_updates_in_place(tool: str) -> None:
    # Only buffers were put back: the lint reported the halving and left the weight halved.
    module = HalvesItsWeight()
    weight = module.fc.weight.detach().clone()
    getattr(dgt, tool)(module, torch.randn(3, 4, requires_grad=True))
    assert torch.equal(module.fc.weight, weight)


@pytest.mark.parametrize("tool", ["lint", "memory_plan"])
def test_the_tools_put_back_a_plain_tensor_attribute_the_callable_updates_in_place(
    tool: str,
) -> None:
    module = HalvesItsWeight()
    getattr(dgt, tool)(module, torch.ones(3, 4, requires_grad=True))
    assert torch.equal(module.seen, torch.zeros(4))


def test_a_plain_tensor_attribute_updated_in_place_is_an_error_the_capture_refuses() -> None:
    # The lint said "nothing found" where make_graphed_callables refuses the callable
    # ('Accumulates.total: the callable updates this tensor in place ...').
    class Accumulates(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.total = torch.zeros(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total.add_(x.detach().sum(0))
            return self.fc(x)

    report = dgt.lint(Accumulates(), torch.randn(3, 4, requires_grad=True))
    assert [(f.kind, f.severity, f.op) for f in report.findings] == [
        (_lint.ATTRIBUTE_MUTATION, "error", "aten.add_ on total")
    ]
    with pytest.raises(CaptureError, match=r"Accumulates\.total: the callable updates"):
        dgt.make_graphed_callables(
            Accumulates(), (torch.randn(3, 4, requires_grad=True),), lint="off"
        )


class BranchesOnGradMode(nn.Module):
    """Scales by 2 with grad on, else by 3; its attention reads grad mode in torch's code."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if torch.is_grad_enabled() else 3.0
        return self.attention(x, x, x)[0] * scale


def test_reading_grad_mode_in_the_callable_is_a_warning_naming_the_line() -> None:
    # a CUDA graph keeps the branch taken with grad on; a replay under no_grad replays it
    report = dgt.lint(BranchesOnGradMode(), torch.randn(2, 3, 4, requires_grad=True))
    (finding,) = report.findings  # none for torch's own reads (MultiheadAttention's)
    assert finding.kind == _lint.GRAD_MODE_READ and finding.severity == "warning"
    assert finding.op == "torch.is_grad_enabled"
    assert finding.code == "scale = 2.0 if torch.is_grad_enabled() else 3.0"


def test_a_graphed_callables_read_of_grad_mode_is_still_named_by_the_capture_lint() -> None:
    # warmup watches torch.is_grad_enabled too (through a replacement): the lint looks past it
    module = BranchesOnGradMode()
    dgt.make_graphed_callables(module, (torch.randn(2, 3, 4),), backend="emulate")
    report = dgt.diagnostics(module).lint
    assert report is not None
    (finding,) = report.findings
    assert finding.code == "scale = 2.0 if torch.is_grad_enabled() else 3.0"


class BranchesOnWhatAutogradRecorded(nn.Module):
    """Scales by 2 where autograd recorded its hidden tensor (grad on), else by 3."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.attention = nn.MultiheadAttention(4, 1, batch_first=True)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(x, x, x)[0]
        recorded = {
            "requires_grad": lambda: hidden.requires_grad,
            "grad_fn": lambda: hidden.grad_fn is not None,
            "is_leaf": lambda: not hidden.is_leaf,
        }[self.read]
        return self.fc(hidden) * (2.0 if recorded() else 3.0)


@pytest.mark.parametrize("read", ["requires_grad", "grad_fn", "is_leaf"])
def test_reading_whether_autograd_recorded_a_computed_tensor_is_a_grad_mode_read(
    read: str,
) -> None:
    # under no_grad eager reads False and scales by 3; a CUDA graph replays the scale by 2
    report = dgt.lint(BranchesOnWhatAutogradRecorded(read), torch.randn(2, 3, 4))
    (finding,) = report.findings  # none for torch's own reads (MultiheadAttention's)
    assert finding.kind == _lint.GRAD_MODE_READ and finding.severity == "warning"
    assert finding.op == f"Tensor.{read}"
    assert finding.code.endswith(f"hidden.{read}" + (" is not None," if read == "grad_fn" else ","))


def test_reading_whether_an_input_or_a_parameter_requires_grad_is_no_finding() -> None:
    # the same under no_grad as with grad on: nothing a graph would replay otherwise
    def scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w * (2.0 if x.requires_grad and w.is_leaf and w.grad_fn is None else 3.0)

    report = dgt.lint(scaled, torch.randn(3, requires_grad=True), torch.randn(3))
    assert report.findings == ()


class LayerDrop(nn.Module):
    """Skips its layer on a random half of the training calls, the coin drawn on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand([]) < 0.5:
            return x
        return x + self.fc(x)


def test_a_random_number_drawn_into_a_host_tensor_is_a_host_draw() -> None:
    # a CUDA graph keeps the coin of capture: the layer always or never skipped, where eager
    # skips it on half of the calls; no sync, so a real capture succeeds silently
    report = dgt.lint(LayerDrop(), torch.randn(2, 4, requires_grad=True))
    (finding,) = report.findings
    assert finding.kind == _lint.HOST_RANDOM and finding.severity == "error"
    assert finding.op == "torch.rand"
    assert finding.code == "if self.training and torch.rand([]) < 0.5:"


def test_random_numbers_drawn_on_the_device_are_no_host_draw() -> None:
    def noisy(x: torch.Tensor) -> torch.Tensor:
        coin = torch.rand((), device=x.device)
        noise = torch.randn_like(x) + torch.bernoulli(torch.sigmoid(x))
        return torch.where(coin < 0.5, x, F.dropout(x, 0.5) + noise)

    assert dgt.lint(noisy, torch.randn(2, 4, requires_grad=True)).findings == ()


def test_histc_that_takes_its_range_from_the_input_is_a_host_sync() -> None:
    # min == max (by default 0, 0): the CUDA kernel reads x.min() and x.max() on the host
    report = dgt.lint(lambda x: x * torch.histc(x, bins=4).sum(), torch.randn(8))
    (finding,) = report.findings
    assert finding.kind == _lint.HOST_SYNC and finding.op == "aten.histc(min=max)"
    assert "x * torch.histc(x, bins=4)" in finding.code


def test_ctc_loss_is_a_host_sync_forward_and_backward() -> None:
    # its CUDA kernels copy the lengths to the host and offsets back: a capture fails there
    def ctc(logits: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return F.ctc_loss(logits.log_softmax(-1), targets, lengths, lengths // 2)

    logits = torch.randn(6, 2, 5, requires_grad=True)
    report = dgt.lint(ctc, logits, torch.randint(1, 5, (2, 3)), torch.full((2,), 6))
    found = [(f.kind, f.op, f.phase) for f in report.findings]
    assert found == [
        (_lint.HOST_SYNC, "aten._ctc_loss", "forward"),
        (_lint.HOST_SYNC, "aten._ctc_loss_backward", "backward"),
    ]


def test_histc_over_a_range_given_is_no_finding() -> None:
    report = dgt.lint(lambda x: x * torch.histc(x, bins=4, min=-3, max=3).sum(), torch.randn(8))
    assert report.findings == ()


def test_a_draw_into_meta_tensors_is_no_host_draw() -> None:
    # a meta tensor holds no data, on no device: nothing a graph would keep
    def shaped(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand(2, 3, device="meta").shape[1]

    assert dgt.lint(shaped, torch.randn(2, requires_grad=True)).findings == ()


@pytest.mark.parametrize("tool", ["lint", "memory_plan"])
def test_lint_and_memory_plan_under_inference_mode_run_what_a_capture_runs(tool: str) -> None:
    # make_graphed_callables captures outside inference mode; the lint failed with torch's
    # "Inference tensors do not track version counter", the memory plan saw no backward
    layer = nn.Linear(4, 4)
    expected = getattr(dgt, tool)(layer, torch.randn(2, 4, requires_grad=True))
    with torch.inference_mode():
        found = getattr(dgt, tool)(layer, torch.randn(2, 4, requires_grad=True))
    assert str(found) == str(expected)


def test_an_error_in_the_callable_propagates_from_lint() -> None:
    def fails(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        dgt.lint(fails, torch.ones(2))


@pytest.mark.parametrize("tool", ["lint", "memory_plan"])
def test_a_call_failing_half_way_leaves_autocast_and_numerics_settings_as_they_were(
    tool: str,
) -> None:
    def fails(x: torch.Tensor) -> torch.Tensor:
        torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False).__enter__()
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError, match="boom"):
            getattr(dgt, tool)(fails, torch.ones(2))
        assert not torch.is_autocast_enabled("cpu")
        assert torch.get_default_dtype() == torch.float32
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)


def test_an_error_in_the_callable_carries_the_findings_seen_before_it() -> None:
    def unique_then_fails(x: torch.Tensor) -> torch.Tensor:
        y = x * torch.unique(x.detach()).numel()
        raise ValueError(f"boom {y.shape}")  # as a backward not implemented would, after it

    with pytest.raises(ValueError, match="boom") as caught:
        dgt.lint(unique_then_fails, torch.ones(2))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "capture lint of " in notes and "unique_then_fails: 1 error" in notes
    assert f"{_lint.DATA_DEPENDENT_SHAPE}: aten._unique2" in notes


def test_an_error_in_the_callable_gets_no_note_without_findings() -> None:
    def fails(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as caught:
        dgt.lint(fails, torch.ones(2))
    assert not getattr(caught.value, "__notes__", [])


# -- the report -----------------------------------------------------------------------------------


def test_the_report_lists_errors_first_with_the_source_line_and_what_to_do() -> None:
    report = dgt.lint(updates_input, torch.ones(4), torch.zeros(4)).merged(
        dgt.lint(item_sync, torch.ones(4))
    )
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "capture lint of updates_input, item_sync: 1 error, 1 warning"
    assert (
        lines[1]
        == f"  [item_sync] error: host sync: Tensor.item at test_torch_lint.py:{line_of('item')}"
    )
    assert lines[2].strip() == SOURCE[line_of("item") - 1].strip()
    assert lines[3].startswith("    A capture cannot wait for a value to reach the host")
    assert "Keep the value on the device" in " ".join(line.strip() for line in lines)
    where = f"test_torch_lint.py:{line_of('input')}"
    assert f"warning: input updated in place: aten.add_ on args[1] at {where}" in text


# -- the lint inside make_graphed_callables ------------------------------------------------------


def test_lint_warn_captures_anyway_and_keeps_the_findings() -> None:
    with pytest.warns(
        DualgraphWarning, match=r"capturing despite the capture lint's errors"
    ) as record:
        graphed = dgt.make_graphed_callables(
            item_sync, (torch.ones(4, requires_grad=True),), backend="emulate", lint="warn"
        )
    assert record[0].filename == __file__  # points at the capture call
    report = dgt.diagnostics(graphed).lint
    assert report is not None and [f.line for f in report.errors] == [line_of("item")]
    out = graphed(torch.full((4,), 2.0))  # emulate re-runs the callable: .item() works here
    assert torch.equal(out, torch.ones(4))


def test_lint_off_skips_the_lint_but_not_the_memory_plan() -> None:
    graphed = dgt.make_graphed_callables(
        item_sync, (torch.ones(4, requires_grad=True),), backend="emulate", lint="off"
    )
    assert dgt.diagnostics(graphed).lint is None
    assert dgt.diagnostics(graphed).memory_plan is not None


def test_an_unknown_lint_mode_is_refused() -> None:
    modes = r"\('auto', 'error', 'warn', 'off'\)"
    with pytest.raises(DualgraphError, match=rf"lint must be one of {modes}"):
        dgt.make_graphed_callables(item_sync, (torch.ones(4),), backend="emulate", lint="on")  # type: ignore[arg-type]


def test_a_clean_capture_keeps_an_empty_report() -> None:
    graphed = dgt.make_graphed_callables(
        nn.Linear(4, 4), (torch.randn(2, 4, requires_grad=True),), backend="emulate"
    )
    report = dgt.diagnostics(graphed).lint
    assert report is not None and report.findings == () and report.callables == ("Linear",)


def test_the_lint_names_the_callable_at_fault_among_several() -> None:
    first, second = nn.Linear(4, 4), Inner()
    with pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(
            (first, second), ((torch.randn(2, 4),), (torch.randn(2, 4),)), backend="emulate"
        )
    assert str(caught.value).startswith("capturing Inner (emulate) failed during warmup")
    assert [f.callable for f in caught.value.report.findings] == ["Inner"]
    assert "forward" not in first.__dict__ and "forward" not in second.__dict__


def test_a_capture_that_fails_for_another_reason_carries_the_findings() -> None:
    def mutates_then_returns_numpy(x: torch.Tensor, cache: torch.Tensor) -> Any:
        cache.add_(1)  # lint: then-numpy
        return x * 2, torch.zeros(2).numpy()

    with pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(
            mutates_then_returns_numpy, (torch.ones(2), torch.zeros(2)), backend="emulate"
        )
    message = str(caught.value)
    assert "output[1]: expected a torch tensor, got numpy.ndarray" in message
    assert "The capture lint had found:" in message
    assert [f.line for f in caught.value.report.warnings] == [line_of("then-numpy")]


def test_the_lint_runs_once_not_on_every_warmup_iteration() -> None:
    calls = []

    def counts(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.overrides._get_current_function_mode_stack())
        return x * 2

    dgt.make_graphed_callables(counts, (torch.ones(2),), backend="emulate", num_warmup_iters=3)
    assert [len(modes) > 0 for modes in calls] == [True, False, False, False]


# -- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in FINDINGS if n != "numpy"])  # raises on CUDA anyway
def test_lint_on_cuda_inputs_reports_the_same_line(name: str) -> None:
    case = FINDINGS[name]
    report = dgt.lint(callable_of(case, "cuda"), *inputs_for(case, "cuda"))
    finding = the_finding(report, case)
    assert (finding.line, finding.phase) == (line_of(case.marker), case.phase)


@pytest.mark.cuda
def test_on_cuda_code_on_the_inputs_device_has_no_findings() -> None:
    report = dgt.lint(CleanModule().cuda(), torch.randn(3, 4, device="cuda", requires_grad=True))
    assert report.findings == ()


@pytest.mark.cuda
@pytest.mark.parametrize("device", range(torch.cuda.device_count()) or [0])
def test_on_cuda_the_default_generator_and_device_factories_are_fine(device: int) -> None:
    def draws(x: torch.Tensor) -> torch.Tensor:
        generator = torch.cuda.default_generators[x.device.index]
        noise = torch.rand(x.shape, generator=generator, device=x.device)
        noise = noise + torch.randn(x.shape, device=x.device)  # the default, by no name
        return x * noise + torch.arange(x.shape[-1], device=x.device) + torch.tensor(2.0)

    x = torch.randn(3, 4, device=f"cuda:{device}", requires_grad=True)
    assert dgt.lint(draws, x).findings == ()


@pytest.mark.cuda
def test_on_cuda_a_generator_of_ones_own_is_reported() -> None:
    report = dgt.lint(own_generator, torch.randn(4, device="cuda", requires_grad=True))
    (finding,) = report.findings
    assert (finding.kind, finding.line) == (_lint.UNREGISTERED_GENERATOR, line_of("generator"))


@pytest.mark.cuda
def test_on_cuda_shape_buckets_lint_clean() -> None:
    # Buckets keep their results outside the pool: the warmup notes the layouts of the outputs
    # (meta tensors dualgraph makes around the callable), which the lint once reported.
    block = CleanModule().cuda()
    samples = [(torch.randn(n, 4, device="cuda", requires_grad=True),) for n in (3, 5)]
    graphed = dgt.make_graphed_callables(block, buckets=samples, lint="error")
    report = dgt.diagnostics(graphed).lint
    assert report is not None and report.findings == ()


@pytest.mark.cuda
def test_on_cuda_the_lint_refuses_before_anything_is_captured() -> None:
    module = Inner().cuda()
    with pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(
            module, (torch.randn(2, 4, device="cuda"),), backend="cuda", lint="error"
        )
    assert str(caught.value).startswith("capturing Inner (cuda) failed during warmup")
    assert "forward" not in module.__dict__
    assert torch.randn(1000, device="cuda").std().item() > 0.5  # the CUDA RNG is untouched
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_on_cuda_a_failed_real_capture_carries_the_lint_findings() -> None:
    module = Inner().cuda()
    with pytest.warns(DualgraphWarning), pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(
            module, (torch.randn(2, 4, device="cuda"),), backend="cuda", lint="warn"
        )
    message = str(caught.value)
    assert message.startswith("capturing Inner (cuda) failed during forward capture")
    assert f"test_torch_lint.py:{line_of('inner')}" in message
    assert "forward" not in module.__dict__
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_on_cuda_a_clean_capture_has_an_empty_lint_report() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed = dgt.make_graphed_callables(
            CleanModule().cuda(),
            (torch.randn(3, 4, device="cuda", requires_grad=True),),
            lint="error",
        )
    report = dgt.diagnostics(graphed).lint
    assert report is not None and report.findings == ()


# -- a graphed callable is linted through the callable behind it --------------------------------


def test_lint_of_a_graphed_module_lints_its_original_forward_and_leaves_it_graphed() -> None:
    module = Inner()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(DualgraphWarning):
        dgt.make_graphed_callables(module, (x,), backend="emulate", lint="warn")
    graphed_forward = module.__dict__["forward"]
    report = dgt.lint(module, x)
    assert [(f.line, f.module) for f in report.errors] == [(line_of("inner"), "")]
    assert report.callables == ("Inner",)
    assert module.__dict__["forward"] is graphed_forward
    assert dgt.diagnostics(module).replays == 0  # the lint did not replay


def test_lint_and_memory_plan_of_a_graphed_function_see_the_function() -> None:
    x = torch.ones(4, requires_grad=True)
    with pytest.warns(DualgraphWarning):
        graphed = dgt.make_graphed_callables(item_sync, (x,), backend="emulate", lint="warn")
    assert [f.line for f in dgt.lint(graphed, x).errors] == [line_of("item")]
    assert dgt.memory_plan(graphed, x) == dgt.memory_plan(item_sync, x)
    assert dgt.diagnostics(graphed).replays == 0


# -- shape buckets: each bucket's capture is linted -----------------------------------------------


def test_each_bucket_is_linted_and_the_bucketed_diagnostics_merge_the_reports() -> None:
    graphed = dgt.make_graphed_callables(
        updates_input,
        buckets=[(torch.ones(n, requires_grad=True), torch.zeros(n)) for n in (4, 2)],
        backend="emulate",
    )
    info = dgt.diagnostics(graphed)
    reports = [bucket.lint for bucket in info.buckets]
    assert all(
        r is not None and [f.line for f in r.warnings] == [line_of("input")] for r in reports
    )
    assert info.lint is not None
    assert info.lint.callables == tuple(r.callables[0] for r in reports if r is not None)
    assert len(info.lint.warnings) == 2 and info.lint.ok


def test_a_bucket_the_lint_refuses_is_named() -> None:
    with pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(
            item_sync, buckets=[(torch.ones(n, requires_grad=True),) for n in (4, 2)]
        )
    assert str(caught.value).startswith("capturing item_sync[args[0]=[4]] (emulate) failed during")
    assert [f.line for f in caught.value.report.errors] == [line_of("item")]


# -- the README's debugging section runs as written and prints what it shows -------------------


def test_the_readme_debugging_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Debugging: lint, verify, memory plan", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    (tmp_path / "debugging.py").write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(dgt.__file__).parents[2]), os.environ.get("PYTHONPATH")])
        ),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "error",
    }
    run = subprocess.run(
        [sys.executable, "debugging.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == shown


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.from_numpy(np.ones(4, np.float32)),
        lambda x: torch.Tensor([1.0, 2.0, 3.0, 4.0]),
    ],
    ids=["from_numpy", "legacy_constructor"],
)
def test_a_tensor_from_host_data_the_function_mode_does_not_see_is_on_the_host(
    make: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """``torch.from_numpy`` and ``torch.Tensor([...])`` pass no function mode: their copy to the
    device (which a capture cannot repeat) was reported clean."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * make(x).to(x.device)

    report = dgt.lint(scaled, torch.randn(4, 4, requires_grad=True))
    kinds = sorted(f.kind for f in report.errors)
    assert kinds == ["CPU tensor made in the callable", "cross-device copy"], str(report)


def test_a_capture_in_anomaly_mode_names_anomaly_modes_nan_check_and_what_avoids_it() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    sample = torch.randn(2, 4, requires_grad=True)
    with torch.autograd.set_detect_anomaly(True), pytest.raises(dgt.CaptureLintError) as caught:
        dgt.make_graphed_callables(module, (sample,), backend="emulate")
    findings = caught.value.report.errors
    assert findings and all("anomaly mode's NaN check" in f.op for f in findings)
    assert all(f.phase == "backward" for f in findings)
    assert "check_nan=False" in str(caught.value)
    # what the message advises captures, and the module was left usable for it
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        graphed = dgt.make_graphed_callables(module, (sample,), backend="emulate")
    assert dgt.diagnostics(graphed).lint.findings == ()


def test_a_host_read_in_a_backward_outside_anomaly_mode_keeps_its_own_words() -> None:
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * float(grad.sum())  # a host read of the user's, not anomaly mode's

    report = dgt.lint(ReadsInBackward.apply, torch.randn(3, requires_grad=True))
    syncs = [f for f in report.errors if f.kind == "host sync"]
    assert syncs and all("anomaly" not in f.op + f.detail for f in syncs), report


@pytest.mark.parametrize("nested", [False, True], ids=["callback", "its-helper"])
def test_a_clock_read_by_a_garbage_collector_callback_is_no_clock_read_of_the_callable(
    nested: bool,
) -> None:
    # hypothesis times the collector from a gc callback (time.perf_counter): a collection that
    # started inside the forward ran it there, and the lint refused the capture, by chance
    def stamp() -> float:
        return time.perf_counter()

    def timed(phase: str, info: dict[str, int]) -> None:
        stamp() if nested else time.perf_counter()

    def collects(x: torch.Tensor) -> torch.Tensor:
        gc.collect()
        return x * 2

    gc.callbacks.append(timed)
    try:
        assert dgt.lint(collects, torch.ones(2, requires_grad=True)).findings == ()
    finally:
        gc.callbacks.remove(timed)
    report = dgt.lint(lambda x: x * time.perf_counter(), torch.ones(2, requires_grad=True))
    assert [f.kind for f in report.findings] == [_lint.HOST_CLOCK]  # the callable's own still is


def _times_the_collector(phase: str, info: dict[str, int]) -> None:
    time.perf_counter()  # as hypothesis times each collection, from a gc callback


def test_a_clock_read_by_a_gc_callback_during_a_call_is_no_clock_read_of_the_callable() -> None:
    # A collection that ran inside a warmup forward ran the gc callbacks on top of the
    # callable's frames: a library's clock read there (hypothesis's, in any process that ran a
    # hypothesis test) was blamed on the callable, and graphing failed or not by when the
    # collector ran.
    def collects(x: torch.Tensor) -> torch.Tensor:
        gc.collect()  # a collection, when it happens to run
        return x * 2

    gc.callbacks.append(_times_the_collector)
    try:
        assert dgt.lint(collects, torch.ones(2, requires_grad=True)).findings == ()
        graphed = dgt.make_graphed_callables(collects, (torch.ones(2),), backend="emulate")
    finally:
        gc.callbacks.remove(_times_the_collector)
    assert torch.equal(graphed(torch.ones(2)), torch.full((2,), 2.0))


def test_a_log_call_in_the_callable_is_no_clock_read() -> None:
    # logging stamps each record with time.time(): lost on a replay, as a print is (README)
    logger = logging.getLogger("dualgraph.tests.lint")

    def logs(x: torch.Tensor) -> torch.Tensor:
        logger.warning("forward of %d rows", x.shape[0])
        return x * 2

    assert dgt.lint(logs, torch.ones(2, requires_grad=True)).findings == ()


def _times_collections(phase: str, info: dict[str, int]) -> None:
    """A garbage collector callback timing each collection (as hypothesis and profilers do)."""
    time.perf_counter()


@pytest.mark.parametrize("draws", [False, True], ids=["clock", "random"])
def test_a_gc_callback_run_during_the_callable_is_no_read_of_the_callables(draws: bool) -> None:
    # A collection may start inside any forward; the interpreter then runs gc.callbacks there.
    # Their clock reads were reported as the callable's (capture refused), at random.
    def callback(phase: str, info: dict[str, int]) -> None:
        _times_collections(phase, info)
        if draws:
            random.random()

    def collects(x: torch.Tensor) -> torch.Tensor:
        gc.collect()  # stands for a collection the forward's allocations set off
        return x * 2

    gc.callbacks.append(callback)
    try:
        assert dgt.lint(collects, torch.ones(2, requires_grad=True)).findings == ()
        dgt.make_graphed_callables(
            collects, (torch.ones(2, requires_grad=True),), backend="emulate"
        )
    finally:
        gc.callbacks.remove(callback)
