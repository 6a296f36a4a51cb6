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
kernel's busy time, the idle time between kernels; a chart beside the JSON). With ``--profile-rows N`` a long chunk of
N rows at position 0 (a cold prompt's, kernel by kernel as the Prefiller launches it) is timed two ways from the same
launches: the chain (events around the whole chunk, PDL between kernels) and each kernel between two events of its
own (``profile_chunk``): where the chain's time goes, per role, against bench.prefill's isolated GEMMs."""

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


def chunk_launches(pre, n: int) -> list[tuple]:
    """(role, Function, Launch, args) of each kernel of a chunk of ``n`` rows at position 0 whose ids are staged in
    ``pre.bufs.tokens``: the launches Prefiller.__call__ makes for a chunk it runs kernel by kernel."""
    seq = []

    def emit(role, *shape, **args):
        spec, fn = pre.kernels["prefill." + role]
        seq.append((role, fn, spec.launch(*shape), args))
    pre._chunk(emit, n, pre.bufs.tokens.ptr, dict(p0=0, n=n))
    return seq


def profile_chunk(pre, ids: list[int], reps: int = REPS) -> dict:
    """A chunk of ``len(ids)`` rows at position 0, kernel by kernel, ``reps`` times each way, each run held at a
    gate until every launch is queued (bench/itl.py Gate): the chain (PDL as the Prefiller launches, events only
    around it) and every kernel between two events (no overlap across them: each kernel's own time)."""
    from .itl import Gate
    n, stream = len(ids), pre.shared.stream
    if not pre.graph_rows() < n <= pre.chunk_tokens:
        raise SystemExit(f"bench.chunks: --profile-rows {n}: a long chunk has {pre.graph_rows() + 1}.."
                         f"{pre.chunk_tokens} rows (prefill.chunk_tokens)")
    pre(ids, 0)   # stages the ids in bufs.tokens (and runs the chunk once: every kernel loaded and warm)
    seq = chunk_launches(pre, n)
    gate, evs = Gate(), [driver.Event() for _ in range(len(seq) + 1)]
    chain, per = [], []
    try:
        for _ in range(reps):
            for each in (False, True):
                gate.hold(stream)
                evs[0].record(stream)
                for i, (role, fn, launch, args) in enumerate(seq):
                    fn.launch(launch, stream, pre.pdl(role), **args)
                    if each:
                        evs[i + 1].record(stream)
                if not each:
                    evs[-1].record(stream)
                gate.release()
                stream.synchronize()
                if each:
                    per.append([driver.Event.elapsed_ms(a, b) * 1e-3 for a, b in zip(evs, evs[1:])])
                else:
                    chain.append(driver.Event.elapsed_ms(evs[0], evs[-1]) * 1e-3)
    finally:
        gate.close()
        for e in evs:
            e.close()
    kernels = [{"index": i, "role": role, "uri": fn.uri, "us": 1e6 * statistics.median(t[i] for t in per)}
               for i, (role, fn, _launch, _args) in enumerate(seq)]
    by_role: dict[str, dict] = {}
    for k in kernels:
        r = by_role.setdefault(k["role"], {"us": 0.0, "launches": 0, "uris": []})
        r["us"] += k["us"]
        r["launches"] += 1
        if k["uri"] not in r["uris"]:
            r["uris"].append(k["uri"])
    return {"rows": n, "reps": reps, "gated": gate.ok, "chain_ms": 1e3 * statistics.median(chain),
            "kernels_ms": sum(k["us"] for k in kernels) / 1e3, "by_role": by_role, "kernels": kernels}


def profile_summary(prof: dict) -> str:
    lines = [f"chunk of {prof['rows']} rows at position 0: {prof['chain_ms']:.3f} ms as a chain, "
             f"{prof['kernels_ms']:.3f} ms summed over its {len(prof['kernels'])} kernels timed one by one "
             f"(gated={prof['gated']})"]
    ranked = sorted(prof["by_role"].items(), key=lambda kv: -kv[1]["us"])
    lines += [f"  {role:28s} {r['us'] / 1e3:8.3f} ms, {r['launches']} x {r['us'] / r['launches']:.1f} us"
              for role, r in ranked]
    return "\n".join(lines)


def run(context: int = CONTEXT, reps: int = REPS, timeline_rows: int = 0, profile_rows: int = 0, log=None) -> dict:
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
        if profile_rows:
            prof = profile_chunk(pre, ids[:profile_rows], reps)
            log(profile_summary(prof))
            session.state.check_errors()
    finally:
        if blocker is not None:
            blocker.free()
        session.close()
    return {"kind": "nanoqwen-bench-chunks", "schema": 1, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": {"name": props.name, "driver_version": props.driver_version},
            "model": "synthetic 7B (random weights at the real shapes)", "context": context, "reps": reps,
            "copy_GBps": copy, "floor_bytes": floor, "chunks": rows, **({"timeline": tl} if timeline_rows else {}),
            **({"long_chunk": prof} if profile_rows else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.chunks", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=CONTEXT, help=f"the prompt's positions (default {CONTEXT})")
    p.add_argument("--timeline", type=int, default=0, metavar="M",
                   help="also time bucket M's kernels inside its graph (a chart beside --json)")
    p.add_argument("--profile-rows", type=int, default=0, metavar="N",
                   help="also time a long chunk of N rows kernel by kernel and as a chain (e.g. 512)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    res = run(args.context, timeline_rows=args.timeline, profile_rows=args.profile_rows)
    protocol.save(res, args.json)
    if args.timeline and args.json is not None:
        from . import timeline
        chart = args.json.with_name(f"timeline-chunk{args.timeline}.png")
        print(timeline.plot(res["timeline"], chart, title=f"prefill chunk of {args.timeline} rows at positions "
                            f"{args.context - args.timeline}..{args.context - 1}, {res['gpu']['name']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
