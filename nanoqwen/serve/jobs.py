"""A request as the engine thread sees it (Job) and what it sends back (Token, Done, Failed), with the
logprobs of a generated token: shared by the worker, the scheduler and the HTTP handlers."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..runtime.sampler import Sampling
from .errors import APIError


@dataclass
class Token:
    text: str                  # new client-visible text (may be empty: held back or mid-character)
    token_id: int
    logprobs: tuple | None     # (token text, logprob, [(text, logprob), ...top k]) when asked for


@dataclass
class PromptLogprobs:
    items: list                # per prompt token, as Token.logprobs; the first token's logprob and top are None


@dataclass
class Done:
    finish_reason: str         # "stop", "length" or "cancelled"
    text: str                  # the tail still held back when generation ended
    completion_tokens: int     # tokens the engine generated, a stop token included
    cached_tokens: int
    stop_word: str | None
    prompt_s: float            # generation start -> first token
    decode_s: float            # first token -> last token
    drafted_tokens: int | None = None   # speculative decoding's draft tokens (None: the engine does not draft)
    accepted_tokens: int = 0            # ... and those the model accepted


@dataclass
class Failed:
    error: APIError


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stops: list[str] = field(default_factory=list)
    top_logprobs: int | None = None   # None: no logits needed
    cutoff: object | None = None      # serve/cutoffs.py: push(text, seconds since the first token) -> (text, stop)
    received: float = field(default_factory=time.perf_counter)   # TTFT is measured from here
    prompt_logprobs: int | None = None   # echo: the prompt tokens' logprobs too, with the top k each

    def __post_init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def top_logprobs(tokenizer, logits: np.ndarray, token: int, k: int) -> tuple:
    """(token text, its logprob, the k most likely (text, logprob) most likely first), from raw logits."""
    z = logits.astype(np.float64)
    lp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    k = min(k, lp.size)
    top = np.argpartition(-lp, k - 1)[:k] if k else np.empty(0, np.int64)
    top = top[np.argsort(-lp[top], kind="stable")]
    return (tokenizer.decode([token]), float(lp[token]), [(tokenizer.decode([int(i)]), float(lp[i])) for i in top])
