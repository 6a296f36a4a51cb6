"""Model dimensions come from the model (HF config.json or a .nanoqwen header), never from constants:
kernels are specialized to these numbers at JIT time."""

from __future__ import annotations

import math
from dataclasses import dataclass, asdict
from pathlib import Path

from . import NanoqwenError
from .safefile import read_json


class DimsError(NanoqwenError):
    pass


# Upper bounds on each dimension, far above any Qwen2.5 (72B: hidden 8192, 80 layers, 64 heads, intermediate
# 29568, vocab 152064, 131072 positions) yet low enough that a hostile header or config.json cannot make a
# reader build millions of table entries or size arrays from them before anything else is checked.
LIMITS = {"hidden": 1 << 16, "layers": 1 << 10, "heads": 1 << 10, "kv_heads": 1 << 10, "head_dim": 1 << 10,
          "intermediate": 1 << 18, "vocab": 1 << 22, "max_positions": 1 << 22}
# The float fields: finite, positive, and below these (an eps near 1 or above would flatten every norm).
FLOAT_LIMITS = {"rope_theta": 1e12, "rms_eps": 1e-1}
# config.json's name of each field
HF_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
           "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
           "vocab": "vocab_size", "max_positions": "max_position_embeddings", "rope_theta": "rope_theta",
           "rms_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}


def check_field(name: str, value, label: str | None = None) -> None:
    """``value`` of dims field ``name`` has the right type and lies within its limits; the error names the
    field as ``label`` (default: ``name``)."""
    label = label or name
    if name in LIMITS:
        if not isinstance(value, int) or isinstance(value, bool):
            raise DimsError(f"{label}: must be an integer, got {value!r}")
        if not 0 < value <= LIMITS[name]:
            raise DimsError(f"{label}: {value} is outside [1, {LIMITS[name]}]")
    elif name in FLOAT_LIMITS:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise DimsError(f"{label}: must be a number, got {value!r}")
        if not (math.isfinite(value) and 0 < value <= FLOAT_LIMITS[name]):
            raise DimsError(f"{label}: {value} is not a finite number in (0, {FLOAT_LIMITS[name]:g}]")
    elif not isinstance(value, bool):
        raise DimsError(f"{label}: must be true or false, got {value!r}")


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool

    def __post_init__(self):
        for name in HF_KEYS:
            check_field(name, getattr(self, name), f"model dims: {name}")
        if self.heads % self.kv_heads:
            raise DimsError(f"model dims: heads ({self.heads}) not a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise DimsError(f"model dims: head_dim must be even for rotate-half RoPE, got {self.head_dim}")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def gqa(self) -> int:
        return self.heads // self.kv_heads

    def check_quantizable(self, group_size: int) -> None:
        """Every INT4 GEMV input dimension (hidden, q_dim, intermediate) must split into whole groups."""
        for name, k in (("hidden", self.hidden), ("q_dim", self.q_dim), ("intermediate", self.intermediate)):
            if k % group_size:
                raise DimsError(f"model dims: {name}={k} is not a multiple of the quant group size {group_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelDims":
        """Every field type- and range-checked (check_field) before anything is sized from it; an error names
        ``source`` and the config.json key."""
        if not isinstance(cfg, dict):
            raise DimsError(f"{source}: must hold a JSON object, not a {type(cfg).__name__}")
        arch = cfg.get("architectures") or []
        if cfg.get("model_type") != "qwen2" and not (isinstance(arch, list) and "Qwen2ForCausalLM" in arch):
            raise DimsError(f"{source}: not a Qwen2 model (model_type={cfg.get('model_type')!r}, "
                            f"architectures={arch!r})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DimsError(f"{source}: hidden_act must be silu, got {cfg['hidden_act']!r}")
        if cfg.get("use_sliding_window", False):
            raise DimsError(f"{source}: sliding-window attention is not supported")
        rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        rope = cfg.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise DimsError(f"{source}: {rope_key}: must be an object, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise DimsError(f"{source}: rope scaling {rope.get('rope_type')!r} is not supported")
        if cfg.get("rope_theta") is None and rope.get("rope_theta") is not None:
            cfg = {**cfg, "rope_theta": rope["rope_theta"]}

        def field(name: str, default=None):
            key = HF_KEYS[name]
            value = cfg.get(key)
            if value is None:  # absent or null: the default, where there is one
                if default is None:
                    raise DimsError(f"{source}: missing field {key!r}")
                value = default
            check_field(name, value, f"{source}: {key}")
            return value

        hidden, heads = field("hidden"), field("heads")
        values = dict(hidden=hidden, layers=field("layers"), heads=heads, kv_heads=field("kv_heads", heads),
                      head_dim=field("head_dim", hidden // heads), intermediate=field("intermediate"),
                      vocab=field("vocab"), max_positions=field("max_positions", 32768),
                      rope_theta=float(field("rope_theta", 10000.0)), rms_eps=float(field("rms_eps", 1e-6)),
                      tie_embeddings=field("tie_embeddings", False))
        try:
            return cls(**values)
        except DimsError as e:
            raise DimsError(f"{source}: {e}") from None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelDims":
        p = Path(path) / "config.json"
        return cls.from_hf_config(read_json(p), str(p))

    def to_hf_config(self) -> dict:
        """A config.json for transformers' Qwen2ForCausalLM with these dims (test models, synthetic 7B)."""
        return {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "hidden_size": self.hidden, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate, "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps, "tie_word_embeddings": self.tie_embeddings,
            "use_sliding_window": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
        }


# Qwen2.5-Coder-7B-Instruct (and Qwen2.5-7B): the shapes the benchmarks and the synthetic 7B use.
QWEN25_7B = ModelDims(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
                      vocab=152064, max_positions=32768, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)
