"""The test suite writes only to temporary directories: conftest gives the whole run a cache root of its
own before any test module is imported (or the one $NANOQWEN_TEST_CACHE_DIR names), and removes it
afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from nanoqwen import config

TESTS = Path(__file__).resolve().parent

INNER = '''
from hypothesis import given, strategies as st

from nanoqwen import codegen, config
from nanoqwen.codegen.kernels.copy import CopySpec

@given(st.integers())
def test_hypothesis_keeps_its_files_out_of_the_cwd(n):
    assert isinstance(n, int)

def test_build_writes_the_cache():
    built = codegen.build(CopySpec())
    assert built.path.is_file() and built.path.is_relative_to(config.cache_root())
    print(f"CACHE_ROOT={config.cache_root()}")
'''


def test_this_run_uses_a_temporary_cache_root():
    root, chosen = config.cache_root(), os.environ.get("NANOQWEN_TEST_CACHE_DIR")
    if chosen:
        assert root == Path(chosen)
    else:
        assert root.parent == Path(tempfile.gettempdir()) and root.name.startswith("nanoqwen-test-cache-")
    assert root != Path("~/.cache/nanoqwen").expanduser()


def test_a_session_building_kernels_leaves_home_untouched(tmp_path):
    """A pytest session with this conftest, run with no NANOQWEN_CACHE_DIR and a fresh HOME, compiles a
    kernel and runs a hypothesis test: nothing appears under HOME or in the working directory, and the
    session's cache root is gone when it ends."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NANOQWEN_CACHE_DIR", "NANOQWEN_TEST_CACHE_DIR", "NANOQWEN_DISABLE_JIT")}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
               PYTHONDONTWRITEBYTECODE="1")   # Python's own __pycache__ is not what this test is about
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    inner_root = Path(re.search(r"CACHE_ROOT=(\S+)", res.stdout)[1])
    assert inner_root.name.startswith("nanoqwen-test-cache-") and inner_root.parent == Path(tempfile.gettempdir())
    assert not inner_root.exists()
    assert list(home.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "test_inner.py"]
