"""GEMV tiles judged where decode runs them: each variant of one role's m = 1 tile swapped into the captured
decode step of one session (the same weights, KV cache and buffers), the graph step timed in interleaved
rounds beside the step as this GPU's tuned tiles make it. nanoqwen-tune judges a tile back to back (graph
replays of that GEMV alone); in the step the same kernel follows other kernels, and it runs slower there
(H100: gate_up 25.0 us back to back, 30.5 us from o_proj's end to its own; the 8-row down 34.7 against 45),
so the back-to-back winner need not be the step's. This judges speed only: a variant that wins is stored and
gated like any tuned entry (its rows need not be the tuned tile's bits).

    python -m nanoqwen.tuning.chain gate_up prefetch=1 unroll=4 [--rows M] [--top K] [--rounds 5] [--json FILE]

--rows M judges the role's m-row kernel in the M-row step (a multirow bucket) instead: variants over its tile
(rows, warps, unroll, prefetch, ctas_per_sm), each bucket graph over its own buffers (the tuned one's too).
--top K adds the K fastest tiles of the role's sweep (m = 1, or M rows) that nanoqwen-tune judged on this GPU
(its progress under the cache root): its back-to-back table as the prefilter, the step as the final word."""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import numpy as np

from .. import NanoqwenError, config
from ..codegen import tuned
from ..codegen.kernels import gemv
from ..codegen.spec import SpecError
from ..dims import QWEN25_7B, ModelDims
from ..bench import protocol
from ..bench.kernels import git_commit
from . import space

PROMPT, GEN = 512, 128   # the bench protocol's request; the steps are timed at its mean decode context
BASE = "tuned"


def _tile(spec: gemv.GemvInt4Spec) -> dict:
    """The tile of ``spec``: what the tuner stores (m = 1: with the L2 fetch size, space.tile_fields)."""
    return space.tile_params(spec) | ({"l2_fetch": spec.l2_fetch} if spec.m == 1 else {})


def variant_specs(role: str, variants: list[str], dims: ModelDims, cfg: config.Config, gpu: str | None,
                  m: int = 1) -> dict:
    """label -> spec of ``role``'s m-row kernel on ``gpu`` (None: the config's tiles) as the step runs it: BASE,
    the kernel the step runs now, then each FIELD=VALUE,... over its tile (NanoqwenError for a bad field, value
    or tile). m > 1 varies the m-row tile over the tuned m = 1 kernel (its rows keep that kernel's order)."""
    if role not in gemv.ROLES:
        raise NanoqwenError(f"unknown role {role!r} (known: {', '.join(gemv.ROLES)})")
    if m != 1 and m not in cfg.multirow.buckets:
        raise NanoqwenError(f"--rows {m}: not a multirow bucket (config multirow.buckets: "
                            f"{', '.join(map(str, cfg.multirow.buckets))})")
    one = tuned.role_spec(role, dims, cfg, gpu)
    base = tuned.role_spec(role, dims, cfg, gpu, m)
    fields = space.tile_fields() if m == 1 else set(gemv.MULTIROW_TILE)
    # the step runs the role's norm apart at this m (config multirow.norm_apart), and the one-row step's QKV GEMV
    # with the rope in its epilogue where the tile allows (runtime/decoder.step_specs): so do its variants
    apart = role in cfg.multirow.apart_roles(m)
    page = cfg.kv_cache.page_size
    fused = role == "qkv" and gemv.with_rope(base, dims, page) is not None

    def as_run(text, spec):
        if fused:
            spec = gemv.with_rope(spec, dims, page)
            if spec is None:
                raise NanoqwenError(f"{role}:{text}: the step's QKV GEMV carries the rope, and this tile cannot")
        return gemv.norm_apart(spec) if apart else spec

    specs = {BASE: base}
    for text in variants:
        try:
            tile = _tile(base) | space.parse_tile(text, fields)
            specs[text] = gemv.role_spec(role, dims, cfg, **tile) if m == 1 else gemv.multirow_spec(one, m, cfg,
                                                                                                   tile=tile)
        except SpecError as e:
            raise NanoqwenError(f"{role}:{text}: {e}") from None
    return {label: as_run(label, spec) for label, spec in specs.items()}


def top_variants(role: str, k: int, dims: ModelDims, cfg: config.Config, gpu: str, done: dict,
                 m: int = 1) -> list[str]:
    """The ``k`` fastest back-to-back tiles of ``role``'s sweep (m = 1, or m rows) on ``gpu`` that nanoqwen-tune
    judged (``done``: its progress, cubin name -> result), other than the tuned one, each as the FIELD=VALUE,...
    that turns the tuned tile into it: the tuner's table as the prefilter, this judge as the final word."""
    from . import sweep
    _one, cands = sweep.candidates(role, dims, cfg, gpu, m, log=lambda line: None)
    base = tuned.role_spec(role, dims, cfg, gpu, m)
    by_uri = {name.rsplit("-", 1)[0]: res for name, res in done.items()}   # cubin name: <uri>-<key16>.cubin
    timed = sorted((by_uri[s.uri]["us"], i) for i, s in enumerate(cands)
                   if s != base and by_uri.get(s.uri, {}).get("status") == "ok")
    tile = _tile(base)
    return [",".join(f"{f}={int(v) if isinstance(v, bool) else v}" for f, v in _tile(cands[i]).items() if v != tile[f])
            for _us, i in timed[:k]]


def rounds_order(labels: list[str], rounds: int) -> list[str]:
    """Every label once a round, the base first, the others rotated a place each round (no variant always
    follows the same one)."""
    base, rest = labels[0], labels[1:]
    order = []
    for r in range(rounds):
        k = r % len(rest) if rest else 0
        order += [base, *rest[k:], *rest[:k]]
    return order


def summarize(times: dict[str, list[float]]) -> dict:
    """label -> median graph step (ms, of its rounds' medians) and its change against BASE in percent."""
    base = statistics.median(times[BASE])
    return {lab: {"graph_step_ms": statistics.median(t), "rounds_ms": t,
                  "vs_tuned_pct": 100.0 * (statistics.median(t) / base - 1.0)} for lab, t in times.items()}


def judge(session, role: str, specs: dict, rounds: int, reps: int, context: int, log=print) -> dict[str, list[float]]:
    """label -> the step's graph time (ms) at ``context``, one per round: the decode step (m = 1 specs) by the
    median of ``reps`` gated replays, the m-row step (the specs' m) by the mean of ``reps`` back-to-back replays
    of its rows at positions context - m + 1 .. context."""
    from .. import codegen
    from ..runtime import driver
    m, base = specs[BASE].m, specs[BASE]
    running, running_fn = session.decoder.kernels[role] if m == 1 else session.rows.kernels[m][role]
    if running.uri != base.uri:
        raise NanoqwenError(f"{role}: the session runs {running.uri}, not the tuned {base.uri}")
    fresh = {label: spec for label, spec in specs.items() if m > 1 or label != BASE}
    built = dict(zip(fresh, codegen.build_many(list(fresh.values()), progress=codegen.ProgressLine())))
    steps = {}
    try:
        for label, spec in specs.items():
            # a candidate takes the shared-memory split of the kernel it stands in for
            fn = driver.load(built[label], carveout=running_fn.carveout) if label in built else None
            steps[label] = (_DecodeStep if m == 1 else _RowsStep)(session, role, spec, fn, context)
        times = {label: [] for label in steps}
        for label in rounds_order(list(steps), rounds):
            times[label].append(1e3 * steps[label].time(reps))
        log("  ".join(f"{lab}: {statistics.median(t):.4f} ms" for lab, t in times.items()))
    finally:
        for step in steps.values():
            step.close()
    return times


class _DecodeStep:
    """The decode step with ``spec`` as ``role`` (``fn`` None: the session's own decoder), over the session's
    buffers, captured; ``time(reps)``: the median of gated replays, seconds."""

    def __init__(self, session, role: str, spec, fn, context: int):
        from ..runtime.decoder import Decoder
        dec, self.pos = session.decoder, context - 1
        self.own = fn is not None
        self.dec = (Decoder(dec.shared, dec.kernels | {role: (spec, fn)}, pdl=dec.pdl, bufs=dec.bufs) if self.own
                    else dec)
        if self.own:
            self.dec.reset(0, pos=self.pos, step=self.pos)
            self.dec.launch_kernels()   # eager once: its modules load outside the capture
            self.dec.drain()
            self.dec.check_errors()
            self.dec.capture()

    def time(self, reps: int) -> float:
        from ..bench.itl import StepTimer
        timer = StepTimer(self.dec)
        try:
            return statistics.median(timer.whole(0, self.pos, reps, graph=True))
        finally:
            timer.close()

    def close(self) -> None:
        if self.own:
            self.dec.close()


class _RowsStep:
    """The m-row step of ``spec``'s m with ``spec`` as ``role``, over buffers of its own (the tuned step's too,
    so that no label runs over the session's placement alone), its rows at positions context - m + 1 ..
    context of the session's sequence, captured; ``time(reps)``: seconds per back-to-back replay."""

    def __init__(self, session, role: str, spec, fn, context: int):
        from ..runtime.rowstep import RowStep
        rows, m = session.rows, spec.m
        self.stream = session.state.stream
        self.step = RowStep(rows.shared, {m: rows.kernels[m] | {role: (spec, fn)}}, pdl=rows.pdl)
        self.m = m
        self.step.run([0] * m, list(range(context - m + 1, context + 1)))   # eager once: modules, inputs up
        self.step.capture()

    def time(self, reps: int) -> float:
        from ..bench.itl import replay_seconds
        return replay_seconds(lambda: self.step.graphs[self.m].launch(self.stream), self.stream, reps)

    def close(self) -> None:
        self.step.close()


def run(role: str, variants: list[str], rounds: int, reps: int, top: int = 0, m: int = 1, log=None) -> dict:
    from ..runtime import driver
    from .sweep import Progress
    from ..runtime.session import CudaSession
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    props = driver.device().props
    if top:
        variants = variants + top_variants(role, top, QWEN25_7B, cfg, props.name, Progress(props.name).done, m)
    if not variants:
        raise NanoqwenError(f"{role}: no variants (and no tile of nanoqwen-tune's progress for --top)")
    specs = variant_specs(role, variants, QWEN25_7B, cfg, props.name, m)   # a bad variant fails before the load
    path = protocol.resolve_model("7b", cfg, log)
    session = CudaSession(path, PROMPT + GEN + 1, log=log)
    try:
        rng = np.random.default_rng(protocol.SYNTHETIC_SEED)
        list(session.generate(rng.integers(0, session.dims.vocab, size=PROMPT).tolist(), GEN + 1))   # K/V written
        context = PROMPT + GEN // 2
        step = "decode step" if m == 1 else f"{m}-row step"
        log(f"{role}: {len(specs) - 1} variants beside the tuned tile in the {step}, {rounds} rounds at context "
            f"{context}")
        times = judge(session, role, specs, rounds, reps, context, log)
    finally:
        session.close()
    return {"kind": "nanoqwen-tune-chain", "schema": 1, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": {"name": props.name, "driver_version": props.driver_version},
            "role": role, "m": m, "context": context, "rounds": rounds, "reps": reps,
            "uris": {lab: s.uri for lab, s in specs.items()}, "variants": summarize(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.tuning.chain", description=__doc__.split("\n")[0])
    p.add_argument("role", help=f"the GEMV whose tile varies: {', '.join(gemv.ROLES)}")
    p.add_argument("variants", nargs="*", metavar="FIELD=VALUE,...", help="tile fields over the tuned tile")
    p.add_argument("--rows", type=int, default=1, metavar="M",
                   help="judge the role's M-row kernel in the M-row step (a multirow bucket; default 1: decode)")
    p.add_argument("--top", type=int, default=0, metavar="K",
                   help="also the K fastest tiles nanoqwen-tune judged back to back on this GPU (its progress)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reps", type=int, default=20, help="gated graph replays a round (default 20)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_intermixed_args(argv)   # variants may follow --rows M, as gpu_check's GPU_CHECK_CHAIN gives them
    if args.rounds < 1 or args.reps < 1 or args.top < 0 or not (args.variants or args.top):
        print("chain: --rounds and --reps must be at least 1, --top at least 0, and some variant named or --top",
              file=sys.stderr)
        return 2
    try:
        variant_specs(args.role, args.variants, QWEN25_7B, config.default(), None, args.rows)   # before the device
        res = run(args.role, args.variants, args.rounds, args.reps, args.top, args.rows)
    except NanoqwenError as e:
        print(f"chain: {e}", file=sys.stderr)
        return 2
    for lab, v in res["variants"].items():
        print(f"{lab:40s} graph step {v['graph_step_ms']:.4f} ms ({v['vs_tuned_pct']:+.2f}%)")
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
