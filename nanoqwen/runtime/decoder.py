"""One decode step (batch 1) as a fixed launch sequence over buffers allocated once, run eagerly or as one
replayed CUDA graph; and the host side that streams tokens out of it.

Step (docs/architecture.md, "Decode step"): embed; per layer qkv GEMV (RMSNorm prologue + bias) ->
rope_append -> attention_decode -> attention_combine -> o_proj GEMV (+= h) -> gate/up GEMV (RMSNorm
prologue + SwiGLU) -> down GEMV (+= h); lm_head_argmax (final norm, argmax, state advance).

Graph scheme: ONE graph, captured once, replayed for every position. Every kernel argument is a fixed
device address; what changes per step (token, position, step index) lives in ``state`` on the device
and is advanced there by the lm_head kernel, and the paged attention derives its page range from
``state[1]``. Pages for the whole request are reserved up front, so no step needs the host. This is the
architecture page's "one graph serves every position" option rather than the article's two graphs
picked by position % page_size: one capture, no host-side branching, and the page-boundary positions
are tested explicitly (tests/gpu/test_decode.py). Every kernel is launched with Programmatic Dependent
Launch, so each one streams its weights while its predecessor drains.

Host side (``generate``): greedy runs ``ahead`` steps in front of the token the host is reading. After
each step a 4-byte copy moves ``tokens_out[step]`` into pinned memory and records an event; the host
only waits on the event of the oldest token it wants, never to decide what to launch next. The prompt
goes through ``prefill`` (runtime/prefill.py: the chunked tensor-core Prefiller, or ``by_steps``
through this step), which leaves the state and tokens_out[P - 1] where P steps would. Sampling
(temperature > 0) needs the host in the loop by nature: the step also writes fp32 logits, which are
downloaded, sampled from, and the choice copied into ``state[0]`` for the next step."""

from __future__ import annotations

import time

import numpy as np

from .. import NanoqwenError
from ..codegen.gpu import DEFAULT as DEFAULT_GPU, GpuProfile
from ..codegen.kernels import attention, embed, gemv, lm_head
from ..codegen import tuned
from . import driver
from .driver import check, cu
from .prefill import by_steps
from .sampler import HostSampler, Sampling

WAIT_TIMEOUT_S = 120.0  # no decode step takes near this long; a hung kernel becomes an error, not a hang


class DecodeTimeout(NanoqwenError):
    pass


class DecodeError(NanoqwenError):
    pass


def _wait(event: driver.Event, what: str, timeout: float = WAIT_TIMEOUT_S) -> None:
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


def step_specs(dims, cfg, gpu: str | None = None, profile: GpuProfile = DEFAULT_GPU) -> dict:
    """Role -> kernel spec of one decode step, each from its family's own constructor; the GEMVs take
    this GPU's tuned tiles (tune/tuned.json) when there are any, grids fill the ``profile``'s SMs."""
    rope_append, attention_decode, attention_combine = attention.decode_specs(dims, cfg, profile)
    return {"embed": embed.specs_for_model(dims, cfg)[0],
            **{role: tuned.role_spec(role, dims, cfg, gpu) for role in gemv.ROLES},
            "rope_append": rope_append, "attention_decode": attention_decode,
            "attention_combine": attention_combine, "lm_head": lm_head.specs_for_model(dims, cfg, profile)[0]}


class Decoder:
    """``kernels`` maps each role of ``step_specs`` to ``(spec, Function)``; ``weights`` is a
    runtime.weights.Weights, ``kv`` a runtime.paged_kv.PagedKVCache of ``capacity`` tokens (generate
    reserves each request's pages); ``rope`` the (cos, sin) fp32 tables of reference.rope_tables for
    ``capacity`` positions; ``prefill(decoder, prompt, read_token, read_logits) -> P`` runs the prompt
    (runtime/prefill.py)."""

    def __init__(self, dims, weights, kv, kernels: dict, rope, capacity: int, graphs: bool = True,
                 pdl: bool = True, ahead: int = 8, prefill=by_steps):
        self.dims, self.weights, self.kv, self.kernels = dims, weights, kv, kernels
        self.capacity, self.graphs, self.pdl, self.ahead, self.prefill = capacity, graphs, pdl, ahead, prefill
        d = dims
        acc_bytes, ml_bytes = attention.partial_bytes(kernels["attention_decode"][0])
        B = driver.DeviceBuffer
        self.stream = driver.Stream()
        self.state = B(16)                                  # int32 [4]: token, pos, step, 0
        self.tokens_out = B(4 * capacity)                   # int32 [capacity], written by lm_head at step
        self.h = B(4 * d.hidden)                            # fp32 residual stream
        self.qkv = B(4 * (d.q_dim + 2 * d.kv_dim))          # fp32 q | k | v
        self.q_rot = B(4 * d.q_dim)
        self.part_acc = B(acc_bytes)                        # attention split partials
        self.part_ml = B(ml_bytes)
        self.o16 = B(2 * d.q_dim)
        self.a16 = B(2 * d.intermediate)
        self.logits = B(4 * d.vocab)                        # always written: host sampling and tests read it
        self.partials = B(kernels["lm_head"][0].partials_bytes)   # lm_head's per-CTA argmax keys
        self.argmax_done = B(4)                             # lm_head arrival counter (embed re-arms it)
        self.err = B(4)                                     # sticky error flags of embed / lm_head
        for buf in (self.argmax_done, self.err):
            buf.memset_u32(0)
        self.cos = B.from_array(np.ascontiguousarray(rope[0], dtype=np.float32))
        self.sin = B.from_array(np.ascontiguousarray(rope[1], dtype=np.float32))
        self.host_in = driver.HostBuffer(4 * capacity)      # tokens copied into state[0] (prompt, samples)
        self.host_out = driver.HostBuffer(4 * capacity)     # tokens read back, slot = step
        self.host_logits = driver.HostBuffer(4 * d.vocab)
        self.host_state = driver.HostBuffer(16)
        self.tok_in = self.host_in.array(np.int32)
        self.tok_out = self.host_out.array(np.int32)
        self.events = [driver.Event() for _ in range(ahead + 2)]
        self.sequence = self._sequence()
        self.graph = None

    # ---- the step ------------------------------------------------------------------------------------
    def _sequence(self) -> list:
        """[(role, Function, Launch, args)] of one step: every argument fixed for the decoder's lifetime."""
        W, kv, d = self.weights.ptr, self.kv, self.dims
        seq = []

        def add(role, **args):
            spec, fn = self.kernels[role]
            seq.append((role, fn, spec.launch(), args))

        add("embed", state=self.state, embed=W("embed"), h=self.h, err=self.err, argmax_done=self.argmax_done)
        for i in range(d.layers):
            L = f"L{i}."
            add("qkv", w0=W(L + "qkv.packed"), s0=W(L + "qkv.scales"), h=self.h, norm_w=W(L + "input_norm"),
                bias=W(L + "qkv.bias"), y=self.qkv)
            add("rope_append", state=self.state, qkv=self.qkv, rope_cos=self.cos, rope_sin=self.sin,
                page_table=kv.page_table, q_rot=self.q_rot, k_pool=kv.k_ptr(i), v_pool=kv.v_ptr(i))
            add("attention_decode", state=self.state, q_rot=self.q_rot, k_pool=kv.k_ptr(i),
                v_pool=kv.v_ptr(i), page_table=kv.page_table, part_acc=self.part_acc, part_ml=self.part_ml)
            add("attention_combine", part_acc=self.part_acc, part_ml=self.part_ml, o16=self.o16)
            add("o_proj", w0=W(L + "o.packed"), s0=W(L + "o.scales"), x=self.o16, y=self.h)
            add("gate_up", w0=W(L + "gate.packed"), s0=W(L + "gate.scales"), w1=W(L + "up.packed"),
                s1=W(L + "up.scales"), h=self.h, norm_w=W(L + "post_norm"), y=self.a16)
            add("down", w0=W(L + "down.packed"), s0=W(L + "down.scales"), x=self.a16, y=self.h)
        add("lm_head", h=self.h, norm_w=W("final_norm"), lm_head=W("lm_head"), logits=self.logits,
            state=self.state, tokens_out=self.tokens_out, tokens_cap=self.capacity, partials=self.partials,
            argmax_done=self.argmax_done, err=self.err)
        return seq

    def launch_kernels(self, stream=None) -> None:
        """One step, kernel by kernel (eager mode, and what the graph captures)."""
        stream = stream or self.stream
        for role, fn, launch, args in self.sequence:
            fn.launch(launch, stream, self.pdl, **args)

    def launch_lm_head(self, h: int) -> None:
        """The step's last kernel alone on another fp32 row ``h`` (prefill's last prompt position): argmax,
        logits and the state advance exactly as in a step."""
        role, fn, launch, args = self.sequence[-1]
        assert role == "lm_head", role
        fn.launch(launch, self.stream, self.pdl, **{**args, "h": h})

    def capture(self) -> None:
        """Record the step once. Run one eager step first: it loads every module and lets any lazy
        driver work happen outside the capture."""
        if self.graph is None:
            with driver.capture(self.stream) as g:
                self.launch_kernels(self.stream)
            self.graph = g

    def step(self, i: int, feed: int | None = None, read_token: bool = False, read_logits: bool = False):
        """Enqueue step ``i``: optionally feed token ``feed`` into state[0] first, optionally copy its
        token (pinned slot i) or its logits out afterwards and record the step's event."""
        s = self.stream.handle
        if feed is not None:
            self.tok_in[i] = feed
            check(cu.cuMemcpyHtoDAsync(self.state.ptr, self.host_in.ptr + 4 * i, 4, s), "feed token")
        if self.graph is not None:
            self.graph.launch(self.stream)
        else:
            self.launch_kernels(self.stream)
        self.read_back(i, read_token, read_logits)

    def read_back(self, i: int, read_token: bool = False, read_logits: bool = False) -> None:
        """After step ``i``: optionally copy its token (pinned slot i) or its logits out, then record the
        step's event."""
        s = self.stream.handle
        if read_token:
            check(cu.cuMemcpyDtoHAsync(self.host_out.ptr + 4 * i, self.tokens_out.ptr + 4 * i, 4, s), "read token")
        if read_logits:
            check(cu.cuMemcpyDtoHAsync(self.host_logits.ptr, self.logits.ptr, self.logits.nbytes, s), "read logits")
        if read_token or read_logits:
            self.events[i % len(self.events)].record(self.stream)

    def wait_step(self, i: int) -> None:
        _wait(self.events[i % len(self.events)], f"decode step {i}")

    def reset(self, token: int, pos: int = 0, step: int = 0) -> None:
        """A new sequence: state = (token, pos, step, 0); (token, 0, 0) starts from an empty cache."""
        self.drain()  # the pinned slot may still feed an earlier copy
        st = self.host_state.array(np.int32)
        st[:] = (token, pos, step, 0)
        check(cu.cuMemcpyHtoDAsync(self.state.ptr, self.host_state.ptr, 16, self.stream.handle), "reset state")

    def read_state(self) -> np.ndarray:
        self.drain()
        out = np.empty(4, np.int32)
        return self.state.download(out)

    def check_errors(self) -> None:
        """The kernels' sticky error flags, read after a request: a bad token id or all-NaN logits is a
        loud error, never silently wrong text."""
        self.drain()
        flags = int(self.err.download(np.empty(1, np.uint32))[0])
        if flags:
            self.err.memset_u32(0)
            what = [m for bit, m in ((embed.ERR_TOKEN_RANGE, "a token id outside the vocabulary reached embed"),
                                     (lm_head.ERR_NO_FINITE_LOGIT, "every logit was NaN"),
                                     (lm_head.ERR_TOKENS_OUT_FULL, "tokens_out overflowed")) if flags & bit]
            raise DecodeError(f"decode step failed (flags {flags:#x}): {'; '.join(what) or 'unknown flag'}")

    def drain(self) -> None:
        ev = driver.Event().record(self.stream)
        try:
            _wait(ev, "draining the decode stream")
        finally:
            ev.close()

    def warm_up(self) -> None:
        """One eager step and one prefill on a dummy token (loads modules, touches every buffer), then
        the capture."""
        self.kv.release()
        self.kv.reserve(1)
        self.reset(0)
        self.launch_kernels()
        self.prefill(self, [0])
        self.check_errors()
        if self.graphs:
            self.capture()

    def close(self) -> None:
        self.drain()
        if self.graph is not None:
            self.graph.close()
        for v in vars(self).values():
            if isinstance(v, (driver.DeviceBuffer, driver.HostBuffer)):
                v.free()
        for ev in self.events:
            ev.close()
        self.stream.close()

    # ---- token streams -----------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling()):
        """Iterator of the ``max_new_tokens`` tokens after ``prompt``; closing it early drains the stream."""
        P, total = len(prompt), len(prompt) + max_new_tokens - 1
        if total > self.capacity:
            raise NanoqwenError(f"{P} prompt + {max_new_tokens} new tokens need {total} cache positions, the "
                                f"decoder holds {self.capacity}")
        self.kv.release()
        self.kv.reserve(total)   # every page the request will write, before any step is enqueued
        clean = False   # check the kernels' error flags only when no other error is on its way out
        try:
            launched = self.prefill(self, prompt, read_token=sampling.greedy, read_logits=not sampling.greedy)
            if sampling.greedy:
                for k in range(P - 1, total):
                    while launched < min(total, k + 1 + self.ahead):
                        self.step(launched, read_token=True)
                        launched += 1
                    self.wait_step(k)
                    yield int(self.tok_out[k])
            else:
                sample, tok = HostSampler(sampling), None
                for k in range(P - 1, total):   # step P - 1 is prefill's: its logits are already on the way
                    if k >= launched:
                        self.step(k, feed=tok, read_logits=True)
                    self.wait_step(k)
                    tok = sample(self.host_logits.array(np.float32))
                    yield tok
            clean = True
        except GeneratorExit:   # the caller stopped early (EOS, Ctrl-C): steps launched ahead still drain
            clean = True
            raise
        finally:
            self.drain()
            if clean:
                self.check_errors()
