"""`python -m nanoqwen.bench.grammar` end to end on the reference backend (small-py, a short prompt, few
tokens): the JSON's structure and its numbers' consistency, the printed table; the synthetic 7B's tokenizer
(a byte-level BPE of Qwen2.5's size) holds the benchmark's grammar; the matcher wrapper changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanoqwen import NanoqwenError, testmodels, tokenizer
from nanoqwen.bench import grammar
from nanoqwen.schema_check import valid


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-grammar")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOQWEN_CACHE_DIR", str(tmp / "cache"))
        out = tmp / "grammar.json"
        assert grammar.main(["--backend", "reference", "--model", str(testmodels.SMALL_PY_DIR), "--prompt-tokens",
                             "8", "--gen-tokens", "64", "--repetitions", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_json_says_what_ran(result):
    assert result["kind"] == "nanoqwen-bench-grammar" and result["schema"] == 1
    assert result["backend"] == "reference" and result["gpu"] is None and result["commit"] and result["date"]
    p = result["protocol"]
    assert (p["prompt_tokens"], p["gen_tokens"], p["repetitions"]) == (8, 64, 2)
    assert p["json_schema"] == grammar.SCHEMA and p["tokenizer"] == "the model's own"
    assert "random weights" in p["output"]
    table = grammar.table(result).splitlines()
    assert table[2].startswith("(1) plain greedy (device path)") and float(table[2].split()[-1]) == pytest.approx(
        result["plain"]["ms_per_token"], abs=1e-3)
    assert f"(2) vs (1): {result['overhead']['constrained_vs_plain_pct']:+.1f}%" in table[-2]
    assert table[-1].startswith(f"constrained answer: {result['constrained']['answer']['tokens']} tokens, finished")


def test_the_numbers_are_consistent(result):
    plain, host, con, g = result["plain"], result["host_loop"], result["constrained"], result["grammar"]
    for mode in (plain, host, con):
        assert len(mode["samples_ms"]) == 2 and all(ms > 0 for ms in mode["samples_ms"])
        assert min(mode["samples_ms"]) <= mode["ms_per_token"] <= max(mode["samples_ms"])
    assert plain["tokens"] == host["tokens"] == 64 and plain["device_path"] is True
    assert host["host_argmax_agrees"] == 64   # the host's argmax of the downloaded rows is the engine's token
    # nested intervals, so no machine's load can reorder them: in every repetition each timed bitmask runs
    # inside a mask, and each mask and advance inside the decode steps that ms_per_token times (with the step
    # itself), over the same steps; an order that holds in every repetition holds for their medians
    assert 0 < g["bitmask_ms_per_token"] < g["mask_ms_per_token"] < con["ms_per_token"]
    assert 0 < g["advance_ms_per_token"] < con["ms_per_token"]
    assert g["grammar_ms_per_token"] == pytest.approx(g["mask_ms_per_token"] + g["advance_ms_per_token"])
    assert g["start_ms_per_request"] > 0 and g["tokenizer_build_s"] > 0
    a = con["answer"]
    assert g["masks_per_request"] == a["tokens"] and con["same_answer_every_repetition"]
    o = result["overhead"]
    assert o["constrained_vs_plain_pct"] == pytest.approx(100 * (con["ms_per_token"] / plain["ms_per_token"] - 1))
    assert o["sampler_rest_ms_per_token"] == pytest.approx(con["ms_per_token"] - host["ms_per_token"]
                                                           - g["grammar_ms_per_token"])


def test_the_constrained_answer_is_checked(result):
    a = result["constrained"]["answer"]
    assert 0 < a["tokens"] < 64 and a["finished"]   # small-py's answer ends within 64 tokens (cut: below)
    assert a["parses"] is True and a["valid"] is True and valid(json.loads(a["text"]), grammar.SCHEMA)


def test_answer_check_reports_what_it_finds():
    tok = tokenizer.Tokenizer(testmodels.SMALL_PY_DIR)
    eog = frozenset({2})
    good = '{"name": "a", "age": 3, "active": true, "tags": [], "city": "b"}'
    assert grammar.answer_check(tok, tok.encode(good) + [2], eog) | {"text": None} == {
        "text": None, "tokens": len(tok.encode(good)) + 1, "finished": True, "parses": True, "valid": True}
    assert grammar.answer_check(tok, tok.encode(good.replace("3", "300")) + [2], eog)["valid"] is False
    assert grammar.answer_check(tok, tok.encode('{"name": ') + [2], eog)["parses"] is False
    cut = grammar.answer_check(tok, tok.encode('{"name": '), eog)
    assert not cut["finished"] and cut["parses"] is None and cut["valid"] is None


def test_the_synthetic_tokenizer_holds_the_grammar():
    """The 7B's stand-in: Qwen2.5's size, the stop tokens the server finds, and the benchmark's grammar over
    it lets '{' start the answer and only end-of-generation follow a complete one."""
    from nanoqwen import paths
    from nanoqwen.serve.prompts import stop_ids
    tok = grammar.synthetic_tokenizer(paths.checkout())
    assert tok.vocab_size == grammar.QWEN25_TOKENIZER_SIZE
    vocab = 152064   # the 7B's embedding rows
    _plain, _grammars, constrained, eog = grammar.requests(tok, vocab, [1, 2, 3], 8)
    assert eog == stop_ids(tok) and tok.token_to_id("<|im_end|>") in eog
    m = constrained.constraint.start()
    z = np.zeros(vocab)
    m.mask(z)
    allowed = np.flatnonzero(np.isfinite(z))
    assert allowed.size > 0 and all(tok.decode([int(t)]).startswith("{") for t in allowed)
    for t in tok.encode('{"name": "a", "age": 3, "active": true, "tags": [], "city": "b"}'):
        z = np.zeros(vocab)
        m.mask(z)
        assert np.isfinite(z[t]), tok.decode([t])
        m.accept(t)
    z = np.zeros(vocab)
    m.mask(z)
    assert set(np.flatnonzero(np.isfinite(z)).tolist()) <= eog


def test_the_timed_matcher_changes_nothing():
    """Wrapped or not, a matcher masks the same logits and takes the same tokens; the wrapper counts its calls."""
    tok = tokenizer.Tokenizer(testmodels.SMALL_PY_DIR)
    _plain, _grammars, constrained, _eog = grammar.requests(tok, 2048, [1, 2, 3], 8)
    timer = grammar.Timed(constrained.constraint)
    bare, timed = constrained.constraint.start(), timer.start()
    rng = np.random.default_rng(0)
    for _ in range(12):
        z = rng.standard_normal(2048)
        a, b = z.copy(), z.copy()
        bare.mask(a)
        timed.mask(b)
        assert np.array_equal(a, b)
        t = int(np.argmax(a))
        bare.accept(t)
        timed.accept(t)
    assert timer.calls == {"start": 1, "mask": 12, "bitmask": 12, "accept": 12}
    assert all(s > 0 for s in timer.seconds.values())
    assert timer.seconds["bitmask"] < timer.seconds["mask"]


def test_bad_arguments_are_one_line_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        grammar.main(["--gen-tokens", "1"])
    assert e.value.code == 2 and "--gen-tokens must be at least 2" in capsys.readouterr().err
    assert grammar.main(["--backend", "reference", "--model", str(testmodels.SMALL_PY_DIR),
                         "--tokenizer", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: --tokenizer {tmp_path}: no tokenizer.json")
    with pytest.raises(NanoqwenError, match="pass --tokenizer DIR"):   # an installed wheel has no tests/data
        grammar.synthetic_tokenizer(None)
