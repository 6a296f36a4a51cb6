"""Token ids in, the text a client may see out: incremental detokenization, then stop strings matched on
the text (OpenAI's ``stop``), however the tokens split it. The matcher holds back the longest tail of the
text that could still begin a stop string, so a stop string split across tokens never leaks out; it runs in
time linear in the output (``limits`` bounds the stop strings' count and length)."""

from __future__ import annotations


class StopMatcher:
    """Text pieces in, safe text out. The stop string that completes first in the text wins (the longest
    one when several end at the same character), whatever the pieces: ``stopped`` holds it, and only the
    text before it ever comes out.

    An Aho-Corasick automaton over the stop strings: each character costs O(1) amortized whatever the
    number of stops, so matching is linear in the output. Its state is the longest tail of the text that
    begins a stop string, which is exactly the text to hold back."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.held = ""
        self.stopped: str | None = None
        self._state = 0
        # per node: goto edges, failure link, depth (the node's string length), and the length of the
        # longest stop string that ends at the node (0: none)
        self._goto: list[dict[str, int]] = [{}]
        self._depth, self._out = [0], [0]
        for s in self.stops:
            node = 0
            for ch in s:
                if ch not in self._goto[node]:
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._out.append(0)
                    self._goto[node][ch] = len(self._goto) - 1
                node = self._goto[node][ch]
            self._out[node] = len(s)
        self._fail = [0] * len(self._goto)
        order = list(self._goto[0].values())   # breadth first: a failure link points to a shallower node
        for u in order:
            for ch, v in self._goto[u].items():
                f = self._fail[u]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[v] = self._goto[f][ch] if u and ch in self._goto[f] else 0
                self._out[v] = self._out[v] or self._out[self._fail[v]]
                order.append(v)

    def _step(self, state: int, ch: str) -> int:
        while state and ch not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(ch, 0)

    def push(self, piece: str) -> str:
        if self.stopped is not None:
            return ""
        text, state = self.held + piece, self._state
        for k, ch in enumerate(piece, len(self.held) + 1):
            state = self._step(state, ch)
            if n := self._out[state]:   # a stop string ends at text[k - 1]
                self.stopped, self.held = text[k - n:k], ""
                return text[:k - n]
        self._state, keep = state, self._depth[state]
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of a generation that did not stop on a string."""
        held, self.held, self._state = self.held, "", 0
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
