"""A drafter for speculative-decoding tests: it proposes the continuation the test expects, through a
``mangle`` of each token (identity: an oracle; anything else: drafts that verification must reject)."""

from __future__ import annotations


class Script:
    """A drafter setting with runtime/drafters.py's contract (PromptLookup's, DraftModel's): called with a
    prompt it starts that request's drafter, ``close()`` releases what the setting holds (nothing here; an
    engine's close calls it). A plain function in its place breaks an engine's close."""

    def __init__(self, expected, mangle, k: int):
        self.expected, self.mangle, self.k = expected, mangle, k

    def __call__(self, prompt) -> "Scripted":
        return Scripted(prompt, self.expected, self.mangle, self.k)

    def close(self) -> None:
        pass


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
