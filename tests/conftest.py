"""Test tiers: unit (one op), layer (one decoder block), graph (whole model). Tests marked `gpu` need a
CUDA device and are skipped cleanly without one; everything else runs on the CPU (CI)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import settings

settings.register_profile("nanoqwen", deadline=None, max_examples=60)
settings.load_profile("nanoqwen")


@functools.cache
def gpu_available() -> bool:
    try:
        from cuda.bindings import driver
    except ImportError:
        return False
    try:
        err, = driver.cuInit(0)
    except Exception:  # noqa: BLE001 - cuda-bindings 13 raises when libcuda itself is absent
        return False
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    err, n = driver.cuDeviceGetCount()
    return err == driver.CUresult.CUDA_SUCCESS and n > 0


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
