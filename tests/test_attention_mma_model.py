"""numpy model of the "mma" pipeline of templates/attention_decode.cu.j2 (no GPU): the producer's cp.async
chunk map into the padded ring rows, ldmatrix and mma.sync m16n8k16 as the PTX ISA maps their fragments to
lanes (lane = 4 g + t), driven by the kernel's own address arithmetic (ROW, the producer's chunk addresses
and zero-fill of garbage V rows, the ldmatrix row addresses, the q / p hi + lo split), against direct
attention math on one page. A wrong lane map or address shows here as wrong scores or outputs before any
GPU run; the GPU tests then check the kernel itself."""

from __future__ import annotations

import numpy as np
import pytest

HD, PAGE, GQA = 128, 16, 7   # the 7B's head dim, page and GQA group
ROW = HD + 8                 # the ring's padded row stride, in halves
SCALE2 = np.log2(np.e) / np.sqrt(HD)
ZERO = np.zeros(2, np.float16)


def ldmatrix_x4(smem, row_addr, trans=False):
    """[lane][matrix i] -> the lane's two halves; lanes 8i..8i+7 give matrix i's row addresses (in halves)."""
    r = np.zeros((32, 4, 2), np.float16)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            if trans:   # rows 2t, 2t + 1 of column g
                r[lane, i] = smem[row_addr[8 * i + 2 * t] + g], smem[row_addr[8 * i + 2 * t + 1] + g]
            else:       # row g, columns 2t, 2t + 1
                r[lane, i] = smem[row_addr[8 * i + g] + 2 * t: row_addr[8 * i + g] + 2 * t + 2]
    return r


def mma(d, a, b0, b1):
    """d += A B for m16n8k16 fragments: a[lane] = 4 half pairs, b0 / b1[lane] = a half pair each."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[lane][0], a[lane][1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[lane][2], a[lane][3]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0[lane], b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d[lane] += C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]


def produce(ring, page, keys, zero_fill, hd=HD):
    """The producer warp's cp.async of one page ([PAGE * hd] halves in global) into a ring slot: lane l copies
    16-byte chunks c = 32 i + l, chunk c = halves 8 (c % LPR) of row c / LPR at the padded stride; with
    zero_fill (V) rows from `keys` on land as zeros. Returns [pass i][lane] -> (global, shared) half offsets."""
    lpr, row_stride, addrs = hd // 8, hd + 8, []
    for i in range(PAGE * lpr // 32):
        addrs.append([])
        for lane in range(32):
            c = 32 * i + lane
            row, src = c // lpr, 8 * lane + 8 * 32 * i
            dst = row * row_stride + 8 * (c % lpr)
            ring[dst:dst + 8] = 0 if zero_fill and row >= keys else page[src:src + 8]
            addrs[-1].append((src, dst))
    return addrs


@pytest.mark.parametrize("hd", [64, 128])
def test_mma_producer_chunks_coalesced_and_conflict_free(hd):
    """Each chunk of a page is copied once into its padded place; per pass the warp reads one contiguous
    512-byte span of global memory, and each quarter warp's 16-byte shared stores hit 8 distinct 4-bank groups."""
    page = np.arange(PAGE * hd, dtype=np.float64)
    ring = np.full(PAGE * (hd + 8), -1.0)
    addrs = produce(ring, page, PAGE, False, hd)
    want = np.full(PAGE * (hd + 8), -1.0)
    for r in range(PAGE):
        want[r * (hd + 8):r * (hd + 8) + hd] = page[r * hd:(r + 1) * hd]
    assert (ring == want).all()
    for i, lanes in enumerate(addrs):
        assert [src for src, _ in lanes] == [8 * (32 * i + lane) for lane in range(32)]
        for q in range(4):
            assert len({(2 * dst // 16) % 8 for _, dst in lanes[8 * q:8 * q + 8]}) == 8, (i, q)


def hi_lo(a, b):
    """attention.cuh's f16_hi_lo."""
    hi = np.array([a, b], np.float16)
    return hi, np.array([a - np.float32(hi[0]), b - np.float32(hi[1])], np.float16)


def quad(x, lane):
    return x[lane] + x[lane ^ 1] + x[lane ^ 2] + x[lane ^ 3]


@pytest.mark.parametrize("keys", [1, 11, 16])
def test_mma_consumer_fragments_give_attention(keys):
    rng = np.random.default_rng(keys)
    q = (3 * rng.standard_normal((GQA, HD))).astype(np.float32)
    K = rng.standard_normal((PAGE, HD)).astype(np.float16)
    V = rng.standard_normal((PAGE, HD)).astype(np.float16)
    # the ring slot holds NaN (an older page's garbage) until the producer lands this page; the page's
    # K and V past the sequence end are garbage (NaN) in global memory, V's must land as zeros
    ks, vs = np.full(PAGE * ROW, np.nan, np.float16), np.full(PAGE * ROW, np.nan, np.float16)
    garbage = np.arange(PAGE)[:, None] >= keys
    produce(ks, np.where(garbage, np.float16(np.nan), K).reshape(-1), keys, False)
    produce(vs, np.where(garbage, np.float16(np.nan), V).reshape(-1), keys, True)

    # q's A fragments (head hg = lane >> 2, rows past GQA zero), S = Q K^T over 8 k16 steps, hi then lo
    qf = np.zeros((32, HD // 16, 2, 2, 2), np.float16)   # [lane][kk][half][hi/lo][pair]
    for lane in range(32):
        hg, t = lane >> 2, lane & 3
        for kk in range(HD // 16):
            for half in range(2):
                v = q[hg, 16 * kk + 8 * half + 2 * t:][:2] if hg < GQA else np.zeros(2, np.float32)
                qf[lane, kk, half] = hi_lo(*v)
    s = np.zeros((2, 32, 4))
    for kk in range(HD // 16):
        b = ldmatrix_x4(ks, [((ln & 7) + 8 * (ln >> 4)) * ROW + 16 * kk + 8 * ((ln >> 3) & 1) for ln in range(32)])
        for part in range(2):
            a = [[qf[ln, kk, 0, part], ZERO, qf[ln, kk, 1, part], ZERO] for ln in range(32)]
            mma(s[0], a, b[:, 0], b[:, 1])
            mma(s[1], a, b[:, 2], b[:, 3])
    S_ref = q.astype(np.float64) @ K.astype(np.float64).T * SCALE2   # [GQA, PAGE]
    for lane in range(4 * GQA):
        for j in range(2):
            for e in range(2):
                key = 8 * j + 2 * (lane & 3) + e
                if key < keys:   # a garbage key's score is garbage, masked by select below
                    want = S_ref[lane >> 2, key]
                    assert abs(s[j, lane, e] * SCALE2 - want) <= 1e-4 * max(1.0, abs(want))

    # the page's softmax on the fragments (a quad max), P (hi + lo) as the A operand of P V
    sc = np.full((2, 32, 2), -np.inf)
    for lane in range(32):
        for j in range(2):
            for e in range(2):
                if 8 * j + 2 * (lane & 3) + e < keys:
                    sc[j, lane, e] = s[j, lane, e] * SCALE2
    mx = sc.max(axis=(0, 2))
    mx = np.array([max(mx[ln], mx[ln ^ 1], mx[ln ^ 2], mx[ln ^ 3]) for ln in range(32)])
    p = np.exp2(sc - mx[None, :, None])
    l = p.sum(axis=(0, 2))
    pf = np.zeros((2, 32, 4, 2), np.float16)   # [hi/lo][lane][a register][pair]
    for lane in range(32):
        for j in range(2):
            pf[:, lane, 2 * j] = hi_lo(p[j, lane, 0], p[j, lane, 1])
    o = np.zeros((HD // 8, 32, 4))
    for dp in range(HD // 16):
        b = ldmatrix_x4(vs, [((ln & 7) + 8 * ((ln >> 3) & 1)) * ROW + 16 * dp + 8 * (ln >> 4) for ln in range(32)],
                        trans=True)
        for part in range(2):
            mma(o[2 * dp], pf[part], b[:, 0], b[:, 1])
            mma(o[2 * dp + 1], pf[part], b[:, 2], b[:, 3])

    P_ref = np.exp2(S_ref[:, :keys] - S_ref[:, :keys].max(axis=1, keepdims=True))
    O_ref = P_ref @ V[:keys].astype(np.float64)
    for lane in range(4 * GQA):
        hg, t = lane >> 2, lane & 3
        assert abs(quad(l, lane) - P_ref[hg].sum()) <= 1e-5 * P_ref[hg].sum()
        got = np.array([o[d, lane, e] for d in range(HD // 8) for e in range(2)])
        want = np.array([O_ref[hg, 8 * d + 2 * t + e] for d in range(HD // 8) for e in range(2)])
        assert np.isfinite(got).all(), "a garbage V row reached O"
        assert np.abs(got - want).max() <= 1e-5 * (1 + np.abs(want).max())
