"""spec -> source (render) -> cubin (NVRTC) -> on-disk cache, resource reports, and the list of kernels a
model needs. Knows nothing of the runtime: it produces cubins, the runtime loads them."""

from .build import Built, ProgressLine, build, build_many
from .cache import JitDisabled
from .nvrtc import CompileError, Compiled
from .manifest import model_kernels
from .render import render
from .resources import Resources
from .spec import KernelSpec, Launch, SpecError, from_params

__all__ = ["Built", "CompileError", "Compiled", "JitDisabled", "KernelSpec", "Launch", "ProgressLine",
           "Resources", "SpecError", "build", "build_many", "from_params", "model_kernels", "render"]
