"""Test tiers: unit (one op), layer (one decoder block), graph (whole model). Tests marked `gpu` need a
CUDA device and are skipped cleanly without one; everything else runs on the CPU (CI)."""

from __future__ import annotations

import pytest
from hypothesis import settings

settings.register_profile("nanoqwen", deadline=None, max_examples=60)
settings.load_profile("nanoqwen")


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory):
    """`build_many(specs, **kw)` into a fresh kernel cache, JIT enabled: CI really compiles every kernel it
    checks (a warm ~/.cache/nanoqwen would hide a template that no longer compiles)."""
    from nanoqwen import codegen

    def build(specs, **kw):
        mp = pytest.MonkeyPatch()
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        mp.delenv("NANOQWEN_DISABLE_JIT", raising=False)
        try:
            return codegen.build_many(specs, **kw)
        finally:
            mp.undo()
    return build


def pytest_collection_modifyitems(config, items):
    from nanoqwen.backends import cuda_available   # not at the top: conftest loads before the run is configured
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
