"""`nanoqwen bench MODEL` end to end on the GPU, short protocol, on the random model with the 7B's layer shapes
(2 layers, the real vocab: a breakdown with realistic kernels in a few seconds): the JSON is complete with
positive figures, the region times of the eager replay add up to the eager step, graph_minus_regions is
graph - sum, the per-kernel profile covers every launch, the in-graph timeline is in the JSON with its chart,
and the PyTorch baselines ran (or say why not)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from nanoqwen.bench import mbu
from nanoqwen.cli.main import main
from nanoqwen.dims import ModelDims

pytestmark = pytest.mark.gpu

P, G = 32, 16


@pytest.fixture(scope="module")
def bench(packed, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", str(packed("7b-shapes")), "--warmup", "1", "--prompt-tokens", str(P), "--gen-tokens", str(G),
            "--repetitions", "2", "--out", str(out / "r.json"), "--profile", str(out / "prof.json"),
            "--plot", str(out / "itl.png"), "--timeline", str(out / "timeline.png")]
    assert main(argv) == 0
    return out, json.loads((out / "r.json").read_text()), json.loads((out / "prof.json").read_text())


def test_json_is_complete_with_positive_figures(bench):
    _out, r, _prof = bench
    assert r["kind"] == "nanoqwen-bench" and r["model"]["synthetic"] and "synthetic" in r["model"]["label"]
    assert r["gpu"]["name"] and r["gpu"]["driver_version"] > 0 and r["gpu"]["lock_clocks"] is False
    assert r["config_hash"] and "clocks_before" in r["gpu"] and "clocks_after" in r["gpu"]
    pp, tg = r["tests"]
    assert (pp["test"], pp["n_prompt"], tg["test"], tg["n_gen"], tg["n_depth"]) == (f"pp{P}", P, f"tg{G}", G, P)
    for t in (pp, tg):
        assert len(t["samples_ts"]) == 2 and t["avg_ts"] > 0 and t["avg_ns"] > 0 and t["stddev_ts"] >= 0
    lat = r["latency"]
    assert 0 < lat["ms_per_token"]["p50"] <= lat["ms_per_token"]["p90"] and lat["ms_per_token"]["n"] == 2 * G
    assert lat["ttft_ms"]["median"] > 0 and r["copy"]["GBps"] > 1000
    m = r["mbu"]
    assert m["bytes_per_token"] == mbu.step_bytes(ModelDims(**r["model"]["dims"]), P + G // 2)
    assert 0 < m["decode_mbu"] < 1.05 and m["floor_ms_per_token"] > 0
    for reg in mbu.REGIONS:   # a region without kernels (rope_append: the QKV GEMV does its work) moves nothing
        moves = m["regions"][reg]["total"] > 0
        assert (r["itl"]["regions_ms"][reg] > 0) == moves and (m["regions"][reg]["mbu"] > 0) == moves, reg
    assert all(m["regions"][reg]["total"] > 0 for reg in mbu.REGIONS if reg != "rope_append")
    print(json.dumps({k: r[k] for k in ("latency", "itl")}, indent=1), file=sys.stderr)


def test_region_times_add_up_to_the_step(bench):
    _out, r, _prof = bench
    it = r["itl"]
    assert it["gated"] and not it["gate_timed_out"], f"eager replay ungated (host time in it): {it['gate_error']}"
    assert it["graph_minus_regions_ms"] == pytest.approx(it["graph_step_ms"] - it["regions_sum_ms"])
    ratio = it["regions_sum_ms"] / it["eager_step_ms"]
    print(f"sum of regions / eager step = {ratio:.3f}, graph step {it['graph_step_ms']:.4f} ms, "
          f"eager {it['eager_step_ms']:.4f} ms, sum {it['regions_sum_ms']:.4f} ms", file=sys.stderr)
    assert 0.7 < ratio < 1.4, it   # events between regions cost ~1-2 us each; PDL overlap can go either way
    assert 0.5 * it["regions_sum_ms"] < it["graph_step_ms"] < 1.5 * it["eager_step_ms"], it


def test_profile_covers_every_launch(bench):
    out, r, prof = bench
    assert len(prof["kernels"]) == r["itl"]["launches"]
    assert [k["index"] for k in prof["kernels"]] == list(range(len(prof["kernels"])))
    assert all(k["us"] > 0 for k in prof["kernels"])
    assert 0.7 < prof["total_us"] / (1e3 * r["itl"]["regions_sum_ms"]) < 1.4
    if importlib.util.find_spec("matplotlib"):
        assert (out / "itl.png").read_bytes()[:4] == b"\x89PNG"


def test_timeline_is_in_the_json_with_its_chart(bench):
    """`--timeline`: the in-graph per-kernel figures (tests/gpu/test_timeline.py checks them in depth)."""
    out, r, _prof = bench
    tl = r["timeline"]
    assert tl["launches"] == r["itl"]["launches"] == len(tl["kernels"]) and tl["context"] == r["itl"]["context"]
    assert 0 < tl["union_us"] <= tl["span_us"] <= tl["timed_graph_step_us"] + 1e-3 * tl["timer_quantum_ns"]
    assert tl["graph_step_us"] > 0 and tl["timer_quantum_ns"] > 0
    if importlib.util.find_spec("matplotlib"):
        assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    print(json.dumps({k: v for k, v in tl.items() if k != "kernels"}, indent=1), file=sys.stderr)


def test_baselines_ran_or_say_why(bench):
    _out, r, _prof = bench
    b = r["baseline"]
    print(json.dumps(b, indent=1)[:4000], file=sys.stderr)
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    tf, g = b["transformers"], b["int4_gemv"]
    if not have_torch:
        assert "skipped" in tf and "skipped" in g
        return
    assert "skipped" not in tf, tf["skipped"]
    assert tf["pp_ms"] > 0 and tf["ms_per_token"] > 0 and tf["cache"] in ("static", "dynamic")
    if "skipped" not in g:
        for row in g["shapes"]:
            assert "skipped" in row or (row["us"] > 0 and row["torch_over_nanoqwen"] > 0), row


def test_prefill_norm_bench_writes_its_json(tmp_path):
    """`python -m nanoqwen.bench.norm`: a time a launch for each M, its bytes over that time below the copy
    bandwidth measured in the same run."""
    from nanoqwen.bench import norm
    norm.main(["--m", "16", "512", "--json", str(tmp_path / "n.json")])
    r = json.loads((tmp_path / "n.json").read_text())
    assert r["kind"] == "nanoqwen-bench-norm" and r["copy_GBps"] > 0
    assert [x["m"] for x in r["norm"]] == [16, 512]
    for x in r["norm"]:
        assert x["launches"] == 56 and x["s"] > 0 and x["bytes"] == x["m"] * 3584 * 6
        assert 0 < x["GBps"] < 1.5 * r["copy_GBps"]


def test_prefill_tile_sweep_keeps_every_rows_bits(tmp_path):
    """`python -m nanoqwen.bench.prefill --tiles`: the INT4 GEMM's tile variants alone, each timed and each giving
    its default tile's bits (every tile but split_k's atomic adds keeps a row's arithmetic: chunk invariance)."""
    from nanoqwen.bench import prefill
    prefill.main(["--m", "8", "--tiles", "--json", str(tmp_path / "p.json")])
    r = json.loads((tmp_path / "p.json").read_text())
    assert r["kind"] == "nanoqwen-bench-prefill" and not r["wgmma"] and not r["gemv_order"] and not r["attention"]
    assert "row_gemv" not in r and {x["role"] for x in r["gemm"]} == {"qkv", "o_proj", "gate_up", "down"}
    for x in r["gemm"]:
        assert x["m"] == 8 and x["s"] > 0, x
        assert x["bits_equal_default"] or "split_k" in x["variant"], f"{x['uri']}: other bits than the default"
