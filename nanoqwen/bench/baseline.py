"""PyTorch baselines measured in the same run as nanoqwen, on the same device (optional: each part is
skipped with a one-line reason where torch, transformers or CUDA is missing, or where an op fails).

* transformers: Qwen2ForCausalLM in fp16 on the GPU holding the *dequantized weights of the same
  .nanoqwen file* (q * scale, rounded to fp16), torch eager (no torch.compile), greedy ``generate``
  with a static KV cache (a dynamic one where static fails; the result says which). pp = the
  ``generate(max_new_tokens=1)`` time for the same prompt length; ms/token = (T(1 + gen) - T(1)) / gen.
* torch's INT4 weight-only GEMV (``torch._weight_int4pack_mm`` after ``torch._convert_weight_to_int4pack``,
  tinygemm, bf16 activations, group 128) on the four decoder GEMV shapes (gate and up as one N = 2 x
  intermediate matrix, as nanoqwen reads both), back to back in a CUDA graph over enough weight copies
  that L2 cannot serve them (config bench.l2_rotate_bytes); against nanoqwen's per-layer region time
  of the ITL breakdown of the same run. tinygemm dequantizes (q - 8) * scale + zero; random q in 1..15
  with zero 0 is nanoqwen's symmetric INT4, so the bytes per weight match except tinygemm's 4-byte
  (scale, zero) pair per group against nanoqwen's 2-byte scale."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import extras
from ..codegen.kernels import gemv
from ..config import Config, default
from .mbu import GEMV_REGION

TG_REPS = 3
GEMV_GRAPH_REPS = 5
INNER_K_TILES = 8
DEQUANT_WORKERS = 8


def _torch_cuda():
    """(torch, None) or (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch is not importable ({e}; {extras.hint('torch')})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, None


# ---- transformers ---------------------------------------------------------------------------------

def _load_hf(torch, path: Path, log):
    """Qwen2ForCausalLM fp16 on cuda with the file's dequantized weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..nqfile import NanoqwenFile
    from ..reference import Fp32Weights, tensor_names
    f = NanoqwenFile(path)
    hf_cfg = Qwen2Config(**{**f.dims.to_hf_config(), "torch_dtype": "float16"})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)   # RoPE's inv_freq is built in fp32 explicitly, weights in fp16
    try:
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    params = dict(model.named_parameters())
    w = Fp32Weights.from_file(f, cache=False)
    names = tensor_names(f.dims)
    missing = [n for n in names if n not in params]
    if missing:
        raise RuntimeError(f"transformers' Qwen2ForCausalLM has no parameter {missing[0]}")
    t0 = time.perf_counter()
    with torch.no_grad(), ThreadPoolExecutor(DEQUANT_WORKERS) as pool:   # numpy dequant releases the GIL
        for name, arr in zip(names, pool.map(lambda n: w[n], names)):
            params[name].copy_(torch.from_numpy(arr).to("cuda", torch.float16))
    log(f"transformers: loaded {len(names)} dequantized tensors in {time.perf_counter() - t0:.1f} s")
    model.generation_config.eos_token_id = None   # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


def _generate_s(torch, model, ids, n: int, cache) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, cache_implementation=cache)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
    return dt


def transformers_baseline(path: Path, prompt_tokens: int, gen_tokens: int, log=print) -> dict:
    torch, why = _torch_cuda()
    if torch is None:
        return {"skipped": why}
    try:
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers is not importable ({e}; {extras.hint('torch')})"}
    model = None
    try:
        model = _load_hf(torch, path, log)
        ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), device="cuda")
        res = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float16",
               "attn_implementation": getattr(model.config, "_attn_implementation", None), "compile": False}
        with torch.no_grad():
            cache, why_dynamic = "static", None
            try:
                _generate_s(torch, model, ids, 2, cache)
            except Exception as e:  # noqa: BLE001 - fall back to the dynamic cache and say why
                cache, why_dynamic = None, f"{type(e).__name__}: {e}"[:300]
                _generate_s(torch, model, ids, 2, cache)
            res.update(cache="static" if cache else "dynamic", static_cache_error=why_dynamic)
            pp = [_generate_s(torch, model, ids, 1, cache) for _ in range(TG_REPS)]
            full = [_generate_s(torch, model, ids, gen_tokens + 1, cache) for _ in range(TG_REPS)]
        pp_s, full_s = statistics.median(pp), statistics.median(full)
        res.update(pp_ms=1e3 * pp_s, pp_ts=prompt_tokens / pp_s, ms_per_token=1e3 * (full_s - pp_s) / gen_tokens,
                   samples_pp_s=pp, samples_full_s=full, n_prompt=prompt_tokens, n_gen=gen_tokens)
        log(f"transformers: pp{prompt_tokens} {res['pp_ms']:.1f} ms, {res['ms_per_token']:.2f} ms/token "
            f"({res['cache']} cache)")
        return res
    except Exception as e:  # noqa: BLE001 - the baseline is optional; the nanoqwen figures stand alone
        return {"skipped": f"transformers baseline failed: {type(e).__name__}: {e}"[:500]}
    finally:
        del model
        torch.cuda.empty_cache()


# ---- torch int4 GEMV ------------------------------------------------------------------------------

def _pack_int4(torch, q_u):
    """uint8 [N, K] of 0..15 -> tinygemm's tiled int32 layout (torch >= 2.5 wants uint8 [N, K/2], the
    even column in the high nibble; older torch took the int32 values themselves)."""
    try:
        return torch._convert_weight_to_int4pack((q_u[:, ::2] << 4 | q_u[:, 1::2]).contiguous(), INNER_K_TILES)
    except RuntimeError:
        return torch._convert_weight_to_int4pack(q_u.to(torch.int32).contiguous(), INNER_K_TILES)


def _gemv_case(torch, n: int, k: int, group: int, rotate_bytes: int):
    q_u = torch.randint(1, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (0.002 + 0.018 * torch.rand(k // group, n, device="cuda")).to(torch.bfloat16)
    sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()   # [K/g, N, 2]
    w = _pack_int4(torch, q_u)
    nbytes = w.numel() * w.element_size() + sz.numel() * sz.element_size()
    copies = max(2, -(-rotate_bytes // nbytes))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    szs = [sz] + [sz.clone() for _ in range(copies - 1)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    return q_u, scales, ws, szs, x, nbytes


def _capture(torch, fn):
    """``fn``'s launches as one CUDA graph (warmed up on the capture stream first)."""
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            fn()
    return g


def _check(torch, q_u, scales, w, sz, x, group: int) -> float:
    """||y - ref|| / ||ref|| of one call against the dequantized matrix in fp32 (a packing check)."""
    wd = (q_u.float() - 8).view(q_u.shape[0], -1, group) * scales.float().t().unsqueeze(-1)
    ref = x.float() @ wd.view(q_u.shape[0], -1).t()
    y = torch._weight_int4pack_mm(x, w, group, sz).float()
    return float((y - ref).norm() / ref.norm())


def int4_gemv_baseline(dims, result: dict, cfg: Config | None = None) -> dict:
    torch, why = _torch_cuda()
    if torch is None:
        return {"skipped": why}
    if not hasattr(torch, "_weight_int4pack_mm") or not hasattr(torch, "_convert_weight_to_int4pack"):
        return {"skipped": f"torch {torch.__version__} has no _weight_int4pack_mm / _convert_weight_to_int4pack"}
    cfg = cfg or default()
    group, rows = cfg.quant.group_size, []
    bw = result.get("copy", {}).get("GBps")
    regions = result.get("itl", {}).get("regions_ms", {})
    for role in gemv.ROLES:
        n, k = gemv.role_shape(role, dims)
        n *= gemv.role_spec(role, dims, cfg).mats
        row = {"role": role, "n": n, "k": k}
        try:
            q_u, scales, ws, szs, x, nbytes = _gemv_case(torch, n, k, group, cfg.bench.l2_rotate_bytes)
            row["rel_err"] = _check(torch, q_u, scales, ws[0], szs[0], x, group)
            del q_u, scales
            calls = 2 * len(ws)
            run_all = lambda: [torch._weight_int4pack_mm(x, ws[i % len(ws)], group, szs[i % len(ws)])
                               for i in range(calls)]
            try:
                g, timing = _capture(torch, run_all), "graph"
                replay = g.replay
            except Exception as e:  # noqa: BLE001 - no capture: back-to-back eager calls (host-bound if short)
                g, timing, replay = None, f"eager ({type(e).__name__} in capture)", run_all
            replay()
            torch.cuda.synchronize()
            per = []
            for _ in range(GEMV_GRAPH_REPS):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                replay()
                b.record()
                b.synchronize()
                per.append(a.elapsed_time(b) * 1e-3 / calls)
            row["timing"] = timing
            t = statistics.median(per)
            io = 2 * k + 2 * n
            row.update(us=1e6 * t, bytes=nbytes + io, GBps=(nbytes + io) / t / 1e9, copies=len(ws), calls=calls)
            if bw:
                row["pct_copy"] = 100 * row["GBps"] / bw
            region_ms = regions.get(GEMV_REGION[role])
            if region_ms:
                row["nanoqwen_us"] = 1e3 * region_ms / dims.layers
                row["torch_over_nanoqwen"] = row["us"] / row["nanoqwen_us"]
            del g, ws, szs, x
        except Exception as e:  # noqa: BLE001 - one shape failing leaves the others
            row["skipped"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        torch.cuda.empty_cache()
    return {"torch": torch.__version__, "op": "torch._weight_int4pack_mm (tinygemm), bf16, group "
            f"{group}, inner_k_tiles {INNER_K_TILES}", "shapes": rows}


def run(path: Path, prompt_tokens: int, gen_tokens: int, result: dict, cfg: Config | None = None, log=print) -> dict:
    from ..nqfile import NanoqwenFile
    dims = NanoqwenFile(path).dims
    out = {"int4_gemv": int4_gemv_baseline(dims, result, cfg)}
    out["transformers"] = transformers_baseline(path, prompt_tokens, gen_tokens, log)
    return out


def summary(result: dict) -> str:
    """Baseline lines, as ratios to nanoqwen's figures of the same run."""
    b = result["baseline"]
    pp = next(t for t in result["tests"] if t["n_prompt"])
    tok_ms = result["latency"]["ms_per_token"]["mean"]
    tf = b["transformers"]
    lines = ["PyTorch baselines (same device, same run):"]
    if "skipped" in tf:
        lines.append(f"  transformers: skipped ({tf['skipped']})")
    else:
        nq_pp_ms = pp["avg_ns"] / 1e6
        lines.append(f"  transformers {tf['transformers']} fp16 eager, {tf['cache']} cache, dequantized same weights: "
                     f"pp{tf['n_prompt']} {tf['pp_ms']:.1f} ms ({tf['pp_ms'] / nq_pp_ms:.2f}x nanoqwen's "
                     f"{nq_pp_ms:.1f} ms), {tf['ms_per_token']:.2f} ms/token ({tf['ms_per_token'] / tok_ms:.2f}x "
                     f"nanoqwen's {tok_ms:.3f})")
    g = b["int4_gemv"]
    if "skipped" in g:
        lines.append(f"  torch int4 GEMV: skipped ({g['skipped']})")
    else:
        lines.append(f"  {g['op']} (nanoqwen: per-layer region time of the breakdown):")
        for r in g["shapes"]:
            if "skipped" in r:
                lines.append(f"    {r['role']:<8} {r['n']:>6} x {r['k']:<6} skipped ({r['skipped']})")
                continue
            ratio = (f"nanoqwen {r['nanoqwen_us']:.2f} us, torch/nanoqwen {r['torch_over_nanoqwen']:.2f}x"
                     if "nanoqwen_us" in r else "no nanoqwen figure")
            pct = (f", {r['pct_copy']:.0f}% of copy" if "pct_copy" in r else "") + \
                  ("" if r.get("timing", "graph") == "graph" else f", timed {r['timing']}")
            lines.append(f"    {r['role']:<8} {r['n']:>6} x {r['k']:<6} torch {r['us']:8.2f} us ({r['GBps']:.0f} GB/s"
                         f"{pct}; check rel err {r['rel_err']:.1e}); {ratio}")
    return "\n".join(lines)
