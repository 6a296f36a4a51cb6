"""`nanoqwen-tune [--model FILE|DIR|7b] [--kernels gemv,attention] [--roles ...] [--rows M,...] [--budget SECONDS]
[--repo] [--compile-only GPU]`: sweep the INT4 GEMV tile parameters (gemv) and the decode attention's fields
(attention) of tune/spaces.yaml per shape on this GPU and store the best in the user's tuned results (<cache
root>/tune/tuned.json; --repo: the source checkout's tune/tuned.json, which ships with the package), which the
decoder and `nanoqwen bench --kernels` read at startup. --rows sweeps the multi-row step's kernels of those
buckets instead (gemv_int4_rows, attention_decode_rows), beside the m = 1 kernels this GPU has: each
candidate's rows must be bitwise the m = 1 kernel's. The budget is shared by the families and buckets.
--compile-only fills the kernel cache with a GEMV sweep's candidates on the CPU, for a device to judge later."""

from __future__ import annotations

import sys

from .. import NanoqwenError, config
from .args import parser
from .errors import run_main

KERNELS = ("gemv", "attention")


def _main(argv) -> int:
    p = parser("nanoqwen-tune", __doc__)
    p.add_argument("--model", default="7b", help="whose shapes: 7b, a .nanoqwen file or a HF directory")
    p.add_argument("--kernels", default="gemv", help=f"kernel families to tune (comma-separated: {', '.join(KERNELS)})")
    p.add_argument("--roles", default="qkv,o_proj,gate_up,down", help="GEMV roles (comma-separated)")
    p.add_argument("--rows", default="1", metavar="M,...",
                   help="multirow buckets whose m-row kernels to sweep (default 1: the decode kernels)")
    p.add_argument("--spaces", default=None, metavar="NAME,...",
                   help="m = 1 search spaces of tune/spaces.yaml to sweep (default: all of them)")
    p.add_argument("--budget", type=float, default=600.0, metavar="SECONDS",
                   help="stop judging new candidates after this long (resume later: progress is kept)")
    p.add_argument("--repo", action="store_true",
                   help="write the source checkout's tune/tuned.json (developers) instead of the user's file")
    p.add_argument("--compile-only", metavar="GPU",
                   help="compile the GEMV sweep's candidates for GPU (its name as the tuned results key it, e.g. "
                        "'NVIDIA H100 80GB HBM3') into the kernel cache and stop: no device needed. A device whose "
                        "NVRTC has this version finds them in a copy of that cache")
    args = p.parse_args(argv)
    families = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in families if k not in KERNELS]
    if unknown:
        raise NanoqwenError(f"--kernels: no tuner for {', '.join(unknown)} yet (tunable: {', '.join(KERNELS)})")
    from ..codegen.kernels import gemv
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    bad = [r for r in roles if r not in gemv.ROLES]
    if bad:
        raise NanoqwenError(f"--roles: unknown role(s) {', '.join(bad)} (known: {', '.join(gemv.ROLES)})")
    if args.budget <= 0:
        raise NanoqwenError(f"--budget must be positive, got {args.budget}")
    buckets = config.default().multirow.buckets
    try:
        ms = [int(v) for v in args.rows.split(",") if v.strip()]
    except ValueError:
        ms = []
    if not ms or any(m not in buckets for m in ms):
        raise NanoqwenError(f"--rows: {args.rows!r} is not a list of multirow buckets "
                            f"({', '.join(map(str, buckets))}; config multirow.buckets)")
    from .gen import model_dims
    from ..codegen import tuned_store as store
    from ..tuning import attention, space, sweep
    out = store.repo_path() if args.repo else store.user_path()
    spaces = tuple(s.strip() for s in args.spaces.split(",") if s.strip()) if args.spaces else space.TILE_SPACES
    space.tile_spaces(spaces)   # an unknown name fails here, before the device starts
    dims, cfg = model_dims(args.model), config.default()
    budget = args.budget / (len(ms) * len(families))

    def log(line):
        print(line, flush=True)
    if args.compile_only:
        if families != ["gemv"]:
            raise NanoqwenError("--compile-only: the GEMV sweep only (--kernels gemv)")
        failed = sum(sweep.compile_only(dims, cfg, roles, args.compile_only, m, spaces, log=log) for m in ms)
        return 1 if failed else 0
    summary = []
    if "gemv" in families:
        summary += [r for m in ms for r in sweep.tune(dims, cfg, roles, budget, log=log, out=out, m=m, spaces=spaces)]
    if "attention" in families:
        summary += [r for m in ms for r in attention.tune_attention(dims, cfg, budget, log=log, out=out, m=m)]
    print(sweep.table(summary))
    if summary:
        print(f"stored in {out}")
    return 0


def main(argv=None) -> int:
    return run_main(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
