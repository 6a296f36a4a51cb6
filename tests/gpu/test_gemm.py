"""GPU unit tests of the prefill INT4 tensor-core GEMM (every epilogue) and the prefill RMSNorm against
numpy on fresh random data each run, for the 7B and tiny-model shapes and M in {1, 7, 16, 17, 100, 512,
4096} (the float32 numpy reference of 7B gate/up at M=4096 is ~1.1 TFLOP: seconds with a threaded BLAS);
the small-M tile variant (gemm.SMALL_M_TILES) for M in {1, 7, 16, 17, 32, 64}. The GEMV-order GEMMs
(gemm.py gemv_order) as well, and besides, bit for bit: each row at every M, and each row against the
tensor-core GEMV (gemv_int4 mma) run on that row alone and among 16.

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
from nanoqwen.bench.gemv_case import GemvCase, bits
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.codegen.kernels import gemv as gv
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
    specs += [G.RmsnormPrefillSpec(hidden=d.hidden, eps=d.rms_eps)
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
    spec = G.RmsnormPrefillSpec(hidden=dims.hidden, eps=dims.rms_eps)
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


# ---- GEMV order: each row bitwise the tensor-core GEMV's (gemm.py gemv_order) -------------------------------

GEMV_SPLITS = {"qkv": 2, "o_proj": 1, "gate_up": 1, "down": 4}   # 2: a split sum on a K = 3584 shape too
ORDER_CASES = [(model, role, small) for model in MODELS for role in ROLES for small in (False, True)]


def order_spec(model: str, role: str, small: bool) -> G.GemmInt4Spec:
    return G.model_gemms(MODELS[model], CFG.quant.group_size, small_m=small, gemv_splits=GEMV_SPLITS)[role]


@pytest.fixture(scope="module")
def order_fns():
    specs = list(dict.fromkeys(order_spec(*c) for c in ORDER_CASES))
    specs += [gemv_twin(model, role) for model in MODELS for role in ROLES]
    specs += [gv.multirow_spec(gemv_twin(model, role), 16, CFG) for model in MODELS for role in ROLES]
    return {b.spec: driver.load(b) for b in codegen.build_many(list(dict.fromkeys(specs)))}


def gemm_args(case: GemvCase, x) -> dict:
    """The GEMM's arguments over a GemvCase's buffers (its weights, bias and output) with X at `x`."""
    a = case.args(0)
    return dict(x=x, w=a["w0"], s=a["s0"], w2=a.get("w1", a["w0"]), s2=a.get("s1", a["s0"]), bias=a.get("bias", 0),
                y=a["y"])


def gemv_twin(model: str, role: str):
    """The tensor-core GEMV whose rows the GEMV-order GEMM of `role` reproduces: the same K splits, x as
    input (no RMSNorm prologue: the prefill normalises in its own kernel)."""
    spec = order_spec(model, role, False)
    return gv.role_spec(role, MODELS[model], CFG, **gv.MMA_TILE, splitk=spec.splits, norm=False)


@pytest.mark.parametrize("model,role,small", ORDER_CASES, ids=[f"{m}-{r}-{'small' if s else 'tiles'}"
                                                               for m, r, s in ORDER_CASES])
def test_gemm_gemv_order_matches_reference_and_its_rows_do_not_depend_on_m(order_fns, model, role, small):
    """Against numpy within the GEMM tolerance (class (b)), and every row bitwise the same at every M (its
    first rows computed at M = 1, 7, ... and at M = 512: class (a), the same arithmetic per row)."""
    spec = order_spec(model, role, small)
    ms = SMALL_MS if small else MS[:-1]
    g = Gemm(spec, np.random.default_rng(), max(ms))
    resid = g.rng.standard_normal((max(ms), spec.n)).astype(np.float32)
    tol = F16_TOL if spec.epilogue in ("swiglu", "f16") else GEMM_TOL
    widest = None
    for m in sorted(ms, reverse=True):
        out, ref = g.run(order_fns[spec], m, resid)
        what = f"{model} {role} {spec.uri} M={m}"
        assert np.isfinite(out).all(), f"{what}: {np.size(out) - np.isfinite(out).sum()} non-finite outputs"
        err = rel_err(out, ref)
        print(f"{what}: rel {err:.2e} (tol {tol:.0e})")
        assert err <= tol, f"{what}: rel error {err:.3e} > {tol}"
        widest = out if widest is None else widest
        assert np.array_equal(bits(out), bits(widest[:m])), f"{what}: rows differ from the M={max(ms)} run"


@pytest.mark.parametrize("model,role,small", ORDER_CASES, ids=[f"{m}-{r}-{'small' if s else 'tiles'}"
                                                               for m, r, s in ORDER_CASES])
def test_gemm_gemv_order_rows_are_the_tensor_core_gemv_rows(order_fns, model, role, small):
    """Each row of the GEMV-order GEMM is bitwise the tensor-core GEMV's output for that row alone, and the
    16-row GEMV's (class (a)): one arithmetic for decode, verify, a short chunk and a 512-row chunk."""
    spec, one = order_spec(model, role, small), gemv_twin(model, role)
    many = gv.multirow_spec(one, 16, CFG)
    case = GemvCase(many, np.random.default_rng())
    try:
        alone = case.alone(order_fns[one], one).reshape(16, -1)
        rows16 = case.run(order_fns[many], many).reshape(16, -1)
        for m in (16, 7, 1):
            case._reset(None)
            order_fns[spec].launch(spec.launch(m), None, pdl=False, m=m, **gemm_args(case, case.act["x"]))
            driver.device().synchronize()
            out = case.y.download(dtype=case.out_dtype, shape=case.shape)[:m]
            for a in range(m):
                assert np.array_equal(bits(out[a]), bits(alone[a])), (
                    f"{spec.uri} M={m}: row {a} differs from {one.uri} in "
                    f"{np.count_nonzero(bits(out[a]) != bits(alone[a]))} of {out.shape[1]} outputs")
                assert np.array_equal(bits(out[a]), bits(rows16[a])), f"{spec.uri} M={m}: row {a} != 16-row GEMV"
    finally:
        case.free()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("role", ["qkv", "gate_up"])
def test_prefill_norm_then_gemm_rows_are_the_gemv_rows_with_its_norm(order_fns, model, role):
    """rmsnorm_prefill, then the GEMV-order GEMM, give each row the bits the tensor-core GEMV gives it with its
    fused RMSNorm prologue (class (a): rmsnorm.cuh's one layout of the sum, the group MMAs), a row of massive
    activations included."""
    dims, spec = MODELS[model], order_spec(model, role, False)
    one = gv.prefill_row_spec(role, dims, CFG, 1, spec.splits)   # the runtime's row GEMV, at m = 1
    assert one.norm
    norm = G.RmsnormPrefillSpec(hidden=dims.hidden, eps=dims.rms_eps)
    fns = {b.spec: driver.load(b) for b in codegen.build_many([one, norm])}
    case = GemvCase(gv.prefill_row_spec(role, dims, CFG, 16, spec.splits), np.random.default_rng(),
                    massive_rows=(1,))
    xn = driver.DeviceBuffer(16 * dims.hidden * 2)
    try:
        alone = case.alone(fns[one], one).reshape(16, -1)
        fns[norm].launch(norm.launch(16), None, pdl=False, h=case.act["h"], w=case.act["norm_w"], xn=xn, m=16)
        case._reset(None)
        order_fns[spec].launch(spec.launch(16), None, pdl=False, m=16, **gemm_args(case, xn))
        driver.device().synchronize()
        out = case.y.download(dtype=case.out_dtype, shape=case.shape)
        for a in range(16):
            assert np.array_equal(bits(out[a]), bits(alone[a])), (
                f"{spec.uri} after {norm.uri}: row {a} differs from {one.uri} in "
                f"{np.count_nonzero(bits(out[a]) != bits(alone[a]))} of {out.shape[1]} outputs")
    finally:
        xn.free()
        case.free()
