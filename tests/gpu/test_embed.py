"""GPU unit test of the embed kernel (7B and tiny dims) on a fresh random fp16 table each run:
h = f32(embed[state[0]]) must be bit-exact (fp16 -> fp32 is exact), for random token ids including 0 and
vocab-1; out-of-range ids (-1, vocab, 2^31-1) are clamped to 0 / vocab-1 and set ERR_TOKEN_RANGE; the
lm_head argmax counter is re-armed to 0; the decode state is left untouched. h is poisoned (NaN) before
every launch, so every element is checked. Tolerance: exact (||h - ref|| / ||ref|| = 0 is reported)."""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen import codegen, config
from nanoqwen.codegen.kernels import embed as E
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.testmodels import tiny_dims

pytestmark = pytest.mark.gpu

CFG = config.default()
MODELS = {"7b": QWEN25_7B, "tiny": tiny_dims()}


def random_f16(rng, shape) -> np.ndarray:
    """Random finite fp16 bit patterns of every kind (normals of both signs, subnormals, +-0), |x| < 1:
    exponent bits 14 and 10 cleared, so no inf/NaN."""
    return (rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & np.uint16(0xBBFF)).view(np.float16)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    dims = MODELS[request.param]
    spec = E.specs_for_model(dims, CFG)[0]
    fn = driver.load(codegen.build(spec))
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    table = random_f16(rng, (dims.vocab, dims.hidden))
    bufs = {"embed": driver.DeviceBuffer.from_array(table), "h": driver.DeviceBuffer(4 * dims.hidden),
            "state": driver.DeviceBuffer(16), "err": driver.DeviceBuffer(4), "argmax_done": driver.DeviceBuffer(4)}
    yield dims, spec, fn, table, bufs, rng, seed
    for b in bufs.values():
        b.free()


def _run(dims, spec, fn, bufs, token: int, pdl: bool):
    state = np.array([token, 37, 5, 0], dtype=np.int32)
    bufs["state"].upload(state)
    bufs["h"].poison()
    bufs["err"].memset_u32(0)
    bufs["argmax_done"].memset_u32(0xDEAD)
    driver.device().synchronize()
    with driver.Stream() as s:
        fn.launch(spec.launch(), stream=s, pdl=pdl, state=bufs["state"], embed=bufs["embed"], h=bufs["h"],
                  err=bufs["err"], argmax_done=bufs["argmax_done"])
        s.synchronize()
    h = bufs["h"].download(dtype=np.float32, shape=(dims.hidden,))
    err = int(bufs["err"].download(dtype=np.uint32, shape=(1,))[0])
    done = int(bufs["argmax_done"].download(dtype=np.uint32, shape=(1,))[0])
    after = bufs["state"].download(dtype=np.int32, shape=(4,))
    np.testing.assert_array_equal(after, state, err_msg="embed must not modify the decode state")
    assert done == 0, "embed must re-arm the argmax arrival counter"
    return h, err


def _check(h, ref, what):
    """Class (a): an fp16 row widened to fp32 is exact, so the kernel's row is numpy's bit for bit."""
    rel = float(np.linalg.norm(h.astype(np.float64) - ref) / max(np.linalg.norm(ref.astype(np.float64)), 1e-30))
    print(f"{what}: ||h - ref|| / ||ref|| = {rel:.1e} (tolerance: exact)")
    np.testing.assert_array_equal(h.view(np.uint32), ref.view(np.uint32), err_msg=what)


def test_embed_valid_tokens(case):
    dims, spec, fn, table, bufs, rng, seed = case
    tokens = [0, dims.vocab - 1, *rng.integers(1, dims.vocab - 1, size=6).tolist()]
    for i, t in enumerate(tokens):
        h, err = _run(dims, spec, fn, bufs, t, pdl=bool(i % 2))
        _check(h, table[t].astype(np.float32), f"seed {seed}, token {t}")
        assert err == 0, f"token {t} is valid but err = {err:#x}"


def test_embed_out_of_range_tokens_clamp_and_flag(case):
    dims, spec, fn, table, bufs, rng, seed = case
    for t, clamped in ((-1, 0), (-2**31, 0), (dims.vocab, dims.vocab - 1), (2**31 - 1, dims.vocab - 1)):
        h, err = _run(dims, spec, fn, bufs, t, pdl=False)
        _check(h, table[clamped].astype(np.float32), f"seed {seed}, out-of-range token {t} -> {clamped}")
        assert err == E.ERR_TOKEN_RANGE, f"token {t}: err = {err:#x}, want ERR_TOKEN_RANGE"
