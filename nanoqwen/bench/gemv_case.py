"""One INT4 GEMV shape on the device with the numpy answer beside it: the data behind the GPU unit test,
the kernel benchmark and the tuner, so the three judge a kernel by one definition.

`copies` distinct weight sets rotate so that L2 (60 MB) cannot serve them; activations stay put (they are
L2-resident in decode too). The expected output of weight set 0 follows the numerics contract: the exact
dequantized weights times the fp16 input (RMSNorm prologue via reference.rmsnorm_f16), fp32 sums, the
epilogue's bias / residual / SwiGLU, and the f16 cast when the output is fp16. A multi-row spec (m > 1) gets
m random activation rows; its outputs are [m, n]."""

from __future__ import annotations

import numpy as np

from .. import quant
from .. import reference as R
from ..codegen.kernels import gemv
from ..runtime import driver


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class GemvCase:
    """Device buffers of one (epilogue, norm, out_f16, n, k) variant; any tile spec of that variant runs
    on them (the tuner times many candidates over one case)."""

    def __init__(self, spec: gemv.GemvInt4Spec, rng, copies: int = 1, massive: bool = False):
        """`massive`: plant Qwen2-style massive activations, so that a few inputs sit at the fp16 limit
        (+-65504 after the saturating casts) and the kernel's fp16 chains must not overflow."""
        self.spec, self.copies = spec, copies
        n, k, g = spec.n, spec.k, spec.group
        rows = (spec.m,) if spec.m > 1 else ()   # the activations' and outputs' leading axis
        self.shape = (*rows, n)
        self.bufs: list[driver.DeviceBuffer] = []
        mats, self.weights = [], [{} for _ in range(copies)]
        for m in range(spec.mats):
            q = rng.integers(-7, 8, size=(n, k), dtype=np.int8)
            packed = quant.pack(q)
            scales = rng.uniform(0.002, 0.02, size=(n, k // g)).astype(np.float16)
            mats.append(quant.dequantize(packed, scales))
            for ws in self.weights:
                ws[f"w{m}"], ws[f"s{m}"] = self._dev(packed), self._dev(scales)
        self.act = {}
        if spec.norm:
            h = (rng.standard_normal((*rows, k)) * 3).astype(np.float32)
            norm_w = rng.uniform(0.5, 1.5, size=k).astype(np.float16)
            if massive:
                big = rng.choice(k, 4, replace=False)
                h[..., big] = rng.choice([-1e5, 1e5], 4)
                norm_w[big] = 4096.0   # x = f16(h / rms * w) saturates to +-65504
            self.act["h"], self.act["norm_w"] = self._dev(h), self._dev(norm_w)
            x = R.rmsnorm_f16(h, norm_w, spec.eps)
        else:
            x = rng.standard_normal((*rows, k)).astype(np.float16)
            if massive:
                x[..., rng.choice(k, 4, replace=False)] = rng.choice([-65504.0, 65504.0], 4)
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

    def _dev(self, a) -> driver.DeviceBuffer:
        b = driver.DeviceBuffer.from_array(np.ascontiguousarray(a))
        self.bufs.append(b)
        return b

    def args(self, i: int = 0) -> dict:
        return {**self.weights[i % self.copies], **self.act}

    def check(self, fn: driver.Function, spec: gemv.GemvInt4Spec, stream=None, pdl: bool = False) -> float:
        """Poison (or reset the residual), launch once on weight set 0, return the relative error. A
        non-finite output element (unwritten, or overflow) raises AssertionError naming the first ones."""
        if self.y0 is not None:
            self.y.upload(self.y0, stream)
        else:
            self.y.poison(stream)
        fn.launch(spec.launch(), stream, pdl, **self.args(0))
        stream.synchronize() if stream is not None else driver.device().synchronize()
        out = self.y.download(dtype=self.out_dtype, shape=self.shape)
        bad = np.flatnonzero(~np.isfinite(out))
        assert bad.size == 0, f"{spec.uri}: {bad.size} non-finite outputs (first at {bad[:8]}): unwritten or overflow"
        return rel_err(out, self.expected)

    def free(self) -> None:
        for b in self.bufs:
            b.free()
        self.bufs = []
