"""Prefill kernels on the CPU (no GPU): the INT4 tensor-core GEMM, the prefill RMSNorm, RoPE append and
causal flash attention render and compile for sm_90a for the 7B and tiny-model dims (GEMMs with the default
and the small-M tiles) plus the non-default variants (f16 epilogue, bk 128, 2 CTAs/SM tile, split-K,
attention split=False), with zero spills and no local memory; the
SASS of every tensor-core kernel holds HMMA (mma.sync) and no local loads/stores; bad specs are rejected
with a message naming the field; launch grids follow M / n."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest

from test_gemv import _opcode, main_loop

from nanoqwen import codegen, config
from nanoqwen.codegen import resources
from nanoqwen.codegen.kernels import attention_prefill as AP
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.codegen.spec import Launch, SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import prefill as prefill_mod
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}


def _specs():
    out = []
    for d in MODELS.values():
        out += G.specs_for_model(d, CFG) + AP.specs_for_model(d, CFG)
    d = QWEN25_7B
    qkv = G.model_gemms(d)["qkv"]
    out += [replace(qkv, epilogue="f16"), replace(qkv, bk=128, stages=3),
            replace(qkv, bm=64, min_blocks=2), replace(G.model_gemms(d)["down"], split_k=4),
            replace(AP.specs_for_model(d, CFG)[1], split=False)]
    splits = {"qkv": 2, "o_proj": 1, "gate_up": 1, "down": 4}   # as tests/gpu/test_gemm.py checks them
    out += [s for d in MODELS.values() for small in (False, True)
            for s in G.model_gemms(d, small_m=small, gemv_splits=splits).values()]
    gemv_order = replace(CFG, prefill=replace(CFG.prefill, gemv_order=True))   # and the short chunks' row GEMVs
    out += [s for d in MODELS.values() for s in prefill_mod.row_gemv_specs(d, gemv_order).values()]
    return list(dict.fromkeys(out))


SPECS = _specs()
TENSOR_CORE = ("gemm_int4", "attention_prefill")


@pytest.fixture(scope="module")
def built(fresh_build):
    return {b.spec: b for b in fresh_build(SPECS)}


@pytest.mark.parametrize("spec", SPECS, ids=[s.uri for s in SPECS])
def test_compiles_without_spills(built, spec):
    r = built[spec].resources
    assert r.local_bytes == 0 and r.spill_stores == 0 and r.spill_loads == 0, f"{spec.uri}: {r}"
    assert r.registers <= 255


@pytest.mark.skipif(resources.tool("cuobjdump") is None and resources.tool("nvdisasm") is None,
                    reason="no cuobjdump / nvdisasm to read SASS")
@pytest.mark.parametrize("spec", [s for s in SPECS if s.family in TENSOR_CORE],
                         ids=[s.uri for s in SPECS if s.family in TENSOR_CORE])
def test_sass_uses_tensor_cores(built, spec):
    sass = resources.sass(built[spec].cubin)
    assert "HMMA.16816.F32" in sass, f"{spec.uri}: no HMMA.16816.F32 in the SASS"
    assert "LDL" not in sass and "STL" not in sass, f"{spec.uri}: local memory traffic in the SASS"
    if not getattr(spec, "gemv_order", False):   # the GEMV order's renamed k slots are not 8x8 matrices
        assert "LDSM" in sass, f"{spec.uri}: fragments not loaded with ldmatrix"


# The GEMV order's k-tile loop, instructions per HMMA (SASS, counted here): 5.6 for the 32-token x 32-row warp
# tile, 6.8 with down's split sums, against the fold order's 5.2-5.4 (a 16 x 64 warp tile was 8.2-9.3: each
# dequantized weight served half the tokens). A regression guard; the GPU decides the tile.
ORDER_BUDGET = {"qkv": 5.8, "o_proj": 5.8, "gate_up": 5.8, "down": 7.0}


@pytest.mark.skipif(resources.tool("cuobjdump") is None and resources.tool("nvdisasm") is None,
                    reason="no cuobjdump / nvdisasm to read SASS")
@pytest.mark.parametrize("role", list(ORDER_BUDGET))
def test_gemv_order_main_loop_budget(role):
    """A k-tile (one group) of the GEMV-order GEMM: 8 HMMA for each (A tile, B tile) of a warp, no local
    memory, and at most ORDER_BUDGET[role] instructions an HMMA."""
    spec = G.config_gemms(QWEN25_7B, CFG, gemv_order=True)[role]
    body = main_loop(resources.sass(codegen.build(spec).cubin))
    ops = collections.Counter(map(_opcode, body))
    hmma = sum(c for op, c in ops.items() if op.startswith("HMMA"))
    print(f"{spec.uri}: {len(body)} instructions, {hmma} HMMA, {len(body) / hmma:.2f} an HMMA; {ops.most_common(6)}")
    assert hmma == (spec.bn // spec.warps_n // 16) * (spec.bm // spec.warps_m // 8) * 8
    assert not any(op.startswith(("LDL", "STL")) for op in ops), "local memory in the main loop"
    assert len(body) / hmma <= ORDER_BUDGET[role], f"{role}: {len(body) / hmma:.2f} instructions an HMMA"


@pytest.mark.skipif(resources.tool("cuobjdump") is None and resources.tool("nvdisasm") is None,
                    reason="no cuobjdump / nvdisasm to read SASS")
@pytest.mark.parametrize("order", [False, True], ids=["fold", "gemv_order"])
def test_short_chunk_tiles_take_their_scales_from_the_ring(order):
    """The short chunks' tiles copy each k-tile's scales into the ring (4-byte LDGSTS) and read them from shared
    memory: no global load waits in their main loop. The long chunks' tiles keep the plain loads (LDG)."""
    for small in (True, False):
        spec = G.config_gemms(QWEN25_7B, CFG, small_m=small, gemv_order=order)["qkv"]
        assert spec.scale_ring == small
        ops = collections.Counter(map(_opcode, main_loop(resources.sass(codegen.build(spec).cubin))))
        loads = sum(c for op, c in ops.items() if op.startswith("LDG."))
        if small:
            assert loads == 0 and ops["LDGSTS.E"] == 1, f"{spec.uri}: {sorted(ops.items())}"
        else:
            assert loads > 0 and "LDGSTS.E" not in ops, f"{spec.uri}: {sorted(ops.items())}"


def test_gemm_launch_follows_m():
    s = G.model_gemms(QWEN25_7B)["qkv"]   # 64 x 64 tiles (LARGE_M_ROLE_TILES)
    assert s.launch(1).grid == (4608 // 64, 1, 1)
    assert s.launch(65).grid == (4608 // 64, 2, 1)
    assert s.launch() == Launch(grid=(72, 4096 // 64, 1), block=(128, 1, 1), smem=4 * (64 * 64 * 2 + 64 * 64 // 2))
    gu = G.model_gemms(QWEN25_7B)["gate_up"]   # 128 x 128, a 128-deep k-tile on 3 stages
    assert gu.n == 2 * 18944 and gu.epilogue == "swiglu"
    assert gu.launch(129) == Launch(grid=(37888 // 128, 2, 1), block=(256, 1, 1),
                                    smem=3 * (128 * 128 * 2 + 128 * 128 // 2))
    small = G.model_gemms(QWEN25_7B, small_m=True)
    assert small["qkv"].launch(32) == Launch(grid=(4608 // 32, 2, 1), block=(128, 1, 1),
                                             smem=4 * (16 * 128 * 2 + 32 * 128 // 2 + 4 * 32))   # X, W, scale words
    assert small["down"].launch(1).grid == (3584 // 32, 1, 1) and small["down"].launch(64).grid == (112, 4, 1)
    assert {s.uri for s in small.values()}.isdisjoint(s.uri for s in G.model_gemms(QWEN25_7B).values())


def test_gemv_order_is_a_late_field_and_follows_the_config():
    """The fold-order GEMMs keep their names (gemv_order and splits are left out while at their defaults);
    prefill.gemv_order switches every prefill GEMM, default and small-M tiles, to the GEMV order with the
    configured splits, shrunk to whole groups on small shapes."""
    fold = G.model_gemms(QWEN25_7B)["down"]
    assert "gemv_order" not in fold.spec_repr and "splits" not in fold.uri
    cfg = replace(CFG, prefill=replace(CFG.prefill, gemv_order=True))
    for small in (False, True):
        specs = G.config_gemms(QWEN25_7B, cfg, small_m=small)
        assert all(s.gemv_order for s in specs.values())
        assert {r: s.splits for r, s in specs.items()} == {"qkv": 1, "o_proj": 1, "gate_up": 1, "down": 4}
    tiny = G.model_gemms(tiny_dims(), gemv_splits={"qkv": 8, "o_proj": 8, "gate_up": 8, "down": 8})
    assert {r: s.splits for r, s in tiny.items()} == {"qkv": 2, "o_proj": 7, "gate_up": 2, "down": 4}
    assert not any(s.gemv_order for s in G.config_gemms(QWEN25_7B, CFG).values())


def test_attention_launch_follows_n():
    _, a = AP.prefill_attention_specs(QWEN25_7B, CFG)
    assert a.launch(1).grid == (1, 28, 1)
    assert a.launch(65).grid == (2, 28, 1)
    assert a.flops(0, 1) == 4 * 128 * 28
    r, _ = AP.prefill_attention_specs(QWEN25_7B, CFG)
    assert r.launch(17).grid == (17, 32, 1)


@pytest.mark.parametrize("kw,field", [
    (dict(n=4608, k=3584, epilogue="gelu"), "epilogue"),
    (dict(n=4600, k=3584), "n"),
    (dict(n=4608, k=3500), "k"),
    (dict(n=4608, k=3584, bk=32), "bk"),
    (dict(n=4608, k=3584, epilogue="residual", bias=True), "bias"),
    (dict(n=4608, k=3584, stages=8, bk=128, bn=256, bm=256), "shared memory"),
    (dict(n=4608, k=3584, bm=80), "bm"),
    (dict(n=4608, k=3584, split_k=2), "split_k"),
    (dict(n=4608, k=3584, epilogue="residual", split_k=3), "split_k"),
    (dict(n=4608, k=3584, gemv_order=True), "gemv_order"),                      # bk 64
    (dict(n=4608, k=3584, gemv_order=True, bk=128, splits=3), "splits"),        # 28 groups
    (dict(n=4608, k=3584, splits=2), "splits"),                                 # fold order
    (dict(n=4608, k=3584, gemv_order=True, bk=128, bn=128, warps_n=16), "bn"),   # 8-row warp tiles
    (dict(n=4608, k=3584, gemv_order=True, bk=128, epilogue="residual", split_k=2), "split_k"),
])
def test_gemm_rejects_bad_specs(kw, field):
    with pytest.raises(SpecError, match=field):
        G.GemmInt4Spec(**kw).validate()


def test_attention_rejects_bad_specs():
    with pytest.raises(SpecError, match="bkv"):
        AP.AttentionPrefillSpec(head_dim=128, heads=28, kv_heads=4, bkv=24).validate()
    with pytest.raises(SpecError, match="kv_heads"):
        AP.AttentionPrefillSpec(head_dim=128, heads=28, kv_heads=5).validate()
