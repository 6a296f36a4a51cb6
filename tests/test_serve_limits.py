"""The server's limits, on a real process started with --max-running 1 --max-queue 1 --api-key
--max-body-bytes: a request beyond the queue gets 503 with Retry-After, a missing or wrong key 401 (/health
and /metrics stay open), a body over the limit 413 (declared or chunked), and the server answers on after
each. Its accepted connections send without Nagle's delay (TCP_NODELAY)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from _serve_util import server as start_server
from nanoqwen.paths import PACKAGE_DIR
from nanoqwen.testmodels import SMALL_PY_DIR

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "def fibonacci(n):", "max_tokens": 4000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(SMALL_PY_DIR, "--max-running", "1", "--max-queue", "1", "--api-key", KEY,
                     "--max-body-bytes", "4096", cache_dir=tmp_path_factory.mktemp("serve-limits"))
    yield s
    s.close()


def test_api_key(server):
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=60).status_code == 200
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="small-py", prompt="x", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_body_over_the_limit_is_413(server):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    r = httpx.post(f"{server.url}/v1/completions", json=big, headers=AUTH, timeout=60)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

    def chunked():   # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'", "max_tokens": 1}'
    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      headers=AUTH, timeout=60).status_code == 200


def test_queue_overflow_is_503_with_retry_after(server):
    """One request runs, one waits (--max-queue 1), the third is refused; the waiting one is served once
    the running one's client leaves."""
    waited = {}

    def queued():
        waited["r"] = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                 headers=AUTH, timeout=120)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, headers=AUTH, timeout=120) as running:
        lines = running.iter_lines()   # kept: a dropped line iterator closes the response (a disconnect)
        next(line for line in lines if line.startswith("data: "))
        assert server.metric("nanoqwen_requests_running") == 1, "the long request ended early"
        t = threading.Thread(target=queued)
        t.start()
        deadline = time.monotonic() + 20
        while server.metric("nanoqwen_queue_depth") != 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH,
                       timeout=60)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    t.join(60)
    assert waited["r"].status_code == 200 and waited["r"].json()["usage"]["completion_tokens"] == 2
    assert server.metric("nanoqwen_requests_total", endpoint="/v1/completions", status="503") >= 1


@pytest.mark.parametrize("args, needle", [
    (["serve", "/nonexistent/model"], "no such file or directory"),
    (["serve", "BAD", "--max-queue", "-1"], "--max-queue must be at least 0"),
    (["serve", "BAD"], "BAD"),   # a file that is no .nanoqwen: the loading error, then exit
])
def test_startup_errors_are_one_line(tmp_path, args, needle):
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(b"not a model" * 100)
    argv = [str(bad) if a == "BAD" else a for a in args] + ["--backend", "reference", "--port", "0"]
    env = dict(os.environ, NANOQWEN_CACHE_DIR=str(tmp_path), PYTHONPATH=str(PACKAGE_DIR.parent))
    r = subprocess.run([sys.executable, "-m", "nanoqwen.cli.main", *argv], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle.replace("BAD", str(bad)) in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_busy_port_is_one_line(tmp_path):
    """The server binds its port before anything loads: an address in use is one error line, exit 1."""
    import socket
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        env = dict(os.environ, NANOQWEN_CACHE_DIR=str(tmp_path), PYTHONPATH=str(PACKAGE_DIR.parent))
        r = subprocess.run([sys.executable, "-m", "nanoqwen.cli.main", "serve", str(SMALL_PY_DIR), "--backend",
                            "reference", "--port", str(port)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_accepted_connections_send_without_delay():
    """asyncio (uvicorn's loop without uvloop) sets TCP_NODELAY on an accepted connection only when the
    listening socket says IPPROTO_TCP; without it Nagle held each response's second write for the client's
    delayed ACK, ~40 ms a request on one kept-alive connection."""
    import asyncio
    import socket

    from nanoqwen.cli.serve import listen

    async def accept_one() -> int:
        sock = listen("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(
            lambda r, w: accepted.set_result(w.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                     socket.TCP_NODELAY)), sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accept_one()) == 1
