"""What one request may ask of the server, checked before any work is done for it: the HTTP head (bytes,
header count) and the time to send a request (protocol.py enforces them), the stop strings (count and
length bound the matcher's automaton and hold-back) and the text to tokenize (bounds the time a tokenizer
thread spends on one request). OpenAI allows 4 stop strings and llama-server any number; 64 of up to 512
characters serve every editor and agent client seen, with room to spare."""

from __future__ import annotations

from .errors import APIError

MAX_HEAD_BYTES = 16 << 10   # request line and headers together
MAX_HEADERS = 100
KEEP_ALIVE_S = 5.0          # an idle kept-alive connection closes after this
READ_TIMEOUT_S = 30.0       # a whole request (head and body) must arrive within this (--read-timeout)
MAX_STOPS = 64
MAX_STOP_CHARS = 512
# default text limit per token of the KV cache: a prompt that fits averages far fewer characters per token
# (about 3-4 for code), so only text that could never fit is refused
CHARS_PER_TOKEN = 16


def check_stops(stops: list[str]) -> None:
    if len(stops) > MAX_STOPS:
        raise APIError(f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
    if (longest := max((len(s) for s in stops), default=0)) > MAX_STOP_CHARS:
        raise APIError(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}",
                       param="stop")


def check_text(size: int, limit: int, param: str, what: str = "characters") -> None:
    """413 when a request's text (or token list) to tokenize (or detokenize) exceeds ``limit``."""
    if size > limit:
        raise APIError(f"{param}: {size} {what}, more than this server takes in one request ({limit})",
                       status=413, param=param, code="text_too_large")
