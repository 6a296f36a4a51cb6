"""Launch 7B prefill GEMM tiles over a short chunk a few times each for a profiler to read, or time them (--time)
(issue 21: what bounds the short chunk's GEMMs):

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy -k regex:gemm_int4 python3 tools/profile_gemm.py --m 32 qkv gate_up:bn=64 down+order

Each argument is ROLE[+order][:FIELD=VALUE,...]: the role's short-chunk tile (codegen/kernels/gemm.py
SMALL_M_TILES, or with +order GEMV_ORDER_SMALL_M_TILES and prefill.gemv_order_splits) with those of its fields
replaced (values as `nanoqwen-gen --param` takes them). For each: its residency (the CTAs an SM holds by
registers, threads and shared memory, the grid in waves of them), then --runs launches; with --time instead its
time alone as bench.prefill times it (a memset before each start event: no host latency, weights out of L2)
and the bytes it copies from L2 (weights once per row block, X once per column block) over that time.
With --sweep each argument is ROLE[+order] and stands for its default tile and every SWEEP tile of its order that
the shape takes (tiles that spill are skipped, with a line each).
The numerics are the GPU suite's business (tests/gpu/test_gemm.py); this tool only runs the tiles.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import replace

import numpy as np

from nanoqwen import NanoqwenError, codegen, config
from nanoqwen.bench import kernels
from nanoqwen.bench.prefill import REPS, WARMUP, free_buffers, gemm_buffers, weight_bytes
from nanoqwen.bench.replay import blocked_seconds
from nanoqwen.codegen.gpu import SMEM_PER_CTA_RESERVED, SMEM_PER_SM, GpuProfile, ctas_an_sm_holds
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.codegen.spec import SpecError, parse_params
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver

TILE_FIELDS = ("bm", "bn", "bk", "warps_m", "warps_n", "stages", "min_blocks", "split_k", "scale_ring")
# --sweep's tiles beside each default: fewer or more warps and columns a CTA, one warp row over 32 rows (each
# weight dequantized once for both m16 blocks), deeper rings (fold order; perf-notes, twenty-sixth session); the GEMV
# order's (weights as A in 16-row tiles, tokens as B in 8s) down to one warp of 16 weight rows x 8 tokens.
SWEEP = {"fold": ("bn=32,warps_n=2", "bn=32,warps_n=1", "bn=64,warps_n=2", "bn=64,warps_n=4", "bn=128,warps_n=4",
                  "bm=32,warps_m=2,bn=32,warps_n=2", "bm=32,warps_m=1,bn=32,warps_n=4",
                  "bm=32,warps_m=1,bn=64,warps_n=4", "bm=32,warps_m=1,bn=128,warps_n=4",
                  "bm=32,warps_m=1,bn=32,warps_n=2", "bn=32,warps_n=2,stages=8", "bm=32,warps_m=1,bn=64,warps_n=2"),
         "order": ("bm=16,warps_m=2,bn=64,warps_n=2", "bm=8,warps_m=1,bn=16,warps_n=1",
                   "bm=16,warps_m=1,bn=16,warps_n=1", "bm=16,warps_m=1,bn=32,warps_n=2",
                   "bm=32,warps_m=1,bn=32,warps_n=2", "bm=32,warps_m=2,bn=32,warps_n=2",
                   "bm=32,warps_m=1,bn=64,warps_n=4", "bm=32,warps_m=1,bn=128,warps_n=4",
                   "bm=16,warps_m=1,bn=32,warps_n=1", "bm=16,warps_m=1,bn=64,warps_n=4",
                   "bm=16,warps_m=2,bn=32,warps_n=2", "stages=4", "stages=8")}


def tile_spec(arg: str, cfg: config.Config) -> G.GemmInt4Spec:
    """ROLE[+order][:FIELD=VALUE,...] -> the 7B's short-chunk GEMM of that role with those fields (NanoqwenError
    when bad)."""
    head, _, fields = arg.partition(":")
    role, _, order = head.partition("+")
    if order not in ("", "order"):
        raise NanoqwenError(f"{arg!r}: +{order}: the only suffix is +order (the GEMV order's tile)")
    specs = G.config_gemms(QWEN25_7B, cfg, small_m=True, gemv_order=order == "order")   # as bench.prefill
    if role not in specs:
        raise NanoqwenError(f"{arg!r}: unknown role {role!r} (known: {', '.join(specs)})")
    try:
        tile = G.GemmInt4Spec.typed_params(parse_params(filter(None, fields.split(","))))
        if other := sorted(set(tile) - set(TILE_FIELDS)):
            raise SpecError(f"{', '.join(other)}: not a tile field (the tile: {', '.join(TILE_FIELDS)})")
        spec = replace(specs[role], **tile)
        spec.validate()
    except SpecError as e:
        raise NanoqwenError(f"{arg!r}: {e}") from None
    return spec


def sweep_tiles(arg: str, cfg: config.Config) -> list[tuple[str, G.GemmInt4Spec]]:
    """ROLE[+order] -> (argument, spec) of its default tile and of each SWEEP tile of its order the shape takes."""
    if ":" in arg:
        raise NanoqwenError(f"{arg!r}: --sweep takes ROLE[+order], its tiles are the sweep's")
    out = [(arg, tile_spec(arg, cfg))]
    for fields in SWEEP["order" if arg.endswith("+order") else "fold"]:
        try:
            out.append((f"{arg}:{fields}", tile_spec(f"{arg}:{fields}", cfg)))
        except NanoqwenError as e:
            print(f"profile_gemm: skipped {e}", flush=True)
    return out


def l2_bytes(spec: G.GemmInt4Spec, m: int) -> int:
    """Bytes the grid copies from L2 into shared memory: each row block's CTAs stream all the weights and
    scales, each column block's stream X's rows."""
    row_blocks, col_blocks = -(-m // spec.bm), spec.n // spec.bn
    return row_blocks * weight_bytes(spec) + col_blocks * row_blocks * spec.bm * spec.k * 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tiles", nargs="+", metavar="ROLE[+order][:FIELD=VALUE,...]")
    p.add_argument("--m", type=int, default=32, help="chunk rows (default 32; at most prefill.small_m_tokens)")
    p.add_argument("--runs", type=int, default=1, help="launches per tile (default 1)")
    p.add_argument("--time", action="store_true", help="time each tile alone instead")
    p.add_argument("--json", help="with --time: write the rows here (GPU, date, commit beside them)")
    p.add_argument("--sweep", action="store_true", help="each argument is ROLE[+order]: its default and SWEEP tiles")
    args = p.parse_args(argv)
    if args.json and not args.time:
        print("profile_gemm: --json writes the times: it takes --time", file=sys.stderr)
        return 2
    cfg = config.default()
    if not 1 <= args.m <= cfg.prefill.small_m_tokens:
        print(f"profile_gemm: --m {args.m}: a short chunk has 1..{cfg.prefill.small_m_tokens} rows", file=sys.stderr)
        return 2
    try:
        tiles = ([t for a in args.tiles for t in sweep_tiles(a, cfg)] if args.sweep
                 else [(a, tile_spec(a, cfg)) for a in args.tiles])
    except NanoqwenError as e:
        print(f"profile_gemm: {e}", file=sys.stderr)
        return 2
    try:
        gpu = GpuProfile.from_props(driver.device().props)
        rows = _launch(tiles, args.m, args.runs, gpu, args.time)
    except NanoqwenError as e:   # no device, a compile or launch error
        print(f"profile_gemm: {e}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "nanoqwen-profile-gemm", "gpu": gpu.name, "commit": kernels.git_commit(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "m": args.m, "rows": rows}, f, indent=1)
    return 0


def _launch(specs: list[tuple[str, G.GemmInt4Spec]], m: int, runs: int, gpu: GpuProfile, time: bool) -> list[dict]:
    """Each tile's residency, and with ``time`` its time alone (also printed, a line a tile)."""
    stream, rng = driver.Stream(), np.random.default_rng(0)
    blocker, rows = driver.DeviceBuffer(kernels.BLOCKER_BYTES), []
    try:
        for (arg, spec), built in zip(specs, codegen.build_many([spec for _, spec in specs])):
            if built.resources.spills:
                print(f"{arg}: {spec.uri}: spills, skipped", flush=True)
                continue
            fn, launch, regs = driver.load(built), spec.launch(m), built.resources.registers
            smem_ctas = SMEM_PER_SM // (spec.smem_bytes + SMEM_PER_CTA_RESERVED)
            ctas = ctas_an_sm_holds(launch.block[0], regs, smem_ctas)
            waves = launch.grid[0] * launch.grid[1] * launch.grid[2] / (ctas * gpu.sm_count)
            bufs = gemm_buffers(spec, m, rng)
            try:
                call = lambda i: fn.launch(launch, stream, False, m=m, **bufs)   # noqa: E731
                line = (f"{arg}: {spec.uri}: {regs} registers, {spec.smem_bytes} B shared, grid {launch.grid} x "
                        f"{launch.block[0]} threads, {ctas} CTAs an SM: {waves:.2f} waves")
                row = {"tile": arg, "uri": spec.uri, "registers": regs, "smem": spec.smem_bytes,
                       "grid": list(launch.grid), "threads": launch.block[0], "ctas_per_sm": ctas, "waves": waves}
                if time:
                    for i in range(WARMUP):
                        call(i)
                    t = statistics.median(blocked_seconds(call, REPS, stream, blocker))
                    row |= {"us": t * 1e6, "l2_GBps": l2_bytes(spec, m) / t / 1e9}
                    line += f"; alone {row['us']:.2f} us, {row['l2_GBps']:.0f} GB/s from L2 to shared"
                else:
                    for i in range(runs):
                        call(i)
                stream.synchronize()
                rows.append(row)
                print(line, flush=True)
            finally:
                free_buffers(bufs)
    finally:
        blocker.free()
        stream.close()
    return rows


if __name__ == "__main__":
    sys.exit(main())
