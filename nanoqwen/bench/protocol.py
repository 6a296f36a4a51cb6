"""`nanoqwen bench MODEL`: the benchmark protocol of config ``bench`` (batch 1, ``warmup`` untimed requests,
then ``repetitions`` timed ones of ``prompt_tokens`` random prompt tokens and ``gen_tokens`` decode steps),
then the ITL breakdown, MBU against the copy bandwidth of the same run, and the optional PyTorch
baselines on the same weights. Clocks are reported as found, never locked (config bench.lock_clocks).

One request = ``session.generate(prompt, gen_tokens + 1)``, the product path, timed on the host as
tokens arrive (gpt-fast's way): TTFT is prompt in -> first token out, so pp t/s = prompt_tokens / TTFT;
the ``gen_tokens`` decode steps after the first token give tg t/s and the per-token latencies
(p50/p90 over every timed step). The decode steps follow the prompt, so they run at context
prompt_tokens .. prompt_tokens + gen_tokens (llama-bench would call this ``tg128 @ d512``; ``n_depth``).
Records use llama-bench's JSON field names (avg_ts, stddev_ts, samples_ns, n_prompt, n_gen, ...)."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .. import NanoqwenError, config
from ..dims import QWEN25_7B
from ..modelcache import new_entry, resolve
from ..nqfile import VERSION, NanoqwenFile, weight_tensors
from ..safefile import check_replaceable
from . import mbu
from .charts import pyplot

SCHEMA = 1
SYNTHETIC_SEED = 0


class BenchError(NanoqwenError):
    pass


# ---- the model --------------------------------------------------------------------------------------

def config_hash(cfg: config.Config) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def synthetic_7b(cfg: config.Config, log=print) -> Path:
    """The random-weight Qwen2.5-7B (exact shapes), packed once into the cache; the name hashes the seed,
    the dims, the quant settings and the format version, so a format change repacks."""
    from ..pack import pack_random, total_random_bytes
    from ..progress import Progress
    key = hashlib.sha256(json.dumps([SYNTHETIC_SEED, QWEN25_7B.to_dict(), dataclasses.asdict(cfg.quant), VERSION],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = config.cache_root(cfg.codegen) / "models" / f"random-7b-seed{SYNTHETIC_SEED}-{key}" / "model.nanoqwen"
    if not path.exists():
        with new_entry(path.parent):
            log(f"packing the synthetic 7B (random weights, seed {SYNTHETIC_SEED}) -> {path}")
            bar = Progress(total_random_bytes(QWEN25_7B, cfg), "random 7b")
            pack_random(QWEN25_7B, path, seed=SYNTHETIC_SEED, progress=bar, cfg=cfg)
            bar.close()
    return path


def resolve_model(model: str, cfg: config.Config, log=print) -> Path:
    """MODEL argument -> .nanoqwen path: ``7b`` (synthetic), a .nanoqwen file or a HF directory."""
    if model == "7b":
        return synthetic_7b(cfg, log)
    return resolve(model, cfg=cfg, log=log)


def model_info(f: NanoqwenFile) -> dict:
    d = f.dims
    params = sum(int(np.prod(s)) for _t, s in weight_tensors(d, f.cfg).values())
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    label = f"qwen2 {size} INT4-g{f.cfg.quant.group_size}" + (" (synthetic: random weights)" if f.synthetic else "")
    return {"path": str(f.path), "synthetic": f.synthetic, "label": label, "n_params": params,
            "size_bytes": f.size, "dims": d.to_dict()}


# ---- statistics -------------------------------------------------------------------------------------

def percentile(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q))


def _stdev(xs) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def bench_record(name: str, n_prompt: int, n_gen: int, n_depth: int, samples_s: list[float], tokens: int,
                 common: dict) -> dict:
    """One llama-bench-style test record from the per-repetition seconds of ``tokens`` tokens."""
    ts = [tokens / s for s in samples_s]
    ns = [s * 1e9 for s in samples_s]
    return {**common, "test": name, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
            "avg_ns": statistics.mean(ns), "stddev_ns": _stdev(ns), "avg_ts": statistics.mean(ts),
            "stddev_ts": _stdev(ts), "samples_ns": ns, "samples_ts": ts}


# ---- the run ----------------------------------------------------------------------------------------

def _request(session, prompt: list[int], gen: int) -> tuple[float, list[float]]:
    """(TTFT s, gen inter-token gaps s) of one request of gen decode steps after the first token."""
    t0 = time.perf_counter()
    stamps = []
    for _tok in session.generate(prompt, gen + 1):
        stamps.append(time.perf_counter())
    return stamps[0] - t0, list(np.diff(stamps))


def check_protocol(warmup: int, prompt_tokens: int, gen_tokens: int, repetitions: int, batch: int) -> None:
    if batch != 1:
        raise BenchError(f"config bench.batch: only batch 1 is implemented, got {batch}")
    for name, v, lo in (("--warmup", warmup, 0), ("--prompt-tokens", prompt_tokens, 1),
                        ("--gen-tokens", gen_tokens, 2), ("--repetitions", repetitions, 1)):
        if v < lo:
            raise BenchError(f"{name} must be at least {lo}, got {v}")


def run(model: str, warmup: int | None = None, prompt_tokens: int | None = None, gen_tokens: int | None = None,
        repetitions: int | None = None, baseline: bool = True, profile_path: Path | None = None,
        timeline: bool = False, timeline_rows: int | None = None, cfg: config.Config | None = None,
        log=None) -> dict:
    cfg = cfg or config.default()
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    b = cfg.bench
    W = b.warmup if warmup is None else warmup
    P = b.prompt_tokens if prompt_tokens is None else prompt_tokens
    G = b.gen_tokens if gen_tokens is None else gen_tokens
    R = b.repetitions if repetitions is None else repetitions
    check_protocol(W, P, G, R, b.batch)
    if b.lock_clocks:
        raise BenchError("config bench.lock_clocks is true: nanoqwen never changes GPU clocks; set it to false")
    from ..runtime import driver
    from ..runtime.session import CudaSession
    from . import itl, kernels

    props = driver.device().props   # no device: one clear error before packing gigabytes
    path = resolve_model(model, cfg, log)
    f = NanoqwenFile(path, cfg)
    info = model_info(f)
    if P + G + 1 > f.dims.max_positions:
        raise BenchError(f"--prompt-tokens {P} + --gen-tokens {G} exceed the model's {f.dims.max_positions} positions")
    result = {"kind": "nanoqwen-bench", "schema": SCHEMA,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": kernels.git_commit(), "config_hash": config_hash(cfg),
              "gpu": {"name": props.name, "sm_count": props.sm_count, "l2_bytes": props.l2_bytes,
                      "total_mem": props.total_mem, "driver_version": props.driver_version,
                      "compute_capability": list(props.compute_capability),
                      "lock_clocks": False, "clocks_before": kernels.clocks()},
              "protocol": {"batch": b.batch, "warmup": W, "prompt_tokens": P, "gen_tokens": G, "repetitions": R,
                           "prompt": f"uniform random token ids, seed {SYNTHETIC_SEED}"},
              "model": info}
    t0 = time.perf_counter()
    loaded = []
    session = CudaSession(path, P + G + 1, eager=False, log=lambda m: (loaded.append(m), log(m)), cfg=cfg)
    result["load"] = {"seconds": time.perf_counter() - t0, "log": loaded}
    # chunked tensor-core prefill, or the prompt fed through the decode step token by token
    result["protocol"]["prefill"] = "chunked" if getattr(session, "prefiller", None) else "decode steps"
    try:
        rng = np.random.default_rng(SYNTHETIC_SEED)
        ttft, tg_s, gaps = [], [], []
        for rep in range(W + R):
            prompt = rng.integers(0, f.dims.vocab, size=P).tolist()
            first, itls = _request(session, prompt, G)
            if rep >= W:
                ttft.append(first)
                tg_s.append(sum(itls))
                gaps += itls
            log(f"{'warmup' if rep < W else 'rep'} {rep - W if rep >= W else rep}: TTFT {1e3 * first:.1f} ms, "
                f"{1e3 * sum(itls) / G:.3f} ms/token")
        backend = "CUDA (nanoqwen, graph)"
        common = {"model_filename": info["path"], "model_type": info["label"], "model_size": info["size_bytes"],
                  "model_n_params": info["n_params"], "backends": backend, "gpu_info": props.name,
                  "build_commit": result["commit"], "n_batch": b.batch, "test_time": result["date"]}
        result["tests"] = [bench_record(f"pp{P}", P, 0, 0, ttft, P, common),
                           bench_record(f"tg{G}", 0, G, P, tg_s, G, common)]
        result["latency"] = {"ttft_ms": {"median": 1e3 * statistics.median(ttft), "min": 1e3 * min(ttft),
                                         "max": 1e3 * max(ttft)},
                             "ms_per_token": {"p50": 1e3 * percentile(gaps, 50), "p90": 1e3 * percentile(gaps, 90),
                                              "mean": 1e3 * statistics.mean(gaps), "min": 1e3 * min(gaps),
                                              "max": 1e3 * max(gaps), "n": len(gaps)}}
        ctx = P + G // 2   # the mean context of the timed decode steps; those positions hold real K/V now
        log(f"ITL breakdown at context {ctx} ...")
        result["itl"] = itl.breakdown(session.decoder, ctx)
        if profile_path is not None:
            prof = itl.profile(session.decoder, ctx)
            prof.update(model=info["label"], gpu=props.name, commit=result["commit"])
            write_json(prof, profile_path)
            result["profile"] = {"path": str(profile_path), "total_us": prof["total_us"]}
            log(itl.slowest(prof))
        if timeline:
            from . import timeline as tl
            log(f"timeline at context {ctx} (timed kernels, stamps inside the replayed graph) ...")
            result["timeline"] = tl.measure(session.decoder, ctx, cfg=cfg)
            if timeline_rows:
                log(f"timeline of the {timeline_rows}-row step at context {ctx} ...")
                result["timeline_rows"] = tl.measure_rows(session.rows, timeline_rows, ctx, cfg=cfg)
        stream = driver.Stream()
        try:
            result["copy"] = kernels.copy_bandwidth(stream)
        finally:
            stream.close()
        result["mbu"] = mbu_report(f.dims, cfg, result)
    finally:
        session.close()
    if baseline:
        from . import baseline as bl
        log("PyTorch baselines on the same weights ...")
        result["baseline"] = bl.run(path, P, G, result, cfg=cfg, log=log)
    result["gpu"]["clocks_after"] = kernels.clocks()
    return result


def mbu_report(dims, cfg, result: dict) -> dict:
    """Bytes and MBU per region of the breakdown, of the graph step, and of the measured decode rate."""
    bw = result["copy"]["GBps"]
    it = result["itl"]
    rb = mbu.region_bytes(dims, it["context"], cfg)
    regions = {}
    for r in mbu.REGIONS:
        ms = it["regions_ms"][r]
        regions[r] = {**rb[r], "ms": ms, "GBps": rb[r]["total"] / (ms * 1e-3) / 1e9 if ms > 0 else 0.0,
                      "mbu": mbu.mbu(rb[r]["total"], ms * 1e-3, bw), "floor_ms": mbu.floor_ms(rb[r]["total"], bw)}
    step = mbu.step_bytes(dims, it["context"], cfg)
    tok_ms = result["latency"]["ms_per_token"]["mean"]
    out = {"copy_GBps": bw, "context": it["context"], "bytes_per_token": step, "regions": regions,
           "floor_ms_per_token": mbu.floor_ms(step, bw),
           "decode_mbu": mbu.mbu(step, tok_ms * 1e-3, bw),      # the measured tg rate (mean ms/token)
           "decode_GBps": step / (tok_ms * 1e-3) / 1e9,
           "eager_sum_mbu": mbu.mbu(step, it["regions_sum_ms"] * 1e-3, bw)}
    if it.get("graph_step_ms"):
        out["graph_step_mbu"] = mbu.mbu(step, it["graph_step_ms"] * 1e-3, bw)
    return out


# ---- output -----------------------------------------------------------------------------------------

def write_json(obj: dict, path: Path) -> None:
    """`path` written whole (a temporary renamed over it); a FIFO, device node or directory there is refused
    (one line), never replaced."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def save(obj: dict, path: Path | None) -> None:
    """A benchmark's ``--json`` output: written when a path is given, and said."""
    if path is not None:
        write_json(obj, path)
        print(f"wrote {path}")


def gpu_info(backend: str) -> dict | None:
    """The device a ``backend`` benchmark runs on (None off CUDA); no device is one clear error, raised before
    a model of gigabytes is packed."""
    if backend != "cuda":
        return None
    from ..runtime import driver
    props = driver.device().props
    return {"name": props.name, "driver_version": props.driver_version}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def table(result: dict) -> str:
    """llama-bench's table, then latency, ITL breakdown, MBU and baseline lines."""
    m = result["model"]
    cols = ("model", "size", "params", "backend", "test", "t/s")
    rows = [(t["model_type"], _gib(t["model_size"]), f"{t['model_n_params'] / 1e9:.2f} B", t["backends"],
             t["test"] + (f" @ d{t['n_depth']}" if t["n_depth"] else ""),
             f"{t['avg_ts']:.2f} ± {t['stddev_ts']:.2f}") for t in result["tests"]]
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    def fmt(cells):   # llama-bench right-aligns test and t/s
        return "| " + " | ".join(c.rjust(w[i]) if i >= 4 else c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
    lines = [fmt(cols), "| " + " | ".join("-" * (x - 1) + (":" if i >= 4 else "-") for i, x in enumerate(w)) + " |"]
    lines += [fmt(r) for r in rows]
    lat = result["latency"]
    lines.append(f"TTFT {lat['ttft_ms']['median']:.1f} ms (median), ms/token p50 {lat['ms_per_token']['p50']:.3f} "
                 f"p90 {lat['ms_per_token']['p90']:.3f} ({lat['ms_per_token']['n']} steps), prefill "
                 f"{result.get('protocol', {}).get('prefill', '?')}; "
                 f"{result['gpu']['name']}, clocks as found, commit {result['commit']}")
    if m["synthetic"]:
        lines.append("model: synthetic (random weights at the real shapes): speed only, the text is meaningless")
    if "itl" in result:
        lines.append("")
        lines.append(itl_table(result))
    if "baseline" in result:
        from .baseline import summary
        lines.append("")
        lines.append(summary(result))
    return "\n".join(lines)


def itl_table(result: dict) -> str:
    it, mb = result["itl"], result.get("mbu")
    head = f"{'region':<16} {'ms':>8} {'%step':>6} {'MB':>9} {'GB/s':>7} {'MBU':>6} {'floor ms':>8}"
    step = it["graph_step_ms"] or it["eager_step_ms"]
    lines = [f"ITL breakdown, one decode step at context {it['context']} (eager replay, events per region"
             f"{'' if it['gated'] else ', UNGATED: host launch time included'}"
             f"{', gate timed out' if it['gate_timed_out'] else ''}):", head, "-" * len(head)]
    for r in mbu.REGIONS:
        ms = it["regions_ms"][r]
        x = mb["regions"][r] if mb else None
        lines.append(f"{r:<16} {ms:>8.4f} {100 * ms / step:>5.1f}% " + (
            f"{x['total'] / 1e6:>9.2f} {x['GBps']:>7.0f} {100 * x['mbu']:>5.1f}% {x['floor_ms']:>8.4f}" if x else ""))
    lines.append(f"{'sum of regions':<16} {it['regions_sum_ms']:>8.4f}")
    if it["graph_step_ms"] is not None:
        lines.append(f"{'graph step':<16} {it['graph_step_ms']:>8.4f}   graph - sum of eager regions = "
                     f"{it['graph_minus_regions_ms']:+.4f} ms (not idle time: see the timeline)")
    lines.append(f"{'eager step':<16} {it['eager_step_ms']:>8.4f}   ({it['launches']} launches)")
    if "timeline" in result:
        from .timeline import summary
        lines += [summary(result[k]) for k in ("timeline", "timeline_rows") if k in result]
    if mb:
        lines.append(f"MBU: {mb['bytes_per_token'] / 1e9:.3f} GB/token at context {mb['context']}, copy bandwidth "
                     f"{mb['copy_GBps']:.0f} GB/s -> floor {mb['floor_ms_per_token']:.3f} ms/token; decode "
                     f"{mb['decode_GBps']:.0f} GB/s = {100 * mb['decode_mbu']:.1f}% (mean ms/token)"
                     + (f", graph step {100 * mb['graph_step_mbu']:.1f}%" if "graph_step_mbu" in mb else ""))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> str:
    """A bar chart of the region times as a PNG, with the real idle time between kernels when the run has
    a timeline (else none: graph - sum of eager regions is not one); returns a line saying what happened."""
    plt = pyplot()
    if plt is None:
        return f"--plot {path}: matplotlib is not installed, no chart written (the table above has the numbers)"
    it = result["itl"]
    gap = [1e-3 * result["timeline"]["kernel_gap_us"]] if "timeline" in result else []
    names = list(mbu.REGIONS) + ["kernel_gap (in-graph)"] * len(gap)
    vals = [it["regions_ms"][r] for r in mbu.REGIONS] + gap
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.bar(names, vals, color=["C0"] * len(mbu.REGIONS) + ["C3"] * (len(names) - len(mbu.REGIONS)))
    if result.get("mbu"):
        for bar, r in zip(bars, mbu.REGIONS):
            ax.annotate(f"{100 * result['mbu']['regions'][r]['mbu']:.0f}%", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{result['model']['label']} on {result['gpu']['name']}: step at context {it['context']} "
                 f"(labels: MBU)", fontsize=9)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
