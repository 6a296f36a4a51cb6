"""CPU checks of the decode runtime's wiring, no GPU: the weight layout (q/k/v stacked back to back, every
region aligned, nothing overlapping), the device memory table against what the parts allocate, the decoder's
launch sequence against every kernel's signature, with a fake driver whose buffers are address ranges
(so every pointer argument is checked to land inside the buffer or weight region it names), and the
Runner's request loop (launch-ahead, sampling feed, early close, prefix reuse through the page table)
over a fake device whose step is the numpy reference.

The Runner's tokens are compared exactly with the reference's own generation: class (a) of
docs/architecture.md, the fake device's steps and prefills are the reference's decode / extend, which
compute each row with the same arithmetic (a reused prefix holds the cold run's bits)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from _drafting import Script
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen import config, testmodels
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.pack import pack_random
from nanoqwen.runtime import batchstep as batchstep_mod
from nanoqwen.runtime import chunk_graphs as chunk_graphs_mod
from nanoqwen.runtime import decoder as decoder_mod
from nanoqwen.runtime import memory as memory_mod
from nanoqwen.runtime import prefill as prefill_mod
from nanoqwen.runtime import rowstep as rowstep_mod
from nanoqwen.runtime import state as state_mod
from nanoqwen.runtime import weights as weights_mod
from nanoqwen.reference import Reference
from nanoqwen.reference import Fp32Weights as ReferenceWeights
from nanoqwen.runtime.paged_kv import KVLayout, PageTable
from nanoqwen.runtime.prefix_cache import PrefixCache
from nanoqwen.runtime.runner import Runner
from nanoqwen.runtime.sampler import HostSampler, Sampling


@pytest.fixture(scope="module")
def nqfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "tiny.nanoqwen"
    pack_random(testmodels.tiny_dims(vocab=512, layers=2), path, seed=3)
    return NanoqwenFile(path)


def test_weight_plan_stacks_qkv_and_aligns(nqfile):
    d = nqfile.dims
    p = weights_mod.plan(nqfile)
    qkv = p.regions["L1.qkv.packed"]
    assert qkv.nbytes == (d.q_dim + 2 * d.kv_dim) * d.hidden // 2
    assert p.regions["L1.qkv.scales"].nbytes == (d.q_dim + 2 * d.kv_dim) * d.hidden // 128 * 2
    assert p.regions["L1.qkv.bias"].nbytes == (d.q_dim + 2 * d.kv_dim) * 2
    spans = sorted((r.offset, r.offset + r.nbytes, r.name) for r in p.regions.values() if r.name != "lm_head" or
                   not d.tie_embeddings)
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{an} overlaps {bn}"
    assert all(r.offset % weights_mod.ALIGN == 0 for r in p.regions.values())
    assert p.nbytes >= spans[-1][1]
    # every file tensor is uploaded exactly once
    parts = [t for r in p.regions.values() for t, _ in r.parts]
    assert sorted(set(parts)) == sorted(n for n in nqfile.tensors if not n.endswith(".scales"))


class FakeBuf:
    """A buffer in a fake address space: ``ptr`` is an address that ``MEM`` resolves back to bytes."""
    next_ptr = 1 << 32

    def __init__(self, nbytes):
        self.nbytes, self.ptr = int(nbytes), FakeBuf.next_ptr
        FakeBuf.next_ptr += -(-self.nbytes // 4096) * 4096 + 4096
        self.mem = np.zeros(self.nbytes, np.uint8)
        MEM.append(self)

    def memset_u32(self, v, stream=None):
        self.mem.view(np.uint32)[:] = v

    def upload(self, arr, stream=None):
        raw = np.ascontiguousarray(arr).view(np.uint8).ravel()
        self.mem[:raw.size] = raw

    def array(self, dtype, shape=None):
        return self.mem.view(dtype)

    def download(self, out):
        out.view(np.uint8).ravel()[:] = self.mem[:out.nbytes]
        return out

    def free(self):
        pass


MEM: list = []


def at(ptr: int, n: int) -> np.ndarray:
    """The n bytes at fake address ptr."""
    for b in MEM:
        if b.ptr <= ptr and ptr + n <= b.ptr + b.nbytes:
            return b.mem[ptr - b.ptr:ptr - b.ptr + n]
    raise AssertionError(f"fake address {ptr:#x}+{n} is in no buffer")


class FakeCu:
    """The few driver calls the runtime makes itself; copies execute at once (a synchronous GPU)."""
    from nanoqwen.runtime.driver import cu as _real
    CUresult = _real.CUresult if _real is not None else None

    @classmethod
    def _ok(cls):
        return (cls.CUresult.CUDA_SUCCESS,)

    @classmethod
    def cuMemcpyHtoDAsync(cls, dst, src, n, stream):
        at(dst, n)[:] = at(src, n)
        return cls._ok()

    @classmethod
    def cuMemcpyDtoHAsync(cls, dst, src, n, stream):
        at(dst, n)[:] = at(src, n)
        return cls._ok()

    @classmethod
    def cuMemcpyDtoDAsync(cls, dst, src, n, stream):
        at(dst, n)[:] = at(src, n)
        return cls._ok()

    @classmethod
    def cuEventQuery(cls, handle):
        return cls._ok()


class FakeFn:
    def __init__(self, spec, carveout=-1):
        self.spec, self.carveout = spec, carveout


class FakeDriver:
    DeviceBuffer = FakeBuf
    HostBuffer = FakeBuf

    class Stream:
        handle = None

        def close(self):
            pass

    class Event:
        handle = None

        def record(self, stream=None):
            return self

        def close(self):
            pass


class FakeWeights:
    def __init__(self, f):
        self.plan = weights_mod.plan(f)
        self.base = self.buffer = FakeBuf(self.plan.nbytes)

    def ptr(self, region):
        return self.base.ptr + self.plan.regions[region].offset


class FakeKV:
    """The pools and the device page table; ``load`` records the page list the table now shows."""

    def __init__(self, layout):
        self.layout = layout
        self.k = [FakeBuf(layout.pool_bytes) for _ in range(layout.layers)]
        self.v = [FakeBuf(layout.pool_bytes) for _ in range(layout.layers)]
        self.page_table = FakeBuf(layout.table_bytes)
        self.pages, self.loaded = [], None

    def load(self, pages, stream):
        assert len(pages) <= self.layout.table_len
        self.pages, self.loaded = list(pages), pages

    def free(self):
        pass

    def locate(self, pos):
        assert pos // self.layout.page_size < len(self.pages), f"position {pos} is on no loaded page"
        return self.pages[pos // self.layout.page_size], pos % self.layout.page_size

    def k_ptr(self, i):
        return self.k[i].ptr

    def v_ptr(self, i):
        return self.v[i].ptr


def fake_runner(nqfile, monkeypatch, capacity=100, ahead=8, chunk=None, fn=lambda role, spec: FakeFn(spec),
                kv_tokens=None, graph_buckets=(), cfg=None) -> Runner:
    """The CUDA engine's parts on the fake driver: a SequenceState, a Decoder, a Prefiller when ``chunk``
    is given (else by_steps; with chunk graphs of ``graph_buckets``), and the Runner over them; ``fn(role,
    spec)`` makes each kernel; ``cfg`` the config (default: config.default())."""
    cfg = cfg or config.default()
    d = nqfile.dims
    for mod in (memory_mod, state_mod, decoder_mod, prefill_mod, rowstep_mod, chunk_graphs_mod, batchstep_mod):
        monkeypatch.setattr(mod, "driver", FakeDriver)
    for mod in (state_mod, decoder_mod, prefill_mod, rowstep_mod, chunk_graphs_mod, batchstep_mod):
        monkeypatch.setattr(mod, "cu", FakeCu)
    specs = decoder_mod.step_specs(d, cfg) | (prefill_mod.prefill_specs(d, cfg) if chunk else {})
    kernels = {role: (spec, fn(role, spec)) for role, spec in specs.items()}
    layout = KVLayout.for_model(d, cfg, capacity, kv_tokens)
    rope = (np.zeros((capacity, d.head_dim // 2), np.float32),) * 2
    shared = state_mod.SequenceState(d, FakeWeights(nqfile), FakeKV(layout), rope, capacity, slots=ahead + 2)
    pre = prefill_mod.Prefiller(shared, kernels, chunk, cfg.prefill.small_m_tokens,
                                graph_buckets=graph_buckets) if chunk else None
    cache = PrefixCache(layout.num_pages, layout.page_size)
    return Runner(shared, decoder_mod.Decoder(shared, kernels), pre, cache, capacity, ahead)


def test_launch_sequence_matches_signatures(nqfile, monkeypatch):
    d = nqfile.dims
    run = fake_runner(nqfile, monkeypatch)
    dec, sh = run.decoder, run.shared
    w, kv = sh.weights, sh.kv
    kernels = dec.kernels
    roles = [role for role, *_ in dec.sequence]
    # the QKV GEMV rotates q and k and appends k and v itself (gemv.with_rope): no rope_append
    per_layer = ["qkv", "attention_decode", "attention_combine", "o_proj", "gate_up", "down"]
    assert roles == ["embed"] + per_layer * d.layers + ["lm_head"] and kernels["qkv"][0].epilogue == "rope"
    buffers = [dec.bufs[n] for n in dec.bufs.names] + [sh.bufs[n] for n in sh.bufs.names] + \
        [w.base, kv.page_table, *kv.k, *kv.v]
    for role, fn, launch, args in dec.sequence:
        spec = kernels[role][0]
        assert launch == spec.launch()
        assert [n for n, _ in spec.signature] == [n for n, _ in spec.signature if n in args]
        assert set(args) == {n for n, _ in spec.signature}, f"{role}: args {sorted(args)} vs {spec.signature}"
        for name, kind in spec.signature:
            v = args[name]
            if kind == "ptr":
                p = v.ptr if isinstance(v, FakeBuf) else v
                assert any(b.ptr <= p < b.ptr + b.nbytes for b in buffers), f"{role}.{name} points nowhere"
    # the GEMV weight operands are the regions of their own layer
    qkv = [a for r, _, _, a in dec.sequence if r == "qkv"]
    assert qkv[1]["w0"] == w.ptr("L1.qkv.packed") and qkv[1]["bias"] == w.ptr("L1.qkv.bias")
    assert (qkv[1]["k_pool"], qkv[1]["v_pool"]) == (kv.k_ptr(1), kv.v_ptr(1)) and qkv[1]["q_rot"] == dec.bufs.q_rot
    gu = [a for r, _, _, a in dec.sequence if r == "gate_up"][0]
    assert (gu["w0"], gu["w1"]) == (w.ptr("L0.gate.packed"), w.ptr("L0.up.packed"))


def test_timed_decoder_gives_each_launch_its_probe_slots(nqfile, monkeypatch):
    """The timeline's Decoder (bench/timeline.py): the same launch list over the session decoder's buffers,
    each launch's ``probe`` its own 3 slots of one table, in launch order; only the step's kernels are
    timed (a session's decoder also holds the prefill's GEMMs, which have no probe hooks)."""
    from nanoqwen import codegen
    from nanoqwen.bench import timeline
    from nanoqwen.runtime import driver
    run = fake_runner(nqfile, monkeypatch, chunk=32)
    seen = []

    class Recorder(FakeFn):
        def launch(self, launch, stream, pdl, **args):
            seen.append(args["probe"])

    def build_many(specs, progress=None, cfg=None):
        specs = list(specs)
        for spec in specs:
            spec.validate()
        return specs
    monkeypatch.setattr(codegen, "build_many", build_many)
    monkeypatch.setattr(driver, "load", Recorder)
    for i, role in enumerate(dict.fromkeys(role for role, *_ in run.decoder.sequence)):
        run.decoder.kernels[role][1].carveout = 10 + i   # each timed variant takes its kernel's shared-memory split
    timed = timeline.timed_decoder(run.decoder)
    kernels = timed.kernels
    assert set(kernels) == {role for role, *_ in run.decoder.sequence} < set(run.decoder.kernels)
    assert all(fn.carveout == run.decoder.kernels[role][1].carveout for role, (_, fn) in kernels.items())
    n = len(timed.sequence)
    assert run.decoder.probe is None and timed.bufs is run.decoder.bufs and timed.probe.nbytes == 24 * n
    assert [args["probe"] for *_rest, args in timed.sequence] == [timed.probe.ptr + 24 * i for i in range(n)]
    for role, _fn, _launch, args in timed.sequence:
        assert set(args) == {name for name, _ in kernels[role][0].signature}, role
    timed.launch_kernels()
    assert seen == [timed.probe.ptr + 24 * i for i in range(n)]
    with pytest.raises(ValueError, match="all timed or all untimed"):
        decoder_mod.Decoder(run.shared, {**kernels, "embed": run.decoder.kernels["embed"]}, bufs=run.decoder.bufs)


def test_memory_table_is_what_the_parts_allocate(nqfile, monkeypatch):
    """The up-front check and the allocation read the same tables: every part allocates exactly its
    entries, and the merged table is all of them (plus the weights and the KV cache)."""
    d, cfg = nqfile.dims, config.default()
    run = fake_runner(nqfile, monkeypatch, capacity=100, chunk=32)
    specs = {r: s for r, (s, _fn) in run.decoder.kernels.items()}
    parts = {"state": (run.shared.bufs, state_mod.buffer_bytes(d, 100)),
             "decode": (run.decoder.bufs, decoder_mod.buffer_bytes(d, specs)),
             "prefill": (run.prefiller.bufs, prefill_mod.buffer_bytes(d, 32, 100, cfg.prefill.small_m_tokens,
                                                                   cfg.prefill.attention_block_keys))}
    for part, (bufs, want) in parts.items():
        assert {n: bufs[n].nbytes for n in bufs.names} == want, part
    lay = KVLayout.for_model(d, cfg, 100)
    p = memory_mod.merge(weights=1000, kv=lay.total_bytes, **{k: v for k, (_b, v) in parts.items()})
    assert sum(p.values()) == 1000 + lay.total_bytes + sum(sum(v.values()) for _b, v in parts.values())
    assert p["decode.h"] == 4 * d.hidden and p["state.tokens_out"] == 400 and p["prefill.tokens"] == 400
    memory_mod.check_fits(p, free=sum(p.values()), total=1 << 40, gpu="fake")
    with pytest.raises(memory_mod.DeviceMemoryError, match=r"needed \(weights"):
        memory_mod.check_fits({**p, "weights": 1 << 40}, free=1 << 39, total=1 << 40, gpu="fake")


def test_page_table_reservation_covers_request():
    """A request of prompt + max_new_tokens - 1 positions maps every page it writes."""
    d = testmodels.tiny_dims()
    layout = KVLayout.for_model(d, config.default(), 40)
    pt = PageTable(layout)
    pt.reserve(17 + 16 - 1)
    for pos in range(32):
        assert pt.locate(pos)[0] >= 0


class FakeDevice:
    """The numpy reference standing in for the GPU, with paged K/V: each (physical page, slot) holds the
    token and the per-layer K/V rows written there. A step (or the fake prefill) at position ``pos``
    loads rows 0..pos-1 into the reference through the loaded page table, so a wrong table, a wrong
    reuse or a position never written shows as a wrong token or a failed lookup."""

    def __init__(self, run, ref):
        self.run, self.ref = run, ref
        self.pages: dict = {}        # (physical page, slot) -> (token, K rows, V rows)
        self.history: list = []      # the running sequence's tokens, by position
        self.fed: list = []          # every token a step or prefill embedded

    def load(self, pos: int) -> None:
        kv, ref = self.run.shared.kv, self.ref
        missing = [q for q in range(pos) if kv.locate(q) not in self.pages]
        assert not missing, f"positions {missing[:5]} were never written"
        rows = [self.pages[kv.locate(q)] for q in range(pos)]
        for i in range(ref.dims.layers if rows else 0):
            for cache, j in ((ref.k_cache[i], 1), (ref.v_cache[i], 2)):
                cache[:pos] = np.stack([r[j][i] for r in rows])
        ref.pos, self.history = pos, [r[0] for r in rows]

    def store(self, pos: int, tokens) -> None:
        kv, ref = self.run.shared.kv, self.ref
        for q, t in enumerate(tokens, start=pos):
            self.pages[kv.locate(q)] = (t, [c[q].copy() for c in ref.k_cache], [c[q].copy() for c in ref.v_cache])
        self.history += list(tokens)
        self.fed += list(tokens)

    def finish(self, logits, step: int) -> None:
        """What lm_head_argmax does: logits, tokens_out[step], state advance."""
        b = self.run.shared.bufs
        tok = int(np.argmax(logits))
        b.logits.mem.view(np.float32)[:] = logits
        b.tokens_out.mem.view(np.int32)[step] = tok
        b.state.mem.view(np.int32)[:3] = (tok, step + 1, step + 1)

    def step(self, stream=None):
        tok, pos, k = (int(x) for x in self.run.shared.bufs.state.mem.view(np.int32)[:3])
        assert pos == k, f"device state {(tok, pos, k)}"
        self.load(pos)
        logits = self.ref.decode(tok)
        self.store(pos, [tok])
        self.finish(logits, k)

    def prefill(self, tokens, p0):
        """The Prefiller's effect (K/V of [p0, p1)) with the reference's batched prefill; the row it
        returns is the logits, for the fake lm_head."""
        self.load(p0)
        logits = self.ref.extend(tokens)[-1]
        self.store(p0, tokens)
        return logits

    def lm_head(self, logits):
        st = self.run.shared.bufs.state.mem.view(np.int32)
        assert st[1] == st[2], "the lm_head after a prefill runs as step p1 - 1 at position p1 - 1"
        self.finish(logits, int(st[2]))


def fake_device(nqfile, monkeypatch, ref, batched_prefill=False, **kw):
    run = fake_runner(nqfile, monkeypatch, chunk=512 if batched_prefill else None, **kw)
    dev = FakeDevice(run, ref)
    monkeypatch.setattr(run.decoder, "launch_kernels", dev.step)
    if batched_prefill:
        run.prefiller = dev.prefill
        monkeypatch.setattr(run.decoder, "lm_head", dev.lm_head)
    return run, dev


def reference_generation(ref, logits, n: int, sampling) -> list[int]:
    """The n tokens the reference generates from the last prompt logits, with the host sampler."""
    sample, want = HostSampler(sampling), []
    for i in range(n):
        want.append(sample(logits))
        if i + 1 < n:
            logits = ref.decode(want[-1])
    return want


PROMPT = [5, 17, 9, 300, 41, 7, 77, 123, 1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, seed=11)])
@pytest.mark.parametrize("ahead", [1, 8])
def test_generate_host_logic(nqfile, monkeypatch, sampling, ahead):
    """The Runner's host side (prefill feeding, launch-ahead, pinned read-back, sampling feed, early
    close) over the fake device with prefill through the decode step. Its tokens must be the
    reference's own generation, and a request that repeats the prompt reuses all but its last token."""
    ref = Reference.from_file(nqfile, max_seq=100)
    run, dev = fake_device(nqfile, monkeypatch, ref, ahead=ahead)
    check = Reference.from_file(nqfile, max_seq=100)
    for n in (1, 2, 12):
        run.cache.clear()
        dev.fed.clear()
        got = list(run.generate(PROMPT, n, sampling))
        for t in PROMPT:  # class (a): the fake device's steps are these very decode steps
            logits = check.decode(t)
        want = reference_generation(check, logits, n, sampling)
        check.reset()
        assert got == want and run.cached_tokens == 0
        assert dev.fed == PROMPT + want[:-1], "the device was fed something other than prompt + generated"
        (kept,) = run.cache.kept.values()
        assert kept.tokens == PROMPT + want[:-1]
    # the same prompt again: only its last token is recomputed
    dev.fed.clear()
    assert list(run.generate(PROMPT, 12, sampling)) == want
    assert run.cached_tokens == len(PROMPT) - 1 and dev.fed == PROMPT[-1:] + want[:-1]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, seed=11)])
@pytest.mark.parametrize("ahead", [1, 8])
def test_close_keeps_what_was_computed(nqfile, monkeypatch, sampling, ahead):
    """Closing after the third token: the steps launched ahead drain, and the kept sequence is exactly
    the positions whose K/V was written, with their tokens; the next request continues it correctly."""
    ref = Reference.from_file(nqfile, max_seq=100)
    run, dev = fake_device(nqfile, monkeypatch, ref, ahead=ahead)
    full = list(run.generate(PROMPT, 12, sampling))
    run.cache.clear()
    it = run.generate(PROMPT, 12, sampling)
    first = [next(it) for _ in range(3)]
    it.close()
    assert first == full[:3]
    (kept,) = run.cache.kept.values()
    written = ref.pos
    assert len(PROMPT) + 2 <= written <= len(PROMPT) + (2 + ahead if sampling.greedy else 2)
    assert kept.tokens == PROMPT + full[:written - len(PROMPT)] == dev.history
    assert run.cache.pool.free + len(kept.pages) == run.cache.pool.num_pages
    # continue the conversation: prompt + the three tokens seen + more
    q = PROMPT + first + [11, 12]
    got = list(run.generate(q, 5, Sampling()))
    assert run.cached_tokens == min(written, len(PROMPT) + 3)
    cold = Reference.from_file(nqfile, max_seq=100)
    for t in q:
        logits = cold.decode(t)
    assert got == reference_generation(cold, logits, 5, Sampling())


def test_logits_pairs_and_eviction(nqfile, monkeypatch):
    """logits=True yields (token, logits copy) on the greedy path without changing the tokens; a pool
    of two sequences evicts the least recently used one."""
    ref = Reference.from_file(nqfile, max_seq=100)
    run, dev = fake_device(nqfile, monkeypatch, ref, capacity=48, kv_tokens=96)
    plain = list(run.generate(PROMPT, 6))
    pairs = list(run.generate(PROMPT, 6, logits=True))
    assert [t for t, _ in pairs] == plain and all(int(np.argmax(r)) == t for t, r in pairs)
    assert len({id(r) for _, r in pairs}) == len(pairs) and pairs[0][1].dtype == np.float32
    other, third = [1, 2, 3] * 5, [400, 401] * 10
    list(run.generate(other, 30))                      # 2 + 3 of 6 pages: both kept
    assert len(run.cache.kept) == 2
    list(run.generate(third, 20))                      # 3 pages: the oldest (PROMPT) goes
    assert [k.tokens[:3] for k in run.cache.kept.values()] == [other[:3], third[:3]]
    list(run.generate(PROMPT, 2))
    assert run.cached_tokens == 0


def fake_session(nqfile, monkeypatch, **kw):
    """A CudaSession (context 100, eager, 320 KV tokens) on the fake driver: kernels that do nothing."""
    from nanoqwen.runtime import session as session_mod

    class Props:
        name, total_mem, free_mem, compute_capability = "Fake H200", 1 << 40, 1 << 40, (9, 0)
        sm_count, max_smem_optin = 132, 227 * 1024

    class Fn(FakeFn):
        def launch(self, launch, stream=None, pdl=False, **args):
            pass

    fake = type("D", (FakeDriver,), {"device": staticmethod(lambda: type("Dev", (), {"props": Props})()),
                                     "load": staticmethod(lambda built, carveout: Fn(None, carveout))})
    fake_runner(nqfile, monkeypatch)   # the fake driver in the parts' modules
    monkeypatch.setattr(session_mod, "driver", fake)
    monkeypatch.setattr(session_mod.codegen, "build_many", lambda specs, **kw: [None for _ in specs])
    monkeypatch.setattr(session_mod, "Weights", lambda f, progress=None, verify=True: FakeWeights(f))
    monkeypatch.setattr(session_mod, "PagedKVCache", FakeKV)
    return session_mod.CudaSession(nqfile.path, 100, eager=True, log=lambda m: None, kv_tokens=320, **kw)


def test_session_wires_the_parts(nqfile, monkeypatch):
    """CudaSession on the fake driver (eager, kernels that do nothing): the memory table it checks is
    what the parts allocate, the KV pool holds kv_tokens, warm-up runs a request and leaves nothing
    kept, and a GPU without the memory is refused in one line before anything is built."""
    from nanoqwen.runtime import session as session_mod
    s = fake_session(nqfile, monkeypatch)
    d = nqfile.dims
    assert s.context == 100 and s.kv.layout.num_pages == 20 and s.decoder.graph is None
    assert not s.runner.cache.kept and s.runner.cache.pool.free == 20
    parts = {"state": s.state.bufs, "decode": s.decoder.bufs, "prefill": s.prefiller.bufs, "rows": s.rows.bufs}
    allocated = {f"{p}.{n}": b[n].nbytes for p, b in parts.items() for n in b.names}
    assert {k: v for k, v in s.device_bytes.items() if k not in ("weights", "kv")} == allocated
    assert s.device_bytes["kv"] == s.kv.layout.total_bytes and s.device_bytes["weights"] == weights_mod.plan(nqfile).nbytes
    assert s.device_bytes["state.tokens_out"] == 400 and s.device_bytes["decode.h"] == 4 * d.hidden
    # the one-row step's kernels take launch.smem_carveout; prefill's and the m-row steps' the driver's split (-1)
    step = {role for role, *_ in s.decoder.sequence}
    splits = {role: fn.carveout for role, (_, fn) in s.decoder.kernels.items()}
    assert {splits[r] for r in step} == {config.default().launch.smem_carveout}
    assert {c for r, c in splits.items() if r not in step} == {-1}
    assert {fn.carveout for roles in s.rows.kernels.values() for _, fn in roles.values()} == {-1}
    assert len(list(s.generate([1, 2, 3], 4))) == 4 and s.cached_tokens == 0
    assert len(list(s.generate([1, 2, 3, 4], 2))) == 2 and s.cached_tokens == 3
    assert s.pages() == (0, 1, 20)   # the server's KV pages gauges: none running, one sequence of 5 kept
    closed = []

    class Setting(Script):   # a drafter setting put in by hand, as tests/gpu/test_speculate.py does
        def close(self):
            closed.append(self)

    s.runner.speculate = setting = Setting([], lambda t: t, 1)
    s.close()
    assert closed == [setting], "the session's close closes its drafter setting"
    session_mod.driver.device().props.free_mem = sum(s.device_bytes.values()) - 1   # the fake Props class
    monkeypatch.setattr(session_mod.codegen, "build_many", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(memory_mod.DeviceMemoryError, match="not enough GPU memory"):
        session_mod.CudaSession(nqfile.path, 100, eager=True, log=lambda m: None, kv_tokens=320)


requests = st.lists(st.tuples(st.integers(0, 2),                       # which base text
                              st.integers(1, 30),                      # how much of it
                              st.lists(st.integers(0, 511), max_size=3),   # then these tokens
                              st.integers(1, 10),                      # max_new_tokens
                              st.integers(1, 10)),                     # tokens read before closing
                    min_size=1, max_size=6)
BASES = [PROMPT + PROMPT[::-1], [300, 301, 302] * 10, PROMPT[:5] + [9] * 25]


@given(requests, st.sampled_from([1, 3, 8]), st.sampled_from([None, 160]))
@settings(max_examples=25)
def test_random_request_streams_on_the_fake_device(nqfile, reqs, ahead, kv_tokens):
    """Random streams of requests sharing prefixes, closed early or not, in a pool of one or several
    sequences: every token equals a cold token-by-token reference generation (the fake device's K/V of
    a reused prefix came from the same computations, so equality is exact), the pages the steps read
    hold the sequence's tokens (FakeDevice.write), and no page is lost."""
    with pytest.MonkeyPatch.context() as mp:
        run, dev = fake_device(nqfile, mp, Reference(tiny_weights(nqfile), max_seq=64), capacity=48, ahead=ahead,
                               kv_tokens=kv_tokens)
        for base, cut, extra, new, read in reqs:
            prompt = (BASES[base][:cut] + extra)[:40]
            new = min(new, 48 - len(prompt) + 1)
            it = run.generate(prompt, new)
            got = [tok for tok, _ in zip(it, range(min(read, new)))]
            it.close()
            assert run.cached_tokens <= len(prompt) - 1
            assert got == cold_greedy(nqfile, tuple(prompt), new)[:len(got)]
            c = run.cache
            assert c.pool.free + c.kept_pages == c.pool.num_pages


@functools.cache
def tiny_weights(nqfile):
    return ReferenceWeights.from_file(nqfile)


@functools.cache
def cold_greedy(nqfile, prompt: tuple, n: int) -> list[int]:
    """Token-by-token greedy generation from an empty cache (the fake device's numerics)."""
    cold = Reference(tiny_weights(nqfile), max_seq=64)
    for t in prompt:
        logits = cold.decode(t)
    return reference_generation(cold, logits, n, Sampling())
