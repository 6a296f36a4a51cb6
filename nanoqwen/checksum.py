"""CRC-32 of byte ranges of one buffer (a .nanoqwen file's map), computed ahead of their use on a thread pool.

zlib.crc32 releases the GIL on buffers over 5 KB, so threads scale with cores; a range is cut into CHUNK-sized
pieces so that one 1 GB embedding does not serialize on one thread, and the pieces' CRCs are joined with
``crc32_combine`` (zlib's, which Python's zlib module does not expose). numpy-free and CUDA-free.
"""

from __future__ import annotations

import functools
import mmap
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK = 32 << 20  # bytes per task: small enough to spread a 1 GB tensor over 16 cores, large enough to amortize
# default pool size: the cores this process may run on, at most 16 (at ~2 GB/s a core, 16 checksum several
# times faster than any host-to-device copy; more would only contend for memory bandwidth)
DEFAULT_WORKERS = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

_POLY = 0xEDB88320  # CRC-32 polynomial, bit-reflected as zlib uses it


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order: bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^n) modulo the polynomial, n = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=64)
def _x8nmodp(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial: the operator that shifts a CRC past nbytes zero bytes."""
    p, k = 1 << 31, 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


class ParallelCRC:
    """``submit(key, offset, nbytes)`` queues the CRC-32 of ``buf[offset:offset + nbytes]``; ``result(key)`` waits
    for that range only. Submit in the order the results will be needed: the pool works first-in first-out.
    ``release``: a map whose checked pages are dropped from this process (they stay in the page cache), so that
    checking a 5 GB file does not look like a 5 GB process; leave it None when the pages are about to be read."""

    def __init__(self, buf, workers: int | None = None, release: mmap.mmap | None = None):
        self._mv = memoryview(buf)
        self._release = release
        self._pool = ThreadPoolExecutor(workers or DEFAULT_WORKERS, thread_name_prefix="crc32")
        self._parts: dict[str, list[tuple[Future, int]]] = {}

    def submit(self, key: str, offset: int, nbytes: int) -> None:
        starts = range(offset, offset + nbytes, CHUNK) if nbytes else [offset]
        self._parts[key] = [(self._pool.submit(self._crc, s, min(s + CHUNK, offset + nbytes)),
                             min(CHUNK, offset + nbytes - s)) for s in starts]

    def _crc(self, start: int, stop: int) -> int:
        crc = zlib.crc32(self._mv[start:stop])
        if self._release is not None and stop > start:
            lo = start - start % mmap.PAGESIZE
            self._release.madvise(mmap.MADV_DONTNEED, lo, stop - lo)
        return crc

    def result(self, key: str) -> int:
        parts = self._parts[key]
        crc = parts[0][0].result()
        for future, nbytes in parts[1:]:
            crc = crc32_combine(crc, future.result(), nbytes)
        return crc

    def close(self) -> None:
        """Drop what is still queued (after an error) and wait for the running chunks."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._mv.release()

    def __enter__(self) -> "ParallelCRC":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
