"""Write a tiny random Qwen2 model as a real HF directory (config.json, bf16 model.safetensors, the committed
small-py tokenizer with its ChatML template, generation_config.json).

Dims: hidden 256, 7 query heads + 1 KV head of head_dim 128 (GQA 7:1), intermediate 512, vocab of the
tokenizer. Random weights give nearly tied logits: use tests/data/small-py for token-match tests.

    python tools/make_tiny_model.py OUT_DIR [--seed 0] [--layers 2] [--massive]
    nanoqwen pack OUT_DIR -o tiny.nanoqwen
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoqwen import testmodels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--massive", action="store_true",
                    help="plant Qwen2-style massive residual activations (|h| ~ 1e5 in a few channels)")
    args = ap.parse_args()
    path = testmodels.make_tiny_model(args.out, seed=args.seed, layers=args.layers, massive=args.massive)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
