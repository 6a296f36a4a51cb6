"""Prefix reuse, the host-side policy both engines share (pure Python: no CUDA, no numpy model).

The engine keeps the token ids of recent sequences together with their KV (a page list into the KV pool;
``payload`` is whatever else an engine needs: the reference engine's K/V rows). A new request continues
the kept sequence that shares its longest token prefix: it takes that sequence's pages over, recomputes
only positions [L, P) and overwrites the divergent tail in place. L <= P - 1 always, so the last prompt
token runs and its logits exist. Taking over (rather than sharing pages between two kept sequences)
keeps the bookkeeping free of reference counts and copy-on-write: the price is that the kept sequence's
own tail past L is dropped, which for the editor's re-request and a chat's next turn is nothing (they
extend it).

Kept sequences form an LRU within the pool: a request that needs more pages than are free evicts the
least recently used ones. A sequence is kept with exactly the tokens whose K/V exists: its prompt plus
every generated token that was fed back."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

from .. import NanoqwenError
from .paged_kv import KVCacheError, PagePool


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Kept:
    tokens: list[int]          # position i's token, for every position whose K/V is in ``pages``
    pages: list[int]           # logical page i -> physical page
    payload: object = None


@dataclass
class Lease:
    """A running request's sequence: ``reused`` leading positions hold valid K/V, ``pages`` map every
    position the request may write. The engine sets ``tokens`` (and its ``payload``) to what may be kept
    once it knows them good."""
    reused: int
    pages: list[int]
    payload: object = None     # the continued sequence's payload at the start, the engine's at the end
    tokens: list[int] = field(default_factory=list)


class PrefixCache:
    def __init__(self, num_pages: int, page_size: int, order=None):
        self.pool = PagePool(num_pages, order)
        self.page_size = page_size
        self.kept: OrderedDict[int, Kept] = OrderedDict()   # least recently used first
        self._next = 0
        self.running = False

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def match(self, prompt: list[int]) -> tuple[int | None, int]:
        """(key of the kept sequence to continue, reused positions L): the longest common prefix, capped
        at P - 1; the most recent sequence wins a tie; (None, 0) when nothing is shared."""
        best, best_len = None, 0
        for key, k in reversed(self.kept.items()):
            n = min(common_prefix(k.tokens, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = key, n
        return best, best_len

    def start(self, prompt: list[int], total: int) -> Lease:
        """Pages for a request of ``prompt`` that will occupy ``total`` positions, continuing the best
        kept sequence; least recently used sequences are evicted while pages are short."""
        need = self.pages_for(total)
        if not self.can_start(total):
            raise KVCacheError(f"KV cache: {total} positions need {need} pages; the pool has {self.pool.num_pages}, "
                               f"{self.pool.free} free and {self.kept_pages} kept (the rest held by a running request)")
        key, L = self.match(prompt)
        pages, payload = [], None
        if key is not None:
            k = self.kept.pop(key)
            pages, payload = k.pages[:need], k.payload
            self.pool.give(k.pages[need:])
        while self.pool.free < need - len(pages):
            self.evict()
        return Lease(L, pages + self.pool.take(need - len(pages)), payload)

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
        _, k = self.kept.popitem(last=False)
        self.pool.give(k.pages)

    def keep(self, lease: Lease, tokens: list[int], payload: object = None) -> None:
        """End a request: keep its first ``len(tokens)`` positions (their K/V written and their tokens
        known) as the most recent sequence; its other pages go back to the pool. No tokens keeps nothing."""
        n = self.pages_for(len(tokens))
        self.pool.give(lease.pages[n:])
        if tokens:
            self.kept[self._next] = Kept(list(tokens), lease.pages[:n], payload)
            self._next += 1

    def clear(self) -> None:
        while self.kept:
            self.evict()

    def usage(self) -> tuple[int, int, int]:
        """(pages held by running requests, pages kept for reuse, pages in the pool)."""
        kept = self.kept_pages
        return self.pool.num_pages - self.pool.free - kept, kept, self.pool.num_pages

    @property
    def kept_pages(self) -> int:
        return sum(len(k.pages) for k in self.kept.values())
