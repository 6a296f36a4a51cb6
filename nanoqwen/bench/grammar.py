"""Structured output's cost per token (issue 25 item 2): `python -m nanoqwen.bench.grammar --json OUT`.

One engine, one prompt (uniform random token ids, seed 0), up to N greedy tokens per request, each mode
``repetitions`` times after one untimed warm-up (median of the per-request means):

  (1) plain greedy, no constraint: the server's Sampling of a plain temperature-0 request, which keeps
      the device path (the lm_head's fused argmax; on CUDA no logits leave the GPU);
  (2) greedy under a json_schema constraint (SCHEMA, strict): the Sampling the server makes of a
      response_format json_schema request (serve/sampling.py, serve/grammar.py), over the tokenizer the
      server would build its grammar on; the request ends at an end-of-generation token, as the server's;
  (3) the host loop without a constraint: the engine's ``logits=True`` call (every step's fp32 logits
      downloaded, the host waiting on each step) and the argmax taken on the host from them;

and the grammar's own time inside (2): the matcher's mask (llguidance's bitmask and its application to
the logits) and advance (consume_token) per token, timed by wrapping the request's matcher, and the
grammar's compile per request (``start``). ms/token counts the decode steps after the first token
(the first one is prefill's); the mask and advance per token count the same steps.

Tokenizer: the model's own, or ``--tokenizer DIR`` (the server's option). The synthetic 7B stores none, and
bench/serve.py's word-level stand-in cannot hold a grammar (llguidance needs a byte-level vocabulary), so
it gets a byte-level BPE of Qwen2.5's tokenizer size built from the committed corpora
(testmodels.sized_tokenizer): the mask walks a trie as large as the real one's. Qwen2.5's real tokenizer
(``--tokenizer``) gives the number that matters most."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .. import NanoqwenError, config, extras, paths, tokenizer
from ..nqfile import NanoqwenFile
from ..schema_check import valid
from . import protocol
from .kernels import git_commit

GEN, PROMPT, REPS = 128, 512, 3
QWEN25_TOKENIZER_SIZE = 151665   # Qwen2.5's tokenizer.json: 151643 tokens and 22 added ones
CORPORA = ("tests/data/corpus-cpython-3.11.7.py.txt", "tests/data/textwrap-cpython-3.11.7.py.txt")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "active", "tags", "city"],
          "properties": {"name": {"type": "string", "maxLength": 32},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "active": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
                         "city": {"type": "string", "maxLength": 32}}}


class Timed:
    """A constraint whose matchers time themselves, doing exactly what the wrapped one's do: ``start`` (the
    grammar's compile for one request), ``mask`` (of which ``bitmask`` is llguidance's own computation) and
    ``accept`` (the advance), in seconds, summed over every matcher started."""

    def __init__(self, constraint):
        self.constraint = constraint
        self.seconds = dict.fromkeys(("start", "mask", "bitmask", "accept"), 0.0)
        self.calls = dict.fromkeys(self.seconds, 0)

    def _add(self, what: str, t0: float) -> None:
        self.seconds[what] += time.perf_counter() - t0
        self.calls[what] += 1

    def start(self):
        t0 = time.perf_counter()
        m = self.constraint.start()
        self._add("start", t0)
        m.m = _TimedLL(m.m, self)   # serve/grammar.Matcher calls llguidance through its ``m``
        return _TimedMatcher(m, self)


class _TimedMatcher:
    def __init__(self, matcher, timed: Timed):
        self.matcher, self.timed = matcher, timed

    def mask(self, z) -> None:
        t0 = time.perf_counter()
        self.matcher.mask(z)
        self.timed._add("mask", t0)

    def accept(self, token: int) -> None:
        t0 = time.perf_counter()
        self.matcher.accept(token)
        self.timed._add("accept", t0)


class _TimedLL:
    """llguidance's matcher, its bitmask timed; everything else passed through."""

    def __init__(self, ll, timed: Timed):
        self.ll, self.timed = ll, timed

    def compute_bitmask(self):
        t0 = time.perf_counter()
        out = self.ll.compute_bitmask()
        self.timed._add("bitmask", t0)
        return out

    def __getattr__(self, name):
        return getattr(self.ll, name)


def synthetic_tokenizer(top: Path | None) -> tokenizer.Tokenizer:
    """The byte-level stand-in of Qwen2.5's size (module docstring), from the checkout's committed corpora."""
    from ..testmodels import sized_tokenizer, tokenizer_config
    if top is None:
        raise NanoqwenError("--model 7b: its tokenizer is built from the source checkout's tests/data, which this "
                            "installation lacks; pass --tokenizer DIR (Qwen2.5's tokenizer directory)")
    tok = sized_tokenizer([(top / c).read_text(encoding="utf-8") for c in CORPORA], QWEN25_TOKENIZER_SIZE)
    return tokenizer.Tokenizer.from_files({"tokenizer.json": tok.to_str().encode(),
                                           "tokenizer_config.json": json.dumps(tokenizer_config()).encode()},
                                          "synthetic tokenizer: ")


def requests(tok, vocab: int, prompt: list[int], gen: int):
    """(plain Sampling, Grammars, json_schema Sampling) as the server makes them of its request bodies."""
    from ..serve.grammar import Grammars
    from ..serve.prompts import stop_ids
    from ..serve.sampling import sampling
    from ..serve.schemas import CompletionRequest
    eog = stop_ids(tok)
    grammars = Grammars(tok, vocab, eog)
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "bench", "strict": True, "schema": SCHEMA}}
    plain = sampling(CompletionRequest(**body), tok, vocab, eog, grammars)
    constrained = sampling(CompletionRequest(**body, response_format=fmt), tok, vocab, eog, grammars)
    return plain, grammars, constrained, eog


def timed_request(engine, prompt: list[int], gen: int, sampling, logits: bool = False, stop=frozenset(),
                  on_first=lambda: None):
    """(tokens, ms per decode step after the first token, host argmax == device token count); ``on_first()``
    is called as the first token's time is taken, where the timed interval begins."""
    stamps, out, agree = [], [], 0
    it = engine.generate(prompt, gen, sampling, logits=logits)
    try:
        for item in it:
            if logits:   # the host loop's choice: argmax of the downloaded row (the kernels' first-max rule)
                tok, row = item
                agree += int(np.argmax(row)) == tok
            else:
                tok = item
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                on_first()
            out.append(tok)
            if tok in stop:
                break
    finally:
        it.close()
    ms = 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return out, ms, agree


def answer_check(tok, tokens: list[int], eog) -> dict:
    """Whether the constrained answer finished (an end-of-generation token) and, if so, whether its text
    parses as JSON and validates against SCHEMA (an answer cut by the token limit is reported, not failed)."""
    finished = bool(tokens) and tokens[-1] in eog
    text = tok.decode(tokens[:-1] if finished else tokens)
    out = {"text": text, "tokens": len(tokens), "finished": finished, "parses": None, "valid": None}
    if finished:
        try:
            value = json.loads(text)
        except ValueError:
            out["parses"] = False
        else:
            out["parses"], out["valid"] = True, valid(value, SCHEMA)
    return out


def run(model: str = "7b", backend: str = "cuda", gen: int = GEN, prompt_tokens: int = PROMPT, reps: int = REPS,
        tokenizer_dir: str | None = None, log=None) -> dict:
    from ..backends import open_engine
    extras.require("serve", "the grammar benchmark (the server's request code)")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    gpu = protocol.gpu_info(backend)
    path = protocol.resolve_model(model, cfg, log)
    nq = NanoqwenFile(path, cfg)
    vocab = nq.dims.vocab
    if model == "7b" and tokenizer_dir is None:
        tok_what = f"synthetic: byte-level BPE of {QWEN25_TOKENIZER_SIZE} tokens from {', '.join(CORPORA)}"
        log(tok_what)
        tok = synthetic_tokenizer(paths.checkout())
    else:
        tok = tokenizer.load(path, tokenizer_dir)
        tok_what = f"--tokenizer {tokenizer_dir}" if tokenizer_dir else "the model's own"
    prompt = np.random.default_rng(protocol.SYNTHETIC_SEED).integers(0, vocab, prompt_tokens).tolist()
    plain, grammars, constrained, eog = requests(tok, vocab, prompt, gen)
    t0 = time.perf_counter()
    grammars.lltokenizer()   # once per server (on its first grammar), not per request: not in the steps
    lltok_s = time.perf_counter() - t0
    timer = Timed(constrained.constraint)
    constrained = dataclasses.replace(constrained, constraint=timer)
    engine = open_engine(backend, path, prompt_tokens + gen, log=log)
    try:
        modes = {"plain": dict(sampling=plain), "host_loop": dict(sampling=plain, logits=True),
                 "constrained": dict(sampling=constrained, stop=eog)}
        runs = {name: [] for name in modes}
        for rep in range(reps + 1):   # rep 0: warm-up (graphs, first matcher), untimed
            for name, kw in modes.items():
                before, first = (dict(timer.seconds), dict(timer.calls)), {}
                out, ms, agree = timed_request(engine, prompt, gen, **kw,
                                               on_first=lambda: first.update(timer.seconds))
                if rep:   # mask and advance from the first token on (the interval ms times); start before it
                    runs[name].append({"tokens": out, "ms": ms, "agree": agree,
                                       "grammar": {k: timer.seconds[k] - (before[0] if k == "start" else first)[k]
                                                   for k in timer.seconds},
                                       "calls": {k: timer.calls[k] - before[1][k] for k in timer.calls}})
            log(f"rep {rep}: " + ", ".join(f"{name} {runs[name][-1]['ms']:.3f} ms/token" for name in modes)
                if rep else "warm-up done")
    finally:
        engine.close()
    return {
        "kind": "nanoqwen-bench-grammar", "schema": 1, "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend, "gpu": gpu, "model": protocol.model_info(nq),
        "protocol": {"prompt_tokens": prompt_tokens, "gen_tokens": gen, "repetitions": reps, "warmup": 1,
                     "prompt": f"uniform random token ids, seed {protocol.SYNTHETIC_SEED}",
                     "tokenizer": tok_what, "json_schema": SCHEMA,
                     "ms_per_token": "decode steps after the first token, per request; median over repetitions",
                     "grammar": "the request's matcher wrapped: mask (llguidance bitmask + applying it) and "
                                "advance (consume_token) summed over the decode steps after the first token, "
                                "divided by their count (the interval ms_per_token times)",
                     "output": "with random weights the constrained answer is whatever the grammar lets the "
                               "argmax pick: the cost is what counts, the answer is checked (parses, validates) "
                               "only when it finished within gen_tokens"}} | report(runs, tok, eog, lltok_s, plain.greedy)


def report(runs: dict, tok, eog, lltok_s: float, device_path: bool) -> dict:
    """``device_path``: the server's plain greedy Sampling keeps the device argmax (Sampling.greedy)."""
    med = {name: statistics.median(r["ms"] for r in rs) for name, rs in runs.items()}
    con = runs["constrained"]   # its answer has >= 2 tokens: the grammar's '{' cannot end a generation
    per_tok = {k: statistics.median(1e3 * r["grammar"][k] / (len(r["tokens"]) - 1) for r in con)
               for k in ("mask", "bitmask", "accept")}
    grammar_ms = per_tok["mask"] + per_tok["accept"]
    return {
        "plain": {"ms_per_token": med["plain"], "samples_ms": [r["ms"] for r in runs["plain"]],
                  "tokens": len(runs["plain"][0]["tokens"]), "device_path": device_path},
        "host_loop": {"ms_per_token": med["host_loop"], "samples_ms": [r["ms"] for r in runs["host_loop"]],
                      "tokens": len(runs["host_loop"][0]["tokens"]),
                      "host_argmax_agrees": min(r["agree"] for r in runs["host_loop"])},
        "constrained": {"ms_per_token": med["constrained"], "samples_ms": [r["ms"] for r in con],
                        "answer": answer_check(tok, con[0]["tokens"], eog),
                        "same_answer_every_repetition": all(r["tokens"] == con[0]["tokens"] for r in con)},
        "grammar": {"mask_ms_per_token": per_tok["mask"], "bitmask_ms_per_token": per_tok["bitmask"],
                    "advance_ms_per_token": per_tok["accept"], "grammar_ms_per_token": grammar_ms,
                    "start_ms_per_request": statistics.median(1e3 * r["grammar"]["start"] for r in con),
                    "masks_per_request": con[0]["calls"]["mask"], "tokenizer_build_s": lltok_s},
        "overhead": {"constrained_vs_plain_pct": 100 * (med["constrained"] / med["plain"] - 1),
                     "host_loop_vs_plain_pct": 100 * (med["host_loop"] / med["plain"] - 1),
                     # what (2) costs beyond the host loop and the grammar: the host sampler's own steps
                     "sampler_rest_ms_per_token": med["constrained"] - med["host_loop"] - grammar_ms}}


def table(res: dict) -> str:
    g, o = res["grammar"], res["overhead"]
    a = res["constrained"]["answer"]
    rows = [("(1) plain greedy" + (" (device path)" if res["plain"]["device_path"] else " (HOST PATH)"),
             res["plain"]["ms_per_token"]),
            ("(2) greedy + json_schema", res["constrained"]["ms_per_token"]),
            ("(3) host loop (logits + host argmax)", res["host_loop"]["ms_per_token"]),
            ("    grammar mask (of (2))", g["mask_ms_per_token"]),
            ("    grammar advance (of (2))", g["advance_ms_per_token"])]
    lines = [f"{'mode':<38} {'ms/token':>9}", "-" * 48] + [f"{n:<38} {v:>9.3f}" for n, v in rows]
    lines.append(f"(2) vs (1): {o['constrained_vs_plain_pct']:+.1f}%; (3) vs (1): {o['host_loop_vs_plain_pct']:+.1f}%; "
                 f"grammar compile {g['start_ms_per_request']:.2f} ms per request")
    lines.append(f"constrained answer: {a['tokens']} tokens, " + (
        f"finished, parses {a['parses']}, validates {a['valid']}" if a["finished"] else "cut by the token limit"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.grammar", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="7b", help="7b (synthetic, the default), a .nanoqwen file or a HF directory")
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer the grammar is built over (as serve's option)")
    p.add_argument("--gen-tokens", type=int, default=GEN, metavar="N")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT, metavar="N")
    p.add_argument("--repetitions", type=int, default=REPS, metavar="N")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    for opt, v, lo in (("--gen-tokens", args.gen_tokens, 2), ("--prompt-tokens", args.prompt_tokens, 1),
                       ("--repetitions", args.repetitions, 1)):
        if v < lo:
            p.error(f"{opt} must be at least {lo}, got {v}")
    from ..serve.errors import APIError   # llguidance missing, say
    try:
        res = run(args.model, args.backend, args.gen_tokens, args.prompt_tokens, args.repetitions, args.tokenizer)
    except (NanoqwenError, APIError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(table(res))
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
