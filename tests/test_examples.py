"""The examples run: each as a subprocess on the CPU, small arguments, warnings as errors.

Also the vision-encoder demo's flags (a bad one is an argparse ``error:`` with exit code 2, never
a traceback), its defaults on either device, and its pieces that a CPU run does not reach.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


#: example -> (arguments, lines its output must contain); "{tmp}" is a fresh folder.
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "quickstart.py": ([], ["emulate: hidden (8, 64), aux None"]),
    "vision_encoder.py": (
        ["--steps", "3", "--device", "cpu"],
        [
            "dualgraph backend emulate (no GPU",
            "dualgraph: losses match eager: 4 steps, largest relative difference 0 ",
            "dualgraph in_graph: losses match eager: 4 steps, largest relative difference 0 ",
            "parity OK: 32 leaves within tolerance",
            "torch.cuda          skipped: needs a CUDA device",
            "te                  skipped: needs a CUDA device",
            "parity vs JAX (dualgraph), float32: parity OK",
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
    "pipeline_schedule.py": (
        ["--device", "cpu", "--steps", "2"],
        [
            "micro-batches in flight per stage at most: 4, 3, 2, 1",
            "dualgraph schedule: losses match eager: 3 steps, largest relative difference 0",
            "dualgraph slots: losses match eager: 3 steps, largest relative difference 0",
            "pipeline_schedule: OK",
        ],
    ),
    "variable_resolution.py": (
        [],
        [
            "dualgraph backend emulate, 3 buckets captured",
            "steps per bucket: 16 px: 3, 24 px: 3, 32 px: 3",
            "dualgraph buckets: losses match eager: 9 steps, largest relative difference 0 ",
            "pool memory: none on the CPU",
            "variable_resolution: OK",
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


def test_vision_encoder_in_bfloat16_checks_parity_on_a_float32_copy(tmp_path: Path) -> None:
    plot = tmp_path / "charts" / "step_time.png"  # its folder is made
    args = ["--device", "cpu", "--dtype", "bfloat16", "--layers", "1", "--steps", "2"]
    result = run_example("vision_encoder.py", [*args, "--warmup", "0", "--plot", str(plot)])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "dualgraph: losses match eager: 2 steps" in result.stdout, output
    assert "parity vs JAX (dualgraph), float32 copy, its blocks graphed the same way: " in output
    assert f"plot: {plot}" in result.stdout
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_a_bad_flag_is_an_error_line_not_a_traceback() -> None:
    result = run_example("vision_encoder.py", ["--layers", "0"])
    assert result.returncode == 2
    assert "error: argument --layers: must be a positive integer, got '0'" in result.stderr
    assert "Traceback" not in result.stderr


# -- the vision-encoder demo, in this process ------------------------------------------------------


def load_example(name: str) -> ModuleType:
    module_name = "example_" + name.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    return load_example("vision_encoder.py")


@pytest.fixture(params=[False, True], ids=["no-gpu", "gpu"])
def has_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Parse flags as on a machine without (or with) a CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: request.param)
    yield request.param


def parse_error(demo: ModuleType, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error: " in line]
    return line.partition("error: ")[2]


BAD_FLAGS = [
    (["--layers", "0"], "argument --layers: must be a positive integer, got '0'"),
    (["--heads", "0"], "argument --heads: must be a positive integer, got '0'"),
    (["--dim", "0"], "argument --dim: must be a positive integer, got '0'"),
    (["--dim", "65", "--heads", "4"], "--dim (65) must be a multiple of --heads (4)"),
    (["--heads", "5"], "--dim (64) must be a multiple of --heads (5)"),
    (["--batch", "0"], "argument --batch: must be a positive integer, got '0'"),
    (["--image-size", "0"], "argument --image-size: must be a positive integer, got '0'"),
    (["--image-size", "30"], "--image-size (30) must be a multiple of --patch (8)"),
    (["--patch", "0"], "argument --patch: must be a positive integer, got '0'"),
    (["--patch", "3"], "--image-size (32) must be a multiple of --patch (3)"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got '0'"),
    (["--steps", "-1"], "argument --steps: must be a positive integer, got '-1'"),
    (["--steps", "2.5"], "argument --steps: must be an integer, got '2.5'"),
    (["--layers", "two"], "argument --layers: must be an integer, got 'two'"),
    (["--warmup", "-1"], "argument --warmup: must be 0 or more, got '-1'"),
    (["--rounds", "0"], "argument --rounds: must be a positive integer, got '0'"),
    (["--steps", "3", "--rounds", "4"], "--rounds (4) must be at most --steps (3)"),
    (["--seed", "-1"], "argument --seed: must be between 0 and 2**32 - 1, got '-1'"),
    (["--seed", str(2**32)], f"argument --seed: must be between 0 and 2**32 - 1, got '{2**32}'"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--backend", "graphs"], "argument --backend: invalid choice: 'graphs'"),
    (["--parity-dtype", "float64"], "argument --parity-dtype: invalid choice: 'float64'"),
    (["--plot", "chart.jpg"], "argument --plot: must be a path ending in .png, got 'chart.jpg'"),
    (["--plot", "a.png", "--no-plot"], "argument --no-plot: not allowed with argument --plot"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_exits_with_a_clean_error(
    demo: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_error(demo, ["--device", "cpu", *argv], capsys).startswith(message)


def test_cuda_flags_without_a_gpu_are_clean_errors(
    demo: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_error(demo, ["--device", "cuda"], capsys) == (
        "--device cuda: no CUDA device is available"
    )
    assert parse_error(demo, ["--backend", "cuda"], capsys) == (
        "--backend cuda: no CUDA device is available (use emulate or eager)"
    )


def test_backend_cuda_on_the_cpu_of_a_gpu_machine_is_a_clean_error(
    demo: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    message = parse_error(demo, ["--device", "cpu", "--backend", "cuda"], capsys)
    assert message == "--backend cuda needs --device cuda"


def test_plot_of_a_folder_is_a_clean_error(
    demo: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "chart.png"
    folder.mkdir()
    assert parse_error(demo, ["--device", "cpu", "--plot", str(folder)], capsys) == (
        f"argument --plot: {str(folder)!r} exists and is not a file"
    )


def test_plot_under_a_file_is_a_clean_error(
    demo: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("")
    chart = tmp_path / "notes.txt" / "charts" / "chart.png"
    assert parse_error(demo, ["--device", "cpu", "--plot", str(chart)], capsys) == (
        f"argument --plot: cannot make a folder for {str(chart)!r}: {tmp_path / 'notes.txt'} "
        "is a file"
    )


def test_plot_without_matplotlib_is_a_clean_error(
    demo: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "installed", lambda name: name != "matplotlib")
    message = parse_error(demo, ["--device", "cpu", "--plot", "chart.png"], capsys)
    assert message == "--plot needs matplotlib: pip install 'dualgraph[examples]'"


def test_defaults_follow_the_device(demo: ModuleType, has_cuda: bool) -> None:
    args = demo.parse_args([])
    if has_cuda:  # ViT-S/16 in bf16, the chart under benchmarks/results
        assert (args.device, args.layers, args.dim, args.heads) == ("cuda", 12, 384, 6)
        assert (args.image_size, args.patch, args.batch, args.dtype) == (224, 16, 32, "bfloat16")
        assert args.plot == ROOT / "benchmarks" / "results" / "vision_encoder_step_time.png"
        assert demo.parse_args(["--no-plot"]).plot is None
    else:
        assert (args.device, args.layers, args.dim, args.heads) == ("cpu", 2, 64, 4)
        assert (args.image_size, args.patch, args.batch, args.dtype) == (32, 8, 8, "float32")
        assert args.plot is None
    assert (args.steps, args.warmup) == ((100, 3) if has_cuda else (10, 1))
    assert (args.backend, args.parity_dtype, args.rounds) == ("auto", "float32", 5)
    assert demo.parse_args(["--device", "cpu", "--layers", "3"]).layers == 3


def test_rounds_default_to_at_most_the_steps(demo: ModuleType) -> None:
    assert demo.parse_args(["--device", "cpu", "--steps", "3"]).rounds == 3


def test_help_shows_every_flag_with_its_default(
    demo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    entries: list[str] = []  # one per option: its line and the wrapped lines of its help
    for line in help_text.split("options:")[1].splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif entries and line.startswith("   "):
            entries[-1] += " " + line.strip()
    assert len(entries) >= 15
    for entry in entries:
        if not entry.startswith(("  -h, --help", "  --no-plot")):
            assert "default" in entry, f"no default in: {entry}"
    assert "encoder blocks (default: 12 on a GPU, 2 on the CPU)" in " ".join(help_text.split())


def test_docstring_commands_that_need_a_gpu_say_so(
    demo: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    commands = re.findall(r"^ +python examples/vision_encoder\.py(.*)$", demo.__doc__, re.M)
    assert len(commands) >= 3
    for command in commands:
        flags, _, comment = command.partition("#")
        try:
            args = demo.parse_args(shlex.split(flags))
        except SystemExit:  # e.g. --device cuda
            assert "GPU" in comment, f"needs a GPU, not marked so: {command}"
            continue
        tokens = (args.image_size // args.patch) ** 2
        if args.batch * tokens * args.dim**2 > demo.CPU_SLOW_WORK:
            assert "GPU" in comment, f"slow on a CPU, not marked as for a GPU: {command}"
    capsys.readouterr()


# -- the demo's pieces -----------------------------------------------------------------------------


def test_losses_that_differ_are_reported_with_their_step(demo: ModuleType) -> None:
    ok, message = demo.compare_losses([2.5, 2.4, 2.3], [2.5, 2.4, 2.31], 1e-6, "float32 on cpu")
    assert not ok
    assert message.startswith("losses differ at step 2: graphed 2.31, eager 2.3 ")
    assert "> tolerance 1e-06 for float32 on cpu" in message


def test_a_nan_loss_never_matches(demo: ModuleType) -> None:
    ok, message = demo.compare_losses([2.5, 2.4], [2.5, float("nan")], 1e-6, "float32 on cpu")
    assert not ok and "at step 1" in message


def test_losses_of_another_length_never_match(demo: ModuleType) -> None:
    ok, message = demo.compare_losses([2.5, 2.4], [2.5], 1e-6, "float32 on cpu")
    assert not ok and message == "1 losses against eager's 2"


def test_losses_within_tolerance_match(demo: ModuleType) -> None:
    ok, message = demo.compare_losses([2.5, 2.4], [2.5, 2.4 + 1e-7], 1e-6, "float32 on cpu")
    assert ok and message.startswith("losses match eager: 2 steps")


def _one_step_above(loss: float, dtype: torch.dtype) -> float:
    """The next ``dtype`` value above ``loss``: the smallest difference a defect can make."""
    value = torch.tensor(loss, dtype=dtype)
    return torch.nextafter(value, torch.tensor(math.inf, dtype=dtype)).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_demo_counts_a_cpu_loss_one_rounding_step_off_as_a_difference(
    demo: ModuleType, dtype: str
) -> None:
    # README: the CPU (emulate) is eager's bit for bit, so its tolerance lets nothing through
    loss = _one_step_above(2.5, getattr(torch, dtype))
    tolerance = demo.LOSS_TOLERANCE[("cpu", dtype)]
    ok, message = demo.compare_losses([2.5], [loss], tolerance, f"{dtype} on cpu")
    assert not ok, message


def test_spec_roundtrip_refuses_a_reference_whose_values_are_off(tmp_path: Path) -> None:
    # it printed the largest difference from torch's values and went on, whatever it was
    example = load_example("spec_roundtrip.py")
    example.torch_side(tmp_path)
    weights = dict(np.load(tmp_path / "weights.npz"))
    weights["norm.bias"] = weights["norm.bias"] + 0.01  # a weight read wrongly
    np.savez(tmp_path / "weights.npz", **weights)
    with pytest.raises(AssertionError, match=r"the reference's values differ from torch's by "):
        example.jax_side(tmp_path)


def test_spec_roundtrip_refuses_a_reference_whose_values_are_nan(tmp_path: Path) -> None:
    example = load_example("spec_roundtrip.py")
    example.torch_side(tmp_path)
    weights = dict(np.load(tmp_path / "weights.npz"))
    weights["norm.bias"] = np.full_like(weights["norm.bias"], np.nan)
    np.savez(tmp_path / "weights.npz", **weights)
    with pytest.raises(AssertionError, match=r"differ from torch's by nan "):
        example.jax_side(tmp_path)


@pytest.mark.parametrize("name", ["pipeline_schedule.py", "variable_resolution.py"])
def test_a_nan_loss_after_an_equal_step_is_the_worst_difference(name: str) -> None:
    # max() over the steps kept step 0's 0.0 over step 1's NaN: a NaN loss printed OK
    example = load_example(name)
    assert math.isnan(example.worst_relative_difference([2.5, math.nan], [2.5, 2.5]))
    assert math.isnan(example.worst_relative_difference([2.5, 2.4], [2.5, math.nan]))
    assert example.worst_relative_difference([2.5, 2.4], [2.5, 2.4]) == 0.0


@pytest.mark.parametrize(
    ("name", "args"),
    [
        (
            "pipeline_schedule.py",
            ["--device", "cpu", "--steps", "1", "--stages", "2", "--microbatches", "2"],
        ),
        ("variable_resolution.py", ["--steps", "3", "--layers", "1", "--sizes", "16,24"]),
    ],
)
def test_an_example_whose_worst_loss_difference_is_nan_fails(
    name: str, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the largest difference is NaN when a loss is: the run must not print OK and exit 0
    example = load_example(name)
    monkeypatch.setattr(example, "worst_relative_difference", lambda *_: math.nan)
    assert example.main(args) == 1


def test_ddp_train_counts_a_nan_parameter_as_a_difference() -> None:
    example = load_example("ddp_train.py")
    eager = torch.nn.Linear(2, 2)
    graphed = copy.deepcopy(eager)
    with torch.no_grad():
        graphed.bias[1] = math.nan  # the weight before it matches: a 0 the NaN came after
    assert math.isnan(example._max_difference(eager, graphed, grads=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_variable_resolution_counts_a_cpu_loss_one_rounding_step_off_as_a_difference(
    dtype: torch.dtype,
) -> None:
    example = load_example("variable_resolution.py")
    loss = _one_step_above(2.5, dtype)
    assert abs(loss - 2.5) / 2.5 > example.loss_tolerance(torch.device("cpu"), dtype)


@pytest.mark.parametrize(("steps", "rounds"), [(10, 5), (11, 5), (3, 3), (7, 1), (4, 3)])
def test_steps_split_into_rounds_of_near_equal_length(
    demo: ModuleType, steps: int, rounds: int
) -> None:
    parts = demo.split(range(steps), rounds)
    assert [index for part in parts for index in part] == list(range(steps))
    assert len(parts) == rounds and max(map(len, parts)) - min(map(len, parts)) <= 1


def measured(demo: ModuleType) -> list[object]:
    variants = [
        demo.Variant("eager", "no graphs", round_ms=[10.0, 12.0, 11.0]),
        demo.Variant("torch.cuda", "", skipped="needs a CUDA device"),
        demo.Variant("dualgraph", "", round_ms=[5.0], capture_seconds=0.5, pool_bytes=2**21),
    ]
    variants[0].step_peak_bytes = 3 * 2**20
    return variants


def test_summary_has_one_aligned_line_per_variant(demo: ModuleType) -> None:
    lines = demo.summary_table(measured(demo), {"dualgraph": "match"})
    assert re.match(
        r"variant +ms/step +x eager +capture s +step peak MiB +pool MiB +losses", lines[0]
    )
    assert lines[1].split() == ["eager", "11.00", "1.00", "-", "3.0", "-", "reference"]
    assert lines[2].split(maxsplit=1) == ["torch.cuda", "skipped: needs a CUDA device"]
    assert lines[3].split() == ["dualgraph", "5.00", "2.20", "0.50", "-", "2.0", "match"]
    right_edge = lines[0].index("ms/step") + len("ms/step")
    assert lines[1].index("11.00") + 5 == lines[3].index("5.00") + 4 == right_edge


def test_plot_is_a_png_with_a_bar_per_variant_that_ran(demo: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "nested" / "chart.png"
    demo.save_plot(path, measured(demo), "title")
    assert path.read_bytes().startswith(PNG_MAGIC)
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "20,24"], "--sizes [20, 24]: each a multiple of --patch (8)"),
        (["--sizes", "big"], "--sizes: comma-separated integers, got 'big'"),
        (["--dim", "33"], "--dim (33) must be a multiple of --heads (2)"),
    ],
)
def test_variable_resolution_bad_flags_are_clean_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("variable_resolution.py")
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err
