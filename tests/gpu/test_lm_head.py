"""GPU unit tests of lm_head_argmax (final RMSNorm + fp16 lm_head GEMV + fused argmax + state advance)
against nanoqwen.reference (rmsnorm_f16, gemv) on fresh random data each run (the seed is printed), for
the 7B shape, the tiny test model and two variants that exercise rows_per_warp > 1, several load batches
and a partial last column (hidden 896).

- Outputs are poisoned before each launch (logits NaN, tokens_out 0x7FFF7FFF, partials NaN); every logit
  is checked. Tolerance: ||logits - ref|| / ||ref|| <= LOGITS_REL_TOL = 1e-4 (fp32 accumulation in
  another order, and the rare fp16 rounding flip of xf when the GPU's sum of squares differs from
  numpy's by an ulp; measured values are printed).
- Argmax: the token must equal np.argmax of the kernel's own fp32 logits exactly (first maximum), and
  np.argmax of the reference logits; with random weights the top two reference logits can sit within
  the measured logit error of each other, and then either is accepted (the test says so). The planted
  tests (clear margins, asserted on the reference first) require exact tokens. Class (b) of
  docs/architecture.md throughout: the margin rule of tests/_margins.py at the measured logit error.
- Ties: identical rows placed in the same warp (next grid sweep), in other CTAs, at vocab-1, and when
  rows_per_warp > 1 in the same chunk: the lowest index must win. NaN logits never win; all-NaN logits
  give token 0 and ERR_NO_FINITE_LOGIT.
- State: consecutive launches advance pos/step by one each and fill tokens_out; a captured CUDA graph of
  embed + lm_head_argmax (PDL edge) replayed 5 + 5 times follows a planted token chain on the device.
- Multi-row (m = 1, 2, 3, 4, 8, 16): every row's logits bitwise the m = 1 kernel's on that row alone, its
  token the m = 1 token (ties included), tokens in tokens_out[0..m), the state untouched.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _margins import check_tokens

from nanoqwen import codegen, config
from nanoqwen import reference as R
from nanoqwen.codegen.kernels import embed as E
from nanoqwen.codegen.kernels import lm_head as L
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver
from nanoqwen.testmodels import tiny_dims

pytestmark = pytest.mark.gpu

CFG = config.default()
LOGITS_REL_TOL = 1e-4
POISON_I32 = 0x7FFF7FFF            # DeviceBuffer.poison's word
DIMS = {"7b": QWEN25_7B, "tiny": tiny_dims()}
_7B = L.specs_for_model(QWEN25_7B, CFG)[0]
SPECS = {
    "7b": _7B,
    "tiny": L.specs_for_model(DIMS["tiny"], CFG)[0],
    "7b-rows2-unroll7": dataclasses.replace(_7B, rows_per_warp=2, unroll=7),
    "h896-rows4": L.LmHeadArgmaxSpec(hidden=896, vocab=8192, warps=4, rows_per_warp=4, unroll=2, ctas=37),
}


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def random_head(rng, n: int, k: int) -> np.ndarray:
    """fp16 [n, k] weights of random sign and mantissa, magnitude in [2^-9, 2^-7) (an exponent bit at random),
    built from random bits: numpy's normal draws and fp16 casts take ~10 s for the 7B's 545 M weights, and
    the module needs a dozen heads."""
    bits = rng.integers(0, 2**16, size=(n, k), dtype=np.uint16)
    return ((bits & np.uint16(0x87FF)) | np.uint16(0x1800)).view(np.float16)


class LmHead:
    """One spec's weights (host + device), scratch and state buffers, launches and read-back. `like`: take
    another case's host weights and norm weight (shared, read-only here) instead of drawing new ones."""

    def __init__(self, spec, fn, tokens_cap: int = 16, like: "LmHead | None" = None):
        self.spec, self.fn, self.tokens_cap = spec, fn, tokens_cap
        self.seed = int(np.random.SeedSequence().entropy % 2**32)
        self.rng = np.random.default_rng(self.seed)
        n, k = spec.vocab, spec.hidden
        if like is not None:
            self.w, self.norm_w, self.w32 = like.w, like.norm_w, like.w32
        else:
            self.w = random_head(self.rng, n, k)
            self.norm_w = np.clip(1 + 0.1 * self.rng.standard_normal(k, dtype=np.float32), 0.5, 1.5).astype(np.float16)
            self.w32 = self.w.astype(np.float32)  # the reference's operand, converted once
        self.buf = {name: driver.DeviceBuffer(nbytes) for name, nbytes in (
            ("h", 4 * k * spec.m), ("norm_w", 2 * k), ("lm_head", 2 * n * k), ("logits", 4 * n * spec.m), ("state", 16),
            ("tokens_out", 4 * tokens_cap), ("partials", spec.partials_bytes), ("argmax_done", 4), ("err", 4))}
        self.buf["lm_head"].upload(self.w)
        self.buf["norm_w"].upload(self.norm_w)
        self.stream = driver.Stream()

    def set_rows(self, rows, values) -> None:
        self.w[rows] = values
        self.w32[rows] = self.w[rows].astype(np.float32)
        self.buf["lm_head"].upload(self.w)

    def set_weights(self, w: np.ndarray) -> None:
        self.w[:] = w
        self.w32[:] = w.astype(np.float32)
        self.buf["lm_head"].upload(self.w)

    def reset(self, state=(123, 40, 0, 0)) -> None:
        self.buf["state"].upload(np.array(state, dtype=np.int32))
        for name in ("tokens_out", "partials", "logits"):
            self.buf[name].poison()
        self.buf["argmax_done"].memset_u32(0)
        self.buf["err"].memset_u32(0)
        driver.device().synchronize()

    def args(self, logits: bool = True) -> dict:
        b = self.buf
        args = dict(h=b["h"], norm_w=b["norm_w"], lm_head=b["lm_head"], logits=b["logits"] if logits else 0,
                    state=b["state"], tokens_out=b["tokens_out"], tokens_cap=self.tokens_cap,
                    partials=b["partials"], argmax_done=b["argmax_done"], err=b["err"])
        return {name: args[name] for name, _ in self.spec.signature}   # m > 1 takes no decode state

    def launch(self, h: np.ndarray, logits: bool = True, pdl: bool = False) -> None:
        self.stream.synchronize()
        self.buf["h"].upload(np.asarray(h, dtype=np.float32))
        driver.device().synchronize()
        self.fn.launch(self.spec.launch(), stream=self.stream, pdl=pdl, **self.args(logits))

    def read(self) -> dict:
        self.stream.synchronize()
        b = self.buf
        m, vocab = self.spec.m, self.spec.vocab
        return dict(logits=b["logits"].download(dtype=np.float32, shape=(m, vocab) if m > 1 else (vocab,)),
                    state=b["state"].download(dtype=np.int32, shape=(4,)),
                    tokens=b["tokens_out"].download(dtype=np.int32, shape=(self.tokens_cap,)),
                    err=int(b["err"].download(dtype=np.uint32, shape=(1,))[0]))

    def reference(self, h: np.ndarray) -> np.ndarray:
        return R.gemv(self.w32, R.rmsnorm_f16(h, self.norm_w, self.spec.eps))

    def random_h(self) -> np.ndarray:
        return self.rng.standard_normal(self.spec.hidden, dtype=np.float32)

    def planted(self):
        """(h, row): a row aligned with sign(xf(h)) whose logit beats every random row by a wide margin."""
        s = self.rng.choice(np.array([-1.0, 1.0], np.float32), self.spec.hidden)
        h = s * (0.5 + np.abs(self.rng.standard_normal(self.spec.hidden, dtype=np.float32)))
        return h.astype(np.float32), (0.05 * s).astype(np.float16)

    def close(self) -> None:
        self.stream.close()
        for b in self.buf.values():
            b.free()


@pytest.fixture(scope="module")
def fns():
    specs = list(SPECS.values()) + [E.specs_for_model(d, CFG)[0] for d in DIMS.values()]
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


@pytest.fixture(scope="module", params=list(SPECS))
def lm(request, fns):
    spec = SPECS[request.param]
    case = LmHead(spec, fns[spec])
    print(f"\n{request.param}: {spec.uri}, seed {case.seed}")
    yield case
    case.close()


def check_logits(lm: LmHead, out: dict, ref: np.ndarray, what: str) -> float:
    logits = out["logits"]
    assert np.isfinite(logits).all(), f"{what}: {np.count_nonzero(~np.isfinite(logits))} non-finite logits"
    err = rel_err(logits, ref)
    print(f"{what}: ||logits - ref|| / ||ref|| = {err:.2e} (tolerance {LOGITS_REL_TOL:g})")
    assert err <= LOGITS_REL_TOL, f"{what} (seed {lm.seed})"
    return float(np.max(np.abs(logits.astype(np.float64) - ref)))


def check_token_vs_reference(token: int, ref: np.ndarray, max_abs: float, what: str) -> None:
    """Class (b), kernel against numpy: the margin rule (tests/_margins.py) at the measured logit error."""
    check_tokens([token], [int(np.argmax(ref))], [ref], lambda j: max_abs, what)


def test_logits_and_argmax_random(lm):
    for i in range(3):
        lm.reset()
        h = lm.random_h()
        lm.launch(h, pdl=bool(i % 2))
        out = lm.read()
        ref = lm.reference(h)
        max_abs = check_logits(lm, out, ref, f"random h #{i}")
        token = int(out["state"][0])
        assert token == int(np.argmax(out["logits"])), "fused argmax disagrees with the kernel's own logits"
        check_token_vs_reference(token, ref, max_abs, f"random h #{i}")
        np.testing.assert_array_equal(out["state"], [token, 41, 1, 0])
        assert out["tokens"][0] == token and (out["tokens"][1:] == POISON_I32).all()
        assert out["err"] == 0
        # The same step without the logits output: same token, logits left untouched.
        lm.reset()
        lm.launch(h, logits=False)
        out2 = lm.read()
        assert int(out2["state"][0]) == token
        assert (out2["logits"].view(np.uint32) == POISON_I32).all(), "logits=0 must skip the logits store"


def test_planted_tokens_advance_state(lm):
    """Four consecutive launches, each with its own clear winner: pos/step +1 per launch, tokens_out filled."""
    rows = lm.rng.choice(lm.spec.vocab, size=4, replace=False)
    hs, vs = zip(*(lm.planted() for _ in rows))
    lm.set_rows(rows, np.stack(vs))
    lm.reset(state=(7, 40, 0, 0))
    for i, (h, r) in enumerate(zip(hs, rows)):
        ref = lm.reference(h)
        second = np.partition(ref, -2)[-2]
        assert int(np.argmax(ref)) == r and ref[r] - second > 100 * LOGITS_REL_TOL * np.abs(ref).max()
        lm.launch(h, pdl=bool(i % 2))
        out = lm.read()
        check_logits(lm, out, ref, f"planted row {r}")
        np.testing.assert_array_equal(out["state"], [r, 41 + i, 1 + i, 0])
    np.testing.assert_array_equal(out["tokens"][:4], rows)
    assert (out["tokens"][4:] == POISON_I32).all() and out["err"] == 0


def test_ties_resolve_to_lowest_index(lm):
    s = lm.spec
    h, v = lm.planted()
    sweep = s.ctas * s.warps * s.rows_per_warp        # rows per grid-wide sweep
    r0 = int(lm.rng.integers(s.vocab // 4, s.vocab // 2))
    cands = {r0, r0 + sweep, r0 + sweep - s.warps * s.rows_per_warp,   # same warp later; a lower CTA later
             int(lm.rng.integers(s.vocab // 2, s.vocab)), s.vocab - 1}
    if s.rows_per_warp > 1:
        cands.add(r0 - r0 % s.rows_per_warp + (r0 + 1) % s.rows_per_warp)   # same chunk, same warp
    rows = np.array(sorted(c for c in cands if 0 <= c < s.vocab))
    lm.set_rows(rows, np.broadcast_to(v, (len(rows), s.hidden)))
    lm.reset()
    lm.launch(h)
    out = lm.read()
    ref = lm.reference(h)
    check_logits(lm, out, ref, f"tie rows {rows.tolist()}")
    tied = out["logits"][rows]
    assert (tied.view(np.uint32) == tied[0].view(np.uint32)).all(), f"identical rows differ: {tied}"
    assert int(np.argmax(ref)) == rows[0]
    assert int(out["state"][0]) == rows[0], f"tie {rows.tolist()}: got {out['state'][0]}, want {rows[0]}"


def test_nan_never_wins(lm):
    s = lm.spec
    h, v = lm.planted()
    r_nan, r_win = sorted(lm.rng.choice(s.vocab, size=2, replace=False).tolist())
    bad = v.copy()
    bad[int(lm.rng.integers(s.hidden))] = np.float16(np.nan)
    lm.set_rows([r_nan, r_win], np.stack([bad, (0.9 * v.astype(np.float32)).astype(np.float16)]))
    lm.reset()
    lm.launch(h)
    out = lm.read()
    assert np.isnan(out["logits"][r_nan])
    ref = lm.reference(h)
    assert int(np.nanargmax(ref)) == r_win
    assert int(out["state"][0]) == r_win, f"a NaN logit at {r_nan} won over {r_win}"
    finite = np.ones(s.vocab, bool)
    finite[r_nan] = False
    assert rel_err(out["logits"][finite], ref[finite]) <= LOGITS_REL_TOL
    lm.set_rows([r_nan], v[None] * np.float16(0))   # leave no NaN behind for the next tests

    # every logit NaN (h carries a NaN): token 0, ERR_NO_FINITE_LOGIT, the state still advances
    h[0] = np.nan
    lm.reset()
    lm.launch(h)
    out = lm.read()
    np.testing.assert_array_equal(out["state"], [0, 41, 1, 0])
    assert out["tokens"][0] == 0 and out["err"] == L.ERR_NO_FINITE_LOGIT


def test_fp16_saturation_of_xf(lm):
    """A massive residual channel times a large norm weight saturates xf to 65504 (never inf), as in numpy."""
    s = lm.spec
    h = lm.random_h()
    h[3] = 4000.0
    saved = lm.norm_w.copy()
    lm.norm_w[3] = np.float16(60000.0)
    lm.buf["norm_w"].upload(lm.norm_w)
    try:
        xf = R.rmsnorm_f16(h, lm.norm_w, s.eps)
        assert xf[3] == np.float16(65504.0)
        lm.reset()
        lm.launch(h)
        out = lm.read()
        ref = lm.reference(h)
        max_abs = check_logits(lm, out, ref, "saturated xf[3]")
        check_token_vs_reference(int(out["state"][0]), ref, max_abs, "saturated xf[3]")
    finally:
        lm.norm_w[:] = saved
        lm.buf["norm_w"].upload(lm.norm_w)


def test_tokens_out_capacity(fns):
    spec = SPECS["tiny"]
    lm = LmHead(spec, fns[spec], tokens_cap=2)
    try:
        lm.reset(state=(5, 0, 0, 0))
        for i in range(3):
            lm.launch(lm.random_h())
            lm.read()
        out = lm.read()
        np.testing.assert_array_equal(out["state"][1:], [3, 3, 0])
        assert (out["tokens"] != POISON_I32).all()
        assert out["err"] == L.ERR_TOKENS_OUT_FULL
    finally:
        lm.close()


@pytest.mark.parametrize("model", list(DIMS))
def test_graph_replay_follows_token_chain(fns, model):
    """embed + lm_head_argmax captured once (lm_head launched with PDL after embed), replayed 5 + 5 times:
    the tokens come from the device state alone. lm_head row perm[t] is embedding row t, so the greedy
    token after t is perm[t] by a wide margin (checked on the reference chain)."""
    dims = DIMS[model]
    spec, espec = SPECS[model], E.specs_for_model(dims, CFG)[0]
    lm = LmHead(spec, fns[spec])
    table = random_head(lm.rng, dims.vocab, dims.hidden)
    perm = lm.rng.permutation(dims.vocab)
    lm.set_weights(table[np.argsort(perm)])   # w[perm[t]] = table[t]
    emb = driver.DeviceBuffer.from_array(table)
    try:
        t0 = int(lm.rng.integers(dims.vocab))
        chain = [t0]
        for _ in range(10):
            ref = lm.reference(table[chain[-1]].astype(np.float32))
            top2 = np.partition(ref, -2)[-2:]
            assert top2[1] - top2[0] > 0.1 * top2[1], "construction: the chain's margin is not clear"
            chain.append(int(np.argmax(ref)))
        assert chain[1:] == [int(perm[t]) for t in chain[:-1]]
        lm.reset(state=(t0, 100, 0, 0))
        lm.buf["argmax_done"].memset_u32(7)   # garbage: the embed kernel must re-arm it every step
        b = lm.buf
        s = lm.stream
        with driver.capture(s) as graph:
            fns[espec].launch(espec.launch(), stream=s, state=b["state"], embed=emb, h=b["h"], err=b["err"],
                              argmax_done=b["argmax_done"])
            lm.fn.launch(spec.launch(), stream=s, pdl=True, **lm.args(logits=False))
        try:
            for _ in range(5):
                graph.launch(s)
            out = lm.read()
            np.testing.assert_array_equal(out["tokens"][:5], chain[1:6])
            assert (out["tokens"][5:] == POISON_I32).all()
            np.testing.assert_array_equal(out["state"], [chain[5], 105, 5, 0])
            for _ in range(5):
                graph.launch(s)
            out = lm.read()
            np.testing.assert_array_equal(out["tokens"][:10], chain[1:11])
            np.testing.assert_array_equal(out["state"], [chain[10], 110, 10, 0])
            assert out["err"] == 0
        finally:
            graph.close()
    finally:
        emb.free()
        lm.close()


def test_bandwidth_7b(fns):
    """Reports the 7B lm_head_argmax time and its weight-stream bandwidth (1.09 GB/launch, far beyond L2);
    asserts only a loose floor (half of the H200's 4.2 TB/s) that a broken load pipeline would miss."""
    spec = SPECS["7b"]
    lm = LmHead(spec, fns[spec])
    try:
        lm.reset()
        h = lm.random_h()
        lm.launch(h, logits=False)
        lm.read()
        n = 20
        for pdl in (False, True):
            start, end = driver.Event(), driver.Event()
            start.record(lm.stream)
            for _ in range(n):
                lm.fn.launch(spec.launch(), stream=lm.stream, pdl=pdl, **lm.args(logits=False))
            end.record(lm.stream)
            us = driver.Event.elapsed_ms(start, end) * 1e3 / n
            gbs = spec.vocab * spec.hidden * 2 / (us * 1e-6) / 1e9
            print(f"\nlm_head_argmax 7B (pdl={pdl}): {us:.1f} us/launch, {gbs:.0f} GB/s of fp16 weights")
            assert gbs > 2100, f"{gbs:.0f} GB/s"
    finally:
        lm.close()


# ---- the multi-row step: m rows against one read of the head, each bitwise the m = 1 kernel ------------

MULTIROW_MS = (1, 2, 3, 4, 8, 16)
MULTIROW_DIMS = {"7b": QWEN25_7B, "tiny": DIMS["tiny"]}


@pytest.fixture(scope="module")
def multirow_fns():
    specs = list(dict.fromkeys(L.model_spec(d, CFG, m=m) for d in MULTIROW_DIMS.values() for m in MULTIROW_MS))
    return {b.spec: driver.load(b) for b in codegen.build_many(specs)}


@pytest.mark.parametrize("m", MULTIROW_MS)
@pytest.mark.parametrize("model", list(MULTIROW_DIMS))
def test_multirow_rows_are_bitwise_single_row(multirow_fns, model, m):
    """m random rows of h (fresh each run), one of them a copy of another and, for m > 2, one with a planted
    winner tied across two vocab rows: every row's logits are bitwise the m = 1 kernel's on that row alone
    and its token is the m = 1 token (the lowest index on the tie); tokens land in tokens_out[0..m), no
    state is advanced, and the logits match the reference. Class (a) against the m = 1 kernel (bits), (b)
    against the reference (tolerance)."""
    dims = MULTIROW_DIMS[model]
    one_spec, spec = L.model_spec(dims, CFG), L.model_spec(dims, CFG, m=m)
    one = LmHead(one_spec, multirow_fns[one_spec])
    many = None
    try:
        hs = one.rng.standard_normal((m, dims.hidden), dtype=np.float32)
        if m > 1:
            hs[-1] = hs[0]   # two identical rows: identical outputs, whatever their slots
        if m > 2:
            h, v = one.planted()
            lo, hi = np.sort(one.rng.choice(dims.vocab, 2, replace=False))
            one.set_rows([lo, hi], np.stack([v, v]))
            hs[1] = h
        many = LmHead(spec, multirow_fns[spec], tokens_cap=16, like=one)   # the same head, planted rows included
        many.reset(state=(5, 6, 0, 8))
        many.launch(hs, pdl=True)
        out = many.read()
        logits = out["logits"].reshape(m, dims.vocab)
        for a in range(m):
            one.reset()
            one.launch(hs[a])
            alone = one.read()
            assert np.array_equal(logits[a].view(np.uint32), alone["logits"].view(np.uint32)), (
                f"{spec.uri}: row {a}: {np.count_nonzero(logits[a] != alone['logits'])} logits differ from m = 1")
            assert out["tokens"][a] == alone["state"][0], f"{spec.uri}: row {a} token differs from m = 1"
            check_logits(one, dict(logits=logits[a]), one.reference(hs[a]), f"{spec.uri} row {a}")
        if m > 2:
            assert out["tokens"][1] == lo, f"tie between rows {lo} and {hi}: the lowest index must win"
        assert (out["tokens"][m:] == POISON_I32).all()
        if m > 1:
            np.testing.assert_array_equal(out["state"], [5, 6, 0, 8])   # untouched: no state parameter
            assert out["tokens"][m - 1] == out["tokens"][0]
        else:
            np.testing.assert_array_equal(out["state"], [out["tokens"][0], 7, 1, 8])   # decode's advance
        assert out["err"] == 0
    finally:
        one.close()
        if many is not None:
            many.close()


def test_multirow_tokens_out_too_small_sets_the_flag(multirow_fns):
    """m = 4 rows into a 2-token tokens_out: rows 0, 1 written, ERR_TOKENS_OUT_FULL set, nothing past it."""
    spec = L.model_spec(DIMS["tiny"], CFG, m=4)
    lm = LmHead(spec, multirow_fns[spec], tokens_cap=2)
    try:
        lm.reset()
        lm.launch(lm.rng.standard_normal((4, spec.hidden), dtype=np.float32))
        out = lm.read()
        assert out["err"] == L.ERR_TOKENS_OUT_FULL
        assert (out["tokens"] == np.argmax(out["logits"], axis=1)[:2]).all()
    finally:
        lm.close()
