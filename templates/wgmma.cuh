// Hopper warpgroup MMA (wgmma, sm_90a only) helpers. Header-free like common.cuh: every helper is one
// PTX instruction with a one-line "why".
//
// A warpgroup is 4 consecutive warps starting at a warp index divisible by 4; the 128 threads issue one
// wgmma.mma_async together, and it runs asynchronously until wgmma.wait_group retires it.
//
// Fragment maps of wgmma.m64nNk16 with A in registers (PTX ISA "Register Fragments and Shared Memory
// Matrix Layouts", wgmma .m64nNk16), warp w = (threadIdx.x / 32) % 4 of the warpgroup owns rows
// 16w..16w+15, and inside those 16 rows lane = 4g + t has the mma.m16n8k16 maps (mma.cuh):
//   A (64x16 f16, 4 regs):  a[0] = (row g, k 2t, 2t+1)   a[1] = (row g+8, k 2t, 2t+1)
//                           a[2] = (row g, k 2t+8, 2t+9) a[3] = (row g+8, k 2t+8, 2t+9)
//   D (64xN f32, N/2 regs): d[4j + 0, 1] = (row g, cols 8j + 2t, +1)  d[4j + 2, 3] = (row g+8, same cols)
// B (16xN) is read from shared memory through a matrix descriptor (below).
#pragma once
#include "common.cuh"
#include "async_copy.cuh"  // fence_proxy_async_shared

// ---- ordering ----------------------------------------------------------------------------------------
// Orders this thread's earlier ordinary writes of registers (A fragments, accumulators) before the next
// wgmma.mma_async reads them: required before the first wgmma and after any register it uses was changed.
NQ_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Closes the wgmma instructions issued since the last commit into one group (waited on as a unit).
NQ_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are still running: their accumulators may then be read and the
// A registers and shared-memory B tiles they used may be overwritten.
template <int N>
NQ_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Pins accumulator registers at this point of the program: the compiler sees a wgmma's outputs as ready at
// its asm statement and could move their readers above wgmma_wait; after the wait, this keeps them below.
template <int N>
NQ_DEVICE void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// wgmma reads shared memory through the async proxy; data written there by the generic proxy (cp.async
// to shared, st.shared) must be fenced by every writing thread before the barrier that publishes it:
// async_copy.cuh's fence_proxy_async_shared.

// ---- shared-memory matrix descriptor ----------------------------------------------------------------------
// 64-bit descriptor of a B tile in shared memory, no swizzle (mode 0 in bits 62-63). The tile is made of
// "core matrices" of 8 rows x 16 bytes (8 x 8 fp16), each stored as 128 contiguous bytes, row r of the core
// matrix at +16r. For a K-major operand (rows along N, 16 bytes of K per core-matrix row):
//   bits  0-13: start address >> 4 (core matrix (n 0, k 0))
//   bits 16-29: leading-dimension byte offset >> 4 = distance between core matrices adjacent in K
//   bits 32-45: stride-dimension byte offset >> 4 = distance between core matrices adjacent in N
//   bits 49-51: base offset (0: only used with swizzles)
NQ_DEVICE u64 wgmma_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | (u64)((lbo & 0x3FFFFu) >> 4) << 16 | (u64)((sbo & 0x3FFFFu) >> 4) << 32;
}

// The MMA itself (wgmma.mma_async m64nNk16, A from registers) is written in the kernel template for its N:
// its asm names every one of the N / 2 accumulators.
