"""Prefill: the prompt through the tensor-core kernels (DESIGN.md section 6), in chunks of at most
``prefill.chunk_tokens`` tokens so the activation buffers stay bounded whatever the prompt length.

Per chunk of n tokens at positions [p0, p0 + n) (all launched with Programmatic Dependent Launch: every
kernel waits before touching what its predecessor wrote):
  embed_prefill   h[n, hidden] = f32(embed[tokens[p0 : p0 + n]])
  per layer       rmsnorm_prefill -> gemm qkv (+bias, f32) -> rope_append_prefill (q_rot; k, v into the
                  pages) -> attention_prefill (causal over keys [0, p0 + n), o16) -> gemm o_proj (h +=)
                  -> rmsnorm_prefill -> gemm gate/up (SwiGLU, a16) -> gemm down (h +=)
Chunks share nothing but the KV pages: a later chunk reads the earlier ones' keys from the cache. After
the last chunk the decode step's own lm_head_argmax kernel runs on the last prompt row of h, with the
device state set to (prompt[-1], P - 1, P - 1): it writes tokens_out[P - 1] (the first new token) and
advances the state to (token, P, P), where token-by-token prefill through the decode step would have
left it, so the decode loop that follows runs unchanged.

``by_steps`` is that token-by-token prefill through the decode step itself: the debugging baseline
(``CudaSession(prefill="decode")``: bit-identical to teacher-forced decode) and what a Decoder built
without a Prefiller uses (the CPU tests of the host logic)."""

from __future__ import annotations

import numpy as np

from ..codegen.gpu import DEFAULT as DEFAULT_GPU, GpuProfile
from ..codegen.kernels import attention_prefill, embed_prefill, gemm
from . import driver
from .driver import check, cu


def prefill_specs(dims, cfg, profile: GpuProfile = DEFAULT_GPU) -> dict:
    """Role -> kernel spec of the prefill chain; roles are prefixed ``prefill.`` so they sit beside the
    decode step's roles (runtime/decoder.py step_specs) in one kernel table."""
    norm = next(s for s in gemm.specs_for_model(dims, cfg) if isinstance(s, gemm.RmsnormPrefillSpec))
    rope, attn = attention_prefill.prefill_attention_specs(dims, cfg, profile)
    return {"prefill.embed": embed_prefill.specs_for_model(dims, cfg)[0], "prefill.rmsnorm": norm,
            **{f"prefill.{r}": s for r, s in gemm.model_gemms(dims, cfg.quant.group_size, profile).items()},
            "prefill.rope_append": rope, "prefill.attention": attn}


def chunks(prompt_len: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(p0, n) of each chunk: consecutive, every one chunk_tokens long but the last."""
    if prompt_len < 1 or chunk_tokens < 1:
        raise ValueError(f"chunks: prompt_len ({prompt_len}) and chunk_tokens ({chunk_tokens}) must be positive")
    return [(p0, min(chunk_tokens, prompt_len - p0)) for p0 in range(0, prompt_len, chunk_tokens)]


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


def buffer_bytes(dims, chunk_tokens: int, capacity: int) -> int:
    """Device bytes of a Prefiller: the chunk activations plus the prompt's token ids."""
    return sum(_nbytes(*sd) for sd in buffer_shapes(dims, chunk_tokens).values()) + 4 * capacity


class Prefiller:
    """``kernels`` holds the ``prefill_specs`` roles as ``(spec, Function)``; ``capacity`` is the longest
    prompt (the decoder's KV capacity). Called as ``prefill(decoder, prompt, read_token, read_logits)``
    like ``by_steps``; it launches on the decoder's stream over the decoder's weights, KV cache, rope
    tables and state, and never waits for the GPU."""

    def __init__(self, dims, kernels: dict, chunk_tokens: int, capacity: int):
        self.dims, self.kernels = dims, kernels
        self.chunk_tokens, self.capacity = chunk_tokens, capacity
        B = driver.DeviceBuffer
        self.bufs = {name: B(_nbytes(*sd)) for name, sd in buffer_shapes(dims, chunk_tokens).items()}
        self.tokens = B(4 * capacity)                     # int32 prompt ids, one copy per request
        self.host_tokens = driver.HostBuffer(4 * capacity)

    def _launch(self, stream, role: str, rows: int, **args) -> None:
        """One prefill kernel, its grid sized for a chunk of ``rows`` tokens, with PDL (each one waits
        before it touches its predecessor's output)."""
        spec, fn = self.kernels["prefill." + role]
        fn.launch(spec.launch(rows), stream, True, **args)

    def _chunk(self, dec, p0: int, n: int) -> None:
        """Enqueue every kernel of one chunk: afterwards bufs["h"] holds its rows' final residual."""
        W, kv, b, s = dec.weights.ptr, dec.kv, self.bufs, dec.stream
        h = b["h"]

        def mm(role, x, w, s_, y, w2=0, s2=0, bias=0):
            self._launch(s, role, n, x=x, w=w, s=s_, w2=w2, s2=s2, bias=bias, y=y, m=n)

        self._launch(s, "embed", n, tokens=self.tokens.ptr + 4 * p0, embed=W("embed"), h=h, err=dec.err, n=n)
        for i in range(self.dims.layers):
            L = f"L{i}."
            self._launch(s, "rmsnorm", n, h=h, w=W(L + "input_norm"), xn=b["xn"], m=n)
            mm("qkv", b["xn"], W(L + "qkv.packed"), W(L + "qkv.scales"), b["qkv"], bias=W(L + "qkv.bias"))
            self._launch(s, "rope_append", n, qkv=b["qkv"], rope_cos=dec.cos, rope_sin=dec.sin,
                         page_table=kv.page_table, q_rot=b["q_rot"], k_pool=kv.k_ptr(i), v_pool=kv.v_ptr(i),
                         p0=p0, n=n)
            self._launch(s, "attention", n, q_rot=b["q_rot"], k_pool=kv.k_ptr(i), v_pool=kv.v_ptr(i),
                         page_table=kv.page_table, o16=b["o16"], p0=p0, n=n)
            mm("o_proj", b["o16"], W(L + "o.packed"), W(L + "o.scales"), h)
            self._launch(s, "rmsnorm", n, h=h, w=W(L + "post_norm"), xn=b["xn"], m=n)
            mm("gate_up", b["xn"], W(L + "gate.packed"), W(L + "gate.scales"), b["a16"],
               w2=W(L + "up.packed"), s2=W(L + "up.scales"))
            mm("down", b["a16"], W(L + "down.packed"), W(L + "down.scales"), h)

    def __call__(self, dec, prompt: list[int], read_token: bool = False, read_logits: bool = False) -> int:
        """Enqueue the prefill of ``prompt`` (its pages must be reserved) and the first token's argmax;
        optionally copy that token / the last position's logits out (decoder step slot P - 1).
        Returns P, the steps prefill stands for."""
        P = len(prompt)
        if not 1 <= P <= self.capacity:
            raise ValueError(f"prefill: prompt of {P} tokens, the prefiller holds 1..{self.capacity}")
        dec.reset(int(prompt[-1]), P - 1, P - 1)   # the argmax below is "step P - 1" (drains the stream first)
        self.host_tokens.array(np.int32)[:P] = prompt
        s = dec.stream.handle
        check(cu.cuMemcpyHtoDAsync(self.tokens.ptr, self.host_tokens.ptr, 4 * P, s), "prefill tokens")
        dec.argmax_done.memset_u32(0, dec.stream)   # the decode embed re-arms it; no embed runs before this argmax
        plan = chunks(P, self.chunk_tokens)
        for p0, n in plan:
            self._chunk(dec, p0, n)
        dec.launch_lm_head(self.bufs["h"].ptr + 4 * self.dims.hidden * (P - 1 - plan[-1][0]))  # last prompt row
        dec.read_back(P - 1, read_token, read_logits)
        return P

    def close(self) -> None:
        for buf in (*self.bufs.values(), self.tokens, self.host_tokens):
            buf.free()


def by_steps(decoder, prompt: list[int], read_token: bool = False, read_logits: bool = False) -> int:
    """Token-by-token prefill through the decode step: steps 0 .. P-1, step i feeding ``prompt[i]``; the
    last step's token / logits are copied out on request. Nothing here waits for the GPU. Returns P."""
    decoder.reset(int(prompt[0]))
    for i, tok in enumerate(prompt):
        last = i == len(prompt) - 1
        decoder.step(i, feed=tok if i else None, read_token=read_token and last, read_logits=read_logits and last)
    return len(prompt)
