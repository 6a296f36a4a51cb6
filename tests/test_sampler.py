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
