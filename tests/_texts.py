"""Committed test texts: prompts never depend on the Python that runs the tests."""

from __future__ import annotations

from pathlib import Path

CODE = Path(__file__).parent / "data" / "textwrap-cpython-3.11.7.py.txt"


def code_text() -> str:
    """Python source that repeats itself as edited code does: CPython 3.11.7's Lib/textwrap.py (PSF license),
    committed as text."""
    return CODE.read_text(encoding="utf-8")
