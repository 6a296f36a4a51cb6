"""Host time of an editor's /infill on this CPU, llama.vim's default request shape (16 extra chunks of 64
lines, 256 lines before the cursor, 64 after), text from this repository's own sources, the small test
model's tokenizer:

- tokenizing it as the server does (serve/prompts.repo_fim): the first request (a fresh tokenizer), the
  same request again, and a keystroke later (one more character before the cursor each time, the extra
  chunks unchanged);
- the server's whole TTFT (its histogram: request received -> first token) of keystroke re-requests against
  tools/measure_host_step.py's stand-in engine, whose steps cost nothing: the host's floor under a
  re-request's TTFT (JSON, pydantic, tokenizing, the request check, the prefix match, scheduling), and the
  client's wall time over one kept-alive connection;
- the same for issue 21's benchmark request, token ids in (`nanoqwen.bench.serve`'s 4096-token prompt whose
  first 4064 tokens the previous request had, /v1/completions): the host's floor under that figure.

Medians over --reps. Usage: python tools/measure_infill.py [--reps 11] [--json FILE]"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import httpx

from measure_host_step import stand_in
from nanoqwen import testmodels
from nanoqwen.bench.kernels import git_commit
from nanoqwen.bench.server_ttft import ServerTTFT
from nanoqwen.serve import prompts
from nanoqwen.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
CHUNKS, CHUNK_LINES, PREFIX_LINES, SUFFIX_LINES = 16, 64, 256, 64   # llama.vim's defaults


def request(lines: list[str]) -> tuple[list[tuple[str, str]], str, str]:
    chunks = [(f"chunk{i}.py", "\n".join(lines[CHUNK_LINES * i:CHUNK_LINES * (i + 1)])) for i in range(CHUNKS)]
    at = CHUNKS * CHUNK_LINES
    return chunks, "\n".join(lines[at:at + PREFIX_LINES]), "\n".join(lines[at + PREFIX_LINES:at + PREFIX_LINES + SUFFIX_LINES])


def rerequests(tokens: int, reps: int, path: str, body) -> tuple[dict, dict]:
    """``reps`` re-requests ``body(r)`` to ``path`` (after two to warm up) against a stand-in server whose
    context holds ``tokens``: (medians and samples of its TTFT and the client's, the last response's JSON)."""
    with stand_in(1, tokens, 0.0) as srv, httpx.Client(timeout=120) as client:
        server_ms, client_ms = [], []
        for r in range(reps + 2):
            with ServerTTFT(srv) as ttft:
                t0 = time.perf_counter()
                res = client.post(f"{srv.url}{path}", json=body(r))
                wall = time.perf_counter() - t0
                res.raise_for_status()
            if r >= 2:
                server_ms.append(ttft.ms)
                client_ms.append(1e3 * wall)
    return ({"server_ttft": statistics.median(server_ms), "client": statistics.median(client_ms),
             "samples_ms": {"server_ttft": server_ms, "client": client_ms}}, res.json())


def server(chunks, prefix: str, suffix: str, tokens: int, reps: int) -> dict:
    """Keystroke re-requests of /infill (one more character before the cursor each time)."""
    extra = [{"filename": name, "text": text} for name, text in chunks]
    times, last = rerequests(tokens, reps, "/infill", lambda r: {
        "input_extra": extra, "input_prefix": prefix + "x" * r, "input_suffix": suffix, "n_predict": 1})
    return times | {"tokens_cached": last["tokens_cached"]}


def ids_server(reps: int, n: int = 4096, changed: int = 32) -> dict:
    """Re-requests of ``n`` token ids whose last ``changed`` differ each time, to /v1/completions."""
    base = [(7 * i) % 2000 + 3 for i in range(n)]   # ids of the small model's vocabulary, fixed
    times, _ = rerequests(n, reps, "/v1/completions", lambda r: {
        "prompt": base[:n - changed] + [(r + j) % 2000 + 3 for j in range(changed)], "max_tokens": 1,
        "temperature": 0})
    return {"tokens": n, "changed": changed} | times


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    lines = [line for f in sorted((ROOT / "nanoqwen").rglob("*.py")) for line in f.read_text().splitlines()]
    chunks, prefix, suffix = request(lines)
    tokens = len(prompts.repo_fim(Tokenizer(testmodels.SMALL_PY_DIR), chunks, prefix, suffix))
    first, again, keystroke = [], [], []
    for r in range(args.reps):
        tok = Tokenizer(testmodels.SMALL_PY_DIR)
        tok.encode_text("warm")   # builds the tokenizer's plain copy: loading, not tokenizing
        first.append(ms(lambda: prompts.repo_fim(tok, chunks, prefix, suffix)))
        again.append(ms(lambda: prompts.repo_fim(tok, chunks, prefix, suffix)))
        keystroke.append(ms(lambda: prompts.repo_fim(tok, chunks, prefix + "x" * (r + 1), suffix)))
    stand = server(chunks, prefix, suffix, tokens, args.reps)
    ids = ids_server(args.reps)
    res = {"kind": "nanoqwen-infill-host", "schema": 1, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpu": platform.processor() or platform.machine(), "tokenizer": "tests/data/small-py (2048 tokens)",
           "request": {"chunks": CHUNKS, "chunk_lines": CHUNK_LINES, "prefix_lines": PREFIX_LINES,
                       "suffix_lines": SUFFIX_LINES, "tokens": tokens},
           "ms": {"first": statistics.median(first), "same_again": statistics.median(again),
                  "keystroke": statistics.median(keystroke)},
           "samples_ms": {"first": first, "same_again": again, "keystroke": keystroke},
           "stand_in_server_ms": stand, "ids_rerequest_ms": ids}
    m = res["ms"]
    print(f"{tokens} tokens: tokenizing the first request {m['first']:.2f} ms, the same again {m['same_again']:.2f} ms, "
          f"a keystroke later {m['keystroke']:.2f} ms\n"
          f"a keystroke later through the server, its engine instant: TTFT {stand['server_ttft']:.2f} ms server-side, "
          f"{stand['client']:.2f} ms at the client ({stand['tokens_cached']} of {tokens} tokens cached)\n"
          f"{ids['tokens']} token ids re-requested, the last {ids['changed']} changed, its engine instant: TTFT "
          f"{ids['server_ttft']:.2f} ms server-side, {ids['client']:.2f} ms at the client")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
