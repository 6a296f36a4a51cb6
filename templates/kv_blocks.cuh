// Prefill attention's key blocks (DESIGN.md section 12: a prompt position's output is bitwise the same
// whatever chunk computed it). Keys are cut into blocks of BLOCK_KEYS at fixed positions [j*B, (j+1)*B),
// never where a chunk or a grid happens to split them. A query row at position q computes, for each
// block j <= q / B, an online softmax over that block's KV tiles starting afresh (its partial: max m2,
// sum l, unnormalized acc, scores in base-2 units as in attention.cuh), then folds the partials in
// ascending j with fold_block and normalizes with block_out. attention_prefill folds inside the kernel
// (long chunks); its split-KV variant writes each block's partial and attention_prefill_combine folds
// them: the same helpers, the same operand order, every rounding explicit (__fmul_rn / __fmaf_rn: no
// contraction the compiler could choose differently in the two kernels), so the two give the same bits.
#pragma once
#include "common.cuh"

// 2^x by MUFU.EX2 (flushes subnormals). The one exponential of the prefill softmax and of the fold.
NQ_DEVICE float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

// The fold's weights for merging a block of max m into the running (M, ...) of the blocks before it:
// wa for what was merged, wb for the block; M moves to the larger max.
struct FoldWeights { float wa, wb; };
NQ_DEVICE FoldWeights fold_weights(float& M, float m) {
    const float mx = fmaxf(M, m);
    const FoldWeights w = {ex2(M - mx), ex2(m - mx)};
    M = mx;
    return w;
}

// One value (a sum l or an acc element) of the running merge, with the block's value folded in.
NQ_DEVICE float fold_block(float merged, float block, FoldWeights w) {
    return __fmaf_rn(merged, w.wa, __fmul_rn(block, w.wb));
}

// The row's output: its merged acc element times the reciprocal of its merged sum (block_rcp).
NQ_DEVICE float block_rcp(float l) { return __frcp_rn(l); }
NQ_DEVICE float block_out(float acc, float rcp_l) { return __fmul_rn(acc, rcp_l); }
