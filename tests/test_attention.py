"""CPU tests of the attention side (no GPU): every rope_append / attention_decode / attention_combine
variant renders and compiles for sm_90a without spills or local memory (tests/test_kernel_params.py checks
its generated parameter list), the SASS really uses the bulk-copy engine (mma: cp.async) and mbarriers;
spec validation; and the paged KV cache's layout, reservation and error cases."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen import resources
from nanoqwen.codegen.gpu import DEFAULT as DEFAULT_GPU
from nanoqwen.codegen.kernels import attention as A
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime.paged_kv import KVCacheError, KVLayout, PageTable
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
# head_dim 64 like Qwen2.5-0.5B (14 query heads, 2 KV heads)
D64 = dataclasses.replace(QWEN25_7B, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864)
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims(), "hd64": D64}
VARIANTS = [s for d in MODELS.values() for s in A.specs_for_model(d, CFG)] + [
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=3, consumer_warps=4),   # bulk before mma
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=2, consumer_warps=2),
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=5, splits=16, stages=2, consumer_warps=8),
    A.AttentionDecodeSpec(head_dim=64, kv_heads=2, gqa=7, splits=66, stages=4, consumer_warps=2),
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=2, consumer_warps=8),
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, pipeline="plain"),
    A.AttentionDecodeSpec(head_dim=64, kv_heads=2, gqa=7, splits=66, pipeline="plain"),
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=4, pipeline="mma"),
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=6, consumer_warps=2, pipeline="mma"),
    A.AttentionDecodeSpec(head_dim=64, kv_heads=2, gqa=7, splits=66, stages=4, pipeline="mma", m=8),
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=8, pipeline="mma"),   # dynamic ring
    # rows paired in the mma tile (pair_rows): 168 registers at 2 CTAs an SM (at 3 the cap spills, as unpaired)
    A.AttentionDecodeSpec(head_dim=128, kv_heads=4, gqa=7, splits=33, stages=4, pipeline="mma", m=8, pair_rows=True,
                          ctas_per_sm=2),
    A.AttentionDecodeSpec(head_dim=64, kv_heads=2, gqa=7, splits=66, stages=4, pipeline="mma", m=16, pair_rows=True),
]


@pytest.fixture(scope="module")
def built(fresh_build):
    return {b.spec: b for b in fresh_build(VARIANTS)}


@pytest.mark.parametrize("spec", VARIANTS, ids=[s.uri for s in VARIANTS])
def test_compiles_without_spills_or_local_memory(built, spec):
    b = built[spec]
    r = b.resources
    assert (r.spill_stores, r.spill_loads) == (0, 0), f"{spec.uri}: {r}"
    assert r.local_bytes == 0 and r.max_stack == 0, f"{spec.uri}: {r}"
    assert r.registers * b.launch.threads <= 65536
    if isinstance(spec, A.AttentionDecodeSpec):
        # the Python smem estimate is what validate() checks against the 48 KB static limit
        assert spec.static_smem() <= r.shared_static <= spec.static_smem() + 128, r
        assert r.shared_static <= A.STATIC_SMEM_LIMIT
        assert b.launch.smem == (spec.ring_bytes() if spec.ring_dynamic else 0)


def test_decode_sass_uses_bulk_copy_and_mbarriers(built):
    if resources.tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    spec = dataclasses.replace(A.decode_specs(QWEN25_7B, CFG)[1], pipeline="bulk", stages=3)
    sass = resources.sass(built[spec].cubin)
    assert sass.count("UBLKCP") == 2, "one bulk copy each for the K and the V page"
    assert "SYNCS.ARRIVE.TRANS64" in sass and "SYNCS.PHASECHK" in sass
    # exactly two CTA-wide barriers (after mbarrier init, after both roles left their branches) and one
    # named barrier over the 4 consumer warps only (before the merge buffer overwrites the ring)
    assert len(re.findall(r"BAR\.SYNC\S* 0x0 ;", sass)) == 2
    assert len(re.findall(r"BAR\.SYNC\S* 0x1, 0x80 ;", sass)) == 1
    assert "LDL" not in sass and "STL" not in sass
    plain = resources.sass(built[dataclasses.replace(spec, pipeline="plain")].cubin)
    assert "UBLKCP" not in plain and "SYNCS" not in plain


def test_mma_decode_sass_is_tensor_core_work():
    """pipeline "mma": per k16 step of a page two ldmatrix-fed mma.sync pairs for S (q hi and lo), per pair
    of dim tiles an ldmatrix.trans and four for P V. The producer's 32 lanes copy by cp.async, 16 bytes x 16
    per lane a page (8 KB of K and V), completing on the full barrier by one cp.async.mbarrier.arrive each;
    nothing goes through the copy engine (async proxy), so no fence.proxy.async.global either."""
    if resources.tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    for m in (1, 8):
        spec = dataclasses.replace(A.decode_specs(QWEN25_7B, CFG, m=m)[1], pipeline="mma", stages=4)
        sass = resources.sass(codegen.build(spec).cubin)
        assert sass.count("HMMA.16816.F32") == 4 * 128 // 16 + 4 * 128 // 16
        assert sass.count("LDSM.16.M88.4") == 128 // 16 and sass.count("LDSM.16.MT88.4") == 128 // 16
        assert sass.count("LDGSTS.E.BYPASS.128") == 2 * 16 * 128 * 2 // 16 // 32
        assert sass.count("ARRIVES.LDGSTSBAR.64.ARVCNT") == 1
        assert "UBLKCP" not in sass and "FENCE.VIEW.ASYNC.G" not in sass
        # m > 1 caps its registers for multirow.attention_ctas_per_sm CTAs an SM and spills by design
        assert spec.ctas_per_sm > 1 or ("LDL" not in sass and "STL" not in sass)


def test_mma_decode_copies_the_older_pages_before_its_wait():
    """M = 1, mma: griddepcontrol.wait three times (the consumers before q_rot; the producer before the newest
    page and after its pages, where thread 0 stamps the timeline), the pages before it copied ahead of it; the
    bulk pipeline and M > 1 wait once, first."""
    if resources.tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    for m, pipeline, waits in ((1, "mma", 3), (8, "mma", 1), (1, "bulk", 1)):
        spec = dataclasses.replace(A.decode_specs(QWEN25_7B, CFG, m=m)[1], pipeline=pipeline, stages=4)
        assert resources.sass(codegen.build(spec).cubin).count("ACQBULK") == waits, (m, pipeline)


def test_pair_rows_from_the_config_on_the_mma_pipeline_only():
    """multirow.attention_pair_rows pairs the rows of its bucket and the larger ones; m = 1 (the decode step), the
    smaller buckets and the bulk pipeline keep one row a CTA. Pairs merge twice the heads: the shared buffers grow,
    the launch does not. Bad values are refused."""
    on, off = (dataclasses.replace(CFG, multirow=dataclasses.replace(CFG.multirow, attention_pair_rows=v))
               for v in (4, 0))
    bulk = dataclasses.replace(on, attention=dataclasses.replace(on.attention, pipeline="bulk"))
    assert [A.decode_specs(QWEN25_7B, on, m=m)[1].pair_rows for m in (1, 2, 4, 8, 16)] == [False, False, True, True,
                                                                                           True]
    assert not A.decode_specs(QWEN25_7B, bulk, m=8)[1].pair_rows
    paired, alone = A.decode_specs(QWEN25_7B, on, m=8)[1], A.decode_specs(QWEN25_7B, off, m=8)[1]
    assert dataclasses.replace(alone, pair_rows=True) == paired and paired.launch() == alone.launch()
    assert paired.static_smem() - alone.static_smem() == paired.consumer_warps * paired.gqa * 2 * 4
    assert "pair_rows" not in alone.uri and "pair_rows1" in paired.uri   # a late field: earlier names stay
    for bad in (1, -1, 17):
        with pytest.raises(config.ConfigError, match="attention_pair_rows"):
            dataclasses.replace(CFG.multirow, attention_pair_rows=bad)


def test_specs_for_model_fill_the_device():
    rope, dec, comb = A.decode_specs(QWEN25_7B, CFG)
    assert dec.launch().grid == (4, 33, 1) and dec.gqa == 7 and dec.page_size == CFG.kv_cache.page_size
    assert comb.splits == dec.splits and comb.heads == 28
    assert rope.launch().grid == (32, 1, 1) and rope.launch().block == (64, 1, 1)
    assert A.partial_bytes(dec) == (28 * 33 * 128 * 4, 28 * 33 * 2 * 4)
    assert A.decode_specs(tiny_dims(), CFG)[1].splits == CFG.attention.ctas_per_sm * DEFAULT_GPU.sm_count


@pytest.mark.parametrize("kw,match", [
    (dict(head_dim=96), "head_dim"),                 # 12 lanes per row do not tile a warp
    (dict(consumer_warps=3), "consumer_warps"),      # 16 tokens do not split over 3 warps
    (dict(consumer_warps=16), "consumer_warps"),     # 1 token per warp < 2 rows per pass
    (dict(stages=9), "stages"),
    (dict(stages=8, gqa=8, consumer_warps=8, head_dim=256), "shared memory"),
    (dict(splits=0), "splits"),
    (dict(pipeline="tma"), "pipeline"),
    (dict(pipeline="mma", page_size=32), "16-token pages"),
    (dict(pipeline="mma", gqa=17), "query heads"),
    (dict(pipeline="mma", stages=3), "multiple of consumer_warps"),
    (dict(pair_rows=True, m=8), "pair_rows"),                         # the pairs are the mma tile's rows
    (dict(pipeline="mma", stages=4, pair_rows=True), "pair_rows"),    # one row: nothing to pair
    (dict(pipeline="mma", stages=4, pair_rows=True, m=8, gqa=9), "pair_rows"),   # 9 heads: no room for a second row
])
def test_decode_spec_rejects_impossible_variants(kw, match):
    base = dict(head_dim=128, kv_heads=4, gqa=7, splits=33)
    with pytest.raises(SpecError, match=match):
        A.AttentionDecodeSpec(**(base | kw)).validate()


def test_other_specs_reject_bad_head_dim():
    with pytest.raises(SpecError, match="head_dim"):
        A.RopeAppendSpec(head_dim=96, heads=7, kv_heads=1).validate()
    with pytest.raises(SpecError, match="head_dim"):
        A.AttentionCombineSpec(head_dim=48, heads=7, splits=4).validate()


# ---------------------------------------------------------------- paged KV cache (host logic)

def test_layout_sizes_7b():
    lay = KVLayout.for_model(QWEN25_7B, CFG, max_tokens=4096)
    assert lay.page_bytes == 4096 and lay.num_pages == 256 and lay.pool_shape == (256, 4, 16, 128)
    assert lay.pool_bytes == 256 * 4 * 4096
    assert lay.total_bytes == 2 * 28 * lay.pool_bytes + 256 * 4  # 224 MiB + the table
    assert lay.capacity_tokens == 4096
    assert lay.element_offset(3, 2, 5) == ((3 * 4 + 2) * 16 + 5) * 128
    # never larger than the model's positions
    small = dataclasses.replace(tiny_dims(), max_positions=100)
    lay = KVLayout.for_model(small, CFG, max_tokens=10_000)
    assert lay.num_pages == 7 and lay.capacity_tokens == 100 and lay.table_len == 7


def test_reserve_release_reuse():
    lay = KVLayout(layers=2, kv_heads=1, head_dim=128, page_size=16, num_pages=10, max_positions=4096)
    order = np.random.default_rng(0).permutation(10)
    pt = PageTable(lay, order)
    table = pt.reserve(33)  # 3 pages
    assert table.dtype == np.int32 and table.shape == (10,)
    assert table[:3].tolist() == order[:3].tolist() and (table[3:] == -1).all()
    assert pt.reserved_tokens == 48 and pt.locate(32) == (int(order[2]), 0) and pt.locate(17) == (int(order[1]), 1)
    pt.reserve(40)  # still 3 pages: nothing moves
    assert table[:3].tolist() == order[:3].tolist() and pt.mapped_pages == 3
    pt.reserve(160)  # grows to the whole pool, keeping the first pages
    assert sorted(table.tolist()) == list(range(10)) and table[:3].tolist() == order[:3].tolist()
    with pytest.raises(KVCacheError, match="outside the reservation"):
        pt.locate(160)
    pt.release()
    assert (table == -1).all() and pt.mapped_pages == 0
    assert len(set(pt.reserve(160).tolist())) == 10


def test_reserve_errors_change_nothing():
    lay = KVLayout(layers=1, kv_heads=2, head_dim=64, page_size=16, num_pages=4, max_positions=50)
    pt = PageTable(lay)
    pt.reserve(20)
    before = pt.table.copy()
    with pytest.raises(KVCacheError, match="max_position_embeddings"):
        pt.reserve(51)
    with pytest.raises(KVCacheError, match="at least one token"):
        pt.reserve(0)
    assert (pt.table == before).all() and pt.mapped_pages == 2
    lay = KVLayout(layers=1, kv_heads=2, head_dim=64, page_size=16, num_pages=4, max_positions=4096)
    pt = PageTable(lay)
    with pytest.raises(KVCacheError, match="capacity of 64 tokens"):
        pt.reserve(65)
    assert (pt.table == -1).all() and pt.reserve(64).tolist() == [0, 1, 2, 3]


def test_layout_and_table_reject_bad_input():
    with pytest.raises(KVCacheError, match="num_pages"):
        KVLayout(layers=1, kv_heads=1, head_dim=128, page_size=16, num_pages=0, max_positions=16)
    with pytest.raises(KVCacheError, match="multiple of 16 bytes"):
        KVLayout(layers=1, kv_heads=1, head_dim=4, page_size=1, num_pages=1, max_positions=16)
    lay = KVLayout(layers=1, kv_heads=1, head_dim=128, page_size=16, num_pages=3, max_positions=64)
    with pytest.raises(KVCacheError, match="permutation"):
        PageTable(lay, order=[0, 0, 1])
