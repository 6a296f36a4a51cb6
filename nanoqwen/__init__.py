"""nanoqwen: JIT-generated CUDA kernels for batch-1 Qwen2.5 INT4 inference on Hopper."""

__version__ = "0.1.0"


class NanoqwenError(Exception):
    """An error a user can act on: printed as one line by the CLIs, with a non-zero exit."""
