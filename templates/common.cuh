// nanoqwen device helpers shared by every template. Header-free on purpose: NVRTC 12.9 ships no
// cuda_fp16.h, so fp16 values are raw bits and every fp16 operation is one line of inline PTX
// (which also pins the exact instruction we want in the SASS).
#pragma once

typedef unsigned short f16;    // one IEEE fp16, raw bits
typedef unsigned int f16x2;    // two fp16: element 0 in the low 16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

#define NQ_DEVICE __device__ __forceinline__

// ---- conversions -------------------------------------------------------------------------------
NQ_DEVICE float f16_to_f32(f16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }

// fp32 -> fp16 saturating: Qwen2's massive residual activations must clamp to +-65504, never become inf
// (DESIGN.md section 4). NaN stays NaN.
NQ_DEVICE f16 f32_to_f16_sat(float f) {
    f16 h; asm("cvt.rn.satfinite.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
// Packs (lo, hi) into one f16x2 with saturation: lo lands in the low half.
NQ_DEVICE f16x2 f32x2_to_f16x2_sat(float lo, float hi) {
    f16x2 r; asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// silu(g) * u in fp32, as the GEMVs' SwiGLU epilogue and the GEMM in their order compute it (one expression:
// the same bits in both).
NQ_DEVICE float swiglu(float g, float u) { return g / (1.f + expf(-g)) * u; }
// Word j of a 16-byte vector (j is a constant once the loops unroll: a register, not a select).
NQ_DEVICE u32 word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }
NQ_DEVICE float f16x2_lo(f16x2 v) { return f16_to_f32((f16)(v & 0xffffu)); }
NQ_DEVICE float f16x2_hi(f16x2 v) { return f16_to_f32((f16)(v >> 16)); }

// ---- packed fp16 arithmetic (HFMA2 / HADD2 / HMUL2 in SASS) ------------------------------------
NQ_DEVICE f16x2 hfma2(f16x2 a, f16x2 b, f16x2 c) {
    f16x2 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
NQ_DEVICE f16x2 hadd2(f16x2 a, f16x2 b) { f16x2 d; asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
NQ_DEVICE f16x2 hmul2(f16x2 a, f16x2 b) { f16x2 d; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }

// ---- fp32 pinned to one rounding per operation ------------------------------------------------
// .rn forbids FMA contraction: RoPE must match the numpy reference (and the prefill the decode) bit for bit.
NQ_DEVICE float mul_rn(float a, float b) { float d; asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
NQ_DEVICE float add_rn(float a, float b) { float d; asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
NQ_DEVICE float sub_rn(float a, float b) { float d; asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }

// Rotate-half RoPE of the pair (x[i], x[i + HD/2]) by angle (cos c, sin c):
// (x1 c - x2 s, x2 c + x1 s), each product and sum rounded separately.
NQ_DEVICE float2 rope_pair(float x1, float x2, float c, float s) {
    return make_float2(sub_rn(mul_rn(x1, c), mul_rn(x2, s)), add_rn(mul_rn(x2, c), mul_rn(x1, s)));
}

// ---- warp reductions -----------------------------------------------------------------------------
NQ_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- Programmatic Dependent Launch ---------------------------------------------------------------
// Weights never depend on the previous kernel: a kernel issues its first weight loads, then waits here
// before touching activations the previous kernel wrote. A no-op when launched without the PDL attribute.
NQ_DEVICE void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel in the stream start its own weight prefetch while this one finishes.
NQ_DEVICE void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ---- memory ---------------------------------------------------------------------------------------
// L2 policy for data read once per token (weights): evict-first, so it does not push the KV cache and
// activations out of L2. Create once per thread, pass to ld_stream_u4.
NQ_DEVICE u64 l2_evict_first_policy() {
    u64 p; asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p)); return p;
}
// Streaming 16-byte weight load: read-only path, no L1 allocation, L2 evict-first hint. L2_FETCH (64, 128
// or 256): on a miss the L2 fetches that aligned block from DRAM (.L2::<n>B), not only the sectors this warp
// asked for, so a block read in pieces by several instructions or warps is one DRAM access (0: no hint).
#define NQ_LD_STREAM_U4(FETCH)                                                                              \
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint" FETCH ".v4.u32 {%0,%1,%2,%3}, [%4], %5;"     \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy))
template <int L2_FETCH = 0>
NQ_DEVICE uint4 ld_stream_u4(const void* p, u64 policy) {
    static_assert(L2_FETCH == 0 || L2_FETCH == 64 || L2_FETCH == 128 || L2_FETCH == 256, "L2 fetch: 0, 64, 128, 256");
    uint4 v;
    if constexpr (L2_FETCH == 64) NQ_LD_STREAM_U4(".L2::64B");
    else if constexpr (L2_FETCH == 128) NQ_LD_STREAM_U4(".L2::128B");
    else if constexpr (L2_FETCH == 256) NQ_LD_STREAM_U4(".L2::256B");
    else NQ_LD_STREAM_U4("");
    return v;
}
#undef NQ_LD_STREAM_U4
// The same load for weights issued BEFORE pdl_wait(): without .nc. ptxas treats .nc loads as free to
// move across griddepcontrol.wait and schedules the wait (SASS ACQBULK) first, so ld_stream_u4 loads
// written before pdl_wait() end up after it; a weak load stays in place (checked in the SASS, NVRTC 12.9).
NQ_DEVICE uint4 ld_stream_u4_early(const void* p, u64 policy) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
    return v;
}

// Activations the previous kernel wrote, read after pdl_wait(): a coherent L2 load (.cg) in volatile asm.
// Never a `const __restrict__` (.nc) load here: ptxas treats .nc data as invariant for the whole kernel and
// may hoist the load above griddepcontrol.wait, reading the previous step's values (seen in the SASS).
NQ_DEVICE uint4 ld_act_u4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
// A batch of small activation loads that must all be in flight before the first is used: PTX volatile loads
// keep their program order in the SASS, where ptxas may spread weak ones over several round trips.
NQ_DEVICE float ld_volatile_f32(const float* p) {
    float v;
    asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
NQ_DEVICE int ld_act_i32(const int* p) {
    int v;
    asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
NQ_DEVICE float4 ld_act_f4(const float* p) {
    const uint4 v = ld_act_u4(p);
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}
