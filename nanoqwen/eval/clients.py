"""Completion sources: one interface, ``complete(request, stops, max_tokens) -> Completion``, greedy.

- EngineSource: a model run in-process, through backends.open_engine and the generation loop
  (runtime/generate.py); an engine proxy ends the token stream as soon as the text holds a stop sequence.
- ServerSource: any OpenAI-compatible endpoint (llama-server, vLLM, `nanoqwen serve`) through the official
  `openai` client: /v1/completions for a prompt, /v1/chat/completions for messages; temperature 0, the
  same stop sequences. The server's own chat template applies to messages.

A request is a prompt string or a list of chat messages (humaneval.request builds both). Both sources
report generated tokens and the request's wall time, so tokens/s means the same thing for both."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .. import NanoqwenError
from .humaneval import INSTALL_HINT


@dataclass
class Completion:
    text: str                 # as the source returned it (before truncation / extraction)
    tokens: int | None        # generated tokens (None: the server did not say)
    seconds: float            # request in -> last token out


class _StopWatch:
    """Engine proxy for generate(): the loop hands each text piece to ``on_text`` before it asks for the next
    token, so the stream can end right after the token that completed a stop sequence."""

    def __init__(self, engine, stops):
        self.engine, self.stops = engine, stops
        self.text, self.hit = "", False
        self._span = max(map(len, stops), default=0)

    def on_text(self, piece: str) -> None:
        tail = len(self.text) - self._span  # a stop may straddle the previous pieces
        self.text += piece
        self.hit = self.hit or any(s in self.text[max(tail, 0):] for s in self.stops)

    def generate(self, prompt_ids, max_new_tokens, sampling):
        stream = self.engine.generate(prompt_ids, max_new_tokens, sampling)
        try:
            for tok in stream:
                yield tok
                if self.hit:
                    return
        finally:
            stream.close()


class EngineSource:
    def __init__(self, model: str, requests: list, max_tokens: int, backend: str = "auto",
                 tokenizer: str | None = None, log=None):
        from ..backends import open_engine
        from ..modelcache import resolve
        from ..nqfile import NanoqwenFile
        from ..runtime.generate import check_request

        from .. import tokenizer as tokenizers
        path = resolve(model, log=log)
        self.tok = tokenizers.load(path, tokenizer)
        longest = max((self._encode(r) for r in requests), key=len)
        context = len(longest) + max_tokens
        check_request(NanoqwenFile(path).dims, longest, max_tokens, context)  # fail before loading
        self.engine = open_engine(backend, path, context, log=log)
        self.description = {"kind": "engine", "label": f"nanoqwen {self.engine.name.split(' ')[0]}",
                            "model": str(model), "file": str(path), "engine": self.engine.name,
                            "backend": backend, "context": context}

    def _encode(self, request) -> list[int]:
        return self.tok.encode(request) if isinstance(request, str) else self.tok.encode_chat(request)

    def complete(self, request, stops, max_tokens: int) -> Completion:
        from ..runtime.generate import generate
        from ..runtime.sampler import Sampling

        watch = _StopWatch(self.engine, stops)
        result = generate(watch, self.tok, self._encode(request), max_tokens, Sampling(), on_text=watch.on_text)
        if result.stop == "interrupted":
            raise KeyboardInterrupt
        return Completion(result.text, len(result.tokens), result.ttft_s + result.decode_s)

    def close(self) -> None:
        getattr(self.engine, "close", lambda: None)()


class ServerSource:
    def __init__(self, url: str, model: str | None = None, timeout_s: float = 600.0):
        try:
            import openai
        except ImportError:
            raise NanoqwenError(f"--server needs the openai client: {INSTALL_HINT}") from None
        self._openai, self.url = openai, url
        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        # servers without authentication ignore the key; the client insists on one
        self.client = openai.OpenAI(base_url=base, api_key=os.environ.get("OPENAI_API_KEY") or "none",
                                    timeout=timeout_s, max_retries=1)
        self.model = model or self._call(lambda: self.client.models.list().data[0].id,
                                         "GET /v1/models (or name the model with --server-model)")
        self.description = {"kind": "server", "label": self.model, "url": url, "model": self.model}

    def _call(self, fn, what: str):
        """One line for every way a server can fail us (unreachable, HTTP error, malformed answer)."""
        try:
            return fn()
        except self._openai.APIStatusError as e:
            raise NanoqwenError(f"--server {self.url}: {what}: HTTP {e.status_code}: {e.message}") from None
        except self._openai.APIError as e:
            raise NanoqwenError(f"--server {self.url}: {what}: {e}") from None
        except (IndexError, AttributeError, TypeError) as e:
            raise NanoqwenError(f"--server {self.url}: {what}: unexpected answer ({e})") from None

    def complete(self, request, stops, max_tokens: int) -> Completion:
        t0 = time.perf_counter()
        if isinstance(request, str):
            r = self._call(lambda: self.client.completions.create(
                model=self.model, prompt=request, max_tokens=max_tokens, temperature=0.0,
                stop=list(stops) or None), "POST /v1/completions")
            text = self._call(lambda: r.choices[0].text, "POST /v1/completions")
        else:
            r = self._call(lambda: self.client.chat.completions.create(
                model=self.model, messages=request, max_tokens=max_tokens, temperature=0.0),
                "POST /v1/chat/completions")
            text = self._call(lambda: r.choices[0].message.content, "POST /v1/chat/completions")
        tokens = r.usage.completion_tokens if getattr(r, "usage", None) else None
        return Completion(text or "", tokens, time.perf_counter() - t0)

    def close(self) -> None:
        self.client.close()
