"""The chain judge (tuning/chain.py) on the GPU, on the trained small test model: each variant's decoder is
built beside the session's, every label gets one step time a round, and the session's own decoder gives the
same logits and token afterwards (the variants ran over its buffers and freed only their own)."""

from __future__ import annotations

import numpy as np
import pytest

from ._gpu_util import fill_kv, fresh_rng, one_step
from nanoqwen import config
from nanoqwen.tuning import chain
from nanoqwen.runtime import driver

pytestmark = pytest.mark.gpu

CONTEXT = 40


def test_variants_replay_beside_the_tuned_step(sessions):
    session = sessions("small-py")
    tokens = fresh_rng().integers(0, session.dims.vocab, CONTEXT).tolist()
    fill_kv(session, tokens)
    specs = chain.variant_specs("o_proj", ["warps=2", "lanes=8"], session.dims, config.default(),
                                driver.device().props.name)
    assert len({s.uri for s in specs.values()}) == 3
    before = one_step(session, session.decoder, tokens[-1], CONTEXT - 1)
    times = chain.judge(session, "o_proj", specs, rounds=2, reps=3, context=CONTEXT, log=lambda m: None)
    assert list(times) == list(specs)
    assert all(len(t) == 2 and all(0 < ms < 1e3 for ms in t) for t in times.values())
    after = one_step(session, session.decoder, tokens[-1], CONTEXT - 1)
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]


def test_row_variants_replay_beside_the_tuned_rows_step(sessions):
    """--rows: each label's m-row step over buffers of its own (gate_up with its RMSNorm apart at m = 4); the
    session's own m-row step gives the same argmaxes and logits afterwards (the judge wrote only the K/V its
    rows rewrite, and freed only its own buffers)."""
    session, m = sessions("small-py"), 4
    tokens = fresh_rng().integers(0, session.dims.vocab, CONTEXT).tolist()
    fill_kv(session, tokens)
    specs = chain.variant_specs("gate_up", ["warps=2", "rows=1"], session.dims, config.default(),
                                driver.device().props.name, m)
    assert len({s.uri for s in specs.values()}) == 3 and all(s.m == m and not s.norm for s in specs.values())
    rows, positions = session.rows, list(range(CONTEXT - m + 1, CONTEXT + 1))
    before = rows.run(tokens[-m:], positions, logits=True), rows.logits(m)
    times = chain.judge(session, "gate_up", specs, rounds=2, reps=3, context=CONTEXT, log=lambda line: None)
    assert list(times) == list(specs)
    assert all(len(t) == 2 and all(0 < ms < 1e3 for ms in t) for t in times.values())
    after = rows.run(tokens[-m:], positions, logits=True), rows.logits(m)
    assert before[0] == after[0] and np.array_equal(before[1], after[1])
