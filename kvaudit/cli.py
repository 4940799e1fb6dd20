"""The ``kvaudit`` command line (click).

Exit codes: 0 clean, 1 findings, 2 usage or input error, 70 internal error, 130 interrupted
with no finding.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from engine_under_test import BUGS, PRESETS, UnknownBugError, UnknownPresetError, get_preset
from kvaudit import __version__, replay
from kvaudit.fuzz import CONFIRM_RUNS, FuzzStats, hypothesis_search, triage
from kvaudit.outputs import FORMATS, Outputs, ReportData
from kvaudit.outputs import write as write_outputs
from kvaudit.report import print_report, print_suppressions, suppressed_by_kind
from kvaudit.runner import INTERRUPTED, execute
from kvaudit.suppress import SuppressionError, SuppressionSet

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 70, 130


class InputError(click.ClickException):
    exit_code = EXIT_USAGE


class KvauditGroup(click.Group):
    """Every error is one line on stderr with a distinct exit code, never a traceback."""

    def main(self, args=None, prog_name=None, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            return sys.exit(e.exit_code)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            return sys.exit(EXIT_CLEAN)
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            click.echo(f"kvaudit: error: {e.format_message()}{hint}", err=True)
            return sys.exit(EXIT_USAGE)
        except click.ClickException as e:
            click.echo(f"kvaudit: error: {e.format_message()}", err=True)
            return sys.exit(e.exit_code)
        except (click.Abort, KeyboardInterrupt):
            click.echo("kvaudit: interrupted", err=True)
            return sys.exit(EXIT_INTERRUPTED)
        except Exception as e:  # a kvaudit bug: say so in one line, keep the traceback opt-in
            if os.environ.get("KVAUDIT_DEBUG"):
                raise
            click.echo(f"kvaudit: internal error: {type(e).__name__}: {e} (set KVAUDIT_DEBUG=1 for a traceback)",
                       err=True)
            return sys.exit(EXIT_INTERNAL)
        return sys.exit(rv or 0)


def _bad(param, msg: str):
    raise click.BadParameter(msg, param=param)


def _config(preset: str, bugs: tuple[str, ...], model: str, device: str, page_size: int | None):
    _check_device(device)
    try:
        changes = {"model": model, "device": device, "bugs": frozenset(bugs)}
        if page_size is not None:
            changes["page_size"] = page_size
        return get_preset(preset).config(**changes)
    except (UnknownPresetError, UnknownBugError) as e:
        raise InputError(str(e)) from None
    except ValueError as e:
        raise InputError(f"bad configuration: {e}") from None


def _suppressions(path: str | None) -> SuppressionSet | None:
    """The rules of ``--suppress FILE``, or None without the flag; a bad file is an input error."""
    if path is None:
        return None
    try:
        return SuppressionSet.load(path)
    except SuppressionError as e:
        raise InputError(str(e)) from None


_suppress_option = click.option(
    "--suppress", "suppress_file", type=click.Path(exists=False), default=None, metavar="FILE",
    help="TOML suppression file: findings its [[suppress]] rules match are not findings (see README).")


_OUTPUT_HELP = {
    "html": "Write a self-contained HTML report (with a plot of pool occupancy) to OUT.",
    "sarif": "Write a SARIF 2.1.0 log (for GitHub code scanning) to OUT.",
    "junit": "Write JUnit XML, one test case per finding signature, to OUT.",
    "json": "Write the report as JSON (a replay file plus the occupancy timeline) to OUT.",
}


def output_options(f):
    """--html/--sarif/--junit/--json OUT, gathered into an ``outputs`` argument."""
    @functools.wraps(f)
    def wrapper(*a, **k):
        k["outputs"] = _outputs(**{fmt: k.pop(f"{fmt}_out") for fmt in FORMATS})
        return f(*a, **k)

    for fmt in reversed(FORMATS):
        wrapper = click.option(f"--{fmt}", f"{fmt}_out", type=click.Path(), default=None, metavar="OUT",
                               help=_OUTPUT_HELP[fmt])(wrapper)
    return wrapper


def _outputs(**paths) -> Outputs:
    """Check the report paths now, not after a long run: not a directory, not named twice, and in
    a directory that exists (or can be made) and is writable."""
    seen: dict[str, str] = {}
    for fmt, path in paths.items():
        if path is None:
            continue
        if path in seen:
            raise InputError(f"--{fmt} and --{seen[path]} both name {path}")
        seen[path] = fmt
        if os.path.isdir(path):
            raise InputError(f"--{fmt} {path}: is a directory (want a file name)")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise InputError(f"--{fmt} {path}: cannot write in {parent}")
    return Outputs(**paths)


def _write_outputs(outputs: Outputs, data: ReportData, err: Console) -> None:
    if not outputs.wanted():
        return
    try:
        written = write_outputs(outputs, data, note=lambda m: err.print(m, soft_wrap=True))
    except OSError as e:
        raise InputError(f"cannot write report: {e.strerror or e}: {e.filename or ''}".rstrip(": ")) from None
    err.print("reports written: " + ", ".join(written), soft_wrap=True)


def _console(stderr: bool = False) -> Console:
    """A rich console; off a terminal it is wide, so that paths in reports are not broken up."""
    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else int(os.environ.get("COLUMNS", 0) or 120)
    return Console(stderr=stderr, highlight=False, width=width)


def _check_device(device: str) -> None:
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"device {device}: no CUDA device is available here (torch {torch.__version__})")


def _warn_unreachable_bugs(config, err: Console) -> None:
    for name in sorted(config.bugs):
        want = BUGS[name].preset
        if want != config.preset:
            err.print(f"warning: bug {name} is reached through preset {want}; with preset {config.preset} "
                      "it may never trigger", soft_wrap=True)


class _Progress:
    """Live status on a terminal (rich); off a terminal, a plain line every ``interval`` seconds (and
    at each phase change), with no control codes, for CI logs."""

    def __init__(self, console: Console, max_time: float, interval: float = 5.0,
                 suppressions: SuppressionSet | None = None):
        self.console, self.max_time, self.interval = console, max_time, interval
        self.suppressions = suppressions
        self.live = Live(console=console, transient=True, auto_refresh=False) if console.is_terminal else None
        self._last = 0.0
        self._phase = None

    @staticmethod
    def _fields(s: FuzzStats, max_time: float) -> list[tuple[str, str]]:
        rate = s.executions / s.elapsed if s.elapsed > 0 else 0.0
        return [("executions", f"{s.executions}"), ("exec/s", f"{rate:.1f}"), ("ops", f"{s.ops}"),
                ("findings", f"{s.findings}"), ("suppressed", f"{len(s.suppressed)}"),
                ("coverage", f"{len(s.sites)} alloc/free sites"),
                ("elapsed", f"{s.elapsed:.1f}s"), ("remaining", f"{max(0.0, max_time - s.elapsed):.0f}s")]

    def line(self, s: FuzzStats) -> str:
        f = dict(self._fields(s, self.max_time))
        return (f"[{s.elapsed:6.1f}s] {s.phase}: executions={f['executions']} exec/s={f['exec/s']} ops={f['ops']} "
                f"findings={f['findings']} suppressed={f['suppressed']} sites={len(s.sites)} "
                f"remaining={f['remaining']}")

    def renderable(self, s: FuzzStats):
        from rich.progress_bar import ProgressBar

        grid = Table.grid(padding=(0, 2))
        grid.add_row(Text(f"kvaudit fuzz: {s.phase}", style="bold blue"),
                     ProgressBar(total=self.max_time, completed=min(s.elapsed, self.max_time), width=40),
                     Text(f"{min(s.elapsed, self.max_time):.0f}/{self.max_time:g}s"))
        stats = Table.grid(padding=(0, 3))
        fields = self._fields(s, self.max_time)
        for _ in fields:
            stats.add_column(justify="right")
        stats.add_row(*[Text(k, style="dim") for k, _ in fields])
        stats.add_row(*[Text(v, style="bold red" if k == "findings" and v != "0" else "bold") for k, v in fields])
        outer = Table.grid()
        outer.add_row(grid)
        outer.add_row(stats)
        return outer

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)

    def update(self, s: FuzzStats, force: bool = False) -> None:
        if self.live:
            self.live.update(self.renderable(s), refresh=True)
        elif force or s.phase != self._phase or time.monotonic() - self._last >= self.interval:
            self._last, self._phase = time.monotonic(), s.phase
            print(self.line(s), file=sys.stderr, flush=True)


_common = [
    click.option("--preset", default="default", show_default=True, metavar="NAME",
                 help="Engine preset (see 'kvaudit presets')."),
    click.option("--bug", "bugs", multiple=True, metavar="NAME",
                 help="Switch a bug-zoo bug on (repeatable; see 'kvaudit bugs')."),
    click.option("--model", type=click.Choice(["none", "tiny"]), default="none", show_default=True,
                 help="'tiny' runs the dummy transformer over real KV tensors; 'none' skips compute."),
    click.option("--device", default="cpu", show_default=True, help="Torch device for the engine: cpu or cuda."),
    click.option("--page-size", type=click.IntRange(min=1), default=None, help="Override the preset's page size (tokens)."),
]


def common_options(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


@click.group(cls=KvauditGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvaudit")
def main():
    """kvaudit: find KV-cache memory leaks, double frees and use-after-free in LLM serving schedulers."""


def _restoring_sigint(fn):
    """Put the caller's SIGINT handler (and a clear interrupt flag) back when ``fn`` returns, so an
    in-process caller (a test, a notebook) keeps its Ctrl-C."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if main_thread else None
        try:
            return fn(*a, **k)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            INTERRUPTED.clear()

    return wrapper


def _catch_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual and also sets :data:`runner.INTERRUPTED`, which the
    next op checks: an interrupt swallowed inside a library callback still stops the run."""
    def handler(signum, frame):
        INTERRUPTED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)


@main.command()
@common_options
@click.option("--max-time", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              callback=lambda ctx, p, v: v if math.isfinite(v) else _bad(p, "must be a finite number of seconds"),
              metavar="SECONDS", help="Time budget for the search, in seconds (triage of a finding comes after).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed; the same seed gives the same search.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="kvaudit-out", show_default=True,
              help="Directory for replay files of findings.")
@_suppress_option
@output_options
@_restoring_sigint
def fuzz(preset, bugs, model, device, page_size, max_time, seed, out_dir, suppress_file, outputs):
    """Fuzz the built-in engine with Hypothesis; minimize, confirm and report what it finds.

    Exits 1 with a replay file in --out when a finding is confirmed, 0 when the budget ends clean
    (findings that --suppress rules match do not count: the search goes on past them).
    """
    config = _config(preset, bugs, model, device, page_size)
    sset = _suppressions(suppress_file)
    try:  # fail now, not after the budget, if findings could not be written
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise InputError(f"--out {out_dir}: {e.strerror or e}") from None
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(os.path.join(out_dir, ".hypothesis"))  # not the user's cwd
    console, err = _console(), _console(stderr=True)
    stats = FuzzStats()
    err.print(f"kvaudit fuzz: preset {preset}, bugs: {', '.join(bugs) or 'none'}, seed {seed}, "
              f"budget {max_time:g}s, out {out_dir}"
              + (f", suppressions {suppress_file} ({len(sset)} rule(s))" if sset is not None else ""), soft_wrap=True)
    _warn_unreachable_bugs(config, err)
    progress = _Progress(err, max_time, suppressions=sset)
    found = crash = None
    _catch_sigint()
    try:
        with progress:
            progress.update(stats)
            found = hypothesis_search(config, max_time, seed, stats, on_progress=progress.update, suppressions=sset)
            if found is None:
                stats.phase = "done"
                progress.update(stats, force=True)
            if found is not None:
                stats.phase = "confirming and minimizing"
                stats.findings = 1
                progress.update(stats, force=True)
                # the report's hit counts are the search's: triage's many reruns count apart
                crash = triage(config, found[0], found[1][0], suppressions=sset.fresh() if sset is not None else None)
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report short
        if found is None:
            err.print(f"interrupted after {stats.elapsed:.1f}s: {stats.executions} executions, no finding")
            _write_outputs(outputs, _run_data(config, [], [], sset, stats, seed, interrupted=True), err)
            return EXIT_INTERRUPTED
        # Interrupted while minimizing: keep what was found, unminimized and unconfirmed.
        program, findings = found
        path = _write(out_dir, config, program, findings, seed=seed, confirmations="interrupted before confirmation",
                      minimized=False)
        print_report(console, config, program, findings, suppressions=sset, program_title="program (unminimized)")
        err.print(f"interrupted while minimizing; the unminimized program is in {path}")
        _write_outputs(outputs, _run_data(config, program, findings, sset, stats, seed, interrupted=True,
                                          program_title="program (unminimized)"), err)
        return EXIT_FINDINGS
    if found is None or crash is None:
        if sset is not None:
            print_suppressions(console, sset)
        if found is None:
            console.print(f"no findings: {stats.executions} executions, {stats.ops} ops in {stats.elapsed:.1f}s "
                          f"({stats.executions / max(stats.elapsed, 1e-9):.1f} exec/s)")
        else:
            console.print(f"a finding ({found[1][0].signature}) did not replay {CONFIRM_RUNS} of {CONFIRM_RUNS} "
                          "times; not reported (flaky)")
        _write_outputs(outputs, _run_data(config, [], [], sset, stats, seed), err)
        return EXIT_CLEAN
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the finding is complete: write and report it whole
    data = _run_data(config, crash.program, crash.findings, sset, stats, seed)
    data.ensure_timeline()
    path = _write(out_dir, config, crash.program, crash.findings, seed=seed,
                  confirmations=f"{crash.confirmations}/{CONFIRM_RUNS}", minimized=True, timeline=data.timeline)
    data.extra.update(confirmations=f"{crash.confirmations}/{CONFIRM_RUNS}", minimized=True)
    print_report(console, config, crash.program, crash.findings, suppressions=sset)
    console.print(f"found after {stats.executions} executions in {stats.elapsed:.1f}s; minimized "
                  f"{crash.original_length} -> {len(crash.program)} ops; reproduced "
                  f"{crash.confirmations}/{CONFIRM_RUNS}")
    console.print(f"replay file: {path}   (kvaudit replay {path})", soft_wrap=True)
    _write_outputs(outputs, data, err)
    return EXIT_FINDINGS


def _run_data(config, program, findings, sset, stats: FuzzStats, seed: int, interrupted: bool = False,
              program_title: str = "minimized program") -> ReportData:
    extra = {"seed": seed, "executions": stats.executions, "ops": stats.ops, "seconds": round(stats.elapsed, 1)}
    if interrupted:
        extra["interrupted"] = True
    return ReportData(config, program, findings, suppressed_by_kind(sset), extra, program_title=program_title,
                      suppressions=sset)


def _write(out_dir, config, program, findings, **extra) -> str:
    path = os.path.join(out_dir, replay.file_name(findings[0].signature))
    try:
        return replay.write_atomic(path, replay.to_doc(config, program, findings, **extra))
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


@main.command("replay")
@click.argument("file", type=click.Path(dir_okay=False))
@_suppress_option
@output_options
def replay_cmd(file, suppress_file, outputs):
    """Rerun a replay file and print its report. Exits 1 if it still yields findings, 0 if clean
    (or if --suppress rules match every finding)."""
    try:
        config, program, recorded, _ = replay.load(file)
    except replay.ReplayFormatError as e:
        raise InputError(str(e)) from None
    sset = _suppressions(suppress_file)
    _check_device(config.device)
    ex = execute(config, program, suppressions=sset)
    console = _console()
    print_report(console, config, program, ex.findings, program_title="program", suppressions=sset)
    want = {f.signature for f in recorded}
    got = set(ex.signatures)
    hidden = sorted(want & sset.suppressed_signatures()) if sset is not None else []
    if want:
        same = "yes" if want <= got | set(hidden) else "no"
        console.print(f"recorded signature(s) reproduced: {same}"
                      + (f" (suppressed: {', '.join(hidden)})" if hidden else ""), soft_wrap=True)
    _write_outputs(outputs, ReportData(config, program, ex.findings, suppressed_by_kind(sset), {"replayed": file},
                                       program_title="program", suppressions=sset), _console(stderr=True))
    return EXIT_FINDINGS if ex.findings else EXIT_CLEAN


@main.command("report")
@click.argument("file", type=click.Path(dir_okay=False))
@output_options
def report_cmd(file, outputs):
    """Render the findings recorded in a replay or report JSON FILE: the console report, and the
    files that --html/--sarif/--junit/--json ask for. Runs no search; the program is replayed once
    only when an occupancy plot (--html, --json) is wanted and FILE has no timeline. Exits 0 once
    the report is rendered, findings or not."""
    try:
        config, program, findings, doc = replay.load(file)
    except replay.ReplayFormatError as e:
        raise InputError(str(e)) from None
    timeline = doc.get("timeline")
    if timeline is not None and not _timeline_ok(timeline):
        raise InputError(f"{file}: bad timeline: want steps, ops and pools with series")
    suppressed = doc.get("suppressed") or {}
    if not isinstance(suppressed, dict) or not all(isinstance(v, int) for v in suppressed.values()):
        raise InputError(f"{file}: bad 'suppressed': want an object of kind -> count")
    if timeline is None and (outputs.html or outputs.json):
        _check_device(config.device)
    title = "minimized program" if doc.get("minimized") else "program"
    print_report(_console(), config, program, findings, program_title=title)
    if suppressed:
        _console().print("suppressed when recorded: " + ", ".join(f"{k} {v}" for k, v in sorted(suppressed.items())))
    extra = {k: v for k, v in doc.items() if k not in ("format", "config", "program", "findings", "timeline",
                                                           "suppressed")}
    _write_outputs(outputs, ReportData(config, program, findings, suppressed, extra, timeline=timeline,
                                       program_title=title), _console(stderr=True))
    return EXIT_CLEAN


def _timeline_ok(t) -> bool:
    try:
        n = len(t["steps"])
        return (len(t["ops"]) == n and isinstance(t["pools"], dict)
                and all(len(v) == n for p in t["pools"].values() for v in p["series"].values())
                and all(isinstance(p["total"], int) for p in t["pools"].values()))
    except (TypeError, KeyError, AttributeError):
        return False


@main.command()
def presets():
    """List the engine presets."""
    t = Table(title="presets")
    t.add_column("preset", no_wrap=True)
    t.add_column("description")
    for p in PRESETS.values():
        t.add_row(p.name, p.description)
    _console().print(t)


@main.command()
def bugs():
    """List the bug-zoo switches with their preset and public source."""
    console = _console()
    t = Table(title="bug zoo")
    t.add_column("bug", no_wrap=True)  # the name is what --bug takes: never cut it
    for col in ("preset", "source", "finding"):
        t.add_column(col, overflow="fold")
    for b in BUGS.values():
        t.add_row(b.name, b.preset, b.source, b.finding)
    console.print(t)
    for b in BUGS.values():
        console.print(Text.assemble((b.name, "bold"), f": {b.description}"))


if __name__ == "__main__":
    main()
