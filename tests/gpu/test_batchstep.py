"""The CUDA engine's multi-sequence step (runtime/batchstep.py) on the GPU, in process, on the trained
small-py model: sequences of mixed prompt lengths and max tokens stepped together (the server's policy,
runtime/batch.step_rows, with small step budgets so that prompts are read in many chunks beside decode
rows) give each the greedy tokens and logits rows that the same request gets alone through the Runner;
and every prompt row's logits (echo) do not depend on the chunks they were computed in, and their last row
is the single-row head's.

Class (a) of docs/architecture.md throughout: decode rows are bitwise the single-row step in any multi-row
run (row invariance), prompt positions bitwise the same in any chunk (chunk invariance), the multi-row
lm_head's rows bitwise the single-row head's; so everything compares exactly. Against the numpy reference
(a different computation) the echo rows are compared within tests/gpu/test_prefill_runtime.py's logits
tolerance."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ._gpu_util import fresh_rng, rel
from .test_prefill_runtime import LOGITS_TOL, corpus, window  # noqa: F401 - corpus is a fixture
from nanoqwen.runtime.batch import Decoding, step_rows
from nanoqwen.runtime.sampler import Sampling

pytestmark = pytest.mark.gpu

CONTEXT = 1024   # the echo test prefills 700 positions: more than one 512-row chunk


@pytest.fixture(scope="module")
def session(sessions):
    return sessions("small-py", context=CONTEXT, kv_tokens=12 * CONTEXT)


def alone(session, prompt, n):
    """[(token, logits row)] of a greedy request alone (the Runner), nothing reused."""
    session.runner.cache.clear()
    return list(session.generate(prompt, n, Sampling(), logits=True))


def together(session, requests, budget):
    """Every (prompt, n, logits) request admitted at once and stepped as the server steps them; per request
    [(token, logits row or None)]."""
    b = session.batch
    session.runner.cache.clear()
    ds = [Decoding(b.open(p, len(p) + n - 1), p, n, Sampling(), logits=lg, max_rows=b.max_rows)
          for p, n, lg in requests]
    out = [[] for _ in ds]
    while not all(d.done for d in ds):
        running = [d for d in ds if not d.done]
        work = step_rows(running, budget)
        for (d, _), rows in zip(work, b.step([(d.seq, r) for d, r in work])):
            out[ds.index(d)] += d.advance(rows)
        for d in running:
            if d.done:
                b.close(d.seq, d.prompt + d.gen)
    assert b.pages()[0] == 0, "a sequence's pages were not given back"
    return out


@pytest.mark.parametrize("budget", [5, 64, 512])
def test_sequences_together_are_each_bitwise_alone(session, corpus, budget):  # noqa: F811
    rng = fresh_rng()
    lengths, news = [3, 150, 17, 64, 1, 300, 40, 9, 120, 33], [12, 5, 20, 1, 16, 8, 3, 24, 10, 6]
    requests = [(window(corpus, rng, p), n, i % 3 == 0) for i, (p, n) in enumerate(zip(lengths, news))]
    want = [alone(session, p, n) for p, n, _ in requests]
    got = together(session, requests, budget)
    for i, ((p, n, lg), w, g) in enumerate(zip(requests, want, got)):
        assert [t for t, _ in g] == [t for t, _ in w], f"request {i} (prompt {len(p)}, budget {budget})"
        if lg:
            for j, ((_, a), (_, b)) in enumerate(zip(g, w)):
                assert np.array_equal(a, b), f"request {i}: token {j}'s logits differ from alone"


def test_a_lone_stream_is_alone(session, corpus):  # noqa: F811
    """One greedy stream through the step (launched ahead each step) is the Runner's, token for token."""
    p = window(corpus, fresh_rng(), 200)
    want = [t for t, _ in alone(session, p, 40)]
    (got,) = together(session, [(p, 40, False)], 512)
    assert [t for t, _ in got] == want


def scored(session, prompt, budget):
    """(every prompt row's logits, the first generated token) of ``prompt`` with echo's prompt logits."""
    b = session.batch
    session.runner.cache.clear()
    seq = b.open(prompt, len(prompt))
    seq.prompt_logits = True
    d = Decoding(seq, prompt, 1, Sampling(), logits=True, max_rows=b.max_rows)
    rows = []
    while not d.done:
        ((_, work),) = step_rows([d], budget)
        r = b.step([(seq, work)])[0]
        assert r.logits is not None and len(r.logits) == len(work) == len(r.argmax)
        rows.append(r.logits)
        tok = d.advance(r)
    b.close(seq, prompt)
    return np.concatenate(rows), tok[0][0]


def test_echo_rows_do_not_depend_on_the_chunks(session, corpus):  # noqa: F811
    p = window(corpus, fresh_rng(), 700)   # > the 512-token prefill chunk
    whole, tok = scored(session, p, 1024)
    assert whole.shape == (len(p), session.dims.vocab)
    for budget in (7, 64, 300):
        rows, t = scored(session, p, budget)
        assert np.array_equal(rows, whole) and t == tok, f"budget {budget}"
    ((t0, row0),) = alone(session, p, 1)
    assert t0 == tok and np.array_equal(row0, whole[-1]), "the last prompt row is not the single-row head's"


def test_echo_rows_match_the_reference(session, corpus, packed):  # noqa: F811
    """Every prompt row against the INT4 simulation (a different computation: within the prefill's logits
    tolerance), each row's argmax its own row's."""
    from nanoqwen.reference import Reference
    p = window(corpus, fresh_rng(), 90)
    rows, _ = scored(session, p, 40)
    want = Reference.from_file(packed("small-py"), max_seq=CONTEXT).prefill(p)
    worst = max(rel(a, b) for a, b in zip(rows, want))
    print(f"echo rows vs the simulation: worst rel error {worst:.3e} (tolerance {LOGITS_TOL:.1e})", file=sys.stderr)
    assert worst <= LOGITS_TOL
