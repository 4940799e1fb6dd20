"""Ctrl-C and SIGTERM in the long commands (``fuzz``, ``minimize``, ``ci``): both raise
KeyboardInterrupt and set :data:`kvaudit.audit.runner.INTERRUPTED`; once a finding is complete, both are
ignored so that its file and the reports are written whole; the caller's handlers come back when
the command returns."""

from __future__ import annotations

import contextlib
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

        hook = sys.unraisablehook
        try:
            with _restored_handlers():
                catch_sigint()
                return fn(*a, **k)
        finally:
            sys.unraisablehook = hook
            INTERRUPTED.clear()

    return wrapper


@contextlib.contextmanager
def _restored_handlers():
    """The SIGINT and SIGTERM handlers as they were on entry are put back on exit (main thread only)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in INTERRUPT_SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


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


def ci_report_paths(argv: list[str]) -> dict[str, str]:
    """``{"junit": PATH, "sarif": PATH}`` as far as the command line ``argv`` (without the program
    name) asks ``kvaudit ci`` for them, read as click reads it (``--junit PATH`` or ``--junit=PATH``,
    the last one given; every option of ``ci`` takes a value; ``--`` ends the options); empty for
    another command. For a job stopped before its options were parsed."""
    if not argv or argv[0] != "ci" or {"-h", "--help"} & set(argv):
        return {}
    paths: dict[str, str] = {}
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            value = next(rest, None)
        if name in ("--junit", "--sarif") and value is not None:
            paths[name[2:]] = value
    return paths


def write_startup_reports(argv: list[str]) -> list[str]:
    """``kvaudit ci`` stopped by Ctrl-C or SIGTERM before its job began (while the engine and the
    search are imported, or its options are read): write the ``--junit`` (one skipped ``interrupted``
    case) and ``--sarif`` (no results, an unsuccessful invocation) that ``argv`` asks for, atomically,
    as the job itself would once interrupted (docs/reference/exit-codes.md: "from the command's first line"). A path the job
    would refuse (a directory, a device, ``-``, both flags naming one file) is skipped, as is one that
    cannot be written. Returns the paths written; one line each on stderr. Standard library only (with
    :mod:`kvaudit.atomic` and :mod:`kvaudit.reports.ci_outputs`): modules half-imported when the signal
    came are not touched. Ctrl-C and SIGTERM are ignored while it writes, then handled as before."""
    import json
    import os

    from kvaudit.atomic import write_text_atomic
    from kvaudit.reports import ci_outputs

    paths = ci_report_paths(argv)
    if len({os.path.realpath(p) for p in paths.values() if p}) < len(paths):
        return []  # the job refuses two flags naming one file
    texts = {"junit": ci_outputs.interrupted_junit,
             "sarif": lambda: json.dumps(ci_outputs.interrupted_sarif(), indent=2) + "\n"}
    written = []
    with _restored_handlers():
        ignore_interrupts()
        for fmt, path in paths.items():
            if path in ("", "-") or os.path.isdir(path) or (os.path.exists(path) and not os.path.isfile(path)):
                continue
            try:
                write_text_atomic(path, texts[fmt]())
            except OSError as e:
                sys.stderr.write(f"kvaudit: cannot write {path}: {e.strerror or e}\n")
                continue
            sys.stderr.write(f"{'JUnit' if fmt == 'junit' else 'SARIF'} written: {path}\n")
            written.append(path)
    return written
