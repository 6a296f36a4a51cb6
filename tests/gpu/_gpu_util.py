"""Small helpers of the GPU tests (metrics, reporting, fresh random generators)."""

from __future__ import annotations

import sys

import numpy as np
from _margins import rel  # noqa: F401 - one definition of the relative error for every tier


def report(name: str, value: float, tol: float) -> None:
    print(f"{name}: {value:.3e} (tol {tol:.1e})", file=sys.stderr)


def fresh_rng():
    """Fresh random data every run; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"rng seed {seed}", file=sys.stderr)
    return np.random.default_rng(seed)
