"""Short prefill chunks as captured CUDA graphs (issue 21): an editor's re-request prefills a tail of a
few dozen tokens, whose ~250 kernel launches cost the host more than the GPU's work on them. One graph
per chunk-size bucket of config ``prefill.graph_buckets`` (those the Prefiller can use: runtime/prefill.py
usable_buckets) holds the whole chunk, every layer, over the Prefiller's buffers; a chunk of n rows
replays the smallest bucket b >= n.

What a graph cannot bake in comes from one device buffer, ``graph_in`` = int32 [p0, n, token ids padded
to b]: rope_append, the split-KV attention and its combine are their ``device_chunk`` variants (p0 and n
read from it, rows past n skipped: nothing is written at a position the chunk does not own); embed,
the norms and the small-M GEMMs compute all b rows (rows past n are scratch no kept row reads: every
kernel computes a row from that row alone). The attention always runs split over every key block
(MAX_KV_SPLITS CTAs per q tile and head, each walking its blocks), whose folded result is the unsplit
kernel's by construction, so a replay gives the bits of the chunk launched kernel by kernel.

The host enqueues per chunk one copy of its inputs from a pinned slot of its own (the copies run in
stream order, so each call stages every chunk first and the next call waits for the last copy before
rewriting the slots) and one graph launch."""

from __future__ import annotations

import numpy as np

from . import driver
from .driver import check, cu
from .state import wait


def graph_input_bytes(rows: int) -> int:
    """``graph_in`` for buckets of up to ``rows`` rows: p0, n, then the token ids (int32)."""
    return 4 * (2 + rows)


class ChunkGraphs:
    """``prefiller``: the runtime.prefill.Prefiller whose kernels, buffers (``graph_in`` among them) and
    launch plan the graphs capture; ``buckets``: rising row counts, each within its small-M chunks."""

    def __init__(self, prefiller, buckets):
        self.pre, self.buckets = prefiller, list(buckets)
        self.gin = prefiller.bufs.graph_in.ptr
        self.slot_ints = 2 + self.buckets[-1]
        self.sequences = {b: self._sequence(b) for b in self.buckets}
        self.graphs: dict[int, driver.Graph] = {}
        self.host, self.slots, self.next = None, [], 0
        self.copied = driver.Event()   # after the latest input copy: the slots may be rewritten once it passed
        self.pending = False

    def _sequence(self, b: int) -> list:
        """[(role, shape, args)] of a chunk of b rows whose p0, n and ids are read from graph_in."""
        seq = []
        self.pre._chunk(lambda role, *shape, **args: seq.append((role, shape, args)), b, self.gin + 8,
                        {"chunk": self.gin})
        return seq

    @property
    def captured(self) -> bool:
        return len(self.graphs) == len(self.buckets)

    def bucket(self, n: int) -> int:
        """The smallest bucket holding n rows."""
        if not 1 <= n <= self.buckets[-1]:
            raise ValueError(f"a chunk graph takes 1..{self.buckets[-1]} rows, got {n}")
        return next(b for b in self.buckets if b >= n)

    def stage(self, chunks: list[tuple[int, list[int]]]) -> None:
        """Write the inputs of this call's replayed chunks ((p0, token ids) each, in launch order) into
        pinned slots; ``run`` then copies and replays them one by one."""
        if self.pending:   # the previous call's copies have read their slots
            wait(self.copied, "prefill chunk graph inputs")
        if len(chunks) > len(self.slots):
            if self.host is not None:
                self.host.free()
            self.host = driver.HostBuffer(4 * self.slot_ints * len(chunks))
            self.slots = list(self.host.array(np.int32).reshape(len(chunks), self.slot_ints))
        for slot, (c0, ids) in zip(self.slots, chunks):
            n = len(ids)
            self.bucket(n)   # 1..the largest bucket
            slot[0], slot[1] = c0, n
            slot[2:2 + n] = ids
            slot[2 + n:] = ids[-1]   # padded rows embed a valid id (their rows are scratch)
        self.next = 0

    def run(self, c0: int, n: int, b: int | None = None) -> None:
        """Copy the next staged chunk's inputs into graph_in and replay bucket ``b`` (default: the
        smallest holding n rows; before capture: its kernels one by one)."""
        slot = self.slots[self.next]
        if (int(slot[0]), int(slot[1])) != (c0, n):
            raise ValueError(f"chunk graph: chunk ({c0}, {n}) was not the next one staged")
        b, stream = b or self.bucket(n), self.pre.shared.stream
        src = self.host.ptr + 4 * self.slot_ints * self.next
        check(cu.cuMemcpyHtoDAsync(self.gin, src, 4 * (2 + b), stream.handle), "prefill chunk graph inputs")
        self.copied.record(stream)
        self.pending, self.next = True, self.next + 1
        if b in self.graphs:
            self.graphs[b].launch(stream)
        else:
            for role, shape, args in self.sequences[b]:
                self.pre._launch(role, *shape, **args)

    def warm(self) -> None:
        """Each bucket once, kernel by kernel, as a chunk of one token (id 0) at position 0 of the loaded
        page table: modules loaded and lazy work done before the capture."""
        for b in self.buckets:
            self.stage([(0, [0])])
            self.run(0, 1, b)

    def capture(self) -> None:
        """One graph per bucket; call after ``warm``."""
        for b in self.buckets:
            if b not in self.graphs:
                with driver.capture(self.pre.shared.stream) as g:
                    for role, shape, args in self.sequences[b]:
                        self.pre._launch(role, *shape, **args)
                self.graphs[b] = g

    def close(self) -> None:
        self.pre.shared.drain()
        for g in self.graphs.values():
            g.close()
        self.graphs = {}
        if self.host is not None:
            self.host.free()
        self.copied.close()
