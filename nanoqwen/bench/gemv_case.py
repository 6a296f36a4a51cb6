"""One INT4 GEMV shape on the device with the numpy answer beside it: the data behind the GPU unit test,
the kernel benchmark and the tuner, so the three judge a kernel by one definition.

`copies` distinct weight sets rotate so that L2 (60 MB) cannot serve them; activations stay put (they are
L2-resident in decode too). The expected output of weight set 0 follows the numerics contract: the exact
dequantized weights times the fp16 input (RMSNorm prologue via reference.rmsnorm_f16), fp32 sums, the
epilogue's bias / residual / SwiGLU, and the f16 cast when the output is fp16. A multi-row spec (m > 1) gets
m random activation rows; its outputs are [m, n], and `alone` runs the m = 1 kernel on each row by itself:
the multi-row contract is that the two agree bit for bit (DESIGN.md section 12).

Drawing and dequantizing a 7B weight takes seconds of host time (gate_up: ~3 s a matrix), more than the
kernel's check. The GPU tests judge many tile variants of each shape, so `GemvCase.seeded` draws a seed's
weights once per shape (`seeded_weights`) and continues that seed's generator for the rest, giving the very
data `GemvCase(spec, np.random.default_rng(seed))` gives."""

from __future__ import annotations

from functools import cache

import numpy as np

from .. import quant
from .. import reference as R
from ..codegen.kernels import gemv
from ..runtime import driver


def random_int4(rng, n: int, k: int, group: int):
    """(packed uint32 [n, k/8], scales fp16 [n, k/group], exact f32 weights): int4 in [-7, 7] (never all
    zero), positive fp16 scales."""
    q = rng.integers(-7, 8, size=(n, k), dtype=np.int8)
    scales = rng.uniform(0.002, 0.02, size=(n, k // group)).astype(np.float16)
    packed = quant.pack(q)
    return packed, scales, quant.dequantize(packed, scales)


@cache
def seeded_weights(seed: int, n: int, k: int, group: int, mats: int) -> tuple[tuple, dict]:
    """The first ``mats`` random_int4 draws of ``default_rng(seed)`` and the generator's state after them,
    computed once per process."""
    rng = np.random.default_rng(seed)
    return tuple(random_int4(rng, n, k, group) for _ in range(mats)), rng.bit_generator.state


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of fp16 / fp32 outputs, for bitwise comparisons (NaN == NaN, -0 != +0)."""
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class GemvCase:
    """Device buffers of one (epilogue, norm, out_f16, n, k) variant; any tile spec of that variant runs
    on them (the tuner times many candidates over one case)."""

    def __init__(self, spec: gemv.GemvInt4Spec, rng, copies: int = 1, massive: bool = False, massive_rows=None,
                 weights=None):
        """`massive`: plant Qwen2-style massive activations, so that a few inputs sit at the fp16 limit
        (+-65504 after the saturating casts) and the kernel's fp16 chains must not overflow; in every row, or
        only in the rows `massive_rows` names (the others stay ordinary). `weights`: the random_int4 draws to
        use (`seeded`), else they are drawn from `rng` first."""
        self.spec, self.copies = spec, copies
        n, k = spec.n, spec.k
        rows = (spec.m,) if spec.m > 1 else ()   # the activations' and outputs' leading axis
        self.shape = (*rows, n)
        if massive_rows is None:
            massive_rows = range(spec.m) if massive else ()
        big_rows = np.zeros(spec.m, bool)
        big_rows[list(massive_rows)] = True
        self.bufs: list[driver.DeviceBuffer] = []
        mats, self.weights = [], [{} for _ in range(copies)]
        for m in range(spec.mats):
            packed, scales, w = weights[m] if weights else random_int4(rng, n, k, spec.group)
            mats.append(w)
            for ws in self.weights:
                ws[f"w{m}"], ws[f"s{m}"] = self._dev(packed), self._dev(scales)
        self.act = {}
        big = rng.choice(k, 4, replace=False)
        if spec.norm:
            h = (rng.standard_normal((spec.m, k)) * 3).astype(np.float32)
            norm_w = rng.uniform(0.5, 1.5, size=k).astype(np.float16)
            if big_rows.any():   # x = f16(h / rms * w) saturates to +-65504 in those rows
                norm_w[big] = 4096.0
                h[np.ix_(~big_rows, big)] *= 1e-3   # ordinary rows: |x| < 2^8 there (no prescale)
                h[np.ix_(big_rows, big)] = rng.choice([-1e5, 1e5], (int(big_rows.sum()), 4))
            h = h.reshape(*rows, k)
            self.act["h"], self.act["norm_w"] = self._dev(h), self._dev(norm_w)
            x = R.rmsnorm_f16(h, norm_w, spec.eps)
        else:
            x = rng.standard_normal((spec.m, k)).astype(np.float16)
            x[np.ix_(big_rows, big)] = rng.choice([-65504.0, 65504.0], (int(big_rows.sum()), 4))
            x = x.reshape(*rows, k)
            self.act["x"] = self._dev(x)
        ys = [R.gemv(w, x) for w in mats]
        self.out_dtype = np.float16 if spec.out_f16 else np.float32
        self.y0 = None
        if spec.epilogue == "residual":
            self.y0 = rng.standard_normal(self.shape).astype(np.float32)
            ref = self.y0 + ys[0]
        elif spec.epilogue == "bias":
            bias = rng.standard_normal(n).astype(np.float16)
            self.act["bias"] = self._dev(bias)
            ref = ys[0] + bias.astype(np.float32)
        elif spec.epilogue == "swiglu":
            ref = R.swiglu(ys[0], ys[1])
        else:
            ref = ys[0]
        self.expected = R.f16(ref) if spec.out_f16 else ref
        self.act["y"] = self.y = driver.DeviceBuffer(spec.m * n * np.dtype(self.out_dtype).itemsize)
        self.bufs.append(self.y)

    @classmethod
    def seeded(cls, spec: gemv.GemvInt4Spec, seed: int, **kw) -> "GemvCase":
        """``GemvCase(spec, np.random.default_rng(seed), **kw)``, its weights drawn once per process."""
        weights, state = seeded_weights(seed, spec.n, spec.k, spec.group, spec.mats)
        rng = np.random.default_rng(seed)
        rng.bit_generator.state = state
        return cls(spec, rng, weights=weights, **kw)

    def _dev(self, a) -> driver.DeviceBuffer:
        b = driver.DeviceBuffer.from_array(np.ascontiguousarray(a))
        self.bufs.append(b)
        return b

    def args(self, i: int = 0) -> dict:
        return {**self.weights[i % self.copies], **self.act}

    def _reset(self, stream) -> None:
        """Poison the output (NaN), or reset the residual to its input."""
        if self.y0 is not None:
            self.y.upload(self.y0, stream)
        else:
            self.y.poison(stream)

    def _output(self, spec, stream) -> np.ndarray:
        stream.synchronize() if stream is not None else driver.device().synchronize()
        out = self.y.download(dtype=self.out_dtype, shape=self.shape)
        bad = np.flatnonzero(~np.isfinite(out))
        assert bad.size == 0, f"{spec.uri}: {bad.size} non-finite outputs (first at {bad[:8]}): unwritten or overflow"
        return out

    def run(self, fn: driver.Function, spec: gemv.GemvInt4Spec, stream=None, pdl: bool = False) -> np.ndarray:
        """Launch once on weight set 0 over every row; the output. A non-finite output element (unwritten,
        or overflow) raises AssertionError naming the first ones."""
        self._reset(stream)
        fn.launch(spec.launch(), stream, pdl, **self.args(0))
        return self._output(spec, stream)

    def check(self, fn: driver.Function, spec: gemv.GemvInt4Spec, stream=None, pdl: bool = False) -> float:
        """The relative error of `run` against the numpy answer."""
        return rel_err(self.run(fn, spec, stream, pdl), self.expected)

    def alone(self, fn1: driver.Function, spec1: gemv.GemvInt4Spec, stream=None) -> np.ndarray:
        """The m = 1 kernel `spec1` (this case's role) on each activation row by itself, its output in that
        row: what every row of the m-row kernel must equal bit for bit."""
        assert spec1.m == 1 and (spec1.n, spec1.k) == (self.spec.n, self.spec.k)
        self._reset(stream)
        act = "h" if spec1.norm else "x"
        x_row, y_row = 4 * spec1.k if spec1.norm else 2 * spec1.k, np.dtype(self.out_dtype).itemsize * spec1.n
        for a in range(self.spec.m):
            args = {**self.args(0), act: self.act[act].ptr + a * x_row, "y": self.y.ptr + a * y_row}
            fn1.launch(spec1.launch(), stream, False, **args)
        return self._output(spec1, stream)

    def free(self) -> None:
        for b in self.bufs:
            b.free()
        self.bufs = []
