"""Speculative greedy decoding on the numpy ReferenceEngine (backends.py), trained small-py model: the
output is token for token plain greedy decoding's on 100 prompts with prompt lookup and with adversarial
drafters (always wrong, oracle, random) and with a draft model (itself: every draft accepted; random
weights; a foreign vocabulary refused); the drafted / accepted counts are exact; the prefix cache keeps
only accepted positions; logits rows, early close and temperature > 0 (drafting off) keep the contract."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from _drafting import Script
from _texts import code_text

from nanoqwen.backends import ReferenceEngine, open_engine
from nanoqwen.reference import Reference
from nanoqwen.runtime.drafters import DraftModel, PromptLookup, SpeculateError, accept
from nanoqwen.runtime.sampler import Sampling

N_NEW = 12


@pytest.fixture(scope="module")
def cases(small_py):
    """100 prompts (windows of a committed copy of a standard-library module's source: code that repeats
    itself, as edits do) with their plain greedy continuations from the bare simulation."""
    path, tok = small_py
    src = tok.encode(code_text())
    ref = Reference.from_file(path, max_seq=256)
    prompts = [src[i * 53:i * 53 + 24 + i % 17] for i in range(100)]
    return [(p, ref.generate_greedy(p, N_NEW)) for p in prompts]


def test_accept_rule():
    assert accept([], [7]) == [7]
    assert accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accept([1, 2, 3], [9, 2, 3, 4]) == [9]


def test_prompt_lookup_is_plain_greedy_on_100_prompts(small_py, cases):
    e = ReferenceEngine(small_py[0], context=256, speculate=PromptLookup(max_draft=6))
    drafted = accepted = 0
    for prompt, expected in cases:
        assert list(e.generate(prompt, N_NEW)) == expected
        assert 0 <= e.accepted_tokens <= e.drafted_tokens
        drafted, accepted = drafted + e.drafted_tokens, accepted + e.accepted_tokens
    assert accepted > 0 and drafted > accepted   # lookup both hits and misses on this text


@pytest.mark.parametrize("kind", ["wrong", "oracle", "random"])
def test_adversarial_drafters_keep_greedy_output(small_py, cases, kind):
    e = ReferenceEngine(small_py[0], context=256)
    vocab, rng = e.dims.vocab, random.Random(0)
    mangle = {"wrong": lambda t: (t + 1) % vocab, "oracle": lambda t: t,
              "random": lambda t: t if rng.random() < 0.5 else rng.randrange(vocab)}[kind]
    for prompt, expected in cases[:40]:
        e.speculate = Script(expected, mangle, 4)
        assert list(e.generate(prompt, N_NEW)) == expected
        if kind == "wrong":   # one token per step, each step drafting min(4, the tokens left but one)
            assert (e.drafted_tokens, e.accepted_tokens) == (sum(min(4, N_NEW - 1 - i) for i in range(1, N_NEW)), 0)
        if kind == "oracle":   # 1 from prefill, 4 + 1 twice, then the last token with nothing left to draft
            assert (e.drafted_tokens, e.accepted_tokens) == (8, 8)


def test_kept_sequence_counts_accepted_positions_only(small_py, cases):
    """Rejected drafts' K/V is never kept: the kept tokens are prompt + every generated token but the
    last, and a request continuing them reuses exactly those and generates what a cold engine does."""
    path, _ = small_py
    prompt, expected = cases[3]
    e = ReferenceEngine(path, context=256)
    e.speculate = Script(expected, lambda t: (t + 1) % e.dims.vocab, 3)
    assert list(e.generate(prompt, N_NEW)) == expected
    (kept,) = e.cache.kept.values()
    assert kept.tokens == prompt + expected[:-1]
    assert all(len(rows) == len(kept.tokens) for kv in kept.payload for rows in kv)
    follow = prompt + expected
    e.speculate = PromptLookup()
    again = list(e.generate(follow, N_NEW))
    assert e.cached_tokens == len(follow) - 1
    assert again == list(ReferenceEngine(path, context=256).generate(follow, N_NEW))


def test_logits_rows_match_plain_decoding(small_py, cases):
    path, _ = small_py
    prompt, expected = cases[7]
    plain = list(ReferenceEngine(path, context=256).generate(prompt, N_NEW, logits=True))
    e = ReferenceEngine(path, context=256)
    e.speculate = Script(expected, lambda t: t, 4)
    spec = list(e.generate(prompt, N_NEW, logits=True))
    assert [t for t, _ in spec] == expected == [t for t, _ in plain]
    for (_, a), (_, b) in zip(spec, plain):   # a verify row is computed as one decode step: the same bits
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert spec[0][1] is not spec[1][1]        # copies, safe to keep


def test_early_close_keeps_what_was_computed(small_py, cases):
    """Closing mid-block (the oracle accepts 4 at a time) keeps the accepted positions; the next request
    continuing them generates the cold output."""
    path, _ = small_py
    prompt, expected = cases[11]
    e = ReferenceEngine(path, context=256)
    e.speculate = Script(expected, lambda t: t, 4)
    stream = e.generate(prompt, N_NEW)
    got = [next(stream) for _ in range(3)]
    stream.close()
    assert got == expected[:3]
    (kept,) = e.cache.kept.values()
    assert kept.tokens == (prompt + expected)[:len(kept.tokens)] and len(kept.tokens) >= len(prompt) + 2
    follow = prompt + expected[:6]
    e.speculate = PromptLookup()
    assert list(e.generate(follow, 8)) == list(ReferenceEngine(path, context=256).generate(follow, 8))
    assert e.cached_tokens == len(kept.tokens)


def test_close_closes_the_setting(small_py, cases):
    """An engine's close() closes its drafter setting (a draft model's engine), whatever set it."""
    closed = []

    class Setting(Script):
        def close(self):
            closed.append(self)

    prompt, expected = cases[2]
    e = ReferenceEngine(small_py[0], context=256)
    e.speculate = setting = Setting(expected, lambda t: t, 4)
    assert list(e.generate(prompt, N_NEW)) == expected
    e.close()
    assert closed == [setting]


def test_sampling_switches_drafting_off(small_py, cases):
    path, _ = small_py
    prompt, _ = cases[0]
    sampling = Sampling(temperature=0.8, seed=5)
    e = ReferenceEngine(path, context=256)
    e.speculate = lambda p: pytest.fail("a drafter was started for a sampled request")
    out = list(e.generate(prompt, N_NEW, sampling))
    assert (e.drafted_tokens, e.accepted_tokens) == (0, 0)
    assert out == list(ReferenceEngine(path, context=256).generate(prompt, N_NEW, sampling))


def test_open_engine_passes_the_setting(small_py):
    path, _ = small_py
    e = open_engine("reference", path, 64, speculate=PromptLookup(max_draft=3))
    assert e.speculate == PromptLookup(max_draft=3)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shortest_requests(small_py, cases, n):
    """max_new_tokens 1..3: nothing or little left to draft; the output is still plain greedy's."""
    prompt, expected = cases[5]
    e = ReferenceEngine(small_py[0], context=256)
    e.speculate = Script(expected, lambda t: t, 4)
    assert list(e.generate(prompt, n)) == expected[:n]
    assert e.drafted_tokens == e.accepted_tokens == max(0, n - 2)


def _random_draft(small_py, tmp_path, **dims) -> str:
    """A one-layer model of random weights: small-py's vocabulary unless ``dims`` changes it."""
    from nanoqwen.nqfile import NanoqwenFile
    from nanoqwen.pack import pack_random
    d = dataclasses.replace(NanoqwenFile(small_py[0]).dims, layers=1, **dims)
    return str(pack_random(d, tmp_path / "draft.nanoqwen", workers=1))


def test_draft_model_of_itself_is_accepted_whole(small_py, cases):
    """The model drafting for itself: its own greedy continuation, so every draft is accepted (the draft
    engine's prefix cache gives the same numbers as a cold run), and the output is plain greedy's."""
    e = open_engine("reference", small_py[0], 256, speculate=DraftModel(str(small_py[0]), max_draft=4))
    try:
        for prompt, expected in cases[:15]:
            assert list(e.generate(prompt, N_NEW)) == expected
            assert e.accepted_tokens == e.drafted_tokens > 0
    finally:
        e.close()


def test_draft_model_of_other_weights_keeps_greedy_output(small_py, cases, tmp_path):
    e = open_engine("reference", small_py[0], 256,
                    speculate=DraftModel(_random_draft(small_py, tmp_path), max_draft=4))
    drafted = accepted = 0
    try:
        for prompt, expected in cases[:15]:
            assert list(e.generate(prompt, N_NEW)) == expected
            drafted, accepted = drafted + e.drafted_tokens, accepted + e.accepted_tokens
    finally:
        e.close()
    assert 0 <= accepted < drafted   # random weights: most drafts rejected, the text unchanged


def test_draft_model_must_share_the_vocabulary(small_py, tmp_path):
    draft = _random_draft(small_py, tmp_path, vocab=512)
    with pytest.raises(SpeculateError, match=r"draft:.*draft.nanoqwen: its vocabulary has 512 tokens, the model's \d+"):
        open_engine("reference", small_py[0], 256, speculate=DraftModel(draft))
