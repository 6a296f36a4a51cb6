"""One clear line and a non-zero exit for every error a user can act on; tracebacks only on request
(NANOQWEN_TRACEBACK=1). SIGTERM unwinds like Ctrl-C, so that cleanup (a packer's temporary file, a half-made
cache entry) runs; the process then still ends by that signal."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from .. import NanoqwenError


class Terminated(BaseException):
    """SIGTERM, raised in the main thread; a BaseException so that only cleanup code (finally, with) sees it."""


def _raise_terminated(signum, frame):
    raise Terminated


@contextlib.contextmanager
def _sigterm_unwinds():
    """Turn SIGTERM into Terminated while inside, unless someone else already handles it (only the main
    thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_main(fn, argv=None) -> int:
    try:
        with _sigterm_unwinds():
            return fn(argv) or 0
    except BrokenPipeError:   # `nanoqwen ... | head`: the reader left, nothing to report
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:  # cleanup has run: now die of the signal, as a supervisor expects of SIGTERM
        print("terminated", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        return 128 + signal.SIGTERM  # only if the signal is blocked
    # OSError: a path the user gave is missing, unreadable, a directory, or its disk is full
    except (NanoqwenError, OSError) as e:
        if os.environ.get("NANOQWEN_TRACEBACK"):
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e
        print(f"error: {message}", file=sys.stderr)
        return 1
