"""The prefix-reuse policy both engines share (runtime/prefix_cache.py), on the CPU: longest-common-prefix
matching capped at P - 1 (the most recent sequence wins a tie), taking a kept sequence over or sharing its
full pages, LRU eviction when pages run short, and page accounting that never loses a page, never frees a
held one and never lets a request write a page another sequence holds (hypothesis drives random request
streams over simulated page contents)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoqwen import NanoqwenError
from nanoqwen.runtime.paged_kv import KVCacheError
from nanoqwen.runtime.prefix_cache import PrefixCache
from nanoqwen.runtime.token_trie import common_prefix

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


def test_a_request_that_agrees_with_the_whole_prompt_takes_the_sequence_over():
    c = PrefixCache(num_pages=20, page_size=PAGE)
    for toks in ([1, 2, 3, 4, 5, 6, 7], [8, 2, 9, 9], [5, 5, 5]):
        lease = c.start(toks, len(toks) + 2)
        c.keep(lease, toks + [10], payload=tuple(toks))   # the prompt and one generated token
    a_pages = c.kept[0].pages
    lease = c.start([1, 2, 3, 4, 5, 6, 7, 0, 0, 0], total=12)   # the next turn: a's prompt, then its own
    assert lease.reused == 7 and lease.payload == (1, 2, 3, 4, 5, 6, 7)
    assert lease.pages[:2] == a_pages, "the continued sequence's pages stay where they are"
    assert len(lease.pages) == 3 and len(c.kept) == 2, "the continued sequence left the kept set"
    assert not set(lease.pages) & set(pages_of(c))


def test_a_request_that_parts_inside_the_prompt_shares_full_pages():
    """An edit inside a kept prompt, or a prompt that is a prefix of it (a warm-up of the context before a
    file): the request shares the kept sequence's full pages below the common prefix, recomputes from that
    page boundary, and the kept sequence stays, whole and most recent."""
    c = PrefixCache(num_pages=20, page_size=PAGE)
    file = list(range(1, 12))
    c.keep(c.start(file, 14), file + [50])
    c.keep(c.start([7, 7], 4), [7, 7])
    (fkey, f), _ = c.kept.items()
    lease = c.start(file[:6] + [0, 0], total=10)          # parts at 6: one full page shared
    assert lease.reused == 4 and lease.pages[0] == f.pages[0] and lease.payload is f.payload
    assert list(c.kept) == [1, fkey] and c.kept[fkey].pages == f.pages and c.kept[fkey].tokens == file + [50]
    assert set(lease.pages[1:]).isdisjoint(f.pages)
    c.keep(lease, [])                                     # the shared page stays: f holds it
    assert c.leased[f.pages[0]] == 0 and c.kept_by[f.pages[0]] == 1
    warm = c.start(file[:9], total=9)                     # a prefix of f's prompt: shares 8 positions
    assert warm.reused == 8 and warm.pages[:2] == f.pages[:2]
    c.keep(warm, file[:9])
    again = c.start(file[:10] + [99], total=12)           # the next keystroke finds the file whole
    assert again.reused == 8 and again.pages[:2] == f.pages[:2], "parts inside f's prompt: shares f again"
    assert again.payload is f.payload and list(c.kept)[-1] == fkey, "f is the most recently used again"


def test_pages_shared_with_running_requests_survive_eviction():
    c = PrefixCache(num_pages=6, page_size=PAGE)
    c.keep(c.start(list(range(12)), 12), list(range(12)))   # 3 pages
    a = c.start(list(range(8)) + [90], total=9)             # shares 2, takes 1
    b = c.start(list(range(4)) + [91], total=5)             # shares 1, takes 1
    assert (a.reused, b.reused) == (8, 4) and a.pages[0] == b.pages[0]
    assert c.usage() == (4, 1, 6)                           # running: 2 shared + 2 fresh; kept alone: 1
    assert c.can_start(8) and not c.can_start(9)            # 1 free + the one page only the kept sequence holds
    c.clear()                                               # frees that page alone
    assert c.pool.free == 2
    c.keep(b, [])
    assert c.pool.free == 3 and c.leased[a.pages[0]] == 1
    c.keep(a, list(range(8)) + [90])
    assert c.usage() == (0, 3, 6) and c.pool.free == 3


def test_reuse_is_capped_so_the_last_prompt_token_runs():
    def reused(prompt):
        c = PrefixCache(num_pages=8, page_size=PAGE)
        c.keep(c.start([1, 2, 3, 4, 5, 6], 8), [1, 2, 3, 4, 5, 6, 7, 8])
        return c.start(prompt, len(prompt) + 1).reused
    assert reused([1, 2, 3, 4, 5, 6]) == 5              # whole prompt cached: still recompute the last one
    assert reused([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert reused([1]) == 0
    assert reused([2, 1]) == 0


def test_most_recent_wins_a_tie():
    c = PrefixCache(num_pages=8, page_size=PAGE)
    for last in (3, 4):                                  # two sequences parting after 2 pages
        toks = list(range(10, 10 + 2 * PAGE)) + [last]
        c.keep(c.start(toks, len(toks)), toks, payload=last)
    lease = c.start(list(range(10, 10 + 2 * PAGE)) + [7], 2 * PAGE + 1)
    assert lease.reused == 2 * PAGE and lease.payload == 4


def test_lru_eviction_when_pages_run_short():
    c = PrefixCache(num_pages=6, page_size=PAGE)       # 24 positions
    for first in (10, 20, 30):                          # three sequences of 2 pages each: pool full
        toks = [first + i for i in range(8)]
        c.keep(c.start(toks, 8), toks)
    assert c.pool.free == 0
    lease = c.start([40, 41, 42], total=7)              # 2 pages: evicts the oldest (10...)
    assert [k.tokens[0] for k in c.kept.values()] == [20, 30]
    c.keep(lease, [40, 41, 42])
    lease = c.start([20 + i for i in range(8)] + [99], total=9)   # continues 20...: the most recent
    c.keep(lease, [20 + i for i in range(8)] + [99])
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


DOCS = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 0, 0, 0, 0, 2, 2, 2, 2])   # prompts part in them
prompts = st.builds(lambda doc, cut, tail: (DOCS[doc][:cut] + tail) or [0],
                    st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(0, 3), max_size=4))
requests = st.lists(st.tuples(prompts,
                              st.integers(1, 6),                                        # new tokens
                              st.integers(0, 7)),                                       # tokens generated
                    min_size=1, max_size=25)


@given(requests, st.integers(4, 8))
def test_random_streams_conserve_pages_and_reuse_only_true_prefixes(reqs, num_pages):
    """Page contents are simulated (each slot holds the token written there): a request reads what it
    reuses from its pages and finds its prompt's tokens, writes only pages no one else holds, and every
    kept sequence still finds its own tokens in its pages after any stream of requests. Each page's
    holders are counted right, and a page is free exactly when it has none."""
    c = PrefixCache(num_pages, PAGE)
    slots: dict[tuple[int, int], int] = {}   # (page, slot) -> token written there

    def read(pages, n):
        return [slots.get((pages[i // PAGE], i % PAGE)) for i in range(n)]

    for r, (prompt, new, produced) in enumerate(reqs):
        total = len(prompt) + new - 1
        if c.pages_for(total) > num_pages:
            continue
        before = {key: (list(k.tokens), k.prompt, k.payload) for key, k in c.kept.items()}
        # the model: the most recent of the longest shared prefixes, capped at P - 1; sharing (parting
        # inside its prompt) rounds the reuse down to a page boundary, taking it over does not
        order = list(before)   # least recently used first
        n, i = max(((common_prefix(before[k][0], prompt), i) for i, k in enumerate(order)), default=(0, -1))
        L = min(n, len(prompt) - 1)
        if n and n < before[order[i]][1]:
            L -= L % PAGE
        lease = c.start(prompt, total)
        assert lease.reused == L
        if L:
            assert lease.payload == before[order[i]][2], "continues the most recent of the longest"
        assert read(lease.pages, lease.reused) == prompt[:lease.reused], "reused positions hold the prompt"
        assert len(lease.pages) == c.pages_for(total)
        for p in lease.pages[lease.reused // PAGE:]:
            assert c.leased[p] == 1 and c.kept_by[p] == 0, "a request writes a page another holds"
        written = prompt + [9] * min(produced, new - 1)
        for i in range(lease.reused, len(written)):
            slots[lease.pages[i // PAGE], i % PAGE] = written[i]
        c.keep(lease, written, payload=r)
        for k in c.kept.values():
            assert len(k.pages) == c.pages_for(len(k.tokens))
            assert read(k.pages, len(k.tokens)) == k.tokens, "a kept sequence's K/V was overwritten"
        held = [p for k in c.kept.values() for p in k.pages]
        assert all(c.kept_by[p] == held.count(p) and not c.leased[p] for p in range(num_pages))
        assert sorted(set(held) | set(c.pool._free)) == list(range(num_pages))
        assert not set(held) & set(c.pool._free) and len(set(c.pool._free)) == c.pool.free
        assert c.usage() == (0, len(set(held)), num_pages)


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
