"""The examples run: each as a subprocess on the CPU, small arguments, warnings as errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

#: example -> (arguments, lines its output must contain)
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "quickstart.py": ([], ["emulate: hidden (8, 64), aux None"]),
    "vision_encoder.py": (
        ["--steps", "3", "--device", "cpu"],
        [
            "backend emulate (no GPU",
            "losses match: 3 steps, largest relative difference 0 ",
            "parity OK: 32 leaves within tolerance",
            "step time graphed",
            "vision_encoder: OK",
        ],
    ),
    "spec_roundtrip.py": (
        [],
        [
            "torch: the encoder returned TreeSpec({'hidden': float32[2, 16, 64](grad), "
            "'pooled': float32[2, 64](grad), 'aux_loss': None})",
            "jax: the reference's output matches the spec",
            "output['aux_loss']: expected None, got float32[]",
            "jax: torch imported in this process: no",
        ],
    ),
    "ddp_train.py": (
        ["--steps", "2", "--layers", "1"],
        [
            "ddp_train: OK world=2 dist=gloo device=cpu backend=emulate",
            "max|grad diff|=0 max|param diff|=0",
        ],
    ),
}


def run_example(name: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "CUDA_VISIBLE_DEVICES": "",  # the CPU, even on a machine with a GPU
        "JAX_PLATFORMS": "cpu",
        "PYTHONWARNINGS": "error",  # as in the tests: a warning in an example fails it
    }
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )


@pytest.mark.parametrize("name", list(RUNS))
def test_example_runs_on_the_cpu(name: str) -> None:
    args, expected = RUNS[name]
    result = run_example(name, args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} exited with {result.returncode}:\n{output}"
    missing = [line for line in expected if line not in result.stdout]
    assert not missing, f"{name}: missing {missing} in its output:\n{output}"


def test_every_example_is_run_here() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(RUNS)


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vision_encoder_reports_the_step_where_losses_differ() -> None:
    example = load_example("vision_encoder.py")
    losses = {"eager": [2.5, 2.4, 2.3], "graphed": [2.5, 2.4, 2.31]}
    ok, message = example.compare_losses(losses, 1e-6, torch.device("cpu"), "float32")
    assert not ok
    assert message.startswith("losses differ at step 2: graphed 2.31, eager 2.3 ")
    assert "> tolerance 1e-06 for float32 on cpu" in message
