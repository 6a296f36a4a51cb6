"""INT4 GEMV kernels on the GPU against numpy, for every variant and every 7B / tiny-model shape; the
multi-row kernels (m = 1, 2, 3, 4, 8, 16) row by row against the m = 1 kernel, bit for bit.

Fresh random data each run (random int4 in [-7, 7], random positive fp16 scales, random x; never zeros).
The reference is the exact dequantized weight (quant.dequantize: q * f32(scale)) times the fp16
activations, summed in float64 (numerics contract); RMSNorm inputs go through reference.rmsnorm_f16 and
the SwiGLU output is compared after the contract's f16 cast. Outputs are poisoned (NaN) before each
launch (the residual epilogue's output is its random fp32 input h, updated in place), every element is checked finite, and ||out - ref|| / ||ref|| must be <= validation.gemv_rel_tol
(the kernels accumulate up to 32 fp16 products per half2 chain before the fp32 fold).
"""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import codegen, config, quant
from nanoqwen import reference as R
from nanoqwen.bench.gemv_case import GemvCase, rel_err
from nanoqwen.codegen.kernels import gemv
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.testmodels import tiny_dims
from nanoqwen.codegen import tuned

pytestmark = pytest.mark.gpu

CFG = config.default()
TOL = CFG.validation.gemv_rel_tol
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
# every variant, plus every tuned tile tune/tuned.json holds (tuned kernels must be as right as the defaults)
CASES = [(m, s) for m, d in MODELS.items()
         for s in dict.fromkeys(gemv.variants(d, CFG) + tuned.tuned_specs(d, CFG))]


def random_int4(rng, n: int, k: int):
    """(packed uint32 [n, k/8], scales fp16 [n, k/group], exact f32 weights)."""
    q = rng.integers(-7, 8, size=(n, k), dtype=np.int8)
    scales = rng.uniform(0.002, 0.02, size=(n, k // CFG.quant.group_size)).astype(np.float16)
    packed = quant.pack(q)
    return packed, scales, quant.dequantize(packed, scales)


@pytest.fixture(scope="module")
def fns():
    specs = list(dict.fromkeys(s for _, s in CASES))
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("model,spec", CASES, ids=[f"{m}-{s.uri}" for m, s in CASES])
def test_gemv_matches_reference(fns, model, spec, pdl):
    case = GemvCase(spec, np.random.default_rng())
    try:
        err = case.check(fns[spec], spec, pdl=pdl)
    finally:
        case.free()
    print(f"{spec.uri} pdl={pdl}: rel err {err:.2e} (tol {TOL:.0e})")
    assert err <= TOL, f"{spec.uri}: ||out - ref|| / ||ref|| = {err:.3e} > {TOL}"


@pytest.mark.parametrize("role", gemv.ROLES)
def test_massive_activations_stay_finite_and_exact(fns, role):
    """Inputs at the fp16 limit (Qwen2's massive activations after the saturating casts): a product
    65504 * 7 alone overflows fp16, so the kernel must prescale x; the output stays finite and within
    tolerance of the fp32 reference."""
    spec = gemv.role_spec(role, QWEN25_7B, CFG)
    case = GemvCase(spec, np.random.default_rng(), massive=True)
    try:
        err = case.check(driver.load(codegen.build(spec)), spec)
    finally:
        case.free()
    # A chain that holds a 65504-sized product rounds at that product's ulp, so the small terms beside it
    # carry fp16 rounding relative to the largest partial sum, not to themselves: twice the ordinary
    # tolerance (measured 2.5e-3 on gate_up, H200 2026-12-02).
    tol = 2 * TOL
    print(f"{spec.uri} massive: rel err {err:.2e} (tol {tol:.0e})")
    assert err <= tol, f"{spec.uri}: massive activations: rel err {err:.3e} > {tol}"


@pytest.mark.parametrize("model", list(MODELS))
def test_pdl_chain_in_graph_sees_previous_output(model):
    """o_proj (h += W_o x) then the QKV kernel (RMSNorm prologue reads that h) as two PDL launches in one
    CUDA graph, the way decode runs them: the second kernel issues its weight loads before
    griddepcontrol.wait, so it must still see the h the first one wrote (reference built from the h the
    GPU produced, so a stale read would show as a large error)."""
    dims = MODELS[model]
    rng = np.random.default_rng()
    o_spec, qkv_spec = gemv.role_spec("o_proj", dims, CFG), gemv.role_spec("qkv", dims, CFG)
    o_fn, qkv_fn = (driver.load(b) for b in codegen.build_many([o_spec, qkv_spec]))
    wo, so, wo_f = random_int4(rng, o_spec.n, o_spec.k)
    wq, sq, wq_f = random_int4(rng, qkv_spec.n, qkv_spec.k)
    x = rng.standard_normal(o_spec.k).astype(np.float16)
    h0 = (rng.standard_normal(dims.hidden) * 3).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, size=dims.hidden).astype(np.float16)
    bias = rng.standard_normal(qkv_spec.n).astype(np.float16)
    bufs = {k: driver.DeviceBuffer.from_array(v) for k, v in
            dict(wo=wo, so=so, wq=wq, sq=sq, x=x, h=h0, norm_w=norm_w, bias=bias).items()}
    y = driver.DeviceBuffer(4 * qkv_spec.n)
    y.poison()
    s = driver.Stream()
    with driver.capture(s) as g:
        o_fn.launch(o_spec.launch(), s, True, w0=bufs["wo"], s0=bufs["so"], x=bufs["x"], y=bufs["h"])
        qkv_fn.launch(qkv_spec.launch(), s, True, w0=bufs["wq"], s0=bufs["sq"], h=bufs["h"],
                      norm_w=bufs["norm_w"], bias=bufs["bias"], y=y)
    g.launch(s)
    s.synchronize()
    h1 = bufs["h"].download(dtype=np.float32, shape=h0.shape)
    out = y.download(dtype=np.float32, shape=(qkv_spec.n,))
    err_h = rel_err(h1, h0.astype(np.float64) + wo_f.astype(np.float64) @ x.astype(np.float64))
    xn = R.rmsnorm_f16(h1, norm_w, qkv_spec.eps).astype(np.float64)
    err_y = rel_err(out, wq_f.astype(np.float64) @ xn + bias.astype(np.float64))
    print(f"{model}: chain rel err h {err_h:.2e}, qkv {err_y:.2e} (tol {TOL:.0e})")
    assert np.isfinite(out).all()
    assert err_h <= TOL and err_y <= TOL
    g.close()
    for b in [*bufs.values(), y]:
        b.free()
    s.close()


# ---- the multi-row step: every row bitwise the m = 1 kernel on that row alone ----------------------------

MULTIROW_MS = (1, 2, 3, 4, 8, 16)   # the buckets, plus 3 (not a power of two)


class RowsCase:
    """One role's weights with m rows of random activations (fresh each run), run through the m-row kernel
    and, row by row, through the m = 1 kernel; `massive` plants Qwen2-style massive activations in those
    rows only (the others stay ordinary)."""

    def __init__(self, spec1, specm, rng, massive_rows=()):
        self.spec1, self.specm, m = spec1, specm, specm.m
        n, k = spec1.n, spec1.k
        self.bufs = []
        self.weights, mats = {}, []
        for i in range(spec1.mats):
            packed, scales, w = random_int4(rng, n, k)
            self.weights[f"w{i}"], self.weights[f"s{i}"] = self._dev(packed), self._dev(scales)
            mats.append(w)
        self.host = {}
        if spec1.norm:
            h = (rng.standard_normal((m, k)) * 3).astype(np.float32)
            norm_w = rng.uniform(0.5, 1.5, size=k).astype(np.float16)
            if massive_rows:   # x = f16(h / rms * w) saturates to +-65504 in those rows only
                big = rng.choice(k, 4, replace=False)
                norm_w[big] = 4096.0
                h[:, big] *= 1e-3   # ordinary rows: x stays ordinary (|x| < 2^8: no prescale) at those inputs
                for a in massive_rows:
                    h[a, big] = rng.choice([-1e5, 1e5], 4)
            self.host["h"], self.shared = h, {"norm_w": self._dev(norm_w)}
            x = R.rmsnorm_f16(h, norm_w, spec1.eps)
        else:
            x = rng.standard_normal((m, k)).astype(np.float16)
            for a in massive_rows:
                x[a, rng.choice(k, 4, replace=False)] = rng.choice([-65504.0, 65504.0], 4)
            self.host["x"], self.shared = x, {}
        ys = [R.gemv(w, x) for w in mats]   # [m, n] each
        self.out_dtype = np.float16 if spec1.out_f16 else np.float32
        self.y0 = None
        if spec1.epilogue == "residual":
            self.y0 = rng.standard_normal((m, n)).astype(np.float32)
            ref = self.y0 + ys[0]
        elif spec1.epilogue == "bias":
            bias = rng.standard_normal(n).astype(np.float16)
            self.shared["bias"] = self._dev(bias)
            ref = ys[0] + bias.astype(np.float32)
        elif spec1.epilogue == "swiglu":
            ref = R.swiglu(ys[0], ys[1])
        else:
            ref = ys[0]
        self.expected = R.f16(ref) if spec1.out_f16 else ref

    def _dev(self, a):
        b = driver.DeviceBuffer.from_array(np.ascontiguousarray(a))
        self.bufs.append(b)
        return b

    def run(self, fn, spec, rows: slice) -> np.ndarray:
        """Launch `spec` on activation rows `rows` (poisoned output, or the residual's y0), return [rows, n]."""
        name = "h" if spec.norm else "x"
        act = self._dev(self.host[name][rows])
        y = driver.DeviceBuffer(spec.m * spec.n * np.dtype(self.out_dtype).itemsize)
        self.bufs.append(y)
        if self.y0 is not None:
            y.upload(self.y0[rows])
        else:
            y.poison()
        fn.launch(spec.launch(), None, False, **self.weights, **self.shared, **{name: act}, y=y)
        driver.device().synchronize()
        return y.download(dtype=self.out_dtype, shape=(spec.m, spec.n))

    def free(self):
        for b in self.bufs:
            b.free()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


MULTIROW_CASES = [(model, role, m) for model in MODELS for role in gemv.ROLES for m in MULTIROW_MS]


@pytest.fixture(scope="module")
def multirow_fns():
    specs = list(dict.fromkeys(gemv.role_spec(role, MODELS[model], CFG, m=m) for model, role, m in MULTIROW_CASES))
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


def _check_rows(multirow_fns, model, role, m, massive_rows=()):
    dims = MODELS[model]
    spec1, specm = gemv.role_spec(role, dims, CFG), gemv.role_spec(role, dims, CFG, m=m)
    case = RowsCase(spec1, specm, np.random.default_rng(), massive_rows)
    try:
        many = case.run(multirow_fns[specm], specm, slice(0, m))
        for a in range(m):
            alone = case.run(multirow_fns[spec1], spec1, slice(a, a + 1))[0]
            assert np.isfinite(many[a]).all(), f"{specm.uri}: row {a} has non-finite outputs"
            assert np.array_equal(_bits(many[a]), _bits(alone)), (
                f"{specm.uri}: row {a} differs from the m = 1 kernel in {np.count_nonzero(many[a] != alone)} "
                f"of {spec1.n} outputs")
            tol = 2 * TOL if a in massive_rows else TOL   # see test_massive_activations_stay_finite_and_exact
            err = rel_err(many[a], case.expected[a])
            assert err <= tol, f"{specm.uri}: row {a}: rel err {err:.3e} > {tol}"
    finally:
        case.free()


@pytest.mark.parametrize("model,role,m", MULTIROW_CASES, ids=[f"{a}-{b}-m{c}" for a, b, c in MULTIROW_CASES])
def test_multirow_rows_are_bitwise_single_row(multirow_fns, model, role, m):
    """Each row of the m-row kernel equals the m = 1 kernel run on that row alone, bit for bit, and the
    numpy reference within the GEMV tolerance."""
    _check_rows(multirow_fns, model, role, m)


@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("role", gemv.ROLES)
def test_multirow_massive_row_beside_ordinary_rows(multirow_fns, role, m):
    """A row with massive activations prescales itself alone: the ordinary rows beside it (and the massive
    row itself) stay bitwise their m = 1 outputs."""
    _check_rows(multirow_fns, "7b", role, m, massive_rows=(1,))
