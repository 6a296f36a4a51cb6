"""A drafter for speculative-decoding tests: it proposes the continuation the test expects, through a
``mangle`` of each token (identity: an oracle; anything else: drafts that verification must reject)."""

from __future__ import annotations


class Scripted:
    """Drafts up to ``k`` tokens of ``expected`` (the greedy continuation of ``prompt``) through ``mangle``."""

    def __init__(self, prompt, expected, mangle, k: int):
        self.P, self.seq, self.expected, self.mangle, self.k = len(prompt), list(prompt), expected, mangle, k

    def append(self, tokens):
        self.seq += tokens

    def draft(self, limit):
        done = len(self.seq) - self.P
        return [self.mangle(t) for t in self.expected[done:done + min(self.k, limit)]]

    def record(self, drafted, accepted):
        pass
