"""llama-server's endpoints: /props, /apply-template, native /completion (same answer as
/v1/completions, llama-server's response fields, streamed objects), generation_settings.n_ctx in /infill
replies, the n_predict 0 warm-up, n_indent and t_max_predict_ms (on scripted output), n_probs, n_cmpl,
response_fields, and the refusals. Real small model on the reference backend, in-process app."""

from __future__ import annotations

import json

import pytest

from _serve_util import ScriptedEngine, serve_in_process
from nanoqwen import tokenizer
from nanoqwen.backends import ReferenceEngine
from nanoqwen.modelcache import resolve
from nanoqwen.testmodels import SMALL_PY_DIR

CODE = "def fibonacci(n):"
CONTEXT = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp_path_factory.mktemp("llama")))
        path = resolve(SMALL_PY_DIR, log=lambda m: None)
    return ReferenceEngine(path, CONTEXT), tokenizer.load(path)


@pytest.fixture(scope="module")
def client(model):
    return serve_in_process(lambda: model, model_id="small")


def sse_objects(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_props(client, model):
    _engine, tok = model
    p = client.get("/props").json()
    assert p["n_ctx"] == CONTEXT and p["default_generation_settings"]["n_ctx"] == CONTEXT
    assert p["model"] == "small" and p["chat_template"] == tok.chat_template
    assert p["fim_tokens"]["prefix"] == "<|fim_prefix|>" and p["fim_tokens"]["middle"] == "<|fim_middle|>"
    assert p["default_generation_settings"]["params"]["temperature"] == 0.0


def test_apply_template(client, model):
    _engine, tok = model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert client.post("/apply-template", json={"messages": messages}).json()["prompt"] == \
        tok.apply_chat_template(messages)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert "# Tools" in client.post("/apply-template", json={"messages": messages, "tools": [tool]}).json()["prompt"]


def test_native_completion_is_the_openai_answer(client):
    want = client.post("/v1/completions", json={"prompt": CODE, "max_tokens": 12, "temperature": 0}).json()
    r = client.post("/completion", json={"prompt": CODE, "n_predict": 12}).json()
    assert r["content"] == want["choices"][0]["text"] and r["stop"] is True
    assert r["tokens_predicted"] == want["usage"]["completion_tokens"] and r["stop_type"] in ("limit", "eos")
    assert r["generation_settings"]["n_ctx"] == CONTEXT and r["timings"]["predicted_n"] == r["tokens_predicted"]
    objs = sse_objects(client.post("/completion", json={"prompt": CODE, "n_predict": 12, "stream": True}))
    assert "".join(o["content"] for o in objs) == r["content"]
    assert objs[-1]["stop"] is True and all(o["stop"] is False for o in objs[:-1])
    # a prompt of token ids and text parts (llama-server's mixed form)
    ids = client.post("/tokenize", json={"content": CODE}).json()["tokens"]
    assert client.post("/completion", json={"prompt": ids, "n_predict": 12}).json()["content"] == r["content"]
    assert client.post("/completions", json={"prompt": [ids[0], client.post(
        "/detokenize", json={"tokens": ids[1:]}).json()["content"]], "n_predict": 12}).status_code == 200


def test_stop_word(client):
    full = client.post("/completion", json={"prompt": CODE, "n_predict": 12}).json()["content"]
    word = full.strip()[:3]
    r = client.post("/completion", json={"prompt": CODE, "n_predict": 12, "stop": [word]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word and word not in r["content"]


def test_infill_reply_has_generation_settings_and_warm_up(client):
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 8}
    r = client.post("/infill", json=body).json()
    assert r["generation_settings"]["n_ctx"] == CONTEXT
    warm = client.post("/infill", json=body | {"input_prefix": "def sub(a, b):\n    ", "n_predict": 0}).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0   # llama.vim's / llama.vscode's prefetch
    again = client.post("/infill", json=body | {"input_prefix": "def sub(a, b):\n    "}).json()
    assert again["tokens_cached"] >= warm["tokens_evaluated"] - 1   # the warm-up cached the prompt


def test_n_probs(client):
    r = client.post("/completion", json={"prompt": CODE, "n_predict": 4, "n_probs": 3}).json()
    probs = r["completion_probabilities"]
    assert len(probs) == 4 and all(len(p["top_logprobs"]) == 3 for p in probs)
    assert "".join(p["token"] for p in probs) == r["content"]
    assert all(p["top_logprobs"][0]["logprob"] >= p["logprob"] - 1e-9 for p in probs)


def test_n_cmpl_gives_a_list(client):
    body = {"prompt": CODE, "n_predict": 6, "n_cmpl": 3, "temperature": 1.0, "seed": 5}
    r = client.post("/completion", json=body).json()
    assert isinstance(r, list) and [o["index"] for o in r] == [0, 1, 2]
    assert [o["content"] for o in r] == [o["content"] for o in client.post("/completion", json=body).json()]
    assert len({o["content"] for o in r}) > 1   # seeds 5, 6, 7


def test_response_fields_are_flat_paths(client):
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]   # llama.vim's
    r = client.post("/infill", json={"input_prefix": "x = ", "n_predict": 3, "response_fields": fields}).json()
    assert set(r) == set(fields) and isinstance(r["timings/prompt_n"], int)


@pytest.mark.parametrize("body, param", [({"ignore_eos": True}, "ignore_eos"), ({"lora": [{"id": 0}]}, "lora"),
                                         ({"n_cmpl": 2, "stream": True}, "n_cmpl"), ({"n_cmpl": 9}, "n_cmpl")])
def test_refusals(client, body, param):
    r = client.post("/completion", json={"prompt": CODE} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_indent_and_t_max_predict_ms():
    tok = tokenizer.Tokenizer(SMALL_PY_DIR)
    text = "    x = 1\n    y = 2\nz = 3\n    w = 4\n"
    engine = ScriptedEngine(tok.encode(text) + [0], context=256)
    c = serve_in_process(lambda: (engine, tok))
    r = c.post("/infill", json={"input_prefix": "def f():\n", "n_indent": 4, "n_predict": 64}).json()
    assert r["content"] == "    x = 1\n    y = 2\n" and r["stop_type"] == "limit"
    objs = sse_objects(c.post("/infill", json={"input_prefix": "def f():\n", "n_indent": 4, "n_predict": 64,
                                               "stream": True}))
    assert "".join(o["content"] for o in objs) == "    x = 1\n    y = 2\n"
    assert c.post("/infill", json={"input_prefix": "def f():\n", "n_predict": 64}).json()["content"] == text
    engine.delay_s = 0.02
    r = c.post("/infill", json={"input_prefix": "def f():\n", "t_max_predict_ms": 100, "n_predict": 64}).json()
    assert r["content"].count("\n") >= 1 and r["content"] != text and r["stop_type"] == "limit", r
