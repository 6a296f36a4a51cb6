"""On-disk cubin cache. Key = sha256(source, headers, options, NVRTC version, arch): a new template, a
new helper, a new flag or a new compiler all mean a new cubin. An entry is ``<uri>-<key16>.cubin``
plus a ``.json`` metadata block written after it; the JSON carries the cubin's sha256, so a torn or
corrupt entry is a miss (rebuilt), never a crash. Writes go to a temporary file then ``os.replace``:
concurrent processes may both compile, and whichever lands last leaves a complete entry."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .. import NanoqwenError


class JitDisabled(NanoqwenError):
    """NANOQWEN_DISABLE_JIT=1 and a kernel is not in the cache."""


def jit_disabled() -> bool:
    return os.environ.get("NANOQWEN_DISABLE_JIT", "") not in ("", "0")


def key(source: str, headers: dict[str, str], options, nvrtc_version: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, *(f"{n}\0{t}" for n, t in sorted(headers.items())), "\0".join(options),
                 nvrtc_version, arch):
        h.update(part.encode())
        h.update(b"\xff")  # separator no UTF-8 text contains
    return h.hexdigest()


@dataclass
class Stats:
    """Hits and misses of this process, for "compiled 12/40 kernels (7 cached)" style reports."""
    hits: int = 0
    misses: int = 0
    compile_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, hit: bool, seconds: float = 0.0) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1
                self.compile_s += seconds


STATS = Stats()


@dataclass(frozen=True)
class Entry:
    cubin_path: Path
    meta_path: Path

    @classmethod
    def at(cls, directory: Path, uri: str, key_: str) -> "Entry":
        stem = f"{uri}-{key_[:16]}"
        return cls(directory / f"{stem}.cubin", directory / f"{stem}.json")

    def load(self) -> tuple[bytes, dict] | None:
        """(cubin, metadata), or None when absent, torn or corrupt."""
        try:
            meta = json.loads(self.meta_path.read_text())
            cubin = self.cubin_path.read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
            return None
        return cubin, meta

    def store(self, cubin: bytes, meta: dict) -> None:
        meta = dict(meta, cubin_sha256=hashlib.sha256(cubin).hexdigest())
        self.cubin_path.parent.mkdir(parents=True, exist_ok=True)
        # cubin first, metadata last: the JSON (with the cubin's hash) is what makes an entry valid.
        _atomic_write(self.cubin_path, cubin)
        _atomic_write(self.meta_path, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
