"""Payload verification in the real CUDA upload: a file with 4 flipped payload bytes is refused while loading,
in one error naming the file and the tensor, and gives its device memory back; an intact file loads with
verification and generates exactly what it generates without."""

from __future__ import annotations

import shutil

import pytest
from _corrupt import flip_payload_bytes

from nanoqwen.nqfile import NanoqwenFile, NqFileError
from nanoqwen.runtime import driver
from nanoqwen.runtime.sampler import Sampling
from nanoqwen.runtime.session import CudaSession
from nanoqwen.runtime.weights import plan

pytestmark = pytest.mark.gpu

TENSOR = "model.layers.1.mlp.down_proj.weight"


def _quiet(msg: str) -> None:
    pass


def test_flipped_bytes_refused_and_memory_returned(packed, tmp_path):
    """On the 7B-shaped model (2.4 GB of weights), so a leaked allocation cannot hide in allocator noise."""
    good = packed("7b-shapes")
    bad = tmp_path / "flipped.nanoqwen"
    shutil.copyfile(good, bad)
    flip_payload_bytes(bad, TENSOR)
    CudaSession(good, 64, log=_quiet).close()  # context, local memory and kernel modules exist from here on
    free_before = driver.device().props.free_mem
    with pytest.raises(NqFileError) as ei:
        CudaSession(bad, 64, log=_quiet)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: tensor {TENSOR}: payload checksum"), msg
    leaked = free_before - driver.device().props.free_mem
    assert leaked < plan(NanoqwenFile(bad)).nbytes // 20, f"{leaked} bytes of device memory not given back"


def test_verified_and_unverified_loads_agree(packed):
    tokens = {}
    for verify in (True, False):
        s = CudaSession(packed("small-py"), 64, log=_quiet, verify=verify)
        try:
            tokens[verify] = list(s.generate(list(range(1, 9)), 16, Sampling()))
        finally:
            s.close()
    assert tokens[True] == tokens[False] and len(tokens[True]) == 16   # class (a): the same bytes uploaded
