"""Peak RSS and wall time of `nanoqwen pack` on a synthetic HF checkpoint at the exact Qwen2.5-7B shapes.

    python tools/measure_pack_rss.py [--dir /tmp/nq7b] [--shards 4] [--keep]

Writes a bf16 HF directory (config.json, N safetensors shards, index; ~15 GB) tensor by tensor, runs
`nanoqwen pack` on it under /usr/bin/time -v, then `nanoqwen inspect --verify` (checksum throughput),
prints the numbers and deletes everything unless --keep. The weights are random bf16 bit patterns of
realistic magnitude (|w| in [2^-7, 2^-5), norms in [1, 2)): packing speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from nanoqwen.dims import QWEN25_7B
from nanoqwen.nqfile import weight_tensors

CHUNK = 1 << 26  # elements generated at a time: 128 MB of bf16


def write_shard(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    header, pos = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for name, shape in shapes.items():
            left = int(np.prod(shape))
            norm = name.endswith("norm.weight")
            while left:
                x = rng.integers(0, 1 << 16, size=min(left, CHUNK), dtype=np.uint16)
                # norms: 1.0 + random mantissa; weights: random sign, exponent 2^-7 or 2^-6, random mantissa
                x = (x & 0x007F) | 0x3F80 if norm else (x & 0x80FF) | 0x3C00
                f.write(x.astype(np.uint16).tobytes())
                left -= x.size


def write_hf_dir(root: Path, shards: int) -> int:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(QWEN25_7B.to_hf_config()))
    shapes = {n: s for n, (_, s) in weight_tensors(QWEN25_7B).items()}
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    parts: list[dict] = [{} for _ in range(shards)]
    done = 0
    for name, shape in shapes.items():  # contiguous split by bytes, like HF's shards
        parts[min(shards - 1, done * shards // total)][name] = shape
        done += int(np.prod(shape)) * 2
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        t = time.perf_counter()
        write_shard(root / fname, part, seed=i)
        weight_map.update({n: fname for n in part})
        print(f"wrote {fname} ({(root / fname).stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s",
              file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    return total


def timed(cmd: list[str]) -> tuple[float, int, float]:
    """(wall s, peak RSS KiB, user + system CPU s) of ``cmd`` under /usr/bin/time -v."""
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], stderr=subprocess.PIPE, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", r.stderr).group(1)
    secs = sum(float(p) * 60 ** i for i, p in enumerate(reversed(wall.split(":"))))
    cpu = sum(float(re.search(rf"{k} time \(seconds\): ([\d.]+)", r.stderr).group(1)) for k in ("User", "System"))
    return secs, rss, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/nq7b"))
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    hf, out = args.dir / "hf", args.dir / "model.nanoqwen"
    try:
        t = time.perf_counter()
        total = write_hf_dir(hf, args.shards)
        print(f"HF dir: {total / 1e9:.2f} GB bf16 in {args.shards} shards, {time.perf_counter() - t:.0f} s")
        wall, rss, cpu = timed([sys.executable, "-m", "nanoqwen.cli.main", "pack", str(hf), "-o", str(out)])
        print(f"pack: wall {wall:.1f} s, CPU {cpu:.1f} s (user+sys; other load on the machine inflates wall), peak RSS {rss / 2**20:.2f} GiB ({rss / 1024:.0f} MiB), "
              f"output {out.stat().st_size / 1e9:.2f} GB")
        vwall, vrss, _cpu = timed([sys.executable, "-m", "nanoqwen.cli.main", "inspect", str(out), "--verify",
                                "--no-table"])
        print(f"inspect --verify: wall {vwall:.1f} s ({out.stat().st_size / vwall / 1e9:.2f} GB/s incl. open), "
              f"peak RSS {vrss / 2**20:.2f} GiB")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
