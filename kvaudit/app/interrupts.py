"""Ctrl-C and SIGTERM in the long commands (``fuzz``, ``minimize``, ``ci``): both raise
KeyboardInterrupt and set :data:`kvaudit.audit.runner.INTERRUPTED`; once a finding is complete, both are
ignored so that its file and the reports are written whole; the caller's handlers come back when
the command returns."""

from __future__ import annotations

import functools
import signal
import sys
import threading

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # SIGTERM: timeout(1), Kubernetes, the Actions runner


def restoring_sigint(fn):
    """Take Ctrl-C and SIGTERM from the command's first line (:func:`catch_sigint`: a SIGTERM while a
    real engine is imported, seconds of start-up, exits 130 with one line, not a bare 143), and put
    the caller's SIGINT and SIGTERM handlers (and a clear interrupt flag) back when ``fn`` returns, so
    an in-process caller (a test, a notebook) keeps its Ctrl-C."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        from kvaudit.audit.runner import INTERRUPTED

        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.getsignal(sig) for sig in INTERRUPT_SIGNALS} if main_thread else {}
        hook = sys.unraisablehook
        try:
            catch_sigint()
            return fn(*a, **k)
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
            sys.unraisablehook = hook
            INTERRUPTED.clear()

    return wrapper


def ignore_interrupts() -> None:
    """A second Ctrl-C or SIGTERM must not cut the finding file and reports short: ignore both
    (on the main thread; the command's wrapper puts the caller's handlers back)."""
    if threading.current_thread() is threading.main_thread():
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def catch_sigint() -> None:
    """Ctrl-C -- and SIGTERM, which ``timeout``, Kubernetes and the Actions runner send -- raises
    KeyboardInterrupt as usual and also sets :data:`runner.INTERRUPTED`, which the next op checks:
    an interrupt swallowed inside a library callback still stops the run. Either signal takes the
    same path: what was found is written, then the reports, with the same exit code."""
    from kvaudit.audit.runner import INTERRUPTED, quiet_unraisable

    def handler(signum, frame):
        INTERRUPTED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, handler)
        # the handler's KeyboardInterrupt can land in a callback Python cannot raise from (a gc
        # callback) and print "Exception ignored"; INTERRUPTED is set, so the next op stops
        quiet_unraisable()
