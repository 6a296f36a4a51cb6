"""Tokenizing text in pieces whose ids concatenate to the text's ids, each piece's ids kept. An editor
resends nearly the same text at every keystroke: its extra context unchanged, the text before the cursor one
character longer. A request then costs only the pieces that changed.

The pieces are whole texts, except with Qwen2's pre-tokenizer (QWEN2_PRETOKENIZER). Its regex splits the
text into pre-tokens, which ByteLevel and BPE then take one at a time; NFC normalizes the text first. There a
text also splits after every "\\n" that is followed by spaces or tabs and then a non-space character:
- each alternative of the regex that takes a newline ends at the end of its newline run, and the run ends
  at that "\\n";
- no alternative looks behind, so the pre-tokens after the split are the same with or without the text
  before it;
- NFC composes nothing with "\\n", and reorders nothing across it.
tests/test_tokenizer.py checks the pieces' ids against the whole text's over adversarial texts."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from itertools import chain

# Pieces whose ids are kept, least recently used dropped first: lines (an editor's files, a chat's turns), or
# whole texts where a text does not split (an editor's extra chunks, a chat's repeated runs). Texts that do
# split are kept whole too (TEXT_CACHE of them), so that a text resent unchanged costs one lookup, not a lookup
# a line: an editor's extra chunks and the text after its cursor, ~90% of llama.vim's request.
LINE_CACHE, TEXT_CACHE = 8192, 64

QWEN2_PRETOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                                           r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
# After a "\n", spaces or tabs, then a character Python counts as no space: the tokenizer's \s is Unicode's
# White_Space, of which Python's is a superset, so that character is no space to the tokenizer either.
_LINE_SPLIT = re.compile(r"\n(?=[ \t]*\S)")


def splits_lines(spec: dict) -> bool:
    """Whether a tokenizer.json (parsed) pre-tokenizes as Qwen2 does, so that its texts split into lines."""
    return spec.get("pre_tokenizer") == QWEN2_PRETOKENIZER and spec.get("normalizer") in (None, {"type": "NFC"})


class PieceCache:
    """``encode(text)``: the text's ids, from its pieces' kept ids; ``tokenize(pieces)`` tokenizes the pieces
    seen for the first time (a list of id lists). Thread safe: the server tokenizes on a thread pool."""

    def __init__(self, tokenize, lines: bool):
        self.tokenize, self.lines, self.size = tokenize, lines, LINE_CACHE if lines else TEXT_CACHE
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()   # least recently used first
        self._texts: OrderedDict[str, tuple[int, ...]] = OrderedDict()   # whole texts that split into lines
        self._lock = threading.Lock()

    def pieces(self, text: str) -> list[str]:
        if not self.lines:
            return [text]
        ends = [m.end() for m in _LINE_SPLIT.finditer(text)]
        return [text[a:b] for a, b in zip([0, *ends], [*ends, len(text)]) if b > a]

    def encode(self, text: str) -> list[int]:
        if not self.lines:
            return self._encode(text)
        with self._lock:
            ids = self._texts.get(text)
            if ids is not None:
                self._texts.move_to_end(text)
                return list(ids)
        out = self._encode(text)
        with self._lock:
            self._texts[text] = tuple(out)
            while len(self._texts) > TEXT_CACHE:
                self._texts.popitem(last=False)
        return out

    def _encode(self, text: str) -> list[int]:
        pieces = self.pieces(text)
        with self._lock:
            known = {p: self._ids[p] for p in pieces if p in self._ids}
            for p in known:
                self._ids.move_to_end(p)
        new = [p for p in dict.fromkeys(pieces) if p not in known]
        if new:
            known.update(zip(new, map(tuple, self.tokenize(new))))
            with self._lock:
                for p in new:
                    self._ids[p] = known[p]
                while len(self._ids) > self.size:
                    self._ids.popitem(last=False)
        return list(chain.from_iterable(map(known.__getitem__, pieces)))
