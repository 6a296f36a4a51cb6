"""CPU tests of the chain judge (tuning/chain.py; its GPU run: tests/gpu/test_tuning_chain.py): the variants are
the tuned tile with the named fields over it, bad ones refused with one line before any device work; the rounds
interleave with the base first; the summary is the median of the rounds against the base's."""

from __future__ import annotations

import pytest

from nanoqwen import NanoqwenError, config
from nanoqwen.tuning import chain
from nanoqwen.codegen import tuned
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import decoder
from nanoqwen.tuning import sweep

H100 = "NVIDIA H100 80GB HBM3"


def test_variants_are_the_tuned_tile_with_fields_over_it():
    cfg = config.default()
    specs = chain.variant_specs("gate_up", ["prefetch=1", "warps=8,l2_fetch=256"], QWEN25_7B, cfg, H100)
    base = tuned.role_spec("gate_up", QWEN25_7B, cfg, H100)
    assert list(specs) == [chain.BASE, "prefetch=1", "warps=8,l2_fetch=256"] and specs[chain.BASE] == base
    assert specs["prefetch=1"].prefetch and not base.prefetch
    assert (specs["warps=8,l2_fetch=256"].warps, specs["warps=8,l2_fetch=256"].l2_fetch) == (8, 256)
    for spec in specs.values():   # everything else is the tuned tile's
        assert (spec.lanes, spec.rows, spec.splitk, spec.mma, spec.norm) == (base.lanes, base.rows, base.splitk,
                                                                             base.mma, base.norm)


@pytest.mark.parametrize("role,variant,match", [("lm", "warps=8", "unknown role"),
                                                ("down", "bogus=1", "unknown parameter"),
                                                ("down", "lanes=3", "down:lanes=3")])
def test_bad_variants_are_one_line_errors(role, variant, match):
    with pytest.raises(NanoqwenError, match=match):
        chain.variant_specs(role, [variant], QWEN25_7B, config.default(), H100)


def test_the_cli_refuses_bad_input_before_the_device(capsys):
    assert chain.main(["down", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chain: down:bogus=1") and err.count("\n") == 1
    assert chain.main(["down", "warps=8", "--rounds", "0"]) == 2
    assert chain.main(["down"]) == 2   # neither a variant nor --top


def test_rounds_interleave_with_the_base_first():
    assert chain.rounds_order(["t", "a", "b", "c"], 4) == ["t", "a", "b", "c", "t", "b", "c", "a",
                                                           "t", "c", "a", "b", "t", "a", "b", "c"]
    assert chain.rounds_order(["t"], 2) == ["t", "t"]


def test_summary_is_the_median_against_the_base():
    res = chain.summarize({chain.BASE: [2.0, 2.1, 1.9], "x": [1.9, 1.8, 2.2]})
    assert res[chain.BASE]["graph_step_ms"] == 2.0 and res[chain.BASE]["vs_tuned_pct"] == 0.0
    assert res["x"]["graph_step_ms"] == 1.9 and res["x"]["vs_tuned_pct"] == pytest.approx(-5.0)


def test_top_variants_are_the_tuners_fastest_other_tiles():
    """From nanoqwen-tune's progress (cubin name -> result), the k fastest judged tiles other than the tuned one,
    each as the fields that turn the tuned tile into it; wrong, unjudged and spilling ones are passed over."""
    cfg = config.default()
    one, cands = sweep.candidates("gate_up", QWEN25_7B, cfg, H100, 1, log=lambda line: None)
    others = [s for s in cands if s != one][:6]
    done = {f"{s.uri}-0123456789abcdef.cubin": {"status": "ok", "us": 30.0 - i} for i, s in enumerate(others)}
    done[f"{one.uri}-0123456789abcdef.cubin"] = {"status": "ok", "us": 1.0}   # the tuned tile is the base
    done[f"{others[5].uri}-0123456789abcdef.cubin"] = {"status": "wrong", "rel_err": 1.0}
    variants = chain.top_variants("gate_up", 3, QWEN25_7B, cfg, H100, done)
    specs = chain.variant_specs("gate_up", variants, QWEN25_7B, cfg, H100)
    assert [s.uri for s in specs.values()] == [one.uri, others[4].uri, others[3].uri, others[2].uri]


def test_row_variants_are_the_tuned_m_row_tile_with_fields_over_it():
    """--rows M: the variants vary the M-row kernel's tile over the tuned m = 1 kernel (its rows keep that
    kernel's order), each as the step runs it (gate_up with its RMSNorm apart, config multirow.norm_apart)."""
    cfg = config.default()
    specs = chain.variant_specs("gate_up", ["rows=1", "warps=8,ctas_per_sm=2"], QWEN25_7B, cfg, H100, 8)
    step = decoder.step_specs(QWEN25_7B, cfg, H100, m=8)
    one = tuned.role_spec("gate_up", QWEN25_7B, cfg, H100)
    assert specs[chain.BASE] == step["gate_up"] and all(s.m == 8 and not s.norm for s in specs.values())
    assert (specs["rows=1"].rows, specs["warps=8,ctas_per_sm=2"].warps, specs["warps=8,ctas_per_sm=2"].ctas_per_sm
            ) == (1, 8, 2)
    for spec in specs.values():   # the m = 1 kernel's order: lanes, splitk and the fields the row keeps
        assert (spec.lanes, spec.splitk, spec.mma, spec.n, spec.k) == (one.lanes, one.splitk, one.mma, one.n, one.k)
    down = chain.variant_specs("down", ["rows=2"], QWEN25_7B, cfg, H100, 8)
    assert down[chain.BASE] == step["down"] and down["rows=2"].rows == 2


@pytest.mark.parametrize("variant,m,match", [("lanes=8", 8, "not a tile field"),
                                             ("rows=2", 3, "not a multirow bucket")])
def test_bad_row_variants_are_one_line_errors(variant, m, match):
    with pytest.raises(NanoqwenError, match=match):
        chain.variant_specs("down", [variant], QWEN25_7B, config.default(), H100, m)
    assert chain.main(["down", variant, "--rows", str(m)]) == 2
    assert chain.main(["down", "--rows", str(m), variant]) == 2   # variants after the option, as gpu_check passes them


def test_top_row_variants_come_from_the_m_row_sweep():
    cfg = config.default()
    _one, cands = sweep.candidates("down", QWEN25_7B, cfg, H100, 8, log=lambda line: None)
    base = tuned.role_spec("down", QWEN25_7B, cfg, H100, 8)
    others = [s for s in cands if s != base][:3]
    done = {f"{s.uri}-0123456789abcdef.cubin": {"status": "ok", "us": 40.0 - i} for i, s in enumerate(others)}
    variants = chain.top_variants("down", 2, QWEN25_7B, cfg, H100, done, 8)
    specs = chain.variant_specs("down", variants, QWEN25_7B, cfg, H100, 8)
    assert [s.uri for s in specs.values()] == [base.uri, others[2].uri, others[1].uri]
