// INT4 (ValueShuffle) -> fp16 dequantization helpers for the GEMV family. Header-free, like common.cuh.
//
// Magic-number unpack. A signed nibble n (two's complement q in [-8, 7]) XOR 8 is q + 8 in [0, 15].
// Placed in the low mantissa bits of the fp16 1024.0 (0x6400) it reads as the fp16 value 1024 + q + 8,
// exact; placed 4 bits higher it reads as 1024 + 16 (q + 8). Both halves of a u32 do this at once, so
// one LOP3 makes a half2 pair from two nibbles that sit 16 bits apart (why the file format puts even
// lanes in the low half and odd lanes in the high half). The XOR 8 folds into the same LOP3:
// ((w ^ 0x88888888) & m) | 0x64006400 == (w & m) ^ ((0x88888888 & m) | 0x64006400), i.e. (a & b) ^ c.
#pragma once
#include "common.cuh"

// d = (a & b) ^ c in one LOP3 (truth table 0x6A).
NQ_DEVICE u32 lop3_and_xor(u32 a, u32 b, u32 c) {
    u32 d; asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}

// The LOP3 constant for a pair mask m: fp16 1024 in both halves with the sign flip of each nibble folded in.
__host__ __device__ constexpr u32 int4_magic(u32 mask) { return (0x88888888u & mask) ^ 0x64006400u; }

// Bias removal, as half2 constants (both halves equal):
//   low nibble position:  (1024 + q + 8) - 1032            = q   -> one HADD2 with -1032
//   high nibble position: (1024 + 16 (q + 8)) * 1/16 - 72  = q   -> one HFMA2 with 1/16, -72
constexpr f16x2 INT4_NEG1032 = 0xE408E408u;   // fp16 -1032.0
constexpr f16x2 INT4_SIXTEENTH = 0x2C002C00u; // fp16 0.0625
constexpr f16x2 INT4_NEG72 = 0xD480D480u;     // fp16 -72.0

// Two signed nibbles (selected by `mask` from `w`) -> half2 (q_lo, q_hi), exact.
// HIGH: the nibbles sit at bit 4 of each half (mask 0x00F000F0) rather than bit 0 (mask 0x000F000F).
template <u32 MASK, bool HIGH>
NQ_DEVICE f16x2 int4_pair(u32 w) {
    static_assert(MASK == (HIGH ? 0x00F000F0u : 0x000F000Fu), "pair mask must select one nibble per half");
    const f16x2 biased = lop3_and_xor(w, MASK, int4_magic(MASK));
    return HIGH ? hfma2(biased, INT4_SIXTEENTH, INT4_NEG72) : hadd2(biased, INT4_NEG1032);
}

// Pair P (logical lanes 2P, 2P + 1: inputs 8j + 2P, 2P + 1 of word j) of a ValueShuffle word as half2
// (q_2P, q_2P+1), exact. ValueShuffle puts lanes 0, 2, 4, 6 at bits 0, 4, 8, 12 and each odd lane 16 bits
// above its even one: pairs 0 and 1 come from `w`, pairs 2 and 3 from `w_shifted` = w >> 8 (one shift a word).
template <int P>
NQ_DEVICE f16x2 int4_word_pair(u32 w, u32 w_shifted) {
    constexpr bool HIGH = P & 1;
    return int4_pair<HIGH ? 0x00F000F0u : 0x000F000Fu, HIGH>(P >= 2 ? w_shifted : w);
}

// lo + hi of a half2, added in fp16 (one HADD2 with operand selects), returned as fp32.
NQ_DEVICE float hsum2_f32(f16x2 v) {
    float f;
    asm("{.reg .f16 l, h, s;\n mov.b32 {l, h}, %1;\n add.rn.f16 s, l, h;\n cvt.f32.f16 %0, s;\n}"
        : "=f"(f) : "r"(v));
    return f;
}

// Running max of |x| over 8 fp16 values, as bit patterns: with the sign bit cleared, the unsigned order
// of fp16 bits is the order of magnitudes (NaN above inf), so two LOP/VIMNMX per word suffice.
NQ_DEVICE u32 absmax_f16x8(uint4 v, u32 m) {
    u32 d;
    asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(m), "r"(v.x & 0x7fff7fffu));
    asm("max.u16x2 %0, %0, %1;" : "+r"(d) : "r"(v.y & 0x7fff7fffu));
    asm("max.u16x2 %0, %0, %1;" : "+r"(d) : "r"(v.z & 0x7fff7fffu));
    asm("max.u16x2 %0, %0, %1;" : "+r"(d) : "r"(v.w & 0x7fff7fffu));
    return d;
}

// Power-of-two prescale of x for the fp16 half2 chains. A chain sums up to 32 products q x with |q| <= 7
// (16 per half), so max|x| < 2^8 keeps every partial sum below 65504. Qwen2's massive activations put
// x at the fp16 limit (65504 after the saturating casts): then x is scaled by 2^-shift (exact, bar the
// underflow of values 2^24 below the maximum, far under the chain's rounding) and the fp32 totals by
// 2^shift. Returns shift for the largest |x| bit pattern `m` (0 for ordinary activations).
NQ_DEVICE int x_prescale_shift(u32 m) {
    const int e = (int)(m >> 10) - 15;   // unbiased exponent of max|x| (16 for inf/NaN)
    return e > 6 ? e - 6 : 0;
}

// fp16x2 with both halves 2^-shift (shift 0..16 stays a normal number).
NQ_DEVICE f16x2 pow2_neg_f16x2(int shift) { return (u32)(15 - shift) << 10 | (u32)(15 - shift) << 26; }

// Read-only (non-coherent) 2-byte load for the group scales: weights' companions, never written by a kernel.
NQ_DEVICE f16 ld_nc_f16(const f16* p) {
    f16 v; asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p)); return v;
}

// Cluster helpers for the split-K GEMV: the SPLITK CTAs of one row range form a thread-block cluster and
// meet in distributed shared memory, so partial sums add in a fixed order (fp32 atomics would add them
// in whatever order the CTAs finish: greedy decoding would not be reproducible).
NQ_DEVICE void cluster_sync() {   // every thread of every CTA of the cluster; release/acquire on shared memory
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// The `threads` threads (whole warps) that share barrier `id` (1..15; 0 is __syncthreads): the KWARPS warps of
// one tile, which meet in shared memory while the CTA's other tiles go on.
NQ_DEVICE void named_barrier_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// Load a float from CTA `rank`'s copy of the shared variable at `p` (same offset in every CTA).
NQ_DEVICE float ld_cluster_f32(const float* p, u32 rank) {
    u32 local = (u32)__cvta_generic_to_shared(p), remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Sum each of V per-lane values over aligned groups of LANES lanes with log2(LANES) + V - 1 - log2(V)
// shuffles instead of V log2(LANES): at each of the first log2(V) butterfly steps a lane keeps half of its
// values and trades the other half with its partner. Returns, in every lane, its group's total of value
// (lane % LANES) >> (log2 LANES - log2 V). V and LANES are powers of two, V <= LANES <= 32.
template <int V, int LANES = 32>
NQ_DEVICE float warp_sum_split(float (&v)[V], int lane) {
    static_assert(V >= 1 && V <= LANES && (V & (V - 1)) == 0, "V must be a power of two <= LANES");
    static_assert(LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES must be a power of two <= 32");
    int offset = LANES / 2;
#pragma unroll
    for (int c = V; c > 1; c >>= 1, offset >>= 1) {
        const bool upper = lane & offset;
#pragma unroll
        for (int i = 0; i < c / 2; ++i) {
            const float keep = upper ? v[i + c / 2] : v[i];
            const float send = upper ? v[i] : v[i + c / 2];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
    }
    float r = v[0];
#pragma unroll
    for (; offset > 0; offset >>= 1) r += __shfl_xor_sync(0xffffffffu, r, offset);
    return r;
}
