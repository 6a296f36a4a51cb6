"""What Python spends enqueuing one prefill chunk at the 7B shapes: no GPU needed.

    PYTHONPATH=. python3 tools/measure_launch_cost.py [--rows 32 512] [--reps 50] [--out launch.json]

A prefill chunk is ~250 kernel launches (runtime/prefill.py). For a long chunk the GPU work (30 ms at 512
rows) hides the host's enqueue time; for an editor's 32-row tail the GPU work is a few ms and the host's
time per launch (argument packing, launch config, grid) is the TTFT. Here cuLaunchKernelEx is replaced by
a no-op and the Prefiller runs over fake device addresses, so the time is the host's alone, without the
driver's own cost per call (a few microseconds, added on a real device).
JSON: CPU, date, commit (NANOQWEN_COMMIT or git), per row count: launches, median and min ms per chunk,
us per launch, every sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

from nanoqwen import config
from nanoqwen.bench.kernels import git_commit
from nanoqwen.dims import QWEN25_7B
from nanoqwen.runtime import driver, prefill


def fake_buffer(ptr: int) -> driver.DeviceBuffer:
    """A DeviceBuffer at a made-up address (nothing allocated), packed like a real one."""
    buf = object.__new__(driver.DeviceBuffer)
    buf.ptr, buf.nbytes = ptr, 1 << 30
    return buf


class _KV:
    page_table = fake_buffer(1 << 40)

    def k_ptr(self, layer: int) -> int:
        return (2 << 40) + (layer << 20)

    def v_ptr(self, layer: int) -> int:
        return (3 << 40) + (layer << 20)


def host_prefiller(cfg) -> prefill.Prefiller:
    """A Prefiller over the 7B's prefill kernels whose device buffers are fake addresses (nothing is
    allocated: the object is assembled field by field, as Prefiller.__init__ would with real buffers)."""
    dims = QWEN25_7B
    kernels = {role: (spec, driver.Function(None, role, spec.signature, spec.uri))
               for role, spec in prefill.prefill_specs(dims, cfg).items()}
    for _, fn in kernels.values():
        fn._smem_limit = 1 << 30   # no cuFuncSetAttribute: there is no function behind the handle
    p = object.__new__(prefill.Prefiller)
    p.shared = types.SimpleNamespace(dims=dims, capacity=32768, stream=None, kv=_KV(),
                                     weights=types.SimpleNamespace(ptr=lambda name: 4 << 40),
                                     bufs=types.SimpleNamespace(err=fake_buffer(5 << 40), cos=fake_buffer(6 << 40),
                                                                sin=fake_buffer(7 << 40)))
    p.dims, p.kernels, p.capacity, p._grids = dims, kernels, 32768, {}
    p.chunk_tokens, p.small_m_tokens = cfg.prefill.chunk_tokens, cfg.prefill.small_m_tokens
    p.bufs = types.SimpleNamespace(**{name: fake_buffer(8 << 40) for name in
                                      ("h", "xn", "qkv", "q_rot", "o16", "a16", "part_acc", "part_ml", "tokens")})
    return p


def measure(rows: int, reps: int, cfg) -> dict:
    """The chunk of ``rows`` rows at position 4096 - rows (an editor's tail of a 4096-token prompt)."""
    pre, c0 = host_prefiller(cfg), 4096 - rows
    count = 0
    launch = driver.Function.launch

    def counted(self, *a, **k):
        nonlocal count
        count += 1
        return launch(self, *a, **k)
    driver.Function.launch = counted
    try:
        pre._chunk(pre._launch, rows, 9 << 40, dict(p0=c0, n=rows))   # warm-up, and the count
    finally:
        driver.Function.launch = launch
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        pre._chunk(pre._launch, rows, 9 << 40, dict(p0=c0, n=rows))
        samples.append(time.perf_counter() - t)
    ms, best = 1e3 * statistics.median(samples), 1e3 * min(samples)
    return {"rows": rows, "position": c0, "launches": count, "ms_per_chunk": ms, "min_ms_per_chunk": best,
            "us_per_launch": 1e3 * ms / count, "samples_ms": [1e3 * s for s in samples]}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if driver.cu is None:
        sys.exit("error: cuda-bindings is not installed")
    driver.cu.cuLaunchKernelEx = lambda *a: (driver.cu.CUresult.CUDA_SUCCESS, None)
    cfg = config.default()
    results = [measure(r, args.reps, cfg) for r in args.rows]
    for r in results:
        print(f"{r['rows']:4d} rows at {r['position']}: {r['launches']} launches, {r['ms_per_chunk']:.2f} ms "
              f"host per chunk (min {r['min_ms_per_chunk']:.2f}), {r['us_per_launch']:.1f} us per launch "
              f"(driver call excluded)")
    if args.out:
        doc = {"kind": "nanoqwen-launch-cost", "schema": 1, "cpu": cpu_name(),
               "python": platform.python_version(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": git_commit(), "driver_call": "no-op (host cost only)", "results": results}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
