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

// lo + hi of a half2, added in fp16 (one HADD2 with operand selects), returned as fp32.
NQ_DEVICE float hsum2_f32(f16x2 v) {
    float f;
    asm("{.reg .f16 l, h, s;\n mov.b32 {l, h}, %1;\n add.rn.f16 s, l, h;\n cvt.f32.f16 %0, s;\n}"
        : "=f"(f) : "r"(v));
    return f;
}

// Read-only (non-coherent) 2-byte load for the group scales: weights' companions, never written by a kernel.
NQ_DEVICE f16 ld_nc_f16(const f16* p) {
    f16 v; asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p)); return v;
}

// Split-K partial sums meet in the fp32 residual: a fire-and-forget reduction (no return value needed).
NQ_DEVICE void red_add_f32(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
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
