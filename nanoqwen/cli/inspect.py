"""`nanoqwen inspect FILE [--verify]`: header, dims, the stored tokenizer, tensor table, totals; --verify checks
every checksum."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from .. import tokenizer
from ..nqfile import NanoqwenFile, weight_tensors
from ..progress import Progress
from ..quant import LAYOUT_NAME
from ..units import size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a .nanoqwen file")
    p.add_argument("--verify", action="store_true", help="check every payload checksum (reads the whole file)")
    p.add_argument("--no-table", action="store_true", help="omit the per-tensor table")


def _print_tokenizer(f: NanoqwenFile) -> None:
    try:
        tok = tokenizer.stored(f)
    except tokenizer.TokenizerError as e:
        print(f"tokenizer unavailable: {e}")
        return
    files = ", ".join(f"{b.name} ({b.nbytes:,} bytes)" for b in f.blobs.values())
    special = {k: v for k, v in tok.special_tokens.items() if v is not None}
    template = f"yes ({len(tok.chat_template):,} chars)" if tok.chat_template else "no"
    print(f"tokenizer {tok.vocab_size:,} tokens; stored as {files}")
    print(f"          eos ids {list(tok.eos_ids)} ({', '.join(tok.decode([i]) for i in tok.eos_ids)}); "
          f"chat template {template}")
    print("          special " + ", ".join(f"{k}={v}" for k, v in special.items()))
    print(f"          added special tokens ({len(tok.added_special_tokens)}) "
          + " ".join(tok.added_special_tokens.values()))
    print(f"          generation config {json.dumps(tok.generation_config)}")


def run(args) -> int:
    f = NanoqwenFile(args.file)  # validates everything but payload checksums
    h = f.header
    print(f"file      {f.path} ({size(f.size)}, {f.size:,} bytes)")
    print(f"format    version {h['version']}, layout {h['layout_id']} ({LAYOUT_NAME}), "
          f"group {h['group_size']}, {'SYNTHETIC (random weights)' if f.synthetic else 'real weights'}")
    print(f"table     {h['entry_count']} entries at {h['table_offset']} ({h['table_bytes']} bytes), "
          f"data at {h['data_offset']}")
    print("dims      " + ", ".join(f"{k}={v}" for k, v in f.dims.to_dict().items()))
    _print_tokenizer(f)
    if not args.no_table:
        width = max(len(e.name) for e in f.entries)
        print(f"\n{'name':<{width}}  tag   {'shape':<14} {'offset':>14} {'bytes':>14}")
        for e in f.entries:
            print(f"{e.name:<{width}}  {e.tag_name:<5} {'x'.join(map(str, e.shape)):<14} {e.offset:>14,} {e.nbytes:>14,}")
    count, nbytes = Counter(), Counter()
    weights = weight_tensors(f.dims, f.cfg)
    for e in f.entries:
        kind = e.tag_name if e.name in weights or e.name in f.blobs else "INT4 scales"
        count[kind] += 1
        nbytes[kind] += e.nbytes
    print("\ntotals")
    for kind in sorted(count):
        print(f"  {kind:<12} {count[kind]:>5} entries {size(nbytes[kind]):>10}")
    if args.verify:
        bar = Progress(sum(e.nbytes for e in f.entries), "verify")
        f.verify(progress=bar)
        bar.close()
        print("checksums OK")
    return 0
