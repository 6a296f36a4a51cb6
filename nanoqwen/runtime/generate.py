"""The generation loop, on one screen (gpt-fast's habit): prefill, decode, stop at EOS or max_new_tokens,
stream text through the tokenizer's incremental detokenizer, report TTFT and tokens/s. Ctrl-C stops
cleanly: the engine's token iterator is closed, which lets it drain the steps it launched ahead.

An engine (the contract both the CUDA engine, runtime/session.py, and the numpy reference engine,
nanoqwen/backends.py, keep) has ``name``, ``dims``, ``context``, ``cached_tokens``, ``close()`` and
``generate(prompt_ids, max_new_tokens, sampling, logits=False)``: an iterator of new token ids (the first
one comes out of prefill), which reuses the longest prefix it kept from earlier requests
(runtime/prefix_cache.py) and stops within one step when closed. ``check_request`` is its one request
check, run before anything else."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .. import NanoqwenError
from ..dims import ModelDims
from .sampler import Sampling


class ContextError(NanoqwenError):
    pass


def check_request(dims: ModelDims, prompt: list[int], max_new_tokens: int, capacity: int) -> None:
    """A request must fit the model's positions and the KV cache reserved for it (``capacity`` tokens).
    The last new token is never fed back, so the cache holds prompt + max_new_tokens - 1 positions."""
    prompt_len = len(prompt)
    if prompt_len < 1:
        raise ContextError("the prompt is empty: nothing to condition on")
    bad = [t for t in prompt if not 0 <= t < dims.vocab]
    if bad:
        raise ContextError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {dims.vocab}) "
                           f"(tokenizer and model do not match?)")
    if max_new_tokens < 1:
        raise ContextError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    need = prompt_len + max_new_tokens
    if need > dims.max_positions:
        raise ContextError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                           f"model's context of {dims.max_positions} positions")
    if need - 1 > capacity:
        raise ContextError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                           f"KV cache of {capacity} tokens (raise --context)")


@dataclass
class Result:
    prompt_tokens: int
    tokens: list[int]        # generated ids, EOS excluded
    text: str
    stop: str                # "eos", "max_new_tokens" or "interrupted"
    ttft_s: float            # prompt in -> first new token out (prefill + first step)
    decode_s: float          # first token out -> last token out

    @property
    def tokens_per_s(self) -> float:
        """Decode rate over the tokens after the first (the first one is prefill's)."""
        n = len(self.tokens) + (self.stop == "eos") - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def generate(engine, tokenizer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
             on_text=None) -> Result:
    detok = tokenizer.stream()
    eos = set(tokenizer.eos_ids)
    tokens, stop, pieces = [], "max_new_tokens", []
    t0 = time.perf_counter()
    t_first = t_last = None
    stream = engine.generate(list(prompt_ids), max_new_tokens, sampling)
    try:
        for tok in stream:
            t_last = time.perf_counter()
            t_first = t_first or t_last
            if tok in eos:
                stop = "eos"
                break
            tokens.append(tok)
            piece = detok.push(tok)
            pieces.append(piece)
            if on_text and piece:
                on_text(piece)
    except KeyboardInterrupt:
        stop = "interrupted"
    finally:
        stream.close()
    tail = detok.flush()
    if tail:
        pieces.append(tail)
        if on_text:
            on_text(tail)
    return Result(prompt_tokens=len(prompt_ids), tokens=tokens, text="".join(pieces), stop=stop,
                  ttft_s=(t_first or time.perf_counter()) - t0, decode_s=(t_last or t0) - (t_first or t0))
