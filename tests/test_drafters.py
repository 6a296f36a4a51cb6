"""Prompt lookup drafting (runtime/drafters.py): the vectorized scan proposes exactly what a brute-force
scan of the sequence proposes, k adapts to acceptance within its bounds, bad settings are one clear error;
with measured step costs the draft length is the one of the best expected rate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoqwen.runtime.drafters import (EXPLORE, PRIOR, DraftModel, PromptLookup, Speculation, SpeculateError,
                                       best_draft, drafter_setting)


def brute_force(seq: list[int], setting: PromptLookup, k: int) -> list[int]:
    """The longest suffix n-gram's most recent earlier occurrence (ending before the last token), and
    up to k tokens after it."""
    for n in range(setting.max_ngram, setting.min_ngram - 1, -1):
        if len(seq) < n:
            continue
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n:end] == seq[len(seq) - n:]:
                return seq[end:end + k]
    return []


small_seqs = st.lists(st.integers(0, 5), max_size=60)   # a small alphabet: many repeats


@given(small_seqs, st.lists(small_seqs, max_size=4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 10))
def test_lookup_matches_brute_force(prompt, outputs, lo, span, max_draft):
    setting = PromptLookup(max_draft=max_draft, max_ngram=lo + span - 1, min_ngram=lo)
    d = setting(prompt)
    seq = list(prompt)
    for chunk in [[]] + outputs:   # appended in pieces, as the engine appends accepted blocks
        d.append(chunk)
        seq += chunk
        assert d.draft(99) == brute_force(seq, setting, max_draft)
        assert d.draft(2) == brute_force(seq, setting, min(2, max_draft))
        assert d.draft(0) == []


def test_lookup_proposes_the_continuation_of_the_longest_match():
    d = PromptLookup(max_draft=3)([1, 2, 3, 4, 5, 9, 3, 4, 7, 7, 2, 3, 4])
    assert d.draft(8) == [5, 9, 3]    # "2 3 4" (n = 3) beats the later "3 4" followed by 7
    d.append([8])
    assert d.draft(8) == []           # 8 never occurred before
    assert PromptLookup()([5]).draft(8) == []


def test_draft_length_adapts_to_acceptance():
    setting = PromptLookup(max_draft=6)
    d = setting(list(range(10)) * 3)
    assert d.k == 6
    d.record(6, 2)
    d.record(5, 0)
    assert d.k == 4
    for _ in range(10):
        d.record(d.k, 0)
    assert d.k == 1                    # never below 1
    d.record(1, 1)
    assert d.k == 3
    d.record(0, 0)                     # nothing drafted: nothing learned
    assert d.k == 3
    for _ in range(5):
        d.record(d.k, d.k)
    assert d.k == 6                    # never above max_draft
    assert len(d.draft(99)) == 6


@pytest.mark.parametrize("kw", [dict(max_draft=0), dict(max_draft=65), dict(min_ngram=0),
                                dict(min_ngram=3, max_ngram=2)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(SpeculateError):
        PromptLookup(**kw)


def test_cli_setting(tmp_path):
    assert drafter_setting(None) is None
    assert drafter_setting("lookup", 5) == PromptLookup(max_draft=5)
    assert drafter_setting(f"draft:{tmp_path}", 5) == DraftModel(str(tmp_path), max_draft=5)
    for bad in ("draft:", "draft", "ngram"):
        with pytest.raises(SpeculateError, match="--speculate must be one of lookup, draft:FILE"):
            drafter_setting(bad)
    with pytest.raises(SpeculateError, match="draft:/nonexistent.nanoqwen: no such file or directory"):
        drafter_setting("draft:/nonexistent.nanoqwen")
    for kind in ("lookup", f"draft:{tmp_path}"):
        with pytest.raises(SpeculateError, match="--draft-tokens"):
            drafter_setting(kind, 0)


# ---- the draft length by measured step costs (Speculation with costs) ------------------------------------

H200 = {1: 1.655, 2: 2.059, 4: 3.283, 8: 5.277, 16: 12.459}   # results/speculate-h200-2026-12-04-rows-tuned.json


def expected_rate(p: float, k: int, costs: dict) -> float:
    """Tokens per ms of drafts of length k (brute force over the first rejection)."""
    tokens = sum(p ** i * ((1 - p) if i < k else 1) * (i + 1) for i in range(k + 1))
    return tokens / costs[min(m for m in costs if m >= k + 1)]


@pytest.mark.parametrize("p", [0.0, 0.1, 0.3, 0.6, 0.85, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("costs", [H200, {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.6}, {1: 1.0, 2: 1.5}])
def test_best_draft_is_the_best_rate(p, costs):
    """best_draft picks the k of the most expected tokens per unit of time (k = 0: a plain step), no k whose
    rows no measured step holds, and never more than the limit."""
    for limit in (0, 1, 3, 15):
        k = best_draft(p, costs, limit)
        fits = [j for j in range(limit + 1) if any(m >= j + 1 for m in costs)]
        assert k in fits and expected_rate(p, k, costs) >= max(expected_rate(p, j, costs) for j in fits) - 1e-12


def test_best_draft_on_the_h200_costs():
    """Today's 7B steps (16 rows cost 7.5 decode steps): plain below ~25% acceptance, a single draft in the
    middle, 8 rows only for drafts that are nearly always right; 16 rows never."""
    assert [best_draft(p, H200, 15) for p in (0.1, 0.4, 0.8, 0.95)] == [0, 1, 3, 7]


class Scripted:
    """A drafter proposing `limit` tokens of `draft` each time, recording what it was asked."""

    def __init__(self):
        self.asked = []

    def draft(self, limit):
        self.asked.append(limit)
        return [7] * limit

    def append(self, tokens):
        pass

    def record(self, drafted, accepted):
        pass


def test_speculation_learns_acceptance_and_explores():
    """Rejected drafts lower the estimate until the costs make plain steps the best; then every EXPLORE-th
    step still verifies one draft, whose acceptance raises the estimate again. Without costs the drafter's
    k stands."""
    d = Scripted()
    s = Speculation(d, H200)
    assert s.acceptance == PRIOR[0] / sum(PRIOR)
    while drafts := s.draft(15):   # every draft rejected at once, until the costs say plain steps
        s.accept(drafts, [0] * (len(drafts) + 1))
    assert s.acceptance < 0.25 and best_draft(s.acceptance, H200, 15) == 0
    asked = len(d.asked)
    after = [s.draft(15) for _ in range(EXPLORE - 1)]   # the EXPLORE-th plain step in a row verifies one draft
    assert after[:-1] == [[]] * (EXPLORE - 2) and after[-1] == [7] and len(d.asked) == asked + 1
    s.accept(after[-1], after[-1] + [1])
    for _ in range(30):   # now every draft accepted
        drafts = s.draft(15)
        if drafts:
            s.accept(drafts, drafts + [1])
    assert s.acceptance > 0.9 and len(s.draft(15)) == 7
    free = Speculation(Scripted())
    assert len(free.draft(15)) == 15 and free.draft(0) == []


def state(s: Speculation) -> tuple:
    return s.plain_run, s.seen, s.drafted, s.accepted, s.verifies, s.drafter.asked


def test_commit_plain_on_the_h200_costs():
    """Below the plain threshold the rounds up to the exploring verify are committed at once, at most the
    limit; none where a draft is worth it, where the next round explores, or without costs."""
    s = Speculation(Scripted(), H200)
    s.seen = [1.0, 9.0]   # p = 0.1: plain steps
    assert s.commit_plain(15) == EXPLORE - 1 and s.plain_run == EXPLORE - 1
    assert s.commit_plain(15) == 0 and s.draft(15) == [7] and s.plain_run == 0   # the next round explores
    assert s.commit_plain(4) == 4 and s.commit_plain(15) == EXPLORE - 5 and s.commit_plain(0) == 0
    s.plain_run, s.seen = 3, [8.0, 2.0]   # p = 0.8: drafts
    assert s.commit_plain(15) == 0 and s.plain_run == 3
    assert s.drafter.asked == [1]
    assert Speculation(Scripted()).commit_plain(15) == 0 and Speculation(None, H200).commit_plain(15) == 0


@given(st.integers(0, EXPLORE - 1), st.floats(0.01, 5.0), st.floats(0.01, 5.0), st.integers(2, 40),
       st.integers(1, 15), st.sampled_from([H200, {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.6}, {1: 1.0, 2: 1.5}, None]))
def test_commit_plain_is_the_rounds_it_replaces(plain_run, accepted, rejected, left, max_draft, costs):
    """commit_plain(limit) is the n next rounds whose draft() returns [] without asking the drafter, their
    limits shrinking with the tokens left as the engine passes them (``left`` tokens to go): it leaves the
    state n such calls leave, and is all of them up to the limit (the round after it drafts alike)."""
    new, old = Speculation(Scripted(), costs), Speculation(Scripted(), costs)
    for s in (new, old):
        s.plain_run, s.seen = plain_run, [accepted, rejected]

    def limit(j):   # the draft limit j rounds on
        return min(left - 1 - j, max_draft)

    n = new.commit_plain(limit(0))
    assert 0 <= n <= limit(0)
    for j in range(n):
        assert old.draft(limit(j)) == [] and not old.drafter.asked
    assert state(new) == state(old)
    if n < limit(0):   # a round that may draft follows
        assert new.draft(limit(n)) == old.draft(limit(n)) and old.drafter.asked
        assert state(new) == state(old)
