"""The runtime's chunked tensor-core prefill (nanoqwen/runtime/prefill.py) on the GPU:

* embed_prefill (unit): h[t] = f32(embed[tokens[t]]) bit-exact for a fresh random fp16 table, rows past n
  untouched (poisoned), out-of-range ids clamped and flagged;
* on the trained small-py model (realistic top-1 margins) for prompt lengths 1, 15, 16, 17, 100 and 600
  (> the 512-token chunk, ending mid-page), with the configured chunk and with small chunks that end
  mid-page (16, 40; chunks of <= prefill.small_m_tokens rows run the small-M GEMM tiles and the split-KV
  attention + combine, so 1..17-token prompts and these chunks do, and 40-token chunks once more with the
  default tiles and the unsplit attention): the last prompt
  token's logits against the INT4 simulation (Reference.prefill), the
  fused argmax, the device state handed to decode ((token, P, P, 0)), and every layer's K/V pages for
  positions 0..P-1 against the simulation's fp16 cache; chunk buffers and logits are poisoned first;
* generation through CudaSession.generate (what the bench's TTFT measures), prefill + free-running
  decode, step by step against the simulation's argmax on the GPU's own prefix: >= 99% token match;
* a random model with the 7B's layer shapes and the planted massive-activation model: logits within
  tolerance and finite.
Tolerances, ||out - ref|| / ||ref||: logits LOGITS_TOL = 4 x validation.gemv_rel_tol (as
tests/gpu/test_decode.py); pages the same (one layer's pages are within 3e-3 in tests/gpu/test_prefill_layer.py,
deeper layers carry the earlier layers' error; a wrong page or slot is an O(1) error).
Exact or within a tolerance (docs/architecture.md): the GPU against the simulation is class (b) (these
tolerances; tokens by DESIGN.md section 7's match rate, each miss printed with the simulation's margin);
embed_prefill and the fused argmax against the kernel's own logits are class (a), exact."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from _texts import corpus_text

from ._gpu_util import fresh_rng, rel, report
from .test_decode import simulated_argmax
from .test_embed import random_f16
from nanoqwen import codegen, config, testmodels
from nanoqwen.codegen.kernels import embed as E
from nanoqwen.codegen.kernels import embed_prefill as EP
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.runtime.prefill import Prefiller
from nanoqwen.testmodels import tiny_dims
from nanoqwen.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

CFG = config.default()
LOGITS_TOL = 4 * CFG.validation.gemv_rel_tol
PAGES_TOL = LOGITS_TOL
TOKEN_MATCH = 0.99
CONTEXT = 1024          # small-py sessions here hold the 600-token prompts
NEW = 24                # tokens generated per prompt in the token-match test
LENGTHS = (1, 15, 16, 17, 100, 600)


# ---- embed_prefill (unit) -----------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [QWEN25_7B, tiny_dims()], ids=["7b", "tiny"])
def test_embed_prefill_kernel(dims):
    spec = EP.specs_for_model(dims, CFG)[0]
    fn = driver.load(codegen.build(spec))
    rng = fresh_rng()
    table = random_f16(rng, (dims.vocab, dims.hidden))
    n, extra = 37, 3
    tokens = np.array([0, dims.vocab - 1, *rng.integers(1, dims.vocab - 1, n - 4), -1, dims.vocab], np.int32)
    want = table[np.clip(tokens, 0, dims.vocab - 1)].astype(np.float32)
    bufs = {"tokens": driver.DeviceBuffer.from_array(tokens), "embed": driver.DeviceBuffer.from_array(table),
            "h": driver.DeviceBuffer(4 * (n + extra) * dims.hidden), "err": driver.DeviceBuffer(4)}
    try:
        bufs["h"].poison()
        bufs["err"].memset_u32(0)
        with driver.Stream() as s:
            fn.launch(spec.launch(n), s, True, n=n, **bufs)
            s.synchronize()
        h = bufs["h"].download(dtype=np.float32, shape=(n + extra, dims.hidden))
        err = int(bufs["err"].download(dtype=np.uint32, shape=(1,))[0])
    finally:
        for b in bufs.values():
            b.free()
    report(f"embed_prefill {dims.hidden}x{dims.vocab}, n={n}: ||h - ref|| / ||ref|| (tolerance: exact)",
           rel(h[:n], want), 0.0)
    np.testing.assert_array_equal(h[:n].view(np.uint32), want.view(np.uint32))   # class (a): an exact widening
    assert (h[n:].view(np.uint32) == 0x7FFF7FFF).all(), "rows past n were written"
    assert err == E.ERR_TOKEN_RANGE, f"out-of-range ids -1 and vocab: err = {err:#x}"


# ---- the runtime prefill against the simulation --------------------------------------------------------
@pytest.fixture(scope="module")
def corpus():
    """A long token stream of real Python (the committed corpus, tests/_texts.py): prompts are random
    windows of it."""
    ids = Tokenizer(testmodels.SMALL_PY_DIR).encode(corpus_text())
    assert len(ids) > 20 * max(LENGTHS)
    return ids


def window(corpus, rng, n: int) -> list[int]:
    start = int(rng.integers(0, len(corpus) - n))
    return corpus[start:start + n]


def run_prefill(session, pre, prompt):
    """Prefill ``prompt`` through ``pre`` on fresh pages, poisoned buffers first; returns (last-position
    logits, fused token, device state)."""
    sh, P = session.state, len(prompt)
    session.runner.reserve(P + NEW - 1)
    for b in (*(pre.bufs[n] for n in pre.bufs.names), sh.bufs.logits):
        b.poison()
    sh.reset(int(prompt[-1]), P - 1, P - 1)
    session.decoder.lm_head(pre(prompt, 0))
    sh.read_back(P - 1, read_token=True, read_logits=True)
    sh.wait_step(P - 1)
    logits = sh.logits()
    token = int(sh.tok_out[P - 1])
    sh.check_errors()
    return logits, token, sh.read_state()


def pages_error(session, ref, P: int) -> float:
    """Worst relative error over layers of the K and V pages at positions 0..P-1 vs the simulation."""
    want = [(ref.k_cache[i][:P], ref.v_cache[i][:P]) for i in range(session.dims.layers)]
    return max(rel(g, w) for got, ws in zip(gathered_pages(session, P), want) for g, w in zip(got, ws))


def gathered_pages(session, P: int) -> list:
    """Per layer (K, V) of positions 0..P-1 from the device pools, through the loaded page table."""
    kv, lay = session.kv, session.kv.layout
    where = [kv.locate(p) for p in range(P)]
    pages, slots = np.array([w[0] for w in where]), np.array([w[1] for w in where])
    out = []
    for i in range(session.dims.layers):
        pair = tuple(pool.download(dtype=np.float16, shape=lay.pool_shape)[pages, :, slots, :] for pool in (kv.k[i], kv.v[i]))
        assert all(np.isfinite(x).all() for x in pair), f"layer {i}: non-finite K/V in the pages"
        out.append(pair)
    return out


def check_prefill(session, ref, pre, prompt, what: str) -> int:
    P = len(prompt)
    logits, token, state = run_prefill(session, pre, prompt)
    want = ref.prefill(prompt)[-1]
    e, pe = rel(logits, want), pages_error(session, ref, P)
    report(f"{what}: last-token logits rel error", e, LOGITS_TOL)
    report(f"{what}: K/V pages rel error (worst layer)", pe, PAGES_TOL)
    assert np.isfinite(logits).all(), f"{what}: non-finite logits"
    assert e <= LOGITS_TOL, f"{what}: logits error {e:.3e}"
    assert pe <= PAGES_TOL, f"{what}: pages error {pe:.3e}"
    assert token == int(np.argmax(logits)), f"{what}: fused argmax {token} != argmax(logits)"
    assert state.tolist() == [token, P, P, 0], f"{what}: device state after prefill {state.tolist()}"
    return token


@pytest.mark.parametrize("chunk,small_m", [(None, None), (16, None), (40, None), (40, 0)],
                         ids=["config-chunk", "chunk16", "chunk40", "chunk40-big-tiles"])
@pytest.mark.parametrize("P", LENGTHS)
def test_prefill_matches_simulation(sessions, references, corpus, P, chunk, small_m):
    s, ref = sessions("small-py", context=CONTEXT), references("small-py")
    assert s.prefiller is not None and s.runner.prefiller is s.prefiller
    if chunk is not None and chunk >= P:
        pytest.skip("one chunk: the config-chunk case covers it")
    small_m = s.prefiller.small_m_tokens if small_m is None else small_m
    pre = s.prefiller if chunk is None else Prefiller(s.state, s.decoder.kernels, chunk, small_m)
    try:
        check_prefill(s, ref, pre, window(corpus, fresh_rng(), P),
                      f"small-py P={P} chunk={pre.chunk_tokens}")
    finally:
        s.state.drain()
        if pre is not s.prefiller:
            pre.close()


def test_generate_token_match(sessions, references, corpus):
    """CudaSession.generate (prefill + free-running decode), two prompts of every length: each token
    against the simulation's argmax on the GPU's own prefix."""
    s, ref = sessions("small-py", context=CONTEXT), references("small-py")
    rng = fresh_rng()
    match = total = 0
    misses = []
    for P in LENGTHS:
        for _ in range(2):
            prompt = window(corpus, rng, P)
            gen = list(s.generate(prompt, NEW))
            want, margin = simulated_argmax(ref, prompt, gen)
            ok = np.asarray(gen) == want
            match += int(ok.sum())
            total += len(gen)
            misses += [(P, P + i, gen[i], int(want[i]), float(margin[i])) for i in np.nonzero(~ok)[0]]
    rate = match / total
    print(f"prefill + decode: {match}/{total} tokens match ({100 * rate:.2f}%), mismatches (P, pos, gpu, sim, "
          f"sim top-1 margin): {misses[:20]}", file=sys.stderr)
    assert rate >= TOKEN_MATCH


@pytest.mark.parametrize("chunk", [None, 48], ids=["config-chunk", "chunk48"])
def test_7b_shapes_prefill(sessions, references, chunk):
    s, ref = sessions("7b-shapes"), references("7b-shapes")
    small_m = s.prefiller.small_m_tokens   # chunks of 48: the small-M tiles at the 7B's shapes
    pre = s.prefiller if chunk is None else Prefiller(s.state, s.decoder.kernels, chunk, small_m)
    try:
        prompt = fresh_rng().integers(0, s.dims.vocab, 100).tolist()
        check_prefill(s, ref, pre, prompt, f"7b-shapes P=100 chunk={pre.chunk_tokens}")
    finally:
        s.state.drain()
        if pre is not s.prefiller:
            pre.close()


def test_massive_activations_prefill(sessions, references):
    s = sessions("massive")
    check_prefill(s, references("massive"), s.prefiller, fresh_rng().integers(0, s.dims.vocab, 40).tolist(),
                  "massive P=40")
