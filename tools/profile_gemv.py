"""Launch decoder-layer GEMV tiles of the 7B a few times each for a profiler to read, or time them (--time):

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy -k regex:gemv_int4 python3 tools/profile_gemv.py \\
        gate_up:mma=1,lanes=4,rows=2,warps=8,unroll=0,kwarps=8 gate_up

Each argument is ROLE[:FIELD=VALUE,...][@M[:FIELD=VALUE,...]]: the role's config tile with those of its
fields replaced (the fields nanoqwen-tune sweeps, tune/spaces.yaml, and l2_fetch; values as `nanoqwen-gen
--param` takes them), and with @M its m-row kernel (`down:splitk=4@8:warps=16`: the fields after M are the
m-row tile's, codegen/kernels/gemv.py MULTIROW_TILE, as a tuned entry holds them). Each kernel is checked
against numpy first (a profile of a wrong kernel is of no use) and its residency printed (the CTAs an SM
holds by registers, threads and shared memory, and the grid in waves of them), then launched --runs times on
the same weights; with --time, instead timed back-to-back in a captured graph with PDL as `nanoqwen bench
--kernels` times them (weights rotating past L2), against the copy bandwidth measured in the same run, then
the same graph without PDL and one launch alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from nanoqwen import NanoqwenError, codegen, config
from nanoqwen.codegen.gpu import GpuProfile, ctas_an_sm_holds
from nanoqwen.codegen.kernels import gemv
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.tuning import space


def tile_spec(arg: str, cfg: config.Config) -> gemv.GemvInt4Spec:
    """ROLE[:FIELD=VALUE,...][@M[:FIELD=VALUE,...]] -> the 7B's spec of that role with those tile fields, over
    M rows (NanoqwenError when bad)."""
    single, _, multi = arg.partition("@")
    role, _, fields = single.partition(":")
    if role not in gemv.ROLES:
        raise NanoqwenError(f"{arg!r}: unknown role {role!r} (known: {', '.join(gemv.ROLES)})")
    try:
        spec = gemv.role_spec(role, QWEN25_7B, cfg, **space.parse_tile(fields, space.tile_fields()))
        if not multi:
            return spec
        m, _, mfields = multi.partition(":")
        if not m.isdigit():
            raise SpecError(f"@{m}: the row count is a number (e.g. @8)")
        return gemv.multirow_spec(spec, int(m), cfg, tile=space.parse_tile(mfields, set(gemv.MULTIROW_TILE)) or None)
    except SpecError as e:
        raise NanoqwenError(f"{arg!r}: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tiles", nargs="+", metavar="ROLE[:FIELD=VALUE,...][@M[:FIELD=VALUE,...]]")
    p.add_argument("--runs", type=int, default=2, help="launches per kernel after the check (default 2)")
    p.add_argument("--time", action="store_true", help="time each tile instead (graph replay, %% of copy bandwidth)")
    args = p.parse_args(argv)
    cfg = config.default()
    try:
        specs = [tile_spec(a, cfg) for a in args.tiles]
    except NanoqwenError as e:
        print(f"profile_gemv: {e}", file=sys.stderr)
        return 2
    try:
        return _launch(list(zip(args.tiles, specs)), args.runs, cfg, args.time)
    except NanoqwenError as e:   # no device, a compile or launch error
        print(f"profile_gemv: {e}", file=sys.stderr)
        return 1


def _launch(specs: list[tuple[str, gemv.GemvInt4Spec]], runs: int, cfg: config.Config, time: bool) -> int:
    from nanoqwen.bench import kernels
    from nanoqwen.bench.gemv_case import GemvCase
    from nanoqwen.bench.replay import graph_seconds
    from nanoqwen.runtime import driver
    stream = driver.Stream()
    gpu = GpuProfile.from_props(driver.device().props)
    copy_GBps = kernels.copy_bandwidth(stream)["GBps"] if time else 0.0
    blocker = driver.DeviceBuffer(kernels.BLOCKER_BYTES) if time else None
    try:
        for (arg, spec), built in zip(specs, codegen.build_many([spec for _, spec in specs])):
            copies = kernels.rotating_copies(spec, cfg.bench.l2_rotate_bytes) if time else 1
            case = GemvCase(spec, np.random.default_rng(0), copies)
            try:
                fn = driver.load(built)
                err = case.check(fn, spec, stream)
                launch, regs = spec.launch(), built.resources.registers
                ctas = ctas_an_sm_holds(launch.block[0], regs, spec.smem_ctas(gpu))
                waves = launch.grid[0] * launch.grid[1] / (ctas * gpu.sm_count)
                print(f"{spec.uri}: {regs} registers, grid {launch.grid}, {ctas} CTAs an SM: {waves:.2f} waves, "
                      f"rel err {err:.1e}", flush=True)
                if not err <= cfg.validation.gemv_rel_tol:
                    print(f"profile_gemv: {spec.uri} is wrong (rel err {err:.2e})", file=sys.stderr)
                    return 1
                if time:
                    t = kernels.time_spec(case, fn, spec, stream, blocker)
                    r = kernels.row(arg, spec, t, copy_GBps, copies)
                    graph = r["graph"]
                    # the same graph with PDL off: what the overlap of a kernel's start with the last one's end buys
                    serial = statistics.median(graph_seconds(
                        lambda i, pdl: fn.launch(launch, stream, False, **case.args(i)), t["graph_calls"], stream))
                    print(f"  graph {graph['us']:.2f} us [{graph['us_min']:.2f}..{graph['us_max']:.2f}], "
                          f"{graph['pct_copy']:.1f}% of copy ({copy_GBps:.0f} GB/s); without PDL "
                          f"{serial * 1e6:.2f} us; alone {r['alone']['us']:.2f} us", flush=True)
                else:
                    for _ in range(runs):
                        case.run(fn, spec, stream)
            finally:
                case.free()
    finally:
        if blocker is not None:
            blocker.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
