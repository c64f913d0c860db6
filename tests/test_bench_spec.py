"""benchmarks/bench_spec.py runs; it is timed by hand, never in the test suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import dualgraph

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_spec.py"


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_spec", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_tree_has_sixteen_arrays_none_and_constants() -> None:
    spec = dualgraph.describe(load_benchmark().sample_tree())
    assert spec.num_arrays == 16
    assert {leaf.kind for leaf in spec.leaves} == {"array", "none", "const"}


def test_benchmark_runs_and_reports_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    medians = load_benchmark().main(rounds=1, number=50)
    assert set(medians) == {"flatten", "unflatten", "check", "flatten+unflatten"}
    assert all(us > 0 for us in medians.values())
    assert "TreeSpec on a 16-array tree" in capsys.readouterr().out


def test_scale_benchmark_reports_times_memory_and_the_json_load_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = load_benchmark().scale(leaves=400, repeat=1)
    assert set(results) >= {"describe_s", "from_json_s", "from_json_peak_per_json_byte"}
    assert all(value > 0 for value in results.values())
    assert "TreeSpec of a 400-leaf tree" in capsys.readouterr().out


def test_large_tree_has_the_leaves_asked_for() -> None:
    assert len(dualgraph.describe(load_benchmark().large_tree(40)).leaves) == 40
