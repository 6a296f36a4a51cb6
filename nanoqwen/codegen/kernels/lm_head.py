"""Final RMSNorm + fp16 lm_head GEMV + fused greedy argmax + decode-state advance
(templates/lm_head_argmax.cu.j2): the last kernel of a decode step and the largest one (7B: 1.09 GB of
fp16 weights per token, ~260 us at 4.2 TB/s).

Over m = 1..16 rows (the multi-row step, DESIGN.md section 12) the head is read once for all rows and
each row's logits and token are bitwise the m = 1 kernel's on that row alone.

Kernel parameters, in order (``kernel_params``):
  h            fp32 [m, hidden] residual stream (read after pdl_wait)
  norm_w       fp16 [hidden] final norm weight (model.norm.weight)
  lm_head      fp16 [vocab, hidden] (lm_head.weight, or the embedding table when tied)
  logits       fp32 [m, vocab] output, or 0 to skip it (host-side sampling and tests need it)
  state        m = 1 only: int32 [4] device decode state: writes state[0] = next token,
               tokens_out[state[2]] = it, state[1] += 1, state[2] += 1, once per launch, after every CTA's
               partial is combined
  tokens_out   int32 [tokens_cap] finished tokens (the host reads them back); m > 1: row a's token at
               tokens_out[a], no state advanced (the speculative verify decides what is accepted)
  tokens_cap   u32 capacity of tokens_out; a step (m > 1: a row) >= tokens_cap writes nothing there and
               sets ERR_TOKENS_OUT_FULL
  partials     u64 [m, ctas] scratch (partials_bytes): one key per row per CTA, fully rewritten by every launch
  argmax_done  u32 scratch counter; must be 0 before the first launch (the embed kernel zeroes it each
               step; the kernel itself wraps it back to 0), so graph replays need no host reset
  err          u32 error flags (sticky): ERR_NO_FINITE_LOGIT when every logit is NaN (token 0 is written)
Launch: grid (ctas,) exactly as ``launch()`` says (the stride and the arrival count are compiled in),
block warps*32; m = 1: static shared memory only (hidden*4 bytes of x + a few words), m > 1: m*hidden*4
bytes of x in dynamic shared memory.

Ties: the lowest index wins; NaN never wins (unlike np.argmax, which returns the first NaN).
Sampling (temperature / top-p) is not fused: the runtime passes a logits buffer and samples on the host
(runtime/sampler.py); greedy stays entirely on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ... import config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, VariantParams, inp, out, scalar

ERR_NO_FINITE_LOGIT = 2   # *err bit: every logit was NaN (state[0] = 0)
ERR_TOKENS_OUT_FULL = 4   # *err bit: state[2] >= tokens_cap (tokens_out not written)

_SMEM_STATIC_MAX = 48 * 1024
_SMEM_MARGIN = 4096   # static shared memory beside x (per-row warp sums and maxima) + the 1 KB sm_90 reservation
# Per lane at m > 1: accumulators (2 m rows_per_warp) + weights in flight (4 rows_per_warp unroll) registers.
# 7B's 8 x 2 x 14 and 16 x 2 x 10 compile to 236 registers; 16 x 2 x 14 spills.
_LIVE_REGS = 144
MAX_M = config.MAX_ROWS   # activation rows of the multi-row step


def lane_vecs(hidden: int) -> int:
    """16-byte vectors of one row each lane loads: ceil(hidden / 8 / 32)."""
    return -(-(hidden // 8) // 32)


def chains(hidden: int, unroll: int) -> tuple[int, ...]:
    """The accumulator chain each of a lane's vectors of a row goes into (acc[u & 1], u its place in a batch of
    ``unroll``): with the lanes, a row's summation order, which an m-row kernel keeps from m = 1."""
    return tuple((j % unroll) & 1 for j in range(lane_vecs(hidden)))


@dataclass(frozen=True)
class LmHeadArgmaxSpec(VariantParams, KernelSpec):
    family = "lm_head_argmax"
    template = "lm_head_argmax.cu.j2"
    timeable = True   # templates/lm_head_argmax.cu.j2 places the timeline probe's hooks
    uri_fields = ("vocab", "hidden", "warps", "rows_per_warp", "unroll", "ctas", "m")

    hidden: int                 # K: model hidden size
    vocab: int                  # N: lm_head rows
    ctas: int                   # persistent grid size (config lm_head.ctas_per_sm x the GPU's SMs)
    eps: float = 1e-6           # final RMSNorm epsilon (dims.rms_eps)
    warps: int = 8              # warps per CTA
    rows_per_warp: int = 1      # rows one warp reduces together
    unroll: int = 14            # 16-byte loads per lane per row in flight before the first FMA (<= lane_vecs)
    m: int = 1                  # activation rows sharing each lm_head read (1..16)

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        """Every parameter of the family, in C++ order, with whether this variant takes it."""
        return ((inp("h", "float4", restrict=False, note="written by the previous kernel: no .nc load above "
                     "pdl_wait"), True), (inp("norm_w", "uint2"), True), (inp("lm_head", "uint4"), True),
                (out("logits", "float", note="or 0 to skip it"), True), (out("state", "int"), self.m == 1),
                (out("tokens_out", "int"), True), (scalar("tokens_cap", "u32"), True),
                (out("partials", "u64"), True), (out("argmax_done", "u32"), True), (out("err", "u32"), True))

    @property
    def xs_bytes(self) -> int:
        """Shared memory of the staged x rows (fp32, hidden per row); dynamic when m > 1."""
        return 4 * self.hidden * self.m

    @property
    def partials_bytes(self) -> int:
        """Size of the ``partials`` scratch buffer the runtime allocates."""
        return 8 * self.ctas * self.m

    def validate(self) -> None:
        super().validate()
        if self.hidden <= 0 or self.hidden % 8:
            raise SpecError(f"lm_head_argmax.hidden must be a positive multiple of 8, got {self.hidden}")
        if not 0 < self.vocab < 2**31:
            raise SpecError(f"lm_head_argmax.vocab must be in 1..2^31-1, got {self.vocab}")
        if not self.eps > 0:
            raise SpecError(f"lm_head_argmax.eps must be positive, got {self.eps}")
        if not 1 <= self.warps <= 32:
            raise SpecError(f"lm_head_argmax.warps must be 1..32, got {self.warps}")
        if not 1 <= self.rows_per_warp <= 32 or self.vocab % self.rows_per_warp:
            raise SpecError(f"lm_head_argmax.rows_per_warp must be 1..32 and divide vocab={self.vocab}, "
                            f"got {self.rows_per_warp}")
        if not 1 <= self.unroll <= lane_vecs(self.hidden):
            raise SpecError(f"lm_head_argmax.unroll must be 1..{lane_vecs(self.hidden)} (a lane's 16-byte "
                            f"vectors per row for hidden={self.hidden}), got {self.unroll}")
        if self.rows_per_warp * self.unroll > 32:
            raise SpecError(f"lm_head_argmax: rows_per_warp * unroll = {self.rows_per_warp * self.unroll} "
                            f"loads in flight per lane would need > 128 registers (max 32)")
        if self.ctas <= 0:
            raise SpecError(f"lm_head_argmax.ctas must be positive, got {self.ctas}")
        if not 1 <= self.m <= MAX_M:
            raise SpecError(f"lm_head_argmax.m must be 1..{MAX_M} activation rows, got {self.m}")
        if self.m > 1 and self.xs_bytes + 12 * self.m * self.warps + 4 > DEFAULT.max_smem:
            raise SpecError(f"lm_head_argmax.m={self.m}: x needs {self.xs_bytes} bytes of shared memory "
                            f"(hidden={self.hidden}) > {DEFAULT.max_smem}")
        smem = 4 * self.hidden + 12 * self.warps + 4
        if self.m == 1 and smem > _SMEM_STATIC_MAX:
            raise SpecError(f"lm_head_argmax.hidden={self.hidden}: x needs {smem} bytes of static shared "
                            f"memory > {_SMEM_STATIC_MAX}")

    def context(self) -> dict:
        note = "// Parameters this variant does not take: null, read only in if constexpr branches it discards."
        absent = self.absent_params
        return {**super().context(), "err_no_finite_logit": ERR_NO_FINITE_LOGIT,
                "err_tokens_out_full": ERR_TOKENS_OUT_FULL, "absent_params": f"\n{note}\n{absent}" if absent else ""}

    def launch(self) -> Launch:
        return Launch(grid=(self.ctas, 1, 1), block=(32 * self.warps, 1, 1),
                      smem=self.xs_bytes if self.m > 1 else 0)


def model_spec(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT, m: int = 1) -> LmHeadArgmaxSpec:
    """The lm_head + argmax over m rows. m > 1 keeps every per-row arithmetic choice of m = 1 (a vocab row's
    lanes, chains and warp sum depend on neither the grid nor rows_per_warp; the argmax key is order-free),
    reduces up to multirow.lm_head_rows_per_warp vocab rows per warp (each x read from shared memory serves
    them all: m x reads per weight is what holds the m-row kernel back), with fewer loads in flight where the
    accumulators need their registers (_LIVE_REGS; an unroll whose chains are m = 1's), and fits the grid to
    the residency its staged x allows (7B: 14 KB per row), so that every CTA is resident at once."""
    lm = cfg.lm_head
    spec = LmHeadArgmaxSpec(hidden=dims.hidden, vocab=dims.vocab, eps=float(dims.rms_eps), warps=lm.warps,
                            rows_per_warp=lm.rows_per_warp, unroll=min(lm.unroll, lane_vecs(dims.hidden)),
                            ctas=lm.ctas_per_sm * gpu.sm_count, m=m)
    if m > 1:
        resident = max(1, gpu.max_smem // (spec.xs_bytes + _SMEM_MARGIN))
        rows, unroll = max((r, u) for r in range(1, cfg.multirow.lm_head_rows_per_warp + 1) if dims.vocab % r == 0
                           for u in range(1, spec.unroll + 1)
                           if chains(dims.hidden, u) == chains(dims.hidden, spec.unroll)
                           and (2 * m * r + 4 * r * u <= _LIVE_REGS or (r, u) == (1, spec.unroll)))
        spec = dataclasses.replace(spec, ctas=min(lm.ctas_per_sm, resident) * gpu.sm_count, rows_per_warp=rows,
                                   unroll=unroll)
    spec.validate()
    return spec


def specs_for_model(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return [model_spec(dims, cfg, gpu)]


def multirow_specs_for_model(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    """The m > 1 lm_head + argmax kernels, one per multirow bucket (config multirow.buckets)."""
    return [model_spec(dims, cfg, gpu, m) for m in cfg.multirow.buckets if m > 1]
