"""`nanoqwen bench MODEL`: the pp512 / tg128 protocol of config ``bench`` (nanoqwen/bench/protocol.py) with
the ITL breakdown, MBU and the PyTorch baselines (``--timeline``: every kernel timed inside the replayed
graph, bench/timeline.py; ``--timeline-rows M``: the same for the multi-row step's bucket M); `nanoqwen
bench --kernels` times the INT4 GEMVs alone
against the copy bandwidth (nanoqwen/bench/kernels.py). MODEL is a .nanoqwen file, a Hugging Face
directory, or ``7b``: the synthetic random-weight Qwen2.5-7B, packed on first use into the cache."""

from __future__ import annotations

from pathlib import Path

from ..bench.protocol import BenchError
from ..modelcache import is_file


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL", help=".nanoqwen file, HF model directory, or 7b (synthetic)")
    p.add_argument("--kernels", action="store_true", help="GEMV kernel benchmark (bandwidth vs device copy; m-row step costs)")
    p.add_argument("--roles", default="qkv,o_proj,gate_up,down", help="--kernels: GEMV roles to time (comma-separated)")
    p.add_argument("--warmup", type=int, metavar="N", help="untimed requests first (default: config bench.warmup)")
    p.add_argument("--prompt-tokens", type=int, metavar="N", help="prompt length (default: config bench.prompt_tokens)")
    p.add_argument("--gen-tokens", type=int, metavar="N", help="decode steps timed (default: config bench.gen_tokens)")
    p.add_argument("--repetitions", type=int, metavar="N", help="timed requests (default: config bench.repetitions)")
    p.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baselines")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="bar chart of the ITL breakdown")
    p.add_argument("--profile", type=Path, metavar="FILE.json", help="per-kernel timings of one step")
    p.add_argument("--timeline", type=Path, metavar="FILE.png",
                   help="time every kernel inside the replayed step graph: chart here, per-kernel figures in the JSON")
    p.add_argument("--timeline-rows", type=int, metavar="M",
                   help="with --timeline: also the multi-row step of bucket M (its chart beside, FILE-rowsM.png)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")


def _check(args) -> None:
    """Argument errors before any GPU work: one line each."""
    if args.kernels:
        extra = [o for o, v in (("MODEL", args.model), ("--warmup", args.warmup),
                                ("--prompt-tokens", args.prompt_tokens), ("--gen-tokens", args.gen_tokens),
                                ("--repetitions", args.repetitions), ("--plot", args.plot),
                                ("--profile", args.profile), ("--timeline", args.timeline),
                                ("--timeline-rows", args.timeline_rows)) if v is not None]
        if extra:
            raise BenchError(f"nanoqwen bench --kernels takes no {', '.join(extra)} "
                             f"(it times the 7B GEMV shapes alone)")
    elif args.model is None:
        raise BenchError("nanoqwen bench: give MODEL (a .nanoqwen file, a HF directory or 7b) or --kernels")
    elif args.model != "7b":
        is_file(args.model)  # a missing or unusable MODEL is one line before anything else
    for opt, v, lo in (("--warmup", args.warmup, 0), ("--prompt-tokens", args.prompt_tokens, 1),
                       ("--gen-tokens", args.gen_tokens, 2), ("--repetitions", args.repetitions, 1)):
        if v is not None and v < lo:
            raise BenchError(f"{opt} must be at least {lo}, got {v}")
    if args.timeline_rows is not None:
        from ..config import default
        buckets = [b for b in default().multirow.buckets if b > 1]
        if args.timeline is None:
            raise BenchError("--timeline-rows needs --timeline (its chart goes beside that one)")
        if args.timeline_rows not in buckets:
            raise BenchError(f"--timeline-rows {args.timeline_rows}: not a multi-row bucket "
                             f"({', '.join(map(str, buckets))})")
    for opt, path, suffix in (("--plot", args.plot, ".png"), ("--profile", args.profile, ".json"),
                              ("--timeline", args.timeline, ".png"), ("--out", args.out, ".json")):
        if path is not None and path.suffix.lower() != suffix:
            raise BenchError(f"{opt} {path}: expected a {suffix} file name")
        if path is not None and not path.resolve().parent.is_dir():   # before the benchmark, not after
            raise BenchError(f"{opt} {path}: no directory {path.parent} to write it into")


def rows_chart(timeline: Path, m: int) -> Path:
    """The m-row step's chart, beside the decode step's."""
    return timeline.with_name(f"{timeline.stem}-rows{m}{timeline.suffix}")


def _kernels(args) -> dict:
    from ..bench import kernels
    from ..codegen.kernels import gemv
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    unknown = [r for r in roles if r not in gemv.ROLES]
    if unknown:
        raise BenchError(f"--roles: unknown role(s) {', '.join(unknown)} (known: {', '.join(gemv.ROLES)})")
    return kernels.run(roles=roles)   # tile sweeps live in nanoqwen-tune


def run(args) -> int:
    from ..bench import protocol
    _check(args)
    if args.kernels:
        result = _kernels(args)
    else:
        result = protocol.run(args.model, warmup=args.warmup, prompt_tokens=args.prompt_tokens,
                              gen_tokens=args.gen_tokens, repetitions=args.repetitions,
                              baseline=not args.no_baseline, profile_path=args.profile,
                              timeline=args.timeline is not None, timeline_rows=args.timeline_rows)
        print(protocol.table(result), flush=True)
        if args.plot:
            print(protocol.plot(result, args.plot))
        if args.timeline:
            from ..bench import timeline
            title = f"{result['model']['label']} on {result['gpu']['name']}, commit {result['commit']}"
            print(timeline.plot(result["timeline"], args.timeline, title))
            if args.timeline_rows:
                print(timeline.plot(result["timeline_rows"], rows_chart(args.timeline, args.timeline_rows),
                                    f"{title}, the {args.timeline_rows}-row step"))
    if args.out:
        protocol.write_json(result, args.out)
        print(f"wrote {args.out}")
    return 0
