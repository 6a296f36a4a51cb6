"""GEMV kernel benchmark: each 7B decoder GEMV alone (events around one launch, median) and back-to-back
in one CUDA graph with Programmatic Dependent Launch (the way decode runs them), against the copy
bandwidth of the same device measured in the same run (cuMemcpyDtoDAsync, bytes read + written).

Weights rotate over enough distinct copies (config bench.l2_rotate_bytes in total) that L2 cannot serve
them; activations stay put (they are L2-resident in decode too). Bytes counted per call: packed weights +
scales + the input vector(s) + the output vector."""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess

import numpy as np

from .. import ROOT, codegen, config, quant
from ..codegen.kernels import gemv
from ..dims import QWEN25_7B, ModelDims
from ..runtime import driver

COPY_BYTES = 2 << 30          # one direction; read + write = 4 GiB moved per copy
COPY_REPS = 10
ALONE_REPS = 50
GRAPH_CALLS_MIN = 200
BLOCKER_BYTES = 256 << 20     # memset queued before each "alone" start event: the GPU is busy while the
                              # host enqueues the launch, so host launch latency stays out of the number

# `--sweep`: tile parameters tried per role (overrides of config gemv_int4.<role>), for nanoqwen-tune's
# first table; the config defaults are always timed first.
SWEEP = {
    "qkv": [dict(rows=1), dict(rows=1, warps=2), dict(rows=2, warps=2), dict(rows=1, warps=8),
            dict(lanes=32, rows=2), dict(rows=4, warps=2)],
    "o_proj": [dict(rows=1), dict(rows=1, warps=2), dict(rows=2, warps=2), dict(rows=1, warps=8),
               dict(lanes=32, rows=2), dict(rows=4, warps=2)],
    "gate_up": [dict(tiles_per_warp=1), dict(tiles_per_warp=4), dict(tiles_per_warp=8),
                dict(warps=8), dict(warps=8, tiles_per_warp=4), dict(lanes=32, rows=2),
                dict(lanes=32, rows=2, tiles_per_warp=4)],
    "down": [dict(rows=2), dict(tiles_per_warp=1), dict(tiles_per_warp=4), dict(rows=2, tiles_per_warp=4),
             dict(rows=2, splitk=2), dict(lanes=16, rows=2), dict(warps=8, tiles_per_warp=1),
             dict(rows=2, tiles_per_warp=8)],
}


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


def _io_bytes(spec: gemv.GemvInt4Spec) -> int:
    x = spec.k * (4 + 2) if spec.norm else spec.k * 2
    y = spec.n * (2 if spec.out_f16 else 4) * (2 if spec.epilogue == "residual" else 1)
    return x + y + (2 * spec.n if spec.epilogue == "bias" else 0)


class _Case:
    """One shape's device buffers: `copies` distinct weight sets, shared activations and output."""

    def __init__(self, spec: gemv.GemvInt4Spec, rotate_bytes: int, rng):
        self.spec = spec
        self.copies = max(2, -(-rotate_bytes // spec.weight_bytes()))
        n, k, g = spec.n, spec.k, spec.group
        q = rng.integers(-7, 8, size=(n, k), dtype=np.int8)
        packed = quant.pack(q)
        scales = rng.uniform(0.002, 0.02, size=(n, k // g)).astype(np.float16)
        self.bufs = []
        self.weights = []
        for _ in range(self.copies):
            ws = {}
            for m in range(spec.mats):
                ws[f"w{m}"] = self._dev(packed)
                ws[f"s{m}"] = self._dev(scales)
            self.weights.append(ws)
        self.act = {}
        if spec.norm:
            self.act["h"] = self._dev(rng.standard_normal(k).astype(np.float32))
            self.act["norm_w"] = self._dev(rng.uniform(0.5, 1.5, size=k).astype(np.float16))
        else:
            self.act["x"] = self._dev(rng.standard_normal(k).astype(np.float16))
        if spec.epilogue == "bias":
            self.act["bias"] = self._dev(rng.standard_normal(n).astype(np.float16))
        y = rng.standard_normal(n).astype(np.float16 if spec.out_f16 else np.float32)
        self.act["y"] = self._dev(y)
        self.fn = driver.load(codegen.build(spec))
        self.launch = spec.launch()

    def _dev(self, a):
        b = driver.DeviceBuffer.from_array(a)
        self.bufs.append(b)
        return b

    def call(self, i: int, stream, pdl: bool) -> None:
        self.fn.launch(self.launch, stream, pdl, **self.weights[i % self.copies], **self.act)

    def free(self) -> None:
        for b in self.bufs:
            b.free()


def time_case(case: _Case, stream: driver.Stream, blocker: driver.DeviceBuffer) -> dict:
    for i in range(case.copies):   # warm-up: module load, first touch of every copy
        case.call(i, stream, False)
    stream.synchronize()
    alone = []
    a, b = driver.Event(), driver.Event()
    for i in range(ALONE_REPS):
        blocker.memset_u32(i, stream)
        a.record(stream)
        case.call(i, stream, False)
        b.record(stream)
        alone.append(driver.Event.elapsed_ms(a, b) * 1e-3)
    calls = max(GRAPH_CALLS_MIN, 2 * case.copies)
    with driver.capture(stream) as graph:
        for i in range(calls):
            case.call(i, stream, True)
    try:
        graph.launch(stream)   # warm-up replay
        stream.synchronize()
        per_call = []
        for _ in range(5):
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            per_call.append(driver.Event.elapsed_ms(a, b) * 1e-3 / calls)
    finally:
        graph.close()
        a.close()
        b.close()
    return {"alone": _median_spread(alone), "graph": _median_spread(per_call), "graph_calls": calls}


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
    try:
        res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return res.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(dims: ModelDims = QWEN25_7B, cfg: config.Config | None = None, roles=gemv.ROLES, sweep: bool = False,
        log=print) -> dict:
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
    plan = []
    for role in roles:
        plan.append((role, {}, gemv.role_spec(role, dims, cfg)))
        for over in SWEEP[role] if sweep else ():
            try:
                plan.append((role, over, gemv.role_spec(role, dims, cfg, **over)))
            except codegen.SpecError as e:
                log(f"sweep {role} {over}: skipped ({e})")
    codegen.build_many([spec for _, _, spec in plan], progress=codegen.ProgressLine())
    blocker = driver.DeviceBuffer(BLOCKER_BYTES)
    rows = []
    for role, over, spec in plan:
        case = _Case(spec, cfg.bench.l2_rotate_bytes, rng)
        try:
            t = time_case(case, stream, blocker)
        finally:
            case.free()
        nbytes = spec.weight_bytes() + _io_bytes(spec)
        row = {"role": role, "override": over, "n": spec.n, "k": spec.k, "uri": spec.uri, "spec": spec.spec_repr,
               "grid": list(spec.launch().grid), "block": list(spec.launch().block), "bytes": nbytes,
               "copies": case.copies, "graph_calls": t["graph_calls"],
               "floor_us": nbytes / (copy["GBps"] * 1e9) * 1e6}
        for mode in ("alone", "graph"):
            med, lo, hi = t[mode]
            row[mode] = {"us": med * 1e6, "us_min": lo * 1e6, "us_max": hi * 1e6, "GBps": nbytes / med / 1e9,
                         "pct_copy": 100 * nbytes / med / 1e9 / copy["GBps"]}
        rows.append(row)
        if sweep:
            log(f"{role:<8} {str(over):<44} alone {row['alone']['us']:7.2f} us  graph {row['graph']['us']:7.2f} us "
                f"{row['graph']['pct_copy']:5.1f}%")
    blocker.free()
    result["gemv"] = rows
    result["clocks_after"] = clocks()
    stream.close()
    log(table(result))
    return result


def _brief(over: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in over.items()) or "(config)"


def table(result: dict) -> str:
    head = (f"{'shape':<8} {'override':<30} {'N x K':>13} {'MB':>6} {'floor us':>8} | {'alone us':>8} {'GB/s':>6} {'%copy':>6} | "
            f"{'graph us':>8} {'GB/s':>6} {'%copy':>6}")
    lines = [head, "-" * len(head)]
    for r in result["gemv"]:
        a, g = r["alone"], r["graph"]
        lines.append(f"{r['role']:<8} {_brief(r['override']):<30} {r['n']:>6} x {r['k']:<6}{r['bytes'] / 1e6:>6.1f} {r['floor_us']:>8.2f} | "
                     f"{a['us']:>8.2f} {a['GBps']:>6.0f} {a['pct_copy']:>5.1f}% | "
                     f"{g['us']:>8.2f} {g['GBps']:>6.0f} {g['pct_copy']:>5.1f}%")
    lines.append(f"copy bandwidth {result['copy']['GBps']:.0f} GB/s on {result['gpu']}")
    return "\n".join(lines)
