// mbarrier + cp.async.bulk helpers (sm_90), and the mbarrier completion of plain cp.async. Header-free like
// common.cuh: every helper is one PTX instruction with a one-line "why". Shared-memory operands are 32-bit
// shared-window addresses (smem_addr).
//
// Phase protocol used by the producer/consumer rings (PTX ISA, mbarrier): a barrier starts in phase 0;
// a phase completes when its pending arrivals reach 0 AND its transaction count (expect_tx bytes minus
// complete_tx bytes) is 0, then the barrier flips to the next phase. try_wait.parity(P) succeeds once
// the phase with parity P has completed, so use k of a ring slot waits on parity (k & 1).
#pragma once
#include "common.cuh"

// Shared-window address of a shared-memory object: mbarrier and cp.async.bulk take 32-bit .shared
// addresses, and cvta keeps the generic->shared conversion to one instruction.
NQ_DEVICE u32 smem_addr(const void* p) {
    u64 a; asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p)); return (u32)a;
}

// One-time init with the number of arrivals per phase. Only one thread calls it, and the whole CTA must
// pass a __syncthreads() before any other thread touches the barrier (init is a plain shared write).
NQ_DEVICE void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrivals) : "memory");
}

// Makes the mbarrier.init writes visible to the async proxy (the copy engine performs complete_tx on the
// barrier through that proxy, not through the generic proxy that wrote it); issue before the __syncthreads.
NQ_DEVICE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Producer: arrive once and announce `bytes` of bulk copies that will complete_tx on this barrier, so
// the phase cannot complete before the data has landed.
NQ_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [%0], %1;\n}"
                 :: "r"(bar), "r"(bytes) : "memory");
}

// Consumer: one arrival that releases a ring slot; release semantics order this thread's earlier
// shared-memory reads of the slot before the producer's next bulk copy overwrites it.
NQ_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}"
                 :: "r"(bar) : "memory");
}

// Non-blocking probe of phase `parity`: true once that phase completed. try_wait (not test_wait) lets
// the hardware suspend the thread for a while inside the instruction instead of spinning in issue slots.
NQ_DEVICE bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Blocking wait; acquire semantics make the bytes the phase delivered visible to this thread.
// Watchdog: a legitimate wait here is a few microseconds (one 4 KB copy or one page of math), so a
// phase that has not completed after 2^24 probes is a protocol bug (wrong parity, wrong expect_tx
// byte count): trap, which fails the launch loudly, instead of hanging the GPU and the graph replay.
NQ_DEVICE void mbar_wait(u32 bar, u32 parity) {
    for (u32 tries = 0; !mbar_try_wait(bar, parity); ++tries) {
        if (tries == (1u << 24)) __trap();
    }
}

// One arrival on `bar` once every cp.async (mma.cuh's cp_async_16*) this thread issued so far has landed:
// a ring of plain cp.async copies completes on an mbarrier like a bulk-copy ring, instead of a per-thread
// wait_group. .noinc: the arrival counts against the barrier's init count (every copying thread one), so
// a warp of copying lanes needs init 32 and no separate mbarrier.arrive. Unlike cp.async.bulk, cp.async
// writes through the generic proxy (PTX ISA): no fence.proxy.async between it and plain loads or stores.
NQ_DEVICE void cp_async_mbar_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

// Orders generic-proxy global writes this thread can see (the previous kernel's K/V append, made visible
// by griddepcontrol.wait) before its later async-proxy reads of them (cp.async.bulk from global).
NQ_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Orders this thread's generic-proxy writes to shared memory before later async-proxy accesses of it (the
// copy engine's next fill of a ring slot the thread wrote into; wgmma's reads of a tile it stored).
NQ_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Named barrier 1 over `threads` threads (a multiple of 32): syncs the consumer warps of a
// warp-specialized CTA without the producer warp (barrier 0 is __syncthreads, which must never sit
// inside a role branch).
NQ_DEVICE void consumer_barrier(u32 threads) { asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory"); }

// Global -> shared bulk copy of `bytes` (multiple of 16, both addresses 16-byte aligned) on the copy
// engine: one thread moves a whole 4 KB KV page with one instruction, no registers, and the barrier's
// transaction count tracks completion. The CTA's own shared::cta address is valid in the cluster window.
NQ_DEVICE void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
