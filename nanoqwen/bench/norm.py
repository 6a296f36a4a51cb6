"""Prefill RMSNorm benchmark: rmsnorm_prefill (the norm in front of the QKV and gate/up GEMMs, two launches a
layer) at M rows, timed over a prefill's 56 launches back to back between events, without PDL: one launch
takes a few us, below what events around a single launch resolve. Prints the time a launch and the bytes of
h (fp32 in) and xn (fp16 out) over it, the bandwidth this kernel reaches, against the device's copy
bandwidth measured in the same run (bench.kernels.copy_bandwidth).

Usage on the GPU machine: ``PYTHONPATH=. python3 -m nanoqwen.bench.norm [--m 32 512 4096] [--json FILE]``."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np

from .. import codegen, config
from ..codegen.kernels import gemm as G
from ..dims import QWEN25_7B
from ..runtime import driver
from .kernels import BLOCKER_BYTES, copy_bandwidth, git_commit
from .prefill import _time
from .protocol import write_json


def bench_norm(m: int, stream, rng, blocker) -> dict:
    """rmsnorm_prefill at m rows: a prefill's launches back to back, timed as bench.prefill times a kernel, per
    launch."""
    d = QWEN25_7B
    spec = next(s for s in G.specs_for_model(d, config.default()) if isinstance(s, G.RmsnormPrefillSpec))
    bufs = {"h": driver.DeviceBuffer.from_array(rng.standard_normal((m, d.hidden)).astype(np.float32)),
            "w": driver.DeviceBuffer.from_array(rng.uniform(0.5, 1.5, d.hidden).astype(np.float16)),
            "xn": driver.DeviceBuffer(m * d.hidden * 2)}
    fn, launch, launches = driver.load(codegen.build(spec)), spec.launch(m), 2 * d.layers

    def prefill_norms(st):
        for _ in range(launches):
            fn.launch(launch, st, False, m=m, **bufs)
    try:
        t = _time(prefill_norms, stream, blocker) / launches   # bench.prefill's timing: median of REPS after WARMUP
    finally:
        for buf in bufs.values():
            buf.free()
    return {"uri": spec.uri, "m": m, "s": t, "launches": launches, "bytes": m * d.hidden * 6,
            "GBps": m * d.hidden * 6 / t / 1e9}


def run(ms=(32, 512, 4096)) -> dict:
    stream, rng = driver.Stream(), np.random.default_rng(0)
    copy = copy_bandwidth(stream)["GBps"] * 1e9
    out = {"kind": "nanoqwen-bench-norm", "gpu": driver.device().props.name, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "copy_GBps": copy / 1e9, "norm": []}
    blocker = driver.DeviceBuffer(BLOCKER_BYTES)
    try:
        for m in ms:
            r = bench_norm(m, stream, rng, blocker)
            out["norm"].append(r)
            print(f"{r['uri']} m={m:5d}: {r['s'] * 1e6:7.2f} us a launch, {r['GBps']:5.0f} GB/s of h + xn "
                  f"({r['GBps'] * 1e9 / copy:.0%} of copy); {r['launches']} a prefill: "
                  f"{r['s'] * r['launches'] * 1e3:.3f} ms", flush=True)
    finally:
        blocker.free()
    stream.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanoqwen.bench.norm", description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[32, 512, 4096], help="rows (prefill tokens)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    res = run(tuple(args.m))
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
