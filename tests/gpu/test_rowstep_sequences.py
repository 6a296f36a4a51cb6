"""The multi-row step over rows of several sequences on the GPU (runtime/rowstep.py ``run(tokens, positions,
tables)``; DESIGN.md sections 12-13), on the trained small-py model: sequences are decoded alone (plain
greedy, CUDA graphs) and kept in the prefix cache with their pages; then one step holds rows of several of
them, each row a token at a position its sequence already decoded, reading its own sequence's page-table
row. Each row's argmax must be the token that sequence's own decode step chose there.

Class (a) of docs/architecture.md: a row is computed with the single-row decode arithmetic whatever else is
in the step (bitwise per kernel in tests/gpu/test_attention.py), and the K/V it rewrites at its position
is the bits the decode step wrote, so the tokens are compared exactly."""

from __future__ import annotations

import sys

import pytest

from ._gpu_util import fresh_rng
from .test_prefill_runtime import corpus, window  # noqa: F401 - corpus is a fixture

pytestmark = pytest.mark.gpu

NEW, CONTEXT, SEQUENCES = 8, 256, 6


@pytest.fixture(scope="module")
def session(packed):
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), CONTEXT, kv_tokens=(SEQUENCES + 1) * CONTEXT,
                    log=lambda m: print(m, file=sys.stderr))
    yield s
    s.close()


@pytest.fixture(scope="module")
def kept(session, corpus):  # noqa: F811
    """SEQUENCES prompts (distinct first tokens, so none takes another's pages over) each decoded alone:
    [(tokens whose K/V is kept, their pages, the NEW generated tokens)]."""
    rng, prompts, firsts = fresh_rng(), [], set()
    while len(prompts) < SEQUENCES:
        p = window(corpus, rng, int(rng.integers(8, 120)))
        if p[0] not in firsts:
            firsts.add(p[0])
            prompts.append(p)
    cache, out = session.runner.cache, []
    cache.clear()
    session.runner.speculate = None
    for p in prompts:
        gen = list(session.generate(p, NEW))
        k = list(cache.kept.values())[-1]
        assert k.tokens == p + gen[:-1]
        out.append((k.tokens, k.pages, gen))
    assert len(cache.kept) == SEQUENCES, "a sequence was evicted or taken over"
    return out


def test_one_row_per_sequence(session, kept):
    """Every sequence's last decoded position in one step: each row's argmax is its sequence's last token."""
    for n in range(1, SEQUENCES + 1):
        seqs = kept[:n]
        got = session.rows.run([t[-1] for t, _p, _g in seqs], [len(t) - 1 for t, _p, _g in seqs],
                               [pages for _t, pages, _g in seqs])
        assert got == [g[-1] for _t, _p, g in seqs], f"{n} sequences"


def test_verify_rows_beside_other_sequences(session, kept):
    """Rows of one sequence at consecutive positions (a verify's shape) beside rows of others, in mixed order,
    padded to a bucket: each row's argmax is what its sequence's decode step chose at that position. (It runs
    after the test above rewrote the last positions: equal bits, so nothing a row reads has changed.)"""
    rows = []   # (token, position, pages, expected argmax)
    for i, (tokens, pages, gen) in enumerate(kept):
        span = 3 if i % 2 == 0 else 1   # positions len-3 .. len-1 hold gen[-4..-2], decoded one by one
        for j in range(span, 0, -1):
            pos = len(tokens) - j
            rows.append((tokens[pos], pos, pages, gen[-j]))
    rows = rows[::2] + rows[1::2]   # interleave the sequences' rows
    for start in range(0, len(rows), session.rows.m):
        part = rows[start:start + session.rows.m]
        got = session.rows.run([r[0] for r in part], [r[1] for r in part], [r[2] for r in part])
        assert got == [r[3] for r in part]

