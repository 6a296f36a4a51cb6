"""The CUDA engine's multi-sequence step (the contract of runtime/batch.py, DESIGN.md section 13): rows of
several sequences per step over the parts the Runner uses, each sequence on its own pages of the shared
pool (runtime/prefix_cache.py).

A step runs its items on the one stream, decode rows first:
- decode rows (positions past the sequence's prompt): two or more in all go through the multi-row step
  (runtime/rowstep.py) in runs of up to ``rows.m`` rows, each row reading its own sequence's page-table
  row; a step of one decode row runs the single-row decode step (the m = 1 kernels, which the multi-row
  rows equal bit for bit, and faster);
- prompt chunks: each through the Prefiller over its sequence's pages, as a request alone prefills (chunk
  invariance: the chunking changes no bit); the prompt's last chunk ends with the single-row lm_head at
  its last position, as alone.
Greedy rows take the device's argmax; logits are copied out only for sequences that asked for them.

The GPU does not wait for the host between greedy steps: when a step is one greedy decode row, the next
step of that sequence is launched before the host waits, fed on the device with this step's argmax (the
Runner's launch-ahead, one step deep); when a step is greedy decode rows of several sequences, one row
each and one multi-row run, the same run is launched again fed forward (``RowStep.feed_forward``: each row
its argmax, its position + 1). The next ``step`` that asks for exactly those rows (same sequences in the
same order, positions and tokens) takes the result; any other step leaves it: it wrote only the K/V of
positions the sequences have not yet kept, which a later step overwrites with the same bits or nobody
reads.

The kernels' sticky error flags are copied out after each step's work and read once it is done, so a
fault ends the step that saw it (or the next, for a launched-ahead step) with DecodeError."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import driver
from .batch import PagesShort, Rows, Sequence
from .driver import check, cu
from .state import wait


def split(n: int, buckets: list[int], ms: dict[int, float]) -> list[int]:
    """Run sizes for n rows: the cut of least total time by the buckets' measured replay times ``ms`` (a run
    of r rows costs its bucket's time); without times, runs of the largest bucket."""
    if not ms:
        return [min(buckets[-1], n - i) for i in range(0, n, buckets[-1])]
    best: list[tuple[float, list[int]]] = [(0.0, [])]
    for k in range(1, n + 1):
        best.append(min((ms[b] + best[max(k - b, 0)][0], best[max(k - b, 0)][1] + [min(b, k)]) for b in buckets))
    return sorted(best[n][1], reverse=True)


@dataclass
class Ahead:
    """A launched-ahead single-row step: ``seq``'s row at ``pos``, fed the argmax ``token`` of the step before."""
    seq: Sequence
    pos: int
    token: int
    resets: int   # the device state's resets when it was launched: any other reset voids it


@dataclass
class RowsAhead:
    """A multi-row run fed forward: one row of each of ``seqs``, fed the argmaxes ``tokens`` at
    ``positions``."""
    seqs: list[Sequence]
    tokens: list[int]
    positions: list[int]


class BatchStep:
    def __init__(self, runner):
        self.runner, self.shared, self.cache, self.rows = runner, runner.shared, runner.cache, runner.rows
        self.max_rows = self.rows.m if self.rows is not None else 1
        self.ahead: Ahead | None = None
        self.rows_ahead: RowsAhead | None = None
        self.host_err = driver.HostBuffer(4)
        self.done = driver.Event()

    @property
    def costs(self) -> dict[int, float] | None:
        """The runner's measured step times (rows -> ms), once the session has them."""
        return self.runner.costs

    # ---- the contract ------------------------------------------------------------------------------------

    def open(self, prompt: list[int], total: int) -> Sequence:
        if not self.cache.can_start(total):
            raise PagesShort(f"KV cache: {total} positions wait for pages held by running sequences")
        return Sequence(self.cache.start(prompt, total), None, len(prompt), total)

    def step(self, work: list) -> list[Rows]:
        out: list[Rows | None] = [None] * len(work)
        decode = []
        for i, (seq, tokens) in enumerate(work):
            if seq.pos >= seq.prompt:
                decode.append(i)
            elif seq.pos + len(tokens) > seq.prompt:
                raise ValueError(f"a step item spans the prompt's end ({seq.pos} + {len(tokens)} > {seq.prompt})")
        lone = len(decode) == len(work) == 1 and len(work[0][1]) == 1
        if self.ahead is not None and not lone:
            self.ahead = None   # (a lone row matching it is taken below)
        rows_ahead, self.rows_ahead = self.rows_ahead, None
        if lone:
            out[0] = self._lone(*work[0])
        elif sum(len(work[i][1]) for i in decode) == 1 or (decode and self.rows is None):
            for i in decode:
                out[i] = self._single(*work[i])
        elif decode:
            self._rows([(i, *work[i]) for i in decode], out, rows_ahead, fed_forward=len(decode) == len(work))
        for i, (seq, tokens) in enumerate(work):
            if out[i] is None:
                out[i] = self._prompt(seq, tokens)
        self._flags()
        if self.ahead is None and self.rows_ahead is None:   # else what was launched ahead runs on
            self.done.record(self.shared.stream)
            wait(self.done, "multi-sequence step")
        self._check()
        return out

    def close(self, seq: Sequence, tokens: list[int]) -> None:
        if self.ahead is not None and self.ahead.seq is seq:
            self.ahead = None
        if self.rows_ahead is not None and any(s is seq for s in self.rows_ahead.seqs):
            self.rows_ahead = None
        self.cache.keep(seq.lease, list(tokens[:seq.pos]))

    def pages(self) -> tuple[int, int, int]:
        return self.cache.usage()

    def free(self) -> None:
        self.host_err.free()
        self.done.close()

    # ---- the parts of a step -----------------------------------------------------------------------------

    def _load(self, seq: Sequence) -> None:
        """The KV cache's page table = the sequence's (the single-row step and the prefill read it)."""
        kv = self.shared.kv
        if kv.loaded is not seq.lease.pages:
            self.shared.drain()   # the pinned table may still feed the previous load's copy
            kv.load(seq.lease.pages, self.shared.stream)

    def _lone(self, seq: Sequence, tokens: list[int]) -> Rows:
        """One decode row alone in the step: take the launched-ahead step when it is this very row, else run
        it; then, for a greedy sequence, launch its next row ahead."""
        sh, pos, a = self.shared, seq.pos, self.ahead
        self.ahead = None
        if a is None or (a.seq, a.pos, a.token, a.resets) != (seq, pos, tokens[0], sh.resets):
            return self._single(seq, tokens, launch_ahead=True)
        self._launch_ahead(seq, pos)
        return self._collect(seq, pos)

    def _single(self, seq: Sequence, tokens: list[int], launch_ahead: bool = False) -> Rows:
        """One decode row through the single-row step (the device state reset to its token and position)."""
        pos, dec = seq.pos, self.runner.decoder
        self._load(seq)
        dec.reset(tokens[0], pos, pos)
        dec.step(pos, read_token=True, read_logits=seq.logits)
        if launch_ahead:
            self._launch_ahead(seq, pos)
        return self._collect(seq, pos)

    def _launch_ahead(self, seq: Sequence, pos: int) -> None:
        """Launch the row after ``pos`` fed on the device, where it may come next: a greedy sequence that may
        still occupy that position."""
        nxt = pos + 1
        if not seq.logits and nxt < seq.total:
            self.runner.decoder.step(nxt, read_token=True)
            self.ahead = Ahead(seq, nxt, -1, self.shared.resets)

    def _collect(self, seq: Sequence, pos: int) -> Rows:
        """Row ``pos``'s token (and logits, if asked) once its step is done; advances the sequence."""
        sh = self.shared
        sh.wait_step(pos)
        tok = int(sh.tok_out[pos])
        if self.ahead is not None and self.ahead.seq is seq:
            self.ahead.token = tok   # the launched-ahead row was fed this argmax
        seq.pos = pos + 1
        return Rows([tok], sh.logits()[None] if seq.logits else None)

    def _rows(self, items: list, out: list, ahead: RowsAhead | None, fed_forward: bool) -> None:
        """Decode rows of several sequences, in order, cut into multi-row runs of the sizes ``split`` says (a
        sequence's rows may span two runs: the later run reads the K/V the earlier one appended, the same
        bits); ``out[i]`` gets item i's Rows. ``ahead``: the run fed forward after the last step, taken when
        these are its rows; ``fed_forward``: the step holds nothing else, so greedy rows of one run may be
        fed forward again."""
        seqs = [s for _i, s, toks in items for _ in toks]
        tokens = [t for _i, _s, toks in items for t in toks]
        positions = [s.pos + j for _i, s, toks in items for j in range(len(toks))]
        runs = split(len(tokens), self.rows.buckets, self.rows.ms)
        one_each = len(seqs) == len(items) and len(runs) == 1
        if (ahead is not None and one_each and len(ahead.seqs) == len(seqs) and ahead.tokens == tokens
                and ahead.positions == positions and all(a is s for a, s in zip(ahead.seqs, seqs))):
            argmax, logits = self.rows.collect(len(seqs)), [None] * len(seqs)
        else:
            argmax, logits, at = [], [], 0
            for n in runs:
                want = any(s.logits for s in seqs[at:at + n])
                argmax += self.rows.run(tokens[at:at + n], positions[at:at + n],
                                        [s.lease.pages for s in seqs[at:at + n]], logits=want)
                logits += list(self.rows.logits(n)) if want else [None] * n
                at += n
        if fed_forward and one_each and not any(s.logits or p + 1 >= s.total for s, p in zip(seqs, positions)):
            nxt = [p + 1 for p in positions]
            self.rows.feed_forward(nxt)
            self.rows_ahead = RowsAhead(seqs, argmax, nxt)
        at = 0
        for i, seq, toks in items:
            n = len(toks)
            out[i] = Rows(argmax[at:at + n], np.stack(logits[at:at + n]) if seq.logits else None)
            seq.pos += n
            at += n

    def _prompt(self, seq: Sequence, tokens: list[int]) -> Rows:
        """A prompt chunk at the sequence's position; the prompt's last chunk gives its last row's token."""
        run, p0 = self.runner, seq.pos
        p1 = p0 + len(tokens)
        last = p1 == seq.prompt
        self._load(seq)
        if seq.prompt_logits:
            return self._scored(seq, tokens)
        if last or run.prefiller is None:
            run.prefill(tokens, p0, read_token=last, read_logits=last and seq.logits)
        else:
            run.prefiller(tokens, p0)
        if not last:
            seq.pos = p1
            return Rows([])
        return self._collect(seq, p1 - 1)

    def _scored(self, seq: Sequence, tokens: list[int]) -> Rows:
        """A prompt chunk with every row's logits (echo): prefilled in pieces the prefill's buffers hold,
        each piece's final rows through the multi-row lm_head (the last row's bits are the single-row
        head's, which a request alone chooses its first token by)."""
        pre, step, row = self.runner.prefiller, self.rows.m, 4 * self.shared.dims.hidden
        argmax, logits = [], []
        for c0 in range(0, len(tokens), pre.chunk_tokens):
            piece = tokens[c0:c0 + pre.chunk_tokens]
            h0 = pre(piece, seq.pos) - (len(piece) - 1) * row   # the piece's rows, from its first
            for r0 in range(0, len(piece), step):
                a, z = self.rows.head(h0 + r0 * row, min(step, len(piece) - r0))
                argmax += a
                logits.append(z)
            seq.pos += len(piece)
        return Rows(argmax, np.concatenate(logits))

    # ---- the sticky error flags ----------------------------------------------------------------------------

    def _flags(self) -> None:
        sh = self.shared
        check(cu.cuMemcpyDtoHAsync(self.host_err.ptr, sh.bufs.err.ptr, 4, sh.stream.handle), "error flags")

    def _check(self) -> None:
        if self.host_err.array(np.uint32)[0]:
            self.ahead = None
            self.shared.check_errors()   # drains, raises DecodeError naming the flags, clears them
