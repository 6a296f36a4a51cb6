"""Multi-row step costs (DESIGN.md section 12, issue 20 item 5): each 7B decoder GEMV and the lm_head +
argmax over m = 1, 2, 4, 8, 16 rows (config multirow.buckets), back-to-back in one captured graph with PDL
(the way a step runs them), as a multiple of the m = 1 time, with bytes moved over time against the copy
bandwidth measured in the same run. The weights-only step estimate sums layers x the four GEMVs + the
lm_head: the part of a decode step the m rows share (attention, rope/append and the norms scale with m and
are not in it). Goals (issue 20): m = 8 within 1.25x, m = 16 within 1.6x of m = 1."""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import codegen, config
from ..codegen import tuned
from ..codegen.kernels import gemv, lm_head
from ..codegen.spec import SpecError
from ..dims import QWEN25_7B, ModelDims
from ..runtime import driver
from .gemv_case import GemvCase
from .replay import graph_seconds

LM_GRAPH_CALLS = 20   # lm_head reads 1.09 GB per call (> L2): no weight rotation needed
# lm_head tiles timed beside the configured one at m > 1 (tuning data: at m >= 8 the staged rows of h leave
# one CTA of 8 warps per SM). Warps, vocab rows per warp and an even unroll leave a row's arithmetic as it is.
LM_VARIANTS = (dict(rows_per_warp=1), dict(rows_per_warp=4, unroll=8), dict(warps=16))


def _graph_seconds(launch_one, calls: int, stream: driver.Stream) -> tuple[float, float, float]:
    """Median (min, max) seconds per call of `calls` back-to-back PDL launches replayed as one graph."""
    launch_one(0, False)   # warm-up: module load
    stream.synchronize()
    per_call = sorted(graph_seconds(launch_one, calls, stream))
    return per_call[len(per_call) // 2], per_call[0], per_call[-1]


def _gemv_seconds(spec: gemv.GemvInt4Spec, fn, stream, rng, rotate_bytes: int) -> tuple[float, float, float]:
    copies = max(2, -(-rotate_bytes // spec.weight_bytes()))
    case = GemvCase(spec, rng, copies)
    try:
        launch = spec.launch()
        return _graph_seconds(lambda i, pdl: fn.launch(launch, stream, pdl, **case.args(i)),
                              max(200, 2 * copies), stream)
    finally:
        case.free()


def _lm_head_seconds(spec: lm_head.LmHeadArgmaxSpec, fn, stream, rng) -> tuple[float, float, float]:
    k, n = spec.hidden, spec.vocab
    bufs = {"h": driver.DeviceBuffer.from_array(rng.standard_normal((spec.m, k)).astype(np.float32)),
            "norm_w": driver.DeviceBuffer.from_array(np.ones(k, np.float16)),
            "lm_head": driver.DeviceBuffer(2 * n * k), "state": driver.DeviceBuffer(16),
            "tokens_out": driver.DeviceBuffer(4 * max(spec.m, LM_GRAPH_CALLS + 2)),
            "partials": driver.DeviceBuffer(spec.partials_bytes), "argmax_done": driver.DeviceBuffer(4),
            "err": driver.DeviceBuffer(4)}
    try:
        bufs["lm_head"].memset_u32(0x1C001C00)   # fp16 0.0039 everywhere: finite logits
        for name in ("state", "argmax_done", "err"):
            bufs[name].memset_u32(0)
        args = {**bufs, "logits": 0, "tokens_cap": bufs["tokens_out"].nbytes // 4}
        args = {name: args[name] for name, _ in spec.signature}
        launch = spec.launch()
        return _graph_seconds(lambda i, pdl: fn.launch(launch, stream, pdl, **args), LM_GRAPH_CALLS, stream)
    finally:
        for b in bufs.values():
            b.free()


def _bytes(spec) -> int:
    if isinstance(spec, gemv.GemvInt4Spec):
        return spec.weight_bytes() + spec.io_bytes()
    return 2 * spec.vocab * spec.hidden + spec.m * spec.hidden * 4 + 2 * spec.hidden   # head + h + norm weight


def run(stream: driver.Stream, copy_GBps: float, dims: ModelDims = QWEN25_7B, cfg: config.Config | None = None,
        roles=gemv.ROLES, gpu_name: str | None = None) -> dict:
    """Time every role (tuned m = 1 tile when the store has one, as the decoder builds it) and the lm_head at
    every bucket; rows of {name, m, uri, bytes, us, us_min, us_max, GBps, pct_copy, x_m1}, plus the
    weights-only step estimate per m."""
    cfg = cfg or config.default()
    buckets = cfg.multirow.buckets
    rng = np.random.default_rng()
    todo = [(role, tuned.role_spec(role, dims, cfg, gpu_name, m)) for role in roles
            for m in buckets]
    todo += [("lm_head", lm_head.model_spec(dims, cfg, m=m)) for m in buckets]
    for m in (m for m in buckets if m > 1):
        for kw in LM_VARIANTS:
            spec = dataclasses.replace(lm_head.model_spec(dims, cfg, m=m), **kw)
            try:
                spec.validate()
            except SpecError:
                continue
            todo.append(("lm_head:" + ",".join(f"{k}{v}" for k, v in kw.items()), spec))
    built = codegen.build_many([s for _, s in todo], progress=codegen.ProgressLine())
    rows, base = [], {}
    for (name, spec), b in zip(todo, built):
        if ":" in name and b.resources.spills:
            continue   # a variant that spills is not worth a timing
        kernel = name.split(":")[0]   # a variant's ratio is to its kernel's configured m = 1 time
        fn = driver.load(b)
        t, lo, hi = (_lm_head_seconds(spec, fn, stream, rng) if kernel == "lm_head"
                     else _gemv_seconds(spec, fn, stream, rng, cfg.bench.l2_rotate_bytes))
        base.setdefault(kernel, t)
        nbytes = _bytes(spec)
        rows.append({"name": name, "m": spec.m, "uri": spec.uri, "bytes": nbytes, "us": t * 1e6,
                     "us_min": lo * 1e6, "us_max": hi * 1e6, "GBps": nbytes / t / 1e9,
                     "pct_copy": 100 * nbytes / t / 1e9 / copy_GBps, "x_m1": t / base[kernel]})
    step = {}
    if set(roles) == set(gemv.ROLES):
        for m in buckets:
            us = sum(r["us"] * (1 if r["name"] == "lm_head" else dims.layers) for r in rows
                     if r["m"] == m and r["name"] in (*gemv.ROLES, "lm_head"))   # the configured kernels
            step[m] = {"us": us, "x_m1": us / step[buckets[0]]["us"] if step else 1.0}
    return {"rows": rows, "weights_step": step}


def table(result: dict) -> str:
    head = f"{'kernel':<24} {'m':>3} {'MB':>8} {'us':>9} {'GB/s':>6} {'%copy':>6} {'x m=1':>6}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['name']:<24} {r['m']:>3} {r['bytes'] / 1e6:>8.1f} {r['us']:>9.2f} {r['GBps']:>6.0f} "
                     f"{r['pct_copy']:>5.1f}% {r['x_m1']:>6.2f}")
    for m, s in result["weights_step"].items():
        lines.append(f"weights-only step, m={m:>2}: {s['us'] / 1e3:.3f} ms = {s['x_m1']:.2f}x m=1 "
                     f"(goal: m=8 <= 1.25x, m=16 <= 1.6x)")
    return "\n".join(lines)
