"""Render the README's performance table from the benchmark results committed under results/ (the JSON
that `nanoqwen bench MODEL --out results/NAME.json` writes), so every number in the README traces to a
committed file and commit.

    python tools/results_table.py                  # print the table (results/*.json as committed at HEAD)
    python tools/results_table.py --worktree       # preview from the files on disk, committed or not
    python tools/results_table.py --update README.md   # rewrite the table between the markers

The README holds the table between ``<!-- results-table:begin -->`` and ``<!-- results-table:end -->``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
COLUMNS = ("model", "GPU", "pp t/s", "tg t/s", "ms/token p50", "TTFT ms", "decode MBU", "floor ms/token",
           "transformers fp16 ms/token", "commit", "result")


class TableError(Exception):
    pass


def committed_results(root: Path = ROOT, rev: str = "HEAD") -> dict[str, dict]:
    """results/*.json as committed at ``rev``: path -> parsed JSON."""
    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, check=True).stdout
    try:
        names = [n for n in git("ls-tree", "-r", "--name-only", rev, "--", "results/").splitlines()
                 if n.endswith(".json")]
        return {n: json.loads(git("show", f"{rev}:{n}")) for n in sorted(names)}
    except subprocess.CalledProcessError as e:
        raise TableError(f"git: {e.stderr.strip() or e}") from None


def worktree_results(root: Path = ROOT) -> dict[str, dict]:
    return {str(p.relative_to(root)): json.loads(p.read_text()) for p in sorted((root / "results").glob("*.json"))}


def _fmt_ts(t: dict) -> str:
    return f"{t['avg_ts']:.2f} ± {t['stddev_ts']:.2f}"


def row(name: str, r: dict) -> list[str]:
    tests = {("pp" if t["n_prompt"] else "tg"): t for t in r["tests"]}
    pp, tg = tests["pp"], tests["tg"]
    lat, mbu = r["latency"], r.get("mbu", {})
    tf = r.get("baseline", {}).get("transformers", {})
    return [r["model"]["label"], r["gpu"]["name"],
            f"{_fmt_ts(pp)} (pp{pp['n_prompt']})",
            f"{_fmt_ts(tg)} (tg{tg['n_gen']}" + (f" @ d{tg['n_depth']})" if tg["n_depth"] else ")"),
            f"{lat['ms_per_token']['p50']:.3f}", f"{lat['ttft_ms']['median']:.1f}",
            f"{100 * mbu['decode_mbu']:.1f}%" if "decode_mbu" in mbu else "-",
            f"{mbu['floor_ms_per_token']:.3f}" if "floor_ms_per_token" in mbu else "-",
            f"{tf['ms_per_token']:.2f}" if "ms_per_token" in tf else "-",
            str(r.get("commit") or "-"), f"[{Path(name).name}]({name})"]


def render(results: dict[str, dict]) -> str:
    rows = [row(n, r) for n, r in results.items() if r.get("kind") == "nanoqwen-bench"]
    if not rows:
        return "_No committed benchmark results yet (results/*.json)._"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    return "\n".join(lines)


def update(readme: Path, table: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise TableError(f"{readme}: no '{BEGIN}' ... '{END}' block to replace")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worktree", action="store_true", help="read results/ from disk instead of git HEAD")
    p.add_argument("--update", type=Path, metavar="README", help="replace the table between the markers")
    args = p.parse_args(argv)
    try:
        table = render(worktree_results() if args.worktree else committed_results())
        if args.update:
            update(args.update, table)
            print(f"updated {args.update}")
        else:
            print(table)
    except (TableError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
