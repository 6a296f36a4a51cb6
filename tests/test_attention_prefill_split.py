"""CPU tests of the split-KV prefill attention (no GPU): the variant's parameters and grid, the splits rule,
spec validation, the unsplit kernel's source untouched by the variant's branches, and a numpy model of the
kernel's split / combine math (per-split tile ranges, online softmax in base-2 units with the -inf guard,
log-sum-exp merge) equal to unsplit attention. Compilation (no spills, no local memory) is
tests/test_kernels_compile.py's, the parameter lists tests/test_kernel_params.py's."""

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


def test_variant_parameters_and_grid():
    names = lambda spec: [p.name for p in spec.kernel_params]  # noqa: E731
    assert names(ATTN) == ["q_rot", "k_pool", "v_pool", "page_table", "o16", "p0", "n"]
    assert names(SPLIT) == ["q_rot", "k_pool", "v_pool", "page_table", "part_acc", "part_ml", "p0", "n"]
    assert names(COMBINE) == ["part_acc", "part_ml", "o16", "splits", "n"]
    assert SPLIT == dataclasses.replace(ATTN, max_splits=AP.MAX_KV_SPLITS)   # same tiles, same smem
    assert SPLIT.launch(32, 16).grid == (1, 28, 16) and ATTN.launch(32).grid == (1, 28, 1)
    assert COMBINE.launch(32).grid == (32, 28, 1) and COMBINE.launch(32).block == (128, 1, 1)
    with pytest.raises(ValueError, match="17 KV splits, the variant takes 1..16"):
        SPLIT.launch(32, 17)
    with pytest.raises(ValueError, match="2 KV splits, the variant takes 1..1"):
        ATTN.launch(32, 2)
    with pytest.raises(SpecError, match="max_splits must be in 1..65535"):
        dataclasses.replace(ATTN, max_splits=0).validate()


def test_unsplit_source_reads_no_partials():
    """The unsplit variant's partial pointers are null constants, the split one's o16 is: each variant's
    discarded branch compiles against nullptr, and its own parameter list is the kernel's."""
    src, split_src = render(ATTN), render(SPLIT)
    assert "constexpr float* part_acc = nullptr;" in src and "constexpr float* part_ml = nullptr;" in src
    assert "constexpr int MAX_SPLITS = 1;" in src and "constexpr int MAX_SPLITS = 16;" in split_src
    assert "constexpr f16* o16 = nullptr;" in split_src and "o16 = nullptr" not in src


@pytest.mark.parametrize("keys,splits", [(1, 1), (33, 1), (128, 1), (129, 1), (192, 1), (193, 2),
                                         (1064, 8), (2048, 16), (4096, 16)])
def test_splits_rule(keys, splits):
    """At least 2 KV tiles of 64 keys per split, at most max_splits: 4096 keys = 16 x 28 = 448 CTAs."""
    assert SPLIT.splits_for(keys) == splits
    tiles = -(-keys // SPLIT.bkv)
    assert splits == 1 or tiles // splits >= 2


def _split_kv(q, k16, v16, p0, bkv, splits):
    """The kernel's math in numpy for one chunk (one q tile): per split, the online softmax over its KV
    tiles in base-2 units -> partial (m2, l, acc) [splits, n, heads]; then the combine's merge."""
    n, H, D = q.shape
    G = H // k16.shape[1]
    k = np.repeat(k16.astype(np.float32), G, axis=1)        # [S, H, D]: query head h reads KV head h // G
    v = np.repeat(v16.astype(np.float32), G, axis=1)
    scale = np.float32(np.log2(np.e) / np.sqrt(D))
    pos = p0 + np.arange(n)
    tiles = -(-(p0 + n) // bkv)
    m = np.full((splits, n, H), -np.inf, np.float32)
    l = np.zeros((splits, n, H), np.float32)
    acc = np.zeros((splits, n, H, D), np.float32)
    ref = lambda x: np.where(x == -np.inf, np.float32(0), x)  # noqa: E731  (softmax_ref)
    for z in range(splits):
        for t in range(z * tiles // splits, (z + 1) * tiles // splits):
            keys = np.arange(t * bkv, min((t + 1) * bkv, p0 + n))
            s = np.einsum("nhd,khd->nhk", q, k[keys]) * scale
            s = np.where(keys[None, None, :] <= pos[:, None, None], s, np.float32(-np.inf))
            mx = np.maximum(m[z], s.max(axis=-1))
            alpha = np.exp2(m[z] - ref(mx))
            p = np.exp2(s - ref(mx)[..., None])
            l[z] = l[z] * alpha + p.sum(axis=-1)
            acc[z] = acc[z] * alpha[..., None] + np.einsum("nhk,khd->nhd", p, v[keys])
            m[z] = mx
    w = np.exp2(m - ref(m.max(axis=0)))
    return (acc * w[..., None]).sum(axis=0) / (l * w).sum(axis=0)[..., None], (m, l, acc)


@pytest.mark.parametrize("p0,n", [(0, 1), (0, 17), (100, 32), (1000, 64)])
@pytest.mark.parametrize("splits", [1, 3, AP.MAX_KV_SPLITS])
def test_split_combine_math_equals_attention(p0, n, splits):
    d = tiny_dims()
    rng = np.random.default_rng(7)
    T = p0 + n
    q = (3 * rng.standard_normal((n, d.heads, d.head_dim))).astype(np.float32)
    k16 = R.f16(3 * rng.standard_normal((T, d.kv_heads, d.head_dim)))
    v16 = R.f16(rng.standard_normal((T, d.kv_heads, d.head_dim)))
    with np.errstate(invalid="raise"):   # a NaN from -inf - -inf fails here
        out, (m, l, acc) = _split_kv(q, k16, v16, p0, SPLIT.bkv, splits)
    ref = R.attention(q, k16, v16, p0 + np.arange(n))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    empty = l == 0   # a split with no key visible to a row keeps the identity partial (-inf, 0, 0)
    assert (m[empty] == -np.inf).all() and (acc[empty] == 0).all()
    if splits > -(-T // SPLIT.bkv):   # more splits than KV tiles: some split walks none
        assert empty.any()
