"""Prompt logprobs with `echo` on /v1/completions, against the real server process (reference backend, the
small test model) through the official `openai` client: every echoed token's logprob and top logprobs are
the reference's log-softmax at that position, exactly (class (a) of docs/architecture.md: the server's
prompt rows are single decode steps, the same numpy calls as the local `extend` here), the first prompt
token's null; whole, streamed, after a reused prefix and with max_tokens 0 (scoring a prompt). An engine
that cannot give every prompt position's logits, and a fill-in-the-middle prompt, are 400s naming `echo`."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from _serve_util import ScriptedEngine, greedy, model_fixtures, serve_in_process, server as start_server

PROMPT = "import os\n\ndef read_lines(path):\n    "


model, local, backend = model_fixtures("echo")


@pytest.fixture(scope="module")
def client(model, local):
    s = start_server(model[0], backend="reference", cache_dir=model[1])
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
    s.close()


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def expected(local, ids: list[int], k: int) -> tuple[list, list, list]:
    """(token texts, logprobs with None first, top-k dicts with None first) of ``ids`` scored as one
    sequence by the reference: row i of its logits scores token i + 1."""
    engine, tok, _ = local
    rows = engine.ref.sequence(len(ids)).extend(ids)
    lps, tops = [None], [None]
    for i, t in enumerate(ids[1:]):
        lp = log_softmax(rows[i])
        lps.append(float(lp[t]))
        best = np.argsort(-lp, kind="stable")[:k]
        tops.append({tok.decode([int(j)]): float(lp[j]) for j in best})
    return [tok.decode([t]) for t in ids], lps, tops


def test_echo_scores_the_prompt_then_the_completion(client, local):
    engine, tok, stop = local
    ids = tok.encode(PROMPT)
    gen = greedy(engine, stop, ids, 4)
    assert len(gen) == 4 and not set(gen) & stop   # the check below covers 4 generated tokens
    client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)   # kept: a prefix to reuse
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=3)
    c = r.choices[0]
    texts, lps, tops = expected(local, ids + gen, 3)
    assert c.text == PROMPT + tok.decode(gen)
    assert c.logprobs.tokens == texts
    assert c.logprobs.token_logprobs == lps
    assert c.logprobs.top_logprobs == tops
    assert c.logprobs.text_offset[len(ids)] == len(PROMPT)   # the completion's offsets follow the echo
    assert r.usage.prompt_tokens_details.cached_tokens == 0   # the reused prefix was recomputed for its logits
    assert r.usage.completion_tokens == 4


def test_echo_streamed_is_the_whole_answer(client):
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    got = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for ch in chunks:
        for choice in ch.choices:
            if choice.logprobs is not None:
                for k in got:
                    got[k] += getattr(choice.logprobs, k)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert got == {k: getattr(whole.choices[0].logprobs, k) for k in got}


def test_max_tokens_0_scores_the_prompt_alone(client, local):
    tok = local[1]
    ids = tok.encode(PROMPT)
    r = client.completions.create(model="m", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    texts, lps, tops = expected(local, ids, 0)
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert (c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs) == (texts, lps, tops)


def test_fill_in_the_middle_with_echo_logprobs_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="def f(", suffix="):", max_tokens=2, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo" and "suffix" in e.value.body["message"]


def test_an_engine_without_prompt_logits_refuses_echo_logprobs(local):
    engine = ScriptedEngine([300])
    client = serve_in_process(lambda: (engine, local[1]))
    r = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 1, "echo": True, "logprobs": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "echo" and engine.name in err["message"] and not engine.requests
    r = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 1, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("x = 1")   # echo alone still works
