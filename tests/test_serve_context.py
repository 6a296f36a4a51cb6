"""Model names and the context, in-process with a stand-in engine of 64 positions: any model name is
served (editors send the name their user typed), /v1/models advertises the context, a max_tokens beyond
the room left is clamped and ends with "length", a prompt alone beyond the context is a 400 with OpenAI's
code and wording, and an image part is refused."""

from __future__ import annotations

import pytest

from _serve_util import ScriptedEngine, serve_in_process
from nanoqwen.testmodels import SMALL_PY_DIR
from nanoqwen.tokenizer import Tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(SMALL_PY_DIR)


@pytest.fixture(scope="module")
def client(tok):
    return serve_in_process(lambda: (ScriptedEngine([300], context=64), tok), model_id="served-name")


def test_any_model_name_is_the_served_model(client):
    for name in ("gpt-4", "qwen2.5-coder:7b", "served-name"):
        r = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "served-name", r.text


def test_models_advertise_the_context(client):
    [m] = client.get("/v1/models").json()["data"]
    assert m["id"] == "served-name" and m["context_length"] == 64 and m["max_model_len"] == 64


def test_max_tokens_beyond_the_room_is_clamped(client, tok):
    prompt = len(tok.encode_chat(HI))
    r = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4096})   # Continue's default
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64 - prompt
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_beyond_the_context_is_context_length_exceeded(client, tok):
    messages = HI * 20
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
    assert err["message"].startswith("This model's maximum context length is 64 tokens. However, your messages "
                                     f"resulted in {len(tok.encode_chat(messages))} tokens"), err


def test_an_image_part_is_refused(client):
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    err = r.json()["error"]
    assert r.status_code == 400 and "this model takes text only" in err["message"] and "image_url" in err["message"]
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": parts[:1]}], "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_the_ignored_fields_are_accepted_and_the_unknown_refused(client):
    from nanoqwen.serve.fields import IGNORED, NEUTRAL
    body = {"prompt": "x", "max_tokens": 1}
    for key in IGNORED:
        assert client.post("/v1/completions", json=body | {key: "anything"}).status_code == 200, key
    for key, off in NEUTRAL.items():
        assert client.post("/completion", json={"prompt": "x", "n_predict": 1, key: off}).status_code == 200, key
    r = client.post("/v1/chat/completions", json={"messages": HI, "logit_bias_typo": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias_typo"
