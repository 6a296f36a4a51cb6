"""Prefix reuse, the host-side policy both engines share (host code: no CUDA, no numpy model).

The engine keeps the token ids of recent sequences together with their KV (a page list into the KV pool;
``payload`` is whatever else an engine needs: the reference engine's K/V rows). A new request continues
the kept sequence that shares its longest token prefix, L positions (L <= P - 1 always, so the last
prompt token runs and its logits exist), in one of two ways:

- it takes the sequence over when it agrees with the sequence's whole prompt (a chat's next turn, the
  same prompt again, a completion after the warm-up that prefilled its context): it keeps the pages in
  place, recomputes only positions [L, P) and overwrites the rest, which it replaces anyway;
- otherwise (the prompts part inside the kept one's: an edit in the middle of a file, another client's
  question after the same system prompt, a warm-up of the context before a file) it shares the kept
  sequence's full pages below L, reference-counted, recomputes from that page boundary, and leaves the
  kept sequence as it was. Nothing still valid is dropped: llama.vim's warm-up of the extra context
  leaves the file being edited in the cache.

A request writes only pages of its own: the shared ones lie below where it starts writing, so no page is
ever copied. Kept sequences form an LRU within the pool: a request that needs more pages than are free
evicts the least recently used ones; a page goes back to the pool when its last holder lets it go. A
sequence is kept with exactly the tokens whose K/V exists: its prompt plus every generated token that was
fed back. The longest shared prefix is found by one walk down a radix tree of the kept tokens
(runtime/token_trie.py), whatever the number of kept sequences; the most recently used one wins a tie."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .. import NanoqwenError
from .paged_kv import KVCacheError, PagePool
from .token_trie import TokenTrie


@dataclass
class Kept:
    tokens: list[int]          # position i's token, for every position whose K/V is in ``pages``
    pages: list[int]           # logical page i -> physical page
    payload: object = None
    prompt: int = 0            # the first ``prompt`` tokens were the request's prompt


@dataclass
class Lease:
    """A running request's sequence: ``reused`` leading positions hold valid K/V, ``pages`` map every
    position the request may write. The engine sets ``tokens`` (and its ``payload``) to what may be kept
    once it knows them good."""
    reused: int
    pages: list[int]
    payload: object = None     # the continued sequence's payload at the start, the engine's at the end
    tokens: list[int] = field(default_factory=list)
    prompt: int = 0


class PrefixCache:
    def __init__(self, num_pages: int, page_size: int, order=None):
        self.pool = PagePool(num_pages, order)
        self.page_size = page_size
        # a page's holders: running leases and kept sequences; it is free when it has none
        self.leased, self.kept_by = np.zeros(num_pages, np.int32), np.zeros(num_pages, np.int32)
        self._kept_only = 0   # pages held by kept sequences alone: what evicting all of them frees
        self.kept: OrderedDict[int, Kept] = OrderedDict()   # least recently used first
        self._trie = TokenTrie()     # the kept sequences' tokens, for the longest-prefix lookup
        self._used: dict[int, int] = {}   # kept key -> when last used (kept, or shared from)
        self._next = self._clock = 0
        self.running = False

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _longest(self, prompt: list[int]) -> tuple[int | None, int, Kept | None]:
        """(key, shared positions, kept sequence) of the kept sequence sharing the longest prefix with
        ``prompt``; the most recently used wins a tie; (None, 0, None) when nothing is shared."""
        n, keys = self._trie.longest(prompt)
        if not keys:
            return None, 0, None
        best = max(keys, key=self._used.__getitem__)
        return best, n, self.kept[best]

    def _touch(self, key: int) -> None:
        """``key`` is the most recently used: last in the LRU order, its use stamp the newest (one order,
        kept two ways: the OrderedDict for eviction, the stamps for the lookup's tie)."""
        self.kept.move_to_end(key)
        self._used[key] = self._clock
        self._clock += 1

    def _forget(self, key: int) -> Kept:
        """Take ``key`` out of the kept sequences (its pages are the caller's to let go)."""
        k = self.kept.pop(key)
        self._trie.remove(key, k.tokens)
        del self._used[key]
        return k

    def start(self, prompt: list[int], total: int) -> Lease:
        """Pages for a request of ``prompt`` that will occupy ``total`` positions, continuing the best
        kept sequence (taken over or shared, see the module's doc); least recently used sequences are
        evicted while pages are short."""
        need = self.pages_for(total)
        if not self.can_start(total):
            raise KVCacheError(f"KV cache: {total} positions need {need} pages; the pool has {self.pool.num_pages}, "
                               f"{self.pool.free} free and {self.kept_pages} kept (the rest held by a running request)")
        key, n, k = self._longest(prompt)
        share = k is not None and n < k.prompt     # it parts inside k's prompt: share k's full pages
        L = min(n, len(prompt) - 1) if n else 0
        if share:
            L -= L % self.page_size
        pages, payload = [], None
        if L and share:
            pages, payload = k.pages[:L // self.page_size], k.payload
            self._move(pages, lease=+1)
            self._touch(key)
        elif L:                                    # it agrees with k's whole prompt: take k over
            self._forget(key)
            pages, payload = k.pages[:need], k.payload
            self._move(pages, lease=+1, kept=-1)
            self._move(k.pages[need:], kept=-1)
        while self.pool.free < need - len(pages):
            self.evict()
        fresh = self.pool.take(need - len(pages))
        self._move(fresh, lease=+1)
        return Lease(L, pages + fresh, payload, prompt=len(prompt))

    def can_start(self, total: int) -> bool:
        """Whether a sequence of ``total`` positions gets its pages now (free ones, or kept ones evicted);
        if not, the rest are held by running sequences."""
        return self.pages_for(total) <= self.pool.free + self.kept_pages

    @contextmanager
    def alone(self):
        """Marks the one request of a batch-1 engine running; a second one meanwhile is an error."""
        if self.running:
            raise NanoqwenError("the engine runs one request at a time: close the previous token stream first")
        self.running = True
        try:
            yield
        finally:
            self.running = False

    @contextmanager
    def request(self, prompt: list[int], total: int):
        """One request at a time (batch 1): ``start`` its lease, and at the end, however it ends, keep
        ``lease.tokens``; a request that failed leaves them empty and keeps nothing."""
        with self.alone():
            lease = self.start(prompt, total)
            try:
                yield lease
            finally:
                self.keep(lease, lease.tokens, lease.payload)

    def evict(self) -> None:
        """Drop the least recently used kept sequence."""
        k = self._forget(next(iter(self.kept)))
        self._move(k.pages, kept=-1)

    def keep(self, lease: Lease, tokens: list[int], payload: object = None) -> None:
        """End a request: keep its first ``len(tokens)`` positions (their K/V written and their tokens
        known) as the most recent sequence; its other pages are let go. No tokens keeps nothing."""
        n = self.pages_for(len(tokens))
        self._move(lease.pages[:n], lease=-1, kept=+1)
        self._move(lease.pages[n:], lease=-1)
        if tokens:
            key, self._next = self._next, self._next + 1
            self.kept[key] = Kept(list(tokens), lease.pages[:n], payload, min(lease.prompt, len(tokens)))
            self._trie.insert(key, self.kept[key].tokens)
            self._touch(key)

    def clear(self) -> None:
        while self.kept:
            self.evict()

    def usage(self) -> tuple[int, int, int]:
        """(pages held by running requests, pages kept for reuse alone, pages in the pool)."""
        kept = self.kept_pages
        return self.pool.num_pages - self.pool.free - kept, kept, self.pool.num_pages

    @property
    def kept_pages(self) -> int:
        """Pages that evicting every kept sequence would free: those no running request holds."""
        return self._kept_only

    def _move(self, pages, lease: int = 0, kept: int = 0) -> None:
        """Add holds on ``pages`` (distinct) by running leases and kept sequences (negative: let go); a page
        that loses its last holder goes back to the pool."""
        p = np.asarray(pages, dtype=np.int64)
        was = int(np.count_nonzero((self.kept_by[p] > 0) & (self.leased[p] == 0)))
        self.leased[p] += lease
        self.kept_by[p] += kept
        self._kept_only += int(np.count_nonzero((self.kept_by[p] > 0) & (self.leased[p] == 0))) - was
        self.pool.give(p[self.leased[p] + self.kept_by[p] == 0])
