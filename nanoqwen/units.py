"""Sizes as a person reads them: the one formatter behind every byte count the CLIs print."""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def size(nbytes: float) -> str:
    """1023 -> '1023 B', 3.5 * 2**20 -> '3.50 MiB', 15.2 * 2**30 -> '15.2 GiB': three significant digits,
    binary units (what `ls -lh` and GPU memory use)."""
    if abs(nbytes) < 1024:
        return f"{int(nbytes)} B"
    for unit in _UNITS:
        nbytes /= 1024
        if abs(nbytes) < 1024:
            break
    digits = 2 if abs(nbytes) < 10 else 1 if abs(nbytes) < 100 else 0
    return f"{nbytes:.{digits}f} {unit}"
