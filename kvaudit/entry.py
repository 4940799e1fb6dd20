"""The ``kvaudit`` console script: imports the CLI (and, for :data:`HEAVY` commands, the engine and the
search) under its own SIGINT/SIGTERM handler, so an interrupt during start-up exits 130 in one line.
Design notes: docs/internals/app.md."""

from __future__ import annotations

import atexit
import errno
import importlib
import os
import signal
import sys
import threading
import time

# standard library only: before the guard
from kvaudit.app.interrupts import asks_help, end_echoed_line, end_startup_interrupt

HEAVY = ("fuzz", "replay", "minimize", "ci", "bench", "report")  # commands that import torch and Hypothesis
GUARDED = ("fuzz", "minimize", "ci", "bench")  # commands that take Ctrl-C and SIGTERM themselves (restoring_sigint)
_HEAVY_MODULES = ("kvaudit.search.fuzz", "kvaudit.reports.report")  # and the default target kind's warm_up()
MAX_WIDTH_DIGITS = 6  # COLUMNS and LINES: past 999,999 a width is junk, read as unset


def main() -> None:
    started = time.monotonic()
    hit = []
    sys.stdout, sys.stderr = ReaderGone.around(sys.stdout), ReaderGone.around(sys.stderr)
    for name in ("COLUMNS", "LINES"):  # rich reads both with int() after str.isdigit(), which "²" passes and
        value = os.environ.get(name, "0")  # 4,301 digits fail (a width of billions: a panel of GBs)
        if not value.isascii() or len(value.strip()) > MAX_WIDTH_DIGITS:
            del os.environ[name]

    def on_sigint(signum, frame):
        hit.append(signum)
        _as_ctrl_c(signum, frame)

    args = sys.argv[1:]
    runs_engine = bool(args) and args[0] in HEAVY and not asks_help(args)  # (`fuzz --out --help` runs)
    try:
        # SIGTERM (timeout, Kubernetes, the Actions runner) as Ctrl-C: the commands take both alike; installed
        # inside the try, since a signal can land as soon as its handler is in (before the next line)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_sigint)
        from kvaudit.cli import CHECK_ONLY, main as cli_main, parses
        refused = runs_engine and not parses(args)  # bad input is refused before the engine is imported
        runs_engine = runs_engine and not refused
        if runs_engine:
            for name in _HEAVY_MODULES:
                importlib.import_module(name)
            from kvaudit.targets import registry
            registry.get(registry.DEFAULT_KIND).warm_up()
            one_torch_thread()
    except BaseException:  # an interrupt can surface as another error from a half-done import (numpy)
        if not hit:
            raise
    if hit:
        end_startup_interrupt(args)  # `ci` and `fuzz` write their reports and SUMMARY: line from the first line
        _exit(SystemExit(130), fast=True)  # (no teardown of what was half-imported: a second signal kills it)
        sys.exit(130)
    if not (runs_engine and args[0] in GUARDED):  # those keep the guard until they take both themselves
        for sig in (signal.SIGINT, signal.SIGTERM):
            # both stay Ctrl-C's (replay, report, export: `kvaudit: interrupted`, 130): SIGTERM is not a kill, and
            # neither is ignored where the process began with it ignored (a script's background job, `kvaudit
            # replay F &`, starts with SIGINT ignored), as in start-up and in the commands that take both
            signal.signal(sig, _as_ctrl_c)  # (not Python's own for SIGINT: it leaves the echoed ^C's line open)
    try:
        cli_main(obj={"process_start": started, CHECK_ONLY: refused})  # (refused: no callback imports the engine)
    except SystemExit as e:
        e = _disk_full(e)
        _exit(e, fast=runs_engine)
        raise e from None


def _disk_full(e: SystemExit) -> SystemExit:
    # standard output on a full disk: the rest of the output went to /dev/null and the reports were written;
    # the run still ends 74, as a report the disk refused does (bad input and errors keep theirs)
    if e.code not in (None, 0, 1, 3, 4, 5):
        return e
    _flush()  # first: what is still buffered meets the full disk here, not after
    if ReaderGone.full is None:
        return e
    try:
        sys.stderr.write(f"kvaudit: disk full: cannot write {ReaderGone.full}; the rest of its output was dropped\n")
    except (OSError, ValueError, AttributeError):  # standard error closed (None) or gone as well
        pass
    return SystemExit(74)


def _as_ctrl_c(signum, frame):
    end_echoed_line(signum)
    raise KeyboardInterrupt


class ReaderGone:
    """``sys.stdout`` / ``sys.stderr`` that outlive their reader (``kvaudit ci ... | head -1``): at the first
    ``BrokenPipeError`` the stream's file descriptor is pointed at ``/dev/null`` and the write goes there, so the
    run goes on, writes the reports it was asked for and exits with its own code (click's own handling exits 1
    silently from wherever the print was). Everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    @classmethod
    def around(cls, stream):
        return stream if stream is None or isinstance(stream, cls) else cls(stream)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    full: str | None = None  # the reason a stream's disk refused a write (``> /dev/full``): exit 74 at the end

    def _retry(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            # a reader gone (EPIPE), a descriptor opened read-only (`1</dev/null`: EBADF), a full disk
            if not isinstance(e, BrokenPipeError) and e.errno not in (errno.EBADF, errno.ENOSPC, errno.EDQUOT):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT) and sys.stdout is self:  # (a full stderr: nothing to say it on)
                ReaderGone.full = ReaderGone.full or f"{self._stream.name} ({e.strerror})"
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
            return call(*args)  # (what the pipe did not take goes to /dev/null with it)

    def write(self, text):
        return self._retry(self._stream.write, text)

    def writelines(self, lines):
        return self._retry(self._stream.writelines, lines)

    def flush(self):
        return self._retry(self._stream.flush)


def one_torch_thread() -> None:
    """Run torch's CPU ops on one thread unless ``OMP_NUM_THREADS`` is set: the tensors are small, and a
    second thread's spin-waits beside a busy core make a step tens of times slower (docs/internals/app.md)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(1)


def _exit(e: SystemExit, fast: bool = False) -> None:
    """Leave with ``e``'s code: flush, run the atexit handlers (a first SIGINT or SIGTERM meanwhile is let pass,
    the run's code being decided; a second leaves at once), flush, and skip the interpreter's slow teardown of
    torch with ``os._exit``. Where no part of torch was imported and not ``fast`` (a command that imports it,
    maybe cut short by a signal, leaves so all the same), returns for a normal exit with both signals ignored:
    Python's teardown puts the default action back for a signal with a handler, so one there killed the process
    (-2, -15). Returns at once when the code is not a number or a non-daemon thread must still be joined."""
    code = 0 if e.code is None else e.code
    if not isinstance(code, int):
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    _flush()
    came = []

    def late(signum, frame):  # no traceback in an atexit handler (torch's); they go on (temporary directories),
        if came:              # unless a second one comes
            os._exit(code)
        came.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, late)
    atexit._run_exitfuncs()  # (run once: the interpreter's exit finds none left)
    _flush()
    # (torch's parts too: an import a signal cut short takes "torch" out of sys.modules, not what it loaded)
    if fast or any(name.partition(".")[0] == "torch" for name in sys.modules):
        os._exit(code)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a closed pipe (| head), a closed descriptor (None)
            pass
