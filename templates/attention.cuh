// Attention math shared by the decode kernels (split partials and their merge). Scores are kept in
// base-2 units: s2 = (q . k) * log2(e) / sqrt(head_dim), so exp(s - m) = exp2(s2 - m2) is one MUFU.EX2.
// A partial is (m2, l, acc): running max in base-2 units, sum of exp2(s2 - m2), unnormalized
// sum of exp2(s2 - m2) * v. An empty partial is (-inf, 0, 0) and merges as the identity.
#pragma once
#include "common.cuh"

#define NQ_NEG_INF (__int_as_float(0xff800000))

// The reference the exponents are taken against: m2 itself, or 0 while nothing was seen (m2 = -inf),
// so that exp2(-inf - ref) = 0 instead of exp2(-inf + inf) = NaN.
NQ_DEVICE float softmax_ref(float m2) { return m2 == NQ_NEG_INF ? 0.f : m2; }

// Merges the parts of one query head: weight of part j is exp2(m_j - max_j m_j).
NQ_DEVICE float part_weight(float m_part, float m_ref) { return exp2f(m_part - m_ref); }

// Shared memory of merge_splits: each head's (m2, l) per split, its split weights and their l-sum.
template <int GQA, int SPLITS>
struct SplitMerge {
    float ml[GQA][SPLITS][2];
    float w[GQA][SPLITS];
    float den[GQA];
};

// o16 = f16sat(o) of GQA query heads from SPLITS partials each (head h's split s: (m2, l) at
// ml[2 * (h * SPLITS + s)], acc at acc[(h * SPLITS + s) * HD]), by the THREADS threads of one CTA:
// o[d] = sum_s acc_s[d] * w_s / sum_s l_s * w_s, w_s = exp2(m2_s - max_s m2_s), both sums fmaf chains in
// split order; empty splits (-inf, 0, 0) weigh 0. At least one split of each head saw a key (l > 0).
// The partials were written by other CTAs of this grid: read through L2 (ld.global.cg), never L1. One CTA
// reads them all, so the loops are unrolled: a thread's loads go out together (up to 24 splits' acc at
// once), one L2 round trip a batch.
template <int GQA, int HD, int SPLITS, int THREADS>
NQ_DEVICE void merge_splits(const float* ml, const float* acc, f16* o16, SplitMerge<GQA, SPLITS>& sh) {
    static_assert(HD % 4 == 0, "four dims per thread");
    constexpr int ML = GQA * SPLITS * 2, ITEMS = GQA * HD / 4;   // (m2, l) floats; float4 outputs
    constexpr int BATCH = (SPLITS + (SPLITS + 23) / 24 - 1) / ((SPLITS + 23) / 24);   // <= 24 float4 in registers
#pragma unroll
    for (int j = 0; j < (ML + THREADS - 1) / THREADS; ++j) {
        const int i = j * THREADS + threadIdx.x;
        if (i < ML) (&sh.ml[0][0][0])[i] = __ldcg(ml + i);
    }
    __syncthreads();
    if (threadIdx.x < GQA) {
        const int h = threadIdx.x;
        float m = NQ_NEG_INF;
#pragma unroll 8
        for (int s = 0; s < SPLITS; ++s) m = fmaxf(m, sh.ml[h][s][0]);
        const float ref = softmax_ref(m);
        float den = 0.f;
#pragma unroll 8
        for (int s = 0; s < SPLITS; ++s) {
            sh.w[h][s] = part_weight(sh.ml[h][s][0], ref);
            den = fmaf(sh.ml[h][s][1], sh.w[h][s], den);
        }
        sh.den[h] = den;
    }
    __syncthreads();
#pragma unroll 1
    for (int i = threadIdx.x; i < ITEMS; i += THREADS) {
        const int h = i / (HD / 4), d = 4 * (i % (HD / 4));
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
        for (int s0 = 0; s0 < SPLITS; s0 += BATCH) {   // BATCH loads in flight, then their fmafs in order
            float4 a[BATCH];
#pragma unroll
            for (int j = 0; j < BATCH; ++j)
                if (s0 + j < SPLITS) a[j] = __ldcg(reinterpret_cast<const float4*>(acc + (h * SPLITS + s0 + j) * HD + d));
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                if (s0 + j >= SPLITS) break;
                const float w = sh.w[h][s0 + j];
                num = make_float4(fmaf(a[j].x, w, num.x), fmaf(a[j].y, w, num.y), fmaf(a[j].z, w, num.z),
                                  fmaf(a[j].w, w, num.w));
            }
        }
        const float den = sh.den[h];
        *reinterpret_cast<uint2*>(o16 + h * HD + d) =
            make_uint2(f32x2_to_f16x2_sat(num.x / den, num.y / den), f32x2_to_f16x2_sat(num.z / den, num.w / den));
    }
}

// Eight fp16 (one 16-byte shared-memory vector) -> eight fp32.
NQ_DEVICE void f16x8_to_f32(uint4 v, float (&f)[8]) {
    f[0] = f16x2_lo(v.x); f[1] = f16x2_hi(v.x); f[2] = f16x2_lo(v.y); f[3] = f16x2_hi(v.y);
    f[4] = f16x2_lo(v.z); f[5] = f16x2_hi(v.z); f[6] = f16x2_lo(v.w); f[7] = f16x2_hi(v.w);
}

// fp32 pair -> its fp16 rounding (saturating) `hi` and the fp16 rounding of the remainder `lo`: hi + lo
// carries ~22 bits, so two fp16 tensor-core products (hi, lo) with fp32 accumulation act as an fp32 one.
NQ_DEVICE void f16_hi_lo(float a, float b, u32& hi, u32& lo) {
    hi = f32x2_to_f16x2_sat(a, b);
    lo = f32x2_to_f16x2_sat(a - f16x2_lo(hi), b - f16x2_hi(hi));
}
