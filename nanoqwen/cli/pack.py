"""`nanoqwen pack HF_DIR -o FILE` or `nanoqwen pack --random 7b -o FILE [--seed N]`. An -o that names an
existing directory receives NAME.nanoqwen inside it (NAME: the HF directory's name, or random-7b)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import NanoqwenError
from ..dims import QWEN25_7B, ModelDims
from ..hf import HFCheckpoint
from ..pack import pack_hf, pack_random, total_random_bytes, total_source_bytes
from ..progress import Progress
from ..units import size

# --random presets: the exact Qwen2.5-7B shapes (benchmarks), and a tiny model for smoke tests.
RANDOM_DIMS = {
    "7b": QWEN25_7B,
    "tiny": ModelDims(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=2048,
                      max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", nargs="?", metavar="HF_DIR", help="Hugging Face Qwen2 model directory")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the .nanoqwen file to write (an existing directory: NAME.nanoqwen inside it)")
    p.add_argument("--random", choices=sorted(RANDOM_DIMS), help="random weights at these shapes, no HF_DIR")
    p.add_argument("--seed", type=int, default=0, help="seed for --random")
    p.add_argument("--workers", type=int, default=None, help="quantizer threads (default: one per core)")


def output_path(args) -> Path:
    out = Path(args.output)
    if out.is_dir():
        name = f"random-{args.random}" if args.random else Path(args.hf_dir).resolve().name
        out = out / f"{name}.nanoqwen"
    return out


def run(args) -> int:
    if (args.hf_dir is None) == (args.random is None):
        raise NanoqwenError("pack: give exactly one of HF_DIR or --random")
    if args.workers is not None and args.workers < 1:
        raise NanoqwenError(f"--workers must be at least 1, got {args.workers}")
    t0 = time.perf_counter()
    out = output_path(args)
    if args.random:
        dims = RANDOM_DIMS[args.random]
        bar = Progress(total_random_bytes(dims), f"random {args.random}")
        pack_random(dims, out, seed=args.seed, progress=bar, workers=args.workers)
    else:
        ckpt = HFCheckpoint(args.hf_dir)
        print(f"{args.hf_dir}: {len(ckpt.shards)} shard(s), {ckpt.dims}", file=sys.stderr)
        bar = Progress(total_source_bytes(ckpt), "pack")
        pack_hf(ckpt, out, progress=bar, workers=args.workers)
    bar.close()
    print(f"wrote {out} ({size(out.stat().st_size)}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
