"""GPU unit tests of the wgmma INT4 GEMM (gemm_wgmma; the prefill's GEMMs with prefill.wgmma) on the 7B and
tiny-model shapes of every role (qkv f32 + bias, o_proj / down residual, gate/up SwiGLU) for M in {1, 7, 16, 17, 100,
512} (the default tile, inflight 0, one consumer warpgroup), against the numpy reference (`reference.gemv` on the exactly dequantized weights) on fresh random
data, with tests/gpu/test_gemm.py's buffers, poisoning and tolerances (GEMM_TOL fp32 out, F16_TOL fp16 out);
plus row invariance: a row's output is bitwise the same at M = 7 and M = 512 and in the short chunks' tile
(same inputs, same residual)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen.kernels import gemm as G
from nanoqwen.codegen.kernels import gemm_wgmma as W
from nanoqwen.runtime import driver

from .test_gemm import F16_TOL, GEMM_TOL, MODELS, ROLES, Gemm, rel_err

pytestmark = pytest.mark.gpu

CFG = config.default()
MS = (1, 7, 16, 17, 100, 512)
F16_VARIANT = dict(epilogue="f16")   # the qkv shape with the f16 epilogue (not in the model plan)
# the default (two consumer warpgroups, one chunk of wgmmas running while the next is dequantized), the
# drain-every-chunk fallback, one consumer warpgroup with two row blocks, and the short chunks' tile
VARIANTS = ({}, {"inflight": 0}, {"consumers": 1, "bn": 128}, W.SMALL_M_TILE)


def _role_spec(model: str, role: str, variant: dict | None = None) -> W.GemmWgmmaSpec:
    return replace(W.model_gemms(MODELS[model], CFG.quant.group_size)[role], **(variant or {}))


def _specs():
    specs = [_role_spec(m, r, v) for m in MODELS for r in ROLES for v in VARIANTS]
    return specs + [replace(_role_spec(m, "qkv"), **F16_VARIANT) for m in MODELS]


@pytest.fixture(scope="module")
def fns():
    return {b.spec: driver.load(b) for b in codegen.build_many(_specs())}


def _check(what: str, out: np.ndarray, ref: np.ndarray, tol: float) -> None:
    assert np.isfinite(out).all(), f"{what}: {np.size(out) - np.isfinite(out).sum()} non-finite outputs"
    err = rel_err(out, ref)
    print(f"{what}: rel {err:.2e} (tol {tol:.0e})")
    assert err <= tol, f"{what}: rel error {err:.3e} > {tol}"


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("role", ROLES)
def test_gemm_wgmma(fns, model, role, variant):
    spec = _role_spec(model, role, variant)
    g = Gemm(spec, np.random.default_rng(), max(MS))
    tol = F16_TOL if spec.epilogue == "swiglu" else GEMM_TOL
    for m in MS:
        out, ref = g.run(fns[spec], m)
        _check(f"{model} {role} {spec.uri} M={m}", out, ref, tol)


@pytest.mark.parametrize("model", MODELS)
def test_gemm_wgmma_f16_epilogue(fns, model):
    spec = replace(_role_spec(model, "qkv"), **F16_VARIANT)
    g = Gemm(spec, np.random.default_rng(), 100)
    for m in (1, 17, 100):
        out, ref = g.run(fns[spec], m)
        _check(f"{model} f16 M={m}", out, ref, F16_TOL)


@pytest.mark.parametrize("role", ROLES)
def test_rows_do_not_depend_on_m(fns, role):
    """Chunk invariance (DESIGN.md section 12): the first 7 rows computed in a 7-row call and in a 512-row
    call (other rows, other CTAs along M, a full tile beside them) are the same bits, and the first 32 in the
    short chunks' tile (a 64-row block a CTA, one consumer warpgroup) too."""
    spec = _role_spec("7b", role)
    rng = np.random.default_rng()
    g = Gemm(spec, rng, 512)
    resid = rng.standard_normal((512, spec.n)).astype(np.float32)
    big, _ = g.run(fns[spec], 512, resid)
    small, _ = g.run(fns[spec], 7, resid)
    assert np.isfinite(big).all()
    np.testing.assert_array_equal(small.view(np.uint8), big[:7].view(np.uint8), err_msg=f"{spec.uri}: M=7 vs M=512")
    g.spec = short = _role_spec("7b", role, W.SMALL_M_TILE)   # the short chunks' tile, same weights and inputs
    tail, _ = g.run(fns[short], 32, resid)
    np.testing.assert_array_equal(tail.view(np.uint8), big[:32].view(np.uint8),
                                  err_msg=f"{short.uri} (short chunks' tile) M=32 vs {spec.uri} M=512")


@pytest.mark.parametrize("role", ROLES)
def test_wgmma_rows_are_the_mma_sync_rows(fns, role):
    """Whether wgmma's m64nNk16 and mma.sync's m16n8k16 give an element the same bits when they see the same fp16
    operands in the same K order (the weights are wgmma's A and mma.sync's B): if they do, the long chunks may run
    on wgmma while the short ones keep the mma.sync tiles, and a row is still the same bits in any chunk. Both
    kernels fold each group's scale into fp16 weights and chain k16 MMAs over K into one fp32 accumulator."""
    spec = _role_spec("7b", role)
    mma = G.model_gemms(MODELS["7b"], CFG.quant.group_size)[role]
    mma_fn = driver.load(codegen.build(mma))
    rng = np.random.default_rng(7)
    g = Gemm(spec, rng, 512)
    resid = rng.standard_normal((512, spec.n)).astype(np.float32)
    for m in (512, 7):
        g.spec = spec
        want, _ = g.run(fns[spec], m, resid)
        g.spec = mma
        got, _ = g.run(mma_fn, m, resid)
        differ = np.count_nonzero(got.view(np.uint8) != want.view(np.uint8))
        print(f"{role} M={m}: {differ} bytes of {got.nbytes} differ between {mma.uri} and {spec.uri}")
        assert differ == 0, f"{role} M={m}: {differ} bytes differ between {mma.uri} and {spec.uri}"
