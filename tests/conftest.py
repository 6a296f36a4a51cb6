"""Test tiers: unit (one op), layer (one decoder block), graph (whole model). Tests marked `gpu` need a
CUDA device and are skipped cleanly without one; everything else runs on the CPU (CI)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest

# What test modules import at their top beyond the runtime (the GPU machine has these and no registry);
# tests of the serve and eval extras check for their own modules.
NEEDED = ("hypothesis", "torch", "transformers")


def pytest_configure(config):
    """The test extra must be installed (one line if not). The whole run uses a cache root of its own
    (kernels, packed models, tuned results), set before any test module is imported: the suite never
    writes into the user's ~/.cache/nanoqwen. $NANOQWEN_TEST_CACHE_DIR names one explicitly (kept after the
    run: tools/gpu_check.sh compiles every kernel into it once for all its test processes)."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(f"the tests need {', '.join(missing)}: pip install -e '.[test]' in the checkout")
    from hypothesis import settings
    from hypothesis.configuration import set_hypothesis_home_dir
    settings.register_profile("nanoqwen", deadline=None, max_examples=60)
    settings.load_profile("nanoqwen")
    chosen = os.environ.get("NANOQWEN_TEST_CACHE_DIR")
    config._nanoqwen_temp_cache = None if chosen else tempfile.mkdtemp(prefix="nanoqwen-test-cache-")
    os.environ["NANOQWEN_CACHE_DIR"] = chosen or config._nanoqwen_temp_cache
    set_hypothesis_home_dir(os.path.join(os.environ["NANOQWEN_CACHE_DIR"], "hypothesis"))  # not ./.hypothesis


def pytest_unconfigure(config):
    if getattr(config, "_nanoqwen_temp_cache", None):
        shutil.rmtree(config._nanoqwen_temp_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory):
    """`build_many(specs, **kw)` into a fresh kernel cache, JIT enabled: CI really compiles every kernel it
    checks (a warm cache would hide a template that no longer compiles)."""
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


@pytest.fixture(scope="session")
def small_py(tmp_path_factory):
    """(path, tokenizer) of the small-py test model packed into a .nanoqwen file of a cache of its own."""
    from nanoqwen import testmodels, tokenizer
    from nanoqwen.modelcache import resolve
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("nq-cache")))
        path = resolve(testmodels.SMALL_PY_DIR, log=lambda m: None)
    return path, tokenizer.load(path)


def pytest_collection_modifyitems(config, items):
    from nanoqwen.backends import cuda_available   # not at the top: conftest loads before the run is configured
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
