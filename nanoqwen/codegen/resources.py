"""Resource report of a cubin, read from its ELF without a GPU: registers, shared memory, local memory
(stack frame), constant bank size, barriers; spills come from ptxas' -v lines in the NVRTC log (the
cubin does not record them). ``cuobjdump`` / ``nvdisasm`` (pip wheels nvidia-cuda-cuobjdump /
nvidia-cuda-nvdisasm, optional) cross-check the ELF reading and print SASS."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import NanoqwenError


class ResourceError(NanoqwenError):
    pass


@dataclass(frozen=True)
class Resources:
    registers: int
    # bytes of .nv.shared.<fn>, as cuobjdump counts it: the static __shared__ arrays plus, on sm_90, the
    # 1 KB per block the system reserves whenever the kernel has any (ptxas -v reports the arrays alone)
    shared_static: int
    local_bytes: int        # per-thread stack frame (EIATTR_FRAME_SIZE): local arrays and spills live here
    max_stack: int          # per-thread stack incl. callees (EIATTR_MAX_STACK_SIZE, else frame size)
    constant0: int          # bytes of constant bank 0 (kernel parameters + driver state)
    barriers: int           # named barriers used
    spill_stores: int = -1  # bytes, from ptxas -v; -1 when the log did not say
    spill_loads: int = -1

    @property
    def spills(self) -> bool:
        """Registers spilled or local memory used (also when the ptxas log did not say: -1)."""
        return bool(self.spill_stores or self.local_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


# EIATTR codes (nvdisasm / cuobjdump names), the ones the report reads.
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_MIN_STACK_SIZE = 0x12
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2F
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


def _sections(elf: bytes):
    """[(name, sh_type, sh_flags, offset, size, sh_info)] of a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ResourceError("not a 64-bit little-endian ELF cubin")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stroff = raw[shstrndx][4]

    def name(off):
        return elf[stroff + off: elf.index(b"\0", stroff + off)].decode()
    return [(name(s[0]), s[1], s[2], s[4], s[5], s[7]) for s in raw]


def _symbols(elf: bytes, sections) -> list[str]:
    sym = next(s for s in sections if s[0] == ".symtab")
    strtab = next(s for s in sections if s[0] == ".strtab")
    names = []
    for off in range(sym[3], sym[3] + sym[4], 24):
        st_name, = struct.unpack_from("<I", elf, off)
        start = strtab[3] + st_name
        names.append(elf[start: elf.index(b"\0", start)].decode())
    return names


def _attributes(data: bytes):
    """Yield (attr, payload bytes | int | None) from an .nv.info section."""
    i = 0
    while i + 2 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == _EIFMT_SVAL:
            size, = struct.unpack_from("<H", data, i + 2)
            yield attr, data[i + 4: i + 4 + size]
            i += 4 + size
        elif fmt == _EIFMT_HVAL:
            yield attr, struct.unpack_from("<H", data, i + 2)[0]
            i += 4
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL):
            yield attr, data[i + 2] if fmt == _EIFMT_BVAL else None
            i += 4
        else:
            raise ResourceError(f"unknown .nv.info attribute format {fmt} at byte {i}")


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)\s*\n.*?(\d+) bytes spill stores, (\d+) bytes spill loads")


def spills_from_log(log: str) -> dict[str, tuple[int, int]]:
    """{function: (spill store bytes, spill load bytes)} from ptxas -v output in an NVRTC log."""
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _PTXAS_FUNC.finditer(log)}


def report(cubin: bytes, log: str = "") -> dict[str, Resources]:
    """{kernel entry: Resources} for every kernel (.text.<fn>) in ``cubin``."""
    sections = _sections(cubin)
    symbols = _symbols(cubin, sections)
    per_sym: dict[str, dict[int, int]] = {}
    for name, _t, _f, off, size, _info in sections:
        if name == ".nv.info":  # module-wide: (symbol index u32, value u32) per attribute
            for attr, payload in _attributes(cubin[off: off + size]):
                if isinstance(payload, bytes) and len(payload) == 8:
                    idx, value = struct.unpack("<II", payload)
                    per_sym.setdefault(symbols[idx], {})[attr] = value
    size_of = {name: size for name, _t, _f, _o, size, _i in sections}
    spills = spills_from_log(log)
    out = {}
    for name, _t, flags, _o, _s, _i in sections:
        if not name.startswith(".text."):
            continue
        fn = name[len(".text."):]
        attrs = per_sym.get(fn, {})
        frame = attrs.get(_EIATTR_FRAME_SIZE, 0)
        st, ld = spills.get(fn, (-1, -1))
        out[fn] = Resources(
            registers=attrs.get(_EIATTR_REGCOUNT, 0),
            shared_static=size_of.get(f".nv.shared.{fn}", 0),
            local_bytes=frame,
            max_stack=attrs.get(_EIATTR_MAX_STACK_SIZE, attrs.get(_EIATTR_MIN_STACK_SIZE, frame)),
            constant0=size_of.get(f".nv.constant0.{fn}", 0),
            barriers=(flags >> 20) & 0x1F,
            spill_stores=st, spill_loads=ld)
    return out


# ---- NVIDIA's binary tools (optional) ----------------------------------------------------------------
def tool(name: str) -> str | None:
    """Path of cuobjdump / nvdisasm: the pip wheels' nvidia/cu*/bin or nvidia/cuda_*/bin, else PATH."""
    try:
        import nvidia
        roots = [Path(p) for p in nvidia.__path__]
    except ImportError:
        roots = []
    for root in roots:
        for cand in sorted(root.glob(f"*/bin/{name}")):
            if cand.is_file():
                return str(cand)
    return shutil.which(name)


def _run_tool(name: str, args: list[str], cubin: bytes) -> str:
    exe = tool(name)
    if exe is None:
        raise ResourceError(f"{name} not found: install the nvidia-cuda-{name} wheel "
                            f"(pip install '.[tools]') to see SASS")
    with tempfile.TemporaryDirectory(prefix="nanoqwen-") as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([exe, *args, str(path)], capture_output=True, text=True)
    if res.returncode:
        raise ResourceError(f"{name} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def sass(cubin: bytes) -> str:
    """SASS of every kernel in ``cubin`` (cuobjdump --dump-sass, else nvdisasm)."""
    if tool("cuobjdump"):
        return _run_tool("cuobjdump", ["--dump-sass"], cubin)
    return _run_tool("nvdisasm", ["--print-instruction-encoding=false"], cubin)


_CUOBJDUMP_FUNC = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+) "
                             r"CONSTANT\[0\]:(\d+)")


def cuobjdump_resources(cubin: bytes) -> dict[str, dict[str, int]]:
    """cuobjdump --dump-resource-usage, parsed: {fn: {registers, stack, shared, local, constant0}}."""
    text = _run_tool("cuobjdump", ["--dump-resource-usage"], cubin)
    return {m.group(1): dict(zip(("registers", "stack", "shared", "local", "constant0"),
                                 map(int, m.groups()[1:]))) for m in _CUOBJDUMP_FUNC.finditer(text)}
