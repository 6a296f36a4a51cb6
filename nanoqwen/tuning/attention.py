"""The decode attention's sweep behind `nanoqwen-tune --kernels attention`: every candidate of
tune/spaces.yaml's attention_decode space (m = 1) or attention_decode_rows space (m > 1, beside the m = 1
fields this GPU runs) is compiled, checked against the numpy attention at each context of
bench.attention (and, m > 1, each row bitwise the m = 1 kernels' on that row alone), then timed there the
way a step runs it (attention_decode + attention_combine back to back with PDL in one graph). One step graph
serves every context, so the best is the one with the least geometric mean over the contexts; it goes into
the tuned-results store beside the GEMVs' (codegen/tuned.py's ``attention_specs`` reads it)."""

from __future__ import annotations

import math
import time

import numpy as np

from .. import codegen, config
from ..bench import attention as bench
from ..bench.gemv_case import bits
from ..codegen import GpuProfile, tuned
from ..codegen import tuned_store as store
from ..dims import ModelDims
from ..runtime import driver
from . import space
from .sweep import Progress, progress_key


def tune_attention(dims: ModelDims, cfg: config.Config, budget_s: float, log=print, out=None, m: int = 1,
                   contexts=bench.CONTEXTS) -> list[dict]:
    """Sweep the decode attention of m rows on this GPU; merge the winner into the tuned-results file
    ``out`` (default: the user's). Returns the summary row (none when the config's own fields could not be
    timed)."""
    props = driver.device().props
    gpu, profile = props.name, GpuProfile.from_props(props)
    stream, progress = driver.Stream(), Progress(gpu)
    key = tuned.attention_key(dims, cfg, gpu, m)
    one = tuned.attention_params(dims, cfg, gpu, profile)   # the m = 1 fields this GPU runs (m > 1 keeps them)
    current = store.lookup_params(key) if m > 1 else one
    cands, ruled_out = space.attention_candidates(dims, cfg, m, one=one, current=current, profile=profile)
    log(f"attention m={m}: {len(cands)} candidates ({ruled_out} ruled out by the spec constraints), "
        f"contexts {', '.join(map(str, contexts))}")
    base = tuned.attention_specs(dims, cfg, gpu, 1, profile)[1:]   # the m = 1 pair (m > 1: each row's bits)
    built = codegen.build_many([s for _, pair in cands for s in pair] + list(base), progress=codegen.ProgressLine(),
                               return_exceptions=True)
    if any(isinstance(b, Exception) for b in built[-2:]):
        raise next(b for b in built[-2:] if isinstance(b, Exception))
    fns1 = tuple(driver.load(b) for b in built[-2:])
    setup = bench.Setup(dims, max(contexts) + m, cfg.kv_cache.page_size, np.random.default_rng(0))
    deadline = time.monotonic() + budget_s
    results = []
    try:
        alone = {} if m == 1 else {c: bits(bench.rows_alone(setup, fns1, *base, c, m, stream)) for c in contexts}
        for i, (params, pair) in enumerate(cands):
            dec_b, comb_b = built[2 * i:2 * i + 2]
            if isinstance(dec_b, Exception) or isinstance(comb_b, Exception):
                log(f"  {pair[0].uri}: compile error: {str(dec_b if isinstance(dec_b, Exception) else comb_b).splitlines()[0]}")
                continue
            pkey = f"{progress_key(dec_b)}+{progress_key(comb_b)}@{','.join(map(str, contexts))}"
            res = progress.done.get(pkey)
            if res is None:
                if time.monotonic() > deadline:
                    log(f"attention m={m}: budget spent after {i}/{len(cands)} candidates")
                    break
                res = _judge(setup, (driver.load(dec_b), driver.load(comb_b)), pair, contexts, stream, alone)
                progress.add(pkey, res)
            results.append((params, pair, res))
            log(f"  {params}: {_line(res)}")
    finally:
        setup.free()
        stream.close()
    ok = [(params, pair, res) for params, pair, res in results if res["status"] == "ok"]
    if not results or results[0][1] != cands[0][1] or results[0][2]["status"] != "ok":
        log(f"attention m={m}: no valid timing for the config's fields; nothing stored")
        return []
    params, pair, res = min(ok, key=lambda r: r[2]["geomean_us"])
    default = results[0][2]
    entry = {"params": params, "uri": pair[0].uri, "us": res["us"], "geomean_us": res["geomean_us"],
             "default_params": results[0][0], "default_us": default["us"], "default_geomean_us": default["geomean_us"],
             "contexts": list(contexts), "candidates": len(cands), "judged": len(results),
             **({"m": m, "base_uri": base[0].uri} if m > 1 else {})}
    store.merge_write({key: entry}, {"written_by": "nanoqwen-tune", "gpu": gpu, "commit": bench.git_commit()}, out)
    return [{"role": "attention", "m": m, "params": params, "us": res["geomean_us"],
             "default_us": default["geomean_us"], "entry": entry}]


def _judge(setup, fns: tuple, pair: tuple, contexts, stream, alone: dict) -> dict:
    """Each context: m > 1 rows bitwise their m = 1 outputs alone, then bench.attention's check against the
    numpy attention and its graph timing."""
    dec, comb = pair
    us = {}
    for c in contexts:
        if alone:
            got = bench.Pair(setup, fns, dec, comb, c, stream)
            try:
                rows = np.flatnonzero((bits(got.output()) != alone[c]).reshape(dec.m, -1).any(axis=1))
            finally:
                got.free()
            if rows.size:
                return {"status": "rows differ", "context": c, "rows": rows.tolist()}
        r = bench.check_and_time(setup, fns, dec, comb, c, stream)
        if r.get("wrong"):
            return {"status": "wrong", "context": c, "rel_err": r["rel_err"]}
        us[str(c)] = r["us"]
    return {"status": "ok", "us": us, "geomean_us": math.exp(sum(map(math.log, us.values())) / len(us))}


def _line(res: dict) -> str:
    if res["status"] == "ok":
        return f"{res['geomean_us']:.2f} us geomean ({', '.join(f'{c}: {u:.2f}' for c, u in res['us'].items())})"
    if res["status"] == "wrong":
        return f"DISCARDED: rel err {res['rel_err']:.2e} at {res['context']} keys (fast but wrong)"
    return f"DISCARDED: rows {res['rows']} differ from the m = 1 kernel's bits at {res['context']} keys"
