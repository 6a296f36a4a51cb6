"""Token choice. Greedy (the default, deterministic) runs on the device: the lm_head kernel's fused argmax
writes the next token where the next step's embedding reads it, so the host never sits in the loop.
Everything else runs here on the host from the step's fp32 logits: one vocab-sized download per token is
cheap next to a decode step, and numpy's seeded generator makes a seed reproducible. That covers drawing
(temperature > 0) and every field that reshapes the logits before the choice, greedy or not: logit bias,
repetition / presence / frequency penalties and the truncations (top-k, top-p, min-p, llama.cpp's infill
step), applied in llama.cpp's way when a request names its ``samplers`` chain.

Per step: logit bias, a grammar's mask (structured output), then the steps of ``order`` (default:
penalties, temperature, top_k, top_p, min_p, so truncation sees the temperature-scaled distribution, as
in vLLM), then argmax or a draw. With an
explicit ``order`` (llama-server's ``samplers``) only the named steps run and the token is always drawn;
a missing "temperature" step draws at temperature 1 and a temperature of 0 keeps only the top token,
as llama.cpp's chain does."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import NanoqwenError

STEPS = ("penalties", "top_k", "top_p", "min_p", "infill", "temperature")
DEFAULT_ORDER = ("penalties", "temperature", "top_k", "top_p", "min_p")
INFILL_MAX_CANDIDATES = 256   # the infill step compares every pair of candidates: a top_k before it bounds them


class SamplingError(NanoqwenError):
    pass


@dataclass(frozen=True, eq=False)
class Vocab:
    """What the infill step needs of the tokenizer: a token's text, and the end-of-generation ids."""
    piece: Callable[[int], str]
    eog: frozenset[int]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 = greedy (argmax, lowest index on ties)
    top_p: float = 1.0         # nucleus: keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None    # None = fresh entropy each run
    top_k: int = 0             # keep the k most likely tokens; 0 = all
    min_p: float = 0.0         # keep tokens at least min_p times as likely as the most likely one
    presence_penalty: float = 0.0    # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0   # ... and this times its count
    repetition_penalty: float = 1.0  # HF's / llama.cpp's: a seen token's logit divided by it (times if < 0)
    penalty_window: int = -1   # the last N tokens (prompt and output) repetition_penalty looks at; -1 = all
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), before any step
    order: tuple[str, ...] | None = None   # llama.cpp's sampler chain; None = DEFAULT_ORDER, greedy at T = 0
    vocab: Vocab | None = field(default=None, compare=False)   # for the infill step
    # a grammar: ``start()`` -> a matcher with ``mask(logits)`` (cut what may not come next, in place)
    # and ``accept(token)``, one per request (serve/grammar.py)
    constraint: object | None = field(default=None, compare=False)

    def __post_init__(self):
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise SamplingError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:   # numpy's generators take non-negative seeds only
            raise SamplingError(f"--seed must be a non-negative integer, got {self.seed}")
        if self.top_k < 0 or not 0.0 <= self.min_p <= 1.0 or not self.repetition_penalty > 0.0:
            raise SamplingError(f"top_k must be >= 0, min_p in [0, 1], repetition_penalty > 0 (got {self.top_k}, "
                                f"{self.min_p}, {self.repetition_penalty})")
        if self.order is not None:
            if bad := [s for s in self.order if s not in STEPS]:
                raise SamplingError(f"samplers: {bad[0]!r} is not supported (supported: {', '.join(STEPS)})")
            if "infill" in self.order:
                before = self.order[:self.order.index("infill")]
                if "top_k" not in before or not 0 < self.top_k <= INFILL_MAX_CANDIDATES or self.vocab is None:
                    raise SamplingError(f"samplers: 'infill' needs 'top_k' before it with 1 <= top_k <= "
                                        f"{INFILL_MAX_CANDIDATES} (it compares every pair of candidates)")

    @property
    def reshapes(self) -> bool:
        """Whether anything changes the logits before the choice (so the device argmax would be wrong)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0 or (self.order is not None and "infill" in self.order) \
            or self.constraint is not None

    @property
    def greedy(self) -> bool:
        """The device's argmax of the raw logits is the answer: nothing drawn, nothing reshaped."""
        return self.temperature == 0.0 and self.order is None and not self.reshapes


class HostSampler:
    """Chooses tokens from fp32 logits; one per request (given its prompt, which repetition_penalty
    sees), so a seed fixes the whole sequence. Each chosen token is remembered for the penalties."""

    def __init__(self, sampling: Sampling, prompt=()):
        self.sampling = s = sampling
        self.matcher = s.constraint.start() if s.constraint is not None else None
        if s.greedy:   # the argmax needs neither a generator nor the history (86 us for a 4096-token prompt)
            self.rng = self.seen = self.counts = None
            return
        self.rng = np.random.default_rng(sampling.seed)
        self.seen = collections.deque(prompt, maxlen=s.penalty_window if s.penalty_window >= 0 else None)
        self.counts: collections.Counter = collections.Counter()   # generated tokens

    def __call__(self, logits: np.ndarray) -> int:
        s = self.sampling
        if s.greedy:
            return int(np.argmax(np.asarray(logits, dtype=np.float32)))  # first maximum: the kernels' tie rule
        z = np.array(logits, dtype=np.float64)
        for tok, bias in s.logit_bias:
            z[tok] += bias
        if self.matcher is not None:
            self.matcher.mask(z)
        for step in s.order or DEFAULT_ORDER:
            z = getattr(self, "_" + step)(z)
        if s.order is None and s.temperature == 0.0:
            tok = int(np.argmax(z))
        else:   # inverse CDF over the tokens left (rng.choice would validate the whole vocabulary each time)
            cand = np.flatnonzero(z > -np.inf)
            c = np.cumsum(np.exp(z[cand] - z[cand].max()))
            tok = int(cand[min(int(np.searchsorted(c, self.rng.random() * c[-1], side="right")), cand.size - 1)])
        self.seen.append(tok)
        self.counts[tok] += 1
        if self.matcher is not None:
            self.matcher.accept(tok)
        return tok

    # ---- the steps: logits in, logits out (-inf = cut) ---------------------------------------------------

    def _penalties(self, z):
        s = self.sampling
        if s.repetition_penalty != 1.0 and self.seen:
            ids = np.fromiter(set(self.seen), np.int64)
            z[ids] = np.where(z[ids] > 0, z[ids] / s.repetition_penalty, z[ids] * s.repetition_penalty)
        if self.counts and (s.presence_penalty or s.frequency_penalty):
            ids = np.fromiter(self.counts.keys(), np.int64)
            z[ids] -= s.presence_penalty + s.frequency_penalty * np.fromiter(self.counts.values(), np.float64)
        return z

    def _temperature(self, z):
        t = self.sampling.temperature
        if t > 0.0:
            return z / t
        return np.where(np.arange(z.size) == np.argmax(z), z, -np.inf)   # llama.cpp: T = 0 keeps the top one

    def _top_k(self, z):
        k = self.sampling.top_k
        if 0 < k < z.size:
            out = np.full_like(z, -np.inf)
            keep = np.argpartition(-z, k - 1)[:k]
            out[keep] = z[keep]
            return out
        return z

    def _top_p(self, z):
        top_p = self.sampling.top_p
        if top_p < 1.0:
            p = _softmax(z)
            n = min(p.size, 256)
            while True:   # sort only the likeliest n tokens, as many as it takes to reach top_p
                head = np.sort(np.argpartition(-p, n - 1)[:n]) if n < p.size else np.arange(p.size)
                head = head[np.argsort(-p[head], kind="stable")]   # ties: the lower id first
                mass = np.cumsum(p[head])
                if mass[-1] >= top_p or n == p.size:
                    break
                n = min(p.size, 8 * n)
            # keep tokens up to and including the one whose cumulative mass reaches top_p
            keep = head[:int(np.searchsorted(mass, top_p)) + 1]
            out = np.full_like(z, -np.inf)
            out[keep] = z[keep]
            return out
        return z

    def _min_p(self, z):
        if self.sampling.min_p > 0.0:
            p = _softmax(z)
            z[p < self.sampling.min_p * p.max()] = -np.inf
        return z

    def _infill(self, z):
        """llama.cpp's infill sampler (src/llama-sampling.cpp): end the fill when end-of-generation is
        likely enough; otherwise merge each token into a likelier one whose text it begins (or that begins
        it), keep the candidates above 0.2, then those above 1 / (n + 1)."""
        vocab = self.sampling.vocab
        cand = np.flatnonzero(np.isfinite(z))
        cand = cand[np.argsort(-z[cand], kind="stable")]
        p = _softmax(z[cand])
        eog = np.array([int(t) in vocab.eog for t in cand])
        if 3 * p[eog].sum() * cand.size > p[~eog].sum():
            return _logits_of(cand[eog], p[eog], z.size)
        text = [vocab.piece(int(t)) for t in cand]
        alive = np.ones(cand.size, bool)
        for i0 in range(cand.size):
            for i1 in range(cand.size):
                if not alive[i0]:
                    break
                if i0 == i1 or not alive[i1]:
                    continue
                if text[i0] and text[i1].startswith(text[i0]):
                    dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                    p[dst] += p[src]
                    p[src], alive[src] = 0.0, False
        keep = alive & ((p >= 0.2) | eog)
        if not (keep & ~eog).any():
            return _logits_of(np.array([min(vocab.eog)]), np.ones(1), z.size)
        p = np.where(keep, p, 0.0) / p[keep].sum()
        keep &= (p >= 1.0 / ((keep & ~eog).sum() + 1)) | eog
        return _logits_of(cand[keep], p[keep], z.size)


def _softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def _logits_of(ids: np.ndarray, p: np.ndarray, size: int) -> np.ndarray:
    """Logits whose softmax is ``p`` on ``ids`` and 0 elsewhere."""
    z = np.full(size, -np.inf)
    z[ids] = np.log(p / p.sum())
    return z
