"""llama-server's two code-completion cut-offs for /infill and /completion, applied to the text as it is
generated (serve/worker.py asks after each token), as llama-server's server.cpp does:

- ``n_indent``: once a new line starts, a line whose first non-blank character sits left of column
  n_indent ends the completion there (the completion was leaving the block being edited);
- ``t_max_predict_ms``: once the text has a new line, generation stops at the next token after this
  much time since the first token (an editor wants a usable completion now rather than a long one)."""

from __future__ import annotations


class Cutoff:
    def __init__(self, n_indent: int = 0, t_max_predict_ms: int = 0):
        self.n_indent, self.t_max_s = n_indent, t_max_predict_ms / 1e3
        self.text, self.pos = "", 0   # the text so far; where to look for the next new line

    def push(self, text: str, elapsed_s: float) -> tuple[str, bool]:
        """(the part of ``text`` to send, whether to stop after it); ``elapsed_s`` since the first token."""
        start = len(self.text)
        self.text += text
        while self.n_indent > 0 and (nl := self.text.find("\n", self.pos)) >= 0:
            line = nl + 1
            first = len(self.text) - len(self.text[line:].lstrip(" \t"))   # as llama-server: "\n" counts
            if first == len(self.text):   # the line's indentation is not known yet
                break
            if first - line < self.n_indent:
                return self.text[start:first], True   # first >= start: earlier lines were judged before
            self.pos = line
        return text, self.t_max_s > 0 and "\n" in self.text and elapsed_s > self.t_max_s
