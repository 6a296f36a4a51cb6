"""Speculative greedy decoding on the CUDA engine (runtime/runner.py ``verify``: the chunked prefill of the
last token and k drafts, the decode step's lm_head on each of the k + 1 rows; host loop, not captured) on
the trained small-py model, 100 prompts of real Python (windows of standard-library files), 16 tokens:

* with prefill through the decode step (``prefill="decode"``) a verify is k + 1 decode steps, the very
  kernels plain decoding runs: the speculative output is plain greedy's, token for token, with the oracle
  drafter (100% acceptance), an always-wrong one and prompt lookup;
* with the tensor-core prefill the verify rows come from the prefill GEMMs, which round differently from
  the decode GEMV: the output must be plain greedy's on every prompt except where plain decoding's own
  top-1 margin at the first differing token is within twice the logits tolerance of the prefill
  (tests/gpu/test_prefill_runtime.py's LOGITS_TOL, relative to the logits' norm), at most 2 of 100;
* the drafted / accepted counts: the oracle accepts all it drafts, the always-wrong drafter none."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from _drafting import Scripted

from ._gpu_util import fresh_rng
from .test_prefill_runtime import LOGITS_TOL, corpus, window  # noqa: F401 - corpus is a fixture
from nanoqwen.runtime.drafters import DraftModel, PromptLookup

pytestmark = pytest.mark.gpu

NEW, PROMPTS = 16, 100


@pytest.fixture(scope="module")
def prompts(corpus):  # noqa: F811
    rng = fresh_rng()
    return [window(corpus, rng, int(rng.integers(8, 120))) for _ in range(PROMPTS)]


def cold(s, p, n=NEW, **kw):
    """A request with nothing kept: every run prefills the whole prompt the same way."""
    s.runner.cache.clear()
    return list(s.generate(p, n, **kw))


def plain(s, prompts):
    """(tokens, logits rows) of plain greedy decoding for each prompt."""
    s.runner.speculate = None
    out = []
    for p in prompts:
        pairs = cold(s, p, logits=True)
        out.append(([t for t, _ in pairs], [r for _, r in pairs]))
    return out


def near_tie(got, tokens, rows) -> tuple[int, float]:
    """(step, margin) where ``got`` first parts from plain greedy's ``tokens``, checked to be a near tie of
    plain decoding's logits there: each of the two top logits may move by up to the tolerance, so a flip
    needs a margin within twice it."""
    j = next(j for j, (a, b) in enumerate(zip(got, tokens)) if a != b)
    top2 = np.sort(rows[j])[-2:]
    margin = float(top2[1] - top2[0])
    assert margin <= 2 * LOGITS_TOL * float(np.linalg.norm(rows[j])), (j, margin)
    return j, margin


def drafters(vocab):
    return {"oracle": lambda want: (lambda q: Scripted(q, want, lambda t: t, 4)),
            "wrong": lambda want: (lambda q: Scripted(q, want, lambda t: (t + 1) % vocab, 4)),
            "lookup": lambda want: PromptLookup(max_draft=8)}


@pytest.mark.parametrize("kind", ["oracle", "wrong", "lookup"])
def test_decode_prefill_verify_is_plain_greedy(packed, prompts, kind):
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), 512, prefill="decode", log=lambda m: print(m, file=sys.stderr))
    try:
        want = plain(s, prompts)
        make = drafters(s.dims.vocab)[kind]
        drafted = accepted = 0
        for p, (tokens, _) in zip(prompts, want):
            s.runner.speculate = make(tokens)
            assert cold(s, p) == tokens
            drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
        assert drafted > 0
        assert accepted == drafted if kind == "oracle" else accepted == 0 if kind == "wrong" else accepted <= drafted
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["oracle", "wrong", "lookup"])
def test_chunked_prefill_verify_is_plain_greedy(sessions, prompts, kind):
    s = sessions("small-py")
    want = plain(s, prompts)
    make = drafters(s.dims.vocab)[kind]
    diverged = []
    try:
        for i, (p, (tokens, rows)) in enumerate(zip(prompts, want)):
            s.runner.speculate = make(tokens)
            got = cold(s, p)
            if got != tokens:
                diverged.append((i, *near_tie(got, tokens, rows)))
            if kind == "oracle":
                assert s.accepted_tokens == s.drafted_tokens or got != tokens
    finally:
        s.runner.speculate = None
    print(f"speculate {kind}: {len(diverged)} of {PROMPTS} prompts differ at near-ties {diverged}", file=sys.stderr)
    assert len(diverged) <= 2


def test_draft_model_verify_is_plain_greedy(sessions, packed, prompts):
    """small-py drafting for itself through a second CudaSession (its own KV cache, prefix cache and
    graphs, the same stream order): plain greedy's text but for near ties, as above, and the drafts, its
    own greedy continuation, accepted but where the verify's chunked rows break such a tie."""
    from nanoqwen.runtime.session import CudaSession
    s = sessions("small-py")
    want = plain(s, prompts[:30])
    draft = CudaSession(packed("small-py"), 512, log=lambda m: print(m, file=sys.stderr))
    diverged, drafted, accepted = [], 0, 0
    try:
        s.runner.speculate = DraftModel(str(packed("small-py")), max_draft=4, engine=draft)
        for i, (p, (tokens, rows)) in enumerate(zip(prompts, want)):
            got = cold(s, p)
            if got != tokens:
                diverged.append((i, *near_tie(got, tokens, rows)))
            drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
    finally:
        s.runner.speculate = None
        draft.close()
    print(f"draft model: {accepted} of {drafted} drafts accepted; near-tie partings {diverged}", file=sys.stderr)
    assert len(diverged) <= 1 and drafted > 0 and accepted >= 0.9 * drafted
