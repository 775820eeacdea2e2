"""Shared fixtures; `gpu` tests are skipped where CuPy finds no device."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device found by CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
