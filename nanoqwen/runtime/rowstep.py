"""The multi-row decode step (DESIGN.md section 12): m rows, each a token of its own at its own position,
through the decode step's kernels in their m-row variants (each weight read once for all rows, every row
computed with exactly the single-row arithmetic, so a row's K/V, logits and argmax are bitwise what a
decode step of that token alone gives). It serves the speculative verify: the last accepted token and k
drafts at positions p..p+k of the loaded sequence are k + 1 rows of one step.

One captured CUDA graph per bucket of config ``multirow.buckets`` above 1, each over the same buffers
(sized for the largest bucket): a step of n rows replays the smallest bucket m >= n. Its inputs (tokens,
positions) are copied from pinned memory into one device buffer before the replay; its outputs, the m
argmaxes (and, when asked, the real rows' fp32 logits, which the lm_head always writes), come back through
pinned memory after it, and the host waits once, on that copy. Rows past n
repeat the last real row (same token, same position): they write the same bits into the same cache slot,
so padding needs no masking in any kernel and never touches a position the request does not own.
Row r attends to positions <= positions[r]: the K/V of the rows before it were appended by this step's
rope_append before any attention ran, which is what causal verification needs. The device decode state
(state[0..2]) is not advanced; the caller decides what is accepted.

Rows of several sequences (continuous batching, DESIGN.md section 13): each row reads its own page-table
row, ``row_tables + offsets[r]`` (the kernels' ``positions[m + r]``). ``run`` without tables copies the KV
cache's loaded table into row 0 on the device (every row of the verify reads it); with tables, each
distinct page list is uploaded into a row of its own. runtime/batchstep.py schedules the server's
sequences over this step."""

from __future__ import annotations

import time

import numpy as np

from . import driver
from .decoder import add_layer, buffer_bytes as step_buffer_bytes
from .driver import check, cu
from .memory import Buffers
from .paged_kv import UNMAPPED, KVCacheError
from .state import wait


def buffer_bytes(dims, specs: dict, table_len: int) -> dict[str, int]:
    """Device buffers of the largest bucket (``specs``: its roles, as ``decoder.step_specs(m=...)``) over a
    KV cache whose page table has ``table_len`` entries."""
    m = specs["attention_decode"].m
    return step_buffer_bytes(dims, specs, m) | {"rows_in": 12 * m, "tokens_out": 4 * m, "argmax_done": 4,
                                                "row_tables": 4 * m * table_len, "logits": 4 * m * dims.vocab}


class RowStep:
    """``kernels``: bucket m -> {role: (spec, Function)} of ``decoder.step_specs(m=...)``; ``bufs`` the
    ``buffer_bytes`` table of the largest bucket (allocated here by default)."""

    def __init__(self, shared, kernels: dict[int, dict], pdl: bool = True, bufs: Buffers | None = None):
        self.shared, self.kernels, self.pdl = shared, kernels, pdl
        self.buckets = sorted(kernels)
        self.m = m = self.buckets[-1]
        self.table_len = shared.kv.layout.table_len
        self.bufs = bufs or Buffers(buffer_bytes(shared.dims, {r: s for r, (s, _f) in kernels[m].items()},
                                                 self.table_len))
        self.bufs.argmax_done.memset_u32(0, shared.stream)   # the lm_head wraps it back to 0 after each launch
        self.host_in = driver.HostBuffer(12 * m)     # tokens [m] | positions [n] | table offsets [n] | ...
        self.host_out = driver.HostBuffer(4 * m)     # argmax per row
        self.host_logits = driver.HostBuffer(4 * m * shared.dims.vocab)   # the rows' logits, when asked
        self.host_tables = driver.HostBuffer(4 * m * self.table_len)   # the rows' sequences' page tables
        self.host_next = driver.HostBuffer(4 * m)    # positions of a step fed forward on the device
        self.rows_in, self.rows_out = self.host_in.array(np.int32), self.host_out.array(np.int32)
        self.tables = self.host_tables.array(np.int32).reshape(m, self.table_len)
        self.sequences = {b: self._sequence(b) for b in self.buckets}
        self.graphs: dict[int, driver.Graph] = {}
        self.ms: dict[int, float] = {}   # bucket -> a verify's wall time in ms (``measure``)
        self.done = driver.Event()

    def _sequence(self, m: int) -> list:
        """[(role, Function, Launch, args)] of the m-row step over the shared buffers."""
        sh, b, d = self.shared, self.bufs, self.shared.dims
        W, kv, st = sh.weights.ptr, sh.kv, sh.bufs
        seq = []

        def add(role, launch=None, **args):
            spec, fn = self.kernels[m][role]
            seq.append((role, fn, launch or spec.launch(), args))

        positions = b.rows_in.ptr + 4 * self.m
        embed_spec = self.kernels[m]["embed"][0]
        add("embed", embed_spec.launch(m), tokens=b.rows_in, embed=W("embed"), h=b.h, err=st.err, n=m)
        for i in range(d.layers):
            add_layer(add, i, W, kv, st, b, where={"positions": positions, "page_table": b.row_tables},
                      roles=self.kernels[m].keys(), m=m)
        add("lm_head", h=b.h, norm_w=W("final_norm"), lm_head=W("lm_head"), logits=b.logits, tokens_out=b.tokens_out,
            tokens_cap=m, partials=b.partials, argmax_done=b.argmax_done, err=st.err)
        return seq

    def bucket(self, n: int) -> int:
        """The smallest bucket holding n rows."""
        if not 1 <= n <= self.m:
            raise ValueError(f"a multi-row step takes 1..{self.m} rows, got {n}")
        return next(b for b in self.buckets if b >= n)

    def _launch(self, m: int) -> None:
        stream = self.shared.stream
        if m in self.graphs:
            self.graphs[m].launch(stream)
        else:
            for _role, fn, launch, args in self.sequences[m]:
                fn.launch(launch, stream, self.pdl, **args)

    def capture(self) -> None:
        """One graph per bucket; call after each bucket ran once eagerly (modules loaded, lazy work done)."""
        for m in self.buckets:
            if m not in self.graphs:
                with driver.capture(self.shared.stream) as g:
                    self._launch(m)
                self.graphs[m] = g

    def measure(self, reps: int = 3) -> None:
        """Each bucket's step as a verify pays for it, host included: the wall time of ``run`` (inputs up,
        the graph, the argmaxes back and waited for), the best of ``reps``, over the warm-up's inputs (m rows
        at positions 0..m-1 of the loaded page table). A small model's host part is 1.5-3x its graph
        (docs/perf-notes.md), and a speculative request weighs its draft length by these times against
        the decode step's, which runs ahead of the host. The step's cost is far from linear in its rows
        (m = 16 costs more than two m = 8 on the H200), so runtime/batchstep.py splits rows by them too."""
        for m in self.graphs:
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                self.run([0] * m, list(range(m)))
                best = min(best, time.perf_counter() - t0)
            self.ms[m] = 1e3 * best

    def run(self, tokens: list[int], positions: list[int], tables: list | None = None,
            logits: bool = False) -> list[int]:
        """The argmax after each row (``tokens[r]`` at ``positions[r]``, K/V appended there); waits for them.
        ``tables[r]``: row r's sequence's page list (rows of one sequence pass the same list); None: every
        row is of the sequence the KV cache's table holds (the verify). ``logits``: also copy the rows' fp32
        logits out (``logits()`` reads them)."""
        self._replay(self.load(tokens, positions, tables), len(tokens), logits)
        return self.collect(len(tokens))

    def feed_forward(self, positions: list[int]) -> None:
        """Launch the step after the last one, without waiting: the same rows (same bucket, same page-table
        rows), each fed on the device the argmax it got there (a greedy row's next token; a padding row's
        is its last real row's, whose bits it repeats) at ``positions`` (each one past the last step's).
        ``collect`` waits for its argmaxes."""
        n, s = len(positions), self.shared.stream.handle
        m = self.bucket(n)
        nxt = self.host_next.array(np.int32)
        nxt[:m] = list(positions) + [positions[-1]] * (m - n)
        check(cu.cuMemcpyDtoDAsync(self.bufs.rows_in.ptr, self.bufs.tokens_out.ptr, 4 * m, s), "rows fed forward")
        check(cu.cuMemcpyHtoDAsync(self.bufs.rows_in.ptr + 4 * self.m, self.host_next.ptr, 4 * m, s),
              "positions fed forward")
        self._replay(m, n, False)

    def _replay(self, m: int, n: int, logits: bool) -> None:
        """Bucket m's step over the inputs on the device, then its outputs copied out."""
        self._launch(m)
        self._copy_out(m, n, logits)

    def _copy_out(self, m: int, n: int, logits: bool) -> None:
        """The bucket's m argmaxes (and the n real rows' logits) copied out; ``done`` marks the end."""
        s = self.shared.stream.handle
        check(cu.cuMemcpyDtoHAsync(self.host_out.ptr, self.bufs.tokens_out.ptr, 4 * m, s), "multi-row argmax")
        if logits:
            check(cu.cuMemcpyDtoHAsync(self.host_logits.ptr, self.bufs.logits.ptr, 4 * n * self.shared.dims.vocab,
                                       s), "multi-row logits")
        self.done.record(self.shared.stream)

    def collect(self, n: int) -> list[int]:
        """The first n argmaxes of the last step launched, once it is done."""
        wait(self.done, f"multi-row step of {n} rows")
        return self.rows_out[:n].tolist()

    def head(self, h: int, n: int) -> tuple[list[int], np.ndarray]:
        """(argmax, fp32 logits) of n fp32 residual rows at device address ``h`` (a prefill chunk's final rows)
        through this step's lm_head, each row bitwise the single-row head's (its row invariance): the rows
        are copied into the step's own rows (the last repeated into the bucket's padding), then its lm_head
        kernel runs alone; waits for them."""
        m, s, row = self.bucket(n), self.shared.stream.handle, 4 * self.shared.dims.hidden
        check(cu.cuMemcpyDtoDAsync(self.bufs.h.ptr, h, n * row, s), "head rows")
        for r in range(n, m):
            check(cu.cuMemcpyDtoDAsync(self.bufs.h.ptr + r * row, h + (n - 1) * row, row, s), "head padding")
        role, fn, launch, args = self.sequences[m][-1]
        assert role == "lm_head", role
        fn.launch(launch, self.shared.stream, self.pdl, **args)
        self._copy_out(m, n, True)
        return self.collect(n), self.logits(n)

    def logits(self, n: int) -> np.ndarray:
        """A copy of the first n rows' logits of the last ``run(..., logits=True)``."""
        return self.host_logits.array(np.float32)[:n * self.shared.dims.vocab].reshape(n, -1).copy()

    def load(self, tokens: list[int], positions: list[int], tables: list | None = None) -> int:
        """Copy a step's inputs to the device, on the stream (``run``'s arguments); returns its bucket."""
        n = len(tokens)
        m, s = self.bucket(n), self.shared.stream.handle
        pad = m - n
        # for the bucket-m kernels, positions[i] is rows_in[self.m + i]: positions [m], table offsets [m]
        self.rows_in[:m] = list(tokens) + [tokens[-1]] * pad
        self.rows_in[self.m:self.m + m] = list(positions) + [positions[-1]] * pad
        offsets = self.rows_in[self.m + m:self.m + 2 * m]
        if tables is None:
            offsets[:] = 0
            check(cu.cuMemcpyDtoDAsync(self.bufs.row_tables.ptr, self.shared.kv.page_table.ptr, 4 * self.table_len,
                                       s), "multi-row page table")
        else:
            offsets[:] = self._tables(tables + [tables[-1]] * pad)
            rows = int(offsets.max()) // self.table_len + 1
            check(cu.cuMemcpyHtoDAsync(self.bufs.row_tables.ptr, self.host_tables.ptr, 4 * rows * self.table_len, s),
                  "multi-row page tables")
        check(cu.cuMemcpyHtoDAsync(self.bufs.rows_in.ptr, self.host_in.ptr, 12 * self.m, s), "multi-row inputs")
        return m

    def _tables(self, tables: list) -> list[int]:
        """Each distinct page list into a row of the host tables (unmapped entries -1, which a kernel reading
        one faults on); the offset of each row's table in entries."""
        seen: dict[int, int] = {}
        for pages in tables:
            if id(pages) not in seen:
                i = len(seen)
                if len(pages) > self.table_len:
                    raise KVCacheError(f"multi-row step: {len(pages)} pages exceed the table of {self.table_len}")
                self.tables[i] = UNMAPPED
                self.tables[i, :len(pages)] = pages
                seen[id(pages)] = i * self.table_len
        return [seen[id(pages)] for pages in tables]

    def close(self) -> None:
        self.shared.drain()
        for g in self.graphs.values():
            g.close()
        self.bufs.free()
        for buf in (self.host_in, self.host_out, self.host_logits, self.host_tables, self.host_next):
            buf.free()
        self.done.close()
