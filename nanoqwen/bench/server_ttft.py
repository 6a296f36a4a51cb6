"""The server's own time to first token of one request, read from its /metrics histogram (the client's
clock adds the connection and the JSON). Shared by bench/serve.py and bench/concurrency.py."""

from __future__ import annotations

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
