"""Prefill INT4 GEMM (tensor cores): Y[M, N] = X[M, K] . W^T with W in the .nanoqwen INT4 layout,
dequantized to fp16 in the mainloop and fed to mma.sync m16n8k16 (fp32 accumulation). M is a run-time
argument (1..4096, tails masked); N and K are baked in. Epilogues match the decode GEMVs:

- ``f32``      y f32 [M, N] = acc (+ f32(bias)): fused QKV (bias on).
- ``residual`` y f32 [M, N] += acc: o_proj and down_proj into the fp32 residual stream.
- ``swiglu``   y f16 [M, N/2] = f16(silu(gate) * up): ``w``/``s`` are gate, ``w2``/``s2`` up (each
               [N/2, K]; the runtime's ``gate_up`` region holds gate rows then up rows, so w2 = w + N/2 rows).
- ``f16``      y f16 [M, N] = f16(acc (+ f32(bias))).

The RMSNorm in front of QKV and gate/up is a separate small kernel for prefill (rmsnorm_prefill family):
with M rows the norm costs one read of X, far below the GEMM's time, and keeping it out of the mainloop
lets X be streamed by cp.async straight from global memory.

``split_k`` > 1 (residual only) spreads K over grid z with atomic fp32 adds into y: o_proj and down have
only N/bn x M/bm CTAs (112 at M=512 on 132 SMs).

``gemv_order``: every output in the order of the tensor-core GEMV (gemv_int4 with ``mma``, split ``splits``
ways), so that a row of Y is bitwise the row that GEMV makes from the same x, whatever M and the tile:
weights as the MMA's A operand in integers, per 128-input group a chain of 8 MMAs from zero and one fp32 FMA
with the scale, the splits' totals added in split order, the GEMV's epilogue (templates/mma.cuh, "the group
MMAs"). Then bn counts weight rows in 16s per warp and bm tokens in 8s, bk is the group (128), and split_k
stays 1 (atomic adds have no order). Both fields are late fields: the fold-order kernels keep their names.

``LARGE_M_ROLE_TILES`` changes the default 128 x 128 tile per role for the long chunks (65..512 rows), from
two sweeps at M = 512 on H100s (2026-12-06 and 12-07, bench.prefill; perf-notes, twenty-ninth session): qkv
(4608 columns: 36 x 4 CTAs of the default tile on 132 SMs) takes 64 x 64 tiles, three CTAs an SM (113 -> 91 us),
the others a 128-deep k-tile on a 3-stage ring (gate_up 517 -> 501 us, down 284 -> 279, o_proj 64.2 -> 63.5).

``SMALL_M_TILES`` is the tile set for chunks of a few rows (a prefix-reuse tail, a short prompt): the
default 128 x 128 tile gives M <= 128 only N/128 CTAs (28 for o_proj/down on 132 SMs), each streaming 128
weight rows with most of its X rows empty; 16-row tiles waste at most 15 rows and bn 32 gives N/32 x
ceil(M/16) CTAs (224 for o_proj/down at M = 32). Every CTA streams its own copy of X's rows (from L2:
4 M / bn bytes per weight byte). ``SMALL_M_ROLE_TILES`` changes that per role, from a sweep of 48 tiles at
8, 16, 32 and 64 rows (H100, 2026-12-07; perf-notes, twenty-sixth session): these kernels issue an instruction
every 2 cycles a scheduler from 2-4 warps, so a tile wins by dequantizing each weight for fewer of them. gate_up
takes 32 rows a CTA (one dequantized weight serves both m16 tiles: 67.8 -> 49.2 us at 32 rows, 114.6 -> 82.2 at
64, but 43.3 -> 48.4 at 8 or 16), down two warps of 16 columns and an 8-deep ring (56.2 -> 52.5 us at 32 rows).
The runtime picks them for chunks of at most ``prefill.small_m_tokens`` rows. They take ``scale_ring``: a k-tile's
group scales ride the cp.async ring with the weights (templates/mma.cuh) instead of plain loads a k-tile ahead,
whose latency each of a short chunk's k-tiles waited out (H100, one call: the 32-row re-request 7.68 -> 7.27 ms);
the long chunks keep the loads (with the ring pp512 TTFT was +3.2%).

Kernel parameters, in order (``kernel_params``; unused pointers may be 0):
``x`` f16 [M, K], ``w`` u32 [N, K/8], ``s`` f16 [N, K/128], ``w2``, ``s2`` (SwiGLU up half), ``bias`` f16 [N],
``y`` (see above), ``m`` rows. Grid ``launch(m)``: (N / bn, ceil(m / bm)); dynamic shared memory is
``stages * (bm*bk*2 + bn*bk/2)`` bytes, plus ``4*bn`` a stage with ``scale_ring`` (> 48 KB: the driver raises
the function's limit)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ...config import Config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, inp, out, scalar, whole_splits

EPILOGUES = ("f32", "residual", "swiglu", "f16")


def check_contract(spec) -> None:
    """What every prefill GEMM family (gemm_int4, gemm_wgmma) asks of the contract they share: the
    epilogue, bias only where it is added, a k-tile of 64 or 128 inside a scale group, whole N tiles and
    whole groups along K."""
    f = spec.family
    if spec.epilogue not in EPILOGUES:
        raise SpecError(f"{f}.epilogue must be one of {', '.join(EPILOGUES)}, got {spec.epilogue!r}")
    if spec.bias and spec.epilogue not in ("f32", "f16"):
        raise SpecError(f"{f}.bias is only supported with the f32 and f16 epilogues")
    if spec.bk not in (64, 128):
        raise SpecError(f"{f}.bk must be 64 or 128, got {spec.bk}")
    if spec.group % spec.bk:
        raise SpecError(f"{f}.group ({spec.group}) must be a multiple of bk ({spec.bk})")
    if spec.n <= 0 or spec.n % spec.bn:
        raise SpecError(f"{f}.n ({spec.n}) must be a positive multiple of bn ({spec.bn})")
    if spec.k <= 0 or spec.k % spec.group:
        raise SpecError(f"{f}.k ({spec.k}) must be a positive multiple of group ({spec.group})")


@dataclass(frozen=True)
class GemmInt4Spec(KernelSpec):
    family = "gemm_int4"
    template = "gemm_int4.cu.j2"
    timeable = True   # the short chunks' graphs time it (bench/timeline.py measure_chunk); fold order only
    uri_fields = ("epilogue", "n", "k", "gemv_order", "splits", "bm", "bn", "bk", "stages", "scale_ring")
    late_fields = KernelSpec.late_fields + ("gemv_order", "splits", "scale_ring")
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("x", "f16"), inp("w", "u32"), inp("s", "f16"), inp("w2", "u32"), inp("s2", "f16"), inp("bias", "f16"),
        out("y", "void"), scalar("m", "int"))

    n: int                   # GEMM columns (weight rows; 2 x intermediate for swiglu)
    k: int                   # reduction length (weight row length)
    epilogue: str = "f32"    # one of EPILOGUES
    bias: bool = False       # add f32(bias) (f32 / f16 epilogues)
    group: int = 128         # inputs per fp16 scale
    bm: int = 128            # rows of X per CTA
    bn: int = 128            # columns of Y per CTA
    bk: int = 64             # reduction step per pipeline stage (64 or 128)
    warps_m: int = 2         # warps along M
    warps_n: int = 4         # warps along N
    stages: int = 4          # cp.async ring depth
    min_blocks: int = 1      # CTAs per SM the registers must allow (__launch_bounds__; 2 caps at 128)
    split_k: int = 1         # CTAs along K, partials added atomically (residual epilogue only)
    max_m: int = 4096        # rows the default grid covers (launch(m) sizes it for a call)
    max_smem: int = DEFAULT.max_smem   # the GPU's opt-in shared memory per block (gpu.GpuProfile)
    gemv_order: bool = False  # each row bitwise the tensor-core GEMV's (see the module docstring)
    splits: int = 1           # gemv_order: the GEMV's K splits (its splitk), summed in split order
    scale_ring: bool = False  # the group scales ride the cp.async ring (short chunks; see SMALL_M_TILES)

    def validate(self) -> None:
        super().validate()
        check_contract(self)
        f = self.family
        row_m, row_n = (8, 16) if self.gemv_order else (16, 8)
        if self.bm % (row_m * self.warps_m) or self.bn % (row_n * self.warps_n):
            raise SpecError(f"{f}: bm must split into warps_m x {row_m} rows and bn into warps_n x {row_n} "
                            f"columns (bm={self.bm}, warps_m={self.warps_m}, bn={self.bn}, warps_n={self.warps_n})")
        if self.gemv_order:
            if self.bk != 128 or self.group != 128 or self.split_k != 1:
                raise SpecError(f"{f}.gemv_order takes bk = group = 128 and split_k = 1 (got bk={self.bk}, "
                                f"group={self.group}, split_k={self.split_k})")
            if not 1 <= self.splits <= 8 or (self.k // self.group) % self.splits:
                raise SpecError(f"{f}.splits ({self.splits}) must be 1..8 and split k={self.k} on group "
                                f"boundaries (the GEMV's splitk)")
            if self.timed:   # its PDL wait sits in gemv_order_tile, outside the probe's scope
                raise SpecError(f"{f}: timed=True takes the fold order (the GEMV order's tile has no probe hooks)")
        elif self.splits != 1:
            raise SpecError(f"{f}.splits is the gemv_order's (the GEMV's K splits); without it, 1")
        threads = 32 * self.warps_m * self.warps_n
        if threads > 1024 or (self.bm * self.bk // 8) % threads or (self.bn * self.bk // 32) % threads:
            raise SpecError(f"{f}: {threads} threads must split the bm x bk and bn x bk tile copies evenly")
        if not 2 <= self.stages <= 8:
            raise SpecError(f"{f}.stages must be 2..8, got {self.stages}")
        if self.smem_bytes > self.max_smem:
            raise SpecError(f"{f}: {self.smem_bytes} bytes of shared memory > max_smem {self.max_smem} "
                            f"(lower stages, bm, bn or bk)")
        if self.split_k < 1 or self.k % (self.bk * self.split_k):
            raise SpecError(f"{f}.split_k ({self.split_k}) must be >= 1 and split k ({self.k}) into whole "
                            f"bk ({self.bk}) tiles")
        if self.split_k > 1 and self.epilogue != "residual":
            raise SpecError(f"{f}.split_k > 1 needs the residual epilogue (partials are added atomically)")
        if not 1 <= self.min_blocks <= 4:
            raise SpecError(f"{f}.min_blocks must be 1..4, got {self.min_blocks}")
        if self.max_m <= 0:
            raise SpecError(f"{f}.max_m must be positive, got {self.max_m}")

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm * self.bk * 2 + self.bn * self.bk // 2 + (4 * self.bn if self.scale_ring else 0))

    def context(self) -> dict:
        return super().context() | {"epilogue_id": EPILOGUES.index(self.epilogue)}

    def launch(self, m: int | None = None) -> Launch:
        m = self.max_m if m is None else m
        if m <= 0:
            raise SpecError(f"{self.family}: m must be positive, got {m}")
        return Launch(grid=(self.n // self.bn, -(-m // self.bm), self.split_k),
                      block=(32 * self.warps_m * self.warps_n, 1, 1), smem=self.smem_bytes)

    def flops(self, m: int) -> int:
        return 2 * m * self.n * self.k


LARGE_M_ROLE_TILES = {"qkv": dict(bm=64, bn=64, warps_n=2, min_blocks=3), "o_proj": dict(bk=128, stages=3),
                      "gate_up": dict(bk=128, stages=3), "down": dict(bk=128, stages=3)}
# one warp row of 16 x 8 warp tiles; bk 128 so the 128 threads split both tile copies evenly
SMALL_M_TILES = dict(bm=16, bn=32, bk=128, warps_m=1, warps_n=4, stages=4, scale_ring=True)
SMALL_M_ROLE_TILES = {"gate_up": dict(bm=32, bn=64), "down": dict(warps_n=2, stages=8)}
# GEMV order: a lane holds two accumulator sets (the running sum and a group's MMA chain), so a warp tile is
# half the fold order's: 32 tokens x 32 weight rows (178-198 registers, no spills; the main loop's SASS 5.6
# instructions an HMMA, 6.8 for down's split sums, against the fold order's 5.2: 16 x 64 was 8.2, each
# dequantized weight serving half the tokens). A few rows: 16 x 32 (9.4 an HMMA), two warps a CTA, so that
# qkv's 4608 rows still make 72 CTAs along N, with a deeper ring for the weight stream.
GEMV_ORDER_TILES = dict(bm=64, bn=128, bk=128, warps_m=2, warps_n=4, stages=4)
GEMV_ORDER_SMALL_M_TILES = dict(bm=16, bn=64, bk=128, warps_m=1, warps_n=2, stages=6, scale_ring=True)


def role_shapes(dims: ModelDims) -> dict[str, dict]:
    """Each prefill GEMM role's N, K and epilogue (q, k, v stacked into one qkv GEMM), for every GEMM family
    (gemm_int4 here, gemm_wgmma)."""
    h, qkv = dims.hidden, dims.q_dim + 2 * dims.kv_dim
    return {"qkv": dict(n=qkv, k=h, epilogue="f32", bias=True),
            "o_proj": dict(n=h, k=dims.q_dim, epilogue="residual"),
            "gate_up": dict(n=2 * dims.intermediate, k=h, epilogue="swiglu"),
            "down": dict(n=h, k=dims.intermediate, epilogue="residual")}


def model_gemms(dims: ModelDims, group: int = 128, gpu: GpuProfile = DEFAULT, small_m: bool = False,
                gemv_splits: dict[str, int] | None = None) -> dict[str, GemmInt4Spec]:
    """The four prefill GEMMs of one decoder layer, by role (q, k, v stacked into one qkv GEMM), in
    LARGE_M_ROLE_TILES; with ``small_m`` in SMALL_M_TILES, for chunks of a few rows; with ``gemv_splits``
    ({role: the GEMV's K splits}) in the GEMV order, each split count shrunk to whole groups for small test models."""
    specs = {}
    for role, shape in role_shapes(dims).items():
        kw = dict(group=group, max_smem=gpu.max_smem)
        if gemv_splits is not None:
            kw |= dict(gemv_order=True, splits=whole_splits(shape["k"], group, gemv_splits[role]),
                       **(GEMV_ORDER_SMALL_M_TILES if small_m else GEMV_ORDER_TILES))
        elif small_m:
            kw |= SMALL_M_TILES | SMALL_M_ROLE_TILES.get(role, {})
        else:
            kw |= LARGE_M_ROLE_TILES[role]
        specs[role] = GemmInt4Spec(**shape, **kw)
    return specs


def config_gemms(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT, small_m: bool = False,
                 gemv_order: bool | None = None):
    """``model_gemms`` in the order the config's prefill section names (``prefill.gemv_order``, unless
    ``gemv_order`` says), the GEMV order with its ``prefill.gemv_order_splits``."""
    p = cfg.prefill
    gemv_order = p.gemv_order if gemv_order is None else gemv_order
    return model_gemms(dims, cfg.quant.group_size, gpu, small_m,
                       dataclasses.asdict(p.gemv_order_splits) if gemv_order else None)


# Threads of an RMSNorm row: the virtual threads of the sum's layout (templates/rmsnorm.cuh NORM_THREADS,
# which the template checks against this).
NORM_THREADS = 128


@dataclass(frozen=True)
class RmsnormPrefillSpec(KernelSpec):
    """xn f16 [M, hidden] = f16(rmsnorm(h) * w) for the M rows of a prefill chunk (the GEMMs' X), in the
    arithmetic of the decode GEMVs' RMSNorm prologue (templates/rmsnorm.cuh): the same bits for a row.
    Parameters: h f32 [M, hidden], w f16 [hidden], xn, m. Grid ``launch(m)``: (m,), NORM_THREADS a row."""
    family = "rmsnorm_prefill"
    template = "rmsnorm_prefill.cu.j2"
    timeable = True   # the multi-row step runs it too (multirow.norm_apart): the timeline's hooks are placed
    uri_fields = ("hidden",)
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("h", "float", restrict=False, note="written by the previous kernel: no .nc"), inp("w", "f16"),
        out("xn", "f16"), scalar("m", "int"))

    hidden: int
    eps: float
    max_m: int = 4096        # rows the default grid covers

    def validate(self) -> None:
        super().validate()
        if self.hidden <= 0 or self.hidden % 8:
            raise SpecError(f"{self.family}: hidden ({self.hidden}) must be a positive multiple of 8")
        if self.eps <= 0 or self.max_m <= 0:
            raise SpecError(f"{self.family}: eps and max_m must be positive")

    def context(self) -> dict:
        return super().context() | {"threads": NORM_THREADS}

    def launch(self, m: int | None = None) -> Launch:
        return Launch(grid=(self.max_m if m is None else m, 1, 1), block=(NORM_THREADS, 1, 1))


def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    norm = RmsnormPrefillSpec(hidden=dims.hidden, eps=dims.rms_eps)
    return [*config_gemms(dims, cfg, gpu).values(), *config_gemms(dims, cfg, gpu, small_m=True).values(), norm]
