"""Time TreeSpec.flatten / unflatten / check on a 16-array-leaf tree (CPU, numpy leaves).

Run: ``python benchmarks/bench_spec.py``. Goals (issue 2): flatten + unflatten < 10 us,
check < 5 us. Prints medians over interleaved rounds.
"""

from __future__ import annotations

import statistics
import timeit

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


def main(rounds: int = 7, number: int = 20000) -> dict[str, float]:
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


if __name__ == "__main__":
    main()
