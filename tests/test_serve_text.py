"""Stop strings never leak, however the text is split into tokens: the concatenated output is exactly the
text before the earliest stop string (all of it when none occurs), and no emitted prefix ever holds the
beginning of a stop string that later completes."""

from __future__ import annotations

from hypothesis import given, strategies as st

from nanoqwen.serve.text import StopMatcher, TextStream
from nanoqwen.testmodels import SMALL_PY_DIR
from nanoqwen.tokenizer import Tokenizer

ALPHABET = "ab\n é"   # few letters: stop strings occur often, partial matches more often


def expected(text: str, stops: list[str]) -> str:
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return text[:min(hits)] if hits else text


@st.composite
def split_text(draw):
    text = draw(st.text(ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
    return text, pieces, stops


@given(split_text())
def test_stop_matcher_never_leaks(case):
    text, pieces, stops = case
    m = StopMatcher(stops)
    out = ""
    for p in pieces:
        out += m.push(p)
        assert expected(text, stops).startswith(out)   # nothing beyond the cut ever comes out
    out += m.flush()
    assert out == expected(text, stops)
    assert (m.stopped is not None) == (expected(text, stops) != text or any(s and s in text for s in stops))


def test_stop_matcher_reports_the_earliest_stop():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hel") + m.push("lo wor") + m.push("ld") == "hel"
    assert m.stopped == "lo w"


def test_text_stream_over_real_tokens():
    tok = Tokenizer(SMALL_PY_DIR)
    text = "def f(x):\n    return x + 1  # é\n"
    ids = tok.encode(text)
    for stop in ("return", "x + 1", "\n", "é\n", "absent"):
        s = TextStream(tok, [stop])
        out = "".join(s.push(i) for i in ids) + s.flush()
        assert out == expected(text, [stop]), stop
