"""The CUDA engine's speculative path (runtime/runner.py: ``verify`` and the speculative rounds) on the
fake device of tests/test_decoder_plan.py (the numpy reference with paged K/V standing in for the GPU),
with the prompt prefilled through the decode step or batched and each verify a multi-row step:
greedy tokens equal plain decoding's with always-wrong, oracle, random and prompt-lookup drafters, the
device is fed exactly the verified positions, the kept sequence holds only accepted positions, and
closing early keeps what was accepted."""

from __future__ import annotations

import random

import numpy as np
import pytest
from _drafting import Scripted
from test_decoder_plan import PROMPT, fake_device, nqfile  # noqa: F401 - nqfile is a fixture

from nanoqwen.reference import Reference
from nanoqwen.runtime.drafters import PromptLookup
from nanoqwen.runtime.sampler import Sampling

N_NEW = 14


class FakeRows:
    """The multi-row step (runtime/rowstep.py) on the fake device: row r, token r at positions[r], computed
    as one reference decode step each (Reference.extend is row invariant), its K/V stored in the pages."""
    m = 16

    def __init__(self, dev, ref):
        self.dev, self.ref = dev, ref

    def run(self, tokens, positions):
        assert positions == list(range(positions[0], positions[0] + len(tokens))), positions
        self.dev.load(positions[0])
        logits = self.ref.extend(tokens)
        self.dev.store(positions[0], tokens)
        return [int(np.argmax(row)) for row in logits]


def spec_device(nqfile, monkeypatch, batched: bool):  # noqa: F811
    """The fake device with the multi-row step; ``batched``: the prompt through the fake batched prefill,
    else token by token."""
    ref = Reference.from_file(nqfile, max_seq=100)
    run, dev = fake_device(nqfile, monkeypatch, ref, batched_prefill=batched)
    run.rows, run.max_draft = FakeRows(dev, ref), FakeRows.m - 1
    return run, dev


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("kind", ["wrong", "oracle", "random", "lookup"])
def test_speculative_tokens_are_plain_greedy(nqfile, monkeypatch, batched, kind):  # noqa: F811
    run, dev = spec_device(nqfile, monkeypatch, batched)
    prompts = [PROMPT, PROMPT[:5] * 3, [7, 8, 9, 10] * 4]
    plain = []
    for p in prompts:
        run.cache.clear()
        plain.append(list(run.generate(p, N_NEW)))
    vocab, rng = run.dims.vocab, random.Random(1)
    mangle = {"wrong": lambda t: (t + 1) % vocab, "oracle": lambda t: t,
              "random": lambda t: t if rng.random() < 0.6 else rng.randrange(vocab)}.get(kind)
    for p, want in zip(prompts, plain):
        run.speculate = PromptLookup(max_draft=4) if kind == "lookup" else \
            (lambda q, want=want: Scripted(q, want, mangle, 3))
        run.cache.clear()
        dev.fed.clear()
        assert list(run.generate(p, N_NEW)) == want
        assert 0 <= run.spec.accepted <= run.spec.drafted
        if kind == "oracle":
            assert run.spec.accepted == run.spec.drafted > 0
        if kind == "wrong":
            assert run.spec.accepted == 0 and run.spec.drafted > 0
        (kept,) = run.cache.kept.values()
        assert kept.tokens == p + want[:-1]   # only accepted positions
        # every verify fed the last token and its drafts; the positions of the accepted ones stay
        assert len(dev.fed) == len(p) + N_NEW - 1 + run.spec.drafted - run.spec.accepted
        assert dev.history[:len(kept.tokens)] == kept.tokens


def test_sampling_and_logits_decode_plainly(nqfile, monkeypatch):  # noqa: F811
    run, _ = spec_device(nqfile, monkeypatch, True)
    run.speculate = lambda q: pytest.fail("a drafter was started")
    sampled = list(run.generate(PROMPT, 6, Sampling(temperature=0.7, seed=2)))
    pairs = list(run.generate(PROMPT, 6, logits=True))
    run.speculate = None
    run.cache.clear()
    assert sampled == list(run.generate(PROMPT, 6, Sampling(temperature=0.7, seed=2)))
    assert [t for t, _ in pairs] == list(run.generate(PROMPT, 6)) and all(int(np.argmax(r)) == t for t, r in pairs)


def test_close_mid_block_keeps_accepted_positions(nqfile, monkeypatch):  # noqa: F811
    run, dev = spec_device(nqfile, monkeypatch, True)
    want = list(run.generate(PROMPT, N_NEW))
    run.cache.clear()
    run.speculate = lambda q: Scripted(q, want, lambda t: t, 3)
    it = run.generate(PROMPT, N_NEW)
    first = [next(it) for _ in range(3)]   # the prefill's token, then 2 of the first verify's 4
    it.close()
    assert first == want[:3]
    (kept,) = run.cache.kept.values()
    assert kept.tokens == PROMPT + want[:4]   # the whole verified block's positions: 4 accepted tokens fed
    run.speculate = PromptLookup()
    q = PROMPT + want[:6]
    got = list(run.generate(q, 5))
    assert run.cached_tokens == len(PROMPT) + 4
    run.speculate = None
    run.cache.clear()
    assert got == list(run.generate(q, 5))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shortest_requests(nqfile, monkeypatch, n):  # noqa: F811
    run, _ = spec_device(nqfile, monkeypatch, True)
    want = list(run.generate(PROMPT, n))
    run.cache.clear()
    run.speculate = lambda q: Scripted(q, want, lambda t: t, 3)
    assert list(run.generate(PROMPT, n)) == want
    assert run.spec.drafted == run.spec.accepted == max(0, n - 2)
    (kept,) = run.cache.kept.values()
    assert kept.tokens == PROMPT + want[:-1]
