"""What installing nanoqwen costs on disk: a fresh venv per variant, `pip install TREE[EXTRAS]` (not editable),
then the venv's size and package count.

    python3 tools/measure_venv.py [--tree .] [--extras "" serve] [--label new] --out venv.json

JSON: date, commit (NANOQWEN_COMMIT or git), Python, per variant: extras, MB on disk (du of the venv), the
installed distributions, and the MB of the largest ones.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nanoqwen.bench.kernels import git_commit  # noqa: E402


def du_mb(path: Path) -> float:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]) / 1e6


def measure(tree: Path, extras: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = venv / "bin" / "python"
        target = f"{tree}[{extras}]" if extras else str(tree)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-cache-dir", target], check=True)
        dists = json.loads(subprocess.run([str(py), "-m", "pip", "list", "--format", "json"], capture_output=True,
                                          text=True, check=True).stdout)
        site = next((venv / "lib").glob("python*/site-packages"))
        largest = sorted(((du_mb(p), p.name) for p in site.iterdir() if p.is_dir()), reverse=True)[:5]
        return {"extras": extras, "mb": du_mb(venv), "distributions": sorted(d["name"] for d in dists),
                "largest_mb": {name: round(mb, 1) for mb, name in largest}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, default=Path("."))
    ap.add_argument("--extras", nargs="+", default=["", "serve"])
    ap.add_argument("--label", default="", help="what the tree is (e.g. the commit before a change)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    results = [measure(args.tree.resolve(), e) for e in args.extras]
    for r in results:
        print(f"{args.label or args.tree} [{r['extras']}]: {r['mb']:.0f} MB, {len(r['distributions'])} distributions")
    doc = {"kind": "nanoqwen-venv-size", "schema": 1, "label": args.label, "commit": git_commit(),
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "variants": results}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
