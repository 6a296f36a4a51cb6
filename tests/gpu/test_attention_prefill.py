"""GPU unit tests of rope_append_prefill + attention_prefill (causal flash attention over the paged KV
cache) against nanoqwen.reference (rope_tables, rope, attention, f16) on fresh random data each run, for
the 7B dims (4 KV heads x GQA 7) and the tiny model (1 KV head x 7).

- Prompt lengths 1, 15, 16, 17, 100, 512 (and 2048 for the tiny model) in one chunk from position 0, and
  chunked prefills (several chunks, lengths ending mid-page) where each chunk attends to the pages the
  earlier chunks wrote.
- Pages sit in a shuffled physical order; every slot outside the sequence is poisoned (K = 65504, V = NaN)
  so a read past the causal range or a wrong page shows; outputs are poisoned (NaN) before each launch.
- Tolerances: q_rot and the written K/V pages are bit-exact (same fp32 rounding as numpy); o16 is within
  one fp16 ulp (+ 1e-5 of max|ref|) of the fp32 reference elementwise, and ||o16 - ref|| / ||ref|| <= 1e-3
  (q and p are split fp16 hi + lo in the kernel: the fp32-like part is ~1e-6, the rest is o16's rounding).
  The split=False variant (plain fp16 q and p) is checked at rel 1e-2 (fp16 q alone costs ~1e-3).
- Split-KV (short chunks: the split attention writes each key block's fp32 partial,
  attention_prefill_combine folds them into o16): chunks (p0, n) after a prefix written by the unsplit
  kernel, with 1, 3 and max_splits splits and the runtime's splits_for(p0 + n), held to the same
  tolerances; the partial buffers are poisoned, so a block that no split wrote, or a fold that read a
  block a row does not see, shows. Their device_chunk variants (p0, n from device memory, a grid sized for
  a 64-row bucket, as a chunk graph replays them) too. The split variants pack a KV head's query heads into
  one CTA's rows (pack_gqa); the unpacked split kernel runs beside them with the same bits.
- Chunk invariance (class (a), DESIGN.md section 12): a position's o16 is the same bits whether its chunk
  was the whole prompt or one of several, unsplit or split over any number of CTAs, launched with its
  p0, n or reading them from the device.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen import reference as R
from nanoqwen.codegen.kernels import attention_prefill as AP
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.runtime.paged_kv import KVLayout, PageTable
from nanoqwen.testmodels import tiny_dims

pytestmark = pytest.mark.gpu

CFG = config.default()
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
MAX_TOKENS = 4096
SPARE_PAGES = 8
K_POISON, V_POISON = np.float16(65504.0), np.float16(np.nan)
REL_TOL, REL_TOL_NOSPLIT = 1e-3, 1e-2
LENGTHS = {"7b": [1, 15, 16, 17, 100, 512], "tiny": [1, 15, 16, 17, 100, 512, 2048]}
CHUNKS = [[100, 17, 183], [16, 16, 1, 31], [5, 250]]   # chunk lengths of one prompt, in order
SPLIT_CHUNKS = [(0, 1), (0, 17), (100, 32), (4064, 32), (1000, 64)]   # (p0, n) of a split-KV chunk


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def fns():
    specs = [s for d in MODELS.values() for s in AP.prefill_attention_specs(d, CFG)]
    specs.append(replace(AP.prefill_attention_specs(MODELS["tiny"], CFG)[1], split=False))
    specs += [s for d in MODELS.values() for s in AP.split_kv_specs(d, CFG)]
    specs += [replace(AP.split_kv_specs(d, CFG)[0], pack_gqa=False) for d in MODELS.values()]
    specs += [s for d in MODELS.values() for s in (*AP.split_kv_specs(d, CFG, device_chunk=True),
                                                   AP.prefill_attention_specs(d, CFG, device_chunk=True)[0])]
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


class Prompt:
    """One prompt's qkv activations, shuffled pages and device buffers; runs chunks through the kernels.
    ``ref`` is the reference output of positions [ref_from, total) (a long cached prefix needs none)."""

    def __init__(self, dims, rng, total: int, ref_from: int = 0):
        self.dims, self.total = dims, total
        P = CFG.kv_cache.page_size
        self.lay = KVLayout(layers=1, kv_heads=dims.kv_heads, head_dim=dims.head_dim, page_size=P,
                            num_pages=MAX_TOKENS // P + SPARE_PAGES, max_positions=MAX_TOKENS)
        pages = PageTable(self.lay, order=rng.permutation(self.lay.num_pages))
        self.table = pages.reserve(total).copy()
        H, KV, D = dims.heads, dims.kv_heads, dims.head_dim
        self.qkv = (3.0 * rng.standard_normal((total, (H + 2 * KV) * D))).astype(np.float32)
        self.cos, self.sin = R.rope_tables(dims, MAX_TOKENS)
        pos = np.arange(total)
        q = self.qkv[:, :H * D].reshape(total, H, D)
        k = self.qkv[:, H * D:(H + KV) * D].reshape(total, KV, D)
        v = self.qkv[:, (H + KV) * D:].reshape(total, KV, D)
        self.q_rot = R.rope(q, self.cos, self.sin, pos)
        self.k16 = R.f16(R.rope(k, self.cos, self.sin, pos))
        self.v16 = R.f16(v)
        self.ref = R.attention(self.q_rot[ref_from:], self.k16, self.v16, pos[ref_from:])  # [.., H, D] fp32
        self.buf = {n: driver.DeviceBuffer.from_array(a) for n, a in (
            ("rope_cos", self.cos), ("rope_sin", self.sin), ("page_table", self.table),
            ("k_pool", np.full(self.lay.pool_shape, K_POISON, np.float16)),
            ("v_pool", np.full(self.lay.pool_shape, V_POISON, np.float16)))}
        self.buf["qkv"] = driver.DeviceBuffer(self.qkv.nbytes)
        self.buf["q_rot"] = driver.DeviceBuffer(total * H * D * 4)
        self.buf["o16"] = driver.DeviceBuffer(total * H * D * 2)

    def chunk(self, fns, rope_spec, attn_spec, p0: int, n: int):
        """Run one chunk [p0, p0 + n); returns (q_rot, o16) of its tokens."""
        b, H, D = self.buf, self.dims.heads, self.dims.head_dim
        b["qkv"].upload(self.qkv[p0:p0 + n])
        b["q_rot"].poison()
        b["o16"].poison()
        fns[rope_spec].launch(rope_spec.launch(n), None, pdl=False, qkv=b["qkv"], rope_cos=b["rope_cos"],
                              rope_sin=b["rope_sin"], page_table=b["page_table"], q_rot=b["q_rot"],
                              k_pool=b["k_pool"], v_pool=b["v_pool"], p0=p0, n=n)
        fns[attn_spec].launch(attn_spec.launch(n), None, pdl=True, q_rot=b["q_rot"], k_pool=b["k_pool"],
                              v_pool=b["v_pool"], page_table=b["page_table"], o16=b["o16"], p0=p0, n=n)
        driver.device().synchronize()
        q_rot = b["q_rot"].download(dtype=np.float32, shape=(n, H, D))
        o16 = b["o16"].download(dtype=np.float16, shape=(n, H, D))
        return q_rot, o16

    def chunk_split_kv(self, fns, rope_spec, split_spec, combine_spec, p0: int, n: int, splits: int,
                       rows: int | None = None):
        """Run one chunk [p0, p0 + n) through rope_append, the split-KV attention and the combine; returns
        its o16. device_chunk specs read p0, n from a device buffer, over grids sized for ``rows`` rows."""
        b, H, D = self.buf, self.dims.heads, self.dims.head_dim
        blocks = split_spec.blocks(p0 + n)
        acc = driver.DeviceBuffer(blocks * n * H * D * 4)
        ml = driver.DeviceBuffer(blocks * n * H * 2 * 4)
        chunk = driver.DeviceBuffer.from_array(np.array([p0, n], np.int32))
        pos = dict(chunk=chunk) if split_spec.device_chunk else dict(p0=p0, n=n)
        grid_n = rows or n
        try:
            b["qkv"].upload(self.qkv[p0:p0 + n])
            for buf in (b["q_rot"], b["o16"], acc, ml):
                buf.poison()
            fns[rope_spec].launch(rope_spec.launch(grid_n), None, pdl=False, qkv=b["qkv"], rope_cos=b["rope_cos"],
                                  rope_sin=b["rope_sin"], page_table=b["page_table"], q_rot=b["q_rot"],
                                  k_pool=b["k_pool"], v_pool=b["v_pool"], **pos)
            fns[split_spec].launch(split_spec.launch(grid_n, splits), None, pdl=True, q_rot=b["q_rot"],
                                   k_pool=b["k_pool"], v_pool=b["v_pool"], page_table=b["page_table"],
                                   part_acc=acc, part_ml=ml, **pos)
            fns[combine_spec].launch(combine_spec.launch(grid_n), None, pdl=True, part_acc=acc, part_ml=ml,
                                     o16=b["o16"], **pos)
            driver.device().synchronize()
            return b["o16"].download(dtype=np.float16, shape=(n, H, D))
        finally:
            for buf in (acc, ml, chunk):
                buf.free()

    def check_pages(self, upto: int, what: str) -> None:
        """Positions [0, upto) hold f16(k_rot), f16(v) bit for bit; every other slot is still poison."""
        P = self.lay.page_size
        k = self.buf["k_pool"].download(dtype=np.float16, shape=self.lay.pool_shape)
        v = self.buf["v_pool"].download(dtype=np.float16, shape=self.lay.pool_shape)
        t = np.arange(upto)
        phys, slot = self.table[t // P], t % P
        assert np.array_equal(k[phys, :, slot, :], self.k16[:upto]), f"{what}: K pages differ"
        assert np.array_equal(v[phys, :, slot, :], self.v16[:upto], equal_nan=True), f"{what}: V pages differ"
        written = np.zeros(self.lay.pool_shape[0] * P, bool)
        written[phys * P + slot] = True
        rest = ~written.reshape(self.lay.pool_shape[0], P)
        assert (k.transpose(0, 2, 1, 3)[rest] == K_POISON).all(), f"{what}: K written outside the sequence"
        assert np.isnan(v.transpose(0, 2, 1, 3)[rest]).all(), f"{what}: V written outside the sequence"


def _check_o16(o16, ref, tol, what, exact_ulp=True) -> float:
    assert np.isfinite(o16).all(), f"{what}: {o16.size - np.isfinite(o16).sum()} non-finite o16 elements"
    if exact_ulp:
        ulp = np.spacing(np.abs(R.f16(ref))).astype(np.float64) + 1e-5 * np.abs(ref).max()
        bad = np.abs(o16.astype(np.float64) - ref) > ulp
        assert not bad.any(), f"{what}: {bad.sum()} o16 elements more than 1 fp16 ulp off"
    err = rel_err(o16, ref)
    print(f"{what}: o16 rel {err:.2e} (tol {tol:.0e})")
    assert err <= tol, f"{what}: rel error {err:.3e} > {tol}"
    return err


@pytest.mark.parametrize("model", MODELS)
def test_prefill_one_chunk(fns, model):
    dims = MODELS[model]
    rope_spec, attn_spec = AP.prefill_attention_specs(dims, CFG)
    rng = np.random.default_rng()
    for n in LENGTHS[model]:
        pr = Prompt(dims, rng, n)
        q_rot, o16 = pr.chunk(fns, rope_spec, attn_spec, 0, n)
        what = f"{model} n={n}"
        # class (a): rope is elementwise with explicit _rn rounding, numpy's arithmetic; pages are its fp16 cast
        assert np.array_equal(q_rot, pr.q_rot), f"{what}: q_rot differs from the fp32 reference"
        pr.check_pages(n, what)
        _check_o16(o16, pr.ref, REL_TOL, what)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("chunks", CHUNKS, ids=lambda c: "+".join(map(str, c)))
def test_prefill_chunked(fns, model, chunks):
    dims = MODELS[model]
    rope_spec, attn_spec = AP.prefill_attention_specs(dims, CFG)
    pr = Prompt(dims, np.random.default_rng(), sum(chunks))
    _, whole = pr.chunk(fns, rope_spec, attn_spec, 0, pr.total)
    p0 = 0
    for n in chunks:
        q_rot, o16 = pr.chunk(fns, rope_spec, attn_spec, p0, n)
        what = f"{model} chunk [{p0}, {p0 + n})"
        assert np.array_equal(q_rot, pr.q_rot[p0:p0 + n]), f"{what}: q_rot differs"
        _check_o16(o16, pr.ref[p0:p0 + n], REL_TOL, what)
        # class (a): the rows of this chunk are the whole prompt's, bit for bit
        assert o16.tobytes() == whole[p0:p0 + n].tobytes(), f"{what}: o16 differs from the one-chunk prefill"
        p0 += n
    pr.check_pages(p0, f"{model} chunks {chunks}")


def test_prefill_no_split(fns):
    dims = MODELS["tiny"]
    rope_spec, attn_spec = AP.prefill_attention_specs(dims, CFG)
    attn_spec = replace(attn_spec, split=False)
    pr = Prompt(dims, np.random.default_rng(), 300)
    _, o16 = pr.chunk(fns, rope_spec, attn_spec, 0, 300)
    _check_o16(o16, pr.ref, REL_TOL_NOSPLIT, "tiny split=False n=300", exact_ulp=False)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("p0,n", SPLIT_CHUNKS)
def test_prefill_split_kv(fns, model, p0, n):
    dims = MODELS[model]
    rope_spec, attn_spec = AP.prefill_attention_specs(dims, CFG)
    split_spec, combine_spec = AP.split_kv_specs(dims, CFG)
    g_split, g_combine = AP.split_kv_specs(dims, CFG, device_chunk=True)
    g_rope = AP.prefill_attention_specs(dims, CFG, device_chunk=True)[0]
    pr = Prompt(dims, np.random.default_rng(), p0 + n, ref_from=p0)
    if p0:
        pr.chunk(fns, rope_spec, attn_spec, 0, p0)   # the cached prefix, as the unsplit kernel writes it
    _, unsplit = pr.chunk(fns, rope_spec, attn_spec, p0, n)
    runs = [(rope_spec, split_spec, combine_spec, s, None)
            for s in sorted({1, 3, split_spec.max_splits, split_spec.splits_for(p0 + n)})]
    runs.append((g_rope, g_split, g_combine, g_split.max_splits, 64))   # a chunk graph's launches
    runs.append((rope_spec, replace(split_spec, pack_gqa=False), combine_spec, split_spec.splits_for(p0 + n), None))
    for rope_, split_, combine_, splits, rows in runs:
        o16 = pr.chunk_split_kv(fns, rope_, split_, combine_, p0, n, splits, rows)
        what = (f"{model} split-KV chunk [{p0}, {p0 + n}) splits={splits}{' device_chunk' if rows else ''}"
                f"{'' if split_.pack_gqa else ' unpacked'}")
        pr.check_pages(p0 + n, what)
        _check_o16(o16, pr.ref, REL_TOL, what)
        # class (a): the key blocks and their fold are the unsplit kernel's, whichever CTA computed them
        assert o16.tobytes() == unsplit.tobytes(), f"{what}: o16 differs from the unsplit kernel's"
