"""The CUDA engine's speculative path (runtime/runner.py: ``verify`` and the speculative rounds) on the
fake device of tests/test_decoder_plan.py (the numpy reference with paged K/V standing in for the GPU),
with the prompt prefilled through the decode step or batched and each verify a multi-row step:
greedy tokens equal plain decoding's with always-wrong, oracle, random and prompt-lookup drafters, the
device is fed exactly the verified positions, the kept sequence holds only accepted positions, and
closing early keeps what was accepted. With step costs, the plain steps the speculation commits to are
launched ahead of the host, with the counters of one draft() per round.

Class (a) of docs/architecture.md ("Exact or within a tolerance"): the fake device computes every row,
batched or not, as the numpy reference's single decode step (``Reference.extend`` is row invariant), so a
verify row is bitwise the plain step's and tokens are compared exactly, as on the GPU, whose multi-row
step keeps the single-row arithmetic per row (tests/gpu/test_speculate.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from _drafting import Script
from test_decoder_plan import PROMPT, fake_device, nqfile  # noqa: F401 - nqfile is a fixture
from test_drafters import H200

from nanoqwen.reference import Reference
from nanoqwen.runtime.drafters import PromptLookup, Speculation
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
            Script(want, mangle, 3)
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
    run.speculate = Script(want, lambda t: t, 3)
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
    run.speculate = Script(want, lambda t: t, 3)
    assert list(run.generate(PROMPT, n)) == want
    assert run.spec.drafted == run.spec.accepted == max(0, n - 2)
    (kept,) = run.cache.kept.values()
    assert kept.tokens == PROMPT + want[:-1]


def one_draft_per_round(spec: Speculation, want: list[int], max_draft: int) -> Speculation:
    """The speculative rounds as they ran before plain steps were committed (a draft() every round, each
    round without drafts one step), on the host alone with the model choosing ``want``: the choices after a
    rejected draft are not the model's, but nothing reads them."""
    gen = spec.accept([], want[:1])
    while len(gen) < len(want):
        drafts = spec.draft(min(len(want) - len(gen) - 1, max_draft))
        gen += spec.accept(drafts, want[len(gen):len(gen) + len(drafts) + 1])
    return spec


def logged(run, monkeypatch) -> list:
    """("step", position) for each decode step enqueued, ("wait", step) for each token the host waits on."""
    log, step, wait = [], run.decoder.step, run.shared.wait_step
    monkeypatch.setattr(run.decoder, "step", lambda i, **kw: (log.append(("step", i)), step(i, **kw))[1])
    monkeypatch.setattr(run.shared, "wait_step", lambda i: (log.append(("wait", i)), wait(i))[1])
    return log


N_LONG = 40   # long enough for the H200 costs to turn rejected drafts into plain stretches, and explore


@pytest.mark.parametrize("kind", ["wrong", "rare", "random", "oracle", "lookup"])
def test_committed_plain_steps_run_ahead(nqfile, monkeypatch, kind):  # noqa: F811
    """With the H200's step costs: plain greedy's tokens, the counters and acceptance estimate of one
    draft() per round, and the committed plain steps enqueued ``ahead`` of the token the host waits on
    (drafts always rejected: the costs choose plain stretches), never further."""
    run, dev = spec_device(nqfile, monkeypatch, True)
    want = list(run.generate(PROMPT, N_LONG))

    def setting():
        rng, vocab = random.Random(1), run.dims.vocab
        chance = {"wrong": 0.0, "rare": 0.15, "random": 0.6, "oracle": 1.0}.get(kind)
        return PromptLookup(max_draft=4) if kind == "lookup" else \
            Script(want, lambda t: t if rng.random() < chance else (t + 1) % vocab, 3)

    before = one_draft_per_round(Speculation(setting()(PROMPT), H200), want, run.max_draft)
    run.speculate, run.costs = setting(), H200
    run.cache.clear()
    dev.fed.clear()
    log = logged(run, monkeypatch)
    assert list(run.generate(PROMPT, N_LONG)) == want
    s = run.spec
    assert (s.drafted, s.accepted, s.verifies, s.seen, s.plain_run) == \
        (before.drafted, before.accepted, before.verifies, before.seen, before.plain_run)
    assert len(dev.fed) == len(PROMPT) + N_LONG - 1 + s.drafted - s.accepted
    (kept,) = run.cache.kept.values()
    assert kept.tokens == PROMPT + want[:-1]
    steps, ahead = [], []
    for what, i in log:
        if what == "step":
            steps.append(i)
        else:
            ahead.append(max(steps, default=i) - i)   # steps enqueued past the one waited on
    assert max(ahead) <= run.ahead
    if kind == "wrong":
        assert max(ahead) == run.ahead and s.verifies < N_LONG // 2


def test_close_in_a_plain_stretch_keeps_its_launched_steps(nqfile, monkeypatch):  # noqa: F811
    """Closing inside a committed plain stretch: the steps launched ahead drain and are kept, their K/V
    and tokens greedy's; the next request continues from them."""
    run, dev = spec_device(nqfile, monkeypatch, True)
    want = list(run.generate(PROMPT, N_LONG))
    run.cache.clear()
    run.speculate, run.costs = Script(want, lambda t: (t + 1) % run.dims.vocab, 3), H200
    it = run.generate(PROMPT, N_LONG)
    first = [next(it) for _ in range(12)]   # the verifies have made plain steps the rule's choice by now
    it.close()
    assert first == want[:12]
    (kept,) = run.cache.kept.values()
    assert len(kept.tokens) > len(PROMPT) + 12   # positions launched past the last token read
    assert kept.tokens == PROMPT + want[:len(kept.tokens) - len(PROMPT)] == dev.history
    q = PROMPT + first + [11, 12]
    got = list(run.generate(q, 5))
    assert run.cached_tokens >= len(PROMPT) + 12
    run.speculate = None
    run.cache.clear()
    assert got == list(run.generate(q, 5))
