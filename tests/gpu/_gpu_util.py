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


def fill_kv(session, tokens) -> None:
    """K/V for positions 0..len-1: the tokens fed one decode step each."""
    sh, dec = session.state, session.decoder
    session.runner.reserve(len(tokens) + 1)
    sh.reset(int(tokens[0]))
    for i, t in enumerate(tokens):
        dec.step(i, feed=int(t) if i else None)
    sh.drain()
    sh.check_errors()


def one_step(session, dec, token: int, pos: int):
    """One graph replay of ``dec`` from state (token, pos): (logits, token, device state after)."""
    sh = session.state
    dec.reset(token, pos=pos, step=pos)
    dec.step(pos, read_token=True, read_logits=True)
    sh.wait_step(pos)
    sh.check_errors()
    return sh.logits(), int(sh.tok_out[pos]), sh.read_state()
