"""`python -m nanoqwen.bench.serve --concurrency` end to end on the reference backend (small-py, tiny
prompts): one server, every level of clients, the TTFT under load, the JSON and the printed table."""

from __future__ import annotations

import json

from nanoqwen import testmodels
from nanoqwen.bench import concurrency, serve


def test_concurrency_mode_measures_every_level(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "conc.json"
    assert serve.main(["--concurrency", "--backend", "reference", "--model", str(testmodels.SMALL_PY_DIR),
                       "--prompt-tokens", "8", "--gen-tokens", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "nanoqwen-bench-serve-concurrency" and res["backend"] == "reference"
    assert res["max_running"] == 16   # the reference engine batches: the server took --max-running 16
    assert [lv["clients"] for lv in res["levels"]] == list(concurrency.LEVELS)
    for lv in res["levels"]:
        assert lv["tokens"] == 4 * lv["clients"]
        assert abs(lv["aggregate_tokens_per_s"] - lv["tokens"] / lv["wall_s"]) < 1e-6
        assert 0 < lv["itl_ms"]["p50"] <= lv["itl_ms"]["p99"]
    t = res["ttft_with_7_decoding"]
    assert 0 < t["server_ms"] <= t["client_ms"]
    printed = capsys.readouterr().out
    assert "clients | aggregate t/s" in printed and "TTFT while 7 streams decode" in printed


def test_percentile_and_report():
    assert concurrency.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    res = {"levels": [{"clients": 2, "aggregate_tokens_per_s": 10.0, "itl_ms": {"p50": 1.0, "p99": 2.0}}],
           "ttft_with_7_decoding": {"server_ms": 3.0, "client_ms": 4.0}}
    assert concurrency.report(res).splitlines()[2].split("|")[0].strip() == "2"
    res["ttft_with_7_decoding"] = {"skipped": "the server runs 1 sequence(s) at once"}
    assert concurrency.report(res).splitlines()[-1] == ("TTFT while 7 streams decode: not measured "
                                                       "(the server runs 1 sequence(s) at once)")
