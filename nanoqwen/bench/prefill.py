"""Prefill kernel benchmark: each 7B prefill GEMM (INT4 tensor-core, nanoqwen/codegen/kernels/gemm.py) at
M = 512 and 4096 against the dense fp16 rate of the same device measured in the same run (torch.matmul
fp16 of the same [M, K] x [K, N] shape, cuBLAS; skipped when torch is absent), each shape also with the
tile VARIANTS below (tuning data: the spec fields to pick per shape), then the wgmma GEMM (gemm_wgmma,
issue 23; the runtime's with prefill.wgmma) on the same shape with its WGMMA_VARIANTS, then the GEMM in the
tensor-core GEMV's order (gemm.py gemv_order, ORDER_VARIANTS), plus the causal prefill attention and the
projected prefill time of the 28 layers (default mma.sync tiles), and the GEMV order's row GEMVs of a chunk
of 8 or 16 rows beside the decode step's GEMVs (bench_row_gemvs).

A chunk of at most ``prefill.small_m_tokens`` rows (an editor's tail, issue 21) is timed from the small-M
tiles instead (``gemm.model_gemms(small_m=True)``) with SMALL_VARIANTS beside them, each row also reporting
the weight stream's bandwidth (such a chunk reads all the weights for a few rows: bytes, not FLOPs, bound
it). Every tile there keeps a row's arithmetic (sequential K, no split-K), so any of them keeps chunk
invariance, except the split_k rows (residual roles only): a diagnostic of whether the serial K loop's
latency, not the bytes, bounds a short chunk (a fixed-order split of K in every GEMM would keep invariance).

Every tile variant's output is also compared bit for bit with its shape's default tile on the same operands
(``bits_equal_default``): a tile that keeps a row's arithmetic must give the same bits (split_k's atomic adds need
not). ``--tiles`` times the INT4 GEMM's tiles alone (no wgmma, GEMV order, attention or row GEMVs): a tile sweep in
a minute of device time.

Usage on the GPU machine: ``PYTHONPATH=. python3 -m nanoqwen.bench.prefill [--m 32 512 4096] [--tiles] [--json
FILE]`` (those M by default).
Timing: events around one launch, after warm-up; median of ``REPS``. A memset of 256 MB (bench/kernels.py
BLOCKER_BYTES) is queued before each start event, as the GEMV bench's "alone" column does: the GPU is busy
while the host issues the launch, so the host's launch latency stays out of the time (until 2026-12-07 it was
in: a rough fit put ~18 us in every short-chunk GEMM's figure, perf-notes), and the memset evicts the weights
from L2, as each layer of a chunk finds them. The fp16 baseline keeps torch's events around one call."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from dataclasses import replace

import numpy as np

from .. import codegen, config, quant
from ..codegen import tuned
from ..codegen.kernels import attention_prefill as AP
from ..codegen.kernels import gemm as G
from ..codegen.kernels import gemm_wgmma as GW
from ..codegen.kernels import gemv
from ..codegen.spec import SpecError
from ..dims import QWEN25_7B
from ..runtime import driver
from . import kernels as kbench
from .gemv_case import GemvCase
from .replay import blocked_seconds

REPS = 20
WARMUP = 3
# Tile variants timed beside each shape's default (tuning data; the first is the role's tile,
# gemm.LARGE_M_ROLE_TILES, the second the spec's generic 128 x 128 tile it replaced).
GENERIC = dict(bm=128, bn=128, bk=64, warps_m=2, warps_n=4, stages=4, min_blocks=1)
VARIANTS = ({}, GENERIC, GENERIC | dict(bm=64, min_blocks=2), GENERIC | dict(bk=128, stages=3),
            GENERIC | dict(bm=64, bn=64, warps_n=2, min_blocks=3), GENERIC | dict(stages=3),
            GENERIC | dict(bm=32, warps_m=1, warps_n=8, min_blocks=2),   # for small M
            GENERIC | dict(bk=128, stages=4),
            # one warp along M: each warp dequantizes its weights for all bm rows (with two, both warps of a
            # column dequantize the same weights): half the dequant instructions an MMA, twice the X fragments
            W1 := GENERIC | dict(warps_m=1, warps_n=8), W1 | dict(bk=128, stages=3), W1 | dict(bn=256),
            W1 | dict(bm=64, min_blocks=2), GENERIC | dict(warps_m=1, bn=64, min_blocks=2),
            GENERIC | dict(split_k=2), GENERIC | dict(split_k=4))   # split_k: residual GEMMs only
# The warp-specialized wgmma GEMM (the long chunks' GEMM of the roles in prefill.wgmma): its default tile, the
# drain-every-chunk fallback, one consumer warpgroup of two row blocks, a deeper ring; then 128- and 256-token
# instructions (each dequantized weight serves 2x / 4x the tokens of the default's 64: 112-174 registers, no
# spills), a tile's bits always the mma.sync default's
WGMMA_VARIANTS = ({}, {"inflight": 0}, {"consumers": 1}, {"stages": 8}, {"bm": 128, "bn": 128},
                  {"bm": 128, "bn": 128, "stages": 4}, {"bm": 128, "bn": 128, "consumers": 1},
                  {"bm": 256, "bn": 64, "consumers": 1})
# Small-M tile variants (the first is the small-M default; invalid ones for a shape are skipped).
SMALL_VARIANTS = ({}, dict(bn=64), dict(bn=128), dict(bn=64, warps_n=8), dict(bm=32, warps_m=2),
                  dict(bm=32, warps_m=2, bn=64), dict(stages=6), dict(bk=64, stages=8), dict(bm=32, warps_m=2, bn=128),
                  dict(split_k=2), dict(split_k=4))
# The GEMV-order GEMMs (gemm.py gemv_order, the splits of prefill.gemv_order_splits), tiles beside their
# defaults (gemm.GEMV_ORDER_TILES, GEMV_ORDER_SMALL_M_TILES); every tile keeps a row's bits.
ORDER_VARIANTS = ({}, dict(stages=3), dict(stages=6), dict(bm=128, warps_m=4, bn=64, warps_n=2),
                  dict(bm=64, warps_m=4, bn=128, warps_n=2), dict(bm=32, warps_m=1))
# The row GEMVs of a short chunk in the GEMV order (bench_row_gemvs): tiles beside gemv.MMA_TILE.
# multirow_spec keeps a short chunk's grid to one wave of the CTAs its staged x lets an SM hold, which at
# m = 16 leaves gate_up 74 CTAs of 255 registers on the 132 SMs: hence the tiles_per_warp 1 rows.
ROW_VARIANTS = ({}, {"warps": 4}, {"warps": 2}, {"splitk": 2}, {"splitk": 4}, {"warps": 2, "splitk": 4},
                {"tiles_per_warp": 1}, {"tiles_per_warp": 1, "warps": 4, "prefetch": False})
SMALL_ORDER_VARIANTS = ({}, dict(stages=4), dict(stages=8), dict(bn=128, warps_n=4), dict(bm=32, bn=128, warps_n=4),
                        dict(bm=16, warps_m=2, bn=64, warps_n=2))


def _time(call, stream, blocker: driver.DeviceBuffer) -> float:
    """Median seconds of ``call(stream)`` over REPS, after WARMUP calls, each behind a memset of ``blocker``
    (the module's "Timing")."""
    for _ in range(WARMUP):
        call(stream)
    return statistics.median(blocked_seconds(lambda i: call(stream), REPS, stream, blocker))


def _torch_fp16_s(m: int, n: int, k: int) -> float | None:
    """Median seconds of torch.matmul fp16 [m, k] x [k, n] (cuBLAS), or None without torch / CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    for _ in range(WARMUP):
        torch.matmul(x, w.t())
    ts = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.matmul(x, w.t())
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    del x, w
    torch.cuda.empty_cache()
    return statistics.median(ts)


def gemm_buffers(spec: G.GemmInt4Spec | GW.GemmWgmmaSpec, m: int, rng) -> dict[str, driver.DeviceBuffer]:
    """Random device operands of one GEMM over m rows, by kernel parameter name (SwiGLU's up half is the gate's
    weights again); free them with ``free_buffers``."""
    rows = spec.n // 2 if spec.epilogue == "swiglu" else spec.n
    q = rng.integers(-7, 8, size=(rows, spec.k), dtype=np.int8)
    packed, scales = quant.pack(q), rng.uniform(0.002, 0.02, size=(rows, spec.k // spec.group)).astype(np.float16)
    out_cols = spec.n // 2 if spec.epilogue == "swiglu" else spec.n
    bufs = {"x": driver.DeviceBuffer.from_array(rng.standard_normal((m, spec.k)).astype(np.float16)),
            "w": driver.DeviceBuffer.from_array(packed), "s": driver.DeviceBuffer.from_array(scales),
            "bias": driver.DeviceBuffer.from_array(rng.standard_normal(spec.n).astype(np.float16)),
            "y": driver.DeviceBuffer.from_array(np.zeros((m, out_cols), np.float32))}
    bufs["w2"], bufs["s2"] = bufs["w"], bufs["s"]
    return bufs


def weight_bytes(spec: G.GemmInt4Spec | GW.GemmWgmmaSpec) -> int:
    """Bytes of packed INT4 weights and fp16 group scales one GEMM reads."""
    return spec.n * spec.k // 2 + spec.n * (spec.k // spec.group) * 2


def free_buffers(bufs: dict[str, driver.DeviceBuffer]) -> None:
    for b in {id(b): b for b in bufs.values()}.values():
        b.free()


def bench_gemm(spec: G.GemmInt4Spec | GW.GemmWgmmaSpec, m: int, stream, rng, blocker,
               with_fp16: bool = True) -> dict:
    """One GEMM (either family: one kernel contract) on random data; the fp16 cuBLAS time of its shape."""
    bufs = gemm_buffers(spec, m, rng)
    fn, launch = driver.load(codegen.build(spec)), spec.launch(m)
    try:
        t = _time(lambda st: fn.launch(launch, st, False, m=m, **bufs), stream, blocker)
    finally:
        free_buffers(bufs)
    ref = _torch_fp16_s(m, spec.n, spec.k) if with_fp16 else None
    flops = spec.flops(m)
    return {"uri": spec.uri, "m": m, "n": spec.n, "k": spec.k, "s": t, "TFLOPs": flops / t / 1e12,
            "weight_GBps": weight_bytes(spec) / t / 1e9,
            "fp16_s": ref, "fp16_TFLOPs": flops / ref / 1e12 if ref else None,
            "vs_fp16": ref / t if ref else None}


def tile_bits(spec: G.GemmInt4Spec, m: int, bufs: dict[str, driver.DeviceBuffer]) -> np.ndarray:
    """``spec``'s output over m rows on ``bufs`` (one operand set for every tile of its shape, ``gemm_buffers``), as
    raw 32-bit words (the residual epilogue adds into zeros)."""
    bufs["y"].memset_u32(0)
    driver.load(codegen.build(spec)).launch(spec.launch(m), None, False, m=m, **bufs)
    driver.device().synchronize()
    return bufs["y"].download(dtype=np.uint32)


def bench_attention(n: int, stream, rng, blocker) -> dict:
    d = QWEN25_7B
    _, spec = AP.prefill_attention_specs(d, config.default())
    P = spec.page_size
    pages = -(-n // P)
    table = rng.permutation(pages).astype(np.int32)
    pool = rng.standard_normal((pages, d.kv_heads, P, d.head_dim)).astype(np.float16)
    bufs = {"q_rot": driver.DeviceBuffer.from_array(rng.standard_normal((n, d.q_dim)).astype(np.float32)),
            "k_pool": driver.DeviceBuffer.from_array(pool), "v_pool": driver.DeviceBuffer.from_array(pool),
            "page_table": driver.DeviceBuffer.from_array(table), "o16": driver.DeviceBuffer(n * d.q_dim * 2)}
    fn, launch = driver.load(codegen.build(spec)), spec.launch(n)
    try:
        t = _time(lambda st: fn.launch(launch, st, False, p0=0, n=n, **bufs), stream, blocker)
    finally:
        free_buffers(bufs)
    return {"uri": spec.uri, "n": n, "s": t, "TFLOPs": spec.flops(0, n) / t / 1e12}


def _bits_note(r: dict) -> str:
    return ", other bits than the default" if r.get("bits_equal_default") is False else ""


def _tiles(default, variants, role: str, m: int, say: bool = True):
    """(spec, variant) for each variant this shape can take; the others are printed as skipped."""
    for kw in variants:
        try:
            spec = replace(default, **kw)
            spec.validate()
        except SpecError as e:   # a tile this shape cannot take (the copies must split evenly, ...)
            if say:
                print(f"{role:8s} M={m:5d} {str(kw):45s} skipped: {e}", flush=True)
            continue
        yield spec, kw


def run(ms=(32, 512, 4096), tiles_only: bool = False) -> dict:
    """Every section; ``ms=()``: the row GEMVs alone; ``tiles_only``: the INT4 GEMM's tiles alone."""
    stream, rng = driver.Stream(), np.random.default_rng(0)
    cfg = config.default()
    wgmmas = GW.model_gemms(QWEN25_7B, cfg.quant.group_size)
    out = {"kind": "nanoqwen-bench-prefill", "gpu": driver.device().props.name, "commit": kbench.git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gemm": [], "wgmma": [], "gemv_order": [], "attention": []}
    blocker = driver.DeviceBuffer(kbench.BLOCKER_BYTES)   # _time's
    try:
        for m in ms:
            _bench_chunk(m, out, cfg, wgmmas, stream, rng, blocker, tiles_only)
    finally:
        blocker.free()
    if not tiles_only:
        out["row_gemv"] = bench_row_gemvs(cfg, stream, rng)
    stream.close()
    return out


def _bench_chunk(m: int, out: dict, cfg, wgmmas: dict, stream, rng, blocker, tiles_only: bool = False) -> None:
    """The GEMMs of a chunk of m rows (each family, its tile variants) and its attention, into ``out``;
    ``tiles_only``: the INT4 GEMM's tiles alone."""
    group, small = cfg.quant.group_size, cfg.prefill.small_m_tokens
    tiles, variants = ((G.model_gemms(QWEN25_7B, group, small_m=True), SMALL_VARIANTS) if m <= small
                       else (G.model_gemms(QWEN25_7B, group), VARIANTS))
    orders = G.config_gemms(QWEN25_7B, cfg, small_m=m <= small, gemv_order=True)
    others = {} if tiles_only else {   # the other GEMM families, against the same fp16 time
        role: (("wgmma", wgmmas[role], WGMMA_VARIANTS),
               ("gemv_order", orders[role], SMALL_ORDER_VARIANTS if m <= small else ORDER_VARIANTS)) for role in tiles}
    codegen.build_many([spec for role, default in tiles.items()   # in parallel, before the first is timed
                        for _, d, vs in (("gemm", default, variants), *others.get(role, ()))
                        for spec, _ in _tiles(d, vs, role, m, say=False)])
    for role, default in tiles.items():
        operands = gemm_buffers(default, m, np.random.default_rng(0))   # every tile's bits, on one operand set
        try:
            for spec, kw in _tiles(default, variants, role, m):
                r = bench_gemm(spec, m, stream, rng, blocker, with_fp16=not kw) | {"role": role, "variant": kw}
                bits = tile_bits(spec, m, operands)
                if not kw:
                    fp16_s, default_bits = r["fp16_s"], bits
                r["bits_equal_default"] = bool(np.array_equal(bits, default_bits))
                out["gemm"].append(r)
                base = f"{r['fp16_TFLOPs']:.0f} TFLOP/s fp16, {r['vs_fp16']:.2f}x" if r["fp16_s"] else "-"
                print(f"{role:8s} M={m:5d} N={spec.n:6d} K={spec.k:6d} {str(kw or 'default'):45s} "
                      f"{r['s'] * 1e3:8.3f} ms {r['TFLOPs']:6.1f} TFLOP/s {r['weight_GBps']:6.0f} GB/s of weights "
                      f"({base}){_bits_note(r)}", flush=True)
            for section, family_default, family_variants in others.get(role, ()):
                for spec, kw in _tiles(family_default, family_variants, role, m):
                    r = bench_gemm(spec, m, stream, rng, blocker, with_fp16=False) | {"role": role, "variant": kw}
                    r["vs_fp16"] = fp16_s / r["s"] if fp16_s else None
                    if section == "wgmma":   # the fold order too: a row's bits are the mma.sync tile's
                        r["bits_equal_default"] = bool(np.array_equal(tile_bits(spec, m, operands), default_bits))
                    out[section].append(r)
                    vs = f"{r['vs_fp16']:.2f}x fp16" if fp16_s else "-"
                    label = section.replace("_", " ") + " " + str(kw or "default")
                    print(f"{role:8s} M={m:5d} N={spec.n:6d} K={spec.k:6d} {label:45s} {r['s'] * 1e3:8.3f} ms "
                          f"{r['TFLOPs']:6.1f} TFLOP/s {r['weight_GBps']:6.0f} GB/s of weights ({vs}){_bits_note(r)}",
                          flush=True)
        finally:
            free_buffers(operands)
    if tiles_only:
        return
    a = bench_attention(m, stream, rng, blocker)
    out["attention"].append(a)
    print(f"attention n={m:5d}  {a['s'] * 1e3:8.3f} ms  {a['TFLOPs']:6.1f} TFLOP/s (causal flops)", flush=True)
    layer = sum(r["s"] for r in out["gemm"] if r["m"] == m and not r["variant"]) + a["s"]
    print(f"projected prefill of {m} tokens, {QWEN25_7B.layers} layers (GEMMs + attention, no norms/rope): "
          f"{layer * QWEN25_7B.layers * 1e3:.2f} ms", flush=True)
    out[f"projected_pp{m}_ms"] = layer * QWEN25_7B.layers * 1e3


def bench_row_gemvs(cfg, stream, rng) -> list[dict]:
    """The GEMV order's row GEMVs of a short chunk (runtime/prefill.py ``rows<m>.<role>``, the norm fused),
    timed as the decode GEMVs are (bench/kernels.py: graph back to back, weights rotating past L2), beside
    the decode step's m = 1 kernel of the role: what a 16-row tail costs against a decode step's GEMVs.
    With ROW_VARIANTS: the staged x (m rows of a K split) bounds the CTAs an SM holds, so fewer warps a CTA
    or more K splits spread the weight stream over more SMs (a split keeps the chunk's bits only where
    prefill.gemv_order_splits of the role says the same)."""
    copy = kbench.copy_bandwidth(stream)["GBps"]
    blocker = driver.DeviceBuffer(kbench.BLOCKER_BYTES)
    splits = {r: s.splits for r, s in G.config_gemms(QWEN25_7B, cfg, gemv_order=True).items()}
    gpu = driver.device().props.name
    first = {}   # spec -> (m, role, spec, variant): each spec timed once, under its first variant's name
    for m in (1, *(b for b in cfg.prefill.graph_buckets if b <= gemv.MAX_M)):
        for role in gemv.ROLES:
            if m == 1:   # the decode step's kernel
                variants = [(tuned.role_spec(role, QWEN25_7B, cfg, gpu), {})]
            else:
                row = gemv.prefill_row_spec(role, QWEN25_7B, cfg, m, splits[role])
                variants = _tiles(row, ROW_VARIANTS, role, m)
            for spec, kw in variants:
                first.setdefault(spec, (m, role, spec, kw))
    tiles = list(first.values())
    built = codegen.build_many([spec for _, _, spec, _ in tiles])
    rows = []
    try:
        for (m, role, spec, kw), b in zip(tiles, built):
            if b.resources.spills:
                print(f"row GEMV {role:8s} m={m:2d} {str(kw):30s} skipped: spills", flush=True)
                continue
            case = GemvCase(spec, rng, kbench.rotating_copies(spec, cfg.bench.l2_rotate_bytes))
            try:
                t = kbench.time_spec(case, driver.load(b), spec, stream, blocker)
            finally:
                case.free()
            r = kbench.row(role, spec, t, copy, case.copies) | {"m": m, "variant": kw}
            rows.append(r)
            print(f"row GEMV {role:8s} m={m:2d} {str(kw or ('decode kernel' if m == 1 else 'default')):30s} "
                  f"{r['graph']['us']:8.2f} us {r['graph']['pct_copy']:5.1f}% of copy, grid {r['grid']}, "
                  f"{spec.smem_ctas()} CTAs/SM by shared memory", flush=True)
    finally:
        blocker.free()
    for m in sorted({r["m"] for r in rows}):
        best = {role: min(r["graph"]["us"] for r in rows if r["m"] == m and r["role"] == role) for role in gemv.ROLES}
        default = sum(r["graph"]["us"] for r in rows if r["m"] == m and not r["variant"])
        print(f"row GEMVs m={m:2d}, {QWEN25_7B.layers} layers: {default * QWEN25_7B.layers / 1e3:.2f} ms "
              f"(best tile per role {sum(best.values()) * QWEN25_7B.layers / 1e3:.2f} ms)", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.prefill", description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[32, 512, 4096],
                   help="prefill rows (tokens; at most prefill.small_m_tokens: the small-M tiles)")
    p.add_argument("--row-gemvs-only", action="store_true", help="only the short chunk's row GEMVs (no --m)")
    p.add_argument("--tiles", action="store_true", help="only the INT4 GEMM's tiles at each --m")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.row_gemvs_only:
        args.m = []
    res = run(tuple(args.m), tiles_only=args.tiles)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
