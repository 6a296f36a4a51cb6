"""Model dimensions come from the model (HF config.json or a .nanoqwen header), never from constants:
kernels are specialized to these numbers at JIT time."""

from __future__ import annotations

import json
from dataclasses import dataclass, asdict
from pathlib import Path

from . import NanoqwenError


class DimsError(NanoqwenError):
    pass


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
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_positions"):
            if getattr(self, name) <= 0:
                raise DimsError(f"model dims: {name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise DimsError(f"model dims: heads ({self.heads}) not a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise DimsError(f"model dims: head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise DimsError("model dims: rope_theta and rms_eps must be positive")

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
        arch = cfg.get("architectures") or []
        if cfg.get("model_type") != "qwen2" and "Qwen2ForCausalLM" not in arch:
            raise DimsError(f"{source}: not a Qwen2 model (model_type={cfg.get('model_type')!r}, "
                            f"architectures={arch})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DimsError(f"{source}: hidden_act must be silu, got {cfg['hidden_act']!r}")
        if cfg.get("use_sliding_window", False):
            raise DimsError(f"{source}: sliding-window attention is not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise DimsError(f"{source}: rope scaling {rope.get('rope_type')!r} is not supported")
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        try:
            heads = int(cfg["num_attention_heads"])
            dims = cls(
                hidden=int(cfg["hidden_size"]),
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                max_positions=int(cfg.get("max_position_embeddings", 32768)),
                rope_theta=float(theta if theta is not None else 10000.0),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise DimsError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise DimsError(f"{source}: bad field value: {e}") from None
        return dims

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelDims":
        p = Path(path) / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except OSError as e:
            raise DimsError(f"{p}: cannot read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise DimsError(f"{p}: invalid JSON: {e}") from None
        return cls.from_hf_config(cfg, str(p))

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
