"""The code-edit workload's speculative rounds, replayed on the CPU from plain greedy output and priced by a
model's measured step costs (issue 20: predict the 7B's edit speed-up from the measured acceptance and the
measured m-row step costs, and check the prediction where the small model allows it).

Greedy speculative output is plain greedy output (runtime/drafters.py ``accept``), so a request's rounds
follow from its plain tokens alone: at each round the runner's loop (runtime/runner.py) asks the same
``Speculation`` for a draft, and the verify's choices are the plain tokens at those positions. ``replay``
runs that loop without a model; ``price`` times the rounds with a model's step costs:

* a verify of k drafts costs the wall time of the smallest bucket of at least k + 1 rows (a verify waits
  for its argmaxes, host included: ``wall_times``' figures, which the runner's cost rule also reads);
* a plain step, here and in the plain baseline, costs the decode graph step (plain steps run ahead of the
  host; the small model's speculate JSON holds no graph step of its own, so its measured decode step, launched
  and waited for, stands in, and the host term below absorbs the difference);
* each verify round adds ``host_ms`` of the host's own work beyond the step's wall time (the drafter, the
  bookkeeping, the plain steps' restart), which the small model's measured run calibrates: its decode time
  (the measured speculative run less the plain run's time beyond its replayed steps, i.e. the prefill and
  request overhead both runs pay) less the replayed rounds, per verify.

The prompt's prefill is the same in both runs and left out, so the figure is the decode part's speed-up.

    python -m nanoqwen.bench.edit_replay --measured results/speculate-h100-2026-12-05-stage.json \\
        --steps results/steps-h100-2026-12-06-norm-apart.json --run B --json out.json

runs the small model's plain greedy output on the CPU (the numpy reference engine; bench/edits.EDIT_MODEL, the
small model trained on the workload's format), replays it under the small model's measured costs (the check: its
drafted / accepted / verify counts and speed-up beside the GPU's, ``--measured``) and under the 7B's (``--steps``:
a steps or speculate JSON), then under the 7B's with each bucket's verify 10% cheaper in turn (``sensitivity``:
which step the speed-up rests on). A ``--measured`` run of another model (before 2026-12-08: small-py) gives
the step costs only, and ``--host-ms`` the host's work a verify."""

from __future__ import annotations

import argparse
import datetime
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .. import config, paths
from ..runtime.drafters import PromptLookup, Speculation
from . import protocol
from .kernels import git_commit
from .edits import EDIT_MODEL, EDIT_SOURCE, edit_cases


@dataclass
class Rounds:
    """One request's speculative decoding: the rows of each verify (k + 1) and the plain steps between."""
    verify_rows: list[int]
    plain_steps: int
    drafted: int
    accepted: int


def replay(prompt: list[int], plain: list[int], setting, costs: dict[int, float] | None, max_draft: int) -> Rounds:
    """The runner's speculative loop for a greedy request whose plain output is ``plain`` (its first token
    from the prefill), with ``setting``'s drafter and the cost rule over ``costs`` (rows -> ms; None: the
    drafter's own k). The tokens it accepts are ``plain`` (asserted)."""
    spec = Speculation(setting(prompt), costs)
    gen = spec.accept([], [plain[0]])
    rows, steps = [], 0
    while len(gen) < len(plain):
        limit = min(len(plain) - len(gen) - 1, max_draft)
        n = spec.commit_plain(limit)
        drafts = [] if n else spec.draft(limit)
        if drafts:
            p = len(gen)
            gen += spec.accept(drafts, plain[p:p + len(drafts) + 1])
            rows.append(len(drafts) + 1)
        else:
            for _ in range(max(n, 1)):
                gen += spec.accept([], [plain[len(gen)]])
                steps += 1
    assert gen == plain, "a replayed round accepted a token plain greedy decoding did not choose"
    return Rounds(rows, steps, spec.drafted, spec.accepted)


def price(rounds: list[Rounds], verify_ms: dict[int, float], step_ms: float, host_ms: float = 0.0) -> dict:
    """Decode time of the rounds against plain decoding of the same tokens (``verify_ms``: bucket -> a
    verify's wall ms; ``step_ms``: the decode graph step; ``host_ms``: the host's own work a verify)."""
    buckets = sorted(verify_ms)
    used = Counter(next(b for b in buckets if b >= r) for rs in rounds for r in rs.verify_rows)
    verifies = sum(used.values())
    spec = sum(verify_ms[b] * n for b, n in used.items())
    spec += step_ms * sum(rs.plain_steps for rs in rounds) + host_ms * verifies
    tokens = sum(len(rs.verify_rows) + rs.accepted + rs.plain_steps for rs in rounds)   # after the first
    plain = step_ms * tokens
    return {"plain_ms": plain, "spec_ms": spec, "speedup": plain / spec, "verifies": verifies, "host_ms": host_ms,
            "verifies_by_bucket": {b: used[b] for b in buckets if used[b]}}


def sensitivity(cases, setting, verify_ms: dict[int, float], step_ms: float, host_ms: float, max_draft: int,
                faster: float = 0.1) -> dict[int, float]:
    """Bucket -> the predicted speed-up with that bucket's verify ``faster`` (a fraction) cheaper: which step's
    cost the workload's speed-up rests on (the cost rule may then draft other lengths)."""
    out = {}
    for m in sorted(verify_ms):
        costs = {**verify_ms, m: verify_ms[m] * (1 - faster)}
        out[m] = price([replay(p, o, setting, costs, max_draft) for p, o in cases], costs, step_ms, host_ms)["speedup"]
    return out


def plain_outputs(small: Path, text: str, gen: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, plain greedy tokens) of each edit case on the CPU reference engine."""
    from ..backends import ReferenceEngine
    from ..modelcache import resolve
    from ..tokenizer import load as load_tokenizer
    tok = load_tokenizer(small)
    engine = ReferenceEngine(resolve(small, log=lambda m: None), 2048)
    return [(p, list(engine.generate(p, gen))) for p in (tok.encode(t) for t, _kind in edit_cases(text))]


def costs_of(res: dict) -> tuple[dict[int, float], float]:
    """(rows -> a verify's wall ms, the decode graph step ms) of a speculate or steps JSON."""
    return {int(m): ms for m, ms in res["step_wall_ms"].items()}, res["step"]["1"]["ms"]


def run(measured: dict, steps: dict, gen: int = 96, host_ms: float | None = None) -> dict:
    """``measured``'s edit run of another model than EDIT_MODEL (runs before it record none: small-py's) still
    prices the rounds (the two models have the same shapes, so the same step costs), but checks nothing and
    cannot calibrate the host's work a verify: ``host_ms`` (an earlier calibration) gives it."""
    edit = measured["edit"]
    model = edit.get("model", "tests/data/small-py")
    if model != EDIT_MODEL and host_ms is None:
        raise ValueError(f"the measured edit run is {model}'s, not {EDIT_MODEL}'s: give the host's work a verify")
    top = paths.checkout()
    cases = plain_outputs(top / EDIT_MODEL, (top / EDIT_SOURCE).read_text(), gen)
    setting, max_draft = PromptLookup(max_draft=15), max(config.default().multirow.buckets) - 1
    small_costs = {int(m): ms for m, ms in edit["costs_ms"].items()}
    small = [replay(p, out, setting, small_costs, max_draft) for p, out in cases]
    alone = price(small, small_costs, small_costs[1])
    if model == EDIT_MODEL:
        check = [{"kind": c["kind"], "measured": [c["drafted"], c["accepted"], c["verifies"]],
                  "replayed": [r.drafted, r.accepted, len(r.verify_rows)]} for c, r in zip(edit["cases"], small)]
        t_plain, t_spec = (1e3 * sum(c[k] for c in edit["cases"]) for k in ("plain_s", "spec_s"))
        host = (t_spec - (t_plain - alone["plain_ms"]) - alone["spec_ms"]) / alone["verifies"]
        measured_run = {"measured_speedup": edit["speedup"],
                        "cases_identical": sum(c["measured"] == c["replayed"] for c in check), "cases": check}
    else:
        host, measured_run = host_ms, {"measured_model": model, "host_ms_given": True}
    wall7, step7 = costs_of(steps)
    big = [replay(p, out, setting, wall7, max_draft) for p, out in cases]
    # issue 20's step goals: up to 8 rows within 1.25x the decode step, 16 within 1.6x (here of its wall time)
    goal = {m: wall7[1] * (1.0 if m == 1 else 1.25 if m <= 8 else 1.6) for m in wall7}
    at_goal = [replay(p, out, setting, goal, max_draft) for p, out in cases]
    return {"kind": "nanoqwen-edit-replay", "schema": 2, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "how": __doc__.split("\n\n")[1].replace("\n", " "),
            "small": {"model": EDIT_MODEL, "costs_from": measured["commit"], "gpu": measured["gpu"]["name"],
                      "acceptance": sum(r.accepted for r in small) / max(sum(r.drafted for r in small), 1),
                      "replayed": alone, "predicted": price(small, small_costs, small_costs[1], host),
                      "host_ms_per_verify": host} | measured_run,
            "7b": {"costs_from": steps["commit"], "gpu": steps["gpu"]["name"], "verify_ms": wall7, "step_ms": step7,
                   "acceptance": sum(r.accepted for r in big) / max(sum(r.drafted for r in big), 1),
                   "verify_rows": sorted(set(n for r in big for n in r.verify_rows)),
                   "steps_alone": price(big, wall7, step7), "predicted": price(big, wall7, step7, host),
                   "at_issue_goals": price(at_goal, goal, step7, host),
                   "if_10pct_faster": sensitivity(cases, setting, wall7, step7, host, max_draft)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.edit_replay", description=__doc__.split("\n")[0])
    p.add_argument("--measured", type=Path, required=True, help="a speculate JSON with the small model's edit run")
    p.add_argument("--steps", type=Path, required=True, help="a steps or speculate JSON with the 7B's step costs")
    p.add_argument("--run", help="the run of a steps A/B JSON (its \"runs\") to take the 7B's costs from")
    p.add_argument("--host-ms", type=float, help="the host's work a verify, where --measured ran another model")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    steps = json.loads(args.steps.read_text())
    if "runs" in steps:
        if args.run not in steps["runs"]:
            p.error(f"--steps {args.steps} holds runs {', '.join(steps['runs'])}: name one with --run")
        steps = steps["runs"][args.run]
    try:
        res = run(json.loads(args.measured.read_text()), steps, host_ms=args.host_ms)
    except ValueError as e:
        p.error(str(e))
    s, b = res["small"], res["7b"]
    check = (f"measured {s['measured_speedup']:.2f}x, {s['cases_identical']}/{len(s['cases'])} cases with the GPU's "
             f"counts" if "cases" in s else f"steps measured on {s['measured_model']}, not checked")
    print(f"small model ({s['gpu']}, {s['costs_from']}): acceptance {s['acceptance']:.2f}, its steps alone "
          f"{s['replayed']['speedup']:.2f}x, predicted {s['predicted']['speedup']:.2f}x ({check}); the host's own "
          f"work {s['host_ms_per_verify']:.3f} ms a verify")
    print(f"7B ({b['gpu']}, {b['costs_from']}): acceptance {b['acceptance']:.2f}, verifies of {b['verify_rows']} "
          f"rows, steps alone {b['steps_alone']['speedup']:.2f}x, predicted {b['predicted']['speedup']:.2f}x; with "
          f"the issue's step goals {b['at_issue_goals']['speedup']:.2f}x")
    print(f"7B verifies by bucket {b['predicted']['verifies_by_bucket']}; predicted with one bucket's step 10% "
          f"faster: " + ", ".join(f"m={m} {x:.2f}x" for m, x in b["if_10pct_faster"].items()))
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
