"""One clear line and a non-zero exit for every error a user can act on; tracebacks only on request
(NANOQWEN_TRACEBACK=1). A signal in the middle of a pack removes what the pack had made (nanoqwen/interrupt.py)."""

from __future__ import annotations

import os
import sys

from .. import NanoqwenError, interrupt


def run_main(fn, argv=None) -> int:
    try:
        with interrupt.handlers():
            return fn(argv) or 0
    except BrokenPipeError:   # `nanoqwen ... | head`: the reader left, nothing to report
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    # OSError: a path the user gave is missing, unreadable, a directory, or its disk is full
    except (NanoqwenError, OSError) as e:
        if os.environ.get("NANOQWEN_TRACEBACK"):
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e
        print(f"error: {message}", file=sys.stderr)
        return 1
