"""GPU unit tests of the prefill INT4 tensor-core GEMM (every epilogue) and the prefill RMSNorm against
numpy on fresh random data each run, for the 7B and tiny-model shapes and M in {1, 7, 16, 17, 100, 512,
4096} (the float32 numpy reference of 7B gate/up at M=4096 is ~1.1 TFLOP: seconds with a threaded BLAS);
the small-M tile variant (gemm.SMALL_M_TILES) for M in {1, 7, 16, 17, 32, 64}.

- Weights: random normal, quantized and packed by nanoqwen.quant (the .nanoqwen layout); the reference
  uses the exact dequantized weight `q * f32(scale)` and float32 numpy matmul.
- Outputs are poisoned (NaN) before each launch (the residual input is random data); every element is
  checked for finiteness and ||out - ref|| / ||ref|| <= tolerance:
  GEMM_TOL 1e-3 for fp32 outputs (the kernel rounds q * scale to fp16 once, relative 2^-11 per weight;
  expected ~1e-4), F16_TOL 2e-3 for fp16 outputs (one more fp16 rounding of the result).
"""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import codegen, config, quant
from nanoqwen import reference as R
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.testmodels import tiny_dims

pytestmark = pytest.mark.gpu

CFG = config.default()
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
ROLES = ("qkv", "o_proj", "gate_up", "down")
MS = (1, 7, 16, 17, 100, 512, 4096)
SMALL_MS = (1, 7, 16, 17, 32, 64)   # the small-M tiles serve chunks of up to prefill.small_m_tokens rows
GEMM_TOL, F16_TOL, NORM_TOL = 1e-3, 2e-3, 2e-3


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def fns():
    specs = [s for d in MODELS.values() for small in (False, True)
             for s in G.model_gemms(d, CFG.quant.group_size, small_m=small).values()]
    specs += [G.RmsnormPrefillSpec(hidden=d.hidden, eps=d.rms_eps, threads=G.rmsnorm_threads(d.hidden))
              for d in MODELS.values()]
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


def int4_weight(rng, n: int, k: int):
    """(packed u32 [n, k/8], scales f16 [n, k/128], exact dequantized fp32 [n, k])."""
    q, s = quant.quantize(rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)))
    packed = quant.pack(q)
    return packed, s, quant.dequantize(packed, s).astype(np.float32)


class Gemm:
    """One role's device buffers for the largest M it is tested at."""

    def __init__(self, spec: G.GemmInt4Spec, rng, m_max: int):
        self.spec, self.rng = spec, rng
        n, k = spec.n, spec.k
        rows = n // 2 if spec.epilogue == "swiglu" else n
        self.w = [int4_weight(rng, rows, k) for _ in range(2 if spec.epilogue == "swiglu" else 1)]
        self.bias = (0.5 * rng.standard_normal(n)).astype(np.float16)
        self.x = rng.standard_normal((m_max, k)).astype(np.float16)
        out_cols = n // 2 if spec.epilogue == "swiglu" else n
        out_bytes = 2 if spec.epilogue in ("swiglu", "f16") else 4
        b = {"x": driver.DeviceBuffer.from_array(self.x), "bias": driver.DeviceBuffer.from_array(self.bias),
             "y": driver.DeviceBuffer(m_max * out_cols * out_bytes)}
        b["w"], b["s"] = (driver.DeviceBuffer.from_array(a) for a in self.w[0][:2])
        b["w2"], b["s2"] = (driver.DeviceBuffer.from_array(a) for a in self.w[-1][:2])
        self.buf = b

    def run(self, fn, m: int, resid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(output, reference) of M rows; the residual epilogue adds into ``resid`` (random if None)."""
        spec, b = self.spec, self.buf
        if spec.epilogue == "residual":
            resid = self.rng.standard_normal((m, spec.n)).astype(np.float32) if resid is None else resid[:m]
            b["y"].upload(resid)
        else:
            b["y"].poison()
        fn.launch(spec.launch(m), None, pdl=False, x=b["x"], w=b["w"], s=b["s"], w2=b["w2"], s2=b["s2"],
                  bias=b["bias"] if spec.bias else 0, y=b["y"], m=m)
        driver.device().synchronize()
        acc = [R.gemv(wd, self.x[:m]) for _, _, wd in self.w]
        if spec.epilogue == "swiglu":
            out = b["y"].download(dtype=np.float16, shape=(m, spec.n // 2))
            return out, R.swiglu(acc[0], acc[1])
        ref = acc[0] + (self.bias.astype(np.float32) if spec.bias else 0)
        if spec.epilogue == "residual":
            ref = ref + resid
        dtype = np.float16 if spec.epilogue == "f16" else np.float32
        return b["y"].download(dtype=dtype, shape=(m, spec.n)), ref


@pytest.mark.parametrize("small", [False, True], ids=["tiles", "small-m-tiles"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("role", ROLES)
def test_gemm_int4(fns, model, role, small):
    spec = G.model_gemms(MODELS[model], CFG.quant.group_size, small_m=small)[role]
    ms = SMALL_MS if small else MS
    g = Gemm(spec, np.random.default_rng(), max(ms))
    tol = F16_TOL if spec.epilogue in ("swiglu", "f16") else GEMM_TOL
    for m in ms:
        out, ref = g.run(fns[spec], m)
        what = f"{model} {role} {spec.uri} M={m}"
        assert np.isfinite(out).all(), f"{what}: {np.size(out) - np.isfinite(out).sum()} non-finite outputs"
        err = rel_err(out, ref)
        print(f"{what}: rel {err:.2e} (tol {tol:.0e})")
        assert err <= tol, f"{what}: rel error {err:.3e} > {tol}"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("epilogue", ["f16"])
def test_gemm_f16_epilogue(fns, model, epilogue):
    """The f16 epilogue (with bias) is not in the model plan; built here so it stays correct."""
    dims = MODELS[model]
    spec = G.GemmInt4Spec(n=dims.q_dim + 2 * dims.kv_dim, k=dims.hidden, epilogue=epilogue, bias=True)
    fn = driver.load(codegen.build(spec))
    g = Gemm(spec, np.random.default_rng(), 100)
    for m in (1, 17, 100):
        out, ref = g.run(fn, m)
        assert np.isfinite(out).all()
        err = rel_err(out, ref)
        print(f"{model} f16 M={m}: rel {err:.2e} (tol {F16_TOL:.0e})")
        assert err <= F16_TOL


@pytest.mark.parametrize("model", MODELS)
def test_rmsnorm_prefill(fns, model):
    dims = MODELS[model]
    spec = G.RmsnormPrefillSpec(hidden=dims.hidden, eps=dims.rms_eps, threads=G.rmsnorm_threads(dims.hidden))
    rng = np.random.default_rng()
    m = 100
    h = (3.0 * rng.standard_normal((m, dims.hidden))).astype(np.float32)
    h[:, 3] = 3e4     # a massive residual channel: the norm must stay finite
    w = (1.0 + 0.1 * rng.standard_normal(dims.hidden)).astype(np.float16)
    b = {"h": driver.DeviceBuffer.from_array(h), "w": driver.DeviceBuffer.from_array(w),
         "xn": driver.DeviceBuffer(m * dims.hidden * 2)}
    b["xn"].poison()
    fns[spec].launch(spec.launch(m), None, pdl=False, m=m, **b)
    driver.device().synchronize()
    out = b["xn"].download(dtype=np.float16, shape=(m, dims.hidden))
    ref = R.rmsnorm(h, w, dims.rms_eps)
    assert np.isfinite(out).all()
    err = rel_err(out, ref)
    print(f"{model} rmsnorm_prefill: rel {err:.2e} (tol {NORM_TOL:.0e})")
    assert err <= NORM_TOL
