"""``kvaudit ci``: the nightly / per-PR job's run, summary and reports; what it checks is
:mod:`kvaudit.search.ci`."""

from __future__ import annotations

import json
import os

import click
from hypothesis.configuration import set_hypothesis_home_dir
from rich.table import Table
from rich.text import Text

from kvaudit import replay
from kvaudit.audit import runner
from kvaudit.app.budget import Budget, duration
from kvaudit.app.errors import (EXIT_CLEAN, EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_NOTHING_SEARCHED, InputError,
                                refused, write_error)
from kvaudit.app.configs import check_available, check_db, presets_arg
from kvaudit.app.files import check_dir, folder_problem, load_suppressions, reports_written, write_reports
from kvaudit.app.fuzz import NOTHING_SEARCHED_SUMMARY, print_replay_file, print_shipped_analysis
from kvaudit.app.interrupts import catch_sigint, ignore_interrupts
from kvaudit.app.progress import Progress, console as make_console
from kvaudit.config import shown_path
from kvaudit.data import data_path
from kvaudit.reports.ci_outputs import not_reached, reached_text
from kvaudit.reports.outputs import Case, Outputs, ReportData
from kvaudit.reports.report import (new_findings_line, print_report, print_suppressions, print_table,
                                    suppressed_by_kind)
from kvaudit.search import ci
from kvaudit.targets import registry


def run(*, budget: Budget, presets_value: str, fuzzer: str, seed: int, regressions_dir: str | None,
        corpus_dir: str | None, out_dir: str, suppress_file: str | None, outputs: Outputs, target: str = "eut",
        db: str | None = None, campaign_name: str = "default", step_timeout: float | None = None,
        out_given: bool = True) -> int:
    """``kvaudit ci``; returns the exit code. ``budget.seconds``: search time in all, split evenly over
    the presets; ``step_timeout``: ``--step-timeout`` (None: the regressions keep the default, the search takes
    ``fuzz``'s for a preset's share); ``out_given``: ``--out`` was given (not its default, which ``--max-time 0``
    never writes in, so need not be writable). Raises :class:`InputError` for a bad option (before any engine is
    imported)."""
    # (a test patches some of them)
    from kvaudit.app.configs import (check_fuzzer, note_campaign_keeps_nothing, require_target,
                                     warn_campaign_without_db)

    check_fuzzer(fuzzer, target)
    if db is not None:  # (only the campaigns use it: --max-time 0 replays the regressions without Redis)
        check_db(db, reach=budget.seconds > 0)
    kind = registry.get(target)  # --target's TargetChoice checked the name
    preset_names = presets_arg("--presets", presets_value, target)
    sset = load_suppressions(suppress_file)
    regressions_dir = _regressions_dir(regressions_dir, kind)
    files = ci.regression_files(regressions_dir) if regressions_dir is not None else []
    if not files and budget.seconds <= 0:  # a wrong path in a CI job went green having checked nothing
        raise InputError(f"--regressions {regressions_dir or '(none for this target)'}: no replay file "
                         "(*.json) in it, and --max-time 0 fuzzes nothing: the job would check nothing")
    per_preset = budget.seconds / len(preset_names) if budget.seconds > 0 else 0.0
    _prepare_dirs(out_dir, corpus_dir, fuzzer, per_preset > 0, out_given)
    console, err = make_console(), make_console(stderr=True)
    result = ci.CiResult(presets=preset_names if per_preset > 0 else [], files=files)
    catch_sigint()
    try:
        # NOTE: loaded before the header and the first preset's budget; interrupted here, the JUnit is still written
        first = kind.preset(preset_names[0]).config()
        require_target(first)
        where = f"{kind.describe(first)}; " if kind.describe is not None else ""  # the engine and its release
        err.print(f"kvaudit ci: {where}"
                  + (f"{len(files)} regression file(s) in {regressions_dir}; " if regressions_dir else
                     "no regression files (none for this target); ")
                  + (f"fuzz {fuzzer} over {len(preset_names)} preset(s), {duration(per_preset)} of search each"
                     if per_preset > 0 else "no fuzz (--max-time 0: the regressions only)")
                  + f"; start-up {duration(budget.startup())} (not counted)", soft_wrap=True)
        warn_campaign_without_db(campaign_name, db, err)
        if per_preset > 0:
            note_campaign_keeps_nothing(fuzzer, target, err)
        for path in files:
            result.replaying = path
            check = ci.check_regression(path)  # a malformed file is a failed check, not the end of the job
            result.regressions.append(check)
            err.print(f"regression {check.name}: " + ("ok" if check.ok else f"FAILED: {check.problem}"),
                      soft_wrap=True)
        if per_preset > 0:
            if step_timeout is None:  # (10 s past a share of less: the share's end cut a stuck step short, no hang)
                runner.set_step_timeout(runner.fuzz_step_timeout(per_preset))
            for preset in preset_names:
                _fuzz_preset(result, err, preset, per_preset, seed, fuzzer, corpus_dir, out_dir, suppress_file,
                             target, db, campaign_name)
                if result.fuzz[-1].not_written is not None:
                    break  # a full disk: the next presets' findings could not be written either
    except KeyboardInterrupt:
        result.interrupted = True
    ignore_interrupts(clear=True)  # the summary and reports are written whole
    for run in result.fuzz:
        for program, findings, path in run.new:
            config = kind.preset(run.preset).config()
            print_replay_file(console, config, path, suppress_file)
            print_shipped_analysis(console, config, findings, path)
            print_report(console, config, program, findings, closing=False)
    _print_table(console, result)
    ran = any(run.executions for run in result.fuzz)
    if sset is not None:  # the presets' campaigns matched; the job's set is the file's
        sset.add_usage(usage for run in result.fuzz for usage in run.suppression_usage)
        print_suppressions(console, sset, not_run=None if ran else _why_nothing_ran(result, per_preset))
    known = _known(result, sset)  # (the SUMMARY line's count, and the --json's list)
    failed = _write_outputs(outputs, result, kind, preset_names[0], sset if ran else None, err, per_preset > 0, known)
    _print_verdict(console, result, sset, known)
    if failed is not None:  # after the job's lines: a report not written does not hide its verdict
        raise failed
    return _exit_code(result, err, per_preset)


def _print_verdict(console, result, sset, known: list[str]) -> None:
    """The job's ``SUMMARY:`` line, over its new findings (the sections above have none of their own) and its
    ``known`` signatures, then its verdict line; a job that searched nothing in some preset (exit 5) says so in
    both, as ``fuzz`` does."""
    unwritten = {sig: path for run in result.fuzz for sig, path in run.unwritten.items()}
    idle = [] if result.failed or result.interrupted else result.nothing_searched
    where = f"in {len(idle)} of {len(result.fuzz)} preset(s) ({', '.join(idle)})"
    runs = [findings for run in result.fuzz for _, findings, _ in run.new]
    console.print(new_findings_line(runs, suppressed_by_kind(sset), result.interrupted, unwritten, len(known))
                  if not idle else
                  NOTHING_SEARCHED_SUMMARY if len(idle) == len(result.fuzz) else
                  f"SUMMARY: kvaudit: nothing searched {where}: its share ended before the first program ran; "
                  "no new findings in the rest.", soft_wrap=True)
    console.print(("FAILED" if result.failed else "INTERRUPTED" if result.interrupted else
                   f"NOTHING SEARCHED {where}" if idle else "passed")
                  + f": {sum(r.ok for r in result.regressions)}/"
                  f"{len(result.regressions)} regressions ok, {len(result.new_findings())} new finding(s)"
                  + (f", {len(unwritten)} found but not written (disk full)" if unwritten else "")
                  + (" (interrupted)" if result.interrupted and result.failed else ""), soft_wrap=True)


def _why_nothing_ran(result, per_preset: float) -> str:
    """Why no fuzz program ran in a job (its suppressions were tried on nothing: the regressions are replayed
    without them)."""
    if per_preset <= 0:
        return "--max-time 0: the regressions only, replayed without suppressions"
    if result.interrupted:
        return "interrupted before the first"
    return "each preset's share ended before one program ran"


def _regressions_dir(regressions_dir: str | None, kind) -> str | None:
    if regressions_dir is None and kind.regressions is not None:
        here = kind.regressions
        regressions_dir = here if os.path.isdir(here) else data_path(*here.split("/"))
    what = folder_problem(regressions_dir) if regressions_dir is not None else None
    if what is not None:  # (the one given: the CLI's callback said so first, before any engine was imported)
        raise InputError(f"--regressions {regressions_dir}: {what}")
    return regressions_dir


def _prepare_dirs(out_dir: str, corpus_dir: str | None, fuzzer: str, fuzz: bool, out_given: bool) -> None:
    """A job that fuzzes: :func:`_prepare_fuzz`. One that does not (``--max-time 0``) makes and writes no directory,
    but refuses an ``--out`` (``out_given``: not its default) or ``--corpus`` that the job with a budget refuses."""
    if fuzz:
        _prepare_fuzz(out_dir, corpus_dir, fuzzer)
        return
    for flag, path in (("out", out_dir if out_given else None), ("corpus", corpus_dir)):
        if path is not None:
            check_dir(path, flag)


def _prepare_fuzz(out_dir: str, corpus_dir: str | None, fuzzer: str) -> None:
    check_dir(out_dir, "out")
    if corpus_dir is not None:
        check_dir(corpus_dir, "corpus")  # (as fuzz does: not after the search, at the run record's write)
        try:
            os.makedirs(corpus_dir, exist_ok=True)
        except OSError as e:
            raise InputError(f"--corpus {corpus_dir}: {e.strerror or e}") from None
    check_available(fuzzer)
    set_hypothesis_home_dir(os.path.abspath(os.path.join(corpus_dir or out_dir, ".hypothesis")))


def _fuzz_preset(result, err, preset, per_preset, seed, fuzzer, corpus_dir, out_dir, suppress_file, target, db,
                 campaign_name) -> None:
    """One preset's share, appended to ``result``; raises KeyboardInterrupt once it was interrupted."""
    if corpus_dir is not None:  # (its known signatures: those of its own kind's replay files)
        from kvaudit.search.campaign import skipped_lines

        for line in skipped_lines(os.path.join(corpus_dir, preset), target)[1]:
            err.print(f"warning: {line}", soft_wrap=True)
    with Progress(err, per_preset) as progress:
        run = ci.fuzz_preset(preset, per_preset, seed, fuzzer, corpus_dir, out_dir, suppress_file,
                             on_progress=progress.update, target=target, db=db, campaign=campaign_name,
                             taken=frozenset(path for r in result.fuzz for _, _, path in r.new))
    result.fuzz.append(run)
    zero = not_reached(run.reached)  # paths no program took: the clean line says they were not searched
    err.print(f"fuzz {preset}: {run.executions} executions, "
              + (f"{len(run.new_signatures())} NEW finding(s)" if run.new else
                 f"{len(run.unwritten)} NEW finding(s) not written (disk full)" if run.unwritten else "nothing searched"
                 if run.nothing_searched else "interrupted before its share ended" if run.interrupted else "clean")
              + (f", {len(run.known)} known" if run.known else "")
              + ("; reached: " + reached_text(run.reached) if run.reached else "")
              + (f"; not reached: {', '.join(zero)} (not searched)" if zero and run.executions else ""),
              soft_wrap=True, markup=False)  # (a path's name is any string: `evict[lru]` is no style)
    if run.interrupted:
        raise KeyboardInterrupt


def _print_table(console, result) -> None:
    """The job's table: a row per regression file and per preset fuzzed, and one per file of ``result.files`` and
    per preset of ``result.presets`` with no result (an interrupt, a full disk), saying why."""
    t = Table(title="kvaudit ci", title_justify="left")
    t.add_column("check", overflow="fold")
    t.add_column("result", overflow="fold")
    why = result.not_run
    for r in result.regressions:
        t.add_row(f"regression {r.name}", Text("ok", style="green") if r.ok else Text(r.problem, style="bold red"))
    for path in result.not_replayed:
        t.add_row(f"regression {os.path.splitext(os.path.basename(path))[0]}",
                  Text(result.not_replayed_why(path), style="yellow"))
    for run in result.fuzz:
        cut = " (interrupted)" if run.interrupted else ""
        t.add_row(f"fuzz {run.preset} ({run.seconds:.1f}s, {run.executions} executions){cut}",
                  Text(", ".join(f"NEW {sig} -> {path}" + (" (not written: disk full)" if sig in run.unwritten else "")
                                 for sig, (_, path) in run.new_signatures().items()), style="bold red")
                  if run.new else Text(", ".join(f"NEW {sig} (not written: disk full)" for sig in sorted(run.unwritten)),
                                       style="bold red")
                  if run.unwritten else Text("interrupted before its share ended: no new findings so far", style="yellow")
                  if run.interrupted else Text(f"no new findings; {len({f.signature for f in run.known_open})} known "
                                               "still open", style="yellow")
                  if run.known_open else Text("clean", style="green") if not run.nothing_searched
                  else Text("nothing searched (its share ended before one program ran): raise --max-time",
                            style="bold yellow"))
    for preset in result.not_started:
        t.add_row(f"fuzz {preset}", Text(why, style="yellow"))
    print_table(console, t)


def _known(result, sset) -> list[str]:
    """The job's known signatures, sorted: as a campaign's, the distinct ones no preset reported as new; one a rule
    suppressed when its file was replayed is counted as suppressed, as the preset's row says clean, not known still
    open."""
    new = {f.signature for run in result.fuzz for _, findings, _ in run.new for f in findings}
    known = {sig for run in result.fuzz for sig in run.known} - new
    unwritten = {sig for run in result.fuzz for sig in run.unwritten}
    return sorted(known - unwritten - (sset.suppressed_signatures() if sset is not None else set()))


def _write_outputs(outputs: Outputs, result, kind, first_preset: str, sset, err, fuzzed: bool, known: list[str]):
    """JUnit and SARIF (every open finding, new and known), then HTML and JSON (the new ones): each it can;
    ``fuzzed``: the job searched (not --max-time 0), so they give its executions, the presets' sum, as ``fuzz``'s;
    ``known``: the job's known signatures (:func:`_known`), the JSON's.
    Returns the error for the first not written, a fuzz campaign's on a full disk first (naming every file
    kept and every other not written), or None."""
    kept = [path for run in result.fuzz for _, _, path in run.new if path not in run.unwritten.values()]
    base = kind.preset(first_preset).config()
    ran = tuple(kind.preset(run.preset).config() for run in result.fuzz)  # (the SARIF's and HTML's header name them)
    texts = {"junit": lambda: ci.junit(result),
             "sarif": lambda: json.dumps(ci.sarif(result, base, ran), indent=2) + "\n"}
    full = next((run.not_written for run in result.fuzz if run.not_written is not None), None)
    failed = [] if full is None else [(full, full.filename or "a file of the fuzz")]  # (after the reports below)
    also: list[str] = []  # (the HTML's and JSON's not written: named after the first)
    written: list[str] = []  # (JUnit, SARIF: named first on write_reports' one line)
    for fmt, path in (("junit", outputs.junit), ("sarif", outputs.sarif)):
        if path:
            try:
                replay.write_text_atomic(path, texts[fmt]())
            except OSError as e:
                failed.append((e, path))
                continue
            written.append(path)
    kept += written
    rest = Outputs(html=outputs.html, json=outputs.json)
    if not rest.wanted():
        reports_written(err, written)
    else:
        cases = [Case(p, f, _timeline(path), doc_extra={"preset": run.preset},
                      config=kind.preset(run.preset).config()) for run in result.fuzz for p, f, path in run.new]
        try:
            lost = {sig: path for run in result.fuzz for sig, path in sorted(run.unwritten.items())}
            idle = result.nothing_searched
            bad = [f"{r.name} ({r.problem})" for r in result.regressions if not r.ok]
            extra = {"job": "kvaudit ci", **({"not_written": lost} if lost else {}),  # (as a campaign's --json)
                     # (the HTML's verdict: a job failed by its regressions alone is not clean)
                     **({"regressions_failed": f"{len(bad)} of {len(result.regressions)} regression file(s): "
                                               + "; ".join(bad)} if bad else {}),
                     **({"interrupted": True} if result.interrupted else {}),  # (the HTML's verdict says so)
                     **({"executions": sum(run.executions for run in result.fuzz)} if fuzzed else {}),
                     **({"nothing_searched": idle} if idle else {}),  # (exit 5: the presets that ran no program)
                     **({"known": known} if known else {}),  # (its SUMMARY line's count)
                     **({"reached": reached} if (reached := ci.reached_by_preset(result)) else {})}
            kept += write_reports(rest, ReportData(base, cases or [Case([], [])], suppressed_by_kind(sset),
                                                   extra, suppressions=sset, ran=ran), err,
                                  kept=tuple(kept), before=tuple(written))
        except click.ClickException as e:
            if not failed:
                return e
            kept += [p for p in getattr(e, "kept", ()) if p not in kept]
            also = list(refused(e))
    return None if not failed else write_error(*failed[0], kept, also=[p for _, p in failed[1:]] + also)


def _exit_code(result, err, per_preset: float) -> int:
    if result.failed:
        return EXIT_FINDINGS
    if result.interrupted:
        return EXIT_INTERRUPTED
    idle = result.nothing_searched
    if idle:
        err.print(f"kvaudit: nothing searched in {len(idle)} of {len(result.fuzz)} preset(s) ({', '.join(idle)}): "
                  f"each share ({duration(per_preset)}) ended before one program ran; raise --max-time",
                  soft_wrap=True, markup=False, highlight=False)
        return EXIT_NOTHING_SEARCHED
    return EXIT_CLEAN


def _timeline(path: str) -> dict | None:
    try:
        return replay.load(path)[3].get("timeline")
    except replay.ReplayFormatError:
        return None
