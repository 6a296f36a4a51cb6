"""The engine thread's loop (DESIGN.md section 13): several requests at once over the engine's
multi-sequence step (runtime/batch.py).

At each step boundary the scheduler retires the sequences whose client left, admits waiting requests
(FIFO) while fewer than ``max_running`` run, and runs one step over the running sequences: one row per
decoding sequence (1 + k rows for a verify of k drafts), then prompt chunks of the admitted ones in
admission order, filling the step up to ``step_tokens`` rows (at least one prompt token per step, so
admission always progresses). ``step_tokens`` therefore bounds a running stream's inter-token latency
while prompts are read. Each sequence's tokens are chosen by its own sampler and drafter (per request:
temperature, top_p, seed, penalties, grammar), and each step row is computed as a decode step alone
computes it, so a greedy stream is bitwise what it gets alone.

A sequence whose pages the pool cannot give now (they are held by running sequences) waits at the head
of the queue until one ends; the others run on. A request error (ContextError: a grammar that fails)
ends its own sequence with a 400; a fault of the step ends every running sequence with a 500 (and, on a
GPU engine, the worker: ``Worker.fault``).

An engine without ``batch`` runs one request at a time through its ``generate``."""

from __future__ import annotations

import time

from ..runtime.batch import Decoding, PagesShort, step_rows
from ..runtime.generate import ContextError
from .text import TextStream
from .jobs import Done, PromptLogprobs, Token, top_logprobs


class Reply:
    """One request's output side: its text stream (detokenization, stop strings, llama-server's cut-offs),
    its Token and Done events and its share of the metrics. ``push`` takes each generated token and says
    when the request has ended."""

    def __init__(self, job, tokenizer, stop_ids: frozenset[int], metrics):
        self.job, self.tokenizer, self.stop_ids, self.metrics = job, tokenizer, stop_ids, metrics
        self.stream = TextStream(tokenizer, job.stops)
        self.n, self.finish, self.cut, self.cached = 0, "length", False, 0
        self.t0 = time.perf_counter()
        self.t_first = self.t_prev = None
        # echo's prompt logprobs, filled by ``score``: the first token has none
        self.scored = [(tokenizer.decode(job.prompt[:1]), None, None)] if job.prompt_logprobs is not None else None

    def score(self, start: int, logits) -> None:
        """Echo's prompt logprobs: ``logits`` are the rows of positions start, start + 1, ...; row i scores
        the prompt token after it. Once every prompt token is scored they go to the client (before any
        generated token: the last prompt row's token is the first generated one)."""
        prompt = self.job.prompt
        for i, row in enumerate(logits[:len(prompt) - 1 - start]):
            self.scored.append(top_logprobs(self.tokenizer, row, prompt[start + 1 + i], self.job.prompt_logprobs))
        if len(self.scored) == len(prompt):
            self.job.emit(PromptLogprobs(self.scored))

    def push(self, tok: int, logits) -> bool:
        job, m, now = self.job, self.metrics, time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            m.ttft.observe(now - job.received)
        else:
            m.itl.observe(now - self.t_prev)
        self.t_prev = now
        if job.max_tokens == 0:   # prefill only: the one token an engine makes is never fed back,
            return True           # so the sequence it keeps for reuse is exactly the prompt
        self.n += 1
        if job.cancelled.is_set():
            self.finish = "cancelled"
            return True
        if tok in self.stop_ids:
            self.finish = "stop"
            return True
        text = self.stream.push(tok)
        if job.cutoff is not None:
            text, self.cut = job.cutoff.push(text, now - self.t_first)
        job.emit(Token(text, tok, top_logprobs(self.tokenizer, logits, tok, job.top_logprobs)
                       if job.top_logprobs is not None else None))
        if self.stream.stopped is not None:
            self.finish = "stop"
            return True
        return self.cut   # llama-server's stop_type "limit"

    def done(self, drafted: int | None, accepted: int) -> None:
        m, job, t0 = self.metrics, self.job, self.t0
        if self.finish == "cancelled":
            m.cancelled.inc()
        m.prompt_tokens.inc(len(job.prompt))
        m.generation_tokens.inc(self.n)
        m.cached_tokens.inc(self.cached)
        m.draft_tokens.inc(drafted or 0)
        m.accepted_tokens.inc(accepted)
        t_first, t_prev = self.t_first or t0, self.t_prev or t0
        job.emit(Done(self.finish, "" if self.cut else self.stream.flush(), self.n, self.cached,
                      self.stream.stopped, t_first - t0, t_prev - t_first, drafted, accepted))


class Running:
    """A running request: its reply and its sequence's generation."""

    def __init__(self, reply: Reply, decoding: Decoding):
        self.reply, self.decoding = reply, decoding


class Scheduler:
    def __init__(self, worker, step_tokens: int):
        self.worker, self.step_tokens = worker, step_tokens
        self.engine, self.batch = worker.engine, getattr(worker.engine, "batch", None)
        self.running: list[Running] = []

    def run(self) -> None:
        """Forever, in the engine thread."""
        w = self.worker
        while True:
            if self.batch is None:
                self._alone(w.take(wait=True))
                continue
            try:
                self._admit()
                if self.running:
                    self._step()
            except Exception as e:  # noqa: BLE001 - a fault of the step (or of the host work around it)
                jobs = [r.reply.job for r in self.running]   # fails every running sequence
                for r in list(self.running):
                    self._drop(r)
                w.fault(e, jobs)

    # ---- one request at a time (an engine without the multi-sequence step) -------------------------------

    def _alone(self, job) -> None:
        w, engine = self.worker, self.engine
        reply, gen = self._reply(job), None
        w.set_running(1)
        try:
            gen = engine.generate(job.prompt, max(job.max_tokens, 1), job.sampling, logits=job.top_logprobs is not None)
            for item in gen:
                tok, logits = item if job.top_logprobs is not None else (item, None)
                if reply.t_first is None:
                    reply.cached = engine.cached_tokens
                    self._pages()   # the request's pages are taken
                if reply.push(tok, logits):
                    break
        except Exception as e:  # noqa: BLE001 - any fault fails this request; the thread serves on
            w.fault(e, [job])
            return
        finally:
            if gen is not None:
                gen.close()
            w.set_running(0)
            self._pages()   # before Done, as _retire
        reply.done(*((None, 0) if engine.speculate is None else (engine.drafted_tokens, engine.accepted_tokens)))

    def _reply(self, job) -> Reply:
        w = self.worker
        return Reply(job, w.tokenizer, w.stop_ids, w.metrics)

    # ---- several at once -----------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Retire the sequences whose client left; take waiting requests while rows are free (blocking while
        nothing runs and nothing waits)."""
        for r in [r for r in self.running if r.reply.job.cancelled.is_set()]:
            r.reply.finish = "cancelled"
            self._retire(r)
        w = self.worker
        while len(self.running) < w.max_running:
            job = w.take(wait=not self.running)
            if job is None:
                break
            seq = None
            try:   # the request was checked when it came in (serve/context.fit: one scan of its ids, not two)
                seq = self.batch.open(job.prompt, len(job.prompt) + max(job.max_tokens, 1) - 1)
                if job.prompt_logprobs is not None:   # every prompt row's logits are wanted: recompute a
                    seq.lease.reused = seq.pos = 0     # reused prefix (its K/V rows come out bitwise the same)
                    seq.prompt_logits = True
                logits = job.top_logprobs is not None or job.prompt_logprobs is not None
                decoding = Decoding(seq, job.prompt, max(job.max_tokens, 1), job.sampling, self.engine.speculate,
                                    logits, self.batch.max_rows, self.batch.costs)
            except PagesShort:
                w.put_back(job)   # waits at the head of the queue for a running sequence's pages
                break
            except Exception as e:  # noqa: BLE001 - a request error (a 400: its grammar cannot start, say) or a
                if seq is not None:   # fault (500) of this request only
                    self.batch.close(seq, [])
                w.fault(e, [job])
                continue
            reply = self._reply(job)
            reply.cached = seq.reused
            self.running.append(Running(reply, decoding))
        self._gauges()

    def _step(self) -> None:
        """One step over the running sequences: decode (and verify) rows first, then prompt chunks."""
        running = {r.decoding: r for r in self.running}
        work = [(running[d], rows) for d, rows in step_rows(list(running), self.step_tokens)]
        m = self.worker.metrics
        m.step_sequences.observe(len(work))
        m.step_rows.observe(sum(len(rows) for _, rows in work))
        starts = [r.decoding.seq.pos for r, _ in work]
        results = self.batch.step([(r.decoding.seq, rows) for r, rows in work])
        for (r, _), start, rows in zip(work, starts, results):
            if r.reply.job.prompt_logprobs is not None and start < len(r.decoding.prompt):
                r.reply.score(start, rows.logits)
            try:
                ended = any(r.reply.push(tok, row) for tok, row in r.decoding.advance(rows))
            except ContextError as e:   # a request error (its grammar failed): this sequence only
                self._drop(r)
                self.worker.fault(e, [r.reply.job])
                continue
            if ended or r.decoding.done:
                self._retire(r)

    def _retire(self, r: Running) -> None:
        d = r.decoding
        self.running.remove(r)
        self.batch.close(d.seq, d.prompt + d.gen)
        self._gauges()   # before Done: a client that reads /metrics after its answer sees its row gone
        r.reply.done(None if self.engine.speculate is None else d.spec.drafted, d.spec.accepted)

    def _drop(self, r: Running) -> None:
        """End a failed sequence keeping nothing (its K/V may be wrong)."""
        self.running.remove(r)
        self.batch.close(r.decoding.seq, [])
        self._gauges()

    def _gauges(self) -> None:
        self.worker.set_running(len(self.running))
        self._pages()

    def _pages(self) -> None:
        """The KV pages gauges, from the step or (one request at a time) the engine, when it tells."""
        pages = getattr(self.batch if self.batch is not None else self.engine, "pages", None)
        if pages is not None:
            running, kept, total = pages()
            kv = self.worker.metrics.kv_pages
            kv.labels("running").set(running)
            kv.labels("kept").set(kept)
            kv.labels("free").set(total - running - kept)
