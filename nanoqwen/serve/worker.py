"""The one engine thread. It loads the model (the CUDA context then belongs to it), takes requests in FIFO
order from a queue of at most ``max_queue`` waiting ones, runs each through ``engine.generate`` and hands
the client's text back to the event loop, token by token, through an asyncio queue. Detokenization and
stop matching run here, between steps, so a stop ends the generation at the token that completes it.

A request error of the engine (ContextError) fails that request with 400. Any other exception is a fault:
it fails the request with 500, and on a GPU engine it also marks the worker failed (/health 503, later
requests refused) rather than risk serving text from a corrupted device state."""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from ..runtime.generate import ContextError
from ..runtime.sampler import Sampling
from .errors import APIError
from .prompts import stop_ids
from .text import TextStream


@dataclass
class Token:
    text: str                  # new client-visible text (may be empty: held back or mid-character)
    token_id: int
    logprobs: tuple | None     # (token text, logprob, [(text, logprob), ...top k]) when asked for


@dataclass
class Done:
    finish_reason: str         # "stop", "length" or "cancelled"
    text: str                  # the tail still held back when generation ended
    completion_tokens: int     # tokens the engine generated, a stop token included
    cached_tokens: int
    stop_word: str | None
    prompt_s: float            # generation start -> first token
    decode_s: float            # first token -> last token
    drafted_tokens: int | None = None   # speculative decoding's draft tokens (None: the engine does not draft)
    accepted_tokens: int = 0            # ... and those the model accepted


@dataclass
class Failed:
    error: APIError


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stops: list[str] = field(default_factory=list)
    top_logprobs: int | None = None   # None: no logits needed
    cutoff: object | None = None      # serve/cutoffs.py: push(text, seconds since the first token) -> (text, stop)
    received: float = field(default_factory=time.perf_counter)   # TTFT is measured from here

    def __post_init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def draft_counts(engine) -> tuple[int | None, int]:
    """(drafted, accepted) of the engine's most recent request; (None, 0) when it does not speculate."""
    if engine.speculate is None:
        return None, 0
    return engine.drafted_tokens, engine.accepted_tokens


def top_logprobs(tokenizer, logits: np.ndarray, token: int, k: int) -> tuple:
    """(token text, its logprob, the k most likely (text, logprob) most likely first), from raw logits."""
    z = logits.astype(np.float64)
    lp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    k = min(k, lp.size)
    top = np.argpartition(-lp, k - 1)[:k] if k else np.empty(0, np.int64)
    top = top[np.argsort(-lp[top], kind="stable")]
    return (tokenizer.decode([token]), float(lp[token]), [(tokenizer.decode([int(i)]), float(lp[i])) for i in top])


class Worker:
    def __init__(self, load, metrics, max_queue: int, log=None, on_load_error=None):
        """``load()`` -> (engine, tokenizer), called in the engine thread; ``on_load_error(message)`` is
        told when it raises (the CLI then stops the server)."""
        self.metrics, self.max_queue = metrics, max_queue
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_load_error = on_load_error
        self.state, self.error = "loading", None
        self.engine = self.tokenizer = None
        self.stop_ids: frozenset[int] = frozenset()
        self.fatal_faults = True
        self._queue: collections.deque[Job] = collections.deque()
        self._busy = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(load,), name="nanoqwen-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def unavailable(self) -> APIError | None:
        if self.state == "loading":
            return APIError("the model is loading", status=503, code="loading", headers={"Retry-After": "5"})
        if self.state == "failed":
            return APIError(f"the engine failed and serves no more requests: {self.error}", status=503,
                            code="engine_failed")
        return None

    def submit(self, job: Job) -> None:
        with self._cv:
            if err := self.unavailable():
                raise err
            if len(self._queue) + self._busy > self.max_queue:
                raise APIError(f"the queue is full ({self.max_queue} requests waiting; batch 1: one request runs "
                               f"at a time)", status=503, code="queue_full", headers={"Retry-After": "1"})
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client left: drop the job if it still waits, else stop it at its next token."""
        job.cancelled.set()
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_depth.set(len(self._queue))
                self.metrics.cancelled.inc()

    def _run(self, load) -> None:
        try:
            self.engine, self.tokenizer = load()
            self.stop_ids = stop_ids(self.tokenizer)
        except BaseException as e:  # noqa: BLE001 - reported on /health, and to whoever started the worker
            self.state, self.error = "failed", f"loading failed: {e}"
            if self.on_load_error:
                self.on_load_error(str(e))
            return
        from ..backends import ReferenceEngine
        self.fatal_faults = not isinstance(self.engine, ReferenceEngine)  # device state may be corrupt
        self.state = "ready"
        self.log(f"ready: {self.engine.name}, context {self.engine.context} tokens")
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
                self._busy = True
                self.metrics.queue_depth.set(len(self._queue))
            try:
                if self.state == "failed":
                    job.emit(Failed(self.unavailable()))
                else:
                    self._serve(job)
            except ContextError as e:
                job.emit(Failed(APIError(str(e))))
            except Exception as e:  # noqa: BLE001 - any fault fails this request; the thread serves on
                traceback.print_exc()
                if self.fatal_faults:
                    self.state, self.error = "failed", f"{type(e).__name__}: {e}"
                job.emit(Failed(APIError(f"the engine failed on this request: {type(e).__name__}: {e}",
                                         status=500, code="engine_error")))
            finally:
                with self._cv:
                    self._busy = False

    def _serve(self, job: Job) -> None:
        m, engine = self.metrics, self.engine
        want_logits = job.top_logprobs is not None
        stream = TextStream(self.tokenizer, job.stops)
        n, finish, t_first, t_prev, cached, gen, cut = 0, "length", None, None, 0, None, False
        m.running.set(1)
        t0 = time.perf_counter()
        try:
            gen = engine.generate(job.prompt, max(job.max_tokens, 1), job.sampling, logits=want_logits)
            for item in gen:
                tok, logits = item if want_logits else (item, None)
                now = time.perf_counter()
                if t_first is None:
                    t_first, cached = now, engine.cached_tokens
                    m.ttft.observe(now - job.received)
                else:
                    m.itl.observe(now - t_prev)
                t_prev = now
                if job.max_tokens == 0:   # prefill only: the one token an engine makes is never fed back,
                    break                 # so the sequence it keeps for reuse is exactly the prompt
                n += 1
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if tok in self.stop_ids:
                    finish = "stop"
                    break
                text = stream.push(tok)
                if job.cutoff is not None:
                    text, cut = job.cutoff.push(text, now - t_first)
                job.emit(Token(text, tok, top_logprobs(self.tokenizer, logits, tok, job.top_logprobs)
                               if want_logits else None))
                if stream.stopped is not None:
                    finish = "stop"
                    break
                if cut:   # llama-server's stop_type "limit"
                    break
        finally:
            if gen is not None:
                gen.close()
            m.running.set(0)
        if finish == "cancelled":
            m.cancelled.inc()
        m.prompt_tokens.inc(len(job.prompt))
        m.generation_tokens.inc(n)
        m.cached_tokens.inc(cached)
        drafted, accepted = draft_counts(engine)   # final: the generator is closed
        m.draft_tokens.inc(drafted or 0)
        m.accepted_tokens.inc(accepted)
        job.emit(Done(finish, "" if cut else stream.flush(), n, cached, stream.stopped,
                      (t_first or t0) - t0, (t_prev or t0) - (t_first or t0), drafted, accepted))
