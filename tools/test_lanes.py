"""GPU test files split into N lanes of about equal time, for tools/gpu_check.sh (GPU_CHECK_LANES=N).

A file's time is from its "== FILE: rc=0 in S s" lines in results/gpu-tests-*.log: the longest of the newest
date's logs that time it (the date in the name; a day's runs differ by the patches applied and by what ran
beside them, so the longest is the safe figure); a file never timed takes the median of the others. Files go longest first to the lane
with the least time so far. Prints the lanes separated by ";" (GPU_CHECK_PARALLEL_TESTS's form).

    python3 tools/test_lanes.py N FILE...
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
STAGE = re.compile(r"^== (\S+\.py): rc=0 in (\d+) s$", re.M)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def durations(logs: list[Path]) -> dict[str, float]:
    """Seconds per test file: the longest figure of the newest date that has one."""
    seen: dict[str, tuple[str, float]] = {}
    for log in logs:
        m = DATE.search(log.name)
        day = m.group(0) if m else ""
        for f, s in STAGE.findall(log.read_text(errors="replace")):
            if f not in seen or (day, float(s)) > seen[f]:
                seen[f] = (day, float(s))
    return {f: s for f, (_, s) in seen.items()}


def lanes(files: list[str], n: int, times: dict[str, float]) -> list[list[str]]:
    """``files`` in ``n`` lanes (empty ones dropped), longest first onto the least loaded lane; each lane keeps
    the files' given order."""
    known = [times[f] for f in files if f in times]
    default = statistics.median(known) if known else 1.0
    t = {f: times.get(f, default) for f in files}
    load, out = [0.0] * n, [[] for _ in range(n)]
    for f in sorted(files, key=lambda f: -t[f]):
        i = load.index(min(load))
        load[i] += t[f]
        out[i].append(f)
    return [sorted(lane, key=files.index) for lane in out if lane]


def main(argv: list[str]) -> int:
    if len(argv) < 1 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: test_lanes.py N FILE...  (N >= 1)", file=sys.stderr)
        return 2
    split = lanes(argv[1:], int(argv[0]), durations(list(RESULTS.glob("gpu-tests-*.log"))))
    print("; ".join(" ".join(lane) for lane in split))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
