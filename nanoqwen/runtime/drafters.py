"""Draft tokens for speculative decoding (host side; DESIGN.md section 11).

A drafter follows one request's sequence (``append`` the tokens the engine accepted), proposes up to
``k`` next tokens (``draft``) and hears how many of them the model accepted (``record``). A drafter kind
(``PromptLookup``, ``DraftModel``) is a frozen setting; calling it with a prompt starts a drafter for that
request, so an engine holds the setting and a request holds its drafter.

Prompt lookup: the longest recent n-gram of the sequence (n from ``max_ngram`` down to ``min_ngram``)
found earlier in prompt + output proposes the tokens that followed its most recent earlier occurrence.
The sequence sits in one int array; a draft scans it with max_ngram vectorized compares (~15 us at 4096
tokens here), so a request starts at once. A dictionary of every n-gram's latest end, the earlier design,
made each draft a few probes but cost ~7 ms of Python before a 4096-token request's first token.

Draft model: a smaller model of the same vocabulary (Qwen2.5-Coder-0.5B for the 7B), opened by
``backends.open_engine`` with the target's backend and context as an engine of its own (its own KV cache,
prefix cache and, on CUDA, graphs), drafts its greedy continuation of the sequence. Its prefix cache keeps
the sequence it last drafted from, so each round prefills only the tokens accepted since.

For both, k adapts to acceptance (the rule of Hugging Face's assisted generation): a draft accepted whole
raises k by 2, any rejection lowers it by 1, within [1, max_draft]. Where the engine measured its step
costs (the CUDA engine: the decode step and each multi-row bucket), ``Speculation`` caps k further to the
draft length of the most expected tokens per unit of step time (``best_draft``), from an estimate of how
likely the model accepts a draft token: a verify costs its bucket whether its drafts are right or not, and
on the H200 a 16-row bucket costs 7.5 decode steps (results/speculate-h200-2026-12-04-rows-tuned.json).
Where the rule chooses plain steps, ``commit_plain`` commits to the ones before the next exploring verify at
once, so that the engine launches them back to back instead of one host round trip per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import NanoqwenError
from ..modelcache import ModelError, is_file

SPECULATE_KINDS = ("lookup", "draft:FILE")


class SpeculateError(NanoqwenError):
    pass


def check_max_draft(max_draft: int) -> None:
    if not 1 <= max_draft <= 64:
        raise SpeculateError(f"--draft-tokens must be in [1, 64], got {max_draft}")


class AdaptiveK:
    """A drafter's k: the most tokens its next draft may have, adapted to what the model accepted."""

    def __init__(self, max_draft: int):
        self.max_draft = self.k = max_draft

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.k = min(self.max_draft, self.k + 2) if accepted == drafted else max(1, self.k - 1)


@dataclass(frozen=True)
class PromptLookup:
    # the most tokens one verify step checks beyond the last accepted one: 7 keeps a verify in the
    # multi-row step's 8-row bucket (H200, 7B: 3.98x the decode step; 16 rows cost 10.3x,
    # results/speculate-h200-2026-12-03.json)
    max_draft: int = 7
    max_ngram: int = 4
    min_ngram: int = 1

    def __post_init__(self):
        check_max_draft(self.max_draft)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpeculateError(f"prompt lookup n-grams need 1 <= min_ngram <= max_ngram, got "
                                 f"{self.min_ngram}..{self.max_ngram}")

    def __call__(self, prompt: list[int]) -> "LookupDrafter":
        return LookupDrafter(self, prompt)

    def close(self) -> None:
        """Nothing to release (a draft model's engine has to be)."""


class LookupDrafter(AdaptiveK):
    def __init__(self, setting: PromptLookup, prompt: list[int]):
        super().__init__(setting.max_draft)
        self.min_ngram, self.max_ngram = setting.min_ngram, setting.max_ngram
        self.seq, self.n = np.empty(max(64, 2 * len(prompt)), np.int64), 0   # tokens [0, n) of the sequence
        self.append(prompt)

    def append(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        end = self.n + len(tokens)
        if end > len(self.seq):
            self.seq = np.concatenate([self.seq[:self.n], np.empty(max(end, 2 * len(self.seq)) - self.n, np.int64)])
        self.seq[self.n:end] = tokens
        self.n = end

    def draft(self, limit: int) -> list[int]:
        """Up to min(k, limit) tokens; [] when no n-gram of the sequence's end occurred before."""
        k, L = min(self.k, limit), self.n
        if k < 1 or L < 2:
            return []
        seq = self.seq[:L]
        # hit[e - 1]: the sequence's last n tokens also end at e (n <= e <= L - 1); longer n-grams' hits are
        # a subset of shorter ones', so n grows while any is left
        hit, end = seq[:L - 1] == seq[L - 1], None
        for n in range(1, self.max_ngram + 1):
            if n > 1:
                hit[:n - 1] = False
                hit[n - 1:] &= seq[:L - n] == seq[L - n]
            found = np.flatnonzero(hit)
            if not found.size:
                break
            if n >= self.min_ngram:
                end = int(found[-1]) + 1
        return [] if end is None else seq[end:end + k].tolist()


@dataclass(frozen=True)
class DraftModel:
    path: str              # the draft model: a .nanoqwen file or a Hugging Face directory
    max_draft: int = PromptLookup.max_draft
    engine: object = field(default=None, compare=False)   # its engine, once open_engine has opened it

    def __post_init__(self):
        check_max_draft(self.max_draft)
        try:
            is_file(self.path)
        except ModelError as e:
            raise SpeculateError(f"--speculate draft:{e}") from None

    def __call__(self, prompt: list[int]) -> "ModelDrafter":
        return ModelDrafter(self, prompt)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class ModelDrafter(AdaptiveK):
    """The draft engine's greedy continuation of the sequence, k tokens at a time."""

    def __init__(self, setting: DraftModel, prompt: list[int]):
        super().__init__(setting.max_draft)
        self.engine, self.tokens = setting.engine, [int(t) for t in prompt]

    def append(self, tokens) -> None:
        self.tokens += [int(t) for t in tokens]

    def draft(self, limit: int) -> list[int]:
        k = min(self.k, limit, self.engine.context - len(self.tokens))   # a draft model of fewer positions stops
        return list(self.engine.generate(self.tokens, k)) if k >= 1 else []


# The acceptance estimate: accepted and rejected drafts, each verify's weighed DECAY times less per later
# verify (the drafter's quality drifts along a request), starting from PRIOR (p = 0.75). A plain step chosen
# by the costs teaches nothing, so after EXPLORE of them in a row one verify of a single draft looks again.
DECAY = 0.9
PRIOR = (3.0, 1.0)
EXPLORE = 16


def best_draft(p: float, costs: dict[int, float], limit: int) -> int:
    """The draft length k <= limit of the most expected tokens per unit of step time. A verify of k drafts
    costs the cheapest measured step of at least k + 1 rows (``costs``: rows -> time, 1 being the decode
    step) and yields (1 - p^(k+1)) / (1 - p) tokens when each draft is accepted with probability p once
    the one before it was (k = 0: a plain step, one token)."""
    best_k, best_rate = 0, 1.0 / costs[1]
    for k in range(1, limit + 1):
        fits = [m for m in costs if m >= k + 1]
        if not fits:
            break
        tokens = (1.0 - p ** (k + 1)) / (1.0 - p) if p < 1.0 else k + 1.0
        rate = tokens / costs[min(fits)]
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def accept(drafts: list[int], choices: list[int]) -> list[int]:
    """A verify step's tokens: ``choices[i]`` is the model's token after ``drafts[:i]`` (len(drafts) + 1 of
    them); the drafts that equal the model's choice are accepted, up to the first that does not, then the
    model's own choice after them. Greedy output is therefore exactly plain greedy decoding's."""
    a = 0
    while a < len(drafts) and drafts[a] == choices[a]:
        a += 1
    return drafts[:a] + [choices[a]]


class Speculation:
    """One request's verify bookkeeping, the same in both engines: drafts from its drafter (none without
    one: every step is then a plain one), acceptance, the drafter told the outcome, and the counts the
    engine reports as ``drafted_tokens`` / ``accepted_tokens`` (``verifies``: the steps that checked drafts)."""

    def __init__(self, drafter=None, costs: dict[int, float] | None = None):
        self.drafter, self.drafted, self.accepted, self.verifies = drafter, 0, 0, 0
        self.costs = costs   # rows -> measured step time (None: k is the drafter's alone)
        self.seen = list(PRIOR)   # decayed (accepted, rejected) drafts
        self.plain_run = 0

    @property
    def acceptance(self) -> float:
        """Estimated probability that the model accepts a draft token after an accepted one."""
        return self.seen[0] / (self.seen[0] + self.seen[1])

    def draft(self, limit: int) -> list[int]:
        if not self.drafter or limit < 1:
            return []
        if self.costs:
            k = best_draft(self.acceptance, self.costs, limit)
            self.plain_run = self.plain_run + 1 if k == 0 else 0
            if k == 0 and self.plain_run < EXPLORE:
                return []
            limit = max(k, 1)
            self.plain_run = 0
        return self.drafter.draft(limit)

    def commit_plain(self, limit: int) -> int:
        """Commits to the next n rounds as plain steps and returns n: n <= ``limit`` (the next
        round's ``draft`` limit) rounds whose ``draft`` would return [] without asking the drafter, their
        bookkeeping done here as those calls would do it; 0 where the next ``draft`` may verify (no costs,
        a draft worth its cost, or the exploring round). The rule's k = 0 holds for all n: a plain step
        leaves the acceptance estimate as it was, and later rounds' limits are no larger."""
        if not (self.drafter and self.costs) or limit < 1 or best_draft(self.acceptance, self.costs, limit):
            return 0
        n = min(limit, EXPLORE - 1 - self.plain_run)   # the EXPLORE-th plain step in a row explores instead
        self.plain_run += n
        return n

    def accept(self, drafts: list[int], choices: list[int]) -> list[int]:
        """The verify step's tokens (``accept``); the drafter follows them."""
        block = accept(drafts, choices)
        self.drafted, self.accepted = self.drafted + len(drafts), self.accepted + len(block) - 1
        self.verifies += bool(drafts)
        if drafts:
            self.seen = [DECAY * self.seen[0] + len(block) - 1, DECAY * self.seen[1] + (len(block) - 1 < len(drafts))]
        if self.drafter:
            self.drafter.append(block)
            self.drafter.record(len(drafts), len(block) - 1)
        return block


def drafter_setting(kind: str | None, draft_tokens: int = PromptLookup.max_draft):
    """The CLI's ``--speculate lookup|draft:FILE [--draft-tokens K]`` as an engine setting (None: plain
    decoding)."""
    if kind is None:
        return None
    if kind == "lookup":
        return PromptLookup(max_draft=draft_tokens)
    if kind.startswith("draft:") and kind[len("draft:"):]:
        return DraftModel(kind[len("draft:"):], max_draft=draft_tokens)
    raise SpeculateError(f"--speculate must be one of {', '.join(SPECULATE_KINDS)}, got {kind!r}")
