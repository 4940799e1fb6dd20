"""``kvaudit report``: render the findings a replay or report JSON file records. Runs no engine: the
occupancy plot is the timeline the file records."""

from __future__ import annotations

import click

from kvaudit import replay
from kvaudit.app.errors import EXIT_CLEAN, InputError, unreadable
from kvaudit.app.files import check_outputs, write_reports
from kvaudit.app.progress import console as make_console
from kvaudit.reports.outputs import Case, Outputs, ReportData, not_all_checked, reach_notes
from kvaudit.reports.report import NOTHING_SEARCHED_SUMMARY, new_findings_line, print_cases
from kvaudit.reports.timeline import is_valid as timeline_is_valid


def run(file: str, outputs: Outputs) -> int:
    """``kvaudit report FILE``; returns 0. Raises :class:`InputError` for a bad file, and for a file it cannot
    render, no report written, what :func:`~kvaudit.app.errors.unreadable` says (a plugin not loaded: exit 69;
    the ``--json`` of a run interrupted during start-up: 5)."""
    check_outputs((file,), **vars(outputs))
    try:
        config, loaded, doc = replay.load_cases(file)
    except replay.ReplayFormatError as e:
        raise unreadable(e) from None
    suppressed = doc.get("suppressed") or {}
    if not isinstance(suppressed, dict) or not all(isinstance(v, int) and v >= 0 for v in suppressed.values()):
        raise InputError(f'{file}: bad "suppressed": want an object of kind -> count')
    for key, (fits, want) in _FACTS.items():  # the run facts the report files are made of (a --json's)
        if key in doc and not fits(doc[key]):
            raise InputError(f'{file}: bad "{key}": want {want}')
    console = make_console()
    cases = []
    for line in dict.fromkeys(replay.other_release(file, c, d) for c, _, _, d in loaded):
        if line is not None:
            click.echo(f"warning: {line}", err=True)
    for i, (case_config, program, findings, case_doc) in enumerate(loaded):
        timeline = case_doc.get("timeline")
        if timeline is not None and not timeline_is_valid(timeline):
            raise InputError(f"{file}: bad timeline{f' in case {i}' if len(loaded) > 1 else ''}: "
                             "want steps, ops and pools whose series are lists of counts as long as steps")
        title = "minimized program" if case_doc.get("minimized") else "program"
        cases.append(Case(program, findings, timeline, title,
                          doc_extra={k: v for k, v in case_doc.items() if k in ("seed", "fuzzer", "confirmations",
                                                                                "minimized", "preset")}
                          | {"engine_version": case_doc.get("engine_version")},  # (None: the file names none)
                          config=case_config))
    extra = {k: v for k, v in doc.items() if k not in ("format", "config", "program", "findings", "timeline",
                                                           "suppressed", "cases")}
    data = ReportData(config, cases, suppressed, extra)
    # the recorded suppressed counts in the summary table and the SUMMARY line, as the run printed them
    short = not_all_checked(data)  # a run cut short, or that searched nothing: its closing line says so, as its files
    interrupted, idle = (short is not None and short[0] == name for name in ("interrupted", "nothing searched"))
    known = doc.get("known")  # a campaign's or ci's: it closes as the run did, its known signatures counted
    clean = not any(c.findings for c in cases)  # (the JUnit's clean or skipped case carries the same lines)
    print_cases(console, config, [(c.program, c.findings, c.program_title) for c in cases], suppressed=suppressed,
                recorded=data.recorded, interrupted=interrupted, closing=not idle and known is None,
                notes=reach_notes(data) if clean else ())
    if idle:
        console.print(NOTHING_SEARCHED_SUMMARY, soft_wrap=True)
    elif known is not None:
        console.print(new_findings_line([c.findings for c in cases], suppressed, interrupted, known=len(known)),
                      soft_wrap=True)
    if doc.get("regressions_failed"):  # a ci job's failed regression files: its verdict, as its --html says it
        console.print(f"FAILED: {doc['regressions_failed']}", soft_wrap=True, markup=False)
    write_reports(outputs, data, make_console(stderr=True))
    return EXIT_CLEAN


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _counts(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _count(x) for k, x in v.items())


#: a run fact of a report file (a ``--json``) that the report files format: key -> (does the value fit?, what it
#: must be), as fuzz and ci write them (reached: ``Target.reach()`` summed; ci's per preset)
_FACTS = {
    "reached": (lambda v: _counts(v) or (isinstance(v, dict) and all(_counts(x) for x in v.values())),
                "an object of path -> count (kvaudit ci's: preset -> path -> count)"),
    "nothing_searched": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of presets"),
    "regressions_failed": (lambda v: isinstance(v, str), "a string"),
    "seconds": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number of seconds"),
    "known": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "a list of signatures (the known ones, found before and not reported again)"),
}
