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
   **Key blocks** (DESIGN.md section 12, templates/kv_blocks.cuh): the keys are cut at fixed multiples of
   ``block_keys``; a row's softmax restarts at each boundary and the blocks' partials are folded in
   ascending order with explicit roundings, so a position's output is bitwise the same in any chunk.
   Split-KV variant (``max_splits > 1``, for short chunks: a prefix-reuse tail of 32 tokens at p0 = 4064 is
   28 CTAs walking 64 KV tiles each otherwise): grid ``launch(n, splits)`` = (q tiles, heads, splits), or with
   ``pack_gqa`` (row tiles of the n x GQA (token, query head) pairs, kv_heads, splits), CTA
   z walks key blocks z, z + splits, ... and writes each block's partial instead of folding it (parameters
   part_acc, part_ml in place of o16); ``splits_for(p0 + n)`` picks the split count (any count gives the
   same bits: it only says which CTA computes which block).
3. ``attention_prefill_combine``: folds a row's key-block partials into o16, the unsplit kernel's fold.
   Parameters: part_acc, part_ml, o16, p0, n. Grid ``launch(n)``: (n, heads), block head_dim.

``device_chunk`` variants (all three kernels) take ``chunk`` (int32 [2] = p0, n in device memory) instead
of the p0, n launch scalars: a captured CUDA graph of a chunk-size bucket replays one grid for any chunk
of up to the bucket's rows at any position.

Partials, fp32, per key block j, chunk row r and query head h (index (j * n + r) * heads + h): ``part_acc
[.., head_dim]`` the sum exp2(s2 - m2) * v, ``part_ml [.., 2]`` (m2, l), scores in base-2 units as in the
decode partials (kernels/attention.py); a block that holds no key of a row is never read for it.
Sizes: ``partial_bytes(dims, rows, blocks)`` for chunks of up to ``rows`` tokens and ``blocks`` key blocks.

Pools are [num_pages, kv_heads, page_size, head_dim] fp16; the page table maps logical page -> physical page
and must cover positions [0, p0 + n)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...config import Config
from ...dims import ModelDims
from ..gpu import DEFAULT, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, VariantParams, inp, out, scalar

MAX_KV_SPLITS = 16   # split-KV variant's most splits: 16 x 28 heads = 448 CTAs on the 7B (132 SMs)


def chunk_params(device_chunk: bool) -> tuple[tuple[Param, bool], ...]:
    """The chunk's first position and row count, with whether a variant takes each: launch scalars, or
    (``device_chunk``) one device pointer to both, which a captured graph reads at replay."""
    return ((scalar("p0", "int"), not device_chunk), (scalar("n", "int"), not device_chunk),
            (inp("chunk", "int", note="p0, n"), device_chunk))


def _check_heads(family: str, head_dim: int, heads: int, kv_heads: int, page_size: int) -> None:
    if head_dim % 64 or not 64 <= head_dim <= 256:
        raise SpecError(f"{family}.head_dim must be 64, 128, 192 or 256, got {head_dim}")
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise SpecError(f"{family}: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if page_size <= 0:
        raise SpecError(f"{family}.page_size must be positive, got {page_size}")


@dataclass(frozen=True)
class RopeAppendPrefillSpec(VariantParams, KernelSpec):
    family = "rope_append_prefill"
    template = "rope_append_prefill.cu.j2"
    timeable = True   # templates/rope_append_prefill.cu.j2 places the timeline probe's hooks
    uri_fields = ("head_dim", "heads", "kv_heads")

    head_dim: int
    heads: int
    kv_heads: int
    page_size: int = 16
    max_n: int = 4096        # chunk length the default grid covers (launch(n) sizes it for a call)
    device_chunk: bool = False   # p0, n from the device (chunk) rather than the launch

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        return ((inp("qkv", "float"), True), (inp("rope_cos", "float"), True), (inp("rope_sin", "float"), True),
                (inp("page_table", "int"), True), (out("q_rot", "float"), True), (out("k_pool", "f16"), True),
                (out("v_pool", "f16"), True), *chunk_params(self.device_chunk))

    def validate(self) -> None:
        super().validate()
        _check_heads(self.family, self.head_dim, self.heads, self.kv_heads, self.page_size)
        if self.max_n <= 0:
            raise SpecError(f"{self.family}.max_n must be positive, got {self.max_n}")

    def launch(self, n: int | None = None) -> Launch:
        return Launch(grid=(self.max_n if n is None else n, self.heads + self.kv_heads, 1),
                      block=(self.head_dim // 2, 1, 1))


@dataclass(frozen=True)
class AttentionPrefillSpec(VariantParams, KernelSpec):
    family = "attention_prefill"
    template = "attention_prefill.cu.j2"
    timeable = True   # templates/attention_prefill.cu.j2 places the timeline probe's hooks
    uri_fields = ("head_dim", "heads", "kv_heads", "warps", "bkv", "block_keys", "max_splits", "pack_gqa")

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
    block_keys: int = 256    # keys per key block: the fixed boundaries of each row's softmax
    device_chunk: bool = False   # p0, n from the device (chunk) rather than the launch
    pack_gqa: bool = False   # a CTA's rows are (token, query head) pairs of one KV head, not tokens of one head

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        """Every parameter of the family, in C++ order, with whether this variant takes it."""
        split_kv = self.max_splits > 1
        return ((inp("q_rot", "float"), True), (inp("k_pool", "f16"), True), (inp("v_pool", "f16"), True),
                (inp("page_table", "int"), True), (out("o16", "f16"), not split_kv),
                (out("part_acc", "float"), split_kv), (out("part_ml", "float"), split_kv),
                *chunk_params(self.device_chunk))

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
        check_block_keys(f, self.block_keys, self.bkv)

    @property
    def smem_bytes(self) -> int:
        kv = 2 * 2 * self.bkv * self.head_dim * 2       # 2 slots x (K + V) x bkv keys x head_dim fp16
        q = (2 if self.split else 1) * 16 * self.warps * self.head_dim * 2   # q hi (+ lo) tiles
        return kv + q

    def launch(self, n: int | None = None, splits: int = 1) -> Launch:
        n = self.max_n if n is None else n
        if not 1 <= splits <= self.max_splits:
            raise ValueError(f"{self.family}: {splits} KV splits, the variant takes 1..{self.max_splits}")
        bq, gqa = 16 * self.warps, self.heads // self.kv_heads
        x, y = (-(-n * gqa // bq), self.kv_heads) if self.pack_gqa else (-(-n // bq), self.heads)
        return Launch(grid=(x, y, splits), block=(32 * self.warps, 1, 1), smem=self.smem_bytes)

    def blocks(self, keys: int) -> int:
        """Key blocks holding keys [0, keys)."""
        return -(-keys // self.block_keys)

    def splits_for(self, keys: int) -> int:
        """KV splits of a chunk whose last row sees ``keys`` keys: one per key block, at most max_splits."""
        return max(1, min(self.max_splits, self.blocks(keys)))

    def flops(self, p0: int, n: int) -> int:
        """Useful (causal) flops: 4 * head_dim per (query, visible key) pair per head."""
        pairs = n * p0 + n * (n + 1) // 2
        return 4 * self.head_dim * self.heads * pairs


@dataclass(frozen=True)
class AttentionPrefillCombineSpec(VariantParams, KernelSpec):
    family = "attention_prefill_combine"
    template = "attention_prefill_combine.cu.j2"
    timeable = True   # templates/attention_prefill_combine.cu.j2 places the timeline probe's hooks
    uri_fields = ("head_dim", "heads", "block_keys")

    head_dim: int
    heads: int
    max_n: int = 4096        # chunk length the default grid covers (launch(n) sizes it for a call)
    block_keys: int = 256    # keys per key block (the attention's)
    device_chunk: bool = False   # p0, n from the device (chunk) rather than the launch

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        return ((inp("part_acc", "float"), True), (inp("part_ml", "float"), True), (out("o16", "f16"), True),
                *chunk_params(self.device_chunk))

    def validate(self) -> None:
        super().validate()
        if self.head_dim % 32 or not 32 <= self.head_dim <= 1024:
            raise SpecError(f"{self.family}.head_dim must be a multiple of 32 in 32..1024, got {self.head_dim}")
        if self.heads <= 0 or self.max_n <= 0:
            raise SpecError(f"{self.family}: heads and max_n must be positive, got {self.heads}, {self.max_n}")
        check_block_keys(self.family, self.block_keys, 16)

    def launch(self, n: int | None = None) -> Launch:
        return Launch(grid=(self.max_n if n is None else n, self.heads, 1), block=(self.head_dim, 1, 1))


def check_block_keys(family: str, block_keys: int, tile: int) -> None:
    if block_keys <= 0 or block_keys % tile:
        raise SpecError(f"{family}.block_keys must be a positive multiple of {tile} (whole KV tiles), got {block_keys}")


def partial_bytes(dims: ModelDims, rows: int, blocks: int) -> tuple[int, int]:
    """(part_acc, part_ml) bytes of the split-KV partials of chunks of up to ``rows`` tokens whose keys
    span up to ``blocks`` key blocks."""
    parts = blocks * rows * dims.heads
    return parts * dims.head_dim * 4, parts * 2 * 4


def prefill_attention_specs(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT, device_chunk: bool = False
                            ) -> tuple[RopeAppendPrefillSpec, AttentionPrefillSpec]:
    kw = dict(head_dim=dims.head_dim, heads=dims.heads, kv_heads=dims.kv_heads, page_size=cfg.kv_cache.page_size)
    return (RopeAppendPrefillSpec(**kw, device_chunk=device_chunk),
            AttentionPrefillSpec(**kw, max_smem=gpu.max_smem, block_keys=cfg.prefill.attention_block_keys,
                                 device_chunk=device_chunk))


def split_kv_specs(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT, device_chunk: bool = False
                   ) -> tuple[AttentionPrefillSpec, AttentionPrefillCombineSpec]:
    """The split-KV attention of short chunks and its combine, in launch order. Its CTAs hold (token, query head)
    pairs of one KV head (``pack_gqa``): a 4-warp CTA of 64 rows held 8 of an 8-token chunk's rows and 32 of a
    32-token one's, and each of a KV head's 7 query heads copied its K/V tiles (448 CTAs of 96 KB for 264 slots
    at 4096 keys, about 2 waves; packed, 32 tokens are 256 CTAs and 8 tokens 64)."""
    attn = dataclasses.replace(prefill_attention_specs(dims, cfg, gpu, device_chunk)[1], max_splits=MAX_KV_SPLITS,
                               pack_gqa=True)
    return attn, AttentionPrefillCombineSpec(head_dim=dims.head_dim, heads=dims.heads, block_keys=attn.block_keys,
                                             device_chunk=device_chunk)


def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return [*prefill_attention_specs(dims, cfg, gpu), *split_kv_specs(dims, cfg, gpu),
            prefill_attention_specs(dims, cfg, gpu, device_chunk=True)[0], *split_kv_specs(dims, cfg, gpu, True)]
