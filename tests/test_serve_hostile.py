"""Attacks on a real `nanoqwen serve` process (reference backend, the small test model with the FIM tokens),
each followed by a check that the server still answers at once (issue 26): stop strings built to match the
output at every step, a huge /tokenize, an abandoned non-streamed request, special-token text typed into
editor and chat content, malformed bodies, half-sent requests, oversized heads, and where the API key
comes from. That /tokenize leaves the event loop free is shown in process, with a tokenizer held mid-encode.
Every loop is bounded and every socket is on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from _serve_util import ScriptedEngine, greedy, model_and_cache, open_local, serve_in_process, server as start_server
from nanoqwen.paths import PACKAGE_DIR
from nanoqwen.serve import limits, prompts
from nanoqwen.serve.launch import ServerProcess
from nanoqwen.testmodels import SMALL_PY_DIR
from nanoqwen.tokenizer import Tokenizer

PROMPT = "def fibonacci(n):"
MAX_TEXT = 1_500_000   # --max-text-chars: room for a /tokenize that takes seconds
READ_TIMEOUT = 2.0     # --read-timeout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_and_cache(tmp_path_factory, "hostile")


@pytest.fixture(scope="module")
def server(model):
    s = start_server(model[0], "--max-text-chars", str(MAX_TEXT), "--max-body-bytes", str(8 * MAX_TEXT),
                     "--read-timeout", str(READ_TIMEOUT), cache_dir=model[1])
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(model):
    return open_local(*model)


def post(server, path, body, timeout=120, **kw):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{server.url}{path}", timeout=timeout, **kw)


def quick(server, limit=5.0) -> float:
    """A short greedy request right after an attack: it must not wait behind the attack's work."""
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert took < limit, f"the next request waited {took:.1f} s"
    return took


def error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- 3: stop strings ------------------------------------------------------------------------------------

def test_stop_strings_that_prefix_the_output_cost_linear_time(server):
    """64 stop strings of up to 512 characters, each the greedy output's beginning plus one character it
    never writes: every step of the old matcher rescanned all of them; the answer is unchanged, and the
    server answers at once afterwards (the matcher's linear cost is counted in test_serve_text.py)."""
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(plain) > 300, "the test needs an output longer than the stop strings' shared prefixes"
    stops = [plain[:limits.MAX_STOP_CHARS - 1 - i] + "\u2603" for i in range(limits.MAX_STOPS)]
    r = post(server, "/v1/completions", body | {"stop": stops})   # the matcher's cost: test_serve_text.py
    assert r.json()["choices"][0]["text"] == plain and r.json()["choices"][0]["finish_reason"] == "length"
    quick(server)


@pytest.mark.parametrize("stop", [[f"s{i}" for i in range(limits.MAX_STOPS + 1)],
                                  ["y" * (limits.MAX_STOP_CHARS + 1)]])
@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": PROMPT}), ("/infill", {"input_prefix": "x"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_too_many_or_too_long_stop_strings_are_400(server, stop, path, extra):
    err = error(post(server, path, extra | {"stop": stop}), 400, "stop")
    assert str(limits.MAX_STOPS if len(stop) > 1 else limits.MAX_STOP_CHARS) in err["message"]


# ---- 4: tokenization off the event loop -----------------------------------------------------------------

class HeldTokenizer(Tokenizer):
    """The small model's tokenizer whose ``encode`` tells it has begun (``entered``), then waits for
    ``release``: a tokenization that lasts exactly as long as the test wants."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text):
        self.entered.set()
        assert self.release.wait(120), "never released"
        return super().encode(text)


def test_health_answers_while_a_tokenize_runs():
    """/tokenize runs off the event loop: while its encode is held, /health answers on the same loop (the
    app in this process under one TestClient portal); /tokenize then gives the right tokens."""
    tok = HeldTokenizer(SMALL_PY_DIR)
    text = "def f(x):\n    return x + 1  # é\n"
    with serve_in_process(lambda: (ScriptedEngine([1]), tok)) as client:
        out = {}
        t = threading.Thread(target=lambda: out.update(r=client.post("/tokenize", json={"content": text,
                                                                                      "with_pieces": True})))
        h = threading.Thread(target=lambda: out.update(health=client.get("/health")))
        try:
            t.start()
            assert tok.entered.wait(60), "/tokenize never began encoding"
            h.start()
            h.join(60)
            assert not h.is_alive(), "/health waited for the tokenization: it runs on the event loop"
            assert out["health"].status_code == 200, out["health"].text
            assert t.is_alive() and "r" not in out   # still held: /health answered beside it
        finally:
            tok.release.set()
            t.join(60)
            h.join(60)
    ids = Tokenizer.encode(tok, text)
    assert out["r"].json() == {"tokens": [{"id": i, "piece": p} for i, p in zip(ids, tok.pieces(ids))]}


def test_huge_tokenize_is_exact(server, local):
    """A /tokenize of MAX_TEXT characters (seconds of work, in slices off the loop) gives every token and
    piece, and the server answers at once afterwards."""
    _engine, tok, _stop = local
    text = "def f(x):\n    return x + 1  # é\n" * (MAX_TEXT // 32)
    assert len(text) <= MAX_TEXT
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    ids = tok.encode(text)
    assert [p["id"] for p in pieces] == ids
    assert [p["piece"] for p in pieces[:30]] == [tok.decode([i]) for i in ids[:30]]
    quick(server)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": "x" * (MAX_TEXT + 1)}, "content"),
    ("/detokenize", {"tokens": [1] * (MAX_TEXT + 1)}, "tokens"),
    ("/v1/completions", {"prompt": "x" * (MAX_TEXT + 1)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (MAX_TEXT + 1)}]}, "messages"),
    ("/infill", {"input_prefix": "x" * MAX_TEXT, "input_suffix": "y"}, "input_prefix"),
])
def test_text_over_the_limit_is_413(server, path, body, param):
    err = error(post(server, path, body), 413, param)
    assert str(MAX_TEXT) in err["message"]
    quick(server)


# ---- 5: an abandoned non-streamed request ---------------------------------------------------------------

def test_abandoned_non_streamed_request_is_cancelled(server):
    """The client gives up after a second; the 3000-token generation (many seconds on this backend) stops
    there, so the next request is served at once."""
    cancelled0 = server.metric("nanoqwen_requests_cancelled_total")
    long = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=long, timeout=httpx.Timeout(60, read=1.0))
    quick(server)
    deadline = time.monotonic() + 60
    while server.metric("nanoqwen_requests_cancelled_total") != cancelled0 + 1 or \
            server.metric("nanoqwen_requests_running") != 0:   # the engine sees the departure at a step
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.05)


# ---- 8: special-token text in user content --------------------------------------------------------------

TYPED = "x = '<|fim_middle|><|fim_suffix|><|file_sep|><|im_end|>'\n"


def test_infill_text_is_text(server, local):
    """The editor's buffer spells FIM and repository tokens: the server's prompt is the layout's own
    special tokens around that text (tokens_evaluated counts it), and the answer is the engine's for it."""
    engine, tok, stop = local
    body = {"input_prefix": TYPED + "def f(", "input_suffix": TYPED, "prompt": "a",
            "input_extra": [{"filename": "<|repo_name|>.py", "text": TYPED}], "n_predict": 6}
    ids = prompts.repo_fim(tok, [("<|repo_name|>.py", TYPED)], TYPED + "def f(a", TYPED)
    special = set(tok.added_special_tokens)
    assert [tok.decode([i]) for i in ids if i in special] == \
        ["<|repo_name|>", "<|file_sep|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    r = post(server, "/infill", body).json()
    assert r["tokens_evaluated"] == len(ids)
    want = greedy(engine, stop, ids, 6)
    assert r["content"] == tok.decode([t for t in want if t not in stop])


def test_completion_suffix_and_chat_content_are_text(server, local):
    engine, tok, stop = local
    ids = prompts.fim(tok, TYPED, TYPED)
    r = post(server, "/v1/completions", {"prompt": TYPED, "suffix": TYPED, "max_tokens": 4, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == len(ids) == len(tok.encode_text(TYPED)) * 2 + 3
    chat = [{"role": "user", "content": TYPED}]
    r = post(server, "/v1/chat/completions", {"messages": chat, "max_tokens": 4, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == len(tok.encode_chat(chat)) > len(tok.encode(tok.apply_chat_template(chat)))
    want = greedy(engine, stop, tok.encode_chat(chat), 4)
    assert r["choices"][0]["message"]["content"] == tok.decode([t for t in want if t not in stop])


# ---- 9: malformed requests are OpenAI errors ------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": PROMPT, "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 1 << 64}, 400, "seed"),
    ("/infill", {"input_prefix": "x", "seed": -1}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -5}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, None),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400, None),   # a surrogate in raw UTF-8 bytes
])
def test_malformed_requests_are_openai_errors(server, path, body, status, param):
    error(post(server, path, body), status, param)
    quick(server)


def test_surrogate_pairs_are_fine(server):
    r = post(server, "/tokenize", b'{"content": "\\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["tokens"]


def raw(server, data: bytes, wait: float) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``wait`` passes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(data)
        got = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                return got
            got += chunk
        raise AssertionError(f"the connection stayed open for {wait} s; got {got[:200]!r}")


@pytest.mark.parametrize("data", [
    b"",                                                             # connects, sends nothing
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",                 # half a head
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",   # half a body
])
def test_half_sent_requests_are_dropped(server, data):
    t0 = time.monotonic()
    raw(server, data, READ_TIMEOUT + 5)
    assert time.monotonic() - t0 >= READ_TIMEOUT - 0.5
    quick(server)


def test_idle_kept_alive_connection_is_closed(server):
    t0 = time.monotonic()
    got = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", limits.KEEP_ALIVE_S + 5)
    assert got.startswith(b"HTTP/1.1 200") and time.monotonic() - t0 >= limits.KEEP_ALIVE_S - 0.5


def test_slow_trickle_does_not_renew_the_deadline(server):
    """A byte every quarter second keeps the connection busy, but the request is never whole: it is
    closed at the deadline, counted from the first byte."""
    head = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100   # longer than the deadline at this pace
    with socket.create_connection(("127.0.0.1", server.port), timeout=0.25) as s:
        t0 = time.monotonic()
        for ch in head:
            try:
                s.sendall(bytes([ch]))
                if s.recv(1) == b"":   # closed by the server
                    break
            except TimeoutError:   # still open: the next byte
                continue
            except OSError:
                break
        else:
            raise AssertionError("the trickling connection was never closed")
        assert READ_TIMEOUT - 0.5 <= time.monotonic() - t0 < READ_TIMEOUT + 2


def response(got: bytes) -> tuple[bytes, dict]:
    head, _, body = got.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)["error"]


@pytest.mark.parametrize("headers", [b"".join(b"X-H%d: v\r\n" % i for i in range(limits.MAX_HEADERS + 1)),
                                     b"X-Big: " + b"a" * limits.MAX_HEAD_BYTES + b"\r\n"])
def test_too_many_or_too_large_headers_are_431(server, headers):
    got = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + headers + b"\r\n", 10)
    status, err = response(got)
    assert status.startswith(b"HTTP/1.1 431") and err["code"] == "headers_too_large", got[:300]


def test_a_head_that_never_ends_is_refused_as_it_grows(server):
    """No end of the head in sight past the limit: h11 refuses it (an OpenAI object, not uvicorn's text)
    without waiting for the rest."""
    got = raw(server, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (2 * limits.MAX_HEAD_BYTES), 10)
    status, err = response(got)
    assert status.startswith(b"HTTP/1.1 400") and err["code"] == "invalid_http_request", got[:300]
    quick(server)


def test_kept_alive_requests_still_work(server):
    """The read deadline counts per request: a connection that sends whole requests stays usable."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            time.sleep(READ_TIMEOUT / 2)
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


# ---- 9: the API key off the command line ----------------------------------------------------------------

def run_cli(tmp_path, *args, env=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "NANOQWEN_API_KEY"} | (env or {}) | \
        {"NANOQWEN_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(PACKAGE_DIR.parent)}
    return subprocess.run([sys.executable, "-m", "nanoqwen.cli.main", "serve", str(SMALL_PY_DIR), "--backend",
                           "reference", "--port", "0", *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, env, needle", [
    (["--api-key", "a", "--api-key-file", "KEYFILE"], None, "--api-key and --api-key-file both give the API key"),
    (["--api-key", "a"], {"NANOQWEN_API_KEY": "b"}, "--api-key and NANOQWEN_API_KEY both give"),
    (["--api-key-file", "KEYFILE"], {"NANOQWEN_API_KEY": "b"}, "--api-key-file and NANOQWEN_API_KEY both give"),
    ([], {"NANOQWEN_API_KEY": ""}, "NANOQWEN_API_KEY: the API key is empty"),
    (["--api-key-file", "/nonexistent/key"], None, "--api-key-file /nonexistent/key: cannot read"),
    (["--api-key-file", "FIFO"], None, "not a regular file"),
    (["--api-key", "two words"], None, "printable ASCII without spaces"),
])
def test_api_key_source_errors_are_one_line(tmp_path, args, env, needle):
    (tmp_path / "key").write_text("secret\n")
    os.mkfifo(tmp_path / "fifo")   # opened without waiting for a writer
    args = [{"KEYFILE": str(tmp_path / "key"), "FIFO": str(tmp_path / "fifo")}.get(a, a) for a in args]
    r = run_cli(tmp_path, *args, env=env, timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1 and needle in errors[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("source", ["file", "env"])
def test_api_key_from_a_file_or_the_environment(tmp_path, source):
    key = "sk-" + os.urandom(8).hex()
    (tmp_path / "key").write_text(key + "\n")
    args, env = (["--api-key-file", str(tmp_path / "key")], {}) if source == "file" else ([], {"NANOQWEN_API_KEY": key})
    s = ServerProcess(SMALL_PY_DIR, *args, log_dir=tmp_path, env={"NANOQWEN_CACHE_DIR": str(tmp_path), **env})
    try:
        with open(f"/proc/{s.proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200
    finally:
        s.close()
