"""The one engine thread. It loads the model (the CUDA context then belongs to it), takes requests in FIFO
order from a queue of at most ``max_queue`` waiting ones, runs up to ``max_running`` of them at once
(serve/scheduler.py) and hands the client's text back to the event loop, token by token, through an
asyncio queue. Detokenization and stop matching run here, between steps, so a stop ends the generation at
the token that completes it.

A request error of the engine (ContextError) fails that request with 400. Any other exception is a fault:
it fails the request with 500, and on a GPU engine it also marks the worker failed (/health 503, later
requests refused) rather than risk serving text from a corrupted device state."""

from __future__ import annotations

import collections
import sys
import threading
import traceback

from ..runtime.generate import ContextError
from .errors import APIError
from .jobs import Failed, Job
from .prompts import stop_ids


class Worker:
    def __init__(self, load, metrics, max_queue: int, log=None, on_load_error=None, max_running: int = 8,
                 step_tokens: int = 512):
        """``load()`` -> (engine, tokenizer), called in the engine thread; ``on_load_error(message)`` is
        told when it raises (the CLI then stops the server). ``max_running`` sequences run at once (1 on an
        engine without the multi-sequence step), ``step_tokens`` bounds one step's rows
        (serve/scheduler.py)."""
        self.metrics, self.max_queue, self.max_running, self.step_tokens = metrics, max_queue, max_running, step_tokens
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_load_error = on_load_error
        self.state, self.error = "loading", None
        self.engine = self.tokenizer = None
        self.stop_ids: frozenset[int] = frozenset()
        self.fatal_faults = True
        self._queue: collections.deque[Job] = collections.deque()
        self._running = 0
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
            if len(self._queue) + self._running >= self.max_queue + self.max_running:
                raise APIError(f"the queue is full ({len(self._queue)} requests waiting, {self._running} running)",
                               status=503, code="queue_full", headers={"Retry-After": "1"})
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client left: drop the job if it still waits, else stop it at the next step boundary."""
        job.cancelled.set()
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_depth.set(len(self._queue))
                self.metrics.cancelled.inc()

    # ---- the scheduler's side (engine thread) ----------------------------------------------------------

    def take(self, wait: bool) -> Job | None:
        """The next waiting job (None when none waits and ``wait`` is false). Once the engine has failed,
        waiting jobs are answered 503 here."""
        while True:
            with self._cv:
                while wait and not self._queue:
                    self._cv.wait()
                if not self._queue:
                    return None
                job = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
            if self.state != "failed":
                return job
            job.emit(Failed(self.unavailable()))

    def put_back(self, job: Job) -> None:
        """A job that cannot start yet waits at the head of the queue (unless its client left meanwhile)."""
        with self._cv:
            if job.cancelled.is_set():
                self.metrics.cancelled.inc()
                return
            self._queue.appendleft(job)
            self.metrics.queue_depth.set(len(self._queue))

    def set_running(self, n: int) -> None:
        with self._cv:
            self._running = n
        self.metrics.running.set(n)

    def fault(self, e: Exception, jobs: list[Job]) -> None:
        """``jobs`` failed on ``e``: a request error (ContextError) is a 400; any other exception is a 500
        and, on a GPU engine, ends the worker (device state may be corrupt)."""
        if isinstance(e, ContextError):
            error = APIError(str(e))
        else:
            traceback.print_exc()
            if self.fatal_faults:
                self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            error = APIError(f"the engine failed on this request: {type(e).__name__}: {e}", status=500,
                             code="engine_error")
        for job in jobs:
            job.emit(Failed(error))

    def _run(self, load) -> None:
        from ..backends import ReferenceEngine
        from .scheduler import Scheduler
        try:
            self.engine, self.tokenizer = load()
            self.stop_ids = stop_ids(self.tokenizer)
        except BaseException as e:  # noqa: BLE001 - reported on /health, and to whoever started the worker
            self.state, self.error = "failed", f"loading failed: {e}"
            if self.on_load_error:
                self.on_load_error(str(e))
            return
        self.fatal_faults = not isinstance(self.engine, ReferenceEngine)  # device state may be corrupt
        if getattr(self.engine, "batch", None) is None and self.max_running > 1:
            self.log(f"{self.engine.name} runs one sequence at a time (no multi-sequence step yet): "
                     f"--max-running {self.max_running} taken as 1")
            self.max_running = 1
        self.state = "ready"
        self.log(f"ready: {self.engine.name}, context {self.engine.context} tokens, "
                 f"up to {self.max_running} sequences at once")
        Scheduler(self, self.step_tokens).run()
