"""The GPU sweep behind `nanoqwen-tune`: per GEMV role, every candidate of the search space is compiled
(in parallel, on the CPU), checked against the numpy answer on the GPU (a fast wrong kernel is discarded
and reported), then timed the way decode runs it (graph back-to-back with PDL, weights rotating through
more than L2). The best per (GPU, shape) goes into the tuned-results store (the user's file unless told
otherwise). With m > 1 it sweeps the m-row kernels of one multirow bucket beside this GPU's m = 1 kernels,
and a candidate must also give every row bitwise what the m = 1 kernel gives that row alone. An m = 1 tile
is stored only if the m-row kernels the decoder derives from it compile without spills (checked for the
fastest candidates, in order: a tile of 4 rows a lane group can run out of registers at m = 4). Progress is
kept per candidate in a side file under the cache root, so an interrupted sweep resumes where it stopped."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from .. import codegen, config
from ..bench import kernels as kbench
from ..bench.gemv_case import GemvCase, bits, rel_err
from ..codegen import nvrtc, tuned
from ..codegen import tuned_store as store
from ..codegen.kernels import gemv
from ..dims import ModelDims
from ..runtime import driver
from . import space


class Progress:
    """uri -> result of every candidate already judged on this GPU (resumability)."""

    def __init__(self, gpu: str):
        directory = config.cache_root() / "tune" / "progress"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / (gpu.replace(" ", "_").replace("/", "_") + ".json")
        try:
            self.done = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            self.done = {}

    def add(self, uri: str, result: dict) -> None:
        self.done[uri] = result
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.done))
        os.replace(tmp, self.path)


def tune(dims: ModelDims, cfg: config.Config, roles, budget_s: float, log=print, out=None, m: int = 1,
         spaces: tuple[str, ...] = space.TILE_SPACES) -> list[dict]:
    """Sweep `roles` (m > 1: their m-row kernels; m = 1: over the search spaces `spaces`); merge the winners
    into the tuned-results file ``out`` (default: the user's)."""
    dev = driver.device()
    gpu = dev.props.name
    stream, rng = driver.Stream(), np.random.default_rng()
    progress = Progress(gpu)
    copy = kbench.copy_bandwidth(stream)["GBps"]
    log(f"{gpu}: copy bandwidth {copy:.0f} GB/s; budget {budget_s:.0f} s of judging, split over the roles")
    blocker = driver.DeviceBuffer(kbench.BLOCKER_BYTES)
    tol = cfg.validation.gemv_rel_tol
    summary, entries = [], {}
    for role in roles:
        one, cands = candidates(role, dims, cfg, gpu, m, spaces, log)
        built = codegen.build_many(cands + [one] * (m > 1), progress=codegen.ProgressLine(), return_exceptions=True)
        # candidates differ only in tile parameters: one set of buffers (and one numpy answer) serves all
        case = GemvCase(cands[0], rng, kbench.rotating_copies(cands[0], cfg.bench.l2_rotate_bytes))
        deadline = time.monotonic() + budget_s / len(roles)   # compiling is not judging: the clock starts now
        best, ok = None, []
        try:
            if m > 1 and isinstance(built[-1], Exception):
                raise built[-1]
            alone = None if m == 1 else bits(case.alone(driver.load(built.pop()), one, stream))
            for i, (spec, b) in enumerate(zip(cands, built)):
                if isinstance(b, Exception):
                    log(f"  {spec.uri}: compile error: {str(b).splitlines()[0]}")
                    continue
                res = progress.done.get(progress_key(b))
                if res is None:
                    if time.monotonic() > deadline:
                        log(f"{role}: budget spent after {i}/{len(cands)} candidates")
                        break
                    res = _judge(spec, b, case, stream, blocker, copy, tol, alone)
                    progress.add(progress_key(b), res)
                if res["status"] == "wrong":
                    log(f"  DISCARDED {spec.uri}: rel err {res['rel_err']:.2e} > {tol} (fast but wrong)")
                elif res["status"] == "rows differ":
                    log(f"  DISCARDED {spec.uri}: rows {res['rows']} differ from the m = 1 kernel's bits")
                elif res["status"] == "ok":
                    ok.append((spec, res))
                    if best is None or res["us"] < best[1]["us"]:
                        best = (spec, res)
                if (i + 1) % 10 == 0 or i + 1 == len(cands):
                    b_us = f"{best[1]['us']:.2f} us, {best[1]['GBps']:.0f} GB/s ({best[1]['pct_copy']:.1f}%)" if best else "-"
                    log(f"  {role}: {i + 1}/{len(cands)} judged, best so far {b_us}")
        finally:
            case.free()
        if m == 1:
            best = fastest_retilable(ok, cfg, log)
        default_res = progress.done.get(progress_key(built[0])) if not isinstance(built[0], Exception) else None
        if best is None or default_res is None or default_res["status"] != "ok":
            log(f"{role}: no valid timing for the config default; nothing stored")
            continue
        spec, res = best
        key = tuned.entry_key(role, dims, cfg, gpu, m)
        entries[key] = {
            "params": space.tile_params(spec), "uri": spec.uri, "us": res["us"], "GBps": res["GBps"],
            "pct_copy": res["pct_copy"], "default_params": space.tile_params(cands[0]),
            "default_us": default_res["us"], "default_pct_copy": default_res["pct_copy"],
            "rel_err": res["rel_err"], "candidates": len(cands),
            "judged": sum(not isinstance(b, Exception) and progress_key(b) in progress.done for b in built),
            "copy_GBps": copy, **({"m": m, "base_uri": one.uri} if m > 1 else {})}
        summary.append({"role": role, **entries[key]})
    blocker.free()
    stream.close()
    if entries:
        store.merge_write(entries, {"written_by": "nanoqwen-tune", "gpu": gpu, "commit": kbench.git_commit()},
                          out)
    return summary


def candidates(role: str, dims: ModelDims, cfg: config.Config, gpu: str, m: int,
               spaces: tuple[str, ...] = space.TILE_SPACES, log=print) -> tuple[gemv.GemvInt4Spec, list]:
    """(the m = 1 kernel `gpu` runs now, the candidates a sweep of `role` compiles and judges): m = 1 over the
    search spaces `spaces`, m > 1 the m-row kernels whose rows keep that m = 1 kernel's order."""
    one = tuned.role_spec(role, dims, cfg, gpu)
    cands, ruled_out = (space.gemv_candidates(role, dims, cfg, spaces, current=one) if m == 1
                        else space.multirow_candidates(one, m, cfg))
    log(f"{role}{f' m={m}' if m > 1 else ''}: {len(cands)} candidates ({ruled_out} ruled out by the spec constraints)")
    return one, cands


def compile_only(dims: ModelDims, cfg: config.Config, roles, gpu: str, m: int = 1,
                 spaces: tuple[str, ...] = space.TILE_SPACES, log=print) -> int:
    """Compile what ``tune`` would compile for `gpu` into the kernel cache, on this machine's CPUs and without
    a device; returns the number that failed to compile. A device whose NVRTC has the same version finds them
    there (the cache key holds it) and spends its time judging. The m = 1 sweep's spill check still compiles
    the re-tilings of the few fastest tiles it looks at."""
    specs = []
    for role in roles:
        one, cands = candidates(role, dims, cfg, gpu, m, spaces, log)
        specs += cands + [one] * (m > 1)
    built = codegen.build_many(specs, progress=codegen.ProgressLine(), return_exceptions=True)
    failed = [(s, b) for s, b in zip(specs, built) if isinstance(b, Exception)]
    for spec, b in failed:
        log(f"  {spec.uri}: compile error: {str(b).splitlines()[0]}")
    log(f"{len(specs) - len(failed)}/{len(specs)} kernels in the cache for {gpu} (NVRTC {nvrtc.version()}, "
        f"{config.cache_root()})")
    return len(failed)


def progress_key(built) -> str:
    """Progress key: the cached cubin's name (URI + source hash), so an edited template is judged anew."""
    return built.path.name


def retiling_spills(one: gemv.GemvInt4Spec, cfg: config.Config) -> int | None:
    """The first multirow bucket whose kernel derived from the m = 1 tile `one` (space.retilings) spills
    registers or uses local memory; None if none does."""
    specs = space.retilings(one, cfg)
    return next((s.m for s, b in zip(specs, codegen.build_many(specs)) if b.resources.spills), None)


def fastest_retilable(judged: list[tuple], cfg: config.Config, log=print) -> tuple | None:
    """The fastest (spec, result) of the m = 1 candidates `judged` whose m-row kernels do not spill."""
    for spec, res in sorted(judged, key=lambda sr: sr[1]["us"]):
        m = retiling_spills(spec, cfg)
        if m is None:
            return spec, res
        log(f"  ruled out {spec.uri} ({res['us']:.2f} us): its m = {m} kernel spills")
    return None


def _judge(spec, built, case, stream, blocker, copy_GBps: float, tol: float, alone=None) -> dict:
    """`alone`: the m = 1 kernel's bits row by row (m > 1), which every row must equal."""
    if built.resources.spills:
        return {"status": "spills"}
    fn = driver.load(built)
    out = case.run(fn, spec, stream)
    if alone is not None and not np.array_equal(bits(out), alone):
        rows = np.flatnonzero((bits(out) != alone).reshape(spec.m, -1).any(axis=1))
        return {"status": "rows differ", "rows": rows.tolist()}
    err = rel_err(out, case.expected)
    if not err <= tol:
        return {"status": "wrong", "rel_err": err}
    r = kbench.row("", spec, kbench.time_spec(case, fn, spec, stream, blocker), copy_GBps, case.copies)
    return {"status": "ok", "rel_err": err, "us": r["graph"]["us"], "GBps": r["graph"]["GBps"],
            "pct_copy": r["graph"]["pct_copy"], "alone_us": r["alone"]["us"]}


def table(summary: list[dict]) -> str:
    """The sweeps' summary rows (GEMV roles, and the attention's, which has no %copy: its us are the geometric
    mean over the contexts)."""
    head = f"{'role':<9} {'m':>2} {'default us':>10} {'%copy':>6} | {'tuned us':>8} {'%copy':>6} | {'gain':>6}  params"
    lines = [head, "-" * len(head)]

    def pct(r, k):
        return f"{r[k]:>5.1f}%" if k in r else f"{'-':>6}"
    for r in summary:
        gain = r["default_us"] / r["us"] - 1
        lines.append(f"{r['role']:<9} {r.get('m', 1):>2} {r['default_us']:>10.2f} {pct(r, 'default_pct_copy')} | "
                     f"{r['us']:>8.2f} {pct(r, 'pct_copy')} | {100 * gain:>5.1f}%  {r['params']}")
    return "\n".join(lines)
