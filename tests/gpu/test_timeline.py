"""The in-graph step timeline (bench/timeline.py) on the GPU, on the trained small test model:

* the probe changes nothing the step computes: one replay of the timed graph gives the untimed graph's
  logits and token bit for bit, from the same state (class (a): the same arithmetic, stamps aside);
* every launch's slots are written, and per replay start <= wait <= end, starts follow launch order, and
  no kernel's PDL wait returns before its predecessor's last warp left (griddepcontrol.wait waits for the
  whole previous grid, so the stamps must say so if %globaltimer is one clock for every SM);
* the kernels' own time and the idle kernel_gap each fit in the span, and the span fits in the event-timed
  graph step of the timed graph (the stamps see a subset of what the events see);
* the session's own decoder still works afterwards (the timed decoder ran over its buffers and freed only
  its own);
* the multi-row step's timeline (``measure_rows``): every launch of the bucket stamped in order (its embed,
  the prefill's kernel, too), its own time within the span, and the session's multi-row step gives the same
  argmaxes before and after;
* a short prefill chunk's timeline (``measure_chunk``): every timeable kernel of the bucket's graph stamped in
  order, its own time within the span, and the timed replay leaves the chunk's residual rows the untimed graph
  left, bit for bit;
* a long chunk's profile (bench/chunks.py ``profile_chunk``): every launch timed, the chain too, the rows' bits
  unchanged."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from ._gpu_util import fill_kv, fresh_rng, one_step
from nanoqwen.bench import chunks, timeline

pytestmark = pytest.mark.gpu

CONTEXT = 40   # crosses two page boundaries (16, 32) and ends on a tail
REPS = 20


@pytest.fixture(scope="module")
def setup(sessions):
    session = sessions("small-py")
    rng = fresh_rng()
    tokens = rng.integers(0, session.dims.vocab, CONTEXT).tolist()
    fill_kv(session, tokens)
    timed = timeline.timed_decoder(session.decoder)
    pos = CONTEXT - 1
    timed.reset(tokens[-1], pos=pos, step=pos)
    timed.launch_kernels()
    timed.drain()
    timed.capture()
    yield session, timed, tokens[-1], pos
    timed.close()


def test_timed_step_computes_the_untimed_steps_bits(setup):
    session, timed, token, pos = setup
    plain = one_step(session, session.decoder, token, pos)
    probed = one_step(session, timed, token, pos)
    assert np.array_equal(plain[0], probed[0]) and plain[1] == probed[1] and np.array_equal(plain[2], probed[2])
    assert np.isfinite(plain[0]).all()


def test_stamps_are_ordered_and_cover_every_launch(setup):
    _session, timed, token, pos = setup
    stamps = timeline.probe_stamps(timed, token, pos, REPS)
    assert stamps.shape == (REPS, len(timed.sequence), 3) and (stamps > 0).all(), "a probe slot was never written"
    start, wait, end = stamps[..., 0], stamps[..., 1], stamps[..., 2]
    assert (start <= wait).all() and (wait <= end).all()
    assert (np.diff(start, axis=1) >= 0).all(), "a kernel started before its predecessor"
    assert (wait[:, 1:] >= end[:, :-1]).all(), "a PDL wait returned before the previous kernel's last warp left"
    print(f"timer quantum {timeline.timer_quantum_ns(stamps)} ns", file=sys.stderr)


def test_own_time_and_gap_fit_in_the_span_within_the_graph_step(setup):
    session, _timed, token, _pos = setup
    tl = timeline.measure(session.decoder, CONTEXT, reps=REPS, token=token)
    roles = [role for role, *_rest in session.decoder.sequence]
    assert [k["role"] for k in tl["kernels"]] == roles and tl["launches"] == len(roles)
    assert all(k["start_us"] <= k["wait_us"] <= k["end_us"] for k in tl["kernels"])
    assert tl["kernels"][0]["start_us"] == 0 and all(k["uri"] and k["grid"] for k in tl["kernels"])
    assert 0 < tl["union_us"] <= tl["span_us"] and 0 <= tl["kernel_gap_us"] <= tl["span_us"]
    assert sum(tl["regions_own_us"].values()) > 0
    assert tl["span_us"] <= tl["timed_graph_step_us"] + 1e-3 * tl["timer_quantum_ns"]
    assert tl["graph_step_us"] > 0 and tl["timed_graph_step_us"] > 0
    print(timeline.summary(tl), file=sys.stderr)
    print(json.dumps({k: v for k, v in tl.items() if k != "kernels"}, indent=1), file=sys.stderr)


def test_the_sessions_decoder_still_runs_after_the_timeline(setup):
    session, _timed, token, pos = setup
    before = one_step(session, session.decoder, token, pos)
    timeline.measure(session.decoder, CONTEXT, reps=2, token=token)
    after = one_step(session, session.decoder, token, pos)
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]


def test_the_multi_row_steps_timeline(setup):
    session, _timed, _token, _pos = setup
    rows, m = session.rows, 4
    positions = list(range(CONTEXT - m, CONTEXT))
    before = rows.run([7] * m, positions)
    tl = timeline.measure_rows(rows, m, CONTEXT, reps=REPS)
    roles = [role for role, *_rest in rows.sequences[m]]
    assert [k["role"] for k in tl["kernels"]] == roles and tl["m"] == m
    assert all(k["start_us"] <= k["wait_us"] <= k["end_us"] for k in tl["kernels"])
    assert 0 < tl["union_us"] <= tl["span_us"] <= tl["timed_graph_step_us"] + 1e-3 * tl["timer_quantum_ns"]
    assert rows.run([7] * m, positions) == before
    print(timeline.summary(tl), file=sys.stderr)


def test_a_prefill_chunks_timeline(setup):
    session, *_rest = setup
    pre, b = session.prefiller, 8
    tokens = fresh_rng().integers(0, session.dims.vocab, CONTEXT).tolist()
    p0 = CONTEXT - b
    session.runner.reserve(CONTEXT + 1)
    pre(tokens[:p0], 0)
    assert pre.graph_rows() >= b
    pre(tokens[p0:], p0)   # the untimed bucket graph
    session.state.drain()
    before = pre.bufs.h.download(shape=(b, session.dims.hidden), dtype=np.float32)
    tl = timeline.measure_chunk(pre, b, p0, tokens[p0:], reps=REPS)
    after = pre.bufs.h.download(shape=(b, session.dims.hidden), dtype=np.float32)
    assert np.array_equal(before, after) and np.isfinite(before).all()
    seq = pre.graphs.sequences[b]
    timed = [role for role, *_rest in seq if pre.kernels["prefill." + role][0].timeable]
    assert [k["role"] for k in tl["kernels"]] == timeline.chunk_roles(timed) and tl["m"] == b
    assert all(k["start_us"] <= k["wait_us"] <= k["end_us"] for k in tl["kernels"])
    assert 0 < tl["union_us"] <= tl["span_us"] <= tl["timed_graph_step_us"] + 1e-3 * tl["timer_quantum_ns"]
    print(timeline.summary(tl), file=sys.stderr)


def test_a_long_chunks_profile(setup):
    """bench.chunks ``profile_chunk`` on a cold chunk of 100 rows (kernel by kernel: more than the graphs' 64 rows):
    every launch timed alone and the chain whole, and the chunk's residual rows the same bits afterwards (each run
    recomputed the same ids at the same positions)."""
    session, *_rest = setup
    pre, n = session.prefiller, 100
    ids = fresh_rng().integers(0, session.dims.vocab, n).tolist()
    session.runner.reserve(n + 1)
    pre(ids, 0)
    session.state.drain()
    before = pre.bufs.h.download(shape=(n, session.dims.hidden), dtype=np.float32)
    prof = chunks.profile_chunk(pre, ids, reps=3)
    after = pre.bufs.h.download(shape=(n, session.dims.hidden), dtype=np.float32)
    assert np.array_equal(before, after) and np.isfinite(before).all()
    assert prof["rows"] == n and len(prof["kernels"]) == len(chunks.chunk_launches(pre, n))
    assert prof["chain_ms"] > 0 and all(k["us"] > 0 for k in prof["kernels"])
    assert sum(r["launches"] for r in prof["by_role"].values()) == len(prof["kernels"])
    assert {"gate_up", "down", "attention"} <= set(prof["by_role"])
    print(chunks.profile_summary(prof), file=sys.stderr)
