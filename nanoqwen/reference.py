"""The numpy reference model: the INT4 simulation of the whole Qwen2 forward that every GPU test is
judged against. It computes exactly the numerics contract of docs/architecture.md: fp32 arithmetic, the
exact dequantized INT4 weights, `f16()` (round-to-nearest-even with saturation, cvt.rn.satfinite) at the
GEMV inputs, at the attention output and in the fp16 KV cache.

One definition of each op lives here (`f16`, `rmsnorm`, `rmsnorm_f16`, `gemv`, `rope_tables`, `rope`,
`attention`, `swiglu`, `swiglu_f16`, `decoder_layer`); the GPU unit and layer tests call these.
`fp16=False` drops every fp16 rounding (fp32 end to end, fp32 KV cache): the structural check against
transformers in fp32, which must then agree to ~1e-6.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from . import NanoqwenError
from .dims import ModelDims
from .nqfile import INT4, NanoqwenFile, expected_tensors
from .quant import dequantize, pack, quantize, to_fp16

FP16_MAX = np.float32(65504.0)
MEMINFO = Path("/proc/meminfo")
SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_FS = Path("/sys/fs/cgroup")


class ReferenceModelError(NanoqwenError):
    pass


# ---------------------------------------------------------------- ops (shared with the GPU tests)

def f16(x) -> np.ndarray:
    """fp32 -> fp16 as cvt.rn.satfinite.f16.f32: nearest-even, |x| beyond 65504 (and +-inf) -> +-65504,
    NaN stays NaN (np.clip propagates NaN)."""
    return np.clip(np.asarray(x, dtype=np.float32), -FP16_MAX, FP16_MAX).astype(np.float16)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def rmsnorm(h: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """fp32 `h * rsqrt(mean(h*h) + eps) * f32(w)` over the last axis."""
    h = _f32(h)
    r = np.float32(1.0) / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + np.float32(eps))
    return h * r * _f32(w)


def rmsnorm_f16(h: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The GEMV input: `f16(rmsnorm(h) * w)`."""
    return f16(rmsnorm(h, w, eps))


def gemv(w: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """`W x (+ bias)` in fp32 for x [..., K] (fp16 or fp32) and W [N, K] the dequantized weight -> [..., N]."""
    y = _f32(x) @ _f32(w).T
    return y + _f32(bias) if bias is not None else y


def rope_tables(dims: ModelDims, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each fp32 [max_pos, head_dim/2]: `inv_freq[i] = theta^(-2i/head_dim)` and
    `angle = pos * inv_freq[i]` in float64, then cast. Column i serves lanes i and i + head_dim/2
    (rotate-half). The runtime uploads these same arrays."""
    half = dims.head_dim // 2
    inv_freq = float(dims.rope_theta) ** (-2.0 * np.arange(half, dtype=np.float64) / dims.head_dim)
    angle = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE in fp32 on x [T, heads, head_dim] at absolute `positions` [T]."""
    x = _f32(x)
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal GQA attention of rotated queries q [T, heads, D] (fp32) over a cache k, v [S, kv_heads, D]
    (fp16 or fp32, widened to fp32): query t sees cache rows 0..positions[t]. Scores `q.k / sqrt(D)`,
    softmax and `sum p v` in fp32 -> [T, heads, D] fp32. Query head h reads KV head h // (heads/kv_heads)."""
    T, H, D = q.shape
    S, KVH, _ = k.shape
    G = H // KVH
    # contiguous [KVH, rows, D] stacks, so that matmul goes to BLAS (strided stacks take numpy's slow loop)
    qg = np.ascontiguousarray(_f32(q).reshape(T, KVH, G, D).transpose(1, 2, 0, 3)).reshape(KVH, G * T, D)
    kk = np.ascontiguousarray(_f32(k).transpose(1, 0, 2))                # [KVH, S, D]
    vv = np.ascontiguousarray(_f32(v).transpose(1, 0, 2))                # [KVH, S, D]
    scores = (qg @ kk.transpose(0, 2, 1)).reshape(KVH, G, T, S) / np.float32(np.sqrt(D))
    visible = np.arange(S)[None, :] <= np.asarray(positions)[:, None]    # [T, S]
    scores = np.where(visible, scores, np.float32(-np.inf))
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = p.reshape(KVH, G * T, S) @ vv                                    # [KVH, G*T, D]
    return o.reshape(KVH, G, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """fp32 `silu(g) * u`, `silu(g) = g / (1 + exp(-g))` (exp overflow for g << 0 gives -0, as on the GPU)."""
    g = _f32(g)
    with np.errstate(over="ignore"):
        return g / (np.float32(1.0) + np.exp(-g)) * _f32(u)


def swiglu_f16(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The down_proj input: `f16(silu(g) * u)`."""
    return f16(swiglu(g, u))


# ---------------------------------------------------------------- weights

def tensor_names(dims: ModelDims) -> list[str]:
    """The model's HF tensor names (the .nanoqwen file's list, without the INT4 `.scales` entries)."""
    return [n for n in expected_tensors(dims) if not n.endswith(".scales")]


class Fp32Weights:
    """HF tensor name -> fp32 array, INT4 weights exactly `q * f32(scale)`. `cache=False` dequantizes on
    every access, so 7B-sized layers can be simulated one at a time without holding 28 GB of fp32."""

    def __init__(self, dims: ModelDims, get: Callable[[str], np.ndarray], cache: bool = True):
        self.dims = dims
        self._get = get
        self._cache: dict[str, np.ndarray] | None = {} if cache else None

    def __getitem__(self, name: str) -> np.ndarray:
        if self._cache is None:
            return self._get(name)
        if name not in self._cache:
            self._cache[name] = self._get(name)
        return self._cache[name]

    def names(self) -> list[str]:
        return tensor_names(self.dims)

    def to_dict(self) -> dict[str, np.ndarray]:
        """Every tensor, fp32 (e.g. to load the same numbers into transformers)."""
        return {n: self[n] for n in self.names()}

    @classmethod
    def from_file(cls, path, cache: bool = True) -> "Fp32Weights":
        """A .nanoqwen file (path or open NanoqwenFile): exactly the numbers the GPU sees."""
        f = path if isinstance(path, NanoqwenFile) else NanoqwenFile(path)

        def get(name: str) -> np.ndarray:
            if f.tensors[name].tag == INT4:
                return dequantize(*f.int4(name))
            return f.array(name).astype(np.float32)
        return cls(f.dims, get, cache)

    @classmethod
    def from_dict(cls, dims: ModelDims, arrays: Mapping[str, np.ndarray]) -> "Fp32Weights":
        """Float arrays used as they are (no quantization): e.g. fp32 structural checks."""
        missing = [n for n in tensor_names(dims) if n not in arrays]
        if missing:
            raise ReferenceModelError(f"weights: tensor {missing[0]} is missing ({len(missing)} missing)")
        return cls(dims, lambda n: _f32(arrays[n]))

    @classmethod
    def quantized(cls, dims: ModelDims, arrays: Mapping[str, np.ndarray]) -> "Fp32Weights":
        """What packing `arrays` into a .nanoqwen file yields, without the file: INT4 tensors go through
        quantize -> pack -> dequantize, the rest through fp16."""
        tags = expected_tensors(dims)

        def get(name: str) -> np.ndarray:
            if tags[name][0] == INT4:
                q, s = quantize(_f32(arrays[name]), name=name)
                return dequantize(pack(q), s)
            return to_fp16(arrays[name], name).astype(np.float32)
        return cls(dims, get)


# ---------------------------------------------------------------- memory

def memory_needed(dims: ModelDims, max_seq: int, fp16: bool = True) -> int:
    """Bytes a Reference of `dims` holds once every weight has been read: each tensor fp32 at its logical
    shape (Fp32Weights caches them), the KV cache and the RoPE tables, plus the peak of dequantizing the
    largest INT4 weight (its int8 values and an fp32 copy beside the result: 5 more bytes per weight).
    A call's activations come on top (small beside the weights unless the prompt is thousands of tokens)."""
    tensors = expected_tensors(dims)
    weights = sum(math.prod(tensors[n][1]) for n in tensor_names(dims))
    int4 = max((math.prod(shape) for tag, shape in tensors.values() if tag == INT4), default=0)
    kv = 2 * dims.layers * max_seq * dims.kv_dim * (2 if fp16 else 4)
    rope = 2 * max_seq * (dims.head_dim // 2) * 4
    return 4 * weights + kv + rope + 5 * int4


def available_memory() -> int | None:
    """Bytes this process can still take: MemAvailable of /proc/meminfo (or, without /proc, the physical
    memory: an upper bound), capped by a cgroup v2 memory limit (a container's); None when unknown."""
    avail = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def _cgroup_room() -> int | None:
    """The least `memory.max - memory.current` over this process's cgroup v2 and its ancestors."""
    try:
        rel = next(ln[3:] for ln in SELF_CGROUP.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    leaf, rooms = CGROUP_FS / rel.strip().lstrip("/"), []
    for d in (leaf, *leaf.parents):
        if not d.is_relative_to(CGROUP_FS):
            break
        try:
            limit = (d / "memory.max").read_text().strip()
            if limit != "max":
                rooms.append(int(limit) - int((d / "memory.current").read_text()))
        except (OSError, ValueError):
            pass
    return min(rooms, default=None)


def check_memory(dims: ModelDims, max_seq: int, fp16: bool = True, available: int | None = None) -> None:
    """Refuse, in one line, a model whose reference simulation would not fit in memory: the alternative is
    the kernel's OOM killer, without a word, after minutes of dequantizing. `available` defaults to
    available_memory(); an unknown amount is not checked."""
    need = memory_needed(dims, max_seq, fp16)
    avail = available_memory() if available is None else available
    if avail is not None and need > avail:
        raise ReferenceModelError(f"reference backend: the model needs {need / 1e9:.3g} GB of memory as fp32 "
                                  f"({need} bytes with the KV cache), {avail / 1e9:.3g} GB ({avail} bytes) "
                                  f"available; use the cuda backend (a GPU)")


# ---------------------------------------------------------------- the model

def decoder_layer(w: Fp32Weights, i: int, h: np.ndarray, positions: np.ndarray, k_cache: np.ndarray,
                  v_cache: np.ndarray, cos: np.ndarray, sin: np.ndarray, fp16: bool = True,
                  trace: dict | None = None) -> np.ndarray:
    """One decoder block on the fp32 residual h [T, hidden] at absolute `positions` [T] (consecutive).
    Writes this block's k_rot, v into k_cache/v_cache [max_seq, kv_heads, D] rows `positions` (cast to the
    cache dtype: fp16 saturating, or fp32) and attends over rows 0..positions[-1]. Returns the new h.
    `trace`, if given, receives every intermediate under the contract's names."""
    d = w.dims
    T = h.shape[0]
    cast = f16 if fp16 else _f32
    p = f"model.layers.{i}."
    a = p + "self_attn."
    xn = cast(rmsnorm(h, w[p + "input_layernorm.weight"], d.rms_eps))
    q = gemv(w[a + "q_proj.weight"], xn, w[a + "q_proj.bias"]).reshape(T, d.heads, d.head_dim)
    k = gemv(w[a + "k_proj.weight"], xn, w[a + "k_proj.bias"]).reshape(T, d.kv_heads, d.head_dim)
    v = gemv(w[a + "v_proj.weight"], xn, w[a + "v_proj.bias"]).reshape(T, d.kv_heads, d.head_dim)
    q_rot = rope(q, cos, sin, positions)
    k_rot = rope(k, cos, sin, positions)
    k_cache[positions] = cast(k_rot)
    v_cache[positions] = cast(v)
    end = int(positions[-1]) + 1
    o = attention(q_rot, k_cache[:end], v_cache[:end], positions)
    o16 = cast(o.reshape(T, d.q_dim))
    h_attn = h + gemv(w[a + "o_proj.weight"], o16)
    xn2 = cast(rmsnorm(h_attn, w[p + "post_attention_layernorm.weight"], d.rms_eps))
    g = gemv(w[p + "mlp.gate_proj.weight"], xn2)
    u = gemv(w[p + "mlp.up_proj.weight"], xn2)
    act = cast(swiglu(g, u))
    h_out = h_attn + gemv(w[p + "mlp.down_proj.weight"], act)
    if trace is not None:
        trace.update(h_in=h, xn=xn, q=q, k=k, v=v, q_rot=q_rot, k_rot=k_rot, o=o, o16=o16, h_attn=h_attn,
                     xn2=xn2, g=g, u=u, a=act, h=h_out)
    return h_out


def _stack(rows: list[dict]) -> dict:
    """Per-row traces -> one trace whose every entry is [T, ...] (the rows in order)."""
    out = {k: np.concatenate([r[k] for r in rows]) for k in ("embed", "xf", "logits")}
    out["layers"] = [{k: np.concatenate([r["layers"][i][k] for r in rows]) for k in layer}
                     for i, layer in enumerate(rows[0]["layers"])]
    return out


class Reference:
    """The whole model with a KV cache. `prefill(tokens)` starts a sequence, `extend(tokens)` continues it
    (chunked prefill), `decode(token)` is one step; each returns fp32 logits. With `trace={}` passed, the
    call fills trace["embed"], trace["layers"][i] (see decoder_layer), trace["xf"], trace["logits"].
    The KV cache is `k_cache[i]`, `v_cache[i]` [max_seq, kv_heads, head_dim] (fp16; fp32 when fp16=False),
    rows 0..pos-1 valid; `kv(i)` returns those rows."""

    def __init__(self, weights: Fp32Weights, fp16: bool = True, max_seq: int | None = None):
        self.w = weights
        self.dims = d = weights.dims
        self.fp16 = fp16
        self.max_seq = min(d.max_positions, 4096) if max_seq is None else max_seq
        check_memory(d, self.max_seq, fp16)   # before a byte is allocated
        self.cos, self.sin = rope_tables(d, self.max_seq)
        dtype = np.float16 if fp16 else np.float32
        self.k_cache = [np.zeros((self.max_seq, d.kv_heads, d.head_dim), dtype) for _ in range(d.layers)]
        self.v_cache = [np.zeros_like(c) for c in self.k_cache]
        self.pos = 0

    @classmethod
    def from_file(cls, path: str | Path, fp16: bool = True, max_seq: int | None = None) -> "Reference":
        return cls(Fp32Weights.from_file(path), fp16, max_seq)

    def sequence(self, max_seq: int) -> "Reference":
        """Another sequence over the same weights and RoPE tables: a K/V cache of its own of ``max_seq``
        (<= this one's) positions, empty. Several of them are the server's concurrent sequences."""
        if not 1 <= max_seq <= self.max_seq:
            raise ReferenceModelError(f"reference: a sequence of {max_seq} positions, the tables hold {self.max_seq}")
        seq = copy.copy(self)
        d, dtype = self.dims, self.k_cache[0].dtype
        seq.max_seq = max_seq
        seq.k_cache = [np.zeros((max_seq, d.kv_heads, d.head_dim), dtype) for _ in range(d.layers)]
        seq.v_cache = [np.zeros_like(c) for c in seq.k_cache]
        seq.pos = 0
        return seq

    def reset(self) -> None:
        self.pos = 0

    def kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.k_cache[layer][:self.pos], self.v_cache[layer][:self.pos]

    def resume(self, k: list[np.ndarray], v: list[np.ndarray]) -> None:
        """Continue a sequence whose first n positions' K/V are given per layer ([n, kv_heads, head_dim],
        as ``kv`` returns them): the next ``extend`` starts at position n."""
        n = len(k[0])
        for i in range(self.dims.layers):
            self.k_cache[i][:n], self.v_cache[i][:n] = k[i], v[i]
        self.pos = n

    def extend(self, tokens, trace: dict | None = None) -> np.ndarray:
        """Logits [T, vocab] after appending ``tokens`` at positions pos..pos+T-1. Row invariant by
        construction: each row is one ``decode`` step (the same numpy calls on the same shapes), so a
        position's K/V and logits are bitwise the same whether it came in a prompt, a verify block or a
        single step, whatever else was computed beside it (DESIGN.md section 12). A multi-row matmul would
        round each row by the BLAS kernel chosen for that M, and a near tie could then fall either way."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        d = self.dims
        if not len(tokens):
            raise ReferenceModelError("reference: no tokens given")
        if self.pos + len(tokens) > self.max_seq:
            raise ReferenceModelError(f"reference: sequence of {self.pos + len(tokens)} tokens exceeds max_seq "
                                 f"{self.max_seq}")
        if tokens.min() < 0 or tokens.max() >= d.vocab:
            raise ReferenceModelError(f"reference: token id out of range [0, {d.vocab})")
        rows = [{} if trace is not None else None for _ in tokens]
        logits = np.concatenate([self._row(int(t), rt) for t, rt in zip(tokens, rows)])
        if trace is not None:
            trace.update(_stack(rows))
        return logits

    def _row(self, token: int, trace: dict | None) -> np.ndarray:
        """One position: logits [1, vocab] for ``token`` at ``self.pos``, its K/V appended."""
        d, w = self.dims, self.w
        positions = np.array([self.pos])
        h = w["model.embed_tokens.weight"][[token]].astype(np.float32)
        layers = [] if trace is not None else None
        if trace is not None:
            trace.update(embed=h, layers=layers)
        for i in range(d.layers):
            lt = {} if layers is not None else None
            h = decoder_layer(w, i, h, positions, self.k_cache[i], self.v_cache[i], self.cos, self.sin,
                              self.fp16, lt)
            if layers is not None:
                layers.append(lt)
        self.pos += 1
        xf = rmsnorm(h, w["model.norm.weight"], d.rms_eps)
        xf = f16(xf) if self.fp16 else xf
        head = w["model.embed_tokens.weight" if d.tie_embeddings else "lm_head.weight"]
        logits = gemv(head, xf)
        if trace is not None:
            trace.update(xf=xf, logits=logits)
        return logits

    def prefill(self, tokens, trace: dict | None = None) -> np.ndarray:
        """Logits [T, vocab] for every prompt position, from an empty cache."""
        self.reset()
        return self.extend(tokens, trace)

    def decode(self, token: int, trace: dict | None = None) -> np.ndarray:
        """Logits [vocab] after appending one token."""
        return self.extend([token], trace)[0]

    def generate_greedy(self, prompt_tokens, n: int, stop_tokens=(), margins: list | None = None) -> list[int]:
        """n greedy tokens after the prompt (argmax, lowest index on ties), stopping early after a stop token.
        `margins`, if given, receives each step's top-1 minus top-2 logit."""
        logits = self.prefill(prompt_tokens)[-1]
        out: list[int] = []
        while True:
            tok = int(np.argmax(logits))
            if margins is not None:
                top2 = np.partition(logits, -2)[-2:]
                margins.append(float(top2[1] - top2[0]))
            out.append(tok)
            if len(out) == n or tok in stop_tokens:
                return out
            logits = self.decode(tok)
