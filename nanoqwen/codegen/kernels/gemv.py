"""INT4 GEMV family (templates/gemv_int4.cu.j2): y = W x for decode, with the epilogues and the RMSNorm
prologue the decoder layer fuses (DESIGN.md section 5, kernel plan 1, 3, 4, 5), over m = 1..16 activation
rows that share each weight read (the multi-row step, DESIGN.md section 12). Every row of an m-row kernel
is bitwise the m = 1 kernel's output for that row, given the same lanes and splitk (``multirow_spec``).

Kernel parameters, in order (``kernel_params``; the C++ list and the launch packing are generated from it):
  w0, s0            packed uint32 [N, K/8] and fp16 scales [N, K/group] (gate for SwiGLU)
  w1, s1            SwiGLU only: the up weights and scales
  h, norm_w         norm=True: fp32 residual h [m, K] and fp16 norm weight [K] (x = f16(rmsnorm(h) * w))
  x                 norm=False: fp16 activations [m, K]
  bias              epilogues "bias" and "rope": fp16 [N]
  y                 output [m, N]: fp32 (or fp16 when out_f16); "residual": fp32 h updated in place, h += W x
  state, page_table, rope_cos, rope_sin, q_rot, k_pool, v_pool
                    epilogue "rope" (the one-row step's QKV GEMV, in place of y): rope_append's inputs and outputs
                    (codegen/kernels/attention.py RopeAppendSpec), on W x + bias
A parameter the variant does not take is a null constant in its source (Param.null_constant).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ... import config, quant
from ...dims import ModelDims
from ..gpu import DEFAULT, THREADS_PER_SM, GpuProfile
from ..spec import KernelSpec, Launch, Param, SpecError, VariantParams, inp, out, whole_splits
from .gemm import NORM_THREADS

EPILOGUES = ("plain", "bias", "residual", "swiglu", "rope")
MAX_M = config.MAX_ROWS                         # activation rows of the multi-row step
SMEM_MARGIN = 4096   # a CTA's static shared memory (reductions, split-K partials) + the 1 KB sm_90 reservation
STATIC_SMEM_MAX = 48 * 1024   # a kernel's static __shared__ arrays, at most
VALUE_SHUFFLE = (0, 16, 4, 20, 8, 24, 12, 28)   # the only lane map the fast path implements
# Registers a thread may give to x (or h) rows staged together (stage_rows): they are live beside the first
# weight batch, loaded before the wait, and at 64 the 4-warp 2-row gate_up went from 167 to 255 registers.
STAGE_REGISTERS = 32


@dataclass(frozen=True)
class GemvInt4Spec(VariantParams, KernelSpec):
    family = "gemv_int4"
    template = "gemv_int4.cu.j2"
    timeable = True   # templates/gemv_int4.cu.j2 places the timeline probe's hooks
    uri_fields = ("epilogue", "n", "k", "norm", "mma", "kwarps", "rows", "lanes", "warps", "tiles_per_warp",
                  "splitk", "m", "l2_fetch", "ctas_per_sm")
    # earlier kernels keep their names
    late_fields = KernelSpec.late_fields + ("mma", "kwarps", "l2_fetch", "ctas_per_sm", "head_dim", "heads", "kv_heads",
                                            "page_size")

    n: int                         # output rows (per weight tensor; SwiGLU: the intermediate size)
    k: int                         # inputs
    epilogue: str = "plain"        # plain | bias | residual | swiglu | rope (bias, then rope_append's work: with_rope)
    norm: bool = False             # RMSNorm prologue (input fp32 h + fp16 norm weight)
    out_f16: bool = False          # fp16 saturated output (required for swiglu, refused for residual)
    eps: float = 1e-6              # RMSNorm epsilon (used only with norm)
    group: int = 128               # weights per scale along K
    lane_offsets: tuple[int, ...] = VALUE_SHUFFLE   # the format's quant.BIT_OFFSETS
    mma: bool = False              # dot products on the tensor cores (lanes 4, rows even; the template's header)
    rows: int = 2                  # rows per lane group (a warp tile is rows * 32 / lanes rows)
    lanes: int = 32                # lanes sharing one row: 32, 16 or 8 (16 fits K = 3584's 112 chunks); mma: 4
    warps: int = 4                 # warps per CTA
    tiles_per_warp: int = 1        # tiles each warp walks in turn (x staged once per CTA)
    unroll: int = 0                # chunk iterations per load batch (0 = all of them; the last batch may be partial)
    prefetch: bool = False         # load the next batch before this one's math (two batches in registers)
    splitk: int = 1                # K splits across blockIdx.y (one cluster; split 0 sums them, then the epilogue)
    m: int = 1                     # activation rows sharing each weight read (1..16; the multi-row step)
    kwarps: int = 1                # mma: warps sharing a tile along K (every kwarps-th group each; sums in warp order)
    l2_fetch: int = 0              # bytes the L2 fetches around a weight miss: 0 (the sectors asked for), 64, 128, 256
    ctas_per_sm: int = 0           # m > 1: CTAs an SM must hold at once (__launch_bounds__ caps the registers; the
                                   # grid is fitted to them); 0: as many as the staged x allows
    head_dim: int = 0              # rope: the heads of q | k | v (n = (heads + 2 kv_heads) head_dim) and the KV page
    heads: int = 0
    kv_heads: int = 0
    page_size: int = 0

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def mats(self) -> int:
        return 2 if self.epilogue == "swiglu" else 1

    @property
    def chunks(self) -> int:
        """16-byte chunks per row per split."""
        return self.k // self.splitk // 32

    @property
    def iters(self) -> int:
        return -(-self.chunks // self.lanes)

    @property
    def witers(self) -> int:
        """Chunk iterations per warp: a tile's, shared by kwarps warps."""
        return -(-self.iters // self.kwarps)

    @property
    def unroll_eff(self) -> int:
        return self.unroll or self.witers

    @property
    def tgroups(self) -> int:
        """Tiles a CTA works on at once (kwarps warps each)."""
        return self.warps // self.kwarps

    @property
    def tile_rows(self) -> int:
        return self.rows * 32 // self.lanes

    @property
    def tiles(self) -> int:
        return self.n // self.tile_rows

    @property
    def grid_x(self) -> int:
        """CTAs along x: each of a CTA's tile groups (kwarps warps) walks tiles_per_warp tiles."""
        return -(-self.tiles // (self.tgroups * self.tiles_per_warp))

    @property
    def xs_bytes(self) -> int:
        """Shared memory of the staged x rows: m rows of witers * kwarps * lanes 64-byte chunks (mma: + 64
        bytes of padding a row, the template's XSTRIDE)."""
        return self.m * (self.witers * self.kwarps * self.lanes + self.mma) * 64

    @property
    def xs_dynamic(self) -> bool:
        """m > 1 stages x in dynamic shared memory (up to 160 KB at m = 16); m = 1 keeps today's static array."""
        return self.m > 1

    @property
    def stage_rows(self) -> int:
        """Rows of x (or of h, for the RMSNorm prologue) staged together: their loads fly together, one
        round trip (and one barrier round) a batch, so m rows cost those of ceil(m / stage_rows), not m.
        As many as hold STAGE_REGISTERS a thread: a thread's vectors of h are 8 floats each over the whole
        of k; x goes one 4-word vector of every row at a time. 1 at m = 1: today's kernel."""
        per_row = 8 * -(-self.k // (8 * 32 * self.warps)) if self.norm else 4
        return min(self.m, max(1, STAGE_REGISTERS // per_row))

    @property
    def static_smem_bytes(self) -> int:
        """The template's static __shared__ arrays, an upper bound (ptxas drops what a variant leaves
        unused): the staged x at m = 1, the norm sums (red; sqv, stage_rows rows of them), the max |x| bits
        (xmax), the split-K totals (part: MATS x m x the CTA's rows, fp32, 35 KB for the 16-row tensor-core
        gate_up) and the kwarps warps' sums of a tile (ksum)."""
        norm_warps = NORM_THREADS // 32
        cta_rows = self.tgroups * self.tiles_per_warp * self.tile_rows
        kvals = self.mats * self.rows * 2 * (2 if self.m > 8 else 1)
        sqv = self.stage_rows * self.k // 8 if self.norm and 32 * self.warps != NORM_THREADS else 1
        floats = (self.m * norm_warps + sqv
                  + self.m * self.warps + (self.mats * self.m * cta_rows if self.splitk > 1 else 1)
                  + (self.warps * kvals * 32 if self.kwarps > 1 else 1))
        return (16 if self.xs_dynamic else self.xs_bytes) + 4 * floats

    def smem_ctas(self, gpu: GpuProfile = DEFAULT) -> int:
        """CTAs per SM the staged x allows (m = 1: not the limit, reported as the shared-memory bound too)."""
        return max(1, gpu.max_smem // (self.xs_bytes + SMEM_MARGIN))

    def resident_ctas(self, gpu: GpuProfile = DEFAULT) -> int:
        """CTAs per SM the grid is fitted to: ctas_per_sm, else the staged x's bound. Registers can allow fewer
        than shared memory does (512 threads of 124 registers: one), which ctas_per_sm makes a promise of the
        kernel (its launch bounds) instead of a guess."""
        return self.ctas_per_sm or self.smem_ctas(gpu)

    def _family_params(self) -> tuple[tuple[Param, bool], ...]:
        """Every parameter of the family, in C++ order, with whether this variant takes it."""
        swiglu, rope = self.epilogue == "swiglu", self.epilogue == "rope"
        return ((inp("w0", "uint4"), True), (inp("s0", "f16"), True),
                (inp("w1", "uint4"), swiglu), (inp("s1", "f16"), swiglu),
                (inp("h", "float", restrict=False, note="written by the previous kernel: no .nc"), self.norm),
                (inp("norm_w", "f16"), self.norm),
                (inp("x", "f16", restrict=False, note="written by the previous kernel: no .nc"), not self.norm),
                (inp("bias", "f16"), self.epilogue in ("bias", "rope")),
                (out("y", "f16" if self.out_f16 else "float"), not rope),
                (inp("state", "int", restrict=False, note="the position, advanced by the previous step: no .nc"), rope),
                (inp("page_table", "int"), rope), (inp("rope_cos", "float"), rope), (inp("rope_sin", "float"), rope),
                (out("q_rot", "float"), rope), (out("k_pool", "f16"), rope), (out("v_pool", "f16"), rope))

    def io_bytes(self) -> int:
        """Activation bytes one call moves beside the weights, for all m rows: x (or h + the norm weight),
        bias, y (read + write for the residual)."""
        x = self.m * self.k * 4 + self.k * 2 if self.norm else self.m * self.k * 2
        y = self.m * self.n * (2 if self.out_f16 else 4) * (2 if self.epilogue == "residual" else 1)
        if self.epilogue == "rope":   # q_rot fp32, k and v fp16, a cos and a sin a pair
            kv = 2 * self.kv_heads * self.head_dim
            y = 4 * (self.n - kv) + 2 * kv + 4 * self.head_dim
        return x + y + (2 * self.n if self.epilogue in ("bias", "rope") else 0)

    def weight_bytes(self) -> int:
        """Bytes of packed weights + scales one call reads (the bandwidth numerator)."""
        return self.mats * self.n * (self.k // 2 + 2 * self.k // self.group)

    def validate(self) -> None:
        super().validate()
        f = self.family
        if self.epilogue not in EPILOGUES:
            raise SpecError(f"{f}.epilogue must be one of {', '.join(EPILOGUES)}, got {self.epilogue!r}")
        if tuple(self.lane_offsets) != VALUE_SHUFFLE:
            raise SpecError(f"{f}.lane_offsets {list(self.lane_offsets)} is not ValueShuffle "
                            f"{list(VALUE_SHUFFLE)}, the only layout the INT4 fast path decodes")
        if self.group <= 0 or self.group % 32:
            raise SpecError(f"{f}.group must be a positive multiple of 32, got {self.group}")
        if self.n <= 0 or self.k <= 0 or self.k % self.group:
            raise SpecError(f"{f}: k={self.k} must be a positive multiple of group={self.group} (n={self.n})")
        if self.mma:
            if self.lanes != 4 or self.group != 128 or self.rows not in (2, 4) or self.n % self.tile_rows:
                raise SpecError(f"{f}: mma takes lanes=4 (got {self.lanes}), group=128 (got {self.group}) and "
                                f"rows 2 or 4 (got {self.rows}) with rows*8 dividing n={self.n}")
            if (self.k // self.splitk) % self.group:
                raise SpecError(f"{f}: mma splits k={self.k} on group boundaries; splitk={self.splitk} does not")
        elif self.lanes not in (8, 16, 32) or (32 * self.lanes) % self.group:
            raise SpecError(f"{f}.lanes must be 8, 16 or 32 with group | 32 * lanes, got {self.lanes}")
        elif self.rows not in (1, 2, 4, 8, 16) or self.mats * self.rows > self.lanes or self.n % self.tile_rows:
            raise SpecError(f"{f}.rows={self.rows} must be a power of two with mats*rows <= lanes={self.lanes} "
                            f"and rows*32/lanes dividing n={self.n}")
        if not 1 <= self.warps <= 32:
            raise SpecError(f"{f}.warps must be 1..32, got {self.warps}")
        if self.kwarps not in (1, 2, 4, 8) or self.warps % self.kwarps or self.kwarps > 1 and not self.mma:
            raise SpecError(f"{f}.kwarps={self.kwarps} must be 1, 2, 4 or 8, divide warps={self.warps}, and "
                            f"be 1 without mma")
        most = min(self.smem_ctas(), THREADS_PER_SM // (32 * self.warps))   # what shared memory and threads allow
        if self.ctas_per_sm and (self.m == 1 or self.ctas_per_sm > most):
            raise SpecError(f"{f}.ctas_per_sm={self.ctas_per_sm}: an m-row kernel's, at most the {most} CTAs its "
                            f"shared memory and threads allow an SM")
        if self.l2_fetch not in (0, 64, 128, 256):
            raise SpecError(f"{f}.l2_fetch must be 0, 64, 128 or 256 bytes, got {self.l2_fetch}")
        if self.tiles_per_warp < 1:
            raise SpecError(f"{f}.tiles_per_warp must be >= 1, got {self.tiles_per_warp}")
        if not 1 <= self.splitk <= 8 or self.k % (32 * self.splitk):
            raise SpecError(f"{f}.splitk={self.splitk} must be 1..8 (one cluster) and split k={self.k} into "
                            f"whole 32-input chunks")
        if self.norm and self.k % 8:
            raise SpecError(f"{f}: norm needs k % 8 == 0")
        if self.epilogue == "swiglu" and not self.out_f16:
            raise SpecError(f"{f}: swiglu output feeds the down GEMV and must be fp16 (out_f16=True)")
        if self.epilogue == "residual" and self.out_f16:
            raise SpecError(f"{f}: the residual stream is fp32 (out_f16 must be False)")
        if self.epilogue == "rope":
            self._validate_rope()
        if not 0 <= self.unroll <= self.witers:
            raise SpecError(f"{f}.unroll={self.unroll} must be 0..{self.witers} (the chunk iterations per lane)")
        if not 1 <= self.m <= MAX_M:
            raise SpecError(f"{f}.m must be 1..{MAX_M} activation rows, got {self.m}")
        if self.xs_bytes > DEFAULT.max_smem:
            raise SpecError(f"{f}: m={self.m} rows of x need {self.xs_bytes} bytes of shared memory > "
                            f"{DEFAULT.max_smem}")
        if self.static_smem_bytes > STATIC_SMEM_MAX or (
                self.xs_dynamic and self.xs_bytes + self.static_smem_bytes > DEFAULT.max_smem):
            raise SpecError(f"{f}: {self.static_smem_bytes} bytes of static shared memory (split-K totals, "
                            f"reductions) beside {self.xs_bytes if self.xs_dynamic else 0} dynamic do not fit "
                            f"(static <= {STATIC_SMEM_MAX}; fewer warps, rows or splitk)")
        if not 0 < self.eps < 1:
            raise SpecError(f"{f}.eps must be in (0, 1), got {self.eps}")
        loads = self.mats * self.rows * self.unroll_eff * (2 if self.prefetch else 1)
        if loads > 32:
            raise SpecError(f"{f}: {loads} 16-byte loads in flight per lane (mats*rows*unroll, x2 with prefetch) "
                            f"exceed 32: the registers would spill")
        try:
            self.launch()   # the grid within the CUDA limits
        except SpecError as e:
            raise SpecError(f"{f}: {e}") from None

    def _validate_rope(self) -> None:
        f = self.family
        if min(self.head_dim, self.heads, self.kv_heads, self.page_size) <= 0 or self.head_dim % 2 or self.out_f16:
            raise SpecError(f"{f}: rope needs positive head_dim (even), heads, kv_heads and page_size and fp32 "
                            f"math, got {self.head_dim}, {self.heads}, {self.kv_heads}, {self.page_size}")
        if self.n != (self.heads + 2 * self.kv_heads) * self.head_dim:
            raise SpecError(f"{f}: rope's n={self.n} must be the q | k | v heads, "
                            f"({self.heads} + 2 x {self.kv_heads}) x {self.head_dim}")
        problem = self.rope_tile_problem()
        if problem:
            raise SpecError(f"{f}: {problem}")

    def rope_tile_problem(self) -> str | None:
        """Why this tile cannot carry the rope epilogue (None: it can)."""
        pairs = self.tile_rows // 2
        if self.m != 1 or self.splitk != 1 or self.tiles_per_warp != 1:
            return (f"rope is the one-row step's epilogue over one K split and one tile a warp, got m={self.m}, "
                    f"splitk={self.splitk}, tiles_per_warp={self.tiles_per_warp}")
        if (self.tile_rows % 2 or (self.head_dim // 2) % pairs or (self.mma and pairs % 8)
                or (not self.mma and self.lanes == 32 and self.rows < 2)):
            return (f"a rope tile holds whole rotation pairs: {self.tile_rows} rows do not split into pairs "
                    f"(j, j + {self.head_dim // 2}) of one head")
        return None

    def context(self) -> dict:
        return super().context() | dict(
            unroll_eff=self.unroll_eff, grid_x=self.grid_x, xs_dynamic=self.xs_dynamic, stage_rows=self.stage_rows,
            # when the staged x already allows one CTA per SM, say so: ptxas may then use every register
            # (without the hint it stopped at 128 and spilled on m = 16 at lanes 32, rows 1)
            launch_bounds=f"__launch_bounds__(THREADS, {self.resident_ctas()})"
            if self.m > 1 and (self.ctas_per_sm or self.resident_ctas() == 1) else "__launch_bounds__(THREADS)",
            cluster_dims="__cluster_dims__(1, SPLITK, 1) " if self.splitk > 1 else "")

    def launch(self) -> Launch:
        return Launch(grid=(self.grid_x, self.splitk, 1), block=(32 * self.warps, 1, 1),
                      smem=self.xs_bytes if self.xs_dynamic else 0)


# ---- the kernels a model needs ---------------------------------------------------------------------

ROLES = ("qkv", "o_proj", "gate_up", "down")


def role_shape(role: str, dims: ModelDims) -> tuple[int, int]:
    """(n, k) of a decoder-layer GEMV role."""
    return {
        "qkv": (dims.q_dim + 2 * dims.kv_dim, dims.hidden),
        "o_proj": (dims.hidden, dims.q_dim),
        "gate_up": (dims.intermediate, dims.hidden),
        "down": (dims.hidden, dims.intermediate),
    }[role]


_ROLE_VARIANT = {
    "qkv": dict(epilogue="bias", norm=True),
    "o_proj": dict(epilogue="residual"),
    "gate_up": dict(epilogue="swiglu", norm=True, out_f16=True),
    "down": dict(epilogue="residual"),
}


def with_rope(spec: GemvInt4Spec, dims: ModelDims, page_size: int) -> GemvInt4Spec | None:
    """The QKV GEMV ``spec`` (epilogue bias) carrying rope_append's work in its epilogue (every row's bits
    unchanged: the template's header), or None where its tile cannot (a K split, several tiles a warp, ...)."""
    if spec.epilogue != "bias":
        raise SpecError(f"{spec.family}: with_rope takes the QKV GEMV (epilogue bias), got {spec.epilogue!r}")
    out = dataclasses.replace(spec, epilogue="rope", head_dim=dims.head_dim, heads=dims.heads,
                              kv_heads=dims.kv_heads, page_size=page_size)
    if out.rope_tile_problem():
        return None
    out.validate()
    return out


def _fit(value: int, limit: int) -> int:
    """Largest power of two <= value that divides `limit` (tiles must divide the shape; small test models)."""
    p = 1
    while p * 2 <= value and limit % (p * 2) == 0:
        p *= 2
    return p


def role_spec(role: str, dims: ModelDims, cfg: config.Config | None = None, m: int = 1,
              **override) -> GemvInt4Spec:
    """The spec of one decoder-layer GEMV over m rows, tile parameters from config gemv_int4.<role> (m > 1:
    re-tiled by multirow_spec, every row bitwise the m = 1 kernel's)."""
    cfg = cfg or config.default()
    n, k = role_shape(role, dims)
    tile = getattr(cfg.gemv_int4, role)
    params = dict(n=n, k=k, eps=float(dims.rms_eps), group=cfg.quant.group_size,
                  lane_offsets=quant.BIT_OFFSETS, mma=tile.mma, rows=tile.rows, lanes=tile.lanes,
                  warps=tile.warps, tiles_per_warp=tile.tiles_per_warp, unroll=tile.unroll,
                  splitk=tile.splitk,
                  **_ROLE_VARIANT[role])
    # Small test models: the config's tile shrunk to fit the shape (K splits, rows); overrides stay as given.
    step = params["group"] if tile.mma else 32   # a K split is whole chunks (mma: whole groups)
    params["splitk"] = whole_splits(k, step, params["splitk"])
    params["rows"] = _fit(tile.rows, n // (8 if tile.mma else 32 // tile.lanes))
    params.update(override)
    spec = GemvInt4Spec(**params)
    if spec.unroll > spec.witers:
        spec = dataclasses.replace(spec, unroll=0)
    spec.validate()
    return multirow_spec(spec, m, cfg)


# Multi-row tiles. A row's arithmetic order depends only on mma, lanes, splitk, k and the group (the template's
# header; the RMSNorm prologue's sum has a layout of its own, NORM_THREADS, whatever the block size): the
# m-row kernel keeps those of its m = 1 kernel and may re-tile the rest (MULTIROW_TILE). m rows
# of x take m times the shared memory (qkv: 7 KB per row), so m > 1 runs fewer, fuller CTAs: by default at
# least multirow.gemv_warps warps each (split-K: the m = 1 warps), and tiles_per_warp raised until the grid
# fits in one wave at the residency the staged x allows (every CTA stages x once; no CTA waits for a slot),
# or at ctas_per_sm CTAs an SM, which the launch bounds make true: the registers can allow fewer CTAs than
# shared memory (H100, the 2-row tensor-core gate_up: 1184 CTAs at 2 an SM, 43.6 us; fitted to 3, 31.2).
# `nanoqwen-tune --rows M` sweeps MULTIROW_TILE per bucket (tune/tuned.json; codegen/tuned.py).

MULTIROW_TILE = ("rows", "warps", "unroll", "prefetch", "ctas_per_sm")   # what an m-row kernel may choose for itself


def multirow_spec(spec: GemvInt4Spec, m: int, cfg: config.Config | None = None,
                  gpu: GpuProfile = DEFAULT, tile: dict | None = None) -> GemvInt4Spec:
    """The m-row kernel whose every row is bitwise `spec`'s output for that row (m = 1: `spec` itself).
    `tile`: MULTIROW_TILE fields in place of the defaults (a tuned entry); tiles_per_warp is always the
    fewest that fit the grid in one wave (of resident_ctas CTAs an SM)."""
    if m == spec.m and not tile:
        return spec
    if spec.m != 1:
        raise SpecError(f"{spec.family}: multirow_spec derives from an m = 1 spec, got m={spec.m}")
    tile = dict(tile or {})
    if tile and m == 1:
        raise SpecError(f"{spec.family}: an m = 1 kernel takes its tile from role_spec, not multirow_spec")
    if set(tile) - set(MULTIROW_TILE):
        raise SpecError(f"{spec.family}: an m-row kernel may choose only {', '.join(MULTIROW_TILE)}; "
                        f"{', '.join(sorted(set(tile) - set(MULTIROW_TILE)))} would change a row's order")
    out = dataclasses.replace(spec, m=m, **tile)
    if 1 < m <= MAX_M and out.xs_bytes <= gpu.max_smem and out.tgroups:   # else validate() names the problem
        # More warps, but not for split-K: ptxas holds a 256-thread split-K cluster kernel to 128 registers
        # (spills at m = 4).
        if not tile and spec.splitk == 1:
            out = dataclasses.replace(out, warps=max(spec.warps, (cfg or config.default()).multirow.gemv_warps))
        tpw = 1 if tile else spec.tiles_per_warp
        while -(-out.tiles // (out.tgroups * tpw)) * out.splitk > out.resident_ctas(gpu) * gpu.sm_count:
            tpw += 1
        out = dataclasses.replace(out, tiles_per_warp=tpw)
    out.validate()
    return out


def specs_for_model(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT) -> list[GemvInt4Spec]:
    """The decoder-layer roles' GEMVs, and the one-row step's QKV GEMV with the rope (``with_rope``)."""
    specs = _role_specs(dims, cfg)
    return specs + [s for s in [with_rope(specs[0], dims, cfg.kv_cache.page_size)] if s]


def _role_specs(dims: ModelDims, cfg: config.Config) -> list[GemvInt4Spec]:
    dims.check_quantizable(cfg.quant.group_size)
    return [role_spec(role, dims, cfg) for role in ROLES]


def multirow_specs_for_model(dims: ModelDims, cfg: config.Config, gpu: GpuProfile = DEFAULT) -> list[GemvInt4Spec]:
    """The m > 1 kernels of the decoder-layer roles, one per multirow bucket (config multirow.buckets)."""
    return [multirow_spec(spec, m, cfg, gpu) for spec in _role_specs(dims, cfg) for m in cfg.multirow.buckets if m > 1]


def norm_apart(spec: GemvInt4Spec) -> GemvInt4Spec:
    """``spec`` (a GEMV with the RMSNorm prologue) reading x that rmsnorm_prefill (codegen/kernels/gemm.py)
    made of h instead: every row's bits unchanged (templates/rmsnorm.cuh is both kernels' arithmetic), h read
    once a row instead of once a CTA (an m-row gate_up's ~400 CTAs each normalise all m rows)."""
    if not spec.norm:
        raise SpecError(f"{spec.family}: norm_apart takes a GEMV with the RMSNorm prologue ({spec.uri} has none)")
    out = dataclasses.replace(spec, norm=False)
    out.validate()
    return out


# A tensor-core tile: prefetch, and a partial last batch on every 7B shape (28 and 37 groups). The tests',
# and the prefill row GEMVs' (until tuned).
MMA_TILE = dict(mma=True, lanes=4, rows=2, warps=8, tiles_per_warp=1, unroll=3, prefetch=True)


def prefill_row_spec(role: str, dims: ModelDims, cfg: config.Config, m: int, splits: int,
                     gpu: GpuProfile = DEFAULT) -> GemvInt4Spec:
    """The m-row tensor-core GEMV a prefill chunk of at most m rows runs for `role` (runtime/prefill.py
    ``rows<m>.<role>``): K split `splits` ways, as the GEMV-order GEMM of that role (codegen/kernels/gemm.py
    gemv_order) splits it, so each row is that GEMM's bits; the role's RMSNorm fused."""
    return multirow_spec(role_spec(role, dims, cfg, **MMA_TILE, splitk=splits), m, cfg, gpu)


def mma_variants(dims: ModelDims, cfg: config.Config) -> list[GemvInt4Spec]:
    """The decoder-layer roles on the tensor cores: MMA_TILE, two MMA tiles per warp over K splits (at
    least 2, where whole groups allow: every epilogue split; the 16 staged rows of down's 18944 inputs fit
    only at its own 4), and four warps sharing each tile along K (down: 37 groups a split, so three of them
    run out of groups one iteration early)."""
    specs = []
    for role in ROLES:
        k, own = role_shape(role, dims)[1], getattr(cfg.gemv_int4, role).splitk
        splitk = max(2, own) if k % (cfg.quant.group_size * max(2, own)) == 0 else 1
        two = {**MMA_TILE, "rows": 4, "unroll": 2, "prefetch": False, "splitk": splitk}
        shared = {**MMA_TILE, "kwarps": 4, "unroll": 2}
        specs += [role_spec(role, dims, cfg, **MMA_TILE), role_spec(role, dims, cfg, **two),
                  role_spec(role, dims, cfg, **shared)]
    return specs


def variants(dims: ModelDims, cfg: config.Config) -> list[GemvInt4Spec]:
    """The decoder-layer kernels (CUDA cores and tensor cores) plus every other epilogue / prologue / output
    combination on the o_proj shape: what the tests compile and check."""
    specs = _role_specs(dims, cfg) + mma_variants(dims, cfg)
    n, k = role_shape("o_proj", dims)
    base = dict(n=n, k=k, eps=float(dims.rms_eps), group=cfg.quant.group_size, lane_offsets=quant.BIT_OFFSETS)
    specs += [
        GemvInt4Spec(**base),                                       # plain fp32
        GemvInt4Spec(**base, out_f16=True),                         # plain fp16
        GemvInt4Spec(**base, norm=True),                            # RMSNorm + plain
        GemvInt4Spec(**base, epilogue="bias"),                      # bias without norm
        GemvInt4Spec(**base, epilogue="residual", splitk=2),        # split-K residual
        GemvInt4Spec(**base, epilogue="bias", norm=True, splitk=2),   # split-K: each split normalises, split 0 adds bias
        GemvInt4Spec(**base, epilogue="swiglu", norm=True, out_f16=True, splitk=4),   # split-K SwiGLU: gate and up parked
        GemvInt4Spec(**base, epilogue="swiglu", out_f16=True),      # SwiGLU without norm
        GemvInt4Spec(**base, lanes=8, rows=1, unroll=3, prefetch=True),    # a partial last batch
    ]
    for spec in specs:
        spec.validate()
    return list(dict.fromkeys(specs))
