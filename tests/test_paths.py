"""Where files live (nanoqwen/paths.py): the installed package's own _data/ first, a source checkout's
top-level folders otherwise, a one-line error when neither is there; writable state under the cache root.
The installed case end to end is .ci/run's wheel smoke test."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoqwen import NanoqwenError, config, paths


@pytest.fixture
def package_at(monkeypatch):
    """Pretend the package lives in another folder (data_dir() is cached: cleared around the test)."""
    def move(directory: Path) -> None:
        monkeypatch.setattr(paths, "PACKAGE_DIR", directory)
        paths.data_dir.cache_clear()
    yield move
    paths.data_dir.cache_clear()


def test_a_checkout_reads_its_top_level_folders():
    top = Path(__file__).resolve().parents[1]
    assert paths.checkout() == top and paths.data_dir() == top
    assert paths.data_path("config", "nanoqwen.yaml") == top / "config" / "nanoqwen.yaml"


def test_installed_package_data_comes_first(tmp_path, package_at):
    site = tmp_path / "site-packages"
    (site / "nanoqwen" / "_data" / "config").mkdir(parents=True)
    (site / "pyproject.toml").write_text("")        # even beside a pyproject.toml: _data/ wins
    (site / "templates").mkdir()
    package_at(site / "nanoqwen")
    assert paths.data_path("config") == site / "nanoqwen" / "_data" / "config"


def test_missing_package_data_is_one_line(tmp_path, package_at):
    (tmp_path / "nanoqwen").mkdir()
    package_at(tmp_path / "nanoqwen")
    assert paths.checkout() is None
    with pytest.raises(NanoqwenError, match=r"package data missing \(a broken install: reinstall nanoqwen\)$"):
        paths.data_dir()


def test_cache_root_is_the_env_else_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path))
    assert config.cache_root() == tmp_path
    monkeypatch.delenv("NANOQWEN_CACHE_DIR")
    assert config.cache_root() == Path(config.default().codegen.cache_dir).expanduser()
