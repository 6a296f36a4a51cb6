"""Payload verification in the CUDA upload (runtime/weights.py), on the CPU: the driver is replaced by a fake
whose device memory is a host array, so the real upload loop runs. A good file arrives byte for byte; a file
with 4 flipped payload bytes fails with one line naming the file and the tensor, before that tensor's bytes
are copied, and the allocation is given back; verify=False uploads it as it is."""

from __future__ import annotations

import ctypes
import re
from types import SimpleNamespace

import numpy as np
import pytest
from _corrupt import flip_payload_bytes

from nanoqwen.nqfile import NanoqwenFile, NqFileError
from nanoqwen.pack import pack_random
from nanoqwen.runtime import weights as W
from nanoqwen.testmodels import tiny_dims

POISON = 0xA5
TARGET = "model.layers.1.mlp.gate_proj.weight"


class FakeDriver:
    """Just what Weights uses: device().props, DeviceBuffer(n) with ptr/free, cu.cuMemcpyHtoD, check."""

    def __init__(self):
        self.buffers = []
        drv = self

        class DeviceBuffer:
            def __init__(self, nbytes):
                self.host = np.full(nbytes, POISON, np.uint8)
                self.ptr = self.host.ctypes.data
                self.freed = False
                drv.buffers.append(self)

            def free(self):
                self.freed = True

        def memcpy(dst, src, nbytes):
            ctypes.memmove(dst, src, nbytes)
            return (0,)

        self.DeviceBuffer = DeviceBuffer
        self.cu = SimpleNamespace(cuMemcpyHtoD=memcpy)
        self.check = lambda result, what="": None
        props = SimpleNamespace(free_mem=1 << 40, total_mem=1 << 40)
        self.device = lambda: SimpleNamespace(props=props)


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(W, "driver", drv)
    return drv


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.nanoqwen"
    pack_random(tiny_dims(vocab=512), path, seed=1, workers=1)
    return path


def _expected(f: NanoqwenFile, region: W.Region) -> bytes:
    return b"".join(np.ascontiguousarray(W._source(f, t, w)).tobytes() for t, w in region.parts)


def test_good_file_uploads_byte_for_byte(fake, model):
    f = NanoqwenFile(model)
    w = W.Weights(f)
    host = fake.buffers[0].host
    for r in w.plan.regions.values():
        assert host[r.offset:r.offset + r.nbytes].tobytes() == _expected(f, r), r.name
    assert not fake.buffers[0].freed


def test_corrupt_tensor_never_reaches_the_device(fake, model):
    flip_payload_bytes(model, TARGET)
    f = NanoqwenFile(model)
    with pytest.raises(NqFileError) as ei:
        W.Weights(f)
    msg = str(ei.value)
    assert "\n" not in msg and re.match(rf"{re.escape(str(model))}: tensor {re.escape(TARGET)}: payload checksum", msg)
    buf = fake.buffers[0]
    region = W.plan(f).regions["L1.gate.packed"]
    assert (buf.host[region.offset:region.offset + region.nbytes] == POISON).all(), "corrupt bytes were copied"
    assert buf.freed


def test_no_verify_uploads_as_is(fake, model):
    flip_payload_bytes(model, TARGET)
    f = NanoqwenFile(model)
    w = W.Weights(f, verify=False)
    region = w.plan.regions["L1.gate.packed"]
    assert fake.buffers[0].host[region.offset:region.offset + region.nbytes].tobytes() == _expected(f, region)
