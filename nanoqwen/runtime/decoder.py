"""One decode step (batch 1) as a fixed launch sequence over buffers allocated once, run eagerly or as one
replayed CUDA graph.

Step (docs/architecture.md, "Decode step"): embed; per layer qkv GEMV (RMSNorm prologue + bias, and RoPE +
the K/V append in its epilogue) -> attention_decode -> attention_combine -> o_proj GEMV (+= h) -> gate/up GEMV
(RMSNorm prologue + SwiGLU) -> down GEMV (+= h); lm_head_argmax (final norm, argmax, state advance). The m-row
steps (runtime/rowstep.py), and a QKV tile that cannot carry the rope (gemv.with_rope), run rope_append after
the QKV GEMV instead: the same bits.

Graph scheme: ONE graph, captured once, replayed for every position. Every kernel argument is a fixed
device address; what changes per step (token, position, step index) lives in the device state
(runtime/state.py) and is advanced there by the lm_head kernel, and the paged attention derives its page
range from ``state[1]``. A request's pages are mapped before its first step, so no step needs the host.
This is the architecture page's "one graph serves every position" option rather than the article's two
graphs picked by position % page_size: one capture, no host-side branching, and the page-boundary
positions are tested explicitly (tests/gpu/test_decode.py). Every kernel is launched with Programmatic
Dependent Launch, so each one streams its weights while its predecessor drains.

``step`` enqueues one step (optionally feeding a host token into ``state[0]`` first) and its read-back;
nothing here waits for the GPU. The request loop around it is runtime/runner.py.

A Decoder over timed kernels (codegen/probe.py; bench/timeline.py builds one) also owns a probe table:
launch i gets slots i as its ``probe`` argument. Zeroing the table (which arms it) is the caller's, before
each step: it stays out of the graph, so the graph holds only the step's kernels, exactly as untimed."""

from __future__ import annotations

import numpy as np

from ..codegen.gpu import DEFAULT as DEFAULT_GPU, GpuProfile
from ..codegen.kernels import attention, embed, embed_prefill, gemm, gemv, lm_head
from ..codegen import probe, tuned
from . import driver
from .driver import check, cu
from .memory import Buffers


def step_specs(dims, cfg, gpu: str | None = None, profile: GpuProfile = DEFAULT_GPU, m: int = 1) -> dict:
    """Role -> kernel spec of one decode step of ``m`` rows, each from its family's own constructor; the
    GEMVs and the attention take this GPU's tuned parameters (tune/tuned.json) when there are any (m > 1:
    the m-row kernel of that tile, every row reduced in its order), grids fill the ``profile``'s SMs. m > 1
    embeds its rows with the prefill's embed (a copy, the same bits). m = 1: the QKV GEMV does rope_append's
    work in its epilogue where its tile allows (gemv.with_rope), and the step has no rope_append."""
    rope_append, attention_decode, attention_combine = tuned.attention_specs(dims, cfg, gpu, m, profile)
    gemvs = {role: tuned.role_spec(role, dims, cfg, gpu, m, profile) for role in gemv.ROLES}
    fused = gemv.with_rope(gemvs["qkv"], dims, cfg.kv_cache.page_size)   # None for m > 1
    if fused:
        gemvs["qkv"] = fused
    apart = cfg.multirow.apart_roles(m)
    return {"embed": embed.specs_for_model(dims, cfg)[0] if m == 1 else embed_prefill.specs_for_model(dims, cfg)[0],
            **gemvs, **{role: gemv.norm_apart(gemvs[role]) for role in apart},
            # multirow.norm_apart: x16 = RMSNorm(h) over the m rows, then the GEMV
            **{norm_role(role): gemm.RmsnormPrefillSpec(hidden=dims.hidden, eps=dims.rms_eps, max_m=m)
               for role in apart},
            **({} if fused else {"rope_append": rope_append}), "attention_decode": attention_decode,
            "attention_combine": attention_combine, "lm_head": lm_head.model_spec(dims, cfg, profile, m)}


def buffer_bytes(dims, specs: dict, m: int = 1) -> dict[str, int]:
    """The step's own device buffers for ``m`` rows (``specs``: the roles of ``step_specs`` for m rows)."""
    d = dims
    acc_bytes, ml_bytes = attention.partial_bytes(specs["attention_decode"])
    return {"h": 4 * m * d.hidden,                          # fp32 residual stream
            **({"qkv": 4 * m * (d.q_dim + 2 * d.kv_dim)} if "rope_append" in specs else {}),   # fp32 q | k | v
            "q_rot": 4 * m * d.q_dim,
            "part_acc": acc_bytes, "part_ml": ml_bytes,      # attention split partials (m rows in the spec)
            "o16": 2 * m * d.q_dim,
            "a16": 2 * m * d.intermediate,
            "partials": specs["lm_head"].partials_bytes,     # lm_head's per-CTA argmax keys
            **({"x16": 2 * m * d.hidden} if any(norm_role(r) in specs for r in gemv.ROLES) else {})}   # norm_apart's x


def norm_role(role: str) -> str:
    """The role of the RMSNorm kernel ahead of GEMV ``role`` when its norm runs apart (config multirow.norm_apart)."""
    return f"{role}_norm"


def add_layer(add, i: int, W, kv, st, b, where: dict, roles=frozenset(), m: int = 1) -> None:
    """Decoder layer ``i`` of a step over the buffers ``b`` (``buffer_bytes``; one row or m rows), each
    kernel through ``add(role, **args)``. ``where`` says where the rows' positions and page table come
    from: the device state and the KV cache's table (the decode step), or a positions array and the rows'
    own tables (the multi-row step, runtime/rowstep.py). ``roles``: the step's kernels, which say whose
    RMSNorm runs apart (``norm_role``), over its ``m`` rows, and whether rope_append runs (else the QKV GEMV
    rotates q and k and appends k and v itself)."""
    L = f"L{i}."

    def normed(role, norm_w, **args):   # the GEMV of RMSNorm(h): the norm in its prologue, or in a kernel before
        if norm_role(role) in roles:
            add(norm_role(role), h=b.h, w=norm_w, xn=b.x16, m=m)
            add(role, x=b.x16, **args)
        else:
            add(role, h=b.h, norm_w=norm_w, **args)

    qkv = dict(w0=W(L + "qkv.packed"), s0=W(L + "qkv.scales"), bias=W(L + "qkv.bias"))
    rope = dict(**where, rope_cos=st.cos, rope_sin=st.sin, q_rot=b.q_rot, k_pool=kv.k_ptr(i), v_pool=kv.v_ptr(i))
    if "rope_append" in roles:
        normed("qkv", W(L + "input_norm"), **qkv, y=b.qkv)
        add("rope_append", qkv=b.qkv, **rope)
    else:
        normed("qkv", W(L + "input_norm"), **qkv, **rope)
    add("attention_decode", **where, q_rot=b.q_rot, k_pool=kv.k_ptr(i),
        v_pool=kv.v_ptr(i), part_acc=b.part_acc, part_ml=b.part_ml)
    add("attention_combine", part_acc=b.part_acc, part_ml=b.part_ml, o16=b.o16)
    add("o_proj", w0=W(L + "o.packed"), s0=W(L + "o.scales"), x=b.o16, y=b.h)
    normed("gate_up", W(L + "post_norm"), w0=W(L + "gate.packed"), s0=W(L + "gate.scales"), w1=W(L + "up.packed"),
           s1=W(L + "up.scales"), y=b.a16)
    add("down", w0=W(L + "down.packed"), s0=W(L + "down.scales"), x=b.a16, y=b.h)


class Decoder:
    """``shared`` is the runtime.state.SequenceState the step runs over; ``kernels`` maps each role of
    ``step_specs`` to ``(spec, Function)``; ``bufs`` the ``buffer_bytes`` table allocated (by default here)."""

    def __init__(self, shared, kernels: dict, pdl: bool = True, bufs: Buffers | None = None):
        self.shared, self.kernels, self.pdl = shared, kernels, pdl
        self.dims, self.stream = shared.dims, shared.stream
        self._own_bufs = bufs is None   # a timed decoder runs over another decoder's buffers
        self.bufs = bufs or Buffers(buffer_bytes(shared.dims, {r: spec for r, (spec, _fn) in kernels.items()}))
        self.host_in = driver.HostBuffer(4 * shared.capacity)   # tokens copied into state[0], slot = step
        self.tok_in = self.host_in.array(np.int32)
        self.sequence = self._sequence()
        self.probe = self._probe_table()
        self.graph = None

    def _sequence(self) -> list:
        """[(role, Function, Launch, args)] of one step: every argument fixed for the decoder's lifetime."""
        sh, b, d = self.shared, self.bufs, self.dims
        W, kv, st = sh.weights.ptr, sh.kv, sh.bufs
        seq = []

        def add(role, **args):
            spec, fn = self.kernels[role]
            seq.append((role, fn, spec.launch(), args))

        add("embed", state=st.state, embed=W("embed"), h=b.h, err=st.err, argmax_done=st.argmax_done)
        for i in range(d.layers):
            add_layer(add, i, W, kv, st, b, where={"state": st.state, "page_table": kv.page_table},
                      roles=frozenset(self.kernels))
        add("lm_head", h=b.h, norm_w=W("final_norm"), lm_head=W("lm_head"), logits=st.logits,
            state=st.state, tokens_out=st.tokens_out, tokens_cap=sh.capacity, partials=b.partials,
            argmax_done=st.argmax_done, err=st.err)
        return seq

    def _probe_table(self) -> driver.DeviceBuffer | None:
        """Timed kernels: the probe table, each launch's ``probe`` argument set to its own slots."""
        timed = {spec.timed for spec, _fn in self.kernels.values()}
        if timed == {False}:
            return None
        if len(timed) > 1:
            raise ValueError("a decode step's kernels are all timed or all untimed")
        table = driver.DeviceBuffer(probe.table_bytes(len(self.sequence)))
        for i, (_role, _fn, _launch, args) in enumerate(self.sequence):
            args[probe.PARAM_NAME] = table.ptr + probe.table_bytes(i)
        return table

    def launch_kernels(self, stream=None) -> None:
        """One step, kernel by kernel (eager mode, and what the graph captures)."""
        stream = stream or self.stream
        for role, fn, launch, args in self.sequence:
            fn.launch(launch, stream, self.pdl, **args)

    def lm_head(self, h: int) -> None:
        """The step's last kernel alone on another fp32 row ``h`` (a prefill's last position): argmax,
        logits and the state advance exactly as in a step. Its arrival counter is re-armed first (the
        step's embed does that, and no embed runs before this one)."""
        role, fn, launch, args = self.sequence[-1]
        assert role == "lm_head", role
        self.shared.bufs.argmax_done.memset_u32(0, self.stream)
        fn.launch(launch, self.stream, self.pdl, **{**args, "h": h})

    def capture(self) -> None:
        """Record the step once; ``step`` replays it from then on. Call it after an eager step: that loads
        every module and lets any lazy driver work happen outside the capture."""
        if self.graph is None:
            with driver.capture(self.stream) as g:
                self.launch_kernels(self.stream)
            self.graph = g

    def measure(self, reps: int = 3) -> float:
        """The captured step's replay time in ms, the best of ``reps``, from token 0 at position 0 of the
        loaded page table (the session's warm-up page, before any request: RowStep.measure's protocol)."""
        start, end = driver.Event(), driver.Event()
        try:
            best = float("inf")
            for _ in range(reps):
                self.shared.reset(0, 0, 0)
                start.record(self.stream)
                self.graph.launch(self.stream)
                end.record(self.stream)
                best = min(best, driver.Event.elapsed_ms(start, end))
            return best
        finally:
            start.close()
            end.close()

    def step(self, i: int, feed: int | None = None, read_token: bool = False, read_logits: bool = False):
        """Enqueue step ``i``: optionally feed token ``feed`` into state[0] first, optionally copy its
        token (pinned slot i) or its logits out afterwards and record the step's event."""
        if feed is not None:
            self.tok_in[i] = feed
            check(cu.cuMemcpyHtoDAsync(self.shared.bufs.state.ptr, self.host_in.ptr + 4 * i, 4, self.stream.handle),
                  "feed token")
        if self.graph is not None:
            self.graph.launch(self.stream)
        else:
            self.launch_kernels(self.stream)
        self.shared.read_back(i, read_token, read_logits)

    # the step's controls for replaying it at a chosen state (bench/itl.py)
    def reset(self, token: int, pos: int = 0, step: int = 0) -> None:
        self.shared.reset(token, pos, step)

    def drain(self) -> None:
        self.shared.drain()

    def check_errors(self) -> None:
        self.shared.check_errors()

    def close(self) -> None:
        self.shared.drain()
        if self.graph is not None:
            self.graph.close()
        if self._own_bufs:
            self.bufs.free()
        if self.probe is not None:
            self.probe.free()
        self.host_in.free()
