"""Token choice. Greedy (the default, deterministic) runs on the device: the lm_head kernel's fused argmax
writes the next token where the next step's embedding reads it, so the host never sits in the loop.
Temperature / top-p sampling runs here on the host from the step's fp32 logits: one vocab-sized download
per token is cheap next to a decode step, and numpy's seeded generator makes `--seed` reproducible."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import NanoqwenError


class SamplingError(NanoqwenError):
    pass


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 = greedy (argmax, lowest index on ties)
    top_p: float = 1.0         # nucleus: keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None    # None = fresh entropy each run

    def __post_init__(self):
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise SamplingError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:   # numpy's generators take non-negative seeds only
            raise SamplingError(f"--seed must be a non-negative integer, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class HostSampler:
    """Draws tokens from fp32 logits; one per request, so a seed fixes the whole sequence."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float32)
        if self.sampling.greedy:
            return int(np.argmax(logits))  # first maximum: the kernels' tie rule
        z = logits.astype(np.float64) / self.sampling.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.sampling.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            # keep tokens up to and including the one whose cumulative mass reaches top_p
            keep = order[: int(np.searchsorted(np.cumsum(p[order]), self.sampling.top_p)) + 1]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(p.size, p=p))
