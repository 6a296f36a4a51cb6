"""Prefix reuse and the p0..p1 prefill of the CUDA engine (runtime/runner.py, runtime/prefix_cache.py) on
the trained small-py model (realistic top-1 margins):

* prefilling [0, p) then [p, P) of one sequence gives the full prefill's last-position logits, token and
  K/V pages, for split points mid-page and page-aligned; parts of <= prefill.small_m_tokens tokens (an
  editor's 32-token tail, a last token) run the small-M GEMM tiles and the split-KV attention (replayed
  as chunk graphs), the 200-token whole the default tiles and the unsplit attention;
* greedy tokens with reuse equal a cold prefill's, for common prefixes L mid-page, page-aligned, a whole
  page table away, and the same prompt again (L = P - 1); ``cached_tokens`` is exactly L where the request
  takes the kept sequence over, and L down to a page boundary where it parts inside the kept prompt and
  shares its full pages (runtime/prefix_cache.py); the kept sequence it shared with still gives its own
  tokens afterwards;
* a reply's tokens are reused by the next turn, after closing a stream early too (only what was
  computed is kept, the steps launched ahead drained);
* LRU eviction in a pool of two sequences; ``logits=True`` rows agree with the tokens.

Exact or within a tolerance (docs/architecture.md): the prefill is chunk invariant (DESIGN.md section
12), so a prompt's tail prefilled after a reused prefix, in whatever chunks, is class (a) against the cold
run: logits rows, tokens and K/V pages compared bit for bit (tests/gpu/test_chunk_invariance.py does so
for 50 prompts). A reply's positions are the exception: their K/V came from decode steps, a different
computation from a cold prefill of the same tokens, so the next turn and a continued closed stream are
class (b): logits rows within LOGITS_TOL (relative, per step, the tolerance of
tests/gpu/test_prefill_runtime.py) and greedy tokens by the margin rule at the error measured at that step
(tests/_margins.py ``check_pairs``): they may part only at a near tie."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from _margins import assert_same_pairs, check_pairs

from ._gpu_util import fresh_rng
from .test_prefill_runtime import LOGITS_TOL, corpus, gathered_pages, window  # noqa: F401
from nanoqwen import config
from nanoqwen.runtime.token_trie import common_prefix

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


def check_cold(s, got, prompt, what: str, n=NEW, exact=True):
    """``got``, the (token, logits) pairs of a greedy request that reused a prefix, against a cold run of
    ``prompt``: class (a), the same bits, where the reused positions were prefilled; class (b) where some
    came from decode steps (``exact`` False: rows within LOGITS_TOL, tokens by the margin rule)."""
    want = cold(s, prompt, n, logits=True)
    if exact:
        assert_same_pairs(got, want, what)
    else:
        check_pairs(got, want, LOGITS_TOL, what)


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
    # class (a): the parts run other tiles and attention splits, with the same per-row arithmetic
    assert_same_pairs([(token, logits)], [(full_token, full_logits)], f"prefill split at {splits}")
    for i, (got, want) in enumerate(zip(pages, full_pages)):
        assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want)), f"split at {splits}: layer {i} K/V"


@pytest.mark.parametrize("L", [37, 48, 16, 199], ids=["mid-page", "page-aligned", "one-page", "same-prompt"])
def test_reuse_gives_cold_tokens(engine, corpus, L):
    rng = fresh_rng()
    prompt = window(corpus, rng, 200)
    other = window(corpus, rng, 60)
    first = prompt[:L] + [t for t in other if t != prompt[min(L, 199)]][:40] if L < 199 else prompt
    got = {}
    for logits in (False, True):   # the greedy path and the logits=True path over the same reuse
        engine.runner.cache.clear()
        first_out = list(engine.generate(first, 4))
        got[logits] = list(engine.generate(prompt, NEW, logits=logits))
        assert engine.cached_tokens == (L if first == prompt else L - L % PAGE)
    assert got[False] == [t for t, _ in got[True]], "class (a): the same kernels over the same reuse"
    if first != prompt:   # the shared pages were not written: the kept sequence gives its tokens again
        assert list(engine.generate(first, 4)) == first_out and engine.cached_tokens == len(first) - 1
    check_cold(engine, got[True], prompt, f"L={L}")


def test_next_turn_reuses_the_reply(engine, corpus):
    rng = fresh_rng()
    p = window(corpus, rng, 150)
    engine.runner.cache.clear()
    reply = list(engine.generate(p, NEW))
    q = p + reply + window(corpus, rng, 30)
    got = list(engine.generate(q, NEW, logits=True))
    assert engine.cached_tokens == len(p) + NEW - 1
    check_cold(engine, got, q, "next turn", exact=False)   # the reply's K/V came from decode steps


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
    assert first == full[:3]   # class (a): the same cold run again
    (kept,) = engine.runner.cache.kept.values()
    n = len(kept.tokens) - len(p)
    assert 2 <= n <= 2 + (0 if sampled else engine.runner.ahead)
    assert kept.tokens == p + full[:n]
    q = p + first + window(corpus, rng, 20)
    got = list(engine.generate(q, NEW, logits=True))
    assert engine.cached_tokens == min(common_prefix(kept.tokens, q), len(q) - 1) >= len(p) + 2
    check_cold(engine, got, q, "after close", exact=False)   # the kept tokens' K/V came from decode steps


def test_lru_eviction(packed, corpus):
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), 256, kv_tokens=512, log=lambda m: None)   # room for two of these
    try:
        rng = fresh_rng()
        prompts = [window(corpus, rng, 200) for _ in range(3)]
        firsts = [list(s.generate(p, 8, logits=True)) for p in prompts]
        assert len(s.runner.cache.kept) == 2
        kept = list(s.generate(prompts[2], 8, logits=True))
        assert s.cached_tokens == 199
        assert_same_pairs(kept, firsts[2], "kept")   # class (a): a one-token tail vs the cold prefill
        evicted = list(s.generate(prompts[0], 8, logits=True))
        assert s.cached_tokens == 0, "the oldest was evicted"
        assert_same_pairs(evicted, firsts[0], "cold again")   # class (a): a cold run again
        again = list(s.generate(prompts[2], 8, logits=True))
        assert s.cached_tokens == 199
        assert_same_pairs(again, kept, "kept again")   # class (a): the same prefix bits, the same tail
    finally:
        s.close()


def test_logits_pairs(engine, corpus):
    """logits=True over a reuse of P - 1 positions: the greedy path's tokens over the same reuse, each
    row's argmax, and the cold run's rows (all class (a))."""
    p = window(corpus, fresh_rng(), 80)
    cold(engine, p)
    plain = list(engine.generate(p, NEW))
    assert engine.cached_tokens == len(p) - 1
    pairs = list(engine.generate(p, NEW, logits=True))
    assert engine.cached_tokens == len(p) - 1
    assert [t for t, _ in pairs] == plain
    assert all(r.dtype == np.float32 and r.shape == (engine.dims.vocab,) and int(np.argmax(r)) == t for t, r in pairs)
    check_cold(engine, pairs, p, "logits pairs")
