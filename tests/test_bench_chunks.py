"""bench/chunks.py on the CPU: the floor a chunk is measured against, the long chunk it profiles, and its command
line."""

from __future__ import annotations

import numpy as np
import pytest
from test_decoder_plan import fake_runner, nqfile  # noqa: F401
from test_prefill_plan import RecFn

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


def test_the_profiled_chunk_is_the_prefillers(nqfile, monkeypatch):
    """profile_chunk times the launches Prefiller.__call__ makes for a long chunk at position 0, kernel by kernel:
    the same kernels, grids, PDL and arguments, in order."""
    log = []
    run = fake_runner(nqfile, monkeypatch, capacity=700, chunk=512, fn=lambda role, spec: RecFn(role, log))
    pre = run.prefiller
    ids = ((np.arange(100) * 37 + 5) % nqfile.dims.vocab).tolist()
    pre(ids, 0)
    seq = chunks.chunk_launches(pre, len(ids))
    assert len(seq) == len(log) > nqfile.dims.layers
    assert [(fn.role, launch, pre.pdl(role), args) for role, fn, launch, args in seq] == log


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as e:
        chunks.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--context" in out and "--profile-rows" in out
