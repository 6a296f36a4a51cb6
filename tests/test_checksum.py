"""checksum.py: crc32_combine against zlib on concatenations, and ParallelCRC's chunked ranges against one
zlib.crc32 call (chunks made small so that every range is split across the pool)."""

import os
import zlib

from hypothesis import given, strategies as st

from nanoqwen import checksum
from nanoqwen.checksum import ParallelCRC, crc32_combine


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_crc_of_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_long_second_part():
    a, b = os.urandom(1000), os.urandom(3 << 20)  # len2 with many bits set in its binary form
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 5000)), min_size=1, max_size=12),
       st.integers(1, 4))
def test_parallel_ranges_equal_zlib(ranges, workers):
    buf = os.urandom(10_000)
    old, checksum.CHUNK = checksum.CHUNK, 700  # ranges of up to 5000 bytes cross several chunks
    try:
        with ParallelCRC(buf, workers) as p:
            for i, (start, n) in enumerate(ranges):
                p.submit(str(i), start, n)
            for i, (start, n) in enumerate(ranges):
                assert p.result(str(i)) == zlib.crc32(buf[start:start + n]), (start, n)
    finally:
        checksum.CHUNK = old
