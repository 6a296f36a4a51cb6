"""Prefill attention over the paged KV cache, as two kernels per layer and chunk of n tokens at positions
[p0, p0 + n) (chunked prefill: memory stays bounded by the chunk, earlier chunks are read from the pages):

1. ``rope_append_prefill``: RoPE on q, k of every token of the chunk (fp32, shared cos/sin tables
   [positions, head_dim/2]), q_rot fp32 [n, heads*head_dim] out, f16(k_rot), f16(v) into the pages.
   Parameters: qkv f32 [n, (heads + 2*kv_heads)*head_dim] (the QKV GEMM's output), rope_cos, rope_sin,
   page_table int32, q_rot, k_pool, v_pool, p0, n. Grid ``launch(n)``: (n, heads + kv_heads).
2. ``attention_prefill``: causal flash attention (mma.sync, fp32 online softmax, q and p split into fp16
   hi + lo) of the chunk against keys [0, p0 + n), o16 f16 [n, heads*head_dim] out (the o_proj GEMM's X).
   Parameters: q_rot, k_pool, v_pool, page_table, o16, p0, n. Grid ``launch(n)``: (ceil(n / (16*warps)),
   heads), dynamic shared memory 2 slots x (K + V) tiles of bkv keys + the q hi / lo tiles.
   Split-KV variant (``max_splits > 1``, for short chunks: a prefix-reuse tail of 32 tokens at p0 = 4064 is
   28 CTAs walking 64 KV tiles each otherwise): grid ``launch(n, splits)`` = (q tiles, heads, splits),
   split s walks a contiguous share of the CTA's KV tiles and writes its unnormalized partial instead of
   o16 (parameters part_acc, part_ml in place of o16); ``splits_for(p0 + n)`` picks the split count.
3. ``attention_prefill_combine``: merges the splits (attention.cuh's log-sum-exp weights) into o16.
   Parameters: part_acc, part_ml, o16, splits, n. Grid ``launch(n)``: (n, heads), block head_dim.

Partials, fp32, per split s, chunk row r and query head h (index (s * n + r) * heads + h): ``part_acc
[.., head_dim]`` the sum exp2(s2 - m2) * v, ``part_ml [.., 2]`` (m2, l), scores in base-2 units as in the
decode partials (kernels/attention.py); a split that sees no key of a row writes (-inf, 0, 0).
Sizes: ``partial_bytes(dims, rows)`` for chunks of up to ``rows`` tokens and MAX_KV_SPLITS splits.

Pools are [num_pages, kv_heads, page_size, head_dim] fp16; the page table maps logical page -> physical page
and must cover positions [0, p0 + n)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ...config import Config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, inp, out, scalar

MAX_KV_SPLITS = 16   # split-KV variant's most splits: 16 x 28 heads = 448 CTAs on the 7B (132 SMs)


def _check_heads(family: str, head_dim: int, heads: int, kv_heads: int, page_size: int) -> None:
    if head_dim % 64 or not 64 <= head_dim <= 256:
        raise SpecError(f"{family}.head_dim must be 64, 128, 192 or 256, got {head_dim}")
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise SpecError(f"{family}: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if page_size <= 0:
        raise SpecError(f"{family}.page_size must be positive, got {page_size}")


@dataclass(frozen=True)
class RopeAppendPrefillSpec(KernelSpec):
    family = "rope_append_prefill"
    template = "rope_append_prefill.cu.j2"
    uri_fields = ("head_dim", "heads", "kv_heads")
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("qkv", "float"), inp("rope_cos", "float"), inp("rope_sin", "float"), inp("page_table", "int"),
        out("q_rot", "float"), out("k_pool", "f16"), out("v_pool", "f16"), scalar("p0", "int"), scalar("n", "int"))

    head_dim: int
    heads: int
    kv_heads: int
    page_size: int = 16
    max_n: int = 4096        # chunk length the default grid covers (launch(n) sizes it for a call)

    def validate(self) -> None:
        super().validate()
        _check_heads(self.family, self.head_dim, self.heads, self.kv_heads, self.page_size)
        if self.max_n <= 0:
            raise SpecError(f"{self.family}.max_n must be positive, got {self.max_n}")

    def launch(self, n: int | None = None) -> Launch:
        return Launch(grid=(self.max_n if n is None else n, self.heads + self.kv_heads, 1),
                      block=(self.head_dim // 2, 1, 1))


@dataclass(frozen=True)
class AttentionPrefillSpec(KernelSpec):
    family = "attention_prefill"
    template = "attention_prefill.cu.j2"
    uri_fields = ("head_dim", "heads", "kv_heads", "warps", "bkv", "max_splits")

    head_dim: int
    heads: int
    kv_heads: int
    page_size: int = 16
    warps: int = 4           # warps per CTA, 16 query tokens each
    bkv: int = 64            # keys per KV tile (whole pages)
    split: bool = True       # q and p as fp16 hi + lo (two mma's each): fp32-like Q.K and P.V
    max_n: int = 4096        # chunk length the default grid covers (launch(n) sizes it for a call)
    max_smem: int = DEFAULT.max_smem   # the GPU's opt-in shared memory per block (gpu.GpuProfile)
    max_splits: int = 1      # 1: o16 out; > 1: split-KV partials out, up to max_splits splits (grid.z)

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        """Every parameter of the family, in C++ order, with whether this variant takes it."""
        split_kv = self.max_splits > 1
        return ((inp("q_rot", "float"), True), (inp("k_pool", "f16"), True), (inp("v_pool", "f16"), True),
                (inp("page_table", "int"), True), (out("o16", "f16"), not split_kv),
                (out("part_acc", "float"), split_kv), (out("part_ml", "float"), split_kv),
                (scalar("p0", "int"), True), (scalar("n", "int"), True))

    @property
    def kernel_params(self) -> tuple[Param, ...]:
        return tuple(p for p, taken in self._family_params() if taken)

    def context(self) -> dict:
        absent = [p.null_constant() for p, taken in self._family_params() if not taken]
        return super().context() | {"absent_params": "\n".join(absent)}

    def validate(self) -> None:
        super().validate()
        f = self.family
        if not 1 <= self.max_splits <= 65535:
            raise SpecError(f"{f}.max_splits must be in 1..65535 (grid.z), got {self.max_splits}")
        _check_heads(f, self.head_dim, self.heads, self.kv_heads, self.page_size)
        if self.bkv % 16 or self.bkv % self.page_size or not 16 <= self.bkv <= 256:
            raise SpecError(f"{f}.bkv must be a multiple of 16 and of page_size ({self.page_size}) in 16..256, "
                            f"got {self.bkv}")
        if not 1 <= self.warps <= 8 or (self.bkv * self.head_dim // 8) % (32 * self.warps):
            raise SpecError(f"{f}.warps must be 1..8 and split the bkv x head_dim tile copies evenly, "
                            f"got {self.warps}")
        if self.smem_bytes > self.max_smem:
            raise SpecError(f"{f}: {self.smem_bytes} bytes of shared memory > max_smem {self.max_smem} (lower bkv)")
        if self.max_n <= 0:
            raise SpecError(f"{f}.max_n must be positive, got {self.max_n}")

    @property
    def smem_bytes(self) -> int:
        kv = 2 * 2 * self.bkv * self.head_dim * 2       # 2 slots x (K + V) x bkv keys x head_dim fp16
        q = (2 if self.split else 1) * 16 * self.warps * self.head_dim * 2   # q hi (+ lo) tiles
        return kv + q

    def launch(self, n: int | None = None, splits: int = 1) -> Launch:
        n = self.max_n if n is None else n
        if not 1 <= splits <= self.max_splits:
            raise ValueError(f"{self.family}: {splits} KV splits, the variant takes 1..{self.max_splits}")
        bq = 16 * self.warps
        return Launch(grid=(-(-n // bq), self.heads, splits), block=(32 * self.warps, 1, 1), smem=self.smem_bytes)

    def splits_for(self, keys: int) -> int:
        """KV splits of a chunk whose last row sees ``keys`` keys: 2 whole KV tiles or more per split."""
        return max(1, min(self.max_splits, -(-keys // self.bkv) // 2))

    def flops(self, p0: int, n: int) -> int:
        """Useful (causal) flops: 4 * head_dim per (query, visible key) pair per head."""
        pairs = n * p0 + n * (n + 1) // 2
        return 4 * self.head_dim * self.heads * pairs


@dataclass(frozen=True)
class AttentionPrefillCombineSpec(KernelSpec):
    family = "attention_prefill_combine"
    template = "attention_prefill_combine.cu.j2"
    uri_fields = ("head_dim", "heads")
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("part_acc", "float"), inp("part_ml", "float"), out("o16", "f16"), scalar("splits", "int"),
        scalar("n", "int"))

    head_dim: int
    heads: int
    max_n: int = 4096        # chunk length the default grid covers (launch(n) sizes it for a call)

    def validate(self) -> None:
        super().validate()
        if self.head_dim % 32 or not 32 <= self.head_dim <= 1024:
            raise SpecError(f"{self.family}.head_dim must be a multiple of 32 in 32..1024, got {self.head_dim}")
        if self.heads <= 0 or self.max_n <= 0:
            raise SpecError(f"{self.family}: heads and max_n must be positive, got {self.heads}, {self.max_n}")

    def launch(self, n: int | None = None) -> Launch:
        return Launch(grid=(self.max_n if n is None else n, self.heads, 1), block=(self.head_dim, 1, 1))


def partial_bytes(dims: ModelDims, rows: int) -> tuple[int, int]:
    """(part_acc, part_ml) bytes of the split-KV partials of chunks of up to ``rows`` tokens."""
    parts = MAX_KV_SPLITS * rows * dims.heads
    return parts * dims.head_dim * 4, parts * 2 * 4


def prefill_attention_specs(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT
                            ) -> tuple[RopeAppendPrefillSpec, AttentionPrefillSpec]:
    kw = dict(head_dim=dims.head_dim, heads=dims.heads, kv_heads=dims.kv_heads, page_size=cfg.kv_cache.page_size)
    return RopeAppendPrefillSpec(**kw), AttentionPrefillSpec(**kw, max_smem=gpu.max_smem)


def split_kv_specs(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT
                   ) -> tuple[AttentionPrefillSpec, AttentionPrefillCombineSpec]:
    """The split-KV attention of short chunks and its combine, in launch order."""
    attn = dataclasses.replace(prefill_attention_specs(dims, cfg, gpu)[1], max_splits=MAX_KV_SPLITS)
    return attn, AttentionPrefillCombineSpec(head_dim=dims.head_dim, heads=dims.heads)


def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return [*prefill_attention_specs(dims, cfg, gpu), *split_kv_specs(dims, cfg, gpu)]
