"""Inter-token latency breakdown of one decode step: device time per region (bench/mbu.REGIONS), summed
over the layers, measured with events around each region's launches in an eager replay of the same step
the graph runs (the decoder's ``sequence``: (role, Function, Launch, args), in launch order), plus
``graph_minus_regions`` = graph step time - sum of the region times. That is NOT the idle time between
kernels (it came out at -0.63 ms on the 7B: each eagerly timed region pays its own ramp and drain, which
the graph overlaps through Programmatic Dependent Launch); the honest per-kernel figures and the real
``kernel_gap`` come from bench/timeline.py, stamps taken inside the replayed graph. ``profile`` is the
breakdown with one event pair per launch.

Why a gate: a Python launch costs ~10-20 us of host time, longer than many of the step's kernels run, so
a stream fed launch by launch measures the host. Every timed replay is therefore enqueued behind a
``cuStreamWaitValue32`` on a pinned host word and released once everything is queued: the GPU then runs
the queued step back to back and the events time the device alone. If the driver refuses stream memory
operations the replay runs ungated and the result says so (``gated: false``). A watchdog releases the
gate after ``GATE_TIMEOUT_S`` (the host could block on a full launch queue) and the result says that too.

The step replayed is a real one: the decode state is set to (token, pos=context-1, step) over a KV cache
that a request has just filled, so attention reads ``context`` tokens of real K/V."""

from __future__ import annotations

import statistics
import threading

import numpy as np

from ..runtime import driver
from ..runtime.driver import check, cu
from .mbu import REGIONS, ROLE_REGION

GATE_TIMEOUT_S = 5.0


class Gate:
    """Holds a stream at a ``cuStreamWaitValue32`` until ``release()``; ``ok`` is False where the driver
    has no stream memory operations (then ``hold`` does nothing)."""

    def __init__(self):
        self.host = driver.HostBuffer(4)
        self.word = self.host.array(np.uint32)
        self.word[0] = 0
        self.gen = 0
        self.timed_out = False
        self.error = None   # why the gate is off, when it is
        try:
            self.dptr = check(cu.cuMemHostGetDevicePointer(self.host.ptr, 0), "cuMemHostGetDevicePointer")
            self.ok = True
        except Exception as e:  # noqa: BLE001 - no stream memory operations here: time ungated, and say so
            self.ok, self.error = False, f"{type(e).__name__}: {e}"
        self._timer = None

    def hold(self, stream: driver.Stream) -> None:
        if not self.ok:
            return
        self.gen += 1
        try:
            check(cu.cuStreamWaitValue32(stream.handle, self.dptr, self.gen,
                                         int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)),
                  "cuStreamWaitValue32")
        except Exception as e:  # noqa: BLE001 - as above
            self.ok, self.error = False, f"{type(e).__name__}: {e}"
            return
        self._timer = threading.Timer(GATE_TIMEOUT_S, self._expire, args=(self.gen,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, gen: int) -> None:
        if self.word[0] < gen:
            self.timed_out = True
            self.word[0] = gen

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.word[0] = self.gen

    def close(self) -> None:
        self.release()
        self.host.free()


def launch_layers(roles) -> list[int | None]:
    """Decoder layer of each launch (a layer starts at its qkv GEMV, or at that GEMV's RMSNorm where it runs
    apart); None for embed and lm_head."""
    layer, out, prev = -1, [], None
    for role in roles:
        layer += role == "qkv_norm" or (role == "qkv" and prev != "qkv_norm")
        out.append(layer if role not in ("embed", "lm_head") else None)
        prev = role
    return out


def _groups(sequence, per_launch: bool) -> list[tuple[str, list[int]]]:
    """(label, launch indices): consecutive launches of one region form one group, or one launch each."""
    groups = []
    for i, (role, *_rest) in enumerate(sequence):
        region = ROLE_REGION[role]
        if per_launch or not groups or groups[-1][0] != region:
            groups.append((region, [i]))
        else:
            groups[-1][1].append(i)
    return groups


def replay_seconds(launch, stream, reps: int) -> float:
    """Seconds per call of ``launch()`` (a graph replay) over ``reps`` back-to-back calls between two events,
    after one call that loads and warms what it needs."""
    a, b = driver.Event(), driver.Event()
    try:
        launch()
        stream.synchronize()
        a.record(stream)
        for _ in range(reps):
            launch()
        b.record(stream)
        b.synchronize()
        return driver.Event.elapsed_ms(a, b) * 1e-3 / reps
    finally:
        a.close()
        b.close()


class StepTimer:
    """Gated, event-timed replays of one decoder step at a fixed decode state."""

    def __init__(self, decoder):
        self.dec = decoder
        self.gate = Gate()

    def _set(self, token: int, pos: int) -> None:
        self.dec.reset(token, pos=pos, step=pos)

    def _launch(self, i: int) -> None:
        role, fn, launch, args = self.dec.sequence[i]
        fn.launch(launch, self.dec.stream, self.dec.pdl, **args)

    def _replay(self, token: int, pos: int, reps: int, events: int, enqueue) -> list[list[float]]:
        """``reps`` gated replays of ``enqueue(stream, events)`` from state (token, pos): the seconds
        between consecutive events of each replay."""
        s = self.dec.stream
        evs = [driver.Event() for _ in range(events)]
        out = []
        try:
            for _ in range(reps):
                self._set(token, pos)
                self.gate.hold(s)
                try:
                    enqueue(s, evs)
                finally:
                    self.gate.release()
                self.dec.drain()   # with a timeout: a hung kernel is an error, not a hang
                out.append([driver.Event.elapsed_ms(a, b) * 1e-3 for a, b in zip(evs, evs[1:])])
        finally:
            self.dec.drain()
            for e in evs:
                e.close()
        self.dec.check_errors()
        return out

    def groups(self, token: int, pos: int, groups, reps: int) -> list[list[float]]:
        """Seconds of each group, ``reps`` times: [[group seconds] per rep]."""
        def enqueue(s, evs):
            evs[0].record(s)
            for g, (_label, idx) in enumerate(groups):
                for i in idx:
                    self._launch(i)
                evs[g + 1].record(s)
        return self._replay(token, pos, reps, len(groups) + 1, enqueue)

    def whole(self, token: int, pos: int, reps: int, graph: bool) -> list[float]:
        """Seconds of the whole step (graph replay, or eager launches without events in between)."""
        def enqueue(s, evs):
            evs[0].record(s)
            if graph:
                self.dec.graph.launch(s)
            else:
                self.dec.launch_kernels(s)
            evs[1].record(s)
        return [t for (t,) in self._replay(token, pos, reps, 2, enqueue)]

    def close(self) -> None:
        self.gate.close()


def breakdown(decoder, context: int, reps: int = 20, token: int = 0) -> dict:
    """Median device time per region of a step whose attention covers ``context`` tokens (pages for them
    must be reserved and written), the graph and eager step times and graph - sum of regions, all in ms."""
    timer = StepTimer(decoder)
    try:
        groups = _groups(decoder.sequence, per_launch=False)
        runs = timer.groups(token, context - 1, groups, reps)
        per_rep = [{r: 0.0 for r in REGIONS} for _ in runs]
        for rep, times in zip(per_rep, runs):
            for (region, _idx), t in zip(groups, times):
                rep[region] += t
        regions = {r: 1e3 * statistics.median(rep[r] for rep in per_rep) for r in REGIONS}
        eager = timer.whole(token, context - 1, reps, graph=False)
        graph = timer.whole(token, context - 1, reps, graph=True) if decoder.graph is not None else None
        gate = {"gated": timer.gate.ok, "gate_timed_out": timer.gate.timed_out, "gate_error": timer.gate.error}
    finally:
        timer.close()
    total = sum(regions.values())
    res = {"context": context, "reps": reps, **gate,
           "regions_ms": regions, "regions_sum_ms": total,
           "eager_step_ms": 1e3 * statistics.median(eager), "eager_step_ms_min": 1e3 * min(eager),
           "graph_step_ms": None, "graph_minus_regions_ms": None, "launches": len(decoder.sequence)}
    if graph:
        res.update(graph_step_ms=1e3 * statistics.median(graph), graph_step_ms_min=1e3 * min(graph))
        res["graph_minus_regions_ms"] = res["graph_step_ms"] - total
    return res


def profile(decoder, context: int, reps: int = 10, token: int = 0) -> dict:
    """Per-launch device time (median over ``reps`` gated eager replays) of one step at ``context``."""
    timer = StepTimer(decoder)
    try:
        groups = _groups(decoder.sequence, per_launch=True)
        runs = timer.groups(token, context - 1, groups, reps)
        gate = {"gated": timer.gate.ok, "gate_timed_out": timer.gate.timed_out, "gate_error": timer.gate.error}
    finally:
        timer.close()
    kernels = []
    layers = launch_layers([role for role, *_rest in decoder.sequence])
    for g, (region, (i,)) in enumerate(groups):
        role, fn, launch, _args = decoder.sequence[i]
        ts = [run[g] for run in runs]
        kernels.append({"index": i, "role": role, "region": region, "layer": layers[i],
                        "uri": fn.uri, "grid": list(launch.grid), "block": list(launch.block), "smem": launch.smem,
                        "us": 1e6 * statistics.median(ts), "us_min": 1e6 * min(ts), "us_max": 1e6 * max(ts)})
    return {"context": context, "reps": reps, **gate, "kernels": kernels,
            "total_us": sum(k["us"] for k in kernels)}


def slowest(prof: dict, n: int = 10) -> str:
    """The ``n`` slowest launches, and the time per kernel URI summed over the step."""
    ks = sorted(prof["kernels"], key=lambda k: -k["us"])[:n]
    lines = [f"slowest {len(ks)} of {len(prof['kernels'])} launches (eager, gated={prof['gated']}, "
             f"context {prof['context']}):", f"{'us':>9} {'layer':>5}  {'role':<18} uri"]
    lines += [f"{k['us']:>9.2f} {'' if k['layer'] is None else k['layer']:>5}  {k['role']:<18} {k['uri']}" for k in ks]
    by_uri: dict[str, list[float]] = {}
    for k in prof["kernels"]:
        by_uri.setdefault(k["uri"], []).append(k["us"])
    lines.append(f"per kernel, summed over the step ({prof['total_us']:.1f} us in all):")
    for uri, ts in sorted(by_uri.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(ts):>9.1f} us {len(ts):>4} x {sum(ts) / len(ts):>8.2f} us  {uri}")
    return "\n".join(lines)
