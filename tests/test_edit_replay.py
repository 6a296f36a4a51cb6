"""nanoqwen/bench/edit_replay.py on the CPU: the runner's speculative rounds replayed from plain greedy output
(the same Speculation, its verify answered by the plain tokens), and their price under step costs."""

from __future__ import annotations

import pytest

from nanoqwen.bench.edit_replay import Rounds, price, replay, sensitivity
from nanoqwen.runtime.drafters import PromptLookup

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
COSTS = {1: 2.0, 2: 2.2, 4: 2.8, 8: 4.1, 16: 11.0}
COPIED = 80   # characters of the changed copy the edit model must write (margin for another CPU's rounding)


@pytest.mark.parametrize("costs", [None, COSTS])
def test_a_copy_of_the_prompt_is_drafted_and_accepted(costs):
    """Plain output that repeats the prompt: prompt lookup drafts it and every draft is accepted; the rounds
    account for every token after the prefill's."""
    plain = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    r = replay(PROMPT, plain, PromptLookup(max_draft=7), costs, max_draft=7)
    assert r.accepted == r.drafted > 0 and all(2 <= n <= 8 for n in r.verify_rows)
    assert len(r.verify_rows) + r.accepted + r.plain_steps == len(plain) - 1


def test_wrong_drafts_cost_a_verify_and_yield_one_token():
    """Plain output that never continues what the prompt did: each verify accepts nothing and gives the
    model's own token, as the runner's does; the replayed tokens are plain's."""
    plain = [5, 1, 5, 2, 5, 3, 5, 4]   # after 5 the prompt had 6, the model never says 6
    r = replay(PROMPT, plain, PromptLookup(max_draft=3), None, max_draft=3)
    assert r.verify_rows and r.accepted == 0 and r.drafted == sum(n - 1 for n in r.verify_rows)
    assert len(r.verify_rows) + r.plain_steps == len(plain) - 1   # a verify's one token, or a plain step's


def test_price_counts_each_verify_at_its_bucket_and_plain_steps_at_the_decode_step():
    """Two verifies (3 rows -> the 4-row bucket, 8 rows -> 8) and 2 plain steps against 13 plain steps
    (2 + 2 tokens from the verifies' bonus tokens, 7 accepted, 2 plain)."""
    r = Rounds(verify_rows=[3, 8], plain_steps=2, drafted=9, accepted=7)
    p = price([r], COSTS, 2.0, host_ms=0.5)
    assert p["spec_ms"] == pytest.approx(2.8 + 4.1 + 2 * 2.0 + 2 * 0.5)
    assert p["plain_ms"] == pytest.approx(2.0 * (2 + 7 + 2)) and p["verifies"] == 2
    assert p["speedup"] == pytest.approx(p["plain_ms"] / p["spec_ms"])
    assert p["verifies_by_bucket"] == {4: 1, 8: 1}


def test_sensitivity_prices_each_bucket_cheaper_in_turn():
    """A bucket the rounds never use leaves the speed-up as it is; the bucket they use raises it, and the
    replay under the cheaper bucket still yields plain's tokens (replay asserts it)."""
    plain = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    cases, setting = [(PROMPT, plain)], PromptLookup(max_draft=3)
    base = price([replay(PROMPT, plain, setting, COSTS, 3)], COSTS, 2.0)
    used = base["verifies_by_bucket"]
    s = sensitivity(cases, setting, COSTS, 2.0, 0.0, 3)
    assert set(s) == set(COSTS) and used
    for m, x in s.items():
        if m in used:
            assert x > base["speedup"]
        elif m > max(used):
            assert x == pytest.approx(base["speedup"])


def test_a_measured_run_of_another_model_needs_the_hosts_work_given():
    """A speculate JSON from before the edit model (its edit run records no model: small-py's) prices the
    rounds but cannot calibrate the host's work a verify: without --host-ms the replay refuses, before it runs
    anything."""
    from nanoqwen.bench.edit_replay import run
    with pytest.raises(ValueError, match="tests/data/small-py's, not tests/data/small-py-edit's"):
        run({"edit": {"costs_ms": {"1": 0.05}}}, {})


def test_the_edit_model_writes_the_changed_copy():
    """bench/edits.EDIT_MODEL, trained on the workload's format from other files than its source, continues
    a function (each change) with the copy the instruction asks for: 109 characters of it here, where small-py,
    which never saw the format, copies 61 (measured when it was trained: docs/perf-notes.md)."""
    from nanoqwen import paths
    from nanoqwen.backends import ReferenceEngine
    from nanoqwen.bench.edits import EDIT_MODEL, EDIT_SOURCE, KINDS, edit, functions
    from nanoqwen.modelcache import resolve
    from nanoqwen.tokenizer import load
    top = paths.checkout()
    model, fn = top / EDIT_MODEL, functions((top / EDIT_SOURCE).read_text())[2]
    tok, engine = load(model), ReferenceEngine(resolve(model, log=lambda m: None), 1024)
    for kind in KINDS:
        prompt, answer = edit(*fn, kind)
        out = tok.decode(list(engine.generate(tok.encode(prompt), 48)))
        assert answer.startswith(out[:COPIED]), (kind, out)
