"""INT4 GEMV kernels on the GPU against numpy, for every variant and every 7B / tiny-model shape; the
multi-row kernels (m = 1, 2, 3, 4, 8, 16) row by row against the m = 1 kernel, bit for bit.

Fresh random data each run (random int4 in [-7, 7], random positive fp16 scales, random x; never zeros),
from one seed a run (RUN_SEED, printed with each check): the tile variants of a shape share its weights,
drawn once (GemvCase.seeded; drawing a 7B matrix costs seconds of host time).
The reference is the exact dequantized weight (quant.dequantize: q * f32(scale)) times the fp16
activations, summed in float64 (numerics contract); RMSNorm inputs go through reference.rmsnorm_f16 and
the SwiGLU output is compared after the contract's f16 cast. Outputs are poisoned (NaN) before each
launch (the residual epilogue's output is its random fp32 input h, updated in place), every element is checked finite, and ||out - ref|| / ||ref|| must be <= validation.gemv_rel_tol
(the kernels accumulate up to 32 fp16 products per half2 chain before the fp32 fold).
"""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen import reference as R
from nanoqwen.bench.gemv_case import GemvCase, bits, random_int4, rel_err
from nanoqwen.codegen.kernels import gemm, gemv
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.testmodels import tiny_dims
from nanoqwen.codegen import tuned
from nanoqwen.codegen import tuned_store as store

pytestmark = pytest.mark.gpu

CFG = config.default()
TOL = CFG.validation.gemv_rel_tol
MASSIVE_SEED = 2026   # the massive-activation input (see test_massive_activations_stay_finite_and_exact)
RUN_SEED = np.random.SeedSequence().entropy   # every other input: fresh each run
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
# every variant, plus every tuned tile tune/tuned.json holds (tuned kernels must be as right as the defaults); the
# rope epilogue writes rope_append's outputs, not y: tests/gpu/test_attention.py checks it against rope_append
CASES = [(m, s) for m, d in MODELS.items()
         for s in dict.fromkeys(gemv.variants(d, CFG) + tuned.tuned_specs(d, CFG)) if s.epilogue != "rope"]


@pytest.fixture(scope="module")
def fns():
    specs = list(dict.fromkeys(s for _, s in CASES))
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("model,spec", CASES, ids=[f"{m}-{s.uri}" for m, s in CASES])
def test_gemv_matches_reference(fns, model, spec, pdl):
    case = GemvCase.seeded(spec, RUN_SEED)
    try:
        err = case.check(fns[spec], spec, pdl=pdl)
    finally:
        case.free()
    print(f"{spec.uri} pdl={pdl} seed {RUN_SEED}: rel err {err:.2e} (tol {TOL:.0e})")
    assert err <= TOL, f"{spec.uri}: ||out - ref|| / ||ref|| = {err:.3e} > {TOL}"


MASSIVE_CASES = [gemv.role_spec(role, QWEN25_7B, CFG) for role in gemv.ROLES] + gemv.mma_variants(QWEN25_7B, CFG)[::3]


@pytest.mark.parametrize("spec", MASSIVE_CASES, ids=[s.uri for s in MASSIVE_CASES])
def test_massive_activations_stay_finite_and_exact(fns, spec):
    """Inputs at the fp16 limit (Qwen2's massive activations after the saturating casts): a product
    65504 * 7 alone overflows fp16, so the CUDA-core kernel must prescale x (the tensor cores accumulate in
    fp32); the output stays finite and within tolerance of the fp32 reference."""
    case = GemvCase.seeded(spec, MASSIVE_SEED, massive=True)
    try:
        err = case.check(driver.load(codegen.build(spec)), spec)
    finally:
        case.free()
    # A chain that holds a 65504-sized product rounds at that product's ulp, so the small terms beside it
    # carry fp16 rounding relative to the largest partial sum, not to themselves: twice the ordinary
    # tolerance (measured 2.5e-3 on gate_up, H200 2026-12-02). One input, drawn from a fixed seed: over
    # fresh draws the error's tail passes it (4.3e-3 on a gate_up row, 2026-12-04), and the first-order
    # bound sum_k |w x| * 19 ulp is 1.6% (22% through swiglu's saturation): too loose to be the check.
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
    wo, so, wo_f = random_int4(rng, o_spec.n, o_spec.k, o_spec.group)
    wq, sq, wq_f = random_int4(rng, qkv_spec.n, qkv_spec.k, qkv_spec.group)
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
# Re-tilings an m-row kernel may choose (gemv.MULTIROW_TILE) beside the default one: the batch loaded
# ahead of the math, twice the rows per lane group, and 2 or 8 warps (the RMSNorm roles' sum then goes
# through its virtual layout, not the 4-warp block's registers).
TILES = ({"unroll": 1, "prefetch": True}, {"rows": 2, "unroll": 1, "prefetch": True},
         {"warps": 8, "unroll": 1, "prefetch": True}, {"warps": 2})


def _tuned_multirow():
    """(model, m = 1 kernel, m-row kernel) of every m-row tile tune/tuned.json holds for these dims."""
    keys = store.load()["entries"]
    gpus = sorted({k.split("|")[0] for k in keys})
    return [(model, tuned.role_spec(role, dims, CFG, gpu), tuned.role_spec(role, dims, CFG, gpu, m))
            for model, dims in MODELS.items() for gpu in gpus for role in gemv.ROLES
            for m in CFG.multirow.buckets if m > 1 and tuned.entry_key(role, dims, CFG, gpu, m) in keys]


MULTIROW_CASES = list(dict.fromkeys(
    [(model, gemv.role_spec(role, MODELS[model], CFG), gemv.role_spec(role, MODELS[model], CFG, m=m))
     for model in MODELS for role in gemv.ROLES for m in MULTIROW_MS]
    + [("7b", one, gemv.multirow_spec(one, m, CFG, tile=t))
       for one in (gemv.role_spec(role, QWEN25_7B, CFG) for role in gemv.ROLES) for t in TILES for m in (2, 8)]
    + [("7b", one, gemv.multirow_spec(one, m, CFG, tile=t)) for one in gemv.mma_variants(QWEN25_7B, CFG)
       for m in (2, 3, 8, 16) for t in (None, {"rows": 4, "unroll": 1, "prefetch": True})]
    + _tuned_multirow()))

# The 512-thread m-row qkv kernel (the H200's tuned m = 8 and 16 tile) beside its 1-row kernel, with seeds whose
# rows differed while the compiler chose per kernel which product of the RMSNorm's x * x + y * y to fuse (the
# 1-row kernel fused x * x, the 16-row one y * y); --fmad=false in config codegen.nvrtc_options ends that.
FUSED_SQUARES_ONE = gemv.role_spec("qkv", QWEN25_7B, CFG, lanes=16, rows=2, warps=4, tiles_per_warp=1, unroll=0)
FUSED_SQUARES_ROWS = {m: gemv.multirow_spec(FUSED_SQUARES_ONE, m, CFG, tile=dict(prefetch=True, rows=2, unroll=1,
                                                                                 warps=16)) for m in (8, 16)}
FUSED_SQUARES = [(16, 339894517984029253835280563836087435779), (16, 3), (16, 5), (8, 4)]
MULTIROW_CASES = list(dict.fromkeys(MULTIROW_CASES + [("7b", FUSED_SQUARES_ONE, s) for s in FUSED_SQUARES_ROWS.values()]))


@pytest.fixture(scope="module")
def multirow_fns():
    specs = list(dict.fromkeys(s for _, one, many in MULTIROW_CASES for s in (one, many)))
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


def _check_rows(multirow_fns, spec1, specm, massive_rows=(), seed=RUN_SEED):
    m = specm.m
    print(f"{specm.uri}: seed {seed}")
    case = GemvCase.seeded(specm, seed, massive_rows=massive_rows)
    try:
        many = case.run(multirow_fns[specm], specm).reshape(m, -1)
        alone = case.alone(multirow_fns[spec1], spec1).reshape(m, -1)
        expected = case.expected.reshape(m, -1)
    finally:
        case.free()
    for a in range(m):
        assert np.array_equal(bits(many[a]), bits(alone[a])), (
            f"{specm.uri}: row {a} differs from the m = 1 kernel in {np.count_nonzero(many[a] != alone[a])} "
            f"of {spec1.n} outputs")
        if a in massive_rows:   # its bits are the m = 1 kernel's; their error is test_massive_activations'
            assert np.isfinite(many[a]).all(), f"{specm.uri}: massive row {a} overflowed"
            continue
        err = rel_err(many[a], expected[a])
        assert err <= TOL, f"{specm.uri}: row {a}: rel err {err:.3e} > {TOL}"


@pytest.mark.parametrize("model,spec1,specm", MULTIROW_CASES,
                         ids=[f"{a}-{c.uri}" for a, _, c in MULTIROW_CASES])
def test_multirow_rows_are_bitwise_single_row(multirow_fns, model, spec1, specm):
    """Each row of the m-row kernel equals the m = 1 kernel run on that row alone, bit for bit (class (a):
    the same arithmetic per row by construction), and the numpy reference within the GEMV tolerance
    (class (b))."""
    _check_rows(multirow_fns, spec1, specm)


@pytest.mark.parametrize("m,seed", FUSED_SQUARES)
def test_multirow_norm_sum_is_the_single_row_sum(multirow_fns, m, seed):
    """Rows whose RMSNorm sum of squares came out one ulp apart between the 512-thread m-row kernel and the
    1-row kernel when the compiler fused the squares' products as it saw fit: bitwise equal now."""
    _check_rows(multirow_fns, FUSED_SQUARES_ONE, FUSED_SQUARES_ROWS[m], seed=seed)


@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("one", MASSIVE_CASES, ids=[s.uri for s in MASSIVE_CASES])
def test_multirow_massive_row_beside_ordinary_rows(multirow_fns, one, m):
    """A row with massive activations prescales itself alone: the ordinary rows beside it (and the massive
    row itself) stay bitwise their m = 1 outputs (class (a)); the ordinary rows within the GEMV tolerance of
    the reference, the massive row finite (its error is the m = 1 kernel's, test_massive_activations')."""
    _check_rows(multirow_fns, one, gemv.multirow_spec(one, m, CFG), massive_rows=(1,))


# multirow.norm_apart: the RMSNorm of qkv's and gate_up's m rows in rmsnorm_prefill, once a row, then the m-row
# GEMV without its prologue (gemv.norm_apart): the default and tensor-core m-row kernels at 2 and 8 rows, and
# every tuned m-row tile (what would ship).
NORM_APART_CASES = list(dict.fromkeys(
    [(one, gemv.multirow_spec(one, m, CFG)) for m in (2, 8)
     for one in [gemv.role_spec(r, QWEN25_7B, CFG) for r in ("qkv", "gate_up")] + gemv.mma_variants(QWEN25_7B, CFG)
     if one.norm]
    + [(one, many) for model, one, many in _tuned_multirow() if model == "7b" and many.norm]))
NORM = gemm.RmsnormPrefillSpec(hidden=QWEN25_7B.hidden, eps=QWEN25_7B.rms_eps, max_m=max(CFG.multirow.buckets))


@pytest.fixture(scope="module")
def norm_apart_fns():
    specs = [NORM] + [gemv.norm_apart(many) for _one, many in NORM_APART_CASES]
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


@pytest.mark.parametrize("massive", [False, True], ids=["ordinary", "massive-row"])
@pytest.mark.parametrize("one,many", NORM_APART_CASES, ids=[s.uri for _, s in NORM_APART_CASES])
def test_norm_apart_rows_are_the_fused_norm_rows(multirow_fns, norm_apart_fns, one, many, massive):
    """rmsnorm_prefill over the m rows, then the m-row GEMV reading its x (gemv.norm_apart): each row the bits
    the m = 1 kernel gives it with the RMSNorm in its prologue (class (a): templates/rmsnorm.cuh is both
    kernels' arithmetic), a row of massive activations included."""
    apart, m = gemv.norm_apart(many), many.m
    case = GemvCase.seeded(many, RUN_SEED, massive_rows=(1,) if massive else ())
    xn = driver.DeviceBuffer(2 * m * many.k)
    try:
        alone = case.alone(multirow_fns[one], one).reshape(m, -1)
        norm_apart_fns[NORM].launch(NORM.launch(m), None, False, h=case.act["h"], w=case.act["norm_w"], xn=xn, m=m)
        case._reset(None)
        args = {k: v for k, v in case.args(0).items() if k not in ("h", "norm_w")}
        norm_apart_fns[apart].launch(apart.launch(), None, False, **args, x=xn)
        out = case._output(apart, None).reshape(m, -1)
    finally:
        xn.free()
        case.free()
    for a in range(m):
        assert np.array_equal(bits(out[a]), bits(alone[a])), (
            f"{apart.uri} after {NORM.uri}: row {a} differs from {one.uri} in "
            f"{np.count_nonzero(bits(out[a]) != bits(alone[a]))} of {one.n} outputs (seed {RUN_SEED})")


# The rope epilogue (gemv.with_rope) on every QKV tile the step may run (the config's, each tuned GPU's) and on tiles
# that pair rows every way the template does: tensor cores 2 and 4 rows a lane group, CUDA cores 8, 16 and 32 lanes.
ROPE_TILES = [{}, gemv.MMA_TILE, {**gemv.MMA_TILE, "rows": 4}, dict(lanes=32, rows=2, warps=4),
              dict(lanes=8, rows=1, warps=4), dict(lanes=16, rows=2, warps=4)]
ROPE_CASES = list(dict.fromkeys(
    (m, s) for m, d in MODELS.items()
    for s in [gemv.role_spec("qkv", d, CFG, **t) for t in ROPE_TILES] + [
        tuned.role_spec("qkv", d, CFG, gpu) for gpu in sorted({k.split("|")[0] for k in store.merged_entries()})]
    if gemv.with_rope(s, d, CFG.kv_cache.page_size)))


@pytest.mark.parametrize("model,spec", ROPE_CASES, ids=[f"{m}-{s.uri}" for m, s in ROPE_CASES])
def test_rope_epilogue_is_the_gemv_then_rope_append(model, spec):
    """The QKV GEMV with rope_append's work in its epilogue gives bit for bit what the GEMV (bias) and then
    rope_append give: q_rot, and the k and v it writes into the page slot of the position (every other slot
    unchanged), at page boundaries and the last position. Class (a): the tile's rows are other weight rows, each
    row's arithmetic the GEMV's, then rope_append's per pair (templates/gemv_int4.cu.j2)."""
    from nanoqwen.codegen.kernels import attention
    from nanoqwen.runtime.paged_kv import KVLayout, PageTable
    d, page = MODELS[model], CFG.kv_cache.page_size
    fused = gemv.with_rope(spec, d, page)
    rope = attention.decode_specs(d, CFG)[0]
    fn, fused_fn, rope_fn = (driver.load(b) for b in codegen.build_many([spec, fused, rope]))
    rng = np.random.default_rng(RUN_SEED % 2**32)
    tokens = 4096
    lay = KVLayout(layers=1, kv_heads=d.kv_heads, head_dim=d.head_dim, page_size=page, num_pages=tokens // page + 4,
                   max_positions=tokens)
    pages = PageTable(lay, order=rng.permutation(lay.num_pages))
    pages.reserve(tokens)
    cos, sin = R.rope_tables(d, tokens)
    pool0 = rng.standard_normal(lay.pool_shape).astype(np.float16)
    case = GemvCase.seeded(spec, RUN_SEED)
    bufs = {n: driver.DeviceBuffer.from_array(a) for n, a in (
        ("rope_cos", cos), ("rope_sin", sin), ("page_table", pages.table), ("k_pool", pool0), ("v_pool", pool0))}
    bufs["q_rot"] = driver.DeviceBuffer(4 * d.q_dim)
    try:
        for pos in (0, 15, 16, 37, tokens - 1, int(rng.integers(0, tokens))):
            state = driver.DeviceBuffer.from_array(np.array([0, pos, 0, 0], np.int32))
            outs = []
            for run in ("apart", "fused"):
                bufs["k_pool"].upload(pool0)
                bufs["v_pool"].upload(pool0)
                bufs["q_rot"].poison()
                if run == "apart":
                    fn.launch(spec.launch(), None, False, **case.args(0))
                    rope_fn.launch(rope.launch(), None, False, qkv=case.y, state=state, **bufs)
                else:
                    args = {k: v for k, v in case.args(0).items() if k != "y"}
                    fused_fn.launch(fused.launch(), None, False, **args, state=state, **bufs)
                driver.device().synchronize()
                outs.append([bufs["q_rot"].download(dtype=np.float32), bufs["k_pool"].download(dtype=np.float16),
                             bufs["v_pool"].download(dtype=np.float16)])
            state.free()
            for name, a, b in zip(("q_rot", "k_pool", "v_pool"), *outs):
                assert np.isfinite(a).all() and np.array_equal(bits(a), bits(b)), (
                    f"{fused.uri} at position {pos}: {name} differs from {spec.uri} + rope_append in "
                    f"{np.count_nonzero(bits(a) != bits(b))} values (seed {RUN_SEED})")
    finally:
        case.free()
        for b in bufs.values():
            b.free()
