"""The prefix-reuse policy both engines share (runtime/prefix_cache.py), on the CPU: longest-common-prefix
matching capped at P - 1, taking a kept sequence over, LRU eviction when pages run short, and page
accounting that never loses or duplicates a page (hypothesis drives random request streams)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoqwen import NanoqwenError
from nanoqwen.runtime.paged_kv import KVCacheError
from nanoqwen.runtime.prefix_cache import PrefixCache, common_prefix

PAGE = 4


def pages_of(cache: PrefixCache) -> list[int]:
    return [p for k in cache.kept.values() for p in k.pages]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2 and common_prefix([7], [8]) == 0


def test_fresh_request_takes_pages_and_keeps_its_tokens():
    c = PrefixCache(num_pages=10, page_size=PAGE)
    lease = c.start([1, 2, 3, 4, 5], total=9)          # 3 pages
    assert lease.reused == 0 and len(lease.pages) == 3 and c.pool.free == 7
    c.keep(lease, [1, 2, 3, 4, 5, 6])                   # 6 positions written: 2 pages kept
    (k,) = c.kept.values()
    assert k.tokens == [1, 2, 3, 4, 5, 6] and k.pages == lease.pages[:2] and c.pool.free == 8


def test_reuse_takes_the_longest_prefix_over():
    c = PrefixCache(num_pages=20, page_size=PAGE)
    for toks in ([1, 2, 3, 4, 5, 6, 7], [8, 2, 9, 9], [5, 5, 5]):
        lease = c.start(toks, len(toks) + 2)
        c.keep(lease, toks, payload=tuple(toks))
    a_pages = c.kept[0].pages
    lease = c.start([1, 2, 3, 4, 5, 0, 0, 0, 0, 0], total=12)
    assert lease.reused == 5 and lease.payload == (1, 2, 3, 4, 5, 6, 7)
    assert lease.pages[:2] == a_pages, "the continued sequence's pages stay where they are"
    assert len(lease.pages) == 3 and len(c.kept) == 2, "the continued sequence left the kept set"
    assert not set(lease.pages) & set(pages_of(c))


def test_reuse_is_capped_so_the_last_prompt_token_runs():
    c = PrefixCache(num_pages=8, page_size=PAGE)
    c.keep(c.start([1, 2, 3, 4, 5, 6], 8), [1, 2, 3, 4, 5, 6, 7, 8])
    assert c.match([1, 2, 3, 4, 5, 6])[1] == 5          # whole prompt cached: still recompute the last one
    assert c.match([1, 2, 3, 4, 5, 6, 7, 8, 9])[1] == 8
    assert c.match([1]) == (None, 0)
    assert c.match([2, 1]) == (None, 0)


def test_most_recent_wins_a_tie():
    c = PrefixCache(num_pages=8, page_size=PAGE)
    for toks in ([1, 2, 3], [1, 2, 4]):
        c.keep(c.start(toks, 3), toks, payload=toks[-1])
    key, L = c.match([1, 2, 7])
    assert L == 2 and c.kept[key].payload == 4


def test_lru_eviction_when_pages_run_short():
    c = PrefixCache(num_pages=6, page_size=PAGE)       # 24 positions
    for first in (10, 20, 30):                          # three sequences of 2 pages each: pool full
        toks = [first + i for i in range(8)]
        c.keep(c.start(toks, 8), toks)
    assert c.pool.free == 0
    c.match([20, 21])                                   # matching alone does not refresh
    lease = c.start([40, 41, 42], total=7)              # 2 pages: evicts the oldest (10...)
    assert [k.tokens[0] for k in c.kept.values()] == [20, 30]
    c.keep(lease, [40, 41, 42])
    lease = c.start([20, 21, 22, 99], total=4)          # continues 20...: it becomes the most recent
    c.keep(lease, [20, 21, 22, 99])
    assert [k.tokens[0] for k in c.kept.values()] == [30, 40, 20]
    c.start([50] * 5, total=24)                         # needs the whole pool: everything else goes
    assert not c.kept and c.pool.free == 0


def test_request_larger_than_the_pool_is_refused_without_change():
    c = PrefixCache(num_pages=2, page_size=PAGE)
    c.keep(c.start([1, 2], 2), [1, 2])
    with pytest.raises(KVCacheError):
        c.start([1, 2, 3], total=9)
    assert len(c.kept) == 1 and c.pool.free == 1


def test_keeping_nothing_frees_everything():
    c = PrefixCache(num_pages=4, page_size=PAGE)
    c.keep(c.start([1, 2, 3, 4, 5], 8), [1, 2, 3, 4, 5])
    lease = c.start([1, 2, 3, 4, 5, 6], 8)
    assert lease.reused == 5
    c.keep(lease, [])                                   # a failed request: its K/V is not trusted
    assert not c.kept and c.pool.free == 4


requests = st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12),   # prompt
                              st.integers(1, 6),                                        # new tokens
                              st.integers(0, 7)),                                       # tokens generated
                    min_size=1, max_size=25)


@given(requests, st.integers(4, 8))
def test_random_streams_conserve_pages_and_reuse_only_true_prefixes(reqs, num_pages):
    """Every page is in exactly one place (free, kept, or the running request); a reused prefix is a
    prefix of both the prompt and what the continued sequence held, at most P - 1; kept sequences fit
    their pages."""
    c = PrefixCache(num_pages, PAGE)
    for prompt, new, produced in reqs:
        total = len(prompt) + new - 1
        if c.pages_for(total) > num_pages:
            continue
        before = {key: list(k.tokens) for key, k in c.kept.items()}
        key, L = c.match(prompt)
        lease = c.start(prompt, total)
        assert lease.reused == L <= len(prompt) - 1
        if key is not None:
            held = before[key]
            assert held[:L] == prompt[:L] and L == min(common_prefix(held, prompt), len(prompt) - 1)
        assert all(common_prefix(t, prompt) <= L or len(prompt) - 1 <= L for t in before.values())
        assert len(lease.pages) == c.pages_for(total)
        everything = lease.pages + pages_of(c) + c.pool._free
        assert sorted(everything) == list(range(num_pages))
        written = prompt + [9] * min(produced, new - 1)
        c.keep(lease, written)
        for k in c.kept.values():
            assert len(k.pages) == c.pages_for(len(k.tokens))
        assert sorted(pages_of(c) + c.pool._free) == list(range(num_pages))


def test_pages_held_by_a_running_request_are_not_handed_out():
    c = PrefixCache(num_pages=4, page_size=PAGE)
    running = c.start([1, 2, 3], total=9)              # 3 pages out
    with pytest.raises(KVCacheError, match="running request"):
        c.start([7, 8], total=8)
    c.keep(running, [1, 2, 3])
    assert len(c.start([7, 8], total=8).pages) == 2


def test_request_keeps_what_the_engine_set_one_at_a_time():
    c = PrefixCache(num_pages=4, page_size=PAGE)
    with c.request([1, 2, 3], total=6) as lease:
        with pytest.raises(NanoqwenError, match="one request at a time"):
            with c.request([4], total=1):
                pass
        lease.tokens, lease.payload = [1, 2, 3, 4], "kv"
    (k,) = c.kept.values()
    assert (k.tokens, k.payload, c.running) == ([1, 2, 3, 4], "kv", False)
    with pytest.raises(RuntimeError):
        with c.request([1, 2, 3, 4, 5], total=6) as lease:
            assert lease.reused == 4 and lease.payload == "kv"
            raise RuntimeError("the device failed")          # tokens never set: nothing is kept
    assert not c.kept and c.pool.free == 4 and not c.running


def test_several_running_sequences_usage_and_can_start():
    """Leases started side by side (the server's batching): usage counts their pages as running, ended ones
    as kept; can_start says whether another fits now (free pages, or kept ones to evict)."""
    c = PrefixCache(8, 4)
    a = c.start([1, 2, 3], 12)            # 3 pages
    b = c.start([9, 8], 16)               # 4 pages
    assert c.usage() == (7, 0, 8) and c.can_start(4) and not c.can_start(5)
    c.keep(a, [1, 2, 3, 4, 5])            # 2 pages kept, 1 back to the pool
    assert c.usage() == (4, 2, 8) and c.can_start(16) and not c.can_start(17)
    c.start([7], 16)                      # evicts a's kept pages
    assert c.usage() == (8, 0, 8) and not c.kept and not c.can_start(1)
    c.keep(b, [])
    assert c.usage() == (4, 0, 8)
