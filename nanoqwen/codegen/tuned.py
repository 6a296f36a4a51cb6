"""What the decoder builds on a given GPU: the tuned tile parameters of tune/tuned.json for (GPU, arch,
role, shape[, m rows]) when a valid entry exists, else the config defaults with a one-line notice (missing
entry, or a stale one the current spec rules out). An m-row entry holds only beside the m = 1 kernel it was
tuned with (its URI is in the entry): rows keep that kernel's order, so a re-tuned m = 1 tile makes it stale.
The decode attention's entries (``attention_specs``) follow the same rules, without the notice for a missing
entry (the config's attention is the measured default)."""

from __future__ import annotations

from functools import cache

from .. import config
from ..dims import ModelDims
from .gpu import DEFAULT, GpuProfile
from . import tuned_store
from .kernels import attention, gemv
from .spec import SpecError


@cache
def _notice_once(message: str) -> None:
    tuned_store.notice(message)


def entry_key(role: str, dims: ModelDims, cfg: config.Config, gpu: str, m: int = 1) -> str:
    n, k = gemv.role_shape(role, dims)
    return tuned_store.key(gpu, cfg.codegen.arch, gemv.GemvInt4Spec.family, role, n, k, m)


def role_spec(role: str, dims: ModelDims, cfg: config.Config, gpu: str | None, m: int = 1,
              profile: GpuProfile = DEFAULT) -> gemv.GemvInt4Spec:
    """The role's kernel over m rows on `gpu` (None: the config defaults)."""
    one = _single_row(role, dims, cfg, gpu)
    default = gemv.multirow_spec(one, m, cfg, profile)
    if m == 1 or gpu is None:
        return default
    return _tuned(entry_key(role, dims, cfg, gpu, m), lambda tile: gemv.multirow_spec(one, m, cfg, profile, tile=tile),
                  default, base=one.uri)   # m-row tiles are optional: no notice when missing


def _single_row(role: str, dims: ModelDims, cfg: config.Config, gpu: str | None) -> gemv.GemvInt4Spec:
    default = gemv.role_spec(role, dims, cfg)
    if gpu is None:
        return default
    return _tuned(entry_key(role, dims, cfg, gpu), lambda params: gemv.role_spec(role, dims, cfg, **params), default,
                  missing=f"no tuned {role} GEMV for {gpu} (n{default.n} k{default.k}): config defaults "
                          f"(run nanoqwen-tune)")


def _tuned(key: str, make, default, base: str | None = None, kind: str = "kernel", missing: str | None = None):
    """``make(params)`` of the tuned entry ``key``, else ``default``: when there is no entry (with the notice
    ``missing``, if any), when an m-row entry was tuned beside another m = 1 kernel than the one of URI
    ``base``, or when the current spec rules its params out (those two stale, each with a one-line notice)."""
    params = tuned_store.lookup_params(key)
    if params is None:
        if missing:
            _notice_once(missing)
        return default
    if base is not None and tuned_store.lookup_base(key) != base:
        _notice_once(f"stale tuned entry {key} (tuned beside another m = 1 {kind}): config defaults")
        return default
    try:
        return make(params)
    except (SpecError, TypeError) as e:
        _notice_once(f"stale tuned entry {key} ({e}): config defaults")
        return default


def tuned_specs(dims: ModelDims, cfg: config.Config) -> list[gemv.GemvInt4Spec]:
    """Every GEMV the decoder builds, m = 1 and each multirow bucket (and the one-row step's QKV GEMV with the
    rope, gemv.with_rope), for each GPU and role the store has a tuned entry for (any m): CI compiles them too
    (no spills)."""
    keys = tuned_store.merged_entries()
    gpus = sorted({k.split("|")[0] for k in keys})
    tuned = [(gpu, role) for gpu in gpus for role in gemv.ROLES
             if any(entry_key(role, dims, cfg, gpu, m) in keys for m in cfg.multirow.buckets)]
    specs = [role_spec(role, dims, cfg, gpu, m) for gpu, role in tuned for m in cfg.multirow.buckets]
    fused = [gemv.with_rope(s, dims, cfg.kv_cache.page_size) for s in specs if s.epilogue == "bias"]
    return list(dict.fromkeys(specs + [s for s in fused if s]))


def attention_key(dims: ModelDims, cfg: config.Config, gpu: str, m: int = 1) -> str:
    """The decode attention's entry: its shape is (query width, KV width)."""
    return tuned_store.key(gpu, cfg.codegen.arch, attention.AttentionDecodeSpec.family, "decode", dims.q_dim,
                           dims.kv_dim, m)


def attention_specs(dims: ModelDims, cfg: config.Config, gpu: str | None, m: int = 1,
                    profile: GpuProfile = DEFAULT) -> tuple:
    """attention.decode_specs of m rows on `gpu` (None: the config's), with the tuned m = 1 fields and, for
    m > 1, the tuned ring of that bucket when it was tuned beside the m = 1 kernel used now."""
    one = attention_params(dims, cfg, gpu, profile)
    default = attention.decode_specs(dims, cfg, profile, m, one=one)
    if m == 1 or gpu is None:
        return default
    base = attention.decode_specs(dims, cfg, profile, one=one)[1].uri
    return _tuned(attention_key(dims, cfg, gpu, m),
                  lambda tile: attention.decode_specs(dims, cfg, profile, m, one=one, tile=tile), default,
                  base=base, kind="attention")


def attention_params(dims: ModelDims, cfg: config.Config, gpu: str | None, profile: GpuProfile = DEFAULT) -> dict | None:
    """The tuned m = 1 fields of the decode attention on `gpu` (None: the config's)."""
    if gpu is None:
        return None

    def checked(params):   # a stale entry raises here
        attention.decode_specs(dims, cfg, profile, one=params)
        return params
    return _tuned(attention_key(dims, cfg, gpu), checked, None)


def tuned_attention_specs(dims: ModelDims, cfg: config.Config) -> list:
    """Every decode attention kernel (m = 1 and each multirow bucket) for each GPU the store has an attention
    entry for: CI compiles them too."""
    keys = tuned_store.merged_entries()
    gpus = sorted({k.split("|")[0] for k in keys if f"|{attention.AttentionDecodeSpec.family}|" in k})
    specs = [s for gpu in gpus for m in cfg.multirow.buckets for s in attention_specs(dims, cfg, gpu, m)]
    return list(dict.fromkeys(specs))
