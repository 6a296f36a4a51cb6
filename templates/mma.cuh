// Tensor-core helpers for the prefill kernels: cp.async (global -> shared without registers),
// ldmatrix (shared -> mma fragments) and mma.sync m16n8k16 fp16 x fp16 -> fp32.
// Header-free like common.cuh: every operation is one line of inline PTX.
//
// Fragment maps of mma.m16n8k16 (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type"),
// lane = 4 * g + t (g = lane / 4 "groupID", t = lane % 4 "threadID_in_group"):
//   A (16x16, row): a[0] = (row g,   cols 2t, 2t+1)   a[1] = (row g+8, cols 2t, 2t+1)
//                   a[2] = (row g,   cols 2t+8, 2t+9) a[3] = (row g+8, cols 2t+8, 2t+9)
//   B (16x8, col):  b[0] = (rows k 2t, 2t+1, col n g)  b[1] = (rows k 2t+8, 2t+9, col n g)
//   C/D (16x8 f32): c[0], c[1] = (row g, cols 2t, 2t+1)  c[2], c[3] = (row g+8, cols 2t, 2t+1)
// Each f16x2 register holds its lower-indexed element in the low 16 bits.
// Note the C map of two adjacent n8 tiles equals the A map of one k16 tile: a softmax row block
// computed as C becomes the A operand of the next mma without shuffles (flash-attention 2).
#pragma once
#include "common.cuh"
#include "async_copy.cuh"  // smem_addr: the 32-bit .shared address cp.async and ldmatrix take
#include "int4.cuh"        // int4_pair: the magic-number nibble-pair unpack shared with the GEMVs

// ---- cp.async ---------------------------------------------------------------------------------------
// 16-byte global -> shared copy that bypasses registers (and L1: .cg), so a multi-stage ring can keep
// several k-tiles in flight while the tensor cores work on an older one.
NQ_DEVICE void cp_async_16(u32 dst, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(gmem) : "memory");
}
// Same, but copies src_bytes (0 or 16) and zero-fills the rest: masks the M tail of a tile without a
// branch around the copy (the address must still be valid; callers clamp it to row 0).
NQ_DEVICE void cp_async_16_zfill(u32 dst, const void* gmem, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(gmem), "r"(src_bytes)
                 : "memory");
}
// Closes the group of copies issued since the last commit: one group per pipeline stage.
NQ_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N groups are pending, i.e. the oldest stage of the ring has landed (this thread's
// copies only: a __syncthreads() must follow before other threads' data is read).
template <int N>
NQ_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// ---- the group scales in the ring ------------------------------------------------------------------------
// A GEMM's k-tile needs one fp16 scale per weight row. Fetched a k-tile ahead with plain loads, they left every
// k-tile of a short chunk a global load's latency long (~1.4 us on an H100), so they ride the cp.async ring beside
// the weights: per weight row the 4 aligned bytes around its scale (cp.async copies 4, 8 or 16 aligned bytes, and
// a scale tensor starts 4-byte aligned, so the word stays inside it), and the reader takes its half.
NQ_DEVICE void cp_async_4(u32 dst, const void* gmem) {   // through L1: .cg takes 16 bytes only
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(gmem) : "memory");
}
// Which half of its word holds the scale at p.
NQ_DEVICE u32 scale_half(const f16* p) { return (reinterpret_cast<size_t>(p) >> 1) & 1; }
// The scale rows one of COPIERS threads copies, tile rows i + COPIERS j (j < COPIES; null past ROWS), found once
// by `row_of` (tile row -> its scale row's group 0); copy() issues a k-tile's words, group `group`, into `words`.
template <int ROWS, int COPIERS>
struct ScaleCopies {
    static constexpr int COPIES = (ROWS + COPIERS - 1) / COPIERS;
    const f16* row[COPIES];
    template <typename RowOf>
    NQ_DEVICE ScaleCopies(int i, RowOf row_of) {
#pragma unroll
        for (int j = 0; j < COPIES; ++j) row[j] = i + COPIERS * j < ROWS ? row_of(i + COPIERS * j) : nullptr;
    }
    NQ_DEVICE void copy(u32 words, u32 group, int i) const {
#pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            if (ROWS % COPIERS == 0 || i + COPIERS * j < ROWS) {
                const size_t p = reinterpret_cast<size_t>(row[j] + group);
                cp_async_4(words + 4 * (i + COPIERS * j), reinterpret_cast<const void*>(p & ~(size_t)3));
            }
        }
    }
};

// ---- ldmatrix -----------------------------------------------------------------------------------------
// Four 8x8 fp16 matrices; lanes 8i..8i+7 give the 16-byte row addresses of matrix i, register i of
// every lane receives (row lane/4, cols 2(lane%4), +1) of matrix i. One instruction fills a whole A
// fragment (or two B fragments), instead of eight 32-bit shared loads.
NQ_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Transposed: register i receives (rows 2(lane%4), +1; col lane/4) of matrix i. Turns a row-major
// [k][n] tile (V: tokens x head_dim) into "col" B fragments.
NQ_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// 16-byte shared load by .shared address (the packed INT4 words of one weight row).
NQ_DEVICE uint4 lds_u4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// The scale in the word at .shared address `addr` (ScaleCopies), `half` its half (scale_half, XOR the parity of
// the group: a row's scales are 2 bytes apart).
NQ_DEVICE f16 lds_scale(u32 addr, u32 half) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return (f16)(v >> (16 * half));
}

// 16-byte shared store by .shared address (fp16 tiles converted in registers, e.g. q hi / lo).
NQ_DEVICE void sts_u4(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// ---- mma ------------------------------------------------------------------------------------------------
// d += a . b on one 16x8x16 tile, fp16 inputs, fp32 accumulation (products are exact, sums fp32).
NQ_DEVICE void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a . b (C = 0: the first MMA of a chain, no zeroed registers).
NQ_DEVICE void mma_16816_first(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// ---- the group MMAs: one arithmetic for the tensor-core GEMV and the GEMM in its order -----------------
// gemv_int4 (mma) and gemm_int4 (gemv_order) compute a dot product of a 128-input group alike, so that a
// row's bits do not depend on which of them ran it: weights as A (integers, unscaled), activations as B,
// the k index renamed rather than shuffled. Lane 4g + t holds chunk t (inputs 32t .. 32t + 31) of its two
// weight rows, lo (A row g) and hi (A row g + 8), and of its activation column g (B column g); MMA (word j,
// half h) puts inputs 32t + 8j + 4h + 0, 1 in k slots 2t, 2t + 1 and + 2, 3 in slots 2t + 8, 2t + 9. The
// group's 8 MMAs chain from zero in the order (j, h); the caller then adds scale * D in fp32.
//
// Word j of a group for one A tile against NB B tiles: MMAs (j, 0) and (j, 1) onto d[nb] (`first`: j = 0,
// the chain starts from zero). lo, hi: word j of the two weight rows' chunks; xw[nb]: the 8 activations
// 32t + 8j .. + 7 of B tile nb's column g (its words 2h, 2h + 1 are MMA (j, h)'s B operand).
template <int NB>
NQ_DEVICE void group_word_mma(float (&d)[NB][4], u32 lo, u32 hi, const uint4 (&xw)[NB], bool first) {
    const u32 los = lo >> 8, his = hi >> 8;
    const f16x2 wl[4] = {int4_word_pair<0>(lo, los), int4_word_pair<1>(lo, los),
                         int4_word_pair<2>(lo, los), int4_word_pair<3>(lo, los)};
    const f16x2 wh[4] = {int4_word_pair<0>(hi, his), int4_word_pair<1>(hi, his),
                         int4_word_pair<2>(hi, his), int4_word_pair<3>(hi, his)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 a[4] = {wl[2 * h], wh[2 * h], wl[2 * h + 1], wh[2 * h + 1]};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const u32 b0 = word(xw[nb], 2 * h), b1 = word(xw[nb], 2 * h + 1);
            if (first && h == 0) mma_16816_first(d[nb], a, b0, b1);
            else mma_16816(d[nb], a, b0, b1);
        }
    }
}

// ---- INT4 (ValueShuffle) -> fp16 B fragments -------------------------------------------------------------
// A packed word holds inputs 8j..8j+7 with lane k at bit [0,16,4,20,8,24,12,28][k]: shifting right by
// 4p puts lanes (2p, 2p+1) at bits 0 and 16, where int4.cuh's magic-number unpack (one LOP3 + one HADD2,
// exact) makes the half2 {q_2p, q_2p+1}. The scale multiply then rounds once to fp16 (relative 2^-11):
// the prefill GEMM's only deviation from the exact dequantized weight.
NQ_DEVICE f16x2 int4_pair_to_f16x2(u32 w_shifted, f16x2 scale2) {
    return hmul2(int4_pair<0x000F000Fu, false>(w_shifted), scale2);
}

// ---- epilogue --------------------------------------------------------------------------------------------
// p[0] += a, p[1] += b as one vector reduction in L2 (sm_90): split-K partial sums of a residual GEMM meet
// here without a second pass; fp32 addition order varies run to run, within the GEMM tolerance.
NQ_DEVICE void red_add_f32x2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
}
