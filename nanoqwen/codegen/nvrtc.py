"""source -> cubin through NVRTC (cuda.bindings.nvrtc; works with cuda-bindings 12 and 13). No GPU is
needed: CI compiles every kernel for sm_90a on the CPU."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .. import NanoqwenError
from .render import templates_dir


class CompileError(NanoqwenError):
    """NVRTC rejected a source. The message carries the options, the NVRTC log and the offending lines."""


class NvrtcUnavailable(NanoqwenError):
    pass


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    ptx: str | None
    log: str


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # cuda-python 12.x before the cuda.bindings namespace
        except ImportError:
            raise NvrtcUnavailable("NVRTC is not available: install cuda-bindings (or cuda-python) and "
                                   "nvidia-cuda-nvrtc") from None
    return nvrtc


def _check(nvrtc, result, what: str):
    """NVRTC calls return (status, *values): the values, or an exception naming the failed call."""
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(status)
        raise CompileError(f"{what}: {msg.decode() if isinstance(msg, bytes) else msg}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def version() -> str:
    """NVRTC version as 'major.minor': part of every cache key (a new compiler means new cubins)."""
    nvrtc = _nvrtc()
    major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def full_options(arch: str, options) -> list[str]:
    """The exact NVRTC command line: architecture, config options, and ptxas -v so that spill counts
    land in the log (the most reliable per-function spill source). No include path: the project's
    headers are handed to NVRTC in memory (``headers(source)``), so the options do not depend on where the
    checkout lives and the cache key covers the header text."""
    return [f"-arch={arch}", *options, "--ptxas-options=-v"]


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def headers(source: str) -> dict[str, str]:
    """The templates/*.cuh that ``source`` includes, directly or through another header, by include name: the
    only headers a kernel may include (no CUDA headers). Only these reach NVRTC and the cache key, so an edit to
    a header a kernel does not include keeps its cubin cached here and in a cache compiled elsewhere (.kcache)."""
    known = {p.name: p for p in templates_dir().glob("*.cuh")}
    found: dict[str, str] = {}
    todo = _INCLUDE.findall(source)
    while todo:
        name = todo.pop()
        if name in known and name not in found:   # an unknown name is left to NVRTC's error
            found[name] = known[name].read_text()
            todo += _INCLUDE.findall(found[name])
    return dict(sorted(found.items()))


def _fetch(nvrtc, prog, size_fn, get_fn, what: str) -> bytes:
    """NVRTC writes its output (log, PTX, cubin) into the bytes object it is handed. That object must be
    a fresh one of our own: `b" " * n` is CPython's cached one-byte b" " when n == 1 (an empty log, as
    NVRTC 13 gives), and the NUL written into it turned every later " ".encode() into b"\x00" (a CLI
    run printed NUL for spaces). bytes(n + 1) is never a cached object (those have length 0 or 1)."""
    n = _check(nvrtc, size_fn(prog), what + "Size")
    buf = bytes(n + 1)
    _check(nvrtc, get_fn(prog, buf), what)
    return buf[:n]


def compile(source: str, name: str, arch: str, options, ptx: bool = False, spec_repr: str | None = None,
            hdrs: dict[str, str] | None = None) -> Compiled:
    """Compile ``source`` (file ``name`` in messages) for ``arch`` with ``full_options(arch, options)``;
    ``hdrs`` defaults to ``headers(source)`` (pass the dict the cache key was computed from)."""
    nvrtc = _nvrtc()
    opts = full_options(arch, options)
    hdrs = headers(source) if hdrs is None else hdrs
    prog = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(hdrs),
                                                  [h.encode() for h in hdrs.values()],
                                                  [n.encode() for n in hdrs]), "nvrtcCreateProgram")
    try:
        status, = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = _fetch(nvrtc, prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, "nvrtcGetProgramLog")
        log = log.rstrip(b"\0 ").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(error_message(source, name, opts, log, spec_repr))
        cubin = _fetch(nvrtc, prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, "nvrtcGetCUBIN")
        text = None
        if ptx:
            text = _fetch(nvrtc, prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, "nvrtcGetPTX")
            text = text.rstrip(b"\0").decode()
        return Compiled(cubin=cubin, ptx=text, log=log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_ERROR_LINE = re.compile(r"\((\d+)\): (?:catastrophic )?error")


def error_message(source: str, name: str, opts, log: str, spec_repr: str | None, context: int = 3) -> str:
    """CuPy-style: what was compiled, how, what NVRTC said, and the rendered lines around each error."""
    lines = source.splitlines()
    shown = sorted({int(m.group(1)) for m in _ERROR_LINE.finditer(log)})
    parts = [f"NVRTC failed to compile {name}"]
    if spec_repr:
        parts.append(f"spec: {spec_repr}")
    parts += [f"options: {' '.join(opts)}", "log:", log.strip()]
    for ln in shown:
        parts.append(f"--- {name} around line {ln}:")
        for i in range(max(1, ln - context), min(len(lines), ln + context) + 1):
            parts.append(f"{'>' if i == ln else ' '}{i:5d} | {lines[i - 1]}")
    dump = os.environ.get("NANOQWEN_DUMP_SOURCE")
    if dump:
        path = Path(dump) / (Path(name).stem + ".cu")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        parts.append(f"source dumped to {path}")
    else:
        parts.append("(set NANOQWEN_DUMP_SOURCE=DIR to dump the .cu)")
    return "\n".join(parts)
