// The RMSNorm arithmetic of a row, shared by the decode GEMVs' prologue (gemv_int4) and the prefill's own
// kernel (rmsnorm_prefill), so that a position's normalised x is the same bits whichever ran it.
//
// Layout of the sum of squares (a row's bits): h in 8-element vectors; vector v's square sum (sq8) goes to
// virtual thread v % NORM_THREADS, each virtual thread adds its vectors in order from zero, each virtual
// warp meets in warp_sum, and the NORM_THREADS / 32 virtual warps are added in order from zero. Then
// rs = rsqrt(sum / K + eps) and x = f16(h * rs * w), per element in that order.
#pragma once
#include "common.cuh"

constexpr int NORM_THREADS = 128;              // virtual threads of the sum's layout
constexpr int NORM_WARPS = NORM_THREADS / 32;

// Sum of the squares of 8 elements of h (p: elements 0..3, c: 4..7): one expression, so every layout
// rounds it alike, because kernels compile with --fmad=false (config codegen.nvrtc_options). With fused
// multiply-adds left to the compiler it fused x*x in one kernel and y*y in another, and rows differed.
NQ_DEVICE float sq8(float4 p, float4 c) {
    return p.x * p.x + p.y * p.y + p.z * p.z + p.w * p.w + c.x * c.x + c.y * c.y + c.z * c.z + c.w * c.w;
}

// x = f16(h * rs * w) for 4 elements p with their norm weights w (4 fp16): per element, so any split of a
// row into vectors gives the same bits.
NQ_DEVICE uint2 rmsnorm_f16x4(float4 p, float rs, uint2 w) {
    return make_uint2(f32x2_to_f16x2_sat(p.x * rs * f16x2_lo(w.x), p.y * rs * f16x2_hi(w.x)),
                      f32x2_to_f16x2_sat(p.z * rs * f16x2_lo(w.y), p.w * rs * f16x2_hi(w.y)));
}

// The same for 8 elements (p: 0..3, c: 4..7).
NQ_DEVICE uint4 rmsnorm_f16x8(float4 p, float4 c, float rs, uint4 w) {
    const uint2 lo = rmsnorm_f16x4(p, rs, make_uint2(w.x, w.y)), hi = rmsnorm_f16x4(c, rs, make_uint2(w.z, w.w));
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}
