"""Symmetric group-wise INT4 quantization and the ValueShuffle packing (DESIGN.md section 3). numpy only.

Weights W [N, K] (out, in) are split along K into groups of ``quant.group_size``; each group gets one fp16
scale = absmax / 7 (computed in fp32, then rounded to fp16), and q = clamp(rint(w / f32(scale16)), -7, 7).
Quantizing with the *stored* fp16 scale makes dequantization ``q * f32(scale16)`` exact and identical in
every implementation (a 4-bit integer times an 11-bit mantissa fits an fp32 mantissa). ``np.rint`` rounds
half to even. An all-zero group (or one whose scale underflows to fp16 zero, absmax < ~2e-7) has scale 0
and q 0. Groups with absmax below ~4e-4 get subnormal fp16 scales and hence coarser relative precision;
the per-element error stays <= scale16/2 except where such a rounded-down scale clamps |w/scale16| > 7.5.
q never takes the value -8, though unpack sign-extends all 16 nibbles.
"""

from __future__ import annotations

import numpy as np

from . import NanoqwenError
from .config import Quant, default

FP16_MAX = float(np.finfo(np.float16).max)  # 65504

# The INT4 packing is a fact of the file format, not a setting: the GEMV kernels decode exactly this order,
# and every .nanoqwen header records LAYOUT_ID. Logical lane k of 8 sits in nibble PACKED_LAYOUT.index(k):
# a word's nibbles hold [w0,w2,w4,w6,w1,w3,w5,w7], so even lanes fill the low 16 bits and odd lanes the high
# 16 (one LOP3 then yields a half2 pair).
LAYOUT_ID = 1
LAYOUT_NAME = "ValueShuffle"
PACKED_LAYOUT = (0, 2, 4, 6, 1, 3, 5, 7)
BIT_OFFSETS = tuple(4 * PACKED_LAYOUT.index(k) for k in range(8))  # bit offset of lane k: 0,16,4,20,8,24,12,28


class QuantError(NanoqwenError):
    pass


def _quant(quant: Quant | None) -> Quant:
    return quant if quant is not None else default().quant


def quantize(w: np.ndarray, group: int | None = None, name: str = "tensor",
             quant: Quant | None = None) -> tuple[np.ndarray, np.ndarray]:
    """w float [N, K] -> (q int8 [N, K] in -7..7, scales fp16 [N, K/group]). Rejects NaN/Inf and groups
    whose scale would overflow fp16 (absmax > 65504 * 7), naming ``name``."""
    quant = _quant(quant)
    group = quant.group_size if group is None else group
    if w.ndim != 2 or w.shape[1] % group:
        raise QuantError(f"{name}: shape {w.shape} is not [N, K] with K a multiple of the group size {group}")
    n, k = w.shape
    g = np.asarray(w, dtype=np.float32).reshape(n, k // group, group)
    absmax = np.abs(g).max(axis=2)  # NaN propagates through max; +-inf shows as inf
    if not np.isfinite(absmax).all():
        row, col = np.argwhere(~np.isfinite(absmax))[0]
        raise QuantError(f"{name}: non-finite weight (NaN or Inf) in row {row}, columns "
                         f"{col * group}..{(col + 1) * group - 1}")
    scale32 = absmax / np.float32(quant.qmax)
    if (scale32 > FP16_MAX).any():
        row, col = np.argwhere(scale32 > FP16_MAX)[0]
        raise QuantError(f"{name}: group absmax {absmax[row, col]:.6g} in row {row} exceeds the fp16 scale range "
                         f"(absmax/7 > {FP16_MAX:g})")
    scale16 = scale32.astype(np.float16)
    s = scale16.astype(np.float32)
    q = g / np.where(s > 0, s, np.float32(1))[..., None]
    np.rint(q, out=q)
    q[s == 0] = 0  # all-zero groups, and nonzero groups whose scale underflowed to fp16 zero
    np.clip(q, -quant.qmax, quant.qmax, out=q)
    return q.astype(np.int8).reshape(n, k), scale16


def pack(q: np.ndarray) -> np.ndarray:
    """q int8 [N, K] -> uint32 [N, K/8]: logical lane k of each 8 at bit offset ``BIT_OFFSETS[k]``,
    nibble = q & 0xF (two's complement)."""
    if q.ndim != 2 or q.shape[1] % 8:
        raise QuantError(f"pack: shape {q.shape} is not [N, K] with K a multiple of 8")
    nib = (q.astype(np.uint8) & np.uint8(0xF)).reshape(q.shape[0], -1, 8)
    out = np.zeros(nib.shape[:2], dtype=np.uint32)
    for lane, shift in enumerate(BIT_OFFSETS):
        out |= nib[:, :, lane].astype(np.uint32) << np.uint32(shift)
    return out


def unpack(packed: np.ndarray) -> np.ndarray:
    """uint32 [N, K/8] -> int8 [N, K], every nibble sign-extended (0x8..0xF -> -8..-1)."""
    if packed.ndim != 2 or packed.dtype != np.uint32:
        raise QuantError(f"unpack: expected uint32 [N, K/8], got {packed.dtype} {packed.shape}")
    n, w = packed.shape
    q = np.empty((n, w, 8), dtype=np.int8)
    for lane, shift in enumerate(BIT_OFFSETS):
        nib = ((packed >> np.uint32(shift)) & np.uint32(0xF)).astype(np.int8)
        q[:, :, lane] = (nib ^ 8) - 8
    return q.reshape(n, w * 8)


def dequantize(packed: np.ndarray, scales: np.ndarray, quant: Quant | None = None) -> np.ndarray:
    """(uint32 [N, K/8], fp16 [N, K/group]) -> float32 [N, K], exactly q * f32(scale)."""
    quant = _quant(quant)
    q = unpack(packed)
    n, k = q.shape
    group = k // scales.shape[1] if scales.ndim == 2 and scales.shape[1] else 0
    if scales.shape != (n, k // quant.group_size) or group != quant.group_size:
        raise QuantError(f"dequantize: scales shape {scales.shape} does not match weights [{n}, {k}] "
                         f"with group {quant.group_size}")
    w = q.reshape(n, k // group, group).astype(np.float32) * scales.astype(np.float32)[..., None]
    return w.reshape(n, k)


def to_fp16(x: np.ndarray, name: str = "tensor") -> np.ndarray:
    """float -> fp16 for the raw tensors (embeddings, norms, biases, lm_head). Values beyond the fp16 range,
    NaN and Inf are rejected rather than saturated: changing a weight silently is worse than a clear error,
    and real Qwen2.5 checkpoints stay well inside fp16."""
    x32 = np.asarray(x, dtype=np.float32)
    peak = np.abs(x32).max(initial=0.0)
    if not np.isfinite(peak):
        raise QuantError(f"{name}: non-finite value (NaN or Inf)")
    if peak > FP16_MAX:
        raise QuantError(f"{name}: value {peak:.6g} is outside the fp16 range (|x| <= {FP16_MAX:g})")
    return x32.astype(np.float16)
