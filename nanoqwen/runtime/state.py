"""What the decode step and the prefill both run over, with one owner: the weights, the KV cache, the
stream, the device decode state, the rope tables, the lm_head's outputs and counters, the sticky error
flags, and the pinned read-back of tokens and logits with its events. The Decoder (runtime/decoder.py)
and the Prefiller (runtime/prefill.py) each hold a ``SequenceState`` and never each other; the Runner
(runtime/runner.py) orders their launches.

Device state (docs/architecture.md, "Device-side decode state"): ``state`` int32 [token, pos, step, 0],
advanced on the device by the lm_head kernel, so that a captured step replays without the host."""

from __future__ import annotations

import time

import numpy as np

from .. import NanoqwenError
from ..codegen.kernels import embed, lm_head
from . import driver
from .driver import check, cu
from .memory import Buffers

WAIT_TIMEOUT_S = 120.0  # no decode step takes near this long; a hung kernel becomes an error, not a hang


class DecodeTimeout(NanoqwenError):
    pass


class DecodeError(NanoqwenError):
    pass


def wait(event, what: str, timeout: float = WAIT_TIMEOUT_S) -> None:
    """Poll instead of cuEventSynchronize so that a hung kernel turns into an error after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        err, = cu.cuEventQuery(event.handle)
        if err == cu.CUresult.CUDA_SUCCESS:
            return
        if err != cu.CUresult.CUDA_ERROR_NOT_READY:
            check((err,), f"{what} (cuEventQuery)")
        if time.monotonic() > deadline:
            raise DecodeTimeout(f"{what}: the GPU did not finish within {timeout:.0f} s (hung kernel?)")
        time.sleep(0)


def buffer_bytes(dims, capacity: int) -> dict[str, int]:
    """The shared device buffers of a sequence of up to ``capacity`` positions."""
    rope = 4 * capacity * (dims.head_dim // 2)
    return {"state": 16,                      # int32 [4]: token, pos, step, 0
            "tokens_out": 4 * capacity,       # int32, written by lm_head at index step
            "logits": 4 * dims.vocab,         # fp32, always written: host sampling and tests read it
            "argmax_done": 4,                 # lm_head arrival counter (embed re-arms it)
            "err": 4,                         # sticky error flags of embed / lm_head
            "cos": rope, "sin": rope}         # fp32 [capacity, head_dim / 2] (reference.rope_tables)


class SequenceState:
    """``weights`` is a runtime.weights.Weights, ``kv`` a runtime.paged_kv.PagedKVCache, ``rope`` the
    (cos, sin) tables of reference.rope_tables for ``capacity`` positions; ``slots`` events ring the
    read-back (the most steps in flight plus two); ``bufs`` the ``buffer_bytes`` table allocated (by
    default here)."""

    def __init__(self, dims, weights, kv, rope, capacity: int, slots: int, bufs: Buffers | None = None):
        self.dims, self.weights, self.kv, self.capacity = dims, weights, kv, capacity
        self.stream = driver.Stream()
        self.bufs = b = bufs or Buffers(buffer_bytes(dims, capacity))
        for buf in (b.argmax_done, b.err):
            buf.memset_u32(0)
        for buf, table in zip((b.cos, b.sin), rope):
            buf.upload(np.ascontiguousarray(table, dtype=np.float32))
        self.host_out = driver.HostBuffer(4 * capacity)     # tokens read back, slot = step
        self.host_logits = driver.HostBuffer(4 * dims.vocab)
        self.host_state = driver.HostBuffer(16)
        self.tok_out = self.host_out.array(np.int32)
        self.events = [driver.Event() for _ in range(slots)]
        self.resets = 0   # how often the host set the device state (a step launched ahead counts on it)

    def reset(self, token: int, pos: int = 0, step: int = 0) -> None:
        """Device state = (token, pos, step, 0): the next step embeds ``token`` at ``pos``."""
        self.drain()  # the pinned slot may still feed an earlier copy
        self.resets += 1
        st = self.host_state.array(np.int32)
        st[:] = (token, pos, step, 0)
        check(cu.cuMemcpyHtoDAsync(self.bufs.state.ptr, self.host_state.ptr, 16, self.stream.handle), "reset state")

    def read_back(self, i: int, read_token: bool = False, read_logits: bool = False) -> None:
        """After step ``i``: optionally copy its token (pinned slot i) or its logits out, then record the
        step's event."""
        s = self.stream.handle
        if read_token:
            check(cu.cuMemcpyDtoHAsync(self.host_out.ptr + 4 * i, self.bufs.tokens_out.ptr + 4 * i, 4, s),
                  "read token")
        if read_logits:
            check(cu.cuMemcpyDtoHAsync(self.host_logits.ptr, self.bufs.logits.ptr, 4 * self.dims.vocab, s),
                  "read logits")
        if read_token or read_logits:
            self.events[i % len(self.events)].record(self.stream)

    def wait_step(self, i: int) -> None:
        wait(self.events[i % len(self.events)], f"decode step {i}")

    def logits(self) -> np.ndarray:
        """A copy of the last logits read back."""
        return self.host_logits.array(np.float32).copy()

    def read_state(self) -> np.ndarray:
        self.drain()
        return self.bufs.state.download(np.empty(4, np.int32))

    def drain(self) -> None:
        ev = driver.Event().record(self.stream)
        try:
            wait(ev, "draining the decode stream")
        finally:
            ev.close()

    def check_errors(self) -> None:
        """The kernels' sticky error flags, read after a request: a bad token id or all-NaN logits is a
        loud error, never silently wrong text."""
        self.drain()
        flags = int(self.bufs.err.download(np.empty(1, np.uint32))[0])
        if flags:
            self.bufs.err.memset_u32(0)
            what = [m for bit, m in ((embed.ERR_TOKEN_RANGE, "a token id outside the vocabulary reached embed"),
                                     (lm_head.ERR_NO_FINITE_LOGIT, "every logit was NaN"),
                                     (lm_head.ERR_TOKENS_OUT_FULL, "tokens_out overflowed")) if flags & bit]
            raise DecodeError(f"decode step failed (flags {flags:#x}): {'; '.join(what) or 'unknown flag'}")

    def close(self) -> None:
        self.drain()
        self.bufs.free()
        for buf in (self.host_out, self.host_logits, self.host_state):
            buf.free()
        for ev in self.events:
            ev.close()
        self.stream.close()
