"""The memory plan: static buffer bytes as a capture counts them, activations saved for backward,
peaks, the expected pool (the caching allocator's rounding), the plan a capture keeps, and on the
GPU the plan beside the measured pool.

``CALLABLES`` is the table the static-bytes tests walk: callables with ``None``, constant and
non-differentiable outputs, kwargs, frozen and unused parameters.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import dualgraph.torch as dgt
from dualgraph.torch import _memory_plan

MIB = 1 << 20


class TwoOutputs(nn.Module):
    """Returns ``(hidden, None, {"ids": int64, "n": 3})`` and has a frozen and an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> Any:
        hidden = self.frozen(F.gelu(self.fc(x))) * scale
        return hidden, None, {"ids": hidden.argmax(-1), "n": 3}


def exp_of_double(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).exp()


CALLABLES: dict[str, tuple[Callable[[], Any], Callable[[], tuple[Any, dict[str, Any]]]]] = {
    "linear": (lambda: nn.Linear(8, 4), lambda: ((torch.randn(3, 8, requires_grad=True),), {})),
    "mlp-frozen-input": (
        lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)),
        lambda: ((torch.randn(5, 8),), {}),
    ),
    "tree-outputs-kwargs": (
        TwoOutputs,
        lambda: ((torch.randn(2, 16, requires_grad=True),), {"scale": torch.rand(32)}),
    ),
    "function": (lambda: exp_of_double, lambda: ((torch.randn(64, requires_grad=True),), {})),
    "mlp-saving-activations": (
        lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
        lambda: ((torch.randn(32, 64, requires_grad=True),), {}),
    ),
}


@pytest.mark.parametrize("name", CALLABLES)
def test_static_bytes_are_what_a_capture_counts(name: str) -> None:
    make, sample = CALLABLES[name]
    fn = make()
    args, kwargs = sample()
    plan = dgt.memory_plan(fn, *args, **kwargs)
    graphed = dgt.make_graphed_callables(
        fn, args, sample_kwargs=kwargs, backend="emulate", allow_unused_input=True
    )
    info = dgt.diagnostics(graphed)
    (memory,) = plan.callables
    assert (memory.static_input_bytes, memory.static_output_bytes, memory.static_grad_bytes) == (
        info.static_input_bytes,
        info.static_output_bytes,
        info.static_grad_bytes,
    )


@pytest.mark.parametrize("name", CALLABLES)
def test_the_plan_a_capture_keeps_is_the_plan_made_before_it(name: str) -> None:
    make, sample = CALLABLES[name]
    fn = make()
    args, kwargs = sample()
    before = dgt.memory_plan(fn, *args, **kwargs)
    graphed = dgt.make_graphed_callables(
        fn, args, sample_kwargs=kwargs, backend="emulate", allow_unused_input=True
    )
    kept = dgt.diagnostics(graphed).memory_plan
    assert kept is not None and len(kept.callables) == 1
    # Every number, the backward peak included: the capture's first warmup call holds no saved
    # activation longer than autograd does (its pack hook notes storages, not tensors).
    assert kept.callables == before.callables
    assert kept.expected_pool_bytes == before.expected_pool_bytes
    assert kept.pool_bytes is None  # emulate has no pool to measure


def test_saved_activations_are_what_autograd_keeps_beyond_inputs_and_parameters() -> None:
    x = torch.randn(256, requires_grad=True)  # 1 KiB
    assert dgt.memory_plan(exp_of_double, x).callables[0].saved_activation_bytes == 1024  # exp()
    assert dgt.memory_plan(lambda t: t * 3.0, x).callables[0].saved_activation_bytes == 0
    # a Linear saves its input and weight: an input and a parameter, not activations
    linear = dgt.memory_plan(nn.Linear(256, 8), x[None]).callables[0]
    assert linear.saved_activation_bytes == 0
    # ReLU saves its output, which the next Linear saves too: counted once
    mlp = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
    assert dgt.memory_plan(mlp, torch.randn(4, 8)).callables[0].saved_activation_bytes == 4 * 64 * 4


def test_a_plan_of_a_forward_that_drops_an_activation_leaves_no_graph_behind() -> None:
    # The probe's pack hook hands autograd the saved tensor detached: packed as itself, a saved
    # output the forward drops held its own node for good, and the parameters' AccumulateGrad
    # nodes with it (graphing the module afterwards was refused).
    class DropsASigmoid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            torch.sigmoid(h)  # dropped
            return h * 2

    module = DropsASigmoid()
    x = torch.randn(2, 4, requires_grad=True)
    dgt.memory_plan(module, x)
    dgt.make_graphed_callables(module, (x,), backend="emulate")


def test_saved_tensors_another_pack_hook_collects_are_handed_over() -> None:
    # Only the innermost saved_tensors_hooks run: an adapter that packs them itself passes them on.
    probe = _memory_plan.MemoryProbe("exp_of_double", exp_of_double)
    collected: list[torch.Tensor] = []
    with probe, saved_tensors_hooks(lambda t: (collected.append(t), t)[1], lambda t: t):
        exp_of_double(torch.randn(256, requires_grad=True))
    assert probe.callable_memory(0, 0, 0).saved_activation_bytes == 0
    probe.note_saved(collected)
    assert probe.callable_memory(0, 0, 0).saved_activation_bytes == 1024
    probe.close()


def test_a_probe_that_saw_no_storage_made_reads_no_saved_tensors_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A capture's warmup hands over each saved tensor (24 a ViT block); unobserved (CUDA's
    # default) the probe knows no storage, so none of theirs can count: none is looked up.
    probe = _memory_plan.MemoryProbe("exp_of_double", exp_of_double)
    looked_up: list[torch.Tensor] = []
    storage_of = _memory_plan._storage_of

    def noting(tensor: torch.Tensor) -> Any:
        looked_up.append(tensor)
        return storage_of(tensor)

    monkeypatch.setattr(_memory_plan, "_storage_of", noting)
    probe.note_saved([torch.randn(256)])
    assert looked_up == []
    assert probe.callable_memory(0, 0, 0).saved_activation_bytes == 0
    probe.close()


def test_the_probe_inside_other_saved_tensor_hooks_hands_over_to_them() -> None:
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> tuple[str, torch.Tensor]:
        packed.append(t)
        return ("boxed", t)

    x = torch.randn(256, requires_grad=True)
    probe = _memory_plan.MemoryProbe("exp_of_double", exp_of_double)
    with saved_tensors_hooks(pack, lambda box: box[1]), probe:
        out = exp_of_double(x)
        out.sum().backward()
    probe.close()
    assert len(packed) == 1 and torch.equal(x.grad, 2 * out.detach())
    assert probe.callable_memory(0, 0, 0).saved_activation_bytes == 1024


def test_peaks_follow_the_tensors_alive_at_once() -> None:
    # forward: t = 2x and exp(t) are alive together (2 KiB); t dies, exp(t) is kept (output,
    # saved). backward: exp(t) plus grad*exp(t) plus that times 2 (3 KiB).
    (memory,) = dgt.memory_plan(exp_of_double, torch.randn(256, requires_grad=True)).callables
    assert (memory.forward_peak_bytes, memory.backward_peak_bytes) == (2048, 3072)


def test_blocks_and_segments_are_sized_as_the_caching_allocator_sizes_them() -> None:
    sizes = (1, 512, 513, 1 << 20, (1 << 20) + 1, 10 * MIB - 1, 10 * MIB + 1)
    assert [_memory_plan._round_size(n) for n in sizes] == [
        512,
        512,
        1024,
        1 << 20,
        (1 << 20) + 512,
        10 * MIB,
        10 * MIB + 512,
    ]
    segments = [_memory_plan._allocation_size(_memory_plan._round_size(n)) for n in sizes]
    assert segments == [2 * MIB] * 4 + [20 * MIB, 10 * MIB, 12 * MIB]


def replayed(*events: tuple[int, int]) -> _memory_plan.CachingAllocatorModel:
    pool = _memory_plan.CachingAllocatorModel()
    pool.replay(events)
    return pool


def test_the_pool_model_serves_a_request_from_the_smallest_free_block_that_fits() -> None:
    # 32 and 16 MiB segments; both freed; 16 MiB goes to the 16 MiB one, 32 MiB then still fits
    pool = replayed((1, 32 * MIB), (2, 16 * MIB), (1, -32 * MIB), (2, -16 * MIB), (3, 16 * MIB))
    pool.replay([(4, 32 * MIB)])
    assert (pool.reserved_bytes, pool.allocated_bytes) == (48 * MIB, 48 * MIB)


def test_the_pool_model_splits_a_large_block_and_a_later_request_needs_a_new_segment() -> None:
    # peak of live tensors 48 MiB, but the 16 MiB took half of the freed 32 MiB block: 80 MiB
    pool = replayed((1, 32 * MIB), (1, -32 * MIB), (2, 16 * MIB), (3, 32 * MIB))
    assert (pool.reserved_bytes, pool.allocated_bytes) == (64 * MIB, 48 * MIB)
    pool.replay([(4, 16 * MIB)])  # the other half of the split block
    assert pool.reserved_bytes == 64 * MIB


def test_the_pool_model_keeps_what_remains_of_a_block_only_when_it_is_a_block_of_its_kind() -> None:
    # Large blocks split when more than 1 MiB remains: 11 MiB takes all of its 12 MiB segment,
    # 10.5 MiB leaves a 1.5 MiB block; small blocks split when 512 B or more remain.
    unsplit = replayed((1, 11 * MIB), (2, MIB + 512))
    assert unsplit.reserved_bytes == 12 * MIB + 20 * MIB
    assert unsplit.allocated_bytes == 12 * MIB + MIB + 512
    split = replayed((1, 21 * MIB // 2), (2, 3 * MIB // 2))
    assert split.reserved_bytes == split.allocated_bytes == 12 * MIB
    small = replayed((1, 4096), (2, 1024), (1, -4096), (3, 3584), (4, 512))
    assert small.reserved_bytes == 2 * MIB and small.allocated_bytes == 1024 + 3584 + 512


def test_the_pool_model_merges_a_freed_block_with_its_free_neighbours() -> None:
    # three 6 MiB blocks fill a 20 MiB segment; freed in any order they merge back into one
    pool = replayed((1, 6 * MIB), (2, 6 * MIB), (3, 6 * MIB), (1, -6 * MIB), (3, -6 * MIB))
    pool.replay([(2, -6 * MIB), (4, 20 * MIB)])
    assert pool.reserved_bytes == 20 * MIB


def test_the_pool_model_lays_out_the_mlp_of_the_gpu_test_as_the_allocator_does() -> None:
    # Linear(1024, 4096), GELU, Linear(4096, 1024) on x[2048, 1024] float32, what a capture
    # allocates: forward h1, g (32 MiB), y (8); backward grad g (32), grad W2 (16), grad b2, g
    # freed, grad h (32, where g was), grad g and h1 freed, grad x (8, beside y), grad W1 (16),
    # grad b1, grad h freed. Kept: y, the grads of x, W1, b1, W2, b2.
    h1, g, y, gg, gw2, gb2, gh, gx, gw1, gb1 = range(10)
    pool = replayed((h1, 32 * MIB), (g, 32 * MIB), (y, 8 * MIB))
    pool.replay([(gg, 32 * MIB), (gw2, 16 * MIB), (gb2, 4096), (g, -32 * MIB), (gh, 32 * MIB)])
    pool.replay([(gg, -32 * MIB), (h1, -32 * MIB), (gx, 8 * MIB), (gw1, 16 * MIB)])
    pool.replay([(gb1, 16384), (gh, -32 * MIB)])
    assert pool.reserved_bytes == 134 * MIB  # 3 x 32 + 16 (grad W2) + 20 (y, grad x) + 2 (biases)
    assert pool.allocated_bytes == 48 * MIB + 4096 + 16384


@pytest.mark.parametrize(
    ("elements", "expected_pool"),
    [
        (256, 2 * MIB),  # small blocks: one 2 MiB segment
        (3 * MIB // 4, 20 * MIB),  # 3 MiB blocks share a 20 MiB segment (peak 9 MiB)
        (12 * MIB // 4, 36 * MIB),  # 12 MiB blocks get their own segments (peak 3 of them)
    ],
)
def test_the_expected_pool_sizes_segments_as_the_caching_allocator_does(
    elements: int, expected_pool: int
) -> None:
    plan = dgt.memory_plan(exp_of_double, torch.randn(elements, requires_grad=True))
    assert plan.expected_pool_bytes == plan.callables[0].expected_pool_bytes == expected_pool


def test_callables_captured_together_share_one_pool_in_capture_order() -> None:
    # Alone, each peaks at 9 MiB of 3 MiB blocks... here 6 MiB blocks: 18 MiB, one 20 MiB
    # segment. Together, A's output stays while B runs forward and backward: 30 MiB, two.
    def a(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).exp()

    def b(x: torch.Tensor) -> torch.Tensor:
        return (x * 3).exp()

    samples = tuple((torch.randn(6 * MIB // 4, requires_grad=True),) for _ in range(2))
    graphed = dgt.make_graphed_callables((a, b), samples, backend="emulate")
    plan = dgt.diagnostics(graphed[0]).memory_plan
    assert plan is not None and plan is dgt.diagnostics(graphed[1]).memory_plan
    assert [c.expected_pool_bytes for c in plan.callables] == [20 * MIB, 20 * MIB]
    assert plan.expected_pool_bytes == 40 * MIB
    assert str(plan).splitlines()[-1].split()[:3] == ["all", "(one", "pool)"]


def test_the_plan_prints_as_a_table() -> None:
    plan = dgt.memory_plan(nn.Linear(256, 256), torch.randn(64, 256))
    assert str(plan).splitlines() == [
        "memory plan (bytes; the pool is measured after capture)",
        "callable  static in  static out  static grads  saved activations  forward peak  "
        "backward peak  kept in pool  pool (expected)  pool (measured)",
        # static grads: out, and the .grad accumulators of W and b ("auto" adds into them in
        # its backward graph); kept in pool: the output alone (x takes no grad here)
        "Linear     64.0 KiB    64.0 KiB     321.0 KiB                0 B      64.0 KiB  "
        "    321.0 KiB      64.0 KiB          2.0 MiB                -",
    ]
    assert plan.with_measured_pool(2 * MIB).pool_bytes == 2 * MIB
    assert str(plan.with_measured_pool(2 * MIB)).endswith("2.0 MiB          2.0 MiB")


def test_what_the_graphs_keep_in_the_pool_is_their_outputs_and_input_grads() -> None:
    # The output and the grad of x: computed in the pool during capture, kept as static buffers
    # (the output grad is a buffer a capture makes outside the pool). The grads of W and b are
    # computed in the pool too, but the backward graph adds them into the .grad accumulators
    # (outside the pool) and lets them go.
    x = torch.randn(64, 256, requires_grad=True)
    (linear,) = dgt.memory_plan(nn.Linear(256, 256), x).callables
    output, weight, bias = 64 * 256 * 4, 256 * 256 * 4, 256 * 4
    assert linear.kept_in_pool_bytes == output + output  # x's grad as large as the output
    # the output grad buffer, x's grad (in the pool) and the accumulators of W and b
    assert linear.static_grad_bytes == output + output + weight + bias
    # ... which the backward peak held at once with the grads of W and b it added
    assert linear.backward_peak_bytes >= output + weight + bias
    (nothing_to_grad,) = dgt.memory_plan(lambda t: t * 2, torch.ones(256)).callables
    assert nothing_to_grad.kept_in_pool_bytes == 1024  # the output alone


def test_rich_renders_the_plan_as_a_table() -> None:
    rich_console = pytest.importorskip("rich.console")
    plan = dgt.memory_plan(nn.Linear(4, 4), torch.randn(2, 4))
    out = io.StringIO()
    rich_console.Console(file=out, width=200).print(plan)
    assert "pool (expected)" in out.getvalue() and "Linear" in out.getvalue()


def test_bytes_read_for_people() -> None:
    assert [_memory_plan.format_bytes(n) for n in (0, 1023, 1536, 20 * MIB, 3 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "20.0 MiB",
        "3.0 GiB",
    ]


def test_memory_plan_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = torch.randn(3, 4, requires_grad=True)
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    dgt.memory_plan(model, x)
    assert all(torch.equal(b, saved) for b, saved in zip(model.buffers(), buffers, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_memory_plan_of_a_function_leaves_the_modules_it_names_as_they_were() -> None:
    # Only the planned module's own buffers and attributes were kept: a function's closed-over
    # BatchNorm kept the call's statistics, and a closed-over module its call counter.
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(4)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.norm(x)

    counts = Counts()
    buffers = [b.clone() for b in counts.buffers()]
    dgt.memory_plan(lambda x: counts(x) * 2, torch.randn(3, 4, requires_grad=True))
    assert all(torch.equal(b, saved) for b, saved in zip(counts.buffers(), buffers, strict=True))
    assert counts.calls == 0


def test_the_warmup_iterations_after_the_first_are_not_watched() -> None:
    # The plan comes from the first warmup iteration; later ones run without the probe.
    graphed = dgt.make_graphed_callables(
        exp_of_double,
        (torch.randn(256, requires_grad=True),),
        backend="emulate",
        num_warmup_iters=4,
    )
    plan = dgt.diagnostics(graphed).memory_plan
    assert plan is not None and plan.callables[0].forward_peak_bytes == 2048


def test_a_capture_that_copies_its_results_out_keeps_nothing_in_the_pool() -> None:
    # Shape buckets on cuda (results_outside_pool): outputs and grads go to buffers outside the
    # pool; the pool is as large (they are computed there), and keeps none of it.
    from dualgraph.torch._capture import CaptureOptions, CaptureRequest, capture
    from dualgraph.torch._inputs import InputGuard

    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    sample = (torch.randn(32, 64, requires_grad=True),)
    guard = InputGuard(sample, None)
    request = CaptureRequest("mlp", mlp.forward, mlp, guard, tuple(guard.tensors(sample, {})))
    options = CaptureOptions(
        backend="emulate",
        num_warmup_iters=1,
        allow_unused_input=False,
        pool=None,
        capture_error_mode="global",
        clone_outputs=False,
        param_grads="autograd",
        results_outside_pool=True,
    )
    (plan,) = capture([request], options)
    kept = plan.diagnostics.memory_plan
    (before,) = dgt.memory_plan(mlp, *sample).callables
    assert kept is not None and kept.kept_in_pool_bytes == kept.callables[0].kept_in_pool_bytes == 0
    assert before.kept_in_pool_bytes > 0
    assert kept.expected_pool_bytes == before.expected_pool_bytes


# -- on the GPU: the plan beside the measured pool --------------------------------------------


def test_each_bucket_keeps_its_plan_and_the_bucketed_callable_the_largest() -> None:
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    samples = [(torch.randn(n, 64, requires_grad=True),) for n in (8, 32)]
    graphed = dgt.make_graphed_callables(mlp, buckets=samples, backend="emulate")
    info = dgt.diagnostics(graphed)
    for bucket, sample in zip(info.buckets, samples, strict=True):
        assert bucket.memory_plan is not None
        (kept,) = bucket.memory_plan.callables
        (before,) = dgt.memory_plan(mlp, *sample).callables
        assert kept.name.startswith("Sequential[args[0]=")  # the bucket's name
        assert dataclasses.replace(kept, name=before.name) == before
    assert info.memory_plan is info.buckets[1].memory_plan  # the largest, which sizes the pool


def graph_pools() -> dict[tuple[int, ...], list[dict[str, Any]]]:
    """The segments of every CUDA graph pool now, by pool."""
    pools: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            pools.setdefault(pool, []).append(segment)
    return pools


def layout(segments: list[dict[str, Any]]) -> str:
    """Each segment's blocks in MiB, the allocated ones starred: what to look at on a mismatch."""
    return "\n".join(
        f"  segment {segment['total_size'] / MIB:.1f} MiB: "
        + ", ".join(
            f"{block['size'] / MIB:.2f}{'*' if block['state'] == 'active_allocated' else ''}"
            for block in segment["blocks"]
        )
        for segment in sorted(segments, key=lambda segment: segment["address"])
    )


def new_pool_segments(before: dict[tuple[int, ...], Any]) -> list[dict[str, Any]]:
    return [s for pool, segments in graph_pools().items() if pool not in before for s in segments]


def allocated_blocks(segments: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(address, size)`` of each allocated block of ``segments`` (a memory snapshot's)."""
    blocks = []
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:  # in address order within the segment
            address = block.get("address", address)
            if block["state"] == "active_allocated":
                blocks.append((address, block["size"]))
            address += block["size"]
    return blocks


def holders(blocks: list[tuple[int, int]]) -> list[str]:
    """What refers to each Python tensor whose memory lies in one of ``blocks``, two levels up.

    For a pool that keeps more than planned: tells a tensor something alive holds (a frame, a
    closure, an attribute) from garbage of a reference cycle that a collection would free.
    """
    objects = gc.get_objects()
    mine = {id(objects), id(sys._getframe())}
    lines = []
    for tensor in objects:
        if not issubclass(type(tensor), torch.Tensor):  # (isinstance reads __class__)
            continue
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except Exception:  # no storage of its own (sparse, a fake or functional tensor): not ours
            continue
        if not any(address <= pointer < address + size for address, size in blocks):
            continue
        referrers = [r for r in gc.get_referrers(tensor) if id(r) not in mine]
        lines.append(
            f"{tuple(tensor.shape)} {tensor.dtype} at {pointer:#x}, held by: "
            + ("; ".join(_describe(r, mine | {id(referrers)}) for r in referrers) or "nothing")
        )
    return lines


def _describe(referrer: Any, mine: set[int]) -> str:
    if isinstance(referrer, types.FrameType):
        code = referrer.f_code
        return f"frame {code.co_name} ({code.co_filename}:{referrer.f_lineno})"
    name = type(referrer).__name__
    if isinstance(referrer, tuple | list | dict | types.CellType):  # who holds the container
        outer = [r for r in gc.get_referrers(referrer) if id(r) not in mine]
        name += " <- " + ", ".join(
            _describe(r, mine) if isinstance(r, types.FrameType) else type(r).__name__
            for r in outer
        )
    return name


def test_allocated_blocks_are_found_at_their_offsets_in_the_segment() -> None:
    segment = {
        "address": 4096,
        "blocks": [
            {"size": 512, "state": "inactive"},
            {"size": 1024, "state": "active_allocated"},
            {"size": 512, "state": "active_pending_free"},
            {"size": 2048, "state": "active_allocated"},
        ],
    }
    assert allocated_blocks([segment]) == [(4608, 1024), (6144, 2048)]


def test_the_holders_of_a_block_name_the_container_and_what_holds_it() -> None:
    kept = {"grads": [torch.ones(4)]}
    (line,) = holders([(kept["grads"][0].data_ptr(), 16)])
    assert "held by: list <- dict" in line


def test_the_holders_of_a_block_name_a_frame_kept_after_its_function_returned() -> None:
    # a frame object outliving its call keeps its locals (the suspect of run W's pool)
    def capture_backward() -> tuple[types.FrameType, int]:
        grad = torch.ones(4)
        return sys._getframe(), grad.data_ptr()

    frame, pointer = capture_backward()
    (line,) = holders([(pointer, 16)])
    assert "frame capture_backward" in line
    del frame


@pytest.mark.cuda
def test_on_cuda_the_plan_before_capture_matches_the_capture() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    before = dgt.memory_plan(mlp, x)
    pools_before = graph_pools()
    graphed = dgt.make_graphed_callables(mlp, (x,), lint="off")  # the memory probe alone
    info = dgt.diagnostics(graphed)
    kept = info.memory_plan
    segments = new_pool_segments(pools_before)
    print(f"\nplan before capture:\n{before}\nplan kept by the capture:\n{kept}")
    print(f"the pool (MiB, * allocated):\n{layout(segments)}")
    assert kept is not None and kept.pool_bytes == info.pool_bytes > 0
    assert info.pool_bytes == sum(segment["total_size"] for segment in segments)
    (planned,) = before.callables
    assert (planned.static_input_bytes, planned.static_output_bytes, planned.static_grad_bytes) == (
        info.static_input_bytes,
        info.static_output_bytes,
        info.static_grad_bytes,
    )
    assert planned.saved_activation_bytes == kept.callables[0].saved_activation_bytes
    assert kept.callables == before.callables
    # What stays allocated in the pool is the output and the grad of x, nothing else: the grads
    # of the weights and biases are added into their .grad accumulators (outside the pool) and
    # let go, and no cuBLAS workspace is there (those are made before the capture).
    # (Run W on an H100 once found 48 MiB + 20 KiB here: the grads of both weights and biases,
    # kept alive after the capture, by something this helper names; not a cuBLAS workspace.)
    allocated = sum(segment["allocated_size"] for segment in segments)
    if allocated != planned.kept_in_pool_bytes:
        print("what holds the allocated blocks:", *holders(allocated_blocks(segments)), sep="\n  ")
        gc.collect()
        collected = new_pool_segments(pools_before)
        print("allocated after gc.collect():", sum(s["allocated_size"] for s in collected))
    assert allocated == planned.kept_in_pool_bytes == 16 * MIB
    # The model of the caching allocator lays the tensors out in 134 MiB. The real pool is no
    # smaller; on the H200 (2026-12-03) it was 214 MiB: a 64 MiB block and more, free after the
    # capture, that the model does not predict (see the README: the expected pool is a floor).
    peak = max(planned.forward_peak_bytes, planned.backward_peak_bytes)
    assert planned.expected_pool_bytes == 134 * MIB
    assert peak <= planned.expected_pool_bytes <= info.pool_bytes


@pytest.mark.cuda
def test_on_cuda_several_callables_share_the_pool_the_plan_expects() -> None:
    torch.manual_seed(0)
    blocks = (
        nn.Sequential(nn.Linear(512, 2048), nn.GELU()).cuda(),
        nn.Sequential(nn.Linear(2048, 512), nn.GELU()).cuda(),
    )
    samples = (
        (torch.randn(1024, 512, device="cuda", requires_grad=True),),
        (torch.randn(1024, 2048, device="cuda", requires_grad=True),),
    )
    pools_before = graph_pools()
    graphed = dgt.make_graphed_callables(blocks, samples, lint="off")  # the memory probe alone
    plan = dgt.diagnostics(graphed[0]).memory_plan
    segments = new_pool_segments(pools_before)
    print(f"\n{plan}\nthe pool (MiB, * allocated):\n{layout(segments)}")
    assert plan is not None and plan.pool_bytes is not None
    assert sum(segment["allocated_size"] for segment in segments) == plan.kept_in_pool_bytes
    peak = max(max(c.forward_peak_bytes, c.backward_peak_bytes) for c in plan.callables)
    # a floor (62 MiB expected, 78 MiB measured on the H200 on 2026-12-03; see above)
    assert peak <= plan.expected_pool_bytes <= plan.pool_bytes
