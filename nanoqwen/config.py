"""config/nanoqwen.yaml -> frozen dataclasses. The dataclasses are the schema: an unknown or missing key
is a ConfigError that names the key's full path (e.g. ``quant.group_size``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import NanoqwenError, paths


class ConfigError(NanoqwenError):
    pass


@dataclass(frozen=True)
class Quant:
    group_size: int
    symmetric: bool
    qmax: int
    zero_point: int
    scale_dtype: str
    int4_tensors: tuple[str, ...]

    def __post_init__(self):
        if self.group_size <= 0 or self.group_size % 8:
            raise ConfigError(f"quant.group_size must be a positive multiple of 8, got {self.group_size}")
        if not self.symmetric or self.zero_point != 0 or self.qmax != 7 or self.scale_dtype != "fp16":
            raise ConfigError("quant: only symmetric INT4 (qmax 7, zero point 0, fp16 scales) is implemented")


@dataclass(frozen=True)
class KVCache:
    page_size: int
    dtype: str


@dataclass(frozen=True)
class Attention:
    ctas_per_sm: int
    stages: int
    consumer_warps: int
    pipeline: str


@dataclass(frozen=True)
class Embed:
    threads: int


@dataclass(frozen=True)
class LmHead:
    warps: int
    rows_per_warp: int
    unroll: int
    ctas_per_sm: int


@dataclass(frozen=True)
class GemvTile:
    mma: bool
    rows: int
    lanes: int
    warps: int
    tiles_per_warp: int
    unroll: int
    splitk: int


@dataclass(frozen=True)
class GemvInt4:
    qkv: GemvTile
    o_proj: GemvTile
    gate_up: GemvTile
    down: GemvTile


MAX_ROWS = 16   # the multi-row step's ceiling: one accumulator set per row per lane in the GEMV


@dataclass(frozen=True)
class Multirow:
    buckets: tuple[int, ...]
    gemv_warps: int
    lm_head_rows_per_warp: int
    attention_ctas_per_sm: int
    attention_stages: int
    attention_pair_rows: int
    norm_apart: tuple[str, ...]
    norm_apart_rows: int

    def __post_init__(self):
        b = self.buckets
        if not b or b[0] != 1 or list(b) != sorted(set(b)) or b[-1] > MAX_ROWS:
            raise ConfigError(f"multirow.buckets must rise strictly from 1 to at most {MAX_ROWS}, got {list(b)}")
        if not 1 <= self.gemv_warps <= 32:
            raise ConfigError(f"multirow.gemv_warps must be 1..32, got {self.gemv_warps}")
        if not 1 <= self.lm_head_rows_per_warp <= 32:
            raise ConfigError(f"multirow.lm_head_rows_per_warp must be 1..32, got {self.lm_head_rows_per_warp}")
        if not 1 <= self.attention_ctas_per_sm <= 8:
            raise ConfigError(f"multirow.attention_ctas_per_sm must be 1..8, got {self.attention_ctas_per_sm}")
        if set(self.norm_apart) - {"qkv", "gate_up"} or len(set(self.norm_apart)) != len(self.norm_apart):
            raise ConfigError(f"multirow.norm_apart names the GEMVs with an RMSNorm, qkv and gate_up, each once; got "
                              f"{list(self.norm_apart)}")
        if self.attention_pair_rows == 1 or not 0 <= self.attention_pair_rows <= MAX_ROWS:
            raise ConfigError(f"multirow.attention_pair_rows must be 0 (never) or the first bucket of paired rows, "
                              f"2..{MAX_ROWS}; got {self.attention_pair_rows}")
        if self.norm_apart_rows < 2:
            raise ConfigError(f"multirow.norm_apart_rows must be at least 2 (one row keeps the fused norm), got "
                              f"{self.norm_apart_rows}")

    def apart_roles(self, m: int) -> tuple[str, ...]:
        """The GEMVs whose RMSNorm runs as its own kernel in the step of ``m`` rows."""
        return self.norm_apart if m >= self.norm_apart_rows else ()


@dataclass(frozen=True)
class RoleSplits:
    """K splits per decoder-layer GEMM role."""
    qkv: int
    o_proj: int
    gate_up: int
    down: int

    def __post_init__(self):
        for role, n in dataclasses.asdict(self).items():
            if not 1 <= n <= 8:
                raise ConfigError(f"splits of {role} must be in 1..8, got {n}")


@dataclass(frozen=True)
class Prefill:
    chunk_tokens: int
    small_m_tokens: int
    attention_block_keys: int
    graph_buckets: tuple[int, ...]
    gemv_order: bool
    gemv_order_splits: RoleSplits
    row_tail_tokens: int
    wgmma: bool

    def __post_init__(self):
        # the prefill kernels' grids cover 1..4096 rows per launch (codegen/kernels/gemm.py: max_m)
        if not 1 <= self.chunk_tokens <= 4096:
            raise ConfigError(f"prefill.chunk_tokens must be in 1..4096, got {self.chunk_tokens}")
        if not 0 <= self.small_m_tokens <= 4096:
            raise ConfigError(f"prefill.small_m_tokens must be in 0..4096, got {self.small_m_tokens}")
        # the attention's KV tiles are 64 keys (codegen/kernels/attention_prefill.py: bkv)
        if self.attention_block_keys <= 0 or self.attention_block_keys % 64:
            raise ConfigError(f"prefill.attention_block_keys must be a positive multiple of 64, "
                              f"got {self.attention_block_keys}")
        # (a bucket above small_m_tokens or the session's chunk is never used: runtime/prefill.py usable_buckets)
        if self.row_tail_tokens < 0:
            raise ConfigError(f"prefill.row_tail_tokens must be >= 0, got {self.row_tail_tokens}")
        if self.wgmma and self.gemv_order:
            raise ConfigError("prefill.wgmma and prefill.gemv_order exclude each other: a row's arithmetic is "
                              "the wgmma GEMM's or the tensor-core GEMV's")
        b = self.graph_buckets
        if list(b) != sorted(set(b)) or (b and (b[0] < 1 or b[-1] > 4096)):
            raise ConfigError(f"prefill.graph_buckets must rise strictly within 1..4096, got {list(b)}")


@dataclass(frozen=True)
class Launch:
    smem_carveout: int

    def __post_init__(self):
        if not -1 <= self.smem_carveout <= 100:
            raise ConfigError(f"launch.smem_carveout must be -1 (the driver's choice) or a percentage 0..100, "
                              f"got {self.smem_carveout}")


@dataclass(frozen=True)
class Codegen:
    arch: str
    nvrtc_options: tuple[str, ...]
    cache_dir: str
    compile_workers: int


@dataclass(frozen=True)
class Bench:
    batch: int
    prompt_tokens: int
    gen_tokens: int
    warmup: int
    repetitions: int
    lock_clocks: bool
    l2_rotate_bytes: int


@dataclass(frozen=True)
class Validation:
    gemv_rel_tol: float
    reference_vs_transformers_rel: float
    graph_token_match: float
    graph_prompts: int


@dataclass(frozen=True)
class Config:
    quant: Quant
    kv_cache: KVCache
    attention: Attention
    embed: Embed
    lm_head: LmHead
    gemv_int4: GemvInt4
    multirow: Multirow
    prefill: Prefill
    launch: Launch
    codegen: Codegen
    bench: Bench
    validation: Validation


def _build(cls, data, path: str):
    """Recursively build dataclass ``cls`` from ``data``, exact key sets, light type coercion."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key '{path}{key}'")
    kwargs = {}
    for name in names:
        if name not in data:
            raise ConfigError(f"missing config key '{path}{name}'")
        kwargs[name] = _coerce(hints[name], data[name], f"{path}{name}")
    return cls(**kwargs)


def _coerce(tp, value, path: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path + ".")
    origin = typing.get_origin(tp)
    if origin is tuple:
        (elem, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{path}' must be a list")
        return tuple(_coerce(elem, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool) or tp is not bool and (
            not isinstance(value, tp) or isinstance(value, bool)):
        raise ConfigError(f"config key '{path}' must be {tp.__name__}, got {value!r}")
    return value


def load(path: str | Path | None = None) -> Config:
    """``path``, or the packaged config/nanoqwen.yaml."""
    path = Path(path) if path is not None else paths.data_path("config", "nanoqwen.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return _build(Config, data, "")


@functools.cache
def default() -> Config:
    """The packaged config, loaded once per process."""
    return load()


CACHE_ENV = "NANOQWEN_CACHE_DIR"


def cache_root(cfg: Codegen | None = None) -> Path:
    """Where writable state lives (kernel cache, packed models, tuner progress, the user's tuned results):
    $NANOQWEN_CACHE_DIR, else ``codegen.cache_dir`` of the config (``~/.cache/nanoqwen``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path((cfg or default().codegen).cache_dir).expanduser()
