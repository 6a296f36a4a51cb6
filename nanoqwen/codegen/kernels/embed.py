"""Token embedding (templates/embed.cu.j2), the first kernel of a decode step: ``h = f32(embed[state[0]])``
into the fp32 residual stream, reading the token the previous step's argmax left in device memory.

Kernel parameters, in order (``kernel_params``):
  state        int32 [4] device decode state; reads state[0] after pdl_wait
  embed        fp16 [vocab, hidden] embedding table (16-byte aligned)
  h            fp32 [hidden] output
  err          uint32 error flags (sticky; the host clears and checks them): ERR_TOKEN_RANGE when
               state[0] is outside [0, vocab) -- the token is clamped to 0 / vocab-1, never read out of bounds
  argmax_done  uint32 arrival counter of lm_head_argmax, reset to 0 here each step (see lm_head.py)
Launch: grid ceil(hidden / 8 / threads), block threads, no dynamic shared memory; PDL-safe (it waits
before reading state and lets the next kernel launch at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ... import config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, inp, out

ERR_TOKEN_RANGE = 1  # *err bit set by the embed kernel: state[0] was not a valid token id


def check_table(spec) -> None:
    """The fields both embed kernels share: the table's row length and rows, and the block size."""
    f = spec.family
    if spec.hidden <= 0 or spec.hidden % 8:
        raise SpecError(f"{f}.hidden must be a positive multiple of 8 (16-byte rows), got {spec.hidden}")
    if not 0 < spec.vocab < 2**31:
        raise SpecError(f"{f}.vocab must be in 1..2^31-1, got {spec.vocab}")
    if spec.threads % 32 or not 32 <= spec.threads <= 1024:
        raise SpecError(f"{f}.threads must be a multiple of 32 in 32..1024, got {spec.threads}")


@dataclass(frozen=True)
class EmbedSpec(KernelSpec):
    family = "embed"
    template = "embed.cu.j2"
    timeable = True   # templates/embed.cu.j2 places the timeline probe's hooks
    uri_fields = ("vocab", "hidden", "threads")
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("state", "int", restrict=False, note="written by the previous kernel: no .nc load above pdl_wait"), inp("embed", "uint4"), out("h", "float4"),
        out("err", "u32"), out("argmax_done", "u32"))

    hidden: int            # row length (fp16 elements)
    vocab: int             # table rows
    threads: int = 128     # threads per CTA, one 16-byte vector each

    def validate(self) -> None:
        super().validate()
        check_table(self)

    def context(self) -> dict:
        return {**super().context(), "err_token_range": ERR_TOKEN_RANGE}

    def launch(self) -> Launch:
        return Launch(grid=(-(-self.hidden // 8 // self.threads), 1, 1), block=(self.threads, 1, 1))


def specs_for_model(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return [EmbedSpec(hidden=dims.hidden, vocab=dims.vocab, threads=cfg.embed.threads)]
