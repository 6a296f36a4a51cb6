"""File surgery for the format tests: flip bytes of one payload, rewrite header fields (the CRC kept valid, as an
attacker would), and hostile paths: a FIFO, a symlink loop."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
import zlib

from nanoqwen.nqfile import _CRC_AT, _HEADER, _HEADER_FIELDS, NanoqwenFile


def flip_payload_bytes(path, tensor: str, count: int = 4, start: int = 64, stride: int = 7) -> None:
    """Invert ``count`` bytes of ``tensor``'s payload, ``stride`` apart from byte ``start`` of the payload."""
    e = NanoqwenFile(path).tensors[tensor]
    assert start + stride * (count - 1) < e.nbytes
    with open(path, "r+b") as fh:
        for i in range(count):
            fh.seek(e.offset + start + stride * i)
            b = fh.read(1)[0]
            fh.seek(-1, 1)
            fh.write(bytes([b ^ 0xFF]))


def header(path) -> dict:
    with open(path, "rb") as fh:
        return dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(fh.read(_HEADER.size))))


def rewrite_header(path, fix_crc: bool = True, **changes) -> None:
    """Set header fields (by name) and, unless told not to, the header checksum to match."""
    h = {**header(path), **changes}
    raw = _HEADER.pack(*(h[k] for k in _HEADER_FIELDS)).ljust(_CRC_AT, b"\0")
    with open(path, "r+b") as fh:
        fh.write(raw + (struct.pack("<I", zlib.crc32(raw)) if fix_crc else b""))


def set_version(path, version: int) -> None:
    rewrite_header(path, version=version)


def fifo(path):
    """A FIFO at ``path``. A daemon thread opens its write end (without blocking) after 20 s, so that a reader
    wrongly blocked in open() wakes up and its test fails instead of hanging the run."""
    os.mkfifo(path)

    def unblock():
        time.sleep(20)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # nobody reading (the right outcome), or the test's directory is gone
            pass
    threading.Thread(target=unblock, daemon=True).start()
    return path


def symlink_loop(path):
    """``path`` -> ``path``.b -> ``path``: resolving it fails with ELOOP."""
    other = path.with_name(path.name + ".b")
    os.symlink(other, path)
    os.symlink(path, other)
    return path


def denied(path, monkeypatch):
    """Make ``path`` unreadable: chmod where that binds; as root (which reads anything), os.open fails the way
    the kernel would for anyone else."""
    os.chmod(path, 0)
    if os.geteuid() == 0:
        real = os.open

        def fake(p, *args, **kwargs):
            if os.fspath(p) == os.fspath(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(p))
            return real(p, *args, **kwargs)
        monkeypatch.setattr(os, "open", fake)
    return path
