"""`nanoqwen serve MODEL`: an OpenAI-compatible HTTP server (plus llama-server's /infill) for code
completion and chat, on FastAPI + uvicorn. The port opens at once; the model loads and every kernel is
built in the engine thread meanwhile, /health answering 503 until it is ready. Up to --max-running requests
run at once (serve/scheduler.py), the rest wait in order in a queue of --max-queue."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

from .. import NanoqwenError
from ..backends import BACKENDS
from ..modelcache import is_file
from ..runtime.drafters import drafter_setting
from ..serve.limits import READ_TIMEOUT_S
from .run import add_speculate_arguments


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help=".nanoqwen file or Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: a free one, which the log line says)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="KV cache size in tokens: the most one request may occupy (default: min(8192, the model's))")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (visible in the process list: prefer --api-key-file "
                        f"or the {KEY_ENV} environment variable)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="--api-key, read from the file PATH")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="cuda, reference (numpy on the CPU) or auto (cuda when a GPU is present)")
    p.add_argument("--eager", action="store_true", help="launch kernels one by one instead of CUDA graphs")
    p.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests that may wait while --max-running run; beyond, 503 with Retry-After (default 16)")
    p.add_argument("--max-running", type=int, default=8, metavar="N",
                   help="requests generated at once, each a row of the engine's step (default 8; an engine "
                        "without the multi-sequence step, the cuda one today, runs 1)")
    p.add_argument("--step-tokens", type=int, default=512, metavar="N",
                   help="most rows one step computes: running streams' rows first, then waiting prompts in "
                        "chunks, which bounds the streams' inter-token latency while a prompt is read (default 512)")
    p.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                   help="KV pool in tokens, shared by the running sequences and those kept for prefix reuse "
                        "(default: --context; a sequence that finds no pages waits for a running one to end)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="N",
                   help="largest request body accepted, else 413 (default 8 MiB)")
    p.add_argument("--max-text-chars", type=int, default=None, metavar="N",
                   help="most characters of text one request may have tokenized (prompt, messages, /infill fields, "
                        "/tokenize content), else 413 (default: 16 per token of --context)")
    p.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, metavar="S",
                   help="seconds a client has to send a whole request, head and body, else the connection "
                        f"closes (default {READ_TIMEOUT_S:g})")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the id /v1/models lists and requests name (default: MODEL's file or directory name)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with tokenizer.json (default: beside MODEL)")
    add_speculate_arguments(p)


KEY_ENV = "NANOQWEN_API_KEY"
MAX_KEY_FILE = 4096


def api_key(args, environ=os.environ) -> str | None:
    """The key from --api-key, --api-key-file or $NANOQWEN_API_KEY (at most one of them), or None."""
    given = [(name, v) for name, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                                       (KEY_ENV, environ.get(KEY_ENV))) if v is not None]
    if len(given) > 1:
        raise NanoqwenError(f"{given[0][0]} and {given[1][0]} both give the API key: use one of them")
    if not given:
        return None
    name, key = given[0]
    if name == "--api-key-file":
        name, key = f"--api-key-file {key}", _read_key_file(key)
    key = key.strip()
    if not key:
        raise NanoqwenError(f"{name}: the API key is empty")
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise NanoqwenError(f"{name}: the API key must be printable ASCII without spaces (it travels in a header)")
    return key


def _read_key_file(path: str) -> str:
    """The file's text; a FIFO or device is refused before it is read (O_NONBLOCK: opening a FIFO does
    not wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise NanoqwenError(f"--api-key-file {path}: not a regular file")
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as e:
        raise NanoqwenError(f"--api-key-file {path}: cannot read: {e.strerror}") from None
    if len(data) > MAX_KEY_FILE:
        raise NanoqwenError(f"--api-key-file {path}: more than {MAX_KEY_FILE} bytes, not a key")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise NanoqwenError(f"--api-key-file {path}: the API key must be printable ASCII without spaces") from None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads, so the log line names the real port (0 picks a
    free one without a window in which another process could take it) and a busy address is one line.
    It says IPPROTO_TCP (create_server's says 0): asyncio sets TCP_NODELAY on an accepted connection only
    then, and without it a kept-alive client waited ~40 ms for each response (Nagle beside delayed ACKs)."""
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise NanoqwenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


def run(args) -> int:
    try:
        import uvicorn

        from ..serve.app import Server, create_app
        from ..serve.protocol import uvicorn_options
    except ImportError as e:
        raise NanoqwenError(f"nanoqwen serve needs fastapi, uvicorn and prometheus-client ({e}): "
                            f"pip install fastapi uvicorn prometheus-client") from None
    from ..serve.metrics import Metrics
    from ..serve.model import load
    from ..serve.worker import Worker

    for opt, v, lo in (("--port", args.port, 0), ("--max-queue", args.max_queue, 0),
                       ("--max-running", args.max_running, 1), ("--step-tokens", args.step_tokens, 1),
                       ("--kv-tokens", 1 if args.kv_tokens is None else args.kv_tokens, 1),
                       ("--max-body-bytes", args.max_body_bytes, 1), ("--max-text-chars", 1 if args.max_text_chars is None else args.max_text_chars, 1)):
        if v < lo:
            raise NanoqwenError(f"{opt} must be at least {lo}, got {v}")
    if not 0 < args.read_timeout < float("inf"):
        raise NanoqwenError(f"--read-timeout must be a positive number of seconds, got {args.read_timeout}")
    key = api_key(args)
    speculate = drafter_setting(args.speculate, args.draft_tokens)
    name = args.model_name or (Path(args.model).stem if is_file(args.model) else Path(args.model).name)
    metrics, load_error = Metrics(), []

    def stop(message: str) -> None:   # a model that cannot load is the command's error, not a 503 forever
        load_error.append(message)
        server.should_exit = True
    worker = Worker(lambda: load(args.model, args.tokenizer, args.backend, args.context, args.eager, _log, speculate,
                                 args.kv_tokens),
                    metrics, args.max_queue, log=_log, on_load_error=stop, max_running=args.max_running,
                    step_tokens=args.step_tokens)
    app = create_app(Server(worker, metrics, name, api_key=key, max_body=args.max_body_bytes,
                            max_text=args.max_text_chars))
    sock = listen(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           **uvicorn_options(args.read_timeout)))
    worker.start()
    host = f"[{args.host}]" if ":" in args.host else args.host
    _log(f"nanoqwen serve: {name} on http://{host}:{sock.getsockname()[1]} (loading; GET /health says 200 when "
         f"ready)")
    server.run(sockets=[sock])
    if load_error:
        raise NanoqwenError(load_error[0])
    return 0 if server.started else 1
