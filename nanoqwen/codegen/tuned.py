"""What the decoder builds on a given GPU: the tuned tile parameters of tune/tuned.json for (GPU, arch,
role, shape) when a valid entry exists, else the config defaults with a one-line notice (missing entry,
or a stale one the current spec rules out)."""

from __future__ import annotations

from functools import cache

from .. import config
from ..dims import ModelDims
from . import tuned_store
from .kernels import gemv
from .spec import SpecError


@cache
def _notice_once(message: str) -> None:
    tuned_store.notice(message)


def entry_key(role: str, dims: ModelDims, cfg: config.Config, gpu: str) -> str:
    n, k = gemv.role_shape(role, dims)
    return tuned_store.key(gpu, cfg.codegen.arch, gemv.GemvInt4Spec.family, role, n, k)


def role_spec(role: str, dims: ModelDims, cfg: config.Config, gpu: str | None) -> gemv.GemvInt4Spec:
    default = gemv.role_spec(role, dims, cfg)
    if gpu is None:
        return default
    key = entry_key(role, dims, cfg, gpu)
    params = tuned_store.lookup_params(key)
    if params is None:
        _notice_once(f"no tuned {role} GEMV for {gpu} (n{default.n} k{default.k}): config defaults "
                     f"(run nanoqwen-tune)")
        return default
    try:
        return gemv.role_spec(role, dims, cfg, **params)
    except (SpecError, TypeError) as e:
        _notice_once(f"stale tuned entry {key} ({e}): config defaults")
        return default


def tuned_specs(dims: ModelDims, cfg: config.Config) -> list[gemv.GemvInt4Spec]:
    """Every tuned GEMV the store holds for these dims, any GPU: CI compiles them too (no spills)."""
    gpus = {k.split("|")[0] for k in tuned_store.load()["entries"]}
    specs = [role_spec(role, dims, cfg, gpu) for gpu in sorted(gpus) for role in gemv.ROLES
             if tuned_store.lookup_params(entry_key(role, dims, cfg, gpu)) is not None]
    return list(dict.fromkeys(specs))
