"""Seconds per call of back-to-back kernel launches captured into one CUDA graph and replayed: what a
decode step sees of a kernel (no host launch cost, neighbours overlapping under PDL); and of one call alone,
behind a memset that keeps the host's launch cost out."""

from __future__ import annotations

from ..runtime import driver


def blocked_seconds(call, reps: int, stream: driver.Stream, blocker: driver.DeviceBuffer) -> list[float]:
    """Seconds of ``call(i)`` for i < ``reps``, events around each call, each behind a memset of ``blocker``
    (bench/kernels.py BLOCKER_BYTES): the GPU is busy while the host issues the call, so the host's launch
    latency stays out of the time, and the memset evicts from L2 what the previous call left there."""
    a, b = driver.Event(), driver.Event()
    try:
        out = []
        for i in range(reps):
            blocker.memset_u32(i, stream)
            a.record(stream)
            call(i)
            b.record(stream)
            out.append(driver.Event.elapsed_ms(a, b) * 1e-3)
        return out
    finally:
        a.close()
        b.close()


def graph_seconds(call, calls: int, stream: driver.Stream, reps: int = 5) -> list[float]:
    """``call(i, pdl)`` launches call i; ``calls`` of them (PDL on) are captured once, replayed once to warm
    up, then ``reps`` times between events: seconds per call of each replay."""
    with driver.capture(stream) as graph:
        for i in range(calls):
            call(i, True)
    a, b = driver.Event(), driver.Event()
    try:
        graph.launch(stream)
        stream.synchronize()
        per_call = []
        for _ in range(reps):
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            per_call.append(driver.Event.elapsed_ms(a, b) * 1e-3 / calls)
        return per_call
    finally:
        graph.close()
        a.close()
        b.close()
