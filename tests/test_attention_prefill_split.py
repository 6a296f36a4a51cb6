"""CPU tests of the prefill attention's key blocks and its split-KV variant (no GPU): the variants'
parameters and grids, the splits rule, spec validation, each variant's absent parameters as constants, the
walk of the key blocks (every block by exactly one split, its tiles in order, whatever the split count), and
a numpy model of the kernels' math (per-block online softmax in base-2 units with the -inf guard, the fold
in ascending block order) equal to attention. Compilation (no spills, no local memory) is
tests/test_kernels_compile.py's, the parameter lists tests/test_kernel_params.py's; the GPU tests compare the
kernels' bits across chunks (tests/gpu/test_chunk_invariance.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nanoqwen import config
from nanoqwen import reference as R
from nanoqwen.codegen.kernels import attention_prefill as AP
from nanoqwen.codegen.render import render
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
ATTN = AP.prefill_attention_specs(QWEN25_7B, CFG)[1]
SPLIT, COMBINE = AP.split_kv_specs(QWEN25_7B, CFG)


GRAPH_SPLIT, GRAPH_COMBINE = AP.split_kv_specs(QWEN25_7B, CFG, device_chunk=True)
GRAPH_ROPE = AP.prefill_attention_specs(QWEN25_7B, CFG, device_chunk=True)[0]


def test_variant_parameters_and_grid():
    names = lambda spec: [p.name for p in spec.kernel_params]  # noqa: E731
    assert names(ATTN) == ["q_rot", "k_pool", "v_pool", "page_table", "o16", "p0", "n"]
    assert names(SPLIT) == ["q_rot", "k_pool", "v_pool", "page_table", "part_acc", "part_ml", "p0", "n"]
    assert names(COMBINE) == ["part_acc", "part_ml", "o16", "p0", "n"]
    assert names(GRAPH_SPLIT) == ["q_rot", "k_pool", "v_pool", "page_table", "part_acc", "part_ml", "chunk"]
    assert names(GRAPH_COMBINE) == ["part_acc", "part_ml", "o16", "chunk"]
    assert names(GRAPH_ROPE)[-1] == "chunk" and "p0" not in names(GRAPH_ROPE)
    assert SPLIT == dataclasses.replace(ATTN, max_splits=AP.MAX_KV_SPLITS, pack_gqa=True)   # same tiles, same smem
    assert GRAPH_SPLIT == dataclasses.replace(SPLIT, device_chunk=True)
    assert ATTN.block_keys == COMBINE.block_keys == GRAPH_COMBINE.block_keys == CFG.prefill.attention_block_keys
    assert SPLIT.launch(32, 16).grid == (4, 4, 16) and ATTN.launch(32).grid == (1, 28, 1)   # 224 rows a KV head
    assert SPLIT.launch(8, 16).grid == (1, 4, 16) and SPLIT.launch(64, 16).grid == (7, 4, 16)
    assert COMBINE.launch(32).grid == (32, 28, 1) and COMBINE.launch(32).block == (128, 1, 1)
    with pytest.raises(ValueError, match="17 KV splits, the variant takes 1..16"):
        SPLIT.launch(32, 17)
    with pytest.raises(ValueError, match="2 KV splits, the variant takes 1..1"):
        ATTN.launch(32, 2)
    with pytest.raises(SpecError, match="max_splits must be in 1..65535"):
        dataclasses.replace(ATTN, max_splits=0).validate()
    for bad in (0, 96, 100):
        with pytest.raises(SpecError, match="block_keys must be a positive multiple of 64"):
            dataclasses.replace(ATTN, block_keys=bad).validate()


def test_absent_parameters_are_constants():
    """Each variant's absent parameters are constants (null pointers, zero scalars), read only in the
    branches it discards; its own parameter list is the kernel's."""
    src, split_src, graph_src = render(ATTN), render(SPLIT), render(GRAPH_SPLIT)
    assert "constexpr float* part_acc = nullptr;" in src and "constexpr float* part_ml = nullptr;" in src
    assert "constexpr int MAX_SPLITS = 1;" in src and "constexpr int MAX_SPLITS = 16;" in split_src
    assert "constexpr f16* o16 = nullptr;" in split_src and "o16 = nullptr" not in src
    assert "constexpr const int* chunk = nullptr;" in src and "constexpr bool DEVICE_CHUNK = false;" in src
    assert "constexpr int p0 = 0;" in graph_src and "constexpr int n = 0;" in graph_src
    assert "constexpr bool DEVICE_CHUNK = true;" in graph_src and "const int* __restrict__ chunk" in graph_src
    assert "constexpr int BLOCK_KEYS = 256;" in src and "constexpr int BLOCK_KEYS = 256;" in render(COMBINE)
    assert "constexpr int p0 = 0;" in render(GRAPH_ROPE) and "constexpr int p0 = 0;" in render(GRAPH_COMBINE)


@pytest.mark.parametrize("keys,splits", [(1, 1), (33, 1), (256, 1), (257, 2), (1064, 5), (2048, 8),
                                         (4096, 16), (4097, 16), (32768, 16)])
def test_splits_rule(keys, splits):
    """One split per key block of 256 keys, at most max_splits: 4096 keys = 16 x 28 = 448 CTAs; past that
    a split walks several blocks."""
    assert SPLIT.splits_for(keys) == splits == min(AP.MAX_KV_SPLITS, SPLIT.blocks(keys))


def next_tile(it: int, tiles: int, blk_step: int, tpb: int) -> int:
    """attention_prefill.cu.j2's next_tile."""
    nxt = it + 1 if (it + 1) % tpb else it + 1 + (blk_step - 1) * tpb
    return nxt if nxt < tiles else -1


def walk(z: int, splits: int, tiles: int, tpb: int) -> list[int]:
    """The KV tiles CTA z of ``splits`` walks, in order (the kernel's loop; unsplit: z = 0, splits = 1)."""
    out, it = [], z * tpb
    if it >= tiles:
        return out
    while it >= 0:
        out.append(it)
        it = next_tile(it, tiles, splits, tpb)
    return out


@pytest.mark.parametrize("tiles", [1, 3, 4, 5, 16, 63, 64, 65, 200])
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_block_walk(tiles, splits):
    """Whatever the split count, every key block is walked by exactly one CTA, whole (its tiles up to the
    last the CTA's rows see) and in order, and a CTA walks its blocks in ascending order: the partials do
    not depend on how many splits the grid has."""
    tpb = SPLIT.block_keys // SPLIT.bkv
    walks = [walk(z, splits, tiles, tpb) for z in range(splits)]
    assert sorted(t for w in walks for t in w) == list(range(tiles))
    for z, w in enumerate(walks):
        assert w == sorted(w) and all(t // tpb % splits == z for t in w)
        for blk in {t // tpb for t in w}:
            assert [t for t in w if t // tpb == blk] == list(range(blk * tpb, min(tiles, (blk + 1) * tpb)))


def _blocks(q, k16, v16, pos, bkv, block_keys):
    """The kernels' math in numpy for query rows at positions ``pos``: per key block, the online softmax over
    its KV tiles from a fresh state (base-2 units, the -inf guard) -> partial (m2, l, acc) [blocks, n, heads];
    then the fold of the blocks each row sees, in ascending order, and the normalization."""
    n, H, D = q.shape
    G = H // k16.shape[1]
    k = np.repeat(k16.astype(np.float32), G, axis=1)        # [S, H, D]: query head h reads KV head h // G
    v = np.repeat(v16.astype(np.float32), G, axis=1)
    scale = np.float32(np.log2(np.e) / np.sqrt(D))
    end = int(pos.max()) + 1
    nblk = -(-end // block_keys)
    m = np.full((nblk, n, H), -np.inf, np.float32)
    l = np.zeros((nblk, n, H), np.float32)
    acc = np.zeros((nblk, n, H, D), np.float32)
    ref = lambda x: np.where(x == -np.inf, np.float32(0), x)  # noqa: E731  (softmax_ref)
    for j in range(nblk):
        for t in range(j * block_keys // bkv, min(-(-end // bkv), (j + 1) * block_keys // bkv)):
            keys = np.arange(t * bkv, min((t + 1) * bkv, end))
            s = np.einsum("nhd,khd->nhk", q, k[keys]) * scale
            s = np.where(keys[None, None, :] <= pos[:, None, None], s, np.float32(-np.inf))
            mx = np.maximum(m[j], s.max(axis=-1))
            alpha = np.exp2(m[j] - ref(mx))
            p = np.exp2(s - ref(mx)[..., None])
            l[j] = l[j] * alpha + p.sum(axis=-1)
            acc[j] = acc[j] * alpha[..., None] + np.einsum("nhk,khd->nhd", p, v[keys])
            m[j] = mx
    M, Lm, A = m[0].copy(), l[0].copy(), acc[0].copy()
    for j in range(1, nblk):
        sees = (j * block_keys <= pos)[:, None]
        mx = np.maximum(M, m[j])
        wa, wb = np.exp2(M - mx), np.exp2(m[j] - mx)
        M = np.where(sees, mx, M)
        Lm = np.where(sees, Lm * wa + l[j] * wb, Lm)
        A = np.where(sees[..., None], A * wa[..., None] + acc[j] * wb[..., None], A)
    return A * (np.float32(1) / Lm)[..., None], (m, l, acc)


@pytest.mark.parametrize("p0,n", [(0, 1), (0, 17), (100, 32), (250, 20), (1000, 64)])
@pytest.mark.parametrize("block_keys", [64, 256])
def test_block_fold_math_equals_attention(p0, n, block_keys):
    d = tiny_dims()
    rng = np.random.default_rng(7)
    T = p0 + n
    q = (3 * rng.standard_normal((n, d.heads, d.head_dim))).astype(np.float32)
    k16 = R.f16(3 * rng.standard_normal((T, d.kv_heads, d.head_dim)))
    v16 = R.f16(rng.standard_normal((T, d.kv_heads, d.head_dim)))
    pos = p0 + np.arange(n)
    with np.errstate(invalid="raise"):   # a NaN from -inf - -inf fails here
        out, (m, l, acc) = _blocks(q, k16, v16, pos, SPLIT.bkv, block_keys)
    ref = R.attention(q, k16, v16, pos)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    empty = l == 0   # a block with no key visible to a row keeps the identity partial (-inf, 0, 0), unread
    assert (m[empty] == -np.inf).all() and (acc[empty] == 0).all()
    blocks = np.arange(m.shape[0])[:, None] * block_keys
    assert (empty[..., 0] == (blocks > pos[None, :])).all()   # exactly the blocks past the row's position


def row_map(gqa: int, n: int, bq: int, packed: bool) -> dict:
    """The kernel's rows as templates/attention_prefill.cu.j2 maps them (row_token, row_head, kv_end and the warps'
    skip bound), in Python: {(CTA x, grid row y): [(token, query head) of each CTA row]} over a one-KV-head model
    of ``gqa`` query heads (grid row y is the KV head packed, else the query head)."""
    rpt = gqa if packed else 1
    out = {}
    for x in range(-(-n * rpt // bq)):
        for y in range(1 if packed else gqa):
            rows = range(x * bq, min((x + 1) * bq, n * rpt))
            out[x, y] = [(r // rpt, y * gqa + r % gqa if packed else y) for r in rows]
            kv_end = min(n, (((x + 1) * bq - 1) // rpt + 1) if packed else (x + 1) * bq)
            assert kv_end == 1 + max(t for t, _ in out[x, y])   # every key a row of the CTA sees, no more
            for w0 in range(x * bq, (x + 1) * bq, 16):          # a warp's skip bound: its last row's token
                warp = [r // rpt for r in range(w0, w0 + 16) if r < n * rpt]
                assert not warp or (w0 + 15) // rpt >= max(warp)
    return out


@pytest.mark.parametrize("gqa", [7, 1, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 32, 33, 64])
def test_packed_rows_cover_every_token_and_head_once(gqa, n):
    """pack_gqa: the CTA rows over (x, kv head) are the n x gqa (token, query head) pairs, each once, as the
    unpacked grid's are; a CTA's kv_end bounds exactly its rows' keys."""
    for packed in (False, True):
        pairs = [p for rows in row_map(gqa, n, 64, packed).values() for p in rows]
        assert sorted(pairs) == [(t, h) for t in range(n) for h in range(gqa)], (packed, n)
