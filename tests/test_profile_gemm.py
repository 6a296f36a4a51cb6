"""tools/profile_gemm.py: a tile argument becomes the role's short-chunk GEMM with those fields, and a bad one a
one-line error before any device work; the L2 byte count it reports bandwidth from."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from _tools import tool
from nanoqwen import NanoqwenError, config
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.dims import QWEN25_7B

profile = tool("profile_gemm")
CFG = config.default()


def test_tile_argument_overrides_the_short_chunk_tile():
    small = G.config_gemms(QWEN25_7B, CFG, small_m=True, gemv_order=False)
    assert profile.tile_spec("down", CFG) == small["down"]
    assert profile.tile_spec("qkv:bm=32,warps_m=1,bn=64", CFG) == replace(small["qkv"], bm=32, bn=64)
    order = G.config_gemms(QWEN25_7B, CFG, small_m=True, gemv_order=True)
    assert profile.tile_spec("gate_up+order:stages=4", CFG) == replace(order["gate_up"], stages=4)


def test_l2_bytes_count_weights_per_row_block_and_x_per_column_block():
    qkv = profile.tile_spec("qkv", CFG)   # bm 16, bn 32: 32 rows are 2 row blocks
    weights = 4608 * 3584 // 2 + 4608 * 28 * 2
    assert profile.l2_bytes(qkv, 32) == 2 * weights + (4608 // 32) * 2 * 16 * 3584 * 2
    assert profile.l2_bytes(qkv, 1) == weights + (4608 // 32) * 16 * 3584 * 2   # a row block holds 16 rows


@pytest.mark.parametrize("arg, words", [
    ("up", "unknown role"),
    ("qkv+fold", "the only suffix is +order"),
    ("qkv:bn", "name=value"),
    ("qkv:n=1024", "not a tile field"),
    ("qkv:bn=33", "multiple of bn"),
    ("qkv:bn=x", "cannot parse 'x' as int"),
])
def test_bad_tile_arguments_are_one_line_errors(arg, words, capsys):
    with pytest.raises(NanoqwenError, match=re.escape(words)):
        profile.tile_spec(arg, CFG)
    assert profile.main([arg]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_rows_past_a_short_chunk_are_refused(capsys):
    assert profile.main(["--m", str(CFG.prefill.small_m_tokens + 1), "qkv"]) == 2
    assert "a short chunk has" in capsys.readouterr().err


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(["--help"])
    assert e.value.code == 0 and "--time" in capsys.readouterr().out


def test_json_without_time_is_refused(capsys):
    assert profile.main(["--json", "out.json", "qkv"]) == 2
    assert "takes --time" in capsys.readouterr().err


def test_sweep_expands_a_role_into_its_default_and_the_tiles_its_shape_takes():
    tiles = profile.sweep_tiles("qkv", CFG)
    assert tiles[0] == ("qkv", profile.tile_spec("qkv", CFG))
    assert [a for a, _ in tiles[1:]] == [f"qkv:{f}" for f in profile.SWEEP["fold"]]   # qkv takes them all
    order = profile.sweep_tiles("down+order", CFG)
    assert order[0][1].gemv_order and all(s.gemv_order for _, s in order)
    assert len({s.uri for _, s in order}) == len(order)   # no tile twice


def test_sweep_refuses_tile_fields(capsys):
    assert profile.main(["--sweep", "qkv:bn=64"]) == 2
    assert "--sweep takes ROLE[+order]" in capsys.readouterr().err
