"""Time TreeSpec on the hot path, and describe / JSON on large trees (CPU, numpy leaves).

Run: ``python benchmarks/bench_spec.py`` (add ``--big`` for the 1e6-leaf tree). Goals:

- hot path, a 16-array tree: flatten + unflatten < 10 us, check < 5 us (medians of interleaved
  rounds);
- a 1e5-leaf tree: describe and from_json < 1 s each, < 300 MiB peak each; JSON load
  (from_json) costs at most ~20x the document's size;
- a 1e6-leaf tree works, or is refused at once: a spec holds at most ``2**20`` nodes (leaves and
  containers), so a flat list of 1e6 arrays works and 1e6 leaves in blocks (1.5e6 nodes) do not.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import timeit
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

import dualgraph


def sample_tree() -> object:
    """A 16-array tree shaped like a block stack's outputs: tuples, dicts, None, constants."""
    rng = np.random.default_rng(0)

    def array(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    layers = [(array(2, 16, 64), None) for _ in range(8)]
    encoder = {
        "hidden": array(2, 16, 64),
        "pooled": array(2, 64),
        "aux_loss": None,
        "mask": np.ones((2, 16), bool),
        "num_tokens": 16,
    }
    extras = [array(4) for _ in range(5)]
    return (layers, encoder, extras, "vit")


def large_tree(leaves: int, *, flat: bool = False) -> object:
    """``leaves`` leaves in blocks of four: an array, None, and a dict of an array and an int
    (with ``flat=True``, a list of arrays)."""
    x = np.zeros((2, 3), np.float32)
    if flat:
        return [x] * leaves
    return {"blocks": [(x, None, {"w": x, "step": i}) for i in range(leaves // 4)]}


def main(rounds: int = 7, number: int = 20000) -> dict[str, float]:
    """The hot path: medians in microseconds."""
    tree = sample_tree()
    spec = dualgraph.describe(tree)
    arrays = spec.flatten(tree)
    assert spec.num_arrays == 16, spec.num_arrays
    cases = {
        "flatten": lambda: spec.flatten(tree),
        "unflatten": lambda: spec.unflatten(arrays),
        "check": lambda: spec.check(tree),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):  # interleaved rounds
        for name, fn in cases.items():
            samples[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    medians["flatten+unflatten"] = medians["flatten"] + medians["unflatten"]
    print(f"TreeSpec on a 16-array tree ({len(spec.leaves)} leaves), median of {rounds} rounds")
    for name, us in medians.items():
        print(f"  {name:<18} {us:6.2f} us")
    return medians


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def _peak(fn: Callable[[], Any]) -> float:
    """Peak memory allocated while ``fn`` runs, in bytes (tracemalloc; slows ``fn`` down)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return float(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def scale(
    leaves: int = 100_000, repeat: int = 3, *, memory: bool = True, flat: bool = False
) -> dict[str, float]:
    """describe / to_json / from_json of a large tree: best seconds, peak MiB, load ratio."""
    tree = large_tree(leaves, flat=flat)
    spec, describe_s = _timed(lambda: dualgraph.describe(tree), repeat)
    text, to_json_s = _timed(spec.to_json.__call__, 1)
    loaded, from_json_s = _timed(lambda: dualgraph.TreeSpec.from_json(text), repeat)
    assert loaded == spec and len(spec.leaves) == leaves
    _, check_s = _timed(lambda: spec.check(tree), repeat)
    results = {
        "describe_s": describe_s,
        "to_json_s": to_json_s,
        "from_json_s": from_json_s,
        "check_s": check_s,
        "json_mb": len(text) / 2**20,
    }
    if memory:
        results["describe_peak_mib"] = _peak(lambda: dualgraph.describe(tree)) / 2**20
        load_peak = _peak(lambda: dualgraph.TreeSpec.from_json(text))
        results["from_json_peak_mib"] = load_peak / 2**20
        results["from_json_peak_per_json_byte"] = load_peak / len(text)
    shape = "flat list" if flat else "tree"
    print(
        f"TreeSpec of a {leaves}-leaf {shape} (JSON {results['json_mb']:.1f} MB), best of {repeat}"
    )
    for name, value in results.items():
        print(f"  {name:<30} {value:8.3f}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also time a 1e6-leaf tree")
    options = parser.parse_args()
    main()
    scale(100_000)
    if options.big:
        scale(1_000_000, repeat=1, memory=False, flat=True)
        big = large_tree(1_000_000)
        start = time.perf_counter()
        try:
            dualgraph.describe(big)
        except dualgraph.DualgraphError as error:
            print(f"1e6 leaves in blocks, refused in {time.perf_counter() - start:.2f} s: {error}")
