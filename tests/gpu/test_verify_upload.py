"""Payload verification in the real CUDA upload: a small-py file with 4 flipped payload bytes is refused while
loading, in one error naming the file and the tensor, and gives its device memory back; the intact file
loads with verification and generates exactly what it generates without."""

from __future__ import annotations

import pytest

from nanoqwen.nqfile import NanoqwenFile, NqFileError
from nanoqwen.runtime import driver
from nanoqwen.runtime.sampler import Sampling
from nanoqwen.runtime.session import CudaSession

pytestmark = pytest.mark.gpu

TENSOR = "model.layers.2.self_attn.o_proj.weight"


def test_flipped_bytes_refused_and_memory_returned(packed, tmp_path):
    good = packed("small-py")
    bad = tmp_path / "flipped.nanoqwen"
    e = NanoqwenFile(good).tensors[TENSOR]
    data = bytearray(good.read_bytes())
    for i in range(4):
        data[e.offset + 64 + 5 * i] ^= 0xFF
    bad.write_bytes(bytes(data))
    free_before = driver.device().props.free_mem
    with pytest.raises(NqFileError) as ei:
        CudaSession(bad, 64, log=lambda m: None)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: tensor {TENSOR}: payload checksum"), msg
    # the weights allocation is freed (other allocators may move free memory by a few MB)
    assert driver.device().props.free_mem >= free_before - (16 << 20)


def test_verified_and_unverified_loads_agree(packed):
    tokens = {}
    for verify in (True, False):
        s = CudaSession(packed("small-py"), 64, log=lambda m: None, verify=verify)
        try:
            tokens[verify] = list(s.generate(list(range(1, 9)), 16, Sampling()))
        finally:
            s.close()
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16
