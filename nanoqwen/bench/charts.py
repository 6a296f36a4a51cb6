"""matplotlib for the bench's PNG charts, headless; None where it is not installed (the caller says so in
one line and the JSON still has the numbers)."""

from __future__ import annotations


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
