"""Timeline of one decode step measured INSIDE the replayed graph: every kernel of the step in its timed
variant (codegen/probe.py) stamps %globaltimer at its start (first CTA in), after its PDL wait (first CTA
past griddepcontrol.wait) and at its end (last warp out) into a probe table; the timed step is captured
as one graph of the same kernels and replayed ``reps`` times at a fixed decode state, the table zeroed
(a memset on the stream, just before each replay: the graph itself holds only kernels, so the first
kernel's PDL launch follows nothing but the previous work, as untimed) and read back after each replay.

Per replay, offsets are relative to the step's first start; per launch: ``busy`` = end - start (its whole
residency, including the PDL prologue it overlaps with its predecessor), ``own`` = the part of [start, end]
no earlier kernel covers, ``gap_before`` = idle time between everything before it and its start. Then
``span`` = last end - first start = sum(own) + kernel_gap exactly, where ``kernel_gap`` = the time no
kernel was resident: the real idle time between kernels that graphs and PDL exist to remove (bench/itl.py's
graph-minus-eager-regions figure is not that: eager regions are timed one by one). ``overlap`` =
sum(busy) - sum(own), the PDL overlap. Every figure is the median over replays (of per-replay values:
the totals are not sums of per-kernel medians).

Beside it, the event-timed graph step of the timed graph and of the untimed one in the same run: their
difference is the probe's own cost (a red.max per CTA at entry and wait, one per warp at exit), and the
timed step minus ``span`` is what the stamps cannot see (graph launch, the first CTA's ramp before its
entry stamp, the last warp's retirement). ``timer_quantum_ns`` is the gcd of all stamp differences: the
globaltimer's update period as this GPU and driver run it (a single stamp is good to that, medians over
replays to better)."""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

from .. import config
from ..codegen import probe
from .charts import pyplot
from .itl import StepTimer, launch_layers, replay_seconds
from .mbu import REGIONS, ROLE_REGION

# the step's kernels in launch order within a layer (the chart's rows)
ROLE_ORDER = ("embed", "qkv_norm", "qkv", "rope_append", "attention_decode", "attention_combine", "o_proj",
              "gate_up_norm", "gate_up", "down", "lm_head")
REPS = 50


def replay_times(stamps: np.ndarray) -> dict:
    """One replay's arithmetic. ``stamps`` int64 [launches, 3] of (start, wait, end) in ns (probe.decode).
    Offsets in ns from the first start; per launch busy, own and gap_before; totals span, union (sum of
    own), kernel_gap (span - union) and overlap (sum of busy - union)."""
    t = np.asarray(stamps, dtype=np.int64)
    if (t < 0).any():
        raise ValueError(f"probe slots never written: launches {sorted(set(np.nonzero(t < 0)[0].tolist()))}")
    rel = t - t[:, 0].min()
    start, wait, end = rel[:, 0], rel[:, 1], rel[:, 2]
    own, gap = np.zeros(len(t), np.int64), np.zeros(len(t), np.int64)
    covered = 0   # the latest end of the kernels that started before this one (intervals by start)
    for i in np.argsort(start, kind="stable"):
        gap[i] = max(0, start[i] - covered)
        own[i] = max(0, end[i] - max(start[i], covered))
        covered = max(covered, end[i])
    busy = end - start
    span = int(end.max())
    return {"start": start, "wait": wait, "end": end, "busy": busy, "own": own, "gap_before": gap,
            "span": span, "union": int(own.sum()), "kernel_gap": span - int(own.sum()),
            "overlap": int(busy.sum() - own.sum()), "busy_sum": int(busy.sum())}


def timer_quantum_ns(stamps: np.ndarray) -> int:
    """gcd of every stamp's distance from the earliest: the timer's update period as observed (0: one value)."""
    t = np.asarray(stamps, dtype=np.int64).ravel()
    return int(np.gcd.reduce(t - t.min())) if t.size else 0


def summarize(roles: list[str], stamps: np.ndarray) -> dict:
    """Medians over replays. ``roles`` per launch; ``stamps`` int64 [reps, launches, 3] (probe.decode)."""
    stamps = np.asarray(stamps, dtype=np.int64)
    if stamps.ndim != 3 or stamps.shape[1:] != (len(roles), 3) or not len(stamps):
        raise ValueError(f"stamps must be [reps >= 1, {len(roles)} launches, 3], got {stamps.shape}")
    runs = [replay_times(s) for s in stamps]

    def med_us(values) -> float:
        return 1e-3 * statistics.median(values)

    kernels = []
    for i, (role, layer) in enumerate(zip(roles, launch_layers(roles))):
        kernels.append({"index": i, "role": role, "region": ROLE_REGION[role], "layer": layer,
                        **{f"{k}_us": med_us([int(r[k][i]) for r in runs])
                           for k in ("start", "wait", "end", "busy", "own", "gap_before")}})
    regions = {reg: med_us([sum(int(r["own"][i]) for i, role in enumerate(roles) if ROLE_REGION[role] == reg)
                            for r in runs]) for reg in REGIONS}
    totals = {f"{k}_us": med_us([r[k] for r in runs]) for k in ("span", "union", "kernel_gap", "overlap", "busy_sum")}
    return {"reps": len(runs), "launches": len(roles), "kernels": kernels, "regions_own_us": regions, **totals,
            "span_us_min": 1e-3 * min(r["span"] for r in runs), "span_us_max": 1e-3 * max(r["span"] for r in runs),
            "timer_quantum_ns": timer_quantum_ns(stamps)}


# ---- on the GPU ------------------------------------------------------------------------------------

def timed_decoder(dec, cfg: config.Config | None = None):
    """A Decoder of the timed variants of ``dec``'s kernels (built, or fetched from the kernel cache) over
    ``dec``'s own buffers and state."""
    from .. import codegen
    from ..runtime import driver
    from ..runtime.decoder import Decoder
    cfg = cfg or config.default()
    used = {role for role, *_ in dec.sequence}   # a session's decoder holds the prefill's kernels too
    specs = {role: dataclasses.replace(spec, timed=True) for role, (spec, _fn) in dec.kernels.items() if role in used}
    built = codegen.build_many(specs.values(), progress=codegen.ProgressLine(), cfg=cfg.codegen)
    kernels = {role: (spec, driver.load(b, carveout=dec.kernels[role][1].carveout))   # the untimed kernel's split
               for (role, spec), b in zip(specs.items(), built)}
    return Decoder(dec.shared, kernels, pdl=dec.pdl, bufs=dec.bufs)


def probe_stamps(timed, token: int, pos: int, reps: int) -> np.ndarray:
    """int64 [reps, launches, 3]: the timed graph replayed ``reps`` times from state (token, pos)."""
    n = len(timed.sequence)
    out = np.empty((reps, n * probe.SLOTS), np.uint64)
    for r in range(reps):
        timed.reset(token, pos=pos, step=pos)
        timed.probe.memset_u32(0, timed.stream)   # arms every slot (probe.py), in stream order before the replay
        timed.graph.launch(timed.stream)
        timed.drain()   # the table is read after the replay finished (with a timeout: a hang is an error)
        timed.probe.download(out[r])
    timed.check_errors()
    return probe.decode(out)


def measure(dec, context: int, reps: int = REPS, token: int = 0, cfg: config.Config | None = None) -> dict:
    """The timeline of ``dec``'s step (a captured Decoder) at ``context`` (pages for it reserved and
    written, as for bench/itl.py), with the untimed and timed graph steps event-timed in the same run."""
    pos = context - 1
    timed = timed_decoder(dec, cfg)
    try:
        timed.reset(token, pos=pos, step=pos)
        timed.launch_kernels()
        timed.drain()
        timed.check_errors()
        timed.capture()   # after an eager step: every module loaded outside the capture
        res = summarize([role for role, *_rest in timed.sequence], probe_stamps(timed, token, pos, reps))
        steps = {}
        for name, d in (("graph_step_us", dec), ("timed_graph_step_us", timed)):
            timer = StepTimer(d)
            try:
                steps[name] = 1e6 * statistics.median(timer.whole(token, pos, reps, graph=True))
            finally:
                timer.close()
    finally:
        timed.close()
    return _finished(res, steps, dec.sequence, context=context)


def _finished(res: dict, steps: dict, launches: list, **extra) -> dict:
    """``summarize``'s result with the event-timed graph steps and what follows from them (the probe's cost,
    what the stamps cannot see), and each kernel's URI and grid from its untimed ``launches``."""
    res.update(**extra, **steps, probe_overhead_us=steps["timed_graph_step_us"] - steps["graph_step_us"],
               unseen_us=steps["timed_graph_step_us"] - res["span_us"])
    for k, (_role, fn, launch, _args) in zip(res["kernels"], launches):
        k.update(uri=fn.uri, grid=list(launch.grid), block=list(launch.block))
    return res


def timed_launches(kernels: dict, launches: list, cfg: config.Config | None = None) -> tuple[list, object]:
    """``launches`` [(role, fn, launch, args)] over the kernels ``kernels`` {role: (spec, fn)} with each timeable
    kernel in its timed variant (the untimed kernel's shared-memory split), each of those launches with its own
    slots of a new probe table: (sequence, table). A kernel without probe hooks stays untimed and slotless (its
    time falls in ``unseen_us``). ``launches`` and their args are not touched."""
    from .. import codegen
    from ..runtime import driver
    cfg = cfg or config.default()
    specs = {role: dataclasses.replace(spec, timed=True) for role, (spec, _fn) in kernels.items() if spec.timeable}
    built = codegen.build_many(specs.values(), progress=codegen.ProgressLine(), cfg=cfg.codegen)
    fns = {role: driver.load(b, carveout=kernels[role][1].carveout) for role, b in zip(specs, built)}
    seq = [(role, fns.get(role, fn), launch, dict(args)) for role, fn, launch, args in launches]
    timed = [args for role, _fn, _launch, args in seq if role in fns]
    table = driver.DeviceBuffer(probe.table_bytes(len(timed)))
    for i, args in enumerate(timed):
        args[probe.PARAM_NAME] = table.ptr + probe.table_bytes(i)
    return seq, table


def timed_rows(rows, m: int, cfg: config.Config | None = None) -> tuple[list, object]:
    """``timed_launches`` of bucket m of ``rows`` (a RowStep), over the step's own buffers and inputs."""
    return timed_launches(rows.kernels[m], rows.sequences[m], cfg)


def _stamped_replays(seq: list, table, shared, pdl, reps: int, reload=lambda: None) -> tuple:
    """Launch ``seq`` (``timed_launches``; ``pdl(role)``: whether a launch takes PDL) once eagerly (every module
    loaded outside the capture), capture it as one graph and replay that ``reps`` times, ``reload()`` before each,
    arming the probe table before and reading it after each: (graph, indices of the stamped launches, int64 stamps
    [reps, stamped, 3]). The caller closes the graph."""
    from ..runtime import driver
    stream = shared.stream

    def launch_all() -> None:
        for role, fn, launch, args in seq:
            fn.launch(launch, stream, pdl(role), **args)
    reload()
    launch_all()
    shared.check_errors()
    with driver.capture(stream) as graph:
        launch_all()
    try:
        stamped = [i for i, (*_rest, args) in enumerate(seq) if probe.PARAM_NAME in args]
        out = np.empty((reps, len(stamped) * probe.SLOTS), np.uint64)
        for r in range(reps):
            reload()
            table.memset_u32(0, stream)   # arms every slot, in stream order before the replay
            graph.launch(stream)
            shared.drain()
            table.download(out[r])
        shared.check_errors()
    except BaseException:
        graph.close()
        raise
    return graph, stamped, probe.decode(out)


def measure_rows(rows, m: int, context: int, reps: int = REPS, cfg: config.Config | None = None) -> dict:
    """The timeline of bucket m of the multi-row step (``rows``, a captured RowStep): m rows of the loaded
    sequence at positions context - m .. context - 1 (a verify's rows; pages for them reserved), its timed
    kernels captured as one graph, replayed ``reps`` times over the same inputs (each rewrites the same
    K/V bits); the untimed bucket graph and the timed one event-timed in the same run."""
    tokens, positions = [0] * m, list(range(context - m, context))
    seq, table = timed_rows(rows, m, cfg)
    graph = None
    try:
        graph, stamped, stamps = _stamped_replays(seq, table, rows.shared, lambda _role: rows.pdl, reps,
                                                  lambda: rows.load(tokens, positions))
        res = summarize([seq[i][0] for i in stamped], stamps)
        steps = {name: 1e6 * statistics.median(_replay_s(rows, launch, tokens, positions, reps))
                 for name, launch in (("graph_step_us", rows.graphs[m].launch), ("timed_graph_step_us", graph.launch))}
    finally:
        if graph is not None:
            graph.close()
        table.free()
    return _finished(res, steps, [rows.sequences[m][i] for i in stamped], m=m, context=context)


def chunk_roles(roles) -> list[str]:
    """The decode step's role (ROLE_REGION's names) of each kernel of a prefill chunk (runtime/prefill.py's roles:
    the small-M, graph and row-GEMV prefixes dropped; the attention as the decode attention's region; an RMSNorm
    named for the GEMM it feeds, as the multi-row step's norms run apart)."""
    base = [role.rsplit(".", 1)[-1] for role in roles]
    out = []
    for i, role in enumerate(base):
        if role == "rmsnorm":
            role = next(r for r in base[i + 1:] if r in ("qkv", "gate_up")) + "_norm"
        out.append("attention_decode" if role == "attention" else role)
    return out


def measure_chunk(pre, b: int, p0: int, ids: list[int], reps: int = REPS, cfg: config.Config | None = None) -> dict:
    """The timeline of graph bucket b of the Prefiller ``pre`` (its chunk graphs captured): a chunk of b rows
    ``ids`` at positions p0.. of the loaded sequence (a re-request's tail; K/V rewritten with the same bits a
    replay), its timeable kernels in their timed variants captured as one graph with the untimed rest, replayed
    ``reps`` times over the same graph input; the untimed bucket graph and the timed one event-timed beside it."""
    graphs, stream = pre.graphs, pre.shared.stream
    kernels = {role: pre.kernels["prefill." + role] for role, _shape, _args in graphs.sequences[b]}
    launches = [(role, kernels[role][1], kernels[role][0].launch(*shape), args)   # as Prefiller._launch makes them
                for role, shape, args in graphs.sequences[b]]
    seq, table = timed_launches(kernels, launches, cfg)
    graph = None
    try:
        graphs.stage([(p0, ids)])
        graphs.run(p0, b)   # the untimed graph: graph_in now holds p0, n and the ids for every replay below
        graph, stamped, stamps = _stamped_replays(seq, table, pre.shared, pre.pdl, reps)
        res = summarize(chunk_roles([seq[i][0] for i in stamped]), stamps)
        steps = {name: 1e6 * replay_seconds(lambda g=g: g.launch(stream), stream, reps)
                 for name, g in (("graph_step_us", graphs.graphs[b]), ("timed_graph_step_us", graph))}
    finally:
        if graph is not None:
            graph.close()
        table.free()
    return _finished(res, steps, [launches[i] for i in stamped], m=b, context=p0 + b, chunk=True)


def _replay_s(rows, launch, tokens: list[int], positions: list[int], reps: int) -> list[float]:
    """Seconds per replay of ``launch(stream)`` over the step's inputs, between events around it."""
    from ..runtime import driver
    stream, start, end, out = rows.shared.stream, driver.Event(), driver.Event(), []
    try:
        for _ in range(reps):
            rows.load(tokens, positions)
            start.record(stream)
            launch(stream)
            end.record(stream)
            out.append(1e-3 * driver.Event.elapsed_ms(start, end))
    finally:
        start.close()
        end.close()
    return out


# ---- output -------------------------------------------------------------------------------------------

def summary(tl: dict) -> str:
    """A few lines for the bench table."""
    step = (f"the {tl['m']}-row prefill chunk" if tl.get("chunk") else f"the {tl['m']}-row step" if "m" in tl
            else "timeline")
    return (f"{step}, in-graph %globaltimer stamps, median of {tl['reps']} replays at context {tl['context']}: "
            f"span {tl['span_us']:.1f} us = kernels {tl['union_us']:.1f} + idle (kernel_gap) "
            f"{tl['kernel_gap_us']:.1f} us; PDL overlap {tl['overlap_us']:.1f} us; graph step "
            f"{tl['graph_step_us']:.1f} us untimed, {tl['timed_graph_step_us']:.1f} us timed (probe cost "
            f"{tl['probe_overhead_us']:+.1f} us, outside the stamps {tl['unseen_us']:.1f} us); timer quantum "
            f"{tl['timer_quantum_ns']} ns")


def plot(tl: dict, path, title: str = "") -> str:
    """One step as bars along time, one row per kernel role: the pre-wait part of each launch (weights
    streaming while the predecessor drains) light, the rest solid, colour by region."""
    plt = pyplot()
    if plt is None:
        return f"--timeline {path}: matplotlib is not installed, no chart written (the JSON has the numbers)"
    rows = [r for r in ROLE_ORDER if any(k["role"] == r for k in tl["kernels"])]
    colour = {reg: f"C{i}" for i, reg in enumerate(REGIONS)}
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.6))
    for k in tl["kernels"]:
        y, c = rows.index(k["role"]), colour[k["region"]]
        pre = max(0.0, min(k["wait_us"], k["end_us"]) - k["start_us"])
        ax.barh(y, pre, left=k["start_us"], height=0.7, color=c, alpha=0.3, linewidth=0)
        ax.barh(y, k["end_us"] - k["start_us"] - pre, left=k["start_us"] + pre, height=0.7, color=c, linewidth=0)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tl["span_us"], max(k["end_us"] for k in tl["kernels"])) * 1.01)
    ax.set_xlabel("us from the step's first kernel start (light: before griddepcontrol.wait returned)")
    ax.set_title((title + "\n" if title else "") + f"span {tl['span_us']:.1f} us, idle between kernels "
                 f"{tl['kernel_gap_us']:.1f} us, graph step {tl.get('graph_step_us', math.nan):.1f} us "
                 f"(median of {tl['reps']} replays)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
