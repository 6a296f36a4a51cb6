"""`nanoqwen eval SUITE ...`: score a model run in-process, or any OpenAI-compatible server, the same way.

  nanoqwen eval humaneval MODEL | --server URL --allow-exec [--limit N] [--chat] [--max-tokens N]
                          [--out FILE.json] [--timeout S] [--jobs N] [--backend B] [--server-model NAME]

HumanEval scores by running the code the model writes. That happens only with --allow-exec, each program in
the sandbox of nanoqwen/eval/sandbox.py; without it the command refuses before it loads a model or sends
a request, so no generation time is spent on a run that could not be scored. The table goes to stdout,
per-problem progress to stderr, everything (configuration, per-problem results, completions) to --out."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from .. import NanoqwenError, __version__
from ..backends import BACKENDS
from ..bench.protocol import write_json

REFUSAL = ("refusing to run: HumanEval scores a model by executing the code it generates; pass --allow-exec "
           "to run each completion in the sandbox (own root with a read-only Python, own PID and network "
           "namespaces, no privileges, time/memory/process/disk limits, where the OS allows)")


def add_arguments(p) -> None:
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    h = suites.add_parser("humaneval", help="HumanEval pass@1 (164 problems, greedy, sandboxed execution)")
    target = h.add_mutually_exclusive_group(required=True)
    target.add_argument("model", nargs="?", metavar="MODEL", help=".nanoqwen file or Hugging Face model directory")
    target.add_argument("--server", metavar="URL", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    h.add_argument("--allow-exec", action="store_true",
                   help="run the generated code (sandboxed); required, the command refuses without it")
    h.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N problems")
    h.add_argument("--chat", action="store_true", help="chat format (Instruct models): instruction + code block")
    h.add_argument("--max-tokens", type=int, default=512, metavar="N", help="tokens per completion (default 512)")
    h.add_argument("--out", metavar="FILE.json", help="write the full report as JSON")
    h.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="wall-clock seconds per program, interpreter start included (default 10)")
    h.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                   help="programs executed in parallel while the next completion generates")
    h.add_argument("--backend", choices=BACKENDS, default="auto", help="MODEL only: cuda, reference or auto")
    h.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="MODEL only: directory with tokenizer.json (default: beside MODEL)")
    h.add_argument("--server-model", default=None, metavar="NAME",
                   help="--server only: the model name to request (default: the first of /v1/models)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check(args) -> None:
    if not args.allow_exec:
        raise NanoqwenError(REFUSAL)
    for name, value, ok in (("--limit", args.limit, args.limit is None or args.limit >= 1),
                            ("--max-tokens", args.max_tokens, args.max_tokens >= 1),
                            ("--timeout", args.timeout, args.timeout > 0),
                            ("--jobs", args.jobs, args.jobs >= 1)):
        if not ok:
            raise NanoqwenError(f"{name} must be positive, got {value}")
    if args.server and (args.backend != "auto" or args.tokenizer):
        raise NanoqwenError("--backend and --tokenizer apply to MODEL, not to --server")
    if args.server_model and not args.server:
        raise NanoqwenError("--server-model applies to --server only")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise NanoqwenError(f"--out {args.out}: directory {Path(args.out).resolve().parent} does not exist")


def humaneval(args) -> int:
    from ..eval import humaneval as he
    from ..eval import sandbox
    from ..eval.clients import EngineSource, ServerSource

    _check(args)
    sandbox.check_platform()
    problems = he.load_problems(args.limit)
    limits = sandbox.Limits(timeout_s=args.timeout)
    started = datetime.now(timezone.utc)
    if args.server:
        source = ServerSource(args.server, args.server_model)
    else:
        source = EngineSource(args.model, [he.request(p, args.chat) for p in problems], args.max_tokens,
                              args.backend, args.tokenizer, log=_log)
    try:
        config = he.config_of(args.chat, args.max_tokens, limits, args.jobs, args.limit) | {
            "source": source.description, "nanoqwen": __version__, "python": platform.python_version(),
            "host": platform.node(), "started_utc": started.isoformat(timespec="seconds")}
        report = he.evaluate(problems, source, args.chat, args.max_tokens, limits, args.jobs, config,
                             log=_log).to_dict()
    finally:
        source.close()
    report["wall_s"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
    if args.out:
        write_json(report, Path(args.out))
    print(he.table(report))
    for applied in report["config"]["sandbox"]["applied"]:
        print("sandbox: " + "; ".join(f"{k} {v}" for k, v in applied.items()))
    return 0


def run(args) -> int:
    return {"humaneval": humaneval}[args.suite](args)
