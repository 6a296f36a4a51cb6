"""Stop strings never leak, however the text is split into tokens: the concatenated output is exactly the
text before the stop string that completes first (all of it when none occurs), and nothing beyond that
cut is ever emitted, even for a moment."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from nanoqwen.serve.text import StopMatcher, TextStream
from nanoqwen.testmodels import SMALL_PY_DIR
from nanoqwen.tokenizer import Tokenizer

ALPHABET = "ab\n é"   # few letters: stop strings occur often, partial matches more often


def expected(text: str, stops: list[str]) -> str:
    """The text before the first stop string to complete, reading the whole text character by character."""
    for end in range(len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))]
    return text


@st.composite
def split_text(draw):
    text = draw(st.text(ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=8))
    return text, pieces, stops


@settings(max_examples=400)   # cheap: many splits
@given(split_text())
def test_stop_matcher_never_leaks(case):
    text, pieces, stops = case
    m = StopMatcher(stops)
    out = ""
    seen = ""
    for p in pieces:
        out += m.push(p)
        seen += p
        assert expected(text, stops).startswith(out)   # nothing beyond the cut ever comes out
        if m.stopped is None:   # ... and nothing more than a stop string's beginning is held back
            assert out + m.held == seen
            assert m.held == max((seen[i:] for i in range(len(seen) + 1) if any(s.startswith(seen[i:]) for s in stops)),
                                 key=len, default="")
    out += m.flush()
    assert out == expected(text, stops)
    assert (m.stopped is not None) == any(s in text for s in stops)


def test_stop_matcher_reports_the_first_completed_stop():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hel") + m.push("lo wor") + m.push("ld") == "hel"
    assert m.stopped == "lo w"
    m = StopMatcher(["a", " aa"])   # " aa" starts earlier, but "a" completes first
    assert m.push(" a") + m.push("a") == " " and m.stopped == "a"


def test_text_stream_over_real_tokens():
    tok = Tokenizer(SMALL_PY_DIR)
    text = "def f(x):\n    return x + 1  # é\n"
    ids = tok.encode(text)
    for stop in ("return", "x + 1", "\n", "é\n", "absent"):
        s = TextStream(tok, [stop])
        out = "".join(s.push(i) for i in ids) + s.flush()
        assert out == expected(text, [stop]), stop


def test_stop_matching_is_linear_in_the_output():
    """64 stop strings of 512 characters that all begin the output (the worst case for a hold-back
    matcher that rescans each stop per piece), 20000 one-character pieces. Counted, not timed: the
    automaton follows at most one failure link per character read (amortized), and the text it holds back
    (copied once per piece) never exceeds the longest stop string."""

    class Counted(list):
        reads = 0

        def __getitem__(self, i):
            self.reads += 1
            return super().__getitem__(i)
    text = "".join(chr(0x4e00 + i % 97) for i in range(20000))
    stops = [text[:511] + chr(0x3000 + i) for i in range(64)]   # each diverges at its last character
    m = StopMatcher(stops)
    m._fail = Counted(m._fail)
    out, held = [], 0
    for ch in text:
        out.append(m.push(ch))
        held = max(held, len(m.held))
    assert "".join(out) + m.flush() == text and m.stopped is None
    assert 0 < m._fail.reads <= len(text), f"{m._fail.reads} failure links followed for {len(text)} characters"
    assert held == 511   # the longest tail that still begins a stop string, never more
