"""The multi-row step's rows of several sequences (runtime/rowstep.py), on the fake driver of
tests/test_decoder_plan.py: what ``RowStep.run`` puts in the device buffers its m > 1 kernels read. Row r
reads positions[r] and its page-table row at ``row_tables + positions[m + r]`` (the kernels' contract,
codegen/kernels/attention.py); rows of one sequence share a table row, each distinct sequence gets its own,
padding repeats the last row, and without tables row 0 is the KV cache's loaded table (the verify)."""

from __future__ import annotations

import numpy as np

from test_decoder_plan import at, fake_session, nqfile  # noqa: F401

from nanoqwen.runtime import rowstep
from nanoqwen.runtime.paged_kv import UNMAPPED


def session(nqfile, monkeypatch):  # noqa: F811
    return fake_session(nqfile, monkeypatch)


def device_ints(buf, n: int) -> np.ndarray:
    return at(buf.ptr, 4 * n).view(np.int32).copy()


def test_rows_of_several_sequences_read_their_own_tables(nqfile, monkeypatch):  # noqa: F811
    s = session(nqfile, monkeypatch)
    rows, T = s.rows, s.rows.table_len
    for m in rows.buckets:   # every m-row kernel that reads a page table reads the rows' tables
        for role, _fn, _launch, args in rows.sequences[m]:
            if "page_table" in args:
                assert args["page_table"] == rows.bufs.row_tables, (m, role)
    a, b, c = [3, 9], [4, 1, 7], [12]
    tables = [a, b, b, c, a]   # a verify of b's two rows beside other sequences' rows
    rows.run([10, 11, 12, 13, 14], [20, 33, 34, 5, 21], tables)
    m = rows.bucket(5)
    got = device_ints(rows.bufs.rows_in, 12 * rows.m // 4)
    tokens, positions, offsets = got[:m], got[rows.m:rows.m + m], got[rows.m + m:rows.m + 2 * m]
    assert tokens.tolist() == [10, 11, 12, 13, 14] + [14] * (m - 5)
    assert positions.tolist() == [20, 33, 34, 5, 21] + [21] * (m - 5)
    assert offsets.tolist() == [0, T, T, 2 * T, 0] + [0] * (m - 5)
    table = device_ints(rows.bufs.row_tables, 3 * T).reshape(3, T)
    for i, pages in enumerate((a, b, c)):
        assert table[i, :len(pages)].tolist() == pages and (table[i, len(pages):] == UNMAPPED).all()


def test_a_verify_reads_the_loaded_table(nqfile, monkeypatch):  # noqa: F811
    s = session(nqfile, monkeypatch)
    rows = s.rows
    at(s.kv.page_table.ptr, 4 * rows.table_len).view(np.int32)[:] = np.arange(rows.table_len) + 5
    rows.run([1, 2, 3], [7, 8, 9])
    m = rows.bucket(3)
    assert device_ints(rows.bufs.rows_in, 3 * rows.m)[rows.m + m:rows.m + 2 * m].tolist() == [0] * m
    assert device_ints(rows.bufs.row_tables, rows.table_len).tolist() == list(range(5, 5 + rows.table_len))


def test_each_bucket_is_timed_over_its_own_inputs(nqfile, monkeypatch):  # noqa: F811
    """``measure`` runs every bucket's graph over inputs laid out for that bucket (the table offsets' place in
    rows_in depends on m, and a bucket replayed over the largest one's inputs read positions as offsets:
    the H200's first run, an illegal address at session start) and keeps the best wall time of a run."""
    s = session(nqfile, monkeypatch)
    rows, seen = s.rows, []

    class Graph:
        def __init__(self, m):
            self.m = m

        def launch(self, stream):
            m, got = self.m, device_ints(rows.bufs.rows_in, 3 * rows.m)
            seen.append((m, got[rows.m:rows.m + m].tolist(), got[rows.m + m:rows.m + 2 * m].tolist()))
    rows.run([0] * rows.m, list(range(rows.m)))   # the warm-up's last run: the largest bucket's layout
    rows.graphs = {m: Graph(m) for m in rows.buckets}
    clock = iter(range(1000))   # each call 1 s later: every run spans 1 s
    monkeypatch.setattr(rowstep.time, "perf_counter", lambda: float(next(clock)))
    rows.measure(reps=2)
    assert sorted({m for m, _p, _o in seen}) == rows.buckets and len(seen) == 2 * len(rows.buckets)
    for m, positions, offsets in seen:
        assert positions == list(range(m)) and offsets == [0] * m, m
    assert rows.ms == {m: 1e3 for m in rows.buckets}


def test_a_step_fed_forward_reads_its_argmaxes_and_the_next_positions(nqfile, monkeypatch):  # noqa: F811
    """``feed_forward``: the same rows again, each fed on the device the argmax the last step left in
    tokens_out (padding rows included), at the positions given (the last repeated into the padding), with
    the table offsets and page-table rows of the last step untouched."""
    s = session(nqfile, monkeypatch)
    rows, T = s.rows, s.rows.table_len
    a, b, c = [3, 9], [4, 1, 7], [12]
    rows.run([10, 11, 12], [20, 33, 5], [a, b, c])
    m = rows.bucket(3)
    argmax = np.arange(100, 100 + m, dtype=np.int32)
    at(rows.bufs.tokens_out.ptr, 4 * m).view(np.int32)[:] = argmax   # what the step's lm_head wrote
    tables = device_ints(rows.bufs.row_tables, 3 * T).copy()
    rows.feed_forward([21, 34, 6])
    got = device_ints(rows.bufs.rows_in, 3 * rows.m)
    assert got[:m].tolist() == argmax.tolist()
    assert got[rows.m:rows.m + m].tolist() == [21, 34, 6] + [6] * (m - 3)
    assert got[rows.m + m:rows.m + 2 * m].tolist() == [0, T, 2 * T] + [2 * T] * (m - 3)
    assert (device_ints(rows.bufs.row_tables, 3 * T) == tables).all()
    assert rows.collect(3) == argmax[:3].tolist()   # the fed-forward step's argmaxes, copied out after it
