"""Chunk invariance on the CPU (DESIGN.md section 12; docs/architecture.md, "Chunk invariance"): for every
chunk size the prefill can meet (1 .. prefill.chunk_tokens rows, launched kernel by kernel or replayed as a
chunk graph), the kernel specs it launches share everything that fixes the order of a row's arithmetic:

- the GEMM of each role: one family (gemm_int4: mma.sync m16n8k16, K walked in ascending k16 steps from a
  zero accumulator), no split-K, the same N, K, scale group, epilogue and bias; only the tile M / N and the
  k-tile (which does not change the order of the k16 steps) vary;
- the attention: the same key blocks (block_keys), KV tile, fp16 hi + lo split and head shape, and its
  combine the same key blocks; the RMSNorm one spec (one CTA per row, one reduction tree).

In the SASS of every prefill GEMM the only MMA is HMMA.16816.F32 and no reduction goes through atomics
(RED / ATOM: split-K). The GPU tests compare the bits (tests/gpu/test_chunk_invariance.py)."""

from __future__ import annotations

import pytest

from nanoqwen import config
from nanoqwen.codegen import resources
from nanoqwen.codegen.kernels import attention_prefill as AP
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import prefill as prefill_mod
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
ROLES = ("qkv", "o_proj", "gate_up", "down")


def launched(specs: dict, n: int, graph: bool) -> dict:
    """Role -> the spec a chunk of n rows launches (runtime/prefill.py's choice)."""
    small_m = CFG.prefill.small_m_tokens
    out = {r: specs["prefill." + prefill_mod.gemm_role(r, n, small_m)] for r in ROLES}
    out["rmsnorm"] = specs["prefill.rmsnorm"]
    if graph:
        out["attention"] = specs["prefill.graph.attention"]
        out["combine"] = specs["prefill.graph.attention_combine"]
    else:
        out["attention"] = specs["prefill." + prefill_mod.gemm_role("attention", n, small_m)]
        out["combine"] = specs["prefill.small.attention_combine"]
    return out


def row_order(role: str, spec):
    """What fixes the order of one row's arithmetic in a kernel of this role."""
    if role in ROLES:
        return (spec.family, spec.split_k, spec.n, spec.k, spec.group, spec.epilogue, spec.bias,
                spec.group % spec.bk == 0)
    if role == "attention":
        return (spec.family, spec.block_keys, spec.bkv, spec.split, spec.head_dim, spec.heads, spec.kv_heads)
    if role == "combine":
        return (spec.family, spec.block_keys, spec.head_dim)
    return spec


@pytest.mark.parametrize("model", MODELS)
def test_every_chunk_size_shares_the_row_order(model):
    specs = prefill_mod.prefill_specs(MODELS[model], CFG)
    chunks = [(n, False) for n in range(1, CFG.prefill.chunk_tokens + 1)]
    chunks += [(b, True) for b in CFG.prefill.graph_buckets]
    orders = {}
    for n, graph in chunks:
        for role, spec in launched(specs, n, graph).items():
            orders.setdefault(role, set()).add(row_order(role, spec))
    assert all(len(o) == 1 for o in orders.values()), {r: o for r, o in orders.items() if len(o) > 1}
    for role in ROLES:
        (family, split_k, *_rest, k_tile_in_group), = orders[role]
        assert family == "gemm_int4" and split_k == 1 and k_tile_in_group
    (attn,) = orders["attention"]
    assert attn[1] == CFG.prefill.attention_block_keys and attn[1] % attn[2] == 0
    # and the tiles do vary: the invariance is not bought by running one tile shape for every chunk
    tiles = {(s.bm, s.bn) for n, graph in chunks for s in [launched(specs, n, graph)["down"]]}
    assert len(tiles) == 2


def test_graph_buckets_are_usable():
    """The default buckets are all replayable: within small_m_tokens and chunk_tokens."""
    p = CFG.prefill
    assert prefill_mod.usable_buckets(p.graph_buckets, p.small_m_tokens, p.chunk_tokens) == list(p.graph_buckets)
    assert prefill_mod.usable_buckets((8, 16, 32, 64), 32, 512) == [8, 16, 32]
    assert prefill_mod.usable_buckets((8, 16, 32, 64), 64, 17) == [8, 16]
    assert prefill_mod.usable_buckets((8, 16), 0, 512) == []


def _gemm_specs():
    return [s for d in MODELS.values() for s in G.specs_for_model(d, CFG) if isinstance(s, G.GemmInt4Spec)]


GEMMS = _gemm_specs()


@pytest.fixture(scope="module")
def built(fresh_build):
    return {b.spec: b for b in fresh_build(GEMMS)}


@pytest.mark.skipif(resources.tool("cuobjdump") is None and resources.tool("nvdisasm") is None,
                    reason="no cuobjdump / nvdisasm to read SASS")
@pytest.mark.parametrize("spec", GEMMS, ids=[s.uri for s in GEMMS])
def test_gemm_sass_has_one_mma_shape_and_no_atomics(built, spec):
    sass = resources.sass(built[spec].cubin)
    mmas = {ln.split()[1].rstrip(";") for ln in sass.splitlines()
            if len(ln.split()) > 1 and ln.split()[1].startswith(("HMMA", "HGMMA", "IMMA"))}
    assert mmas == {"HMMA.16816.F32"}, f"{spec.uri}: MMA instructions {mmas}"
    atomics = [ln.strip() for ln in sass.splitlines() if " RED." in ln or " ATOM" in ln or " RED " in ln]
    assert not atomics, f"{spec.uri}: atomics (split-K) in the SASS: {atomics[:3]}"


def test_attention_specs_follow_the_config():
    cfg = config.default()
    for dims in MODELS.values():
        rope, attn = AP.prefill_attention_specs(dims, cfg)
        split, combine = AP.split_kv_specs(dims, cfg)
        assert attn.block_keys == split.block_keys == combine.block_keys == cfg.prefill.attention_block_keys
        assert not (rope.device_chunk or attn.device_chunk or combine.device_chunk)
