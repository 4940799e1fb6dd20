"""Ctrl-C and SIGTERM in the long commands (``fuzz``, ``minimize``, ``ci``). Design notes:
docs/internals/app.md."""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # SIGTERM: timeout(1), Kubernetes, the Actions runner


def restoring_sigint(fn):
    """Take Ctrl-C and SIGTERM from the command's first line (:func:`catch_sigint`); put the caller's
    handlers and a clear interrupt flag back when ``fn`` returns (a test, a notebook keeps its Ctrl-C)."""
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
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in INTERRUPT_SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def ignore_interrupts(clear: bool = False) -> None:
    """Ignore both signals (main thread): a second one must not cut a finding file or report short.
    ``clear``: and clear :data:`runner.INTERRUPTED`, so that ops run again (a last replay)."""
    if threading.current_thread() is threading.main_thread():
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    if clear:
        from kvaudit.audit.runner import INTERRUPTED

        INTERRUPTED.clear()


LIVE: list = []  # the live displays showing now (progress.LiveDisplay): their next redraw clears the ^C's line


def end_echoed_line(signum: int) -> None:
    """A Ctrl-C typed on a terminal echoes ``^C`` with no newline after it: end that line on standard error, so
    the next one starts on its own (``kvaudit: interrupted``, not ``^Ckvaudit: interrupted``). Only for SIGINT,
    and only where standard error is a terminal that echoes control characters (SIGTERM echoes nothing, a log
    none), and no live display is showing (its redraw clears the line; a newline put it a line low, leaving its
    first line on the screen). ``os.write``: safe inside a signal handler, whatever print it cut into. Never
    raises."""
    import os
    import termios

    if signum != signal.SIGINT or LIVE:
        return
    try:
        lflag = termios.tcgetattr(2)[3]  # (not a terminal, or closed: termios.error, OSError)
        if lflag & termios.ECHO and lflag & termios.ECHOCTL:
            os.write(2, b"\n")
    except (termios.error, OSError, ValueError):
        pass


def catch_sigint() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt and set :data:`runner.INTERRUPTED`, which the next op
    checks: an interrupt swallowed inside a library callback still stops the run."""
    from kvaudit.audit.runner import INTERRUPTED, quiet_unraisable

    def handler(signum, frame):
        INTERRUPTED.set()
        end_echoed_line(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, handler)
        # NOTE: a KeyboardInterrupt landing in a gc callback prints "Exception ignored"; INTERRUPTED stops the run
        quiet_unraisable()


# the reports each command writes when interrupted during start-up (bench's: :func:`_bench_paths`)
_STARTUP_REPORTS = {"ci": ("--junit", "--sarif", "--json", "--html"), "fuzz": ("--junit", "--sarif", "--json", "--html"),
                    "bench": ("--out", "--json")}
# bench's Markdown and raw data per --suite unless --out and --json name others: in the current directory, never a
# checkout's committed docs/
BENCH_OUT = {"zoo": ("benchmarks.md", "benchmarks.json"), "history": ("benchmarks-history.md", "benchmarks-history.json")}
# the options that take no value (click's flags) of each command the entry point starts the engine for (entry.HEAVY)
_FLAGS = {"fuzz": ("--seeds", "--no-seeds", "--paranoid"), "ci": (), "replay": ("--check-determinism", "--update",
          "--paranoid"), "minimize": (), "bench": ("--list",), "report": ()}
# stdout's last lines for a run interrupted during start-up: the job's own for one interrupted with nothing found
# (kvaudit.reports.report.summary_line, new_findings_line for a campaign and ci; ci's verdict, kvaudit.app.ci)
_NO_FINDINGS = "SUMMARY: kvaudit: no findings (interrupted)."
_NO_NEW_FINDINGS = "SUMMARY: kvaudit: no new findings (interrupted)."
_CI_VERDICT = "INTERRUPTED: 0/0 regressions ok, 0 new finding(s)"


def _startup_options(argv: list[str]) -> dict[str, str] | None:
    """``{"--junit": VALUE, ...}``: the options ``argv`` (no program name) gives ``kvaudit ci`` or ``kvaudit fuzz``
    (:func:`_options`); None for another command or ``--help``."""
    return _options(argv) if argv and argv[0] in _STARTUP_REPORTS else None


def _options(argv: list[str]) -> dict[str, str] | None:
    """``{"--out": VALUE, ...}``: the long options ``argv`` (no program name) gives a command of :data:`_FLAGS`,
    read as click reads them (every option but the command's flags takes a value, a short one's either joined to
    it or the next argument; the last one given wins), each flag given as ``""``; None for ``--help`` or ``-h``
    (where an option is read: ``--out --help`` names a directory) or another command."""
    if not argv or argv[0] not in _FLAGS:
        return None
    flags = _FLAGS[argv[0]]
    values: dict[str, str] = {}
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--":
            break
        if arg in ("-h", "--help"):
            return None
        if len(arg) == 2 and arg[0] == "-" and arg not in flags:  # (-o OUT: minimize's)
            next(rest, None)
        if arg in flags:  # (given: bench's --list writes no report)
            values[arg] = ""
        if not arg.startswith("--") or arg in flags:
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            value = next(rest, None)
        if value is not None:
            values[name] = value
    return values


def asks_help(argv: list[str]) -> bool:
    """Whether ``argv`` (no program name; its command one of :data:`_FLAGS`) asks for the command's help as click
    reads it: ``fuzz --out --help`` does not (its --out is a directory named ``--help``). Standard library only:
    the entry point asks before its start-up guard."""
    return bool(argv) and argv[0] in _FLAGS and _options(argv) is None


def startup_report_paths(argv: list[str]) -> dict[str, str]:
    """``{"junit": PATH, "sarif": PATH, "json": PATH, "html": PATH}`` that ``argv`` (no program name) asks
    ``kvaudit ci`` or ``kvaudit fuzz`` for, read as click reads it (every other option takes a value); ``kvaudit
    bench``'s ``{"out": MD, "json": RAW}`` (:func:`_bench_paths`); empty for another command."""
    values = _startup_options(argv) or {}
    if argv and argv[0] == "bench":
        return _bench_paths(values)
    return {name[2:]: value for name, value in values.items() if name in _STARTUP_REPORTS[argv[0]]}


def _bench_paths(values: dict[str, str]) -> dict[str, str]:
    """``{"out": MD, "json": RAW}`` of a ``kvaudit bench`` run (``values``: its options): --out and --json, else the
    suite's defaults; empty for ``--list`` (no report) or a suite click refuses."""
    suite = values.get("--suite", "zoo")
    if "--list" in values or suite not in BENCH_OUT:
        return {}
    return {"out": values.get("--out", BENCH_OUT[suite][0]), "json": values.get("--json", BENCH_OUT[suite][1])}


def _bench_texts(argv: list[str], paths: dict[str, str]) -> dict:
    """``kvaudit bench``'s report (``paths``: :func:`_bench_paths`) of a run stopped before its first trial: the
    raw data as the suite writes it, with no trial, ``"interrupted": true``; a Markdown that says so."""
    import json
    import os

    history = (_startup_options(argv) or {}).get("--suite") == "history"
    rows = {"failures": [], "releases": [], "trials": []} if history else {
        "trials": [], "false_positives": [], "overhead": []}
    doc = {"format": "kvaudit.bench-history/1" if history else "kvaudit.bench/1", "settings": {}, "wall_seconds": 0.0,
           "interrupted": True, **rows, "note": "interrupted (Ctrl-C or SIGTERM) during start-up: no trial ran"}
    title = "# kvaudit bench --suite history" if history else "# kvaudit bench"
    return {"json": lambda: json.dumps(doc, indent=2) + "\n",
            "out": lambda: (f"{title}\n\nINTERRUPTED during start-up (Ctrl-C or SIGTERM): no trial ran, nothing was "
                            f"measured. Raw data: `{os.path.basename(paths.get('json', ''))}`.\n")}


def startup_summary(argv: list[str]) -> list[str]:
    """The lines ``kvaudit ci`` or ``fuzz`` (``argv``, no program name) interrupted before its job began ends
    stdout with: its ``SUMMARY:`` line (a campaign's and ci's over new findings), and ci's verdict line after it;
    none for another command."""
    values = _startup_options(argv)
    if values is None or argv[0] == "bench":
        return []
    if argv[0] == "ci":
        return [_NO_NEW_FINDINGS, _CI_VERDICT]
    try:
        workers = int(values.get("--workers", "1"))  # (as click reads it: ``+2`` and `` 2`` are 2)
    except ValueError:
        workers = 1
    campaign = "--corpus" in values or "--db" in values or workers > 1
    return [_NO_NEW_FINDINGS if campaign else _NO_FINDINGS]


def end_startup_interrupt(argv: list[str]) -> None:
    """A command (``argv``, no program name) interrupted before its job began: ``kvaudit ci`` and ``fuzz`` write
    the reports asked for (:func:`write_startup_reports`) and end stdout with their summary
    (:func:`startup_summary`); then ``kvaudit: interrupted`` on stderr. Standard library only."""
    write_startup_reports(argv)
    with _restored_handlers():
        ignore_interrupts()
        for stream, lines in ((sys.stdout, startup_summary(argv)), (sys.stderr, ["kvaudit: interrupted"])):
            try:
                for line in lines:
                    stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed (None), read-only: nothing to say it on
                pass


def _startup_json(command: str) -> str:
    """``fuzz --json`` or ``ci --json`` (``"job"`` says which, as a job's own does) of a run stopped before its
    search began: no config (it was not built yet)."""
    import json

    from kvaudit.reports import ci_outputs

    return json.dumps({"format": "kvaudit.replay/1", "program": [], "findings": [], "executions": 0, "ops": 0,
                       "seconds": 0.0, "interrupted": True, "note": ci_outputs.NOTHING_RAN,
                       **({"job": "kvaudit ci"} if command == "ci" else {})}, indent=2) + "\n"


def write_startup_reports(argv: list[str]) -> list[str]:
    """``kvaudit ci`` or ``fuzz`` interrupted before its job began: write the ``--junit``, ``--sarif``, ``--json``
    and ``--html`` that ``argv`` asks for, each saying nothing was checked (``bench``: its Markdown and raw data,
    which it writes unless told, saying no trial ran); a path the job would refuse,
    or that cannot be written, is skipped. Returns the paths written, named on stderr in one ``reports written``
    line, as a run's, that says what they hold. Standard library only: half-imported modules are not touched."""
    import json
    import os

    from kvaudit.atomic import fd_link, write_text_atomic
    from kvaudit.reports import ci_outputs

    paths = startup_report_paths(argv)
    if len({os.path.realpath(p) for p in paths.values() if p}) < len(paths):
        return []  # the job refuses two flags naming one file
    texts = _bench_texts(argv, paths) if argv[0] == "bench" else {
        "junit": lambda: ci_outputs.interrupted_junit(argv[0]),
        "sarif": lambda: json.dumps(ci_outputs.interrupted_sarif(), indent=2) + "\n",
        "json": lambda: _startup_json(argv[0]),
        "html": ci_outputs.interrupted_html}
    written = []
    with _restored_handlers():
        ignore_interrupts()
        for fmt, path in paths.items():
            if (path in ("", "-") or os.path.isdir(path) or (os.path.exists(path) and not os.path.isfile(path))
                    or fd_link(path)):
                continue
            try:
                write_text_atomic(path, texts[fmt]())
            except OSError as e:
                sys.stderr.write(f"kvaudit: cannot write {_shown(path)}: {e.strerror or e}\n")
                continue
            written.append(path)
    if written:  # (not "JSON written: PATH": a run's line is "reports written: ...", and these hold no results)
        sys.stderr.write(f"reports written, each saying nothing was checked (interrupted during start-up): "
                         f"{', '.join(map(_shown, written))}\n")
    return written


def _shown(path: str) -> str:
    """``path`` on one printable line, as :func:`kvaudit.config.shown_path` shows it (not imported: it may be
    half-imported when the interrupt lands): bytes that are not UTF-8 as ``\\xNN``, a newline as ``\\n``."""
    import os

    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
