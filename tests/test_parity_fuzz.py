"""Differential fuzzing of parity: random torch/JAX pairs that compute the same (parity says OK)
and pairs with one planted difference at a random output (parity fails and names its path)."""

from __future__ import annotations

import random
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualgraph import DualgraphError, DualgraphWarning
from dualgraph.parity import compare

# each output kind, and the differences that can be planted in its torch side
PLANTS: dict[str, list[str]] = {
    "sin": ["value", "grad", "dtype"],
    "scaled": ["none"],
    "int": ["value", "dtype"],
    "none": ["array"],
    "const": ["value"],
    "dict": ["order", "value"],
    "nan": ["position"],
    "inf": ["sign"],
    "bf16": ["value"],
    "same": [],
}
fuzzed = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def _outputs(
    kinds: list[str], on_torch: bool, x: Any, k: Any, plant: tuple[int, str] | None
) -> Any:
    lib: Any = torch if on_torch else jnp
    out: list[Any] = []
    for i, kind in enumerate(kinds):
        p = plant[1] if on_torch and plant is not None and plant[0] == i else None
        if kind == "sin":
            y = lib.sin(x)
            if p == "value":
                y = y + 1e-2
            elif p == "grad":  # the same values, another gradient
                y = y + (x * 0.1 - (x * 0.1).detach())
            elif p == "dtype":
                y = y.double()
            out.append(y)
        elif kind == "scaled":
            out.append(None if p == "none" else x * 3.0)
        elif kind == "int":
            y = k + (2 if p == "value" else 1)
            out.append(y.short() if p == "dtype" else y)
        elif kind == "none":
            out.append(x * 1.0 if p == "array" else None)
        elif kind == "const":
            out.append(3 if p == "value" else 2)
        elif kind == "dict":
            d = {"a": x + 1, "b": x * (2.02 if p == "value" else 2)}
            out.append({"b": d["b"], "a": d["a"]} if p == "order" else d)
        elif kind == "nan":
            at = lib.arange(x.shape[0]) == (1 if p == "position" else 0)
            out.append(lib.where(at, float("nan"), x))
        elif kind == "inf":
            at = lib.arange(x.shape[0]) == 0
            out.append(lib.where(at, float("-inf") if p == "sign" else float("inf"), x))
        elif kind == "bf16":
            scale = 3.1 if p == "value" else 3
            if on_torch:
                out.append((x.to(torch.bfloat16) * scale).float())
            else:
                out.append((x.astype(jnp.bfloat16) * scale).astype(jnp.float32))
        else:
            y = x * 2
            out.append((y, y))
    return tuple(out)


@fuzzed
@given(st.randoms(use_true_random=False))
def test_parity_passes_equal_pairs_and_names_a_planted_difference(r: random.Random) -> None:
    kinds = [r.choice(list(PLANTS)) for _ in range(r.randrange(1, 4))]
    x = np.random.default_rng(r.randrange(1 << 30)).uniform(0.5, 2, size=(4,)).astype(np.float32)
    k = np.arange(4, dtype=np.int32)
    candidates = [(i, p) for i, kind in enumerate(kinds) for p in PLANTS[kind]]
    plant = r.choice(candidates) if candidates and r.random() < 0.7 else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DualgraphWarning)
            report = compare(
                lambda a, b: _outputs(kinds, True, a, b, plant),
                lambda a, b: _outputs(kinds, False, a, b, None),
                (x, k),
            )
        ok, text = report.ok, str(report)
        named = [entry.path for entry in report.failures]  # the table names every leaf
    except DualgraphError as error:  # a difference in structure, dtype, key order
        ok, text = False, str(error)
        named = [text]
    if plant is None:
        assert ok, text
    else:
        assert not ok, (plant, text)
        # A gradient-only difference fails at the input's gradient, any other at its output.
        path = "grad args[0]" if plant[1] == "grad" else f"output[{plant[0]}]"
        assert any(path in found for found in named), (plant, text)
