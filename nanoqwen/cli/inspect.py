"""`nanoqwen inspect FILE [--verify]`: header, dims, tensor table, totals; --verify checks every checksum."""

from __future__ import annotations

import argparse
from collections import Counter

from ..nqfile import NanoqwenFile, weight_tensors
from ..progress import Progress
from ..units import size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a .nanoqwen file")
    p.add_argument("--verify", action="store_true", help="check every payload checksum (reads the whole file)")
    p.add_argument("--no-table", action="store_true", help="omit the per-tensor table")


def run(args) -> int:
    f = NanoqwenFile(args.file)  # validates everything but payload checksums
    h = f.header
    print(f"file      {f.path} ({size(f.size)}, {f.size:,} bytes)")
    print(f"format    version {h['version']}, layout {h['layout_id']} ({f.cfg.quant.layout_name}), "
          f"group {h['group_size']}, {'SYNTHETIC (random weights)' if f.synthetic else 'real weights'}")
    print(f"table     {h['tensor_count']} tensors at {h['table_offset']} ({h['table_bytes']} bytes), "
          f"data at {h['data_offset']}")
    print("dims      " + ", ".join(f"{k}={v}" for k, v in f.dims.to_dict().items()))
    if not args.no_table:
        width = max(len(n) for n in f.tensors)
        print(f"\n{'name':<{width}}  tag   {'shape':<14} {'offset':>14} {'bytes':>14}")
        for e in sorted(f.tensors.values(), key=lambda e: e.offset):
            print(f"{e.name:<{width}}  {e.tag_name:<5} {'x'.join(map(str, e.shape)):<14} {e.offset:>14,} {e.nbytes:>14,}")
    count, nbytes = Counter(), Counter()
    weights = weight_tensors(f.dims, f.cfg)
    for e in f.tensors.values():
        kind = e.tag_name if e.name in weights else "INT4 scales"
        count[kind] += 1
        nbytes[kind] += e.nbytes
    print("\ntotals")
    for kind in sorted(count):
        print(f"  {kind:<12} {count[kind]:>5} tensors {size(nbytes[kind]):>10}")
    if args.verify:
        bar = Progress(sum(e.nbytes for e in f.tensors.values()), "verify")
        f.verify(progress=bar)
        bar.close()
        print("checksums OK")
    return 0
