"""One clear line and a non-zero exit for every error a user can act on; tracebacks only on request."""

from __future__ import annotations

import os
import sys

from .. import NanoqwenError


def run_main(fn, argv=None) -> int:
    try:
        return fn(argv) or 0
    except NanoqwenError as e:
        if os.environ.get("NANOQWEN_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
