"""What NVRTC cost a run: the kernel cache's entries written since a time, their compile seconds (each
entry's compile_s) summed by family. tools/gpu_check.sh prints it last: the device machine compiles at about
the rate of two cores, so a call that compiles much spends device time that tools/kcache.sh can spend here.

    python tools/compile_cost.py CACHE_DIR SINCE_EPOCH_SECONDS"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cost(cache: Path, since: float) -> dict[str, tuple[int, float]]:
    """family -> (kernels compiled, compile seconds summed) over the cubin entries of ``cache`` (<arch>/*.json)
    written at or after ``since``."""
    out: dict[str, tuple[int, float]] = {}
    for meta in cache.glob("sm_*/*.json"):
        try:
            if meta.stat().st_mtime < since:
                continue
            entry = json.loads(meta.read_text())
            n, s = out.get(entry["family"], (0, 0.0))
            out[entry["family"]] = (n + 1, s + float(entry["compile_s"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue   # a torn entry is the cache's miss, not this report's business
    return out


def line(families: dict[str, tuple[int, float]]) -> str:
    n, s = sum(k for k, _ in families.values()), sum(t for _, t in families.values())
    parts = [f"{f} {k} in {t:.0f} s" for f, (k, t) in sorted(families.items(), key=lambda item: -item[1][1])]
    tail = f" ({', '.join(parts)})" if parts else ""
    return f"NVRTC during this check: {n} kernel{'s' * (n != 1)}, {s:.0f} s summed over workers{tail}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(line(cost(Path(argv[0]), float(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
