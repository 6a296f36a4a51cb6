"""Server benchmark (`python -m nanoqwen.bench.serve --json OUT`), on the synthetic 7B and a CUDA GPU:

  (a) server-side TTFT of a cold 512-token prompt (no prefix shared with any kept sequence),
  (b) server-side TTFT of a 4096-token prompt whose first 4064 tokens are cached (an edit near the
      cursor: the previous request had the same 4064 tokens, then something else),
  (c) streamed decode tokens/s through the server (SSE chunks as the client receives them) against the
      engine's own rate on the same prompt length, measured first in this process.

Server-side TTFT is the server's own histogram (nanoqwen_time_to_first_token_seconds: request received
-> first token generated) read as the change of its sum over one request, so neither the client nor the
network is in it; the client's wall time to the response (to the first text chunk when streaming) is
reported beside it. Every request goes over ONE kept-alive httpx.Client, as an editor's connection does:
`httpx.post` builds a new client (and its TLS context) per call, ~35 ms that no server can remove. Prompts are uniform
random token ids (seed 0), sent as ids; the random-weight model has no tokenizer, so the server gets a
word-level one of the model's vocabulary ("t0 t1 ..."): detokenization and SSE still run per token.
``--concurrency`` measures several streaming clients at once instead (bench/concurrency.py)."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from .. import config
from ..nqfile import NanoqwenFile
from . import protocol
from .kernels import git_commit
from .server_ttft import ServerTTFT

PROMPT_COLD, PROMPT_LONG, CACHED = 512, 4096, 4064
TARGETS = {"ttft_cached_ms": 5.0, "stream_vs_engine": 0.95}


def word_tokenizer(vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


def decode_rate(stamps: list[float]) -> float:
    """Tokens/s over the steps after the first token (the first one is prefill's)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def engine_rate(backend: str, path: Path, context: int, prompts: list[list[int]], gen: int, log) -> list[float]:
    from ..backends import open_engine
    from ..runtime.sampler import Sampling
    engine = open_engine(backend, path, context, log=log)
    try:
        rates = []
        for p in prompts:
            stamps = []
            for _ in engine.generate(p, gen, Sampling()):
                stamps.append(time.perf_counter())
            rates.append(decode_rate(stamps))
        return rates
    finally:
        engine.close()


def server_ttft(srv, client: httpx.Client, prompt: list[int]) -> dict:
    """One non-streamed request of one token: server-side TTFT, client wall time."""
    with ServerTTFT(srv) as server:
        t0 = time.perf_counter()
        r = client.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        wall = time.perf_counter() - t0
        r.raise_for_status()
    return {"server_ms": server.ms, "client_ms": 1e3 * wall,
            "cached_tokens": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]}


def stream_rate(srv, client: httpx.Client, prompt: list[int], gen: int) -> dict:
    """One streamed request: decode tokens/s as the client receives the chunks, TTFT at both ends."""
    stamps = []
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True}
    with ServerTTFT(srv) as server:
        t0 = time.perf_counter()
        with client.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    assert len(stamps) == gen, f"{len(stamps)} text chunks for {gen} tokens"
    return {"rate": decode_rate(stamps), "server_ms": server.ms, "client_ms": 1e3 * (stamps[0] - t0)}


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def run(reps: int = 10, gen: int = 256, model: str = "7b", backend: str = "cuda", log=None) -> dict:
    """``model``/``backend`` other than the synthetic 7B on cuda only serve to try the script elsewhere."""
    from ..serve.launch import ServerProcess
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    gpu = protocol.gpu_info(backend)
    path = protocol.resolve_model(model, cfg, log)
    nq = NanoqwenFile(path, cfg)
    dims = nq.dims
    context = PROMPT_LONG + gen
    rng = np.random.default_rng(protocol.SYNTHETIC_SEED)

    def rand(n):
        return rng.integers(0, dims.vocab, n).tolist()
    stream_prompts = [rand(PROMPT_COLD) for _ in range(reps)]
    log(f"engine: {reps} x (prompt {PROMPT_COLD}, {gen} tokens) in this process")
    engine = engine_rate(backend, path, context, stream_prompts, gen, log)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = word_tokenizer(dims.vocab, Path(tmp) / "tokenizer")
        srv = ServerProcess(path, "--tokenizer", str(tok_dir), "--context", str(context), "--max-queue", "1",
                            backend=backend, log_dir=Path(tmp), timeout=900)
        try:
            with httpx.Client(timeout=300) as client:   # one kept-alive connection, as an editor keeps
                stream_rate(srv, client, rand(PROMPT_COLD), 16)   # warm-up: first requests through every path
                cold = [server_ttft(srv, client, rand(PROMPT_COLD)) for _ in range(reps)]
                base = rand(PROMPT_LONG)
                server_ttft(srv, client, base)   # the sequence later requests share 4064 tokens with
                cached = [server_ttft(srv, client, base[:CACHED] + rand(PROMPT_LONG - CACHED)) for _ in range(reps)]
                streams = [stream_rate(srv, client, p, gen) for p in stream_prompts]
        finally:
            srv.close()
    served = [s["rate"] for s in streams]
    ratio = statistics.median(served) / statistics.median(engine)
    return {"kind": "nanoqwen-bench-serve", "schema": 1,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "backend": backend, "gpu": gpu,
            "model": protocol.model_info(nq),
            "protocol": {"repetitions": reps, "gen_tokens": gen, "context": context,
                         "prompt": f"uniform random token ids, seed {protocol.SYNTHETIC_SEED}",
                         "ttft": "server histogram (request received -> first token), sum delta per request",
                         "client": "one kept-alive httpx.Client for every request"},
            "ttft_cold_512": {k: summary([c[k] for c in cold]) for k in ("server_ms", "client_ms")}
            | {"cached_tokens": [c["cached_tokens"] for c in cold]},
            "ttft_4096_cached_4064": {k: summary([c[k] for c in cached]) for k in ("server_ms", "client_ms")}
            | {"cached_tokens": [c["cached_tokens"] for c in cached]},
            "stream_tokens_per_s": {"server": summary(served), "engine": summary(engine), "server_vs_engine": ratio},
            "stream_ttft_512": {k: summary([s[k] for s in streams]) for k in ("server_ms", "client_ms")},
            "targets": TARGETS,
            "meets": {"ttft_cached_ms": statistics.median([c["server_ms"] for c in cached]) <= TARGETS["ttft_cached_ms"],
                      "stream_vs_engine": ratio >= TARGETS["stream_vs_engine"]}}


def run_concurrency(prompt_len: int = PROMPT_COLD, gen: int = 128, model: str = "7b", backend: str = "cuda",
                    log=None) -> dict:
    """bench/concurrency.py's table on one server process."""
    from . import concurrency
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    gpu = protocol.gpu_info(backend)
    path = protocol.resolve_model(model, cfg, log)
    nq = NanoqwenFile(path, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = word_tokenizer(nq.dims.vocab, Path(tmp) / "tokenizer")
        res = concurrency.run(path, tok_dir, backend, prompt_len, gen, log, Path(tmp))
    return {"kind": "nanoqwen-bench-serve-concurrency", "schema": 1,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "backend": backend, "gpu": gpu, "model": protocol.model_info(nq)} | res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--repetitions", type=int, default=10, metavar="N")
    p.add_argument("--gen-tokens", type=int, default=256, metavar="N")
    p.add_argument("--model", default="7b", help="7b (synthetic, the default), a .nanoqwen file or a HF directory")
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--concurrency", action="store_true",
                   help="the concurrency table instead (bench/concurrency.py): 1..16 streaming clients at once")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_COLD, metavar="N", help="--concurrency's prompts")
    args = p.parse_args(argv)
    for opt, v in (("--repetitions", args.repetitions), ("--gen-tokens", args.gen_tokens),
                   ("--prompt-tokens", args.prompt_tokens)):
        if v < 1:
            p.error(f"{opt} must be at least 1, got {v}")
    if args.concurrency:
        from .concurrency import report
        res = run_concurrency(args.prompt_tokens, args.gen_tokens, args.model, args.backend)
        print(report(res))
        protocol.save(res, args.json)
        return 0
    res = run(args.repetitions, args.gen_tokens, args.model, args.backend)
    c, w, s, st = res["ttft_cold_512"], res["ttft_4096_cached_4064"], res["stream_tokens_per_s"], res["stream_ttft_512"]
    print(f"TTFT cold 512: {c['server_ms']['median']:.2f} ms server-side ({c['client_ms']['median']:.2f} ms client)\n"
          f"TTFT 4096 with 4064 cached: {w['server_ms']['median']:.2f} ms server-side "
          f"({w['client_ms']['median']:.2f} ms client; cached {w['cached_tokens'][0]})\n"
          f"stream: {s['server']['median']:.1f} tokens/s through the server, {s['engine']['median']:.1f} in the "
          f"engine ({100 * s['server_vs_engine']:.1f}%); first chunk {st['server_ms']['median']:.2f} ms "
          f"server-side, {st['client_ms']['median']:.2f} ms at the client")
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
