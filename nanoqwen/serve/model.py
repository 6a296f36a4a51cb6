"""MODEL argument -> (engine, tokenizer), for `nanoqwen serve` and `nanoqwen chat`. The tokenizer is taken
here and nowhere else in the serving code."""

from __future__ import annotations

from .. import NanoqwenError
from ..backends import open_engine
from ..nqfile import NanoqwenFile

DEFAULT_CONTEXT = 8192   # tokens of KV cache when --context is not given (or the model's limit, if smaller)


def tokenizer_for(model: str, tokenizer_dir: str | None, log):
    """(.nanoqwen path, Tokenizer): MODEL is a .nanoqwen file or a HF directory (packed on first use)."""
    from .. import tokenizer
    from ..modelcache import resolve
    path = resolve(model, log=log)
    return path, tokenizer.load(path, tokenizer_dir)


def load(model: str, tokenizer_dir: str | None, backend: str, context: int | None, eager: bool, log,
         speculate=None, kv_tokens: int | None = None):
    path, tok = tokenizer_for(model, tokenizer_dir, log)
    dims = NanoqwenFile(path).dims
    context = context or min(DEFAULT_CONTEXT, dims.max_positions)
    if not 1 <= context <= dims.max_positions:
        raise NanoqwenError(f"--context must be in [1, {dims.max_positions}] (the model's positions), got {context}")
    return open_engine(backend, path, context, eager=eager, log=log, speculate=speculate, kv_tokens=kv_tokens), tok
