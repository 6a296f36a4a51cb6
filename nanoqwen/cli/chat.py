"""`nanoqwen chat MODEL`: multi-turn chat in the terminal, streaming (like `ollama run`). Each turn's prompt
is the whole conversation through the chat template, which extends the last turn's tokens, so the engine's
prefix reuse prefills only the new message. Ctrl-C stops the reply (what came so far stays in the
conversation), not the program; /clear starts over, /exit (or Ctrl-D) leaves."""

from __future__ import annotations

import sys

from ..backends import BACKENDS

HELP = "/clear starts a new conversation, /exit leaves; Ctrl-C stops a reply"


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help=".nanoqwen file or Hugging Face model directory")
    p.add_argument("--system", help="system message (default: the template's)")
    p.add_argument("--max-new-tokens", type=int, default=1024, metavar="N", help="longest reply (default 1024)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="cuda, reference (numpy on the CPU) or auto (cuda when a GPU is present)")
    p.add_argument("--eager", action="store_true", help="launch kernels one by one instead of CUDA graphs")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="KV cache size in tokens: the whole conversation must fit (default: min(8192, the model's))")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with tokenizer.json (default: beside MODEL)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _reply(engine, tok, stop, prompt: list[int], max_new: int, sampling) -> str:
    """Stream one reply to stdout and return its text; Ctrl-C ends it early."""
    from ..serve.text import TextStream

    text, pieces, n, gen, interrupted = TextStream(tok, []), [], 0, None, False
    try:
        gen = engine.generate(prompt, max_new, sampling)
        for t in gen:
            n += 1
            if t in stop:
                break
            pieces.append(text.push(t))
            sys.stdout.write(pieces[-1])
            sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if gen is not None:
            gen.close()
    pieces.append(text.flush())
    sys.stdout.write(pieces[-1] + "\n")
    sys.stdout.flush()
    reused = engine.cached_tokens if n else 0   # set when the request started, i.e. at its first token
    _log(f"[{n} tokens; {reused} of {len(prompt)} prompt tokens reused{'; stopped' if interrupted else ''}]")
    return "".join(pieces)


def run(args) -> int:
    from .. import NanoqwenError
    from ..runtime.generate import ContextError
    from ..runtime.sampler import Sampling
    from ..serve.model import load
    from ..serve.prompts import stop_ids

    sampling = Sampling(args.temperature, args.top_p, args.seed)
    engine, tok = load(args.model, args.tokenizer, args.backend, args.context, args.eager, _log)
    stop = stop_ids(tok)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    _log(f"{engine.name}, context {engine.context} tokens. {HELP}")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        cmd = line.strip()
        if cmd == "/exit":
            return 0
        if cmd == "/clear":
            messages = list(system)
            _log("(new conversation)")
            continue
        if not cmd or cmd.startswith("/"):
            if cmd:
                _log(f"unknown command {cmd}: {HELP}")
            continue
        turn = messages + [{"role": "user", "content": line}]
        try:
            prompt = tok.encode_chat(turn)
            max_new = min(args.max_new_tokens, engine.context - len(prompt) + 1)
            if max_new < 1:
                raise ContextError(f"the conversation ({len(prompt)} tokens) fills the context of "
                                   f"{engine.context} tokens")
            reply = _reply(engine, tok, stop, prompt, max_new, sampling)
        except NanoqwenError as e:
            _log(f"error: {e} (/clear starts over)")
            continue
        messages = turn + [{"role": "assistant", "content": reply}]
