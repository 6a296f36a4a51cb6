"""The QKV GEMV with rope_append's work in its epilogue (gemv.with_rope) on the CPU: which tiles can carry it,
that the one-row step runs it in place of rope_append (the m-row steps, and a tile that cannot, keep
rope_append), and that it compiles where the template pairs rows each way. That its q_rot and K/V pages are
bitwise the GEMV's and then rope_append's is tests/gpu/test_gemv.py's
test_rope_epilogue_is_the_gemv_then_rope_append."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen.kernels import gemv
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import decoder

CFG = config.default()
PAGE = CFG.kv_cache.page_size
D = QWEN25_7B


def _qkv(**tile):
    return gemv.role_spec("qkv", D, CFG, **tile)


@pytest.mark.parametrize("tile", [{}, gemv.MMA_TILE, {**gemv.MMA_TILE, "rows": 4}, dict(lanes=32, rows=2, warps=4),
                                  dict(lanes=8, rows=1, warps=4)], ids=str)
def test_with_rope_keeps_the_tile_and_compiles(tile):
    spec = _qkv(**tile)
    fused = gemv.with_rope(spec, D, PAGE)
    assert fused is not None and fused.epilogue == "rope"
    assert replace(fused, epilogue="bias", head_dim=0, heads=0, kv_heads=0, page_size=0) == spec
    assert fused.launch() == spec.launch()
    names = [n for n, _ in fused.signature]
    rope = {"state", "page_table", "rope_cos", "rope_sin", "q_rot", "k_pool", "v_pool"}
    assert "y" not in names and rope <= set(names)
    r = codegen.build(fused).resources
    assert (r.spill_stores, r.spill_loads, r.local_bytes) == (0, 0, 0)


@pytest.mark.parametrize("tile, why", [
    (dict(splitk=2), "one K split"),
    (dict(tiles_per_warp=2), "one tile a warp"),
    (dict(lanes=32, rows=1), "whole rotation pairs"),
])
def test_a_tile_that_cannot_carry_the_rope_keeps_rope_append(tile, why):
    spec = _qkv(**tile)
    assert gemv.with_rope(spec, D, PAGE) is None
    fused = replace(spec, epilogue="rope", head_dim=D.head_dim, heads=D.heads, kv_heads=D.kv_heads, page_size=PAGE)
    with pytest.raises(SpecError, match=why):
        fused.validate()
    cfg = replace(CFG, gemv_int4=replace(CFG.gemv_int4, qkv=replace(CFG.gemv_int4.qkv, **tile)))
    specs = decoder.step_specs(D, cfg)
    assert "rope_append" in specs and specs["qkv"].epilogue == "bias" and "qkv" in decoder.buffer_bytes(D, specs)


def test_only_the_qkv_gemv_takes_the_rope():
    with pytest.raises(SpecError, match="epilogue bias"):
        gemv.with_rope(gemv.role_spec("o_proj", D, CFG), D, PAGE)
    with pytest.raises(SpecError, match="q \\| k \\| v heads"):
        replace(_qkv(), epilogue="rope", head_dim=D.head_dim, heads=D.heads + 1, kv_heads=D.kv_heads,
                page_size=PAGE).validate()


@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_the_one_row_step_rotates_in_its_qkv_gemv(m):
    specs = decoder.step_specs(D, CFG, m=m)
    if m == 1:
        assert "rope_append" not in specs and specs["qkv"] == gemv.with_rope(_qkv(), D, PAGE)
        assert "qkv" not in decoder.buffer_bytes(D, specs)   # q, k and v never leave the registers
    else:   # the m-row steps keep rope_append: the same bits (class (a)), rows at their own positions
        assert "rope_append" in specs and specs["qkv"].epilogue == "bias"
