"""The shape-bucket memory benchmark (a GPU script): without a GPU it says so and exits cleanly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_buckets_memory.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs for real")
def test_without_a_gpu_the_benchmark_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_buckets_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main([])
    assert exit_info.value.code == 2
    assert "error: needs a CUDA device" in capsys.readouterr().err
