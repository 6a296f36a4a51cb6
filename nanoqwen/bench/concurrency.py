"""Several streaming clients at once (`python -m nanoqwen.bench.serve --concurrency --json OUT`; issue 24):

  (a) for 1, 2, 4, 8, 16 clients streaming together (one kept-alive httpx.Client each, started at one
      barrier, one request each): aggregate tokens/s (every client's tokens over the wall time from the
      barrier to the last chunk) and the per-stream inter-token latency p50 / p99 (the gaps between
      consecutive text chunks as each client receives them, pooled over the streams);
  (b) TTFT of a request arriving while 7 others decode: server-side (the server's TTFT histogram, sum
      delta over that one request, taken once the 7 have all streamed their first token) and at the client.
      The 7 ask for LOAD_TOKENS tokens and hang up once the probe has its answer (the server cancels them),
      so they outlast it whatever the machine's speed. An engine that runs one sequence at a time has no
      (b): the probe would wait in the queue behind the 7, so the JSON says so instead of a number.

The server runs with ``--max-running 16``; an engine without the multi-sequence step runs one at a time
(then the figures show the queue). Prompts are uniform random token ids (seed 0), sent as ids, over the
word-level tokenizer of bench/serve.py. ``measure`` is the table against any server that takes token-id
prompts on /v1/completions: bench/llamacpp.py runs it against llama-server."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time

import httpx
import numpy as np

from .protocol import SYNTHETIC_SEED

LEVELS = (1, 2, 4, 8, 16)
BACKGROUND = 7       # streams decoding while the TTFT of (b) is measured
LOAD_TOKENS = 1024   # ... each asking for this many tokens; they hang up when the probe has its answer


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


def stream_stamps(client: httpx.Client, url: str, prompt: list[int], gen: int, started=None,
                  until=None, extra: dict | None = None) -> list[float]:
    """perf_counter() at each text chunk of one streamed greedy request (``extra``: more body fields);
    ``started`` (an Event) is set at the first one; once ``until`` (an Event) is set the client hangs up at
    its next chunk."""
    stamps = []
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True} | (extra or {})
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                if started is not None and len(stamps) == 1:
                    started.set()
                if until is not None and until.is_set():
                    return stamps
    if len(stamps) != gen:
        raise RuntimeError(f"{len(stamps)} text chunks for {gen} tokens")
    return stamps


def together(fns: list) -> list:
    """Each of ``fns`` in its own thread, released at one barrier; (their results, the release time)."""
    out, errors, barrier = [None] * len(fns), [], threading.Barrier(len(fns) + 1)

    def work(i):
        try:
            barrier.wait()
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out, t0


def level(url: str, clients: list[httpx.Client], prompts: list[list[int]], gen: int, extra=None) -> dict:
    """(a) for len(prompts) clients."""
    stamps, t0 = together([lambda c=c, p=p: stream_stamps(c, url, p, gen, extra=extra)
                           for c, p in zip(clients, prompts)])
    gaps = [1e3 * (b - a) for s in stamps for a, b in zip(s, s[1:])]
    wall = max(s[-1] for s in stamps) - t0
    return {"clients": len(prompts), "tokens": len(prompts) * gen, "wall_s": wall,
            "aggregate_tokens_per_s": len(prompts) * gen / wall,
            "itl_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
            "ttft_client_ms": {"median": statistics.median(1e3 * (s[0] - t0) for s in stamps)}}


def ttft_under_load(url: str, clients: list[httpx.Client], background: list[list[int]], prompt: list[int],
                    probe, extra=None) -> dict:
    """(b): ``background`` streams decode (up to LOAD_TOKENS tokens); once all have their first token,
    ``probe(client, prompt)`` times one request (one token, not streamed); then the streams hang up."""
    started = [threading.Event() for _ in background]
    answered = threading.Event()
    result: dict = {}

    def timed():
        for e in started:
            if not e.wait(600):
                raise RuntimeError("a background stream never started")
        result.update(probe(clients[-1], prompt), end=time.perf_counter())
        answered.set()
    fns = [lambda c=c, p=p, e=e: stream_stamps(c, url, p, LOAD_TOKENS, e, answered, extra)
           for c, p, e in zip(clients, background, started)]
    try:
        stamps, _ = together(fns + [timed])
    finally:
        answered.set()   # a failed probe must not leave the streams running to LOAD_TOKENS
    if not all(s[-1] > result["end"] for s in stamps[:-1]):
        raise RuntimeError(f"a background stream ended before the probe's answer (LOAD_TOKENS {LOAD_TOKENS})")
    return {k: v for k, v in result.items() if k != "end"}


def measure(url: str, vocab: int, prompt_len: int, gen: int, running: int, probe, log, extra=None) -> dict:
    """(a) and (b) against the server at ``url``, which runs ``running`` sequences at once; ``probe`` times
    (b)'s request, ``extra`` adds body fields to every streamed request."""
    rng = np.random.default_rng(SYNTHETIC_SEED)

    def rand(n):
        return rng.integers(0, vocab, n).tolist()
    clients = [httpx.Client(timeout=600) for _ in range(max(LEVELS))]
    try:
        log("warm-up: every client once, one after another")
        for c in clients:
            stream_stamps(c, url, rand(prompt_len), 4, extra=extra)
        levels = []
        for n in LEVELS:
            log(f"{n} concurrent clients x (prompt {prompt_len}, {gen} tokens)")
            levels.append(level(url, clients[:n], [rand(prompt_len) for _ in range(n)], gen, extra))
        if running > BACKGROUND:
            log(f"TTFT of a {prompt_len}-token prompt while {BACKGROUND} streams decode")
            loaded = ttft_under_load(url, clients[:BACKGROUND + 1], [rand(prompt_len) for _ in range(BACKGROUND)],
                                     rand(prompt_len), probe, extra)
        else:
            loaded = {"skipped": f"the server runs {running} sequence(s) at once: the probe would queue behind "
                                 f"the {BACKGROUND} streams"}
    finally:
        for c in clients:
            c.close()
    return {"levels": levels, f"ttft_with_{BACKGROUND}_decoding": loaded, "max_running": running}


def protocol_fields(prompt_len: int, gen: int, context: int, server: str) -> dict:
    return {"prompt_tokens": prompt_len, "gen_tokens": gen, "context": context, "server": server,
            "load": f"{BACKGROUND} streams of up to {LOAD_TOKENS} tokens, hung up once the probe has its answer",
            "clients": "one kept-alive httpx.Client per stream, started at one barrier",
            "itl": "gaps between a stream's text chunks at the client, pooled over its level's streams"}


def run(path, tok_dir, backend: str, prompt_len: int, gen: int, log, tmp) -> dict:
    """The table on `nanoqwen serve` of ``path``; (b)'s server-side TTFT is its /metrics histogram's."""
    from ..nqfile import NanoqwenFile
    from ..serve.launch import ServerProcess
    from .server_ttft import server_ttft
    context = prompt_len + max(gen, LOAD_TOKENS)
    top = max(LEVELS)
    flags = f"--max-running {top} --max-queue {top}"
    srv = ServerProcess(path, "--tokenizer", str(tok_dir), "--context", str(context), *flags.split(),
                        "--kv-tokens", str((top + 1) * context), backend=backend, log_dir=tmp, timeout=900)
    try:
        running = int(re.search(r"up to (\d+) sequences at once", srv.output())[1])   # 1: no batching
        res = measure(srv.url, NanoqwenFile(path).dims.vocab, prompt_len, gen, running,
                      lambda client, prompt: server_ttft(srv, client, prompt), log)
    finally:
        srv.close()
    return res | {"protocol": protocol_fields(prompt_len, gen, context, flags)}


def report(res: dict) -> str:
    lines = ["clients | aggregate t/s | ITL p50 ms | ITL p99 ms", "------- | ------------- | ---------- | ----------"]
    for lv in res["levels"]:
        lines.append(f"{lv['clients']:7d} | {lv['aggregate_tokens_per_s']:13.1f} | {lv['itl_ms']['p50']:10.2f} | "
                     f"{lv['itl_ms']['p99']:10.2f}")
    t = res[f"ttft_with_{BACKGROUND}_decoding"]
    if "skipped" in t:
        what = f"not measured ({t['skipped']})"
    else:
        server = (f"{t['server_ms']:.2f} ms server-side" if "server_ms" in t else
                  f"{t['prompt_ms']:.2f} ms of prompt processing (llama-server's timings)")
        what = f"{server}, {t['client_ms']:.2f} ms at the client"
    lines.append(f"TTFT while {BACKGROUND} streams decode: {what}")
    return "\n".join(lines)
