"""Prompt lookup drafting (runtime/drafters.py): the indexed search proposes exactly what a brute-force
scan of the sequence proposes, k adapts to acceptance within its bounds, bad settings are one clear error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoqwen.runtime.drafters import DraftModel, PromptLookup, SpeculateError, drafter_setting


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
