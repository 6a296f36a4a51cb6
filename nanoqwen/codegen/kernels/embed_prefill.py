"""Prefill token embedding (templates/embed_prefill.cu.j2): ``h[t] = f32(embed[tokens[t]])`` for the n
tokens of a prefill chunk, the batched form of the decode step's embed kernel (embed.py), with the same
clamp and error flag. One launch per chunk: launching the decode embed once per token costs ~40 us of
Python launch overhead each (measured), ~20 ms for a 512-token prompt.

Kernel parameters, in order (``kernel_params``):
  tokens  int32 [n] token ids of the chunk (read after pdl_wait)
  embed   fp16 [vocab, hidden] embedding table (16-byte aligned)
  h       fp32 [n, hidden] output rows
  err     uint32 error flags (sticky): embed.ERR_TOKEN_RANGE when a token is outside [0, vocab) -- it is
          clamped to 0 / vocab-1, never read out of bounds
  n       tokens in the chunk
Launch ``launch(n)``: grid (ceil(hidden / 8 / threads), n), block threads, no dynamic shared memory;
PDL-safe (it waits before touching tokens or h)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ... import config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, inp, out, scalar
from .embed import ERR_TOKEN_RANGE, check_table


@dataclass(frozen=True)
class EmbedPrefillSpec(KernelSpec):
    family = "embed_prefill"
    template = "embed_prefill.cu.j2"
    timeable = True   # templates/embed_prefill.cu.j2 places the timeline probe's hooks
    uri_fields = ("vocab", "hidden", "threads")
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("tokens", "int", restrict=False, note="written by the previous kernel: no .nc load above pdl_wait"), inp("embed", "uint4"), out("h", "float4"),
        out("err", "u32"), scalar("n", "int"))

    hidden: int            # row length (fp16 elements)
    vocab: int             # table rows
    threads: int = 128     # threads per CTA, one 16-byte vector each
    max_n: int = 4096      # tokens the default grid covers (launch(n) sizes it for a call)

    def validate(self) -> None:
        super().validate()
        check_table(self)
        if not 0 < self.max_n <= 65535:
            raise SpecError(f"{self.family}.max_n must be in 1..65535 (grid y), got {self.max_n}")

    def context(self) -> dict:
        return {**super().context(), "err_token_range": ERR_TOKEN_RANGE}

    def launch(self, n: int | None = None) -> Launch:
        n = self.max_n if n is None else n
        if not 0 < n <= 65535:
            raise SpecError(f"{self.family}: n must be in 1..65535, got {n}")
        return Launch(grid=(-(-self.hidden // 8 // self.threads), n, 1), block=(self.threads, 1, 1))


def specs_for_model(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return [EmbedPrefillSpec(hidden=dims.hidden, vocab=dims.vocab, threads=cfg.embed.threads)]
