"""Where nanoqwen's files live.

Read-only data (templates/, config/, tune/) sits at the top level of the repository and ships inside the
wheel as the package's ``_data/`` folder (setup.py copies it there): an installed nanoqwen reads only its own
package data. A source checkout (``PYTHONPATH=.``, an editable install) has no ``_data/`` and reads the
top-level folders, so an edited template takes effect without reinstalling.

Writable state (kernel cache, packed models, tuner progress and the user's tuned results) lives under the
cache root, never in the package or the checkout."""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

from . import NanoqwenError

PACKAGE_DIR = Path(str(importlib.resources.files(__package__)))


def checkout() -> Path | None:
    """The source checkout this package runs from, or None when it is installed."""
    top = PACKAGE_DIR.parent
    return top if (top / "pyproject.toml").is_file() and (top / "templates").is_dir() else None


@functools.cache
def data_dir() -> Path:
    """The folder holding templates/, config/ and tune/."""
    shipped = PACKAGE_DIR / "_data"
    if shipped.is_dir():
        return shipped
    top = checkout()
    if top is None:
        raise NanoqwenError(f"{shipped}: package data missing (a broken install: reinstall nanoqwen)")
    return top


def data_path(*parts: str) -> Path:
    """A file or folder of the package data, e.g. ``data_path("config", "nanoqwen.yaml")``."""
    return data_dir().joinpath(*parts)

