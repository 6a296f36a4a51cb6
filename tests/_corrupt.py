"""File surgery for the format tests: flip bytes of one payload, relabel a file's format version."""

from __future__ import annotations

import struct
import zlib

from nanoqwen.nqfile import _CRC_AT, NanoqwenFile


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


def set_version(path, version: int) -> None:
    """Rewrite the header's format version and its checksum (the version follows the 8-byte magic)."""
    with open(path, "r+b") as fh:
        header = bytearray(fh.read(_CRC_AT))
        struct.pack_into("<I", header, 8, version)
        fh.seek(0)
        fh.write(header + struct.pack("<I", zlib.crc32(header)))
