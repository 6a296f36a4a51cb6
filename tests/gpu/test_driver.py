"""The driver wrapper on a real device: memory round trips, poison, typed launches (argument checking,
PDL), events, graph capture and replay, errors carrying the driver's name."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import codegen
from nanoqwen.codegen.kernels.copy import CopySpec
from nanoqwen.runtime import driver

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def copy_fn():
    spec = CopySpec(threads=256, unroll=4, blocks=264)
    assert spec.signature == (("src", "ptr"), ("dst", "ptr"), ("n16", "u64"))   # declared on CopySpec
    return spec, driver.load(codegen.build(spec))


def test_props():
    p = driver.device().props
    assert p.sm_count > 0 and p.l2_bytes > 0 and 0 < p.free_mem <= p.total_mem
    assert p.compute_capability >= (7, 0) and p.driver_version >= 12000 and p.name


def test_round_trip_and_poison():
    rng = np.random.default_rng()
    a = rng.standard_normal(1 << 16).astype(np.float32)
    buf = driver.DeviceBuffer.from_array(a)
    assert np.array_equal(buf.download(dtype=np.float32, shape=a.shape), a)
    buf.poison()
    assert np.isnan(buf.download(dtype=np.float32, shape=a.shape)).all()
    assert np.isnan(buf.download(dtype=np.float16, shape=(2 * a.size,)).astype(np.float32)).all()
    buf.free()


def test_pinned_host_buffer_async_copy():
    host = driver.HostBuffer(4096)
    arr = host.array(np.uint32)
    arr[:] = np.arange(arr.size, dtype=np.uint32) * 7 + 1
    dev = driver.DeviceBuffer(4096)
    s = driver.Stream()
    dev.upload(arr, s)
    back = np.empty_like(arr)
    dev.download(back, stream=s)
    s.synchronize()
    assert np.array_equal(back, arr)
    dev.free()
    host.free()
    s.close()


@pytest.mark.parametrize("pdl", [False, True])
def test_typed_launch_copies(copy_fn, pdl):
    spec, fn = copy_fn
    rng = np.random.default_rng()
    a = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint32)
    src, dst = driver.DeviceBuffer.from_array(a), driver.DeviceBuffer(a.nbytes)
    dst.poison()
    s = driver.Stream()
    fn.launch(spec.launch(), s, pdl, src=src, dst=dst.ptr, n16=a.nbytes // 16)
    s.synchronize()
    assert np.array_equal(dst.download(dtype=np.uint32, shape=a.shape), a)
    for b in (src, dst):
        b.free()
    s.close()


def test_launch_argument_errors(copy_fn):
    spec, fn = copy_fn
    with pytest.raises(driver.CudaError, match="missing \\['n16'\\]"):
        fn.launch(spec.launch(), src=0, dst=0)
    with pytest.raises(driver.CudaError, match="unexpected \\['extra'\\]"):
        fn.launch(spec.launch(), src=0, dst=0, n16=0, extra=1)
    with pytest.raises(driver.CudaError, match="must be an integer"):
        fn.launch(spec.launch(), src=0, dst=0, n16=1.5)
    with pytest.raises(driver.CudaError, match="out of range"):
        fn.launch(spec.launch(), src=0, dst=0, n16=-1)


def test_driver_error_names_the_call():
    with pytest.raises(driver.CudaError, match="CUDA_ERROR_\\w+ in cuMemAlloc"):
        driver.DeviceBuffer(1 << 60)


def test_graph_capture_replay_and_events(copy_fn):
    spec, fn = copy_fn
    rng = np.random.default_rng()
    a = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint32)
    bufs = [driver.DeviceBuffer.from_array(a)] + [driver.DeviceBuffer(a.nbytes) for _ in range(3)]
    for b in bufs[1:]:
        b.poison()
    s = driver.Stream()
    with driver.capture(s) as g:   # a chain of PDL launches, as decode runs them
        for i in range(3):
            fn.launch(spec.launch(), s, True, src=bufs[i], dst=bufs[i + 1], n16=a.nbytes // 16)
    start, end = driver.Event(), driver.Event()
    start.record(s)
    g.launch(s)
    end.record(s)
    assert driver.Event.elapsed_ms(start, end) > 0
    assert np.array_equal(bufs[3].download(dtype=np.uint32, shape=a.shape), a)
    g.close()
    for b in bufs:
        b.free()
    s.close()
