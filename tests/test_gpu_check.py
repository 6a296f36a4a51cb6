"""tools/gpu_check.sh's test lanes, run here with a stand-in interpreter (no GPU, no compile): a file named in
GPU_CHECK_PARALLEL_TESTS runs beside the others, the files that measure the whole device only after both lanes, every
file's log lands in pytest.log, and a failure in any lane fails the check; lanes separated by ";" run side
by side."""

from __future__ import annotations

import difflib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from _tools import tool

test_lanes = tool("test_lanes")
compile_cost = tool("compile_cost")

ROOT = Path(__file__).resolve().parent.parent

# Stands in for python3: the wheel install, the compile stage and the version line succeed at once; a pytest
# run logs its file with start and end times (the lane file takes longer, so the others overlap it) and
# fails for FAIL_FILE.
FAKE_PY = r"""#!/usr/bin/env bash
case "$*" in
  *nanoqwen.cli.tune*) echo "start tune $(date +%s.%N)" >> "$RUNS"; exit 0;;
  *nanoqwen.tuning.chain*) echo "chain $*" >> "$RUNS"; exit 0;;
  *nanoqwen.bench.chunks*) echo "$*" >> "$RUNS"; exit 0;;
  *tools/profile_gemv.py*|*tools/profile_gemm.py*) echo "$*" >> "$RUNS"; exit 0;;
  *nanoqwen.cli.gen*) [ -n "${NEW_ENTRY:-}" ] && echo '{"family": "embed", "compile_s": 1.5}' > "$NEW_ENTRY"; exit 0;;
  *"-m pip "*|*"import sys, numpy"*) exit 0;;
  *"cache_root()"*) echo "$CACHE"; exit 0;;
  *tools/test_lanes.py*|*tools/compile_cost.py*) exec "$REAL_PY" "$@";;
esac
f="${@: -1}"
echo "start $f $(date +%s.%N)" >> "$RUNS"
sleep "$([ "$f" = "$SLOW_FILE" ] && echo 1.5 || echo 0.2)"
echo "end $f $(date +%s.%N)" >> "$RUNS"
echo "1 passed in 0.1s ($f)"
[ "$f" = "${FAIL_FILE:-}" ] && exit 1
exit 0
"""

SLOW, OTHERS = "tests/gpu/test_gemv.py", ["tests/gpu/test_embed.py", "tests/gpu/test_driver.py"]
ALONE = ["tests/gpu/test_bench.py", "tests/gpu/test_verify_upload.py"]   # times; the device's free memory


def _gpu_check(tmp_path: Path, **env: str) -> int:
    """tools/gpu_check.sh with FAKE_PY as its python3 and ``env`` on top (runs.txt in tmp_path, $OUT its out/);
    its exit status."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PY)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "out"), RUNS=str(tmp_path / "runs.txt"),
               GPU_CHECK_KERNELS="0", PATH=f"{tmp_path}:{os.environ['PATH']}", REAL_PY=sys.executable, **env)
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], env=env, capture_output=True,
                          timeout=120).returncode


def _started(tmp_path: Path) -> list[str]:
    """The last argument of each command the stand-in ran, in order."""
    return [line.split()[1] for line in (tmp_path / "runs.txt").read_text().splitlines() if line.startswith("start")]


def _run(tmp_path: Path, fail: str = "", lanes: str = SLOW, **extra: str) -> tuple[int, dict, str]:
    runs, out = tmp_path / "runs.txt", tmp_path / "out"
    rc = _gpu_check(tmp_path, SLOW_FILE=SLOW, FAIL_FILE=fail, GPU_CHECK_TESTS=" ".join([SLOW, *ALONE, *OTHERS]),
                    GPU_CHECK_PARALLEL_TESTS=lanes, **extra)
    times = {}
    for line in runs.read_text().splitlines():
        what, f, t = line.split()
        times.setdefault(f, {})[what] = float(t)
    return rc, times, (out / "pytest.log").read_text()


def test_the_parallel_lane_overlaps_and_the_alone_files_wait(tmp_path):
    rc, t, log = _run(tmp_path)
    assert rc == 0
    assert set(t) == {SLOW, *ALONE, *OTHERS}
    assert all(t[f]["start"] < t[SLOW]["end"] for f in OTHERS)        # beside the slow file
    assert all(t[a]["start"] >= max(t[f]["end"] for f in [SLOW, *OTHERS]) for a in ALONE)   # after both lanes
    assert all(f"({f})" in log for f in t)


@pytest.mark.parametrize("fail", [SLOW, OTHERS[0]])
def test_a_failure_in_either_lane_fails_the_check(tmp_path, fail):
    rc, t, _ = _run(tmp_path, fail=fail)
    assert rc == 1 and set(t) == {SLOW, *ALONE, *OTHERS}   # and the other files still ran


@pytest.mark.parametrize("fail", ["", OTHERS[0]])
def test_lanes_run_side_by_side(tmp_path, fail):
    """Two lanes and the rest: all three overlap, the alone files wait for all, a failure in one fails."""
    rc, t, log = _run(tmp_path, fail=fail, lanes=f"{SLOW}; {OTHERS[0]}")
    assert rc == (1 if fail else 0) and set(t) == {SLOW, *ALONE, *OTHERS}
    assert all(t[f]["start"] < t[SLOW]["end"] for f in OTHERS)
    assert all(t[a]["start"] >= max(t[f]["end"] for f in [SLOW, *OTHERS]) for a in ALONE)
    assert all(f"({f})" in log for f in t)


def test_lanes_balance_past_times():
    """tools/test_lanes.py: longest first onto the least loaded lane; a file never timed takes the median."""
    times = {"a": 100.0, "b": 60.0, "c": 50.0, "d": 10.0}
    assert test_lanes.lanes(["a", "b", "c", "d"], 2, times) == [["a", "d"], ["b", "c"]]   # 110 s each
    assert test_lanes.lanes(["a", "b", "c", "d", "new"], 3, times) == [["a"], ["b", "d"], ["c", "new"]]
    assert test_lanes.lanes(["a", "b"], 4, times) == [["a"], ["b"]]   # no empty lanes


def test_lanes_take_the_longest_time_of_the_newest_day(tmp_path):
    for name, secs in [("gpu-tests-h200-2026-12-04-x.log", 300), ("gpu-tests-h200-2026-12-05-a.log", 50),
                       ("gpu-tests-h200-2026-12-05-b.log", 80)]:
        (tmp_path / name).write_text(f"== tests/gpu/test_x.py: rc=0 in {secs} s\n== tests/gpu/test_y.py: rc=1 in 9 s\n")
    assert test_lanes.durations(sorted(tmp_path.glob("*.log"))) == {"tests/gpu/test_x.py": 80.0}


def test_gpu_check_lanes_from_past_times(tmp_path):
    """GPU_CHECK_LANES=2: every file but the alone ones in two lanes side by side, those after."""
    rc, t, log = _run(tmp_path, lanes="", GPU_CHECK_LANES="2")
    assert rc == 0 and set(t) == {SLOW, *ALONE, *OTHERS}
    assert all(t[a]["start"] >= max(t[f]["end"] for f in [SLOW, *OTHERS]) for a in ALONE)
    starts = sorted(t[f]["start"] for f in [SLOW, *OTHERS])
    assert starts[1] < min(t[f]["end"] for f in [SLOW, *OTHERS])   # two lanes began together


def test_the_tuner_stage_returns_every_judged_candidate(tmp_path):
    """GPU_CHECK_TUNE: besides tuned.json, the tuner's progress file (every candidate judged on the machine)
    comes back as tune-progress.json."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    progress = cache / "tune" / "progress" / "NVIDIA_H100_80GB_HBM3.json"
    progress.parent.mkdir(parents=True)
    progress.write_text('{"gemv_int4_x-0123.cubin": {"status": "ok", "us": 25.1}}')
    assert _gpu_check(tmp_path, CACHE=str(cache), GPU_CHECK_TESTS="none", GPU_CHECK_TUNE="10") == 0
    assert (out / "tune-progress.json").read_text() == progress.read_text()
    assert (out / "tuned.json").read_bytes() == (ROOT / "tune" / "tuned.json").read_bytes()


def test_the_tuner_runs_before_the_tests(tmp_path):
    """GPU_CHECK_TUNE with tests: the tuner writes this tree's tuned.json first, so the tests (and a gate's
    A/B after them) run over the tree with its new entries, the one that lands."""
    rc, t, _ = _run(tmp_path, GPU_CHECK_TUNE="10", CACHE=str(tmp_path / "cache"))
    assert rc == 0 and set(t) == {"tune", SLOW, *ALONE, *OTHERS}
    assert t["tune"]["start"] < min(t[f]["start"] for f in [SLOW, *ALONE, *OTHERS])


def test_steps_run_here_then_in_each_ab_tree_then_here_again(tmp_path):
    """GPU_CHECK_SPECULATE=steps with two A/B trees (GPU_CHECK_STEPS_AB, space-separated): the multi-row step
    times run in this tree, then in each tree in turn (its file named for the tree), then here again."""
    trees = [tmp_path / "ab" / name for name in ("1111111", "2222222")]
    for tree in trees:
        tree.mkdir(parents=True)
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", GPU_CHECK_SPECULATE="steps",
                      GPU_CHECK_STEPS_AB=" ".join(map(str, trees))) == 0
    out = tmp_path / "out"
    assert _started(tmp_path) == [str(out / f"steps{s}.json") for s in ("", "-1111111", "-2222222", "-again")]


@pytest.mark.parametrize("rows", ["", "16"])
def test_the_timeline_times_the_bucket_it_is_given(tmp_path, rows):
    """GPU_CHECK_TIMELINE=1 times the 8-row step beside the decode step, GPU_CHECK_TIMELINE_ROWS another bucket
    (the stand-in logs the command's last argument: the bucket)."""
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", GPU_CHECK_TIMELINE="1", GPU_CHECK_TIMELINE_ROWS=rows) == 0
    assert _started(tmp_path) == [rows or "8"]


def test_compile_cost_sums_the_entries_written_since(tmp_path):
    """Cubin entries (<arch>/*.json) written at or after the time, by family; older, torn and non-cubin
    files (the tuner's results) are left out."""
    arch = tmp_path / "sm_90a"
    arch.mkdir()
    for name, family, s, mtime in [("a", "gemv_int4", 2.0, 200), ("b", "gemv_int4", 0.5, 300),
                                   ("c", "embed", 0.25, 250), ("old", "gemv_int4", 9.0, 50)]:
        p = arch / f"{name}.json"
        p.write_text(json.dumps({"family": family, "compile_s": s}))
        os.utime(p, (mtime, mtime))
    (arch / "torn.json").write_text("{")
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tuned.json").write_text(json.dumps({"meta": {}, "entries": {}}))
    assert compile_cost.cost(tmp_path, 100) == {"gemv_int4": (2, 2.5), "embed": (1, 0.25)}
    assert compile_cost.line(compile_cost.cost(tmp_path, 100)) == (
        "NVRTC during this check: 3 kernels, 3 s summed over workers (gemv_int4 2 in 2 s, embed 1 in 0 s)")


def test_the_check_ends_with_what_nvrtc_cost_it(tmp_path):
    """The stand-in compile stage writes one cache entry; one written before the check is not counted."""
    cache = tmp_path / "cache" / "sm_90a"
    cache.mkdir(parents=True)
    (cache / "before.json").write_text(json.dumps({"family": "gemv_int4", "compile_s": 7.0}))
    os.utime(cache / "before.json", (1, 1))
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", NANOQWEN_CACHE_DIR=str(tmp_path / "cache"),
                      NEW_ENTRY=str(cache / "new.json")) == 0
    log = (tmp_path / "out" / "run.log").read_text()
    assert "NVRTC during this check: 1 kernel, 2 s summed over workers (embed 1 in 2 s)" in log


def test_the_chain_judge_gets_its_role_and_variants(tmp_path):
    """GPU_CHECK_CHAIN="ROLE FIELDS...": tuning/chain.py with them as its arguments, chain.json in $OUT."""
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", GPU_CHECK_CHAIN="gate_up prefetch=1 unroll=4") == 0
    assert (tmp_path / "runs.txt").read_text() == (
        f"chain -m nanoqwen.tuning.chain gate_up prefetch=1 unroll=4 --json {tmp_path / 'out' / 'chain.json'}\n")


def test_the_gemv_profile_times_the_tiles_then_profiles_them(tmp_path):
    """GPU_CHECK_GEMV_PROFILE="TILE...": tools/profile_gemv.py --time over the tiles, then one launch of each under
    Nsight Compute (a stand-in ncu on PATH), its report in $OUT/ncu.txt."""
    ncu = tmp_path / "ncu"
    ncu.write_text('#!/usr/bin/env bash\necho "ncu" >> "$RUNS"\n'   # its options, then the command it profiles
                   'while [ "$1" != regex:gemv_int4 ]; do shift; done\nshift\nexec "$@"\n')
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    tiles = "down:splitk=4@4:rows=2 gate_up"
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", GPU_CHECK_GEMV_PROFILE=tiles) == 0
    assert (tmp_path / "runs.txt").read_text() == (
        f"tools/profile_gemv.py --time {tiles}\nncu\ntools/profile_gemv.py --runs 1 {tiles}\n")
    assert (tmp_path / "out" / "ncu.txt").exists()


def test_the_gemm_profile_times_the_tiles_then_profiles_them(tmp_path):
    """GPU_CHECK_GEMM_PROFILE="TILE...": tools/profile_gemm.py --time over the short-chunk GEMM tiles at
    GPU_CHECK_GEMM_PROFILE_M rows, then one launch of each under Nsight Compute, its report in $OUT/ncu-gemm.txt."""
    ncu = tmp_path / "ncu"
    ncu.write_text('#!/usr/bin/env bash\necho "ncu" >> "$RUNS"\n'
                   'while [ "$1" != regex:gemm_int4 ]; do shift; done\nshift\nexec "$@"\n')
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    tiles = "qkv gate_up:bn=64 down+order"
    env = dict(GPU_CHECK_TESTS="none", GPU_CHECK_GEMM_PROFILE=tiles, GPU_CHECK_GEMM_PROFILE_M="16")
    assert _gpu_check(tmp_path, **env) == 0
    assert (tmp_path / "runs.txt").read_text() == (
        f"tools/profile_gemm.py --time --m 16 --json {tmp_path / 'out' / 'gemm-time.json'} {tiles}\nncu\n"
        f"tools/profile_gemm.py --m 16 {tiles}\n")
    assert (tmp_path / "out" / "ncu-gemm.txt").exists()


def test_the_chunk_bench_writes_its_json(tmp_path):
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", GPU_CHECK_CHUNKS="1") == 0
    out = tmp_path / "out" / "chunks.json"
    assert (tmp_path / "runs.txt").read_text() == (f"-m nanoqwen.bench.chunks --timeline 32 --profile-rows 512 "
                                                   f"--json {out}\n")


def test_the_gemm_sweep_times_both_orders_at_each_row_count(tmp_path):
    """GPU_CHECK_GEMM_SWEEP="M...": tools/profile_gemm.py --time --sweep over every role in both orders, a JSON a
    row count."""
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none", GPU_CHECK_GEMM_SWEEP="8 32") == 0
    roles = "qkv o_proj gate_up down qkv+order o_proj+order gate_up+order down+order"
    assert (tmp_path / "runs.txt").read_text() == "".join(
        f"tools/profile_gemm.py --time --sweep --m {m} --json {tmp_path / 'out' / f'gemm-sweep-m{m}.json'} {roles}\n"
        for m in (8, 32))


def test_chain_judges_separated_by_semicolons_run_in_turn(tmp_path):
    """GPU_CHECK_CHAIN="A; B": one judge each, the first's JSON chain.json, the second's chain-2.json."""
    assert _gpu_check(tmp_path, GPU_CHECK_TESTS="none",
                      GPU_CHECK_CHAIN="gate_up --rows 4 unroll=2; down --rows 4 prefetch=1,unroll=2") == 0
    out = tmp_path / "out"
    assert (tmp_path / "runs.txt").read_text() == (
        f"chain -m nanoqwen.tuning.chain gate_up --rows 4 unroll=2 --json {out / 'chain.json'}\n"
        f"chain -m nanoqwen.tuning.chain down --rows 4 prefetch=1,unroll=2 --json {out / 'chain-2.json'}\n")


def test_ab_tree_applies_patches_to_the_tree_only(tmp_path):
    """tools/ab_tree.sh COMMIT PATCH...: the commit's tree with the patches applied in order, named for them; a
    hunk outside the tree's folders (tests) is left out rather than failing the patch."""
    def at_head(path: str) -> list[str]:   # the patch is written against the commit, not the working tree
        return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.splitlines(keepends=True)
    patch = tmp_path / "extra.patch"
    patch.write_text("".join(line for path in ("nanoqwen/__init__.py", "tests/conftest.py")
                             for line in difflib.unified_diff(at_head(path), at_head(path) + ["# patched\n"],
                                                              f"a/{path}", f"b/{path}")))
    out = subprocess.run(["bash", str(ROOT / "tools" / "ab_tree.sh"), "HEAD", str(patch)], capture_output=True,
                         text=True, env={**os.environ, "AB_DIR": str(tmp_path / "ab")})
    assert out.returncode == 0, out.stderr
    tree = tmp_path / "ab" / "HEAD+extra"
    assert out.stdout.strip() == str(tree)
    assert (tree / "nanoqwen" / "__init__.py").read_text().endswith("# patched\n")
    assert (tree / "templates").is_dir() and not (tree / "tests").exists()
