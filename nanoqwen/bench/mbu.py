"""Byte accounting of one decode step (DESIGN.md section 5): the fewest bytes each region of the step must
move through device memory, each input read once and each output written once, and what that means
against a measured bandwidth (MBU = bytes / time / copy bandwidth).

Regions are the ITL breakdown's (bench/itl.py), in step order; per-layer regions are summed over the
layers. Counted per region:
  weights      INT4 packed + fp16 scales (GemvInt4Spec.weight_bytes), the fp16 lm_head, the embedding row
  kv           K and V of every KV head at the current context (attention covers ``context`` tokens,
               the new one included) plus the page-table entries
  activations  vectors in and out (GemvInt4Spec.io_bytes: fp32 h + fp16 norm weight for a
               normed input, fp32 residual read + written, fp16 bias), q/k/v in rope_append and the
               fp16 k/v it appends (the QKV GEMV's outputs where it does rope_append's work itself,
               gemv.with_rope: then the rope_append region is empty), q_rot and o16 around attention, the fp32
               logits lm_head writes
The attention split partials stay out: they live between two kernels of one region, in L2.
For the 7B at small context this is 3.37 GB of INT4 weights + 1.09 GB of lm_head, ~4.46 GB per token."""

from __future__ import annotations

from ..codegen.kernels import gemv
from ..config import Config, default
from ..dims import ModelDims

REGIONS = ("embed", "qkv_gemv", "rope_append", "paged_attention", "o_proj", "gate_up_gemv", "down", "lm_head_argmax")
# decoder role (runtime/decoder.step_specs) -> region; decode and combine are one region
ROLE_REGION = {"embed": "embed", "qkv_norm": "qkv_gemv", "qkv": "qkv_gemv", "rope_append": "rope_append",
               "attention_decode": "paged_attention", "attention_combine": "paged_attention",
               "o_proj": "o_proj", "gate_up_norm": "gate_up_gemv", "gate_up": "gate_up_gemv", "down": "down",
               "lm_head": "lm_head_argmax"}   # a GEMV's RMSNorm run apart (multirow.norm_apart) is its region's
GEMV_REGION = {"qkv": "qkv_gemv", "o_proj": "o_proj", "gate_up": "gate_up_gemv", "down": "down"}

F16, F32, I32 = 2, 4, 4


def region_bytes(dims: ModelDims, context: int, cfg: Config | None = None) -> dict[str, dict[str, int]]:
    """region -> {"weights", "kv", "activations", "total"} bytes of one decode step whose attention
    covers ``context`` tokens."""
    cfg = cfg or default()
    d, L = dims, dims.layers
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    out = {r: {"weights": 0, "kv": 0, "activations": 0} for r in REGIONS}
    out["embed"].update(weights=d.hidden * F16, activations=d.hidden * F32 + I32)   # one row in, fp32 h out
    fused = False
    for role, region in GEMV_REGION.items():
        spec = gemv.role_spec(role, d, cfg)
        if role == "qkv":   # the one-row step's QKV GEMV as runtime/decoder.step_specs makes it
            spec = gemv.with_rope(spec, d, cfg.kv_cache.page_size) or spec
            fused = spec.epilogue == "rope"
        out[region]["weights"] = L * spec.weight_bytes()
        out[region]["activations"] = L * spec.io_bytes()
    if not fused:
        qkv_n = d.q_dim + 2 * d.kv_dim
        rope = qkv_n * F32 + 2 * (d.head_dim // 2) * F32 + d.q_dim * F32 + 2 * d.kv_dim * F16   # in, cos/sin, out
        out["rope_append"]["activations"] = L * rope
    pages = -(-context // cfg.kv_cache.page_size)
    out["paged_attention"]["kv"] = L * (2 * d.kv_dim * context * F16 + pages * I32)
    out["paged_attention"]["activations"] = L * (d.q_dim * F32 + d.q_dim * F16)           # q_rot in, o16 out
    out["lm_head_argmax"].update(weights=d.vocab * d.hidden * F16,
                          activations=d.hidden * (F32 + F16) + d.vocab * F32)              # h, norm in; logits out
    for r in out.values():
        r["total"] = r["weights"] + r["kv"] + r["activations"]
    return out


def step_bytes(dims: ModelDims, context: int, cfg: Config | None = None) -> int:
    return sum(r["total"] for r in region_bytes(dims, context, cfg).values())


def floor_ms(nbytes: int, bandwidth_GBps: float) -> float:
    """Time to move ``nbytes`` at the copy bandwidth: the floor no implementation beats."""
    return nbytes / (bandwidth_GBps * 1e9) * 1e3


def mbu(nbytes: int, seconds: float, bandwidth_GBps: float) -> float:
    """Fraction of the copy bandwidth achieved when ``nbytes`` move in ``seconds``."""
    return nbytes / seconds / (bandwidth_GBps * 1e9) if seconds > 0 else 0.0
