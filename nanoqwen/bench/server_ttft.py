"""The server's own time to first token of one request, read from its /metrics histogram (the client's
clock adds the connection and the JSON). Shared by bench/serve.py and bench/concurrency.py."""

from __future__ import annotations

import time

import httpx

TTFT = "nanoqwen_time_to_first_token_seconds"


class ServerTTFT:
    """The server's own TTFT of the one request made inside the ``with``: its histogram's sum delta."""

    def __init__(self, srv):
        self.srv = srv

    def __enter__(self):
        self.sum0, self.count0 = self.srv.metric(f"{TTFT}_sum"), self.srv.metric(f"{TTFT}_count")
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            assert self.srv.metric(f"{TTFT}_count") == self.count0 + 1
            self.ms = 1e3 * (self.srv.metric(f"{TTFT}_sum") - self.sum0)


def server_ttft(srv, client: httpx.Client, prompt: list[int]) -> dict:
    """One non-streamed request of one token: server-side TTFT, client wall time."""
    with ServerTTFT(srv) as server:
        t0 = time.perf_counter()
        r = client.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        wall = time.perf_counter() - t0
        r.raise_for_status()
    return {"server_ms": server.ms, "client_ms": 1e3 * wall,
            "cached_tokens": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]}
