"""The multi-sequence step's contract (DESIGN.md section 13), host side: what an engine offers so that the
server's scheduler (serve/scheduler.py) can run rows of several sequences in one step.

An engine that can exposes ``engine.batch``, an object with:

- ``open(prompt, total) -> Sequence``: pages for a sequence that will occupy ``total`` positions, from
  the engine's shared pool, continuing the longest kept prefix (runtime/prefix_cache.py); positions
  ``[0, sequence.reused)`` hold valid K/V. Raises ``PagesShort`` when the pool cannot hold it now (pages
  are held by running sequences): the caller retries once one of them has ended;
- ``step(work) -> [Rows]``: ``work`` is ``[(sequence, tokens)]``, each sequence at most once, its tokens
  written at positions ``sequence.pos, sequence.pos + 1, ...``; returns, per item, its ``Rows`` and
  advances each ``sequence.pos`` by ``len(tokens)``. The caller may set ``pos`` back (a verify's rejected
  drafts: their K/V rows are overwritten later). Tokens at positions past the prompt given to ``open``
  are decode rows, computed with exactly a single decode step's arithmetic whatever else is in the step
  (row invariance, DESIGN.md section 12); prompt tokens are computed as the engine prefills a prompt
  alone, which is the same whatever the chunks (chunk invariance). So a sequence's tokens are bitwise what
  it gets alone. A sequence puts at most ``max_rows`` decode rows in one step (None: no bound); ``costs``
  (rows -> measured step time, or None) lets a speculative sequence pick its draft length by them;
- ``close(sequence, tokens)``: end it, keeping its first ``len(tokens)`` positions (their K/V written,
  ``tokens`` their ids) for prefix reuse; its other pages go back to the pool;
- ``pages()``: (pages held by running sequences, pages kept for reuse, pages in the pool).

An engine without ``batch`` (or with ``batch = None``) runs one sequence at a time through its
``generate`` (runtime/generate.py); the scheduler then admits one request at a time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import NanoqwenError
from .drafters import Speculation
from .prefix_cache import Lease
from .sampler import HostSampler, Sampling


class PagesShort(NanoqwenError):
    """The KV pool cannot hold the sequence while the running ones hold their pages: wait, do not fail."""


@dataclass
class Rows:
    """One item's results of a step. ``argmax``: the greedy choice after each row (the first maximum, the
    kernels' tie rule); ``logits``: fp32 ``[rows, vocab]``, given at least where the sequence asked for
    them (``Sequence.logits``), else None. A prompt chunk's rows: at least its last one (only the last prompt
    row chooses a token) and nothing before the prompt's last chunk; an engine with ``prompt_logits``
    gives every row of a sequence with ``prompt_logits``."""
    argmax: list[int]
    logits: np.ndarray | None = None


@dataclass(eq=False)
class Sequence:
    lease: Lease       # its pages (runtime/prefix_cache.py)
    state: object      # the engine's per-sequence state (the reference: a Reference over its own K/V)
    prompt: int        # the prompt's length: positions from here on are decode rows
    total: int         # the positions it may occupy (``open``'s)
    pos: int = 0       # the next position written: positions [0, pos) hold valid K/V
    logits: bool = False   # whether steps return its rows' logits (host sampling, logprobs)
    prompt_logits: bool = False   # whether they return every prompt row's too (echo's prompt logprobs)

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

    def __init__(self, seq: Sequence, prompt: list[int], max_new_tokens: int, sampling: Sampling, speculate=None,
                 logits: bool = False, max_rows: int | None = None, costs: dict[int, float] | None = None):
        self.seq, self.prompt, self.max_new_tokens = seq, prompt, max_new_tokens
        self.sample, self.greedy = HostSampler(sampling, prompt), sampling.greedy
        seq.logits = logits or not sampling.greedy   # greedy rows take the engine's argmax
        self.spec = Speculation(speculate(prompt) if speculate and sampling.greedy else None, costs)
        self.max_draft = None if max_rows is None else max_rows - 1
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
        limit = self.max_new_tokens - len(self.gen) - 1
        self.drafts = self.spec.draft(limit if self.max_draft is None else min(limit, self.max_draft))
        return [self.gen[-1]] + self.drafts

    def advance(self, rows: Rows) -> list[tuple[int, np.ndarray | None]]:
        """The step's ``Rows`` of this sequence -> [(new token, its logits row or None)]."""
        if self.prefilling:
            return []
        n = len(self.drafts) + 1   # after a prompt chunk only its last row chooses
        logits = rows.logits[-n:] if rows.logits is not None else [None] * n
        choices = rows.argmax[-n:] if self.greedy else [self.sample(row) for row in logits]
        block = self.spec.accept(self.drafts, choices)
        self.seq.pos -= len(self.drafts) + 1 - len(block)   # back past the rejected drafts
        self.gen += block
        self.drafts = []
        return list(zip(block, logits))


def step_rows(decodings: list[Decoding], budget: int) -> list[tuple[Decoding, list[int]]]:
    """What one step holds (the scheduler's policy, serve/scheduler.py): a row per decoding sequence (1 + k
    for a verify of k drafts) first, then prompt chunks in order, filling the step up to ``budget`` rows
    (at least one prompt token per step, so that a prompt always progresses)."""
    work = [(d, d.rows(1)) for d in decodings if not d.prefilling]
    left, chunked = budget - sum(len(rows) for _, rows in work), False
    for d in decodings:
        if d.prefilling and (left > 0 or not chunked):
            work.append((d, d.rows(left)))
            left, chunked = left - len(work[-1][1]), True
    return work
