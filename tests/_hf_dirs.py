"""Tiny random Qwen2 HF directories for the pack tests: config.json + safetensors (one file or shards with an
index), bf16 / fp16 / fp32. safetensors' numpy frontend cannot write bf16, so the format is written here."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from nanoqwen.dims import ModelDims
from nanoqwen.nqfile import weight_tensors

TINY = ModelDims(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=384, vocab=512,
                 max_positions=2048, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)

_ST_DTYPE = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit pattern (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def stored_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a checkpoint of ``dtype`` holds for fp32 ``x``, as fp32 (the values pack must see)."""
    if dtype == "bf16":
        return (to_bf16_bits(x).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return x.astype(np.float16).astype(np.float32) if dtype == "fp16" else x.astype(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    header, blobs, pos = {}, [], 0
    for name, x in tensors.items():
        raw = (to_bf16_bits(x) if dtype == "bf16" else x.astype(np.float16 if dtype == "fp16" else np.float32))
        b = raw.tobytes()
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(x.shape), "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def random_weights(dims: ModelDims, seed: int = 0) -> dict[str, np.ndarray]:
    """fp32 weights with every HF tensor of ``dims`` (in file order), at realistic scales."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (_, shape) in weight_tensors(dims).items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.02
        out[name] = x + 1 if name.endswith("norm.weight") else x
    return out


def write_hf_dir(path: Path, dims: ModelDims = TINY, dtype: str = "bf16", shards: int = 1, seed: int = 0,
                 weights: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a Qwen2 HF directory; returns the fp32 weights as stored (after the dtype's rounding)."""
    path.mkdir(parents=True, exist_ok=True)
    weights = weights if weights is not None else random_weights(dims, seed)
    (path / "config.json").write_text(json.dumps(dims.to_hf_config()))
    names = list(weights)
    if shards == 1:
        write_safetensors(path / "model.safetensors", weights, dtype)
    else:
        weight_map = {}
        for s, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(path / fname, {names[i]: weights[names[i]] for i in part}, dtype)
            weight_map.update({names[i]: fname for i in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {n: stored_values(x, dtype) for n, x in weights.items()}
