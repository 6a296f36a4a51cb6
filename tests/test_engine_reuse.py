"""The engine contract on the numpy ReferenceEngine (backends.py), on the trained small-py model (realistic
top-1 margins): prefix reuse gives the greedy tokens of a cold prefill, ``cached_tokens`` counts exactly
the reused positions (prompt plus fed-back tokens, at most P - 1), closing a stream early keeps only what
was computed, LRU eviction within ``kv_tokens``, ``logits=True`` rows equal the simulation's logits, and
request errors raise before anything runs.

Class (a) of docs/architecture.md ("Exact or within a tolerance"): the reference computes every row as
one decode step (``Reference.extend``), so a reused prefix holds the cold run's K/V bits and reuse, cold
runs and the standalone simulation are compared exactly (tokens, and logits rows bit for bit).
tests/gpu/test_prefix_reuse.py is the CUDA engine's counterpart, class (b) until its prefill is chunk
invariant."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import NanoqwenError
from nanoqwen.backends import ReferenceEngine, open_engine
from nanoqwen.reference import Reference
from nanoqwen.runtime.generate import ContextError
from nanoqwen.runtime.token_trie import common_prefix
from nanoqwen.runtime.sampler import Sampling

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n"
MORE = "\n\ndef main():\n    print("


def cold(path, prompt, n, **kw):
    """What an engine with nothing kept generates."""
    e = ReferenceEngine(path, context=256)
    out = list(e.generate(prompt, n, **kw))
    assert e.cached_tokens == 0
    return out


def test_reuse_matches_cold_prefill_and_counts(small_py):
    path, tok = small_py
    e = ReferenceEngine(path, context=256)
    p1 = tok.encode(CODE)
    g1 = list(e.generate(p1, 8))
    assert e.cached_tokens == 0 and g1 == cold(path, p1, 8)
    # the next turn extends prompt + reply: everything fed back is reused (the last reply token was not)
    p2 = p1 + g1 + tok.encode(MORE)
    g2 = list(e.generate(p2, 8))
    assert e.cached_tokens == len(p1) + len(g1) - 1
    assert g2 == cold(path, p2, 8)
    # the same prompt again: all but its last token
    assert list(e.generate(p2, 8)) == g2 and e.cached_tokens == len(p2) - 1
    # an edit in the middle of the prompt, mid-page: the full pages before it are shared
    page = e.cache.page_size
    p3 = p2[:page + 5] + tok.encode("  # edited\n") + p2[page + 5:]
    g3 = list(e.generate(p3, 6))
    assert e.cached_tokens == page
    assert g3 == cold(path, p3, 6)
    # and the unedited sequence stayed kept beside it
    assert list(e.generate(p2, 8)) == g2 and e.cached_tokens == len(p2) - 1


def test_closing_early_keeps_only_computed_positions(small_py):
    path, tok = small_py
    e = ReferenceEngine(path, context=256)
    p = tok.encode(CODE)
    full = list(e.generate(p, 10))
    it = e.generate(p + tok.encode(MORE), 10)
    first = [next(it) for _ in range(3)]
    it.close()                                        # K/V of the first two reply tokens exist
    q = p + tok.encode(MORE) + first + tok.encode(")")
    got = list(e.generate(q, 5))
    assert e.cached_tokens == len(p + tok.encode(MORE)) + 2
    assert got == cold(path, q, 5)
    assert full == cold(path, p, 10)


def test_lru_eviction_within_kv_tokens(small_py):
    path, tok = small_py
    prompts = [tok.encode(s) for s in ("import os\nimport sys\n" * 3, "class Foo:\n    def bar(self):\n" * 2,
                                        "for i in range(10):\n    print(i)\n" * 2)]
    longest = max(len(p) for p in prompts) + 4
    e = ReferenceEngine(path, context=longest, kv_tokens=2 * longest)   # room for two sequences
    for p in prompts:
        list(e.generate(p, 4))
        assert e.cached_tokens == 0
    assert len(e.cache.kept) == 2
    list(e.generate(prompts[2], 4))                   # the newest is kept
    assert e.cached_tokens == len(prompts[2]) - 1
    list(e.generate(prompts[1], 4))
    assert e.cached_tokens == len(prompts[1]) - 1
    list(e.generate(prompts[0], 4))                   # the oldest was evicted
    assert e.cached_tokens == 0


@pytest.mark.parametrize("reuse", [False, True])
def test_logits_rows_equal_the_reference(small_py, reuse):
    path, tok = small_py
    e = ReferenceEngine(path, context=256)
    p = tok.encode(CODE)
    kept = p[:-5] + list(e.generate(p[:-5], 3))[:2] if reuse else []
    pairs = list(e.generate(p, 6, logits=True))
    assert e.cached_tokens == min(common_prefix(kept, p), len(p) - 1) >= (len(p) - 5 if reuse else 0)
    toks = [t for t, _ in pairs]
    rows = np.stack([r for _, r in pairs])
    want = Reference.from_file(path, max_seq=256).prefill(p + toks[:-1])[len(p) - 1:]
    assert rows.dtype == np.float32 and rows.shape == want.shape
    # one prefill of the whole sequence computes each row as the engine's step did: the same bits
    np.testing.assert_array_equal(rows.view(np.uint32), want.view(np.uint32))
    assert toks == rows.argmax(axis=1).tolist()
    assert toks == list(e.generate(p, 6)), "logits=True must not change the tokens"
    rows[:] = 0   # the rows are copies: changing them changes nothing the engine holds
    assert [t for t, _ in e.generate(p, 6, logits=True)] == toks


def test_sampling_is_reproducible_with_reuse(small_py):
    path, tok = small_py
    e = ReferenceEngine(path, context=256)
    p = tok.encode(CODE)
    s = Sampling(temperature=0.8, top_p=0.95, seed=5)
    a = list(e.generate(p, 12, s))
    b = list(e.generate(p, 12, s))
    assert e.cached_tokens == len(p) - 1 and a == b


def test_request_errors_raise_before_anything_runs(small_py):
    path, _ = small_py
    e = ReferenceEngine(path, context=32)
    list(e.generate([5, 6, 7], 2))
    for prompt, n in (([], 4), ([1, 99999], 4), ([1] * 30, 8), ([1, 2], 0)):
        with pytest.raises(ContextError):
            e.generate(prompt, n)                     # no next(): the call itself raises
    assert len(e.cache.kept) == 1, "a refused request changed the cache"


def test_one_request_at_a_time(small_py):
    path, _ = small_py
    e = ReferenceEngine(path, context=64)
    it = e.generate([5, 6, 7], 4)
    next(it)
    with pytest.raises(NanoqwenError, match="one request at a time"):
        next(e.generate([5, 6, 7], 4))
    it.close()
    assert len(list(e.generate([5, 6, 7], 4))) == 4


def test_open_engine_passes_kv_tokens(small_py):
    path, _ = small_py
    e = open_engine("reference", path, 64, kv_tokens=256)
    assert e.context == 64 and e.cache.pool.num_pages * e.cache.page_size == 256
    with pytest.raises(NanoqwenError, match="kv_tokens"):
        open_engine("reference", path, 64, kv_tokens=32)
    e.close()
