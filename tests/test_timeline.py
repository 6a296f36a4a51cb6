"""The decode-step timeline without a GPU: the timed kernel variants (codegen/probe.py) render with the
probe in every decode-step kernel and compile for sm_90a with NVRTC; untimed kernels are exactly what
they were before the ``timed`` field existed (source, spec repr, URI, cache key); the timeline arithmetic
of bench/timeline.py on hand-made stamps and measure() on a simulated device; the chart renders."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen.bench import protocol, timeline
from nanoqwen.codegen import kernels, nvrtc, probe
from nanoqwen.codegen.spec import PROBE_PARAM, SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime.decoder import step_specs
from nanoqwen.runtime.prefill import prefill_specs
from nanoqwen.testmodels import tiny_dims
from tests.test_bench import (ROLE_US, FakeClock, FakeDecoder, FakeFn, FakeGraph, FakeLaunch,  # noqa: F401
                              fake_driver, fake_result, fake_sequence)

# every kernel of the 7B's decode step (m = 1, and the multi-row step's buckets) and the test model's
STEPS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
SPECS = [(name, f"m{m}.{role}", spec) for name, dims in STEPS.items()
         for m in (1, *[m for m in config.default().multirow.buckets if m > 1])
         for role, spec in step_specs(dims, config.default(), m=m).items()
         if not (m > 1 and role == "embed")]   # m > 1 embeds with the prefill's embed (not a decode kernel)
# and every timeable kernel of their prefill (the short chunks' graphs: bench/timeline.py measure_chunk)
SPECS += [(name, role, spec) for name, dims in STEPS.items()
          for role, spec in prefill_specs(dims, config.default()).items() if spec.timeable]
IDS = [f"{name}-{role}" for name, role, _s in SPECS]


def _pre_field_uri(spec) -> str:
    """The URI as spec.py defined it before ``timed`` and the other late fields existed: every other field in
    the repr, and a late field only where a decode kernel here sets it (the m-row attention's pair_rows)."""
    late = {f.name for f in dataclasses.fields(spec)
            if f.name in spec.late_fields and getattr(spec, f.name) == f.default}
    assert "timed" in late
    fields = ", ".join(f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec) if f.name not in late)
    h = hashlib.sha256(f"{spec.family}[{spec.template}]({fields})".encode()).hexdigest()[:8]
    parts = [spec.family] + [codegen.spec._uri_part(n, getattr(spec, n)) for n in spec.uri_fields if n not in late] + [h]
    return re.sub(r"[^0-9A-Za-z_]", "_", "_".join(parts))


def _strip_probe(timed_src: str, spec) -> str:
    """The timed source with everything the probe adds taken out again (and its own names put back)."""
    t = dataclasses.replace(spec, timed=True)
    hooks = probe.hooks(True)
    out = timed_src.replace(hooks["probe_code"], "").replace(hooks["probe_enter"], "").replace(hooks["probe_wait"], "")
    out = out.replace(f",\n        {PROBE_PARAM.declaration()}", "")
    return out.replace(t.spec_repr, spec.spec_repr).replace(t.entry, spec.entry)


@pytest.mark.parametrize("name,role,spec", SPECS, ids=IDS)
def test_untimed_kernel_is_unchanged(name, role, spec):
    assert spec.timed is False and "timed" not in spec.spec_repr and "timed" not in spec.uri
    assert spec.uri == _pre_field_uri(spec)
    src = codegen.render(spec)
    assert src == codegen.render(dataclasses.replace(spec, timed=False))
    assert "globaltimer" not in src and "NqProbe" not in src and "probe" not in src.lower()
    assert probe.SOURCE not in "".join(nvrtc.headers(src).values())   # no untimed kernel's key covers the probe


@pytest.mark.parametrize("name,role,spec", SPECS, ids=IDS)
def test_timed_kernel_adds_only_the_probe(name, role, spec):
    t = dataclasses.replace(spec, timed=True)
    src = codegen.render(t)
    assert t.uri != spec.uri and "_timed_" in t.uri and "timed=True" in t.spec_repr
    assert t.signature == spec.signature + (("probe", "ptr"),)
    assert src.count("NqProbe nq_probe(probe);") == 1 and src.count("nq_probe.waited();") == 1
    assert src.count("pdl_wait(); nq_probe.waited();") == 1   # the wait stamp right after the PDL wait
    assert src.count("mov.u64 %0, %%globaltimer;") == 1
    assert _strip_probe(src, spec) == codegen.render(spec)


def test_timed_kernels_compile_for_sm90a_without_spills(fresh_build):
    """The test model's timed decode step and the 7B's: every kernel compiles, defines its entry, keeps
    the untimed kernel's shared memory and spills nothing."""
    specs = [dataclasses.replace(s, timed=True) for name, role, s in SPECS
             if role.startswith(("m1.", "prefill.graph.", "prefill.small.", "prefill.embed"))]
    for spec, b in zip(specs, fresh_build(specs)):
        r = b.resources
        assert b.entry == spec.entry and b.cubin[:4] == b"\x7fELF" and not b.cached, spec.uri
        assert (r.spill_stores, r.spill_loads, r.local_bytes) == (0, 0, 0), f"{spec.uri}: {r}"
        assert r.registers * b.launch.threads <= 65536, spec.uri


def test_timed_needs_a_template_with_the_hooks():
    fam = kernels.family("copy")
    assert not fam.timeable
    with pytest.raises(SpecError, match=r"copy: unknown parameter\(s\) timed \(known: threads, unroll, blocks\)"):
        fam.from_params(timed="true")
    with pytest.raises(SpecError, match="copy: timed=True, but templates/copy.cu.j2 has no timeline probe hooks"):
        fam(timed=True).validate()
    spec = kernels.from_params("embed", hidden="256", vocab="2048", timed="true")   # nanoqwen-gen's path
    assert spec.timed is True and spec.signature[-1] == ("probe", "ptr")
    assert list(kernels.family("embed").parameters())[-1] == "timed"


def test_the_gemv_order_gemm_is_not_timeable():
    """Its PDL wait is inside gemv_order_tile, where the probe's scope does not reach."""
    from nanoqwen.codegen.kernels import gemm
    spec = gemm.config_gemms(QWEN25_7B, config.default(), small_m=True, gemv_order=True)["down"]
    with pytest.raises(SpecError, match="timed=True takes the fold order"):
        dataclasses.replace(spec, timed=True).validate()


def test_chunk_roles_name_a_chunks_kernels_as_the_decode_step_does():
    from nanoqwen.bench.itl import launch_layers
    roles = ["embed", "rmsnorm", "small.qkv", "graph.rope_append", "graph.attention", "graph.attention_combine",
             "small.o_proj", "rmsnorm", "small.gate_up", "small.down", "rmsnorm", "rows16.qkv"]
    got = timeline.chunk_roles(roles)
    assert got == ["embed", "qkv_norm", "qkv", "rope_append", "attention_decode", "attention_combine", "o_proj",
                   "gate_up_norm", "gate_up", "down", "qkv_norm", "qkv"]
    assert launch_layers(got) == [None, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]   # a layer starts at its qkv's norm
    assert launch_layers(["embed", "qkv", "down", "qkv", "lm_head"]) == [None, 0, 0, 1, None]


def test_probe_decode_undoes_the_complement():
    t = np.array([[100, 140, 900], [120, 0, 0]], dtype=np.uint64)   # launch 1: wait and end never written
    raw = t.copy()
    raw[:, :2] = ~raw[:, :2]
    raw[1, 1] = 0
    got = probe.decode(raw.reshape(-1))
    assert got.dtype == np.int64 and got.tolist() == [[100, 140, 900], [120, -1, -1]]
    assert probe.table_bytes(3) == 72


# ---- the arithmetic, on hand-made stamps ----------------------------------------------------------------

ROLES = ["embed", "qkv", "rope_append", "attention_decode", "attention_combine", "o_proj", "gate_up", "down",
         "lm_head"]


def _stamps(shift: int = 0) -> np.ndarray:
    """(start, wait, end) ns of one step: PDL overlaps (qkv starts inside embed), one idle gap of 30 ns
    (before rope_append), the rest back to back."""
    s = [(0, 10, 50), (20, 50, 200), (230, 230, 260), (250, 260, 400), (400, 400, 420), (410, 420, 500),
         (480, 500, 700), (690, 700, 800), (800, 810, 1000)]
    return np.array(s, dtype=np.int64) + 10_000 + shift


def test_replay_arithmetic_adds_up():
    r = timeline.replay_times(_stamps())
    assert r["start"].tolist()[:3] == [0, 20, 230] and r["wait"][1] == 50 and r["end"][-1] == 1000
    assert r["busy"].tolist() == [50, 180, 30, 150, 20, 90, 220, 110, 200]
    assert r["gap_before"].tolist() == [0, 0, 30, 0, 0, 0, 0, 0, 0]
    assert r["own"].tolist() == [50, 150, 30, 140, 20, 80, 200, 100, 200]
    assert r["span"] == 1000 and r["kernel_gap"] == 30 and r["union"] == 970
    assert r["span"] == r["union"] + r["kernel_gap"] and r["overlap"] == r["busy_sum"] - r["union"] == 80


def test_a_kernel_inside_another_owns_nothing():
    r = timeline.replay_times(np.array([[0, 0, 100], [10, 20, 50], [120, 130, 150]]))
    assert r["own"].tolist() == [100, 0, 30] and r["kernel_gap"] == 20 and r["overlap"] == 40


def test_unwritten_slots_are_an_error():
    s = _stamps()
    s[4, 2] = -1
    with pytest.raises(ValueError, match=r"never written: launches \[4\]"):
        timeline.replay_times(s)


def test_summary_takes_medians_over_replays_per_figure():
    reps = np.stack([_stamps(7 * k) for k in range(4)] + [_stamps(3)])
    reps[1, 2:, :] += 100   # replay 1: a 100 ns idle gap before rope_append instead of 30
    reps[2, -1, 2] += 1000  # replay 2: a slow lm_head
    tl = timeline.summarize(ROLES, reps)
    assert tl["reps"] == 5 and tl["launches"] == 9
    k = {x["role"]: x for x in tl["kernels"]}
    assert k["rope_append"]["gap_before_us"] == pytest.approx(0.030) and k["lm_head"]["busy_us"] == pytest.approx(0.2)
    assert tl["span_us"] == pytest.approx(1.0) and tl["span_us_max"] == pytest.approx(2.0)
    assert tl["kernel_gap_us"] == pytest.approx(0.03) and tl["union_us"] == pytest.approx(0.97)
    assert tl["regions_own_us"]["paged_attention"] == pytest.approx(0.16)
    assert sum(tl["regions_own_us"].values()) == pytest.approx(tl["union_us"])
    assert [x["layer"] for x in tl["kernels"]] == [None, 0, 0, 0, 0, 0, 0, 0, None]
    assert tl["timer_quantum_ns"] == 1


def test_timer_quantum_is_the_gcd_of_the_stamps():
    assert timeline.timer_quantum_ns(np.array([1_000_032, 1_000_064, 1_001_056])) == 32
    assert timeline.timer_quantum_ns(_stamps() * 1000) == 10_000


def test_summary_refuses_a_table_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"\[reps >= 1, 9 launches, 3\]"):
        timeline.summarize(ROLES, np.zeros((2, 8, 3), np.int64))


def _fake_timeline() -> dict:
    tl = timeline.summarize(ROLES, np.stack([_stamps(), _stamps(5)]))
    tl.update(context=48, graph_step_us=1.4, timed_graph_step_us=1.5, probe_overhead_us=0.1,
              unseen_us=1.5 - tl["span_us"])
    return tl


def test_chart_and_table_lines(tmp_path):
    tl = _fake_timeline()
    msg = timeline.plot(tl, tmp_path / "sub" / "timeline.png", "synthetic")
    if importlib.util.find_spec("matplotlib"):
        assert msg.startswith("wrote") and (tmp_path / "sub" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in msg
    line = timeline.summary(tl)
    assert "idle (kernel_gap) 0.0 us" in line and "median of 2 replays at context 48" in line
    assert "1.4 us untimed, 1.5 us timed" in line


def test_bench_table_and_chart_use_the_timeline(tmp_path):
    res = fake_result()
    assert "in-graph %globaltimer stamps" not in protocol.table(res)
    res["timeline"] = _fake_timeline()
    text = protocol.table(res)
    assert "in-graph %globaltimer stamps" in text and "not idle time: see the timeline" in text
    msg = protocol.plot(res, tmp_path / "itl.png")   # the region chart with the in-graph kernel_gap bar
    assert msg.startswith("wrote") or "matplotlib is not installed" in msg


# ---- measure()'s glue on a simulated device ---------------------------------------------------------------


class StampingFn(FakeFn):
    """A timed kernel on the simulated clock: it runs ROLE_US, waits a quarter of it, and stamps its slots."""

    def __init__(self, role, table):
        super().__init__(role)
        self.table = table

    def launch(self, launch, stream, pdl, **args):
        t0 = int(FakeClock.t * 1e9)
        super().launch(launch, stream, pdl, **args)
        t1 = int(FakeClock.t * 1e9)
        slot = self.table.mem[args["probe"] * probe.SLOTS:]
        slot[:3] = np.maximum(slot[:3], [~np.uint64(t0), ~np.uint64(t0 + (t1 - t0) // 4), np.uint64(t1)])


class FakeTable:
    def __init__(self, n):
        self.mem = np.full(n * probe.SLOTS, 2**64 - 1, np.uint64)   # stale: read unzeroed, every start is 0

    def memset_u32(self, value, stream=None):
        self.mem[:] = value

    def download(self, out):
        out[:] = self.mem
        return out


class FakeTimedDecoder(FakeDecoder):
    def __init__(self, layers):
        super().__init__(layers)
        self.probe = FakeTable(len(self.sequence))
        self.sequence = [(r, StampingFn(r, self.probe), launch, {"probe": i})
                         for i, (r, _fn, launch, _a) in enumerate(self.sequence)]
        self.graph, self.captured, self.closed = None, False, False

    def capture(self):
        self.graph, self.captured = FakeGraph(self), True

    def close(self):
        self.closed = True


def test_measure_reports_the_simulated_step(fake_driver, monkeypatch):
    layers = 2
    dec, timed = FakeDecoder(layers), FakeTimedDecoder(layers)
    monkeypatch.setattr(timeline, "timed_decoder", lambda d, cfg=None: timed)
    FakeClock.t = 1.0
    tl = timeline.measure(dec, context=100, reps=3, token=5)
    assert timed.captured and timed.closed and set(timed.resets) == {(5, 99, 99)}
    roles = [r for r, *_ in dec.sequence]
    assert [k["role"] for k in tl["kernels"]] == roles and tl["context"] == 100 and tl["reps"] == 3
    want = np.cumsum([0] + [ROLE_US[r] for r in roles])   # back to back on the simulated clock
    assert [k["start_us"] for k in tl["kernels"]] == pytest.approx(want[:-1])
    assert [k["end_us"] for k in tl["kernels"]] == pytest.approx(want[1:])
    assert [k["wait_us"] - k["start_us"] for k in tl["kernels"]] == pytest.approx([ROLE_US[r] / 4 for r in roles], abs=1e-3)
    assert tl["span_us"] == pytest.approx(want[-1]) and tl["kernel_gap_us"] == 0 and tl["overlap_us"] == 0
    assert tl["graph_step_us"] == pytest.approx(want[-1] - 5) == tl["timed_graph_step_us"]   # FakeGraph: -5 us
    assert tl["probe_overhead_us"] == 0 and tl["unseen_us"] == pytest.approx(-5)
    assert tl["kernels"][1]["uri"] == "qkv_kernel_abcd1234" and tl["kernels"][1]["grid"] == [132, 1, 1]


# ---- the multi-row step's timeline (measure_rows) on a simulated device -------------------------------------

class FakeRowStep:
    """A captured RowStep of one bucket on the simulated clock: its graph replays the untimed launches."""

    def __init__(self, m: int, layers: int):
        self.m, self.pdl, self.loads = m, True, []
        self.sequences = {m: [(r, FakeFn(r), FakeLaunch(), {}) for r, *_ in fake_sequence(layers)]}
        self.graphs = {m: type("G", (), {"launch": lambda g, stream: self._replay(self.sequences[m])})()}
        self.shared = type("Shared", (), {"stream": None, "drain": lambda sh: None, "check_errors": lambda sh: None})()

    def _replay(self, seq):
        for _r, fn, launch, args in seq:
            fn.launch(launch, None, self.pdl, **args)
        FakeClock.t -= 5e-6   # PDL overlap, as FakeGraph

    def load(self, tokens, positions, tables=None):
        self.loads.append((list(tokens), list(positions), tables))
        return self.m


def test_measure_rows_times_the_bucket_over_its_own_inputs(fake_driver, monkeypatch):
    from contextlib import contextmanager
    from nanoqwen.runtime import driver
    rows = FakeRowStep(8, layers=2)
    embed, *rest = rows.sequences[8]   # one launch untimed, with no slot (as timed_rows leaves a hookless kernel)
    table = FakeTable(len(rest))
    timed = [embed] + [(r, StampingFn(r, table), launch, {"probe": i}) for i, (r, _f, launch, _a) in enumerate(rest)]
    monkeypatch.setattr(timeline, "timed_rows", lambda rs, m, cfg=None: (timed, table))
    table.free = lambda: None

    @contextmanager
    def capture(stream):
        yield type("G", (), {"launch": lambda g, s: rows._replay(timed), "close": lambda g: None})()
    monkeypatch.setattr(driver, "capture", capture)
    FakeClock.t = 1.0
    tl = timeline.measure_rows(rows, 8, context=100, reps=3)
    assert {(tuple(t), tuple(p), tb) for t, p, tb in rows.loads} == {((0,) * 8, tuple(range(92, 100)), None)}
    roles = [r for r, *_ in rows.sequences[8]][1:]
    assert [k["role"] for k in tl["kernels"]] == roles and (tl["m"], tl["context"], tl["reps"]) == (8, 100, 3)
    want = np.cumsum([0] + [ROLE_US[r] for r in roles])   # from the first timed launch's start
    assert [k["end_us"] for k in tl["kernels"]] == pytest.approx(want[1:])
    assert tl["graph_step_us"] == pytest.approx(want[-1] + ROLE_US["embed"] - 5) == tl["timed_graph_step_us"]
    assert tl["unseen_us"] == pytest.approx(ROLE_US["embed"] - 5)
    assert [k["uri"] for k in tl["kernels"]] == [f"{r}_kernel_abcd1234" for r in roles]
    assert timeline.summary(tl).startswith("the 8-row step, in-graph %globaltimer stamps, median of 3 replays")


def test_timed_rows_times_the_buckets_own_kernels(monkeypatch):
    """timed_rows: bucket m's launch list in timed variants, each launch its own probe slots (the m-row embed,
    the prefill's embed_prefill, too); the RowStep's own launch list untouched."""
    from nanoqwen.runtime import driver

    class Untimed:   # the bucket's kernels: a timed variant takes their shared-memory split
        carveout = 37

    class Rows:
        kernels = {4: {r: (spec, Untimed) for r, spec in step_specs(tiny_dims(), config.default(), m=4).items()}}
        sequences = {4: [(r, Untimed, FakeLaunch(), {"h": 1}) for r, *_ in fake_sequence(2)]}

    def build_many(specs, progress=None, cfg=None):
        specs = list(specs)
        for spec in specs:
            assert spec.timed
            spec.validate()
        return specs

    class Table:
        ptr, nbytes = 4096, 0

        def __init__(self, n):
            self.nbytes = n
    monkeypatch.setattr(codegen, "build_many", build_many)
    monkeypatch.setattr(driver, "load", lambda spec, carveout: ("fn", spec.family, carveout))
    monkeypatch.setattr(driver, "DeviceBuffer", Table)
    seq, table = timeline.timed_rows(Rows, 4)
    assert Rows.kernels[4]["embed"][0].family == "embed_prefill" and seq[0][1] == ("fn", "embed_prefill", 37)
    assert all(fn[0] == "fn" and fn[2] == 37 for _r, fn, *_ in seq)
    assert table.nbytes == probe.table_bytes(len(seq))
    assert [a["probe"] for *_r, a in seq] == [4096 + 24 * i for i in range(len(seq))]
    assert all(a["h"] == 1 for *_r, a in seq) and all(a == {"h": 1} for *_r, a in Rows.sequences[4])


# ---- a short prefill chunk's timeline (measure_chunk) on a simulated device ---------------------------------

CHUNK_ROLES = ["embed", "rmsnorm", "small.qkv", "graph.rope_append", "graph.attention", "graph.attention_combine",
               "small.o_proj", "rmsnorm", "small.gate_up", "small.down"]
CHUNK_US = dict(ROLE_US, qkv_norm=1, gate_up_norm=1)


class ChunkFn(FakeFn):
    """A chunk kernel on the simulated clock (its decode-step role's time); timed, it stamps the slots at the
    byte address its ``probe`` argument names; inside a capture it is recorded, not run."""
    recording: list | None = None
    table = None

    def __init__(self, role, timed=False):
        super().__init__(role)
        self.timed, self.carveout = timed, 41

    def launch(self, launch, stream, pdl, **args):
        if ChunkFn.recording is not None:
            ChunkFn.recording.append((self, launch, pdl, args))
            return
        t0 = int(FakeClock.t * 1e9)
        FakeClock.t += CHUNK_US[self.role] * 1e-6
        t1 = int(FakeClock.t * 1e9)
        if self.timed:
            slot = ChunkFn.table.mem[args["probe"] // 8:]
            slot[:3] = np.maximum(slot[:3], [~np.uint64(t0), ~np.uint64(t0 + (t1 - t0) // 4), np.uint64(t1)])


def test_measure_chunk_times_the_buckets_kernels_inside_its_graph(fake_driver, monkeypatch):
    from contextlib import contextmanager
    from nanoqwen.runtime import driver
    roles = timeline.chunk_roles(CHUNK_ROLES)

    class Spec:
        def __init__(self, role, timeable=True):
            self.role, self.timeable, self.timed = role, timeable, False

        def launch(self, *shape):
            return FakeLaunch()
    specs = {r: Spec(d, timeable=r != "graph.attention_combine") for r, d in zip(CHUNK_ROLES, roles)}

    class Graphs:
        sequences = {32: [(r, (32,), {"x": i}) for i, r in enumerate(CHUNK_ROLES)]}
        staged, ran = [], []
        graphs = {32: type("G", (), {"launch": lambda g, s: [ChunkFn(d).launch(None, s, True)
                                                                for d in roles]})()}

        def stage(self, chunks):
            self.staged.append(chunks)

        def run(self, c0, n):
            self.ran.append((c0, n))

    class Pre:
        graphs, kernels = Graphs(), {"prefill." + r: (specs[r], ChunkFn(specs[r].role)) for r in CHUNK_ROLES}
        shared = type("Shared", (), {"stream": type("Stream", (), {"synchronize": lambda st: None})(),
                                     "drain": lambda sh: None, "check_errors": lambda sh: None})()

        @staticmethod
        def pdl(role):
            return role != "small.o_proj"

    def table(nbytes):
        ChunkFn.table = FakeTable(nbytes // 24)
        ChunkFn.table.ptr, ChunkFn.table.free = 0, lambda: None
        return ChunkFn.table

    captured = []

    @contextmanager
    def capture(stream):
        ChunkFn.recording = recorded = []
        captured.append(recorded)
        try:
            yield type("G", (), {"launch": lambda g, s: [fn.launch(ln, s, p, **a) for fn, ln, p, a in recorded],
                                 "close": lambda g: None})()
        finally:
            ChunkFn.recording = None
    monkeypatch.setattr(codegen, "build_many", lambda specs, progress=None, cfg=None: list(specs))
    monkeypatch.setattr(dataclasses, "replace", lambda spec, timed: spec)   # the fake specs are plain objects
    monkeypatch.setattr(driver, "load", lambda spec, carveout: ChunkFn(spec.role, timed=True))
    monkeypatch.setattr(driver, "DeviceBuffer", table)
    monkeypatch.setattr(driver, "capture", capture)
    FakeClock.t = 1.0
    tl = timeline.measure_chunk(Pre, 32, 4064, list(range(32)), reps=3)
    assert Pre.graphs.staged == [[(4064, list(range(32)))]] and Pre.graphs.ran == [(4064, 32)]
    assert [p for _fn, _ln, p, _a in captured[0]] == [Pre.pdl(r) for r in CHUNK_ROLES]   # as the Prefiller's
    timed = [d for r, d in zip(CHUNK_ROLES, roles) if r != "graph.attention_combine"]   # not timeable: no slot
    assert [k["role"] for k in tl["kernels"]] == timed
    assert [k["layer"] for k in tl["kernels"]] == [None] + [0] * (len(timed) - 1)
    assert (tl["m"], tl["context"], tl["reps"], tl["chunk"]) == (32, 4096, 3, True)
    ends = np.cumsum([CHUNK_US[d] for d in roles])
    assert [k["end_us"] for k in tl["kernels"]] == pytest.approx([e for d, e in zip(roles, ends)
                                                                  if d != "attention_combine"])
    assert tl["kernel_gap_us"] == pytest.approx(CHUNK_US["attention_combine"])   # the unstamped kernel's time
    assert tl["graph_step_us"] == pytest.approx(ends[-1]) == tl["timed_graph_step_us"]
    assert [k["uri"] for k in tl["kernels"]] == [Pre.kernels["prefill." + r][1].uri for r in CHUNK_ROLES
                                                 if r != "graph.attention_combine"]   # the untimed kernels
    assert timeline.summary(tl).startswith("the 32-row prefill chunk, in-graph %globaltimer stamps")
