"""The CUDA engine's multi-sequence step (runtime/batchstep.py) on the fake device of
tests/test_decoder_plan.py (the numpy reference with paged K/V standing in for the GPU): sequences of
mixed prompt lengths, max tokens and sampling, admitted one per step and read in chunks between decode
rows (runtime/batch.py ``step_rows``, the server's policy), each get what the reference generates for the
request alone, and the device is fed exactly each sequence's own tokens through its own pages.

Class (a) of docs/architecture.md: the fake device computes every row (single-row step, multi-row row,
prefill row) as the reference's decode step (``Reference.extend`` is row invariant), as the GPU's kernels
keep the single-row arithmetic per row (tests/gpu/test_rowstep_sequences.py), so tokens compare exactly."""

from __future__ import annotations

import numpy as np
import pytest
from test_decoder_plan import fake_device, nqfile, reference_generation  # noqa: F401 - nqfile is a fixture

from nanoqwen.reference import Reference
from nanoqwen.runtime.batch import Decoding, PagesShort, step_rows
from nanoqwen.runtime.batchstep import BatchStep, split
from nanoqwen.runtime.sampler import Sampling

CAPACITY = 64


class FakeRows:
    """The multi-row step on the fake device: row r (token r at positions[r], through its own page list
    tables[r]) computed in order as one reference decode step, its K/V stored in its pages."""
    m, buckets, ms = 4, [2, 4], {}   # small, so that a step of several sequences needs several runs

    def __init__(self, dev):
        self.dev, self.last, self.runs, self.fed_forward = dev, None, [], 0

    def feed_forward(self, positions):
        """The last run again, each row fed its argmax there, at ``positions`` (the device computes it now;
        ``collect`` hands its argmaxes over)."""
        self.fed_forward += 1
        self.argmax = self.run(self.argmax, positions, self.tables)

    def collect(self, n):
        return self.argmax[:n]

    def run(self, tokens, positions, tables, logits=False):
        kv, ref = self.dev.run.shared.kv, self.dev.ref
        assert len(tokens) <= self.m and len({id(t) for t in tables}) <= len(tokens)
        loaded, out = kv.pages, []
        try:
            for tok, pos, pages in zip(tokens, positions, tables):
                kv.pages = pages   # the row's own page-table row; the loaded table is untouched
                self.dev.load(pos)
                out.append(ref.decode(tok))
                self.dev.store(pos, [tok])
        finally:
            kv.pages = loaded
        self.last = np.stack(out).astype(np.float32)
        self.runs.append(len(tokens))
        self.argmax, self.tables = [int(np.argmax(row)) for row in self.last], list(tables)
        return self.argmax

    def logits(self, n):
        return self.last[:n].copy()


def batch_device(nqfile, monkeypatch, kv_tokens=8 * CAPACITY):  # noqa: F811
    ref = Reference.from_file(nqfile, max_seq=CAPACITY)
    run, dev = fake_device(nqfile, monkeypatch, ref, batched_prefill=True, capacity=CAPACITY, kv_tokens=kv_tokens)
    run.rows = FakeRows(dev)
    return BatchStep(run), run, dev


def alone(nqfile, prompt, n, sampling):  # noqa: F811
    ref = Reference.from_file(nqfile, max_seq=CAPACITY)
    for t in prompt:
        logits = ref.decode(t)
    return reference_generation(ref, logits, n, sampling)


def serve(batch, requests, budget):
    """Every request through ``batch``, admitted one per step in order, stepped as the server steps them;
    {request index: generated tokens}."""
    waiting, running, out = list(enumerate(requests)), {}, {}
    while waiting or running:
        if waiting:
            i, (prompt, n, sampling) = waiting.pop(0)
            seq = batch.open(prompt, len(prompt) + n - 1)
            running[Decoding(seq, prompt, n, sampling, max_rows=batch.max_rows)] = i
        work = step_rows(list(running), budget)
        for (d, _), rows in zip(work, batch.step([(d.seq, rows) for d, rows in work])):
            d.advance(rows)
            if rows.logits is not None:
                assert d.seq.logits and rows.logits.shape == (len(rows.argmax), batch.runner.dims.vocab)
            if d.done:
                out[running.pop(d)] = d.gen
                batch.close(d.seq, d.prompt + d.gen)
    return out


PROMPTS = [[5, 17, 9, 300, 41, 7, 77, 123, 1, 2, 3], [8, 8, 9], [400, 3, 2, 1, 50, 60, 70, 80, 90, 100, 11, 12,
                                                                    13, 14, 15, 16, 17, 18, 19, 20], [33], [2, 4, 6, 8, 10]]


@pytest.mark.parametrize("budget", [3, 8, 64])
def test_sequences_side_by_side_are_each_alone(nqfile, monkeypatch, budget):  # noqa: F811
    batch, run, dev = batch_device(nqfile, monkeypatch)
    samplings = [Sampling(), Sampling(temperature=0.8, seed=3), Sampling(), Sampling(temperature=0.5, seed=9),
                 Sampling()]
    requests = [(p, n, s) for p, n, s in zip(PROMPTS, (9, 4, 12, 1, 7), samplings)]
    got = serve(batch, requests, budget)
    for i, (p, n, s) in enumerate(requests):
        assert got[i] == alone(nqfile, p, n, s), f"request {i}"
    if budget >= 8:
        assert max(run.rows.runs) > 1, "no multi-row run held two sequences"
    assert run.cache.usage()[0] == 0   # every running page went back (kept or free)
    kept = {tuple(k.tokens[:3]) for k in run.cache.kept.values()}
    assert {tuple(p[:3]) for p in PROMPTS} == kept


def test_a_lone_greedy_stream_runs_ahead_and_resumes_exactly(nqfile, monkeypatch):  # noqa: F811
    """One greedy sequence alone: each step launches its next row ahead (the device is fed one token past
    the last one asked for); a second sequence joining voids the launched row, whose position the first
    then recomputes; the kept sequence holds exactly the tokens whose rows were asked for."""
    batch, run, dev = batch_device(nqfile, monkeypatch)
    first, other = PROMPTS[0], PROMPTS[2]
    want = alone(nqfile, first, 10, Sampling())
    d = Decoding(batch.open(first, len(first) + 9), first, 10, Sampling(), max_rows=batch.max_rows)
    dev.fed.clear()
    while len(d.gen) < 5:
        (work,) = step_rows([d], 64)
        d.advance(batch.step([(d.seq, work[1])])[0])
    assert d.gen == want[:5] and batch.ahead is not None and batch.ahead.pos == d.seq.pos
    # the prompt, the 4 tokens fed so far, and the launched-ahead row fed the 5th
    assert dev.fed == first + want[:5]
    e = Decoding(batch.open(other, len(other) + 3), other, 4, Sampling(), max_rows=batch.max_rows)
    while not (d.done and e.done):
        ds = [x for x in (d, e) if not x.done]
        work = step_rows(ds, 8)
        for (x, _), rows in zip(work, batch.step([(x.seq, rows) for x, rows in work])):
            x.advance(rows)
        assert batch.ahead is None or len(ds) == 1
    assert d.gen == want and e.gen == alone(nqfile, other, 4, Sampling())
    batch.close(d.seq, d.prompt + d.gen)
    kept = [k for k in run.cache.kept.values() if k.tokens[0] == first[0]]
    assert kept[0].tokens == first + want[:-1]


def test_greedy_rows_of_several_sequences_are_fed_forward(nqfile, monkeypatch):  # noqa: F811
    """Greedy sequences decoding together (one row each, one run): each step launches the same run again
    fed on the device, and the next step takes it; a sampled sequence, a prompt chunk or a finished sequence
    in the step stops it, and a step that asks for other rows leaves it. Every sequence gets what it gets
    alone."""
    batch, run, dev = batch_device(nqfile, monkeypatch)
    greedy = [(PROMPTS[i], n, Sampling()) for i, n in ((0, 9), (2, 12), (4, 6))]
    got = serve(batch, greedy, 64)
    assert all(got[i] == alone(nqfile, p, n, s) for i, (p, n, s) in enumerate(greedy))
    assert run.rows.fed_forward >= 4, "no run was fed forward"
    taken = run.rows.fed_forward
    mixed = greedy + [(PROMPTS[1], 8, Sampling(temperature=0.8, seed=3))]
    got = serve(batch, mixed, 64)
    assert all(got[i] == alone(nqfile, p, n, s) for i, (p, n, s) in enumerate(mixed))
    assert run.rows.fed_forward - taken < 4, "a step with a sampled row was fed forward"
    # a run fed forward that the next step does not ask for (a sequence left): the others go on exactly
    a, b, c = (Decoding(batch.open(p, len(p) + n - 1), p, n, s, max_rows=batch.max_rows) for p, n, s in greedy)
    live = [a, b, c]
    while live:
        work = step_rows(live, 64)
        for (d, _), rows in zip(work, batch.step([(d.seq, r) for d, r in work])):
            d.advance(rows)
        if a in live and len(a.gen) == 3:
            assert batch.rows_ahead is not None and a.seq in batch.rows_ahead.seqs
            batch.close(a.seq, [])   # the client left with a row of it fed forward
            live.remove(a)
            assert batch.rows_ahead is None
        for d in [d for d in live if d.done]:
            batch.close(d.seq, d.prompt + d.gen)
            live.remove(d)
    assert (b.gen, c.gen) == (alone(nqfile, *greedy[1]), alone(nqfile, *greedy[2]))
    assert batch.rows_ahead is None


def test_no_row_is_launched_past_the_last_one(nqfile, monkeypatch):  # noqa: F811
    """A lone greedy sequence run to its max tokens: the device is fed exactly its prompt and every token but
    the last (no row launched ahead past the positions it may occupy)."""
    batch, run, dev = batch_device(nqfile, monkeypatch)
    p = PROMPTS[2]
    dev.fed.clear()
    assert serve(batch, [(p, 6, Sampling())], 64) == {0: alone(nqfile, p, 6, Sampling())}
    assert dev.fed == p + alone(nqfile, p, 6, Sampling())[:-1] and batch.ahead is None


def test_logits_only_for_the_sequences_that_ask(nqfile, monkeypatch):  # noqa: F811
    """Greedy rows take the device argmax with no logits copied; a sequence with ``logits`` gets its rows',
    in the single-row step, in multi-row runs and after its prompt; they match the reference alone."""
    batch, run, dev = batch_device(nqfile, monkeypatch)
    plain = Decoding(batch.open(PROMPTS[1], 10), PROMPTS[1], 8, Sampling(), max_rows=batch.max_rows)
    asked = Decoding(batch.open(PROMPTS[4], 12), PROMPTS[4], 8, Sampling(), logits=True, max_rows=batch.max_rows)
    rows_seen = []
    while not (plain.done and asked.done):
        ds = [x for x in (plain, asked) if not x.done]
        work = step_rows(ds, 64)
        for (x, _), rows in zip(work, batch.step([(x.seq, r) for x, r in work])):
            assert (rows.logits is not None) == (x is asked) or not rows.argmax
            if x is asked:
                rows_seen += [lg for _t, lg in x.advance(rows)]
            else:
                x.advance(rows)
    ref = Reference.from_file(nqfile, max_seq=CAPACITY)
    for t in PROMPTS[4]:
        logits = ref.decode(t)
    for i, tok in enumerate(asked.gen):
        np.testing.assert_array_equal(rows_seen[i], logits)
        assert int(np.argmax(logits)) == tok
        logits = ref.decode(tok)


def test_a_sequence_short_of_pages_waits(nqfile, monkeypatch):  # noqa: F811
    """A pool of one context: a second sequence cannot get its pages while the first runs (PagesShort, the
    scheduler's cue to wait), and gets them once the first is closed."""
    batch, run, dev = batch_device(nqfile, monkeypatch, kv_tokens=CAPACITY)
    a = batch.open(PROMPTS[0], CAPACITY)
    with pytest.raises(PagesShort, match="wait for pages"):
        batch.open(PROMPTS[1], CAPACITY)
    batch.close(a, [])
    batch.open(PROMPTS[1], CAPACITY)


def test_an_item_across_the_prompts_end_is_refused(nqfile, monkeypatch):  # noqa: F811
    batch, run, dev = batch_device(nqfile, monkeypatch)
    seq = batch.open(PROMPTS[1], 8)
    with pytest.raises(ValueError, match="spans the prompt's end"):
        batch.step([(seq, PROMPTS[1] + [4])])


def test_split_follows_the_measured_bucket_times():
    """Rows cut into runs by the buckets' replay times: the H200's (results/speculate-h200-2026-12-04.json:
    m = 16 costs more than two m = 8) give two runs of 8 for 16 rows; without times, runs of the largest."""
    h200 = {2: 2.39, 4: 3.48, 8: 6.58, 16: 17.09}
    assert split(16, [2, 4, 8, 16], h200) == [8, 8]
    assert split(12, [2, 4, 8, 16], h200) == [8, 4]
    assert split(3, [2, 4, 8, 16], h200) == [3]   # one run of 3 rows in the bucket of 4
    assert split(5, [2, 4, 8, 16], h200) == [4, 1]
    linear = {2: 2.0, 4: 2.1, 8: 2.2, 16: 2.3}   # a step that reads the weights once for all rows
    assert split(16, [2, 4, 8, 16], linear) == [16] and split(9, [2, 4, 8, 16], linear) == [9]
    assert split(9, [2, 4], {}) == [4, 4, 1] and split(4, [2, 4], {}) == [4]
