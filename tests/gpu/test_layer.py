"""Layer tier: one decoder block (embed + layer 0's kernels, exactly as the decoder launches them) on the
GPU, token by token over T = 19 positions (crossing the page boundary at 16), against

  * the numpy INT4 simulation (nanoqwen/reference.py) at every intermediate: qkv (where rope_append runs; the
    QKV GEMV with the rope keeps q, k and v in registers), q_rot, the KV cache pages (through the page table),
    o16, a16 and the block's residual update;
  * transformers' Qwen2 decoder layer running the dequantized weights in fp32 (the independent check;
    looser, since it has no fp16 activations).

Models: the trained small-py model, a tiny model with planted massive activations (every output must
stay finite through the saturating fp16 casts) and a random model with the 7B's layer shapes.
Inputs are fresh random token ids each run (the seed is printed); outputs are poisoned before each step."""

from __future__ import annotations

import numpy as np
import pytest

from ._gpu_util import fresh_rng, rel, report
from nanoqwen import config

pytestmark = pytest.mark.gpu

T = 19
GEMV_TOL = config.default().validation.gemv_rel_tol
# fp32 GEMV outputs carry the kernels' half2-per-group accumulation error (gemv_rel_tol); quantities
# after a second fp16 rounding or a second GEMV get twice that, the block output (three GEMVs deep) 4x.
TOL = {"qkv": GEMV_TOL, "q_rot": GEMV_TOL, "k_cache": 2 * GEMV_TOL, "v_cache": 2 * GEMV_TOL,
       "o16": 2 * GEMV_TOL, "a16": 2 * GEMV_TOL, "block_delta": 4 * GEMV_TOL}
HF_TOL = 2e-2  # block delta vs transformers fp32: fp16 activations (xn, o16, a) vs none


def run_block(session, tokens):
    """Layer 0 on the GPU for tokens[t] at position t, t = 0..T-1; returns per-step intermediates."""
    dec = session.decoder
    roles = [r for r, *_ in dec.sequence]
    sub = dec.sequence[:roles.index("down") + 1]
    rope = ["rope_append"] if "rope_append" in roles else []   # else the QKV GEMV does its work (gemv.with_rope)
    assert [r for r, *_ in sub] == ["embed", "qkv", *rope, "attention_decode", "attention_combine", "o_proj",
                                    "gate_up", "down"]
    session.runner.reserve(len(tokens))
    out = {k: [] for k in ("h_in", "q_rot", "o16", "a16", "h") + ("qkv",) * bool(rope)}
    d = session.dims
    for t, tok in enumerate(tokens):
        dec.reset(int(tok), pos=t, step=t)
        b = dec.bufs
        for buf in (b.q_rot, b.o16, b.a16, b.h, *([b.qkv] if rope else [])):
            buf.poison(dec.stream)
        fn, launch, args = sub[0][1:]
        fn.launch(launch, dec.stream, dec.pdl, **args)
        dec.drain()
        out["h_in"].append(b.h.download(np.empty(d.hidden, np.float32)))
        for role, fn, launch, args in sub[1:]:
            fn.launch(launch, dec.stream, dec.pdl, **args)
        dec.drain()
        out["h"].append(b.h.download(np.empty(d.hidden, np.float32)))
        if rope:
            out["qkv"].append(b.qkv.download(np.empty(d.q_dim + 2 * d.kv_dim, np.float32)))
        out["q_rot"].append(b.q_rot.download(np.empty(d.q_dim, np.float32)))
        out["o16"].append(b.o16.download(np.empty(d.q_dim, np.float16)))
        out["a16"].append(b.a16.download(np.empty(d.intermediate, np.float16)))
    dec.check_errors()
    return {k: np.stack(v) for k, v in out.items()}


def gathered_cache(session, layer: int, n: int):
    """K and V of positions 0..n-1 from the device pools, following the page table."""
    kv, d = session.kv, session.dims
    lay = kv.layout
    out = []
    for pool in (kv.k[layer], kv.v[layer]):
        host = pool.download(np.empty(lay.pool_shape, np.float16))
        rows = [host[kv.locate(p)[0], :, kv.locate(p)[1], :] for p in range(n)]
        out.append(np.stack(rows).reshape(n, d.kv_heads, d.head_dim))
    return out


@pytest.mark.parametrize("name", ["small-py", "massive", "7b-shapes"])
def test_block_vs_int4_simulation(name, sessions, references):
    s, ref = sessions(name, eager=True), references(name)
    d = s.dims
    tokens = fresh_rng().integers(0, d.vocab, T)
    trace = {}
    ref.prefill(tokens, trace)
    L = trace["layers"][0]
    gpu = run_block(s, tokens)
    for k, v in gpu.items():
        assert np.isfinite(v).all(), f"{name}: non-finite {k} on the GPU"
    assert np.array_equal(gpu["h_in"], trace["embed"]), "embed must be exact (a widened fp16 row)"   # class (a)
    want = {"qkv": np.concatenate([L["q"].reshape(T, -1), L["k"].reshape(T, -1), L["v"].reshape(T, -1)], 1),
            "q_rot": L["q_rot"].reshape(T, -1), "o16": L["o16"], "a16": L["a"]}
    want = {k: v for k, v in want.items() if k in gpu}
    k_gpu, v_gpu = gathered_cache(s, 0, T)
    errs = {k: rel(gpu[k], want[k]) for k in want}
    errs["k_cache"] = rel(k_gpu, ref.k_cache[0][:T])
    errs["v_cache"] = rel(v_gpu, ref.v_cache[0][:T])
    errs["block_delta"] = rel(gpu["h"] - gpu["h_in"], L["h"] - L["h_in"])
    for k, e in errs.items():
        report(f"{name} layer 0 {k}", e, TOL[k])
    bad = {k: e for k, e in errs.items() if not e <= TOL[k]}
    assert not bad, f"{name}: relative errors above tolerance: {bad}"


def test_block_vs_transformers(sessions, references):
    """The trained model's block against transformers' own Qwen2 decoder layer (fp32, dequantized INT4
    weights): hidden_states[1] of Qwen2ForCausalLM is layer 0's output."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s, ref = sessions("small-py", eager=True), references("small-py")
    tokens = fresh_rng().integers(0, s.dims.vocab, T)
    model = Qwen2ForCausalLM(Qwen2Config(**s.dims.to_hf_config(), attn_implementation="eager"))
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ref.w.to_dict().items()}
    model.load_state_dict(state, strict=False)
    model = model.float().eval()
    with torch.no_grad():
        hs = model(torch.tensor([tokens.tolist()]), output_hidden_states=True).hidden_states
    h_in, h_out = hs[0][0].double().numpy(), hs[1][0].double().numpy()
    gpu = run_block(s, tokens)
    e = rel(gpu["h"] - gpu["h_in"], h_out - h_in)
    report("small-py layer 0 block delta vs transformers", e, HF_TOL)
    assert e <= HF_TOL
