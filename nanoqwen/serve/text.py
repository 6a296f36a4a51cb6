"""Token ids in, the text a client may see out: incremental detokenization, then stop strings matched on
the text (OpenAI's ``stop``), however the tokens split it. The matcher holds back the longest tail of the
text that could still begin a stop string, so a stop string split across tokens never leaks out."""

from __future__ import annotations


class StopMatcher:
    """Text pieces in, safe text out. The stop string that completes first in the text wins (the longest
    one when several end at the same character), whatever the pieces: ``stopped`` holds it, and only the
    text before it ever comes out."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.held = ""
        self.stopped: str | None = None

    def push(self, piece: str) -> str:
        if self.stopped is not None:
            return ""
        text = self.held + piece
        hits = [(i + len(s), -len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            _end, _longest, i, self.stopped = min(hits)
            self.held = ""
            return text[:i]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[len(text) - k:])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of a generation that did not stop on a string."""
        held, self.held = self.held, ""
        return held


class TextStream:
    """One request's output text: ``push(token_id)`` -> the new safe text (maybe ""), ``stopped`` once a
    stop string has appeared, ``flush()`` at the end."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok = tokenizer.stream()
        self.matcher = StopMatcher(stops)

    @property
    def stopped(self) -> str | None:
        return self.matcher.stopped

    def push(self, token_id: int) -> str:
        return self.matcher.push(self.detok.push(token_id))

    def flush(self) -> str:
        return self.matcher.push(self.detok.flush()) + self.matcher.flush()
