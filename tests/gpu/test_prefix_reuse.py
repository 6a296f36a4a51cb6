"""Prefix reuse and the p0..p1 prefill of the CUDA engine (runtime/runner.py, runtime/prefix_cache.py) on
the trained small-py model (realistic top-1 margins):

* prefilling [0, p) then [p, P) of one sequence gives the full prefill's last-position logits, token and
  K/V pages, for split points mid-page and page-aligned; parts of <= prefill.small_m_tokens tokens (an
  editor's 32-token tail, a last token) run the small-M GEMM tiles and the split-KV attention (2 splits
  over 200 keys), the 200-token whole the default tiles and the unsplit attention;
* greedy tokens with reuse equal a cold prefill's, for reused prefixes L mid-page, page-aligned, a whole
  page table away, and the same prompt again (L = P - 1); ``cached_tokens`` is exactly L;
* a reply's tokens are reused by the next turn, after closing a stream early too (only what was
  computed is kept, the steps launched ahead drained);
* LRU eviction in a pool of two sequences; ``logits=True`` rows agree with the tokens.
Tolerances as tests/gpu/test_prefill_runtime.py (LOGITS_TOL = 4 x validation.gemv_rel_tol)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ._gpu_util import fresh_rng, rel, report
from .test_prefill_runtime import LOGITS_TOL, PAGES_TOL, corpus, gathered_pages, window  # noqa: F401
from nanoqwen import config
from nanoqwen.runtime.prefix_cache import common_prefix

pytestmark = pytest.mark.gpu

PAGE = config.default().kv_cache.page_size
CONTEXT = 512
NEW = 16


@pytest.fixture(scope="module")
def engine(packed):
    """A graph session whose pool holds three full-context sequences."""
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), CONTEXT, kv_tokens=3 * CONTEXT, log=lambda m: print(m, file=sys.stderr))
    yield s
    s.close()


def cold(s, prompt, n=NEW, **kw):
    """The tokens of a request with nothing kept."""
    s.runner.cache.clear()
    out = list(s.generate(prompt, n, **kw))
    assert s.cached_tokens == 0
    return out


def prefill_parts(s, prompt, splits):
    """Prefill ``prompt`` in the given consecutive parts on fresh pages: (logits, token, per-layer K/V)."""
    P, sh = len(prompt), s.state
    s.runner.reserve(P + 1)
    bounds = [0, *splits, P]
    for p0, p1 in zip(bounds, bounds[1:]):
        s.runner.prefill(prompt[p0:p1], p0, read_token=True, read_logits=p1 == P)
    sh.wait_step(P - 1)
    logits, token = sh.logits(), int(sh.tok_out[P - 1])
    sh.check_errors()
    assert sh.read_state().tolist() == [token, P, P, 0]
    return logits, token, gathered_pages(s, P)


@pytest.mark.parametrize("splits", [(37,), (48,), (16, 17, 100), (168,), (199,)],
                         ids=["mid-page", "page-aligned", "three-parts", "32-token-tail", "last-token"])
def test_prefill_in_parts_equals_full_prefill(engine, corpus, splits):
    prompt = window(corpus, fresh_rng(), 200)
    full_logits, full_token, full_pages = prefill_parts(engine, prompt, ())
    logits, token, pages = prefill_parts(engine, prompt, splits)
    e = rel(logits, full_logits)
    pe = max(rel(g, w) for got, want in zip(pages, full_pages) for g, w in zip(got, want))
    report(f"prefill split at {splits} vs whole: logits rel error", e, LOGITS_TOL)
    report(f"prefill split at {splits} vs whole: K/V pages rel error", pe, PAGES_TOL)
    assert e <= LOGITS_TOL and pe <= PAGES_TOL and token == full_token


@pytest.mark.parametrize("L", [37, 48, 16, 199], ids=["mid-page", "page-aligned", "one-page", "same-prompt"])
def test_reuse_gives_cold_tokens(engine, corpus, L):
    rng = fresh_rng()
    prompt = window(corpus, rng, 200)
    other = window(corpus, rng, 60)
    first = prompt[:L] + [t for t in other if t != prompt[min(L, 199)]][:40] if L < 199 else prompt
    want = cold(engine, prompt)
    engine.runner.cache.clear()
    list(engine.generate(first, 4))
    got = list(engine.generate(prompt, NEW))
    assert engine.cached_tokens == L
    assert got == want, f"L={L}: reuse {got} vs cold {want}"


def test_next_turn_reuses_the_reply(engine, corpus):
    rng = fresh_rng()
    p = window(corpus, rng, 150)
    engine.runner.cache.clear()
    reply = list(engine.generate(p, NEW))
    q = p + reply + window(corpus, rng, 30)
    got = list(engine.generate(q, NEW))
    assert engine.cached_tokens == len(p) + NEW - 1
    assert got == cold(engine, q)


@pytest.mark.parametrize("sampled", [False, True])
def test_close_keeps_only_what_was_computed(engine, corpus, sampled):
    """Close after three tokens with steps launched ahead: the kept sequence is the prompt plus the
    tokens whose K/V was written, all of them the request's own; the next request continues it."""
    from nanoqwen.runtime.sampler import Sampling
    rng = fresh_rng()
    p = window(corpus, rng, 100)
    sampling = Sampling(temperature=0.8, seed=3) if sampled else Sampling()
    full = cold(engine, p, 40, sampling=sampling)
    engine.runner.cache.clear()
    it = engine.generate(p, 40, sampling)
    first = [next(it) for _ in range(3)]
    it.close()
    assert first == full[:3]
    (kept,) = engine.runner.cache.kept.values()
    n = len(kept.tokens) - len(p)
    assert 2 <= n <= 2 + (0 if sampled else engine.runner.ahead)
    assert kept.tokens == p + full[:n]
    q = p + first + window(corpus, rng, 20)
    got = list(engine.generate(q, NEW))
    assert engine.cached_tokens == min(common_prefix(kept.tokens, q), len(q) - 1) >= len(p) + 2
    assert got == cold(engine, q)


def test_lru_eviction(packed, corpus):
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), 256, kv_tokens=512, log=lambda m: None)   # room for two of these
    try:
        rng = fresh_rng()
        prompts = [window(corpus, rng, 200) for _ in range(3)]
        firsts = [list(s.generate(p, 8)) for p in prompts]
        assert len(s.runner.cache.kept) == 2
        assert list(s.generate(prompts[2], 8)) == firsts[2] and s.cached_tokens == 199
        assert list(s.generate(prompts[0], 8)) == firsts[0] and s.cached_tokens == 0, "the oldest was evicted"
        assert list(s.generate(prompts[2], 8)) == firsts[2] and s.cached_tokens == 199
    finally:
        s.close()


def test_logits_pairs(engine, corpus):
    p = window(corpus, fresh_rng(), 80)
    plain = cold(engine, p)
    pairs = list(engine.generate(p, NEW, logits=True))
    assert engine.cached_tokens == len(p) - 1
    assert [t for t, _ in pairs] == plain
    assert all(r.dtype == np.float32 and r.shape == (engine.dims.vocab,) and int(np.argmax(r)) == t for t, r in pairs)
