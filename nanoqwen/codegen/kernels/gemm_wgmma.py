"""Prefill INT4 GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): the same contract as ``gemm_int4``
(kernel parameters, epilogues, launch over M) computed transposed, Y^T = W . X^T: the dequantized INT4
weight tile is wgmma's A operand in registers, the fp16 activations its B operand in shared memory read
through a matrix descriptor (wgmma cannot take B from registers; Machete's layout). Warp-specialized: a
producer warpgroup streams X and W k-tiles through a ring of shared-memory stages on mbarriers while
``consumers`` warpgroups dequantize and keep the tensor cores busy (templates/gemm_wgmma.cu.j2). The
runtime's prefill runs ``model_gemms`` for every chunk with ``prefill.wgmma`` (off until measured, issue 23;
runtime/prefill.py); ``specs_for_model`` lists them for ``nanoqwen-gen`` and the compile tests.

Row invariance: one instruction shape (m64n{bm}k16) whatever M, K walked in order by one CTA (no
split-K): a token's outputs are the same bits for any M and in the short chunks' tile (SMALL_M_TILE)
(tests/gpu/test_gemm_wgmma.py).

The index maps below (X's shared-memory layout, the SwiGLU row order) are the kernel's, written once here
and rendered into the template as constants where the template needs numbers; tests/test_gemm_wgmma.py
checks them on the CPU against the PTX ISA's descriptor and fragment rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import Config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError
from .gemm import EPILOGUES, GemmInt4Spec, check_contract, role_shapes

# wgmma's no-swizzle K-major layout: a "core matrix" is 8 rows x 16 bytes stored as 128 contiguous bytes
CORE_ROWS, CORE_BYTES = 8, 16
MMA_M = 64     # wgmma's rows per instruction (a row block); its N is the tile's bm, its K 16


@dataclass(frozen=True)
class GemmWgmmaSpec(KernelSpec):
    family = "gemm_wgmma"
    template = "gemm_wgmma.cu.j2"
    uri_fields = ("epilogue", "n", "k", "bm", "bn", "bk", "stages", "consumers")
    kernel_params: ClassVar[tuple[Param, ...]] = GemmInt4Spec.kernel_params   # same contract, same launch packing

    n: int                   # GEMM columns (weight rows; 2 x intermediate for swiglu)
    k: int                   # reduction length (weight row length)
    epilogue: str = "f32"    # one of gemm.EPILOGUES
    bias: bool = False       # add f32(bias) (f32 / f16 epilogues)
    group: int = 128         # inputs per fp16 scale
    bm: int = 64             # tokens per CTA = the wgmma's N (a multiple of 64, at most 256)
    bn: int = 256            # weight rows per CTA: consumers x row blocks of 64 (64 x 256 moves the most FLOPs
                             # per byte of X: the fastest tile on every role at M = 512, perf-notes 2026-12-05)
    bk: int = 64             # reduction step per pipeline stage (64 or 128)
    stages: int = 6          # shared-memory ring depth (the producer runs stages - 2 tiles ahead)
    consumers: int = 2       # consumer warpgroups (plus one producer warpgroup)
    inflight: int = 1        # wgmma groups (16-byte W chunks) left running while the next chunk is dequantized
    max_m: int = 4096        # rows the default grid covers (launch(m) sizes it for a call)
    max_smem: int = DEFAULT.max_smem   # the GPU's opt-in shared memory per block (gpu.GpuProfile)

    def validate(self) -> None:
        super().validate()
        check_contract(self)
        f = self.family
        if self.bm <= 0 or self.bm % 64 or self.bm > 256:
            raise SpecError(f"{f}.bm must be 64, 128, 192 or 256 (the wgmma's N), got {self.bm}")
        if self.consumers not in (1, 2):
            raise SpecError(f"{f}.consumers must be 1 or 2 (warpgroups beside the producer), got {self.consumers}")
        if self.bn <= 0 or self.bn % (MMA_M * self.consumers) or self.bn > 4 * MMA_M:
            raise SpecError(f"{f}.bn must be a multiple of {MMA_M * self.consumers} (64-row blocks per consumer "
                            f"warpgroup) up to 256, got {self.bn}")
        if self.accumulators > self.max_accumulators:
            raise SpecError(f"{f}: bm {self.bm} x {self.row_blocks} row blocks needs {self.accumulators} accumulators "
                            f"a thread, at most {self.max_accumulators} with {self.threads} threads (fewer bm or bn)")
        if self.inflight not in (0, 1):
            raise SpecError(f"{f}.inflight must be 0 or 1 (A fragments are double-buffered), got {self.inflight}")
        if not 3 <= self.stages <= 8:
            raise SpecError(f"{f}.stages must be 3..8 (the producer runs stages - 2 tiles ahead), got {self.stages}")
        if self.smem_bytes > self.max_smem:
            raise SpecError(f"{f}: {self.smem_bytes} bytes of shared memory > max_smem {self.max_smem} "
                            f"(lower stages, bm, bn or bk)")
        if self.max_m <= 0:
            raise SpecError(f"{f}.max_m must be positive, got {self.max_m}")

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)   # + the producer warpgroup

    @property
    def row_blocks(self) -> int:
        """64-row blocks per consumer warpgroup (one wgmma each per k16 step)."""
        return self.bn // (MMA_M * self.consumers)

    @property
    def lag(self) -> int:
        """k-tiles the producer issues past the last one it published: it publishes tile kt at the top of
        iteration kt + lag, after refilling the slot of tile kt + lag - 1 - stages. The consumers release
        tile kt - 1 only once they hold tile kt (inflight 1): lag <= stages - 2 leaves them two published
        tiles of slack and keeps the waits acyclic."""
        return self.stages - 2

    @property
    def accumulators(self) -> int:
        """fp32 accumulator registers per consumer thread: m64n{bm} D is bm / 2 a row block."""
        return self.row_blocks * self.bm // 2

    @property
    def max_accumulators(self) -> int:
        """What the register budget leaves for them beside the A fragments and addresses: ptxas gives every
        thread 65536 / (32 x the busiest sub-partition's warps) registers, 168 with 12 warps, 255 with 8."""
        return 64 if self.consumers == 2 else 128

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm * self.bk * 2 + self.bn * self.bk // 2 + 16)   # + full / empty mbarriers

    # X's layout in a stage: core matrix (token row group r // 8, 16-byte chunk c) at (r // 8) * sbo + c * lbo
    @property
    def x_lbo(self) -> int:
        """Bytes between X core matrices adjacent in K (the descriptor's leading-dimension offset)."""
        return CORE_ROWS * CORE_BYTES

    @property
    def x_sbo(self) -> int:
        """Bytes between X core matrices adjacent in tokens (the descriptor's stride-dimension offset)."""
        return self.bk // 8 * self.x_lbo

    def x_offset(self, r: int, c: int) -> int:
        """Byte offset of token r's 16-byte chunk c (inputs 8c..8c+7 of the k-tile) in a stage."""
        return r // CORE_ROWS * self.x_sbo + c * self.x_lbo + r % CORE_ROWS * CORE_BYTES

    def x_copy(self, i: int) -> tuple[int, int]:
        """(token, chunk) that copy slot i (thread + iteration x threads) moves: 8 consecutive slots fill
        one core matrix, so a warp's 16-byte shared stores land in 4 x 128 contiguous bytes."""
        cpr = self.bk // 8
        return i // 8 // cpr * 8 + i % 8, i // 8 % cpr

    def weight_row(self, n: int) -> tuple[int, int]:
        """(half, row) of the weight behind tile row n: half 0 is ``w``, 1 is ``w2`` (SwiGLU up). SwiGLU
        puts gate rows in rows 0..7 and up rows in rows 8..15 of every 16-row slab, so the lane holding
        row g of a warp (wgmma D map) also holds up row g + 8 of the same output 8 (n // 16) + n % 8."""
        if self.epilogue != "swiglu":
            return 0, n
        return int(n % 16 >= 8), n // 16 * 8 + n % 8

    def context(self) -> dict:
        acc = self.bm // 2   # the wgmma's D operands: its asm names them one by one
        return super().context() | {"epilogue_id": EPILOGUES.index(self.epilogue),
                                    "x_lbo": self.x_lbo, "x_sbo": self.x_sbo, "lag": self.lag, "acc": acc,
                                    "wgmma_d": ", ".join(f"%{i}" for i in range(acc)),
                                    "wgmma_d_bind": ", ".join(f'"+f"(d[{i}])' for i in range(acc))}

    def launch(self, m: int | None = None) -> Launch:
        m = self.max_m if m is None else m
        if m <= 0:
            raise SpecError(f"{self.family}: m must be positive, got {m}")
        return Launch(grid=(self.n // self.bn, -(-m // self.bm), 1), block=(self.threads, 1, 1), smem=self.smem_bytes)

    def flops(self, m: int) -> int:
        return 2 * m * self.n * self.k


# Short chunks (at most prefill.small_m_tokens rows: a prefix-reuse tail) take one 64-row block a CTA, 4x the
# default tile's CTAs: the same instruction (bm) and K walk (bk), so the same bits a row; bn and the consumer
# count only choose which CTA computes a weight row.
SMALL_M_TILE = dict(bn=64, consumers=1)


def model_gemms(dims: ModelDims, group: int = 128, gpu: GpuProfile = DEFAULT,
                small_m: bool = False) -> dict[str, GemmWgmmaSpec]:
    """The four prefill GEMMs of one decoder layer, by role, as in gemm.model_gemms; with ``small_m`` in
    SMALL_M_TILE. bn 256 where N allows it, else 128 (small test models)."""
    return {role: GemmWgmmaSpec(**shape, group=group, max_smem=gpu.max_smem,
                                **(SMALL_M_TILE if small_m else dict(bn=256 if shape["n"] % 256 == 0 else 128)))
            for role, shape in role_shapes(dims).items()}


def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    """Listed (nanoqwen-gen, compile tests), not launched: the runtime builds only its roles' specs."""
    return [s for small_m in (False, True) for s in model_gemms(dims, cfg.quant.group_size, gpu, small_m).values()]
