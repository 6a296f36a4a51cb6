"""tools/profile_gemv.py: a tile argument becomes the role's spec with those fields, and a bad one a one-line
error before any device work."""

from __future__ import annotations

import pytest

from _tools import tool
from nanoqwen import NanoqwenError, config
from nanoqwen.codegen.kernels import gemv
from nanoqwen.dims import QWEN25_7B

profile = tool("profile_gemv")
CFG = config.default()


def test_tile_argument_overrides_the_config_tile():
    spec = profile.tile_spec("gate_up:mma=1,lanes=4,rows=2,warps=8,unroll=0,kwarps=8", CFG)
    assert spec == gemv.role_spec("gate_up", QWEN25_7B, CFG, mma=True, lanes=4, rows=2, warps=8, unroll=0, kwarps=8)
    assert profile.tile_spec("down", CFG) == gemv.role_spec("down", QWEN25_7B, CFG)
    assert profile.tile_spec("down:l2_fetch=256", CFG) == gemv.role_spec("down", QWEN25_7B, CFG, l2_fetch=256)


def test_row_count_takes_the_multirow_tile():
    one = gemv.role_spec("gate_up", QWEN25_7B, CFG, mma=True, lanes=4, rows=2, warps=8, unroll=0, kwarps=8)
    assert profile.tile_spec("gate_up:mma=1,lanes=4,rows=2,warps=8,unroll=0,kwarps=8@8:rows=4,unroll=1,warps=16",
                             CFG) == gemv.multirow_spec(one, 8, CFG, tile=dict(rows=4, unroll=1, warps=16))
    assert profile.tile_spec("down@4", CFG) == gemv.role_spec("down", QWEN25_7B, CFG, m=4)


@pytest.mark.parametrize("arg, words", [
    ("up:rows=2", "unknown role"),
    ("qkv:rows", "name=value"),
    ("qkv:epilogue=plain", "not a tile field"),
    ("qkv:n=1024", "not a tile field"),
    ("qkv:rows=two", "cannot parse 'two' as int"),
    ("qkv:mma=1,lanes=16", "mma takes lanes=4"),
    ("qkv@x", "the row count is a number"),
    ("qkv@8:splitk=2", "not a tile field"),
])
def test_bad_tile_arguments_are_one_line_errors(arg, words, capsys):
    with pytest.raises(NanoqwenError, match=words):
        profile.tile_spec(arg, CFG)
    assert profile.main([arg]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(["--help"])
    assert e.value.code == 0 and "--time" in capsys.readouterr().out
