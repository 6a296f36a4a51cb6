"""`python -m nanoqwen.bench.serve` end to end on the reference backend (small-py, small prompt sizes): every
editor measurement runs through a real server, the JSON holds each one's server and client times and the
cached tokens the server reported, and the printed report names them. The cached counts are the prefix
cache's policy (runtime/prefix_cache.py) seen from outside."""

from __future__ import annotations

import json

import pytest

from nanoqwen import testmodels
from nanoqwen.bench import serve

SIZES = serve.Editor(cold=8, long=64, tail=16, extra=32)


def test_serve_bench_measures_the_editor_requests(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOQWEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    assert serve.main(["--backend", "reference", "--model", str(testmodels.SMALL_PY_DIR), "--repetitions", "2",
                       "--gen-tokens", "4", "--sizes", ",".join(map(str, vars(SIZES).values())),
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "nanoqwen-bench-serve" and res["protocol"]["sizes"] == vars(SIZES)
    cached = SIZES.long - SIZES.tail
    for key in ("ttft_cold", "ttft_rerequest", "ttft_after_warm_up", "ttft_warm_up_between_keystrokes"):
        t = res[key]
        assert len(t["server_ms"]["samples"]) == 2 and 0 < t["server_ms"]["median"] <= t["client_ms"]["median"], key
    assert res["ttft_rerequest"]["cached_tokens"] == [cached] * 2
    assert res["ttft_after_warm_up"]["cached_tokens"] == [cached] * 2
    # the warm-up of the extra context shared the file's pages and left the file's sequence kept
    assert res["ttft_warm_up_between_keystrokes"]["cached_tokens"] == [cached] * 2
    assert res["stream_tokens_per_s"]["server_vs_engine"] > 0 and set(res["meets"]) == set(res["targets"])
    printed = capsys.readouterr().out
    assert f"TTFT 64 re-requested, {cached} cached" in printed and "between keystrokes" in printed


@pytest.mark.parametrize("sizes", ["8,64,16", "8,64,40,32", "0,64,16,32", "a,b,c,d"])
def test_bad_sizes_are_one_line_errors(sizes, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--backend", "reference", "--sizes", sizes])
    assert e.value.code == 2 and "--sizes" in capsys.readouterr().err
