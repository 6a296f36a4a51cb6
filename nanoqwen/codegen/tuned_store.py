"""Tuned results: parameters (never binaries) per (GPU, arch, family, role, shape), with a metadata block,
merged and written atomically. The codegen reads them at startup; a missing or stale entry falls back to
the config defaults with a notice.

Two files hold them: the shipped tune/tuned.json (package data, read-only once installed) and the user's
``<cache root>/tune/tuned.json``, where `nanoqwen-tune` writes by default. Readers see both merged, the
user's entry winning per key, so a local sweep overrides the shipped tiles for that GPU and shape."""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
from functools import cache
from pathlib import Path

from .. import NanoqwenError, config, paths

FORMAT = 1


class StoreError(NanoqwenError):
    pass


def key(gpu: str, arch: str, family: str, role: str, n: int, k: int, m: int = 1) -> str:
    """m > 1: the m-row kernel's entry (its tile beside the m = 1 kernel it derives from)."""
    return f"{gpu}|{arch}|{family}|{role}|n{n}_k{k}" + (f"_m{m}" if m > 1 else "")


def shipped_path() -> Path:
    return paths.data_path("tune", "tuned.json")


def user_path() -> Path:
    return config.cache_root() / "tune" / "tuned.json"


def repo_path() -> Path:
    """The source checkout's tune/tuned.json (developers commit their sweeps there)."""
    top = paths.checkout()
    if top is None:
        raise StoreError("no source checkout to write tune/tuned.json into (nanoqwen runs installed)")
    return top / "tune" / "tuned.json"


def load(path: Path | None = None) -> dict:
    """{"meta": {...}, "entries": {key: {"params": {...}, ...}}} of ``path``, or without one the shipped
    results merged with the user's (the user's entry wins per key)."""
    if path is None:
        shipped, user = load(shipped_path()), load(user_path())
        return {"meta": user["meta"], "entries": {**shipped["entries"], **user["entries"]}}
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
    """Merge `entries` into the file (default: the user's; newer wins per key), atomically (``write``)."""
    path = path or user_path()
    data = load(path)
    data["entries"].update(entries)
    data["meta"] = {**data["meta"], **meta, "format": FORMAT,
                    "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write(data, path)
    merged_entries.cache_clear()


def write(data: dict, path: Path) -> None:
    """``data`` ({"meta", "entries"}, as ``load`` gives it) as the file at ``path``, atomically: temp file,
    fsync, os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
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


@cache
def merged_entries() -> dict:
    """The merged entries (``load()``), read once; ``merge_write`` drops them."""
    return load()["entries"]


def lookup_params(k: str) -> dict | None:
    entry = merged_entries().get(k)
    return None if entry is None else dict(entry["params"])


def lookup_base(k: str) -> str | None:
    """An m-row entry's m = 1 kernel (its URI): the tile holds only beside that kernel."""
    entry = merged_entries().get(k)
    return None if entry is None else entry.get("base_uri")


def notice(message: str) -> None:
    print(f"nanoqwen: {message}", file=sys.stderr)
