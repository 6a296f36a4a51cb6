"""The .nanoqwen file (DESIGN.md section 3): one mmap-able file, validated completely on open.

Layout (all integers little-endian):
  [0, 256)     header: struct ``_HEADER`` below, zero padded, CRC-32 of bytes [0, 252) in bytes [252, 256)
  [256, ...)   table: ``entry_count`` entries, each
                 u16 name length, name (utf-8), u8 storage tag, u8 ndim, ndim x u64 shape,
                 u64 offset, u64 bytes, u32 CRC-32 of the payload; the table's own CRC-32 is in the header
  data_offset  payloads, each starting on an ``ALIGNMENT`` (128-byte, one L2 line) boundary

An INT4 weight [N, K] is two entries: ``<name>`` (tag INT4, logical shape [N, K], payload uint32 [N, K/8]
in ValueShuffle order) and ``<name>.scales`` (tag FP16, [N, K/group]). Everything else is FP16 raw.
``expected_tensors(dims)`` is the one list of names, tags and shapes; writer and reader both enforce it.
Version 2 adds blobs: entries with tag BYTES (shape [nbytes]) holding named files beside the tensors, e.g. the
tokenizer's (nanoqwen/tokenizer.py decides which). Version-1 files have none and still open.

Checksum: zlib.crc32 (stdlib, ~2.8 GB/s here vs 0.7 GB/s for blake2b); it guards against truncation and
bit rot, not tampering.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import NanoqwenError, interrupt
from .checksum import ParallelCRC
from .config import Config, default
from .dims import DimsError, ModelDims
from .quant import LAYOUT_ID, LAYOUT_NAME
from .safefile import FileError, check_replaceable, open_regular


class NqFileError(NanoqwenError):
    pass


# Facts of the format, not settings: a file written with other values would be unreadable.
MAGIC = b"NANOQWEN"
VERSION = 2                # what the writer writes: version 1 plus blobs
READABLE_VERSIONS = (1, 2)
HEADER_BYTES = 256
ALIGNMENT = 128            # payload alignment: one L2 line

INT4, FP16, FP32, BYTES = 1, 2, 3, 4
TAG_NAMES = {INT4: "INT4", FP16: "FP16", FP32: "FP32", BYTES: "BYTES"}
# numpy dtype of the payload and how many logical elements one payload element holds
_PAYLOAD = {INT4: (np.dtype(np.uint32), 8), FP16: (np.dtype(np.float16), 1), FP32: (np.dtype(np.float32), 1),
            BYTES: (np.dtype(np.uint8), 1)}

FLAG_SYNTHETIC = 1  # random weights (`nanoqwen pack --random`), not a real checkpoint
_KNOWN_FLAGS = FLAG_SYNTHETIC

_DIM_INTS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_positions")
_HEADER = struct.Struct("<8s4I8I2d2I4QI")
_HEADER_FIELDS = ("magic", "version", "layout_id", "group_size", "flags", *_DIM_INTS, "rope_theta", "rms_eps",
                  "tie_embeddings", "entry_count", "table_offset", "table_bytes", "data_offset", "file_size",
                  "table_crc")
_CRC_AT = HEADER_BYTES - 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tag: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc: int

    @property
    def tag_name(self) -> str:
        return TAG_NAMES[self.tag]


def expected_tensors(dims: ModelDims, cfg: Config | None = None) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Every tensor a .nanoqwen file for ``dims`` holds, in file order: name -> (storage tag, logical shape).
    HF names are kept; each INT4 weight brings its ``.scales`` entry right after it."""
    cfg = cfg or default()
    g = cfg.quant.group_size
    dims.check_quantizable(g)
    h, qd, kvd, inter = dims.hidden, dims.q_dim, dims.kv_dim, dims.intermediate
    out: dict[str, tuple[int, tuple[int, ...]]] = {"model.embed_tokens.weight": (FP16, (dims.vocab, h))}

    def weight(name: str, module: str, shape: tuple[int, int]):
        if module in cfg.quant.int4_tensors:
            out[name] = (INT4, shape)
            out[name + ".scales"] = (FP16, (shape[0], shape[1] // g))
        else:
            out[name] = (FP16, shape)

    for i in range(dims.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (FP16, (h,))
        for proj, n in (("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)):
            weight(f"{p}self_attn.{proj}.weight", proj, (n, h))
            out[f"{p}self_attn.{proj}.bias"] = (FP16, (n,))
        weight(f"{p}self_attn.o_proj.weight", "o_proj", (h, qd))
        out[p + "post_attention_layernorm.weight"] = (FP16, (h,))
        weight(f"{p}mlp.gate_proj.weight", "gate_proj", (inter, h))
        weight(f"{p}mlp.up_proj.weight", "up_proj", (inter, h))
        weight(f"{p}mlp.down_proj.weight", "down_proj", (h, inter))
    out["model.norm.weight"] = (FP16, (h,))
    if not dims.tie_embeddings:
        weight("lm_head.weight", "lm_head", (dims.vocab, h))
    return out


def weight_tensors(dims: ModelDims, cfg: Config | None = None) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The tensors a checkpoint provides: expected_tensors without the derived ``<name>.scales`` entries."""
    exp = expected_tensors(dims, cfg)
    return {n: v for n, v in exp.items() if not (n.endswith(".scales") and exp.get(n[:-7], (0,))[0] == INT4)}


def payload_bytes(tag: int, shape: tuple[int, ...]) -> int:
    dtype, per = _PAYLOAD[tag]
    return int(np.prod(shape, dtype=np.int64)) // per * dtype.itemsize


def _entry_bytes(name: str, ndim: int) -> int:
    return 2 + len(name.encode()) + 2 + 8 * ndim + 8 + 8 + 4


_MIN_ENTRY_BYTES = _entry_bytes("", 0)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _encode_table(entries: list[TensorInfo]) -> bytes:
    parts = []
    for e in entries:
        nb = e.name.encode()
        parts.append(struct.pack(f"<H{len(nb)}sBB{len(e.shape)}QQQI", len(nb), nb, e.tag, len(e.shape),
                                 *e.shape, e.offset, e.nbytes, e.crc))
    return b"".join(parts)


class Writer:
    """Streaming writer: ``with Writer(path, dims) as w: w.add_int4(...); w.add_fp16(...)``. Tensors may come in
    any order, each exactly once; ``blobs`` (name -> bytes) are written first. The table is sized up front from
    ``expected_tensors(dims)`` and the blob names. Payloads go to a temporary file beside ``path``; only a
    complete, fsynced file is renamed to ``path``."""

    def __init__(self, path: str | Path, dims: ModelDims, synthetic: bool = False, cfg: Config | None = None,
                 blobs: dict[str, bytes] | None = None):
        self.path = Path(path)
        self.dims = dims
        self.cfg = cfg or default()
        self.flags = FLAG_SYNTHETIC if synthetic else 0
        try:
            self.expected = expected_tensors(dims, self.cfg)
        except DimsError as e:
            raise NqFileError(f"{self.path}: {e}") from None
        self.blobs = dict(blobs or {})
        for name in self.blobs:
            if not name or name in self.expected:
                raise NqFileError(f"{self.path}: blob {name!r}: a blob needs a name of its own")
        self._table_bytes = sum(_entry_bytes(n, len(s)) for n, (_, s) in self.expected.items()) + \
            sum(_entry_bytes(n, 1) for n in self.blobs)
        self._data_offset = _align(HEADER_BYTES + self._table_bytes, ALIGNMENT)
        self._entries: dict[str, TensorInfo] = {}
        self._f = None

    def __enter__(self) -> "Writer":
        check_replaceable(self.path)
        # Named and registered before it exists, so that a signal at any point after its creation removes it
        self._tmp = self.path.parent / f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        interrupt.register(self._tmp)
        try:
            # 0o666 less the umask, as for any new file (mkstemp's 0600 would become the final file's mode)
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except OSError as e:
            interrupt.unregister(self._tmp)
            raise NqFileError(f"{self.path}: cannot create a file in {self.path.parent}: {e.strerror}") from None
        try:
            self._f = os.fdopen(fd, "wb")
            self._f.seek(self._data_offset)
            for name, data in self.blobs.items():
                self._write(name, BYTES, np.frombuffer(data, np.uint8), (len(data),))
        except BaseException:  # __exit__ is not called when __enter__ fails
            self._remove_temporary()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            self._remove_temporary()

    def _remove_temporary(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)
        interrupt.unregister(self._tmp)

    def add_int4(self, name: str, packed: np.ndarray, scales: np.ndarray) -> None:
        """packed uint32 [N, K/8] (quant.pack) and scales fp16 [N, K/group] (quant.quantize) of weight ``name``."""
        self._check(name, INT4, packed, np.uint32)
        self._check(name + ".scales", FP16, scales, np.float16)  # both checked before either is written
        self._write(name, INT4, packed)
        self._write(name + ".scales", FP16, scales)

    def add_fp16(self, name: str, arr: np.ndarray) -> None:
        """A raw fp16 tensor (convert with quant.to_fp16, which rejects out-of-range values)."""
        self._check(name, FP16, arr, np.float16)
        self._write(name, FP16, arr)

    def _check(self, name: str, tag: int, arr: np.ndarray, dtype) -> None:
        where = f"{self.path}: tensor {name}"
        if name not in self.expected:
            raise NqFileError(f"{where}: not a tensor of this model")
        if name in self._entries:
            raise NqFileError(f"{where}: added twice")
        etag, shape = self.expected[name]
        if etag != tag:
            raise NqFileError(f"{where}: stored as {TAG_NAMES[etag]}, not {TAG_NAMES[tag]}")
        per = _PAYLOAD[tag][1]
        want = shape[:-1] + (shape[-1] // per,)
        if arr.dtype != dtype or arr.shape != want:
            raise NqFileError(f"{where}: expected {np.dtype(dtype)} {list(want)}, got {arr.dtype} {list(arr.shape)}")

    def _write(self, name: str, tag: int, arr: np.ndarray, shape: tuple[int, ...] | None = None) -> None:
        shape = shape or self.expected[name][1]
        view = memoryview(np.ascontiguousarray(arr)).cast("B")
        offset = self._f.tell()
        self._f.write(view)
        self._f.write(b"\0" * (_align(offset + view.nbytes, ALIGNMENT) - offset - view.nbytes))
        self._entries[name] = TensorInfo(name, tag, shape, offset, view.nbytes, zlib.crc32(view))

    def _finish(self) -> None:
        missing = [n for n in self.expected if n not in self._entries]
        if missing:
            raise NqFileError(f"{self.path}: {len(missing)} tensors never added, first {missing[0]}")
        file_size = self._f.tell()
        # file order = expected order, so the table is independent of the order tensors were added in
        table = _encode_table([self._entries[n] for n in [*self.expected, *self.blobs]])
        assert len(table) == self._table_bytes
        d = self.dims
        values = dict(magic=MAGIC, version=VERSION, layout_id=LAYOUT_ID, group_size=self.cfg.quant.group_size,
                      flags=self.flags, **{k: getattr(d, k) for k in _DIM_INTS}, rope_theta=d.rope_theta,
                      rms_eps=d.rms_eps, tie_embeddings=int(d.tie_embeddings),
                      entry_count=len(self.expected) + len(self.blobs), table_offset=HEADER_BYTES,
                      table_bytes=len(table),
                      data_offset=self._data_offset, file_size=file_size, table_crc=zlib.crc32(table))
        header = _HEADER.pack(*(values[k] for k in _HEADER_FIELDS)).ljust(_CRC_AT, b"\0")
        header += struct.pack("<I", zlib.crc32(header))
        self._f.seek(0)
        self._f.write(header)
        self._f.write(table)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        check_replaceable(self.path)  # again: the packing took a while
        os.replace(self._tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # make the rename itself durable
        finally:
            os.close(dfd)


class NanoqwenFile:
    """A validated, memory-mapped .nanoqwen file. Arrays returned are read-only zero-copy views of the map.
    ``tensors``: the model's tensors (exactly ``expected_tensors(dims)``); ``blobs``: the named byte entries."""

    def __init__(self, path: str | Path, cfg: Config | None = None):
        self.path = Path(path)
        self.cfg = cfg or default()
        try:
            with open_regular(self.path) as f:  # never a FIFO or a device: those would hang or never end
                size = os.fstat(f.fileno()).st_size
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except FileError as e:
            raise NqFileError(str(e)) from None
        except OSError as e:
            raise NqFileError(f"{self.path}: cannot map: {e.strerror}") from None
        self.size = size
        self.header = self._read_header()
        self.version = self.header["version"]
        self.synthetic = bool(self.header["flags"] & FLAG_SYNTHETIC)
        self.tensors, self.blobs = self._read_table()

    def _fail(self, field: str, msg: str):
        raise NqFileError(f"{self.path}: {field}: {msg}")

    def _read_header(self) -> dict:
        hb = HEADER_BYTES
        if self.size < hb:
            self._fail("header", f"file is {self.size} bytes, shorter than the {hb}-byte header")
        raw = bytes(self._mm[:hb])
        h = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(raw)))
        if h["magic"] != MAGIC:
            self._fail("magic", f"{h['magic']!r} is not {MAGIC!r} (not a .nanoqwen file)")
        if h["version"] not in READABLE_VERSIONS:
            self._fail("version", f"format version {h['version']} is not supported (this build reads "
                       f"{', '.join(map(str, READABLE_VERSIONS))})")
        (crc,) = struct.unpack_from("<I", raw, _CRC_AT)
        if crc != zlib.crc32(raw[:_CRC_AT]):
            self._fail("header checksum", f"stored {crc:#010x} != computed {zlib.crc32(raw[:_CRC_AT]):#010x} "
                       "(header corrupted)")
        if h["layout_id"] != LAYOUT_ID:
            self._fail("layout id", f"{h['layout_id']} is not {LAYOUT_ID} ({LAYOUT_NAME})")
        if h["group_size"] != self.cfg.quant.group_size:
            self._fail("group size", f"{h['group_size']} is not the configured {self.cfg.quant.group_size}")
        if h["flags"] & ~_KNOWN_FLAGS:
            self._fail("flags", f"unknown flag bits {h['flags'] & ~_KNOWN_FLAGS:#x}")
        if h["file_size"] != self.size:
            what = "truncated" if self.size < h["file_size"] else "trailing bytes"
            self._fail("file size", f"header says {h['file_size']} bytes, file has {self.size} ({what})")
        try:
            self.dims = ModelDims(**{k: h[k] for k in _DIM_INTS}, rope_theta=h["rope_theta"], rms_eps=h["rms_eps"],
                                  tie_embeddings=bool(h["tie_embeddings"]))
            self.expected = expected_tensors(self.dims, self.cfg)
        except DimsError as e:
            self._fail("dims", str(e))
        if h["table_offset"] != hb or h["data_offset"] < hb + h["table_bytes"] or h["data_offset"] > self.size:
            self._fail("table offset", f"table [{h['table_offset']}, +{h['table_bytes']}) and data offset "
                       f"{h['data_offset']} do not fit a {self.size}-byte file")
        if h["data_offset"] % ALIGNMENT:
            self._fail("data offset", f"{h['data_offset']} is not {ALIGNMENT}-byte aligned")
        # a file cannot describe more entries or payload bytes than it holds: checked before either is read
        if h["entry_count"] > h["table_bytes"] // _MIN_ENTRY_BYTES:
            self._fail("entry count", f"{h['entry_count']} entries do not fit a {h['table_bytes']}-byte table")
        need = sum(payload_bytes(t, s) for t, s in self.expected.values())
        if need > self.size - h["data_offset"]:
            self._fail("dims", f"the tensors of these dims need {need:,} bytes, the data region holds "
                       f"{self.size - h['data_offset']:,}")
        return h

    def _read_table(self) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo]]:
        h = self.header
        table = bytes(self._mm[h["table_offset"]:h["table_offset"] + h["table_bytes"]])
        if zlib.crc32(table) != h["table_crc"]:
            self._fail("table checksum", "tensor table corrupted")
        entries: dict[str, TensorInfo] = {}
        pos = 0
        try:
            for _ in range(h["entry_count"]):
                (nlen,) = struct.unpack_from("<H", table, pos)
                name = table[pos + 2:pos + 2 + nlen].decode()
                pos += 2 + nlen
                tag, ndim = struct.unpack_from("<BB", table, pos)
                *shape, offset, nbytes, crc = struct.unpack_from(f"<{ndim}QQQI", table, pos + 2)
                pos += 2 + 8 * ndim + 20
                if name in entries:
                    self._fail(f"tensor {name}", "appears twice in the table")
                entries[name] = TensorInfo(name, tag, tuple(shape), offset, nbytes, crc)
        except (struct.error, UnicodeDecodeError) as e:
            self._fail("tensor table", f"malformed ({e})")
        if pos != len(table):
            self._fail("tensor table", f"{len(table) - pos} unparsed bytes after {h['entry_count']} entries")
        blobs = {n: e for n, e in entries.items() if e.tag == BYTES}
        for name, e in blobs.items():
            if self.version < 2:
                self._fail(f"blob {name}", f"format version {self.version} has no blobs")
            if e.shape != (e.nbytes,):
                self._fail(f"blob {name}", f"shape {list(e.shape)} is not [{e.nbytes}]")
        for name in entries:
            if name not in self.expected and name not in blobs:
                self._fail(f"tensor {name}", "not a tensor of a model with these dims")
        for name, (tag, shape) in self.expected.items():
            e = entries.get(name)
            if e is None:
                self._fail(f"tensor {name}", "missing")
            if e.tag != tag:
                self._fail(f"tensor {name}", f"storage {TAG_NAMES.get(e.tag, e.tag)} is not {TAG_NAMES[tag]}")
            if e.shape != shape:
                self._fail(f"tensor {name}", f"shape {list(e.shape)} does not match the dims ({list(shape)})")
            if e.nbytes != payload_bytes(tag, shape):
                self._fail(f"tensor {name}", f"{e.nbytes} bytes, expected {payload_bytes(tag, shape)}")
        for e in entries.values():
            what = f"{'blob' if e.tag == BYTES else 'tensor'} {e.name}"
            if e.offset % ALIGNMENT:
                self._fail(what, f"offset {e.offset} is not {ALIGNMENT}-byte aligned")
            if e.offset < h["data_offset"] or e.offset + e.nbytes > self.size:
                self._fail(what, f"payload [{e.offset}, +{e.nbytes}) is outside the data region")
        ordered = sorted(entries.values(), key=lambda e: e.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.nbytes > b.offset:
                self._fail(f"tensor {b.name}", f"payload overlaps {a.name}")
        return {n: entries[n] for n in self.expected}, blobs

    def _view(self, name: str, tag: int) -> np.ndarray:
        e = self.tensors.get(name)
        if e is None:
            raise NqFileError(f"{self.path}: tensor {name}: no such tensor")
        if e.tag != tag:
            raise NqFileError(f"{self.path}: tensor {name}: stored as {e.tag_name}, not {TAG_NAMES[tag]}")
        dtype, per = _PAYLOAD[tag]
        shape = e.shape[:-1] + (e.shape[-1] // per,)
        return np.frombuffer(self._mm, dtype=dtype, count=e.nbytes // dtype.itemsize, offset=e.offset).reshape(shape)

    def int4(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(packed uint32 [N, K/8], scales fp16 [N, K/group]) of INT4 weight ``name``."""
        return self._view(name, INT4), self._view(name + ".scales", FP16)

    def array(self, name: str) -> np.ndarray:
        """A raw (FP16/FP32) tensor."""
        e = self.tensors.get(name)
        return self._view(name, e.tag if e is not None and e.tag != INT4 else FP16)

    def blob(self, name: str) -> bytes | None:
        """The bytes of blob ``name`` (None when the file has none), checksum verified: blobs are small."""
        e = self.blobs.get(name)
        if e is None:
            return None
        data = bytes(self._mm[e.offset:e.offset + e.nbytes])
        self._check_crc(e, zlib.crc32(data))
        return data

    def _check_crc(self, e: TensorInfo, crc: int) -> None:
        if crc != e.crc:
            self._fail(f"{'blob' if e.tag == BYTES else 'tensor'} {e.name}",
                       f"payload checksum {crc:#010x} != stored {e.crc:#010x} (corrupted)")

    def checker(self, order: list[str] | None = None, workers: int | None = None,
                release_pages: bool = False) -> "PayloadChecker":
        """Starts checksumming the payloads ``order`` names (default: every entry, in file order) on a thread
        pool, in that order; ``check(name)`` waits for one."""
        return PayloadChecker(self, order, workers, release_pages)

    def verify(self, progress=None, workers: int | None = None) -> None:
        """Check every payload's CRC-32; ``progress(nbytes)`` is called as payloads are checked. The checked
        pages are dropped from this process's RSS (they stay in the page cache)."""
        with self.checker(workers=workers, release_pages=True) as c:
            for e in self.entries:
                c.check(e.name)
                if progress:
                    progress(e.nbytes)

    @property
    def entries(self) -> list[TensorInfo]:
        """Every table entry, tensors and blobs, in file order."""
        return sorted([*self.tensors.values(), *self.blobs.values()], key=lambda e: e.offset)

    def entry(self, name: str) -> TensorInfo:
        e = self.tensors.get(name) or self.blobs.get(name)
        if e is None:
            raise NqFileError(f"{self.path}: {name}: no such entry")
        return e

    def __enter__(self) -> "NanoqwenFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop the file's reference to the map; it is unmapped once no returned view is alive."""
        self._mm = None


class PayloadChecker:
    """CRC-32 of payloads of ``f``, computed ahead on a thread pool (checksum.ParallelCRC) so that a loader can
    ``check(name)`` each tensor right before it uses it at almost no cost: the pool runs ahead of the consumer
    when both go through the same ``order``. A mismatch is an NqFileError naming the file and the tensor."""

    def __init__(self, f: NanoqwenFile, order: list[str] | None = None, workers: int | None = None,
                 release_pages: bool = False):
        self.file = f
        self._crc = ParallelCRC(f._mm, workers, release=f._mm if release_pages else None)
        for e in f.entries if order is None else map(f.entry, order):
            self._crc.submit(e.name, e.offset, e.nbytes)

    def check(self, name: str) -> None:
        self.file._check_crc(self.file.entry(name), self._crc.result(name))

    def close(self) -> None:
        self._crc.close()

    def __enter__(self) -> "PayloadChecker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
