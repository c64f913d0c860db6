"""Shared pytest setup: tests marked ``cuda`` skip cleanly where no CUDA device is usable."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_items:
        item.add_marker(skip)
