"""Cleanup that survives a signal. While a command creates something that is incomplete until it is renamed
or filled (a packer's temporary file, a new cache entry), the path is registered here; SIGINT or SIGTERM then
removes the registered paths and ends the process by that signal at once. Unwinding with an exception is not
enough: an exception raised by a signal handler is lost when it lands in a weakref callback or a __del__, and
the pack then runs to its end (seen: SIGTERM during an import's lock cleanup)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

_pending: list[Path] = []  # append/remove are atomic under the GIL; a lock could deadlock with the handler


def register(path: Path) -> None:
    """Remove ``path`` (a file, or a directory once empty) if the process is interrupted before unregister."""
    _pending.append(path)


def unregister(path: Path) -> None:
    with contextlib.suppress(ValueError):
        _pending.remove(path)


def _handler(signum, frame) -> None:
    doomed = list(reversed(_pending))  # the newest first: a temporary before the entry directory holding it
    if not doomed and signum == signal.SIGINT:
        raise KeyboardInterrupt  # nothing to clean: Ctrl-C stops a generation cleanly, as before
    for path in doomed:
        with contextlib.suppress(OSError):
            os.rmdir(path) if path.is_dir() else path.unlink(missing_ok=True)
    if doomed:
        print("interrupted" if signum == signal.SIGINT else "terminated", file=sys.stderr, flush=True)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


@contextlib.contextmanager
def handlers():
    """Install the handler for SIGINT and SIGTERM while inside, where they still have Python's default
    behaviour (only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    mine = [s for s, d in defaults.items() if signal.getsignal(s) is d]
    for s in mine:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s in mine:
            signal.signal(s, defaults[s])
