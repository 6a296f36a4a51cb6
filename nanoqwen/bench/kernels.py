"""GEMV kernel benchmark: each 7B decoder GEMV alone (events around one launch, median) and back-to-back
in one CUDA graph with Programmatic Dependent Launch (the way decode runs them), against the copy
bandwidth of the same device measured in the same run (cuMemcpyDtoDAsync, bytes read + written).

Weights rotate over enough distinct copies (config bench.l2_rotate_bytes in total) that L2 cannot serve
them; activations stay put (they are L2-resident in decode too). Bytes counted per call: packed weights +
scales + the input vector(s) + the output vector. Then the multi-row step's costs (bench/multirow.py): each
GEMV and the lm_head over m = 1, 2, 4, 8, 16 rows as a multiple of m = 1."""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess

import numpy as np

from .. import codegen, config, paths
from ..codegen import tuned
from ..codegen.kernels import gemv
from ..dims import QWEN25_7B, ModelDims
from ..runtime import driver
from . import multirow
from .gemv_case import GemvCase
from .replay import blocked_seconds, graph_seconds

COPY_BYTES = 2 << 30          # one direction; read + write = 4 GiB moved per copy
COPY_REPS = 10
ALONE_REPS = 50
GRAPH_CALLS_MIN = 200
BLOCKER_BYTES = 256 << 20     # memset queued before each "alone" start event: the GPU is busy while the
                              # host enqueues the launch, so host launch latency stays out of the number

def _median_spread(ts: list[float]) -> tuple[float, float, float]:
    return statistics.median(ts), min(ts), max(ts)


def copy_bandwidth(stream: driver.Stream) -> dict:
    src, dst = driver.DeviceBuffer(COPY_BYTES), driver.DeviceBuffer(COPY_BYTES)
    try:
        src.memset_u32(0x3C003C00, stream)
        dst.memset_u32(0, stream)
        times = []
        for i in range(COPY_REPS + 2):
            a, b = driver.Event().record(stream), driver.Event()
            driver.memcpy_dtod(dst.ptr, src.ptr, COPY_BYTES, stream)
            b.record(stream)
            if i >= 2:   # warm-up
                times.append(driver.Event.elapsed_ms(a, b) * 1e-3)
        t, lo, hi = _median_spread(times)
        return {"bytes_moved": 2 * COPY_BYTES, "s_median": t, "GBps": 2 * COPY_BYTES / t / 1e9,
                "GBps_min": 2 * COPY_BYTES / hi / 1e9, "GBps_max": 2 * COPY_BYTES / lo / 1e9}
    finally:
        src.free()
        dst.free()


def time_spec(case: GemvCase, fn: driver.Function, spec: gemv.GemvInt4Spec, stream: driver.Stream,
              blocker: driver.DeviceBuffer) -> dict:
    """Seconds per call of `spec` on `case`: alone (events around one launch, a memset queued before the
    start event keeps host launch latency out) and back-to-back in one captured graph with PDL."""
    launch = spec.launch()

    def call(i: int, pdl: bool) -> None:
        fn.launch(launch, stream, pdl, **case.args(i))

    for i in range(case.copies):   # warm-up: module load, first touch of every copy
        call(i, False)
    stream.synchronize()
    alone = blocked_seconds(lambda i: call(i, False), ALONE_REPS, stream, blocker)
    calls = max(GRAPH_CALLS_MIN, 2 * case.copies)
    per_call = graph_seconds(call, calls, stream)
    return {"alone": _median_spread(alone), "graph": _median_spread(per_call), "graph_calls": calls}


def rotating_copies(spec: gemv.GemvInt4Spec, rotate_bytes: int) -> int:
    return max(2, -(-rotate_bytes // spec.weight_bytes()))


def row(role: str, spec: gemv.GemvInt4Spec, t: dict, copy_GBps: float, copies: int) -> dict:
    """One result row: bytes moved per call, the floor at the measured copy bandwidth, and for both modes
    the median (min, max) time, GB/s and % of the copy bandwidth."""
    nbytes = spec.weight_bytes() + spec.io_bytes()
    out = {"role": role, "n": spec.n, "k": spec.k, "uri": spec.uri, "spec": spec.spec_repr,
           "grid": list(spec.launch().grid), "block": list(spec.launch().block), "bytes": nbytes,
           "copies": copies, "graph_calls": t["graph_calls"], "floor_us": nbytes / (copy_GBps * 1e9) * 1e6}
    for mode in ("alone", "graph"):
        med, lo, hi = t[mode]
        out[mode] = {"us": med * 1e6, "us_min": lo * 1e6, "us_max": hi * 1e6, "GBps": nbytes / med / 1e9,
                     "pct_copy": 100 * nbytes / med / 1e9 / copy_GBps}
    return out


def clocks() -> dict:
    """GPU clocks as found (nvidia-smi query; never changed)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    fields = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu,pstate"
    try:
        out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(fields.split(","), (v.strip() for v in out[0].split(",")))) if out else {}


def git_commit() -> str | None:
    if os.environ.get("NANOQWEN_COMMIT"):
        return os.environ["NANOQWEN_COMMIT"]
    top = paths.checkout()
    if top is None:
        return None
    try:
        res = subprocess.run(["git", "-C", str(top), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return res.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(dims: ModelDims = QWEN25_7B, cfg: config.Config | None = None, roles=gemv.ROLES, log=print) -> dict:
    """Copy bandwidth, then each role's GEMV as the decoder would build it on this GPU (tuned parameters
    from tune/tuned.json when present, else the config defaults; both are timed when they differ)."""
    cfg = cfg or config.default()
    dev = driver.device()
    props = dev.props
    stream = driver.Stream()
    rng = np.random.default_rng()
    result = {
        "gpu": props.name, "sm_count": props.sm_count, "l2_bytes": props.l2_bytes,
        "driver_version": props.driver_version, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "commit": git_commit(), "clocks_before": clocks(), "l2_rotate_bytes": cfg.bench.l2_rotate_bytes,
    }
    log(f"{props.name}: {props.sm_count} SMs, L2 {props.l2_bytes >> 20} MB, driver {props.driver_version}")
    copy = copy_bandwidth(stream)
    result["copy"] = copy
    log(f"copy bandwidth (cuMemcpyDtoD, read+write): {copy['GBps']:.0f} GB/s "
        f"[{copy['GBps_min']:.0f}..{copy['GBps_max']:.0f}]")
    to_time = []
    for role in roles:
        default = gemv.role_spec(role, dims, cfg)
        best = tuned.role_spec(role, dims, cfg, props.name)
        to_time += [(role, "tuned", best)] + ([(role, "default", default)] if best != default else [])
    built = codegen.build_many([spec for _, _, spec in to_time], progress=codegen.ProgressLine())
    blocker = driver.DeviceBuffer(BLOCKER_BYTES)
    rows = []
    for (role, source, spec), b in zip(to_time, built):
        copies = rotating_copies(spec, cfg.bench.l2_rotate_bytes)
        case = GemvCase(spec, rng, copies)
        try:
            r = row(role, spec, time_spec(case, driver.load(b), spec, stream, blocker), copy["GBps"], copies)
        finally:
            case.free()
        r["source"] = source
        rows.append(r)
    blocker.free()
    result["gemv"] = rows
    log(table(result))
    result["multirow"] = multirow.run(stream, copy["GBps"], dims, cfg, roles, props.name)
    log(multirow.table(result["multirow"]))
    result["clocks_after"] = clocks()
    stream.close()
    return result


def table(result: dict) -> str:
    head = (f"{'shape':<8} {'params':<8} {'N x K':>13} {'MB':>6} {'floor us':>8} | {'alone us':>8} {'GB/s':>6} {'%copy':>6} | "
            f"{'graph us':>8} {'GB/s':>6} {'%copy':>6}")
    lines = [head, "-" * len(head)]
    for r in result["gemv"]:
        a, g = r["alone"], r["graph"]
        lines.append(f"{r['role']:<8} {r['source']:<8} {r['n']:>6} x {r['k']:<6}{r['bytes'] / 1e6:>6.1f} {r['floor_us']:>8.2f} | "
                     f"{a['us']:>8.2f} {a['GBps']:>6.0f} {a['pct_copy']:>5.1f}% | "
                     f"{g['us']:>8.2f} {g['GBps']:>6.0f} {g['pct_copy']:>5.1f}%")
    lines.append(f"copy bandwidth {result['copy']['GBps']:.0f} GB/s on {result['gpu']}")
    return "\n".join(lines)
