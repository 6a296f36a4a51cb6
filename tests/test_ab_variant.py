"""tools/ab_variant.py: a copy of an A/B tree whose tuned.json gives one GEMV another m = 1 tile, on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _tools import tool

from nanoqwen import config
from nanoqwen.codegen import tuned
from nanoqwen.codegen.kernels import gemv
from nanoqwen.dims import QWEN25_7B

ab_variant = tool("ab_variant")
ROOT = Path(__file__).resolve().parent.parent
KEY = tuned.entry_key("gate_up", QWEN25_7B, config.default(), ab_variant.H100)


@pytest.fixture
def base(tmp_path):
    tree = tmp_path / "base"
    (tree / "tune").mkdir(parents=True)
    shutil.copy(ROOT / "tune" / "tuned.json", tree / "tune" / "tuned.json")
    (tree / "nanoqwen").mkdir()
    (tree / "nanoqwen" / "marker.py").write_text("# the tree's code travels with it\n")
    return tree


def test_variant_changes_one_tile_and_drops_its_row_entries(base, tmp_path):
    before = json.loads((base / "tune" / "tuned.json").read_text())["entries"]
    assert KEY + "_m8" in before
    entry = ab_variant.make_variant(base, tmp_path / "v", "gate_up", "mma=1,lanes=4,rows=2,warps=8,kwarps=8,l2_fetch=256")
    after = json.loads((tmp_path / "v" / "tune" / "tuned.json").read_text())["entries"]
    assert after[KEY] == entry and entry["params"] == before[KEY]["params"] | dict(
        mma=True, lanes=4, rows=2, warps=8, kwarps=8, l2_fetch=256)
    assert not any(k.startswith(KEY + "_m") for k in after)
    assert {k: v for k, v in after.items() if not k.startswith(KEY)} == \
        {k: v for k, v in before.items() if not k.startswith(KEY)}
    assert (tmp_path / "v" / "nanoqwen" / "marker.py").is_file()
    assert json.loads((base / "tune" / "tuned.json").read_text())["entries"] == before   # the base untouched
    spec = gemv.role_spec("gate_up", QWEN25_7B, config.default(), **entry["params"])
    assert spec.mma and spec.l2_fetch == 256


@pytest.mark.parametrize("role, fields, words", [
    ("gate", "rows=2", "unknown role"),
    ("gate_up", "m=4", "not a tile field"),
    ("gate_up", "mma=1,lanes=16", "mma"),           # the tensor-core kernel takes 4 lanes
])
def test_bad_variant_is_refused_before_anything_is_written(base, tmp_path, capsys, role, fields, words):
    assert ab_variant.main([str(base), str(tmp_path / "v"), role, fields]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ab_variant: ") and words in err and err.count("\n") == 1
    assert not (tmp_path / "v").exists()


MMA = "mma=1,lanes=4,rows=2,warps=8,kwarps=8"
ROWS = ROOT / "results" / "tuned-h100-2026-12-06-mma-gate_up-rows.json"   # the tuner's, beside MMA's m = 1 tile


def test_rows_from_brings_the_m_row_tiles_tuned_beside_the_same_kernel(base, tmp_path, monkeypatch):
    cfg = config.default()
    entry = ab_variant.make_variant(base, tmp_path / "v", "gate_up", MMA, rows_from=ROWS)
    after = json.loads((tmp_path / "v" / "tune" / "tuned.json").read_text())["entries"]
    src = json.loads(ROWS.read_text())["entries"]
    one = gemv.role_spec("gate_up", QWEN25_7B, cfg, **entry["params"])
    brought = [m for m in cfg.multirow.buckets[1:] if KEY + f"_m{m}" in after]
    assert brought == [m for m in cfg.multirow.buckets[1:] if KEY + f"_m{m}" in src] == [2, 4, 8]
    for m in brought:
        row = after[KEY + f"_m{m}"]
        assert row["params"] == src[KEY + f"_m{m}"]["params"] and row["base_uri"] == one.uri
    # what a session on the H100 builds from the variant's store: the tensor-core kernel and the m-row tiles tuned
    monkeypatch.setattr(tuned.tuned_store, "merged_entries", lambda: after)
    assert tuned.role_spec("gate_up", QWEN25_7B, cfg, ab_variant.H100) == one
    for m in brought:
        tile = src[KEY + f"_m{m}"]["params"]
        want = gemv.multirow_spec(one, m, cfg, tile=tile)
        assert tuned.role_spec("gate_up", QWEN25_7B, cfg, ab_variant.H100, m) == want != gemv.multirow_spec(one, m, cfg)


def test_rows_from_a_file_tuned_beside_another_kernel_is_refused(base, tmp_path, capsys):
    args = [str(base), str(tmp_path / "v"), "gate_up", MMA.replace("kwarps=8", "kwarps=4"), "--rows-from", str(ROWS)]
    assert ab_variant.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ab_variant: ") and "another kernel" in err and err.count("\n") == 1
    assert not (tmp_path / "v").exists()
