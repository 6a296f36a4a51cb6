"""GPU unit tests of rope_append, attention_decode and attention_combine against nanoqwen.reference
(rope_tables, rope, attention, f16), on fresh random data each run, for the 7B dims (4 KV heads x GQA 7)
and the tiny test model (1 KV head x 7).

- The KV pages of the sequence sit in a *shuffled* physical order (PageTable with a permuted free list),
  so the kernels must follow the page table; every slot outside the sequence (the tail of the last page,
  unmapped pages) is poisoned: K = 65504 (would dominate any softmax it entered), V = NaN.
- Outputs are poisoned (NaN) before each launch; every element is checked.
- Tolerances: rope_append is bit-exact (the kernel rounds each product and sum like numpy's fp32);
  the attention partials, merged on the host in float64, match the fp32 reference to rel 1e-5
  (||out - ref|| / ||ref||; fp32 math and MUFU.EX2); o16 is within one fp16 ulp of f16(ref) elementwise.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen import reference as R
from nanoqwen.codegen.kernels import attention as A
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.runtime.paged_kv import KVLayout, PageTable
from nanoqwen.testmodels import tiny_dims

from ._gpu_util import fresh_rng, rel, report

pytestmark = pytest.mark.gpu

CFG = config.default()
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
MAX_TOKENS = 4096
SPARE_PAGES = 8                 # unmapped, poisoned physical pages beside the sequence's
REL_TOL = 1e-5                  # attention partials (fp32) vs the fp32 reference
K_POISON, V_POISON = np.float16(65504.0), np.float16(np.nan)
SEQ_LENS = [1, 15, 16, 17, 49, 4095, 4096]


@pytest.fixture(scope="module")
def fns():
    """{model: {"rope" | "bulk" | "bulk_w8s2" | "plain" | "mma" | "mma_w2s2" | "combine": (spec, fn)}} built
    once for the module. "bulk" is the CUDA-core consumers (4 warps, a 3-deep ring), "bulk_w8s2" the same
    with 8 consumer warps and a 2-deep ring (the ring parity flips every other page), "plain" the decode
    kernel without the producer warp (the oracle that localizes a pipeline bug), "mma" the tensor-core
    consumers, "mma_w2s2" those with 2 warps taking turns on a 2-deep ring, "mma_w4s8" with an 8-deep ring in
    dynamic shared memory (each warp a page in flight behind the one it reads: the configured kernel)."""
    specs = {}
    for name, d in MODELS.items():
        rope, dec, comb = A.decode_specs(d, CFG)
        specs[name] = {"rope": rope, "bulk": dataclasses.replace(dec, pipeline="bulk", consumer_warps=4, stages=3),
                       "plain": dataclasses.replace(dec, pipeline="plain"),
                       "bulk_w8s2": dataclasses.replace(dec, pipeline="bulk", consumer_warps=8, stages=2),
                       "mma": dataclasses.replace(dec, pipeline="mma", consumer_warps=4, stages=4),
                       "mma_w2s2": dataclasses.replace(dec, pipeline="mma", consumer_warps=2, stages=2),
                       "mma_w4s8": dataclasses.replace(dec, pipeline="mma", consumer_warps=4, stages=8),
                       "combine": comb}
    built = codegen.build_many([s for t in specs.values() for s in t.values()])
    loaded = {b.spec: driver.load(b) for b in built}
    return {name: {k: (s, loaded[s]) for k, s in t.items()} for name, t in specs.items()}


def _layout(dims) -> KVLayout:
    return KVLayout(layers=1, kv_heads=dims.kv_heads, head_dim=dims.head_dim, page_size=CFG.kv_cache.page_size,
                    num_pages=MAX_TOKENS // CFG.kv_cache.page_size + SPARE_PAGES, max_positions=MAX_TOKENS)


def _scatter(pool: np.ndarray, table: np.ndarray, rows: np.ndarray, page: int) -> None:
    """pool[table[t // page], :, t % page, :] = rows[t] for t = 0..len(rows)-1."""
    t = np.arange(len(rows))
    pool[table[t // page], :, t % page, :] = rows


class Attn:
    """Device buffers of one attention setup: q_rot, paged K/V pools, page table, state, outputs."""

    def __init__(self, dims, rng):
        self.dims, self.lay = dims, _layout(dims)
        self.pages = PageTable(self.lay, order=rng.permutation(self.lay.num_pages))
        self.pages.reserve(MAX_TOKENS)
        self.table = self.pages.table.copy()
        self.q = (3.0 * rng.standard_normal((1, dims.heads, dims.head_dim))).astype(np.float32)
        self.k_seq = rng.standard_normal((MAX_TOKENS, dims.kv_heads, dims.head_dim)).astype(np.float16)
        self.v_seq = rng.standard_normal((MAX_TOKENS, dims.kv_heads, dims.head_dim)).astype(np.float16)
        self.buf = {n: driver.DeviceBuffer(b) for n, b in (
            ("k_pool", self.lay.pool_bytes), ("v_pool", self.lay.pool_bytes), ("page_table", self.lay.table_bytes),
            ("state", 16), ("q_rot", self.q.nbytes), ("o16", dims.q_dim * 2))}
        self.buf["page_table"].upload(self.table)
        self.buf["q_rot"].upload(self.q)

    def fill(self, seq_len: int) -> None:
        """Pools hold the first seq_len tokens at their shuffled pages; every other slot is poison."""
        page = self.lay.page_size
        k = np.full(self.lay.pool_shape, K_POISON, np.float16)
        v = np.full(self.lay.pool_shape, V_POISON, np.float16)
        _scatter(k, self.table, self.k_seq[:seq_len], page)
        _scatter(v, self.table, self.v_seq[:seq_len], page)
        self.buf["k_pool"].upload(k)
        self.buf["v_pool"].upload(v)

    def set_pos(self, seq_len: int) -> None:
        self.buf["state"].upload(np.array([7, seq_len - 1, 3, 0], np.int32))

    def reference(self, seq_len: int) -> np.ndarray:
        return R.attention(self.q, self.k_seq[:seq_len], self.v_seq[:seq_len], np.array([seq_len - 1]))[0]


def _launch_attention(model_fns, at: Attn, part_acc, part_ml, stream=None, pipeline="bulk") -> None:
    (dspec, dfn), (cspec, cfn) = model_fns[pipeline], model_fns["combine"]
    b = at.buf
    dfn.launch(dspec.launch(), stream, pdl=False, state=b["state"], q_rot=b["q_rot"], k_pool=b["k_pool"],
               v_pool=b["v_pool"], page_table=b["page_table"], part_acc=part_acc, part_ml=part_ml)
    cfn.launch(cspec.launch(), stream, pdl=True, part_acc=part_acc, part_ml=part_ml, o16=b["o16"])


def _check_o16(o16: np.ndarray, ref: np.ndarray, what: str) -> float:
    assert np.isfinite(o16).all(), f"{what}: non-finite o16"
    # one fp16 ulp of rounding room, plus the fp32 error (REL_TOL of the scale) for elements near 0
    ulp = np.spacing(np.abs(R.f16(ref))).astype(np.float64) + REL_TOL * np.abs(ref).max()
    bad = np.abs(o16.astype(np.float64) - ref) > ulp
    assert not bad.any(), f"{what}: {bad.sum()} o16 elements more than 1 fp16 ulp off"
    return rel(o16, ref)


@pytest.mark.parametrize("pipeline", ["bulk", "bulk_w8s2", "plain", "mma", "mma_w2s2", "mma_w4s8"])
@pytest.mark.parametrize("model", MODELS)
def test_attention_decode_and_combine(fns, model, pipeline):
    dims = MODELS[model]
    rng = fresh_rng()
    at = Attn(dims, rng)
    dspec = fns[model][pipeline][0]
    acc_bytes, ml_bytes = A.partial_bytes(dspec)
    part_acc, part_ml = driver.DeviceBuffer(acc_bytes), driver.DeviceBuffer(ml_bytes)
    S, H, D, P = dspec.splits, dims.heads, dims.head_dim, CFG.kv_cache.page_size
    for seq_len in SEQ_LENS + [int(rng.integers(2, MAX_TOKENS))]:
        at.fill(seq_len)
        at.set_pos(seq_len)
        for buf in (part_acc, part_ml, at.buf["o16"]):
            buf.poison()
        _launch_attention(fns[model], at, part_acc, part_ml, pipeline=pipeline)
        driver.device().synchronize()
        acc = part_acc.download(dtype=np.float32).reshape(H, S, D).astype(np.float64)
        ml = part_ml.download(dtype=np.float32).reshape(H, S, 2).astype(np.float64)
        o16 = at.buf["o16"].download(dtype=np.float16).reshape(H, D)
        ref = at.reference(seq_len)
        what = f"{model} {pipeline} seq_len={seq_len}"

        # neutral partials exactly where a split's page range [s*P/S, (s+1)*P/S) is empty
        n_pages = -(-seq_len // P)
        empty = np.array([s * n_pages // S == (s + 1) * n_pages // S for s in range(S)])
        assert (ml[:, empty, 0] == -np.inf).all() and (ml[:, empty, 1] == 0).all() and (acc[:, empty] == 0).all(), what
        assert np.isfinite(ml[:, ~empty]).all() and (ml[:, ~empty, 1] > 0).all() and np.isfinite(acc).all(), what
        m = ml[:, :, 0].max(axis=1, keepdims=True)
        w = np.exp2(ml[:, :, 0] - m)
        out = (acc * w[:, :, None]).sum(1) / (ml[:, :, 1] * w).sum(1)[:, None]
        err = rel(out, ref)
        err16 = _check_o16(o16, ref, what)
        report(f"{what}: partials merged in float64 vs reference", err, REL_TOL)
        report(f"{what}: o16 vs reference (checked per element to 1 fp16 ulp)", err16, 1e-3)
        assert err <= REL_TOL, f"{what}: rel error {err:.3e} > {REL_TOL}"


@pytest.mark.parametrize("model", MODELS)
def test_one_graph_serves_every_position(fns, model):
    """Decode + combine captured once; only state[1] changes between replays (page boundary and tails)."""
    dims = MODELS[model]
    at = Attn(dims, fresh_rng())
    at.fill(MAX_TOKENS)
    part_acc, part_ml = (driver.DeviceBuffer(n) for n in A.partial_bytes(fns[model]["bulk"][0]))
    stream = driver.Stream()
    at.set_pos(1)
    with driver.capture(stream) as graph:
        _launch_attention(fns[model], at, part_acc, part_ml, stream)
    for seq_len in (33, 32, 1, 4096, 2049):
        at.set_pos(seq_len)
        at.buf["o16"].poison()
        graph.launch(stream)
        stream.synchronize()
        o16 = at.buf["o16"].download(dtype=np.float16).reshape(dims.heads, dims.head_dim)
        _check_o16(o16, at.reference(seq_len), f"{model} graph seq_len={seq_len}")
    start, end = driver.Event(), driver.Event()
    start.record(stream)
    for _ in range(100):
        graph.launch(stream)
    end.record(stream)
    print(f"{model}: decode + combine at seq_len 2049: {driver.Event.elapsed_ms(start, end) * 10:.2f} us per replay")
    graph.close()
    stream.close()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pos", [0, 15, 16, 37, 4095, None])
def test_rope_append(fns, model, pos):
    dims = MODELS[model]
    rng = fresh_rng()
    pos = int(rng.integers(0, MAX_TOKENS)) if pos is None else pos
    rspec, rfn = fns[model]["rope"]
    lay = _layout(dims)
    pages = PageTable(lay, order=rng.permutation(lay.num_pages))
    pages.reserve(MAX_TOKENS)
    cos, sin = R.rope_tables(dims, MAX_TOKENS)
    Q, KV, D = dims.q_dim, dims.kv_dim, dims.head_dim
    qkv = (3.0 * rng.standard_normal(Q + 2 * KV)).astype(np.float32)
    qkv[Q + KV] = 1e6   # a massive v activation: must saturate to 65504, never inf
    qkv[Q] = -1e6       # and a massive k one (rotated, still beyond fp16)
    k0 = rng.standard_normal(lay.pool_shape).astype(np.float16)
    v0 = rng.standard_normal(lay.pool_shape).astype(np.float16)
    buf = {n: driver.DeviceBuffer.from_array(a) for n, a in (
        ("state", np.array([0, pos, 0, 0], np.int32)), ("qkv", qkv), ("rope_cos", cos), ("rope_sin", sin),
        ("page_table", pages.table), ("k_pool", k0), ("v_pool", v0))}
    buf["q_rot"] = driver.DeviceBuffer(Q * 4)
    buf["q_rot"].poison()
    rfn.launch(rspec.launch(), None, pdl=False, **buf)
    driver.device().synchronize()
    q_rot = buf["q_rot"].download(dtype=np.float32)
    k = buf["k_pool"].download(dtype=np.float16).reshape(lay.pool_shape)
    v = buf["v_pool"].download(dtype=np.float16).reshape(lay.pool_shape)

    positions = np.array([pos])
    q_ref = R.rope(qkv[:Q].reshape(1, dims.heads, D), cos, sin, positions).reshape(Q)
    k_ref = R.f16(R.rope(qkv[Q:Q + KV].reshape(1, dims.kv_heads, D), cos, sin, positions)[0])
    v_ref = R.f16(qkv[Q + KV:].reshape(dims.kv_heads, D))
    page, slot = pages.locate(pos)
    k_exp, v_exp = k0.copy(), v0.copy()
    k_exp[page, :, slot, :] = k_ref
    v_exp[page, :, slot, :] = v_ref
    report(f"{model} pos={pos}: q_rot rel (bit-exact required)", rel(q_rot, q_ref), 0.0)
    # class (a): elementwise mul/sub/add with explicit _rn rounding (no FMA contraction), numpy's arithmetic
    np.testing.assert_array_equal(q_rot.view(np.uint32), q_ref.view(np.uint32))
    assert np.isfinite(k).all() and np.isfinite(v).all() and v[page, 0, slot, 0] == 65504
    # the written slots match bit for bit and nothing else in the pools changed
    np.testing.assert_array_equal(k.view(np.uint16), k_exp.view(np.uint16))
    np.testing.assert_array_equal(v.view(np.uint16), v_exp.view(np.uint16))


def _decode_specs(d, m: int, pipeline: str):
    """pipeline "bulk", "mma" or "mma-pairs" (mma, m > 1 rows paired: attention_decode's pair_rows)."""
    rope, dec, comb = A.decode_specs(d, CFG, m=m)
    # mma: each warp its own slots; bulk: a ring within the static 48 KB
    base = pipeline.split("-")[0]
    ring = {"mma": dict(consumer_warps=4, stages=4), "bulk": dict(consumer_warps=4, stages=3)}[base]
    dec = dataclasses.replace(dec, pipeline=base, pair_rows=pipeline == "mma-pairs" and m > 1, **ring)
    return rope, dec, comb


@pytest.mark.parametrize("positions", ["spread", "verify"])
@pytest.mark.parametrize("pipeline", ["bulk", "mma", "mma-pairs"])
@pytest.mark.parametrize("m", [2, 3, 16])
@pytest.mark.parametrize("model", ["7b", "tiny"])
def test_multi_row_rows_are_the_single_row_kernels(model, m, pipeline, positions):
    """The multi-row step's rope_append, attention_decode and attention_combine: row r, a token of its own at
    position positions[r], gives BITWISE what the m = 1 kernels give for that token alone (q_rot, the K/V
    written into its page slot, o16), whatever the other rows hold (DESIGN.md section 12). Positions "spread"
    over page boundaries and lengths, or a "verify"'s consecutive ones across a page boundary (the rows the
    mma-pairs pipeline serves two to a CTA, but the pair the boundary splits); two rows share a position
    (padding repeats the last real row). Class (a) of docs/architecture.md: the same arithmetic per row by
    construction, compared bit for bit."""
    d, rng = MODELS[model], fresh_rng()
    specs = {m_: _decode_specs(d, m_, pipeline) for m_ in (1, m)}
    built = codegen.build_many([s for t in specs.values() for s in t])
    fn = {b.spec: driver.load(b) for b in built}
    at = Attn(d, rng)
    at.fill(MAX_TOKENS)
    if positions == "spread":
        positions = np.sort(rng.choice(np.arange(17, MAX_TOKENS - 1), m, replace=False)).astype(np.int32)
        positions[:2] = (15, 16)   # the last slot of a page and the first of the next
    else:                          # a page boundary after row 2 (between rows 2 and 3: the pair (2, 3) split)
        p0 = 16 * int(rng.integers(2, (MAX_TOKENS - 2 * m) // 16)) - 3
        positions = np.arange(p0, p0 + m, dtype=np.int32)
    positions[-1] = positions[-2]  # a padded row repeats the last real one
    qkv_row = (d.heads + 2 * d.kv_heads) * d.head_dim
    qkv = (3.0 * rng.standard_normal((m, qkv_row))).astype(np.float32)
    qkv[-1] = qkv[-2]              # ... the same token: it writes the same bits into the same slot
    cos, sin = (driver.DeviceBuffer.from_array(t) for t in R.rope_tables(d, MAX_TOKENS))
    acc_b, ml_b = A.partial_bytes(specs[m][1])
    bufs = {n: driver.DeviceBuffer(b) for n, b in (("qkv", qkv.nbytes), ("q_rot", m * d.q_dim * 4), ("o16", m * d.q_dim * 2),
                                                   ("part_acc", acc_b), ("part_ml", ml_b), ("positions", 8 * m))}
    b = at.buf

    def run(m_, rows_qkv, pos, state_or_positions):
        (rs, rf), (ds, df), (cs, cf) = ((s, fn[s]) for s in specs[m_])
        bufs["qkv"].upload(np.ascontiguousarray(rows_qkv))
        for name in ("q_rot", "o16"):
            bufs[name].upload(np.full(bufs[name].nbytes // 4, np.nan, np.float32))
        where = {"state": b["state"]} if m_ == 1 else {"positions": bufs["positions"]}
        state_or_positions()
        rf.launch(rs.launch(), None, pdl=False, **where, qkv=bufs["qkv"], rope_cos=cos, rope_sin=sin,
                  page_table=b["page_table"], q_rot=bufs["q_rot"], k_pool=b["k_pool"], v_pool=b["v_pool"])
        df.launch(ds.launch(), None, pdl=True, **where, q_rot=bufs["q_rot"], k_pool=b["k_pool"], v_pool=b["v_pool"],
                  page_table=b["page_table"], part_acc=bufs["part_acc"], part_ml=bufs["part_ml"])
        cf.launch(cs.launch(), None, pdl=True, part_acc=bufs["part_acc"], part_ml=bufs["part_ml"], o16=bufs["o16"])
        driver.device().synchronize()
        q_rot = bufs["q_rot"].download(np.empty((m, d.q_dim), np.float32))[:m_]
        o16 = bufs["o16"].download(np.empty((m, d.q_dim), np.float16))[:m_]
        return q_rot, o16

    def slot_bytes(pool: str, pos: int) -> bytes:
        lay = at.lay
        pools = b[pool].download(np.empty(lay.pool_shape, np.float16))
        return pools[at.table[pos // lay.page_size], :, pos % lay.page_size, :].tobytes()

    try:
        bufs["positions"].upload(np.concatenate([positions, np.zeros(m, np.int32)]))   # one table: offsets 0
        q_m, o_m = run(m, qkv, positions, lambda: None)
        kv_m = [(slot_bytes("k_pool", p), slot_bytes("v_pool", p)) for p in positions]
        # the rows again, one at a time, in order (each row's K/V is in the pool before a later row reads it)
        at.fill(MAX_TOKENS)
        for r, p in enumerate(positions):
            q_1, o_1 = run(1, qkv[r:r + 1], p, lambda p=p: at.set_pos(int(p) + 1))
            assert q_1.tobytes() == q_m[r].tobytes(), f"row {r} (position {p}): q_rot differs from the m = 1 kernel"
            assert (slot_bytes("k_pool", p), slot_bytes("v_pool", p)) == kv_m[r], f"row {r}: K/V slot differs"
            assert o_1.tobytes() == o_m[r].tobytes(), f"row {r} (position {p}): o16 differs from the m = 1 kernels"
            assert np.isfinite(o_1).all()
    finally:
        for buf in (*bufs.values(), cos, sin):
            buf.free()
        for buf in at.buf.values():
            buf.free()


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("m", [3, 16])
@pytest.mark.parametrize("model", ["7b", "tiny"])
def test_multi_row_rows_of_several_sequences(model, m, pairs):
    """Rows of several sequences in one multi-row step (continuous batching, DESIGN.md section 13): row r
    reads its own sequence's page-table row at page_table + positions[m + r] (a table of SEQS rows over one
    shared pool, each sequence's pages shuffled among the others'). Each row gives BITWISE what the m = 1
    kernels give for that token with its sequence's table alone: q_rot, the K/V slot it writes in its own
    sequence's page, o16 over its own sequence's K/V. The sequences' rows are interleaved, each sequence's
    positions ascending (so the rows re-run one at a time, in order, see what the step saw); the last row
    pads (repeats the one before). ``pairs``: attention_decode's pair_rows, whose CTAs serve two rows only where
    they share a table row and its page count (here the padded pair), each other row alone. Class (a) of
    docs/architecture.md, compared bit for bit."""
    SEQS, d, rng = 3, MODELS[model], fresh_rng()
    page = CFG.kv_cache.page_size
    per = MAX_TOKENS // page
    lay = KVLayout(layers=1, kv_heads=d.kv_heads, head_dim=d.head_dim, page_size=page,
                   num_pages=SEQS * per + SPARE_PAGES, max_positions=MAX_TOKENS)
    T = lay.table_len
    perm = rng.permutation(lay.num_pages).astype(np.int32)
    tables = np.stack([perm[s * per:(s + 1) * per] for s in range(SEQS)])   # [SEQS, T]: T == per
    k_seq = rng.standard_normal((SEQS, MAX_TOKENS, d.kv_heads, d.head_dim)).astype(np.float16)
    v_seq = rng.standard_normal((SEQS, MAX_TOKENS, d.kv_heads, d.head_dim)).astype(np.float16)
    # rows: sequences round robin, each sequence's positions ascending; the last row pads
    seq_of = np.array([r % SEQS for r in range(m - 1)] + [(m - 2) % SEQS], np.int32)
    positions = np.zeros(m, np.int32)
    for s in range(SEQS):
        rows = np.flatnonzero(seq_of[:m - 1] == s)
        picked = np.sort(rng.choice(np.arange(17, MAX_TOKENS - 1), len(rows), replace=False))
        if s == 0 and len(rows) >= 2:
            picked[:2] = (15, 16)   # the last slot of a page and the first of the next
        positions[rows] = picked
    positions[-1] = positions[-2]
    qkv_row = (d.heads + 2 * d.kv_heads) * d.head_dim
    qkv = (3.0 * rng.standard_normal((m, qkv_row))).astype(np.float32)
    qkv[-1] = qkv[-2]
    specs = {m_: A.decode_specs(d, CFG, m=m_) for m_ in (1, m)}
    rope, dec, comb = specs[m]
    specs[m] = rope, dataclasses.replace(dec, pair_rows=pairs), comb
    fn = {b.spec: driver.load(b) for b in codegen.build_many([s for t in specs.values() for s in t])}
    cos, sin = (driver.DeviceBuffer.from_array(t) for t in R.rope_tables(d, MAX_TOKENS))
    acc_b, ml_b = A.partial_bytes(specs[m][1])
    bufs = {n: driver.DeviceBuffer(b) for n, b in (
        ("qkv", qkv.nbytes), ("q_rot", m * d.q_dim * 4), ("o16", m * d.q_dim * 2), ("part_acc", acc_b),
        ("part_ml", ml_b), ("positions", 8 * m), ("state", 16), ("tables", tables.nbytes), ("table", T * 4),
        ("k_pool", lay.pool_bytes), ("v_pool", lay.pool_bytes))}

    def fill():
        """Each sequence's K/V at its own shuffled pages; the spare pages are poison."""
        k = np.full(lay.pool_shape, K_POISON, np.float16)
        v = np.full(lay.pool_shape, V_POISON, np.float16)
        for s in range(SEQS):
            _scatter(k, tables[s], k_seq[s], page)
            _scatter(v, tables[s], v_seq[s], page)
        bufs["k_pool"].upload(k)
        bufs["v_pool"].upload(v)

    def run(m_, rows_qkv, where, page_table):
        (rs, rf), (ds, df), (cs, cf) = ((s, fn[s]) for s in specs[m_])
        bufs["qkv"].upload(np.ascontiguousarray(rows_qkv))
        for name in ("q_rot", "o16"):
            bufs[name].upload(np.full(bufs[name].nbytes // 4, np.nan, np.float32))
        rf.launch(rs.launch(), None, pdl=False, **where, qkv=bufs["qkv"], rope_cos=cos, rope_sin=sin,
                  page_table=page_table, q_rot=bufs["q_rot"], k_pool=bufs["k_pool"], v_pool=bufs["v_pool"])
        df.launch(ds.launch(), None, pdl=True, **where, q_rot=bufs["q_rot"], k_pool=bufs["k_pool"],
                  v_pool=bufs["v_pool"], page_table=page_table, part_acc=bufs["part_acc"], part_ml=bufs["part_ml"])
        cf.launch(cs.launch(), None, pdl=True, part_acc=bufs["part_acc"], part_ml=bufs["part_ml"], o16=bufs["o16"])
        driver.device().synchronize()
        return (bufs["q_rot"].download(np.empty((m, d.q_dim), np.float32))[:m_],
                bufs["o16"].download(np.empty((m, d.q_dim), np.float16))[:m_])

    def slot_bytes(pool: str, s: int, pos: int) -> bytes:
        pools = bufs[pool].download(np.empty(lay.pool_shape, np.float16))
        return pools[tables[s][pos // page], :, pos % page, :].tobytes()

    try:
        fill()
        bufs["tables"].upload(tables)
        bufs["positions"].upload(np.concatenate([positions, seq_of * T]).astype(np.int32))
        q_m, o_m = run(m, qkv, {"positions": bufs["positions"]}, bufs["tables"])
        kv_m = [(slot_bytes("k_pool", s, p), slot_bytes("v_pool", s, p)) for s, p in zip(seq_of, positions)]
        fill()
        for r, (s, p) in enumerate(zip(seq_of, positions)):
            bufs["table"].upload(tables[s])
            bufs["state"].upload(np.array([7, p, 3, 0], np.int32))
            q_1, o_1 = run(1, qkv[r:r + 1], {"state": bufs["state"]}, bufs["table"])
            what = f"row {r} (sequence {s}, position {p})"
            assert q_1.tobytes() == q_m[r].tobytes(), f"{what}: q_rot differs from the m = 1 kernel"
            assert (slot_bytes("k_pool", s, p), slot_bytes("v_pool", s, p)) == kv_m[r], f"{what}: K/V slot differs"
            assert o_1.tobytes() == o_m[r].tobytes(), f"{what}: o16 differs from the m = 1 kernels"
            assert np.isfinite(o_1).all()
    finally:
        for buf in (*bufs.values(), cos, sin):
            buf.free()
