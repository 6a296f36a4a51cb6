"""What payload verification costs at load time: the same model loaded with and without it, alternately.

    PYTHONPATH=. python3 tools/measure_load.py [--model 7b|FILE|HF_DIR] [--backend cuda|reference]
                                              [--reps 3] [--out load.json]

``7b`` (default) is the synthetic Qwen2.5-7B of the bench protocol (packed once into the cache). The file is
read once first, so every timed load finds it in the page cache. Per mode (verify / no-verify):
  cuda       upload_s: NanoqwenFile + Weights (the upload, where the checksums run); session_s: a whole
             CudaSession (kernels from the cache, upload, KV cache, warm-up, graph capture)
  reference  session_s: ReferenceEngine + the first token of an 8-token prompt (which dequantizes every
             layer: the reference loads lazily)
plus CRC-32 throughput: zlib.crc32 on one core, and the whole file through NanoqwenFile.verify's pool.
JSON: GPU (or CPU) name, date, commit (NANOQWEN_COMMIT), cores, file bytes, every sample, medians and
the overhead of verification in percent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path

from nanoqwen import checksum, config
from nanoqwen.bench import protocol
from nanoqwen.bench.kernels import git_commit
from nanoqwen.nqfile import NanoqwenFile
from nanoqwen.runtime.sampler import Sampling


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def crc_throughput(path: Path) -> dict:
    buf = os.urandom(256 << 20)
    serial = min(_timed(lambda: zlib.crc32(buf)) for _ in range(3))
    f = NanoqwenFile(path)
    pool = min(_timed(f.verify) for _ in range(2))
    return {"serial_GBps": len(buf) / serial / 1e9, "pool_GBps": f.size / pool / 1e9, "pool_s": pool,
            "workers": checksum.DEFAULT_WORKERS}


def cuda_load(path: Path, verify: bool) -> dict:
    from nanoqwen.runtime import driver
    from nanoqwen.runtime.session import CudaSession
    from nanoqwen.runtime.weights import Weights

    driver.device()  # context creation is not part of either mode
    t0 = time.perf_counter()
    w = Weights(NanoqwenFile(path), verify=verify)
    upload = time.perf_counter() - t0
    w.buffer.free()
    t0 = time.perf_counter()
    s = CudaSession(path, 1024, log=lambda m: None, verify=verify)
    session = time.perf_counter() - t0
    s.close()
    return {"upload_s": upload, "session_s": session}


def reference_load(path: Path, verify: bool) -> dict:
    from nanoqwen.backends import ReferenceEngine

    def load():
        engine = ReferenceEngine(path, 16, verify=verify)
        next(engine.generate(list(range(1, 9)), 1, Sampling()))
    return {"session_s": _timed(load)}


def device_name(backend: str) -> str:
    if backend == "cuda":
        from nanoqwen.runtime import driver
        return driver.device().props.name
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b", help="7b (synthetic), a .nanoqwen file or a HF directory")
    ap.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    ap.add_argument("--reps", type=int, default=3, help="timed loads per mode (after one untimed pair)")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    args = ap.parse_args()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    path = protocol.resolve_model(args.model, config.default(), log=log)
    load = cuda_load if args.backend == "cuda" else reference_load
    result = {"device": device_name(args.backend), "backend": args.backend, "model": str(args.model),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": git_commit(),
              "cpu_count": os.cpu_count(), "file_bytes": path.stat().st_size, "crc": crc_throughput(path)}
    log(f"crc32: {result['crc']['serial_GBps']:.2f} GB/s on one core, {result['crc']['pool_GBps']:.2f} GB/s "
        f"through the pool of {checksum.DEFAULT_WORKERS}")
    samples = {"verify": [], "no_verify": []}
    for rep in range(args.reps + 1):  # alternate the modes so drift hits both; the first pair warms up
        for mode in ("verify", "no_verify") if rep % 2 else ("no_verify", "verify"):
            t = load(path, verify=mode == "verify")
            log(f"{mode:<9} " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
            if rep:
                samples[mode].append(t)
    result["samples"] = samples
    for key in samples["verify"][0]:
        on = statistics.median(s[key] for s in samples["verify"])
        off = statistics.median(s[key] for s in samples["no_verify"])
        result[key] = {"verify": on, "no_verify": off, "overhead_pct": 100 * (on - off) / off}
        log(f"{key}: {off:.3f} s without verification, {on:.3f} s with: {100 * (on - off) / off:+.1f}%")
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
