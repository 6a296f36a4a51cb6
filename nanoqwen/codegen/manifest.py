"""The kernels a model needs on a GPU: every registered family module's ``specs_for_model(dims, cfg, gpu)``,
concatenated and de-duplicated. Building ahead of time (CI, ``nanoqwen-gen emit --all``, runtime
start-up) is this list fed to ``build_many``."""

from __future__ import annotations

from .. import config
from ..dims import ModelDims
from . import kernels
from .gpu import DEFAULT, GpuProfile
from .spec import KernelSpec


def model_kernels(dims: ModelDims, cfg: config.Config | None = None, gpu: GpuProfile = DEFAULT) -> list[KernelSpec]:
    cfg = cfg or config.default()
    specs: list[KernelSpec] = []
    for name in kernels.modules():
        hook = getattr(kernels.module(name), "specs_for_model", None)
        if hook is not None:
            specs.extend(hook(dims, cfg, gpu))
    return list(dict.fromkeys(specs))
