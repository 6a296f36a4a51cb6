"""`nanoqwen serve --speculate lookup`, in-process on the reference engine (small-py): the same text as plain
greedy, the draft tokens in usage.completion_tokens_details (OpenAI's accepted / rejected prediction
tokens) and in the /metrics counters; a server that does not speculate leaves the details out. The text
comparison is class (a) of docs/architecture.md (the reference's verify rows are its decode steps)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from _serve_util import serve_in_process, server as start_server

from nanoqwen import testmodels
from nanoqwen.backends import ReferenceEngine
from nanoqwen.cli.main import main
from nanoqwen.runtime.drafters import PromptLookup

PROMPT = "def add_all(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n\n\n" \
         "def add_all(values):\n"
BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 20, "temperature": 0}


def serve(small_py, speculate):
    path, tok = small_py
    return serve_in_process(lambda: (ReferenceEngine(path, context=256, speculate=speculate), tok))


def counter(client, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.M)
    assert m, name
    return float(m[1])


def test_usage_and_metrics_count_drafts(small_py):
    plain = serve(small_py, None).post("/v1/completions", json=BODY).json()
    assert "completion_tokens_details" not in plain["usage"]
    client = serve(small_py, PromptLookup(max_draft=5))
    totals = [0, 0]
    for body in (BODY, BODY | {"prompt": PROMPT + "    total = 0\n"}):
        r = client.post("/v1/completions", json=body).json()
        if body is BODY:
            assert r["choices"][0]["text"] == plain["choices"][0]["text"]
        details = r["usage"]["completion_tokens_details"]
        accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
        assert accepted >= 0 and rejected >= 0
        totals = [totals[0] + accepted + rejected, totals[1] + accepted]
    assert totals[1] > 0
    assert counter(client, "nanoqwen_spec_decode_num_draft_tokens_total") == totals[0]
    assert counter(client, "nanoqwen_spec_decode_num_accepted_tokens_total") == totals[1]
    sampled = client.post("/v1/completions", json=BODY | {"temperature": 0.8, "seed": 3}).json()
    assert sampled["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                             "rejected_prediction_tokens": 0}


def test_streamed_usage_carries_the_details(small_py):
    client = serve(small_py, PromptLookup())
    want = client.post("/v1/completions", json=BODY).json()["usage"]
    with client.stream("POST", "/v1/completions",
                       json=BODY | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1].removeprefix("data: "))["usage"]
    # the repeat reuses the prompt's K/V but drafts the same way: the same counts
    assert usage["completion_tokens_details"] == want["completion_tokens_details"]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize("kind", ["lookup", f"draft:{testmodels.SMALL_PY_DIR}"])
def test_serve_command_speculates(tmp_path, kind):
    """`nanoqwen serve --speculate KIND --draft-tokens 4`, a real process: the option reaches the engine
    (the model as its own draft model: every draft accepted)."""
    s = start_server(testmodels.SMALL_PY_DIR, "--speculate", kind, "--draft-tokens", "4", "--model-name", "m",
                     cache_dir=tmp_path)
    try:
        r = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=120).json()
        details = r["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        if kind != "lookup":
            assert details["rejected_prediction_tokens"] == 0
        assert s.metric("nanoqwen_spec_decode_num_accepted_tokens_total") == details["accepted_prediction_tokens"]
        assert s.metric("nanoqwen_spec_decode_num_draft_tokens_total") == \
            details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    finally:
        s.close()


def test_serve_refuses_bad_draft_tokens(capsys):
    rc = main(["serve", str(testmodels.SMALL_PY_DIR), "--speculate", "lookup", "--draft-tokens", "99"])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("error: --draft-tokens must be in [1, 64], got 99")
