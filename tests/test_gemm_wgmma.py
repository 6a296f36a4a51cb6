"""The wgmma INT4 GEMM (gemm_wgmma) on the CPU: the 7B / tiny-model GEMMs and non-default tiles render and
compile for sm_90a with no spills and no local memory and their SASS issues HGMMA of the tile's shape (with
`inflight` 1, a per-chunk wait that leaves one group running); bad specs are rejected
with a message naming the field; the grid follows M; a numpy model of one tile checks the index maps
against the PTX ISA rules: X's shared-memory layout read back through the K-major no-swizzle descriptor
(core matrix rows 16 bytes apart, SBO between 8-token groups, LBO between k halves) is X^T, the copy
slots cover the tile once with bank-conflict-free 128-byte runs, each lane's nibble-pair dequant lands on
wgmma's A fragment map, and the SwiGLU row order gives one lane the gate and up of the same output; and a
model of the producer / consumer ring (its mbarrier phases, parities and lag, as the template writes
them) runs every interleaving a random scheduler finds without a deadlock, a read of an unpublished tile
or an overwrite of a tile still in use."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from nanoqwen import config, quant
from nanoqwen.codegen import resources
from nanoqwen.codegen.kernels import gemm_wgmma as W
from nanoqwen.codegen.spec import Launch, SpecError
from nanoqwen.dims import QWEN25_7B
from nanoqwen.testmodels import tiny_dims

CFG = config.default()


def _specs():
    out = W.specs_for_model(QWEN25_7B, CFG) + W.specs_for_model(tiny_dims(), CFG)
    qkv = W.model_gemms(QWEN25_7B)["qkv"]
    gu = W.model_gemms(QWEN25_7B)["gate_up"]
    out += [replace(qkv, epilogue="f16"), replace(qkv, bm=128, bn=128),
            replace(gu, consumers=1, bn=128), replace(qkv, consumers=1, bn=64, bm=256, stages=4),
            replace(gu, bk=128, stages=4), replace(qkv, inflight=0, stages=3), replace(gu, inflight=0)]
    return list(dict.fromkeys(out))


SPECS = _specs()


@pytest.fixture(scope="module")
def built(fresh_build):
    return {b.spec: b for b in fresh_build(SPECS)}


@pytest.mark.parametrize("spec", SPECS, ids=[s.uri for s in SPECS])
def test_compiles_without_spills(built, spec):
    b = built[spec]
    r = b.resources
    assert r.local_bytes == 0 and r.spill_stores == 0 and r.spill_loads == 0, f"{spec.uri}: {r}"
    assert r.registers * spec.threads <= 65536
    # e.g. "wgmma.mma_async instructions are serialized": a warning means the pipeline is broken
    assert "warning" not in b.log.lower(), f"{spec.uri}: ptxas warns: {b.log}"


@pytest.mark.skipif(resources.tool("cuobjdump") is None and resources.tool("nvdisasm") is None,
                    reason="no cuobjdump / nvdisasm to read SASS")
@pytest.mark.parametrize("spec", SPECS, ids=[s.uri for s in SPECS])
def test_sass_uses_warpgroup_mma(built, spec):
    sass = resources.sass(built[spec].cubin)
    shape = f"HGMMA.64x{spec.bm}x16.F32"
    assert shape in sass, f"{spec.uri}: no {shape} in the SASS"
    assert "HMMA" not in sass, f"{spec.uri}: mma.sync in the SASS"
    assert "LDL" not in sass and "STL" not in sass, f"{spec.uri}: local memory traffic in the SASS"
    # the per-chunk wait keeps `inflight` groups running (ptxas did not turn it into a full drain)
    waits = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    assert waits == ({"0x1", "0x0"} if spec.inflight else {"0x0"}), f"{spec.uri}: wgmma waits {waits}"


@pytest.mark.parametrize("kw,field", [
    (dict(epilogue="gelu"), "epilogue"), (dict(epilogue="residual", bias=True), "bias"),
    (dict(bk=32), "bk"), (dict(bm=96), "bm"), (dict(bm=320), "bm"), (dict(bn=64), "bn"),
    (dict(bn=512), "bn"), (dict(n=4608 + 64), "n"), (dict(k=3584 + 64), "k"), (dict(stages=2), "stages"),
    (dict(stages=9), "stages"), (dict(inflight=2), "inflight"), (dict(consumers=3), "consumers"),
    (dict(bm=256), "accumulators"), (dict(consumers=1, bm=256), "accumulators"),
    (dict(consumers=1, bn=64, bm=256, bk=128, stages=8), "shared memory"), (dict(max_m=0), "max_m"),
    (dict(group=96), "group"),
])
def test_bad_specs_are_rejected(kw, field):
    with pytest.raises(SpecError, match=field):
        replace(W.model_gemms(QWEN25_7B)["qkv"], **kw).validate()


def test_launch_follows_m():
    s = W.model_gemms(QWEN25_7B)["qkv"]
    ring = 6 * (64 * 64 * 2 + 256 * 64 // 2 + 16)   # six stages of X and W, a full and an empty mbarrier each
    assert s.launch(1) == Launch(grid=(4608 // 256, 1, 1), block=(384, 1, 1), smem=ring)
    assert s.launch(65).grid == (18, 2, 1) and s.launch().grid == (18, 4096 // 64, 1)
    assert replace(s, bn=64, consumers=1).launch(7).block == (256, 1, 1)
    with pytest.raises(SpecError, match="m must be positive"):
        s.launch(0)


def test_listed_for_gen_and_in_the_runtime_plan_only_when_asked():
    """The family is in the model's kernel list (nanoqwen-gen); the runtime's prefill builds it only with
    prefill.wgmma, and then for every GEMM role of every chunk size (two tiles of one arithmetic: chunk
    invariance);
    prefill.wgmma with prefill.gemv_order is refused."""
    from nanoqwen import codegen
    from nanoqwen.config import ConfigError
    from nanoqwen.runtime import prefill
    assert set(W.specs_for_model(QWEN25_7B, CFG)) <= set(codegen.model_kernels(QWEN25_7B, CFG))
    assert not any(s.family == "gemm_wgmma" for s in prefill.prefill_specs(QWEN25_7B, CFG).values())
    cfg = replace(CFG, prefill=replace(CFG.prefill, wgmma=True))
    plan = prefill.prefill_specs(QWEN25_7B, cfg)
    gemms, short = W.model_gemms(QWEN25_7B), W.model_gemms(QWEN25_7B, small_m=True)
    for role, spec in gemms.items():
        assert plan[f"prefill.{role}"] == spec and plan[f"prefill.{prefill.SMALL}{role}"] == short[role]
        # what orders a row's sum is the instruction's N (bm) and the K walk (bk): the same in both tiles
        assert (short[role].bm, short[role].bk) == (spec.bm, spec.bk) and short[role].launch(32).grid[0] >= 56
    assert not any(s.family == "gemm_int4" for s in plan.values())
    with pytest.raises(ConfigError, match="exclude each other"):
        replace(CFG.prefill, wgmma=True, gemv_order=True)


# ---- numpy model of one tile ----------------------------------------------------------------------------------


def _descriptor_read(smem: np.ndarray, start: int, lbo: int, sbo: int, n: int) -> np.ndarray:
    """B [16, n] fp16 as wgmma reads a K-major no-swizzle tile (PTX ISA, matrix descriptor): element
    (k, j) at start + (j // 8) sbo + (k // 8) lbo + (j % 8) 16 + (k % 8) 2."""
    b = np.empty((16, n), np.float16)
    for k in range(16):
        for j in range(n):
            off = start + j // 8 * sbo + k // 8 * lbo + j % 8 * 16 + k % 8 * 2
            b[k, j] = smem[off:off + 2].view(np.float16)[0]
    return b


@pytest.mark.parametrize("bm,bk", [(64, 64), (128, 64), (128, 128)])
def test_x_layout_is_what_the_descriptor_reads(bm, bk):
    spec = replace(W.model_gemms(QWEN25_7B)["qkv"], bm=bm, bk=bk)
    x = np.random.default_rng(0).standard_normal((bm, bk)).astype(np.float16)
    smem = np.zeros(bm * bk * 2, np.uint8)
    seen = set()
    for i in range(bm * bk // 8):
        r, c = spec.x_copy(i)
        off = spec.x_offset(r, c)
        smem[off:off + 16] = x[r, 8 * c:8 * c + 8].view(np.uint8)
        seen.add((r, c))
        if i % 8 == 0:   # 8 consecutive slots (one shared-store phase) write 128 contiguous bytes
            assert [spec.x_offset(*spec.x_copy(i + d)) for d in range(8)] == [off + 16 * d for d in range(8)]
    assert len(seen) == bm * bk // 8
    for kk in range(bk // 16):   # one instruction's B: all bm tokens of k-step kk
        b = _descriptor_read(smem, 2 * kk * spec.x_lbo, spec.x_lbo, spec.x_sbo, bm)
        np.testing.assert_array_equal(b, x[:, 16 * kk:16 * kk + 16].T)


def _int4_pair(word: int, scale: np.float16) -> tuple[np.float16, np.float16]:
    """int4.cuh's magic-number unpack of the nibbles at bits 0 and 16 of ``word``, times the scale in fp16."""
    biased = ((word ^ 0x88888888) & 0x000F000F) | 0x64006400
    lo, hi = np.array([biased & 0xFFFF, biased >> 16], np.uint16).view(np.float16)
    return (np.float16(lo - np.float16(1032)) * scale, np.float16(hi - np.float16(1032)) * scale)


@pytest.mark.parametrize("epilogue", ["f32", "swiglu"])
def test_a_fragments_and_swiglu_rows(epilogue):
    """One warpgroup, one k16 step: the lanes' dequantized A fragments placed by wgmma's A map rebuild the
    dequantized weight tile in the tile-row order weight_row() gives; with SwiGLU, the D map's two rows of a
    lane (g and g + 8) are the gate and up rows of one output."""
    spec = W.model_gemms(QWEN25_7B)["gate_up" if epilogue == "swiglu" else "qkv"]
    rng = np.random.default_rng(1)
    halves = [quant.quantize(rng.standard_normal((64, 128)).astype(np.float32)) for _ in range(2)]
    packed = [quant.pack(q) for q, _ in halves]
    deq = [quant.dequantize(p, s) for p, (_, s) in zip(packed, halves)]
    rows = [spec.weight_row(n) for n in range(64)]
    assert len(set(rows)) == 64 and all(r < 64 for _, r in rows)
    kk = 3
    a = np.full((64, 16), np.nan, np.float32)
    for lane_id in range(128):
        warp, g, t = lane_id // 32, lane_id % 32 // 4, lane_id % 4
        regs = []
        for dr, dw in ((0, 0), (8, 0), (0, 1), (8, 1)):          # a[0..3]: (g, 2t) (g+8, 2t) (g, 2t+8) (g+8, 2t+8)
            half, row = rows[16 * warp + g + dr]
            word = int(packed[half][row, 2 * kk + dw]) >> (4 * t)
            regs.append(_int4_pair(word, halves[half][1][row, 0]))
        for reg, (dr, dk) in zip(regs, ((0, 0), (8, 0), (0, 8), (8, 8))):
            a[16 * warp + g + dr, 2 * t + dk:2 * t + dk + 2] = reg
    want = np.stack([deq[h][r, 16 * kk:16 * kk + 16] for h, r in rows])
    np.testing.assert_array_equal(a, want.astype(np.float16))   # the kernel rounds q * scale to fp16 once
    if epilogue == "swiglu":
        for warp in range(4):
            for g in range(8):
                (hg, og), (hu, ou) = rows[16 * warp + g], rows[16 * warp + g + 8]
                assert (hg, hu) == (0, 1) and og == ou == 8 * warp + g


# ---- model of the producer / consumer ring ------------------------------------------------------------------


class _Ring:
    """The template's ring protocol with its own index and parity formulas, one agent per role: the producer
    warpgroup (its threads act alike; a full barrier's phase completes on its one arrival here), each
    consumer warpgroup (empty completes on all of their arrivals), plus the hardware's asynchronous events:
    a cp.async group landing (in commit order) and a wgmma group retiring (in commit order, per warpgroup).
    mbarrier try_wait.parity(P) succeeds once the phase of parity P completed: with c phases completed,
    iff c % 2 != P (a fresh barrier passes parity 1: the phase before phase 0)."""

    def __init__(self, spec: W.GemmWgmmaSpec, kt: int, rng):
        self.s, self.kt, self.rng = spec, kt, rng
        S, C = spec.stages, spec.consumers
        self.full_done, self.empty_done = [0] * S, [0] * S        # completed phases
        self.empty_pending = [0] * S                              # arrivals in the current phase
        self.slot_tile = [None] * S                               # which tile the slot's copies hold
        self.landed, self.published = set(), set()
        self.copies = []                                          # committed, not yet landed
        self.reading = [dict() for _ in range(C)]                 # warpgroup -> {tile: wgmma groups running}
        self.inflight = [[] for _ in range(C)]                    # committed wgmma groups, oldest first
        self.agents = [self._producer()] + [self._consumer(c) for c in range(C)]
        self.waits = [None] * len(self.agents)                    # the condition an agent is blocked on

    @staticmethod
    def _passes(done: int, parity: int) -> bool:
        return done % 2 != parity

    def _producer(self):
        s, S, lag = self.s, self.s.stages, self.s.lag
        for kt in range(self.kt):
            if kt >= lag:   # cp.async.wait_group lag - 1, fence, arrive on full[(kt - lag) % S]
                yield lambda: len(self.copies) <= lag - 1
                self._publish(kt - lag)
            slot = kt % S
            if kt >= S:
                yield lambda slot=slot, p=(kt // S - 1) & 1: self._passes(self.empty_done[slot], p)
                assert all(kt - S not in r for r in self.reading), f"tile {kt} overwrites tile {kt - S} in use"
            self.slot_tile[slot] = kt
            self.landed.discard(kt - S)
            self.copies.append(kt)
        yield lambda: not self.copies
        for kt in range(max(self.kt - lag, 0), self.kt):
            self._publish(kt)

    def _publish(self, kt: int) -> None:
        assert kt in self.landed, f"tile {kt} published before it landed"
        self.published.add(kt)
        self.full_done[kt % self.s.stages] += 1

    def _consumer(self, c: int):
        S, chunks, inflight = self.s.stages, self.s.bk // 32, self.s.inflight
        for kt in range(self.kt):
            slot = kt % S
            yield lambda slot=slot, p=(kt // S) & 1: self._passes(self.full_done[slot], p)
            assert self.slot_tile[slot] == kt and kt in self.published, f"consumer {c} reads tile {kt} unpublished"
            for ch in range(chunks):
                self.reading[c][kt] = self.reading[c].get(kt, 0) + 1
                self.inflight[c].append(kt)
                yield lambda: len(self.inflight[c]) <= inflight   # wgmma.wait_group inflight
                if inflight == 1 and ch == 0 and kt > 0:
                    self._release(kt - 1)
                if inflight == 0 and ch == chunks - 1:
                    self._release(kt)

    def _release(self, kt: int) -> None:
        slot = kt % self.s.stages
        self.empty_pending[slot] += 1
        if self.empty_pending[slot] == self.s.consumers:
            self.empty_pending[slot] = 0
            self.empty_done[slot] += 1

    def run(self) -> None:
        done = [False] * len(self.agents)
        while not all(done):
            moves = [i for i, w in enumerate(self.waits) if not done[i] and (w is None or w())]
            if self.copies:
                moves.append("land")
            moves += [("retire", c) for c in range(self.s.consumers) if self.inflight[c]]
            assert moves, "deadlock: every agent waits and nothing is in flight"
            m = moves[self.rng.integers(len(moves))]
            if m == "land":
                self.landed.add(self.copies.pop(0))
            elif isinstance(m, tuple):
                c = m[1]
                kt = self.inflight[c].pop(0)
                self.reading[c][kt] -= 1
                if not self.reading[c][kt]:
                    del self.reading[c][kt]
            else:
                try:
                    self.waits[m] = next(self.agents[m])
                except StopIteration:
                    done[m] = True


@pytest.mark.parametrize("kw", [dict(), dict(inflight=0), dict(consumers=1), dict(stages=3), dict(stages=8),
                                dict(stages=3, inflight=0), dict(bk=128, stages=4)])
@pytest.mark.parametrize("kt", [1, 2, 5, 28])
def test_ring_protocol_has_no_race_and_no_deadlock(kw, kt):
    spec = replace(W.model_gemms(QWEN25_7B)["qkv"], **kw)
    spec.validate()
    rng = np.random.default_rng(kt)
    for _ in range(30):
        _Ring(spec, kt, rng).run()
