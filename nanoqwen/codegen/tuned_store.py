"""Tuned results: parameters (never binaries) per (GPU, arch, family, role, shape), with a metadata block,
merged and written atomically. The codegen reads them at startup; a missing or stale entry falls back to
the config defaults with a notice."""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from functools import cache
from pathlib import Path

from .. import ROOT, NanoqwenError

TUNED_PATH = ROOT / "tune" / "tuned.json"
FORMAT = 1


class StoreError(NanoqwenError):
    pass


def key(gpu: str, arch: str, family: str, role: str, n: int, k: int) -> str:
    return f"{gpu}|{arch}|{family}|{role}|n{n}_k{k}"


def load(path: Path | None = None) -> dict:
    """{"meta": {...}, "entries": {key: {"params": {...}, ...}}}; an absent file is an empty store."""
    path = path or TUNED_PATH
    if not path.exists():
        return {"meta": {"format": FORMAT}, "entries": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"{path}: unreadable tuned results: {e}") from None
    if data.get("meta", {}).get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        raise StoreError(f"{path}: tuned results of an unknown format (want format {FORMAT})")
    return data


def merge_write(entries: dict, meta: dict, path: Path | None = None) -> None:
    """Merge `entries` into the file (newer wins per key), atomically: temp file, fsync, os.replace."""
    path = path or TUNED_PATH
    data = load(path)
    data["entries"].update(entries)
    data["meta"] = {**data["meta"], **meta, "format": FORMAT,
                    "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    lookup_params.cache_clear()


@cache
def lookup_params(k: str) -> dict | None:
    entry = load()["entries"].get(k)
    return None if entry is None else dict(entry["params"])


def notice(message: str) -> None:
    print(f"nanoqwen: {message}", file=sys.stderr)
