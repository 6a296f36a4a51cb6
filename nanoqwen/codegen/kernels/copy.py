"""Streaming 16-byte device copy: the bandwidth yardstick GEMVs are judged against (DESIGN.md section 5
quotes the H200's copy bandwidth), and the smallest real kernel for the codegen's own tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..gpu import DEFAULT
from ..spec import KernelSpec, Launch, Param, SpecError, inp, out, scalar


@dataclass(frozen=True)
class CopySpec(KernelSpec):
    family = "copy"
    template = "copy.cu.j2"
    uri_fields = ("threads", "unroll")
    kernel_params: ClassVar[tuple[Param, ...]] = (inp("src", "uint4"), out("dst", "uint4"), scalar("n16", "u64"))

    threads: int = 256   # threads per block
    unroll: int = 4      # 16-byte loads in flight per thread before the first store
    blocks: int = 8 * DEFAULT.sm_count   # grid size (8 CTAs per SM); the kernel grid-strides over the buffer

    def validate(self) -> None:
        super().validate()
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise SpecError(f"copy.threads must be a multiple of 32 in 32..1024, got {self.threads}")
        if not 1 <= self.unroll <= 16:
            raise SpecError(f"copy.unroll must be 1..16, got {self.unroll}")
        if self.blocks <= 0:
            raise SpecError(f"copy.blocks must be positive, got {self.blocks}")

    def launch(self) -> Launch:
        return Launch(grid=(self.blocks, 1, 1), block=(self.threads, 1, 1))
