"""Short prefill chunks on the GPU alone (issue 21): each graph bucket's chunk replayed at the end of a long
prompt, the editor re-request's prefill without the server, the host or the lm_head
(`python -m nanoqwen.bench.chunks --json OUT`, synthetic 7B).

A session loads a sequence of ``context`` positions and prefills its first ``context - largest bucket`` cold; then
for each bucket b of ``prefill.graph_buckets``, the largest first, the Prefiller prefills positions [context - b,
context) as one chunk of b rows, as a re-request's tail does (its K/V rewritten with the same bits each time): the
host stages the ids, the stream copies them and replays bucket b's graph. Timing as bench.prefill's, a memset before
each start event (bench/replay.py blocked_seconds), of 1 GB here (~0.4 ms: the host stages a chunk in Python
meanwhile), so the host's staging stays out of the time and the weights come from HBM, as a keystroke finds them.
Beside each time: the bytes the chunk must read at least (the decoder layers' weights and scales, and the K/V of the
``context`` keys its attention reads) over the copy bandwidth measured in the same run, the chunk's floor. With
``--timeline M`` bucket M's kernels are also timed inside its replayed graph (bench/timeline.py measure_chunk: each
kernel's busy time, the idle time between kernels; a chart beside the JSON)."""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import numpy as np

from .. import config
from ..codegen.kernels import gemv
from ..dims import ModelDims
from ..nqfile import NanoqwenFile
from ..runtime import driver
from . import protocol
from .kernels import BLOCKER_BYTES, copy_bandwidth, git_commit
from .replay import blocked_seconds

CONTEXT, REPS = 4096, 20
BLOCKER = 4 * BLOCKER_BYTES   # longer than the host's staging of a chunk (kernel benches need ~10 us of cover)


def floor_bytes(dims: ModelDims, cfg: config.Config, context: int) -> int:
    """The least a chunk at the end of ``context`` positions reads: every layer's four weight matrices with
    their scales once, and the K and V (fp16) of its ``context`` keys."""
    weights = sum(gemv.role_spec(role, dims, cfg).weight_bytes() for role in gemv.ROLES)
    return dims.layers * (weights + 2 * context * dims.kv_dim * 2)


def run(context: int = CONTEXT, reps: int = REPS, timeline_rows: int = 0, log=None) -> dict:
    from ..runtime.session import CudaSession
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    props = driver.device().props
    path = protocol.resolve_model("7b", cfg, log)
    dims = NanoqwenFile(path, cfg).dims
    session = CudaSession(path, context, log=log)
    blocker = None
    try:
        pre, stream = session.prefiller, session.state.stream
        buckets = [] if pre is None or pre.graphs is None else pre.graphs.buckets
        if not buckets or pre.graph_rows() < buckets[-1]:
            raise SystemExit("bench.chunks: this session replays no chunk graphs (prefill.graph_buckets)")
        ids = np.random.default_rng(protocol.SYNTHETIC_SEED).integers(0, dims.vocab, context).tolist()
        session.runner.reserve(context)
        pre(ids[:context - buckets[-1]], 0)   # the cached part, cold
        copy = copy_bandwidth(stream)["GBps"]
        floor = floor_bytes(dims, cfg, context)
        blocker = driver.DeviceBuffer(BLOCKER)
        rows = []
        for b in reversed(buckets):   # the largest first: it writes the keys a smaller chunk reads before its own
            p0 = context - b
            t = statistics.median(blocked_seconds(lambda i, p0=p0: pre(ids[p0:], p0), reps, stream, blocker))
            rows.append({"rows": b, "ms": 1e3 * t, "floor_ms": 1e3 * floor / (copy * 1e9),
                         "GBps": floor / t / 1e9, "pct_copy": 100 * floor / t / (copy * 1e9)})
            log(f"chunk of {b:2d} rows at positions {p0}..{context - 1}: {1e3 * t:.3f} ms, "
                f"{floor / 1e9:.2f} GB at least: {floor / t / 1e9:.0f} GB/s, {rows[-1]['pct_copy']:.1f}% of copy "
                f"({copy:.0f} GB/s; floor {rows[-1]['floor_ms']:.3f} ms)")
        session.state.check_errors()
        rows.reverse()
        if timeline_rows:
            if timeline_rows not in buckets:
                raise SystemExit(f"bench.chunks: --timeline {timeline_rows}: not a graph bucket ({buckets})")
            from . import timeline
            p0 = context - timeline_rows
            tl = timeline.measure_chunk(pre, timeline_rows, p0, ids[p0:], cfg=cfg)
            log(timeline.summary(tl))
    finally:
        if blocker is not None:
            blocker.free()
        session.close()
    return {"kind": "nanoqwen-bench-chunks", "schema": 1, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": {"name": props.name, "driver_version": props.driver_version},
            "model": "synthetic 7B (random weights at the real shapes)", "context": context, "reps": reps,
            "copy_GBps": copy, "floor_bytes": floor, "chunks": rows, **({"timeline": tl} if timeline_rows else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.chunks", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=CONTEXT, help=f"the prompt's positions (default {CONTEXT})")
    p.add_argument("--timeline", type=int, default=0, metavar="M",
                   help="also time bucket M's kernels inside its graph (a chart beside --json)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    res = run(args.context, timeline_rows=args.timeline)
    protocol.save(res, args.json)
    if args.timeline and args.json is not None:
        from . import timeline
        chart = args.json.with_name(f"timeline-chunk{args.timeline}.png")
        print(timeline.plot(res["timeline"], chart, title=f"prefill chunk of {args.timeline} rows at positions "
                            f"{args.context - args.timeline}..{args.context - 1}, {res['gpu']['name']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
