"""The decode attention benchmark's host side (no GPU): variant parsing, the specs it builds (the spec's own
validation rules variants out), the bytes it counts, and its argument errors."""

import pytest

from nanoqwen import config
from nanoqwen.bench import attention as B
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B

CFG = config.default()


def test_parse_variant():
    assert B.parse_variant("stages=4,ctas_per_sm=3") == {"stages": 4, "ctas_per_sm": 3}
    assert B.parse_variant("pipeline=bulk") == {"pipeline": "bulk"}
    assert B.parse_variant("") == {}
    for bad in ("stages", "=4", "stages="):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            B.parse_variant(bad)


def test_kernels_apply_overrides_to_the_configured_specs():
    dec, comb = B.kernels(QWEN25_7B, CFG, 8, {"stages": 8})
    assert dec.m == comb.m == 8 and dec.stages == 8 and dec.ctas_per_sm == CFG.multirow.attention_ctas_per_sm
    one, _ = B.kernels(QWEN25_7B, CFG, 1, {})
    assert one.stages == CFG.attention.stages and one.ctas_per_sm == 1
    with pytest.raises(SpecError, match="multiple of consumer_warps"):
        B.kernels(QWEN25_7B, CFG, 1, {"stages": 3})   # mma: each warp its own ring slots
    with pytest.raises(TypeError):
        B.kernels(QWEN25_7B, CFG, 1, {"no_such_field": 1})


def test_kv_bytes_counts_the_pages_the_rows_see():
    page, per_page = 16, 2 * QWEN25_7B.kv_heads * 16 * QWEN25_7B.head_dim * 2
    assert B.kv_bytes(QWEN25_7B, 16, 1, page) == per_page            # one full page
    assert B.kv_bytes(QWEN25_7B, 16, 2, page) == 2 * per_page        # the second row's key opens a page
    assert B.kv_bytes(QWEN25_7B, 577, 8, page) == 37 * per_page


@pytest.mark.parametrize("argv", [["--rows", "17"], ["--rows", "0"], ["--contexts", "0"], ["--variant", "stages"]])
def test_bad_arguments_exit_before_any_gpu_work(argv, capsys):
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
