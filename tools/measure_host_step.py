"""The server's host work per step with N streams, on the CPU, and how much of it the GPU would wait for:
greedy decode steps are fed forward (runtime/batchstep.py: the next step is launched on the device before the
host takes this one's tokens), so host work shows in the step rate only where it outlasts the step.

A stand-in engine whose multi-sequence step costs only time (``Instant``: the contract of runtime/batch.py,
every row's argmax a fixed word, no logits) behind the real app in a server process of its own (uvicorn,
the scheduler, the samplers, detokenization and stop matching, SSE and the event loop) serves N clients
streaming greedy completions at once from this process. A step waits until ``step_ms`` after its launch: a
step over the same decoding sequences as the last one was launched when the last one returned (fed
forward), any other when it is called. The server's wall time per step (its step count from the stand-in)
less its waits is all host work; less ``step_ms``, it is the host work the GPU would idle for (on average,
the admissions' prompt chunks and the first and last steps included); the median time between two fed-forward
steps' returns is the steady state a stream's inter-token latency sees.

    python tools/measure_host_step.py [--streams 1 2 4 8 16] [--tokens 256] [--step-ms 1.7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from nanoqwen import testmodels, tokenizer
from nanoqwen.runtime.batch import PagesShort, Rows, Sequence
from nanoqwen.runtime.prefix_cache import PrefixCache
from nanoqwen.serve.launch import ChildServer


class Instant:
    """The multi-sequence step as a wait until ``step_s`` after its launch (a GPU step the host waits for,
    releasing the GIL, so the streams overlap as they do on the GPU; fed forward as above): every row's argmax
    is ``token``; ``waited`` sums the waits."""
    max_rows = 16
    costs = None   # steps are not timed: a drafter's k stands (the contract of runtime/batch.py)

    def __init__(self, token: int, step_s: float, pages: int = 4096, page_size: int = 16):
        self.token, self.step_s, self.cache = token, step_s, PrefixCache(pages, page_size)
        self.steps, self.waited = 0, 0.0
        self.fed, self.returned = None, 0.0   # the sequences of the step fed forward, and when it was launched
        self.periods: list[float] = []        # seconds between the returns of consecutive fed-forward steps

    def open(self, prompt, total):
        if not self.cache.can_start(total):
            raise PagesShort("no pages")
        return Sequence(self.cache.start(prompt, total), None, len(prompt), total)

    def step(self, work):
        t = time.perf_counter()
        decoding = [id(seq) for seq, _ in work] if all(seq.pos >= seq.prompt for seq, _ in work) else None
        fed = decoding is not None and decoding == self.fed
        launched = self.returned if fed else t
        while time.perf_counter() < launched + self.step_s:   # runtime/state.wait's poll (a sleep overshoots)
            time.sleep(0)
        out = []
        for seq, tokens in work:
            seq.pos += len(tokens)
            out.append(Rows([self.token] * len(tokens)))
        self.steps += 1
        now = time.perf_counter()
        if fed:
            self.periods.append(now - self.returned)
        self.returned = now
        self.waited += now - t
        self.fed = decoding
        return out

    def close(self, seq, tokens):
        self.cache.keep(seq.lease, list(tokens[:seq.pos]))

    def pages(self):
        return self.cache.usage()


class Engine:
    name, cached_tokens, speculate, prompt_logits = "instant stand-in", 0, None, False

    def __init__(self, token: int, context: int, step_s: float):
        import dataclasses
        dims = testmodels.tiny_dims()
        self.context, self.batch = context, Instant(token, step_s)
        self.dims = dataclasses.replace(dims, max_positions=context, vocab=2048)


def serve(streams: int, context: int, step_s: float) -> None:
    """The app over the stand-in engine on a free port of 127.0.0.1 (bound first and printed on stdout, as
    ``nanoqwen serve --port 0`` does; uvicorn), with one route more: GET /stand-in, its steps and their
    summed waits."""
    import uvicorn
    from nanoqwen.cli.serve import listen
    from nanoqwen.serve.app import Server, create_app
    from nanoqwen.serve.metrics import Metrics
    from nanoqwen.serve.worker import Worker
    tok = tokenizer.load(testmodels.SMALL_PY_DIR)
    metrics = Metrics()
    engine = Engine(tok.encode(" value")[0], context, step_s)
    worker = Worker(lambda: (engine, tok), metrics, streams, log=lambda m: None, max_running=streams)
    worker.start()
    app = create_app(Server(worker, metrics, "m"))
    app.get("/stand-in")(lambda: {"steps": engine.batch.steps, "waited_s": engine.batch.waited,
                                  "periods_s": engine.batch.periods})
    sock = listen("127.0.0.1", 0)
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


@contextmanager
def stand_in(streams: int, tokens: int, step_ms: float):
    """The stand-in server in a process of its own (``serve``: ``streams`` at once, 4 x ``tokens`` of
    context, a step that waits ``step_ms``), ready: a ChildServer (its ``url`` and ``metric(name)``)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        srv = ChildServer([sys.executable, __file__, "--serve", "--streams", str(streams), "--tokens", str(tokens),
                           "--step-ms", str(step_ms)], name="stand-in server", log_dir=Path(tmp),
                          bound=r"^(\d+)$", timeout=60)   # ``serve`` prints its port alone on a line
        try:
            yield srv
        finally:
            srv.close()


def measure(streams: int, tokens: int, step_ms: float) -> dict:
    """N clients (threads of this process, one kept-alive connection each) stream ``tokens`` each from a
    stand-in server process whose step takes ``step_ms``: its wall time per step less the waits is host work,
    less ``step_ms`` the host work left exposed."""
    import httpx
    with stand_in(streams, tokens, step_ms) as srv:
        url = srv.url
        clients = [httpx.Client(timeout=120) for _ in range(streams)]
        barrier, done = threading.Barrier(streams + 1), []

        def request(c, n):
            with c.stream("POST", f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": n,
                                                                 "temperature": 0, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass

        def one(c):
            barrier.wait()
            request(c, tokens)
            done.append(time.perf_counter())
        for c in clients:   # the server's first requests (lazy imports, the connections) before the clock
            request(c, 2)

        def stats() -> tuple[int, float, list[float]]:
            st = httpx.get(f"{url}/stand-in", timeout=30).json()
            return st["steps"], st["waited_s"], st["periods_s"]
        threads = [threading.Thread(target=one, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        n0, w0, p0 = stats()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = max(done) - t0
        n1, w1, p1 = stats()
        n, waited = n1 - n0, w1 - w0
        for c in clients:
            c.close()
    return {"streams": streams, "tokens_each": tokens, "steps": int(n), "wall_s": wall,
            "step_wait_ms": 1e3 * waited / n, "host_ms_per_step": 1e3 * (wall - waited) / n,
            "exposed_ms_per_step": 1e3 * wall / n - step_ms,
            "fed_forward_step_ms": {"p50": 1e3 * statistics.median(p1[len(p0):]),
                                    "p90": 1e3 * statistics.quantiles(p1[len(p0):], n=10)[-1]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=1.7, help="the stand-in step's wait (the 7B's decode step)")
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)   # the stand-in server's side
    args = p.parse_args(argv)
    if args.serve:
        serve(max(args.streams), 4 * args.tokens, args.step_ms / 1e3)
        return 0
    rows = [measure(n, args.tokens, args.step_ms) for n in args.streams]
    for r in rows:
        print(f"{r['streams']:3d} streams: {r['host_ms_per_step']:.3f} ms of host work per step, "
              f"{r['exposed_ms_per_step']:.3f} ms of it past a {args.step_ms:.2f} ms step on average "
              f"({r['steps']} steps); fed-forward steps p50 {r['fed_forward_step_ms']['p50']:.3f} ms, "
              f"p90 {r['fed_forward_step_ms']['p90']:.3f}")
    if args.json:
        import platform

        from nanoqwen.bench.kernels import git_commit
        args.json.write_text(json.dumps({"kind": "nanoqwen-host-step", "commit": git_commit(),
                                         "cpu": platform.processor() or platform.machine(),
                                         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "cores": __import__("os").cpu_count(), "step_ms": args.step_ms,
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
