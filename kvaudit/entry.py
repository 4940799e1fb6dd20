"""The ``kvaudit`` console script: a thin entry point that imports the CLI (and, through it,
torch) under its own SIGINT handler, so a Ctrl-C during the seconds of start-up exits 130 with one
line instead of a traceback from the middle of an import -- or, if some library swallowed the
KeyboardInterrupt, instead of being lost."""

from __future__ import annotations

import signal
import sys


def main() -> None:
    hit = []

    def on_sigint(signum, frame):
        hit.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        from kvaudit.cli import main as cli_main
    except BaseException:  # an interrupt can surface as another error from a half-done import (numpy)
        if not hit:
            raise
    if hit:
        sys.stderr.write("kvaudit: interrupted\n")
        sys.exit(130)
    signal.signal(signal.SIGINT, previous)
    cli_main()
