"""Chunk invariance of the CUDA prefill (DESIGN.md section 12; docs/architecture.md, "Chunk invariance"):
a prompt position's K/V, hidden state and logits are the same bits whether it was prefilled cold in a long
chunk, reused from the prefix cache or prefilled in a short tail chunk, and a short chunk replayed as a
captured graph (runtime/chunk_graphs.py) gives the bits of the same chunk launched kernel by kernel.

Class (a) throughout (docs/architecture.md, "Exact or within a tolerance"): every comparison here is of
the same per-row arithmetic by construction, so logits and K/V are compared as bits and greedy tokens
with no tolerance.

* 50 prompts of committed Python (tests/_texts.py, fixed windows), each cut at several points (mid-page,
  page-aligned, at and across the 256-key attention block and the 512-row chunk boundaries, a 32-token
  editor tail, the last token): the request that reuses the cut's prefix gives the cold request's logits
  rows and tokens, bit for bit;
* one prompt prefilled in chunks of 1 .. 512 rows (long chunks kernel by kernel, short ones as graphs, and
  short ones kernel by kernel): the same K/V pages and last-position logits, bit for bit, on the trained
  small-py model and on a random model with the 7B's layer shapes (28 heads, 4 KV heads, head_dim 128);
* a tail of 1 .. 64 rows at positions around the key-block boundaries, replayed as a graph and launched
  kernel by kernel: the same pages and logits, and the graph path really replayed.
The chunk sizes and the graph replay are checked again with ``prefill.gemv_order`` (GEMMs in the tensor-core
GEMV's order, chunks of at most 16 rows as row GEMVs: their bits must be the GEMMs') and with
``prefill.wgmma`` (the wgmma GEMM's one tile per role for every chunk)."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest

from _margins import assert_same_pairs

from .test_prefill_runtime import corpus, gathered_pages, window  # noqa: F401
from nanoqwen import config

pytestmark = pytest.mark.gpu

CFG = config.default()
PAGE = CFG.kv_cache.page_size
BLOCK = CFG.prefill.attention_block_keys
CHUNK = CFG.prefill.chunk_tokens
CONTEXT = 1024
NEW = 8
PROMPTS = 50


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def engine(packed):
    """A graph session of the trained small-py model whose pool holds two full-context sequences."""
    from nanoqwen.runtime.session import CudaSession
    s = CudaSession(packed("small-py"), CONTEXT, kv_tokens=2 * CONTEXT, log=lambda m: print(m, file=sys.stderr))
    assert s.prefiller.graphs is not None and s.prefiller.graphs.captured
    yield s
    s.close()


def cuts(P: int) -> list[int]:
    """Reused prefix lengths of a prompt of P tokens: mid-page, page-aligned, the first key block's end and
    just past it, the first chunk's end and just past it, a 32-token tail, the last token."""
    want = [37, 3 * PAGE, BLOCK, BLOCK + 5, CHUNK, CHUNK + 1, P - 32, P - 1]
    return sorted({c for c in want if 1 <= c <= P - 1})


def test_cached_request_equals_cold(engine, corpus):
    rng = np.random.default_rng(21)   # fixed windows: the same 50 prompts every run
    s, checked = engine, 0
    for k in range(PROMPTS):
        P = int(rng.integers(300, 800))
        prompt = window(corpus, rng, P)
        s.runner.cache.clear()
        cold = list(s.generate(prompt, NEW, logits=True))
        assert s.cached_tokens == 0
        for L in cuts(P):
            s.runner.cache.clear()
            list(s.generate(prompt[:L], 1))   # keeps exactly positions [0, L)
            got = list(s.generate(prompt, NEW, logits=True))
            assert s.cached_tokens == L
            assert_same_pairs(got, cold, f"prompt {k} (P={P}) reusing {L}")
            checked += 1
    print(f"{checked} cached requests equal their cold runs bit for bit", file=sys.stderr)


def prefill_in_chunks(s, prompt, chunk: int, replay: bool):
    """Prefill ``prompt`` on fresh pages in chunks of ``chunk`` rows (short ones replayed as graphs or not):
    (last-position logits, token, per-layer K/V pages)."""
    P, sh, pre = len(prompt), s.state, s.prefiller
    saved = pre.chunk_tokens, pre.replay
    pre.chunk_tokens, pre.replay = chunk, replay
    try:
        s.runner.reserve(P + 1)
        s.runner.prefill(prompt, 0, read_token=True, read_logits=True)
        sh.wait_step(P - 1)
        logits, token = sh.logits(), int(sh.tok_out[P - 1])
        sh.check_errors()
    finally:
        pre.chunk_tokens, pre.replay = saved
    return logits, token, gathered_pages(s, P)


def assert_same_prefill(got, want, what: str) -> None:
    (lg, tg, pg), (lw, tw, pw) = got, want
    assert tg == tw, f"{what}: token {tg} != {tw}"
    assert np.array_equal(bits(lg), bits(lw)), f"{what}: last-position logits differ"
    for i, (layer_g, layer_w) in enumerate(zip(pg, pw)):
        for name, g, w in zip("KV", layer_g, layer_w):
            same = g.view(np.uint16) == w.view(np.uint16)
            if not same.all():
                pos = int(np.argwhere(~same)[0][0])
                raise AssertionError(f"{what}: layer {i} {name} pages differ first at position {pos}")


# prefill.gemv_order: the GEMMs in the tensor-core GEMV's order, chunks of <= 16 rows as row GEMVs (and with
# row_tail_tokens, last chunks of up to 64 rows cut into such chunks)
GEMV_ORDER = replace(CFG, prefill=replace(CFG.prefill, gemv_order=True))
GEMV_ORDER_CUT = replace(CFG, prefill=replace(CFG.prefill, gemv_order=True, row_tail_tokens=64))
WGMMA = replace(CFG, prefill=replace(CFG.prefill, wgmma=True))   # every GEMM the wgmma GEMM, short chunks too
ORDERS = {"fold": None, "gemv": GEMV_ORDER, "wgmma": WGMMA}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("model", ["small-py", "7b-shapes"])
def test_any_chunk_size_gives_the_same_bits(sessions, corpus, model, order):
    s = sessions(model, context=CONTEXT, cfg=GEMV_ORDER_CUT if order == "gemv" else ORDERS[order])
    prompt = window(corpus, np.random.default_rng(5), 700) if model == "small-py" else \
        np.random.default_rng(5).integers(0, s.dims.vocab, 700).tolist()
    whole = prefill_in_chunks(s, prompt, CHUNK, True)
    for chunk in (300, 100, 64, 33, 32, 17, 8, 1):   # at most the session's chunk (its buffers' rows)
        for replay in (True, False):
            assert_same_prefill(prefill_in_chunks(s, prompt, chunk, replay), whole,
                                f"{model}: chunks of {chunk} ({'graphs' if replay else 'kernel by kernel'})")


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("model", ["small-py", "7b-shapes"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 32, 33, 64])
def test_graph_replay_equals_kernel_by_kernel(sessions, corpus, monkeypatch, model, n, order):
    """A tail of n rows after a prefix prefilled once, ending before, at and past a key-block boundary."""
    s = sessions(model, context=CONTEXT, cfg=ORDERS[order])
    pre = s.prefiller
    assert pre.graphs.captured and pre.graph_rows() == max(CFG.prefill.graph_buckets)
    replays = []
    monkeypatch.setattr(pre.graphs, "run", lambda c0, n_, b=None, run=pre.graphs.run: (replays.append(n_), run(c0, n_, b)))
    prompt = window(corpus, np.random.default_rng(n), 3 * BLOCK) if model == "small-py" else \
        np.random.default_rng(n).integers(0, s.dims.vocab, 3 * BLOCK).tolist()
    for end in (BLOCK - 3, BLOCK, 2 * BLOCK + n // 2, 3 * BLOCK):
        p0 = end - n
        out = {}
        for replay in (True, False):
            pre.replay = replay
            try:
                s.runner.reserve(end + 1)
                if p0:
                    s.runner.prefill(prompt[:p0], 0)
                replays.clear()
                s.runner.prefill(prompt[p0:end], p0, read_token=True, read_logits=True)
                s.state.wait_step(end - 1)
                s.state.check_errors()
                assert replays == ([n] if replay else []), f"graph replays {replays}"
                out[replay] = (s.state.logits(), int(s.state.tok_out[end - 1]), gathered_pages(s, end))
            finally:
                pre.replay = True
        assert_same_prefill(out[True], out[False], f"{model}: tail of {n} at {p0}")
