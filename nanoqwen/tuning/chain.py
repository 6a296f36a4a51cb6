"""GEMV tiles judged where decode runs them: each variant of one role's m = 1 tile swapped into the captured
decode step of one session (the same weights, KV cache and buffers), the graph step timed in interleaved
rounds beside the step as this GPU's tuned tiles make it. nanoqwen-tune judges a tile back to back (graph
replays of that GEMV alone); in the step the same kernel follows other kernels, and it runs slower there
(H100: gate_up 25.0 us back to back, 30.5 us from o_proj's end to its own), so the back-to-back winner need
not be the step's. This judges speed only: a variant that wins is stored and gated like any tuned entry
(its rows need not be the tuned tile's bits).

    python -m nanoqwen.tuning.chain gate_up prefetch=1 unroll=4 [--top K] [--rounds 5] [--json FILE]

--top K adds the K fastest tiles of the role's m = 1 sweep that nanoqwen-tune judged on this GPU (its progress
under the cache root): its back-to-back table as the prefilter, the step as the final word."""

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
    """The m = 1 tile of ``spec``: what the tuner stores, and the L2 fetch size (space.tile_fields)."""
    return space.tile_params(spec) | {"l2_fetch": spec.l2_fetch}


def variant_specs(role: str, variants: list[str], dims: ModelDims, cfg: config.Config, gpu: str | None) -> dict:
    """label -> m = 1 spec of ``role`` on ``gpu`` (None: the config's tiles): BASE, the kernel decode runs now,
    then each FIELD=VALUE,... over its tile (NanoqwenError for a bad field, value or tile)."""
    if role not in gemv.ROLES:
        raise NanoqwenError(f"unknown role {role!r} (known: {', '.join(gemv.ROLES)})")
    one = tuned.role_spec(role, dims, cfg, gpu)
    tile = _tile(one)
    specs = {BASE: one}
    for fields in variants:
        try:
            specs[fields] = gemv.role_spec(role, dims, cfg, **(tile | space.parse_tile(fields, space.tile_fields())))
        except SpecError as e:
            raise NanoqwenError(f"{role}:{fields}: {e}") from None
    return specs


def top_variants(role: str, k: int, dims: ModelDims, cfg: config.Config, gpu: str, done: dict) -> list[str]:
    """The ``k`` fastest back-to-back tiles of ``role``'s m = 1 sweep on ``gpu`` that nanoqwen-tune judged
    (``done``: its progress, cubin name -> result), other than the tuned one, each as the FIELD=VALUE,... that
    turns the tuned tile into it: the tuner's table as the prefilter, this judge as the final word."""
    from . import sweep
    one, cands = sweep.candidates(role, dims, cfg, gpu, 1, log=lambda line: None)
    by_uri = {name.rsplit("-", 1)[0]: res for name, res in done.items()}   # cubin name: <uri>-<key16>.cubin
    timed = sorted((by_uri[s.uri]["us"], i) for i, s in enumerate(cands)
                   if s != one and by_uri.get(s.uri, {}).get("status") == "ok")
    base = _tile(one)
    return [",".join(f"{f}={int(v) if isinstance(v, bool) else v}" for f, v in _tile(cands[i]).items() if v != base[f])
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
    """label -> the graph step's median of ``reps`` gated replays (ms) at ``context``, one per round."""
    from .. import codegen
    from ..runtime import driver
    from ..runtime.decoder import Decoder
    from ..bench.itl import StepTimer
    dec, pos = session.decoder, context - 1
    if dec.kernels[role][0].uri != specs[BASE].uri:
        raise NanoqwenError(f"{role}: the session runs {dec.kernels[role][0].uri}, not the tuned {specs[BASE].uri}")
    built = codegen.build_many(list(specs.values())[1:], progress=codegen.ProgressLine())
    decoders = {BASE: dec}
    for (label, spec), b in zip(list(specs.items())[1:], built):
        v = Decoder(dec.shared, dec.kernels | {role: (spec, driver.load(b))}, pdl=dec.pdl, bufs=dec.bufs)
        v.reset(0, pos=pos, step=pos)
        v.launch_kernels()   # eager once: its modules load outside the capture
        v.drain()
        v.check_errors()
        v.capture()
        decoders[label] = v
    times = {label: [] for label in decoders}
    try:
        for label in rounds_order(list(decoders), rounds):
            timer = StepTimer(decoders[label])
            try:
                times[label].append(1e3 * statistics.median(timer.whole(0, pos, reps, graph=True)))
            finally:
                timer.close()
        log("  ".join(f"{lab}: {statistics.median(t):.4f} ms" for lab, t in times.items()))
    finally:
        for label, v in decoders.items():
            if v is not dec:
                v.close()
    return times


def run(role: str, variants: list[str], rounds: int, reps: int, top: int = 0, log=None) -> dict:
    from ..runtime import driver
    from .sweep import Progress
    from ..runtime.session import CudaSession
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg = config.default()
    props = driver.device().props
    if top:
        variants = variants + top_variants(role, top, QWEN25_7B, cfg, props.name, Progress(props.name).done)
    if not variants:
        raise NanoqwenError(f"{role}: no variants (and no tile of nanoqwen-tune's progress for --top)")
    specs = variant_specs(role, variants, QWEN25_7B, cfg, props.name)   # a bad variant fails before the load
    path = protocol.resolve_model("7b", cfg, log)
    session = CudaSession(path, PROMPT + GEN + 1, log=log)
    try:
        rng = np.random.default_rng(protocol.SYNTHETIC_SEED)
        list(session.generate(rng.integers(0, session.dims.vocab, size=PROMPT).tolist(), GEN + 1))   # K/V written
        context = PROMPT + GEN // 2
        log(f"{role}: {len(specs) - 1} variants beside the tuned tile, {rounds} rounds at context {context}")
        times = judge(session, role, specs, rounds, reps, context, log)
    finally:
        session.close()
    return {"kind": "nanoqwen-tune-chain", "schema": 1, "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": {"name": props.name, "driver_version": props.driver_version},
            "role": role, "context": context, "rounds": rounds, "reps": reps,
            "uris": {lab: s.uri for lab, s in specs.items()}, "variants": summarize(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.tuning.chain", description=__doc__.split("\n")[0])
    p.add_argument("role", help=f"the GEMV whose tile varies: {', '.join(gemv.ROLES)}")
    p.add_argument("variants", nargs="*", metavar="FIELD=VALUE,...", help="tile fields over the tuned tile")
    p.add_argument("--top", type=int, default=0, metavar="K",
                   help="also the K fastest tiles nanoqwen-tune judged back to back on this GPU (its progress)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reps", type=int, default=20, help="gated graph replays a round (default 20)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.reps < 1 or args.top < 0 or not (args.variants or args.top):
        print("chain: --rounds and --reps must be at least 1, --top at least 0, and some variant named or --top",
              file=sys.stderr)
        return 2
    try:
        variant_specs(args.role, args.variants, QWEN25_7B, config.default(), None)   # bad input: before the device
        res = run(args.role, args.variants, args.rounds, args.reps, args.top)
    except NanoqwenError as e:
        print(f"chain: {e}", file=sys.stderr)
        return 2
    for lab, v in res["variants"].items():
        print(f"{lab:40s} graph step {v['graph_step_ms']:.4f} ms ({v['vs_tuned_pct']:+.2f}%)")
    protocol.save(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
