"""Small helpers of the GPU tests (metrics, reporting, fresh random generators)."""

from __future__ import annotations

import sys

import numpy as np


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def report(name: str, value: float, tol: float) -> None:
    print(f"{name}: {value:.3e} (tol {tol:.1e})", file=sys.stderr)


def fresh_rng():
    """Fresh random data every run; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}", file=sys.stderr)
    return np.random.default_rng(seed)
