"""The server's states, in-process with stand-in engines: /health 503 while the model loads and after a
load failure; an engine fault fails its request with a 500 error object, and on a GPU engine also turns
/health to 503 and refuses later requests (device state may be corrupt), while a fault of the numpy
reference engine leaves the server serving."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from starlette.testclient import TestClient

from nanoqwen.backends import ReferenceEngine
from nanoqwen.runtime.generate import check_request
from nanoqwen.serve.app import Server, create_app
from nanoqwen.serve.metrics import Metrics
from nanoqwen.serve.worker import Worker
from nanoqwen.testmodels import SMALL_PY_DIR, tiny_dims
from nanoqwen.tokenizer import Tokenizer

BODY = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


class GpuLikeEngine:
    """Not the reference engine, so its faults are fatal; fails at token ``fail_at``."""
    name, context, dims = "stand-in GPU engine", 64, tiny_dims()
    cached_tokens, speculate = 0, None   # the engine contract's fields: nothing reused, no drafting

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def generate(self, prompt, max_new_tokens, sampling, logits=False):
        check_request(self.dims, prompt, max_new_tokens, self.context)
        for i in range(max_new_tokens):
            if i == self.fail_at:
                raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS (simulated)")
            yield 300 + i


class FullContextEngine(GpuLikeEngine):
    """KV cache as long as the model's positions (the server's default when the model is short)."""
    context, dims = 64, dataclasses.replace(tiny_dims(), max_positions=64)


class FlakyReference(GpuLikeEngine, ReferenceEngine):
    name = "stand-in reference engine"


def serve(load, raise_server_exceptions=True):
    metrics = Metrics()
    worker = Worker(load, metrics, max_queue=4, log=lambda m: None)
    client = TestClient(create_app(Server(worker, metrics, "m")), raise_server_exceptions=raise_server_exceptions)
    worker.start()
    return client


def wait_health(client, status, timeout=30):
    deadline = time.monotonic() + timeout
    while (r := client.get("/health")).status_code != status:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.02)
    return r


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(SMALL_PY_DIR)


def test_health_is_503_while_loading_then_200(tok):
    go = threading.Event()
    client = serve(lambda: (go.wait(), (GpuLikeEngine(), tok))[1])
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"]
    go.set()
    wait_health(client, 200)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_load_failure_is_503_with_the_reason():
    def load():
        raise OSError("model.nanoqwen: truncated")
    client = serve(load)
    deadline = time.monotonic() + 30
    while (r := client.get("/health")).json()["error"]["code"] == "loading":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert r.status_code == 503 and "truncated" in r.json()["error"]["message"]


def test_gpu_fault_fails_the_request_and_the_server(tok):
    client = serve(lambda: (GpuLikeEngine(fail_at=2), tok))
    wait_health(client, 200)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 500 and "ILLEGAL_ADDRESS" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def test_gpu_fault_while_streaming_is_reported_in_band(tok):
    client = serve(lambda: (GpuLikeEngine(fail_at=2), tok))
    wait_health(client, 200)
    with client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert client.get("/health").status_code == 503


def test_reference_fault_fails_only_its_request(tok):
    client = serve(lambda: (FlakyReference(fail_at=2), tok))
    wait_health(client, 200)
    assert client.post("/v1/completions", json=BODY).status_code == 500
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json=BODY | {"max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_without_max_tokens_generation_fills_the_context(tok):
    client = serve(lambda: (FullContextEngine(), tok))
    wait_health(client, 200)
    messages = [{"role": "user", "content": "hi"}]
    prompt = len(tok.encode_chat(messages))
    r = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64 - prompt
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"messages": messages * 20})
    assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"]


def test_prompt_ids_outside_the_vocabulary_are_a_400_naming_the_first(tok):
    client = serve(lambda: (GpuLikeEngine(), tok))
    wait_health(client, 200)
    for prompt, bad in (([5, 2048, -1], 2048), ([5, -1, 2048], -1)):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"prompt token id {bad} is outside the model's vocabulary")
    assert client.post("/v1/completions", json={"prompt": [5, 2047, 0], "max_tokens": 1}).status_code == 200


class BrokenTokenizer:
    """A bug stand-in: encoding raises something no route expects."""
    eos_ids = ()

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text):
        raise KeyError("simulated bug")


def test_an_unexpected_exception_is_a_json_500_and_the_server_serves_on(tok):
    client = serve(lambda: (FlakyReference(), BrokenTokenizer(tok)), raise_server_exceptions=False)
    wait_health(client, 200)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "internal_error" and "simulated bug" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=BODY | {"prompt": [300, 301]})   # token ids: no encode
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
