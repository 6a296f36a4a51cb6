"""Speculative greedy decoding on the CUDA engine (runtime/runner.py ``verify``: the last accepted token and
k drafts as k + 1 rows of one multi-row decode step, runtime/rowstep.py) on the trained small-py model,
100 prompts of real Python (windows of the committed corpus, tests/_texts.py), 16 tokens:

* class (a) of docs/architecture.md ("Exact or within a tolerance"): every row of the multi-row step is
  computed with the single-row decode arithmetic (DESIGN.md section 12; bitwise per kernel in
  tests/gpu/test_attention.py), and the prompt is prefilled the same way in both runs (through the decode
  step with ``prefill="decode"``, through the tensor-core prefill otherwise, cold both), so the speculative
  output is plain greedy's, token for token, with no tolerance: with the oracle drafter (100% acceptance),
  an always-wrong one, prompt lookup and a draft model (small-py drafting for itself);
* the drafted / accepted counts: the oracle accepts all it drafts, the always-wrong drafter none, the draft
  model nearly all (its drafts come from its own prefix-cache reuse, class (b), so a near tie may fall
  the other way there: that costs acceptance, never output).
Drafters are settings with ``close()`` (tests/_drafting.py ``Script``): a session's close closes its
setting, as it does a draft model's engine. The session's measured step costs are set aside while drafting
(``drafting``): with them the cost rule may choose plain steps for all 16 tokens of every prompt (it did on
an H100 with untuned tiles, 2026-12-05), and these tests are about the verify's output."""

from __future__ import annotations

import contextlib
import sys

import pytest

from _drafting import Script

from ._gpu_util import fresh_rng
from .test_prefill_runtime import corpus, window  # noqa: F401 - corpus is a fixture
from nanoqwen.runtime.drafters import DraftModel, PromptLookup

pytestmark = pytest.mark.gpu

NEW, PROMPTS = 16, 100


@pytest.fixture(scope="module")
def prompts(corpus):  # noqa: F811
    rng = fresh_rng()
    return [window(corpus, rng, int(rng.integers(8, 120))) for _ in range(PROMPTS)]


def cold(s, p, n=NEW):
    """A request with nothing kept: every run prefills the whole prompt the same way."""
    s.runner.cache.clear()
    return list(s.generate(p, n))


def plain(s, prompts):
    """Plain greedy decoding's tokens for each prompt."""
    s.runner.speculate = None
    return [cold(s, p) for p in prompts]


def drafters(vocab):
    return {"oracle": lambda want: Script(want, lambda t: t, 4),
            "wrong": lambda want: Script(want, lambda t: (t + 1) % vocab, 4),
            "lookup": lambda want: PromptLookup(max_draft=8)}


@contextlib.contextmanager
def drafting(s):
    """Speculative requests that draft every round (no step costs: k is the drafter's alone); afterwards
    plain decoding with the session's costs again."""
    costs, s.runner.costs = s.runner.costs, None
    try:
        yield
    finally:
        s.runner.speculate, s.runner.costs = None, costs


def speculative_is_plain(s, prompts, kind):
    """Each prompt's speculative tokens are plain greedy's exactly; the counts as the drafter implies."""
    want = plain(s, prompts)
    make = drafters(s.dims.vocab)[kind]
    drafted = accepted = 0
    with drafting(s):
        for p, tokens in zip(prompts, want):
            s.runner.speculate = make(tokens)
            assert cold(s, p) == tokens
            drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
    assert drafted > 0
    assert accepted == drafted if kind == "oracle" else accepted == 0 if kind == "wrong" else accepted <= drafted


@pytest.mark.parametrize("kind", ["oracle", "wrong", "lookup"])
def test_decode_prefill_verify_is_plain_greedy(packed, prompts, kind):
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), 512, prefill="decode", log=lambda m: print(m, file=sys.stderr))
    try:
        speculative_is_plain(s, prompts, kind)
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["oracle", "wrong", "lookup"])
def test_chunked_prefill_verify_is_plain_greedy(sessions, prompts, kind):
    speculative_is_plain(sessions("small-py"), prompts, kind)


def test_draft_model_verify_is_plain_greedy(sessions, packed, prompts):
    """small-py drafting for itself through a second CudaSession (its own KV cache, prefix cache and
    graphs, the same stream order): plain greedy's text exactly, the drafts nearly all accepted."""
    from nanoqwen.runtime.session import CudaSession
    s = sessions("small-py")
    want = plain(s, prompts[:30])
    draft = CudaSession(packed("small-py"), 512, log=lambda m: print(m, file=sys.stderr))
    drafted = accepted = 0
    try:
        with drafting(s):
            s.runner.speculate = DraftModel(str(packed("small-py")), max_draft=4, engine=draft)
            for p, tokens in zip(prompts, want):
                assert cold(s, p) == tokens
                drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
    finally:
        draft.close()
    print(f"draft model: {accepted} of {drafted} drafts accepted", file=sys.stderr)
    assert drafted > 0 and accepted >= 0.9 * drafted
