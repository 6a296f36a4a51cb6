"""`nanoqwen run MODEL --prompt TEXT | --chat TEXT`: generate text. MODEL is a .nanoqwen file or a Hugging
Face directory (packed on first use into the cache, keyed by its content). Greedy by default, so the
same command prints the same text; --temperature/--top-p/--seed sample instead. The text goes to stdout
(a --prompt is echoed before its continuation, a --chat reply stands alone); timings go to stderr."""

from __future__ import annotations

import sys

from .. import NanoqwenError
from ..backends import BACKENDS, open_engine
from ..runtime.drafters import SPECULATE_KINDS, PromptLookup, drafter_setting


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL", help=".nanoqwen file or Hugging Face model directory")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw text to continue")
    what.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    p.add_argument("--system", help="system message for --chat (default: the template's)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="stop after this many tokens")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: keep this probability mass")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (reproducible runs)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="cuda, reference (numpy on the CPU) or auto (cuda when a GPU is present)")
    p.add_argument("--eager", action="store_true", help="launch kernels one by one instead of CUDA graphs")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="KV cache size in tokens, at most the model's positions (default: exactly prompt + "
                        "max-new-tokens)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="HF directory whose tokenizer replaces the model's (default: the one MODEL stores)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the payload checksums while loading")
    add_speculate_arguments(p)


def add_speculate_arguments(p) -> None:
    """The speculative decoding options, shared with `nanoqwen serve`."""
    p.add_argument("--speculate", default=None, metavar="|".join(SPECULATE_KINDS),
                   help="speculative greedy decoding, draft tokens from prompt lookup (n-grams of the prompt "
                        "and output) or from a draft model of the same vocabulary (a .nanoqwen file or HF "
                        "directory, run on the same backend); identical output; greedy only (sampling "
                        "decodes plainly)")
    p.add_argument("--draft-tokens", type=int, default=PromptLookup.max_draft, metavar="K",
                   help=f"the most draft tokens one verify step checks (default {PromptLookup.max_draft})")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_args(args) -> None:
    """Argument errors that need no model: one line each, before anything is loaded."""
    for opt, text in (("--prompt", args.prompt), ("--chat", args.chat)):
        if text is not None and not text.strip():
            raise NanoqwenError(f"{opt} is empty: give it some text")
    if args.context is not None and args.context < 1:
        raise NanoqwenError(f"--context must be at least 1 token, got {args.context}")


def _context(args, dims, prompt_tokens: int) -> int:
    """The KV cache size: --context (at most the model's positions), or exactly what the request needs."""
    if args.context is None:
        return prompt_tokens + args.max_new_tokens
    if args.context > dims.max_positions:
        raise NanoqwenError(f"--context {args.context} exceeds the model's {dims.max_positions} positions")
    return args.context


def run(args) -> int:
    from .. import tokenizer
    from ..modelcache import resolve
    from ..nqfile import NanoqwenFile
    from ..runtime.generate import check_request, generate
    from ..runtime.sampler import Sampling

    _check_args(args)
    speculate = drafter_setting(args.speculate, args.draft_tokens)
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    path = resolve(args.model, log=_log)
    tok = tokenizer.load(path, args.tokenizer)
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.chat}]
        prompt_ids = tok.encode_chat(messages)
    else:
        prompt_ids = tok.encode(args.prompt)
    dims = NanoqwenFile(path).dims
    context = _context(args, dims, len(prompt_ids))
    check_request(dims, prompt_ids, args.max_new_tokens, context)  # fail before loading
    engine = open_engine(args.backend, path, context, eager=args.eager, log=_log, verify=not args.no_verify,
                         speculate=speculate)
    out = sys.stdout
    if args.prompt is not None:
        out.write(args.prompt)
        out.flush()

    def on_text(piece: str) -> None:
        out.write(piece)
        out.flush()

    result = generate(engine, tok, prompt_ids, args.max_new_tokens, sampling, on_text if args.stream else None)
    if not args.stream:
        out.write(result.text)
    out.write("\n")
    out.flush()
    bandwidth = getattr(engine, "bytes_per_token", 0) * result.tokens_per_s
    _log(f"[{engine.name}] prompt {result.prompt_tokens} tokens, generated {len(result.tokens)} "
         f"(stop: {result.stop}); TTFT {1e3 * result.ttft_s:.1f} ms, {result.tokens_per_s:.2f} tokens/s"
         + (f", {bandwidth / 1e9:.0f} GB/s of weights" if bandwidth else "")
         + (f"; speculate: drafted {engine.drafted_tokens}, accepted {engine.accepted_tokens}" if speculate else ""))
    return 130 if result.stop == "interrupted" else 0
