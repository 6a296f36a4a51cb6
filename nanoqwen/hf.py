"""Read a Hugging Face Qwen2 checkpoint directory one tensor (or row range) at a time.

safetensors' numpy frontend cannot produce bf16, so shards are read directly: an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then raw little-endian data. Rows are read with
``np.fromfile(offset=...)`` into anonymous memory, so memory stays bounded by the rows asked for (no mapping
of multi-GB shards whose touched pages would count against the process), and bf16 becomes fp32 by a 16-bit
shift, which is exact.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import NanoqwenError
from .dims import ModelDims


class HFError(NanoqwenError):
    pass


_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}


@dataclass(frozen=True)
class HFTensor:
    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the shard


def _read_shard_header(path: Path) -> dict[str, HFTensor]:
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise HFError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (hlen,) = struct.unpack("<Q", raw)
            if 8 + hlen > size:
                raise HFError(f"{path}: header length {hlen} exceeds the file size {size} (truncated?)")
            header = json.loads(f.read(hlen))
    except OSError as e:
        raise HFError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path}: invalid safetensors JSON header: {e}") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HFError(f"{path}: tensor {name}: malformed header entry {meta!r}") from None
        if dtype not in _DTYPES:
            raise HFError(f"{path}: tensor {name}: dtype {dtype} is not supported (BF16, F16 or F32)")
        n = int(np.prod(shape, dtype=np.int64))
        if end - begin != n * _DTYPES[dtype].itemsize or 8 + hlen + end > size:
            raise HFError(f"{path}: tensor {name}: data range [{begin}, {end}) does not hold {dtype} {list(shape)} "
                          f"inside the {size}-byte file (truncated?)")
        out[name] = HFTensor(name, path, dtype, shape, 8 + hlen + begin)
    return out


class HFCheckpoint:
    """``config.json`` -> ``.dims``; ``model.safetensors`` or ``model.safetensors.index.json`` + shards ->
    ``.tensors`` (name -> HFTensor). ``read(name, start, stop)`` returns fp32 rows."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise HFError(f"{self.path}: not a directory")
        self.dims = ModelDims.from_hf_dir(self.path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFError(f"{index}: cannot read weight_map: {e}") from None
            shards = sorted(set(weight_map.values()))
            absent = [s for s in shards if not (self.path / s).exists()]
            if absent:
                raise HFError(f"{index}: {len(absent)} shard(s) missing, first {absent[0]}")
        elif single.exists():
            weight_map, shards = None, ["model.safetensors"]
        else:
            raise HFError(f"{self.path}: neither model.safetensors nor model.safetensors.index.json found")
        self.tensors: dict[str, HFTensor] = {}
        for s in shards:
            for name, t in _read_shard_header(self.path / s).items():
                if weight_map is not None and weight_map.get(name) != s:
                    continue  # the index decides which shard owns a name
                self.tensors[name] = t
        if weight_map is not None:
            lost = [n for n in weight_map if n not in self.tensors]
            if lost:
                raise HFError(f"{index}: tensor {lost[0]} is not in its shard {weight_map[lost[0]]}")

    @property
    def shards(self) -> list[Path]:
        return sorted({t.shard for t in self.tensors.values()})

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected name (HF shape) is present with that shape; the config and the weights must agree."""
        for name, shape in expected.items():
            t = self.tensors.get(name)
            if t is None:
                raise HFError(f"{self.path}: tensor {name} is missing from the checkpoint")
            if t.shape != shape:
                raise HFError(f"{t.shard}: tensor {name} has shape {list(t.shape)}, config.json implies "
                              f"{list(shape)}")

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of tensor ``name`` (the first axis) as float32."""
        t = self.tensors[name]
        rows = t.shape[0] if t.shape else 1
        stop = rows if stop is None else min(stop, rows)
        row_elems = int(np.prod(t.shape[1:], dtype=np.int64))
        dt = _DTYPES[t.dtype]
        raw = np.fromfile(t.shard, dtype=dt, count=(stop - start) * row_elems,
                          offset=t.offset + start * row_elems * dt.itemsize)
        if t.dtype == "BF16":
            out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            out = raw.astype(np.float32, copy=False)
        return out.reshape((stop - start,) + t.shape[1:])
