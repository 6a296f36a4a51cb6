"""Same-run A/B of two source trees on the synthetic 7B: `nanoqwen bench 7b --no-baseline`, alternating.

    PYTHONPATH=. python3 tools/ab_bench.py OLD_TREE [--old-commit ID] [--rounds 2] [--gate 1.0]
                                           [--also ID=TREE ...] --out ab.json

OLD_TREE is a checkout of the other commit (on the device machine: a git-ignored folder such as .ab/old,
named in the device call's `carry`; `tools/ab_tree.sh COMMIT` writes one); the new side is this tree.
Rounds run old, new, old, new, ... in one process each, so drift in clocks or temperature hits both sides
alike. `--also` adds more trees to every round (a bisection in one call), reported beside old and new.
JSON: GPU, date, the commits, per run the decode and TTFT figures, the graph and eager step, the eager
regions, MBU and copy bandwidth, and the medians of each side with new vs old in percent. `--gate PCT`
exits 1 when new is more than PCT percent slower than old on any of ms/token, TTFT or the graph step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ("ms_per_token_p50", "ttft_ms_median", "graph_step_ms")


def bench(tree: Path, commit: str, out: Path) -> dict:
    """One `nanoqwen bench 7b --no-baseline` of ``tree`` in a process of its own -> the figures compared."""
    env = dict(os.environ, PYTHONPATH=str(tree), NANOQWEN_COMMIT=commit)
    subprocess.run([sys.executable, "-m", "nanoqwen.cli.main", "bench", "7b", "--no-baseline", "--out", str(out)],
                   cwd=tree, env=env, check=True)
    d = json.loads(out.read_text())
    return {"ms_per_token_p50": d["latency"]["ms_per_token"]["p50"], "ttft_ms_median": d["latency"]["ttft_ms"]["median"],
            "graph_step_ms": d["itl"]["graph_step_ms"], "eager_step_ms": d["itl"]["eager_step_ms"],
            "eager_regions_ms": d["itl"]["regions_ms"], "decode_mbu": d["mbu"]["decode_mbu"],
            "copy_GBps": d["copy"]["GBps"], "gpu": d["gpu"]["name"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path, help="the other source tree")
    ap.add_argument("--old-commit", default="old", help="its commit id, recorded in the JSON")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gate", type=float, metavar="PCT", help="fail when new is more than PCT%% slower than old")
    ap.add_argument("--also", action="append", default=[], metavar="ID=TREE", help="another tree in every round")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    new_commit = os.environ.get("NANOQWEN_COMMIT", "new")
    sides = {"old": (args.old, args.old_commit)}
    for item in args.also:
        commit, sep, tree = item.partition("=")
        if not sep or commit in ("old", "new"):
            sys.exit(f"error: --also {item!r}: expected ID=TREE with an ID other than old and new")
        sides[commit] = (Path(tree), commit)
    for side, (tree, _) in sides.items():
        if not (tree / "nanoqwen").is_dir():
            sys.exit(f"error: {tree}: not a nanoqwen source tree (no nanoqwen/ inside)")
    sides = {side: (tree.resolve(), commit) for side, (tree, commit) in sides.items()} | {"new": (ROOT, new_commit)}
    runs = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side, (tree, commit) in sides.items():
                print(f"round {r}: {side} ({commit})", file=sys.stderr, flush=True)
                runs[side].append(bench(tree, commit, Path(tmp) / f"{side}-{r}.json"))
    med = {k: {s: statistics.median(run[k] for run in runs[s]) for s in runs} for k in SUMMARY}
    for k, m in med.items():
        m["new_vs_old_pct"] = 100 * (m["new"] / m["old"] - 1)
        print(f"{k}: " + ", ".join(f"{s} {m[s]:.4f}" for s in runs) + f" (new vs old {m['new_vs_old_pct']:+.2f}%)")
    slower = [k for k, m in med.items() if args.gate is not None and m["new_vs_old_pct"] > args.gate]
    doc = {"kind": "nanoqwen-ab-decode", "schema": 1, "gpu": runs["new"][0]["gpu"],
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "how": f"tools/ab_bench.py: `nanoqwen bench 7b --no-baseline`, {args.rounds} rounds of {', '.join(runs)}",
           **{side: {"commit": sides[side][1], "runs": runs[side]} for side in runs},
           "summary": med, "gate_pct": args.gate, "gate_failed": slower}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    if slower:
        print(f"regression gate: new is more than {args.gate}% slower than old on {', '.join(slower)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
