"""Timeline probe: a kernel variant (``spec.timed``) that stamps %globaltimer into a device table, so the
kernels of a replayed decode graph can be timed from inside the graph (bench/timeline.py).

Each launch of a timed step owns ``SLOTS`` u64 slots of one probe table; the kernel takes their address as
its last parameter, ``probe``. Thread 0 of every CTA stamps its entry and the moment its PDL wait
(griddepcontrol.wait) returned; every warp stamps the moment it leaves the kernel (a C++ destructor, so
early ``return``s are covered and no barrier is added). The stamps meet in the slots through atomics:
start = min over CTAs of the entry, wait = min over CTAs of the after-wait stamp, end = max over warps
of the exit. Start and wait are stored complemented (``~t``) so that every slot is an atomicMax target and
one memset to 0 arms the whole table: max(~t) = ~min(t). ``decode`` undoes that on the host.

The device code lives in templates/probe.cu.inc and is spliced into a timed kernel's source by three
template hooks (``hooks``): the code before the kernel, the scope object at its first line, the stamp
after its pdl_wait(). With timed False every hook is the empty string, so an untimed kernel's source is
byte for byte what it was, and the file is not a *.cuh header (those are in every kernel's cache key).

%globaltimer (PTX ISA, special registers) is "a predefined, 64-bit global nanosecond timer", common to all
SMs; the ISA promises no resolution. Its update period is a property of the GPU and driver (tens of ns on
recent parts, 1 us has been reported on others), so a single stamp is only good to that period: the
bench reports the period it saw (``timer_quantum_ns``) and medians over many replays."""

from __future__ import annotations

from functools import cache

import numpy as np

from .. import paths

SLOTS = 3                 # per launch: ~start, ~wait, end (u64 each)
PARAM_NAME = "probe"
PARAM_NOTE = "timeline probe: this launch's 3 u64 slots (~min entry, ~min after-wait, max exit)"
SOURCE = "probe.cu.inc"   # inside templates/

_ENTER = "\n    NqProbe nq_probe(probe);   // timeline: entry now, exit when each warp leaves"
_WAIT = " nq_probe.waited();"


@cache
def _code() -> str:
    return paths.data_path("templates", SOURCE).read_text()


def hooks(timed: bool) -> dict[str, str]:
    """The template variables every timeable template places: ``probe_code`` before the kernel,
    ``probe_enter`` at the end of the kernel's opening line, ``probe_wait`` right after pdl_wait();."""
    if not timed:
        return {"probe_code": "", "probe_enter": "", "probe_wait": ""}
    return {"probe_code": _code(), "probe_enter": _ENTER, "probe_wait": _WAIT}


def table_bytes(launches: int) -> int:
    return 8 * SLOTS * launches


def decode(raw: np.ndarray) -> np.ndarray:
    """u64 probe table(s) [..., launches * SLOTS] -> int64 [..., launches, 3] of (start, wait, end) in
    globaltimer ns. A slot no CTA wrote reads as -1 (start/wait: ~0; end: 0)."""
    t = np.asarray(raw, dtype=np.uint64).reshape(*np.shape(raw)[:-1], -1, SLOTS).copy()
    written = t != 0
    t[..., :2] = ~t[..., :2]
    return np.where(written, t, np.uint64(2**64 - 1)).astype(np.int64)
