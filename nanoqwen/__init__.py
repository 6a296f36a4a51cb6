"""nanoqwen: JIT-generated CUDA kernels for batch-1 Qwen2.5 INT4 inference on Hopper."""

from pathlib import Path

__version__ = "0.1.0"

# Repository root holds config/ and templates/ beside the package (run from the source tree or installed
# editable); both are data the package reads, never code it imports.
ROOT = Path(__file__).resolve().parent.parent


class NanoqwenError(Exception):
    """An error a user can act on: printed as one line by the CLIs, with a non-zero exit."""
