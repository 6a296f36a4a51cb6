"""Device memory as one table, name -> bytes, of every buffer the engine allocates. Each part declares its
buffers once (``state.buffer_bytes``, ``decoder.buffer_bytes``, ``prefill.buffer_bytes``, beside the
weights' and the KV cache's totals); the session merges the tables for the up-front check against the
free GPU memory, and each part allocates exactly its own entries through ``Buffers``."""

from __future__ import annotations

from .. import NanoqwenError
from ..units import size
from . import driver


class DeviceMemoryError(NanoqwenError):
    pass


class Buffers:
    """One device allocation per entry of a table, reachable as attributes (``bufs.h``)."""

    def __init__(self, sizes: dict[str, int]):
        self.names = list(sizes)
        for name, nbytes in sizes.items():
            setattr(self, name, driver.DeviceBuffer(nbytes))

    def __getitem__(self, name: str):
        return getattr(self, name)

    def free(self) -> None:
        for name in self.names:
            self[name].free()


def merge(**parts) -> dict[str, int]:
    """One table from the parts' tables, names prefixed with their part (``decode.h``); an int part is
    one buffer of that many bytes."""
    out = {}
    for part, p in parts.items():
        out.update({part: p} if isinstance(p, int) else {f"{part}.{name}": b for name, b in p.items()})
    return out


def check_fits(sizes: dict[str, int], free: int, total: int, gpu: str) -> None:
    """One line naming the bytes, per part, when the table does not fit the free memory."""
    need = sum(sizes.values())
    if need > free:
        parts: dict[str, int] = {}
        for name, b in sizes.items():
            parts[name.split(".")[0]] = parts.get(name.split(".")[0], 0) + b
        detail = ", ".join(f"{k} {size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        raise DeviceMemoryError(f"not enough GPU memory: {size(need)} needed ({detail}), "
                                f"{size(free)} free of {size(total)} on {gpu}")
