"""spec -> source (render) -> cubin (NVRTC) -> on-disk cache, resource reports, and the list of kernels a
model needs. Knows nothing of the runtime: it produces cubins, the runtime loads them."""

from .build import Built, ProgressLine, build, build_many
from .cache import JitDisabled
from .gpu import GpuProfile
from .kernels import from_params
from .nvrtc import CompileError, Compiled
from .manifest import model_kernels, multirow_kernels
from .render import render
from .resources import Resources
from .spec import KernelSpec, Launch, SpecError

__all__ = ["Built", "CompileError", "Compiled", "GpuProfile", "JitDisabled", "KernelSpec", "Launch", "ProgressLine",
           "Resources", "SpecError", "build", "build_many", "from_params", "model_kernels", "multirow_kernels", "render"]
