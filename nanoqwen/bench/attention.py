"""Decode attention benchmark (issues 20, 22): attention_decode and attention_combine alone, for m rows of one
sequence at consecutive positions (m = 1: the decode step; m > 1: a verify of the multi-row step), at a few
context lengths, launched back to back with PDL in one captured CUDA graph (how a step runs them), against the
copy bandwidth of the same run.

Bytes counted per launch: the K/V pages the rows see (their union, ceil((L + m - 1) / page) pages of every KV
head, K and V), the least DRAM must deliver; the split partials stay in L2. At short context the pair is a
chain of latencies, not bytes (docs/perf-notes.md, "The multi-row decode attention"), so the table gives
microseconds first.

Each variant is the config's spec with overrides (``--variant stages=4,ctas_per_sm=3``): the spec's own
validate() rules out impossible ones, and every variant's o16 is checked against nanoqwen.reference.attention
before it is timed (a fast wrong kernel is reported, not timed).

Usage on the GPU machine: ``PYTHONPATH=. python3 -m nanoqwen.bench.attention [--contexts 577 4097 16385]
[--rows 1 8] [--variant KEY=VALUE,...]... [--json FILE]``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import numpy as np

from .. import codegen, config
from .. import reference as R
from ..codegen.kernels import attention as A
from ..codegen.spec import SpecError
from ..dims import QWEN25_7B, ModelDims
from ..runtime import driver
from ..runtime.paged_kv import KVLayout
from .kernels import copy_bandwidth, git_commit
from .replay import graph_seconds

CONTEXTS = (577, 4097, 16385)
ROWS = (1, 2, 4, 8, 16)
CALLS = 50          # decode + combine pairs per graph
REL_TOL = 2e-3      # o16 (fp16) against the fp32 reference, relative to the largest |o|


def parse_variant(text: str) -> dict:
    """``"stages=4,pipeline=bulk"`` -> {"stages": 4, "pipeline": "bulk"} (integers where they parse)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"variant item {item!r}: expected KEY=VALUE")
        value = value.strip()
        out[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return out


def kernels(dims: ModelDims, cfg: config.Config, m: int, overrides: dict) -> tuple[A.AttentionDecodeSpec,
                                                                                   A.AttentionCombineSpec]:
    """The config's decode attention and combine for m rows, the overrides applied to attention_decode."""
    _rope, dec, comb = A.decode_specs(dims, cfg, m=m)
    dec = dataclasses.replace(dec, **overrides)
    dec.validate()
    return dec, comb


def kv_bytes(dims: ModelDims, context: int, m: int, page: int) -> int:
    """K and V bytes of the pages that m rows at positions context - 1 .. context + m - 2 see."""
    pages = -(-(context + m - 1) // page)
    return 2 * pages * dims.kv_heads * page * dims.head_dim * 2


class Setup:
    """A paged K/V cache holding ``tokens`` random tokens in shuffled pages, q for 16 rows, the state."""

    def __init__(self, dims: ModelDims, tokens: int, page: int, rng):
        self.dims, self.page = dims, page
        lay = KVLayout(layers=1, kv_heads=dims.kv_heads, head_dim=dims.head_dim, page_size=page,
                       num_pages=-(-tokens // page), max_positions=dims.max_positions)
        self.k = rng.standard_normal((tokens, dims.kv_heads, dims.head_dim)).astype(np.float16)
        self.v = rng.standard_normal((tokens, dims.kv_heads, dims.head_dim)).astype(np.float16)
        self.table = rng.permutation(lay.num_pages).astype(np.int32)
        self.q = rng.standard_normal((A.MAX_ROWS, dims.heads, dims.head_dim)).astype(np.float32)
        t = np.arange(tokens)
        k_pool, v_pool = np.zeros(lay.pool_shape, np.float16), np.zeros(lay.pool_shape, np.float16)
        k_pool[self.table[t // page], :, t % page] = self.k
        v_pool[self.table[t // page], :, t % page] = self.v
        self.buf = {"k_pool": driver.DeviceBuffer.from_array(k_pool), "v_pool": driver.DeviceBuffer.from_array(v_pool),
                    "page_table": driver.DeviceBuffer.from_array(self.table), "q_rot": driver.DeviceBuffer.from_array(self.q),
                    "state": driver.DeviceBuffer(16)}

    def free(self) -> None:
        for b in self.buf.values():
            b.free()


class Pair:
    """attention_decode + attention_combine over ``setup``'s cache: m rows at positions context - 1 ..
    context + m - 2 with q rows first_row .. first_row + m - 1, their buffers, and one call of the pair."""

    def __init__(self, setup: Setup, fns: tuple, dec, comb, context: int, stream, first_row: int = 0):
        m, d = dec.m, setup.dims
        self.setup, self.m, self.stream = setup, m, stream
        self.acc, self.ml = (driver.DeviceBuffer(n) for n in A.partial_bytes(dec))
        self.o16 = driver.DeviceBuffer(2 * m * d.q_dim)
        self.positions = np.arange(context - 1 + first_row, context - 1 + first_row + m, dtype=np.int32)
        self.rows = driver.DeviceBuffer.from_array(np.concatenate([self.positions, np.zeros(m, np.int32)]))
        self.q = setup.q[first_row:first_row + m]
        b = setup.buf
        where = {"state": b["state"]} if m == 1 else {"positions": self.rows}
        self.dec_args = dict(**where, q_rot=b["q_rot"].ptr + 4 * first_row * d.q_dim, k_pool=b["k_pool"],
                             v_pool=b["v_pool"], page_table=b["page_table"], part_acc=self.acc, part_ml=self.ml)
        self.fns, self.launches = fns, (dec.launch(), comb.launch())

    def call(self, _i=0, pdl=False) -> None:
        (dfn, cfn), (dl, cl) = self.fns, self.launches
        dfn.launch(dl, self.stream, pdl, **self.dec_args)
        cfn.launch(cl, self.stream, pdl, part_acc=self.acc, part_ml=self.ml, o16=self.o16)

    def output(self) -> np.ndarray:
        """One call's o16, [m, heads, head_dim]."""
        d = self.setup.dims
        self.setup.buf["state"].upload(np.array([0, self.positions[0], 0, 0], np.int32))
        self.call()
        self.stream.synchronize()
        return self.o16.download(np.empty((self.m, d.heads, d.head_dim), np.float16))

    def free(self) -> None:
        for buf in (self.acc, self.ml, self.o16, self.rows):
            buf.free()


def rows_alone(setup: Setup, fns1: tuple, dec1, comb1, context: int, m: int, stream) -> np.ndarray:
    """The o16 of m rows (positions context - 1 ...), each computed by the m = 1 pair by itself: what each
    row of an m-row kernel must equal bit for bit."""
    out = []
    for r in range(m):
        pair = Pair(setup, fns1, dec1, comb1, context, stream, first_row=r)
        try:
            out.append(pair.output()[0])
        finally:
            pair.free()
    return np.stack(out)


def check_and_time(setup: Setup, fns: tuple, dec, comb, context: int, stream) -> dict:
    """Check one (variant, m, context) against the reference, then time it; one result row."""
    pair = Pair(setup, fns, dec, comb, context, stream)
    try:
        got = pair.output().astype(np.float64)
        ref = R.attention(pair.q, setup.k, setup.v, pair.positions)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        row = {"context": context, "m": dec.m, "rel_err": err}
        if not np.isfinite(got).all() or err > REL_TOL:
            return row | {"wrong": True}
        us = float(np.median(graph_seconds(pair.call, CALLS, stream))) * 1e6
        return row | {"us": us, "us_per_row": us / dec.m, "kv_bytes": kv_bytes(setup.dims, context, dec.m, setup.page)}
    finally:
        pair.free()


def run(dims: ModelDims = QWEN25_7B, cfg: config.Config | None = None, contexts=CONTEXTS, rows=ROWS,
        variants=({},), log=print) -> dict:
    cfg = cfg or config.default()
    stream, rng = driver.Stream(), np.random.default_rng(0)
    copy = copy_bandwidth(stream)["GBps"]
    log(f"{driver.device().props.name}: copy bandwidth {copy:.0f} GB/s")
    page = cfg.kv_cache.page_size
    cases, ruled_out = [], []
    for overrides in variants:
        for m in rows:
            try:
                cases.append((overrides, kernels(dims, cfg, m, overrides)))
            except (SpecError, TypeError) as e:   # TypeError: a key that is no spec field
                ruled_out.append({"variant": overrides, "m": m, "error": str(e)})
    built = {b.spec: driver.load(b) for b in codegen.build_many([s for _, pair in cases for s in pair])}
    setup = Setup(dims, max(contexts) + max(rows), page, rng)
    results = []
    try:
        for context in contexts:
            for overrides, (dec, comb) in cases:
                r = {"variant": overrides, "uri": dec.uri} | check_and_time(setup, (built[dec], built[comb]), dec, comb, context, stream)
                if "us" in r:
                    r["pct_copy"] = 100 * r["kv_bytes"] / (r["us"] * 1e-6) / (copy * 1e9)
                results.append(r)
                log(line(r))
    finally:
        setup.free()
    return {"kind": "nanoqwen-attention-bench", "schema": 1, "gpu": driver.device().props.name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
            "dims": dataclasses.asdict(dims), "copy_GBps": copy, "calls_per_graph": CALLS, "results": results,
            "ruled_out": ruled_out}


def line(r: dict) -> str:
    v = ",".join(f"{k}={x}" for k, x in r["variant"].items()) or "config"
    head = f"context {r['context']:6d}  m {r['m']:2d}  {v:28s}"
    if r.get("wrong"):
        return f"{head}  WRONG (rel err {r['rel_err']:.2e} > {REL_TOL})"
    return (f"{head}  {r['us']:8.2f} us  {r['us_per_row']:7.2f} us/row  {r['kv_bytes'] / 2**20:7.1f} MiB  "
            f"{r['pct_copy']:5.1f}% of copy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="tokens in the cache (last row's)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows m per launch (1..16)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE,...",
                   help="attention_decode spec overrides, timed beside the config's (repeatable)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    try:
        variants = [{}] + [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    if not all(1 <= m <= A.MAX_ROWS for m in args.rows) or min(args.contexts) < 1:
        p.error(f"--rows must be 1..{A.MAX_ROWS} and --contexts positive")
    res = run(contexts=args.contexts, rows=args.rows, variants=variants)
    for r in res["ruled_out"]:
        print(f"ruled out: {r['variant']} m = {r['m']}: {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if any(r.get("wrong") for r in res["results"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
