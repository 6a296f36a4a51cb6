"""Committed test texts: prompts never depend on the Python that runs the tests."""

from __future__ import annotations

from pathlib import Path

CODE = Path(__file__).parent / "data" / "textwrap-cpython-3.11.7.py.txt"
CORPUS = Path(__file__).parent / "data" / "corpus-cpython-3.11.7.py.txt"


def code_text() -> str:
    """Python source that repeats itself as edited code does: CPython 3.11.7's Lib/textwrap.py (PSF license),
    committed as text."""
    return CODE.read_text(encoding="utf-8")


def corpus_text() -> str:
    """A longer stretch of real Python: six modules of CPython 3.11.7's Lib/ (PSF license), committed as text."""
    return CORPUS.read_text(encoding="utf-8")
