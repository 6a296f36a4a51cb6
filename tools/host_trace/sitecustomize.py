"""Where a server request's host time goes: timestamps of the serving and engine calls of every request, up to
its first token. Python imports this module at startup when its folder is on PYTHONPATH; it does nothing
unless NQ_TRACE names a file. A child process (the server that nanoqwen.bench.serve starts) inherits both:

    NQ_TRACE=trace.jsonl PYTHONPATH=tools/host_trace:. python -m nanoqwen.bench.serve

Each request appends one JSON line at its first token: its prompt length, cached tokens and the stamps since
the previous line, (name, thread, ms from the request's arrival); "X>" enters and "X<" leaves call X. The
wrappers cost a few microseconds a call (results/serve-trace-*.json summarize such a run)."""

import os

if os.environ.get("NQ_TRACE"):
    import functools
    import inspect
    import json
    import threading
    import time

    from nanoqwen.runtime import batchstep, chunk_graphs, decoder, prefill, prefix_cache, state
    from nanoqwen.serve import app, scheduler, worker

    EVENTS: list[tuple[str, str, float]] = []   # list.append is atomic: the loop and engine threads share it

    def stamp(name: str) -> None:
        EVENTS.append((name, threading.current_thread().name[:12], time.perf_counter()))

    def wrap(owner, attr: str, name: str | None = None) -> None:
        fn, name = getattr(owner, attr), name or f"{getattr(owner, '__name__', owner)}.{attr}"
        if inspect.iscoroutinefunction(fn):
            async def timed(*a, **k):
                stamp(name + ">")
                try:
                    return await fn(*a, **k)
                finally:
                    stamp(name + "<")
        else:
            def timed(*a, **k):
                stamp(name + ">")
                try:
                    return fn(*a, **k)
                finally:
                    stamp(name + "<")
        setattr(owner, attr, functools.wraps(fn)(timed))

    wrap(app, "parse", "parse")
    for cls, names in ((worker.Worker, ("submit", "take")), (scheduler.Scheduler, ("_admit", "_step")),
                       (batchstep.BatchStep, ("open", "step", "_load", "_collect", "close")),
                       (prefix_cache.PrefixCache, ("start", "keep")), (prefill.Prefiller, ("__call__",)),
                       (chunk_graphs.ChunkGraphs, ("stage", "run")), (decoder.Decoder, ("lm_head",)),
                       (state.SequenceState, ("wait_step", "drain", "reset"))):
        for attr in names:
            wrap(cls, attr)
    for mod in (batchstep, chunk_graphs, state):   # the GPU waits, under the name of the module that waits
        wrap(mod, "wait", f"wait@{mod.__name__.rsplit('.', 1)[1]}")
    push = scheduler.Reply.push

    def traced_push(self, tok, logits):
        first = self.t_first is None
        stamp("push")
        ended = push(self, tok, logits)
        if first:
            t0, events = self.job.received, EVENTS[:]
            del EVENTS[:len(events)]
            with open(os.environ["NQ_TRACE"], "a") as f:
                f.write(json.dumps({"prompt": len(self.job.prompt), "cached": self.cached, "events": [
                    (n, th, round(1e3 * (t - t0), 4)) for n, th, t in events]}) + "\n")
        return ended
    scheduler.Reply.push = traced_push
