"""config multirow.norm_apart on the CPU: from its bucket on, the multi-row step normalises qkv's and gate_up's m
rows once in rmsnorm_prefill and runs their GEMVs without the RMSNorm prologue (gemv.norm_apart); the launch
plan wires the norm's x into the GEMV (fake driver of tests/test_decoder_plan.py). That the rows keep their
bits is tests/gpu/test_gemv.py's test_norm_apart_rows_are_the_fused_norm_rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_decoder_plan import FakeBuf, fake_session, nqfile  # noqa: F401

from nanoqwen import config
from nanoqwen.codegen.kernels import gemm, gemv
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import decoder

CFG = config.default()
FUSED = replace(CFG, multirow=replace(CFG.multirow, norm_apart=()))   # every prologue in its GEMV
APART = replace(CFG, multirow=replace(CFG.multirow, norm_apart=("qkv", "gate_up"), norm_apart_rows=4))


def test_norm_apart_drops_only_the_prologue():
    fused = gemv.role_spec("gate_up", QWEN25_7B, CFG, m=8)
    apart = gemv.norm_apart(fused)
    assert not apart.norm and replace(apart, norm=True) == fused
    with pytest.raises(SpecError, match="RMSNorm prologue"):
        gemv.norm_apart(gemv.role_spec("down", QWEN25_7B, CFG, m=8))


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_step_specs_take_the_norm_apart_from_its_bucket_on(m):
    specs, fused = decoder.step_specs(QWEN25_7B, APART, m=m), decoder.step_specs(QWEN25_7B, FUSED, m=m)
    if m < 4:
        assert specs == fused and "x16" not in decoder.buffer_bytes(QWEN25_7B, specs, m)
        return
    norm = gemm.RmsnormPrefillSpec(hidden=QWEN25_7B.hidden, eps=QWEN25_7B.rms_eps, max_m=m)
    assert specs["qkv_norm"] == specs["gate_up_norm"] == norm and norm.launch().grid == (m, 1, 1)
    for role in gemv.ROLES:
        assert specs[role] == (gemv.norm_apart(fused[role]) if role in ("qkv", "gate_up") else fused[role])
    assert decoder.buffer_bytes(QWEN25_7B, specs, m)["x16"] == 2 * m * QWEN25_7B.hidden


@pytest.mark.parametrize("bad, words", [
    (dict(norm_apart=("o_proj",)), "qkv and gate_up"),
    (dict(norm_apart=("qkv", "qkv")), "each once"),
    (dict(norm_apart_rows=1), "at least 2"),
])
def test_bad_norm_apart_config_is_refused(bad, words):
    with pytest.raises(config.ConfigError, match=words):
        replace(CFG.multirow, **bad)


def test_the_row_step_feeds_the_norms_x_to_its_gemv(nqfile, monkeypatch):  # noqa: F811
    """Each bucket from norm_apart_rows on: rmsnorm_prefill of the layer's norm weights over the step's m rows
    into x16, right before the GEMV that reads x16; every launch's arguments are its kernel's signature and land
    in the step's buffers or the weights; buckets below it keep the fused norm."""
    s = fake_session(nqfile, monkeypatch, cfg=APART)
    rows, w = s.rows, s.weights
    buffers = [rows.bufs[n] for n in rows.bufs.names] + [s.state.bufs[n] for n in s.state.bufs.names] + \
        [w.base, s.kv.page_table, *s.kv.k, *s.kv.v]
    for m in rows.buckets:
        seq = rows.sequences[m]
        roles = [role for role, *_ in seq]
        if m < 4:
            assert "qkv_norm" not in roles and "gate_up_norm" not in roles
            continue
        for role, norm_w in (("qkv", "input_norm"), ("gate_up", "post_norm")):
            at = [i for i, r in enumerate(roles) if r == role]
            assert len(at) == nqfile.dims.layers and all(roles[i - 1] == role + "_norm" for i in at)
            for layer, i in enumerate(at):
                norm, gemv_args = seq[i - 1][3], seq[i][3]
                assert norm == dict(h=rows.bufs.h, w=w.ptr(f"L{layer}.{norm_w}"), xn=rows.bufs.x16, m=m)
                assert gemv_args["x"] is rows.bufs.x16 and "h" not in gemv_args
        for role, _fn, launch, args in seq:
            spec = rows.kernels[m][role][0]
            assert launch == (spec.launch(m) if role == "embed" else spec.launch())
            assert set(args) == {n for n, _ in spec.signature}, f"{role}: {sorted(args)} vs {spec.signature}"
            for name, kind in spec.signature:
                p = args[name].ptr if isinstance(args[name], FakeBuf) else args[name]
                assert kind != "ptr" or any(b.ptr <= p < b.ptr + b.nbytes for b in buffers), f"{role}.{name}"
