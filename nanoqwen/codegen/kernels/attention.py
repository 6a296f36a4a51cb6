"""The attention side of a decode step (docs/architecture.md, "Decode step"): ``rope_append`` (RoPE on q, k
and the append of f16(k_rot), f16(v) to the paged KV cache), ``attention_decode`` (paged, split along the
sequence, warp-specialized: one producer warp copies K/V pages into a shared-memory ring, consumer warps
run the online softmax, on the tensor cores in the default pipeline) and ``attention_combine`` (merges the
splits into o16 for o_proj).

Partials between decode and combine, fp32, per query head h and split s (row = h * splits + s):
``part_acc [heads, splits, head_dim]`` the unnormalized sum exp2(s2 - m2) * v, ``part_ml [heads, splits, 2]``
(m2, l) with scores in base-2 units s2 = q.k * log2(e) / sqrt(head_dim) and l = sum exp2(s2 - m2).
An empty split (short sequences) writes (-inf, 0, 0). Sizes: ``partial_bytes(decode_spec)``.

``m`` rows (the multi-row step, DESIGN.md section 12): each kernel serves m independent queries at once, row
r at its own position ``positions[r]`` (int32 [2m], in place of ``state[1]``) with its own page-table row
at ``page_table + positions[m + r]`` (rows of one sequence share one; rows of several sequences each
their sequence's), its qkv / q_rot / partials / o16 rows at r, each row computed exactly as the m = 1
kernel computes it; m = 1 is the decode step itself, and its source does not change with this (the
per-row table statement, ``row_table``, is rendered for m > 1 only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ...config import Config
from ...dims import ModelDims
from ..gpu import DEFAULT, SMEM_PER_CTA_RESERVED, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, VariantParams, inp, out

MAX_ROWS = 16   # the multi-row step's largest bucket


def _check_rows(family: str, m: int) -> None:
    if not 1 <= m <= MAX_ROWS:
        raise SpecError(f"{family}.m must be 1..{MAX_ROWS} rows, got {m}")


def _row_params(m: int) -> tuple[tuple[Param, bool], ...]:
    """Where a row's position comes from: the device state's position (m = 1) or one per row."""
    return ((inp("state", "int"), m == 1),
            (inp("positions", "int", note="int32 [2m]: each row's position, then where its page-table row "
                                          "starts in page_table (entries)"), m > 1))


def _row_table(m: int) -> str:
    """The statement (m > 1) that points ``page_table`` at row r's own table; appended to the line that
    reads the row's position, so an m = 1 source is the decode step's, unchanged."""
    return "\n    page_table += positions[M + r];  // row r's own page-table row (rows of several sequences)" \
        if m > 1 else ""

STATIC_SMEM_LIMIT = 48 * 1024  # static __shared__ needs no opt-in attribute up to here
# ptxas adds the CTA's system-reserved shared memory (gpu.SMEM_PER_CTA_RESERVED, seen in every compiled
# variant) to the static shared size of these kernels, so the 48 KB check counts it.
VEC = 8                        # fp16 per lane per K/V row in attention_decode (one 16-byte load)


@dataclass(frozen=True)
class AttentionDecodeSpec(VariantParams, KernelSpec):
    family = "attention_decode"
    template = "attention_decode.cu.j2"
    timeable = True   # templates/attention_decode.cu.j2 places the timeline probe's hooks
    uri_fields = ("pipeline", "head_dim", "kv_heads", "gqa", "splits", "stages", "consumer_warps", "m",
                  "ctas_per_sm", "pair_rows")
    late_fields = KernelSpec.late_fields + ("pair_rows",)

    head_dim: int
    kv_heads: int
    gqa: int                  # query heads per KV head; one CTA serves all of them
    splits: int               # sequence splits (grid.y); the page range of each is computed on the device
    page_size: int = 16
    stages: int = 3           # K/V pages in flight (ring depth)
    consumer_warps: int = 4   # softmax warps beside the producer warp
    # "bulk": warp-specialized (producer warp + cp.async.bulk ring, CUDA-core consumers); "mma": a producer
    # warp whose 32 lanes fill the ring (padded rows) by cp.async, the consumers on the tensor cores (each
    # warp whole pages; another rounding of the same math), the config's choice (faster at every context
    # measured on the H200); "plain": consumers read pages straight from global with bulk's math, no
    # producer/ring: a debugging oracle on the GPU.
    pipeline: str = "bulk"
    m: int = 1                # rows (queries at their own positions), grid.z
    # CTAs each SM must hold at once (__launch_bounds__' minimum, which caps the registers): the m rows'
    # 132 m CTAs of a few microseconds each run in fewer waves; none of a row's arithmetic depends on it
    ctas_per_sm: int = 1
    # m > 1, mma: rows 2i and 2i + 1 that read the same pages (a verify's rows) share CTA 2i, row 2i + 1 in the
    # tile rows the m = 1 kernel leaves zero (templates/attention_decode.cu.j2, PAIR): half the CTAs, each row
    # rounded as alone
    pair_rows: bool = False

    def _family_params(self):
        return (*_row_params(self.m), (inp("q_rot", "float"), True), (inp("k_pool", "f16"), True),
                (inp("v_pool", "f16"), True), (inp("page_table", "int"), True), (out("part_acc", "float"), True),
                (out("part_ml", "float"), True))

    def validate(self) -> None:
        super().validate()
        _check_rows(self.family, self.m)
        for name in ("head_dim", "kv_heads", "gqa", "splits", "page_size", "stages", "consumer_warps", "ctas_per_sm"):
            if getattr(self, name) <= 0:
                raise SpecError(f"attention_decode.{name} must be positive, got {getattr(self, name)}")
        lanes = self.head_dim // VEC
        if self.head_dim % VEC or 32 % lanes or lanes > 32:
            raise SpecError(f"attention_decode.head_dim={self.head_dim}: a K/V row must split into 16-byte "
                            f"lanes of one warp (head_dim = 8 * a divisor of 32)")
        rows = 32 // lanes
        if self.pipeline not in ("bulk", "mma", "plain"):
            raise SpecError(f"attention_decode.pipeline must be 'bulk', 'mma' or 'plain', got {self.pipeline!r}")
        if self.pipeline == "mma":
            if self.page_size != 16 or self.gqa > 16 or self.head_dim % 16:
                raise SpecError(f"attention_decode: pipeline 'mma' needs 16-token pages, at most 16 query heads "
                                f"per KV head and head_dim % 16 == 0 (page {self.page_size}, gqa {self.gqa}, "
                                f"head_dim {self.head_dim})")
            if self.stages % self.consumer_warps:
                # warp w takes pages w, w + CWARPS, ...: with slot = page % STAGES each slot must belong to one
                # warp, or a warp a lap ahead of another passes a full barrier's parity meant for the next page
                raise SpecError(f"attention_decode: pipeline 'mma' needs stages a multiple of consumer_warps "
                                f"(each warp its own ring slots), got stages {self.stages}, "
                                f"consumer_warps {self.consumer_warps}")
        elif self.page_size % self.consumer_warps or (self.page_size // self.consumer_warps) % rows:
            raise SpecError(f"attention_decode.consumer_warps={self.consumer_warps}: each warp must own a "
                            f"multiple of {rows} of the {self.page_size} tokens of a page")
        if self.pair_rows and (self.pipeline != "mma" or self.m == 1 or self.gqa > 8):
            raise SpecError(f"attention_decode.pair_rows needs pipeline 'mma', m > 1 and at most 8 query heads per KV "
                            f"head (pipeline {self.pipeline!r}, m {self.m}, gqa {self.gqa})")
        if self.stages > 8:
            raise SpecError(f"attention_decode.stages must be 1..8, got {self.stages}")
        if self.splits > 65535:
            raise SpecError(f"attention_decode.splits={self.splits} exceeds grid.y 65535")
        if self.static_smem() > STATIC_SMEM_LIMIT:
            raise SpecError(f"attention_decode: {self.static_smem()} B of static shared memory > "
                            f"{STATIC_SMEM_LIMIT} (lower stages or consumer_warps)")
        if self.ring_dynamic and self.ring_bytes() > DEFAULT.max_smem:
            raise SpecError(f"attention_decode: a ring of {self.ring_bytes()} B > {DEFAULT.max_smem} B of shared "
                            f"memory (lower stages)")

    @property
    def query_rows(self) -> int:
        """Query rows one CTA may serve (pair_rows: 2)."""
        return 2 if self.pair_rows else 1

    @property
    def producers(self) -> int:
        return 0 if self.pipeline == "plain" else 1

    def ring_bytes(self) -> int:
        """The ring and the warps' merge buffer, which share memory (the template's Smem union)."""
        row = self.head_dim + (8 if self.pipeline == "mma" else 0)   # mma pads each K/V row by 16 bytes
        ring = 2 * self.stages * self.page_size * row * 2 * self.producers
        merge = self.consumer_warps * self.query_rows * self.gqa * self.head_dim * 4
        return max(ring, merge)

    @property
    def ring_dynamic(self) -> bool:
        """The mma pipeline's ring moves to dynamic shared memory when it outgrows the static 48 KB (its
        warps each take whole pages: a deeper ring gives each one a page in flight behind the one it reads)."""
        return self.pipeline == "mma" and self.ring_bytes() + self._fixed_smem() > STATIC_SMEM_LIMIT

    def _fixed_smem(self) -> int:
        return (2 * self.stages * 8 * self.producers + self.consumer_warps * self.query_rows * self.gqa * 2 * 4
                + SMEM_PER_CTA_RESERVED)

    def static_smem(self) -> int:
        return self._fixed_smem() + (0 if self.ring_dynamic else self.ring_bytes())

    def context(self) -> dict:
        return super().context() | {"scale_log2": math.log2(math.e) / math.sqrt(self.head_dim),
                                    "row_table": _row_table(self.m), "ring_dynamic": self.ring_dynamic}

    def launch(self) -> Launch:
        return Launch(grid=(self.kv_heads, self.splits, self.m),
                      block=(32 * (self.producers + self.consumer_warps), 1, 1),
                      smem=self.ring_bytes() if self.ring_dynamic else 0)


@dataclass(frozen=True)
class AttentionCombineSpec(KernelSpec):
    family = "attention_combine"
    template = "attention_combine.cu.j2"
    timeable = True   # templates/attention_combine.cu.j2 places the timeline probe's hooks
    uri_fields = ("head_dim", "heads", "splits", "m")
    kernel_params: ClassVar[tuple[Param, ...]] = (
        inp("part_acc", "float"), inp("part_ml", "float"), out("o16", "f16"))

    head_dim: int
    heads: int
    splits: int
    m: int = 1                # rows, grid.y

    def validate(self) -> None:
        super().validate()
        _check_rows(self.family, self.m)
        if self.head_dim % 32 or not 32 <= self.head_dim <= 1024:
            raise SpecError(f"attention_combine.head_dim must be a multiple of 32 in 32..1024, got {self.head_dim}")
        if self.heads <= 0 or self.splits <= 0:
            raise SpecError(f"attention_combine: heads and splits must be positive, got {self.heads}, {self.splits}")

    def launch(self) -> Launch:
        return Launch(grid=(self.heads, self.m, 1), block=(self.head_dim, 1, 1))


@dataclass(frozen=True)
class RopeAppendSpec(VariantParams, KernelSpec):
    family = "rope_append"
    template = "rope_append.cu.j2"
    timeable = True   # templates/rope_append.cu.j2 places the timeline probe's hooks
    uri_fields = ("head_dim", "heads", "kv_heads", "m")

    head_dim: int
    heads: int
    kv_heads: int
    page_size: int = 16
    m: int = 1                # rows, grid.y

    def _family_params(self):
        return (*_row_params(self.m), (inp("qkv", "float"), True), (inp("rope_cos", "float"), True),
                (inp("rope_sin", "float"), True), (inp("page_table", "int"), True), (out("q_rot", "float"), True),
                (out("k_pool", "f16"), True), (out("v_pool", "f16"), True))

    def context(self) -> dict:
        return super().context() | {"row_table": _row_table(self.m)}

    def validate(self) -> None:
        super().validate()
        _check_rows(self.family, self.m)
        if self.head_dim % 64 or self.head_dim > 2048:
            raise SpecError(f"rope_append.head_dim must be a multiple of 64 (head_dim/2 threads in whole warps), "
                            f"got {self.head_dim}")
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads or self.page_size <= 0:
            raise SpecError(f"rope_append: bad heads/kv_heads/page_size {self.heads}/{self.kv_heads}/{self.page_size}")

    def launch(self) -> Launch:
        return Launch(grid=(self.heads + self.kv_heads, self.m, 1), block=(self.head_dim // 2, 1, 1))


def splits_for(kv_heads: int, ctas: int) -> int:
    """Sequence splits so that kv_heads x splits fills ``ctas`` CTAs (one wave)."""
    return max(1, ctas // kv_heads)


def partial_bytes(spec: AttentionDecodeSpec) -> tuple[int, int]:
    """(part_acc, part_ml) buffer sizes in bytes for ``spec`` (its m rows)."""
    rows = spec.m * spec.kv_heads * spec.gqa * spec.splits
    return rows * spec.head_dim * 4, rows * 2 * 4


# The decode attention's tunable fields (nanoqwen-tune --kernels attention), named as in the config. m = 1:
# config attention's, where ctas_per_sm sets the splits (splits_for) and with the pipeline and consumer warps
# fixes a row's rounding; m > 1: config multirow's ring, which changes no row's bits (the CTAs an SM holds
# and the ring depth), beside the m = 1 fields.
SINGLE_ROW_TILE = ("pipeline", "consumer_warps", "stages", "ctas_per_sm")
MULTIROW_TILE = ("stages", "ctas_per_sm")


def decode_specs(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT, m: int = 1, one: dict | None = None,
                 tile: dict | None = None) -> tuple[RopeAppendSpec, AttentionDecodeSpec, AttentionCombineSpec]:
    """The three attention-side kernels of one decode step of ``m`` rows, in launch order. The splits do
    not depend on m: a row's pages split as in the single-row step, so it rounds the same (the ring depth
    and the CTAs per SM do, config multirow). ``one``: SINGLE_ROW_TILE fields in place of config
    attention's (a tuned entry); ``tile``: MULTIROW_TILE fields in place of config multirow's (m > 1). An
    unknown field is a SpecError."""
    page, rows = cfg.kv_cache.page_size, cfg.multirow
    a = _tile(SINGLE_ROW_TILE, {n: getattr(cfg.attention, n) for n in SINGLE_ROW_TILE}, one)
    splits = splits_for(dims.kv_heads, a["ctas_per_sm"] * gpu.sm_count)
    # m > 1: more, smaller CTAs an SM (their 132 m CTAs are latency-bound); none of it changes a row's bits
    ring = dict(stages=a["stages"]) if m == 1 else _tile(
        MULTIROW_TILE, dict(stages=rows.attention_stages, ctas_per_sm=rows.attention_ctas_per_sm), tile) | dict(
        pair_rows=0 < rows.attention_pair_rows <= m and a["pipeline"] == "mma")   # (the pairs are the mma tile's)
    dec = AttentionDecodeSpec(head_dim=dims.head_dim, kv_heads=dims.kv_heads, gqa=dims.gqa, splits=splits,
                              page_size=page, consumer_warps=a["consumer_warps"], pipeline=a["pipeline"], m=m, **ring)
    dec.validate()
    return (RopeAppendSpec(head_dim=dims.head_dim, heads=dims.heads, kv_heads=dims.kv_heads, page_size=page, m=m),
            dec, AttentionCombineSpec(head_dim=dims.head_dim, heads=dims.heads, splits=splits, m=m))


def _tile(names: tuple[str, ...], default: dict, given: dict | None) -> dict:
    unknown = set(given or ()) - set(names)
    if unknown:
        raise SpecError(f"attention_decode: {', '.join(sorted(unknown))} is not a tunable field ({', '.join(names)})")
    return {**default, **(given or {})}


def specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return list(decode_specs(dims, cfg, gpu))


def multirow_specs_for_model(dims: ModelDims, cfg: Config, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    """The m > 1 attention-side kernels, one set per multirow bucket (config multirow.buckets)."""
    return [s for m in cfg.multirow.buckets if m > 1 for s in decode_specs(dims, cfg, gpu, m)]
