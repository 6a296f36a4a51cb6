"""`nanoqwen serve` end to end: the real server process (reference backend, the small test model with
the FIM tokens) driven by the official `openai` client and by raw HTTP. Every greedy answer is checked
against the same backend's engine run in this process, token for token, with exact usage counts.
tests/gpu/test_serve.py runs this module again against the CUDA backend (the `backend` fixture).
On the reference backend every comparison is class (a) of docs/architecture.md: a reused prefix holds the
cold run's bits, so the server's prefix cache cannot change a token (on CUDA see tests/gpu/test_serve.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from _serve_util import greedy, model_and_cache, server as start_server
from nanoqwen.backends import open_engine
from nanoqwen.modelcache import resolve
from nanoqwen.serve import prompts
from nanoqwen import tokenizer

PROMPT = "def fibonacci(n):"
CONTEXT = 4096   # the server's default for this model (its max_positions)


@pytest.fixture(scope="module")
def backend():
    return "reference"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_and_cache(tmp_path_factory, "serve")


@pytest.fixture(scope="module")
def local(model, backend):
    """(engine, tokenizer, stop ids): the server's backend in this process, for the expected answers."""
    model_dir, cache = model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(cache))
        path = resolve(model_dir, log=lambda m: None)
        engine = open_engine(backend, path, CONTEXT, log=lambda m: None)
    tok = tokenizer.load(path)
    yield engine, tok, prompts.stop_ids(tok)
    if hasattr(engine, "close"):
        engine.close()


@pytest.fixture(scope="module")
def server(model, backend, local):
    s = start_server(model[0], "--max-queue", "16", backend=backend, cache_dir=model[1])
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def expect(local, prompt_ids, max_tokens):
    """(text, completion_tokens, finish_reason) of a greedy request."""
    engine, tok, stop = local
    toks = greedy(engine, stop, prompt_ids, max_tokens)
    stopped = bool(toks) and toks[-1] in stop
    return tok.decode(toks[:-1] if stopped else toks), len(toks), "stop" if stopped else "length"


def post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


# ---- OpenAI client --------------------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["small-py-fim"]


def test_completion_greedy_matches_engine_with_exact_usage(client, local):
    _engine, tok, _stop = local
    r = client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=8, temperature=0)
    text, n, finish = expect(local, tok.encode(PROMPT), 8)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(PROMPT)), n)
    assert r.usage.total_tokens == r.usage.prompt_tokens + n


def test_completion_token_id_prompt(client, local):
    _engine, tok, _stop = local
    ids = tok.encode("import os\n")
    r = client.completions.create(model="small-py-fim", prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == expect(local, ids, 5)[0]
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_equals_non_streaming_with_usage(client):
    kw = dict(model="small-py-fim", prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_across_tokens_is_cut_and_counted(client, local):
    engine, tok, stop = local
    ids = tok.encode(PROMPT)
    toks = greedy(engine, stop, ids, 16)
    assert not set(toks) & stop, "pick a prompt whose first 16 greedy tokens hold no stop token"
    full = tok.decode(toks)
    k = len(tok.decode(toks[:3]))
    word = full[k - 2:k + 2]   # spans the boundary after the third token
    assert len(word) == 4 and full.startswith(tok.decode(toks[:3]))
    want = full[:full.find(word)]
    n = next(j for j in range(1, len(toks) + 1) if word in tok.decode(toks[:j]))
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=16,
                                                    temperature=0, stop=[word, "never-seen"], stream=True,
                                                    stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=16, temperature=0,
                                          stop=word)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert (text, finish) == (want, "stop"), stream
        assert usage.completion_tokens == n


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(123) == sample(123)
    assert len({sample(s) for s in range(1, 5)}) > 1, "different seeds should not all sample the same text"


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_logprobs_top_k(client):
    r = client.completions.create(model="small-py-fim", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and all(v <= 0 for v in top.values())
        assert chosen == pytest.approx(max(top.values()))   # greedy takes the most likely token
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="small-py-fim", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_suffix_is_fill_in_the_middle(client, local):
    _engine, tok, _stop = local
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    r = client.completions.create(model="small-py-fim", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0)
    ids = prompts.fim(tok, prefix, suffix)
    text, n, finish = expect(local, ids, 6)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)


def test_prefix_cache_hits_in_usage_and_metrics(client, server, local):
    prompt = "class Stack:\n    def push(self, item):\n"
    first = client.completions.create(model="small-py-fim", prompt=prompt, max_tokens=3, temperature=0)
    hits0 = server.metric("nanoqwen_prefix_cache_hit_tokens_total")
    again = client.completions.create(model="small-py-fim", prompt=prompt, max_tokens=3, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert server.metric("nanoqwen_prefix_cache_hit_tokens_total") == hits0 + again.usage.prompt_tokens - 1


def test_chat_streaming_and_max_completion_tokens(client, local):
    _engine, tok, _stop = local
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    ids = tok.encode_chat(messages)
    text, n, finish = expect(local, ids, 6)
    r = client.chat.completions.create(model="small-py-fim", messages=messages, max_completion_tokens=6,
                                       temperature=0)
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("assistant", text)
    assert (r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens) == (finish, len(ids), n)
    chunks = list(client.chat.completions.create(model="small-py-fim", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n


# ---- raw HTTP: llama-server's endpoints, metrics, errors ------------------------------------------------

def test_infill_repo_level(server, local):
    _engine, tok, _stop = local
    body = {"input_prefix": "def area(r):\n    return ", "input_suffix": "\n", "prompt": "3.14",
            "input_extra": [{"filename": "util.py", "text": "PI = 3.14159\n"}], "n_predict": 6}
    ids = prompts.repo_fim(tok, [("util.py", "PI = 3.14159\n")], "def area(r):\n    return 3.14", "\n")
    text, n, finish = expect(local, ids, 6)
    r = post(server, "/infill", body)
    assert r.status_code == 200, r.text
    j = r.json()
    assert (j["content"], j["stop"], j["tokens_predicted"], j["tokens_evaluated"]) == (text, True, n, len(ids))
    assert j["stop_type"] == ("limit" if finish == "length" else "eos")
    assert j["timings"]["predicted_n"] == n and j["timings"]["prompt_ms"] > 0
    with httpx.stream("POST", f"{server.url}/infill", json=body | {"stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == text
    assert [e["stop"] for e in events][-1] is True and events[-1]["tokens_predicted"] == n


def test_tokenize_detokenize(server, local):
    _engine, tok, _stop = local
    r = post(server, "/tokenize", {"content": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT)
    pieces = post(server, "/tokenize", {"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == PROMPT
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"content": PROMPT}


def test_health_and_metrics(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    before = server.metric("nanoqwen_requests_total", endpoint="/v1/completions", status="200")
    gen0 = server.metric("nanoqwen_generation_tokens_total")
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}).json()
    assert server.metric("nanoqwen_requests_total", endpoint="/v1/completions", status="200") == before + 1
    assert server.metric("nanoqwen_generation_tokens_total") == gen0 + r["usage"]["completion_tokens"]
    assert server.metric("nanoqwen_time_to_first_token_seconds_count") >= 1
    assert server.metric("nanoqwen_queue_depth") == 0


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "x " * 5000}, 400, "maximum context length is 4096 tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 17}, 400, "n must be between 1 and 16"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": [999999]}, 400, "999999"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/infill", {"input_prefix": "x", "n_cmpl": 2, "stream": True}, 400, "n_cmpl"),
    ("/infill", {"input_prefix": "x", "n_predict": -2}, 400, "n_predict"),
    ("/detokenize", {"tokens": [-1]}, 400, "-1"),
    ("/v1/nothing", {}, 404, "Not Found"),
])
def test_errors_are_openai_objects(server, path, body, status, needle):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"], err
    assert httpx.get(f"{server.url}/health").status_code == 200   # the server stays up


def test_context_error_names_both_numbers(server, local):
    _engine, tok, _stop = local
    prompt = "x " * 5000
    r = post(server, "/v1/completions", {"prompt": prompt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
    assert f"maximum context length is {CONTEXT} tokens" in err["message"]
    assert f"resulted in {len(tok.encode(prompt))} tokens" in err["message"], err


def test_disconnect_cancels_generation(server):
    cancelled0 = server.metric("nanoqwen_requests_cancelled_total")
    long = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=120) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert time.monotonic() - t0 < 10, "the next request waited for the abandoned generation"
    deadline = time.monotonic() + 60
    while server.metric("nanoqwen_requests_cancelled_total") != cancelled0 + 1:   # seen at the engine's next step
        assert time.monotonic() < deadline, "the client's departure did not cancel its generation"
        time.sleep(0.05)


def test_concurrent_clients_get_their_sequential_answers(client):
    prompts_ = [f"def f{i}(x):\n    return x" for i in range(8)]

    def ask(p):
        return client.completions.create(model="small-py-fim", prompt=p, max_tokens=4, temperature=0).choices[0].text
    sequential = [ask(p) for p in prompts_]
    out = [None] * 8

    def worker(i):
        out[i] = ask(prompts_[i])
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == sequential
