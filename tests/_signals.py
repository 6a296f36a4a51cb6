"""Children that a test stops with SIGINT. A command started in the background by a non-interactive shell
(`cmd &`, as a CI runner may start the suite) ignores SIGINT, and its children inherit that (POSIX), so
such a child would never see the test's Ctrl-C and Python would not even install its handler. Started with
``preexec_fn=sigint_default``, the child gets the default disposition back before it execs."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
