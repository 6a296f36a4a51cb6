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

// ---- the MMA -------------------------------------------------------------------------------------------------
// d (64x64 f32) += a (64x16 f16, registers) . b (16x64 f16, descriptor; K-major: imm-trans-b 0), issued by the
// whole warpgroup. scale-d is the predicate p (always on: accumulators start at 0 and every k-step adds, so
// the K order of each output is the same whatever the tile's row count). One fixed instruction shape:
// a tile of BM tokens is BM/64 of these, so a token's arithmetic does not depend on BM.
NQ_DEVICE void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
        : "memory");
}
