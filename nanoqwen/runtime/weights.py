"""Upload a .nanoqwen file's tensors to the GPU once, into one device allocation.

Why one allocation: one cuMemAlloc (one size check, one out-of-memory message with the exact byte count),
and the kernels receive plain pointers into it. Why a layout of our own rather than the file's order:
the fused QKV GEMV reads q, k and v as one stacked [q_dim + 2*kv_dim, hidden] matrix, so per layer the q,
k and v packed rows are uploaded back to back (then their scales back to back, then their biases), and
the whole region is a single GEMV operand. Every region starts on an ``ALIGN``-byte boundary so 16-byte
vector loads and 128-byte L2 lines never straddle two tensors.

The layout is computed on the host (``plan``) without a GPU, so CPU tests check it; ``upload`` copies
from the file's mmap straight into the allocation, tensor by tensor (no host copy of the model).

Verification: a thread pool computes every payload's CRC-32 ahead of the copies (NanoqwenFile.checker), in
the copy order, and each tensor is checked right before its copy, so a corrupt byte never reaches the GPU.
When the pool's cores together checksum faster than the copy moves bytes (zlib.crc32: ~2 GB/s a core; the
7B's upload: ~7 GB/s), the copy waits only for the first, small tensor; tools/measure_load.py measures the
cost on the 7B."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from .. import NanoqwenError
from ..nqfile import NanoqwenFile
from ..units import size
from . import driver

ALIGN = 256  # bytes; cuMemAlloc itself aligns to 256, so every region is as aligned as a fresh allocation


class WeightsError(NanoqwenError):
    pass


@dataclass(frozen=True)
class Region:
    """One named operand in the allocation, filled from ``parts`` (file tensor names, with what to take
    from each) copied back to back."""
    name: str
    offset: int
    nbytes: int
    parts: tuple[tuple[str, str], ...]  # (file tensor name, "packed" | "scales" | "array")


@dataclass
class Plan:
    regions: dict[str, Region] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, parts, sizes) -> None:
        self.regions[name] = Region(name, self.nbytes, int(sum(sizes)), tuple(parts))
        self.nbytes += -(-int(sum(sizes)) // ALIGN) * ALIGN


def _entry(tensor: str, what: str) -> str:
    """The file entry a part is copied from."""
    return tensor + ".scales" if what == "scales" else tensor


def _source(f: NanoqwenFile, tensor: str, what: str) -> np.ndarray:
    if what == "array":
        return f.array(tensor)
    packed, scales = f.int4(tensor)
    return packed if what == "packed" else scales


def plan(f: NanoqwenFile) -> Plan:
    """Region names: ``embed``, ``final_norm``, ``lm_head`` (the embedding region again when tied), and per
    layer i ``L{i}.input_norm``, ``L{i}.qkv.packed|scales|bias`` (q, k, v stacked), ``L{i}.o.packed|scales``,
    ``L{i}.post_norm``, ``L{i}.gate|up|down.packed|scales``."""
    p = Plan()

    def add(name, *parts):
        p.add(name, parts, [_source(f, t, w).nbytes for t, w in parts])

    add("embed", ("model.embed_tokens.weight", "array"))
    for i in range(f.dims.layers):
        L, a = f"L{i}.", f"model.layers.{i}.self_attn."
        m = f"model.layers.{i}.mlp."
        add(L + "input_norm", (f"model.layers.{i}.input_layernorm.weight", "array"))
        qkv = [a + f"{x}_proj.weight" for x in "qkv"]
        add(L + "qkv.packed", *[(t, "packed") for t in qkv])
        add(L + "qkv.scales", *[(t, "scales") for t in qkv])
        add(L + "qkv.bias", *[(a + f"{x}_proj.bias", "array") for x in "qkv"])
        add(L + "o.packed", (a + "o_proj.weight", "packed"))
        add(L + "o.scales", (a + "o_proj.weight", "scales"))
        add(L + "post_norm", (f"model.layers.{i}.post_attention_layernorm.weight", "array"))
        for x in ("gate", "up"):  # the SwiGLU GEMV takes gate and up as two operands
            add(L + f"{x}.packed", (m + f"{x}_proj.weight", "packed"))
            add(L + f"{x}.scales", (m + f"{x}_proj.weight", "scales"))
        add(L + "down.packed", (m + "down_proj.weight", "packed"))
        add(L + "down.scales", (m + "down_proj.weight", "scales"))
    add("final_norm", ("model.norm.weight", "array"))
    if f.dims.tie_embeddings:
        p.regions["lm_head"] = p.regions["embed"]
    else:
        add("lm_head", ("lm_head.weight", "array"))
    return p


class Weights:
    """The model on the device: ``ptr(region)`` is the device address of a region of ``plan(f)``."""

    def __init__(self, f: NanoqwenFile, progress=None, verify: bool = True):
        # NanoqwenFile has refused any nibble order but the one the GEMV kernels decode (quant.LAYOUT_ID)
        self.file, self.plan = f, plan(f)
        props = driver.device().props
        free, total = props.free_mem, props.total_mem
        if self.plan.nbytes > free:
            raise WeightsError(f"{f.path}: weights need {size(self.plan.nbytes)} of GPU memory, "
                               f"only {size(free)} of {size(total)} is free")
        self.buffer = driver.DeviceBuffer(self.plan.nbytes)
        base = self.buffer.ptr
        # the 1 GB embedding goes last: the checksum pool works in the copy order, so no copy waits for it
        regions = sorted({id(r): r for r in self.plan.regions.values()}.values(), key=lambda r: r.name == "embed")
        order = [_entry(t, w) for r in regions for t, w in r.parts]
        try:
            with f.checker(order) if verify else contextlib.nullcontext() as checker:
                for r in regions:
                    at = base + r.offset
                    for tensor, what in r.parts:
                        if checker:
                            checker.check(_entry(tensor, what))
                        src = np.ascontiguousarray(_source(f, tensor, what))
                        driver.check(driver.cu.cuMemcpyHtoD(at, src.ctypes.data, src.nbytes), f"upload {tensor}")
                        at += src.nbytes
                        if progress:
                            progress(src.nbytes)
        except BaseException:
            self.buffer.free()  # a corrupt file must not leave gigabytes allocated in a long-lived process
            raise

    def ptr(self, region: str) -> int:
        return self.buffer.ptr + self.plan.regions[region].offset

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes
