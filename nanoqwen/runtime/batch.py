"""The multi-sequence step's contract (DESIGN.md section 13), host side: what an engine offers so that the
server's scheduler (serve/scheduler.py) can run rows of several sequences in one step.

An engine that can exposes ``engine.batch``, an object with:

- ``open(prompt, total) -> Sequence``: pages for a sequence that will occupy ``total`` positions, from
  the engine's shared pool, continuing the longest kept prefix (runtime/prefix_cache.py); positions
  ``[0, sequence.reused)`` hold valid K/V. Raises ``PagesShort`` when the pool cannot hold it now (pages
  are held by running sequences): the caller retries once one of them has ended;
- ``step(work) -> logits``: ``work`` is ``[(sequence, tokens)]``, each sequence at most once, its tokens
  written at positions ``sequence.pos, sequence.pos + 1, ...``; returns, per item, fp32 logits
  ``[len(tokens), vocab]`` and advances each ``sequence.pos`` by ``len(tokens)``. The caller may set
  ``pos`` back (a verify's rejected drafts: their K/V rows are overwritten later). Every row is computed
  with exactly a single decode step's arithmetic, whatever else is in the step (row invariance,
  DESIGN.md section 12): a sequence's tokens are bitwise what it gets alone;
- ``close(sequence, tokens)``: end it, keeping its first ``len(tokens)`` positions (their K/V written,
  ``tokens`` their ids) for prefix reuse; its other pages go back to the pool;
- ``pages()``: (pages held by running sequences, pages kept for reuse, pages in the pool).

An engine without ``batch`` (or with ``batch = None``) runs one sequence at a time through its
``generate`` (runtime/generate.py); the scheduler then admits one request at a time."""

from __future__ import annotations

from dataclasses import dataclass

from .. import NanoqwenError
from .drafters import Speculation
from .prefix_cache import Lease
from .sampler import HostSampler, Sampling


class PagesShort(NanoqwenError):
    """The KV pool cannot hold the sequence while the running ones hold their pages: wait, do not fail."""


@dataclass(eq=False)
class Sequence:
    lease: Lease       # its pages (runtime/prefix_cache.py)
    state: object      # the engine's per-sequence state (the reference: a Reference over its own K/V)
    pos: int = 0       # the next position written: positions [0, pos) hold valid K/V

    def __post_init__(self):
        self.pos = self.lease.reused

    @property
    def reused(self) -> int:
        return self.lease.reused


class Decoding:
    """One sequence's generation over the step, the same for a request alone (ReferenceEngine.generate)
    and for a row of the server's batch (serve/scheduler.py): its prompt fed in chunks, then per step one
    plain row (the last token) or a verify (the last token and k drafts of its drafter, DESIGN.md section
    11), each row's token chosen on the host by its own sampler, so seeds and penalties are per request.
    ``rows(budget)`` says what the sequence puts in the next step; ``advance(logits)`` takes that step's
    logits and returns the new (token, logits row) pairs (none while the prompt is still being fed)."""

    def __init__(self, seq: Sequence, prompt: list[int], max_new_tokens: int, sampling: Sampling, speculate=None):
        self.seq, self.prompt, self.max_new_tokens = seq, prompt, max_new_tokens
        self.sample = HostSampler(sampling, prompt)
        self.spec = Speculation(speculate(prompt) if speculate and sampling.greedy else None)
        self.fed, self.gen, self.drafts = seq.reused, [], []

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.gen) >= self.max_new_tokens

    def rows(self, budget: int) -> list[int]:
        """The next step's tokens: up to ``budget`` (>= 1) prompt tokens, else a decode row and drafts."""
        if self.prefilling:
            chunk = self.prompt[self.fed:self.fed + max(budget, 1)]
            self.fed += len(chunk)
            return chunk
        self.drafts = self.spec.draft(self.max_new_tokens - len(self.gen) - 1)
        return [self.gen[-1]] + self.drafts

    def advance(self, logits) -> list[tuple[int, object]]:
        if self.prefilling:
            return []
        rows = logits if self.gen else logits[-1:]   # after a prompt chunk only its last row chooses
        block = self.spec.accept(self.drafts, [self.sample(row) for row in rows])
        self.seq.pos -= len(self.drafts) + 1 - len(block)   # back past the rejected drafts
        self.gen += block
        self.drafts = []
        return list(zip(block, rows))
