"""bench/chunks.py on the CPU: the floor a chunk is measured against, and its command line."""

from __future__ import annotations

import pytest

from nanoqwen import config
from nanoqwen.bench import chunks
from nanoqwen.dims import QWEN25_7B


def test_floor_is_the_layers_weights_and_the_keys_kv():
    d = QWEN25_7B
    h, i, q, kv = d.hidden, d.intermediate, d.q_dim, d.kv_dim
    packed = (q + 2 * kv) * h + q * h + 2 * i * h + h * i   # qkv, o_proj, gate + up, down: inputs a layer
    weights = packed // 2 + 2 * packed // 128              # INT4 and an fp16 scale per 128 inputs
    assert chunks.floor_bytes(d, config.default(), 4096) == d.layers * (weights + 4096 * kv * 2 * 2)
    assert 3.5e9 < chunks.floor_bytes(d, config.default(), 4096) < 3.7e9


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as e:
        chunks.main(["--help"])
    assert e.value.code == 0 and "--context" in capsys.readouterr().out
