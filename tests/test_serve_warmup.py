"""Editor traffic on a real server (reference backend, the small test model with the FIM tokens; issue 21):
llama.vim's cache warm-up (/infill with n_predict 0 and only input_extra) prefills and keeps the context
that the next completion then reuses; /v1/completions with max_tokens 0 does the same; /infill reports
llama-server's timings and tokens_cached and honours response_fields; the prefix cache keeps several
sequences, so neither a warm-up nor an unrelated request in between evicts the file being edited. A
request that parts from a kept prompt shares its full pages (runtime/prefix_cache.py): the reused count is
the common prefix down to a page boundary."""

from __future__ import annotations

import json

import httpx
import pytest

from _serve_util import greedy, model_and_cache, open_local, server as start_server
from nanoqwen import config
from nanoqwen.runtime.token_trie import common_prefix
from nanoqwen.serve import prompts

PAGE = config.default().kv_cache.page_size

EXTRA = [{"filename": "util.py", "text": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n" * 4},
         {"filename": "consts.py", "text": "LIMIT = 10\nNAME = 'demo'\n"}]
PREFIX, SUFFIX = "from util import clamp\n\ndef scale(x):\n    return clamp(", "\n\nprint(scale(3))\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_and_cache(tmp_path_factory, "warmup")


@pytest.fixture(scope="module")
def server(model):
    s = start_server(model[0], cache_dir=model[1])
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(model):
    return open_local(*model)


def post(server, path, body):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def infill_ids(tok, prefix="", suffix=""):
    return prompts.repo_fim(tok, [(f["filename"], f["text"]) for f in EXTRA], prefix, suffix)


def shared(a, b) -> int:
    """Positions a request of ``b`` reuses from a kept prompt ``a`` it parts from: whole pages."""
    n = common_prefix(a, b)
    return n - n % PAGE


def test_warmup_prefills_and_the_completion_reuses_it(server, local):
    engine, tok, stop = local
    warm = post(server, "/infill", {"input_extra": EXTRA, "n_predict": 0})
    warm_ids = infill_ids(tok)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    assert warm["tokens_evaluated"] == len(warm_ids)
    t = warm["timings"]
    assert t["predicted_n"] == 0 and t["prompt_n"] == len(warm_ids) - warm["tokens_cached"] and t["prompt_ms"] > 0

    ids = infill_ids(tok, PREFIX, SUFFIX)
    r = post(server, "/infill", {"input_extra": EXTRA, "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 5})
    assert r["tokens_cached"] == shared(warm_ids, ids) > len(ids) // 2   # the warmed context
    assert r["timings"]["prompt_n"] == len(ids) - r["tokens_cached"] and r["tokens_evaluated"] == len(ids)
    want = greedy(engine, stop, ids, 5)
    assert r["content"] == tok.decode([x for x in want if x not in stop])
    assert r["tokens_predicted"] == r["timings"]["predicted_n"] == len(want)


def test_response_fields_flatten_paths(server):
    asked = ["content", "timings/prompt_n", "timings/predicted_ms", "tokens_cached", "absent", "timings/absent"]
    body = {"input_prefix": PREFIX, "n_predict": 2, "response_fields": asked}
    r = post(server, "/infill", body)
    assert set(r) == {"content", "timings/prompt_n", "timings/predicted_ms", "tokens_cached"}
    assert isinstance(r["timings/prompt_n"], int) and r["timings/predicted_ms"] >= 0
    with httpx.stream("POST", f"{server.url}/infill", json=body | {"stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert set(events[-1]) == {"content", "timings/prompt_n", "timings/predicted_ms", "tokens_cached"}
    assert all(e["stop"] is False for e in events[:-1])   # the token chunks are llama-server's, unfiltered


def test_completion_max_tokens_zero_keeps_the_prompt(server, local):
    _engine, tok, _stop = local
    prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n"
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True})
    n = len(tok.encode(prompt))
    assert r["choices"][0]["text"] == prompt and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] == n and r["usage"]["completion_tokens"] == 0
    r = post(server, "/v1/completions", {"prompt": prompt + "\n    def push(self, x):", "max_tokens": 2,
                                         "temperature": 0})
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == common_prefix(
        tok.encode(prompt), tok.encode(prompt + "\n    def push(self, x):"))


def test_prefix_cache_keeps_several_sequences(server, local):
    """The file being edited, then llama.vim's warm-up of the same extra context, an unrelated chat and a
    completion, then the file again one keystroke later: the warm-up shared the file's pages and the
    file's sequence was kept beside the others (LRU within the pool), so the re-request reuses the file."""
    _engine, tok, _stop = local
    body = {"input_extra": EXTRA, "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3}
    post(server, "/infill", body)
    post(server, "/infill", {"input_extra": EXTRA, "n_predict": 0})
    post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "what is a monad?"}],
                                          "max_tokens": 3})
    post(server, "/v1/completions", {"prompt": "import numpy as np\n", "max_tokens": 3})
    r = post(server, "/infill", body | {"input_prefix": PREFIX + "x"})
    first, again = infill_ids(tok, PREFIX, SUFFIX), infill_ids(tok, PREFIX + "x", SUFFIX)
    assert r["tokens_cached"] == shared(first, again) > common_prefix(infill_ids(tok), again)

