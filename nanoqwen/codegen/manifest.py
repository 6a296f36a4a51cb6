"""The kernels a model needs on a GPU: every registered family module's ``specs_for_model(dims, cfg, gpu)``,
concatenated and de-duplicated (``multirow_kernels``: the multi-row step's, from ``multirow_specs_for_model``). Building ahead of time (CI, ``nanoqwen-gen emit --all``, runtime
start-up) is this list fed to ``build_many``."""

from __future__ import annotations

from .. import config
from ..dims import ModelDims
from . import kernels
from .gpu import DEFAULT, GpuProfile
from .spec import KernelSpec


def model_kernels(dims: ModelDims, cfg: config.Config | None = None, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    return _collect("specs_for_model", dims, cfg, gpu)


def multirow_kernels(dims: ModelDims, cfg: config.Config | None = None,
                     gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    """The multi-row step's m > 1 kernels (DESIGN.md section 12): every family's
    ``multirow_specs_for_model``, one variant per config multirow.buckets entry above 1."""
    return _collect("multirow_specs_for_model", dims, cfg, gpu)


def _collect(hook_name: str, dims: ModelDims, cfg: config.Config | None, gpu: GpuProfile) -> list[KernelSpec]:
    cfg = cfg or config.default()
    specs: list[KernelSpec] = []
    for name in kernels.modules():
        hook = getattr(kernels.module(name), hook_name, None)
        if hook is not None:
            specs.extend(hook(dims, cfg, gpu))
    return list(dict.fromkeys(specs))
