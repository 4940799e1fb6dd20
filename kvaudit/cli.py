"""The ``kvaudit`` command line (click).

Exit codes: 0 clean, 1 findings, 2 usage or input error, 3 a replay is not deterministic
(``replay --check-determinism``), 4 a recorded finding no longer reproduces (``minimize``),
69 an optional dependency is missing here (atheris), 70 internal error, 74 disk full (a finding or report could not be written; what was written is
kept), 130 interrupted with no finding. ``fuzz``, ``minimize`` and ``ci`` take SIGTERM (``timeout``,
Kubernetes, the Actions runner) as they take Ctrl-C: what was found is written, then the reports.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import tempfile
import threading
import time

import click

# NOTE: only modules that import neither torch, Hypothesis nor rich belong up here: `kvaudit --help`
# must start in a fraction of a second (tests/test_entry.py checks it with -X importtime). The
# commands import what they run inside their functions.
from engine_under_test import BUGS, PRESETS, UnknownBugError, UnknownPresetError, get_preset
from kvaudit.targets.sglang.config import TREE_CORES
from kvaudit import __version__, replay
from kvaudit.constants import CONFIRM_RUNS, DEFAULT_STEP_TIMEOUT, EXIT_UNAVAILABLE, FUZZERS
from kvaudit.outputs import FORMATS, Case, Outputs, ReportData, WriteError, disk_full
from kvaudit.outputs import write as write_outputs
from kvaudit.suppress import SuppressionError, SuppressionSet

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 70, 130
EXIT_NONDETERMINISTIC, EXIT_NOT_REPRODUCED, EXIT_DISK_FULL = 3, 4, 74
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # SIGTERM: timeout(1), Kubernetes, the Actions runner


class InputError(click.ClickException):
    exit_code = EXIT_USAGE


class DiskFull(click.ClickException):
    exit_code = EXIT_DISK_FULL


def _write_error(e: OSError, path: str, kept: list[str] | tuple = ()) -> click.ClickException:
    """The one-line error for a finding or report that could not be written: disk full (exit 74,
    naming the files kept), else an input error (exit 2)."""
    if disk_full(e):
        return DiskFull(f"disk full: cannot write {path} ({e.strerror or e}); "
                        + (f"kept what was written: {', '.join(kept)}" if kept else "nothing else was written"))
    return InputError(f"cannot write {path}: {e.strerror or e}")


class UnavailableError(click.ClickException):
    exit_code = EXIT_UNAVAILABLE


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


def _require_target(config) -> None:
    """A real-SGLang config needs SGLang importable: say so in one line (exit 2) before any run."""
    if getattr(config, "target", "eut") == "sglang":
        from kvaudit.targets.sglang.boot import SglangUnavailable, load
        try:
            load()
            if getattr(config, "disaggregation_mode", "null") == "decode":
                from kvaudit.targets.sglang.pd import load_pd
                load_pd()
        except SglangUnavailable as e:
            raise InputError(str(e)) from None


def _sglang_version() -> str:
    from kvaudit.targets.sglang.boot import installed_version
    return installed_version() or "?"


def _sglang_config(preset: str, bugs: tuple[str, ...], model: str, device: str, page_size: int | None,
                   tree_core: str | None):
    from kvaudit.targets.sglang.config import SGLANG_PRESETS, UnknownFaultError
    preset = "sglang" if preset == "default" else preset
    if preset not in SGLANG_PRESETS:
        raise InputError(f"unknown preset {preset!r} for --target sglang; valid presets: {', '.join(SGLANG_PRESETS)}")
    if model != "none":
        raise InputError("--model tiny is for the built-in engine: --target sglang computes no KV")
    changes = {"device": device, "bugs": frozenset(bugs), "tree_core": tree_core or "rust"}
    if page_size is not None:
        changes["page_size"] = page_size
    try:
        config = SGLANG_PRESETS[preset].config(**changes)
    except UnknownFaultError as e:
        raise InputError(str(e)) from None
    except ValueError as e:
        raise InputError(f"bad configuration: {e}") from None
    _require_target(config)
    return config


def _config(preset: str, bugs: tuple[str, ...], model: str, device: str, page_size: int | None,
            target: str = "eut", tree_core: str | None = None):
    _check_device(device)
    if target == "sglang":
        return _sglang_config(preset, bugs, model, device, page_size, tree_core)
    if tree_core is not None:
        raise InputError("--tree-core applies to --target sglang only")
    if preset.startswith("sglang"):
        raise InputError(f"preset {preset!r} drives real SGLang: add --target sglang")
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


def _set_step_timeout(ctx, param, value):
    if value is not None and not math.isfinite(value):
        _bad(param, "must be a finite number of seconds")
    from kvaudit.runner import set_step_timeout

    set_step_timeout(DEFAULT_STEP_TIMEOUT if value is None else value)  # process-wide: reset every command
    return value


_step_timeout_option = click.option(
    "--step-timeout", type=click.FloatRange(min=0, min_open=True), default=None, callback=_set_step_timeout,
    metavar="SECONDS",
    help=f"Watchdog: one engine step that runs longer is a hang finding naming the frames it is stuck in (the "
         f"step is interrupted; a step blocked inside one C call cannot be). [default: {DEFAULT_STEP_TIMEOUT:g}; "
         f"fuzz: min({DEFAULT_STEP_TIMEOUT:g}, --max-time / 6), at least 1]")


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


def _outputs(inputs: tuple[str, ...] = (), **paths) -> Outputs:
    """Check the report paths now, not after a long run: a non-empty file name (not ``-``), not a
    directory or a device, not one of the ``inputs`` and not named twice (however spelled), in a
    directory where a file can really be created (tried)."""
    seen: dict[str, str] = {}
    given = {os.path.realpath(p): p for p in inputs if p and os.path.exists(p)}
    for fmt, path in paths.items():
        if path is None:
            continue
        if path in ("", "-"):
            raise InputError(f"--{fmt}: want a file name, not {path!r}")
        real = os.path.realpath(path)
        if real in seen:
            raise InputError(f"--{fmt} and --{seen[real]} both name {path}")
        seen[real] = fmt
        if real in given:
            raise InputError(f"--{fmt} {path}: is the input file {given[real]}; it would be overwritten")
        if os.path.isdir(real):
            raise InputError(f"--{fmt} {path}: is a directory (want a file name)")
        if os.path.exists(real) and not os.path.isfile(real):
            raise InputError(f"--{fmt} {path}: not a regular file (reports are written by renaming a new file "
                             "over the old one)")
        parent = os.path.dirname(real)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise InputError(f"--{fmt} {path}: cannot write in {parent} (not a directory)")
        try:  # os.access says yes to root on read-only mounts and /sys: try it
            tempfile.TemporaryFile(dir=parent).close()
        except OSError as e:
            raise InputError(f"--{fmt} {path}: cannot write in {parent}: {e.strerror or e}") from None
    return Outputs(**paths)


def _write_outputs(outputs: Outputs, data: ReportData, err: Console, kept: tuple[str, ...] = ()) -> None:
    """Write the reports asked for; ``kept``: files this run wrote before (named if the disk is full)."""
    if not outputs.wanted():
        return
    try:
        written = write_outputs(outputs, data, note=lambda m: err.print(m, soft_wrap=True))
    except WriteError as e:
        raise _write_error(e, f"report {e.filename}", [*kept, *e.written]) from None
    err.print("reports written: " + ", ".join(written), soft_wrap=True)


def _console(stderr: bool = False) -> Console:
    """A rich console; off a terminal it is wide, so that paths in reports are not broken up."""
    from rich.console import Console

    probe = Console(stderr=stderr)
    width = None if probe.is_terminal else int(os.environ.get("COLUMNS", 0) or 120)
    return Console(stderr=stderr, highlight=False, width=width)


def _check_device(device: str) -> None:
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"device {device}: no CUDA device is available here (torch {torch.__version__})")


def _warn_unreachable_bugs(config, err: Console) -> None:
    if getattr(config, "target", "eut") != "eut":
        return
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
        from rich.live import Live

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
                ("coverage", getattr(s, "coverage", None) or f"{len(s.sites)} alloc/free sites"),
                ("elapsed", f"{s.elapsed:.1f}s"), ("remaining", f"{max(0.0, max_time - s.elapsed):.0f}s")]

    def line(self, s: FuzzStats) -> str:
        f = dict(self._fields(s, self.max_time))
        cov = getattr(s, "coverage", None)
        return (f"[{s.elapsed:6.1f}s] {s.phase}: executions={f['executions']} exec/s={f['exec/s']} ops={f['ops']} "
                f"findings={f['findings']} suppressed={f['suppressed']} sites={len(s.sites)} "
                + (f"coverage={cov.replace(' ', '_')} " if cov else "") + f"remaining={f['remaining']}")

    def renderable(self, s: FuzzStats):
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

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
                 help="Engine preset (see 'kvaudit presets'); with --target sglang, 'default' means 'sglang'."),
    click.option("--bug", "bugs", multiple=True, metavar="NAME",
                 help="Switch a bug-zoo bug on (repeatable; see 'kvaudit bugs')."),
    click.option("--model", type=click.Choice(["none", "tiny"]), default="none", show_default=True,
                 help="'tiny' runs the dummy transformer over real KV tensors; 'none' skips compute."),
    click.option("--device", default="cpu", show_default=True, help="Torch device for the engine: cpu or cuda."),
    click.option("--page-size", type=click.IntRange(min=1), default=None, help="Override the preset's page size (tokens)."),
    click.option("--target", type=click.Choice(["eut", "sglang"]), default="eut", show_default=True,
                 help="eut: the built-in engine_under_test; sglang: SGLang 0.5.23's own memory manager on CPU "
                      "(its presets start with 'sglang', see 'kvaudit presets'; --bug takes its injected faults, "
                      "see 'kvaudit bugs')."),
    click.option("--tree-core", type=click.Choice(TREE_CORES), default=None,
                 help="--target sglang: the UnifiedRadixCache tree core [default: rust, SGLang's own default]."),
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
    """Put the caller's SIGINT and SIGTERM handlers (and a clear interrupt flag) back when ``fn``
    returns, so an in-process caller (a test, a notebook) keeps its Ctrl-C."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        from kvaudit.runner import INTERRUPTED

        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.getsignal(sig) for sig in INTERRUPT_SIGNALS} if main_thread else {}
        hook = sys.unraisablehook
        try:
            return fn(*a, **k)
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
            sys.unraisablehook = hook
            INTERRUPTED.clear()

    return wrapper


def _ignore_interrupts() -> None:
    """A second Ctrl-C or SIGTERM must not cut the finding file and reports short: ignore both
    (on the main thread; the command's wrapper puts the caller's handlers back)."""
    if threading.current_thread() is threading.main_thread():
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _catch_sigint() -> None:
    """Ctrl-C -- and SIGTERM, which ``timeout``, Kubernetes and the Actions runner send -- raises
    KeyboardInterrupt as usual and also sets :data:`runner.INTERRUPTED`, which the next op checks:
    an interrupt swallowed inside a library callback still stops the run. Either signal takes the
    same path: what was found is written, then the reports, with the same exit code."""
    from kvaudit.runner import INTERRUPTED, quiet_unraisable

    def handler(signum, frame):
        INTERRUPTED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, handler)
        # the handler's KeyboardInterrupt can land in a callback Python cannot raise from (a gc
        # callback) and print "Exception ignored"; INTERRUPTED is set, so the next op stops
        quiet_unraisable()


@main.command()
@common_options
@click.option("--fuzzer", type=click.Choice(FUZZERS), default="hypothesis", show_default=True,
              help="hypothesis: stateful generation with shrinking and swarm testing; atheris: coverage-guided "
                   "libFuzzer over a byte encoding of programs; random: the plain random baseline.")
@click.option("--max-time", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              callback=lambda ctx, p, v: v if math.isfinite(v) else _bad(p, "must be a finite number of seconds"),
              metavar="SECONDS", help="Time budget for the search, in seconds, counted from the start of the process "
                                      "(start-up included; triage of a finding comes after).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed; the same seed gives the same search.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="kvaudit-out", show_default=True,
              help="Directory for replay files of findings.")
@click.option("--workers", type=click.IntRange(min=1, max=256), default=1, show_default=True,
              help="Worker processes (atheris: libFuzzer -fork=N). More than 1 runs a campaign.")
@click.option("--corpus", "corpus_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Run a resumable campaign over DIR (corpus, example database, findings): search the whole "
                   "budget, report each new signature once, skip those DIR already holds.")
@click.option("--seeds/--no-seeds", "use_seeds", default=True, show_default=True,
              help="atheris: start from the seed corpus in corpora/seeds/<preset> (it holds the regression "
                   "reproducers; --no-seeds to measure how the search finds them).")
@_suppress_option
@_step_timeout_option
@output_options
@_restoring_sigint
def fuzz(preset, bugs, model, device, page_size, target, tree_core, fuzzer, max_time, seed, out_dir, workers,
         corpus_dir, use_seeds, suppress_file, step_timeout, outputs):
    """Fuzz the built-in engine (or, with --target sglang, SGLang's own memory manager); confirm,
    minimize and report what it finds.

    Without --corpus (and one worker) the search stops at the first finding and exits 1 with a
    replay file in --out, or 0 when the budget ends clean. With --corpus DIR, or --workers N > 1
    (DIR defaults to --out), it is a campaign: it searches the whole budget, writes one replay file
    per new signature to DIR/findings/ as soon as it is confirmed, and exits 1 if any is new.
    Findings that --suppress rules match do not count: the search goes on past them.

    Exit codes: 0 clean, 1 a finding (campaign: a new one), 2 bad input, 130 interrupted with
    nothing found. Ctrl-C keeps what was found (unminimized if minimizing) and writes the reports
    asked for.
    """
    from kvaudit.fuzz import FuzzStats, triage
    from kvaudit.report import print_report, print_suppressions, summary_line, suppressed_by_kind
    from kvaudit.runner import INTERRUPTED, set_step_timeout
    from kvaudit.runner import step_timeout as runner_step_timeout

    config = _config(preset, bugs, model, device, page_size, target, tree_core)
    preset = config.preset
    if step_timeout is None:  # a hang found near the end costs one more limit in triage: keep it a fraction
        set_step_timeout(min(DEFAULT_STEP_TIMEOUT, max(1.0, max_time / 6)))
    if fuzzer == "atheris" and target != "eut":
        raise InputError("--fuzzer atheris instruments the built-in engine only; use hypothesis or random with "
                         "--target sglang")
    sset = _suppressions(suppress_file)
    campaign = corpus_dir is not None or workers > 1
    target_dir = corpus_dir if corpus_dir is not None else out_dir
    try:  # fail now, not after the budget, if findings could not be written
        os.makedirs(target_dir, exist_ok=True)
        if not os.access(target_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise InputError(f"--{'corpus' if corpus_dir is not None else 'out'} {target_dir}: {e.strerror or e}") from None
    if fuzzer == "atheris":
        _check_atheris()
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(os.path.join(target_dir, ".hypothesis"))  # not the user's cwd
    console, err = _console(), _console(stderr=True)
    stats = FuzzStats()
    where = (f"target sglang {_sglang_version()} ({config.tree_core} tree core), " if target == "sglang" else "")
    err.print(f"kvaudit fuzz: {where}{fuzzer}, preset {preset}, bugs: {', '.join(bugs) or 'none'}, seed {seed}, "
              f"budget {max_time:g}s, step timeout {runner_step_timeout():g}s, " + (f"campaign in {target_dir}, {workers} worker(s)" if campaign
                                           else f"out {out_dir}")
              + (f", suppressions {suppress_file} ({len(sset)} rule(s))" if sset is not None else ""), soft_wrap=True)
    _warn_unreachable_bugs(config, err)
    if getattr(config, "enable_hierarchical_cache", False) and config.tree_core == "rust":
        err.print("note: on the rust tree core the hicache_host_pool is checked by its ledger and free-list replay "
                  "only (the core cannot list host values: no leak check there); --tree-core python checks it fully",
                  soft_wrap=True)
    max_time = _budget_left(max_time)
    if campaign:
        return _campaign(config, fuzzer, max_time, seed, workers, target_dir, suppress_file, sset, outputs,
                         console, err, use_seeds)
    progress = _Progress(err, max_time, suppressions=sset)
    found = crash = None
    _catch_sigint()
    try:
        with progress:
            progress.update(stats)
            found = _search(fuzzer, config, max_time, seed, stats, progress.update, sset, suppress_file, out_dir,
                            use_seeds)
            if found is None:
                stats.phase = "done"
                progress.update(stats, force=True)
            else:
                stats.findings = 1

                def phase(name: str) -> None:  # a line per phase off a terminal: confirming, minimizing, ...
                    stats.phase = name
                    progress.update(stats, force=True)

                # the report's hit counts are the search's: triage's many reruns count apart
                crash = triage(config, found[0], found[1][0], suppressions=sset.fresh() if sset is not None else None,
                               on_phase=phase)
                phase("done")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        _ignore_interrupts()  # a second Ctrl-C or SIGTERM must not cut the report short
        INTERRUPTED.clear()  # the reports below replay the program (the timeline)
        if found is None:
            err.print(f"interrupted after {stats.elapsed:.1f}s: {stats.executions} executions, no finding")
            _write_outputs(outputs, _run_data(config, [], [], sset, stats, seed, interrupted=True), err)
            return EXIT_INTERRUPTED
        if crash is None:  # interrupted while confirming or minimizing: keep it, unminimized and unconfirmed
            program, findings = found
            print_report(console, config, program, findings, suppressions=sset, program_title="program (unminimized)")
            path = _write(out_dir, config, program, findings, seed=seed,
                          confirmations="interrupted before confirmation", minimized=False)
            err.print(f"interrupted while minimizing; the unminimized program is in {path}", soft_wrap=True)
            _write_outputs(outputs, _run_data(config, program, findings, sset, stats, seed, interrupted=True,
                                              program_title="program (unminimized)"), err, kept=(path,))
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
        console.print(summary_line([], suppressed_by_kind(sset)), soft_wrap=True)
        _write_outputs(outputs, _run_data(config, [], [], sset, stats, seed), err)
        return EXIT_CLEAN
    _ignore_interrupts()  # the finding is complete: write and report it whole
    minimized = crash.runs == CONFIRM_RUNS  # a watchdog hang is confirmed once and not minimized
    title = "minimized program" if minimized else "program (not minimized)"
    data = _run_data(config, crash.program, crash.findings, sset, stats, seed, program_title=title)
    data.cases[0].timeline = crash.timeline  # triage recorded it when a replay is costly (a hang)
    data.ensure_timelines()
    data.extra.update(confirmations=f"{crash.confirmations}/{crash.runs}", minimized=minimized)
    hit_execs, hit_s = stats.first_hit or (stats.executions, stats.elapsed)
    console.print(f"found after {hit_execs} executions in {hit_s:.1f}s (search: {stats.executions} executions"
                  + (f", then {stats.shrink_executions} shrinking" if stats.shrink_executions else "")
                  + f", {stats.elapsed:.1f}s in all); "
                  + (f"minimized {crash.original_length} -> {len(crash.program)} ops" if minimized else
                     f"{len(crash.program)} ops, not minimized (each replay of a hang costs the step timeout)")
                  + f"; reproduced {crash.confirmations}/{crash.runs}", soft_wrap=True)
    try:
        path = _write(out_dir, config, crash.program, crash.findings, seed=seed, fuzzer=fuzzer,
                      confirmations=f"{crash.confirmations}/{crash.runs}", minimized=minimized,
                      timeline=data.cases[0].timeline)
    except click.ClickException:  # a full disk (_write_error): the finding still reaches the log
        print_report(console, config, crash.program, crash.findings, suppressions=sset, program_title=title)
        raise
    console.print(f"replay file: {path}   (kvaudit replay {path})", soft_wrap=True)
    # the report last: its closing SUMMARY: line is the last line on stdout, as LeakSanitizer's
    print_report(console, config, crash.program, crash.findings, suppressions=sset, program_title=title)
    _write_outputs(outputs, data, err, kept=(path,))
    return EXIT_FINDINGS


def _check_atheris() -> None:
    from kvaudit.atheris_fuzz import HARNESS
    from kvaudit.constants import MISSING_ATHERIS

    try:
        import atheris
    except ImportError:
        raise UnavailableError(f"--fuzzer atheris: {MISSING_ATHERIS}; or use --fuzzer hypothesis or random") from None
    del atheris
    if not os.access(HARNESS, os.X_OK):
        raise UnavailableError(f"--fuzzer atheris: the harness {HARNESS} is missing or not executable (reinstall "
                               "kvaudit: the wheel ships it)")


def _budget_left(max_time: float) -> float:
    """What is left of ``--max-time`` seconds for the search: the budget counts from the process
    start (:data:`kvaudit.entry.STARTED`), so start-up (importing torch and Hypothesis, building the
    target) is part of it; 0 if start-up spent it all. In-process callers (click's test runner)
    have no start time and get the whole budget."""
    from kvaudit import entry

    if entry.STARTED is None:
        return max_time
    return max(0.0, max_time - (time.monotonic() - entry.STARTED))


def _search(fuzzer, config, max_time, seed, stats, on_progress, sset, suppress_file, out_dir, use_seeds=True):
    """One search that stops at the first finding: (program, findings) or None."""
    from kvaudit.fuzz import hypothesis_search, random_search

    if fuzzer == "random":
        return random_search(config, max_time, seed, stats, on_progress=on_progress, suppressions=sset)
    if fuzzer == "atheris":
        from kvaudit.atheris_fuzz import atheris_search

        return atheris_search(config, max_time, seed, stats, on_progress=on_progress, corpus_dir=None, workers=1,
                              suppressions_path=suppress_file, work_dir=os.path.join(out_dir, ".atheris"),
                              use_seeds=use_seeds)
    return hypothesis_search(config, max_time, seed, stats, on_progress=on_progress, suppressions=sset)


def _campaign(config, fuzzer, max_time, seed, workers, corpus, suppress_file, sset, outputs, console, err,
              use_seeds: bool = True) -> int:
    """``kvaudit fuzz --corpus DIR`` / ``--workers N``: see :mod:`kvaudit.campaign`."""
    from rich.table import Table
    from rich.text import Text

    from kvaudit.campaign import findings_dir, known_signatures, run_campaign
    from kvaudit.fuzz import FuzzStats
    from kvaudit.report import print_report, print_suppressions, print_table, summary_line, suppressed_by_kind
    from kvaudit.runner import INTERRUPTED

    progress = _Progress(err, max_time, suppressions=sset)
    before = known_signatures(corpus)
    if before:
        err.print(f"resuming: {len(before)} signature(s) recorded in {len(set(before.values()))} file(s) in "
                  f"{findings_dir(corpus)} are known, not new", soft_wrap=True)

    def landed(sig: str, path: str) -> None:
        (progress.live.console if progress.live else err).print(f"new finding: {sig} -> {path}", soft_wrap=True)

    _catch_sigint()
    try:
        with progress:
            progress.update(FuzzStats())
            result = run_campaign(config, fuzzer, max_time, seed, workers, corpus, suppress_file,
                                  on_progress=progress.update, on_finding=landed, use_seeds=use_seeds)
            progress.update(result.stats, force=True)
    except OSError as e:
        if not disk_full(e):
            raise
        raise _write_error(e, e.filename or f"in {corpus}", [f"the finding files in {findings_dir(corpus)}"]) from None
    finally:
        _ignore_interrupts()  # the summary and reports are written whole
        INTERRUPTED.clear()
    cases = []
    for sig, path in sorted(result.new.items()):
        try:
            _, program, findings, doc = replay.load(path)
        except replay.ReplayFormatError as e:
            err.print(f"warning: {e}", soft_wrap=True)
            continue
        print_report(console, config, program, findings)
        cases.append(Case(program, findings, doc.get("timeline"),
                          doc_extra={k: doc[k] for k in ("seed", "fuzzer", "confirmations") if k in doc}))
    t = Table(title="campaign", title_justify="left")
    t.add_column("signature", overflow="fold")
    t.add_column("status", no_wrap=True)
    t.add_column("replay file", overflow="fold")
    for sig, path in sorted(result.new.items()):
        t.add_row(sig, Text("new", style="bold red"), path)
    for sig, path in sorted(result.known.items()):
        t.add_row(sig, Text("known", style="dim"), path)
    for sig in sorted(result.flaky):
        t.add_row(sig, Text("flaky (not reproduced 3/3)", style="yellow"), "-")
    if result.new or result.known or result.flaky:
        print_table(console, t)
    if sset is not None:
        print_suppressions(console, sset)
    s = result.stats
    console.print(f"{'interrupted' if result.interrupted else 'campaign done'}: {s.executions} executions, {s.ops} ops "
                  f"in {s.elapsed:.1f}s ({s.executions / max(s.elapsed, 1e-9):.1f} exec/s, {result.workers} worker(s)); "
                  f"{len(result.new)} new, {len(result.known)} known signature(s); corpus {corpus}", soft_wrap=True)
    # the closing line: the new findings (a campaign reports each signature once)
    line = summary_line([f for c in cases for f in c.findings], suppressed_by_kind(sset))
    line = line.replace("kvaudit: no findings", "kvaudit: no new findings")
    if result.known:
        line = line[:-1] + f"; {len(result.known)} known signature(s) not reported again."
    console.print(line, soft_wrap=True)
    if s.executions == 0 and not result.interrupted:
        err.print("warning: no program ran: the workers spent the budget starting up (importing SGLang takes "
                  "about 6 s per worker); raise --max-time", soft_wrap=True)
    extra = {"fuzzer": fuzzer, "seed": seed, "workers": workers, "executions": s.executions, "ops": s.ops,
             "seconds": round(s.elapsed, 1), "corpus": corpus}
    if result.interrupted:
        extra["interrupted"] = True
    _write_outputs(outputs, ReportData(config, cases or [Case([], [])], suppressed_by_kind(sset), extra,
                                       suppressions=sset), err, kept=tuple(sorted(set(result.new.values()))))
    if result.new:
        return EXIT_FINDINGS
    return EXIT_INTERRUPTED if result.interrupted else EXIT_CLEAN


def _run_data(config, program, findings, sset, stats: FuzzStats, seed: int, interrupted: bool = False,
              program_title: str = "minimized program") -> ReportData:
    from kvaudit.report import suppressed_by_kind

    extra = {"seed": seed, "executions": stats.executions, "ops": stats.ops, "seconds": round(stats.elapsed, 1)}
    if stats.shrink_executions:
        extra["shrink_executions"] = stats.shrink_executions
    if stats.first_hit is not None:
        extra["first_hit_executions"], extra["first_hit_seconds"] = stats.first_hit[0], round(stats.first_hit[1], 1)
    if interrupted:
        extra["interrupted"] = True
    return ReportData.single(config, program, findings, suppressed_by_kind(sset), extra, program_title=program_title,
                             suppressions=sset)


def _write(out_dir, config, program, findings, **extra) -> str:
    """The replay file of ``findings`` in ``out_dir``, named by the first one's signature."""
    return _write_file(os.path.join(out_dir, replay.file_name(findings[0].signature)), config, program, findings,
                       **extra)


def _write_file(path, config, program, findings, **extra) -> str:
    try:
        return replay.write_atomic(path, replay.to_doc(config, program, findings, **extra))
    except OSError as e:
        raise _write_error(e, path) from None


def _load_replay(file: str, suppress_file: str | None, tree_core: str | None = None):
    """(config, program, recorded findings, suppressions) of a replay file named on the command
    line; a bad file, suppression file or device is an input error. ``tree_core`` overrides a
    real-SGLang file's tree core."""
    try:
        config, program, recorded, _ = replay.load(file)
    except replay.ReplayFormatError as e:
        raise InputError(str(e)) from None
    if tree_core is not None:
        if getattr(config, "target", "eut") != "sglang":
            raise InputError("--tree-core applies to replay files of --target sglang only")
        config = config.replace(tree_core=tree_core)
    sset = _suppressions(suppress_file)
    _check_device(config.device)
    _require_target(config)
    return config, program, recorded, sset


@main.command("replay")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="FILE...")
@_suppress_option
@click.option("--check-determinism", is_flag=True,
              help="Run the replay --runs times and compare the ledger digests (every alloc, free and lock "
                   "event) and findings; exit 3 if any run differs.")
@click.option("--runs", type=click.IntRange(min=2, max=1000), default=CONFIRM_RUNS, show_default=True,
              help="Runs for --check-determinism.")
@click.option("--tree-core", type=click.Choice(TREE_CORES), default=None,
              help="A --target sglang file: run it with this UnifiedRadixCache tree core instead of its own.")
@click.option("--update", is_flag=True,
              help="Re-record each FILE in place (atomically) instead of reporting: replay it and write back "
                   "its findings with today's stacks, source lines and signatures, keeping the config, program "
                   "and every other field (a timeline is recorded again). For keeping a corpus fresh after the "
                   "engine's code moved: kvaudit replay --update corpora/regressions/*.json. Exits 4 if a file "
                   "that recorded findings yields none (it is left as it was).")
@_step_timeout_option
@output_options
def replay_cmd(files, suppress_file, check_determinism, runs, tree_core, update, step_timeout,
               outputs):
    """Rerun a replay file and print its report. Exits 1 if it still yields findings, 0 if clean
    (or if --suppress rules match every finding); with --check-determinism, 3 if the runs differ.
    With --html or --json the program runs once more, to record the pool occupancy. With --update,
    re-record one or more files in place (see --update)."""
    from kvaudit.report import print_report, suppressed_by_kind
    from kvaudit.runner import execute

    if update:
        if suppress_file or check_determinism or tree_core or outputs.wanted():
            raise InputError("--update re-records files as they are: it takes no --suppress, "
                             "--check-determinism, --tree-core or report flags")
        return _update_replays(files)
    if len(files) > 1:
        raise InputError(f"one FILE at a time ({len(files)} given); several only with --update")
    file = files[0]
    _outputs((file, suppress_file), **vars(outputs))
    config, program, recorded, sset = _load_replay(file, suppress_file, tree_core)
    ex = execute(config, program, suppressions=sset, drain=True)
    console = _console()
    print_report(console, config, program, ex.findings, program_title="program", suppressions=sset)
    want = {f.signature for f in recorded}
    got = set(ex.signatures)
    hidden = sorted(want & sset.suppressed_signatures()) if sset is not None else []
    if want:
        same = "yes" if want <= got | set(hidden) else "no"
        console.print(f"recorded signature(s) reproduced: {same}"
                      + (f" (suppressed: {', '.join(hidden)})" if hidden else ""), soft_wrap=True)
    _write_outputs(outputs, ReportData.single(config, program, ex.findings, suppressed_by_kind(sset),
                                              {"replayed": file}, program_title="program", suppressions=sset),
                   _console(stderr=True))
    if check_determinism and _check_determinism(console, config, program, sset, ex, runs):
        return EXIT_NONDETERMINISTIC
    return EXIT_FINDINGS if ex.findings else EXIT_CLEAN


def _update_replays(files: tuple[str, ...]) -> int:
    """``replay --update``: each file replayed and its findings written back (see
    :func:`kvaudit.replay.rerecord`), one line per file; EXIT_NOT_REPRODUCED if any file that
    recorded findings now yields none (that file is not written)."""
    from kvaudit.runner import execute

    console = _console()
    lost = 0
    for file in files:
        config, program, recorded, _ = _load_replay(file, None)
        try:
            outcome = replay.rerecord(file, execute(config, program).findings)
        except OSError as e:
            raise _write_error(e, file) from None
        lost += outcome.startswith("not updated")
        console.print(f"{file}: {outcome}", soft_wrap=True)
    return EXIT_NOT_REPRODUCED if lost else EXIT_CLEAN


def _check_determinism(console: Console, config, program, sset, first, runs: int) -> bool:
    """Run ``program`` ``runs - 1`` more times beside ``first``; print one row per run (ledger
    digest, findings); True if any run differs."""
    from rich.table import Table
    from rich.text import Text

    from kvaudit.report import print_table
    from kvaudit.runner import execute

    execs = [first] + [execute(config, program, suppressions=sset.fresh() if sset is not None else None)
                       for _ in range(runs - 1)]

    def key(ex):
        return ex.digest, [(f.signature, f.slots, f.step) for f in ex.findings], ex.steps

    t = Table(title=f"determinism: {runs} runs", title_justify="left")
    for col in ("run", "ledger digest", "steps", "findings"):
        t.add_column(col, overflow="fold")
    for i, ex in enumerate(execs):
        same = key(ex) == key(execs[0])
        t.add_row(str(i + 1), ex.digest[:16], str(ex.steps), ", ".join(ex.signatures) or "none",
                  style="" if same else "bold red")
    print_table(console, t)
    differ = any(key(ex) != key(execs[0]) for ex in execs)
    console.print(Text("NOT deterministic: the runs differ" if differ else f"deterministic: {runs} identical runs",
                       style="bold red" if differ else "green"))
    return differ


@main.command("minimize")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out_file", type=click.Path(dir_okay=False), default=None, metavar="OUT",
              help="Where to write the minimized replay file (default: FILE with .min.json).")
@click.option("--signature", default=None, metavar="SIG",
              help="The finding to keep (default: the first finding recorded in FILE).")
@_suppress_option
@_step_timeout_option
@_restoring_sigint
def minimize_cmd(file, out_file, signature, suppress_file, step_timeout):
    """Minimize a replay file: delta debugging over its ops, then simpler op arguments, keeping the
    finding's signature; the result is confirmed 3 of 3 times and written atomically. Exits 0 when
    written, 4 if the finding does not reproduce (or not 3 of 3 after minimizing). Ctrl-C or
    SIGTERM writes the smallest program that reproduced so far (unconfirmed) and exits 130."""
    from kvaudit.report import print_report
    from kvaudit.runner import execute

    config, program, recorded, sset = _load_replay(file, suppress_file)
    if signature is None:
        if not recorded:
            raise InputError(f"{file} records no finding: name one with --signature")
        signature = recorded[0].signature
    out_file = out_file or (file[:-5] if file.endswith(".json") else file) + ".min.json"
    _outputs((file,), json=out_file)  # the same checks as the report flags
    console, err = _console(), _console(stderr=True)
    fresh = (lambda: sset.fresh()) if sset is not None else (lambda: None)
    err.print(f"minimizing {len(program)} ops of {file}, keeping {signature}", soft_wrap=True)
    _catch_sigint()
    from kvaudit.fuzz import confirm
    from kvaudit.minimize import Interrupted, minimize

    small = None
    try:
        small = minimize(config, program, signature, fresh())
        confirmations = confirm(config, small, signature, suppressions=fresh())
    except ValueError:
        err.print(f"{file}: {signature} does not reproduce", soft_wrap=True)
        return EXIT_NOT_REPRODUCED
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        smallest = small if small is not None else e.smallest if isinstance(e, Interrupted) else None
        return _write_interrupted_minimize(config, program, smallest, signature, file, out_file, fresh(),
                                           console, err)
    if confirmations < CONFIRM_RUNS:
        err.print(f"the minimized program reproduces {signature} only {confirmations}/{CONFIRM_RUNS} times; "
                  "nothing written", soft_wrap=True)
        return EXIT_NOT_REPRODUCED
    final = execute(config, small, suppressions=fresh(), drain=True)
    findings = _signature_first(final.findings, signature)
    try:
        path = _write_file(out_file, config, small, findings, minimized=True, minimized_from=file,
                           confirmations=f"{confirmations}/{CONFIRM_RUNS}")
    except click.ClickException:  # a full disk (_write_error): the minimized program still reaches the log
        print_report(console, config, small, findings)
        raise
    console.print(f"minimized {len(program)} -> {len(small)} ops; reproduced {confirmations}/{CONFIRM_RUNS}; "
                  f"written to {path}", soft_wrap=True)
    print_report(console, config, small, findings)  # last: its SUMMARY: line closes stdout
    return EXIT_CLEAN


def _signature_first(findings: list, signature: str) -> list:
    """``findings`` with those of ``signature`` first (a replay file's first finding is the one kept)."""
    return [f for f in findings if f.signature == signature] + [f for f in findings if f.signature != signature]


def _write_interrupted_minimize(config, program, smallest, signature, file, out_file, suppressions, console,
                                err) -> int:
    """``kvaudit minimize`` interrupted: write the smallest program that reproduced so far (replayed
    once more for its findings' stacks; not confirmed 3/3, ``"minimized": false``); EXIT_INTERRUPTED."""
    from kvaudit.report import print_report
    from kvaudit.runner import INTERRUPTED, execute

    _ignore_interrupts()  # a second Ctrl-C or SIGTERM must not cut the file short
    INTERRUPTED.clear()  # the replay below runs ops
    if smallest is None:
        err.print("interrupted before the program reproduced: nothing written")
        return EXIT_INTERRUPTED
    final = execute(config, smallest, suppressions=suppressions, drain=True)
    findings = _signature_first(final.findings, signature)
    if signature not in final.signatures:
        err.print(f"interrupted; the smallest program so far ({len(smallest)} ops) did not reproduce {signature} "
                  "when replayed: nothing written", soft_wrap=True)
        return EXIT_INTERRUPTED
    print_report(console, config, smallest, findings)
    path = _write_file(out_file, config, smallest, findings, minimized=False, minimized_from=file,
                       confirmations="interrupted before confirmation")
    err.print(f"interrupted: the smallest program so far ({len(program)} -> {len(smallest)} ops, not confirmed) "
              f"written to {path}", soft_wrap=True)
    return EXIT_INTERRUPTED


@main.command("ci")
@click.option("--max-time", type=click.FloatRange(min=0), default=60.0, show_default=True, metavar="SECONDS",
              callback=lambda ctx, p, v: v if math.isfinite(v) else _bad(p, "must be a finite number of seconds"),
              help="Total fuzz budget, split evenly over the presets (0: replay the regressions only); "
                   "start-up and the regression replays are not counted.")
@click.option("--presets", "presets_value", default="all", show_default=True, metavar="LIST",
              help="Presets to fuzz: 'all' or a comma-separated list.")
@click.option("--fuzzer", type=click.Choice(FUZZERS), default="hypothesis", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--regressions", "regressions_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Replay files that must still reproduce (and be clean when their switches are off) "
                   "[default: ./corpora/regressions, else the one kvaudit ships].")
@click.option("--corpus", "corpus_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Keep a campaign corpus per preset in DIR/<preset> between runs (nightly): known findings "
                   "are not new.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="kvaudit-ci-out", show_default=True,
              help="Directory for the replay files of new findings.")
@_suppress_option
@_step_timeout_option
@output_options
@_restoring_sigint
def ci_cmd(max_time, presets_value, fuzzer, seed, regressions_dir, corpus_dir, out_dir, suppress_file, step_timeout,
           outputs):
    """The nightly / per-PR job: replay every regression file (it must reproduce 3 times
    identically with its switches on and be clean with them off), fuzz the clean engine over the
    presets for --max-time seconds in all, write JUnit/SARIF/HTML/JSON as asked. Exits 0 when
    clean, 1 on a failed regression (a malformed file among them: a JUnit error, and the job goes on)
    or a new finding, 130 when interrupted (Ctrl-C or SIGTERM; the reports are written)."""
    from rich.table import Table
    from rich.text import Text

    from kvaudit import ci
    from kvaudit.report import print_report, print_table, suppressed_by_kind
    from kvaudit.runner import INTERRUPTED

    try:
        preset_names = ci.presets_arg(presets_value)
    except ValueError as e:
        raise InputError(f"--presets: {e}") from None
    sset = _suppressions(suppress_file)
    if regressions_dir is None:
        from kvaudit.data import data_path

        here = os.path.join("corpora", "regressions")
        regressions_dir = here if os.path.isdir(here) else data_path("corpora", "regressions")
    if not os.path.isdir(regressions_dir):
        raise InputError(f"--regressions {regressions_dir}: no such directory")
    files = ci.regression_files(regressions_dir)
    for d, flag in ((out_dir, "out"), (corpus_dir, "corpus")):
        if d is not None:
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise InputError(f"--{flag} {d}: {e.strerror or e}") from None
    if fuzzer == "atheris":
        _check_atheris()
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(os.path.join(corpus_dir or out_dir, ".hypothesis"))
    console, err = _console(), _console(stderr=True)
    result = ci.CiResult()
    per_preset = max_time / len(preset_names) if max_time > 0 else 0.0
    err.print(f"kvaudit ci: {len(files)} regression file(s) in {regressions_dir}; fuzz {fuzzer} over "
              f"{len(preset_names)} preset(s), {per_preset:.1f}s each", soft_wrap=True)
    _catch_sigint()
    try:
        for path in files:
            check = ci.check_regression(path)  # a malformed file is a failed check, not the end of the job
            result.regressions.append(check)
            err.print(f"regression {check.name}: " + ("ok" if check.ok else f"FAILED: {check.problem}"),
                      soft_wrap=True)
        if per_preset > 0:
            for preset in preset_names:
                progress = _Progress(err, per_preset, suppressions=sset)
                with progress:
                    run = ci.fuzz_preset(preset, per_preset, seed, fuzzer, corpus_dir, out_dir, suppress_file,
                                         on_progress=progress.update)
                result.fuzz.append(run)
                err.print(f"fuzz {preset}: {run.executions} executions, "
                          + (f"{len(run.new)} NEW finding(s)" if run.new else "clean")
                          + (f", {len(run.known)} known" if run.known else ""), soft_wrap=True)
                if run.interrupted:  # its findings are kept above
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        result.interrupted = True
    _ignore_interrupts()  # the summary and reports are written whole
    INTERRUPTED.clear()
    for run in result.fuzz:
        for program, findings, path in run.new:
            print_report(console, get_preset(run.preset).config(), program, findings)
    t = Table(title="kvaudit ci", title_justify="left")
    t.add_column("check", overflow="fold")
    t.add_column("result", overflow="fold")
    for r in result.regressions:
        t.add_row(f"regression {r.name}", Text("ok", style="green") if r.ok else Text(r.problem, style="bold red"))
    for run in result.fuzz:
        t.add_row(f"fuzz {run.preset} ({run.seconds:.0f}s, {run.executions} executions)",
                  Text(", ".join(f"NEW {f[1][0].signature} -> {f[2]}" for f in run.new), style="bold red")
                  if run.new else Text("clean", style="green"))
    print_table(console, t)
    kept = [path for run in result.fuzz for _, _, path in run.new]
    if outputs.junit:
        try:
            replay.write_text_atomic(outputs.junit, ci.junit(result))
        except OSError as e:
            raise _write_error(e, outputs.junit, kept) from None
        err.print(f"JUnit written: {outputs.junit}")
        kept.append(outputs.junit)
    if outputs.sarif:  # every open finding, new and known (HTML and JSON: the new ones)
        import json

        try:
            replay.write_text_atomic(outputs.sarif, json.dumps(ci.sarif(result, get_preset(preset_names[0]).config()),
                                                               indent=2) + "\n")
        except OSError as e:
            raise _write_error(e, outputs.sarif, kept) from None
        err.print(f"SARIF written: {outputs.sarif}")
        kept.append(outputs.sarif)
    rest = Outputs(html=outputs.html, json=outputs.json)
    if rest.wanted():
        cases = [Case(p, f, doc_extra={"preset": run.preset}, config=get_preset(run.preset).config())
                 for run in result.fuzz for p, f, _ in run.new]
        base = get_preset(preset_names[0]).config()
        _write_outputs(rest, ReportData(base, cases or [Case([], [])], suppressed_by_kind(sset),
                                        {"job": "kvaudit ci"}, suppressions=sset), err, kept=tuple(kept))
    failed = result.failed
    console.print(("FAILED" if failed else "passed") + f": {sum(r.ok for r in result.regressions)}/"
                  f"{len(result.regressions)} regressions ok, {len(result.new_findings())} new finding(s)"
                  + (" (interrupted)" if result.interrupted else ""))
    if failed:
        return EXIT_FINDINGS
    return EXIT_INTERRUPTED if result.interrupted else EXIT_CLEAN


@main.command("bench")
@click.option("--trials", type=click.IntRange(min=1, max=100), default=5, show_default=True,
              help="Trials per bug and fuzzer (seeds 1..N).")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              metavar="SECONDS", help="Time budget of one trial.")
@click.option("--fuzzers", "fuzzers_value", default=",".join(FUZZERS), show_default=True, metavar="LIST")
@click.option("--bugs", "bugs_value", default="all", show_default=True, metavar="LIST",
              help="Zoo bugs: 'all' or a comma-separated list.")
@click.option("--fp-seconds", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Clean-engine time per fuzzer for the false-positive run (default: the budget).")
@click.option("--overhead-presets", default="all", show_default=True, metavar="LIST",
              help="Presets for the overhead/throughput table ('all', a list, or 'none').")
@click.option("--out", "out_md", type=click.Path(dir_okay=False), default="docs/benchmarks.md", show_default=True)
@click.option("--json", "out_json", type=click.Path(dir_okay=False), default="docs/benchmarks.json",
              show_default=True)
def bench_cmd(trials, budget, fuzzers_value, bugs_value, fp_seconds, overhead_presets, out_md, out_json):
    """Benchmark the fuzzers on the bug zoo: each bug x fuzzer for --trials trials of --budget
    seconds, a false-positive run on the clean engine and the overhead per preset; writes a markdown
    report and the raw JSON (see kvaudit/bench.py for the method)."""
    from kvaudit import bench

    fuzzers = [f.strip() for f in fuzzers_value.split(",") if f.strip()]
    bad = [f for f in fuzzers if f not in FUZZERS]
    if bad or not fuzzers:
        raise InputError(f"--fuzzers: unknown fuzzer {bad[0] if bad else fuzzers_value!r} "
                         f"(valid: {', '.join(FUZZERS)})")
    bugs = list(BUGS) if bugs_value == "all" else [b.strip() for b in bugs_value.split(",") if b.strip()]
    bad = [b for b in bugs if b not in BUGS]
    if bad or not bugs:
        raise InputError(f"--bugs: unknown bug {bad[0] if bad else bugs_value!r} (see 'kvaudit bugs')")
    from kvaudit import ci

    try:
        ov = [] if overhead_presets == "none" else ci.presets_arg(overhead_presets)
    except ValueError as e:
        raise InputError(f"--overhead-presets: {e}") from None
    if "atheris" in fuzzers:
        _check_atheris()
    _outputs(html=out_md, json=out_json)  # writable, distinct (--out and --json)
    err = _console(stderr=True)
    err.print(f"kvaudit bench: {len(bugs)} bug(s) x {len(fuzzers)} fuzzer(s) x {trials} trial(s), "
              f"budget {budget:g}s each", soft_wrap=True)
    res = bench.run(bugs, fuzzers, trials, budget, budget if fp_seconds is None else fp_seconds, ov,
                    on_event=lambda line: err.print(line, soft_wrap=True, highlight=False))
    kept: list[str] = []
    for path, write in ((out_json, lambda: replay.write_atomic(out_json, res.to_json())),
                        (out_md, lambda: replay.write_text_atomic(out_md, bench.markdown(res)))):
        try:
            kept.append(write())
        except OSError as e:
            raise _write_error(e, path, kept) from None
    _console().print(f"bench done in {res.wall / 60:.1f} min: {out_md}, {out_json}")
    return EXIT_CLEAN


@main.command("report")
@click.argument("file", type=click.Path(dir_okay=False))
@output_options
def report_cmd(file, outputs):
    """Render the findings recorded in a replay or report JSON FILE: the console report, and the
    files that --html/--sarif/--junit/--json ask for. Runs no search; the program is replayed once
    only when an occupancy plot (--html, --json) is wanted and FILE has no timeline. Exits 0 once
    the report is rendered, findings or not."""
    from kvaudit.report import print_cases
    from kvaudit.timeline import is_valid as timeline_is_valid

    _outputs((file,), **vars(outputs))
    try:
        config, loaded, doc = replay.load_cases(file)
    except replay.ReplayFormatError as e:
        raise InputError(str(e)) from None
    suppressed = doc.get("suppressed") or {}
    if not isinstance(suppressed, dict) or not all(isinstance(v, int) and v >= 0 for v in suppressed.values()):
        raise InputError(f"{file}: bad 'suppressed': want an object of kind -> count")
    console = _console()
    cases = []
    for i, (case_config, program, findings, case_doc) in enumerate(loaded):
        timeline = case_doc.get("timeline")
        if timeline is not None and not timeline_is_valid(timeline):
            raise InputError(f"{file}: bad timeline{f' in case {i}' if len(loaded) > 1 else ''}: "
                             "want steps, ops and pools whose series are lists of counts as long as steps")
        if timeline is None and program and (outputs.html or outputs.json):
            _check_device(case_config.device)
        title = "minimized program" if case_doc.get("minimized") else "program"
        cases.append(Case(program, findings, timeline, title,
                          doc_extra={k: v for k, v in case_doc.items() if k in ("seed", "fuzzer", "confirmations",
                                                                                "minimized", "preset")},
                          config=case_config))
    notes = ("suppressed when recorded: " + ", ".join(f"{k} {v}" for k, v in sorted(suppressed.items())),) \
        if suppressed else ()
    print_cases(console, config, [(c.program, c.findings, c.program_title) for c in cases], notes=notes)
    extra = {k: v for k, v in doc.items() if k not in ("format", "config", "program", "findings", "timeline",
                                                           "suppressed", "cases")}
    _write_outputs(outputs, ReportData(config, cases, suppressed, extra), _console(stderr=True))
    return EXIT_CLEAN


@main.command()
def presets():
    """List the engine presets."""
    from rich.table import Table

    t = Table(title="presets")
    t.add_column("preset", no_wrap=True)
    t.add_column("description")
    t.add_column("target", no_wrap=True)
    for p in PRESETS.values():
        t.add_row(p.name, p.description, "eut")
    from kvaudit.targets.sglang.config import SGLANG_PRESETS
    for p in SGLANG_PRESETS.values():
        t.add_row(p.name, p.description, "sglang (--target sglang)")
    _console().print(t)


@main.command()
def bugs():
    """List the bug-zoo switches with their preset and public source."""
    from rich.table import Table
    from rich.text import Text

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
    from kvaudit.targets.sglang.config import FAULTS
    f = Table(title="injected faults (--target sglang)")
    f.add_column("fault", no_wrap=True)
    f.add_column("finding")
    f.add_column("what it does", overflow="fold")
    for name, (kind, what) in FAULTS.items():
        f.add_row(name, kind, what)
    console.print(f)


if __name__ == "__main__":
    main()
