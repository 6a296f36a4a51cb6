"""Prefill INT4 GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): the same contract as ``gemm_int4``
(kernel parameters, epilogues, launch over M) computed transposed, Y^T = W . X^T: the dequantized INT4
weight tile is wgmma's A operand in registers (64 weight rows per warpgroup), the fp16 activations its B
operand in shared memory read through a matrix descriptor (wgmma cannot take B from registers; Machete's
layout). Not used by the runtime yet (issue 23, first step): ``specs_for_model`` lists it for
``nanoqwen-gen`` and the compile tests only; the runtime picks its kernels by role in runtime/prefill.py.

Row invariance: one instruction shape (m64n64k16) whatever the tile's token count ``bm``, K walked in order
by one CTA (no split-K): a token's outputs are the same bits for any M (tests/gpu/test_gemm_wgmma.py).

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
from .gemm import EPILOGUES, GemmInt4Spec, check_contract

# wgmma's no-swizzle K-major layout: a "core matrix" is 8 rows x 16 bytes stored as 128 contiguous bytes
CORE_ROWS, CORE_BYTES = 8, 16
MMA_M, MMA_N, MMA_K = 64, 64, 16     # the one instruction shape: m64n64k16 (rows per warpgroup, tokens, k)


@dataclass(frozen=True)
class GemmWgmmaSpec(KernelSpec):
    family = "gemm_wgmma"
    template = "gemm_wgmma.cu.j2"
    uri_fields = ("epilogue", "n", "k", "bm", "bn", "bk", "stages")
    kernel_params: ClassVar[tuple[Param, ...]] = GemmInt4Spec.kernel_params   # same contract, same launch packing

    n: int                   # GEMM columns (weight rows; 2 x intermediate for swiglu)
    k: int                   # reduction length (weight row length)
    epilogue: str = "f32"    # one of gemm.EPILOGUES
    bias: bool = False       # add f32(bias) (f32 / f16 epilogues)
    group: int = 128         # inputs per fp16 scale
    bm: int = 128            # tokens per CTA (a multiple of 64: m64n64k16 instructions side by side)
    bn: int = 128            # weight rows per CTA (64 per warpgroup)
    bk: int = 64             # reduction step per pipeline stage (64 or 128)
    stages: int = 4          # cp.async ring depth (stages - 1 - inflight tiles of copies ahead)
    inflight: int = 1        # k-tiles of wgmmas left running while the next tile is refilled and dequantized
    max_m: int = 4096        # rows the default grid covers (launch(m) sizes it for a call)
    max_smem: int = DEFAULT.max_smem   # the GPU's opt-in shared memory per block (gpu.GpuProfile)

    def validate(self) -> None:
        super().validate()
        check_contract(self)
        f = self.family
        if self.bm <= 0 or self.bm % MMA_N or self.bm > 256:
            raise SpecError(f"{f}.bm must be 64, 128, 192 or 256 (whole n{MMA_N} instructions), got {self.bm}")
        if self.bn <= 0 or self.bn % MMA_M or self.bn > 4 * MMA_M:
            raise SpecError(f"{f}.bn must be 64, 128, 192 or 256 (64 weight rows per warpgroup), got {self.bn}")
        if self.inflight not in (0, 1):
            raise SpecError(f"{f}.inflight must be 0 or 1 (A fragments are double-buffered), got {self.inflight}")
        if not 2 + self.inflight <= self.stages <= 8:
            raise SpecError(f"{f}.stages must be {2 + self.inflight}..8 with inflight {self.inflight} (the ring "
                            f"holds the computed tile, the running ones and a prefetch), got {self.stages}")
        if self.smem_bytes > self.max_smem:
            raise SpecError(f"{f}: {self.smem_bytes} bytes of shared memory > max_smem {self.max_smem} "
                            f"(lower stages, bm, bn or bk)")
        if self.max_m <= 0:
            raise SpecError(f"{f}.max_m must be positive, got {self.max_m}")

    @property
    def threads(self) -> int:
        return 128 * (self.bn // MMA_M)

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm * self.bk * 2 + self.bn * self.bk // 2)

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
        return super().context() | {"epilogue_id": EPILOGUES.index(self.epilogue),
                                    "x_lbo": self.x_lbo, "x_sbo": self.x_sbo}

    def launch(self, m: int | None = None) -> Launch:
        m = self.max_m if m is None else m
        if m <= 0:
            raise SpecError(f"{self.family}: m must be positive, got {m}")
        return Launch(grid=(self.n // self.bn, -(-m // self.bm), 1), block=(self.threads, 1, 1), smem=self.smem_bytes)

    def flops(self, m: int) -> int:
        return 2 * m * self.n * self.k


def model_gemms(dims: ModelDims, group: int = 128, gpu: GpuProfile = DEFAULT) -> dict[str, GemmWgmmaSpec]:
    """The four prefill GEMMs of one decoder layer, by role, as in gemm.model_gemms."""
    h, qkv = dims.hidden, dims.q_dim + 2 * dims.kv_dim
    kw = dict(group=group, max_smem=gpu.max_smem)
    return {
        "qkv": GemmWgmmaSpec(n=qkv, k=h, epilogue="f32", bias=True, **kw),
        "o_proj": GemmWgmmaSpec(n=h, k=dims.q_dim, epilogue="residual", **kw),
        "gate_up": GemmWgmmaSpec(n=2 * dims.intermediate, k=h, epilogue="swiglu", **kw),
        "down": GemmWgmmaSpec(n=h, k=dims.intermediate, epilogue="residual", **kw),
    }


def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    """Listed (nanoqwen-gen, compile tests), not launched: the runtime builds only its roles' specs."""
    return list(model_gemms(dims, cfg.quant.group_size, gpu).values())
