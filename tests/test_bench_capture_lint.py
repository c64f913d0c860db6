"""benchmarks/bench_capture_lint.py runs; it is timed by hand (or on the GPU), never here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from dualgraph.torch._probe import WarmupProbe

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_capture_lint.py"
TINY = ["--depth", "2", "--dim", "16", "--heads", "2", "--tokens", "4", "--batch", "1"]


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_capture_lint", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_reports_every_mode_per_block(capsys: pytest.CaptureFixture[str]) -> None:
    medians = load_benchmark().main([*TINY, "--rounds", "1"])
    assert set(medians) == {"no probe", "off", "error"}
    assert all(seconds > 0 for seconds in medians.values())
    out = capsys.readouterr().out
    assert out.startswith("2 ViTBlock(dim=16, heads=2), input [1, 4, 16], backend emulate")
    assert out.count("ms per block") == 3


def test_the_baseline_runs_without_the_probe_and_leaves_it_as_it_was() -> None:
    bench = load_benchmark()
    enter = WarmupProbe.__enter__
    args = bench.parse_args(TINY)
    assert bench.capture_seconds(args, "no probe") > 0
    assert WarmupProbe.__enter__ is enter


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--depth", "0"], "--depth must be at least 1"),
        (["--dim", "10", "--heads", "3"], "--dim must be a multiple of --heads"),
    ],
)
def test_bad_arguments_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        load_benchmark().parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
