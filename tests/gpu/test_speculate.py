"""Speculative greedy decoding on the CUDA engine (runtime/runner.py ``verify``: the chunked prefill of the
last token and k drafts, the decode step's lm_head on each of the k + 1 rows; host loop, not captured) on
the trained small-py model, 100 prompts of real Python (windows of standard-library files), 16 tokens:

* class (a) of docs/architecture.md ("Exact or within a tolerance"): with prefill through the decode step
  (``prefill="decode"``) a verify is k + 1 decode steps (``by_steps``), the very kernels and graph plain
  decoding runs, so the speculative output is plain greedy's, token for token, with the oracle drafter
  (100% acceptance), an always-wrong one and prompt lookup;
* class (b): with the tensor-core prefill the verify rows come from the prefill GEMM and attention, which
  round differently from the decode GEMV: the output must be plain greedy's except where the margin rule
  (tests/_margins.py) lets it part: at the first differing token plain decoding's lead is within twice the
  logit error the prefill's stated tolerance allows (LOGITS_TOL of tests/gpu/test_prefill_runtime.py,
  relative to the row's norm; the verify's rows are not read back, so the error is not measured), and
  that at most 2 of 100 prompts;
* the drafted / accepted counts: the oracle accepts all it drafts, the always-wrong drafter none.
Drafters are settings with ``close()`` (tests/_drafting.py ``Script``): a session's close closes its
setting, as it does a draft model's engine."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from _drafting import Script
from _margins import check_tokens

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


def near_tie(got, tokens, rows, what: str) -> int | None:
    """The margin rule for a verify that ran the prefill kernels: where ``got`` parts from plain greedy's
    ``tokens``, plain decoding's lead there is within twice the logit error LOGITS_TOL allows."""
    return check_tokens(got, tokens, rows, lambda j: LOGITS_TOL * float(np.linalg.norm(rows[j])), what)


def drafters(vocab):
    return {"oracle": lambda want: Script(want, lambda t: t, 4),
            "wrong": lambda want: Script(want, lambda t: (t + 1) % vocab, 4),
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
            if (j := near_tie(got, tokens, rows, f"speculate {kind}, prompt {i}")) is not None:
                diverged.append((i, j))
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
            if (j := near_tie(got, tokens, rows, f"draft model, prompt {i}")) is not None:
                diverged.append((i, j))
            drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
    finally:
        s.runner.speculate = None
        draft.close()
    print(f"draft model: {accepted} of {drafted} drafts accepted; near-tie partings {diverged}", file=sys.stderr)
    assert len(diverged) <= 1 and drafted > 0 and accepted >= 0.9 * drafted
