"""nanoqwen-tune on the CPU: search-space constraints (the GEMVs' and the decode attention's), the m-row
spill rule (NVRTC compiles here), the tuned-results store (atomic merge, stale and missing entries fall back
to the config with a notice), the decoder taking tuned attention fields, and the CLI's argument errors. The
GPU sweeps themselves run in tools/gpu_check.sh (tests/gpu/test_tuning_attention.py runs the attention's on
the tiny model)."""

from __future__ import annotations

import json

import pytest

from nanoqwen import config, paths
from nanoqwen.cli import tune as tune_cli
from nanoqwen.codegen.kernels import attention, gemv
from nanoqwen.dims import QWEN25_7B
from nanoqwen.codegen import tuned
from nanoqwen.codegen import tuned_store as store
from nanoqwen.codegen.spec import SpecError
from nanoqwen.tuning import space

CFG = config.default()


@pytest.mark.parametrize("role", gemv.ROLES)
def test_candidates_are_valid_distinct_and_start_with_the_default(role):
    cands, ruled_out = space.gemv_candidates(role, QWEN25_7B, CFG)
    assert cands[0] == gemv.role_spec(role, QWEN25_7B, CFG)
    assert len(set(cands)) == len(cands) > 1
    for spec in cands:
        spec.validate()
        assert (spec.n, spec.k) == gemv.role_shape(role, QWEN25_7B)
    assert ruled_out > 0   # e.g. rows that do not divide the shape, too many loads in flight
    assert any(s.splitk > 1 for s in cands)   # every epilogue takes K splits (split 0 applies it)
    for spec in cands[1:]:   # a stored m = 1 tile must re-tile for every multirow bucket: the decoder builds them
        for m in CFG.multirow.buckets:
            gemv.multirow_spec(spec, m, CFG)


def test_tiles_the_multirow_step_cannot_retile_are_ruled_out():
    """A tensor-core down GEMV with one split stages all 18944 inputs of each of 16 rows (606 KB): valid at
    m = 1, impossible at m = 16, so no sweep may store it."""
    one = gemv.role_spec("down", QWEN25_7B, CFG, mma=True, lanes=4, rows=2, splitk=1, unroll=1)
    with pytest.raises(SpecError, match="rows of x"):
        gemv.multirow_spec(one, max(CFG.multirow.buckets), CFG)
    cands, _ = space.gemv_candidates("down", QWEN25_7B, CFG, names=("gemv_int4_mma",))
    assert one not in cands and all(s.splitk > 1 for s in cands[1:] if s.mma)


def test_a_tile_whose_m_row_kernels_spill_is_passed_over():
    """The H100's fastest qkv tile of 2026-12-05 (4 rows a 16-lane group, 4.27 us) compiles clean at m = 1 but
    its m = 4 kernel spills (255 registers, 28 bytes spilled); the sweep stores the next fastest instead."""
    from nanoqwen.tuning import sweep
    spills = gemv.role_spec("qkv", QWEN25_7B, CFG, lanes=16, rows=4, warps=4, tiles_per_warp=1, splitk=1)
    clean = gemv.role_spec("qkv", QWEN25_7B, CFG)
    assert sweep.retiling_spills(spills, CFG) == 4 and sweep.retiling_spills(clean, CFG) is None
    lines = []
    judged = [(clean, {"us": 4.5}), (spills, {"us": 4.27})]
    assert sweep.fastest_retilable(judged, CFG, lines.append) == judged[0]
    assert lines == [f"  ruled out {spills.uri} (4.27 us): its m = 4 kernel spills"]


def test_the_kernel_run_now_competes_second():
    """A sweep starts from the config default and what this GPU runs now (its tuned entry), so it never
    stores anything slower than either; a current kernel the space already holds is not repeated."""
    default = gemv.role_spec("down", QWEN25_7B, CFG)
    current = gemv.role_spec("down", QWEN25_7B, CFG, rows=1, warps=8, tiles_per_warp=3)   # outside the space
    cands, _ = space.gemv_candidates("down", QWEN25_7B, CFG, current=current)
    assert cands[:2] == [default, current] and len(set(cands)) == len(cands)
    inside = cands[5]
    again, _ = space.gemv_candidates("down", QWEN25_7B, CFG, current=inside)
    assert again.count(inside) == 1 and again[1] != inside


@pytest.fixture
def tmp_store(tmp_path, monkeypatch):
    """The user's tuned results under a fresh cache root (the shipped file is read beside it, never written)."""
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path))
    store.merged_entries.cache_clear()
    tuned._notice_once.cache_clear()
    yield store.user_path()
    store.merged_entries.cache_clear()


def test_tuned_entry_is_used_missing_and_stale_fall_back(tmp_store, capsys):
    gpu = "Test GPU"
    default = gemv.role_spec("qkv", QWEN25_7B, CFG)
    assert tuned.role_spec("qkv", QWEN25_7B, CFG, gpu) == default
    assert "no tuned qkv GEMV for Test GPU" in capsys.readouterr().err
    key = tuned.entry_key("qkv", QWEN25_7B, CFG, gpu)
    store.merge_write({key: {"params": {"rows": 2, "lanes": 32, "warps": 4}}}, {"gpu": gpu}, tmp_store)
    spec = tuned.role_spec("qkv", QWEN25_7B, CFG, gpu)
    assert (spec.rows, spec.lanes, spec.warps) == (2, 32, 4) and spec != default
    assert spec in tuned.tuned_specs(QWEN25_7B, CFG)
    store.merge_write({key: {"params": {"rows": 3}}}, {}, tmp_store)          # rows 3 is impossible
    assert tuned.role_spec("qkv", QWEN25_7B, CFG, gpu) == default
    assert "stale tuned entry" in capsys.readouterr().err


@pytest.mark.parametrize("role", gemv.ROLES)
def test_multirow_candidates_keep_the_single_row_order(role):
    """The m-row sweep starts with the default re-tiling and keeps the m = 1 kernel's order fields in every
    candidate."""
    one = gemv.role_spec(role, QWEN25_7B, CFG)
    cands, _ = space.multirow_candidates(one, 8, CFG)
    assert cands[0] == gemv.multirow_spec(one, 8, CFG) and len(set(cands)) == len(cands) > 1
    for spec in cands:
        assert (spec.m, spec.lanes, spec.splitk, spec.k, spec.n) == (8, one.lanes, one.splitk, one.k, one.n)
    assert any(s.prefetch for s in cands) and {s.rows for s in cands} > {one.rows}
    assert {s.warps for s in cands} >= {4, 8, 16}
    assert space.tile_params(cands[-1]).keys() == set(gemv.MULTIROW_TILE)


def test_multirow_candidates_of_a_kwarps_kernel_rule_out_fewer_warps():
    """A tensor-core kernel whose tiles take kwarps = 8 warps: m-row tiles of fewer warps are ruled out by
    validate() (a clear SpecError), not a division by zero tile groups."""
    one = gemv.role_spec("gate_up", QWEN25_7B, CFG, mma=True, lanes=4, rows=2, warps=8, kwarps=8)
    with pytest.raises(SpecError, match="kwarps"):
        gemv.multirow_spec(one, 4, CFG, tile={"warps": 4})
    cands, rejected = space.multirow_candidates(one, 4, CFG)
    assert rejected > 0 and {s.warps for s in cands} == {8, 16}


def test_multirow_entry_holds_beside_its_single_row_kernel(tmp_store, capsys):
    """An m-row entry is used with the m = 1 kernel it was tuned beside; none: the default re-tiling without a
    notice; tuned beside another m = 1 kernel: stale, default, one notice."""
    gpu = "Test GPU"
    one = gemv.role_spec("down", QWEN25_7B, CFG)
    assert tuned.role_spec("down", QWEN25_7B, CFG, gpu, 8) == gemv.multirow_spec(one, 8, CFG)
    capsys.readouterr()
    tile = {"rows": 1, "warps": 8, "unroll": 1, "prefetch": True}
    key = tuned.entry_key("down", QWEN25_7B, CFG, gpu, 8)
    assert key.endswith("|down|n3584_k18944_m8") and key != tuned.entry_key("down", QWEN25_7B, CFG, gpu)
    store.merge_write({key: {"params": tile, "base_uri": one.uri, "m": 8}}, {"gpu": gpu}, tmp_store)
    spec = tuned.role_spec("down", QWEN25_7B, CFG, gpu, 8)
    assert spec == gemv.multirow_spec(one, 8, CFG, tile=tile) and spec.prefetch
    assert spec in tuned.tuned_specs(QWEN25_7B, CFG)
    assert tuned.role_spec("down", QWEN25_7B, CFG, gpu, 4) == gemv.multirow_spec(one, 4, CFG)   # other buckets
    assert "stale" not in capsys.readouterr().err
    store.merge_write({key: {"params": tile, "base_uri": "gemv_int4_other", "m": 8}}, {}, tmp_store)
    assert tuned.role_spec("down", QWEN25_7B, CFG, gpu, 8) == gemv.multirow_spec(one, 8, CFG)
    assert "tuned beside another m = 1 kernel" in capsys.readouterr().err


def test_merge_keeps_other_entries_and_leaves_no_temp_files(tmp_store):
    store.merge_write({"a": {"params": {}}}, {"gpu": "x"}, tmp_store)
    store.merge_write({"b": {"params": {}}}, {"gpu": "y"}, tmp_store)
    data = json.loads(tmp_store.read_text())
    assert set(data["entries"]) == {"a", "b"} and data["meta"]["gpu"] == "y"
    assert [p.name for p in tmp_store.parent.iterdir()] == ["tuned.json"]


def test_user_results_override_shipped_ones_per_key(tmp_store, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"meta": {"format": store.FORMAT},
                                   "entries": {"a": {"params": {"rows": 1}}, "b": {"params": {"rows": 2}}}}))
    monkeypatch.setattr(store, "shipped_path", lambda: shipped)
    before = shipped.read_bytes()
    store.merge_write({"a": {"params": {"rows": 4}}}, {"gpu": "x"})       # default target: the user's file
    assert json.loads(tmp_store.read_text())["entries"] == {"a": {"params": {"rows": 4}}}
    assert shipped.read_bytes() == before
    assert store.load()["entries"] == {"a": {"params": {"rows": 4}}, "b": {"params": {"rows": 2}}}
    assert store.lookup_params("a") == {"rows": 4} and store.lookup_params("b") == {"rows": 2}


@pytest.mark.parametrize("argv,where", [([], "user"), (["--repo"], "repo")])
def test_cli_writes_the_user_file_unless_told_repo(argv, where, tmp_store, monkeypatch):
    from nanoqwen.tuning import sweep
    seen = {}

    def fake_tune(*args, out, **kwargs):   # the GPU sweep itself runs in tools/gpu_check.sh
        seen["out"] = out
        return []
    monkeypatch.setattr(sweep, "tune", fake_tune)
    assert tune_cli.main(["--roles", "qkv", *argv]) == 0
    want = tmp_store if where == "user" else paths.checkout() / "tune" / "tuned.json"
    assert seen["out"] == want


@pytest.mark.parametrize("m", [1, 16])
def test_compile_only_builds_what_the_sweep_would_and_counts_failures(m, tmp_store, monkeypatch, capsys):
    from nanoqwen import codegen
    from nanoqwen.tuning import sweep
    cfg, gpu = config.default(), "NVIDIA H100 80GB HBM3"
    built = []

    def fake_build_many(specs, return_exceptions, **kw):   # real compiles: tests/test_kernels_compile.py
        built.append(list(specs))
        return [SpecError("too many registers") if i == 1 else object() for i in range(len(specs))]
    monkeypatch.setattr(codegen, "build_many", fake_build_many)
    assert tune_cli.main(["--compile-only", gpu, "--roles", "o_proj", "--rows", str(m)]) == 1
    one, cands = sweep.candidates("o_proj", QWEN25_7B, cfg, gpu, m)
    assert built == [cands + [one] * (m > 1)] and len(cands) > 10
    out = capsys.readouterr().out
    assert f"{cands[1].uri}: compile error: too many registers" in out
    assert f"{len(built[0]) - 1}/{len(built[0])} kernels in the cache for {gpu}" in out


def test_compile_only_is_the_gemv_sweep_only(capsys):
    assert tune_cli.main(["--compile-only", "NVIDIA H200", "--kernels", "attention"]) == 1
    err = capsys.readouterr().err
    assert "the GEMV sweep only" in err and err.count("\n") == 1


def test_cli_repo_without_a_checkout_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(paths, "checkout", lambda: None)
    assert tune_cli.main(["--repo"]) == 1
    err = capsys.readouterr().err
    assert "no source checkout" in err and err.count("\n") == 1


def test_unknown_format_is_a_clear_error(tmp_path):
    p = tmp_path / "tuned.json"
    p.write_text(json.dumps({"meta": {"format": 99}, "entries": {}}))
    with pytest.raises(store.StoreError, match="unknown format"):
        store.load(p)


@pytest.mark.parametrize("argv,msg", [(["--kernels", "gemv,prefill"], "no tuner for prefill"),
                                      (["--roles", "qkv,lm"], "unknown role"),
                                      (["--budget", "0"], "must be positive"),
                                      (["--rows", "3"], "not a list of multirow buckets"),
                                      (["--rows", "8,x"], "not a list of multirow buckets")])
def test_cli_errors_are_one_line(argv, msg, capsys):
    assert tune_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


# ---- the decode attention ----------------------------------------------------------------------------------

def test_attention_candidates_start_with_the_config_and_keep_the_single_row_rounding():
    cands, ruled_out = space.attention_candidates(QWEN25_7B, CFG)
    a = CFG.attention
    assert cands[0] == ({n: getattr(a, n) for n in attention.SINGLE_ROW_TILE}, attention.decode_specs(QWEN25_7B, CFG)[1:])
    assert ruled_out > 0 and len({pair for _, pair in cands}) == len(cands) > 1
    assert {p["pipeline"] for p, _ in cands} == {"mma", "bulk"} and {d.splits for _, (d, _c) in cands} == {33, 66, 99}
    for params, (dec, comb) in cands:
        assert set(params) == set(attention.SINGLE_ROW_TILE) and dec.splits == comb.splits
        assert (dec, comb) == attention.decode_specs(QWEN25_7B, CFG, one=params)[1:]
    one = cands[-1][0]
    rows, _ = space.attention_candidates(QWEN25_7B, CFG, m=8, one=one)
    base = attention.decode_specs(QWEN25_7B, CFG, one=one)[1]
    assert len(rows) > 1 and rows[0][0] == {"stages": CFG.multirow.attention_stages,
                                            "ctas_per_sm": CFG.multirow.attention_ctas_per_sm}
    for params, (dec, comb) in rows:
        assert set(params) == set(attention.MULTIROW_TILE) and dec.m == comb.m == 8
        assert (dec.splits, dec.pipeline, dec.consumer_warps) == (base.splits, base.pipeline, base.consumer_warps)


def test_attention_current_fields_compete_second():
    """What this GPU runs now (its tuned entry) competes second when the space lacks it, once when the
    space has it, not at all when it is stale."""
    outside = {"pipeline": "bulk", "consumer_warps": 4, "stages": 3, "ctas_per_sm": 1}
    cands, _ = space.attention_candidates(QWEN25_7B, CFG, current={"pipeline": "bulk", "stages": 3})
    assert cands[1][0] == outside and [p for p, _ in cands].count(outside) == 1
    inside = {"pipeline": "mma", "consumer_warps": 2, "stages": 6, "ctas_per_sm": 2}
    cands, _ = space.attention_candidates(QWEN25_7B, CFG, current=inside)
    assert [p for p, _ in cands].count(inside) == 1 and cands[1][0] != inside
    stale, _ = space.attention_candidates(QWEN25_7B, CFG, current={"stages": 9})
    assert [p for p, _ in stale] == [p for p, _ in space.attention_candidates(QWEN25_7B, CFG)[0]]


def test_tuned_attention_fields_are_used_and_stale_ones_fall_back(tmp_store, capsys):
    gpu = "Test GPU"
    default = attention.decode_specs(QWEN25_7B, CFG)
    assert tuned.attention_specs(QWEN25_7B, CFG, gpu) == default
    assert capsys.readouterr().err == "", "a missing attention entry is no news: the config's is measured"
    key = tuned.attention_key(QWEN25_7B, CFG, gpu)
    assert key.endswith("|attention_decode|decode|n3584_k512")
    store.merge_write({key: {"params": {"stages": 4, "ctas_per_sm": 2}}}, {"gpu": gpu}, tmp_store)
    rope, dec, comb = tuned.attention_specs(QWEN25_7B, CFG, gpu)
    assert (dec.stages, dec.splits, comb.splits, rope) == (4, 66, 66, default[0])
    rows = tuned.attention_specs(QWEN25_7B, CFG, gpu, 8)
    assert rows[1].splits == rows[2].splits == 66 and rows[1].m == 8, "the m-row kernels keep the tuned splits"
    from nanoqwen.runtime.decoder import step_specs
    assert step_specs(QWEN25_7B, CFG, gpu)["attention_decode"] == dec
    assert dec in tuned.tuned_attention_specs(QWEN25_7B, CFG) and rows[1] in tuned.tuned_attention_specs(QWEN25_7B, CFG)
    store.merge_write({key: {"params": {"stages": 3}}}, {}, tmp_store)   # mma: stages a multiple of 4
    assert tuned.attention_specs(QWEN25_7B, CFG, gpu) == default
    assert "stale tuned entry" in capsys.readouterr().err
    store.merge_write({key: {"params": {"warps": 3}}}, {}, tmp_store)    # no such field
    tuned._notice_once.cache_clear()
    assert tuned.attention_specs(QWEN25_7B, CFG, gpu) == default
    assert "not a tunable field" in capsys.readouterr().err


def test_multirow_attention_entry_holds_beside_its_single_row_kernel(tmp_store, capsys):
    gpu = "Test GPU"
    base = attention.decode_specs(QWEN25_7B, CFG)[1]
    key = tuned.attention_key(QWEN25_7B, CFG, gpu, 8)
    tile = {"stages": 8, "ctas_per_sm": 2}
    store.merge_write({key: {"params": tile, "base_uri": base.uri, "m": 8}}, {"gpu": gpu}, tmp_store)
    assert tuned.attention_specs(QWEN25_7B, CFG, gpu, 8) == attention.decode_specs(QWEN25_7B, CFG, m=8, tile=tile)
    assert tuned.attention_specs(QWEN25_7B, CFG, gpu, 4) == attention.decode_specs(QWEN25_7B, CFG, m=4)
    assert capsys.readouterr().err == ""
    one_key = tuned.attention_key(QWEN25_7B, CFG, gpu)
    store.merge_write({one_key: {"params": {"ctas_per_sm": 2}}}, {}, tmp_store)   # a re-tuned m = 1 kernel
    assert tuned.attention_specs(QWEN25_7B, CFG, gpu, 8) == attention.decode_specs(
        QWEN25_7B, CFG, m=8, one={"ctas_per_sm": 2})
    assert "tuned beside another m = 1 attention" in capsys.readouterr().err


def test_cli_tunes_the_attention_beside_the_gemvs(tmp_store, monkeypatch):
    from nanoqwen.tuning import attention as tune_attention, sweep
    calls = []
    monkeypatch.setattr(sweep, "tune", lambda *a, m, budget_s=None, **kw: calls.append(("gemv", m, a[3])) or [])
    monkeypatch.setattr(tune_attention, "tune_attention",
                        lambda dims, cfg, budget, m, out, log: calls.append(("attention", m, budget)) or [])
    assert tune_cli.main(["--kernels", "gemv,attention", "--rows", "1,8", "--budget", "400"]) == 0
    assert calls == [("gemv", 1, 100.0), ("gemv", 8, 100.0), ("attention", 1, 100.0), ("attention", 8, 100.0)]
