"""Read a Hugging Face Qwen2 checkpoint directory one tensor (or row range) at a time.

safetensors' numpy frontend cannot produce bf16, so shards are read directly: an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then raw little-endian data. Rows are read with
``np.fromfile(offset=...)`` into anonymous memory, so memory stays bounded by the rows asked for (no mapping
of multi-GB shards whose touched pages would count against the process), and bf16 becomes fp32 by a 16-bit
shift, which is exact.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import NanoqwenError
from .dims import ModelDims
from .safefile import kind, lookup, open_regular, parse_json, read_json


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


# safetensors' own bound on the JSON header
MAX_HEADER_BYTES = 100_000_000


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _ints(x, count: int | None = None) -> bool:
    return isinstance(x, list) and (count is None or len(x) == count) and \
        all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)


def _read_shard_header(path: Path) -> dict[str, HFTensor]:
    """The tensors of one shard, every header field type-checked and every data range inside the file and
    disjoint from the others, so that reads later cannot go astray."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise HFError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", raw)
        if 8 + hlen > size or hlen > MAX_HEADER_BYTES:
            raise HFError(f"{path}: header length {hlen} exceeds the file size {size} or the "
                          f"{MAX_HEADER_BYTES:,}-byte limit (truncated, or not a safetensors file)")
        header = parse_json(f.read(hlen), f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise HFError(f"{path}: safetensors header: must be a JSON object, not {_short(header)}")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name}"
        if not isinstance(meta, dict):
            raise HFError(f"{where}: header entry must be an object, not {_short(meta)}")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if dtype not in _DTYPES:
            raise HFError(f"{where}: dtype {_short(dtype)} is not supported (BF16, F16 or F32)")
        if not _ints(shape):
            raise HFError(f"{where}: shape {_short(shape)} is not a list of non-negative integers")
        if not _ints(offsets, 2) or offsets[0] > offsets[1]:
            raise HFError(f"{where}: data_offsets {_short(offsets)} is not [begin, end] with begin <= end")
        begin, end = offsets
        if end - begin != math.prod(shape) * _DTYPES[dtype].itemsize or 8 + hlen + end > size:
            raise HFError(f"{where}: data range [{begin}, {end}) does not hold {dtype} {list(shape)} "
                          f"inside the {size}-byte file (truncated?)")
        out[name] = HFTensor(name, path, dtype, tuple(shape), 8 + hlen + begin)
    ordered = sorted(out.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + math.prod(a.shape) * _DTYPES[a.dtype].itemsize > b.offset:
            raise HFError(f"{path}: tensor {b.name}: data_offsets overlap tensor {a.name}")
    return out


def _weight_map(index: Path) -> dict[str, str]:
    """tensor name -> shard file name (a plain name in the same directory) of an index.json."""
    doc = read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise HFError(f"{index}: weight_map: missing or not an object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise HFError(f"{index}: weight_map: tensor {name}: shard {_short(shard)} is not a file name in "
                          "the model directory")
    return weight_map


class HFCheckpoint:
    """``config.json`` -> ``.dims``; ``model.safetensors`` or ``model.safetensors.index.json`` + shards ->
    ``.tensors`` (name -> HFTensor). ``read(name, start, stop)`` returns fp32 rows."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mode = lookup(self.path)
        if not stat.S_ISDIR(mode):
            raise HFError(f"{self.path}: not a directory ({kind(mode)}); a Hugging Face model is a directory")
        self.dims = ModelDims.from_hf_dir(self.path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if os.path.lexists(index):  # lexists: a symlink loop or a FIFO is reported as what it is, not as absent
            weight_map = _weight_map(index)
            shards = sorted(set(weight_map.values()))
            absent = [s for s in shards if not os.path.lexists(self.path / s)]
            if absent:
                raise HFError(f"{index}: {len(absent)} shard(s) missing, first {absent[0]}")
        elif os.path.lexists(single):
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
