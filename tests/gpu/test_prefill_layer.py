"""One decoder layer of prefill through the prefill kernels, in two chunks, against
nanoqwen.reference.decoder_layer on the same INT4 weights (fresh random ones each run), for the tiny model
and one 7B-shaped layer:

  rmsnorm_prefill -> gemm_int4 qkv (+bias, f32) -> rope_append_prefill (pages) -> attention_prefill (o16)
  -> gemm_int4 o_proj (+= h) -> rmsnorm_prefill -> gemm_int4 gate/up (SwiGLU, f16) -> gemm_int4 down (+= h)

Every intermediate is checked (so a failure names the stage): ||out - ref|| / ||ref|| <= LAYER_TOL 3e-3.
The kernels and the reference round at the same places (fp16 xn, o16, a); the remaining differences are
the GEMM's fp16 rounding of q * scale (relative 2^-11 per weight) and an occasional one-ulp flip of an
fp16 intermediate, so the observed errors are expected near 1e-4 .. 1e-3. Pages are shuffled, poisoned
outside the sequence, and outputs are poisoned before the launches.
"""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import codegen, config, quant
from nanoqwen import reference as R
from nanoqwen.codegen.kernels import attention_prefill as AP
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.runtime.paged_kv import KVLayout, PageTable
from nanoqwen.testmodels import tiny_dims

pytestmark = pytest.mark.gpu

CFG = config.default()
MODELS = {"tiny": tiny_dims(), "7b": QWEN25_7B}
CHUNKS = (100, 37)         # two chunks, the second ending mid-page
LAYER_TOL = 3e-3
P = "model.layers.0."


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def layer_weights(dims, rng):
    """(fp32 arrays by HF name as the reference sees them, INT4 (packed, scales) by projection name)."""
    H, Q, KV, I = dims.hidden, dims.q_dim, dims.kv_dim, dims.intermediate
    shapes = {"self_attn.q_proj": (Q, H), "self_attn.k_proj": (KV, H), "self_attn.v_proj": (KV, H),
              "self_attn.o_proj": (H, Q), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}
    arrays, int4 = {}, {}
    for name, (n, k) in shapes.items():
        q, s = quant.quantize(rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)))
        packed = quant.pack(q)
        int4[name] = (packed, s)
        arrays[P + name + ".weight"] = quant.dequantize(packed, s)
    for name, n in (("q", Q), ("k", KV), ("v", KV)):
        arrays[P + f"self_attn.{name}_proj.bias"] = (0.5 * rng.standard_normal(n)).astype(np.float16)
    for name in ("input_layernorm", "post_attention_layernorm"):
        arrays[P + name + ".weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    return arrays, int4


@pytest.fixture(scope="module")
def fns():
    specs = []
    for d in MODELS.values():
        specs += G.specs_for_model(d, CFG) + AP.specs_for_model(d, CFG)
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


@pytest.mark.parametrize("model", MODELS)
def test_prefill_layer_in_chunks(fns, model):
    dims = MODELS[model]
    rng = np.random.default_rng()
    arrays, int4 = layer_weights(dims, rng)
    T = sum(CHUNKS)
    H, Q, KV, D = dims.hidden, dims.q_dim, dims.kv_dim, dims.head_dim

    # reference, whole prompt at once (causal: identical to chunked)
    w = R.Fp32Weights(dims, lambda n: np.asarray(arrays[n], np.float32))
    h0 = rng.standard_normal((T, H)).astype(np.float32)
    cos, sin = R.rope_tables(dims, 1024)
    k_ref = np.zeros((1024, dims.kv_heads, D), np.float16)
    v_ref = np.zeros_like(k_ref)
    trace = {}
    R.decoder_layer(w, 0, h0, np.arange(T), k_ref, v_ref, cos, sin, trace=trace)

    # device
    gemms = G.model_gemms(dims, CFG.quant.group_size)
    norm = next(s for s in G.specs_for_model(dims, CFG) if isinstance(s, G.RmsnormPrefillSpec))
    rope_spec, attn_spec = AP.prefill_attention_specs(dims, CFG)
    lay = KVLayout(layers=1, kv_heads=dims.kv_heads, head_dim=D, page_size=CFG.kv_cache.page_size,
                   num_pages=64, max_positions=1024)
    table = PageTable(lay, order=rng.permutation(lay.num_pages)).reserve(T).copy()
    dev = driver.DeviceBuffer.from_array
    qkv_w = np.concatenate([int4[f"self_attn.{p}_proj"][0] for p in "qkv"])
    qkv_s = np.concatenate([int4[f"self_attn.{p}_proj"][1] for p in "qkv"])
    qkv_b = np.concatenate([arrays[P + f"self_attn.{p}_proj.bias"] for p in "qkv"])
    gu_w = np.concatenate([int4["mlp.gate_proj"][0], int4["mlp.up_proj"][0]])   # gate rows then up rows
    gu_s = np.concatenate([int4["mlp.gate_proj"][1], int4["mlp.up_proj"][1]])
    b = {"norm1": dev(arrays[P + "input_layernorm.weight"]),
         "norm2": dev(arrays[P + "post_attention_layernorm.weight"]),
         "qkv_w": dev(qkv_w), "qkv_s": dev(qkv_s), "qkv_b": dev(qkv_b),
         "o_w": dev(int4["self_attn.o_proj"][0]), "o_s": dev(int4["self_attn.o_proj"][1]),
         "gu_w": dev(gu_w), "gu_s": dev(gu_s),
         "d_w": dev(int4["mlp.down_proj"][0]), "d_s": dev(int4["mlp.down_proj"][1]),
         "cos": dev(cos), "sin": dev(sin), "table": dev(table),
         "k_pool": dev(np.full(lay.pool_shape, 65504.0, np.float16)),
         "v_pool": dev(np.full(lay.pool_shape, np.nan, np.float16))}
    I = dims.intermediate
    rows = {"xn": (H, np.float16), "qkv": (Q + 2 * KV, np.float32), "q_rot": (Q, np.float32),
            "o16": (Q, np.float16), "xn2": (H, np.float16), "a16": (I, np.float16)}   # per-chunk activations
    out = {k: [] for k in rows} | {"h_attn": [], "h": []}
    gu_words = I * H // 8
    gu_scales = I * H // CFG.quant.group_size
    p0 = 0
    for n in CHUNKS:
        c = {k: driver.DeviceBuffer(n * cols * np.dtype(dt).itemsize) for k, (cols, dt) in rows.items()}
        for buf in c.values():
            buf.poison()
        h = driver.DeviceBuffer.from_array(h0[p0:p0 + n])   # this chunk's residual rows, updated in place

        def gemm(role, x, w_, s_, y, w2=0, s2=0, bias=0):
            spec = gemms[role]
            fns[spec].launch(spec.launch(n), None, pdl=False, x=x, w=w_, s=s_, w2=w2, s2=s2, bias=bias, y=y, m=n)

        fns[norm].launch(norm.launch(n), None, pdl=False, h=h, w=b["norm1"], xn=c["xn"], m=n)
        gemm("qkv", c["xn"], b["qkv_w"], b["qkv_s"], c["qkv"], bias=b["qkv_b"])
        fns[rope_spec].launch(rope_spec.launch(n), None, pdl=False, qkv=c["qkv"], rope_cos=b["cos"],
                              rope_sin=b["sin"], page_table=b["table"], q_rot=c["q_rot"], k_pool=b["k_pool"],
                              v_pool=b["v_pool"], p0=p0, n=n)
        fns[attn_spec].launch(attn_spec.launch(n), None, pdl=False, q_rot=c["q_rot"], k_pool=b["k_pool"],
                              v_pool=b["v_pool"], page_table=b["table"], o16=c["o16"], p0=p0, n=n)
        gemm("o_proj", c["o16"], b["o_w"], b["o_s"], h)
        driver.device().synchronize()
        out["h_attn"].append(h.download(dtype=np.float32, shape=(n, H)))
        fns[norm].launch(norm.launch(n), None, pdl=False, h=h, w=b["norm2"], xn=c["xn2"], m=n)
        gemm("gate_up", c["xn2"], b["gu_w"], b["gu_s"], c["a16"],
             w2=b["gu_w"].ptr + gu_words * 4, s2=b["gu_s"].ptr + gu_scales * 2)
        gemm("down", c["a16"], b["d_w"], b["d_s"], h)
        driver.device().synchronize()
        for k, (cols, dt) in rows.items():
            out[k].append(c[k].download(dtype=dt, shape=(n, cols)))
        out["h"].append(h.download(dtype=np.float32, shape=(n, H)))
        p0 += n
    out = {k: np.concatenate(v) for k, v in out.items()}

    ref = {"xn": trace["xn"], "qkv": np.concatenate([trace["q"].reshape(T, -1), trace["k"].reshape(T, -1),
                                                      trace["v"].reshape(T, -1)], axis=1),
           "q_rot": trace["q_rot"].reshape(T, -1), "o16": trace["o16"], "xn2": trace["xn2"], "a16": trace["a"],
           "h_attn": trace["h_attn"], "h": trace["h"]}
    errs = {k: rel_err(out[k], ref[k]) for k in ref}
    k_pool = b["k_pool"].download(dtype=np.float16, shape=lay.pool_shape)
    t = np.arange(T)
    errs["k_pages"] = rel_err(k_pool[table[t // lay.page_size], :, t % lay.page_size, :], k_ref[:T])
    print(f"{model} prefill layer, chunks {CHUNKS}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
          + f" (tol {LAYER_TOL:.0e})")
    for k, arr in out.items():
        assert np.isfinite(arr).all(), f"{model}: non-finite {k}"
    bad = {k: v for k, v in errs.items() if not v <= LAYER_TOL}
    assert not bad, f"{model}: stages over tolerance {LAYER_TOL}: {bad}"
