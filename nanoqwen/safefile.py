"""Paths a user names, opened so that they cannot hang or fool a command: only regular files are read (a FIFO
would block the open, /dev/zero would never end), and only regular files are replaced (never a device node
or a FIFO). Every refusal is a FileError naming the path and what it is."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from . import NanoqwenError


class FileError(NanoqwenError):
    pass


_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _reason(e: OSError) -> str:
    """strerror in the lower case of the rest of a message: "too many levels of symbolic links"."""
    return e.strerror[:1].lower() + e.strerror[1:] if e.strerror else str(e)


def kind(mode: int) -> str:
    """What a file of this mode is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def open_regular(path: str | Path, optional: bool = False) -> BinaryIO | None:
    """``path`` opened for reading if it is a regular file (symlinks followed); None if it does not exist and
    ``optional``. O_NONBLOCK keeps the open of a FIFO from waiting for a writer; it is cleared once the file is
    known to be regular."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        if optional and isinstance(e, FileNotFoundError):
            return None
        raise FileError(f"{path}: cannot open: {_reason(e)}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileError(f"{path}: not a regular file ({kind(mode)})")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def read_regular(path: str | Path, limit: int, optional: bool = False) -> bytes | None:
    """The bytes of regular file ``path``, refused when it holds more than ``limit`` bytes (a side file such as
    config.json is read whole); None if it does not exist and ``optional``."""
    f = open_regular(path, optional)
    if f is None:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileError(f"{path}: {size:,} bytes, more than the {limit:,} this file may hold")
        try:
            return f.read(limit + 1)[:limit]
        except OSError as e:
            raise FileError(f"{path}: cannot read: {_reason(e)}") from None


def check_replaceable(path: str | Path) -> None:
    """An output path may name nothing yet or a regular file (through symlinks); anything else (a FIFO, a device
    node, a directory, a symlink loop) is refused rather than replaced."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # nothing there, or a dangling symlink: the rename replaces the link itself
    except OSError as e:
        raise FileError(f"{path}: cannot write: {_reason(e)}") from None
    if not stat.S_ISREG(mode):
        raise FileError(f"{path}: exists and is {kind(mode)}, not a regular file: refusing to replace it")


# The most a side file read whole (config.json, an index, tokenizer files) may hold: tokenizer.json of
# Qwen2.5 is 7 MB.
SIDE_FILE_LIMIT = 64 << 20


def parse_json(data: bytes, where: str):
    """``data`` parsed as JSON; malformed (or absurdly nested) input is a FileError naming ``where``."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileError(f"{where}: invalid JSON: {e}") from None
    except RecursionError:
        raise FileError(f"{where}: invalid JSON: nested too deeply") from None


def read_json(path: str | Path, optional: bool = False):
    """The JSON value regular file ``path`` holds (at most SIDE_FILE_LIMIT bytes); None if it does not exist
    and ``optional``."""
    data = read_regular(path, SIDE_FILE_LIMIT, optional)
    return None if data is None else parse_json(data, str(path))


def lookup(path: str | Path) -> int:
    """The mode of what ``path`` names (symlinks followed); a missing path, a symlink loop or a denied
    lookup is a FileError saying which."""
    try:
        return os.stat(path).st_mode
    except OSError as e:
        raise FileError(f"{path}: {_reason(e)}") from None
