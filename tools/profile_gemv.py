"""Launch decoder-layer GEMV tiles of the 7B a few times each for a profiler to read (it times nothing itself):

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy -k regex:gemv_int4 python3 tools/profile_gemv.py \\
        gate_up:mma=1,lanes=4,rows=2,warps=8,unroll=0,kwarps=8 gate_up

Each argument is ROLE[:FIELD=VALUE,...]: the role's config tile with those of its fields replaced (the
fields nanoqwen-tune sweeps, tune/spaces.yaml; values as `nanoqwen-gen --param` takes them). Each kernel is checked against numpy first (a profile of a
wrong kernel is of no use), then launched --runs times on the same weights.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from nanoqwen import NanoqwenError, codegen, config
from nanoqwen.codegen.kernels import gemv
from nanoqwen.codegen.spec import SpecError, parse_params
from nanoqwen.dims import QWEN25_7B
from nanoqwen.tuning import space


def tile_spec(arg: str, cfg: config.Config) -> gemv.GemvInt4Spec:
    """ROLE[:FIELD=VALUE,...] -> the 7B's spec of that role with those tile fields (NanoqwenError when bad)."""
    role, _, fields = arg.partition(":")
    if role not in gemv.ROLES:
        raise NanoqwenError(f"{arg!r}: unknown role {role!r} (known: {', '.join(gemv.ROLES)})")
    tile_fields = {name for s in space.tile_spaces() for name in s}   # what nanoqwen-tune sweeps
    try:
        override = gemv.GemvInt4Spec.typed_params(parse_params(filter(None, fields.split(","))))
        if other := sorted(set(override) - tile_fields):
            raise SpecError(f"{', '.join(other)}: not a tile field (the tile: {', '.join(sorted(tile_fields))})")
        return gemv.role_spec(role, QWEN25_7B, cfg, **override)
    except SpecError as e:
        raise NanoqwenError(f"{arg!r}: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tiles", nargs="+", metavar="ROLE[:FIELD=VALUE,...]")
    p.add_argument("--runs", type=int, default=2, help="launches per kernel after the check (default 2)")
    args = p.parse_args(argv)
    cfg = config.default()
    try:
        specs = [tile_spec(a, cfg) for a in args.tiles]
    except NanoqwenError as e:
        print(f"profile_gemv: {e}", file=sys.stderr)
        return 2
    try:
        return _launch(specs, args.runs, cfg.validation.gemv_rel_tol)
    except NanoqwenError as e:   # no device, a compile or launch error
        print(f"profile_gemv: {e}", file=sys.stderr)
        return 1


def _launch(specs: list[gemv.GemvInt4Spec], runs: int, tol: float) -> int:
    from nanoqwen.bench.gemv_case import GemvCase
    from nanoqwen.runtime import driver
    stream = driver.Stream()
    for spec, built in zip(specs, codegen.build_many(specs)):
        case = GemvCase(spec, np.random.default_rng(0))
        fn = driver.load(built)
        err = case.check(fn, spec, stream)
        print(f"{spec.uri}: {built.resources.registers} registers, grid {spec.launch().grid}, rel err {err:.1e}",
              flush=True)
        if not err <= tol:
            print(f"profile_gemv: {spec.uri} is wrong (rel err {err:.2e})", file=sys.stderr)
            return 1
        for _ in range(runs):
            case.run(fn, spec, stream)
        case.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
