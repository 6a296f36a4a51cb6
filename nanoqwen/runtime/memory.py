"""The memory plan: every device buffer the engine allocates, as name -> bytes. Each part declares its
buffers once (``state.buffer_bytes``, ``decoder.buffer_bytes``, ``prefill.buffer_bytes``, beside the
weights' and the KV cache's totals); the session sums the plan for the up-front check against the free
GPU memory, and each part allocates exactly its own entries through ``Buffers``."""

from __future__ import annotations

from .. import NanoqwenError
from . import driver

GiB = 2**30


class DeviceMemoryError(NanoqwenError):
    pass


class Buffers:
    """One device allocation per entry of a plan, reachable as attributes (``bufs.h``)."""

    def __init__(self, plan: dict[str, int]):
        self.names = list(plan)
        for name, nbytes in plan.items():
            setattr(self, name, driver.DeviceBuffer(nbytes))

    def __getitem__(self, name: str):
        return getattr(self, name)

    def free(self) -> None:
        for name in self.names:
            self[name].free()


def plan(**parts) -> dict[str, int]:
    """One plan from the parts' plans, names prefixed with their part (``decode.h``); an int part is one
    buffer of that many bytes."""
    out = {}
    for part, p in parts.items():
        out.update({part: p} if isinstance(p, int) else {f"{part}.{name}": b for name, b in p.items()})
    return out


def check_fits(plan: dict[str, int], free: int, total: int, gpu: str) -> None:
    """One line naming the bytes when the plan does not fit the free memory."""
    need = sum(plan.values())
    if need > free:
        parts: dict[str, int] = {}
        for name, b in plan.items():
            parts[name.split(".")[0]] = parts.get(name.split(".")[0], 0) + b
        detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        raise DeviceMemoryError(f"not enough GPU memory: {need / GiB:.2f} GiB needed ({detail}), "
                                f"{free / GiB:.2f} GiB free of {total / GiB:.2f} on {gpu}")
