"""``kvaudit fuzz``: a search that stops at its first finding, or a campaign over a corpus directory
(:mod:`kvaudit.search.campaign`). Design notes: docs/internals/app.md."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import click
from hypothesis.configuration import set_hypothesis_home_dir
from rich.table import Table
from rich.text import Text

from kvaudit import replay
from kvaudit.app.budget import Budget, duration
from kvaudit.app.configs import (check_available, check_db, check_fuzzer, note_campaign_keeps_nothing,
                                 warn_campaign_without_db, warn_unreachable_bugs)
from kvaudit.app.errors import (EXIT_CLEAN, EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_NOTHING_SEARCHED, DiskFull,
                                InputError, refused, write_error)
from kvaudit.app.files import check_dir, load_suppressions, replay_hint, shell_quoted, write_finding, write_reports
from kvaudit.app.interrupts import catch_sigint, ignore_interrupts
from kvaudit.app.progress import Progress, console as make_console
from kvaudit.app.replay import record_timeline
from kvaudit.audit import runner
from kvaudit.audit.suppress import SuppressionSet
from kvaudit.config import shown_path
from kvaudit.history.notes import note_for
from kvaudit.constants import CONFIRM_RUNS, default_fuzzer
from kvaudit.reports.ci_outputs import not_reached, reached_text
from kvaudit.reports.outputs import Case, Outputs, ReportData, disk_full
from kvaudit.reports.report import (NOTHING_SEARCHED_SUMMARY, new_findings_line, print_report, print_suppressions,
                                    print_table, summary_line, suppressed_by_kind)
from kvaudit.search import campaign, fuzzers
# NOTE: names of the search read through their modules when called (tests patch them)
from kvaudit.search import fuzz as search_fuzz
from kvaudit.search.hub import safe_url
from kvaudit.targets import registry


@dataclass(frozen=True)
class Checked:
    sset: SuppressionSet | None
    target_dir: str
    campaign: bool
    fuzzer: str  # --fuzzer, or its default for this kind of run (kvaudit.constants.default_fuzzer)


def check_options(*, target: str, fuzzer: str | None, out_dir: str, corpus_dir: str | None, workers: int,
                  db: str | None, suppress_file: str | None) -> Checked:
    """The checks of ``fuzz``'s options that need no engine (run before one is imported). Raises
    :class:`InputError` (exit 2), :class:`UnavailableError` (atheris or Redis missing, exit 69). ``fuzzer``
    None: the default for a campaign or a single search (:func:`kvaudit.constants.default_fuzzer`)."""
    campaign = corpus_dir is not None or workers > 1 or db is not None
    fuzzer = fuzzer or default_fuzzer(campaign)
    check_fuzzer(fuzzer, target)
    sset = load_suppressions(suppress_file)
    if campaign and not fuzzers.get(fuzzer).campaign:
        raise InputError(f"--fuzzer {fuzzer} cannot run a campaign (--corpus, --workers > 1, --db)")
    if db is not None:
        check_db(db)
    target_dir = corpus_dir if corpus_dir is not None else out_dir
    check_dir(target_dir, "corpus" if corpus_dir is not None else "out")
    check_available(fuzzer)
    return Checked(sset, target_dir, campaign, fuzzer)


def run(config, checked: Checked, *, fuzzer: str, budget: Budget, seed: int, out_dir: str,
        workers: int, corpus_dir: str | None, use_seeds: bool, suppress_file: str | None,
        step_timeout: float | None, outputs: Outputs, db: str | None = None, campaign_name: str = "default",
        seeds_given: bool = False) -> int:
    """``kvaudit fuzz`` on ``config``; returns the exit code. ``budget.seconds`` counts from when the
    first engine is built. ``seeds_given``: ``--seeds`` or ``--no-seeds`` was on the command line (either one,
    with a fuzzer that takes no seed corpus, is a warning; ``use_seeds`` False alone is too)."""
    sset, max_time = checked.sset, budget.seconds
    if step_timeout is None:  # a hang found near the end costs one more limit in triage: keep it a fraction
        runner.set_step_timeout(runner.fuzz_step_timeout(max_time))
    set_hypothesis_home_dir(os.path.join(checked.target_dir, ".hypothesis"))  # not the user's cwd
    console, err = make_console(), make_console(stderr=True)
    _announce(config, checked, err, fuzzer=fuzzer, max_time=max_time, seed=seed, out_dir=out_dir, workers=workers,
              use_seeds=use_seeds, suppress_file=suppress_file, db=db, campaign_name=campaign_name,
              seeds_given=seeds_given)
    catch_sigint()
    runner.warm_up(config)  # the first engine is start-up too: the search's clock starts after it
    fuzzers.get(fuzzer).warm_up()  # and the fuzzer's own first-run set-up (Hypothesis's)
    fuzzers.settle_heap()  # (the per-program targets' cycles are collected every few hundred programs)
    err.print(f"start-up {duration(budget.startup())} (imports, the first engine; not counted): searching for "
              f"{duration(max_time)}" + (" per worker, each from its own start-up" if checked.campaign and workers > 1
                                         else ""), soft_wrap=True)
    if checked.campaign:
        return _campaign(config, fuzzer, max_time, seed, workers, checked.target_dir, suppress_file, sset, outputs,
                         console, err, use_seeds, db=db, campaign_name=campaign_name)
    single = _Single(config, fuzzer, seed, out_dir, use_seeds, suppress_file, sset, console, err)
    try:
        single.search(budget)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        code = single.interrupted(e, outputs)
        if code is not None:
            return code
    if single.crash is None:
        return single.clean(outputs, max_time)
    return single.report(outputs)


def _announce(config, checked: Checked, err, *, fuzzer, max_time, seed, out_dir, workers, use_seeds, seeds_given,
              suppress_file, db, campaign_name) -> None:
    sset, kind = checked.sset, registry.kind_of(config)
    where = kind.describe(config) + ", " if kind.describe is not None else ""
    if checked.campaign:
        dest = f"campaign in {shown_path(checked.target_dir)}, {workers} worker(s)" + (
            f", shared as {campaign_name} through {safe_url(db)}" if db else "")
    else:
        dest = f"out {shown_path(out_dir)}"
    err.print(f"kvaudit fuzz: {where}{fuzzer}, preset {config.preset}, bugs: {', '.join(sorted(config.bugs)) or 'none'}, "
              f"seed {seed}, search budget {duration(max_time)}, step timeout {runner.step_timeout():.3g}s, {dest}"
              + (f", suppressions {shown_path(suppress_file)} ({len(sset)} rule(s))" if sset is not None else ""),
              soft_wrap=True, markup=False)
    warn_unreachable_bugs(config, err)
    warn_campaign_without_db(campaign_name, db, err)
    if checked.campaign:
        note_campaign_keeps_nothing(fuzzer, kind.name, err)
    if (seeds_given or not use_seeds) and not fuzzers.get(fuzzer).uses_seeds:  # (--seeds said nothing)
        seeded = " or ".join(f"--fuzzer {n}" for n, k in fuzzers.kinds().items() if k.uses_seeds)
        err.print(f"warning: {'--seeds' if use_seeds else '--no-seeds'} applies to {seeded} (its seed corpus); with --fuzzer {fuzzer} it is "
                  "ignored", soft_wrap=True, markup=False)
    for note in kind.notes(config):
        err.print(f"note: {note}", soft_wrap=True)


class _Single:
    """``kvaudit fuzz`` without a campaign: rounds of search until a finding survives triage (a flaky
    one is passed over); what a round found stays here, so that an interrupt can still write it."""

    def __init__(self, config, fuzzer, seed, out_dir, use_seeds, suppress_file, sset, console, err):
        self.config, self.fuzzer, self.seed, self.out_dir, self.use_seeds = config, fuzzer, seed, out_dir, use_seeds
        self.suppress_file, self.sset, self.console, self.err = suppress_file, sset, console, err
        self.found = self.crash = None
        self.flaky: list[str] = []  # signatures that did not replay: the search goes on past them, as past known ones
        self.kept: dict = {}  # what the fuzzer keeps across rounds (the corpus fuzzer's Corpus)
        self.stats = search_fuzz.FuzzStats()

    def search(self, budget: Budget) -> None:
        sset = self.sset
        self.stats = stats = search_fuzz.FuzzStats()  # the search's clock starts now
        deadline = budget.deadline()
        with Progress(self.err, budget.seconds) as progress:
            progress.update(stats)

            def phase(name: str) -> None:  # a line per phase off a terminal: confirming, minimizing, ...
                stats.phase = name
                progress.update(stats, force=True)

            while not self.flaky or time.monotonic() < deadline:  # past a flaky finding: while budget is left
                self.found = fuzzers.get(self.fuzzer).search(
                    self.config, max(0.0, deadline - time.monotonic()),
                    search_fuzz.retry_seed(self.seed, len(self.flaky)), stats,
                    fuzzers.Search(on_progress=progress.update, suppressions=sset, suppressions_path=self.suppress_file,
                                   known=frozenset(self.flaky), out_dir=self.out_dir, use_seeds=self.use_seeds,
                                   kept=self.kept))
                if self.found is None:
                    break
                stats.findings = 1
                first = next(f for f in self.found[1] if f.signature not in self.flaky)
                self.crash = search_fuzz.triage(self.config, self.found[0], first,
                                    suppressions=sset.fresh() if sset is not None else None, on_phase=phase)
                if self.crash is not None:
                    break
                runs = 1 if runner.is_watchdog_hang(first) else CONFIRM_RUNS
                self.err.print(f"a finding ({first.signature}) did not replay {runs} of {runs} times: not reported "
                               f"(flaky); the search goes on past it", soft_wrap=True)
                self.flaky.append(first.signature)
                self.found, stats.findings, stats.first_hit = None, 0, None
                stats.phase = "fuzzing"
            phase("done")

    def interrupted(self, e: KeyboardInterrupt, outputs: Outputs) -> int | None:
        """The reports of what was found so far; None when the finding was complete (reported as usual)."""
        config, sset, stats, err = self.config, self.sset, self.stats, self.err
        ignore_interrupts(clear=True)  # the timeline below replays the program
        # met, not yet returned: Hypothesis was shrinking it
        if self.found is None and isinstance(e, search_fuzz.SearchInterrupted):
            self.found, stats.findings = e.found, 1
        if self.found is None:
            err.print(f"interrupted after {stats.elapsed:.1f}s: {stats.executions} executions, no finding")
            print_reached(self.console, stats)
            self.console.print(summary_line([], suppressed_by_kind(sset), interrupted=True), soft_wrap=True)
            write_reports(outputs, _run_data(config, [], [], sset, stats, self.seed, self.fuzzer, interrupted=True), err)
            return EXIT_INTERRUPTED
        if self.crash is not None:
            return None
        program = self.found[0]
        findings = sorted(self.found[1], key=lambda f: f.signature in self.flaky)  # a new one first
        title = "program (unminimized)"
        print_report(self.console, config, program, findings, suppressions=sset, program_title=title)
        # triage confirms the found program K of K before it minimizes: past "confirming", it was confirmed
        confirmed = stats.phase not in ("fuzzing", "confirming") and not isinstance(e, search_fuzz.SearchInterrupted)
        path = write_finding(self.out_dir, config, program, findings, seed=self.seed, fuzzer=self.fuzzer,
                             minimized=False,
                             confirmations=f"{CONFIRM_RUNS}/{CONFIRM_RUNS}" if confirmed
                             else "interrupted before confirmation")
        during = ("Hypothesis shrank it" if isinstance(e, search_fuzz.SearchInterrupted) else
                  "confirming it" if not confirmed else "minimizing")
        err.print(f"interrupted while {during}; the unminimized program is in {shown_path(path)}", soft_wrap=True)
        data = _run_data(config, program, findings, sset, stats, self.seed, self.fuzzer, interrupted=True,
                         program_title=title)
        if outputs.html or outputs.json:  # no confirming replay recorded its timeline
            data.cases[0].timeline = record_timeline(config, program, sset, err)
        write_reports(outputs, data, err, kept=(path,))
        return EXIT_FINDINGS

    def clean(self, outputs: Outputs, max_time: float) -> int:
        stats, sset, console, flaky = self.stats, self.sset, self.console, self.flaky
        data = lambda: _run_data(self.config, [], [], sset, stats, self.seed, self.fuzzer)  # noqa: E731
        write = lambda: write_reports(outputs, data(), self.err)  # noqa: E731
        if stats.executions == 0:
            if sset is not None:
                print_suppressions(console, sset, not_run="the budget ended before the first")
            console.print(NOTHING_SEARCHED_SUMMARY, soft_wrap=True)
            write()
            return nothing_searched(self.err, max_time)
        if sset is not None:
            print_suppressions(console, sset)
        console.print(f"no findings: {stats.executions} executions, {stats.ops} ops in {stats.elapsed:.1f}s "
                      f"({stats.executions / max(stats.elapsed, 1e-9):.1f} exec/s)"
                      + (f"; {len(flaky)} flaky finding(s) not reported: {', '.join(flaky)}" if flaky else ""),
                      soft_wrap=True)
        print_reached(console, stats)
        console.print(summary_line([], suppressed_by_kind(sset)), soft_wrap=True)
        write()
        return EXIT_CLEAN

    def report(self, outputs: Outputs) -> int:
        """The triaged finding; its report comes last: its SUMMARY: line ends stdout, as LeakSanitizer's."""
        config, crash, stats, console, sset = self.config, self.crash, self.stats, self.console, self.sset
        ignore_interrupts()  # the finding is complete: write and report it whole
        minimized = crash.runs == CONFIRM_RUNS  # a watchdog hang is confirmed once and not minimized
        title = "minimized program" if minimized else "program (not minimized)"
        data = _run_data(config, crash.program, crash.findings, sset, stats, self.seed, self.fuzzer,
                         program_title=title)
        data.cases[0].timeline = crash.timeline  # triage's confirming replay recorded it
        confirmations = f"{crash.confirmations}/{crash.runs}"
        data.extra.update(confirmations=confirmations, minimized=minimized)
        hit_execs, hit_s = stats.first_hit or (stats.executions, stats.elapsed)

        def executions(n: int) -> str:
            return f"{n} execution" + ("" if n == 1 else "s")

        console.print(f"found after {executions(hit_execs)} in {hit_s:.1f}s (search: {executions(stats.executions)}"
                      + (f", then {stats.shrink_executions} shrinking" if stats.shrink_executions else "")
                      + f", {stats.elapsed:.1f}s in all); "
                      + (f"minimized {crash.original_length} -> {len(crash.program)} ops" if minimized else
                         f"{len(crash.program)} ops, not minimized (each replay of a hang costs the step timeout)")
                      + f"; reproduced {confirmations}", soft_wrap=True)
        try:
            path = write_finding(self.out_dir, config, crash.program, crash.findings, seed=self.seed,
                                 fuzzer=self.fuzzer, confirmations=confirmations, minimized=minimized,
                                 timeline=data.cases[0].timeline)
        except click.ClickException as e:  # a full disk (write_error): the finding still reaches the log
            print_report(console, config, crash.program, crash.findings, suppressions=sset, program_title=title)
            raise _with_reports(e, outputs, data, self.err) from None
        print_replay_file(console, config, path, self.suppress_file)
        print_shipped_analysis(console, config, crash.findings, path)
        print_report(console, config, crash.program, crash.findings, suppressions=sset, program_title=title)
        write_reports(outputs, data, self.err, kept=(path,))
        return EXIT_FINDINGS


def print_replay_file(console, config, path: str, suppress_file: str | None) -> None:
    """The ``replay file:`` line of a finding's new replay file ``path``, with the command that replays it under
    the run's suppressions (a single run's finding, each new file of a campaign)."""
    console.print(f"replay file: {shown_path(path)}   ({replay_hint(config, path, suppress_file)})", soft_wrap=True)


def shipped_analysis(config, findings, path: str) -> str:
    """One line when kvaudit ships an analysis of one of ``findings``' signatures for ``config``'s target kind
    (``corpora/<kind>/notes.toml``, keyed ``signature|preset`` or ``signature``: a finding kvaudit already
    reported in that engine), naming it, its section of ``corpora/<kind>/README.md`` and how to see the whole
    text (the replay file ``path``'s export); "" when none is (a new finding, or a kind with no notes)."""
    kind = replay.target_name(config)
    for f in findings:
        note = note_for(kind, [f.signature], config.preset)
        if note is not None:
            where = f"corpora/{kind}/README.md" + (f", finding {note.readme}" if note.readme else "")
            return (f"known: kvaudit ships an analysis of {f.signature} ({where}): {note.title}; "
                    f"kvaudit export --issue ISSUE.md {shell_quoted(path)} writes it as an issue text")
    return ""


def print_shipped_analysis(console, config, findings, path: str) -> None:
    """The :func:`shipped_analysis` line of a finding's replay file ``path``, where it has one (a single run's
    finding, each new file of a campaign)."""
    known = shipped_analysis(config, findings, path)
    if known:
        console.print(known, soft_wrap=True, markup=False, highlight=False)


def _with_reports(e: click.ClickException, outputs: Outputs, data, err) -> click.ClickException:
    """``e`` (the replay file not written) once the reports asked for are written where they can be (on another
    disk, say), naming those among the files kept and the ones a full disk refused too."""
    unwritten: tuple[str, ...] = ()
    try:
        written = write_reports(outputs, data, err)
    except click.ClickException as later:
        written = list(getattr(later, "kept", ()))
        unwritten = refused(later)
    return e.keeping(written, also=unwritten) if isinstance(e, DiskFull) else e


def nothing_searched(err, max_time: float) -> int:
    """The budget ended before the first program ran: nothing was checked, so not clean (exit 5)."""
    err.print(f"kvaudit: nothing searched: the {duration(max_time)} search budget ended before the first program "
              "ran; raise --max-time", soft_wrap=True, markup=False, highlight=False)
    return EXIT_NOTHING_SEARCHED


def _campaign(config, fuzzer, max_time, seed, workers, corpus, suppress_file, sset, outputs, console, err,
              use_seeds: bool = True, db: str | None = None, campaign_name: str = "default") -> int:
    progress = Progress(err, max_time)
    before, skipped = campaign.skipped_lines(corpus, replay.target_name(config))
    for line in skipped:
        err.print(f"warning: {line}", soft_wrap=True)
    if before:
        err.print(f"resuming: {len(before)} signature(s) recorded in {len(set(before.values()))} file(s) in "
                  f"{shown_path(campaign.findings_dir(corpus))} are known, not new", soft_wrap=True)

    def landed(sig: str, path: str) -> None:
        (progress.live.console if progress.live else err).print(f"new finding: {sig} -> {shown_path(path)}",
                                                                 soft_wrap=True)

    catch_sigint()
    try:
        with progress:
            progress.update(search_fuzz.FuzzStats())
            result = campaign.run_campaign(config, fuzzer, max_time, seed, workers, corpus, suppress_file,
                                  on_progress=progress.update, on_finding=landed, use_seeds=use_seeds, db=db,
                                  campaign=campaign_name)
            progress.update(result.stats, force=True)
    except OSError as e:
        if not disk_full(e):
            raise
        raise write_error(e, e.filename or f"in {corpus}",
                          [f"the finding files in {campaign.findings_dir(corpus)}"]) from None
    finally:
        ignore_interrupts(clear=True)  # the summary and reports are written whole
    cases, paths = _campaign_cases(result, config, console, err, suppress_file)
    known = {**result.fleet, **result.known}  # signature -> the file that knows it (another host's, the corpus's)
    known_open = _still_open(result, known, suppress_file, sset) if outputs.sarif else None
    for w in result.warnings:
        err.print(f"warning: {w}", soft_wrap=True)
    if result.new or result.known or result.flaky or result.fleet or result.unwritten:
        print_table(console, _campaign_table(result))
    if sset is not None:
        sset.add_usage(result.suppression_usage.values())  # (the workers matched; the parent's set is the file's)
        print_suppressions(console, sset, not_run=None if result.stats.executions else
                           "interrupted before the first" if result.interrupted else "the budget ended before the first")
    s = result.stats
    console.print(f"{'interrupted' if result.interrupted else 'campaign done'}: {s.executions} executions, {s.ops} ops "
                  f"in {s.elapsed:.1f}s ({s.executions / max(s.elapsed, 1e-9):.1f} exec/s, {result.workers} worker(s)); "
                  f"{len(result.new)} new, {len(result.known)} known signature(s)"
                  + (f", {len(result.fleet)} found by another host" if result.fleet else "") + f"; corpus {shown_path(corpus)}",
                  soft_wrap=True)
    print_reached(console, s)
    line = _campaign_summary(result, cases, paths, sset)
    nothing = s.executions == 0 and not result.interrupted and not result.new
    console.print(NOTHING_SEARCHED_SUMMARY if nothing else line, soft_wrap=True)
    extra = {"fuzzer": fuzzer, "seed": seed, "workers": workers, "executions": s.executions, "ops": s.ops,
             "seconds": round(s.elapsed, 1), "corpus": corpus}
    if result.interrupted:
        extra["interrupted"] = True
    if s.reached:  # (the report files say it beside a clean run, as the console does)
        extra["reached"] = dict(sorted(s.reached.items()))
    for key, sigs in (("found_by_another_host", result.fleet), ("not_written", result.unwritten)):
        if sigs:  # signature -> its file here (pulled from the fleet), or the file it would have had (disk full)
            extra[key] = dict(sorted(sigs.items()))
    if result.known:  # (the SUMMARY line's "N known signature(s) not reported again", which kvaudit report says)
        extra["known"] = sorted(result.known)
    kept, also = tuple(sorted(set(result.new.values()))), list(result.also_not_written)
    try:
        kept += tuple(write_reports(outputs, ReportData(config, cases or [Case([], [])], suppressed_by_kind(sset),
                                                        extra, suppressions=sset if s.executions else None,
                                                        known_open=known_open, known=frozenset(known)),
                                    err, kept=kept))
    except click.ClickException as e:
        if result.not_written is None:
            raise
        kept = getattr(e, "kept", kept)
        also += refused(e)
    if result.not_written is not None:  # (after the run's lines and reports: a corpus disk full loses none)
        raise write_error(result.not_written, result.not_written.filename or f"in {corpus}", kept, also=also)
    if result.new:
        return EXIT_FINDINGS
    if nothing:
        return nothing_searched(err, max_time)
    return EXIT_INTERRUPTED if result.interrupted else EXIT_CLEAN


def _still_open(result, known: dict[str, str], suppress_file, sset) -> list:
    """For a campaign's SARIF, as ``kvaudit ci``'s: the findings of ``known`` (signature -> its file) whose file
    still reproduces them, replayed once each (none when interrupted: no time for replays); a rule of ``sset``
    that left one out is in use."""
    from kvaudit.search.ci import still_open

    if result.interrupted:
        return []
    usage: list = []
    still = still_open(known, suppress_file, usage)
    if sset is not None:
        sset.add_usage(usage)
    return still


def _campaign_summary(result, cases: list[Case], paths: list[str], sset) -> str:
    """The campaign's ``SUMMARY:`` line: over its new findings, with its known ones and those found but not
    written (a full disk) counted."""
    # NOTE: a file counts only the new signatures it reports (it can hold known ones the same program raised)
    runs = [[f for f in c.findings if result.new.get(f.signature) == path] for c, path in zip(cases, paths)]
    return new_findings_line(runs, suppressed_by_kind(sset), result.interrupted, result.unwritten, len(result.known))


def _campaign_cases(result, config, console, err, suppress_file=None) -> tuple[list[Case], list[str]]:
    """Each new finding's replay file reported (a program with several new signatures once), as cases and paths,
    after its ``replay file:`` line."""
    cases, paths = [], []
    for path in dict.fromkeys(path for _, path in sorted(result.new.items())):
        try:
            _, program, findings, doc = replay.load(path)
        except replay.ReplayFormatError as e:
            err.print(f"warning: {e}", soft_wrap=True)
            continue
        paths.append(path)
        print_replay_file(console, config, path, suppress_file)
        # (of the findings it reports new, as ci: the file can hold known signatures its program raised too)
        print_shipped_analysis(console, config, [f for f in findings if result.new.get(f.signature) == path], path)
        print_report(console, config, program, findings, closing=False)  # the campaign's line closes the run
        cases.append(Case(program, findings, doc.get("timeline"),
                          doc_extra={k: doc[k] for k in ("seed", "fuzzer", "confirmations") if k in doc}))
    return cases, paths


def _campaign_table(result):
    t = Table(title="campaign", title_justify="left")
    t.add_column("signature", overflow="fold")
    t.add_column("status", no_wrap=True)
    t.add_column("replay file", overflow="fold")
    for paths, status, style in ((result.new, "new", "bold red"), (result.known, "known", "dim"),
                                 (result.fleet, "found by another host", "dim"),
                                 (result.unwritten, "not written (disk full)", "bold red"),
                                 (dict.fromkeys(result.flaky, "-"), "flaky (not reproduced 3/3)", "yellow")):
        for sig, path in sorted(paths.items()):
            t.add_row(sig, Text(status, style=style), Text(shown_path(path)))
    return t


def _run_data(config, program, findings, sset, stats: search_fuzz.FuzzStats, seed: int, fuzzer: str,
              interrupted: bool = False, program_title: str = "minimized program") -> ReportData:
    extra = {"fuzzer": fuzzer, "seed": seed, "executions": stats.executions, "ops": stats.ops,
             "seconds": round(stats.elapsed, 1)}
    if stats.shrink_executions:
        extra["shrink_executions"] = stats.shrink_executions
    if stats.first_hit is not None:
        extra["first_hit_executions"], extra["first_hit_seconds"] = stats.first_hit[0], round(stats.first_hit[1], 1)
    if interrupted:
        extra["interrupted"] = True
    if stats.reached:  # (the report files say it beside a clean run, as the console does)
        extra["reached"] = dict(sorted(stats.reached.items()))
    return ReportData.single(config, program, findings, suppressed_by_kind(sset), extra, program_title=program_title,
                             suppressions=sset if stats.executions else None)  # (tried on nothing: no table)


def print_reached(console, stats) -> None:
    """``reached: name=count, ...``: what the programs reached (``Target.reach()`` summed), where the target
    counts paths; then, where some are at 0, ``not reached: name, ...``: paths no program took (not searched)."""
    if stats.reached:
        console.print("reached: " + reached_text(stats.reached), soft_wrap=True, markup=False)  # (names: any string)
        zero = not_reached(stats.reached)
        if zero and stats.executions:
            console.print(f"not reached: {', '.join(zero)} (no program of the {stats.executions} took these paths: "
                          "not searched)", soft_wrap=True, markup=False)
