// Attention math shared by the decode kernels (split partials and their combine). Scores are kept in
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

// Merged output of one query head (one dim) from SPLITS partials: split s's (m2, l) at ml[s * ml_step], its acc
// at acc[s * acc_step]. At least one split must have seen a key (l > 0). The first AHEAD splits' partials are
// all loaded before the first is used (volatile loads keep their order: one L2 round trip, where ptxas spread
// plain loads over two or three waves to save registers); more would spill, and load where used. The merge's
// arithmetic is the two loops, whichever way a partial arrived.
template <int SPLITS>
NQ_DEVICE float merge_partials(const float* ml, const float* acc, int ml_step, int acc_step) {
    constexpr int AHEAD = SPLITS < 40 ? SPLITS : 40;   // three registers a split
    float m2[AHEAD], l[AHEAD], a[AHEAD];
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        m2[s] = ld_volatile_f32(ml + s * ml_step);
        l[s] = ld_volatile_f32(ml + s * ml_step + 1);
        a[s] = ld_volatile_f32(acc + s * acc_step);
    }
    auto m2_of = [&](int s) { return s < AHEAD ? m2[s] : ld_volatile_f32(ml + s * ml_step); };
    float m = NQ_NEG_INF;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) m = fmaxf(m, m2_of(s));
    const float ref = softmax_ref(m);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) {
        const float w = part_weight(m2_of(s), ref);
        num = fmaf(s < AHEAD ? a[s] : ld_volatile_f32(acc + s * acc_step), w, num);
        den = fmaf(s < AHEAD ? l[s] : ld_volatile_f32(ml + s * ml_step + 1), w, den);
    }
    return num / den;
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
