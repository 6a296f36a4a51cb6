"""`nanoqwen-gen`: not built yet (see its issue)."""

import sys


def main(argv=None) -> int:
    print("nanoqwen-gen: not built yet", file=sys.stderr)
    return 2
