"""CPU checks of the decode runtime's wiring, no GPU: the weight layout (q/k/v stacked back to back, every
region aligned, nothing overlapping), and the decoder's launch sequence against every kernel's
signature, with a fake driver whose buffers are address ranges (so every pointer argument is checked
to land inside the buffer or weight region it names)."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import config, testmodels
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.pack import pack_random
from nanoqwen.runtime import decoder as decoder_mod
from nanoqwen.runtime import weights as weights_mod
from nanoqwen.reference import Reference
from nanoqwen.runtime.paged_kv import KVLayout, PageTable
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

    @classmethod
    def from_array(cls, arr):
        b = cls(arr.nbytes)
        b.mem[:] = np.ascontiguousarray(arr).view(np.uint8).ravel()
        return b

    def memset_u32(self, v, stream=None):
        self.mem.view(np.uint32)[:] = v

    def array(self, dtype, shape=None):
        return self.mem.view(dtype)

    def download(self, out):
        out.view(np.uint8).ravel()[:] = self.mem[:out.nbytes]
        return out

    def free(self):
        pass

    def close(self):
        pass


MEM: list = []


def at(ptr: int, n: int) -> np.ndarray:
    """The n bytes at fake address ptr."""
    for b in MEM:
        if b.ptr <= ptr and ptr + n <= b.ptr + b.nbytes:
            return b.mem[ptr - b.ptr:ptr - b.ptr + n]
    raise AssertionError(f"fake address {ptr:#x}+{n} is in no buffer")


class FakeCu:
    """The few driver calls the decoder makes itself; copies execute at once (a synchronous GPU)."""
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
    def cuEventQuery(cls, handle):
        return cls._ok()
class FakeFn:
    def __init__(self, spec):
        self.spec = spec


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
        self.base = FakeBuf(self.plan.nbytes)

    def ptr(self, region):
        return self.base.ptr + self.plan.regions[region].offset


class FakeKV:
    def release(self):
        self.reserved = 0

    def reserve(self, n):
        self.reserved = n

    def __init__(self, layout):
        self.layout = layout
        self.k = [FakeBuf(layout.pool_bytes) for _ in range(layout.layers)]
        self.v = [FakeBuf(layout.pool_bytes) for _ in range(layout.layers)]
        self.page_table = FakeBuf(layout.table_bytes)

    def k_ptr(self, i):
        return self.k[i].ptr

    def v_ptr(self, i):
        return self.v[i].ptr


def fake_decoder(nqfile, monkeypatch, capacity=100, **kw):
    cfg = config.default()
    d = nqfile.dims
    monkeypatch.setattr(decoder_mod, "driver", FakeDriver)
    monkeypatch.setattr(decoder_mod, "cu", FakeCu)
    specs = decoder_mod.step_specs(d, cfg)
    kernels = {role: (spec, FakeFn(spec)) for role, spec in specs.items()}
    layout = KVLayout.for_model(d, cfg, capacity)
    w, kv = FakeWeights(nqfile), FakeKV(layout)
    rope = (np.zeros((capacity, d.head_dim // 2), np.float32),) * 2
    return decoder_mod.Decoder(d, w, kv, kernels, rope, capacity, **kw), w, kv, kernels


def test_launch_sequence_matches_signatures(nqfile, monkeypatch):
    d = nqfile.dims
    dec, w, kv, kernels = fake_decoder(nqfile, monkeypatch)
    roles = [role for role, *_ in dec.sequence]
    per_layer = ["qkv", "rope_append", "attention_decode", "attention_combine", "o_proj", "gate_up", "down"]
    assert roles == ["embed"] + per_layer * d.layers + ["lm_head"]
    buffers = [v for v in vars(dec).values() if isinstance(v, FakeBuf)] + [w.base, kv.page_table, *kv.k, *kv.v]
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
    gu = [a for r, _, _, a in dec.sequence if r == "gate_up"][0]
    assert (gu["w0"], gu["w1"]) == (w.ptr("L0.gate.packed"), w.ptr("L0.up.packed"))


def test_page_table_reservation_covers_request():
    """What Decoder.generate reserves (prompt + max_new_tokens - 1 positions) maps every page it writes."""
    d = testmodels.tiny_dims()
    layout = KVLayout.for_model(d, config.default(), 40)
    pt = PageTable(layout)
    pt.reserve(17 + 16 - 1)
    for pos in range(32):
        assert pt.locate(pos)[0] >= 0


def reference_step(dec, ref, fed: list):
    """A stand-in for one decode step on the fake device: the reference decodes the token in the
    device state, writes logits, tokens_out and the advanced state as lm_head_argmax would, and records
    the token it was fed."""
    def step(stream=None):
        state = dec.state.mem.view(np.int32)
        tok, pos, k = (int(x) for x in state[:3])
        assert pos == ref.pos == k, f"device state {state[:3]} vs reference position {ref.pos}"
        assert dec.kv.reserved > pos, "a step ran on a position that has no reserved page"
        logits = ref.decode(tok)
        dec.logits.mem.view(np.float32)[:] = logits
        dec.tokens_out.mem.view(np.int32)[k] = int(np.argmax(logits))
        state[:3] = (int(np.argmax(logits)), pos + 1, k + 1)
        fed.append(tok)
    return step


def reference_generation(ref, logits, n: int, sampling) -> list[int]:
    """The n tokens the reference generates from the last prompt logits, with the host sampler."""
    sample, want = HostSampler(sampling), []
    for i in range(n):
        want.append(sample(logits))
        if i + 1 < n:
            logits = ref.decode(want[-1])
    return want


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, seed=11)])
@pytest.mark.parametrize("ahead", [1, 8])
def test_generate_host_logic(nqfile, monkeypatch, sampling, ahead):
    """Decoder.generate's host side (prefill feeding, launch-ahead, pinned read-back, sampling feed,
    early close) over a fake device whose "step" is the numpy reference reading and advancing the
    device state exactly as the kernels do. Its tokens must be the reference's own generation."""
    dec, *_ = fake_decoder(nqfile, monkeypatch, ahead=ahead)
    ref = Reference.from_file(nqfile, max_seq=100)
    steps = []
    monkeypatch.setattr(dec, "launch_kernels", reference_step(dec, ref, steps))
    prompt = [5, 17, 9, 300, 41, 7, 77, 123, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    for n in (1, 2, 12):
        ref.reset()
        steps.clear()
        got = list(dec.generate(prompt, n, sampling))
        ref.reset()
        for t in prompt:  # token by token, like the fake device: batched prefill rounds differently
            logits = ref.decode(t)
        want = reference_generation(ref, logits, n, sampling)
        assert got == want
        assert steps == prompt + want[:-1], "the device was fed something other than prompt + generated"
    # closing early: the steps launched ahead stay bounded by the request
    ref.reset()
    it = dec.generate(prompt, 12, sampling)
    next(it)
    it.close()
    assert len(prompt) <= ref.pos <= len(prompt) + (ahead if sampling.greedy else 0)
