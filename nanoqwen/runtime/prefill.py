"""Prefill: tokens at positions [p0, p1) of a sequence through the tensor-core kernels (DESIGN.md
section 6), in chunks of at most ``prefill.chunk_tokens`` tokens so the activation buffers stay bounded
whatever the length. Positions before p0 must already be in the KV pages: a whole prompt is p0 = 0, a
prompt whose prefix the cache kept starts at the first position it did not (runtime/prefix_cache.py),
and speculative decoding's verify step would be a few tokens past the accepted ones.

Per chunk of n tokens at positions [c0, c0 + n) (launched with Programmatic Dependent Launch but NO_PDL's:
every kernel waits before touching what its predecessor wrote):
  embed_prefill   h[n, hidden] = f32(embed[tokens[c0 : c0 + n]])
  per layer       rmsnorm_prefill -> gemm qkv (+bias, f32) -> rope_append_prefill (q_rot; k, v into the
                  pages) -> attention_prefill (causal over keys [0, c0 + n), o16) -> gemm o_proj (h +=)
                  -> rmsnorm_prefill -> gemm gate/up (SwiGLU, a16) -> gemm down (h +=)
                  (the GEMMs with small-M tiles when n <= prefill.small_m_tokens: a prefix-reuse tail; such
                  a chunk's attention is split-KV where its keys span 2 key blocks or more,
                  attention_prefill -> attention_prefill_combine -> o16)
With ``prefill.gemv_order`` the GEMMs compute in the tensor-core GEMV's order (codegen/kernels/gemm.py), and
a chunk of at most 16 rows (a graph bucket's) runs each norm + GEMM as one row GEMV of that bucket instead
(gemv_int4 with mma, the norm fused: ``prefill.rows<m>.<role>``), the same bits at decode-GEMV speed; a
last chunk of up to ``prefill.row_tail_tokens`` rows is cut into such chunks. With ``prefill.wgmma`` every
GEMM is the wgmma GEMM (codegen/kernels/gemm_wgmma.py), short chunks in a tile of more CTAs with the same
bits a row.
Every kernel computes a row with arithmetic that does not depend on the chunk around it (DESIGN.md section
12; docs/architecture.md, "Chunk invariance"), so a position's K/V and logits are the same bits whether
it was prefilled cold in a long chunk, in a short tail or reused from the prefix cache.
Chunks of up to the largest usable ``prefill.graph_buckets`` row count replay one captured graph
(runtime/chunk_graphs.py) once captured; the others are launched kernel by kernel.
Chunks share nothing but the KV pages: a later chunk reads the earlier ones' keys from the cache. The
Prefiller returns the device address of the last row's final residual; the Runner (runtime/runner.py)
runs the decode step's own lm_head_argmax on it with the device state at (token, p1 - 1, p1 - 1), which
writes tokens_out[p1 - 1] and leaves the state at (next token, p1, p1), where token-by-token prefill
through the decode step would have left it, so the decode loop that follows runs unchanged.

``by_steps`` is that token-by-token prefill through the decode step itself: the debugging baseline
(``CudaSession(prefill="decode")``: bit-identical to teacher-forced decode)."""

from __future__ import annotations

import numpy as np

from ..codegen.gpu import DEFAULT as DEFAULT_GPU, GpuProfile
from ..codegen.kernels import attention_prefill, embed_prefill, gemm, gemm_wgmma, gemv
from . import driver
from .chunk_graphs import ChunkGraphs, graph_input_bytes
from .driver import check, cu
from .memory import Buffers

SMALL = "small."   # role prefix of the small-M GEMMs
GRAPH = "graph."   # role prefix of the device_chunk kernels a chunk graph replays
ROWS = "rows"      # role prefix of the row GEMVs of a chunk bucket: rows<m>.<role>
# Launched without PDL, after the whole of their predecessor: a short chunk's o_proj launched early, beside the
# split-KV combine's 896 one-row CTAs, had its CTAs crowded onto few SMs (26.6 us in the 32-row chunk graph
# against 15.2 alone; launched after the combine, the chunk 5.01 -> 4.58 ms: H100, perf-notes, twenty-seventh
# session).
NO_PDL = frozenset({SMALL + "o_proj"})


def prefill_specs(dims, cfg, profile: GpuProfile = DEFAULT_GPU) -> dict:
    """Role -> kernel spec of the prefill chain; roles are prefixed ``prefill.`` so they sit beside the
    decode step's roles (runtime/decoder.py step_specs) in one kernel table. Each GEMM comes twice:
    ``prefill.<role>`` with the default tiles and ``prefill.small.<role>`` with gemm.SMALL_M_TILES for
    chunks of at most ``prefill.small_m_tokens`` rows, and so does the attention: ``prefill.small.attention``
    is the split-KV variant, followed by ``prefill.small.attention_combine`` (one split: ``prefill.attention``).
    With ``prefill.graph_buckets``, ``prefill.graph.<role>`` are the device_chunk variants of rope_append and
    the split-KV attention and combine, which the chunk graphs replay."""
    norm = next(s for s in gemm.specs_for_model(dims, cfg) if isinstance(s, gemm.RmsnormPrefillSpec))
    rope, attn = attention_prefill.prefill_attention_specs(dims, cfg, profile)
    split_attn, combine = attention_prefill.split_kv_specs(dims, cfg, profile)
    graph = {}
    if cfg.prefill.graph_buckets:
        g_rope = attention_prefill.prefill_attention_specs(dims, cfg, profile, device_chunk=True)[0]
        g_attn, g_combine = attention_prefill.split_kv_specs(dims, cfg, profile, device_chunk=True)
        graph = {f"prefill.{GRAPH}rope_append": g_rope, f"prefill.{GRAPH}attention": g_attn,
                 f"prefill.{GRAPH}attention_combine": g_combine}
    return {"prefill.embed": embed_prefill.specs_for_model(dims, cfg)[0], "prefill.rmsnorm": norm,
            **{f"prefill.{r}": s for r, s in _gemms(dims, cfg, profile, small_m=False).items()},
            **{f"prefill.{SMALL}{r}": s for r, s in _gemms(dims, cfg, profile, small_m=True).items()},
            "prefill.rope_append": rope, "prefill.attention": attn, f"prefill.{SMALL}attention": split_attn,
            f"prefill.{SMALL}attention_combine": combine, **graph, **row_gemv_specs(dims, cfg, profile)}


def _gemms(dims, cfg, profile: GpuProfile, small_m: bool) -> dict:
    """The prefill GEMMs by role: the config's gemm_int4 tiles (small-M ones for short chunks), or with
    ``prefill.wgmma`` the wgmma GEMM's tiles, whose rows are the same bits in either (one instruction, one K
    walk: a chunk of 7 rows computes each row as a chunk of 512 does)."""
    if cfg.prefill.wgmma:
        return gemm_wgmma.model_gemms(dims, cfg.quant.group_size, profile, small_m=small_m)
    return gemm.config_gemms(dims, cfg, profile, small_m=small_m)


def row_gemv_specs(dims, cfg, profile: GpuProfile = DEFAULT_GPU) -> dict:
    """``prefill.rows<m>.<role>``: with ``prefill.gemv_order``, for each graph bucket m of at most 16 rows
    (gemv.MAX_M) and each role, the tensor-core row GEMV whose rows are the GEMV-order GEMM's (its splits)."""
    if not cfg.prefill.gemv_order:
        return {}
    gemms = gemm.config_gemms(dims, cfg, profile)
    return {f"prefill.{ROWS}{m}.{r}": gemv.prefill_row_spec(r, dims, cfg, m, gemms[r].splits, profile)
            for m in cfg.prefill.graph_buckets if m <= gemv.MAX_M for r in gemms}


def gemm_role(role: str, rows: int, small_m_tokens: int) -> str:
    """The GEMM role (``qkv``, ``o_proj``, ``gate_up``, ``down``; or ``attention``) a chunk of ``rows``
    tokens launches: its small-M variant up to small_m_tokens rows (for the attention, the split-KV one,
    which Prefiller._attention runs where the keys make 2 splits or more)."""
    return SMALL + role if rows <= small_m_tokens else role


def chunks(p0: int, p1: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(c0, n) of each chunk of positions [p0, p1): consecutive, every one chunk_tokens long but the last."""
    if not 0 <= p0 < p1 or chunk_tokens < 1:
        raise ValueError(f"chunks: positions [{p0}, {p1}) must be a non-empty range and chunk_tokens "
                         f"({chunk_tokens}) positive")
    return [(c0, min(chunk_tokens, p1 - c0)) for c0 in range(p0, p1, chunk_tokens)]


def buffer_shapes(dims, chunk_tokens: int) -> dict:
    """Name -> (shape, dtype) of the chunk activations (allocated once per session)."""
    d, C = dims, chunk_tokens
    return {"h": ((C, d.hidden), np.float32),                     # residual rows of the chunk
            "xn": ((C, d.hidden), np.float16),                    # RMSNorm output: X of qkv and gate/up
            "qkv": ((C, d.q_dim + 2 * d.kv_dim), np.float32),
            "q_rot": ((C, d.q_dim), np.float32),
            "o16": ((C, d.q_dim), np.float16),                    # attention out: X of o_proj
            "a16": ((C, d.intermediate), np.float16)}             # SwiGLU out: X of down


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def buffer_bytes(dims, chunk_tokens: int, capacity: int, small_m_tokens: int, block_keys: int,
                 graph_buckets=()) -> dict[str, int]:
    """The Prefiller's device buffers: the chunk activations, the token ids of up to ``capacity``
    positions, the split-KV attention partials of chunks of up to ``small_m_tokens`` rows (none at 0) over
    the key blocks (``block_keys`` each) of ``capacity`` positions, and the chunk graphs' inputs."""
    rows = min(small_m_tokens, chunk_tokens)
    acc, ml = attention_prefill.partial_bytes(dims, rows, -(-capacity // block_keys))
    buckets = usable_buckets(graph_buckets, small_m_tokens, chunk_tokens)
    return {**{name: _nbytes(*sd) for name, sd in buffer_shapes(dims, chunk_tokens).items()}, "tokens": 4 * capacity,
            **({"part_acc": acc, "part_ml": ml} if rows else {}),
            **({"graph_in": graph_input_bytes(buckets[-1])} if buckets else {})}


def usable_buckets(graph_buckets, small_m_tokens: int, chunk_tokens: int) -> list[int]:
    """The graph buckets a Prefiller replays: those of at most ``small_m_tokens`` rows (the graphs launch
    the small-M GEMMs) and at most ``chunk_tokens`` (the activation buffers' rows)."""
    return [b for b in graph_buckets if b <= min(small_m_tokens, chunk_tokens)]


class Prefiller:
    """``shared`` is the runtime.state.SequenceState it runs over (weights, KV cache, rope tables, stream,
    error flags); ``kernels`` holds the ``prefill_specs`` roles as ``(spec, Function)``; ``capacity`` is
    the most positions a sequence has; chunks of at most ``small_m_tokens`` rows use the small-M GEMMs.
    ``bufs`` is the ``buffer_bytes`` table allocated (by default here). Never waits for the GPU."""

    def __init__(self, shared, kernels: dict, chunk_tokens: int, small_m_tokens: int, bufs: Buffers | None = None,
                 graph_buckets=(), row_tail_tokens: int = 0):
        self.shared, self.dims, self.kernels = shared, shared.dims, kernels
        self.chunk_tokens, self.small_m_tokens, self.capacity = chunk_tokens, small_m_tokens, shared.capacity
        self.block_keys = kernels["prefill.attention"][0].block_keys
        self.row_buckets = sorted({spec.m for role, (spec, _) in kernels.items()   # chunks as row GEMVs
                                   if role.startswith("prefill." + ROWS) and spec.m <= chunk_tokens})
        self.row_tail_tokens = row_tail_tokens if self.row_buckets else 0
        buckets = usable_buckets(graph_buckets, small_m_tokens, chunk_tokens)
        self.bufs = bufs or Buffers(buffer_bytes(self.dims, chunk_tokens, self.capacity, small_m_tokens,
                                                 self.block_keys, buckets))
        self.host_tokens = driver.HostBuffer(4 * self.capacity)
        self._grids = {}   # (role, shape) -> Launch: one checked Launch per shape, not one per launch
        # short chunks as captured graphs (replayed once capture() ran; ``replay`` False: kernel by kernel)
        self.graphs = ChunkGraphs(self, buckets) if buckets else None
        self.replay = True

    def _launch(self, role: str, *shape: int, **args) -> None:
        """One prefill kernel, its grid ``spec.launch(*shape)`` (a chunk's rows, then KV splits where the
        kernel takes them), with PDL where ``pdl(role)`` (each one waits before it touches its predecessor's
        output)."""
        spec, fn = self.kernels["prefill." + role]
        launch = self._grids.get((role, shape))
        if launch is None:
            launch = self._grids[role, shape] = spec.launch(*shape)
        fn.launch(launch, self.shared.stream, self.pdl(role), **args)

    @staticmethod
    def pdl(role: str) -> bool:
        """Whether kernel ``role`` launches with Programmatic Dependent Launch: all but NO_PDL's."""
        return role not in NO_PDL

    def _attention(self, emit, layer: int, n: int, pos: dict) -> None:
        """o16 of the chunk's rows: one kernel, or for a short chunk split-KV partials and their combine;
        ``pos`` is {"p0", "n"} (launch scalars) or {"chunk"} (a graph: every key block's split, always)."""
        kv, b = self.shared.kv, self.bufs
        args = dict(q_rot=b.q_rot, k_pool=kv.k_ptr(layer), v_pool=kv.v_ptr(layer), page_table=kv.page_table, **pos)
        if "chunk" in pos:
            role = GRAPH + "attention"
            splits = self.kernels["prefill." + role][0].max_splits
        else:
            role = gemm_role("attention", n, self.small_m_tokens)
            splits = self.kernels["prefill." + role][0].splits_for(pos["p0"] + n)
        if splits == 1:   # one key block: the unsplit kernel folds nothing either, the very same bits
            emit("attention", n, o16=b.o16, **args)
            return
        parts = dict(part_acc=b.part_acc, part_ml=b.part_ml)   # allocated only where short chunks split
        emit(role, n, splits, **parts, **args)
        emit(role + "_combine", n, **parts, o16=b.o16, **pos)

    def _chunk(self, emit, n: int, tokens: int, pos: dict) -> None:
        """Every kernel of a chunk of ``n`` rows (ids at device address ``tokens``) through ``emit(role,
        *shape, **args)``: ``pos`` {"p0": c0, "n": n} launches at positions [c0, c0 + n); {"chunk": ptr}
        builds a graph's sequence, whose rope/attention read p0 and the rows from the device (the other
        kernels compute all n rows; rows past the chunk are scratch). Afterwards bufs.h holds the rows'
        final residual."""
        sh, b = self.shared, self.bufs
        W, kv, h = sh.weights.ptr, sh.kv, b.h
        g = GRAPH if "chunk" in pos else ""
        rows = next((m for m in self.row_buckets if m >= n), 0)   # the GEMMs as row GEMVs of `rows` rows

        def mm(role, w, s_, y, x=None, norm=None, w2=0, s2=0, bias=0):
            """The layer's GEMM `role` of x, or of rmsnorm(h) with weight `norm`: one row GEMV (norm fused)
            or [rmsnorm_prefill,] GEMM."""
            if rows:
                emit(f"{ROWS}{rows}.{role}", w0=w, s0=s_, y=y, **(dict(h=h, norm_w=norm) if norm else dict(x=x)),
                     **(dict(w1=w2, s1=s2) if w2 else {}), **(dict(bias=bias) if bias else {}))
                return
            if norm:
                emit("rmsnorm", n, h=h, w=norm, xn=b.xn, m=n)
                x = b.xn
            emit(gemm_role(role, n, self.small_m_tokens), n, x=x, w=w, s=s_, w2=w2, s2=s2, bias=bias, y=y, m=n)

        emit("embed", n, tokens=tokens, embed=W("embed"), h=h, err=sh.bufs.err, n=n)
        for i in range(self.dims.layers):
            L = f"L{i}."
            mm("qkv", W(L + "qkv.packed"), W(L + "qkv.scales"), b.qkv, norm=W(L + "input_norm"),
               bias=W(L + "qkv.bias"))
            emit(g + "rope_append", n, qkv=b.qkv, rope_cos=sh.bufs.cos, rope_sin=sh.bufs.sin,
                 page_table=kv.page_table, q_rot=b.q_rot, k_pool=kv.k_ptr(i), v_pool=kv.v_ptr(i), **pos)
            self._attention(emit, i, n, pos)
            mm("o_proj", W(L + "o.packed"), W(L + "o.scales"), h, x=b.o16)
            mm("gate_up", W(L + "gate.packed"), W(L + "gate.scales"), b.a16, norm=W(L + "post_norm"),
               w2=W(L + "up.packed"), s2=W(L + "up.scales"))
            mm("down", W(L + "down.packed"), W(L + "down.scales"), h, x=b.a16)

    def _cut_tail(self, parts: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The last chunk, when it has more rows than the largest row-GEMV bucket but at most
        ``row_tail_tokens``, cut into chunks of that bucket's rows (the last one shorter): each reads the
        weights once at row-GEMV speed. Chunk invariance makes the cut a choice of speed only."""
        c0, n = parts[-1]
        b = self.row_buckets[-1] if self.row_buckets else 0
        if not b < n <= self.row_tail_tokens:
            return parts
        return parts[:-1] + chunks(c0, c0 + n, b)

    def graph_rows(self) -> int:
        """The most rows a chunk may have to replay a graph now (0: none; ``replay`` off, not captured,
        or no bucket within today's small_m_tokens and chunk_tokens)."""
        if self.graphs is None or not self.replay or not self.graphs.captured:
            return 0
        return max(usable_buckets(self.graphs.buckets, self.small_m_tokens, self.chunk_tokens), default=0)

    def __call__(self, tokens: list[int], p0: int = 0) -> int:
        """Enqueue the prefill of ``tokens`` at positions [p0, p0 + len(tokens)) of the sequence whose
        pages are loaded (positions before p0 already hold its K/V). Returns the device address of the
        last position's fp32 residual row, for the lm_head."""
        p1 = p0 + len(tokens)
        if not 0 <= p0 < p1 <= self.capacity:
            raise ValueError(f"prefill: positions [{p0}, {p1}), the sequence holds 0..{self.capacity}")
        self.host_tokens.array(np.int32)[:len(tokens)] = tokens
        check(cu.cuMemcpyHtoDAsync(self.bufs.tokens.ptr, self.host_tokens.ptr, 4 * len(tokens),
                                   self.shared.stream.handle), "prefill tokens")
        parts = self._cut_tail(chunks(p0, p1, self.chunk_tokens))
        graph_rows = self.graph_rows()
        replayed = [(c0, n) for c0, n in parts if n <= graph_rows]
        if replayed:
            self.graphs.stage([(c0, tokens[c0 - p0:c0 - p0 + n]) for c0, n in replayed])
        for c0, n in parts:
            if n <= graph_rows:
                self.graphs.run(c0, n)
            else:
                self._chunk(self._launch, n, self.bufs.tokens.ptr + 4 * (c0 - p0), dict(p0=c0, n=n))
        return self.bufs.h.ptr + 4 * self.dims.hidden * (p1 - 1 - parts[-1][0])

    def warm(self) -> None:
        """Run each chunk graph's kernels once (position 0 of the loaded page table), before ``capture``."""
        if self.graphs is not None:
            self.graphs.warm()

    def capture(self) -> None:
        """Capture the chunk graphs; short chunks replay them from now on."""
        if self.graphs is not None:
            self.graphs.capture()

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        self.bufs.free()
        self.host_tokens.free()


def by_steps(decoder, tokens: list[int], p0: int = 0, read_token: bool = False, read_logits: bool = False) -> None:
    """Token-by-token prefill of ``tokens`` at positions [p0, p1) through the decode step: steps p0 ..
    p1 - 1, step i feeding the token of position i; the last step's token / logits are copied out on
    request. Nothing here waits for the GPU."""
    decoder.reset(int(tokens[0]), p0, p0)
    for j, tok in enumerate(tokens):
        last = j == len(tokens) - 1
        decoder.step(p0 + j, feed=tok if j else None, read_token=read_token and last,
                     read_logits=read_logits and last)
