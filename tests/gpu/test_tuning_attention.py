"""`nanoqwen-tune --kernels attention`'s sweep on the GPU, on the tiny model's attention (1 KV head x 7) at
two short contexts: every m = 1 candidate is checked against the numpy attention and timed, the winner is
stored with the config's fields beside it; the m = 2 sweep then keeps that kernel's rounding, each of its
rows bitwise the m = 1 kernels' on that row alone, and stores its ring beside the m = 1 kernel's URI."""

from __future__ import annotations

import json

import pytest

from nanoqwen import config
from nanoqwen.codegen import tuned
from nanoqwen.codegen.kernels import attention as A
from nanoqwen.testmodels import tiny_dims
from nanoqwen.tuning import space
from nanoqwen.tuning.attention import tune_attention

pytestmark = pytest.mark.gpu

CFG = config.default()
CONTEXTS = (40, 300)


def test_attention_sweep_stores_a_checked_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))   # progress and the user's file
    out, dims, lines = tmp_path / "tuned.json", tiny_dims(), []
    summary = tune_attention(dims, CFG, budget_s=300, log=lines.append, out=out, contexts=CONTEXTS)
    print("\n".join(lines))
    assert not any("DISCARDED" in line for line in lines), "a candidate of the space computes wrong"
    cands, _ = space.attention_candidates(dims, CFG)
    (row,) = summary
    assert row["entry"]["judged"] == len(cands) and row["us"] <= row["default_us"]
    assert row["params"] in [p for p, _ in cands] and set(row["params"]) == set(A.SINGLE_ROW_TILE)
    entries = json.loads(out.read_text())["entries"]
    gpu = next(iter(entries)).split("|")[0]
    (entry,) = entries.values()
    assert entry["params"] == row["params"] and list(entries) == [tuned.attention_key(dims, CFG, gpu)]

    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path))   # the m = 2 sweep reads the m = 1 entry there
    user = tuned.tuned_store.user_path()
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(out.read_text())
    tuned.tuned_store.merged_entries.cache_clear()
    lines.clear()
    (rows,) = tune_attention(dims, CFG, budget_s=300, log=lines.append, out=out, m=2, contexts=CONTEXTS)
    print("\n".join(lines))
    assert not any("DISCARDED" in line for line in lines), "an m = 2 ring changed a row's bits"
    base = A.decode_specs(dims, CFG, one=row["params"])[1]
    assert rows["entry"]["base_uri"] == base.uri and set(rows["params"]) == set(A.MULTIROW_TILE)
    tuned.tuned_store.merged_entries.cache_clear()
