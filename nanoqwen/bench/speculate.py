"""Speculative decoding on the GPU (issue 20 item 5): `python -m nanoqwen.bench.speculate --json OUT`.

  (a) the multi-row step: one replay of each bucket's graph (m = 2, 4, 8, 16 rows at positions 512..) as a
      multiple of the decode step's graph (m = 1), synthetic 7B, context 512;
  (b) tokens/s of greedy decoding with oracle drafts (the plain greedy continuation, so every draft is
      accepted) at k = 4, 8, 15, against plain decoding of the same prompt, synthetic 7B;
  (c) the draft-model drafter's cost per drafted token: a random model at Qwen2.5-0.5B's shapes with the
      7B's vocabulary drafting for the synthetic 7B;
  (a') the same steps as the host sees a verify (``wall_times``): RowStep.run's wall time (inputs up, the
      graph, the argmaxes back and waited for), and a decode step launched and waited for, per bucket, for
      the 7B and for the small model of (d): what a verify costs beyond its graph;
  (d) a code-edit workload on the small test model trained for it too (bench/edits.EDIT_MODEL): each case
      is a function of a committed standard-library source followed by an instruction to write it again with one change
      (a rename, an added argument, a changed constant) and the start of the changed copy; prompt lookup
      (`--speculate lookup`) against plain greedy decoding: acceptance, accepted tokens per verify,
      speed-up, and the output equal token for token.

Every speculative run is checked against plain greedy decoding (the same tokens, no tolerance). `--steps`
measures (a) and (a') for the 7B alone: a quick A/B of the m-row kernels, run in each tree."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .. import config, paths
from ..dims import QWEN25_7B
from ..nqfile import NanoqwenFile
from ..runtime import driver
from ..runtime.drafters import AdaptiveK, DraftModel, PromptLookup
from ..runtime.prefill import by_steps
from . import protocol
from .edits import EDIT_MODEL, EDIT_SOURCE, edit_cases
from .itl import replay_seconds
from .kernels import git_commit

CONTEXT, PROMPT, GEN = 1024, 512, 128
ORACLE_K = (4, 8, 15)
DRAFT_DIMS = dataclasses.replace(QWEN25_7B, hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64,
                                 intermediate=4864)   # Qwen2.5-0.5B's shapes, the 7B's vocabulary


class Oracle(AdaptiveK):
    """Drafts the known continuation: every draft is accepted, so k stays at max_draft."""

    def __init__(self, prompt: list[int], expected: list[int], k: int):
        super().__init__(k)
        self.P, self.seq, self.expected = len(prompt), list(prompt), expected

    def append(self, tokens) -> None:
        self.seq += tokens

    def draft(self, limit: int) -> list[int]:
        done = len(self.seq) - self.P
        return self.expected[done:done + min(self.k, limit)]


def timed(session, prompt: list[int], n: int) -> tuple[list[int], float]:
    """(tokens, decode seconds after the first token)."""
    stamps, out = [], []
    for tok in session.generate(prompt, n):
        stamps.append(time.perf_counter())
        out.append(tok)
    return out, stamps[-1] - stamps[0]


def graph_times(session, load_rows, reps: int) -> dict:
    """Milliseconds per replay of the decode graph at position PROMPT and of each multi-row graph, its inputs
    loaded by ``load_rows(m)``, and each as a multiple of the decode graph."""
    stream, dec, rows = session.state.stream, session.decoder, session.rows
    dec.reset(0, PROMPT, PROMPT)
    out = {1: replay_seconds(lambda: dec.graph.launch(stream), stream, reps)}
    for m in rows.buckets:
        load_rows(m)
        out[m] = replay_seconds(lambda m=m: rows.graphs[m].launch(stream), stream, reps)
    return {str(m): {"ms": 1e3 * s, "vs_m1": s / out[1]} for m, s in out.items()}


def step_times(session, reps: int = 50) -> dict:
    """``graph_times`` with the multi-row graphs' rows at positions 512.. of one sequence."""
    rows = session.rows
    session.runner.reserve(PROMPT + reps + rows.m + 1)
    try:   # the reserved sequence's table, offsets 0
        return graph_times(session, lambda m: rows.load([0] * m, list(range(PROMPT, PROMPT + m))), reps)
    finally:
        session.runner.cache.clear()


def sequence_step_times(path: Path, cfg, log, reps: int = 50) -> dict:
    """``graph_times`` with each multi-row graph's m rows m sequences, one row each at position PROMPT on its
    own pages (the step of m concurrent streams, runtime/batchstep.py; ``step_times``' rows are one
    sequence's, whose pages the attention shares), the decode graph over the first of them. A session of its
    own, whose KV cache holds the largest bucket's sequences."""
    from ..runtime.session import CudaSession
    session = CudaSession(path, CONTEXT, log=log, cfg=cfg, kv_tokens=cfg.multirow.buckets[-1] * CONTEXT)
    rows, cache = session.rows, session.runner.cache
    try:
        # distinct prompts (no reuse); the decode graph appends a position a replay (its warm-up and reps)
        tables = [cache.start([i], PROMPT + reps + 2).pages for i in range(rows.m)]
        session.state.kv.load(tables[0], session.state.stream)
        return graph_times(session, lambda m: rows.load([0] * m, [PROMPT] * m, tables[:m]), reps)
    finally:
        session.close()


def wall_times(session, reps: int = 20) -> dict:
    """Median wall milliseconds of one step as a verify runs it, host included: bucket m's ``RowStep.run``
    (m rows at positions 512..) and, for m = 1, the decode step launched and waited for (a verify without
    drafts before plain stretches ran ahead)."""
    dec, rows, sh = session.decoder, session.rows, session.state
    session.runner.reserve(PROMPT + rows.m + 1)

    def median(call) -> float:
        spans = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            spans.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(spans)

    def decode_step():
        by_steps(dec, [0], PROMPT, read_token=True)
        sh.wait_step(PROMPT)
    try:
        out = {"1": median(decode_step)}
        for m in rows.buckets:
            out[str(m)] = median(lambda m=m: rows.run([0] * m, list(range(PROMPT, PROMPT + m))))
    finally:
        session.runner.cache.clear()
    return out


def oracle_rates(session, rng, vocab: int) -> dict:
    prompt = rng.integers(0, vocab, PROMPT).tolist()
    plain, t_plain = timed(session, prompt, GEN)
    res = {"plain_tokens_per_s": (GEN - 1) / t_plain}
    costs, session.runner.costs = session.runner.costs, None   # the oracle's k as given, not as the costs say
    for k in ORACLE_K:
        session.runner.speculate = lambda p, k=k: Oracle(p, plain, k)
        try:
            got, t = timed(session, prompt, GEN)
        finally:
            session.runner.speculate, session.runner.costs = None, costs
        assert got == plain, f"oracle k={k}: speculative output differs from plain greedy"
        res[f"k{k}"] = {"tokens_per_s": (GEN - 1) / t, "speedup": t_plain / t,
                        "verifies": session.runner.spec.verifies}
    return res


def draft_cost(draft_path: Path, rng, vocab: int) -> dict:
    """Seconds per drafted token of the draft-model drafter (its greedy continuation, k = 8 at a time)."""
    from ..runtime.session import CudaSession
    engine = CudaSession(draft_path, CONTEXT, log=lambda m: None)
    try:
        drafter = DraftModel(path=str(draft_path), max_draft=8, engine=engine)
        prompt = rng.integers(0, vocab, PROMPT).tolist()
        d = drafter(prompt)
        d.draft(8)   # warm-up: the prompt's prefill
        t0, drafted = time.perf_counter(), 0
        for _ in range(10):
            out = d.draft(8)
            drafted += len(out)
            d.append(out)
        return {"ms_per_drafted_token": 1e3 * (time.perf_counter() - t0) / drafted, "drafted": drafted,
                "draft_dims": dataclasses.asdict(DRAFT_DIMS)}
    finally:
        engine.close()


def edit_workload(small: Path, text: str, gen: int = 96) -> dict:
    from ..runtime.session import CudaSession
    from ..tokenizer import load as load_tokenizer
    from ..modelcache import resolve
    tok = load_tokenizer(small)
    session = CudaSession(resolve(small, log=lambda m: None), 2048, log=lambda m: None)
    try:
        rows, t_plain, t_spec, drafted, accepted, verifies = [], 0.0, 0.0, 0, 0, 0
        for prompt_text, kind in edit_cases(text):
            prompt = tok.encode(prompt_text)
            session.runner.cache.clear()
            plain, tp = timed(session, prompt, gen)
            costs, ts_k = session.runner.costs, None
            session.runner.speculate = PromptLookup(max_draft=15)
            try:
                if costs:   # the drafter's k alone, beside the draft length the step costs choose
                    session.runner.costs = None
                    session.runner.cache.clear()
                    got, ts_k = timed(session, prompt, gen)
                    assert got == plain, f"edit case ({kind}, drafter's k): output differs from plain greedy"
                    session.runner.costs = costs
                session.runner.cache.clear()
                got, ts = timed(session, prompt, gen)
            finally:
                session.runner.speculate, session.runner.costs = None, costs
            assert got == plain, f"edit case ({kind}): speculative output differs from plain greedy"
            spec = session.runner.spec
            rows.append({"kind": kind, "prompt_tokens": len(prompt), "plain_s": tp, "spec_s": ts,
                         "spec_drafter_k_s": ts_k, "drafted": spec.drafted, "accepted": spec.accepted,
                         "verifies": spec.verifies})
            t_plain, t_spec = t_plain + tp, t_spec + ts
            drafted, accepted, verifies = drafted + spec.drafted, accepted + spec.accepted, verifies + spec.verifies
        t_k = sum(r["spec_drafter_k_s"] or 0.0 for r in rows)
        return {"model": EDIT_MODEL, "cases": rows, "gen_tokens": gen, "speedup": t_plain / t_spec,
                "wall_ms": wall_times(session),
                "speedup_drafter_k": t_plain / t_k if t_k else None,
                "costs_ms": session.runner.costs,
                "acceptance": accepted / max(drafted, 1), "accepted_per_verify": accepted / max(verifies, 1),
                "plain_tokens_per_s": len(rows) * (gen - 1) / t_plain,
                "spec_tokens_per_s": len(rows) * (gen - 1) / t_spec}
    finally:
        session.close()


def run(log=None, steps_only: bool = False) -> dict:
    from ..runtime.session import CudaSession
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    props = driver.device().props
    path = protocol.resolve_model("7b", cfg, log)
    vocab = NanoqwenFile(path, cfg).dims.vocab
    rng = np.random.default_rng(protocol.SYNTHETIC_SEED)
    res = {"kind": "nanoqwen-bench-speculate", "schema": 1, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": {"name": props.name, "driver_version": props.driver_version}}
    session = CudaSession(path, CONTEXT, log=log)
    try:
        log("multi-row step times")
        res["step"] = step_times(session)
        res["step_wall_ms"] = wall_times(session)
        if not steps_only:
            log("oracle drafts")
            res["oracle"] = oracle_rates(session, rng, vocab)
    finally:
        session.close()
    log("multi-row step times over as many sequences as rows")
    res["step_sequences"] = sequence_step_times(path, cfg, log)
    if steps_only:
        return res
    draft = config.cache_root(cfg.codegen) / "models" / "random-draft-0.5b-seed0" / "model.nanoqwen"
    if not draft.exists():
        from ..pack import pack_random
        draft.parent.mkdir(parents=True, exist_ok=True)
        pack_random(DRAFT_DIMS, draft, seed=0, cfg=cfg)
    log("draft-model drafter")
    res["draft_model"] = draft_cost(draft, rng, vocab)
    top = paths.checkout()
    if top is not None:
        log(f"code-edit workload ({EDIT_MODEL}, prompt lookup)")
        res["edit"] = edit_workload(top / EDIT_MODEL, (top / EDIT_SOURCE).read_text())
    return res


def wall_line(label: str, wall: dict) -> str:
    return f"{label}, a step as a verify runs it (host included): " + ", ".join(f"m={m} {ms:.3f} ms" for m, ms in wall.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.speculate", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--steps", action="store_true",
                   help="the multi-row step times alone (a quick A/B of the m-row kernels between two trees)")
    args = p.parse_args(argv)
    res = run(steps_only=args.steps)
    for m, s in res["step"].items():
        print(f"step m={m}: {s['ms']:.3f} ms ({s['vs_m1']:.2f}x m=1)")
    print(wall_line("7B", res["step_wall_ms"]))
    print("steps over m sequences: " + ", ".join(f"m={m} {s['ms']:.3f} ms ({s['vs_m1']:.2f}x)"
                                                 for m, s in res["step_sequences"].items()))
    if args.steps:
        protocol.save(res, args.json)
        return 0
    o = res["oracle"]
    print(f"plain {o['plain_tokens_per_s']:.1f} tokens/s; " + "; ".join(
        f"oracle k={k}: {o[f'k{k}']['tokens_per_s']:.1f} tokens/s ({o[f'k{k}']['speedup']:.2f}x)" for k in ORACLE_K))
    print(f"draft model: {res['draft_model']['ms_per_drafted_token']:.3f} ms per drafted token")
    if "edit" in res:
        e = res["edit"]
        print(f"edit workload ({len(e['cases'])} cases): acceptance {e['acceptance']:.2f}, speed-up "
              f"{e['speedup']:.2f}x ({e['spec_tokens_per_s']:.0f} vs {e['plain_tokens_per_s']:.0f} tokens/s)"
              + (f"; with the drafter's k alone {e['speedup_drafter_k']:.2f}x" if e["speedup_drafter_k"] else ""))
        print(wall_line("small model", e["wall_ms"]) + "; graph steps: "
              + ", ".join(f"m={m} {ms:.3f} ms" for m, ms in (e["costs_ms"] or {}).items()))
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
