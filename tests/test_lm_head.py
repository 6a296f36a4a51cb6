"""CPU tests of the first and last kernels of a decode step (embed, lm_head_argmax): the specs follow the
config and reject impossible shapes (the multi-row lm_head: m in 1..16, x within shared memory); every variant below renders and compiles for sm_90a with no spills
and no local memory; the SASS streams lm_head with 16-byte loads, the first batch of them issued before
griddepcontrol.wait (SASS ACQBULK), and never reads h or the decode state through the .nc path."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen import resources
from nanoqwen.codegen.gpu import DEFAULT as DEFAULT_GPU
from nanoqwen.codegen.kernels import embed, lm_head
from nanoqwen.codegen.spec import SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.testmodels import tiny_dims

CFG = config.default()
LM7B = lm_head.specs_for_model(QWEN25_7B, CFG)[0]
LMTINY = lm_head.specs_for_model(tiny_dims(), CFG)[0]
LM_CASES = {
    "7b": LM7B,
    "tiny": LMTINY,
    "7b-rows2-unroll7": dataclasses.replace(LM7B, rows_per_warp=2, unroll=7),
    # 5120 (Qwen2.5-14B/32B): 20 vectors per lane, two load batches per row
    "h5120": dataclasses.replace(LM7B, hidden=5120),
    # 896 (Qwen2.5-0.5B): 112 vectors per row, so lanes 16-31 sit out the last column
    "h896-rows4": lm_head.LmHeadArgmaxSpec(hidden=896, vocab=151936, warps=4, rows_per_warp=4, unroll=2, ctas=132),
    # the multi-row step: m rows of x against one read of the head (7B m = 16: 224 KB of x, one CTA per SM)
    "7b-m2": lm_head.model_spec(QWEN25_7B, CFG, m=2),
    "7b-m16": lm_head.model_spec(QWEN25_7B, CFG, m=16),
    "tiny-m16": lm_head.model_spec(tiny_dims(), CFG, m=16),
}
EMBED_CASES = {"7b": embed.specs_for_model(QWEN25_7B, CFG)[0], "tiny": embed.specs_for_model(tiny_dims(), CFG)[0]}
LDG128 = re.compile(r"\bLDG\.E(?:\.\w+)*\.128\b")


@pytest.fixture(scope="module")
def built(fresh_build):
    specs = [*LM_CASES.values(), *EMBED_CASES.values()]
    return dict(zip(specs, fresh_build(specs)))


def _sass_ops(cubin: bytes) -> list[str]:
    """SASS instructions in order (predicate guards dropped), e.g. 'LDG.E.NA.128 R4, desc[UR4][R2.64]'."""
    ops = []
    for line in resources.sass(cubin).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([^;]+);", line)
        if m:
            ops.append(m.group(1).strip())
    return ops


def test_specs_follow_config():
    lm, ctas = CFG.lm_head, CFG.lm_head.ctas_per_sm * DEFAULT_GPU.sm_count   # 2 x 132 on the default H200
    assert (LM7B.hidden, LM7B.vocab, LM7B.eps) == (3584, 152064, 1e-6)
    assert (LM7B.warps, LM7B.rows_per_warp, LM7B.unroll, LM7B.ctas) == (lm.warps, lm.rows_per_warp, lm.unroll, ctas)
    assert LMTINY.unroll == 1  # hidden 256: one 16-byte vector per lane per row, so unroll is clamped
    assert LM7B.launch() == codegen.Launch(grid=(ctas, 1, 1), block=(32 * lm.warps, 1, 1))
    assert LM7B.partials_bytes == 8 * ctas
    e = EMBED_CASES["7b"]
    assert e.launch() == codegen.Launch(grid=(-(-3584 // 8 // CFG.embed.threads), 1, 1), block=(CFG.embed.threads, 1, 1))
    assert [n for n, _ in LM7B.signature] == ["h", "norm_w", "lm_head", "logits", "state", "tokens_out",
                                              "tokens_cap", "partials", "argmax_done", "err"]
    assert [n for n, _ in e.signature] == ["state", "embed", "h", "err", "argmax_done"]
    assert len({embed.ERR_TOKEN_RANGE, lm_head.ERR_NO_FINITE_LOGIT, lm_head.ERR_TOKENS_OUT_FULL}) == 3


@pytest.mark.parametrize("change,match", [
    (dict(unroll=15), "unroll"),                    # 7B has 14 vectors per lane per row
    (dict(rows_per_warp=5), "rows_per_warp"),       # 152064 % 5 != 0
    (dict(hidden=3588), "hidden"),
    (dict(rows_per_warp=4, unroll=14), "registers"),
    (dict(hidden=16384, unroll=14), "shared"),
    (dict(eps=0.0), "eps"),
    (dict(ctas=0), "ctas"),
])
def test_invalid_lm_head_specs_rejected(change, match):
    with pytest.raises(SpecError, match=match):
        codegen.render(dataclasses.replace(LM7B, **change))


def test_invalid_embed_spec_rejected():
    with pytest.raises(SpecError, match="hidden"):
        codegen.render(embed.EmbedSpec(hidden=100, vocab=10))
    with pytest.raises(SpecError, match="threads"):
        codegen.render(embed.EmbedSpec(hidden=256, vocab=10, threads=48))


def test_render_is_deterministic_and_embeds_the_spec():
    src = codegen.render(LM7B)
    assert src == codegen.render(dataclasses.replace(LM7B))
    assert LM7B.spec_repr in src and f"{LM7B.entry}(" in src
    assert "constexpr float EPS = 1e-06f;" in src


@pytest.mark.parametrize("name", LM_CASES)
def test_lm_head_compiles_clean_and_streams_before_the_wait(built, name):
    spec = LM_CASES[name]
    b = built[spec]
    r = b.resources
    print(f"{spec.uri}: {r}")
    assert (r.spill_stores, r.spill_loads, r.local_bytes) == (0, 0, 0), r
    assert r.shared_static + b.launch.smem <= 4 * spec.hidden * spec.m + 1024 + 64 * spec.warps * spec.m, r
    assert b.launch.smem == (spec.xs_bytes if spec.m > 1 else 0)
    if name == "7b":  # the default must keep two 256-thread CTAs per SM (16 warps streaming)
        assert r.registers <= 128, r
    ops = _sass_ops(b.cubin)
    assert not any(o.startswith(("LDL", "STL")) for o in ops)
    wait = next(i for i, o in enumerate(ops) if o.startswith("ACQBULK"))
    early = [o for o in ops[:wait] if LDG128.search(o)]
    assert len(early) == spec.rows_per_warp * spec.unroll, early   # batch 0 of the first chunk
    assert not any(o.startswith("LDG") and "CONSTANT" in o and ".128" not in o for o in ops[:wait])
    weight_loads = [o for o in ops if LDG128.search(o) and ".NA." in o]  # L1::no_allocate: the weight stream
    assert len(weight_loads) >= 2 * spec.rows_per_warp * spec.unroll
    # h is read after the wait and not through the non-coherent path (it was written by the previous kernel)
    after = ops[wait:]
    assert any(LDG128.search(o) and "CONSTANT" not in o and ".NA." not in o for o in after)
    assert any(o.startswith("ATOMG.E.INC") for o in ops)


@pytest.mark.parametrize("name", EMBED_CASES)
def test_embed_compiles_clean(built, name):
    spec = EMBED_CASES[name]
    b = built[spec]
    r = b.resources
    assert (r.spill_stores, r.spill_loads, r.local_bytes) == (0, 0, 0), r
    ops = _sass_ops(b.cubin)
    wait = next(i for i, o in enumerate(ops) if o.startswith("ACQBULK"))
    assert not any(o.startswith("LDG") for o in ops[:wait]), "nothing may be read before the wait"
    state_load = next(o for o in ops[wait:] if o.startswith("LDG"))
    assert "CONSTANT" not in state_load, f"state[0] read through the .nc path: {state_load}"
    assert sum(bool(LDG128.search(o)) for o in ops) == 1
    assert sum(o.startswith("STG.E.128") for o in ops) == 2


def test_multirow_specs():
    """m rows: m in the URI, the per-row arithmetic fields of m = 1 kept, no decode state taken (the M tokens
    go to tokens_out[0..m)), partials per row, x in dynamic shared memory, the grid fitted to residency,
    multirow.lm_head_rows_per_warp vocab rows per warp, with fewer loads in flight (of m = 1's chains) where
    the accumulators of 16 rows need the registers."""
    for m in CFG.multirow.buckets:
        spec = lm_head.model_spec(QWEN25_7B, CFG, m=m)
        assert spec.m == m and f"_m{m}_" in spec.uri and f"constexpr int M = {m};" in codegen.render(spec)
        assert (spec.hidden, spec.vocab, spec.eps, spec.warps) == (LM7B.hidden, LM7B.vocab, LM7B.eps, LM7B.warps)
        assert lm_head.chains(spec.hidden, spec.unroll) == lm_head.chains(LM7B.hidden, LM7B.unroll)
        assert (spec.rows_per_warp, spec.unroll) == ((LM7B.rows_per_warp, LM7B.unroll) if m == 1 else
                                                     (CFG.multirow.lm_head_rows_per_warp, 10 if m == 16 else 14))
        assert spec.partials_bytes == 8 * spec.ctas * m
        names = [n for n, _ in spec.signature]
        assert ("state" in names) == (m == 1)
        assert spec.launch().smem == (4 * 3584 * m if m > 1 else 0)
        resident = max(1, DEFAULT_GPU.max_smem // (spec.xs_bytes + 4096)) if m > 1 else CFG.lm_head.ctas_per_sm
        assert spec.ctas == min(CFG.lm_head.ctas_per_sm, resident) * DEFAULT_GPU.sm_count
    assert lm_head.model_spec(QWEN25_7B, CFG) == LM7B
    assert lm_head.multirow_specs_for_model(QWEN25_7B, CFG) == [
        lm_head.model_spec(QWEN25_7B, CFG, m=m) for m in CFG.multirow.buckets if m > 1]


def test_chains_pin_a_rows_summation_order():
    assert lm_head.chains(3584, 14) == (0, 1) * 7 == lm_head.chains(3584, 10) == lm_head.chains(3584, 2)
    assert lm_head.chains(3584, 7) != lm_head.chains(3584, 14)   # the second batch would start on chain 0 at j = 7


@pytest.mark.parametrize("change,match", [
    (dict(m=0), r"\.m must be 1\.\.16"), (dict(m=17), r"\.m must be 1\.\.16"),
    (dict(m=16, hidden=4096, unroll=16), "shared memory"),   # 16 rows x 16 KB of fp32 x > 227 KB
])
def test_invalid_multirow_lm_head_rejected(change, match):
    with pytest.raises(SpecError, match=match):
        codegen.render(dataclasses.replace(LM7B, **change))
