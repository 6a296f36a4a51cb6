"""Host sampler: greedy ties, nucleus truncation, seeded reproducibility, parameter errors."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen.runtime.sampler import HostSampler, Sampling, SamplingError


def test_greedy_lowest_index_on_ties():
    assert HostSampler(Sampling())(np.array([1.0, 3.0, 3.0, -2.0], np.float32)) == 1


def test_top_p_keeps_the_nucleus_only():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = HostSampler(Sampling(temperature=1.0, top_p=0.7, seed=0))
    draws = {s(logits) for _ in range(400)}
    assert draws == {0, 1}, draws            # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut
    tiny = HostSampler(Sampling(temperature=1.0, top_p=1e-6, seed=0))
    assert {tiny(logits) for _ in range(50)} == {0}


def test_seed_reproducible_and_distribution():
    logits = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    a = HostSampler(Sampling(temperature=0.8, seed=5))
    b = HostSampler(Sampling(temperature=0.8, seed=5))
    xs = [a(logits) for _ in range(2000)]
    assert xs == [b(logits) for _ in range(2000)]
    p = np.exp(logits / 0.8 - (logits / 0.8).max())
    p /= p.sum()
    freq = np.bincount(xs, minlength=64) / len(xs)
    assert np.abs(freq - p).max() < 0.04


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                dict(top_p=1.5)])
def test_bad_parameters(kw):
    with pytest.raises(SamplingError):
        Sampling(**kw)


def test_penalties_arithmetic():
    logits = np.array([2.0, -1.0, 1.9, 0.0], np.float32)
    s = HostSampler(Sampling(repetition_penalty=2.0), prompt=[0])
    assert s(logits) == 2                      # 2.0 / 2 < 1.9: the seen token loses
    s = HostSampler(Sampling(repetition_penalty=2.0, penalty_window=1), prompt=[0, 3])
    assert s(logits) == 0                      # token 0 is outside the window of one
    s = HostSampler(Sampling(frequency_penalty=0.06))
    assert [s(logits) for _ in range(3)] == [0, 0, 2]   # 2.0 - 2 * 0.06 < 1.9 after two picks
    s = HostSampler(Sampling(presence_penalty=0.2, logit_bias=((3, 1.95),)))
    assert [s(logits) for _ in range(3)] == [0, 3, 2]   # bias lifts 3 to 1.95; each pick is penalized once


def test_top_k_and_min_p_cut():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    s = HostSampler(Sampling(temperature=1.0, top_k=2, seed=0))
    assert {s(logits) for _ in range(300)} == {0, 1}
    s = HostSampler(Sampling(temperature=1.0, min_p=0.45, seed=0))
    assert {s(logits) for _ in range(300)} == {0, 1, 2}   # 0.2 >= 0.45 * 0.4; 0.1 is cut


def test_infill_step():
    """llama.cpp's infill sampler: a token whose text begins a likelier one merges into it; likely
    end-of-generation ends the fill."""
    from nanoqwen.runtime.sampler import Vocab
    pieces = {0: "<eot>", 1: "re", 2: "return", 3: "x", 4: "y"}
    vocab = Vocab(pieces.__getitem__, frozenset({0}))
    kw = dict(order=("top_k", "infill"), top_k=5, vocab=vocab, seed=0)
    probs = np.array([0.001, 0.1, 0.35, 0.4, 0.149])
    s = HostSampler(Sampling(**kw))
    draws = {s(np.log(probs)) for _ in range(300)}
    assert {2, 3} <= draws <= {0, 2, 3}, draws   # "re" merged into "return" (0.45); "y" under 0.2 is cut
    s = HostSampler(Sampling(**kw))
    probs = np.array([0.001, 0.3, 0.35, 0.25, 0.099])
    draws = {s(np.log(probs)) for _ in range(300)}
    assert 2 in draws and draws <= {0, 2}, draws   # "x" (0.28 of the rest) is under 1 / 3
    s = HostSampler(Sampling(**kw))
    assert {s(np.log(np.array([0.2, 0.3, 0.2, 0.2, 0.1]))) for _ in range(50)} == {0}   # 3 * 0.2 * 5 > 0.8
    with pytest.raises(SamplingError, match="top_k"):
        Sampling(order=("infill",), vocab=vocab)
    with pytest.raises(SamplingError, match="'dry'"):
        Sampling(order=("dry",))
