"""`nanoqwen SUBCOMMAND ...`: pack, inspect, run, bench, serve, chat, eval."""

from __future__ import annotations

import importlib
import sys

from .args import parser
from .errors import run_main

# subcommand -> module holding add_arguments/run; imported only when chosen, so `nanoqwen pack` never
# pays for the CUDA bindings.
SUBCOMMANDS = {
    "pack": ("nanoqwen.cli.pack", "HF Qwen2 directory (or --random 7b) -> .nanoqwen file"),
    "inspect": ("nanoqwen.cli.inspect", "print a .nanoqwen header and tensor table; --verify checksums"),
    "run": ("nanoqwen.cli.run", "generate text"),
    "bench": ("nanoqwen.cli.bench", "benchmarks (pp512/tg128 protocol, --kernels for GEMV bandwidth)"),
    "serve": ("nanoqwen.cli.serve", "OpenAI-compatible HTTP server (completions, chat, /infill for editors)"),
    "chat": ("nanoqwen.cli.chat", "interactive multi-turn chat in the terminal"),
    "eval": ("nanoqwen.cli.eval", "score a model or an OpenAI-compatible server (humaneval pass@1, sandboxed)"),
}


def _main(argv) -> int:
    top = parser("nanoqwen", __doc__)
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            mod = importlib.import_module(module)
            p.description = mod.__doc__
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = top.parse_args(argv)
    return args._run(args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
