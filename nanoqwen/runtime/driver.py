"""Thin CUDA driver-API layer over cuda.bindings.driver (cuda-bindings 12.x and 13.x).

Everything the runtime does on the GPU goes through here: one `check()` turns each result tuple into a
value or a CudaError carrying the driver's error name and the context (call, kernel URI, grid).
The primary context is used (never cuCtxCreate, whose signature differs between 12 and 13), so this
module and torch/cupy can share a process.

API (stable; other runtime modules build on it):
  init(ordinal=0) -> Device          device(): the initialised Device (inits on first use)
  Device.props -> DeviceProps(name, sm_count, l2_bytes, total_mem, free_mem, driver_version,
                              compute_capability, max_smem_optin)
  Stream()                          .handle, .synchronize(), .close(); a context manager
  DeviceBuffer(nbytes)              .ptr, .nbytes, .upload(arr, stream=None), .download(out|dtype+shape),
                                    .memset_u32(v, stream=None), .poison(stream=None), .free()
  DeviceBuffer.from_array(arr)      allocate + upload
  HostBuffer(nbytes)                pinned host memory, .array(dtype, shape) numpy view, .free()
  memcpy_dtod(dst, src, nbytes, stream=None)
  Module(cubin bytes)               .function(entry, signature=(), uri="") -> Function
  Function.launch(launch, stream=None, pdl=False, **args)   checked and packed by the spec's `signature`
                                    (Function.params: its ArgPacker)
  pack_args(signature, args, where)  that check and packing alone (no device needed)
  Event()                           .record(stream=None), .synchronize(), Event.elapsed_ms(a, b)
  capture(stream) -> Graph          `with capture(s) as g: ...` then g.launch(stream), g.close()
  load(built) -> Function           codegen Built -> Function, modules cached by cubin bytes
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .. import NanoqwenError

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - the package always depends on cuda-bindings
    cu = None


class CudaError(NanoqwenError):
    """A CUDA driver call failed; the message names the driver error and what was being done."""

    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = code


def _error_name(err) -> str:
    try:
        e, name = cu.cuGetErrorName(err)
        if e == cu.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming the error must never hide it
        pass
    return str(err)


def check(result, what: str = ""):
    """(CUresult, *values) -> None, value or tuple of values; raises CudaError otherwise."""
    if not isinstance(result, tuple):
        result = (result,)
    err, *vals = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{_error_name(err)} in {what or 'CUDA driver call'}", err)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


# ---- device and primary context ----------------------------------------------------------------

@dataclass(frozen=True)
class DeviceProps:
    name: str
    sm_count: int
    l2_bytes: int
    total_mem: int
    free_mem: int
    driver_version: int          # e.g. 13000 for CUDA 13.0
    compute_capability: tuple[int, int]
    max_smem_optin: int          # dynamic shared memory a block may opt into (bytes)


class Device:
    def __init__(self, ordinal: int):
        if cu is None:
            raise CudaError("cuda-bindings is not installed: no CUDA driver access")
        try:
            err, = cu.cuInit(0)
        except Exception as e:  # noqa: BLE001 - cuda-bindings 13 raises when libcuda.so is absent
            raise CudaError(f"no usable CUDA device: the NVIDIA driver library cannot be loaded ({e})") from None
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"no usable CUDA device: cuInit failed with {_error_name(err)}", err)
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if ordinal >= count:
            raise CudaError(f"CUDA device {ordinal} requested but {count} device(s) present")
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.make_current()

    def make_current(self) -> None:
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def attribute(self, attr) -> int:
        return check(cu.cuDeviceGetAttribute(attr, self.handle), f"cuDeviceGetAttribute({attr})")

    @property
    def props(self) -> DeviceProps:
        A = cu.CUdevice_attribute
        name = check(cu.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return DeviceProps(
            name=name,
            sm_count=self.attribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            l2_bytes=self.attribute(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            total_mem=int(total), free_mem=int(free),
            driver_version=int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion")),
            compute_capability=(self.attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                self.attribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            max_smem_optin=self.attribute(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )

    def synchronize(self) -> None:
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


@functools.cache
def init(ordinal: int = 0) -> Device:
    return Device(ordinal)


def device() -> Device:
    """The initialised device 0 (its primary context is made current on first use)."""
    return init(0)


def _stream_handle(stream) -> object:
    if stream is None:
        return cu.CUstream(0)
    return stream.handle if isinstance(stream, Stream) else stream


# ---- streams and events ------------------------------------------------------------------------

class Stream:
    def __init__(self, non_blocking: bool = True):
        device()
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else cu.CUstream_flags.CU_STREAM_DEFAULT
        self.handle = check(cu.cuStreamCreate(int(flags)), "cuStreamCreate")

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def close(self) -> None:
        if self.handle is not None:
            check(cu.cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Event:
    def __init__(self):
        device()
        self.handle = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DEFAULT)), "cuEventCreate")

    def record(self, stream=None) -> "Event":
        check(cu.cuEventRecord(self.handle, _stream_handle(stream)), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    @staticmethod
    def elapsed_ms(start: "Event", end: "Event") -> float:
        end.synchronize()
        return float(check(cu.cuEventElapsedTime(start.handle, end.handle), "cuEventElapsedTime"))

    def close(self) -> None:
        if self.handle is not None:
            check(cu.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


# ---- memory ------------------------------------------------------------------------------------

def _host_ptr(arr: np.ndarray) -> int:
    if not arr.flags["C_CONTIGUOUS"]:
        raise CudaError("host array must be C-contiguous for a copy")
    return arr.ctypes.data


class DeviceBuffer:
    """Plain device allocation (cuMemAlloc). `ptr` is the device address as an int."""

    def __init__(self, nbytes: int):
        device()
        if nbytes <= 0:
            raise CudaError(f"DeviceBuffer: size must be positive, got {nbytes}")
        self.nbytes = int(nbytes)
        self.ptr = int(check(cu.cuMemAlloc(self.nbytes), f"cuMemAlloc({self.nbytes} bytes)"))

    @classmethod
    def from_array(cls, arr: np.ndarray, stream=None) -> "DeviceBuffer":
        buf = cls(arr.nbytes)
        buf.upload(arr, stream)
        return buf

    def _size_check(self, nbytes: int, what: str) -> None:
        if nbytes > self.nbytes:
            raise CudaError(f"{what}: {nbytes} bytes do not fit a {self.nbytes}-byte device buffer")

    def upload(self, arr: np.ndarray, stream=None) -> None:
        """Host -> device. Synchronous unless a stream is given (then `arr` must outlive the copy)."""
        arr = np.ascontiguousarray(arr)
        self._size_check(arr.nbytes, "upload")
        if stream is None:
            check(cu.cuMemcpyHtoD(self.ptr, _host_ptr(arr), arr.nbytes), "cuMemcpyHtoD")
        else:
            check(cu.cuMemcpyHtoDAsync(self.ptr, _host_ptr(arr), arr.nbytes, _stream_handle(stream)),
                  "cuMemcpyHtoDAsync")

    def download(self, out: np.ndarray | None = None, dtype=None, shape=None, stream=None) -> np.ndarray:
        """Device -> host into `out` (or a new array of dtype/shape). Synchronous unless a stream is given."""
        if out is None:
            out = np.empty(shape if shape is not None else self.nbytes // np.dtype(dtype).itemsize, dtype=dtype)
        self._size_check(out.nbytes, "download")
        if stream is None:
            check(cu.cuMemcpyDtoH(_host_ptr(out), self.ptr, out.nbytes), "cuMemcpyDtoH")
        else:
            check(cu.cuMemcpyDtoHAsync(_host_ptr(out), self.ptr, out.nbytes, _stream_handle(stream)),
                  "cuMemcpyDtoHAsync")
        return out

    def memset_u32(self, value: int, stream=None) -> None:
        if self.nbytes % 4:
            raise CudaError("memset_u32 needs a buffer size that is a multiple of 4")
        check(cu.cuMemsetD32Async(self.ptr, value & 0xFFFFFFFF, self.nbytes // 4, _stream_handle(stream)),
              "cuMemsetD32Async")
        if stream is None:
            device().synchronize()

    def poison(self, stream=None) -> None:
        """Fill with 0x7FFF7FFF: a NaN as fp32 and a NaN pair as fp16, so unwritten outputs never pass."""
        if self.nbytes % 4:
            check(cu.cuMemsetD8Async(self.ptr, 0xFF, self.nbytes, _stream_handle(stream)), "cuMemsetD8Async")
            if stream is None:
                device().synchronize()
        else:
            self.memset_u32(0x7FFF7FFF, stream)

    def free(self) -> None:
        if self.ptr:
            check(cu.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0

    def __index__(self) -> int:   # its address wherever an integer is taken: int(), ArgPacker's struct
        return self.ptr


def memcpy_dtod(dst, src, nbytes: int, stream=None) -> None:
    check(cu.cuMemcpyDtoDAsync(int(dst), int(src), int(nbytes), _stream_handle(stream)), "cuMemcpyDtoDAsync")


class HostBuffer:
    """Pinned (page-locked) host memory: async copies and device-written tokens read back without a stage."""

    def __init__(self, nbytes: int):
        device()
        self.nbytes = int(nbytes)
        self.ptr = int(check(cu.cuMemAllocHost(self.nbytes), f"cuMemAllocHost({self.nbytes} bytes)"))

    def array(self, dtype, shape=None) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = self.nbytes // dtype.itemsize
        raw = (ctypes.c_byte * (count * dtype.itemsize)).from_address(self.ptr)
        arr = np.frombuffer(raw, dtype=dtype, count=count)
        return arr.reshape(shape) if shape is not None else arr

    def free(self) -> None:
        if self.ptr:
            check(cu.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


# ---- modules, functions, typed launches --------------------------------------------------------

# _SLOT: a kernel parameter's kind (codegen Param.kind, from the spec's one declaration) -> its 8-byte
# kernelParams slot as a struct format (the value in the low bytes); _RANGES: the ints each integer kind takes.
_SLOT = {"ptr": "Q", "u64": "Q", "i32": "i4x", "u32": "I4x", "f32": "f4x"}
_RANGES = {"i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1), "u64": (0, 2**64 - 1), "ptr": (0, 2**64 - 1)}


def _pack_value(kind: str, name: str, value, where: str):
    if kind == "ptr":
        if isinstance(value, DeviceBuffer):
            value = value.ptr
        elif hasattr(value, "getPtr") and not isinstance(value, int):   # a CUdeviceptr
            value = int(value)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise CudaError(f"{where}: argument '{name}' must be a device pointer (DeviceBuffer or int), "
                            f"got {type(value).__name__}")
    elif kind == "f32":
        if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
            raise CudaError(f"{where}: argument '{name}' must be a number, got {type(value).__name__}")
        return float(value)
    elif kind in _RANGES:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise CudaError(f"{where}: argument '{name}' must be an integer, got {type(value).__name__}")
    else:
        raise CudaError(f"{where}: unknown parameter kind '{kind}' for '{name}'")
    lo, hi = _RANGES[kind]
    if not lo <= int(value) <= hi:
        raise CudaError(f"{where}: argument '{name}'={value} out of range for {kind}")
    return int(value)


def check_signature(signature, where: str) -> tuple[tuple[str, str], ...]:
    """``signature`` as a tuple of (name, kind) pairs; an unknown kind is a CudaError naming the parameter."""
    signature = tuple(tuple(p) for p in signature)
    for name, kind in signature:
        if kind not in _SLOT:
            raise CudaError(f"{where}: parameter '{name}' has unknown kind '{kind}'")
    return signature


class ArgPacker:
    """Launch arguments by name -> cuLaunchKernelEx's kernelParams, checked against the kernel's (name, kind)
    signature: a missing, unexpected or mistyped argument is a CudaError naming the kernel and the argument,
    raised before anything reaches the driver. One 8-byte slot per parameter (its value in the low bytes,
    little-endian); the driver copies the values out when the launch (or its capture) is made.

    A launch costs host time that a short prefill chunk does not hide (~250 launches), so the common case
    is one struct.pack_into; only what struct refuses (or a bool, a DeviceBuffer, a CUdeviceptr) takes the
    converting, checking path."""

    def __init__(self, signature, where: str):
        self.signature, self.where = check_signature(signature, where), where
        self.names = tuple(n for n, _ in self.signature)
        self.struct = struct.Struct("<" + "".join(_SLOT[k] for _, k in self.signature))
        self.offsets = np.arange(len(self.names), dtype=np.uint64) * np.uint64(8)

    def pack(self, args: dict) -> tuple[np.ndarray, int]:
        """-> (memory, kernelParams): ``memory`` holds the slots, then the address of each slot (the void**
        array that kernelParams points at; NULL for a kernel without parameters). It must stay alive until
        the launch call returns."""
        n = len(self.names)
        memory = np.empty(2 * n + 1, dtype=np.uint64)
        base = memory.ctypes.data
        try:
            if len(args) != n:
                raise KeyError
            values = [args[name] for name in self.names]
            if bool in map(type, values):
                raise TypeError
            self.struct.pack_into(memory, 0, *values)
        except (KeyError, TypeError, OverflowError, struct.error):
            self.struct.pack_into(memory, 0, *self._checked(args))
        np.add(self.offsets, np.uint64(base), out=memory[n:2 * n])
        return memory, base + 8 * n if n else 0

    def _checked(self, args: dict) -> list:
        missing = [n for n in self.names if n not in args]
        extra = [n for n in args if n not in self.names]
        if missing or extra:
            raise CudaError(f"{self.where}: launch arguments do not match the kernel parameters "
                            f"{list(self.names)}: missing {missing}, unexpected {extra}")
        return [_pack_value(kind, name, args[name], self.where) for name, kind in self.signature]


def pack_args(signature, args: dict, where: str):
    """ArgPacker(signature, where).pack(args): the check and packing alone (no device needed)."""
    return ArgPacker(signature, where).pack(args)


@functools.lru_cache(maxsize=4096)   # a handful of distinct grids, each launched many times
def _dims3(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


class Function:
    def __init__(self, handle, entry: str, signature=(), uri: str = "", module=None):
        self.handle = handle
        self.entry = entry
        self.uri = uri or entry
        self.params = ArgPacker(signature, self.uri)
        self._module = module      # keeps the module alive as long as the function
        self._smem_limit = None    # dynamic shared memory a launch may take without raising the attribute
        self.carveout = -1         # the shared-memory split it prefers, in percent (-1: the driver's choice)

    def attribute(self, attr) -> int:
        return check(cu.cuFuncGetAttribute(attr, self.handle), f"cuFuncGetAttribute({attr}) on {self.uri}")

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        A = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(self.handle, A, int(nbytes)),
              f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) on {self.uri}")
        self._smem_limit = int(nbytes)

    def set_carveout(self, percent: int) -> None:
        A = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        check(cu.cuFuncSetAttribute(self.handle, A, int(percent)),
              f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT={percent}) on {self.uri}")
        self.carveout = int(percent)

    def launch(self, launch, stream=None, pdl: bool = False, **args) -> None:
        grid, block, smem = _dims3(launch.grid), _dims3(launch.block), int(launch.smem)
        memory, params = self.params.pack(args)
        if smem:
            if self._smem_limit is None:   # without the opt-in, static + dynamic must fit 48 KB
                self._smem_limit = 48 * 1024 - self.attribute(
                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            if smem > self._smem_limit:
                self.set_max_dynamic_smem(smem)
        config = _launch_config(grid, block, smem, int(_stream_handle(stream)), pdl)
        # no `extra`; `memory` stays alive until the call returns, as a local
        result = cu.cuLaunchKernelEx(config, self.handle, params, 0)
        if result[0] != cu.CUresult.CUDA_SUCCESS:   # the message is built only for a failure
            check(result, f"cuLaunchKernelEx({self.uri}, grid={grid}, block={block}, smem={smem}, pdl={pdl})")


@functools.lru_cache(maxsize=4096)   # a handful of shapes per stream, each launched many times
def _launch_config(grid, block, smem: int, stream: int, pdl: bool):
    """cuLaunchKernelEx's configuration, built once per (grid, block, smem, stream handle, pdl): the driver
    only reads it during a call. With ``pdl``, Programmatic Dependent Launch: the kernel may start while
    the previous one in the stream finishes; it must griddepcontrol.wait before reading what that kernel
    wrote."""
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = cu.CUstream(stream)
    if pdl:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attr], 1
    else:
        config.numAttrs = 0
    return config


class Module:
    def __init__(self, image: bytes, uri: str = ""):
        device()
        self.uri = uri
        self._image = np.frombuffer(bytes(image), dtype=np.uint8)   # owned, stable address
        self.handle = check(cu.cuModuleLoadData(self._image.ctypes.data), f"cuModuleLoadData({uri or 'cubin'})")

    def function(self, entry: str, signature=(), uri: str = "") -> Function:
        h = check(cu.cuModuleGetFunction(self.handle, entry.encode()),
                  f"cuModuleGetFunction({entry}) in {uri or self.uri}")
        return Function(h, entry, signature, uri or self.uri, module=self)


_MODULES: dict[str, Module] = {}


def load(built, signature=None, carveout: int = -1) -> Function:
    """codegen Built -> Function. The signature comes from the built spec (`spec.signature`) unless
    given; modules are cached by the cubin's hash so repeated loads are free. ``carveout``: the percentage
    of the SM's L1 the kernel prefers as shared memory (the session's: config launch.smem_carveout for the one-row
    step's kernels), or -1: the driver's choice. It is the function's attribute: it holds for every load of the
    same cubin."""
    spec = getattr(built, "spec", None)
    if signature is None:
        signature = getattr(built, "signature", None) or getattr(spec, "signature", ())
    uri = getattr(spec, "uri", None) or getattr(built, "uri", None) or built.entry
    key = hashlib.sha256(bytes(built.cubin)).hexdigest()
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = Module(built.cubin, uri)
    fn = mod.function(built.entry, signature, uri)
    if carveout >= 0:
        fn.set_carveout(carveout)
    return fn


# ---- graphs ------------------------------------------------------------------------------------

class Graph:
    def __init__(self):
        self.graph = None
        self.exec = None

    def launch(self, stream=None) -> None:
        check(cu.cuGraphLaunch(self.exec, _stream_handle(stream)), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec is not None:
            check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.exec = None
        if self.graph is not None:
            check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.graph = None


def _instantiate(graph):
    # cuda-bindings 12 and 13 both expose cuGraphInstantiate(hGraph, flags) (the WithFlags form);
    # older 11.x-style (graph, errorNode, log, size) is tried for robustness.
    try:
        return check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    except TypeError:
        return check(cu.cuGraphInstantiateWithFlags(graph, 0), "cuGraphInstantiateWithFlags")


@contextmanager
def capture(stream: Stream):
    """Capture everything launched on `stream` inside the block into an instantiated Graph."""
    g = Graph()
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(cu.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
    try:
        yield g
    except BaseException:
        err, graph = cu.cuStreamEndCapture(stream.handle)
        if err == cu.CUresult.CUDA_SUCCESS and graph is not None:
            cu.cuGraphDestroy(graph)
        raise
    g.graph = check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
    g.exec = _instantiate(g.graph)
